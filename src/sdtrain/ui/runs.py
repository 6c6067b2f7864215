"""The run folders under the UI's root, as the API shows them: names, summaries, curves, files and differences.

Everything here reads through `sdtrain.runview`, the one view of a run the report and the CLI share, and keeps
what it read while the files it came from are unchanged: a page polling 200 runs of 100,000 logged steps would
otherwise parse every metrics file every few seconds.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdtrain import runview

# A run's id is its folder relative to the root; runview finds runs down to this depth.
MAX_DEPTH = 3
# Enough points for a chart as wide as a screen; spikes survive because each bucket keeps its min and its max.
DEFAULT_POINTS = runview.SCREEN_POINTS
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$")
# Files that make a folder a run, whoever started it (the UI writes its config and job before the trainer starts).
_RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints", "events.jsonl", "train.log", "ui-config.yaml",
                "ui-job.json")
# Parsed runs kept at once: a run of 100,000 logged steps is tens of MB of records, so not all 200 of a root.
_LOADED_RUNS = 12
_THINNED = 256
# A running run's status comes from its lock, which a dying process releases without touching any file.
_RUNNING_RECHECK_S = 2.0


class NotFound(Exception):
    """A run or file the request names is not under the root; the message is the one line the page shows."""


def clean(value: Any) -> Any:
    """JSON-safe: paths as text, NaN and infinities (a diverged loss) as null, which browsers' JSON can read."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def valid_name(name: str) -> bool:
    parts = name.split("/")
    return 0 < len(parts) <= MAX_DEPTH and all(_SEGMENT.match(p) and ".." not in p for p in parts)


def inside(root: Path, path: Path) -> bool:
    """`path`, symlinks followed, is `root` or under it."""
    try:
        path.resolve().relative_to(root.resolve())
    except (ValueError, OSError):
        return False
    return True


def is_run(folder: Path) -> bool:
    return folder.is_dir() and any((folder / marker).exists() for marker in _RUN_MARKERS)


@dataclass
class _Cached:
    stamp: tuple
    read_at: float
    value: Any


class Runs:
    """The root's runs, their summaries and loaded views cached by the stamps of the files they came from."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self._summaries: dict[Path, _Cached] = {}
        self._loaded: OrderedDict[Path, _Cached] = OrderedDict()
        self._thinned: OrderedDict[tuple, dict] = OrderedDict()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------------ naming

    def name(self, run: Path) -> str:
        return run.resolve().relative_to(self.root).as_posix()

    def resolve(self, name: str) -> Path:
        """The run folder `name` names, refusing anything that is not a run folder under the root."""
        run = self.root / name
        if not valid_name(name) or not inside(self.root, run) or not is_run(run):
            raise NotFound(f"no run '{name}' under {self.root}")
        return run

    def split(self, path: str) -> tuple[Path, list[str]]:
        """`a/b/metrics` -> (the run a/b, ["metrics"]): run ids hold slashes, so the shortest run prefix wins."""
        parts = [p for p in path.split("/") if p]
        for depth in range(1, min(MAX_DEPTH, len(parts)) + 1):
            name = "/".join(parts[:depth])
            run = self.root / name
            if valid_name(name) and inside(self.root, run) and is_run(run):
                return run, parts[depth:]
        raise NotFound(f"no run '{'/'.join(parts[:MAX_DEPTH])}' under {self.root}")

    def find(self) -> list[Path]:
        # The root itself is no run of its own here: a run's id is its folder under the root.
        return [run for run in runview.find_runs(self.root) if run != self.root and inside(self.root, run)]

    # ------------------------------------------------------------------------------------------ reading

    def summary(self, run: Path) -> dict[str, Any]:
        stamp = _stamp(run, ("metrics.jsonl", "events.jsonl", ".sdtrain.lock", "stop", "config.yaml",
                             "checkpoints", "samples"))
        with self._lock:
            cached = self._summaries.get(run)
        fresh = cached and cached.stamp == stamp and (
            cached.value.get("status") != "running" or time.monotonic() - cached.read_at < _RUNNING_RECHECK_S)
        if fresh:
            return cached.value
        value = clean(runview.summary(run, self.root).to_json())
        value["id"] = self.name(run)
        with self._lock:
            self._summaries[run] = _Cached(stamp, time.monotonic(), value)
        return value

    def _load_stamp(self, run: Path) -> tuple:
        stamp = _stamp(run, ("metrics.jsonl", "config.yaml", "checkpoints", "samples"))
        return stamp + tuple(_stat(p) for p in sorted(run.glob("config.*.yaml")))

    def load(self, run: Path) -> Any:
        stamp = self._load_stamp(run)
        with self._lock:
            cached = self._loaded.get(run)
            if cached and cached.stamp == stamp:
                self._loaded.move_to_end(run)
                return cached.value
        value = runview.load_run(run) if runview.is_run(run) else _queued(run)
        with self._lock:
            self._loaded[run] = _Cached(stamp, time.monotonic(), value)
            self._loaded.move_to_end(run)
            while len(self._loaded) > _LOADED_RUNS:
                self._loaded.popitem(last=False)
        return value

    def file_url(self, run: Path, path: Path) -> str:
        return f"/api/runs/{self.name(run)}/files/{path.resolve().relative_to(run.resolve()).as_posix()}"

    def detail(self, run: Path) -> dict[str, Any]:
        loaded = self.load(run)
        return clean({
            "summary": self.summary(run),
            "config_text": loaded.config_text,
            "config": loaded.config,
            "metric_keys": loaded.metrics.keys(),
            "samples": [{"step": step, "url": self.file_url(run, path)} for step, path in loaded.samples],
            "checkpoints": [self._checkpoint(run, folder, meta) for folder, meta in loaded.checkpoints],
            "log": runview.log_tail(run),
        })

    def _checkpoint(self, run: Path, folder: Path, meta: dict | None) -> dict[str, Any]:
        files = sorted(p for p in folder.rglob("*") if p.is_file())[:500]
        return {"name": folder.name, "meta": meta,
                "files": [{"path": p.relative_to(folder).as_posix(), "size": p.stat().st_size,
                           "url": self.file_url(run, p), "weights": p.suffix == ".safetensors"} for p in files]}

    def file(self, run: Path, relative: str) -> Path:
        """A file inside `run`; anything that leads out of it (.., absolute, a symlink) is not found."""
        path = run / relative
        if not relative or relative.startswith("/") or not inside(run, path) or not path.is_file():
            raise NotFound(f"no file '{relative}' in run '{self.name(run)}'")
        return path

    def metrics(self, run: Path, keys: list[str] | None, by: str, lo: float | None, hi: float | None,
                points: int = DEFAULT_POINTS) -> dict[str, Any]:
        # A compare page asks every run's curve again on each change of metric or axis: answers are kept.
        asked = (run, self._load_stamp(run), tuple(keys or ()), by, lo, hi, points)
        with self._lock:
            if asked in self._thinned:
                return self._thinned[asked]
        answer = self._metrics(run, keys, by, lo, hi, points)
        with self._lock:
            self._thinned[asked] = answer
            while len(self._thinned) > _THINNED:
                self._thinned.popitem(last=False)
        return answer

    def _metrics(self, run: Path, keys: list[str] | None, by: str, lo: float | None, hi: float | None,
                 points: int) -> dict[str, Any]:
        loaded = self.load(run).metrics
        available = loaded.keys()
        keys = [k for k in (keys or available) if k in available]
        series = {}
        for key in keys:
            xs, ys = _series(loaded.records, key, by)
            xs, ys = _window(xs, ys, lo, hi)
            series[key] = dict(zip(("x", "y"), runview.thin(xs, ys, points)))
        return clean({"by": by, "keys": available, "series": series})

    def compare(self, runs: list[Path]) -> dict[str, Any]:
        # Configs and samples only: parsing every run's metrics here would make comparing 200 runs wait minutes.
        flat = [flatten(runview.read_config(run)[1]) for run in runs]
        keys = sorted({key for config in flat for key in config})
        differences = [{"key": key, "values": [config.get(key) for config in flat]} for key in keys
                       if len({repr(config.get(key)) for config in flat}) > 1]
        samples = [{step: self.file_url(run, path) for step, path in runview.read_samples(run)} for run in runs]
        common = sorted(set.intersection(*(set(s) for s in samples)) if samples else set())
        return clean({"runs": [self.summary(run) for run in runs], "differences": differences,
                      "common_sample_steps": common,
                      "samples": [{str(step): url for step, url in s.items()} for s in samples]})


def _queued(run: Path) -> runview.Run:
    """A run the UI queued, before its trainer writes anything: the config it was given, nothing else yet."""
    given = run / "ui-config.yaml"
    text = given.read_text(errors="replace") if given.is_file() else None
    return runview.Run(path=run, config_text=text, config={}, later_configs=[], metrics=runview.Metrics(),
                       samples=[], checkpoints=[])


def _stat(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


def _stamp(run: Path, names: tuple[str, ...]) -> tuple:
    return tuple(_stat(run / name) for name in names)


def _series(records: list[dict], key: str, by: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for record in records:
        x, y = record.get(by), record.get(key)
        if _number(x) and _number(y):
            xs.append(x)
            ys.append(float(y))
    return xs, ys


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _window(xs: list[float], ys: list[float], lo: float | None, hi: float | None) -> tuple[list, list]:
    if lo is None and hi is None:
        return xs, ys
    # One point either side of the window, so a zoomed line runs to the chart's edges.
    import bisect

    start = max(bisect.bisect_left(xs, lo) - 1, 0) if lo is not None else 0
    end = min(bisect.bisect_right(xs, hi) + 1, len(xs)) if hi is not None else len(xs)
    return xs[start:end], ys[start:end]


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """Nested config as dotted keys (`optim.lr`); lists stay values, as the command line writes them."""
    if not isinstance(config, dict):
        return {prefix: config} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        flat.update(flatten(value, name) if isinstance(value, dict) and value else {name: value})
    return flat
