"""Model families: one spec per family says which components it has and of which classes, and which
repeated blocks each component has (the units of activation checkpointing, compilation and FSDP sharding).

Code outside a family's module asks its spec rather than naming the family's classes. Stable Diffusion
1.x/2.x is the first family (`sd`); the spec grows (conditioning, pipeline, file layouts) as families join.
"""

from __future__ import annotations

from torch import nn

from sdtrain.models.families.sd import SD
from sdtrain.models.families.spec import ModelFamily

FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (SD,)}


def blocks(root: nn.Module) -> list[nn.Module]:
    """The repeated blocks of whatever family's components `root` holds, in the order of `root.modules()`."""
    found = {id(block) for family in FAMILIES.values() for block in family.blocks(root)}
    return [module for module in root.modules() if id(module) in found]
