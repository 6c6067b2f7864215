"""Host memory of a process tree as the machine sees it: the trainer, its loader workers, and the ranks a
launcher started, sampled while they run.

A process's own high-water mark (``ru_maxrss``) misses what its children hold, and adding up resident
sets counts pages that processes share once per process. So every process of the tree is counted once:
a large process (a trainer or a rank) by its resident set, which is cheap to read at any size, and a small
one (a loader worker, the fork server, a launcher) by its proportional set size, which splits the library
pages it shares with its siblings between them. Reading a proportional size walks the process's mappings
(some 4 ms for a loader worker), so a sampler refreshes small processes' every few seconds: what they hold
changes slowly, while a trainer's peak comes and goes within a step. Linux only; elsewhere the tree is the
process alone.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# Above this a process is a trainer or a rank: walking its page tables for a proportional size would
# cost tens of milliseconds every sample, and what it shares with the rest of the tree is small.
_LARGE = 1 << 30


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, children first."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            with contextlib.suppress(OSError, ValueError):
                children = [int(c) for c in (task / "children").read_text().split()]
                found += children
                pending += children
    return found


def _resident(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE


def _proportional(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def process_bytes(pid: int, root: bool = False) -> int:
    """What one process of a tree costs: see the module docstring. 0 once it has gone."""
    try:
        resident = _resident(pid)
        return resident if root or resident > _LARGE else _proportional(pid)
    except (OSError, ValueError, IndexError):
        return 0


def tree_bytes(pid: int | None = None) -> int:
    """The memory of `pid` (this process by default) and everything it started."""
    pid = os.getpid() if pid is None else pid
    if not Path(f"/proc/{pid}/statm").exists():
        return own_peak_bytes() if pid == os.getpid() else 0
    return process_bytes(pid, root=True) + sum(process_bytes(child) for child in descendants(pid))


def own_peak_bytes() -> int:
    """This process's own high-water mark, as the kernel keeps it (never missed between samples)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class TreePeak:
    """Samples a process tree's memory in a background thread and keeps the peak of each phase
    (say, loading the models, then training), so one run reports both."""

    def __init__(self, pid: int | None = None, interval: float = 0.1, phase: str = "start", refresh: float = 2.0):
        self.pid = os.getpid() if pid is None else pid
        self.interval = interval
        self.refresh = refresh
        self.peaks: dict[str, int] = {}
        self._small: dict[int, tuple[float, int]] = {}
        self._phase = phase
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sdtrain-memory", daemon=True)

    def __enter__(self) -> TreePeak:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
        self.sample()

    def phase(self, name: str) -> None:
        """Close the current phase (with one last sample) and count what follows under `name`."""
        self.sample()
        with self._lock:
            self._phase = name
        self.sample()

    def sample(self) -> int:
        now = self._tree_bytes()
        with self._lock:
            self.peaks[self._phase] = max(self.peaks.get(self._phase, 0), now)
        return now

    def peak(self, phase: str | None = None) -> int:
        with self._lock:
            return self.peaks.get(phase, 0) if phase is not None else max(self.peaks.values(), default=0)

    def _tree_bytes(self) -> int:
        """tree_bytes, with each small process's proportional size re-read only every `refresh` seconds."""
        if not Path(f"/proc/{self.pid}/statm").exists():
            return tree_bytes(self.pid)
        total, clock, small = process_bytes(self.pid, root=True), time.monotonic(), {}
        for child in descendants(self.pid):
            try:
                resident = _resident(child)
            except (OSError, ValueError, IndexError):
                continue
            if resident > _LARGE:
                total += resident
                continue
            read_at, size = self._small.get(child, (float("-inf"), 0))
            if clock - read_at > self.refresh:
                read_at, size = clock, process_bytes(child)
            small[child] = (read_at, size)
            total += size
        self._small = small
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

