"""The training loader: a DataLoader over a ShardStream (workers from a fork server), the data position
the trainer checkpoints, and resume on the same or another layout of ranks and workers."""

from __future__ import annotations

import atexit
import functools
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

from sdtrain.config import DataConfig
from sdtrain.data.decode import caption_lines
from sdtrain.data.encoded import TEXT_FIELDS, dataset_encoding, empty_caption_file, load_npy
from sdtrain.data.order import DataPosition, relayout, resolve_shards
from sdtrain.data.shards import tar_samples
from sdtrain.data.stream import ShardStream
from sdtrain.errors import UserError

log = logging.getLogger(__name__)


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
