"""Optimizer and learning-rate schedule, built from their own config section."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from sdtrain.config import OptimConfig
from sdtrain.errors import UserError
from sdtrain.train.budget import StepPlan, lr_factor


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
    if config.weights == "bf16" and sharded:
        raise UserError("optim.weights: bf16 weights are rounded a whole tensor at a time, which FSDP2's shards are "
                        "not; FSDP2 already splits fp32 weights over the ranks: use optim.weights=fp32, or "
                        "parallel.strategy=ddp")


def keep_in_bf16(params: list[nn.Parameter]) -> None:
    """``optim.weights: bf16``: the trained weights (and so their gradients) held in bf16, with no fp32 copy."""
    for param in params:
        param.data = param.data.to(torch.bfloat16)


def round_to_bf16(values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 `values` rounded to bf16 stochastically: up with the probability of the distance to the value below,
    so the rounding is unbiased and an update smaller than bf16's spacing still moves a weight on average (rounding
    to nearest would drop it). Noise added below bf16's 16 bits of an fp32, then those bits cut; fp32 stores sign
    and magnitude apart, so this rounds the magnitude of negative values the same way."""
    noise = torch.randint(0, 1 << 16, values.shape, dtype=torch.int32, device=values.device, generator=generator)
    bits = (values.view(torch.int32) + noise) & -(1 << 16)
    return bits.view(torch.float32).to(torch.bfloat16)


ROUNDS = "bf16_rounds"
"""Per-parameter optimizer state under ``optim.weights: bf16``: how many updates the parameter has been rounded
after, which seeds its next rounding (saved with the optimizer's state, so a resumed run rounds as it would have)."""


def rounding_seed(seed: int, index: int, rounds: int) -> int:
    """The rounding noise of a parameter's update depends only on the run's seed, the parameter and how many updates
    it has had: every data-parallel rank rounds its replica alike, and a resumed run continues the same draws."""
    digest = hashlib.blake2b(f"{seed}/{index}/{rounds}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class RoundsToBF16:
    """Mixed into the optimizer class under ``optim.weights: bf16``. Its ``step`` widens a few parameters at a time
    (at most WIDE_BYTES of them), with their gradients, to fp32, steps them with the optimizer's own update (its
    state is created and kept in fp32, as for fp32 weights), and rounds them back stochastically (`round_to_bf16`).
    A parameter keeps its identity (only its ``data`` changes), so the optimizer's state, keyed by it, carries over.
    The gradients are freed as each parameter is stepped."""

    WIDE_BYTES = 256 * 2**20
    rounding_seed_base = 0
    rounding_index: dict[int, int]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        groups = self.param_groups
        try:
            for group in groups:
                params = [p for p in group["params"] if p.grad is not None]
                for chunk in _chunks(params, self.WIDE_BYTES // 4):
                    for param in chunk:
                        grad = param.grad
                        param.grad = None
                        param.data = param.data.float()
                        param.grad = grad.float()
                    self.param_groups = [{**group, "params": chunk}]
                    super().step()  # type: ignore[misc]
                    for param in chunk:
                        self._round(param)
        finally:
            self.param_groups = groups

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Loading casts floating state to each parameter's dtype (torch's and bitsandbytes' optimizers both), which
        # would round the fp32 state of bf16 weights to bf16: while it loads, each weight stands as an empty fp32
        # tensor on its device, all the cast reads, without widening any weight.
        params = [p for group in self.param_groups for p in group["params"]]
        kept = [p.data for p in params]
        try:
            for param in params:
                param.data = torch.empty(0, device=param.device)
            super().load_state_dict(state_dict)  # type: ignore[misc]
        finally:
            for param, data in zip(params, kept):
                param.data = data

    def _round(self, param: nn.Parameter) -> None:
        state = self.state[param]  # type: ignore[attr-defined]
        rounds = state.get(ROUNDS, 0)
        generator = torch.Generator(param.device).manual_seed(
            rounding_seed(self.rounding_seed_base, self.rounding_index[id(param)], rounds))
        param.grad = None
        param.data = round_to_bf16(param.data, generator)
        state[ROUNDS] = rounds + 1


def _chunks(params: list[nn.Parameter], most: int) -> list[list[nn.Parameter]]:
    """`params` in runs of at most `most` elements (a larger parameter alone)."""
    chunks: list[list[nn.Parameter]] = []
    size = most
    for param in params:
        if size + param.numel() > most:
            chunks.append([])
            size = 0
        chunks[-1].append(param)
        size += param.numel()
    return chunks


def build_optimizer(params: list[nn.Parameter], config: OptimConfig, seed: int = 0) -> torch.optim.Optimizer:
    """The optimizer ``optim.name`` names (see OptimConfig.name); with ``in_backward`` each parameter gets a group
    of its own, stepped from its gradient hook; with ``weights: bf16`` each update is rounded stochastically into
    the bf16 weights (RoundsToBF16, its noise drawn from `seed`)."""
    sharded = any(isinstance(p, DTensor) for p in params)
    groups = [{"params": [p]} for p in params] if config.in_backward else params
    settings = optimizer_settings(config)
    if config.name == "adamw8bit":
        import bitsandbytes

        kind: type = bitsandbytes.optim.AdamW8bit
    elif config.name == "adafactor":
        kind = torch.optim.Adafactor
    else:
        kind = torch.optim.AdamW
        # Fused kernels exist on CPU as on CUDA (the per-parameter default loop cost 3.4 s a step on the SD2
        # UNet on a CPU). Sharded DTensor parameters take the foreach path, which every placement supports.
        fused = config.fused and not sharded
        settings |= {"fused": fused or None, "foreach": None if fused else True}
    if config.weights == "bf16":
        kind = type(f"{kind.__name__}RoundsToBF16", (RoundsToBF16, kind), {
            "rounding_seed_base": seed, "rounding_index": {id(p): i for i, p in enumerate(params)}})
    optimizer = kind(groups, **settings)
    if config.in_backward:
        step_in_backward(optimizer)
    return optimizer


@torch.no_grad()
def match_parameter_layouts(optimizer: torch.optim.Optimizer) -> None:
    """Each state tensor shaped as its parameter (AdamW's moments) laid out in memory as the parameter is. A
    checkpoint saved in another layout (``train.channels_last``) loads in its own strides, and fused optimizer
    kernels pair the elements of a parameter and its moments by their place in memory."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape and value.stride() != param.stride():
                    state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)


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
        for counter in ("step", ROUNDS):
            count = optimizer.state[p].get(counter)
            if isinstance(count, torch.Tensor):
                count.zero_()
            elif count is not None:
                optimizer.state[p][counter] = 0


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


def build_lr_schedule(optimizer: torch.optim.Optimizer, config: OptimConfig, plan: StepPlan) -> LambdaLR:
    """``optim.schedule`` over the run's planned steps, which a time budget may re-plan while it trains."""
    return LambdaLR(optimizer, lr_factor(config.schedule, config.warmup_steps, plan))
