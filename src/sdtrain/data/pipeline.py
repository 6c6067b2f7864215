"""The training loader: a DataLoader over a ShardStream (workers from a fork server), the batches formed
from its units in order, the data position the trainer checkpoints, and resume on the same or another
number of ranks (see sdtrain.data.order)."""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import multiprocessing
import multiprocessing.util  # noqa: F401 - registers its exit handler before ours, see below
import os
import select
import signal
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader
from torch.utils.data._utils.pin_memory import pin_memory

from sdtrain.config import DataConfig
from sdtrain.data.decode import caption_lines
from sdtrain.data.encoded import TEXT_FIELDS, dataset_encoding, empty_caption_file, load_npy
from sdtrain.data.order import DataPosition, from_slots, rebatch, relayout, resolve_shards
from sdtrain.data.shards import tar_samples
from sdtrain.data.stream import ShardStream
from sdtrain.errors import UserError

log = logging.getLogger(__name__)


class TrainBatches:
    """Iterates training batches from a DataLoader over a ShardStream, tracking the data position.

    A batch holds ``pixel_values`` (B, 3, H, W) in [-1, 1], or with `clips` (a model of clips) (B, 3, T, H, W),
    images being clips of one frame; its samples share one bucket: one size and, with clips, one frame count. Encoded
    shards give ``latent_mean``/``latent_std`` instead, (B, C, h, w), or a clip's (B, C, t, h, w), likewise bucketed
    by t. Besides: ``captions``, ``keys``, ``size_ids``, ``caption_draws``, ``places`` and, where samples have them,
    ``mask`` and companion images; the tokenizer's fields when there is one.
    """

    def __init__(self, config: DataConfig, tokenizer: Any | None, seed: int, rank: int = 0, world_size: int = 1,
                 pin_memory: bool = False, encoded: bool = False, clips: bool = False, frame_step: int = 1):
        """`clips`: the model reads clips, whose frame counts are 1 + a multiple of `frame_step` (Wan: 4); without it
        a clip in the data is a one-line error naming it (see SampleDecoder)."""
        self.config = config
        self.clips = clips
        self.frame_step = frame_step
        self.pin_memory = pin_memory
        self.tokenizer = tokenizer
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shards = resolve_shards(config.shards)
        self.position = DataPosition(self.num_samples, config.batch_size, rank, world_size)
        # Samples read, not yet batched: (place, stacked batch, row) per bucket (and frame count) in the order read;
        # full buckets wait in `ready` for their turn.
        self._waiting: dict[tuple[int, int], list[tuple[int, dict[str, Any], int]]] = {}
        self._ready: list[list[tuple[int, dict[str, Any], int]]] = []
        self._stream: ShardStream | None = None
        self._iterator: Iterator[dict[str, Any]] | None = None
        self.encoding: dict[str, Any] | None = None
        self.empty_caption: dict[str, torch.Tensor] | None = None
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
            self.empty_caption = {}
            for field in TEXT_FIELDS:
                empty = folder / empty_caption_file(field)
                if empty.is_file():
                    self.empty_caption[field] = torch.from_numpy(load_npy(empty.read_bytes()).astype(np.float32))

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    def _make_iterator(self) -> Iterator[dict[str, Any]]:
        self._stream = stream = ShardStream(
            self.shards, self.config, self.tokenizer, self.seed, self.rank, self.world_size,
            start=self.position.next, pending=list(self.position.pending), done=list(self.position.done),
            empty_caption=self.empty_caption, clips=self.clips, frame_step=self.frame_step,
        )
        self._waiting, self._ready = {}, []
        workers = self.config.num_workers
        loader = DataLoader(
            stream, batch_size=None, num_workers=workers, pin_memory=False,
            persistent_workers=False, prefetch_factor=2 if workers else None,
            worker_init_fn=functools.partial(_start_worker, os.getpid()) if workers else None,
            multiprocessing_context=worker_context(self.tokenizer) if workers else None,
            # Its own generator: drawing worker seeds from the global RNG would make a resumed run's
            # global RNG stream differ from an uninterrupted one.
            generator=torch.Generator().manual_seed(self.seed),
        )
        return iter(loader)

    def close(self) -> None:
        """Stop the loader workers. They ignore SIGTERM (see _start_worker), so they must be told."""
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
        # A rank whose units hold no usable sample for a whole epoch (and the loader's read-ahead) has none.
        barren, limit = 0, self.num_samples // (self.config.batch_size * self.world_size) + 4 + self.config.num_workers
        while not self._ready:
            try:
                item = next(self._iterator)
            except UserError as exc:
                # A worker's error arrives wrapped with its traceback; the user needs its last line.
                raise UserError(str(exc).strip().splitlines()[-1].split("UserError: ", 1)[-1]) from None
            self._take(item)
            barren = 0 if item["groups"] else barren + 1
            if barren > limit:
                raise UserError(
                    f"data.shards: no sample of '{self.config.shards}' could be decoded with "
                    f"data.image_key={self.config.image_key!r}{' or as a clip' if self.clips else ''}; check the "
                    "image field names and the files"
                )
        entries = self._ready.pop(0)
        self.position.batches += 1
        self.position.pending = sorted(entry[0] for waiting in [*self._waiting.values(), *self._ready]
                                       for entry in waiting)
        parts: list[tuple[dict[str, Any], int, int]] = []
        for _, stacked, row in entries:  # runs of rows of one stacked batch
            if parts and parts[-1][0] is stacked and parts[-1][2] == row:
                parts[-1] = (stacked, parts[-1][1], row + 1)
            else:
                parts.append((stacked, row, row + 1))
        # Each sample's place in the run's sequence: epoch place // num_samples.
        batch = {**self._stream.collate(parts), "places": [entry[0] for entry in entries]}
        return pin_memory(batch) if self.pin_memory else batch

    def _take(self, item: dict[str, Any]) -> None:
        """A unit from the loader: its samples join their buckets, a bucket that holds a batch is ready."""
        self.position.next = (item["unit"] - self.rank) // self.world_size + 1
        self.position.skipped += item["skipped"]
        self.position.filtered += item["filtered"]
        for group in item["groups"]:
            key = tuple(group["bucket"])  # (bucket, frames), a list once the loader has handed it over
            for row, place in enumerate(group["places"]):
                bucket = self._waiting.setdefault(key, [])
                bucket.append((place, group["batch"], row))
                if len(bucket) == self.config.batch_size:
                    self._ready.append(self._waiting.pop(key))

    def state_dict(self) -> dict[str, Any]:
        return self.position.state_dict()

    def load_state_dict(self, rank_states: list[dict[str, Any]]) -> None:
        """Resume from the positions of every rank of the run that saved them.

        With the same number of ranks this rank continues exactly where it stopped, whatever the number of
        loader workers; with another, it continues the same sequence (see `relayout`).
        """
        if "cursors" in rank_states[0]:  # an earlier release's per-slot positions
            rank_states = [from_slots(rank_states, self.num_samples, self.config.batch_size)]
        elif int(rank_states[0]["batch_size"]) != self.config.batch_size:
            log.warning("data: data.batch_size changed from %s to %d: the run's sequence of samples continues, cut "
                        "into other batches", rank_states[0]["batch_size"], self.config.batch_size)
            rank_states = [rebatch(rank_states, self.config.batch_size)]
        if len(rank_states) == self.world_size:
            state = rank_states[self.rank]
        else:
            state = relayout(rank_states, self.rank, self.world_size)
            if self.rank == 0:
                log.warning("data: resuming a run of %d ranks on %d: the same sequence of samples continues from "
                            "the first batch some rank had not read", len(rank_states), self.world_size)
        self.close()
        self.position.load_state_dict(state)


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
    modules = ["sdtrain.data.pipeline", "sdtrain.data.stream"]
    if tokenizer is not None:
        modules += getattr(tokenizer, "modules", [type(tokenizer).__module__])
    # Takes effect when the server starts, i.e. at the first loader of the process.
    context.set_forkserver_preload(modules)
    return context


def _start_worker(trainer: int, _: int) -> None:
    # Loader workers decode images; letting each also spawn a full torch thread pool starves the
    # training process on small machines.
    torch.set_num_threads(1)
    # Every object inherited from the fork server moves to the permanent generation (a splice of the collector's
    # lists): the worker's collections then never write to their headers, each of which would copy a page the
    # worker now shares with the server and its other workers.
    gc.freeze()
    # Launchers signal the whole process group; the trainer decides when to stop, and a worker that
    # died first would take the final save down with it.
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_exit_with, args=(trainer,), name="sdtrain-trainer-watch", daemon=True).start()


def _exit_with(trainer: int) -> None:
    """End this worker when the trainer process ends, however it ends (kill -9 included).

    The loader's own watchdog watches the worker's parent, which is the fork server, and the fork server
    lives as long as any worker holds the descriptor the trainer passed it: after a kill -9 of the trainer
    each waited on the other forever, with the resource tracker beside them. Once the workers are gone,
    the server and the tracker see their pipes close and exit by themselves.
    """
    try:
        select.select([os.pidfd_open(trainer)], [], [])  # readable once the process has exited
    except ProcessLookupError:  # already gone
        pass
    except OSError:  # no pidfd (a kernel before 5.3): the trainer's pid, looked at every second
        pause = threading.Event()
        while _alive(trainer):
            pause.wait(1.0)
    os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or its pid taken by someone else's process
        return False
    return True


def read_captions(spec: str, caption_key: str = "txt", limit: int = 200_000) -> list[str]:
    """Captions of the shards (up to `limit`), in shard order, for training a tokenizer."""
    captions: list[str] = []
    suffix = "." + caption_key
    for shard in resolve_shards(spec):
        samples = tar_samples(shard.url, handler=wds.handlers.warn_and_continue,
                              select=lambda name: name.endswith(suffix))
        for sample in samples:
            value = sample.get(caption_key)
            if value:  # several captions of one image, one per line, are each a caption
                captions += caption_lines(value)
            if len(captions) >= limit:
                return captions
    return captions
