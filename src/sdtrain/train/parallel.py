"""Activation checkpointing, compilation and data parallelism, applied to a task's trained modules
from outside the model code, in that order (as torchtitan's parallelize step does).

A task names the attributes its loss calls the trained modules through (``task.parallel_modules()``,
e.g. ``unet``); wrapping replaces those attributes with the parallel wrapper while ``task.trainable``
keeps the plain modules, whose weights the checkpoint and the EMA read.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

from sdtrain.config import ParallelConfig
from sdtrain.distributed import Topology
from sdtrain.models import families
from sdtrain.models.frozen import as_parameters

log = logging.getLogger(__name__)


class DataParallel:
    def __init__(self, config: ParallelConfig, topology: Topology, device: torch.device):
        self.config = config
        self.topology = topology
        self.device = device
        self.wrapped: list[DistributedDataParallel] = []
        self.sharded: list[nn.Module] = []

    def apply(self, task, bf16: bool = False, checkpointing: bool = False, compile: bool = False,
              cuda_graphs: bool = False) -> None:
        """Checkpointing and compilation of each block of the trained modules (`cuda_graphs`: compiled blocks
        replay as CUDA graphs), then the data-parallel wrapping of several processes."""
        for module in task.parallel_modules().values() if compile or checkpointing else ():
            for block in shard_units(module):
                if compile:
                    # Static shapes: training shapes are fixed, and dynamic-shape graphs hit inductor bugs here.
                    block.forward = torch.compile(block.forward, dynamic=False,
                                                  mode="reduce-overhead" if cuda_graphs else None)
                if checkpointing:
                    block.forward = _checkpointed(block.forward)
        if not self.topology.distributed:
            return
        if self.config.strategy == "fsdp":
            self._shard(task, bf16)
            return
        for name, module in task.parallel_modules().items():
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            # The models' buffers are constants (positions, frozen weights stored in low precision), the same on
            # every rank from the same source: DDP's default re-sends them before every forward, which for a
            # low-precision frozen base would move the whole base each step.
            # Parameters that train but that no output reads (the family says which) get no gradient: DDP must look
            # for them each step, or it waits for them forever.
            unused = any(parameter.requires_grad for path in task.family.conditioner.unused_modules(name, module)
                         for parameter in module.get_submodule(path).parameters())
            wrapped = DistributedDataParallel(module, device_ids=device_ids, broadcast_buffers=False,
                                              find_unused_parameters=unused)
            setattr(task, name, wrapped)
            self.wrapped.append(wrapped)

    def _shard(self, task, bf16: bool) -> None:
        """FSDP2: each block of the model is its own shard unit, then the whole module; parameters are
        gathered in bf16 and gradients reduced in fp32 when training in bf16."""
        mesh = init_device_mesh(self.device.type, (self.topology.world_size,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        for name, module in task.parallel_modules().items():
            # A frozen base stored low (model.frozen_precision) is sharded with the rest: parameters, not buffers.
            as_parameters(module)
            for block in shard_units(module):
                fully_shard(block, mesh=mesh, mp_policy=policy)
            fully_shard(module, mesh=mesh, mp_policy=policy)
            self.sharded.append(module)
            weights = [(p.numel() * p.element_size(), p.requires_grad) for p in module.parameters()]
            total, frozen = sum(size for size, _ in weights), sum(size for size, trains in weights if not trains)
            whole = sum(b.numel() * b.element_size() for b in module.buffers())
            log.info("FSDP2 shards the %s over %d ranks: %.3g GiB of weights (%.3g GiB of them frozen), %.3g GiB per "
                     "rank; %.3g GiB of buffers stay whole on every rank", name, self.topology.world_size,
                     total / 2**30, frozen / 2**30, total / self.topology.world_size / 2**30, whole / 2**30)

    @contextlib.contextmanager
    def no_sync(self, skip: bool) -> Iterator[None]:
        """Skip the gradient reduction on micro-steps that are not the last of an accumulation."""
        for module in self.sharded:
            module.set_requires_gradient_sync(not skip)
        with contextlib.ExitStack() as stack:
            if skip:
                for module in self.wrapped:
                    stack.enter_context(module.no_sync())
            yield


def shard_units(root: nn.Module) -> list[nn.Module]:
    """The repeated blocks of the model components in `root`, as their family's spec lists them: the units
    of activation checkpointing, compilation and FSDP sharding. A component no spec knows would silently
    train without any of them, so it is an error."""
    units = families.blocks(root)
    if not units:
        raise RuntimeError(f"{type(root).__name__}: no model family lists blocks for the components it holds; "
                           "add them to the family's spec (sdtrain.models.families)")
    return units


_uncounted = False


@contextlib.contextmanager
def uncounted_recomputation() -> Iterator[None]:
    """Within it, a checkpointed block's recomputation during backward runs outside every dispatch mode, so a FLOP
    counter sees the model's own work only; memory stays as checkpointing keeps it. (Running the blocks plainly
    instead would need the very memory checkpointing was turned on to save.)"""
    global _uncounted
    previous, _uncounted = _uncounted, True
    try:
        yield
    finally:
        _uncounted = previous


def _checkpointed(forward: Callable) -> Callable:
    """The block's forward, keeping only its inputs for backward and running it again there.

    Set on the instance rather than wrapping the module, so parameter names (and with them
    checkpoints, EMA and export) stay those of the plain model; parallel wrappers' hooks, which run
    around the module call, stay outside the recomputed part.
    """

    def again(*args, **kwargs):
        # The autograd engine runs a graph task only in backward, where the block's forward is the recomputation.
        if _uncounted and torch._C._current_graph_task_id() != -1:
            with _disable_current_modes():
                return forward(*args, **kwargs)
        return forward(*args, **kwargs)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(again, *args, use_reentrant=False, **kwargs)

    return run
