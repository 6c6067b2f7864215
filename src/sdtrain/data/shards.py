"""Writing WebDataset tar shards safely, plus the ``manifest.json`` that describes them.

Every dataset sdtrain produces (demo shapes, reshards, filtered copies, pre-encoded latents) uses this
layout: numbered ``{prefix}-{index:06d}.tar`` files and a manifest listing each shard's sample count and
sha256. The shards themselves are plain WebDataset tars, so any WebDataset reader can consume them and
shards from elsewhere (without a manifest) remain usable.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tarfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import webdataset as wds

from sdtrain.data.remote import open_url
from sdtrain.errors import UserError
from sdtrain.utils import atomic_write_text

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "sdtrain-shards/1"
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass
class ShardInfo:
    """One finished shard: its file name (relative to the dataset folder), sample count and sha256."""

    name: str
    samples: int
    sha256: str


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in chunks so large shards don't need to fit in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(out_dir: str | Path, shards: list[ShardInfo], extra: dict | None = None) -> Path:
    """Write ``manifest.json`` atomically and return its path.

    ``extra`` adds provenance keys (source, seed, ...); it may not override the structural keys, since
    readers rely on them.
    """
    extra = dict(extra or {})
    clash = {"format", "total", "shards"} & extra.keys()
    if clash:
        raise ValueError(f"manifest extra keys {sorted(clash)} are reserved")
    manifest = {
        "format": MANIFEST_FORMAT,
        "total": sum(s.samples for s in shards),
        "shards": [asdict(s) for s in shards],
        **extra,
    }
    path = Path(out_dir) / MANIFEST_NAME
    atomic_write_text(path, json.dumps(manifest, indent=1) + "\n")
    return path


def read_manifest(out_dir: str | Path) -> dict | None:
    """Load and validate ``{out_dir}/manifest.json``; None when there is none (e.g. shards from elsewhere).

    Raises UserError (one line, naming the file and the fix) when it exists but is unreadable or malformed.
    """
    path = Path(out_dir) / MANIFEST_NAME
    fix = "delete it and re-create the dataset (or fix the file by hand)"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read shard manifest ({e}); {fix}") from e
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: shard manifest is not valid JSON ({e}); {fix}") from e

    def bad(why: str) -> UserError:
        return UserError(f"{path}: malformed shard manifest: {why}; {fix}")

    if not isinstance(manifest, dict):
        raise bad("top level is not a JSON object")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise bad(f"format is {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise bad("'shards' is missing or not a list")
    for i, s in enumerate(shards):
        ok = (
            isinstance(s, dict)
            and isinstance(s.get("name"), str)
            # Names must stay inside the dataset folder: a manifest is data, not a pointer to anywhere.
            and s["name"] not in ("", ".", "..")
            and "/" not in s["name"]
            and "\\" not in s["name"]
            and isinstance(s.get("samples"), int)
            and not isinstance(s.get("samples"), bool)
            and s["samples"] >= 0
            and isinstance(s.get("sha256"), str)
            and _SHA256_RE.match(s["sha256"]) is not None
        )
        if not ok:
            raise bad(f"shard entry {i} needs a plain file 'name', integer 'samples' >= 0 and hex 'sha256'")
    total = sum(s["samples"] for s in shards)
    if manifest.get("total") != total:
        raise bad(f"'total' is {manifest.get('total')!r} but the shard counts add up to {total}")
    return manifest


class ShardWriter:
    """Writes samples into numbered tar shards ``{out_dir}/{prefix}-{index:06d}.tar``.

    Each shard holds at most ``samples_per_shard`` samples and is written under a hidden temporary name,
    then renamed into place once complete, so an interrupted run never leaves a truncated shard under a
    final name. ``close()`` finishes the last shard and writes the manifest; leaving the ``with`` block
    through an exception discards the unfinished shard and writes no manifest.

    Samples are dicts with ``"__key__"`` (no dots: WebDataset splits the key from the field at the first
    dot) and fields such as ``"png"`` (bytes), ``"txt"`` (str) or ``"json"`` (dict); WebDataset's encoder
    turns str/dict into bytes. Tar headers carry a fixed mtime so equal input gives byte-identical shards.

    ``start_index`` and ``manifest=False`` let several writers (e.g. one per worker) fill one folder with
    distinct prefixes or index ranges and have the caller merge their ``shards`` into one manifest.
    """

    def __init__(
        self,
        out_dir: str | Path,
        samples_per_shard: int = 1000,
        prefix: str = "shard",
        *,
        start_index: int = 0,
        manifest: bool = True,
        extra: dict | None = None,
    ) -> None:
        if samples_per_shard < 1:
            raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
        self.out_dir = Path(out_dir)
        self.samples_per_shard = samples_per_shard
        self.prefix = prefix
        self.shards: list[ShardInfo] = []
        self._index = start_index
        self._write_manifest = manifest
        self._extra = extra
        self._file: BinaryIO | None = None
        self._tar: wds.TarWriter | None = None
        self._count = 0
        self._closed = False
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # Shards from an earlier run are about to be overwritten, so its manifest would lie about their
        # checksums if this run were interrupted; better to have no manifest than a wrong one.
        if manifest:
            (self.out_dir / MANIFEST_NAME).unlink(missing_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _paths(self) -> tuple[Path, Path]:
        final = self.out_dir / f"{self.prefix}-{self._index:06d}.tar"
        return final, final.with_name(f".{final.name}.tmp")

    def write(self, sample: dict[str, Any]) -> None:
        """Append one sample, starting a new shard when the current one is full."""
        if self._closed:
            raise RuntimeError("ShardWriter is closed")
        key = sample.get("__key__")
        if not isinstance(key, str) or not key or "." in key:
            raise ValueError(f"sample needs a non-empty string '__key__' without dots, got {key!r}")
        if self._tar is None:
            # Stays open across write() calls until the shard is full; closed by _finish_shard/abort.
            self._file = open(self._paths()[1], "wb")  # noqa: SIM115
            # mtime=0: TarWriter otherwise stamps every member with the current time.
            self._tar = wds.TarWriter(self._file, mtime=0.0)
        self._tar.write(sample)
        self._count += 1
        if self._count >= self.samples_per_shard:
            self._finish_shard()

    def _finish_shard(self) -> None:
        assert self._tar is not None and self._file is not None
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        final, tmp = self._paths()
        info = ShardInfo(final.name, self._count, sha256_file(tmp))
        os.replace(tmp, final)
        self.shards.append(info)
        self._tar, self._file, self._count = None, None, 0
        self._index += 1

    def close(self) -> None:
        """Finish the last (partial) shard and write the manifest. Idempotent."""
        if self._closed:
            return
        if self._tar is not None:
            self._finish_shard()
        self._closed = True
        if self._write_manifest:
            write_manifest(self.out_dir, self.shards, self._extra)

    def abort(self) -> None:
        """Drop the unfinished shard without writing a manifest; finished shards stay on disk."""
        if self._closed:
            return
        self._closed = True
        if self._tar is not None:
            assert self._file is not None
            # Close the tar stream too, or its finaliser later writes to the closed file; the failure that
            # led here may be an I/O error, which must not mask the original exception.
            with contextlib.suppress(OSError, ValueError):
                self._tar.close()
            self._file.close()
            self._paths()[1].unlink(missing_ok=True)
            self._tar, self._file = None, None


def tar_keys(path: str | Path) -> Iterator[str]:
    """The sample key (WebDataset's: the name up to the first dot) of each file in a local tar, in order.
    Reading headers only, tarfile seeks over member data, so this is cheap.

    Raises ``tarfile.TarError``/``OSError`` where the tar can't be read on.
    """
    with tarfile.open(path) as tar:
        for member in tar:
            if member.isreg():
                key = wds.tariterators.base_plus_ext(member.name)[0]
                if key is not None:
                    yield key


def count_tar_samples(path: str | Path) -> int:
    """Number of distinct sample keys in a local tar; raises as `tar_keys` does."""
    return len(set(tar_keys(path)))


def verify_shards(out_dir: str | Path) -> list[str]:
    """Check a dataset folder against its manifest; return one line per problem (empty: all good).

    Every listed shard must exist, match its sha256 and hold the listed number of samples. Raises UserError
    when there is no manifest or it is malformed.
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise UserError(f"{out_dir}: not a folder; point verify at a dataset folder holding {MANIFEST_NAME}")
    manifest = read_manifest(out_dir)
    if manifest is None:
        raise UserError(f"{out_dir / MANIFEST_NAME}: no shard manifest; write the dataset with `sdtrain prepare`")
    problems = []
    for entry in manifest["shards"]:
        name, path = entry["name"], out_dir / entry["name"]
        if not path.is_file():
            problems.append(f"{name}: missing (listed in the manifest)")
            continue
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            problems.append(f"{name}: sha256 is {digest[:12]}..., manifest says {entry['sha256'][:12]}...")
        try:
            samples = count_tar_samples(path)
        except (tarfile.TarError, OSError) as e:
            problems.append(f"{name}: unreadable tar ({' '.join(str(e).split()) or type(e).__name__})")
            continue
        if samples != entry["samples"]:
            problems.append(f"{name}: holds {samples} samples, manifest says {entry['samples']}")
    return problems


MAX_MEMBER_BYTES = 1 << 30
"""1 GiB, far above any image, latent or caption: a member declaring more is refused without being read."""


class UnsafeMember(ValueError):
    """A tar member no reader should take: a path out of the archive, or a size no sample has."""


def safe_members(stream: BinaryIO, url: str, handler: Any, select: Any = None) -> Iterator[dict[str, Any]]:
    """The regular files of a tar stream as webdataset's ``{"fname", "data", "__url__"}`` records.

    Shards come from anywhere, so the reader trusts none of a member's header: links, devices and folders
    are skipped (never followed); a name with ``..`` or an absolute path, or a member over
    ``MAX_MEMBER_BYTES``, goes to ``handler`` as an ``UnsafeMember`` before its data is read (True reads
    on past it, False stops). Nothing is extracted to disk.
    """
    with tarfile.open(fileobj=stream, mode="r|*") as tar:
        for info in tar:
            if not info.isreg():
                continue
            name, problem = info.name, None
            if name.startswith("/") or ".." in name.split("/"):
                problem = f"{url}: member {name!r} points outside the archive; refused"
            elif info.size > MAX_MEMBER_BYTES:
                problem = (f"{url}: member {name!r} declares {info.size} bytes, over the {MAX_MEMBER_BYTES} a "
                           "sample file may have; refused")
            if problem is not None:
                if handler(UnsafeMember(problem)):
                    continue
                return
            if select is not None and not select(name):
                continue
            member = tar.extractfile(info)
            assert member is not None  # a regular file
            yield {"fname": name, "data": member.read(), "__url__": url}
            tar.members = []  # a stream of millions of members must not keep every header


def tar_samples(url: str, handler: Any, select: Any = None) -> Iterator[dict[str, Any]]:
    """The samples of one shard (webdataset's grouping of members by key), read through
    :func:`safe_members`; ``handler(exc)`` decides whether to go on after a bad member (True) or stop."""

    def members() -> Iterator[dict[str, Any]]:
        try:
            with open_url(url) as stream:
                yield from safe_members(stream, url, handler, select)
        except (OSError, tarfile.TarError, EOFError) as exc:
            handler(exc)

    yield from wds.tariterators.group_by_keys(members(), handler=handler)
