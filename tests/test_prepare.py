"""`sdtrain prepare folder | reshard | verify`: image folders and foreign shards into checked, even shards."""

from __future__ import annotations

import io
import itertools
import json
import struct
import tarfile
import zlib
from pathlib import Path

import pytest
import webdataset as wds
from PIL import Image

from sdtrain.cli.main import main
from sdtrain.data.shards import read_manifest, sha256_file

_FILES = itertools.count(1)


def image_bytes(size: tuple[int, int] = (24, 16), fmt: str = "PNG", colour: str = "red") -> bytes:
    """An image of `colour`, a different file at each call (the call's number in black and white pixels along the
    top row, which survive JPEG): prepare drops an image whose bytes repeat an earlier one's."""
    img = Image.new("RGB", size, colour)
    n = next(_FILES)
    for bit in range(min(size[0], 16)):
        img.putpixel((bit, 0), (255, 255, 255) if n >> bit & 1 else (0, 0, 0))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def put(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        path.write_bytes(data)
    return path


def huge_png_header(width: int = 100_000, height: int = 100_000) -> bytes:
    """A PNG whose header claims ``width x height`` pixels but holds no real image data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"xx") + chunk(b"IEND", b"")


def samples(out: Path) -> list[dict]:
    """Every sample of a dataset folder, read with plain webdataset in manifest order."""
    manifest = read_manifest(out)
    assert manifest is not None
    urls = [str(out / s["name"]) for s in manifest["shards"]]
    return list(wds.WebDataset(urls, shardshuffle=False)) if urls else []


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, list[str], str]:
    code = main(["prepare", *argv])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def folder_files(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir())


@pytest.fixture()
def image_folder(tmp_path: Path) -> Path:
    src = tmp_path / "images"
    put(src / "b.jpg", image_bytes((32, 20), "JPEG"))
    put(src / "b.txt", "a jpeg\n")
    put(src / "a" / "x.png", image_bytes((16, 16), "PNG", "blue"))
    put(src / "a" / "x.txt", "a png")
    put(src / "a" / "deep" / "y.webp", image_bytes((20, 40), "WEBP", "green"))
    put(src / "a" / "deep" / "y.txt", "a webp")
    put(src / "c.JPEG", image_bytes((8, 8), "JPEG", "white"))
    put(src / "c.txt", "upper-case extension")
    put(src / "notes.md", "not an image")
    put(src / ".hidden" / "z.png", image_bytes())  # hidden folders are not read
    put(src / ".hidden" / "z.txt", "hidden")
    return src


def test_folder_nested_formats_readable_by_plain_webdataset(image_folder: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    code, lines, _ = run(capsys, "folder", str(image_folder), "--out", str(out), "--samples-per-shard", "3")
    assert code == 0
    assert lines == [f"written: 4 samples in 2 shards to {out}"]
    assert folder_files(out) == ["manifest.json", "shard-000000.tar", "shard-000001.tar"]
    manifest = read_manifest(out)
    assert manifest is not None and manifest["total"] == 4
    assert [s["samples"] for s in manifest["shards"]] == [3, 1]
    assert manifest["source"] == "folder" and manifest["input"] == str(image_folder.resolve())

    got = {s["__key__"]: s for s in samples(out)}
    # Sorted relative paths; nested folders keep their path in the key.
    assert list(got) == ["a/deep/y", "a/x", "b", "c"]
    expect = {
        "a/deep/y": ("webp", "a/deep/y.webp", (20, 40), "a webp"),
        "a/x": ("png", "a/x.png", (16, 16), "a png"),
        "b": ("jpg", "b.jpg", (32, 20), "a jpeg"),
        "c": ("jpg", "c.JPEG", (8, 8), "upper-case extension"),
    }
    for key, (ext, rel, size, caption) in expect.items():
        sample = got[key]
        assert set(sample) - {"__key__", "__url__", "__local_path__"} == {ext, "txt", "json"}
        assert sample[ext] == (image_folder / rel).read_bytes()  # the original bytes, not re-encoded
        assert sample["txt"].decode() == caption
        assert json.loads(sample["json"]) == {"width": size[0], "height": size[1], "file_name": rel}

    # The same input gives byte-identical shards (stable keys, fixed tar mtimes).
    again = tmp_path / "again"
    assert main(["prepare", "folder", str(image_folder), "--out", str(again), "--samples-per-shard", "3"]) == 0
    assert [s["sha256"] for s in read_manifest(again)["shards"]] == [s["sha256"] for s in manifest["shards"]]


def test_keys_are_sanitised_unique_and_dot_free(tmp_path: Path) -> None:
    from sdtrain.data.prepare import prepare_folder, sample_key

    src = tmp_path / "src"
    for name in ("x.y", "x y", "x_y", "café", "dir.v2/img"):
        put(src / f"{name}.png", image_bytes())
        put(src / f"{name}.txt", name)
    report = prepare_folder(src, tmp_path / "out")
    assert report.written == 5 and not report.skipped
    keys = [s["__key__"] for s in samples(tmp_path / "out")]
    assert len(set(keys)) == 5 and not any("." in k for k in keys)
    assert "x_y" in keys  # unchanged names keep their key
    assert sample_key("x.y") == sample_key("x.y") != sample_key("x_y")
    captions = {s["__key__"]: s["txt"].decode() for s in samples(tmp_path / "out")}
    assert captions[sample_key("dir.v2/img")] == "dir.v2/img"


def test_metadata_jsonl(tmp_path: Path, capsys) -> None:
    src = tmp_path / "src"
    put(src / "imgs" / "one.png", image_bytes((30, 10)))
    put(src / "imgs" / "two.jpg", image_bytes((10, 10), "JPEG"))
    put(src / "three.webp", image_bytes((12, 12), "WEBP"))
    put(src / "four.png", image_bytes((12, 12)))
    put(src / "one.txt", "ignored: metadata wins over caption files")
    rows = [
        {"file_name": "imgs/one.png", "text": "first", "pwatermark": 0.1, "tags": ["a", "b"], "width": 999},
        {"file_name": "imgs/two.jpg", "caption": "second", "pwatermark": 0.9},
        {"file_name": "three.webp", "text": "third"},  # no pwatermark: rejected as missing
        {"file_name": "gone.png", "text": "listed, not there", "pwatermark": 0.0},
        {"file_name": "four.png", "text": "   ", "pwatermark": 0.0},  # empty caption
    ]
    put(src / "metadata.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    out = tmp_path / "out"
    code, lines, _ = run(capsys, "folder", str(src), "--out", str(out), "--filter", "pwatermark=<=0.5")
    assert code == 0
    assert lines == [
        f"written: 1 samples in 1 shards to {out}",
        "skipped (image file listed in the metadata not found): 1",
        "skipped (missing or empty caption): 1",
        "filtered (pwatermark<=0.5): 1",
        "filtered (pwatermark: missing): 1",
    ]
    (sample,) = samples(out)
    assert sample["__key__"] == "imgs/one" and sample["txt"] == b"first"
    # Metadata columns, then the measured size (over the column's 999) and the file name.
    assert json.loads(sample["json"]) == {"pwatermark": 0.1, "tags": ["a", "b"], "width": 30, "height": 10,
                                          "file_name": "imgs/one.png"}
    manifest = read_manifest(out)
    assert list(manifest["filtered"].items()) == [("pwatermark", 1), ("pwatermark: missing", 1)]
    assert manifest["skipped"] == {"no_file": 1, "no_caption": 1}
    assert manifest["filters"] == {"pwatermark": "pwatermark<=0.5"}

    # Without the filter, the "caption" column serves when there is no "text".
    code, lines, _ = run(capsys, "folder", str(src), "--out", str(out))
    assert lines[0] == f"written: 3 samples in 1 shards to {out}"
    assert {s["__key__"]: s["txt"] for s in samples(out)}["imgs/two"] == b"second"


def test_metadata_csv_strings_and_numeric_filters(tmp_path: Path, capsys) -> None:
    src = tmp_path / "src"
    for name in ("a", "b", "c"):
        put(src / f"{name}.png", image_bytes((20, 10)))
    put(src / "metadata.csv", "file_name,caption,score,source\na.png,alpha,0.9,web\nb.png,beta,0.2,web\n"
                              "c.png,\"gamma, with comma\",,web\n")
    out = tmp_path / "out"
    code, lines, _ = run(capsys, "folder", str(src), "--out", str(out), "--filter", "score=>=0.5", "--min-width", "20")
    assert code == 0
    assert lines == [f"written: 1 samples in 1 shards to {out}", "filtered (score>=0.5): 1",
                     "filtered (score: missing): 1"]
    (sample,) = samples(out)
    assert json.loads(sample["json"]) == {"score": "0.9", "source": "web", "width": 20, "height": 10,
                                          "file_name": "a.png"}
    code, lines, _ = run(capsys, "folder", str(src), "--out", str(out))
    assert {s["__key__"]: s["txt"].decode() for s in samples(out)}["c"] == "gamma, with comma"


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("metadata.csv", "path,text\na.png,x\n", "no 'file_name' column"),
        ("metadata.csv", "file_name,score\na.png,1\n", "no 'text' or 'caption' column"),
        ("metadata.jsonl", '{"file_name": "a.png", "text": "x"}\n{oops\n', "line 2: not valid JSON"),
        ("metadata.jsonl", '["a.png"]\n', "line 1: expected a JSON object"),
        ("metadata.jsonl", '{"file_name": "../a.png", "text": "x"}\n', "must be a path inside"),
        ("metadata.jsonl", '{"text": "x"}\n', "line 1: needs a 'file_name'"),
    ],
)
def test_bad_metadata_is_one_line_error(tmp_path: Path, capsys, name: str, content: str, needle: str) -> None:
    src = tmp_path / "src"
    put(src / "a.png", image_bytes())
    put(src / name, content)
    code, lines, err = run(capsys, "folder", str(src), "--out", str(tmp_path / "out"))
    assert code == 2 and lines == []
    assert err.startswith("sdtrain prepare: error: ") and err.count("\n") == 1
    assert needle in err and name in err


def test_folder_errors(tmp_path: Path, capsys) -> None:
    code, _, err = run(capsys, "folder", str(tmp_path / "nope"), "--out", str(tmp_path / "out"))
    assert code == 2 and "not a folder" in err
    put(tmp_path / "empty" / "readme.txt", "no images")
    code, _, err = run(capsys, "folder", str(tmp_path / "empty"), "--out", str(tmp_path / "out"))
    assert code == 2 and "no .jpg/.jpeg/.png/.webp/.gif/.tif/.tiff images found" in err
    put(tmp_path / "one" / "a.png", image_bytes())
    code, _, err = run(capsys, "folder", str(tmp_path / "one"), "--out", str(tmp_path / "out"),
                       "--samples-per-shard", "0")
    assert code == 2 and "--samples-per-shard" in err
    code, _, err = run(capsys, "folder", str(tmp_path / "one"), "--out", str(tmp_path / "out"), "--filter", "width")
    assert code == 2 and "--filter 'width': expected KEY=COND" in err
    code, _, err = run(capsys, "folder", str(tmp_path / "one"), "--out", str(tmp_path / "out"),
                       "--filter", "min_width=3", "--min-width", "4")
    assert code == 2 and "min_width is given twice" in err
    code, _, err = run(capsys, "folder", str(tmp_path / "one"), "--out", str(tmp_path / "out"),
                       "--filter", "pwatermark=>>1")
    assert code == 2 and "filter 'pwatermark'" in err and err.count("\n") == 1


def test_corrupt_empty_truncated_and_unsupported_images_are_skipped(tmp_path: Path, capsys) -> None:
    src = tmp_path / "src"
    good = image_bytes((64, 64), "PNG")
    jpeg = image_bytes((64, 64), "JPEG")
    files = {
        "good.png": good,
        "empty.png": b"",
        "garbage.jpg": b"definitely not a jpeg" * 10,
        "truncated.png": good[: len(good) // 2],
        "truncated.jpg": jpeg[: len(jpeg) // 2],
        "bmp.png": image_bytes((8, 8), "BMP"),
    }
    for name, data in files.items():
        put(src / name, data)
        put(src / (name.split(".")[0] + ".txt"), f"caption of {name}")
    out = tmp_path / "out"
    code, lines, _ = run(capsys, "folder", str(src), "--out", str(out))
    assert code == 0
    assert lines == [
        f"written: 1 samples in 1 shards to {out}",
        "skipped (corrupt, empty or truncated image): 4",
        "skipped (not a JPEG, PNG, WebP, GIF or TIFF image): 1",
    ]
    assert [s["__key__"] for s in samples(out)] == ["good"]


def test_oversized_images_rejected_before_decoding(tmp_path: Path, capsys, monkeypatch) -> None:
    src = tmp_path / "src"
    put(src / "small.png", image_bytes((10, 10)))
    put(src / "medium.png", image_bytes((20, 20)))
    put(src / "bomb.png", huge_png_header())  # 10^10 pixels claimed, over PIL's own bomb limit too
    for name in ("small", "medium", "bomb"):
        put(src / f"{name}.txt", name)

    loads: list[tuple[int, int]] = []
    real_load = Image.Image.load

    def spy_load(self):
        loads.append(self.size)
        return real_load(self)

    monkeypatch.setattr(Image.Image, "load", spy_load)
    out = tmp_path / "out"
    code, lines, _ = run(capsys, "folder", str(src), "--out", str(out))  # default limit
    assert code == 0
    assert lines == [f"written: 2 samples in 1 shards to {out}", "skipped (image over 89478485 pixels): 1"]
    assert (100_000, 100_000) not in loads  # the bomb was never decoded
    code, lines, _ = run(capsys, "folder", str(src), "--out", str(out), "--max-pixels", "150")
    assert lines == [f"written: 1 samples in 1 shards to {out}", "skipped (image over 150 pixels): 2"]
    assert [s["__key__"] for s in samples(out)] == ["small"]
    assert Image.MAX_IMAGE_PIXELS == 89_478_485  # PIL's global limit is restored afterwards


def test_missing_caption_skip_or_empty(tmp_path: Path, capsys) -> None:
    src = tmp_path / "src"
    put(src / "with.png", image_bytes())
    put(src / "with.txt", "  a caption  \n")
    put(src / "without.png", image_bytes())
    put(src / "blank.png", image_bytes())
    put(src / "blank.txt", " \n")
    put(src / "other.png", image_bytes())
    put(src / "other.caption", "from another extension")
    out = tmp_path / "out"
    code, lines, _ = run(capsys, "folder", str(src), "--out", str(out))
    assert lines == [f"written: 1 samples in 1 shards to {out}", "skipped (missing or empty caption): 3"]
    assert [(s["__key__"], s["txt"]) for s in samples(out)] == [("with", b"a caption")]

    code, lines, _ = run(capsys, "folder", str(src), "--out", str(out), "--missing-caption", "empty")
    assert lines == [f"written: 4 samples in 1 shards to {out}"]
    assert {s["__key__"]: s["txt"] for s in samples(out)} == {
        "blank": b"", "other": b"", "with": b"a caption", "without": b""}

    code, lines, _ = run(capsys, "folder", str(src), "--out", str(out), "--caption-ext", "caption")
    assert [(s["__key__"], s["txt"]) for s in samples(out)] == [("other", b"from another extension")]


def test_duplicate_keys_first_usable_wins(tmp_path: Path, capsys) -> None:
    src = tmp_path / "src"
    put(src / "a.jpg", image_bytes(fmt="JPEG"))
    put(src / "a.png", image_bytes())
    put(src / "a.webp", image_bytes(fmt="WEBP"))
    put(src / "a.txt", "shared caption")
    put(src / "b.jpg", b"corrupt")  # skipped as corrupt, so b.png takes the key
    put(src / "b.png", image_bytes())
    put(src / "b.txt", "b")
    out = tmp_path / "out"
    code, lines, _ = run(capsys, "folder", str(src), "--out", str(out))
    assert lines == [f"written: 2 samples in 1 shards to {out}", "skipped (corrupt, empty or truncated image): 1",
                     "skipped (duplicate key): 2"]
    got = {s["__key__"]: s for s in samples(out)}
    assert "jpg" in got["a"] and "png" in got["b"]
    assert json.loads(got["a"]["json"])["file_name"] == "a.jpg"


def test_rerun_after_interrupted_prepare_ends_consistent(tmp_path: Path, capsys, monkeypatch) -> None:
    import sdtrain.data.prepare as prepare

    src = tmp_path / "src"
    for i in range(7):
        put(src / f"{i:02d}.png", image_bytes((8 + i, 8)))
        put(src / f"{i:02d}.txt", f"image {i}")
    out = tmp_path / "out"
    # An earlier complete run with smaller shards: 7 shards and a manifest.
    assert main(["prepare", "folder", str(src), "--out", str(out), "--samples-per-shard", "1"]) == 0
    assert len(read_manifest(out)["shards"]) == 7

    # A run with bigger shards is interrupted on the 6th image (Ctrl-C), after two complete shards.
    calls = {"n": 0}
    real = prepare._read_caption_file

    def interrupt(path: Path) -> str | None:
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real(path)

    monkeypatch.setattr(prepare, "_read_caption_file", interrupt)
    assert main(["prepare", "folder", str(src), "--out", str(out), "--samples-per-shard", "2"]) == 130
    monkeypatch.setattr(prepare, "_read_caption_file", real)
    # No manifest (it would describe the old shards), no temporary file; the finished shards are in place.
    assert "manifest.json" not in folder_files(out)
    assert not any(name.startswith(".") for name in folder_files(out))
    # A hard kill could also leave a temporary shard and a temporary manifest behind.
    put(out / ".shard-000002.tar.tmp", b"partial")
    put(out / ".manifest.json.tmp-4242", b"{")
    put(out / "keep-me.txt", "not ours")

    capsys.readouterr()
    code, lines, _ = run(capsys, "folder", str(src), "--out", str(out), "--samples-per-shard", "3")
    assert code == 0 and lines == [f"written: 7 samples in 3 shards to {out}"]
    assert folder_files(out) == ["keep-me.txt", "manifest.json", "shard-000000.tar", "shard-000001.tar",
                                 "shard-000002.tar"]
    assert [s["samples"] for s in read_manifest(out)["shards"]] == [3, 3, 1]
    assert [s["__key__"] for s in samples(out)] == [f"{i:02d}" for i in range(7)]
    code, lines, _ = run(capsys, "verify", str(out))
    assert code == 0 and lines == [f"OK: 3 shards, 7 samples in {out}"]


# ------------------------------------------------------------------------------------------------------ reshard


def write_tar(path: Path, items: list[dict]) -> Path:
    """An img2dataset-style shard: {key}.jpg, {key}.txt, {key}.json."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(path)) as writer:
        for item in items:
            writer.write(item)
    return path


def img2dataset_sample(key: str, size: tuple[int, int] = (16, 16), caption: str | None = None, **meta) -> dict:
    sample = {"__key__": key, "jpg": image_bytes(size, "JPEG"),
              "json": json.dumps({"key": key, "original_width": size[0] * 4, "original_height": size[1] * 4,
                                  **meta}).encode()}
    if caption is not None:
        sample["txt"] = caption
    return sample


def test_reshard_evens_out_drops_corrupt_and_survives_truncation(tmp_path: Path, capsys) -> None:
    src = tmp_path / "downloads"
    first = [img2dataset_sample(f"0000{i}", caption=f"caption {i}") for i in range(5)]
    write_tar(src / "00000.tar", first)
    bad = img2dataset_sample("10000", caption="corrupt image")
    bad["jpg"] = b"\xff\xd8 not really"
    write_tar(src / "00001.tar", [bad, img2dataset_sample("10001", caption="ok")])
    whole = write_tar(tmp_path / "whole.tar", [img2dataset_sample(f"2000{i}", caption=f"t{i}") for i in range(4)])
    # Cut the third shard in the middle of its third sample's image.
    with tarfile.open(whole) as tar:
        member = next(m for m in tar.getmembers() if m.name == "20002.jpg")
    put(src / "00002.tar", whole.read_bytes()[: member.offset_data + 100])
    put(src / "00000.parquet", b"PAR1 not a tar")
    put(src / "00000_stats.json", "{}")
    put(src / "nocaption" / "ignored.tar", b"")  # folders are not searched recursively

    out = tmp_path / "out"
    code, lines, err = run(capsys, "reshard", str(src), "--out", str(out), "--samples-per-shard", "3")
    assert code == 0
    assert lines == [
        f"written: 8 samples in 3 shards to {out}",
        "skipped (corrupt, empty or truncated image): 1",
        "unreadable tar data (the readable samples were kept): 1 shards: 00002.tar",
    ]
    assert [s["samples"] for s in read_manifest(out)["shards"]] == [3, 3, 2]
    got = samples(out)
    assert [s["__key__"] for s in got] == ["00000", "00001", "00002", "00003", "00004", "10001", "20000", "20001"]
    original = first[3]
    sample = got[3]
    assert (sample["jpg"], sample["txt"], sample["json"]) == (original["jpg"], b"caption 3", original["json"])
    assert read_manifest(out)["source"] == "reshard"
    code, lines, _ = run(capsys, "verify", str(out))
    assert code == 0


def test_reshard_patterns_filters_and_captions(tmp_path: Path, capsys) -> None:
    src = tmp_path / "in"
    # Their json has no "width": min_width reads the image's own width (not original_width, 4x as large).
    write_tar(src / "a-0.tar", [img2dataset_sample("a0", (16, 16), "big", pwatermark=0.1),
                                img2dataset_sample("a1", (8, 8), "small", pwatermark=0.1),
                                img2dataset_sample("a2", (16, 16), "marked", pwatermark=0.8)])
    write_tar(src / "a-1.tar", [img2dataset_sample("b0", (16, 16), None, pwatermark=0.0),
                                img2dataset_sample("a0", (16, 16), "again", pwatermark=0.0),
                                {"__key__": "c0", "txt": "no image"}])
    out = tmp_path / "out"
    code, lines, _ = run(capsys, "reshard", str(src / "a-{0..1}.tar"), "--out", str(out), "--samples-per-shard",
                         "10", "--filter", "pwatermark=<=0.5", "--min-width", "12")
    assert code == 0
    assert lines == [
        f"written: 1 samples in 1 shards to {out}",
        "skipped (sample without an image): 1",
        "skipped (missing or empty caption): 1",
        "skipped (duplicate key): 1",
        "filtered (pwatermark<=0.5): 1",
        "filtered (min_width=12): 1",
    ]
    code, lines, _ = run(capsys, "reshard", str(src / "*"), "--out", str(out), "--samples-per-shard", "10",
                         "--missing-caption", "empty")
    assert lines[0] == f"written: 4 samples in 1 shards to {out}"
    assert {s["__key__"]: s["txt"] for s in samples(out)}["b0"] == b""

    code, _, err = run(capsys, "reshard", str(src / "a-{0..2}.tar"), "--out", str(out), "--samples-per-shard", "2")
    assert code == 2 and "a-2.tar: no such shard" in err
    code, _, err = run(capsys, "reshard", str(tmp_path / "none*.tar"), "--out", str(out), "--samples-per-shard", "2")
    assert code == 2 and "no .tar shards found" in err
    code, _, err = run(capsys, "reshard", str(out), "--out", str(out), "--samples-per-shard", "2")
    assert code == 2 and "holds the input shard" in err


def test_reshard_reads_a_prepared_folder_through_its_manifest(tmp_path: Path, capsys) -> None:
    src = tmp_path / "src"
    for i in range(5):
        put(src / f"{i}.png", image_bytes())
        put(src / f"{i}.txt", f"c{i}")
    first = tmp_path / "first"
    assert main(["prepare", "folder", str(src), "--out", str(first), "--samples-per-shard", "2"]) == 0
    put(first / "shard-000099.tar", b"stale, not in the manifest")
    capsys.readouterr()
    code, lines, _ = run(capsys, "reshard", str(first), "--out", str(tmp_path / "second"), "--samples-per-shard", "5")
    assert code == 0 and lines == [f"written: 5 samples in 1 shards to {tmp_path / 'second'}"]


# ------------------------------------------------------------------------------------------------------- verify


@pytest.fixture()
def dataset(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    for i in range(5):
        put(src / f"{i}.png", image_bytes((8, 8), colour=("red", "blue")[i % 2]))
        put(src / f"{i}.txt", f"caption {i}")
    out = tmp_path / "data"
    assert main(["prepare", "folder", str(src), "--out", str(out), "--samples-per-shard", "2"]) == 0
    return out


def test_verify_ok(dataset: Path, capsys) -> None:
    capsys.readouterr()
    code, lines, _ = run(capsys, "verify", str(dataset))
    assert code == 0 and lines == [f"OK: 3 shards, 5 samples in {dataset}"]


def test_verify_changed_byte(dataset: Path, capsys) -> None:
    shard = dataset / "shard-000001.tar"
    data = bytearray(shard.read_bytes())
    data[600] ^= 0xFF  # inside the first member's data
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    code, lines, _ = run(capsys, "verify", str(dataset))
    assert code == 1
    assert len(lines) == 1 and "shard-000001.tar: sha256 is" in lines[0]


def test_verify_missing_shard(dataset: Path, capsys) -> None:
    (dataset / "shard-000002.tar").unlink()
    capsys.readouterr()
    code, lines, _ = run(capsys, "verify", str(dataset))
    assert code == 1 and lines == [f"{dataset}: shard-000002.tar: missing (listed in the manifest)"]


def test_verify_wrong_count(dataset: Path, capsys) -> None:
    manifest = json.loads((dataset / "manifest.json").read_text())
    manifest["shards"][0]["samples"] = 3
    manifest["total"] = 6
    (dataset / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    code, lines, _ = run(capsys, "verify", str(dataset))
    assert code == 1 and lines == [f"{dataset}: shard-000000.tar: holds 2 samples, manifest says 3"]


def test_verify_truncated_shard(dataset: Path, capsys) -> None:
    shard = dataset / "shard-000000.tar"
    shard.write_bytes(shard.read_bytes()[:700])
    capsys.readouterr()
    code, lines, _ = run(capsys, "verify", str(dataset))
    assert code == 1 and lines and all("shard-000000.tar" in line for line in lines)
    assert any("sha256" in line for line in lines)


def test_verify_without_manifest(tmp_path: Path, capsys) -> None:
    put(tmp_path / "d" / "shard-000000.tar", b"")
    code, lines, err = run(capsys, "verify", str(tmp_path / "d"))
    assert code == 2 and lines == []
    assert err == f"sdtrain prepare: error: {tmp_path / 'd' / 'manifest.json'}: no shard manifest; " \
                  "write the dataset with `sdtrain prepare`\n"


# --------------------------------------------------------------------------------------------------------- misc


def test_cli_defaults_match_the_library_and_shapes_still_works(tmp_path: Path, capsys) -> None:
    import sdtrain.cli.prepare as cli
    import sdtrain.data.prepare as lib

    assert cli.DEFAULT_MAX_PIXELS == lib.DEFAULT_MAX_PIXELS == Image.MAX_IMAGE_PIXELS
    assert cli.MISSING_CAPTION == lib.MISSING_CAPTION
    from sdtrain.data.dedup import DEDUP_MODES

    assert cli.DEDUP_MODES == DEDUP_MODES
    code, lines, _ = run(capsys, "shapes", "--out", str(tmp_path / "s"), "--num", "3", "--size", "16")
    assert code == 0 and lines == [f"wrote 3 samples in 1 shards to {tmp_path / 's'}"]
    assert sha256_file(tmp_path / "s" / "shard-000000.tar") == read_manifest(tmp_path / "s")["shards"][0]["sha256"]


def test_captions_that_are_not_utf8_are_kept_with_replacement_characters(tmp_path: Path, capsys) -> None:
    src = tmp_path / "src"
    put(src / "latin.png", image_bytes())
    put(src / "latin.txt", "a café by the sea".encode("latin-1"))  # é is one byte, invalid as UTF-8
    out = tmp_path / "out"
    code, lines, _ = run(capsys, "folder", str(src), "--out", str(out))
    assert code == 0 and lines == [f"written: 1 samples in 1 shards to {out}"]
    [sample] = samples(out)
    assert sample["txt"].decode("utf-8") == "a caf\ufffd by the sea"
    code, lines, _ = run(capsys, "reshard", str(out), "--out", str(tmp_path / "again"), "--samples-per-shard", "5")
    assert code == 0 and [s["txt"] for s in samples(tmp_path / "again")] == [sample["txt"]]
