"""What a model family is: the spec every family module fills in (see the package docstring)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass(frozen=True)
class ModelFamily:
    name: str
    components: dict[str, type[nn.Module]]
    """Component name (vae, text_encoder, unet, ...) -> its class."""
    block_lists: dict[type[nn.Module], Callable[[nn.Module], list[nn.Module | None]]] = field(default_factory=dict)
    """Component class -> its repeated blocks, in forward order (None entries, an absent mid block, are skipped)."""
    presets: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    """Preset name -> component name -> constructor settings."""

    def blocks(self, root: nn.Module) -> list[nn.Module]:
        """The blocks of every component of this family inside `root` (a component itself, or a module that
        holds components), in the order of `root.modules()`."""
        listed: set[int] = set()
        for module in root.modules():
            lister = self.block_lists.get(type(module))
            if lister is not None:
                listed.update(id(block) for block in lister(module) if block is not None)
        return [module for module in root.modules() if id(module) in listed]
