"""The shapes demo dataset and the shard writer/manifest it is built on."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from sdtrain.data.shapes import COLOURS, KINDS, caption_prompts, write_shapes_dataset
from sdtrain.data.shards import ShardWriter, read_manifest, sha256_file
from sdtrain.errors import UserError


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("shapes")
    return out, write_shapes_dataset(out, num=50, seed=1, samples_per_shard=20)


def _samples(out: Path, manifest: dict) -> list[dict]:
    urls = [str(out / s["name"]) for s in manifest["shards"]]
    return list(wds.WebDataset(urls, shardshuffle=False).decode("pil"))


def test_shards_and_manifest(dataset: tuple[Path, dict]) -> None:
    out, manifest = dataset
    assert manifest["format"] == "sdtrain-shards/1"
    assert manifest["total"] == 50
    assert (manifest["source"], manifest["seed"], manifest["size"]) == ("shapes", 1, 64)
    assert [s["samples"] for s in manifest["shards"]] == [20, 20, 10]
    assert [s["name"] for s in manifest["shards"]] == [f"shard-{i:06d}.tar" for i in range(3)]
    for s in manifest["shards"]:
        assert sha256_file(out / s["name"]) == s["sha256"]
    assert read_manifest(out) == manifest
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"] + [
        s["name"] for s in manifest["shards"]
    ]


def test_read_back_with_plain_webdataset(dataset: tuple[Path, dict]) -> None:
    out, manifest = dataset
    samples = _samples(out, manifest)
    assert len(samples) == 50
    assert len({s["__key__"] for s in samples}) == 50
    counts = set()
    for s in samples:
        img, caption, meta = s["png"], s["txt"], s["json"]
        assert img.size == (64, 64) and img.mode == "RGB"
        assert (meta["width"], meta["height"]) == (64, 64)
        assert len(meta["shapes"]) in (1, 2)
        counts.add(len(meta["shapes"]))
        for shape in meta["shapes"]:
            assert shape["colour"] in COLOURS and shape["kind"] in KINDS
            assert f"{shape['colour']} {shape['kind']}" in caption
        centres = [(sh["box"][0] + sh["box"][2]) / 2 for sh in meta["shapes"]]
        assert centres == sorted(centres)
        if len(meta["shapes"]) == 2:  # one shape in each half: left and right are never a judgement call
            left, right = (sh["box"] for sh in meta["shapes"])
            assert left[2] <= 32 <= right[0]
        phrases = [f"{'an' if sh['colour'] == 'orange' else 'a'} {sh['colour']} {sh['kind']}" for sh in meta["shapes"]]
        if len(phrases) == 1:
            assert caption == phrases[0]
        else:  # every phrasing, one per line: sides left first, sides right first, no sides
            first, second = phrases
            assert caption.splitlines() == [f"{first} on the left and {second} on the right",
                                             f"{second} on the right and {first} on the left",
                                             f"{first} and {second}"]
    assert counts == {1, 2}


def test_deterministic(tmp_path: Path) -> None:
    def hashes(folder: str, seed: int) -> list[str]:
        m = write_shapes_dataset(tmp_path / folder, num=12, seed=seed, samples_per_shard=5)
        return [s["sha256"] for s in m["shards"]]

    first = hashes("a", 7)
    assert hashes("b", 7) == first
    assert hashes("c", 8) != first


def test_image_shows_stated_colour(dataset: tuple[Path, dict]) -> None:
    out, manifest = dataset
    singles = [s for s in _samples(out, manifest) if len(s["json"]["shapes"]) == 1]
    assert {s["json"]["shapes"][0]["kind"] for s in singles} >= {"circle", "square", "triangle"}
    for s in singles:
        shape = s["json"]["shapes"][0]
        x0, y0, x1, y1 = shape["box"]
        pixel = np.asarray(s["png"])[(y0 + y1) // 2, (x0 + x1) // 2].astype(int)
        assert np.abs(pixel - COLOURS[shape["colour"]]).max() <= 12, (s["__key__"], shape, pixel)


def test_prompts_use_caption_style() -> None:
    from sdtrain.evaluate.adherence import phrasing_of

    prompts = caption_prompts()
    assert "an orange triangle" in prompts and "a red circle" in prompts
    assert all(c in " ".join(prompts) for c in COLOURS) and all(k in " ".join(prompts) for k in KINDS)
    assert Counter(phrasing_of(p) for p in prompts) == {None: 6, "sides": 2, "sides_reversed": 2, "plain": 2}


def test_malformed_manifest(tmp_path: Path) -> None:
    assert read_manifest(tmp_path) is None
    path = tmp_path / "manifest.json"
    path.write_text("{not json")
    with pytest.raises(UserError, match="manifest.json"):
        read_manifest(tmp_path)
    path.write_text(json.dumps({"format": "sdtrain-shards/1", "total": 1, "shards": [{"name": "x.tar"}]}))
    with pytest.raises(UserError, match="manifest.json"):
        read_manifest(tmp_path)


def test_interrupted_writer_leaves_no_partial_shard(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), ShardWriter(tmp_path, samples_per_shard=2) as w:
        for i in range(3):
            w.write({"__key__": f"{i:03d}", "txt": "x"})
        raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-000000.tar"]
