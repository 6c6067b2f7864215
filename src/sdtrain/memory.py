"""Host memory of a process tree as the machine sees it: the trainer, its loader workers, and the ranks a
launcher started, sampled while they run.

A process's own high-water mark (``ru_maxrss``) misses what its children hold, and adding up resident
sets counts pages that processes share once per process. So every process of the tree is counted once,
by what it adds:

- the root, and a large process started afresh (a trainer under a launcher, a rank): its resident set,
  which is cheap to read at any size;
- a large process forked from a large one (a loader worker forked from its trainer): only the pages it
  alone maps (its unique set); the rest are its parent's, already counted;
- a small process (a loader worker forked from the fork server, the server itself, a launcher): its
  proportional set, which splits the pages it shares with its siblings between them.

Unique and proportional sizes walk a process's mappings (4 ms for a loader worker, 80 ms for 8 GiB), so
a sampler re-reads them only every few seconds: what such processes hold changes slowly, while a
trainer's peak comes and goes within a step. Linux only; elsewhere the tree is the process alone.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# Above this a process is a trainer, a rank or a fork of one; below it a worker, a server or a launcher.
_LARGE = 1 << 30


def descendants(pid: int) -> list[tuple[int, int]]:
    """(process, its parent) for every live process below `pid`, parents before their children."""
    found: list[tuple[int, int]] = []
    pending = [pid]
    while pending:
        parent = pending.pop(0)
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            with contextlib.suppress(OSError, ValueError):
                children = [int(c) for c in (task / "children").read_text().split()]
                found += [(child, parent) for child in children]
                pending += children
    return found


def _resident(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE


def _rollup(pid: int, fields: tuple[str, ...]) -> int:
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            name, _, value = line.partition(":")
            if name in fields:
                total += int(value.split()[0]) * 1024
    return total


def _walked(pid: int, forked_from_large: bool) -> int:
    """The size that needs a walk of the mappings: unique for a fork of a large process, else proportional."""
    return _rollup(pid, ("Private_Clean", "Private_Dirty") if forked_from_large else ("Pss",))


def tree_bytes(pid: int | None = None) -> int:
    """The memory of `pid` (this process by default) and everything it started, read now."""
    pid = os.getpid() if pid is None else pid
    if not Path(f"/proc/{pid}/statm").exists():
        return own_peak_bytes() if pid == os.getpid() else 0
    return _TreeReader(pid, refresh=0.0).read()


def own_peak_bytes() -> int:
    """This process's own high-water mark, as the kernel keeps it (never missed between samples)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class _TreeReader:
    """Reads a tree's memory, keeping each walked size for `refresh` seconds (or 20 times what reading it
    took, for large processes), so that sampling costs little of the cores the tree itself runs on."""

    def __init__(self, pid: int, refresh: float):
        self.pid = pid
        self.refresh = refresh
        self._walked: dict[int, tuple[float, float, int]] = {}
        """pid -> (when read, seconds reading it took, size)."""

    def read(self) -> int:
        try:
            total = _resident(self.pid)
        except (OSError, ValueError, IndexError):
            return 0
        sizes: dict[int, int] = {self.pid: total}
        walked: dict[int, tuple[float, float, int]] = {}
        for child, parent in descendants(self.pid):
            try:
                resident = _resident(child)
            except (OSError, ValueError, IndexError):
                continue
            sizes[child] = resident
            if resident > _LARGE and sizes.get(parent, 0) <= _LARGE:
                total += resident
                continue
            clock = time.monotonic()
            read_at, cost, size = self._walked.get(child, (float("-inf"), 0.0, 0))
            if clock - read_at > max(self.refresh, 20 * cost):
                with contextlib.suppress(OSError, ValueError):
                    size = _walked(child, resident > _LARGE)
                    read_at, cost = clock, time.monotonic() - clock
            walked[child] = (read_at, cost, size)
            total += size
        self._walked = walked
        return total


class TreePeak:
    """Samples a process tree's memory in a background thread and keeps the peak of each phase
    (say, loading the models, then training), so one run reports both."""

    def __init__(self, pid: int | None = None, interval: float = 0.1, phase: str = "start", refresh: float = 2.0):
        self.pid = os.getpid() if pid is None else pid
        self.interval = interval
        self.peaks: dict[str, int] = {}
        self._reader = _TreeReader(self.pid, refresh)
        self._linux = Path(f"/proc/{self.pid}/statm").exists()
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
        with self._lock:
            now = self._reader.read() if self._linux else tree_bytes(self.pid)
            self.peaks[self._phase] = max(self.peaks.get(self._phase, 0), now)
        return now

    def peak(self, phase: str | None = None) -> int:
        with self._lock:
            return self.peaks.get(phase, 0) if phase is not None else max(self.peaks.values(), default=0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()
