"""``val_loss``: the training loss on held-out shards at fixed timesteps and fixed noise, MLPerf Training's quality
metric for Flux.1 (text_to_image, from round 5.1; target 0.586).

As the reference does (after Esser et al., 2024, sec. 5.1), held-out sample i is evaluated once, at timestep
t = k / N with k = i mod N, N = ``evaluation.val_timesteps`` (8), or the k its json metadata names as
``timestep`` (MLPerf's COCO shards fix each sample's so): sigma = t for flow matching, timestep
t * num_train_timesteps on a noise-prediction schedule. The value is the mean of the N per-timestep means. Unlike
the reference, which draws fresh noise (and posterior samples) at every evaluation, sample i's noise comes from
(seed, i) alone and its latent is the posterior's mean (or, with ``evaluation.val_posterior: sample``, a draw from
the posterior as the reference takes it, also from (seed, i) alone), so two evaluations of the same weights give
the same number; no caption is dropped.

Samples are cut into blocks of ``batch`` consecutive ones and each rank takes a contiguous run of blocks (so it
reads only its own shards); each sample's loss is gathered by index and summed in index order. The blocks, and
so each sample's batch-mates, are those of one process whatever the rank count. The modules scored may be the
trained ones as FSDP shards them (the trainer swaps the EMA weights into them): their forward passes are then
collectives, and every rank makes as many.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from sdtrain.config import DataConfig, EvaluationConfig
from sdtrain.data.decode import Filtered, SampleDecoder, caption_lines
from sdtrain.data.encoded import TEXT_FIELDS, dataset_encoding
from sdtrain.data.order import read_shard, resolve_shards
from sdtrain.distributed import gather_objects
from sdtrain.errors import UserError

log = logging.getLogger(__name__)


def sample_noise_seed(seed: int, index: int, what: str = "") -> int:
    """The seed of held-out sample `index`'s noise (`what`: "" for the diffusion noise, "posterior" for the draw of
    its latent): a function of these alone."""
    digest = hashlib.blake2b(f"val_loss/{what + '/' if what else ''}{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def sample_noise(seed: int, index: int, shape: tuple[int, ...], what: str = "") -> torch.Tensor:
    """Sample `index`'s noise, drawn on the CPU in fp32 so that every device and batch size sees the same numbers."""
    generator = torch.Generator().manual_seed(sample_noise_seed(seed, index, what))
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def timestep_of(raw: dict[str, Any], index: int, timesteps: int) -> int:
    """The k of the timestep k / N that held-out sample `index` is evaluated at: its json ``timestep`` when that is
    an integer in [0, N), else index mod N."""
    try:
        given = json.loads(raw["json"]).get("timestep") if "json" in raw else None
    except (ValueError, AttributeError, UnicodeDecodeError):
        given = None
    if isinstance(given, int) and not isinstance(given, bool) and 0 <= given < timesteps:
        return given
    return index % timesteps


def my_blocks(count: int, batch: int, rank: int, world: int) -> list[list[int]]:
    """Blocks of `batch` consecutive sample indices; rank r takes the r-th contiguous run of them, so the blocks
    (a sample's batch-mates) are those of one process and each rank reads a contiguous part of the shards."""
    blocks = [list(range(start, min(start + batch, count))) for start in range(0, count, batch)]
    return blocks[len(blocks) * rank // world: len(blocks) * (rank + 1) // world]


class ValLoss:
    """The val_loss of a diffusion task's modules on ``evaluation.val_shards``; built once, called by every rank at
    every evaluation point with the modules to score (the EMA weights when the run keeps them)."""

    def __init__(self, task: Any, config: EvaluationConfig, device: torch.device, rank: int = 0, world: int = 1,
                 bf16: bool = False):
        self.task, self.device, self.rank, self.world, self.bf16 = task, device, rank, world, bf16
        self.seed, self.batch, self.timesteps = config.seed, config.batch, config.val_timesteps
        self.sample_posterior = config.val_posterior == "sample"
        self.spec = str(config.val_shards)
        try:
            self.shards = resolve_shards(self.spec)
        except UserError as exc:
            raise UserError(f"evaluation.val_shards: {str(exc).removeprefix('data.shards: ')}") from None
        total = sum(shard.samples for shard in self.shards)
        self.count = min(config.num, total) if config.num else total
        base = task.data_config()
        # Held-out samples as they are: no caption dropout, augmentation, filters or buckets.
        self.data = dataclasses.replace(base, shards=self.spec, caption_dropout=0.0, random_flip=False,
                                        center_crop=True, aspect_buckets=False, filters={})
        self.encoded, self.text_embeddings = self._check_encoding(base)
        self.decoder = SampleDecoder(self.data, None, seed=0, encoded=self.encoded, **task.clip_reading())
        self._vae: nn.Module | None = None

    def _check_encoding(self, base: DataConfig) -> tuple[bool, bool]:
        """Whether to read the shards' latents, and their text embeddings, checked against the task's weights."""
        found = dataset_encoding(self.spec) if self.task.config.data.use_encoded else None
        if found is None:
            return False, False
        encoding, folder = found
        task = self.task
        if encoding["vae"] != task.sources.get("vae"):
            raise UserError(f"evaluation.val_shards: the latents in {folder} were encoded with the VAE "
                            f"{encoding['vae']} but model.components.vae.source is {task.sources.get('vae')}; "
                            "encode them with the run's VAE, or set data.use_encoded=false to encode their images "
                            "online")
        if encoding["resolution"] != base.resolution:
            raise UserError(f"evaluation.val_shards: the shards in {folder} were encoded at {encoding['resolution']} "
                            f"px but data.resolution is {base.resolution}; encode them at {base.resolution}")
        # As for training: embeddings stand in only for the frozen encoders that made them, from plain captions.
        unread = task.components.stood_in_for(encoding, base, task.text_encoder_runs())
        return True, any(name in unread for name in task.family.components.text_encoders)

    def __call__(self, modules: dict[str, nn.Module]) -> dict[str, Any]:
        """Every rank calls this together (the losses are gathered); `modules` are the trained modules to score,
        by the task's names for them."""
        start = time.perf_counter()
        result = self.summarise(gather_objects(self.score(modules)))
        return {**result, "seconds": round(time.perf_counter() - start, 2)}

    def score(self, modules: dict[str, nn.Module]) -> tuple[list[tuple[int, int, float]], int]:
        """This rank's share: (sample index, timestep k, loss) for each sample it read, and how many it could not."""
        losses: list[tuple[int, int, float]] = []
        skipped = passes = 0
        last = None
        with torch.no_grad(), self._scoring(modules):
            for indices, batch in self._batches(my_blocks(self.count, self.batch, self.rank, self.world)):
                if batch is None:
                    skipped += len(indices)
                    continue
                skipped += len(indices) - len(batch["indices"])
                values = self._losses(batch).double().cpu().tolist()
                losses += list(zip(batch["indices"], batch["timesteps"], values))
                passes, last = passes + 1, batch
            if any(isinstance(module, FSDPModule) for module in modules.values()):
                # A sharded forward pass gathers each block's weights from every rank: all ranks must make as many.
                # A rank with fewer blocks (or unreadable ones) repeats one and drops its losses.
                rounds = max(len(my_blocks(self.count, self.batch, r, self.world)) for r in range(self.world))
                if passes < rounds and last is None:
                    last = next((b for _, b in self._batches([[0]]) if b is not None), None)
                for _ in range(rounds - passes if last is not None else 0):
                    self._losses(last)
        return losses, skipped

    def summarise(self, parts: list[tuple[list[tuple[int, int, float]], int]]) -> dict[str, Any]:
        """The whole set's numbers from every rank's `score`."""
        scored = sorted(entry for part in parts for entry in part[0])
        skipped = sum(part[1] for part in parts)
        if not scored:
            raise UserError(f"evaluation.val_shards: no sample of {self.spec} could be read or decoded; check the "
                            "shards (sdtrain prepare verify) and data.image_key")
        if skipped:
            log.warning("val_loss: %d of %d held-out samples unreadable, left out", skipped, self.count)
        sums, counts = np.zeros(self.timesteps), np.zeros(self.timesteps, dtype=np.int64)
        for _, k, loss in scored:  # in index order: the same sums on any number of ranks
            sums[k] += loss
            counts[k] += 1
        by_timestep = {f"{k}/{self.timesteps}": float(sums[k] / counts[k]) for k in range(self.timesteps) if counts[k]}
        return {"val_loss": float(np.mean(list(by_timestep.values()))), "val_samples": len(scored),
                "val_loss_by_timestep": by_timestep, "world_size": self.world,
                "val_posterior": "sample" if self.sample_posterior else "mean"}

    def _losses(self, batch: dict[str, Any]) -> torch.Tensor:
        """Each sample's loss at its fixed timestep and noise."""
        task = self.task
        with torch.autocast(self.device.type, enabled=False):
            # The collated latent (the posterior's mean, or its draw) with a spread of zero: the task's sampling of
            # it (diffusion.sample_latents) gives it unchanged, and its random draw goes to a generator of its own.
            latents = task._latents(batch, torch.Generator(self.device).manual_seed(0))
        noise = torch.stack([sample_noise(self.seed, i, tuple(latents.shape[1:])) for i in batch["indices"]])
        fractions = torch.tensor(batch["timesteps"], dtype=torch.float32) / self.timesteps
        noisy, timesteps, target = task.objective.draw_at(latents, noise.to(self.device), fractions.to(self.device))
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            # No generator: a guidance-distilled model is fed its constant diffusion.flow.guidance, not a draw.
            condition, extra = task.denoiser_inputs(batch, noisy, timesteps)
            return task.denoising_loss_at(noisy, timesteps, target, condition, extra=extra).float()

    @contextmanager
    def _scoring(self, modules: dict[str, nn.Module]) -> Iterator[None]:
        """The task's loss calls its modules through attributes (parallel wrappers when they train): point them at
        the modules to score until the block ends."""
        task = self.task
        live = {name: getattr(task, name) for name in modules}
        try:
            for name, module in modules.items():
                setattr(task, name, module)
            yield
        finally:
            for name, module in live.items():
                setattr(task, name, module)

    def _batches(self, blocks: list[list[int]]) -> Iterator[tuple[list[int], dict[str, Any] | None]]:
        """Each block's indices and its collated batch (None when none of its samples could be read). The indices
        only grow, so each shard this rank needs is read once, and dropped once passed."""
        starts = np.cumsum([0] + [shard.samples for shard in self.shards])
        loaded: dict[int, list[dict[str, Any]]] = {}
        for block in blocks:
            samples = []
            for index in block:
                shard_index = int(np.searchsorted(starts, index, side="right") - 1)
                if shard_index not in loaded:
                    loaded = {shard_index: read_shard(self.shards[shard_index].url)}
                raw, local = loaded[shard_index], index - int(starts[shard_index])
                # A damaged shard holds fewer samples than its manifest says: the missing ones are skipped.
                sample = self.decoder(self._first_caption(raw[local]), (0, shard_index, local)) \
                    if local < len(raw) else None
                if sample is not None and not isinstance(sample, Filtered):
                    samples.append((index, {**sample, "timestep": timestep_of(raw[local], index, self.timesteps)}))
            yield block, self._collate(samples) if samples else None

    def _first_caption(self, raw: dict[str, Any]) -> dict[str, Any]:
        """A held-out sample with several captions (one per line) is scored with its first, as a validation set
        names one caption per image."""
        value = raw.get(self.data.caption_key)
        if not isinstance(value, bytes):
            return raw
        captions = caption_lines(value)
        return {**raw, self.data.caption_key: captions[0].encode()} if len(captions) > 1 else raw

    def _collate(self, samples: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
        rows = [sample for _, sample in samples]
        captions = [row["caption"] for row in rows]
        batch: dict[str, Any] = {"indices": [i for i, _ in samples], "timesteps": [row["timestep"] for row in rows],
                                 "keys": [row["key"] for row in rows],
                                 "captions": captions, "size_ids": torch.stack([row["size_ids"] for row in rows])}
        if self.encoded:
            mean = torch.stack([row["latent_mean"] for row in rows])
            std = torch.stack([row["latent_std"] for row in rows]) if self.sample_posterior else None
            if self.text_embeddings:
                for key in TEXT_FIELDS:
                    if all(key in row for row in rows):
                        batch[key] = torch.stack([row[key] for row in rows])
        else:
            pixels = torch.stack([row["pixel_values"] for row in rows]).to(self.device)
            with torch.autocast(self.device.type, enabled=False):
                posterior = self.task.family.codec.encode(self.vae(), pixels)
            mean, std = posterior.mean, posterior.std
        if self.sample_posterior:
            draws = torch.stack([sample_noise(self.seed, i, tuple(mean.shape[1:]), "posterior") for i, _ in samples])
            mean = mean.float() + std.float() * draws.to(std.device)
        batch["latent_mean"] = mean
        batch["latent_std"] = torch.zeros_like(mean)
        # Token ids too: the task reads embeddings only when its training batches carry them.
        batch.update(self.task.caption_tokenizer(captions))
        return batch

    def vae(self) -> nn.Module:
        """The task's frozen VAE with its weights (training on encoded shards releases them; loaded once here)."""
        if self._vae is None:
            self._vae = self.task.frozen("vae")
        return self._vae
