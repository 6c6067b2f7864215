"""Optimizer and learning-rate schedule, built from their own config section."""

from __future__ import annotations

import torch
from diffusers.optimization import get_scheduler
from torch import nn

from sdtrain.config import OptimConfig


def build_optimizer(params: list[nn.Parameter], config: OptimConfig) -> torch.optim.Optimizer:
    # fused kernels exist for CUDA; foreach is the fast path elsewhere.
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=(config.betas[0], config.betas[1]),
        weight_decay=config.weight_decay,
        eps=config.eps,
        fused=fused or None,
    )


def build_lr_schedule(optimizer: torch.optim.Optimizer, config: OptimConfig, max_steps: int):
    name = "constant_with_warmup" if config.schedule == "constant" else "cosine"
    return get_scheduler(
        name, optimizer, num_warmup_steps=config.warmup_steps, num_training_steps=max_steps
    )
