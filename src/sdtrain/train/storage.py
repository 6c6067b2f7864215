"""Where a diffusion run's frozen weights live: the precision their linear layers are stored in
(``model.frozen_precision``, planned from the shapes before any weight loads, since weights are stored low as they
load) and whether the blocks holding them stay in host memory, streamed to the device a block ahead of use
(``model.offload_frozen``). A component of the diffusion task: the task asks it how each component loads, and
hands it each module to place and the frozen ones to store."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from sdtrain.config import RunConfig
from sdtrain.distributed import detect_topology
from sdtrain.models import families
from sdtrain.models.families.spec import ModelFamily
from sdtrain.models.frozen import storage_bytes, store_frozen, stored_bytes
from sdtrain.models.offload import WeightStream
from sdtrain.train import autotune

log = logging.getLogger(__name__)


def on_meta(module: nn.Module) -> bool:
    """Whether `module` was built or released without its weights."""
    return next(module.parameters()).is_meta


class FrozenStorage:
    """The run's storage of frozen weights. `keeps_frozen(name)`: whether the trained part trains none of
    component `name`'s linear weights (the mode's answer)."""

    def __init__(self, config: RunConfig, device: torch.device, family: ModelFamily,
                 keeps_frozen: Callable[[str], bool], resumed: dict[str, Any]):
        self.config = config
        self.device = device
        self.family = family
        self.keeps_frozen = keeps_frozen
        model = config.model
        # A resumed run keeps the storage it started with: its adapters trained over that base.
        self.fixed = model.frozen_precision if model.frozen_precision != "auto" else resumed.get("frozen_precision")
        self.precision: str = self.fixed or "auto"
        """``model.frozen_precision`` as this run applies it: the planner's choice for ``auto``, and on resume
        the run's first choice."""
        self.offloads = model.offload_frozen is True
        # FSDP shards the frozen base across the ranks instead of streaming it from the host.
        self.sharded = config.parallel.strategy == "fsdp" and detect_topology().distributed
        """Whether FSDP shards the denoiser across the ranks."""
        self._offload_planned = model.offload_frozen == "auto" and device.type == "cuda" and self.fixed != "fp32" \
            and not self.sharded

    @property
    def needs_plan(self) -> bool:
        """Whether the precision or the offload is the planner's to choose (`plan`)."""
        return self.fixed is None or self._offload_planned

    def plan(self, modules: dict[str, nn.Module], unread: list[str]) -> None:
        """Choose the storage for the frozen weights of `modules` (built without weights) that training reads,
        beside the state of those that train (autotune.plan_frozen_precision), or whether the fixed one fits (for
        ``model.offload_frozen: auto``); logged with the figures behind it."""
        stored = dict.fromkeys(autotune.FROZEN_ORDER, 0)
        trained: list[nn.Parameter] = []
        for name, module in modules.items():
            if name in unread:
                continue
            if self.keeps_frozen(name):
                stored = {precision: stored[precision] + size for precision, size in storage_bytes(module).items()}
            else:  # a text encoder with adapters counts whole: the planner errs on the side of fitting
                trained += list(module.parameters())
        optim = self.config.optim
        state = autotune.training_bytes(trained, [], 0, 0, self.config.ema.enabled, checkpointing=False,
                                        optimizer=optim.name, in_backward=optim.in_backward,
                                        weight_size=2 if optim.weights == "bf16" else None)
        available, held = autotune.memory_budget(self.device, detect_topology().local_world_size)
        chosen = autotune.plan_frozen_precision(stored, state, held, available, self.fixed)
        log.info("model.frozen_precision=%s: %s (%s)", self.fixed or "auto", chosen.precision, chosen.why)
        self.precision = chosen.precision
        self.offloads = self.offloads or (self._offload_planned and not chosen.fits)

    def stored_as(self, name: str) -> str:
        """How component `name`'s linear weights are stored as it loads: the run's precision for the denoiser and
        text encoders the trained part keeps frozen, so their full-precision weights never all exist; fp32 for the
        rest (the VAE's few linear layers, in its attention, decode validation images)."""
        trained = (self.family.components.denoiser, *self.family.components.text_encoders)
        if name not in trained or not self.keeps_frozen(name):
            return "fp32"
        return self.precision

    def stages(self, name: str) -> bool:
        """Whether component `name` waits in host memory for FSDP, which moves each block's shard to the GPU as it
        shards it: the denoiser FSDP shards, so a base larger than one GPU never has to fit on one (each rank's
        host memory holds it once, in its storage)."""
        return self.sharded and self.device.type != "cpu" and name == self.family.components.denoiser

    def offload(self, module: nn.Module) -> None:
        """``model.offload_frozen``: the frozen linear weights stored low in `module`'s blocks kept in host memory
        and streamed to the device a block ahead of use (models/offload.py). Layers stored later are streamed when
        they are (`store`)."""
        if not self.offloads or on_meta(module):
            return
        stream = WeightStream(families.blocks(module), self.device)
        if stream.layers:
            log.info("model.offload_frozen: %d frozen linear layers in %d blocks of the %s stay in host memory, "
                     "streamed to the %s a block ahead", sum(map(len, stream.layers)), len(stream.layers),
                     type(module).__name__, self.device.type)

    def store(self, modules: Iterable[nn.Module]) -> None:
        """The frozen linear weights of `modules` (the denoiser and text encoders) in the run's precision."""
        if self.precision == "fp32":
            return
        loaded = [module for module in modules if not on_meta(module)]
        for module in loaded:
            store_frozen(module, self.precision)
            self.offload(module)
        stored, full = (sum(sizes) for sizes in zip(*(stored_bytes(module) for module in loaded)))
        log.info("model.frozen_precision=%s: frozen linear weights take %.2f GiB (%.2f GiB in fp32)",
                 self.precision, stored / 2**30, full / 2**30)
