"""prepare drops repeated images: the same file twice by default, and with --dedup perceptual the same picture saved
again (re-encoded, resized, or stored sideways with an EXIF orientation)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from sdtrain.cli.main import main
from sdtrain.data.shards import read_manifest, tar_samples


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


def _dropped(count: int, key: str, same_as: str) -> dict:
    """A reason's entry in the manifest's duplicates: how many it dropped, with the first named."""
    return {"dropped": count, "examples": [{"key": key, "same_as": same_as}]}


def test_edit_pairs_are_duplicates_only_when_their_sources_repeat_too(tmp_path, capsys):
    """Pairs sharing a byte-identical edited image but not their source are all kept; the pair whose source repeats
    too is dropped, whatever its caption, and named beside the pair it repeats. A near copy of a whole pair goes under
    --dedup perceptual; the distinct pairs stay."""
    folder = tmp_path / "edits"
    folder.mkdir()
    target, source, other_source = (_save(_picture(seed).resize((32, 32)), "PNG") for seed in (10, 11, 12))
    pairs = {"a": (target, source), "b": (target, other_source), "c": (target, source)}
    for key, (image, src) in pairs.items():
        (folder / f"{key}.png").write_bytes(image)
        (folder / f"{key}.src.png").write_bytes(src)
        (folder / f"{key}.txt").write_text(f"make it {key}")
    (folder / "d.png").write_bytes(target)  # the edited image on its own: no source, so no pair's repeat
    (folder / "d.txt").write_text("a picture")
    out = tmp_path / "exact"
    assert main(["prepare", "folder", str(folder), "--out", str(out)]) == 0
    assert _kept(out) == ["a", "b", "d"]
    assert "skipped (image with the same bytes as an earlier one): 1: c (same as a)" in capsys.readouterr().out
    assert read_manifest(out)["duplicates"] == {"duplicate_image": _dropped(1, "c", "a")}

    # A re-encoded copy of pair a: its edited image saved as JPEG, its source re-compressed.
    (folder / "e.jpg").write_bytes(_save(Image.open(io.BytesIO(target)), "JPEG", quality=90))
    (folder / "e.src.png").write_bytes(_save(Image.open(io.BytesIO(source)), "PNG", compress_level=1))
    (folder / "e.txt").write_text("make it e")
    out = tmp_path / "near"
    assert main(["prepare", "folder", str(folder), "--out", str(out), "--dedup", "perceptual"]) == 0
    assert _kept(out) == ["a", "b", "d"]
    printed = capsys.readouterr().out
    assert "skipped (image with the same bytes as an earlier one): 1: c (same as a)" in printed
    assert "skipped (image nearly the same as an earlier one (--dedup perceptual)): 1: e (same as a)" in printed
    assert read_manifest(out)["duplicates"] == {"duplicate_image": _dropped(1, "c", "a"),
                                                "near_duplicate": _dropped(1, "e", "a")}


def test_a_controlnet_image_under_two_maps_is_two_samples_in_prepare_and_reshard(tmp_path, capsys):
    """One image with two different conditioning maps (and once with the first map and a mask) gives three samples;
    the image with its first map again is a duplicate. Reshard compares the shards' maps alike."""
    folder = tmp_path / "control"
    folder.mkdir()
    rng = np.random.default_rng(5)
    image = _save(_picture(20).resize((16, 16)), "PNG")
    edges, other_edges, mask = (_save(Image.fromarray(rng.integers(0, 2, (16, 16), dtype=np.uint8) * 255), "PNG")
                                for _ in range(3))
    for key, cond in {"x": edges, "y": other_edges, "z": edges, "masked": edges}.items():
        (folder / f"{key}.png").write_bytes(image)
        (folder / f"{key}.cond.png").write_bytes(cond)
        (folder / f"{key}.txt").write_text("edges")
    (folder / "masked.mask.png").write_bytes(mask)
    everything = tmp_path / "all"
    assert main(["prepare", "folder", str(folder), "--out", str(everything), "--dedup", "none"]) == 0
    assert _kept(everything) == ["masked", "x", "y", "z"]
    assert "duplicates" not in read_manifest(everything)  # nothing dropped: the manifest is as it was before
    out = tmp_path / "exact"
    assert main(["prepare", "folder", str(folder), "--out", str(out)]) == 0
    assert _kept(out) == ["masked", "x", "y"]
    assert "skipped (image with the same bytes as an earlier one): 1: z (same as x)" in capsys.readouterr().out
    assert read_manifest(out)["duplicates"] == {"duplicate_image": _dropped(1, "z", "x")}
    resharded = tmp_path / "resharded"
    assert main(["prepare", "reshard", str(everything), "--out", str(resharded), "--samples-per-shard", "10"]) == 0
    assert _kept(resharded) == ["masked", "x", "y"]
    assert "skipped (image with the same bytes as an earlier one): 1: z (same as x)" in capsys.readouterr().out
