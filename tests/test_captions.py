"""Captions as users keep them: several per image (lines of a .txt, a JSON list, several CSV columns), one drawn
each time a sample is read, reproducibly; comma-separated tags shuffled after the first few."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from sdtrain.cli.main import main
from sdtrain.config import DataConfig
from sdtrain.data.decode import SampleDecoder
from sdtrain.data.pipeline import TrainBatches
from sdtrain.data.shards import ShardWriter, tar_samples


def _png(seed: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def _samples(out: Path) -> dict[str, dict]:
    return {s["__key__"].rsplit("/", 1)[-1]: s for tar in sorted(out.glob("*.tar"))
            for s in tar_samples(str(tar), lambda exc: False)}


PHRASINGS = ["a red square and a blue circle", "a blue circle and a red square",
             "a red square on the left and a blue circle on the right"]


def test_prepare_keeps_every_caption_of_a_text_file_a_json_list_or_several_columns(tmp_path, capsys, caplog):
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "a.png").write_bytes(_png(0))
    (folder / "a.txt").write_text("\n".join(PHRASINGS) + "\n\n")
    (folder / "b.png").write_bytes(_png(1))
    (folder / "b.txt").write_bytes(_png(9))  # an image saved as a caption: skipped, counted, named
    assert main(["prepare", "folder", str(folder), "--out", str(tmp_path / "s1")]) == 0
    samples = _samples(tmp_path / "s1")
    assert set(samples) == {"a"} and samples["a"]["txt"].decode().splitlines() == PHRASINGS
    captured = capsys.readouterr()
    assert "caption file that is not text): 1" in captured.out
    assert any("b.txt: not text" in r.getMessage() for r in caplog.records)

    listed = tmp_path / "jsonl"
    listed.mkdir()
    (listed / "a.png").write_bytes(_png(0))
    (listed / "metadata.jsonl").write_text(json.dumps({"file_name": "a.png", "text": PHRASINGS[:2]}) + "\n")
    assert main(["prepare", "folder", str(listed), "--out", str(tmp_path / "s2")]) == 0
    assert _samples(tmp_path / "s2")["a"]["txt"].decode().splitlines() == PHRASINGS[:2]

    columns = tmp_path / "csv"
    columns.mkdir()
    (columns / "a.png").write_bytes(_png(0))
    (columns / "metadata.csv").write_text(f"file_name,short,long,source\na.png,{PHRASINGS[0]},{PHRASINGS[2]},cam\n")
    assert main(["prepare", "folder", str(columns), "--out", str(tmp_path / "s3"), "--caption-column", "short",
                 "--caption-column", "long"]) == 0
    sample = _samples(tmp_path / "s3")["a"]
    assert sample["txt"].decode().splitlines() == [PHRASINGS[0], PHRASINGS[2]]
    assert json.loads(sample["json"])["source"] == "cam"
    capsys.readouterr()
    assert main(["prepare", "folder", str(columns), "--out", str(tmp_path / "s4"), "--caption-column", "alt"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "metadata.csv: no column 'alt' (columns: file_name, short, long, source)" in error[0]


def _shards(tmp_path: Path, captions: dict[str, str]) -> Path:
    out = tmp_path / "shards"
    with ShardWriter(out, samples_per_shard=4) as writer:
        for i, (key, caption) in enumerate(captions.items()):
            writer.write({"__key__": key, "png": _png(i), "txt": caption})
    return out


def test_one_caption_is_drawn_per_reading_every_one_in_turn_and_resume_draws_the_same(tmp_path):
    out = _shards(tmp_path, {f"s{i}": "\n".join(PHRASINGS) for i in range(4)})
    config = DataConfig(shards=str(out), resolution=32, batch_size=4, num_workers=0, caption_dropout=0.0)
    straight = [TrainBatches(config, None, seed=1).next() for _ in range(1)]
    loader = TrainBatches(config, None, seed=1)
    drawn = [caption for _ in range(12) for caption in loader.next()["captions"]]  # 12 epochs of 4 samples
    assert set(drawn) == set(PHRASINGS)  # every phrasing gets its turn
    assert straight[0]["captions"] == drawn[:4]

    head = TrainBatches(config, None, seed=1)
    first = [head.next()["captions"] for _ in range(5)]
    state = json.loads(json.dumps(head.state_dict()))  # as a checkpoint stores it
    resumed = TrainBatches(config, None, seed=1)
    resumed.load_state_dict([state])
    rest = [resumed.next()["captions"] for _ in range(7)]
    assert [c for batch in first + rest for c in batch] == drawn


def test_tags_shuffle_after_the_ones_kept_in_place():
    raw = {"__key__": "t", "png": _png(0), "txt": b"sks dog, on a sofa, red collar, sunlight, smiling"}
    config = DataConfig(shards="x", resolution=32, caption_dropout=0.0, shuffle_tags=True, keep_tags=1)
    decoder = SampleDecoder(config, None, seed=0)
    captions = [decoder(raw, (epoch, 0, 0))["caption"] for epoch in range(8)]
    assert all(c.startswith("sks dog, ") for c in captions)
    assert all(sorted(c.split(", ")) == sorted(raw["txt"].decode().split(", ")) for c in captions)
    assert len(set(captions)) > 1
    assert captions == [decoder(raw, (epoch, 0, 0))["caption"] for epoch in range(8)]
    plain = SampleDecoder(DataConfig(shards="x", resolution=32, caption_dropout=0.0), None, seed=0)
    assert plain(raw, (0, 0, 0))["caption"] == raw["txt"].decode()
