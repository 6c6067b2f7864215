"""Host memory of a process tree as the machine sees it: the trainer, its loader workers, and the ranks a
launcher started, sampled while they run.

A process's own high-water mark (``ru_maxrss``) misses what its children hold, and adding up resident
sets counts pages that processes share once per process. The exact sum is of proportional set sizes
(each shared page split between the processes mapping it), but reading one walks a process's mappings:
4 ms for a loader worker, 80 ms for 8 GiB. So:

- a large process that shares little (a trainer whose loader workers come from a fork server, a rank) is
  counted by its resident set, cheap to read at any size, at every sample;
- every other process (a small one: a worker, a fork server, a launcher; a large one forked from a large
  one, and that parent) by its resident set now, less what its resident set exceeded its proportional one
  by at the last walk. Walks are repeated only every few seconds (and never more often than 20 times their
  own cost): what such processes share changes slowly, while a trainer's peak comes and goes within a step.

Linux only; elsewhere the tree is the process alone.
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


def _proportional(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def tree_bytes(pid: int | None = None) -> int:
    """The memory of `pid` (this process by default) and everything it started, read now."""
    return _TreeReader(os.getpid() if pid is None else pid, refresh=0.0).read()


def own_peak_bytes() -> int:
    """This process's own high-water mark, as the kernel keeps it (never missed between samples)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class _TreeReader:
    """Reads a tree's memory as the module docstring describes, keeping what each walk found."""

    def __init__(self, pid: int, refresh: float):
        self.pid = pid
        self.refresh = refresh
        self._shared: dict[int, tuple[float, float, int]] = {}
        """pid -> (when walked, seconds the walk took, resident less proportional size then)."""

    def read(self) -> int:
        if not Path(f"/proc/{self.pid}/statm").exists():  # not Linux: the process's own high-water mark
            return own_peak_bytes() if self.pid == os.getpid() else 0
        tree = [(self.pid, 0), *descendants(self.pid)]
        resident: dict[int, int] = {}
        for pid, _ in tree:
            with contextlib.suppress(OSError, ValueError, IndexError):
                resident[pid] = _resident(pid)
        # Pages a large process shares with another large one: only a fork does that.
        forked = {pid for pid, parent in tree if resident.get(pid, 0) > _LARGE and resident.get(parent, 0) > _LARGE}
        sharing = forked | {parent for pid, parent in tree if pid in forked}
        total, shared = 0, {}
        for pid, size in resident.items():
            if size > _LARGE and pid not in sharing:
                total += size
                continue
            clock = time.monotonic()
            walked_at, cost, excess = self._shared.get(pid, (float("-inf"), 0.0, 0))
            if clock - walked_at > max(self.refresh, 20 * cost):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    excess = _resident(pid) - _proportional(pid)
                    walked_at, cost = clock, time.monotonic() - clock
            shared[pid] = (walked_at, cost, excess)
            total += max(0, size - excess)
        self._shared = shared
        return total


class TreePeak:
    """Samples a process tree's memory in a background thread and keeps the peak of each phase
    (say, loading the models, then training), so one run reports both."""

    def __init__(self, pid: int | None = None, interval: float = 0.1, phase: str = "start", refresh: float = 2.0):
        self.pid = os.getpid() if pid is None else pid
        self.interval = interval
        self.peaks: dict[str, int] = {}
        self._reader = _TreeReader(self.pid, refresh)
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
            now = self._reader.read()
            self.peaks[self._phase] = max(self.peaks.get(self._phase, 0), now)
        return now

    def peak(self, phase: str | None = None) -> int:
        with self._lock:
            return self.peaks.get(phase, 0) if phase is not None else max(self.peaks.values(), default=0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()
