"""``train.threads: auto``: torch's CPU threads follow the cores the run gets while other processes share them.

Every intra-op thread waits for the others at the end of each parallel region, so a thread that shares its core
with another process holds up all of them: with a busy loop on one of two cores, the shapes demo's UNet step took
1.56 s on two threads and 0.76 s on one (0.43 s on two, idle). Between logging points the tuner reads how much of
the run's cores other processes used (``/proc/stat`` less the CPU time of this process and its children, the loader
workers) and, when that leaves fewer or more cores than it has threads, tries one thread fewer or more for the next
window and keeps the count whose steps were faster. A probe that loses is not retried for a while, each loss doubling
the wait, so a loaded or noisy machine does not pay for probes at every window.

Floating-point sums split over another thread count round differently: a run whose count changed is not bitwise
repeatable, which is why this is asked for (``train.threads: auto``) and not the default.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sdtrain.memory import descendants

log = logging.getLogger(__name__)

FASTER = 0.05
"""How much shorter a probed thread count's steps must be to be kept: less is within a window's noise."""
LONGEST_WAIT = 32
"""The most windows a lost probe waits before the same move is tried again."""
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
DEFAULT_THREADS = torch.get_num_threads()
"""torch's count when this module was first imported: the most ``auto`` uses, whatever a script set since."""


def _allowed_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def busy_seconds(cpus: set[int]) -> float | None:
    """CPU seconds spent on `cpus` by anything (not idle, not waiting on I/O) since boot, or None off Linux."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(f) for f in fields[:8]]
        busy += sum(ticks) - ticks[3] - ticks[4]
    return busy / _TICK


def tree_seconds(pid: int | None = None) -> dict[int, float]:
    """CPU seconds of `pid` (this process by default) and each live process below it, by process."""
    root = os.getpid() if pid is None else pid
    seconds: dict[int, float] = {}
    for process in [root, *(child for child, _ in descendants(root))]:
        try:
            stat = Path(f"/proc/{process}/stat").read_text()
        except OSError:
            continue
        after_name = stat[stat.rfind(")") + 2:].split()
        seconds[process] = (int(after_name[11]) + int(after_name[12])) / _TICK
    return seconds


@dataclass
class Usage:
    """What the run's cores, and this process with its children, had spent at one moment."""

    wall: float
    busy: float
    tree: dict[int, float]

    def others_until(self, later: Usage) -> float:
        """Cores that processes outside this tree kept busy on average from this moment to `later`."""
        ours = sum(seconds - self.tree.get(pid, 0.0) for pid, seconds in later.tree.items())
        return max(0.0, (later.busy - self.busy - ours) / max(later.wall - self.wall, 1e-9))


def usage_now(cpus: set[int], read_busy: Callable[[set[int]], float | None] = busy_seconds,
              read_tree: Callable[[], dict[int, float]] = tree_seconds,
              clock: Callable[[], float] = time.perf_counter) -> Usage | None:
    """The usage of `cpus` and of this process tree now, or None where the machine does not say (not Linux)."""
    busy = read_busy(cpus)
    return None if busy is None else Usage(clock(), busy, read_tree())


def threads_left(cpus: int, others: float, most: int) -> int:
    """The thread count that fits the `cpus` other processes leave (`others` cores busy), 1 to `most`."""
    return max(1, min(most, round(cpus - others)))


class LoadWatch:
    """For a script of commands in one process (``sdtrain demo``): the thread count the cores other processes left
    during the last command, for a command that runs no trainer of its own (encoding, sampling)."""

    def __init__(self) -> None:
        self.cpus = _allowed_cpus()
        self.most = DEFAULT_THREADS
        self.last = usage_now(self.cpus) if self.cpus else None

    def threads(self) -> int:
        """Threads for the next command, from what other processes used since the last call."""
        before, self.last = self.last, usage_now(self.cpus) if self.cpus else None
        if before is None or self.last is None:
            return self.most
        return threads_left(len(self.cpus), before.others_until(self.last), self.most)


@dataclass
class ThreadTuner:
    """Moves torch's thread count between 1 and `most` as other processes take or free the run's `cpus`."""

    most: int
    cpus: set[int]
    read_busy: Callable[[set[int]], float | None] = busy_seconds
    read_tree: Callable[[], dict[int, float]] = tree_seconds
    clock: Callable[[], float] = time.perf_counter
    set_threads: Callable[[int], None] = torch.set_num_threads
    threads: int = 0
    window: tuple[int, Usage] | None = None
    """The step the current window began at, and the usage then."""
    probe: tuple[int, float] | None = None
    """While a probe runs: the thread count before it and the seconds a step took there."""
    waits: dict[int, int] = field(default_factory=dict)
    """Per direction (-1, +1): windows left before that move is probed again."""
    lost: dict[int, int] = field(default_factory=dict)
    """Per direction: the wait after the next lost probe."""

    started: int = 0
    """The count the run started on, which `finish` gives back."""

    def __post_init__(self) -> None:
        self.threads = self.threads or self.most
        self.started = self.threads

    @classmethod
    def for_run(cls, threads: int | str, device: torch.device) -> ThreadTuner | None:
        """The tuner of a run on `device` with train.threads=`threads`, or None when it keeps its count."""
        cpus = _allowed_cpus()
        if threads != "auto" or device.type != "cpu" or cpus is None or busy_seconds(cpus) is None:
            return None
        # A script of commands (sdtrain demo) may start the run on fewer, from what the command before it saw.
        return cls(most=max(DEFAULT_THREADS, torch.get_num_threads()), cpus=cpus, threads=torch.get_num_threads())

    def restart(self, step: int) -> None:
        """Begin a window at `step`: what came before it (an evaluation, a save) is not judged."""
        usage = usage_now(self.cpus, self.read_busy, self.read_tree, self.clock)
        self.window = None if usage is None else (step, usage)

    def observe(self, step: int) -> None:
        """End the window at `step`, settle a probe that ran in it or start one, and begin the next window."""
        window = self.window
        self.restart(step)
        if window is None or self.window is None or step <= window[0]:
            return
        (first, before), now = window, self.window[1]
        pace = (now.wall - before.wall) / (step - first)
        if self.probe is not None:
            self._settle(pace)
            return
        wanted = threads_left(len(self.cpus), before.others_until(now), self.most)
        move = (wanted > self.threads) - (wanted < self.threads)
        if not move:
            return
        if self.waits.get(move, 0) > 0:
            self.waits[move] -= 1
            return
        self.probe = (self.threads, pace)
        self._use(self.threads + move)
        log.debug("other processes left %d of %d cores: trying %d threads (%.2f s a step on %d)", wanted,
                  len(self.cpus), self.threads, pace, self.probe[0])

    def finish(self) -> None:
        """Give torch back the count the run started with (a process that trains again starts from it)."""
        if self.threads != self.started:
            self._use(self.started)

    def _settle(self, pace: float) -> None:
        before, before_pace = self.probe
        self.probe = None
        move = self.threads - before
        if pace < (1 - FASTER) * before_pace:
            self.lost[move] = 1
            log.info("train.threads=auto: %d threads (%.2f s a step, %.2f on %d)", self.threads, pace, before_pace,
                     before)
            return
        wait = self.lost.get(move, 1)
        self.waits[move], self.lost[move] = wait, min(2 * wait, LONGEST_WAIT)
        self._use(before)

    def _use(self, threads: int) -> None:
        self.threads = threads
        self.set_threads(threads)
