"""Exponential moving average of trained weights.

Kept by parameter name rather than position (as diffusers' EMAModel does) so that the average
saves to safetensors under the model's own keys, loads into a fresh model for export, and maps
onto sharded parameters when the model is wrapped for data parallelism.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from sdtrain.config import EMAConfig


class EMA:
    def __init__(self, modules: dict[str, nn.Module], config: EMAConfig):
        self.config = config
        self.modules = modules
        self.updates = 0
        self.shadow: dict[str, torch.Tensor] = {
            name: param.detach().clone().float()
            for name, param in self._named_parameters()
        }

    def _named_parameters(self):
        for prefix, module in self.modules.items():
            for name, param in module.named_parameters():
                if param.requires_grad:
                    yield f"{prefix}.{name}", param

    def decay(self, step: int) -> float:
        """The decay of one optimizer step: the warmup ramp counts optimizer steps, not updates."""
        if not self.config.warmup:
            return self.config.decay
        return min(self.config.decay, (1 + step) / (10 + step))

    def due(self, step: int) -> bool:
        """Whether optimizer step `step` (1-based) ends an EMA period."""
        return step % self.config.every == 0

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold in the weights after optimizer step `step`, which ends a period of ``every`` steps.

        The decays of the period's steps are multiplied together: the result is exactly the per-step
        average of weights held for the whole period at their value now."""
        decay = 1.0
        for past in range(step - self.config.every, step):
            decay *= self.decay(past)
        params = dict(self._named_parameters())
        wide = [n for n in self.shadow if params[n].dtype == torch.float32]
        # shadow <- decay * shadow + (1 - decay) * param, in one fused call per step.
        torch._foreach_lerp_([self.shadow[n] for n in wide], [params[n].detach() for n in wide], 1.0 - decay)
        # Weights kept narrower (optim.weights=bf16) are widened a tensor at a time, never all at once.
        for name in (n for n in self.shadow if params[n].dtype != torch.float32):
            self.shadow[name].lerp_(params[name].detach().float(), 1.0 - decay)
        self.updates += 1

    def full_state(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """Unsharded CPU copies; a collective when parameters are sharded, so every rank calls it. A rank
        that does not use them (``keep`` false) drops each once gathered instead of holding a whole copy."""
        state = {}
        for name, value in self.shadow.items():
            whole = (value.full_tensor() if isinstance(value, DTensor) else value).detach()
            if keep:
                state[name] = whole.cpu().contiguous()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], updates: int) -> None:
        missing = set(self.shadow) - set(state)
        if missing:
            raise KeyError(f"EMA state lacks {sorted(missing)[0]}")
        for name, shadow in self.shadow.items():
            full = state[name].to(shadow.device)
            if isinstance(shadow, DTensor):  # keep this rank's shard of the full tensor
                full = distribute_tensor(full, shadow.device_mesh, shadow.placements, src_data_rank=None)
            shadow.copy_(full)
        self.updates = updates
