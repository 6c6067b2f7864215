"""Download a list of image URLs + captions (the LAION shape) into sdtrain shards, through img2dataset.

``prepare_urls`` validates the list (parquet, csv or tsv with a url and a caption column), hands it to
img2dataset's ``download()`` (resize, retries, threads, per-shard stats), then writes sdtrain's
``manifest.json`` over the finished tars. Failed URLs (404, timeouts, not an image, too small, ...) are
counted per reason, never fatal.

Output folder layout (img2dataset's): ``00000.tar`` holding ``{key}.jpg``, ``{key}.txt`` and ``{key}.json``
(the list's extra columns plus ``width``/``height`` of the saved image, ``original_width``/``original_height``,
``url``, ``caption``, ``sha256``), beside ``00000.parquet`` (one row per URL, failures included) and
``00000_stats.json``. A shard is finished once its ``_stats.json`` exists, so an interrupted run is resumed by
running the same command again: img2dataset's incremental mode downloads only the unfinished shards. URLs
that failed in a finished shard are not retried by a rerun.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import tarfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from sdtrain.data.prepare import DEFAULT_MAX_PIXELS
from sdtrain.data.shards import MANIFEST_NAME, ShardInfo, count_tar_samples, sha256_file, write_manifest
from sdtrain.errors import UserError, first_line
from sdtrain.utils import atomic_write_text

log = logging.getLogger(__name__)

RESIZE_MODES = ("no", "border", "keep_ratio", "keep_ratio_largest", "center_crop")
# Columns img2dataset writes itself; it refuses them in save_additional_columns.
RESERVED_COLUMNS = frozenset(
    {
        "key", "caption", "url", "width", "height", "original_width", "original_height",
        "status", "error_message", "exif", "md5", "sha256", "sha512",
    }
)  # fmt: skip
# img2dataset names shards with 5 digits (its oom_shard_count default).
_SHARD_DIGITS = 5
_OPENCV_PIXEL_LIMIT = "OPENCV_IO_MAX_IMAGE_PIXELS"
_STATS_RE = re.compile(r"^(\d+)_stats\.json$")
# Written at the start of a run; a rerun with other settings would mix two datasets in one folder. Not *.json:
# img2dataset parses every *.json in the output folder as "{shard}_stats.json".
PARAMS_NAME = ".sdtrain-urls-params"
_INSTALL_HINT = "prepare urls needs img2dataset: pip install 'sdtrain[urls]'"


def _input_format(path: Path) -> str:
    name = path.name.lower()
    for fmt in ("parquet", "csv", "tsv", "csv.gz", "tsv.gz"):
        if name.endswith("." + fmt):
            return fmt
    raise UserError(f"{path}: unknown list format; use a .parquet, .csv or .tsv file (optionally .csv.gz/.tsv.gz)")


def _read_list_info(path: Path, fmt: str, url_col: str) -> tuple[list[str], int]:
    """Column names and row count of the list, read the way img2dataset will read it (pyarrow)."""
    try:  # pyarrow comes with img2dataset, not with sdtrain
        import pyarrow as pa
        import pyarrow.csv as pa_csv
        import pyarrow.parquet as pq
    except ImportError as e:
        raise UserError(_INSTALL_HINT) from e

    try:
        if fmt == "parquet":
            pf = pq.ParquetFile(path)
            return list(pf.schema_arrow.names), pf.metadata.num_rows
        parse = pa_csv.ParseOptions(delimiter="\t" if fmt.startswith("tsv") else ",")
        columns = list(pa_csv.open_csv(path, parse_options=parse).schema.names)
        if url_col not in columns:
            return columns, 0
        only_urls = pa_csv.ConvertOptions(include_columns=[url_col])
        table = pa_csv.read_csv(path, parse_options=parse, convert_options=only_urls)
        return columns, table.num_rows
    except (pa.ArrowException, OSError, ValueError) as e:
        what = "parquet" if fmt == "parquet" else fmt.split(".")[0].upper()
        raise UserError(f"{path}: not a readable {what} file ({first_line(e)}); check the file or its extension") from e


def _check_columns(
    path: Path, fmt: str, columns: list[str], url_col: str, caption_col: str, extra_columns: list[str] | None
) -> list[str]:
    """Validate the url/caption/extra columns; return the extra columns to keep in each sample's json."""
    listed = ", ".join(columns)

    def missing(col: str, flag: str) -> UserError:
        guess = next((c for c in columns if c.lower() in _GUESSES[flag]), None)
        fix = f"pass {flag} {guess}" if guess else f"pass {flag} NAME"
        return UserError(f"{path.name}: no column '{col}'; columns are {listed}; {fix}")

    if url_col not in columns:
        raise missing(url_col, "--url-col")
    if caption_col not in columns:
        raise missing(caption_col, "--caption-col")
    if url_col == caption_col:
        raise UserError(f"{path.name}: url and caption columns are both '{url_col}'; pass a different --caption-col")
    # img2dataset renames the chosen columns to 'url' and 'caption'; a csv/tsv is read whole, so another column
    # already named so would collide with the renamed one.
    if not fmt.startswith("parquet"):
        for chosen, target in ((url_col, "url"), (caption_col, "caption")):
            if chosen != target and target in columns:
                raise UserError(
                    f"{path.name}: has both '{chosen}' and '{target}' columns, and '{chosen}' would be renamed to "
                    f"'{target}'; drop or rename the '{target}' column (or pass it as the column to use)"
                )
    if extra_columns is None:
        return [c for c in columns if c not in (url_col, caption_col) and c not in RESERVED_COLUMNS]
    for c in extra_columns:
        if c not in columns:
            raise UserError(f"{path.name}: extra column '{c}' does not exist; columns are {listed}")
        if c in RESERVED_COLUMNS or c in (url_col, caption_col):
            raise UserError(
                f"{path.name}: extra column '{c}' clashes with a field img2dataset writes itself "
                f"({', '.join(sorted(RESERVED_COLUMNS))}); leave it out of the extra columns"
            )
    return list(dict.fromkeys(extra_columns))


_GUESSES = {
    "--url-col": {"url", "link", "image_url", "img_url"},
    "--caption-col": {"caption", "text", "txt", "alt", "alt_text", "title", "prompt"},
}


def failure_reason(message: str) -> str:
    """Group one of img2dataset's error strings (``status_dict`` keys) into a short readable reason."""
    m = message.strip()
    low = m.lower()
    http = re.match(r"http error (\d{3})", low)
    if http:
        return f"http {http.group(1)}"
    if "timed out" in low or "timeout" in low:
        return "timeout"
    if "image decoding error" in low or "cannot identify image" in low or "imdecode" in low:
        return "not an image / decode error"
    if "image too small" in low:
        return "too small"
    if "aspect ratio too large" in low:
        return "aspect ratio too large"
    if "image area too large" in low or "cv_io_max_image_pixels" in low:
        return "over the pixel limit"
    if "x-robots-tag" in low:
        return "disallowed by X-Robots-Tag"
    if "hash mismatch" in low:
        return "hash mismatch"
    if (
        "urlopen error" in low
        or "connection" in low
        or "name or service not known" in low
        or "temporary failure in name resolution" in low
        or "remote end closed" in low
        or "network is unreachable" in low
        or "no route to host" in low
    ):
        return "connection error"
    if "unknown url type" in low or "no host given" in low:
        return "bad url"
    return "other"


def _shard_name(shard_id: int) -> str:
    return f"{shard_id:0{_SHARD_DIGITS}d}"


def _read_stats(out: Path) -> dict[int, dict]:
    """Finished shards: id -> parsed ``_stats.json``; unreadable stats files are treated as unfinished."""
    stats = {}
    for p in sorted(out.iterdir()):
        m = _STATS_RE.match(p.name)
        if not m:
            continue
        try:
            s = json.loads(p.read_text(encoding="utf-8"))
            if not isinstance(s, dict) or not isinstance(s.get("status_dict"), dict):
                raise ValueError("unexpected content")
        except (OSError, ValueError):
            continue
        stats[int(m.group(1))] = s
    return stats


def _drop_unfinished(out: Path) -> None:
    """Remove stats files img2dataset would take as 'done' but that aren't usable, so their shards are redone.

    img2dataset writes a shard's tar first, then its stats (not atomically): a stats file that does not parse
    or has no tar beside it means the shard was cut short.
    """
    good = _read_stats(out)
    for p in out.iterdir():
        m = _STATS_RE.match(p.name)
        if m and (int(m.group(1)) not in good or not (out / f"{_shard_name(int(m.group(1)))}.tar").is_file()):
            log.warning("%s: unfinished shard, it will be downloaded again", p)
            p.unlink()


def _check_params(out: Path, params: dict[str, Any]) -> None:
    """Refuse to mix runs with different settings (or foreign files) in one output folder; then record ours."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a folder; pass a folder for --out")
    ppath = out / PARAMS_NAME
    if ppath.is_file():
        try:
            old = json.loads(ppath.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            old = {}
        changed = [k for k in params if old.get(k) != params[k]]
        if changed:
            what = ", ".join(f"{k} {old.get(k)!r} -> {params[k]!r}" for k in changed)
            raise UserError(
                f"{out}: holds a download made with other settings ({what}); "
                f"use another --out, or delete {out} to start over"
            )
        return
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out}: folder is not empty and was not made by `sdtrain prepare urls`; use an empty --out")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(ppath, json.dumps(params, indent=1) + "\n")


def _import_img2dataset():
    # albumentations (imported by img2dataset) asks PyPI for a newer version at import unless told not to; the
    # spawned download workers inherit this environment. Nothing but the listed URLs may be fetched.
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    try:
        import img2dataset
    except ImportError as e:
        if e.name in (None, "img2dataset"):
            raise UserError(_INSTALL_HINT) from e
        # Installed but broken, e.g. a missing dependency, or Python >= 3.13 without the imghdr module it uses.
        raise UserError(f"{_INSTALL_HINT} (img2dataset is installed but its import failed: {e})") from e
    return img2dataset


def prepare_urls(
    url_list: Path,
    out: Path,
    *,
    url_col: str = "url",
    caption_col: str = "caption",
    image_size: int = 512,
    resize_mode: str = "keep_ratio",
    min_image_size: int = 0,
    max_aspect_ratio: float | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    processes: int = 2,
    threads: int = 8,
    retries: int = 2,
    timeout: float = 10,
    samples_per_shard: int = 1000,
    extra_columns: list[str] | None = None,
) -> dict:
    """Download the images of a URL + caption list into WebDataset shards with a sdtrain ``manifest.json``.

    ``url_list`` is a .parquet, .csv or .tsv file with at least ``url_col`` and ``caption_col``. Images are
    re-encoded as jpg and resized by img2dataset: ``keep_ratio`` makes the shorter side ``image_size``,
    ``center_crop`` then crops to a square, ``border`` pads the longer side's resize to a white square,
    ``keep_ratio_largest`` makes the longer side ``image_size``, ``no`` keeps the size. Images whose shorter side
    is below ``min_image_size`` or whose aspect ratio exceeds ``max_aspect_ratio`` are dropped, and so are
    images of more than ``max_pixels`` pixels, which OpenCV refuses from their header before decoding them.
    ``extra_columns`` are copied into each sample's json (default: every other column of the list except the
    names img2dataset writes itself, such as the list's own ``width``/``height``).

    Rerunning with the same arguments finishes an interrupted download (only unfinished shards are fetched)
    and rewrites the manifest. Returns a summary: ``total`` URLs, ``succeeded``, ``failed``,
    ``failed_by_reason`` ({"http 404": n, "timeout": n, ...}), ``errors`` (the most frequent raw messages),
    ``shards`` (in the manifest), ``incomplete_shards`` and ``manifest`` (its path).

    img2dataset runs its workers as *spawned* processes, which re-import the caller's ``__main__``: a script that
    calls this needs an ``if __name__ == "__main__":`` guard. Ctrl-C raises KeyboardInterrupt (img2dataset's own
    handler would exit with status 0); finished shards stay and a rerun continues from them.
    """
    url_list, out = Path(url_list), Path(out)
    if not url_list.is_file():
        raise UserError(f"{url_list}: no such file; pass the path of a .parquet or .csv list of URLs")
    fmt = _input_format(url_list)
    if resize_mode not in RESIZE_MODES:
        raise UserError(f"resize mode '{resize_mode}' is not one of {', '.join(RESIZE_MODES)}")
    for name, value, low in (
        ("image_size", image_size, 1),
        ("samples_per_shard", samples_per_shard, 1),
        ("processes", processes, 1),
        ("threads", threads, 1),
        ("retries", retries, 0),
        ("min_image_size", min_image_size, 0),
        ("max_pixels", max_pixels, 1),
    ):
        if not isinstance(value, int) or value < low:
            raise UserError(f"{name} must be an integer >= {low}, got {value!r}")
    if not timeout > 0:
        raise UserError(f"timeout must be > 0 seconds, got {timeout!r}")
    if max_aspect_ratio is not None and not max_aspect_ratio >= 1:
        raise UserError(f"max_aspect_ratio must be >= 1, got {max_aspect_ratio!r}")

    columns, rows = _read_list_info(url_list, fmt, url_col)
    extras = _check_columns(url_list, fmt, columns, url_col, caption_col, extra_columns)
    if rows == 0:
        raise UserError(f"{url_list}: the list has no rows; nothing to download")
    img2dataset = _import_img2dataset()

    params = {
        "source": str(url_list.resolve()),
        "url_col": url_col,
        "caption_col": caption_col,
        "image_size": image_size,
        "resize_mode": resize_mode,
        "min_image_size": min_image_size,
        "max_aspect_ratio": max_aspect_ratio,
        "max_pixels": max_pixels,
        "samples_per_shard": samples_per_shard,
        "extra_columns": extras,
    }
    _check_params(out, params)
    # The old manifest describes the shards of an earlier run that may be about to change; img2dataset would
    # also parse it as a shard's stats (it reads every *.json in the folder). Written afresh at the end.
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    _drop_unfinished(out)

    n_shards = math.ceil(rows / samples_per_shard)
    before = _read_stats(out)
    start = time.monotonic()
    if all(i in before for i in range(n_shards)):
        log.info("%s: all %d shards already downloaded", out, n_shards)
    else:
        previous_sigint = signal.getsignal(signal.SIGINT)
        # img2dataset decodes with OpenCV, which checks this limit against the header before allocating; the
        # spawned download workers inherit it. Its own max_image_area is only checked after decoding.
        previous_limit = os.environ.get(_OPENCV_PIXEL_LIMIT)
        os.environ[_OPENCV_PIXEL_LIMIT] = str(max_pixels)
        try:
            img2dataset.download(
                url_list=str(url_list),
                output_folder=str(out),
                input_format=fmt,
                output_format="webdataset",
                url_col=url_col,
                caption_col=caption_col,
                save_additional_columns=extras or None,
                image_size=image_size,
                resize_mode=resize_mode,
                min_image_size=min_image_size,
                max_aspect_ratio=float("inf") if max_aspect_ratio is None else float(max_aspect_ratio),
                max_image_area=float(max_pixels),
                encode_format="jpg",
                processes_count=processes,
                thread_count=threads,
                retries=retries,
                timeout=timeout,
                number_sample_per_shard=samples_per_shard,
                oom_shard_count=_SHARD_DIGITS,
                distributor="multiprocessing",
                incremental_mode="incremental",
                enable_wandb=False,
            )
        except SystemExit as e:
            # img2dataset's SIGINT handler deletes its temp folder and calls sys.exit(0): an interrupt, not success.
            raise KeyboardInterrupt(f"download interrupted; rerun the same command to finish {out}") from e
        finally:
            signal.signal(signal.SIGINT, previous_sigint)
            if previous_limit is None:
                os.environ.pop(_OPENCV_PIXEL_LIMIT, None)
            else:
                os.environ[_OPENCV_PIXEL_LIMIT] = previous_limit
    elapsed = time.monotonic() - start

    stats = _read_stats(out)
    reasons: Counter[str] = Counter()
    raw: Counter[str] = Counter()
    shards: list[ShardInfo] = []
    attempted = succeeded = 0
    for shard_id in sorted(stats):
        tar = out / f"{_shard_name(shard_id)}.tar"
        try:
            samples = count_tar_samples(tar)
        except (tarfile.TarError, OSError) as e:
            # Finished by img2dataset's account but unreadable: drop its stats so a rerun downloads it again.
            log.warning("%s: unreadable shard (%s); rerun the same command to download it again", tar, e)
            (out / f"{_shard_name(shard_id)}_stats.json").unlink(missing_ok=True)
            del stats[shard_id]
            continue
        if samples > 0:  # a shard whose URLs all failed is an empty tar: leave it out
            shards.append(ShardInfo(tar.name, samples, sha256_file(tar)))
        s = stats[shard_id]
        attempted += int(s.get("count", 0))
        succeeded += int(s.get("successes", 0))
        for message, n in s["status_dict"].items():
            if message != "success":
                raw[message] += int(n)
                reasons[failure_reason(message)] += int(n)
    incomplete = [i for i in range(n_shards) if i not in stats]
    new_successes = sum(int(s.get("successes", 0)) for i, s in stats.items() if i not in before)
    summary: dict[str, Any] = {
        "total": rows,
        "attempted": attempted,
        "succeeded": succeeded,
        "failed": attempted - succeeded,
        "failed_by_reason": dict(reasons.most_common()),
        "errors": dict(raw.most_common(10)),
        "shards": len(shards),
        "samples": sum(s.samples for s in shards),
        "incomplete_shards": [f"{_shard_name(i)}.tar" for i in incomplete],
        "seconds": round(elapsed, 2),
        "images_per_second": round(new_successes / elapsed, 2) if elapsed > 0 and new_successes else None,
    }
    extra = {
        "source": str(url_list),
        "made_by": "sdtrain prepare urls (img2dataset)",
        "img2dataset_version": getattr(img2dataset, "__version__", None) or _dist_version("img2dataset"),
        "image_size": image_size,
        "resize_mode": resize_mode,
        "min_image_size": min_image_size,
        "max_aspect_ratio": max_aspect_ratio,
        "urls": {k: summary[k] for k in ("total", "attempted", "succeeded", "failed", "failed_by_reason")},
    }
    manifest = write_manifest(out, shards, extra)
    summary["manifest"] = str(manifest)
    if incomplete:
        log.warning(
            "%s: %d of %d shards did not finish (%s); rerun the same command to retry them",
            out, len(incomplete), n_shards, ", ".join(summary["incomplete_shards"][:5]),
        )  # fmt: skip
    log.info(
        "%s: %d of %d images downloaded, %d failed %s",
        out, succeeded, rows, attempted - succeeded, summary["failed_by_reason"],
    )  # fmt: skip
    return summary


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None
