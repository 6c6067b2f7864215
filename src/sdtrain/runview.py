"""The one view of a run folder, shared by the report, the UI and the CLI: what a run is (config, metrics,
samples, checkpoints), where it stands (status, step, loss, throughput, last save, disk used), what happened to it
(events.jsonl) and its log; and the one request a reader may make of it, to stop after a save.

Reading never changes a run and never raises for a damaged one: a half-written metrics line (a run killed
mid-write) is counted and skipped, an unreadable config or meta.json leaves its fields empty. Nothing here loads
torch, so a page over hundreds of runs starts at once.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from itertools import chain, pairwise
from pathlib import Path
from typing import Any

from sdtrain import __version__
from sdtrain.errors import UserError
from sdtrain.paths import EVENTS, LOCK, STOP_REQUEST, TRAIN_LOG, checkpoint_folders

SAMPLE_NAME = re.compile(r"^step_(\d+)\.png$")
# Not metrics: the x axis itself and clock stamps.
NOT_PLOTTED = {"step", "time", "timestamp"}
# The newest record of a metrics file lies in its last lines: a summary reads no more than this of it.
_TAIL_BYTES = 64 * 1024
_MAX_DEPTH = 3
SCREEN_POINTS = 2000
"""About as many points as a plot is pixels wide: what a series is thinned to for drawing."""


# ------------------------------------------------------------------------------------------------ metrics


@dataclass
class Metrics:
    """metrics.jsonl, one merged record per step: a resumed run logs some steps twice, the later value wins."""

    records: list[dict[str, Any]] = field(default_factory=list)
    lines: int = 0
    unreadable: int = 0
    restarts: int = 0

    def keys(self) -> list[str]:
        """The metrics logged as numbers, in the order they first appear."""
        every = dict.fromkeys(chain.from_iterable(self.records))  # in C: a long run has a million values
        return [key for key in every if key not in NOT_PLOTTED and any(is_number(r.get(key)) for r in self.records)]

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(r["step"], float(r[key])) for r in self.records if is_number(r.get(key))]

    def last(self, key: str) -> float | None:
        points = self.series(key)
        return points[-1][1] if points else None

    def non_finite(self) -> list[tuple[str, int, float]]:
        return [(key, step, value) for key in self.keys() for step, value in self.series(key)
                if not math.isfinite(value)]


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _records(lines: list[str]) -> tuple[list[dict[str, Any]], int]:
    """The readable records of metrics lines, and how many lines were not."""
    lines = [line for line in lines if line.strip()]
    try:  # every line whole, as in all but a run killed mid-write: one parse, twice as fast as a parse a line
        parsed = json.loads("[" + ",".join(lines) + "]")
    except ValueError:
        parsed = None
    if parsed is not None and all(isinstance(r, dict) and type(r.get("step")) is int for r in parsed):
        return parsed, 0
    found, unreadable = [], 0
    for line in lines:
        try:
            record = json.loads(line)
            record["step"] = int(record["step"])
        except (ValueError, KeyError, TypeError):
            # A run killed mid-write leaves half a line; the rest of the file is still good.
            unreadable += 1
            continue
        found.append(record)
    return found, unreadable


def read_metrics(path: Path) -> Metrics:
    metrics = Metrics()
    if not path.is_file():
        return metrics
    lines = path.read_text(errors="replace").splitlines()
    records, metrics.unreadable = _records(lines)
    metrics.lines = len(records) + metrics.unreadable
    merged: dict[int, dict[str, Any]] = {}
    order = [r["step"] for r in records if "loss" in r]  # an evaluation logged late for an earlier checkpoint
    for record in records:
        # Merged rather than replaced: an evaluation may log its own line for a step training already logged.
        merged.setdefault(record["step"], {}).update(record)
    metrics.restarts = sum(1 for a, b in pairwise(order) if b < a)
    metrics.records = [merged[step] for step in sorted(merged)]
    return metrics


def thin(xs: list[float], ys: list[float], points: int = SCREEN_POINTS) -> tuple[list[float], list[float]]:
    """At most about `points` points: the first and last, and each bucket's lowest and highest value in order,
    so a chart of the thinned series shows the same envelope (spikes and dips) as the full one."""
    n = len(xs)
    if n <= points:
        return xs, ys
    buckets = max(points // 2 - 1, 1)
    keep = {0, n - 1}
    size = (n - 2) / buckets
    for b in range(buckets):
        start, end = 1 + int(b * size), 1 + int((b + 1) * size)
        if start >= end:
            continue
        chunk = range(start, end)
        finite = [i for i in chunk if math.isfinite(ys[i])]
        if len(finite) < len(chunk):  # a NaN or inf is what the chart must show, not what min() skips
            keep.update(i for i in chunk if not math.isfinite(ys[i]))
        if finite:
            keep.add(min(finite, key=ys.__getitem__))
            keep.add(max(finite, key=ys.__getitem__))
    order = sorted(keep)
    return [xs[i] for i in order], [ys[i] for i in order]


def _last_records(path: Path) -> list[dict[str, Any]]:
    """The readable records among the last lines of a metrics file (its whole tail, never the whole file)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - _TAIL_BYTES))
            tail = handle.read().decode(errors="replace")
    except OSError:
        return []
    lines = tail.splitlines()
    if size > _TAIL_BYTES:
        lines = lines[1:]  # the first is cut where the read began
    return _records(lines)[0]


# --------------------------------------------------------------------------------------------------- a run


@dataclass
class Run:
    path: Path
    config_text: str | None
    config: dict[str, Any]
    later_configs: list[Path]
    metrics: Metrics
    samples: list[tuple[int, Path]]
    """Newest first."""
    checkpoints: list[tuple[Path, dict[str, Any] | None]]
    """Oldest first; the meta is None when meta.json could not be read."""
    world_size: int | None = None


def check_is_run(path: Path) -> None:
    hint = "pass the run_dir that `sdtrain train` wrote (it holds config.yaml and metrics.jsonl)"
    if not path.exists():
        raise UserError(f"{path}: no such folder; {hint}")
    if not path.is_dir():
        raise UserError(f"{path} is a file, not a run folder; {hint}")
    if not is_run(path):
        raise UserError(f"{path} is not a training run (no config.yaml, metrics.jsonl or checkpoints/); {hint}")


def is_run(path: Path) -> bool:
    return any((path / name).exists() for name in ("config.yaml", "metrics.jsonl", "checkpoints"))


def read_config(path: Path) -> tuple[str | None, dict[str, Any], list[Path]]:
    """The newest resolved config of a run (its text and mapping) and the later ones a restart recorded."""
    import yaml

    first = path / "config.yaml"
    # A restart with a changed config (say a longer max_steps) records it beside the first; the newest rules.
    later = sorted(path.glob("config.*.yaml"), key=lambda p: (p.stat().st_mtime_ns, p.name))
    newest = later[-1] if later else first
    if not newest.is_file():
        return None, {}, later
    text = newest.read_text(errors="replace")
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        parsed = None
    return text, parsed if isinstance(parsed, dict) else {}, later


def _meta(folder: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def read_checkpoints(path: Path) -> list[tuple[Path, dict[str, Any] | None]]:
    return [(folder, _meta(folder)) for folder in checkpoint_folders(path)]


def read_samples(path: Path) -> list[tuple[int, Path]]:
    """The validation grids (``samples/step_N.png``: every prompt's images at step N), newest first."""
    folder = path / "samples"
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := SAMPLE_NAME.match(p.name))]
    return sorted(found, reverse=True)


def load_run(path: Path) -> Run:
    path = Path(path)
    check_is_run(path)
    text, config, later = read_config(path)
    checkpoints = read_checkpoints(path)
    return Run(path=path, config_text=text, config=config, later_configs=later,
               metrics=read_metrics(path / "metrics.jsonl"), samples=read_samples(path),
               checkpoints=checkpoints, world_size=world_size(checkpoints))


def world_size(checkpoints: list[tuple[Path, dict[str, Any] | None]]) -> int | None:
    """Ranks of the newest checkpoint: each saves its own data position and RNG streams there."""
    if not checkpoints:
        return None
    folder, meta = checkpoints[-1]
    if meta and isinstance(meta.get("world_size"), int):
        return meta["world_size"]
    ranks = len(list((folder / "ranks").glob("rank_*"))) if (folder / "ranks").is_dir() else 0
    return ranks or None


# ----------------------------------------------------------------------------------------------- where it is


@dataclass
class RunSummary:
    """A run as a table row: what it trains and where it stands."""

    name: str
    """Its folder relative to the root it was found under."""
    path: Path
    stage: str | None
    family: str | None
    mode: str | None
    status: str
    """``running`` (its trainer holds the lock), ``finished``, ``stopped`` (resumable), ``failed`` (its last event
    is an error) or ``new`` (nothing trained yet)."""
    step: int | None
    max_steps: int | None
    samples: int | None
    loss: float | None
    images_per_second: float | None
    last_save: float | None
    """Unix time of the newest complete checkpoint."""
    disk_bytes: int
    problem: str | None = None
    """What could not be read (a damaged metrics file, an unreadable config), one line."""

    def to_json(self) -> dict[str, Any]:
        row = asdict(self)
        row["path"] = str(self.path)
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def summary(path: Path, root: Path | None = None) -> RunSummary:
    path = Path(path)
    text, config, _ = read_config(path)
    train = config.get("train") if isinstance(config.get("train"), dict) else {}
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    last = {}
    for record in _last_records(path / "metrics.jsonl"):
        last.update(record)
    checkpoints = checkpoint_folders(path)
    newest_meta = _meta(checkpoints[-1]) if checkpoints else None
    mode = config.get("mode")
    problems = []
    if text is not None and not config:
        problems.append("config.yaml is not a YAML mapping")
    if newest_meta is None and checkpoints:
        problems.append(f"{checkpoints[-1].name}/meta.json is unreadable")
    return RunSummary(
        name=str(path.relative_to(root)) if root is not None else path.name, path=path,
        stage=config.get("stage"), family=(newest_meta or {}).get("family") or model.get("family"),
        mode="+".join(mode) if isinstance(mode, list) else mode,
        status=status(path, last.get("step"), train.get("max_steps"), saved=bool(checkpoints)),
        step=last.get("step"), max_steps=train.get("max_steps") if isinstance(train.get("max_steps"), int) else None,
        samples=last.get("samples") if is_number(last.get("samples")) else None,
        loss=last.get("loss") if is_number(last.get("loss")) else None,
        images_per_second=last.get("img_per_s") if is_number(last.get("img_per_s")) else None,
        last_save=checkpoints[-1].stat().st_mtime if checkpoints else None, disk_bytes=disk_bytes(path),
        problem="; ".join(problems) or None)


def status(path: Path, step: int | None = None, max_steps: Any = None, saved: bool | None = None) -> str:
    """Where the run stands (`RunSummary.status`); `saved`: whether it has a complete checkpoint, where the caller
    has listed them already (else they are listed here)."""
    if is_locked(path / LOCK):
        return "running"
    events = read_events(path)
    last = events[-1]["event"] if events else None
    if last == "end" or (last is None and isinstance(max_steps, int) and step is not None and step >= max_steps):
        return "finished"
    if last == "error":
        return "failed"
    if last in ("stop", "save", "start", "validation") or (saved if saved is not None else checkpoint_folders(path)):
        return "stopped"
    return "new"


def is_locked(lock: Path) -> bool:
    """Whether a trainer holds this run's lock, asked without taking it (a lock taken even briefly could refuse a
    trainer starting at that instant): from the kernel's table of flock locks where it has one."""
    try:
        found = lock.stat()
    except OSError:
        return False
    try:
        table = Path("/proc/locks").read_text()
    except OSError:
        return _holder_alive(lock)
    wanted = f"{os.major(found.st_dev):02x}:{os.minor(found.st_dev):02x}:{found.st_ino}"
    return any(line.split()[1] == "FLOCK" and line.split()[5] == wanted for line in table.splitlines()
               if len(line.split()) > 5)


def _holder_alive(lock: Path) -> bool:
    """Where the kernel keeps no table: whether the process the lock file names on this host is alive."""
    import socket

    found = re.search(r"pid (\d+) on (\S+?),", lock.read_text(errors="replace"))
    if found is None or found.group(2) != socket.gethostname():
        return False
    try:
        os.kill(int(found.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def disk_bytes(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue  # removed while walking: a checkpoint rotated out
    return total


def find_runs(root: Path) -> list[Path]:
    """The run folders under `root` (itself included), at most three levels down, sorted by path; a run's own
    subfolders (checkpoints, samples) are not searched."""
    root = Path(root)
    found = []

    def walk(folder: Path, depth: int) -> None:
        if is_run(folder):
            found.append(folder)
            return
        if depth >= _MAX_DEPTH:
            return
        try:
            children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            return
        for child in children:
            walk(child, depth + 1)

    walk(root, 0)
    return found


# ------------------------------------------------------------------------------------------ what happened


def read_events(path: Path, after: int = 0) -> list[dict[str, Any]]:
    """events.jsonl's records from line `after` on, each with its line ``index``; a half-written last line is
    left for the next read."""
    try:
        lines = (path / EVENTS).read_text(errors="replace").splitlines()
    except OSError:
        return []
    found = []
    for index, line in enumerate(lines[after:], start=after):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("event"), str):
            found.append({**record, "index": index})
    return found


def log_tail(path: Path, lines: int = 200) -> list[str]:
    try:
        with open(path / TRAIN_LOG, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 200 * lines))
            text = handle.read().decode(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


def request_stop(path: Path) -> None:
    """Ask the run's trainer to save and stop after the step in progress (it removes the request when it stops).
    Does nothing to a run no trainer holds."""
    (Path(path) / STOP_REQUEST).write_text(f"requested at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment() -> list[tuple[str, str]]:
    """The machine this is read on, which is the training machine when the run ends with it."""
    from sdtrain.flops import cpu_flags

    rows = [("sdtrain", __version__)]
    rows += [(p, _version(p)) for p in ("torch", "diffusers", "transformers", "tokenizers", "peft")]
    rows.append(("Python", f"{platform.python_version()} ({sys.executable})"))
    rows.append(("Platform", platform.platform()))
    cpu = cpu_flags()
    flags = ", ".join(k for k, v in cpu.items() if k != "model" and v) or "none of avx2, avx512f, amx"
    rows.append(("CPU", f"{cpu.get('model') or platform.processor() or '?'}; {os.cpu_count()} logical cores; "
                        f"{flags}"))
    rows += _torch_rows()
    return rows


def _torch_rows() -> list[tuple[str, str]]:
    try:
        import torch
    except ImportError:
        return []
    rows = [("torch CPU kernels", torch.backends.cpu.get_cpu_capability())]
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        rows.append(("CUDA", f"{torch.version.cuda}; " + ", ".join(f"{i}: {n}" for i, n in enumerate(names))))
    else:
        rows.append(("CUDA", "no device visible"))
    return rows
