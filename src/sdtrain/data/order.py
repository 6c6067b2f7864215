"""Shards, their order in every epoch, and each loader slot's resumable position in it.

Every epoch has one global order: shards in a seeded permutation, samples within each shard in
a seeded permutation. That order is cut into equal contiguous ranges, one per loader *slot*
(a DataLoader worker; with several ranks, rank x worker), so within an epoch every sample is
read once and every slot reads only about its share of shards. A slot's whole position is
(epoch, offset into its range); batches carry it, the trainer records the position of each
batch it consumes, and a resumed run restarts every slot exactly there. Augmentation and caption
dropout draw from an RNG keyed by the sample's place in the epoch, so they replay identically.

A run resumed with another number of ranks or workers cannot replay the old order; instead the
samples each unfinished epoch still owes are dealt out again, in contiguous pieces, to the new
slots (an epoch *plan*), so the epoch still sees every sample once.
"""

from __future__ import annotations

import logging
import os
import tarfile
from dataclasses import dataclass
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


def slot_range(total: int, slot: int, slots: int) -> tuple[int, int]:
    return total * slot // slots, total * (slot + 1) // slots


Intervals = list[tuple[int, int]]
"""Half-open ranges of places in an epoch's global order."""


def slot_intervals(total: int, slot: int, slots: int, plans: dict[int, list[Intervals]], epoch: int) -> Intervals:
    """What a slot reads in an epoch: its planned pieces after a re-layout, else its equal share."""
    if epoch in plans:
        return plans[epoch][slot]
    return [slot_range(total, slot, slots)]


def drop_prefix(intervals: Intervals, count: int) -> Intervals:
    rest = []
    for start, end in intervals:
        taken = min(count, end - start)
        count -= taken
        if start + taken < end:
            rest.append((start + taken, end))
    return rest


def _deal(intervals: Intervals, slots: int) -> list[Intervals]:
    """Cut the places in `intervals` (in order) into `slots` contiguous pieces of near-equal size."""
    total = sum(end - start for start, end in intervals)
    pieces = []
    for slot in range(slots):
        first, last = slot_range(total, slot, slots)
        pieces.append(_take(drop_prefix(intervals, first), last - first))
    return pieces


def _take(intervals: Intervals, count: int) -> Intervals:
    taken = []
    for start, end in intervals:
        if count <= 0:
            break
        stop = min(end, start + count)
        taken.append((start, stop))
        count -= stop - start
    return taken


@dataclass
class SlotCursor:
    epoch: int = 0
    offset: int = 0
    pending: tuple[tuple[int, int], ...] = ()
    """(epoch, place in the epoch's order) of samples read but still waiting in a part-filled bucket."""


class DataPosition:
    """The resumable part of the data stream: where every slot is and how many batches were consumed."""

    def __init__(self, workers: int):
        self.workers = workers
        self.batches = 0
        # Batches consumed when the current slot layout began; the loader's round-robin restarts there.
        self.layout_start = 0
        self.cursors: dict[int, SlotCursor] = {}
        self.skipped: dict[int, int] = {}
        self.filtered: dict[int, int] = {}
        self.plans: dict[int, list[Intervals]] = {}

    def advance(self, batch: dict[str, Any]) -> None:
        pos = batch["position"]
        self.cursors[pos["slot"]] = SlotCursor(pos["epoch"], pos["offset"],
                                               tuple((int(e), int(p)) for e, p in pos.get("pending", ())))
        self.skipped[pos["slot"]] = pos["skipped"]
        self.filtered[pos["slot"]] = pos.get("filtered", 0)
        self.batches += 1

    @property
    def rotation(self) -> int:
        return (self.batches - self.layout_start) % self.workers

    @property
    def epoch(self) -> int:
        """The oldest epoch a slot still reads from (waiting samples included)."""
        return min((min([c.epoch, *(e for e, _ in c.pending)]) for c in self.cursors.values()), default=0)

    @property
    def total_skipped(self) -> int:
        return sum(self.skipped.values())

    @property
    def total_filtered(self) -> int:
        return sum(self.filtered.values())

    def state_dict(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "batches": self.batches,
            "layout_start": self.layout_start,
            "cursors": {str(k): [c.epoch, c.offset, [list(p) for p in c.pending]] for k, c in self.cursors.items()},
            "skipped": {str(k): v for k, v in self.skipped.items()},
            "filtered": {str(k): v for k, v in self.filtered.items()},
            # Plans of epochs every slot has finished are no longer needed.
            "plans": {str(e): [[list(iv) for iv in slot] for slot in plan]
                      for e, plan in self.plans.items() if e >= self.epoch},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches = int(state["batches"])
        self.layout_start = int(state.get("layout_start", 0))
        self.cursors = {int(k): _cursor(v) for k, v in state["cursors"].items()}
        self.skipped = {int(k): int(v) for k, v in state["skipped"].items()}
        self.filtered = {int(k): int(v) for k, v in state.get("filtered", {}).items()}
        self.plans = self._plans_from(state)

    @staticmethod
    def _plans_from(state: dict[str, Any]) -> dict[int, list[Intervals]]:
        return {int(e): [[(int(a), int(b)) for a, b in slot] for slot in plan]
                for e, plan in state.get("plans", {}).items()}


def _cursor(saved: list) -> SlotCursor:
    pending = tuple((int(e), int(p)) for e, p in saved[2]) if len(saved) > 2 else ()
    return SlotCursor(int(saved[0]), int(saved[1]), pending)


def relayout(states: list[dict[str, Any]], total: int, slots: int) -> dict[str, Any]:
    """One global data position for a new number of slots, from every old rank's position.

    Each epoch some old slot has not finished is dealt out again: the places the old slots have not
    yet read, in their epoch order, cut into contiguous pieces for the new slots. Every new slot
    starts at the oldest unfinished epoch; epochs after the planned ones use the usual equal shares.
    """
    old_workers = int(states[0]["workers"])
    old_slots = len(states) * old_workers
    old = DataPosition(old_workers)
    old.load_state_dict({**states[0], "cursors": {}, "skipped": {}, "filtered": {}, "plans": {}})
    for state in states:
        # Every rank holds the same plans, but each drops an epoch once its own slots are past it.
        for epoch, plan in DataPosition._plans_from(state).items():
            old.plans.setdefault(epoch, plan)
        for key, saved in state["cursors"].items():
            old.cursors[int(key)] = _cursor(saved)
        for key, count in state["skipped"].items():
            old.skipped[int(key)] = int(count)
        for key, count in state.get("filtered", {}).items():
            old.filtered[int(key)] = int(count)
    cursors = [old.cursors.get(slot, SlotCursor()) for slot in range(old_slots)]
    first = min(min([c.epoch, *(e for e, _ in c.pending)]) for c in cursors)
    plans = {}
    for epoch in range(first, max(c.epoch for c in cursors) + 1):
        owed: Intervals = []
        for slot, cursor in enumerate(cursors):
            if cursor.epoch <= epoch:
                share = slot_intervals(total, slot, old_slots, old.plans, epoch)
                owed += drop_prefix(share, cursor.offset if cursor.epoch == epoch else 0)
            # Read but never batched: still owed.
            owed += [(place, place + 1) for e, place in cursor.pending if e == epoch]
        plans[str(epoch)] = [[list(iv) for iv in piece] for piece in _deal(sorted(owed), slots)]
    return {
        "workers": None,  # filled in by the loader that takes it
        "batches": old.batches,
        "layout_start": old.batches,
        "cursors": {str(slot): [first, 0] for slot in range(slots)},
        "skipped": {"0": old.total_skipped},
        "filtered": {"0": old.total_filtered},
        "plans": plans,
    }
