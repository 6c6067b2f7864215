"""Images as users have them: phone photos with an EXIF orientation, transparent cut-outs, CMYK, 16-bit, palette,
greyscale and animated files, each decoded to the RGB a viewer shows, in `prepare` and in the loader alike."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdtrain.cli.main import main
from sdtrain.config import DataConfig
from sdtrain.data.decode import SampleDecoder
from sdtrain.data.images import rgb_image
from sdtrain.data.shards import tar_samples

RED, BLUE, WHITE, GREEN = (255, 0, 0), (0, 0, 255), (255, 255, 255), (0, 255, 0)


def _bytes(img: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **options)
    return out.getvalue()


def phone_photo() -> bytes:
    """A 48x32 landscape scene, red on top, stored as a phone held upright stores it: pixels turned a quarter,
    EXIF orientation 6 (turn 90 degrees clockwise to view)."""
    upright = Image.new("RGB", (48, 32), BLUE)
    upright.paste(RED, (0, 0, 48, 16))
    stored = upright.transpose(Image.Transpose.ROTATE_90)
    exif = Image.Exif()
    exif[0x0112] = 6
    return _bytes(stored, "JPEG", quality=95, exif=exif)


def sticker() -> bytes:
    """A blue disc-like square on a transparent background whose clear pixels store black, as editors write them."""
    img = Image.new("RGBA", (32, 32), (0, 0, 0, 0))
    img.paste((*BLUE, 255), (8, 8, 24, 24))
    return _bytes(img, "PNG")


def cmyk_red() -> bytes:
    return _bytes(Image.new("CMYK", (32, 32), (0, 255, 255, 0)), "JPEG", quality=95)


def grey16() -> bytes:
    """A 16-bit greyscale PNG (scans, depth maps) at half intensity."""
    return _bytes(Image.fromarray(np.full((32, 32), 32768, dtype=np.uint16)), "PNG")


def palette_with_transparency() -> bytes:
    img = Image.new("P", (32, 32), 0)
    img.putpalette([0, 0, 0, *BLUE] + [0] * 762)
    img.paste(1, (8, 8, 24, 24))
    return _bytes(img, "PNG", transparency=0)


def animated() -> bytes:
    """Two frames, red then blue."""
    frames = [Image.new("RGB", (32, 32), RED), Image.new("RGB", (32, 32), BLUE)]
    return _bytes(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)


def _decoded(data: bytes, background=WHITE) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        img.load()
        return np.asarray(rgb_image(img, background).image).astype(int)


def _close(pixel, colour, tolerance: int = 8) -> bool:
    return all(abs(int(a) - b) <= tolerance for a, b in zip(pixel, colour))


def test_a_phone_photo_arrives_upright():
    pixels = _decoded(phone_photo())
    assert pixels.shape == (32, 48, 3)  # landscape, as it was taken
    assert _close(pixels[4, 24], RED) and _close(pixels[28, 24], BLUE)


def test_a_transparent_image_arrives_on_the_chosen_background_not_black():
    assert _close(_decoded(sticker())[0, 0], WHITE, 0) and _close(_decoded(sticker())[16, 16], BLUE, 0)
    assert _close(_decoded(sticker(), GREEN)[0, 0], GREEN, 0)
    assert _close(_decoded(palette_with_transparency())[0, 0], WHITE, 0)
    assert _close(_decoded(palette_with_transparency())[16, 16], BLUE, 0)
    with Image.open(io.BytesIO(sticker())) as img:
        alpha = rgb_image(img, WHITE).alpha
    assert alpha is not None and alpha.getpixel((0, 0)) == 0 and alpha.getpixel((16, 16)) == 255


def test_cmyk_16_bit_greyscale_and_animated_files_decode_to_the_rgb_a_viewer_shows():
    assert _close(_decoded(cmyk_red())[16, 16], RED, 12)
    assert _close(_decoded(grey16())[16, 16], (128, 128, 128), 1)  # not clipped to white
    assert _close(_decoded(animated())[16, 16], RED, 0)
    with Image.open(io.BytesIO(animated())) as img:
        img.seek(1)  # whatever frame is current, the first one trains
        assert _close(np.asarray(rgb_image(img, WHITE).image)[16, 16], RED, 0)
    grey = Image.new("L", (32, 32), 200)
    assert _close(_decoded(_bytes(grey, "PNG"))[0, 0], (200, 200, 200), 0)
    with_alpha = Image.new("LA", (32, 32), (50, 0))
    assert _close(_decoded(_bytes(with_alpha, "PNG"), (10, 20, 30))[0, 0], (10, 20, 30), 0)


@pytest.fixture
def mixed_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "mixed"
    folder.mkdir()
    files = {"phone.jpg": phone_photo(), "sticker.png": sticker(), "cmyk.jpg": cmyk_red(), "grey16.png": grey16(),
             "palette.png": palette_with_transparency(), "animated.gif": animated()}
    for name, data in files.items():
        (folder / name).write_bytes(data)
        (folder / name).with_suffix(".txt").write_text(f"a {Path(name).stem}")
    return folder


def test_prepare_records_what_decoding_does_and_the_loader_decodes_alike(mixed_folder, tmp_path):
    out = tmp_path / "shards"
    assert main(["prepare", "folder", str(mixed_folder), "--out", str(out)]) == 0
    samples = {s["__key__"].rsplit("/", 1)[-1]: s for tar in sorted(out.glob("*.tar"))
               for s in tar_samples(str(tar), lambda exc: False)}
    assert set(samples) == {"phone", "sticker", "cmyk", "grey16", "palette", "animated"}
    meta = {key: json.loads(s["json"]) for key, s in samples.items()}
    assert (meta["phone"]["width"], meta["phone"]["height"]) == (48, 32)  # as seen, not as stored
    assert meta["phone"]["decode"] == {"orientation": 6}
    assert meta["sticker"]["decode"] == {"mode": "RGBA", "alpha": True}
    assert meta["cmyk"]["decode"] == {"mode": "CMYK"} and meta["animated"]["decode"]["frames"] == 2
    assert "decode" not in meta.get("grey", {})

    config = DataConfig(shards=str(out), resolution=32, center_crop=True, caption_dropout=0.0, background="#00ff00",
                        resize=True)
    decoder = SampleDecoder(config, None, seed=0)

    def colour(key: str, y: int, x: int) -> tuple[int, ...]:
        pixels = decoder(samples[key], (0, 0, 0))["pixel_values"]
        return tuple(int(round((float(c) + 1) * 127.5)) for c in pixels[:, y, x])

    assert _close(colour("sticker", 0, 0), GREEN, 1) and _close(colour("sticker", 16, 16), BLUE, 1)
    assert _close(colour("phone", 2, 16), RED, 12) and _close(colour("phone", 30, 16), BLUE, 12)
    assert _close(colour("cmyk", 16, 16), RED, 12) and _close(colour("animated", 16, 16), RED, 1)
    assert _close(colour("grey16", 16, 16), (128, 128, 128), 2)


def test_a_random_background_is_drawn_per_sample_and_again_alike():
    raw = {"__key__": "s", "png": sticker(), "txt": b"a sticker"}
    decoder = SampleDecoder(DataConfig(shards="x", resolution=32, caption_dropout=0.0, background="random"), None,
                            seed=0)
    corners = [tuple(decoder(raw, (0, 0, i))["pixel_values"][:, 0, 0].tolist()) for i in range(4)]
    assert len(set(corners)) == 4  # a colour per sample
    assert corners == [tuple(decoder(raw, (0, 0, i))["pixel_values"][:, 0, 0].tolist()) for i in range(4)]


def test_a_background_that_is_not_a_colour_is_one_line(tmp_path, capsys):
    assert main(["train", str(Path(__file__).resolve().parents[1] / "configs" / "demo" / "autoencoder.yaml"),
                 f"run_dir={tmp_path}", "data.shards=absent", "data.background=purple-ish"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "data.background: 'purple-ish' is not a colour" in error[0]


def test_data_preview_shows_samples_as_training_receives_them_and_counts_what_it_skipped(tmp_path, capsys):
    from sdtrain.data.shards import ShardWriter

    shards = tmp_path / "shards"
    with ShardWriter(shards, samples_per_shard=3) as writer:
        for key, data in {"phone": phone_photo(), "sticker": sticker(), "cmyk": cmyk_red(), "grey16": grey16(),
                          "animated": animated()}.items():
            writer.write({"__key__": key, "png": data, "txt": f"a {key}\nanother phrasing of {key}"})
        writer.write({"__key__": "broken", "png": b"not an image", "txt": "lost"})
    out = tmp_path / "preview.png"
    config = Path(__file__).resolve().parents[1] / "configs" / "demo" / "diffusion.yaml"
    # 4 of the 5 good samples: within one epoch, so the broken one is read once (a preview past the data's end reads
    # it again in the next epoch's order, and counts each read).
    assert main(["data", "preview", str(config), f"data.shards={shards}", "data.resolution=32",
                 "data.batch_size=2", "data.background=00ff00", "--num", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"{out}: the first 4 samples as training receives them (1 skipped as undecodable" in printed
    with Image.open(out) as grid:
        pixels = np.asarray(grid.convert("RGB")).reshape(-1, 3)
    # The sticker's clear pixels show on the chosen background, not black.
    assert ((pixels == GREEN).all(axis=1)).sum() > 100
