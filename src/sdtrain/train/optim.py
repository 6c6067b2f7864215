"""Optimizer and learning-rate schedule, built from their own config section."""

from __future__ import annotations

from typing import Any

import torch
from diffusers.optimization import get_scheduler
from torch import nn
from torch.distributed.tensor import DTensor

from sdtrain.config import OptimConfig
from sdtrain.errors import UserError


def optimizer_settings(config: OptimConfig) -> dict[str, Any]:
    """The hyperparameters of ``optim.name``'s optimizer that the config sets (a resumed one takes them too)."""
    if config.name == "adafactor":
        return {"lr": config.lr, "weight_decay": config.weight_decay}
    return {"lr": config.lr, "betas": (config.betas[0], config.betas[1]), "weight_decay": config.weight_decay,
            "eps": config.eps}


def check_optimizer(config: OptimConfig, sharded: bool) -> None:
    """Refuse an optimizer that cannot step this run's parameters (FSDP2's shards when `sharded`), before any
    weights load."""
    if config.name == "adamw8bit" and sharded:
        raise UserError("optim.name: adamw8bit cannot step FSDP2's sharded parameters (bitsandbytes quantises whole "
                        "tensors); use adamw or adafactor, or parallel.strategy=ddp")


def build_optimizer(params: list[nn.Parameter], config: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer ``optim.name`` names (see OptimConfig.name); with ``in_backward`` each parameter gets a group
    of its own, stepped from its gradient hook."""
    sharded = any(isinstance(p, DTensor) for p in params)
    groups = [{"params": [p]} for p in params] if config.in_backward else params
    if config.name == "adamw8bit":
        import bitsandbytes

        optimizer = bitsandbytes.optim.AdamW8bit(groups, **optimizer_settings(config))
    elif config.name == "adafactor":
        optimizer = torch.optim.Adafactor(groups, **optimizer_settings(config))
    else:
        # Fused kernels exist on CPU as on CUDA (the per-parameter default loop cost 3.4 s a step on the SD2
        # UNet on a CPU). Sharded DTensor parameters take the foreach path, which every placement supports.
        fused = config.fused and not sharded
        optimizer = torch.optim.AdamW(groups, **optimizer_settings(config), fused=fused or None,
                                      foreach=None if fused else True)
    if config.in_backward:
        step_in_backward(optimizer)
    return optimizer


@torch.no_grad()
def allocate_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (AdamW's two moments: twice the trained weights) now rather than lazily
    in the first step, so the first step costs what every step costs and a run that cannot hold its
    state fails at start-up. One step with zero gradients at learning rate 0 leaves every weight exactly
    as it was (the update and the decay are both multiplied by 0); the step counters are then reset, so
    the state equals the one the first real step would have created."""
    groups = optimizer.param_groups
    try:
        # A group at a time, so an optimizer stepped in backward (a group per parameter) never holds more
        # than one zero gradient, as in its training steps.
        for group in groups:
            learning_rate, group["lr"] = group["lr"], 0.0
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
            optimizer.param_groups = [group]
            try:
                optimizer.step()
            finally:
                group["lr"] = learning_rate
                for p in group["params"]:
                    p.grad = None
    finally:
        optimizer.param_groups = groups
    for p in (p for group in groups for p in group["params"]):
        step = optimizer.state[p].get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            optimizer.state[p]["step"] = 0


def step_in_backward(optimizer: torch.optim.Optimizer) -> None:
    """Step each parameter the moment backward has accumulated its gradient, then drop the gradient.

    PyTorch's optimizer-in-backward recipe, with one optimizer instead of one per parameter, so the LR
    schedule and the checkpointed state stay those of a plain AdamW: each parameter has a group of its
    own, and the hook steps only that group. The optimizer's own ``step()`` afterwards finds no
    gradients and does nothing.
    """
    def hook(param: torch.Tensor, index: int) -> None:
        # Looked up at each call: loading a checkpoint replaces the optimizer's group dicts.
        groups = optimizer.param_groups
        optimizer.param_groups = [groups[index]]
        try:
            optimizer.step()
        finally:
            optimizer.param_groups = groups
        param.grad = None

    for index, group in enumerate(optimizer.param_groups):
        (param,) = group["params"]
        param.register_post_accumulate_grad_hook(lambda p, i=index: hook(p, i))
    optimizer.steps_in_backward = True  # type: ignore[attr-defined]


def build_lr_schedule(optimizer: torch.optim.Optimizer, config: OptimConfig, max_steps: int):
    name = "constant_with_warmup" if config.schedule == "constant" else "cosine"
    return get_scheduler(
        name, optimizer, num_warmup_steps=config.warmup_steps, num_training_steps=max_steps
    )
