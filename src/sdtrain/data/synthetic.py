"""Fixed random batches shaped like the loader's, for benchmarks and for start-up measurements that
must not touch the real data (its position is part of the resumable state)."""

from __future__ import annotations

from typing import Any

import torch

from sdtrain.config import DataConfig
from sdtrain.models import build


class SyntheticBatches:
    """One fixed random batch per rank, served forever: the data side of the step costs nothing.

    `encoded` batches look like pre-encoded shards: latents (and, for a frozen text encoder, text
    embeddings) instead of pixels, so the step skips the encoders as it would on such shards.
    """

    def __init__(self, config: DataConfig, task: Any, seed: int, rank: int, encoded: bool = False):
        generator = torch.Generator().manual_seed(seed * 1000 + rank)
        size, count = config.resolution, config.batch_size
        self.shards: list = []
        self.num_samples = 0
        self.encoding = {"synthetic": True} if encoded else None
        self.batch: dict[str, Any] = {
            "captions": ["synthetic"] * count,
            "keys": [f"synthetic-{i}" for i in range(count)],
        }
        tokenizer = task.tokenizer
        if tokenizer is not None:
            length = tokenizer.model_max_length
            self.batch["input_ids"] = torch.randint(0, len(tokenizer), (count, length), generator=generator)
        if not encoded:
            self.batch["pixel_values"] = torch.rand(count, 3, size, size, generator=generator) * 2 - 1
            return
        vae = task.vae.config
        side = size // build.vae_scale(vae.block_out_channels)
        self.batch["latent_mean"] = torch.randn(count, vae.latent_channels, side, side, generator=generator)
        self.batch["latent_std"] = torch.full_like(self.batch["latent_mean"], 0.1)
        if task.text_embeddings:
            hidden = task.text_encoder.config.hidden_size
            self.batch["text_emb"] = torch.randn(count, tokenizer.model_max_length, hidden, generator=generator)

    def next(self) -> dict[str, Any]:
        return self.batch

    def close(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}
