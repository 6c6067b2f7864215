"""Frozen weights kept in host memory and streamed to the device a block ahead of use (``model.offload_frozen``):
kohya's block swap, for a base stored in low precision (models/frozen.py) that does not fit the GPU even so.

Only the stored bits of the frozen linear layers inside the model's repeated blocks move (nearly all of a
transformer's weights); everything else stays on the device. Each block's bits are copied to the device when the
block before it starts (on a side CUDA stream, so the copy overlaps the computation), used, and dropped once
computation has moved two blocks on: at most ``ahead + 1`` blocks' bits are on the device at once, whatever the
model's depth. Backward walks the blocks in reverse and streams them in that order; with gradient checkpointing,
the recomputation of a block in backward streams it again. The frozen layer keeps no device copy for its backward
(it fetches its bits again), so nothing of an offloaded block outlives its turn.

On a CPU the device is the host: nothing is copied, and the same bookkeeping runs (what the tests check).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (recomputation included)."""
    return torch._C._current_graph_task_id() != -1


class WeightStream:
    """Streams the stored bits of the frozen linear layers of `blocks` (in the order they run) to `device`,
    `ahead` blocks before use."""

    def __init__(self, blocks: list[nn.Module], device: torch.device, ahead: int = 1):
        self.device = device
        self.ahead = ahead
        # A layer belongs to the first block that holds it (an outer block before the blocks nested in it).
        self.layers: list[list[nn.Module]] = []
        claimed: set[int] = set()
        for block in blocks:
            layers = [m for m in block.modules() if _stored(m) and id(m) not in claimed]
            claimed.update(id(m) for m in layers)
            if layers:
                self.layers.append(layers)
        self.block_of = {id(layer): index for index, layers in enumerate(self.layers) for layer in layers}
        self.resident: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self.ready: dict[int, Any] = {}
        """A block's copy event, on CUDA: the computation waits for it before reading the bits."""
        self.copies = 0
        """Blocks copied to the device so far (a block fetched twice in a step, forward and backward, counts twice)."""
        self.most_resident = 0
        """The most blocks whose bits were on the device at once."""
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        for layers in self.layers:
            for layer in layers:
                _to_host(layer, pin=device.type == "cuda")
                layer.weight_stream = self

    def fetch(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`layer`'s stored bits and scale on the device; streams the next blocks in the direction of the pass."""
        index = self.block_of[id(layer)]
        step = -1 if _in_backward() else 1
        window = [index + step * k for k in range(self.ahead + 1) if 0 <= index + step * k < len(self.layers)]
        for block in list(self.resident):
            if block not in window:
                self._drop(block)
        for block in window:
            self._load(block)
        self.most_resident = max(self.most_resident, len(self.resident))
        event = self.ready.pop(index, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        return self.resident[index][id(layer)]

    def _load(self, block: int) -> None:
        if block in self.resident:
            return
        self.copies += 1
        if self.copy_stream is None:
            self.resident[block] = {id(m): (m.weight_stored.to(self.device), _maybe_to(m.weight_scale, self.device))
                                    for m in self.layers[block]}
            return
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.copy_stream):
            copied = {id(m): (m.weight_stored.to(self.device, non_blocking=True),
                              _maybe_to(m.weight_scale, self.device, non_blocking=True)) for m in self.layers[block]}
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        for stored, scale in copied.values():
            # Allocated on the copy stream, read on the compute stream: freed only after the compute stream is done.
            stored.record_stream(compute)
            if scale is not None:
                scale.record_stream(compute)
        self.resident[block] = copied
        self.ready[block] = event

    def _drop(self, block: int) -> None:
        self.resident.pop(block, None)
        self.ready.pop(block, None)


def _stored(module: nn.Module) -> bool:
    return hasattr(module, "weight_stored") and not hasattr(module, "weight_stream")


def _maybe_to(tensor: torch.Tensor | None, device: torch.device, non_blocking: bool = False) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device, non_blocking=non_blocking)


def _to_host(layer: nn.Module, pin: bool) -> None:
    """`layer`'s stored bits and scale as plain attributes in host memory (pinned for asynchronous copies), so that
    moving the module to the device leaves them where they are."""
    for name in ("weight_stored", "weight_scale"):
        tensor = layer._buffers.pop(name, None)
        if tensor is not None:
            tensor = tensor.cpu()
            tensor = tensor.pin_memory() if pin else tensor
        object.__setattr__(layer, name, tensor)


def streamed_layers(module: nn.Module) -> int:
    """How many of `module`'s layers stream their weights."""
    return sum(1 for m in module.modules() if hasattr(m, "weight_stream"))
