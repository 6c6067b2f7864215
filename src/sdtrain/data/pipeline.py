"""The training data stream: WebDataset shards in, collated batches out, resumable to the sample.

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

import atexit
import io
import json
import logging
import math
import multiprocessing
import multiprocessing.util  # noqa: F401 - registers its exit handler before ours, see below
import os
import signal
import tarfile
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from sdtrain.config import DataConfig
from sdtrain.data.encoded import EMPTY_CAPTION, LATENT_MEAN, LATENT_STD, TEXT_EMB, dataset_encoding, load_npy
from sdtrain.data.filters import parse_filters
from sdtrain.data.prepare import DEFAULT_MAX_PIXELS
from sdtrain.data.shards import MANIFEST_NAME, read_manifest, tar_keys, tar_samples
from sdtrain.data.sources import expand_spec, is_remote, read_json
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


def _epoch_order(shards: list[Shard], seed: int, epoch: int) -> list[int]:
    return list(np.random.default_rng([seed, epoch, 0x5A4D]).permutation(len(shards)))


def _within_shard_order(samples: int, seed: int, epoch: int, shard_index: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, shard_index, 0x1D]).permutation(samples)


def load_class_prompts(path: str) -> dict[str, list[str]]:
    """``data.class_prompts``: class index -> prompt or list of prompts, as lists."""
    try:
        mapping = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(
            f"data.class_prompts: cannot read {path} ({exc}); give a JSON object of index -> prompt") from None
    if not isinstance(mapping, dict) or not mapping:
        raise UserError(f"data.class_prompts: {path} is not a JSON object of class index -> prompt")
    prompts = {}
    for key, value in mapping.items():
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
            raise UserError(f"data.class_prompts: {path}: class {key} needs a prompt or a list of prompts")
        prompts[str(key)] = values
    return prompts


def make_buckets(config: DataConfig) -> list[tuple[int, int]]:
    """Aspect-ratio buckets: (width, height) pairs with sides multiples of `bucket_step`, about
    resolution^2 pixels each, aspects from 1/max_aspect to max_aspect, widest first."""
    step, area = config.bucket_step, config.resolution**2
    buckets = set()
    width = step
    while width <= area // step:
        height = int(area / width) // step * step
        if height >= step and 1 / config.max_aspect <= width / height <= config.max_aspect:
            buckets.update({(width, height), (height, width)})  # a tall bucket for every wide one
        width += step
    side = config.resolution // step * step
    buckets.add((side, side))
    return sorted(buckets, key=lambda wh: -wh[0] / wh[1])


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


def _drop_prefix(intervals: Intervals, count: int) -> Intervals:
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
        pieces.append(_take(_drop_prefix(intervals, first), last - first))
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


@dataclass(frozen=True)
class Filtered:
    """A sample that data.filters rejected, and why."""

    reason: str


class SampleDecoder:
    """Turns a raw WebDataset sample into tensors; returns None for samples that cannot be used and
    `Filtered` for samples the configured filters reject."""

    def __init__(self, config: DataConfig, tokenizer: Any | None, seed: int, encoded: bool = False):
        self.config = config
        self.tokenizer = tokenizer
        self.seed = seed
        self.encoded = encoded
        self.image_keys = [k.strip() for k in config.image_key.split(";") if k.strip()]
        self.filters = parse_filters(config.filters)
        self.buckets = make_buckets(config) if config.aspect_buckets else []
        self.class_prompts = load_class_prompts(config.class_prompts) if config.class_prompts else None

    def _caption(self, raw: dict[str, Any], rng: np.random.Generator) -> str | Filtered | None:
        """The sample's caption, None when it has none to offer, Filtered when a filter rejects it."""
        if self.class_prompts is not None:
            value = raw.get(self.config.class_key)
            try:
                prompts = self.class_prompts[str(int(value.decode() if isinstance(value, bytes) else value))]
            except (TypeError, ValueError, KeyError, UnicodeDecodeError):
                return None
            caption = prompts[int(rng.integers(len(prompts)))]
        else:
            caption = raw.get(self.config.caption_key, b"")
            caption = caption.decode("utf-8", "replace") if isinstance(caption, bytes) else str(caption)
            caption = caption.strip()
        if self.filters:
            try:
                meta = json.loads(raw.get("json", b"{}"))
            except ValueError:
                meta = {}
            reason = self.filters.check(meta if isinstance(meta, dict) else {}, caption)
            if reason is not None:
                return Filtered(reason)
        templates = self.config.prompt_templates
        if templates:
            caption = templates[int(rng.integers(len(templates)))].replace("{caption}", caption)
        return caption

    def __call__(self, raw: dict[str, Any], place: tuple[int, int, int]) -> dict[str, Any] | Filtered | None:
        rng = np.random.default_rng([self.seed, *place, 0xDA7A])
        caption = self._caption(raw, rng)
        if caption is None or isinstance(caption, Filtered):
            return caption
        if self.encoded:
            return self._encoded(raw, rng, caption)
        image_bytes = next((raw[k] for k in self.image_keys if k in raw), None)
        if image_bytes is None:
            return None
        try:
            with Image.open(io.BytesIO(image_bytes)) as img:
                # The header's size, before decoding: a shard not made by `prepare` may hold a bomb.
                if img.width * img.height > DEFAULT_MAX_PIXELS:
                    return None
                img.load()
                bucket = self._bucket(img.size)
                target = self.buckets[bucket] if self.buckets else (self.config.resolution,) * 2
                pixels = self._transform(img.convert("RGB"), rng, target)
        except (OSError, ValueError, Image.DecompressionBombError, SyntaxError):
            return None
        drop = rng.random() < self.config.caption_dropout
        return {"pixel_values": pixels, "caption": "" if drop else caption, "key": raw["__key__"], "bucket": bucket}

    def _bucket(self, size: tuple[int, int]) -> int:
        """The bucket whose aspect ratio is nearest the image's (0 without buckets)."""
        if not self.buckets:
            return 0
        aspect = math.log(size[0] / size[1])
        return min(range(len(self.buckets)), key=lambda b: abs(math.log(self.buckets[b][0] / self.buckets[b][1])
                                                              - aspect))

    def _encoded(self, raw: dict[str, Any], rng: np.random.Generator, caption: str) -> dict[str, Any] | None:
        """A pre-encoded sample: the latent distribution (and text embedding) instead of pixels."""
        if LATENT_MEAN not in raw or LATENT_STD not in raw:
            return None
        try:
            sample = {"latent_mean": torch.from_numpy(load_npy(raw[LATENT_MEAN]).astype(np.float32)),
                      "latent_std": torch.from_numpy(load_npy(raw[LATENT_STD]).astype(np.float32))}
            if TEXT_EMB in raw:
                sample["text_emb"] = torch.from_numpy(load_npy(raw[TEXT_EMB]).astype(np.float32))
        except (OSError, ValueError):
            return None
        drop = bool(rng.random() < self.config.caption_dropout)
        return {**sample, "caption": "" if drop else caption, "dropped": drop, "key": raw["__key__"], "bucket": 0}

    def _transform(self, img: Image.Image, rng: np.random.Generator, target: tuple[int, int]) -> torch.Tensor:
        width, height = target
        scale = max(width / img.width, height / img.height)
        if scale != 1.0 and (self.config.resize or scale > 1.0):
            new_size = (max(width, round(img.width * scale)), max(height, round(img.height * scale)))
            img = img.resize(new_size, Image.Resampling.BICUBIC)
        if self.config.center_crop:
            left, top = (img.width - width) // 2, (img.height - height) // 2
        else:
            left = int(rng.integers(0, img.width - width + 1))
            top = int(rng.integers(0, img.height - height + 1))
        img = img.crop((left, top, left + width, top + height))
        if self.config.random_flip and rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        array = np.asarray(img, dtype=np.float32) / 127.5 - 1.0
        return torch.from_numpy(array.transpose(2, 0, 1).copy())


@dataclass
class SlotCursor:
    epoch: int = 0
    offset: int = 0
    pending: tuple[tuple[int, int], ...] = ()
    """(epoch, place in the epoch's order) of samples read but still waiting in a part-filled bucket."""


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
        empty_caption: torch.Tensor | None = None,
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
        # Pre-encoded shards: caption dropout swaps in the empty caption's embedding.
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
        order = _epoch_order(self.shards, self.seed, epoch)
        return order, np.cumsum([0] + [self.shards[i].samples for i in order])

    def _locate(self, epoch: int, place: int) -> tuple[int, int]:
        """(shard index, sample index in the shard) at `place` in the epoch's global order."""
        order, bounds = self._epoch_layout(epoch)
        j = int(np.searchsorted(bounds, place, side="right") - 1)
        shard_index = order[j]
        perm = _within_shard_order(self.shards[shard_index].samples, self.seed, epoch, shard_index)
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
        for start, end in _drop_prefix(slot_intervals(self.total, slot, self.slots, self.plans, epoch), offset):
            position = start
            while position < end:
                j = int(np.searchsorted(bounds, position, side="right") - 1)
                shard_index = order[j]
                first, last = position - bounds[j], min(end, bounds[j + 1]) - bounds[j]
                raw = self._read_shard(shard_index)
                perm = _within_shard_order(self.shards[shard_index].samples, self.seed, epoch, shard_index)
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
        out: dict[str, Any] = {"captions": captions, "keys": [s["key"] for s in batch], "position": position}
        if "pixel_values" in batch[0]:
            out["pixel_values"] = torch.stack([s["pixel_values"] for s in batch])
        else:
            out["latent_mean"] = torch.stack([s["latent_mean"] for s in batch])
            out["latent_std"] = torch.stack([s["latent_std"] for s in batch])
            if all("text_emb" in s for s in batch) and self.empty_caption.numel():
                out["text_emb"] = torch.stack([self.empty_caption if s["dropped"] else s["text_emb"] for s in batch])
        if self.tokenizer is not None:
            tokens = self.tokenizer(captions, padding="max_length", truncation=True,
                                    max_length=self.tokenizer.model_max_length, return_tensors="pt")
            out["input_ids"] = tokens.input_ids
        return out


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
                owed += _drop_prefix(share, cursor.offset if cursor.epoch == epoch else 0)
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


class TrainBatches:
    """Iterates training batches from a DataLoader over a ShardStream, tracking the data position."""

    def __init__(self, config: DataConfig, tokenizer: Any | None, seed: int, rank: int = 0, world_size: int = 1,
                 pin_memory: bool = False, encoded: bool = False):
        self.config = config
        self.pin_memory = pin_memory
        self.tokenizer = tokenizer
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shards = resolve_shards(config.shards)
        self.position = DataPosition(max(1, config.num_workers))
        slots = world_size * self.position.workers
        if self.num_samples < slots:
            raise UserError(
                f"data.shards: {self.num_samples} samples cannot feed {slots} loader slots "
                f"({world_size} ranks x {self.position.workers} workers); lower data.num_workers or add data"
            )
        self._iterator: Iterator[dict[str, Any]] | None = None
        self.encoding: dict[str, Any] | None = None
        self.empty_caption: torch.Tensor | None = None
        found = dataset_encoding(config.shards) if encoded else None
        if found is not None:
            self.encoding, folder = found
            if config.aspect_buckets:
                raise UserError(f"data.aspect_buckets: the shards in {folder} are encoded at one size; train on "
                                "their images with data.use_encoded=false, or turn buckets off")
            if self.encoding["resolution"] != config.resolution:
                raise UserError(
                    f"data.resolution: the shards in {folder} were encoded at {self.encoding['resolution']} px; "
                    f"set data.resolution={self.encoding['resolution']} or encode them again"
                )
            empty = folder / EMPTY_CAPTION
            self.empty_caption = torch.from_numpy(load_npy(empty.read_bytes()).astype(np.float32)) \
                if empty.is_file() else torch.empty(0)

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    def _make_iterator(self) -> Iterator[dict[str, Any]]:
        stream = ShardStream(
            self.shards, self.config, self.tokenizer, self.seed, self.rank, self.world_size,
            cursors=dict(self.position.cursors), skipped=dict(self.position.skipped),
            filtered=dict(self.position.filtered),
            rotation=self.position.rotation, plans=dict(self.position.plans), empty_caption=self.empty_caption,
        )
        workers = self.config.num_workers
        loader = DataLoader(
            stream, batch_size=None, num_workers=workers, pin_memory=self.pin_memory,
            persistent_workers=False, prefetch_factor=2 if workers else None,
            worker_init_fn=_single_thread_worker if workers else None,
            multiprocessing_context=worker_context(self.tokenizer) if workers else None,
            # Its own generator: drawing worker seeds from the global RNG would make a resumed run's
            # global RNG stream differ from an uninterrupted one.
            generator=torch.Generator().manual_seed(self.seed),
        )
        return iter(loader)

    def close(self) -> None:
        """Stop the loader workers. They ignore SIGTERM (see _single_thread_worker), so they must be told."""
        shutdown = getattr(self._iterator, "_shutdown_workers", None)
        workers = list(getattr(self._iterator, "_workers", []))
        if shutdown is not None:
            shutdown()
        # The loader's own fallback for a worker that does not stop in time is SIGTERM, which ours
        # ignore; one left alive would hold interpreter exit forever.
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=10)
        self._iterator = None

    def __del__(self) -> None:
        # Promptly, while the workers still answer: a loader iterator left to the cycle collector
        # is shut down late, at interpreter exit, when its workers wait out every timeout.
        if getattr(self, "_iterator", None) is not None:
            self.close()

    def next(self) -> dict[str, Any]:
        if self._iterator is None:
            self._iterator = self._make_iterator()
            _open_loaders.add(self)
            _track_workers(self._iterator)
        empty_passes = 0
        while True:
            try:
                batch = next(self._iterator)
            except UserError as exc:
                # A worker's error arrives wrapped with its traceback; the user needs its last line.
                raise UserError(str(exc).strip().splitlines()[-1].split("UserError: ", 1)[-1]) from None
            self.position.advance(batch)
            if not batch.get("empty"):
                return batch
            empty_passes += 1
            if empty_passes > 2 * self.position.workers:
                raise UserError(
                    f"data.shards: no sample of '{self.config.shards}' could be decoded with "
                    f"data.image_key={self.config.image_key!r}; check the image field names and the files"
                )

    def state_dict(self) -> dict[str, Any]:
        return self.position.state_dict()

    def load_state_dict(self, rank_states: list[dict[str, Any]]) -> None:
        """Resume from the positions of every rank of the run that saved them.

        With the same ranks and workers this rank continues exactly where it stopped; with others,
        the unfinished epochs are dealt out again over the new slots (see `relayout`).
        """
        workers = self.position.workers
        same_layout = len(rank_states) == self.world_size and all(int(s["workers"]) == workers for s in rank_states)
        if same_layout:
            state = rank_states[self.rank]
        else:
            state = {**relayout(rank_states, self.num_samples, self.world_size * workers), "workers": workers}
            # Each rank keeps only its own slots, so that a later re-layout finds one owner per slot.
            mine = {str(slot) for slot in range(self.rank * workers, (self.rank + 1) * workers)}
            state["cursors"] = {k: v for k, v in state["cursors"].items() if k in mine}
            state["skipped"] = {k: v for k, v in state["skipped"].items() if k in mine}
            state["filtered"] = {k: v for k, v in state["filtered"].items() if k in mine}
            if self.rank == 0:
                log.warning(
                    "data: resuming %d ranks x %d workers from a run of %d x %s: every sample of the unfinished "
                    "epoch is still read once, in a different order than the original layout would have read it",
                    self.world_size, workers, len(rank_states), rank_states[0]["workers"])
        self.position.load_state_dict(state)
        self.close()


# multiprocessing's exit handler stops leftover workers with SIGTERM, which ours ignore, then waits for
# them forever. A loader's workers are left over when its iterator sits in a reference cycle that no
# garbage collection reached before exit, so every worker started here is tracked and stopped first.
# Exit handlers run last-registered first: multiprocessing's is registered (by importing its util
# module) before ours.
_open_loaders: weakref.WeakSet[TrainBatches] = weakref.WeakSet()
_loader_workers: list[Any] = []


def _track_workers(iterator: Any) -> None:
    _loader_workers[:] = [w for w in _loader_workers if w.is_alive()] + list(getattr(iterator, "_workers", []))


@atexit.register
def _stop_loader_workers() -> None:
    # At exit nothing waits for another batch: stop the workers outright (they only read shards).
    for worker in _loader_workers:
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=10)
    for loader in list(_open_loaders):
        loader.close()


def worker_context(tokenizer: Any | None = None) -> multiprocessing.context.BaseContext:
    """Where loader workers come from: a fork server, a fresh interpreter started once per process.

    A worker forked from the trainer itself shares every page of its weights and optimizer state
    copy-on-write, and each page the trainer rewrites afterwards is copied while the worker lives: at
    SD2 size that is gigabytes per worker, and the kernel kills the run. Forked from the server instead,
    a worker holds only what decoding needs. The server imports the loader's modules (and the
    tokenizer's) once, so each worker starts in milliseconds rather than importing torch anew.
    """
    context = multiprocessing.get_context("forkserver")
    modules = ["sdtrain.data.pipeline"]
    if tokenizer is not None:
        modules.append(type(tokenizer).__module__)
    # Takes effect when the server starts, i.e. at the first loader of the process.
    context.set_forkserver_preload(modules)
    return context


def _single_thread_worker(_: int) -> None:
    # Loader workers decode images; letting each also spawn a full torch thread pool starves the
    # training process on small machines.
    torch.set_num_threads(1)
    # Launchers signal the whole process group; the trainer decides when to stop, and a worker that
    # died first would take the final save down with it.
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def read_captions(spec: str, caption_key: str = "txt", limit: int = 200_000) -> list[str]:
    """Captions of the shards (up to `limit`), in shard order, for training a tokenizer."""
    captions: list[str] = []
    suffix = "." + caption_key
    for shard in resolve_shards(spec):
        samples = tar_samples(shard.url, handler=wds.handlers.warn_and_continue,
                              select=lambda name: name.endswith(suffix))
        for sample in samples:
            value = sample.get(caption_key)
            if value:
                captions.append(value.decode("utf-8", "replace").strip())
            if len(captions) >= limit:
                return captions
    return captions
