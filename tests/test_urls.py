"""prepare_urls: a URL + caption list downloaded through the real img2dataset from a local HTTP server."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

# albumentations (imported by img2dataset) asks PyPI for its latest version at import unless told not to.
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
pytest.importorskip("img2dataset")

import pyarrow as pa  # noqa: E402  (after the skip: pyarrow comes with img2dataset)
import pyarrow.csv as pa_csv  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import webdataset as wds  # noqa: E402
from PIL import Image  # noqa: E402

from sdtrain.cli.main import main  # noqa: E402
from sdtrain.data.shards import read_manifest, sha256_file  # noqa: E402
from sdtrain.data.urls import failure_reason, prepare_urls  # noqa: E402
from sdtrain.errors import UserError  # noqa: E402

IMAGE_SIZE = 40
MIN_IMAGE_SIZE = 24
# Served good images: name -> (width, height). "big" is larger than IMAGE_SIZE, so it is downscaled.
GOOD = {"a": (48, 64), "b": (64, 48), "c": (80, 80), "d": (56, 72), "big": (200, 150)}


def _png(size: tuple[int, int], color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


class _Handler(BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, str, bytes]] = {}

    def do_GET(self):  # noqa: N802
        status, ctype, body = self.routes.get(self.path, (404, "text/plain", b"not found"))
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    colors = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30), (30, 200, 200)]
    routes = {f"/{name}.png": (200, "image/png", _png(size, colors[i])) for i, (name, size) in enumerate(GOOD.items())}
    routes["/tiny.png"] = (200, "image/png", _png((12, 12), (0, 0, 0)))
    routes["/page.png"] = (200, "text/html", b"<html><body>not an image</body></html>")
    _Handler.routes = routes
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(base: str) -> list[dict]:
    """Rows in list order; with 4 samples per shard the third shard holds only failures."""
    names = ["a", "b", "missing", "c", "page", "d", "tiny", "big", "missing2", "refused"]
    rows = []
    for i, name in enumerate(names):
        url = f"http://127.0.0.1:{_closed_port()}/x.png" if name == "refused" else f"{base}/{name}.png"
        rows.append(
            {"url": url, "TEXT": f"caption of {name}", "width": 1, "height": 1, "pwatermark": i / 10, "punsafe": 0.5}
        )
    return rows


def _write_list(rows: list[dict], path: Path) -> Path:
    table = pa.Table.from_pylist(rows)
    if path.suffix == ".parquet":
        pq.write_table(table, path)
    else:
        pa_csv.write_csv(table, path)
    return path


def _read_shards(out: Path, manifest: dict) -> list[dict]:
    urls = [str(out / s["name"]) for s in manifest["shards"]]
    return list(wds.WebDataset(urls, shardshuffle=False).decode("pil"))


def _run(lst: Path, out: Path, mode: str) -> dict:
    return prepare_urls(
        lst,
        out,
        caption_col="TEXT",
        image_size=IMAGE_SIZE,
        resize_mode=mode,
        min_image_size=MIN_IMAGE_SIZE,
        processes=1,
        threads=4,
        retries=0,
        timeout=5,
        samples_per_shard=4,
    )


@pytest.fixture(scope="module", params=[("parquet", "center_crop"), ("csv", "keep_ratio")], ids=lambda p: "-".join(p))
def downloaded(request, server, tmp_path_factory):
    """One real download per list format, shared by the tests that only read its output."""
    fmt, mode = request.param
    tmp = tmp_path_factory.mktemp(fmt)
    rows = _rows(server)
    lst = _write_list(rows, tmp / f"urls.{fmt}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # the spawned download workers inherit it
        if fmt == "csv":  # through the command line, as a user runs it
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                assert main(["prepare", "urls", str(lst), "--out", str(tmp / "out"), "--caption-col", "TEXT",
                             "--image-size", str(IMAGE_SIZE), "--resize-mode", mode, "--min-image-size",
                             str(MIN_IMAGE_SIZE), "--processes", "1", "--threads", "4",
                             "--samples-per-shard", "4"]) == 0
            assert f"downloaded {len(GOOD)} of {len(rows)} images" in printed.getvalue()
            assert "failed (http 404): 2" in printed.getvalue()
            summary = _run(lst, tmp / "out", mode)  # a rerun of a finished download: the same summary
        else:
            summary = _run(lst, tmp / "out", mode)
    return fmt, mode, rows, lst, tmp / "out", summary


def test_prepare_urls_downloads_and_counts_failures(downloaded):
    fmt, mode, rows, lst, out, summary = downloaded
    json.dumps(summary)  # the CLI prints it

    assert summary["total"] == len(rows) == summary["attempted"]
    assert summary["succeeded"] == len(GOOD)
    assert summary["failed"] == len(rows) - len(GOOD)
    assert summary["failed_by_reason"] == {
        "http 404": 2,
        "not an image / decode error": 1,
        "too small": 1,
        "connection error": 1,
    }
    assert summary["incomplete_shards"] == []

    manifest = read_manifest(out)
    assert manifest is not None and summary["manifest"] == str(out / "manifest.json")
    # The third shard (rows 8-9) failed entirely: its empty tar stays out of the manifest.
    assert [s["name"] for s in manifest["shards"]] == ["00000.tar", "00001.tar"]
    assert (out / "00002.tar").is_file()
    assert manifest["total"] == len(GOOD) == summary["samples"]
    for s in manifest["shards"]:
        assert s["sha256"] == sha256_file(out / s["name"])
    assert manifest["image_size"] == IMAGE_SIZE and manifest["resize_mode"] == mode
    assert manifest["source"] == str(lst)
    assert manifest["urls"]["succeeded"] == len(GOOD) and manifest["urls"]["failed_by_reason"]["http 404"] == 2

    samples = _read_shards(out, manifest)
    assert len(samples) == len(GOOD)
    assert sum(s["samples"] for s in manifest["shards"]) == len(samples)
    by_url = {r["url"]: r for r in rows}
    seen = set()
    for sample in samples:
        meta = sample["json"]
        name = meta["url"].rsplit("/", 1)[-1].removesuffix(".png")
        seen.add(name)
        assert sample["txt"] == f"caption of {name}" == meta["caption"]
        assert meta["pwatermark"] == pytest.approx(by_url[meta["url"]]["pwatermark"])
        assert meta["punsafe"] == pytest.approx(0.5)
        img = sample["jpg"]
        ow, oh = GOOD[name]
        assert (meta["original_width"], meta["original_height"]) == (ow, oh)
        assert (meta["width"], meta["height"]) == img.size
        if mode == "center_crop":
            assert img.size == (IMAGE_SIZE, IMAGE_SIZE)
        else:  # keep_ratio: the shorter side becomes IMAGE_SIZE, the aspect ratio stays
            assert min(img.size) == IMAGE_SIZE
            assert img.size[0] / img.size[1] == pytest.approx(ow / oh, rel=0.05)
    assert seen == set(GOOD)

    # sdtrain's training data stream takes the folder as it is.
    from sdtrain.data.order import resolve_shards

    assert [(Path(s.url).name, s.samples) for s in resolve_shards(str(out))] == [
        (s["name"], s["samples"]) for s in manifest["shards"]
    ]


def test_rerun_finishes_missing_shards_without_duplicates(downloaded, tmp_path):
    fmt, mode, rows, lst, done, first = downloaded
    out = tmp_path / "out"
    shutil.copytree(done, out)
    names = sorted(p.name for p in out.iterdir())
    shard0 = (out / "00000.tar").read_bytes()

    # A rerun of a finished download does nothing new and rewrites the same manifest.
    again = _run(lst, out, mode)
    assert sorted(p.name for p in out.iterdir()) == names
    assert {k: again[k] for k in ("succeeded", "failed_by_reason", "samples")} == {
        k: first[k] for k in ("succeeded", "failed_by_reason", "samples")
    }

    # Interrupted in the middle of shard 1: a truncated tar and no stats; the manifest is gone too.
    (out / "00001_stats.json").unlink()
    (out / "00001.tar").write_bytes((out / "00001.tar").read_bytes()[:700])
    (out / "manifest.json").unlink()
    resumed = _run(lst, out, mode)
    assert sorted(p.name for p in out.iterdir()) == names
    assert (out / "00000.tar").read_bytes() == shard0  # finished shards are not downloaded again
    assert resumed["succeeded"] == first["succeeded"] and resumed["failed_by_reason"] == first["failed_by_reason"]
    manifest = read_manifest(out)
    assert manifest is not None and manifest["total"] == len(GOOD)
    for s in manifest["shards"]:
        assert s["sha256"] == sha256_file(out / s["name"])
    assert len(_read_shards(out, manifest)) == len(GOOD)

    # Other settings in the same folder would mix two datasets.
    with pytest.raises(UserError, match="image_size 40 -> 64"):
        prepare_urls(lst, out, caption_col="TEXT", image_size=64, resize_mode="center_crop",
                     min_image_size=MIN_IMAGE_SIZE, samples_per_shard=4)  # fmt: skip


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_missing_caption_column_is_one_line_user_error(tmp_path, suffix):
    lst = _write_list([{"url": "http://127.0.0.1:9/a.png", "TEXT": "x"}], tmp_path / f"urls{suffix}")
    with pytest.raises(UserError) as exc:
        prepare_urls(lst, tmp_path / "out")
    msg = str(exc.value)
    assert msg == f"urls{suffix}: no column 'caption'; columns are url, TEXT; pass --caption-col TEXT"
    assert "\n" not in msg
    assert not (tmp_path / "out").exists()


def test_list_errors(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        prepare_urls(tmp_path / "nope.parquet", tmp_path / "out")
    bad = tmp_path / "urls.parquet"
    bad.write_text("url,caption\nhttp://x/a.png,hi\n")
    with pytest.raises(UserError, match=r"urls.parquet: not a readable parquet file"):
        prepare_urls(bad, tmp_path / "out")
    lst = _write_list([{"url": "http://127.0.0.1:9/a.png", "caption": "x", "key": "k"}], tmp_path / "urls.csv")
    with pytest.raises(UserError, match="extra column 'nope' does not exist"):
        prepare_urls(lst, tmp_path / "out", extra_columns=["nope"])
    with pytest.raises(UserError, match="extra column 'key' clashes"):
        prepare_urls(lst, tmp_path / "out", extra_columns=["key"])
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text("{}")
    with pytest.raises(UserError, match="not made by `sdtrain prepare urls`"):
        prepare_urls(lst, other)
    assert (other / "manifest.json").exists()
    assert not os.path.exists(tmp_path / "out")


def test_missing_img2dataset_is_user_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "img2dataset", None)  # makes `import img2dataset` fail
    lst = _write_list([{"url": "http://127.0.0.1:9/a.png", "caption": "x"}], tmp_path / "urls.csv")
    with pytest.raises(UserError) as exc:
        prepare_urls(lst, tmp_path / "out")
    assert str(exc.value) == "prepare urls needs img2dataset: pip install 'sdtrain[urls]'"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "message, reason",
    [
        ("HTTP Error 404: Not Found", "http 404"),
        ("HTTP Error 503: Service Unavailable", "http 503"),
        ("timed out", "timeout"),
        ("<urlopen error timed out>", "timeout"),
        ("The read operation timed out", "timeout"),
        ("Image decoding error", "not an image / decode error"),
        ("image too small", "too small"),
        ("aspect ratio too large", "aspect ratio too large"),
        ("<urlopen error [Errno 111] Connection refused>", "connection error"),
        ("<urlopen error [Errno -2] Name or service not known>", "connection error"),
        ("Remote end closed connection without response", "connection error"),
        ("Use of image disallowed by X-Robots-Tag directive", "disallowed by X-Robots-Tag"),
        ("something else entirely", "other"),
    ],
)
def test_failure_reason(message, reason):
    assert failure_reason(message) == reason



def test_images_over_the_pixel_limit_are_refused(server, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rows = [{"url": f"{server}/{name}.png", "TEXT": f"caption of {name}"} for name in ("a", "big", "c")]
    lst = _write_list(rows, tmp_path / "urls.parquet")
    # 200 x 150 = 30,000 pixels: over the limit; a (48 x 64) and c (80 x 80) are under it.
    summary = prepare_urls(lst, tmp_path / "out", caption_col="TEXT", image_size=IMAGE_SIZE, max_pixels=10_000,
                           processes=1, threads=2, retries=0, timeout=5, samples_per_shard=4)
    assert summary["succeeded"] == 2 and summary["failed"] == 1, summary
    assert summary["failed_by_reason"] == {"over the pixel limit": 1}
    assert "OPENCV_IO_MAX_IMAGE_PIXELS" not in os.environ
