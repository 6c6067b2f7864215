"""Conditioning and source images in the data: beside an image in a folder (``KEY.cond.png``, ``KEY.src.png``), kept by
`prepare folder` in its sample, computed there as Canny edges for samples without one, written by `prepare shapes
--conditioning layout` as each shape's silhouette; the loader resizes, crops and flips them with the image, and the
data preview shows them beside it."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sdtrain.cli.main import main
from sdtrain.config import DataConfig
from sdtrain.data.decode import SampleDecoder
from sdtrain.data.order import read_shard, resolve_shards
from sdtrain.data.pipeline import TrainBatches

from .conftest import config_path


def _samples(folder: Path) -> list[dict]:
    return [sample for shard in resolve_shards(str(folder)) for sample in read_shard(shard.url)]


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_shapes_layout_maps_put_each_shape_in_its_colour_where_the_image_has_it(tmp_path):
    assert main(["prepare", "shapes", "--out", str(tmp_path / "s"), "--num", "6", "--seed", "3",
                 "--conditioning", "layout"]) == 0
    plain = _samples(_write_plain(tmp_path))
    for sample, same in zip(_samples(tmp_path / "s"), plain):
        assert sample["png"] == same["png"]  # the images are those of the dataset without maps
        layout = np.asarray(Image.open(io.BytesIO(sample["cond.png"])).convert("RGB"), dtype=np.int32)
        image = np.asarray(Image.open(io.BytesIO(sample["png"])).convert("RGB"), dtype=np.int32)
        for shape in json.loads(sample["json"])["shapes"]:
            x0, y0, x1, y1 = shape["box"]
            cx, cy = (x0 + x1) // 2, (y0 + y1) // 2 + (y1 - y0) // 4  # inside every kind, triangles included
            assert np.abs(layout[cy, cx] - image[cy, cx]).max() <= 2, shape
        assert (layout[0, 0] == 0).all() and (layout[-1, -1] == 0).all()  # black where no shape is


def _write_plain(tmp_path: Path) -> Path:
    assert main(["prepare", "shapes", "--out", str(tmp_path / "plain"), "--num", "6", "--seed", "3"]) == 0
    return tmp_path / "plain"


@pytest.fixture
def folder(tmp_path) -> Path:
    """Three captioned images: one with a conditioning and a source image beside it, one with neither, one whose
    map is the wrong size."""
    src = tmp_path / "images"
    src.mkdir()
    rng = np.random.default_rng(0)
    for name in ("a", "b", "c"):
        Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(src / f"{name}.png")
        (src / f"{name}.txt").write_text(f"photo {name}")
    Image.new("RGB", (64, 48), (255, 0, 0)).save(src / "a.cond.png")
    Image.new("RGB", (64, 48), (0, 0, 255)).save(src / "a.src.png")
    Image.new("RGB", (32, 32)).save(src / "c.cond.png")
    return src


def test_prepare_folder_keeps_the_images_beside_each_and_skips_a_map_of_another_size(folder, tmp_path, caplog):
    assert main(["prepare", "folder", str(folder), "--out", str(tmp_path / "out")]) == 0
    samples = {s["__key__"]: s for s in _samples(tmp_path / "out")}
    assert set(samples) == {"a", "b"}  # c's map is another size: skipped, with the file named
    assert "c.cond.png: 32x32, not the 64x48 of its image" in caplog.text
    assert {"cond.png", "src.png"} <= set(samples["a"]) and "cond.png" not in samples["b"]
    assert not any(s.get("json") and "cond" in json.loads(s["json"])["file_name"] for s in samples.values())


def test_prepare_folder_computes_canny_edges_for_samples_without_a_map(folder, tmp_path):
    pytest.importorskip("cv2", reason="--conditioning canny needs OpenCV (pip install 'sdtrain[control]')")
    (folder / "c.cond.png").unlink()
    square = Image.new("RGB", (64, 48), (0, 0, 0))
    square.paste((255, 255, 255), (16, 12, 48, 36))
    square.save(folder / "b.png")
    assert main(["prepare", "folder", str(folder), "--out", str(tmp_path / "out"), "--conditioning", "canny"]) == 0
    samples = {s["__key__"]: s for s in _samples(tmp_path / "out")}
    assert Image.open(io.BytesIO(samples["a"]["cond.png"])).getpixel((0, 0)) == (255, 0, 0)  # its own map is kept
    edges = np.asarray(Image.open(io.BytesIO(samples["b"]["cond.png"])).convert("L"))
    assert edges.shape == (48, 64) and set(np.unique(edges)) == {0, 255}
    assert edges[24, 16] == 255 or edges[24, 15] == 255  # the square's left side
    assert edges[24, 32] == 0 and edges[2, 2] == 0  # inside it and outside it, no edge


def test_the_loader_crops_and_flips_the_map_and_the_source_with_the_image(tmp_path):
    """Map and source are the image itself here: whatever crop and flip a sample draws, they stay aligned with it
    (the map in [0, 1], the source in [-1, 1] as the image)."""
    rng = np.random.default_rng(1)
    image = Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8))
    raw = {"__key__": "k", "png": _png(image), "txt": b"a photo", "cond.png": _png(image), "src.png": _png(image)}
    decoder = SampleDecoder(DataConfig(shards="x", resolution=32, random_flip=True, center_crop=False), None, 0)
    flips = set()
    for place in range(12):
        sample = decoder(raw, (0, 0, place))
        pixels = sample["pixel_values"]
        torch.testing.assert_close(sample["source_pixels"], pixels, rtol=0, atol=0)
        torch.testing.assert_close(sample["conditioning_pixels"] * 2 - 1, pixels, rtol=0, atol=1e-6)
        flips.add(int(sample["size_ids"][3]))
    assert len(flips) > 2  # crops (and flips) did vary
    raw["cond.png"] = _png(image.resize((20, 20)))
    assert decoder(raw, (0, 0, 0)) is None  # a map of another size: the sample is skipped


def test_a_batch_stacks_the_maps_and_fills_a_missing_one_with_black(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    with tarfile.open(shards / "shard-000000.tar", "w") as tar:
        for key, cond in (("a", True), ("b", False)):
            image = Image.new("RGB", (32, 32), (200, 10, 10))
            members = {"png": _png(image), "txt": b"red"}
            if cond:
                members["cond.png"] = _png(Image.new("RGB", (32, 32), (255, 255, 255)))
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    loader = TrainBatches(DataConfig(shards=str(shards / "shard-000000.tar"), resolution=32, batch_size=2,
                                     num_workers=0, random_flip=False), None, 0)
    try:
        batch = loader.next()
    finally:
        loader.close()
    maps = dict(zip(batch["keys"], batch["conditioning_pixels"]))
    assert maps["a"].shape == (3, 32, 32) and bool((maps["a"] == 1).all()) and bool((maps["b"] == 0).all())


def test_data_preview_shows_the_map_beside_each_image(tmp_path):
    assert main(["prepare", "shapes", "--out", str(tmp_path / "s"), "--num", "4", "--conditioning", "layout"]) == 0
    out = tmp_path / "preview.png"
    assert main(["data", "preview", str(config_path("diffusion.yaml")), f"data.shards={tmp_path / 's'}",
                 "data.resolution=32", "--num", "4", "--out", str(out)]) == 0
    without = tmp_path / "plain.png"
    assert main(["prepare", "shapes", "--out", str(tmp_path / "p"), "--num", "4"]) == 0
    assert main(["data", "preview", str(config_path("diffusion.yaml")), f"data.shards={tmp_path / 'p'}",
                 "data.resolution=32", "--num", "4", "--out", str(without)]) == 0
    # The maps' black backgrounds stand beside the images (whose backgrounds are light; captions are thin).
    def black(path: Path) -> float:
        with Image.open(path) as grid:
            return float((np.asarray(grid.convert("L")) < 8).mean())

    assert black(out) > black(without) + 0.1
