"""Data parallelism applied to a task's trained modules from outside the model code.

A task names the attributes its loss calls the trained modules through (``task.parallel_modules()``,
e.g. ``unet``); wrapping replaces those attributes with the parallel wrapper while ``task.trainable``
keeps the plain modules, whose weights the checkpoint and the EMA read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdtrain.config import ParallelConfig
from sdtrain.distributed import Topology
from sdtrain.errors import UserError


class DataParallel:
    def __init__(self, config: ParallelConfig, topology: Topology, device: torch.device):
        self.config = config
        self.topology = topology
        self.device = device
        self.wrapped: list[DistributedDataParallel] = []

    def apply(self, task) -> None:
        if not self.topology.distributed:
            return
        if self.config.strategy != "ddp":
            raise UserError(f"parallel.strategy: {self.config.strategy} is not available yet; use ddp")
        for name, module in task.parallel_modules().items():
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped = DistributedDataParallel(module, device_ids=device_ids)
            setattr(task, name, wrapped)
            self.wrapped.append(wrapped)

    @contextlib.contextmanager
    def no_sync(self, skip: bool) -> Iterator[None]:
        """Skip the gradient all-reduce on micro-steps that are not the last of an accumulation."""
        with contextlib.ExitStack() as stack:
            if skip:
                for module in self.wrapped:
                    stack.enter_context(module.no_sync())
            yield

    @staticmethod
    def unwrap(module: nn.Module) -> nn.Module:
        return module.module if isinstance(module, DistributedDataParallel) else module
