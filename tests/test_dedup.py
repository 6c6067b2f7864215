"""prepare drops repeated images: the same file twice by default, and with --dedup perceptual the same picture saved
again (re-encoded, resized, or stored sideways with an EXIF orientation)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from sdtrain.cli.main import main
from sdtrain.data.shards import tar_samples


def _picture(seed: int) -> Image.Image:
    """A smooth random picture (blocks blurred by upscaling), whose structure survives resizing and JPEG."""
    small = np.random.default_rng(seed).integers(0, 256, (6, 6, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((96, 96), Image.Resampling.BICUBIC)


def _save(img: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **options)
    return out.getvalue()


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "photos"
    folder.mkdir()
    original = _picture(0)
    sideways = original.transpose(Image.Transpose.ROTATE_90)
    exif = Image.Exif()
    exif[0x0112] = 6  # shown upright: the same picture as the original
    files = {"a.png": _save(original, "PNG"), "b.png": _save(original, "PNG"),
             "c.jpg": _save(original.resize((80, 80)), "JPEG", quality=85),
             "d.jpg": _save(sideways, "JPEG", quality=90, exif=exif), "e.png": _save(_picture(1), "PNG")}
    for name, data in files.items():
        (folder / name).write_bytes(data)
        (folder / name).with_suffix(".txt").write_text(f"photo {name}")
    return folder


def _kept(out: Path) -> list[str]:
    return sorted(s["__key__"] for tar in out.glob("*.tar") for s in tar_samples(str(tar), lambda exc: False))


def test_exact_copies_are_dropped_by_default_and_near_copies_with_perceptual(tmp_path, capsys):
    folder = _folder(tmp_path)
    assert main(["prepare", "folder", str(folder), "--out", str(tmp_path / "exact")]) == 0
    assert _kept(tmp_path / "exact") == ["a", "c", "d", "e"]
    assert "skipped (image with the same bytes as an earlier one): 1" in capsys.readouterr().out

    assert main(["prepare", "folder", str(folder), "--out", str(tmp_path / "near"), "--dedup", "perceptual"]) == 0
    assert _kept(tmp_path / "near") == ["a", "e"]
    printed = capsys.readouterr().out
    assert "skipped (image with the same bytes as an earlier one): 1" in printed
    assert "skipped (image nearly the same as an earlier one (--dedup perceptual)): 2" in printed

    assert main(["prepare", "folder", str(folder), "--out", str(tmp_path / "all"), "--dedup", "none"]) == 0
    assert _kept(tmp_path / "all") == ["a", "b", "c", "d", "e"]


def test_a_duplicate_of_a_filtered_image_is_judged_on_its_own(tmp_path):
    """The first copy filtered out (too small here) does not make a later, passing copy a duplicate."""
    folder = tmp_path / "f"
    folder.mkdir()
    data = _save(_picture(3), "PNG")
    (folder / "a.png").write_bytes(data)
    (folder / "a.txt").write_text("x")
    (folder / "b.png").write_bytes(data)
    (folder / "b.txt").write_text("a long enough caption")
    assert main(["prepare", "folder", str(folder), "--out", str(tmp_path / "out"),
                 "--filter", "min_caption_length=5"]) == 0
    assert _kept(tmp_path / "out") == ["b"]
