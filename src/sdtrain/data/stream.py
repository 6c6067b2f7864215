"""The stream one loader slot reads: its share of each epoch's order, decoded, bucketed and collated into
batches that carry the slot's position (see sdtrain.data.order)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from sdtrain.config import DataConfig
from sdtrain.data.decode import COMPANION_FIELDS, Filtered, SampleDecoder, present
from sdtrain.data.encoded import TEXT_FIELDS
from sdtrain.data.order import (
    Intervals,
    Shard,
    SlotCursor,
    drop_prefix,
    epoch_order,
    read_shard,
    slot_intervals,
    within_shard_order,
)

log = logging.getLogger(__name__)


class ShardStream(IterableDataset):
    """An endless, resumable stream of batches over shards; see the module docstring."""

    def __init__(
        self,
        shards: list[Shard],
        config: DataConfig,
        tokenizer: Any | None,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        cursors: dict[int, SlotCursor] | None = None,
        skipped: dict[int, int] | None = None,
        rotation: int = 0,
        filtered: dict[int, int] | None = None,
        plans: dict[int, list[Intervals]] | None = None,
        empty_caption: dict[str, torch.Tensor] | None = None,
    ):
        self.shards = shards
        self.config = config
        self.tokenizer = tokenizer
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.workers = max(1, config.num_workers)
        self.cursors = cursors or {}
        self.skipped = skipped or {}
        self.filtered = filtered or {}
        self.rotation = rotation
        self.plans = plans or {}
        # Pre-encoded shards: caption dropout swaps in the empty caption's embeddings (text field -> tensor).
        self.empty_caption = empty_caption
        self.decoder = SampleDecoder(config, tokenizer, seed, encoded=empty_caption is not None)
        self.total = sum(s.samples for s in shards)

    @property
    def slots(self) -> int:
        return self.world_size * self.workers

    def _slot(self) -> int:
        info = get_worker_info()
        worker = 0 if info is None else info.id
        # DataLoader always starts its round-robin at worker 0; rotating the logical slots makes the
        # first batch after a resume come from the slot whose turn it was.
        return self.rank * self.workers + (worker + self.rotation) % self.workers

    def __iter__(self) -> Iterator[dict[str, Any]]:
        slot = self._slot()
        cursor = self.cursors.get(slot, SlotCursor())
        epoch, offset = cursor.epoch, cursor.offset
        skipped = self.skipped.get(slot, 0)
        filtered = self.filtered.get(slot, 0)
        # Samples wait per bucket until a bucket holds a batch (without buckets there is one bucket and
        # nothing waits between batches); a resumed slot first reads its waiting samples again.
        waiting: dict[int, list[tuple[int, int, dict[str, Any]]]] = {}
        for at_epoch, place in cursor.pending:
            sample = self._sample_at(at_epoch, place)
            if isinstance(sample, dict):
                waiting.setdefault(sample["bucket"], []).append((at_epoch, place, sample))
        while True:
            usable = False
            for at_epoch, at_offset, place, sample in self._epoch_samples(slot, epoch, offset):
                if sample is None:
                    skipped += 1
                    continue
                if isinstance(sample, Filtered):
                    filtered += 1
                    continue
                usable = True
                bucket = waiting.setdefault(sample["bucket"], [])
                bucket.append((at_epoch, place, sample))
                if len(bucket) == self.config.batch_size:
                    batch = [entry[2] for entry in bucket]
                    places = [[e, p] for e, p, _ in bucket]
                    bucket.clear()
                    pending = [[e, p] for entries in waiting.values() for e, p, _ in entries]
                    position = {"slot": slot, "epoch": at_epoch, "offset": at_offset, "skipped": skipped,
                                "filtered": filtered, "pending": pending}
                    yield {**self._collate(batch, position), "places": places}
            epoch, offset = epoch + 1, 0
            if not usable:
                # This slot's whole share yielded nothing (say, one unreadable shard). It must still take
                # its turn in the loader's round-robin, or the other slots would wait for it forever.
                pending = [[e, p] for entries in waiting.values() for e, p, _ in entries]
                yield {"empty": True, "position": {"slot": slot, "epoch": epoch, "offset": 0, "skipped": skipped,
                                                   "filtered": filtered, "pending": pending}}

    def _epoch_layout(self, epoch: int) -> tuple[list[int], np.ndarray]:
        """The epoch's shard order and where each shard starts in the epoch's global order."""
        order = epoch_order(self.shards, self.seed, epoch)
        return order, np.cumsum([0] + [self.shards[i].samples for i in order])

    def _locate(self, epoch: int, place: int) -> tuple[int, int]:
        """(shard index, sample index in the shard) at `place` in the epoch's global order."""
        order, bounds = self._epoch_layout(epoch)
        j = int(np.searchsorted(bounds, place, side="right") - 1)
        shard_index = order[j]
        perm = within_shard_order(self.shards[shard_index].samples, self.seed, epoch, shard_index)
        return shard_index, int(perm[place - bounds[j]])

    def _sample_at(self, epoch: int, place: int) -> Any:
        shard_index, index = self._locate(epoch, place)
        raw = self._read_shard(shard_index)
        return self.decoder(raw[index], (epoch, shard_index, index)) if index < len(raw) else None

    def _epoch_samples(self, slot: int, epoch: int, offset: int) -> Iterator[tuple[int, int, int, Any]]:
        """(epoch, this slot's offset after the sample, the sample's place in the epoch order, decoded sample or
        None) from `offset` to the end of the slot's share."""
        order, bounds = self._epoch_layout(epoch)
        done = offset
        for start, end in drop_prefix(slot_intervals(self.total, slot, self.slots, self.plans, epoch), offset):
            position = start
            while position < end:
                j = int(np.searchsorted(bounds, position, side="right") - 1)
                shard_index = order[j]
                first, last = position - bounds[j], min(end, bounds[j + 1]) - bounds[j]
                raw = self._read_shard(shard_index)
                perm = within_shard_order(self.shards[shard_index].samples, self.seed, epoch, shard_index)
                for k in range(first, last):
                    index = int(perm[k])
                    sample = None
                    if index < len(raw):
                        sample = self.decoder(raw[index], (epoch, shard_index, index))
                        if sample is None:
                            log.warning("skipped undecodable sample %s in %s", raw[index].get("__key__"),
                                        self.shards[shard_index].url)
                    position += 1
                    done += 1
                    yield epoch, done, position - 1, sample
                if len(raw) < self.shards[shard_index].samples:
                    log.warning("%s: %d of the %d samples the manifest lists are readable (a truncated or corrupt "
                                "tar, or a wrong manifest: `sdtrain prepare verify` tells which); the rest are "
                                "skipped", self.shards[shard_index].url, len(raw), self.shards[shard_index].samples)

    def _read_shard(self, shard_index: int) -> list[dict[str, Any]]:
        return read_shard(self.shards[shard_index].url)

    def _collate(self, batch: list[dict[str, Any]], position: dict[str, Any]) -> dict:
        captions = [s["caption"] for s in batch]
        out: dict[str, Any] = {"captions": captions, "keys": [s["key"] for s in batch], "position": position,
                               "size_ids": torch.stack([s["size_ids"] for s in batch])}
        if any("mask" in s for s in batch):
            # A sample without a mask counts everywhere: ones the shape of another's mask.
            shape = next(s["mask"].shape for s in batch if "mask" in s)
            out["mask"] = torch.stack([s["mask"] if "mask" in s else torch.ones(shape) for s in batch])
        # The loader's one draw per sample behind its caption's dropout, for what a mode drops with the caption.
        out["caption_draws"] = torch.tensor([s["caption_draw"] for s in batch], dtype=torch.float64)
        for field in COMPANION_FIELDS:
            if any(field in s for s in batch):
                # A sample without one gets zeros, and which have one is said: a black map is no control, but
                # zero pixels are a grey source, which the mode replaces (or refuses).
                shape = next(s[field].shape for s in batch if field in s)
                out[field] = torch.stack([s[field] if field in s else torch.zeros(shape) for s in batch])
                out[present(field)] = torch.tensor([field in s for s in batch])
        if "pixel_values" in batch[0]:
            out["pixel_values"] = torch.stack([s["pixel_values"] for s in batch])
        else:
            out["latent_mean"] = torch.stack([s["latent_mean"] for s in batch])
            out["latent_std"] = torch.stack([s["latent_std"] for s in batch])
            for field in TEXT_FIELDS:
                empty = self.empty_caption.get(field)
                if empty is not None and all(field in s for s in batch):
                    out[field] = torch.stack([empty if s["dropped"] else s[field] for s in batch])
        if self.tokenizer is not None:
            out.update(self.tokenizer(captions))
        return out
