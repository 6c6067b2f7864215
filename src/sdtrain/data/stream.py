"""What a rank's loader workers read: its units of the run's sample order (see sdtrain.data.order), each
decoded by one worker, in turn."""

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
from sdtrain.data.order import Shard, epoch_order, read_shard, within_shard_order

log = logging.getLogger(__name__)


class ShardStream(IterableDataset):
    """An endless stream of this rank's units from `start` on, one item per unit (see `__iter__`)."""

    def __init__(
        self,
        shards: list[Shard],
        config: DataConfig,
        tokenizer: Any | None,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        start: int = 0,
        pending: list[int] | None = None,
        done: list[int] | None = None,
        empty_caption: dict[str, torch.Tensor] | None = None,
        clips: bool = False,
        frame_step: int = 1,
    ):
        """`clips`, `frame_step`: what the model reads, see SampleDecoder."""
        self.shards = shards
        self.config = config
        self.tokenizer = tokenizer
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.start = start
        self.pending = pending or []
        self.done = set(done or [])
        # Pre-encoded shards: caption dropout swaps in the empty caption's embeddings (text field -> tensor).
        self.empty_caption = empty_caption
        self.decoder = SampleDecoder(config, tokenizer, seed, encoded=empty_caption is not None, clips=clips,
                                     frame_step=frame_step)
        self.total = sum(s.samples for s in shards)
        self._layouts: dict[int, tuple[list[int], np.ndarray]] = {}
        self._read: dict[int, list[dict[str, Any]]] = {}
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Worker w of k decodes the rank's units start + w, start + w + k, ...: the loader, taking one item
        from each worker in turn, hands them over in order. An item holds the unit's usable samples and their
        places, stacked per bucket (of one size and frame count), and counts those skipped and filtered; the
        first also holds the samples a resumed rank had waiting, decoded again."""
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        local = self.start + worker
        again = self.pending if worker == 0 else []
        batch_size = self.config.batch_size
        while True:
            unit = local * self.world_size + self.rank
            fresh = [] if unit in self.done else list(range(unit * batch_size, (unit + 1) * batch_size))
            item: dict[str, Any] = {"unit": unit, "groups": [], "skipped": 0, "filtered": 0}
            buckets: dict[int, list[tuple[int, dict[str, Any]]]] = {}
            # Samples read again were counted when first read.
            for counted, place in [(False, p) for p in again] + [(True, p) for p in fresh]:
                sample = self._sample_at(place)
                if sample is None:
                    item["skipped"] += counted
                elif isinstance(sample, Filtered):
                    item["filtered"] += counted
                else:
                    buckets.setdefault(sample["bucket"], []).append((place, sample))
            for bucket, entries in buckets.items():
                item["groups"].append({"bucket": bucket, "places": [place for place, _ in entries],
                                       "batch": self.stack([sample for _, sample in entries])})
            yield item
            local += workers
            again = []

    def _locate(self, place: int) -> tuple[int, int, int]:
        """(epoch, shard index, sample index in the shard) at `place` in the run's sequence."""
        epoch = place // self.total
        if epoch not in self._layouts:
            order = epoch_order(self.shards, self.seed, epoch)
            self._layouts = {epoch: (order, np.cumsum([0] + [self.shards[i].samples for i in order]))}
        order, bounds = self._layouts[epoch]
        at = place - epoch * self.total
        j = int(np.searchsorted(bounds, at, side="right") - 1)
        shard_index = order[j]
        if (epoch, shard_index) not in self._perms:  # kept while the shard is read, like the shard
            self._perms = {(epoch, shard_index): within_shard_order(self.shards[shard_index].samples, self.seed,
                                                                    epoch, shard_index)}
        return epoch, shard_index, int(self._perms[epoch, shard_index][at - bounds[j]])

    def _sample_at(self, place: int) -> Any:
        epoch, shard_index, index = self._locate(place)
        raw = self._read_shard(shard_index)
        if index >= len(raw):
            return None
        sample = self.decoder(raw[index], (epoch, shard_index, index))
        if sample is None:
            log.warning("skipped undecodable sample %s in %s", raw[index].get("__key__"), self.shards[shard_index].url)
        return sample

    def _read_shard(self, shard_index: int) -> list[dict[str, Any]]:
        # A worker's next units are mostly in the shard it read last; one shard is kept, as much memory as
        # reading it whole takes.
        if shard_index not in self._read:
            raw = read_shard(self.shards[shard_index].url)
            if len(raw) < self.shards[shard_index].samples:
                log.warning("%s: %d of the %d samples the manifest lists are readable (a truncated or corrupt "
                            "tar, or a wrong manifest: `sdtrain prepare verify` tells which); the rest are "
                            "skipped", self.shards[shard_index].url, len(raw), self.shards[shard_index].samples)
            self._read = {shard_index: raw}
        return self._read[shard_index]

    def stack(self, batch: list[dict[str, Any]]) -> dict:
        """Decoded samples of one bucket as one batch of tensors: what a worker hands over (one tensor a field
        crosses between processes far faster than one a sample)."""
        captions = [s["caption"] for s in batch]
        out: dict[str, Any] = {"captions": captions, "keys": [s["key"] for s in batch],
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
        return out

    def collate(self, parts: list[tuple[dict[str, Any], int, int]]) -> dict[str, Any]:
        """One training batch from rows start:end of stacked batches (see `stack`), tokenized."""
        if len(parts) == 1 and parts[0][1] == 0 and parts[0][2] == len(parts[0][0]["keys"]):
            out = dict(parts[0][0])
        else:
            out = {}
            for key in dict.fromkeys(k for part, _, _ in parts for k in part):
                have = next(part[key] for part, _, _ in parts if key in part)
                if isinstance(have, list):
                    out[key] = [v for part, start, end in parts for v in part[key][start:end]]
                elif key == "mask" or key in COMPANION_FIELDS or all(key in part for part, _, _ in parts):
                    # As `stack` fills a sample's: a missing mask counts everywhere, a missing map or source is
                    # zeros; text embeddings only where every sample has them.
                    fill = torch.ones if key == "mask" else torch.zeros
                    out[key] = torch.cat([part[key][start:end] if key in part else fill(end - start, *have.shape[1:])
                                          for part, start, end in parts])
        if self.tokenizer is not None:
            out.update(self.tokenizer(out["captions"]))
        return out

