"""Turning image and video folders and foreign shards into checked, evenly sized sdtrain shards.

``prepare_folder`` reads a folder of images and videos with captions beside them (``a.jpg`` + ``a.txt``), or a
``metadata.jsonl`` / ``metadata.csv`` at its root (Hugging Face imagefolder style: ``file_name`` relative to
the folder, a ``text`` or ``caption`` column, any other columns). ``reshard`` re-tars existing WebDataset
shards (img2dataset output, say) into shards of an even size. For images, both

- keep the image bytes as they are (the tar member is named after the format PIL detects: jpg, png, webp, gif, tif),
- check every image: the size is read from the header and images over ``max_pixels`` are rejected before
  anything is decoded; the rest is decoded fully, and files PIL can't read are skipped,
- skip samples without a caption (or keep them with ``""``), duplicate keys (the first one written wins),
  samples rejected by the filters (``sdtrain.data.filters``) and repeats of a kept sample (``sdtrain.data.dedup``: its
  image and the images beside it alike), counting every skip by reason and naming the first repeats beside the
  samples they repeat, in the report and the manifest's ``duplicates``,
- write through ``ShardWriter`` (temporary names, renamed when complete) and finish by deleting shards of an
  earlier run that this run did not write, then writing the manifest. An interrupted run leaves no manifest;
  running it again redoes the work and ends with a folder whose manifest lists exactly the shards in it.

Sample keys in ``prepare_folder`` come from the relative path without its extension (``sub/a.jpg`` ->
``sub/a``); characters other than letters, digits, ``_``, ``-`` and ``/`` become ``_`` and such keys get a
short hash of the original path appended, so keys stay unique, free of dots and the same on every run.
Inputs are read in sorted order of their relative paths.

Videos (``.mp4``, ``.mov``, ``.webm``, ``.mkv``) are decoded, resampled and cut into windows of frames by a
``FrameRule`` (see ``sdtrain.data.video``, which also says how a window is stored): each window is a sample of its
own, keyed ``sub/a`` under the ``head`` rule and ``sub/a_w000``, ``sub/a_w001``... under rules that may give several.
A video's frame size is checked against ``max_pixels`` from its header before anything is decoded; one that does not
decode, broke off, has no video stream or is shorter than one window is skipped, counted and named in the report;
one damaged part-way keeps the windows cut before the damage (and is named too).
The exact-bytes dedup compares video files as it does images (the perceptual one, their first frames; a mask beside
a video is not part of what it compares); the filters see a video's upright width and height. Conditioning and source
images beside a video are not read.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import hashlib
import io
import json
import logging
import os
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from PIL import Image

from sdtrain.data.conditioning import canny_map
from sdtrain.data.conditioning import require as require_conditioning
from sdtrain.data.dedup import Duplicates
from sdtrain.data.encoded import CONDITIONING_IMAGE, MASK_IMAGE, SOURCE_IMAGE
from sdtrain.data.filters import Filters
from sdtrain.data.images import describe, rgb_image
from sdtrain.data.remote import is_remote
from sdtrain.data.shards import MANIFEST_NAME, ShardInfo, ShardWriter, tar_samples, write_manifest
from sdtrain.data.sources import expand_spec
from sdtrain.data.video import (
    CLIP_FIELD,
    VIDEO_EXTENSIONS,
    ClipSkipped,
    FrameRule,
    VideoFile,
    Window,
    clip_size,
    json_number,
)
from sdtrain.errors import UserError, first_line

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".tif", ".tiff")
IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp", "gif", "tif", "tiff")
# PIL's format name -> tar member extension. Camera JPEGs often open as MPO (JPEG with extra frames).
FORMAT_EXTENSIONS = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "TIFF": "tif"}
# PIL's own DecompressionBombWarning threshold (Image.MAX_IMAGE_PIXELS): about 9459 x 9459.
DEFAULT_MAX_PIXELS = 89_478_485
MISSING_CAPTION = ("skip", "empty")
METADATA_FILES = ("metadata.jsonl", "metadata.csv")
CAPTION_COLUMNS = ("text", "caption")
MASK_SUFFIX = ".mask.png"
"""A loss mask beside its image (``photo.mask.png`` for ``photo.jpg``): white counts, black does not."""
COMPANIONS = {MASK_SUFFIX: (MASK_IMAGE, "mask", "mask_size"),
              ".cond.png": (CONDITIONING_IMAGE, "conditioning image", "cond_size"),
              ".src.png": (SOURCE_IMAGE, "source image", "src_size")}
"""The images that may stand beside a sample's image (``photo.cond.png`` for ``photo.jpg``), by suffix: the field
the shard keeps each in, what it is, and the skip reason when it is not the image's size."""
COMPANION_FIELDS = tuple(field for field, _, _ in COMPANIONS.values())
Beside = Callable[[tuple[int, int]], dict[str, bytes] | None]
"""What gives a sample's other images (by field) once its image's upright size is known; see `_Job.image`."""
SHARD_PREFIX = "shard"
PROGRESS_EVERY = 10_000

SKIP_REASONS = {
    "corrupt": "corrupt, empty or truncated image",
    "format": "not a JPEG, PNG, WebP, GIF or TIFF image",
    "too_large": "image over the pixel limit",
    "no_image": "sample without an image",
    "no_file": "image file listed in the metadata not found",
    "no_caption": "missing or empty caption",
    "caption_not_text": "caption file that is not text",
    "mask_size": "mask of another size than its image",
    "cond_size": "conditioning image of another size than its image",
    "src_size": "source image of another size than its image",
    "duplicate": "duplicate key",
    "duplicate_image": "image with the same bytes as an earlier one",
    "near_duplicate": "image nearly the same as an earlier one (--dedup perceptual)",
    "video_unreadable": "video the decoder cannot read: corrupt, truncated or not a video",
    "video_truncated": "video that ends before the length its file declares (cut short)",
    "no_video": "file without a video stream",
    "video_too_large": "video frames over the pixel limit",
    "too_short": "video shorter than one window (--frames at --fps)",
    "video_damaged": "video damaged or cut short part-way, the windows before the damage kept",
    "duplicate_video": "video with the same bytes as an earlier one",
    "near_duplicate_video": "video whose first frame nearly repeats an earlier one's (--dedup perceptual)",
}
VIDEO_DUPLICATES = {"duplicate_image": "duplicate_video", "near_duplicate": "near_duplicate_video"}
"""The dedup's reasons, as a video's."""
NAMED_AT_MOST = 10
"""Skipped videos the report names per reason (each is also logged)."""
REPEATS_NAMED = 2
"""Duplicates the report and the manifest name per reason, each beside the kept sample it repeats: a pair or two
show what the dedup matched, and a long list of them would bury the rest of the summary."""
CLIP_KEY = "{key}_w{index:03d}"
"""The key of a window of a video under a rule that may give several."""

_KEY_BAD = re.compile(r"[^A-Za-z0-9_\-/]")
_OUR_SHARD = re.compile(rf"^{SHARD_PREFIX}-\d{{6}}\.tar$")
# A shard's temporary name, or the manifest's (per-process, see utils.atomic_write_bytes).
_OUR_TEMP = re.compile(rf"^\.({SHARD_PREFIX}-\d{{6}}\.tar\.tmp|{re.escape(MANIFEST_NAME)}\.tmp-\d+)$")


def sample_key(name: str) -> str:
    """A WebDataset key for a relative path without extension: stable, unique and free of dots."""
    name = name.replace("\\", "/")
    clean = _KEY_BAD.sub("_", name)
    if clean != name:
        clean += "_" + hashlib.sha1(name.encode("utf-8", "surrogateescape")).hexdigest()[:10]
    return clean


@dataclass
class Report:
    """What a prepare run did: the shards written and every skipped sample counted by reason."""

    out_dir: Path
    shards: list[ShardInfo]
    max_pixels: int
    filters: Filters
    skipped: Counter = field(default_factory=Counter)
    filtered: Counter = field(default_factory=Counter)
    read_errors: list[str] = field(default_factory=list)
    named: dict[str, list[str]] = field(default_factory=dict)
    """The videos skipped, by reason."""
    repeats: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    """The first duplicates dropped, by reason: each one's name and the name of the kept sample it repeats."""
    frame_rule: FrameRule | None = None
    videos: int = 0
    """Videos cut into windows."""
    windows: int = 0

    @property
    def written(self) -> int:
        return sum(s.samples for s in self.shards)

    def filtered_in_order(self) -> list[tuple[str, int]]:
        """Filter counts in the filters' order, a filter's own rejections before its missing/non-numeric ones."""
        names = self.filters.names

        def order(reason: str) -> tuple[int, bool, str]:
            name = reason.split(": ", 1)[0]
            return (names.index(name) if name in names else len(names), name != reason, reason)

        return sorted(self.filtered.items(), key=lambda item: order(item[0]))

    def lines(self) -> list[str]:
        """The summary: one line for what was written, one per reason anything was left out."""
        lines = [f"written: {self.written} samples in {len(self.shards)} shards to {self.out_dir}"]
        if self.videos and self.frame_rule is not None:
            rule = self.frame_rule
            rate = f"{json_number(rule.fps)} fps" if rule.fps else "the source's frame rate"
            lines.append(f"clips: {self.videos} videos cut into {self.windows} windows of {rule.frames} frames at "
                         f"{rate} (--frame-rule {rule.rule})")
        for reason, text in SKIP_REASONS.items():
            if self.skipped[reason]:
                if reason == "too_large":
                    text = f"image over {self.max_pixels} pixels"
                elif reason == "video_too_large":
                    text = f"video frames over {self.max_pixels} pixels"
                line = f"skipped ({text}): {self.skipped[reason]}"
                names = self.named.get(reason) or [f"{name} (same as {of})"
                                                   for name, of in self.repeats.get(reason, [])]
                if names:
                    more = self.skipped[reason] - len(names)
                    line += ": " + ", ".join(names) + (f" and {more} more" if more > 0 else "")
                lines.append(line)
        for reason, count in self.filtered_in_order():
            lines.append(f"filtered ({self.filters.describe(reason)}): {count}")
        if self.read_errors:
            lines.append(f"unreadable tar data (the readable samples were kept): {len(self.read_errors)} shards: "
                         + ", ".join(self.read_errors))
        return lines


@contextlib.contextmanager
def _own_pixel_limit() -> Iterator[None]:
    """Turn off PIL's bomb check while we apply our own (``max_pixels``) to the header size before decoding."""
    old = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = old


class _Job:
    """The part both commands share: checks, counting and writing through ShardWriter."""

    def __init__(self, out_dir: Path, samples_per_shard: int, missing_caption: str, max_pixels: int,
                 filters: Filters | None, extra: dict[str, Any], duplicates: Duplicates | None = None) -> None:
        if samples_per_shard < 1:
            raise UserError(f"--samples-per-shard: must be at least 1, got {samples_per_shard}")
        if missing_caption not in MISSING_CAPTION:
            raise UserError(f"--missing-caption: {missing_caption!r} is not one of {', '.join(MISSING_CAPTION)}")
        if max_pixels < 1:
            raise UserError(f"--max-pixels: must be at least 1, got {max_pixels}")
        if out_dir.exists() and not out_dir.is_dir():
            raise UserError(f"--out: {out_dir} is a file; choose a folder")
        self.out_dir = out_dir
        self.missing_caption = missing_caption
        self.max_pixels = max_pixels
        self.filters = filters or Filters()
        self.duplicates = duplicates or Duplicates()
        self.extra = {**extra, "dedup": self.duplicates.mode}
        self.report = Report(out_dir, [], max_pixels, self.filters)
        self.keys: set[str] = set()
        self.seen = 0
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # An earlier run's manifest would describe shards this run is about to overwrite.
        (self.out_dir / MANIFEST_NAME).unlink(missing_ok=True)
        self.writer = ShardWriter(out_dir, samples_per_shard, SHARD_PREFIX, manifest=False)

    def filtered(self, meta: dict[str, Any], caption: str) -> bool:
        """Whether the filters reject a sample of `meta` and `caption`: counted by their reason if so."""
        reason = self.filters.check(meta, caption)
        if reason is not None:
            self.report.filtered[reason] += 1
        return reason is not None

    def skip(self, reason: str, name: str | None = None) -> None:
        """Count a skipped input; `name` it in the report (videos are, being few and each many samples)."""
        self.report.skipped[reason] += 1
        if name is not None:
            named = self.report.named.setdefault(reason, [])
            if len(named) < NAMED_AT_MOST:
                named.append(name)

    def repeated(self, reason: str, name: str, of: str) -> None:
        """Count a sample dropped by the dedup, and keep the first few of each reason beside the kept `of`."""
        self.skip(reason)
        repeats = self.report.repeats.setdefault(reason, [])
        if len(repeats) < REPEATS_NAMED:
            repeats.append((name, of))

    def caption(self, caption: str | None) -> str | None:
        """The caption to write, or None (counted) when the sample is skipped for lack of one."""
        caption = (caption or "").strip()
        if not caption and self.missing_caption == "skip":
            self.skip("no_caption")
            return None
        return caption

    def image(self, data: bytes, meta: dict[str, Any], caption: str, fill_size: bool, name: str,
              beside: Beside | None = None) -> tuple[str, dict[str, bytes]] | None:
        """Check an image, the filters and the dedup; return its extension and the images beside it (by field, from
        `beside`), or None (counted) when it is skipped.

        The size is read from the header; ``meta`` gets ``width``/``height`` (overwriting any given when
        ``fill_size``, else only where missing) before the filters see it, and nothing is decoded unless
        the image passes the pixel limit and the filters. `beside` is given the upright size and returns the images
        that go with this one, or None when it skipped the sample for one; the dedup compares them too, so only a
        sample whose every image repeats a kept sample's is a duplicate (the kept one is named by `name`).
        """
        if not data:
            self.skip("corrupt")
            return None
        try:
            img = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError:
            self.skip("too_large")
            return None
        except Exception:  # PIL raises many kinds on malformed headers; none may stop a long run.
            self.skip("corrupt")
            return None
        with img:
            ext = FORMAT_EXTENSIONS.get(img.format or "")
            if ext is None:
                self.skip("format")
                return None
            if img.width * img.height > self.max_pixels:
                self.skip("too_large")
                return None
            # As the loader will see it: upright (a phone photo's sides swap), and what decoding does, recorded.
            described = describe(img)
            width, height = described.width, described.height
            if described.notes():
                meta["decode"] = described.notes()
            if fill_size:
                meta["width"], meta["height"] = width, height
            else:
                meta.setdefault("width", width)
                meta.setdefault("height", height)
            if self.filtered(meta, caption):
                return None
            try:
                img.load()
            except Exception:
                self.skip("corrupt")
                return None
            others = beside((width, height)) if beside else {}
            if others is None:
                return None
            # Compared as training sees it (upright, on white), so a rotated or re-saved copy is the same picture.
            repeat, keep = self.duplicates.check(name, data, lambda: rgb_image(img, (255, 255, 255)).image, others)
            if repeat is not None:
                self.repeated(repeat.reason, name, repeat.of)
                return None
        keep()
        return ext, others

    def clip(self, data: bytes, meta: dict[str, Any], caption: str, rule: FrameRule, name: str) -> Iterator[Window]:
        """Check a video and yield its windows by `rule` as they are cut; a video that gives none is counted, and named
        in the report by `name`.

        The pixel limit is checked on the header's frame size, the window count on the packets' timestamps, then the
        first frame is decoded: ``meta`` gets the upright ``width``/``height`` and the ``source`` (the file's frame
        size, rate, frames, duration and codec) before the filters see it; the rest is decoded only for a video that
        passes them and the dedup. A video whose decoding fails part-way keeps the windows cut before (a long
        video's windows are not all held in memory), counted as damaged.
        """
        cut = 0
        try:
            video = VideoFile(data)
            if video.width * video.height > self.max_pixels:
                raise ClipSkipped("video_too_large", f"{video.width}x{video.height} pixels")
            timeline = video.timeline()
            length = timeline.length(rule.rate)
            starts = rule.starts(length)
            if not starts:
                raise ClipSkipped("too_short", f"{length} frames, fewer than --frames {rule.frames}")
            first = video.picture()
            meta["width"], meta["height"] = first.image.size
            if first.rotation:
                meta["decode"] = {"rotation": first.rotation * 90}
            meta["source"] = {"width": video.width, "height": video.height, "fps": json_number(timeline.rate),
                              "frames": timeline.frames, "duration": json_number(timeline.duration),
                              "codec": first.codec}
            if self.filtered(meta, caption):
                return
            repeat, keep = self.duplicates.check(name, data, lambda: first.image)
            if repeat is not None:
                log.warning("%s: %s (same as %s); skipped", name, SKIP_REASONS[VIDEO_DUPLICATES[repeat.reason]],
                            repeat.of)
                self.repeated(VIDEO_DUPLICATES[repeat.reason], name, repeat.of)
                return
            for window in video.windows(rule, timeline, starts):
                if not cut:
                    keep()
                    self.report.videos += 1
                cut += 1
                self.report.windows += 1
                yield window
        except ClipSkipped as skipped:
            reason = "video_damaged" if cut else skipped.reason
            log.warning("%s: %s%s; %s", name, SKIP_REASONS[reason], f" ({skipped.detail})" if skipped.detail else "",
                        f"its first {cut} windows kept" if cut else "skipped")
            self.skip(reason, name)

    def clip_member(self, data: bytes, meta: dict[str, Any], caption: str, name: str) -> bool:
        """Check a clip a shard already holds (its size from the header, the filters, the dedup on its bytes); False
        when it is skipped (counted, and named by `name`). ``meta`` gets ``width``/``height`` where it has none."""
        try:
            width, height = clip_size(data)
        except ValueError:
            self.skip("video_unreadable", name)
            return False
        if width * height > self.max_pixels:
            self.skip("video_too_large", name)
            return False
        meta.setdefault("width", width)
        meta.setdefault("height", height)
        if self.filtered(meta, caption):
            return False
        try:
            repeat, keep = self.duplicates.check(name, data, lambda: VideoFile(data).picture().image)
        except ClipSkipped:
            self.skip("video_unreadable", name)
            return False
        if repeat is not None:
            self.repeated(VIDEO_DUPLICATES[repeat.reason], name, repeat.of)
            return False
        keep()
        return True

    def write(self, sample: dict[str, Any]) -> None:
        self.keys.add(sample["__key__"])
        self.writer.write(sample)

    def progress(self) -> None:
        self.seen += 1
        if self.seen % PROGRESS_EVERY == 0:
            log.info("%d inputs read, %d samples written", self.seen, len(self.keys))

    def finish(self) -> Report:
        """Close the last shard, delete what an earlier run left that this one did not write, write the manifest."""
        self.writer.close()
        self.report.shards = list(self.writer.shards)
        ours = {s.name for s in self.report.shards}
        for path in self.out_dir.iterdir():
            stale_shard = _OUR_SHARD.match(path.name) and path.name not in ours
            if (stale_shard or _OUR_TEMP.match(path.name)) and path.is_file():
                log.info("removing %s left by an earlier run", path)
                path.unlink()
        extra = dict(self.extra)
        extra["skipped"] = {k: v for k, v in self.report.skipped.items() if v}
        extra["filtered"] = dict(self.report.filtered_in_order())
        extra["filters"] = {f.name: f.describe() for f in self.filters.filters}
        if self.report.repeats:
            extra["duplicates"] = {reason: {"dropped": self.report.skipped[reason],
                                            "examples": [{"key": name, "same_as": of} for name, of in repeats]}
                                   for reason, repeats in self.report.repeats.items()}
        if self.report.videos and self.report.frame_rule is not None:
            extra["clips"] = self.report.frame_rule.describe()
        write_manifest(self.out_dir, self.report.shards, extra)
        return self.report


# ----------------------------------------------------------------------------------------------------- folder


@dataclass
class _Entry:
    rel: str  # path relative to the source folder, with forward slashes
    caption: str | None  # None: read it from the caption file beside the image
    columns: dict[str, Any]
    line: int = 0


class NotText(Exception):
    """A caption file whose bytes are not text (an image saved as .txt, a binary tagger output)."""


def _read_caption_file(path: Path) -> str | None:
    """The file's text (several captions, one per line, are kept as they are); None when there is none."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    # A caption in a legacy encoding (Windows-1252's é) keeps its text with a replacement character; bytes that are
    # not text at all (NULs, or mostly invalid) are refused.
    text = data.decode("utf-8-sig", "replace")
    if "\x00" in text or text.count("\ufffd") > len(text) / 4:
        raise NotText("binary data, not a caption")
    return text


def _read_companion(path: Path, size: tuple[int, int], what: str) -> bytes | bool | None:
    """The bytes of the image beside a sample's at `path` (a mask, a conditioning or source image: `what`), if there
    is one; False (logged) when it is not an image of `size` (the image's, upright)."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    try:
        with Image.open(io.BytesIO(data)) as img:
            upright = describe(img)
            found = (upright.width, upright.height)
    except Exception:  # PIL raises many kinds on malformed files
        found = None
    if found != size:
        log.warning("%s: %s, not the %dx%d of its image; sample skipped: save the %s at the image's size",
                    path, f"{found[0]}x{found[1]}" if found else "not an image", *size, what)
        return False
    return data


def _walk_inputs(src: Path) -> list[_Entry]:
    entries = []
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # .git, .ipynb_checkpoints, ...
        for name in files:
            if not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS + VIDEO_EXTENSIONS) \
                    and not name.lower().endswith(tuple(COMPANIONS)):
                rel = Path(root, name).relative_to(src).as_posix()
                entries.append(_Entry(rel, None, {}))
    entries.sort(key=lambda e: e.rel)
    return entries


def _file_name(path: Path, where: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise UserError(f"{path}: {where}: needs a 'file_name' (the image path relative to {path.parent})")
    rel = PurePosixPath(value.strip().replace("\\", "/"))
    if rel.is_absolute() or ".." in rel.parts:
        raise UserError(f"{path}: {where}: file_name {value!r} must be a path inside {path.parent}")
    return rel.as_posix()


def _caption_of(row: dict[str, Any], names: list[str] | None = None) -> tuple[str | None, dict[str, Any]]:
    """The captions of the `names` columns (default: ``text``, else ``caption``), one per line (a column may hold a
    JSON list of several), and the remaining columns for the json. None when the row has none of the columns."""
    columns = {k: v for k, v in row.items() if k != "file_name"}
    names = names or next(([n] for n in CAPTION_COLUMNS if n in columns), [])
    values = [columns.pop(name) for name in names if name in columns]
    if not values:
        return None, columns
    captions = [str(v).strip() for value in values for v in (value if isinstance(value, list) else [value])
                if v is not None and str(v).strip()]
    return "\n".join(captions), columns


def _read_metadata(path: Path, missing_caption: str, caption_columns: list[str] | None = None) -> list[_Entry]:
    entries = []
    try:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8-sig") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise UserError(f"{path}: line {number}: not valid JSON ({e}); fix or remove the line") from e
                    if not isinstance(row, dict):
                        raise UserError(f"{path}: line {number}: expected a JSON object with file_name and text")
                    caption, columns = _caption_of(row, caption_columns)
                    entries.append(_Entry(_file_name(path, f"line {number}", row.get("file_name")),
                                          caption, columns, number))
        else:
            with open(path, encoding="utf-8-sig", newline="") as f:
                reader = csv.DictReader(f)
                header = reader.fieldnames or []
                if "file_name" not in header:
                    raise UserError(f"{path}: no 'file_name' column (columns: {', '.join(header) or 'none'}); "
                                    "add one with each image's path relative to the folder")
                absent = [c for c in caption_columns or [] if c not in header]
                if absent:
                    raise UserError(f"{path}: no column {absent[0]!r} (columns: {', '.join(header)}); name the "
                                    "caption columns it has with --caption-column")
                if missing_caption == "skip" and not caption_columns and not any(c in header for c in CAPTION_COLUMNS):
                    raise UserError(f"{path}: no 'text' or 'caption' column; add one, or pass "
                                    "--missing-caption empty to keep images without captions")
                for row in reader:
                    number = reader.line_num
                    row.pop(None, None)  # values beyond the header
                    caption, columns = _caption_of({k: v for k, v in row.items() if v is not None}, caption_columns)
                    entries.append(_Entry(_file_name(path, f"line {number}", row.get("file_name")),
                                          caption, columns, number))
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e}); save it as UTF-8") from e
    except csv.Error as e:
        raise UserError(f"{path}: malformed CSV ({e})") from e
    entries.sort(key=lambda e: (e.rel, e.line))  # stable: for a file listed twice, the first line wins
    return entries


def prepare_folder(
    src: str | Path,
    out_dir: str | Path,
    *,
    samples_per_shard: int = 1000,
    caption_ext: str = "txt",
    missing_caption: str = "skip",
    max_pixels: int = DEFAULT_MAX_PIXELS,
    filters: Filters | None = None,
    caption_columns: list[str] | None = None,
    duplicates: Duplicates | None = None,
    conditioning: str | None = None,
    clips: FrameRule | None = None,
) -> Report:
    """Write the images and videos of ``src`` (and their captions) as shards in ``out_dir``; see the module docstring.
    Beside an image, ``{stem}.mask.png`` (a loss mask), ``{stem}.cond.png`` (a conditioning image: a ControlNet's
    map) and ``{stem}.src.png`` (a source image, for editing) go into its sample, each the image's size; with
    `conditioning` (``canny``), a sample without a conditioning image gets one computed from its image.
    A caption file with several lines, a metadata column holding a list, or several `caption_columns` give a sample
    several captions, written one per line; training draws one of them each time it reads the sample.

    Each sample holds the image bytes (``jpg``/``png``/``webp``), ``txt`` (the caption) and ``json``: the
    metadata columns, if any, then ``width``, ``height`` (as read from the image) and ``file_name`` (the
    image's path relative to ``src``).

    Videos are cut into windows by `clips` (default: ``FrameRule()``, the first 81 frames at 16 fps). A window's
    sample holds ``mp4`` (the window, see ``sdtrain.data.video``), ``txt`` and ``json``: the metadata columns, then
    ``width``, ``height`` (of its frames, upright), ``source`` (the video file's ``width``, ``height``, ``fps``,
    ``frames``, ``duration`` in seconds and ``codec``), ``decode`` (``rotation``, where it was turned upright),
    ``frames``, ``fps``, ``start`` (the time of its first frame in the video, in seconds), ``window`` (its number,
    under rules that may give several) and ``file_name``.
    """
    src, out_dir = Path(src), Path(out_dir)
    clips = clips or FrameRule()
    if not src.is_dir():
        raise UserError(f"{src}: not a folder; point prepare folder at a folder of images or videos")
    if conditioning:
        require_conditioning(conditioning)
    caption_ext = caption_ext.lstrip(".")
    if not caption_ext:
        raise UserError("--caption-ext: must not be empty (e.g. txt)")
    found = [src / name for name in METADATA_FILES if (src / name).is_file()]
    if len(found) > 1:
        raise UserError(f"{src}: has both {METADATA_FILES[0]} and {METADATA_FILES[1]}; keep one")
    metadata = found[0] if found else None
    if caption_columns and not metadata:
        raise UserError(f"--caption-column: {src} has no {' or '.join(METADATA_FILES)} to read columns from; "
                        f"captions come from the .{caption_ext} files beside the images")
    entries = _read_metadata(metadata, missing_caption, caption_columns) if metadata else _walk_inputs(src)
    if not entries:
        what = f"{metadata} lists no images or videos" if metadata else \
            f"{src}: no {'/'.join(IMAGE_EXTENSIONS)} images found (nor {'/'.join(VIDEO_EXTENSIONS)} videos)"
        raise UserError(f"{what}; nothing to prepare")
    log.info("%s: %d images and videos listed%s", src, len(entries), f" in {metadata.name}" if metadata else "")

    extra = {"source": "folder", "input": str(src.resolve()),
             "captions": metadata.name if metadata else f"*.{caption_ext}"}
    job = _Job(out_dir, samples_per_shard, missing_caption, max_pixels, filters, extra, duplicates)
    job.report.frame_rule = clips
    with _own_pixel_limit(), job.writer:
        for entry in entries:
            job.progress()
            stem = entry.rel.rsplit(".", 1)[0] if "." in PurePosixPath(entry.rel).name else entry.rel
            key = sample_key(stem)
            video = entry.rel.lower().endswith(VIDEO_EXTENSIONS)
            first_key = CLIP_KEY.format(key=key, index=0) if video and clips.several else key
            if first_key in job.keys:
                job.skip("duplicate")
                continue
            try:
                raw_caption = entry.caption if metadata else _read_caption_file(src / f"{stem}.{caption_ext}")
            except NotText as exc:
                log.warning("%s: not text (%s); sample skipped", src / f"{stem}.{caption_ext}", exc)
                job.skip("caption_not_text")
                continue
            caption = job.caption(raw_caption)
            if caption is None:
                continue
            try:
                data = (src / entry.rel).read_bytes()
            except (FileNotFoundError, NotADirectoryError):
                job.skip("no_file")
                continue
            except OSError as e:
                log.warning("%s: unreadable (%s); skipped", src / entry.rel, e)
                job.skip("corrupt")
                continue
            meta = dict(entry.columns)
            if video:
                _write_clip(job, src, entry.rel, stem, key, data, meta, caption, clips)
                continue
            checked = job.image(data, meta, caption, fill_size=True, name=key,
                                beside=functools.partial(_companions, job, src, stem))
            if checked is None:
                continue
            ext, companions = checked
            if conditioning and CONDITIONING_IMAGE not in companions:
                # After the dedup, which need not see it: a map computed from the image repeats when the image does.
                companions = {**companions, CONDITIONING_IMAGE: canny_map(data)}
            meta.pop("file_name", None)
            meta["file_name"] = entry.rel
            body = json.dumps(meta, ensure_ascii=False, default=str).encode("utf-8")
            job.write({"__key__": key, ext: data, "txt": caption, "json": body, **companions})
    return job.finish()


def _companions(job: _Job, src: Path, stem: str, size: tuple[int, int]) -> dict[str, bytes] | None:
    """The images beside the image `stem` (see COMPANIONS) by field, or None (counted) when one is not of `size`."""
    found = {}
    for suffix, (member, what, reason) in COMPANIONS.items():
        data = _read_companion(src / f"{stem}{suffix}", size, what)
        if data is False:
            job.skip(reason)
            return None
        if isinstance(data, bytes):
            found[member] = data
    return found


def _write_clip(job: _Job, src: Path, rel: str, stem: str, key: str, data: bytes, meta: dict[str, Any],
                caption: str, rule: FrameRule) -> None:
    """The windows of the video at `rel` as samples (see `prepare_folder`), unless it is skipped. A loss mask beside
    it (``KEY.mask.png`` at the video's upright size) is every frame's, kept with each window."""
    beside = [src / f"{stem}{suffix}" for suffix in COMPANIONS
              if suffix != MASK_SUFFIX and (src / f"{stem}{suffix}").is_file()]
    if beside:
        log.warning("%s: conditioning and source images of videos are not read; %s ignored", rel,
                    ", ".join(path.name for path in beside))
    mask: bytes | None = None
    for number, window in enumerate(job.clip(data, meta, caption, rule, rel)):
        if number == 0:  # the video's upright size is known once its first window is cut
            found = _read_companion(src / f"{stem}{MASK_SUFFIX}", (meta["width"], meta["height"]), "mask")
            if found is False:
                job.skip("mask_size")
                return
            mask = found
        name = CLIP_KEY.format(key=key, index=window.index) if rule.several else key
        if name in job.keys:
            job.skip("duplicate")
            continue
        fields = {**meta, "frames": rule.frames, "fps": json_number(rule.fps) if rule.fps else meta["source"]["fps"],
                  "start": round(window.time, 6), **({"window": window.index} if rule.several else {})}
        fields.pop("file_name", None)
        fields["file_name"] = rel
        body = json.dumps(fields, ensure_ascii=False, default=str).encode("utf-8")
        job.write({"__key__": name, CLIP_FIELD: window.data, "txt": caption, "json": body,
                   **({MASK_IMAGE: mask} if mask else {})})


# ---------------------------------------------------------------------------------------------------- reshard


def resolve_inputs(specs: list[str]) -> list[str]:
    """Shard paths from folders (the manifest's shards, else every ``*.tar``), globs and brace lists.

    Only ``.tar`` files count in folders and globs, so img2dataset's ``.parquet``/``_stats.json`` beside the
    shards are ignored.
    """
    urls: list[str] = []
    for spec in specs:
        found = expand_spec(spec)
        if not found:
            raise UserError(f"{spec}: no .tar shards found; point reshard at a folder, glob or brace list of shards")
        for url in found:
            if not is_remote(url) and not os.path.isfile(url):
                raise UserError(f"{url}: no such shard; fix the path or pattern")
        urls.extend(found)
    return list(dict.fromkeys(urls))


def _reshard_key(key: str) -> str:
    key = key.removeprefix("./")
    return sample_key(key) if "." in key else key


def reshard(
    sources: list[str],
    out_dir: str | Path,
    *,
    samples_per_shard: int,
    missing_caption: str = "skip",
    max_pixels: int = DEFAULT_MAX_PIXELS,
    filters: Filters | None = None,
    duplicates: Duplicates | None = None,
) -> Report:
    """Re-tar the samples of existing shards into shards of ``samples_per_shard`` in ``out_dir``.

    Every field of a kept sample is copied byte for byte (``txt`` is added as ``""`` for a sample without a
    caption under ``missing_caption="empty"``). A sample needs an image field (jpg, jpeg, png, webp, gif, tif or
    tiff) that passes the checks; filters see its ``json`` with ``width``/``height`` from the image where the json has
    none. A tar that breaks off or is corrupt part-way keeps the samples read before the damage.
    """
    out_dir = Path(out_dir)
    urls = resolve_inputs(list(sources))
    out_resolved = out_dir.resolve()
    for url in urls:
        if not is_remote(url) and Path(url).resolve().parent == out_resolved:
            raise UserError(f"--out: {out_dir} holds the input shard {url}; write to another folder")
    log.info("resharding %d shards", len(urls))
    job = _Job(out_dir, samples_per_shard, missing_caption, max_pixels, filters,
               {"source": "reshard", "input": [url if is_remote(url) else str(Path(url).resolve()) for url in urls]},
               duplicates)
    with _own_pixel_limit(), job.writer:
        for url in urls:
            errors: list[Exception] = []

            def keep_going(exc: Exception, errors: list[Exception] = errors) -> bool:
                errors.append(exc)
                return True

            for raw in tar_samples(url, handler=keep_going):
                job.progress()
                _reshard_sample(job, raw)
            if errors:
                log.warning("%s: %s; kept the samples read before it", url, first_line(errors[0]))
                job.report.read_errors.append(os.path.basename(url))
    return job.finish()


def _reshard_sample(job: _Job, raw: dict[str, Any]) -> None:
    fields = {k: v for k, v in raw.items() if not k.startswith("_") and isinstance(v, bytes)}
    key = _reshard_key(raw["__key__"])
    if key in job.keys:
        job.skip("duplicate")
        return
    image_field = next((f for f in IMAGE_FIELDS if f in fields), None)
    if image_field is None and CLIP_FIELD not in fields:
        job.skip("no_image")
        return
    caption = job.caption(fields["txt"].decode("utf-8", "replace") if "txt" in fields else None)
    if caption is None:
        return
    fields.setdefault("txt", b"")
    meta: dict[str, Any] = {}
    if "json" in fields:
        with contextlib.suppress(ValueError):
            loaded = json.loads(fields["json"])
            meta = dict(loaded) if isinstance(loaded, Mapping) else {}
    if image_field is None:
        if not job.clip_member(fields[CLIP_FIELD], meta, caption, key):
            return
    else:
        # A prepared sample's source, conditioning map and mask are part of what the dedup compares, as they were
        # when the folder was prepared.
        companions = {f: fields[f] for f in COMPANION_FIELDS if f in fields}
        if job.image(fields[image_field], meta, caption, fill_size=False, name=key,
                     beside=lambda size: companions) is None:
            return
    job.write({"__key__": key, **fields})
