"""The training data stream: every sample once per epoch, seeded order, exact resume, damaged data skipped."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sdtrain.config import DataConfig
from sdtrain.data.order import resolve_shards
from sdtrain.data.pipeline import TrainBatches
from sdtrain.data.shapes import write_shapes_dataset
from sdtrain.data.shards import ShardWriter
from sdtrain.errors import UserError
from sdtrain.memory import descendants

NUM = 37  # 10 + 10 + 10 + 7 samples: uneven shards
KEYS = [f"{i:08d}" for i in range(NUM)]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shapes")
    write_shapes_dataset(out, num=NUM, seed=3, samples_per_shard=10, size=32)
    return out


@pytest.fixture
def shapes_copy(shapes: Path, tmp_path: Path) -> Path:
    """A copy a test may modify."""
    return Path(shutil.copytree(shapes, tmp_path / "copy"))


def data_config(shards: Path | str, workers: int = 0, **kwargs) -> DataConfig:
    return DataConfig(**{
        "shards": str(shards), "resolution": 32, "batch_size": 4, "num_workers": workers, "caption_dropout": 0.0,
        **kwargs,
    })


def take(tb: TrainBatches, n: int) -> list[dict]:
    return [tb.next() for _ in range(n)]


def keys_of(batches: list[dict]) -> list[str]:
    return [k for b in batches for k in b["keys"]]


def png(seed: int, size: tuple[int, int] = (40, 48)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_once_per_epoch(shapes: Path, workers: int) -> None:
    tb = TrainBatches(data_config(shapes, workers), None, seed=0)
    assert tb.num_samples == NUM
    keys = []
    while tb.position.epoch == 0:
        batch = tb.next()
        assert batch["pixel_values"].shape == (4, 3, 32, 32)
        assert batch["pixel_values"].dtype == torch.float32
        assert batch["pixel_values"].min() >= -1.0 and batch["pixel_values"].max() <= 1.0
        assert len(batch["captions"]) == len(batch["keys"]) == 4
        keys += batch["keys"]
    # The last batch of an epoch runs on into the next one.
    assert sorted(keys[:NUM]) == KEYS


def global_batches(config: DataConfig, world: int, units: int, seed: int = 0,
                   state: list[dict] | None = None) -> list[dict]:
    """The first `units` batches of `world` ranks, in the order of the run's sequence: step s of rank r is
    unit s * world + r."""
    ranks = [TrainBatches(config, None, seed=seed, rank=r, world_size=world) for r in range(world)]
    for tb in ranks:
        if state is not None:
            tb.load_state_dict(state)
    batches = [ranks[unit % world].next() for unit in range(units)]
    for tb in ranks:
        tb.close()
    return batches


def test_the_sample_order_is_the_same_whatever_the_workers_and_ranks(shapes: Path) -> None:
    # The flip draws too: each sample's augmentation goes with it, whoever decodes it.
    config = data_config(shapes, 0, random_flip=True, center_crop=False)
    straight = global_batches(config, 1, 12)  # 48 samples: into the second epoch
    for world, workers in [(1, 1), (1, 2), (2, 0), (2, 1)]:
        other = global_batches(dataclasses.replace(config, num_workers=workers), world, 12)
        assert keys_of(other) == keys_of(straight), (world, workers)
        assert all(torch.equal(a["pixel_values"], b["pixel_values"]) for a, b in zip(straight, other, strict=True))


def test_a_resume_on_other_workers_and_ranks_continues_the_same_sequence(shapes: Path) -> None:
    config = data_config(shapes, 2)
    straight = global_batches(dataclasses.replace(config, num_workers=0), 1, 14)
    first = [TrainBatches(config, None, seed=0, rank=r, world_size=2) for r in range(2)]
    head = [first[unit % 2].next() for unit in range(6)]
    states = [json.loads(json.dumps(tb.state_dict())) for tb in first]  # as stored in a checkpoint
    for tb in first:
        tb.close()
    tail = global_batches(dataclasses.replace(config, num_workers=1), 1, 8, state=states)
    assert keys_of(head + tail) == keys_of(straight)


def test_order_is_seeded_and_differs_between_epochs(shapes: Path) -> None:
    def two_epochs(seed: int) -> list[str]:
        return keys_of(take(TrainBatches(data_config(shapes), None, seed=seed), 19))[: 2 * NUM]

    a = two_epochs(0)
    assert a == two_epochs(0)
    assert a != two_epochs(1)
    assert sorted(a[NUM:]) == KEYS
    assert a[:NUM] != a[NUM:]
    assert a[:NUM] != KEYS  # shuffled, not file order


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_exact(shapes: Path, workers: int) -> None:
    # Shapes are square, so the random crop has no room; the flip is the augmentation that must replay.
    config = data_config(shapes, workers, random_flip=True, center_crop=False)
    straight = take(TrainBatches(config, None, seed=5), 25)  # 100 samples: crosses two epoch boundaries

    first = TrainBatches(config, None, seed=5)
    head = take(first, 9)
    state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
    del first
    resumed = TrainBatches(config, None, seed=5)
    resumed.load_state_dict([state])
    tail = take(resumed, 16)

    assert keys_of(head + tail) == keys_of(straight)
    for a, b in zip(straight[9:], tail, strict=True):
        assert torch.equal(a["pixel_values"], b["pixel_values"])
        assert a["captions"] == b["captions"]
    assert resumed.position.batches == 25
    assert resumed.position.epoch == 2


def epoch_zero_keys(loaders: list[TrainBatches], batches_per_rank: int | None) -> list[str]:
    """Keys of epoch 0 read by these ranks: `batches_per_rank` each, or until each finished the epoch."""
    keys = []
    for tb in loaders:
        taken = 0
        while (taken < batches_per_rank) if batches_per_rank is not None else tb.position.epoch == 0:
            batch = tb.next()
            taken += 1
            keys += [key for key, place in zip(batch["keys"], batch["places"]) if place < NUM]
    return keys


@pytest.mark.parametrize("workers", [0, 2])
def test_ranks_read_disjoint_samples_that_cover_the_epoch(shapes: Path, workers: int) -> None:
    config = data_config(shapes, workers, batch_size=1)
    ranks = [TrainBatches(config, None, seed=0, rank=r, world_size=2) for r in range(2)]
    per_rank = [epoch_zero_keys([tb], None) for tb in ranks]
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == KEYS
    assert abs(len(per_rank[0]) - len(per_rank[1])) <= 1


@pytest.mark.parametrize("layouts", [
    [(2, 0, 7), (1, 0, None)],  # a 2-rank job resumed on one process
    [(1, 2, 5), (3, 0, 4), (2, 2, None)],  # more ranks, then fewer ranks with workers, mid-epoch each time
])
def test_resume_on_other_ranks_and_workers_reads_the_rest_of_the_epoch_once(shapes: Path, layouts) -> None:
    seen: list[str] = []
    states = None
    for world, workers, batches in layouts:
        config = data_config(shapes, workers, batch_size=1)
        ranks = [TrainBatches(config, None, seed=0, rank=r, world_size=world) for r in range(world)]
        if states is not None:
            for tb in ranks:
                tb.load_state_dict(states)
        seen += epoch_zero_keys(ranks, batches)
        states = [json.loads(json.dumps(tb.state_dict())) for tb in ranks]  # as stored in a checkpoint
        for tb in ranks:
            tb.close()
    assert len(seen) == len(set(seen)), "a sample was read twice in one epoch"
    assert sorted(seen) == KEYS


def test_resume_on_the_same_layout_ignores_other_ranks_positions(shapes: Path) -> None:
    config = data_config(shapes, 0)
    ranks = [TrainBatches(config, None, seed=0, rank=r, world_size=2) for r in range(2)]
    take(ranks[0], 1), take(ranks[1], 3)
    states = [tb.state_dict() for tb in ranks]
    resumed = TrainBatches(config, None, seed=0, rank=1, world_size=2)
    resumed.load_state_dict(states)
    assert resumed.next()["keys"] == ranks[1].next()["keys"]


def write_damaged(out: Path) -> None:
    """Three shards of ten: s003 has garbage png bytes, s005 has no image, the last shard is cut to 60%."""
    with ShardWriter(out, samples_per_shard=10) as writer:
        for i in range(30):
            sample = {"__key__": f"s{i:03d}", "txt": f"caption {i}"}
            if i == 3:
                sample["png"] = b"\x89PNG\r\n\x1a\n this is not an image"
            elif i != 5:
                sample["png"] = png(i)
            writer.write(sample)
    last = out / "shard-000002.tar"
    data = last.read_bytes()
    last.write_bytes(data[: int(len(data) * 0.6)])


@pytest.mark.parametrize("workers", [0, 2])
def test_damaged_data_is_skipped(tmp_path: Path, workers: int) -> None:
    write_damaged(tmp_path)
    tb = TrainBatches(data_config(tmp_path, workers), None, seed=0)
    seen = []
    while tb.position.epoch == 0:
        batch = tb.next()
        assert batch["pixel_values"].shape == (4, 3, 32, 32)
        assert torch.isfinite(batch["pixel_values"]).all()
        seen += batch["keys"]
    assert "s003" not in seen and "s005" not in seen
    assert {f"s{i:03d}" for i in range(10, 20)} <= set(seen)  # the intact shard is read in full
    assert len({k for k in seen if k >= "s020"}) < 10  # the cut shard lost samples
    assert tb.position.total_skipped >= 3  # garbage + no image + at least one lost to the cut


def test_sample_without_image_counts_as_skipped(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, samples_per_shard=10) as writer:
        for i in range(5):
            writer.write({"__key__": f"s{i}", "txt": f"caption {i}", **({"png": png(i)} if i != 2 else {})})
    tb = TrainBatches(data_config(tmp_path), None, seed=0)
    batches = take(tb, 2)  # four good samples per epoch: the second batch ends past epoch 0
    assert "s2" not in keys_of(batches)
    assert tb.position.total_skipped >= 1


def test_resolve_shards_prefers_the_manifest(shapes_copy: Path) -> None:
    shutil.copy(shapes_copy / "shard-000000.tar", shapes_copy / "shard-000009.tar")  # stale leftover
    shards = resolve_shards(str(shapes_copy))
    assert [os.path.basename(s.url) for s in shards] == [f"shard-{i:06d}.tar" for i in range(4)]
    assert [s.samples for s in shards] == [10, 10, 10, 7]


def test_resolve_shards_patterns(shapes: Path) -> None:
    brace = resolve_shards(f"{shapes}/shard-{{000001..000003}}.tar")
    assert [(os.path.basename(s.url), s.samples) for s in brace] == [
        ("shard-000001.tar", 10),
        ("shard-000002.tar", 10),
        ("shard-000003.tar", 7),
    ]
    glob = resolve_shards(f"{shapes}/shard-*.tar")
    assert [s.samples for s in glob] == [10, 10, 10, 7]
    assert resolve_shards(f"{shapes}/shard-00000[02].tar") == [glob[0], glob[2]]


@pytest.mark.parametrize("pattern", ["nothing-*.tar", "shard-{000007..000009}.tar", "empty"])
def test_resolve_shards_without_match_names_data_shards(shapes: Path, tmp_path: Path, pattern: str) -> None:
    (tmp_path / "empty").mkdir()
    spec = f"{tmp_path}/{pattern}" if pattern == "empty" else f"{shapes}/{pattern}"
    with pytest.raises(UserError, match="data.shards") as info:
        resolve_shards(spec)
    assert "\n" not in str(info.value)


def test_resolve_shards_counts_by_scanning_without_manifest(shapes_copy: Path) -> None:
    (shapes_copy / "manifest.json").unlink()
    shards = resolve_shards(str(shapes_copy))
    assert [os.path.basename(s.url) for s in shards] == [f"shard-{i:06d}.tar" for i in range(4)]
    assert [s.samples for s in shards] == [10, 10, 10, 7]
    assert TrainBatches(data_config(shapes_copy), None, seed=0).num_samples == NUM


def test_captions_match_the_shards(shapes: Path) -> None:
    expected = {}
    for tar_path in sorted(shapes.glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            for member in tar:
                if member.name.endswith(".txt"):
                    expected[member.name.split(".")[0]] = tar.extractfile(member).read().decode()
    assert sorted(expected) == KEYS
    got = {}
    for batch in take(TrainBatches(data_config(shapes), None, seed=0), 10):
        got.update(zip(batch["keys"], batch["captions"]))
    assert sorted(got) == KEYS
    # A pair's caption file holds its phrasings one per line: each sample gets one of its own.
    assert all(caption in expected[key].splitlines() for key, caption in got.items())
    assert all(c.startswith(("a ", "an ")) for c in got.values())


def test_data_with_no_decodable_image_is_one_clear_error_not_a_hang(shapes: Path) -> None:
    for workers in (0, 1):
        tb = TrainBatches(data_config(shapes, workers, image_key="jpg"), None, seed=0)
        with pytest.raises(UserError, match="data.image_key") as info:
            tb.next()
        assert "\n" not in str(info.value)


def test_one_unreadable_shard_does_not_stop_the_others(tmp_path: Path) -> None:
    write_damaged(tmp_path)
    (tmp_path / "shard-000000.tar").write_bytes(b"")  # one worker's whole share is unreadable
    tb = TrainBatches(data_config(tmp_path, workers=2), None, seed=0)
    keys = keys_of(take(tb, 6))
    assert keys and all(k >= "s010" for k in keys)


def test_training_filters_skip_samples_count_them_and_resume_exactly(shapes: Path) -> None:
    # Shapes captions of one shape ("a red circle") are short; two shapes make long ones.
    config = data_config(shapes, 2, batch_size=1, filters={"min_caption_length": 20})
    captions = {}
    tb = TrainBatches(config, None, seed=0)
    first_epoch = {}
    while tb.position.epoch == 0:
        batch = tb.next()
        if batch["places"][0] < NUM:  # one sample per batch
            first_epoch.update(zip(batch["keys"], batch["captions"]))
    import webdataset as wds

    for sample in wds.WebDataset(sorted(str(p) for p in shapes.glob("*.tar")), shardshuffle=False):
        captions[sample["__key__"]] = sample["txt"].decode().splitlines()
    # Every phrasing of a pair is long, every single shape short: a pair passes whichever it draws.
    long = [key for key, lines in captions.items() if min(map(len, lines)) >= 20]
    assert 0 < len(long) < NUM
    assert sorted(first_epoch) == sorted(long)
    assert all(caption in captions[key] for key, caption in first_epoch.items())
    assert tb.position.total_filtered >= NUM - len(long)

    state = json.loads(json.dumps(tb.state_dict()))
    expected = keys_of(take(tb, 5))
    resumed = TrainBatches(config, None, seed=0)
    resumed.load_state_dict([state])
    assert keys_of(take(resumed, 5)) == expected
    assert resumed.position.total_filtered >= NUM - len(long)


def test_a_bad_training_filter_is_one_clear_error(shapes: Path, tmp_path: Path) -> None:
    from sdtrain.config import load_config

    yaml = tmp_path / "c.yaml"
    yaml.write_text(f"stage: autoencoder\nrun_dir: {tmp_path}\ndata:\n  shards: {shapes}\n  filters:\n"
                    "    pwatermark: '<=lots'\n")
    with pytest.raises(UserError, match="data.filters") as info:
        load_config(yaml)
    assert "\n" not in str(info.value)


def test_class_datasets_take_captions_from_the_class_prompts(tmp_path: Path) -> None:
    out = tmp_path / "classes"
    with ShardWriter(out, samples_per_shard=4) as writer:
        for i in range(8):
            writer.write({"__key__": f"c{i}", "png": png(i), "cls": str(i % 3)})
    prompts = tmp_path / "idx_to_prompt.json"
    prompts.write_text(json.dumps({"0": "a photo of a tench", "1": ["a goldfish", "a photo of a goldfish"],
                                   "2": "a great white shark"}))
    config = data_config(out, 0, batch_size=8, class_key="cls", class_prompts=str(prompts))
    batch = TrainBatches(config, None, seed=0).next()
    by_key = dict(zip(batch["keys"], batch["captions"], strict=True))
    assert by_key["c0"] == "a photo of a tench" and by_key["c2"] == "a great white shark"
    assert by_key["c1"] in ("a goldfish", "a photo of a goldfish")


@pytest.fixture
def http_server(shapes: Path):
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(shapes))
    handler.log_message = lambda *_: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_shards_stream_over_http_with_their_manifest(shapes: Path, http_server: str) -> None:
    names = sorted(p.name for p in shapes.glob("*.tar"))
    first, last = names[0].split("-")[1][:6], names[-1].split("-")[1][:6]
    spec = f"{http_server}/shard-{{{first}..{last}}}.tar"
    tb = TrainBatches(data_config(spec, 2, batch_size=1), None, seed=0)
    assert tb.num_samples == NUM and all(s.url.startswith("http://") for s in tb.shards)
    keys = []
    while tb.position.epoch == 0:
        batch = tb.next()
        if batch["places"][0] < NUM:  # one sample per batch
            keys += batch["keys"]
    tb.close()
    assert sorted(keys) == KEYS


def test_pipe_shards_without_a_manifest_are_counted_by_reading_them(shapes: Path) -> None:
    names = sorted(p.name for p in shapes.glob("*.tar"))
    spec = "pipe:cat " + str(shapes) + "/shard-{" + names[0][6:12] + ".." + names[-1][6:12] + "}.tar"
    tb = TrainBatches(data_config(spec, 0, batch_size=NUM), None, seed=0)
    assert tb.num_samples == NUM
    assert sorted(tb.next()["keys"]) == KEYS


def test_buckets_keep_about_the_same_pixel_count_within_the_aspect_limit() -> None:
    from sdtrain.data.decode import make_buckets

    buckets = make_buckets(DataConfig(shards="x", resolution=256, bucket_step=64, max_aspect=2.0))
    assert (256, 256) in buckets and len(buckets) >= 3
    assert all((height, width) in buckets for width, height in buckets)
    for width, height in buckets:
        assert width % 64 == 0 and height % 64 == 0
        assert 0.5 <= width / height <= 2.0
        assert 0.7 * 256**2 <= width * height <= 256**2


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wide, tall and square images, their shape in the key."""
    out = tmp_path_factory.mktemp("mixed")
    sizes = {"wide": (120, 64), "tall": (64, 120), "square": (80, 80)}
    with ShardWriter(out, samples_per_shard=7) as writer:
        for i in range(30):
            shape = list(sizes)[i % 3]
            writer.write({"__key__": f"{shape}{i:02d}", "png": png(i, sizes[shape]), "txt": f"caption {i}"})
    return out


def bucket_config(shards: Path, workers: int, **kwargs) -> DataConfig:
    return data_config(shards, workers, resolution=64, aspect_buckets=True, bucket_step=16, batch_size=3,
                       random_flip=True, center_crop=False, **kwargs)


def test_each_batch_comes_from_one_bucket_that_fits_its_images(mixed: Path) -> None:
    tb = TrainBatches(bucket_config(mixed, 0), None, seed=0)
    shapes = set()
    for batch in take(tb, 12):
        height, width = batch["pixel_values"].shape[2:]
        kinds = {key.rstrip("0123456789") for key in batch["keys"]}
        assert len(kinds) == 1  # one bucket: one kind of shape
        kind = kinds.pop()
        assert (width > height) if kind == "wide" else (width < height) if kind == "tall" else (width == height)
        assert abs(width * height - 64 * 64) <= 0.3 * 64 * 64
        shapes.add((width, height))
    assert len(shapes) == 3


@pytest.mark.parametrize("workers", [0, 2])
def test_a_bucketed_filtered_loader_resumes_exactly(mixed: Path, workers: int) -> None:
    config = bucket_config(mixed, workers, filters={"max_caption_length": 9})  # drops "caption 10".."caption 29"
    straight = take(TrainBatches(config, None, seed=2), 12)
    first = TrainBatches(config, None, seed=2)
    head = take(first, 5)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["pending"]  # samples were waiting in buckets
    first.close()
    resumed = TrainBatches(config, None, seed=2)
    resumed.load_state_dict([state])
    tail = take(resumed, 7)
    assert keys_of(head + tail) == keys_of(straight)
    for a, b in zip(straight[5:], tail, strict=True):
        assert torch.equal(a["pixel_values"], b["pixel_values"])
    assert resumed.position.total_filtered > 0


def test_a_bucketed_loader_resumed_on_other_ranks_reads_each_sample_once_per_epoch(mixed: Path) -> None:
    seen: list[tuple[int, str]] = []
    states = None
    for world, workers, batches in [(2, 0, 3), (1, 2, None)]:
        ranks = [TrainBatches(bucket_config(mixed, workers), None, seed=1, rank=r, world_size=world)
                 for r in range(world)]
        for tb in ranks:
            if states is not None:
                tb.load_state_dict(states)
            taken = 0
            while (taken < batches) if batches is not None else tb.position.epoch == 0:
                batch = tb.next()
                taken += 1
                seen += [(place // 30, key) for place, key in zip(batch["places"], batch["keys"], strict=True)]
        states = [json.loads(json.dumps(tb.state_dict())) for tb in ranks]
        for tb in ranks:
            tb.close()
    first_epoch = [key for epoch, key in seen if epoch == 0]
    assert len(first_epoch) == len(set(first_epoch)) == 30


def test_shards_from_an_fsspec_filesystem(shapes: Path) -> None:
    fsspec = pytest.importorskip("fsspec")
    # fsspec's in-memory filesystem stands in for s3:// or gs://, which take the same path.
    memory = fsspec.filesystem("memory")
    for path in sorted(shapes.iterdir()):
        memory.pipe(f"/sdtrain-test/{path.name}", path.read_bytes())
    names = sorted(p.name for p in shapes.glob("*.tar"))
    spec = "memory://sdtrain-test/shard-{" + names[0][6:12] + ".." + names[-1][6:12] + "}.tar"
    try:
        tb = TrainBatches(data_config(spec, 0, batch_size=NUM), None, seed=0)
        assert tb.num_samples == NUM  # counts from the manifest beside the shards
        assert sorted(tb.next()["keys"]) == KEYS
    finally:
        memory.rm("/sdtrain-test", recursive=True)


def _bomb_png(width: int, height: int) -> bytes:
    """A small PNG whose header declares width x height: what a decompression bomb shows before decoding."""
    import struct
    import zlib

    data = bytearray(png(0))
    header = b"IHDR" + struct.pack(">II", width, height) + bytes(data[24:29])
    data[12:29] = header
    data[29:33] = struct.pack(">I", zlib.crc32(header))
    return bytes(data)


def test_an_image_over_the_pixel_limit_is_skipped_before_decoding(tmp_path: Path) -> None:
    # Over sdtrain's limit (PIL's warning threshold, 89M pixels) and under PIL's own refusal (twice that):
    # PIL alone would only warn, then decode 300 MB of pixels.
    bomb = _bomb_png(10_000, 10_000)
    with pytest.warns(Image.DecompressionBombWarning), Image.open(io.BytesIO(bomb)) as img:
        assert img.size == (10_000, 10_000)  # only the header says so
    with ShardWriter(tmp_path, samples_per_shard=10) as writer:
        for i in range(5):
            writer.write({"__key__": f"s{i}", "txt": f"caption {i}", "png": bomb if i == 1 else png(i)})
    tb = TrainBatches(data_config(tmp_path), None, seed=0)
    batches = take(tb, 2)
    assert "s1" not in keys_of(batches)
    assert tb.position.total_skipped >= 1



def _evil_shard(path: Path, outside: Path) -> None:
    """A shard with good samples beside members no reader may take: a path out of the archive, an absolute
    path, a symlink to a file outside, and, last, a member whose header declares 2 GiB."""

    def add(tar: tarfile.TarFile, name: str, data: bytes = b"", **fields) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        for key, value in fields.items():
            setattr(info, key, value)
        tar.addfile(info, io.BytesIO(data) if info.isreg() else None)

    with tarfile.open(path, "w") as tar:
        add(tar, "s0.png", png(0))
        add(tar, "s0.txt", b"caption 0")
        add(tar, "../s9.txt", b"escaped")
        add(tar, "/s8.txt", b"absolute")
        add(tar, "s1.png", type=tarfile.SYMTYPE, linkname=str(outside))
        add(tar, "s1.txt", b"caption 1")
        add(tar, "s2.png", png(2))
        add(tar, "s2.txt", b"caption 2")
        add(tar, "s3.png", b"tiny")
    data = bytearray(path.read_bytes())
    start = data.rindex(b"s3.png")
    header = data[start:start + 512]
    header[124:136] = b"%011o\0" % (2 << 30)
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    data[start:start + 512] = header
    path.write_bytes(bytes(data))


def test_every_reader_refuses_tar_members_that_escape_or_lie_about_their_size(tmp_path: Path) -> None:
    from sdtrain.data.order import read_shard
    from sdtrain.data.pipeline import read_captions
    from sdtrain.data.prepare import reshard

    outside = tmp_path / "secret.png"
    outside.write_bytes(png(7))
    shards = tmp_path / "in"
    shards.mkdir()
    _evil_shard(shards / "shard-000000.tar", outside)
    from sdtrain.data.shards import UnsafeMember, tar_samples

    refused: list[Exception] = []
    list(tar_samples(str(shards / "shard-000000.tar"), handler=lambda exc: refused.append(exc) or True))
    messages = [str(e) for e in refused if isinstance(e, UnsafeMember)]
    assert len(messages) == 3, refused
    assert "'../s9.txt' points outside" in messages[0] and "'/s8.txt' points outside" in messages[1]
    assert "'s3.png' declares 2147483648 bytes" in messages[2]  # refused from its header, never read
    # The training loader's reader: the good samples, nothing else.
    samples = read_shard(str(shards / "shard-000000.tar"))
    keys = {s["__key__"] for s in samples}
    assert {"s0", "s2"} <= keys and not {"../s9", "/s8", "s9", "s8"} & keys
    assert all("png" not in s for s in samples if s["__key__"] == "s1")  # the symlink was not followed
    assert read_captions(str(shards)) == ["caption 0", "caption 1", "caption 2"]
    report = reshard([str(shards)], tmp_path / "out", samples_per_shard=10)
    assert report.written == 2
    with tarfile.open(tmp_path / "out" / "shard-000000.tar") as tar:
        names = tar.getnames()
    assert all(".." not in n and not n.startswith("/") for n in names)
    assert outside.read_bytes() == png(7)


def _unique_mib(pid: int) -> float:
    """Memory only this process holds (its unique set size): pages no other process shares."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
    return sum(int(fields[k].split()[0]) for k in ("Private_Clean", "Private_Dirty")) / 1024


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux's /proc/PID/smaps_rollup")
def test_loader_workers_share_none_of_the_trainers_writable_memory(shapes: Path) -> None:
    # What the trainer holds when the workers start (weights, optimizer state), every page touched.
    held = torch.ones(64 * 2**20)  # 256 MiB
    # One worker: pages the trainer rewrites after forking two would stay shared between the two, and
    # count in neither one's unique set.
    tb = TrainBatches(data_config(shapes, workers=1), None, seed=0)
    try:
        take(tb, 4)
        workers = [w.pid for w in tb._iterator._workers]
        before = {pid: _unique_mib(pid) for pid in workers}
        # A training step rewrites its state and allocates more: a worker forked from this process would
        # now own a private copy of every page rewritten.
        held.mul_(2)
        extra = torch.ones(32 * 2**20)
        take(tb, 8)
        after = {pid: _unique_mib(pid) for pid in workers}
    finally:
        tb.close()
    del held, extra
    for pid in workers:
        assert after[pid] - before[pid] < 32, (before, after)
        assert after[pid] < 200, after


def _left_running(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Those of `pids` still running after up to `timeout` s (a zombie has ended)."""
    pause = threading.Event()
    deadline = time.monotonic() + timeout
    while True:
        running = [pid for pid in pids if _state(pid) not in ("", "Z", "X")]
        if not running or time.monotonic() > deadline:
            return running
        pause.wait(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return ""


def _kill_and_count_left(process: subprocess.Popen) -> tuple[list[int], list[int]]:
    """kill -9 the process; every process below it before, and those of them still running after."""
    below = [pid for pid, _ in descendants(process.pid)]
    process.kill()
    process.wait(timeout=30)
    return below, _left_running(below)


LOADER_SCRIPT = """
import sys
from sdtrain.config import DataConfig
from sdtrain.data.pipeline import TrainBatches

if __name__ == "__main__":
    tb = TrainBatches(DataConfig(shards=sys.argv[1], resolution=32, batch_size=4, num_workers=2), None, seed=0)
    tb.next()
    print("ready", flush=True)
    sys.stdin.read()
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads Linux's /proc")
def test_loader_processes_end_with_a_killed_trainer(shapes: Path, tmp_path: Path) -> None:
    script = tmp_path / "loader.py"
    script.write_text(LOADER_SCRIPT)
    process = subprocess.Popen([sys.executable, str(script), str(shapes)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert process.stdout.readline() == "ready\n"
        below, left = _kill_and_count_left(process)
    finally:
        process.kill()
    # The fork server, both workers and the resource tracker.
    assert len(below) == 4, below
    assert left == []


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads Linux's /proc")
def test_kill_9_of_a_training_run_leaves_no_process_behind(shapes: Path, tmp_path: Path) -> None:
    from .conftest import TINY, config_path

    run = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "sdtrain", "train", str(config_path("autoencoder.yaml")), f"run_dir={run}",
         f"data.shards={shapes}", *TINY, "data.num_workers=2", "train.max_steps=100000", "logging.every=1",
         "checkpoint.every=0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        pause = threading.Event()
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text():
            assert process.poll() is None and time.monotonic() < deadline
            pause.wait(0.2)
        below, left = _kill_and_count_left(process)
    finally:
        process.kill()
    assert len(below) >= 4, below
    assert left == []


def test_a_position_saved_by_an_earlier_release_resumes_exactly(shapes: Path) -> None:
    # One loader slot, as the previous release's fixtures saved it: its order is this one.
    straight = take(TrainBatches(data_config(shapes), None, seed=0), 5)
    resumed = TrainBatches(data_config(shapes, 2), None, seed=0)
    resumed.load_state_dict([{"workers": 1, "batches": 2, "layout_start": 0, "cursors": {"0": [0, 8, []]},
                              "skipped": {"0": 0}, "filtered": {"0": 0}, "plans": {}}])
    assert keys_of(take(resumed, 3)) == keys_of(straight[2:])
    resumed.close()
