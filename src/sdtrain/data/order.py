"""Shards, the one order a run reads them in, and each rank's resumable position in it.

Every epoch has one global order: shards in a seeded permutation, samples within each shard in
a seeded permutation; the epochs follow one another as one sequence of samples. That sequence is
cut into *units* of `data.batch_size` samples, unit n holding samples n*B to (n+1)*B - 1, and rank r
of W reads units r, r + W, r + 2W, ...: a step's global batch is the same samples whatever the number
of ranks (1 x 2 micro-batches reads units 0 and 1 as 2 ranks do), and within an epoch every sample is
read once. Loader workers only share the decoding of a rank's units, so their number changes nothing.
Augmentation and caption dropout draw from an RNG keyed by the sample's place in its epoch.

Batches are formed in the rank's process from its units in order: a sample that is skipped (unreadable)
or filtered leaves its unit short, and the rank's next samples fill the batch (with aspect buckets each
bucket fills its own). A rank's whole position is the next unit it reads and the samples read but not
yet batched; a resumed run continues there. Resumed on another number of ranks, the run continues the
same sequence from the first unit some rank had not read yet, skipping those another rank had already
read and dealing out what waited in part-filled batches, so every sample is still read once.
"""

from __future__ import annotations

import logging
import os
import tarfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sdtrain.data.remote import is_remote, read_json
from sdtrain.data.shards import MANIFEST_NAME, read_manifest, tar_keys, tar_samples
from sdtrain.data.sources import expand_spec
from sdtrain.errors import UserError, first_line

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    url: str
    samples: int


def count_samples(path: str) -> int:
    """Number of distinct keys in a local tar, counting what precedes any damage."""
    keys = set()
    try:
        keys.update(tar_keys(path))
    except (tarfile.TarError, OSError) as exc:
        log.warning("%s: unreadable past %d samples (%s); the rest is skipped", path, len(keys), exc)
    return len(keys)


def resolve_shards(spec: str) -> list[Shard]:
    """Expand a directory, glob or brace pattern into shards with their sample counts.

    Counts come from the folder's manifest.json when there is one (``sdtrain prepare`` writes it);
    local shards without one are counted by scanning their headers.
    """
    urls = expand_spec(spec)
    if not urls:
        raise UserError(f"data.shards: no shards match '{spec}'; point it at a folder of .tar files or a pattern")
    counts: dict[str, int] = {}
    for folder in {os.path.dirname(u) for u in urls if not is_remote(u)}:
        manifest = read_manifest(folder) if os.path.isdir(folder) else None
        for entry in (manifest or {}).get("shards", []):
            counts[os.path.join(folder, entry["name"])] = int(entry["samples"])
    for folder in {u.rsplit("/", 1)[0] for u in urls if is_remote(u) and not u.startswith("pipe:")}:
        manifest = read_json(f"{folder}/{MANIFEST_NAME}")
        for entry in (manifest or {}).get("shards", []):
            counts[f"{folder}/{entry['name']}"] = int(entry["samples"])
    shards = []
    for url in urls:
        if url in counts:
            shards.append(Shard(url, counts[url]))
        elif is_remote(url):
            # Without a manifest the only way to know a stream's size is to read it once.
            log.warning("%s: no manifest.json beside it; reading it once to count its samples", url)
            shards.append(Shard(url, len(read_shard(url))))
        elif not os.path.isfile(url):
            raise UserError(f"data.shards: {url} does not exist; fix the path or pattern")
        else:
            shards.append(Shard(url, count_samples(url)))
    if sum(s.samples for s in shards) == 0:
        raise UserError(f"data.shards: the shards of '{spec}' hold no samples")
    return shards


def epoch_order(shards: list[Shard], seed: int, epoch: int) -> list[int]:
    return list(np.random.default_rng([seed, epoch, 0x5A4D]).permutation(len(shards)))


def within_shard_order(samples: int, seed: int, epoch: int, shard_index: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, shard_index, 0x1D]).permutation(samples)


def read_shard(url: str) -> list[dict[str, Any]]:
    """Every sample of a tar that can be read; a damaged tar yields what precedes the damage."""
    errors: list[Exception] = []

    def keep_going(exc: Exception) -> bool:
        errors.append(exc)
        return True

    samples = list(tar_samples(url, handler=keep_going))
    if errors:
        log.warning("%s: %s", url, first_line(errors[0]))
    return samples


@dataclass
class DataPosition:
    """The resumable part of one rank's data stream (see the module docstring)."""

    total: int
    batch_size: int
    rank: int = 0
    world_size: int = 1
    next: int = 0
    """The next of this rank's units to read: unit next * world_size + rank."""
    pending: list[int] = field(default_factory=list)
    """Samples (places in the whole sequence) read but not yet batched, in the order they were read."""
    done: list[int] = field(default_factory=list)
    """Units of this rank that a run on another number of ranks had already read."""
    skipped: int = 0
    filtered: int = 0
    batches: int = 0

    def unit(self, local: int) -> int:
        return local * self.world_size + self.rank

    @property
    def epoch(self) -> int:
        """The oldest epoch this rank still reads from (waiting samples included)."""
        return min([self.unit(self.next) * self.batch_size, *self.pending]) // self.total

    @property
    def total_skipped(self) -> int:
        return self.skipped

    @property
    def total_filtered(self) -> int:
        return self.filtered

    def state_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "batch_size": self.batch_size, "next": self.next,
                "pending": list(self.pending), "done": [u for u in self.done if u >= self.unit(self.next)],
                "skipped": self.skipped, "filtered": self.filtered, "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next = int(state["next"])
        self.pending = [int(p) for p in state["pending"]]
        self.done = sorted(int(u) for u in state["done"])
        self.skipped, self.filtered = int(state["skipped"]), int(state["filtered"])
        self.batches = int(state["batches"])


def relayout(states: list[dict[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
    """This rank's position on `world_size` ranks, from every old rank's position (see the module docstring)."""
    old_world = len(states)
    reached = [int(s["next"]) * old_world + r for r, s in enumerate(states)]
    first = min(reached)
    read = {u for s in states for u in s["done"] if u >= first}
    for end in reached:
        read.update(range(end - old_world, first - 1, -old_world))
    pending = sorted(int(p) for s in states for p in s["pending"])
    return {
        "next": max(0, -(-(first - rank) // world_size)),
        "pending": pending[rank::world_size],
        "done": sorted(u for u in read if u % world_size == rank),
        # The run's counts, kept once.
        **{**_totals(states), **({} if rank == 0 else {"skipped": 0, "filtered": 0})},
    }


def rebatch(states: list[dict[str, Any]], batch_size: int) -> dict[str, Any]:
    """A one-rank position in units of `batch_size`, from every old rank's in units of another batch size: it
    continues from the first unit some rank had not read (what other ranks had read after it is read again)."""
    old = int(states[0]["batch_size"])
    at = min(int(s["next"]) * len(states) + r for r, s in enumerate(states)) * old
    return {**_continue_at(at, sorted(int(p) for s in states for p in s["pending"]), batch_size),
            **_totals(states)}


def _continue_at(at: int, waiting: list[int], batch_size: int) -> dict[str, Any]:
    # Units start at multiples of the batch size; what comes before the next one waits as if read.
    unit = -(-at // batch_size)
    return {"next": unit, "pending": waiting + list(range(at, unit * batch_size)), "done": []}


def _totals(states: list[dict[str, Any]]) -> dict[str, int]:
    """Skipped and filtered samples of every rank (kept per slot by earlier releases), and batches consumed."""
    def count(value: Any) -> int:
        return sum(int(v) for v in value.values()) if isinstance(value, dict) else int(value)

    return {"skipped": sum(count(s["skipped"]) for s in states), "filtered": sum(count(s.get("filtered", 0))
                                                                               for s in states),
            "batches": max(int(s["batches"]) for s in states)}


def from_slots(states: list[dict[str, Any]], total: int, batch_size: int) -> dict[str, Any]:
    """One rank's position from the per-slot positions earlier releases saved (one contiguous range of each
    epoch per rank x worker). With one slot that order is this one and the run continues exactly; with
    several it starts again at the oldest epoch a slot had not finished."""
    cursors = [(int(e), int(o), [(int(pe), int(pp)) for pe, pp in (rest[0] if rest else [])])
               for s in states for e, o, *rest in s["cursors"].values()]
    slots = len(states) * int(states[0]["workers"])
    waiting: list[int] = []
    if slots == 1:
        epoch, offset, pairs = cursors[0] if cursors else (0, 0, [])
        at, waiting = epoch * total + offset, sorted(e * total + p for e, p in pairs)
    else:
        at = min([e for e, _, _ in cursors] + [e for _, _, w in cursors for e, _ in w], default=0) * total
        log.warning("data: the checkpoint's data position is of %d loader slots, from an earlier release; "
                    "the run reads its oldest unfinished epoch again from the start", slots)
    return {**_continue_at(at, waiting, batch_size), **_totals(states)}
