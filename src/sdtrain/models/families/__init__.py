"""Model families: one spec per family says which components it has and of which classes, and which
repeated blocks each component has (the units of activation checkpointing, compilation and FSDP sharding).

Code outside a family's module asks its spec rather than naming the family's classes. Stable Diffusion
1.x/2.x is the first family (`sd`); the spec grows (conditioning, pipeline, file layouts) as families join.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open
from torch import nn

from sdtrain.errors import UserError
from sdtrain.models.families.sd import SD
from sdtrain.models.families.spec import ModelFamily

FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (SD,)}


def blocks(root: nn.Module) -> list[nn.Module]:
    """The repeated blocks of whatever family's components `root` holds, in the order of `root.modules()`."""
    found = {id(block) for family in FAMILIES.values() for block in family.blocks(root)}
    return [module for module in root.modules() if id(module) in found]


# Families this release recognises but does not train yet: a pipeline class or single-file key -> its name.
_OTHER_PIPELINES = {"StableDiffusionXLPipeline": "SDXL", "StableDiffusionXLImg2ImgPipeline": "SDXL",
                    "StableDiffusion3Pipeline": "SD3", "FluxPipeline": "Flux.1"}
_OTHER_KEYS = {"conditioner.embedders.": "SDXL", "model.diffusion_model.joint_blocks.": "SD3",
               "double_blocks.": "Flux.1", "model.diffusion_model.double_blocks.": "Flux.1"}
_SD_PIPELINES = ("StableDiffusionPipeline",)
_SD_KEYS = ("model.diffusion_model.input_blocks.", "cond_stage_model.", "first_stage_model.")


def detect(source: str | Path) -> ModelFamily:
    """The family of a pretrained pipeline folder or single file, from its files alone (the pipeline class in
    model_index.json; a single file's key names). Other sources (a run, a component folder) are this
    release's own family. A model of a family this release does not train is one line naming what was found."""
    path = Path(source)
    found = None
    if (path / "model_index.json").is_file():
        try:
            found = json.loads((path / "model_index.json").read_text()).get("_class_name")
        except (OSError, ValueError, AttributeError):
            return SD  # the pipeline loader reports what is wrong with the file
        if found in _SD_PIPELINES:
            return SD
        family = _OTHER_PIPELINES.get(found)
    elif path.is_file() and path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt") as file:
                keys = list(file.keys())
        except (OSError, SafetensorError):
            return SD  # the single-file loader reports what is wrong with the file
        if any(key.startswith(_SD_KEYS) for key in keys):
            return SD
        family = next((name for prefix, name in _OTHER_KEYS.items() if any(k.startswith(prefix) for k in keys)), None)
        found = f"keys such as {', '.join(keys[:3])}"
    else:
        return SD
    what = f"{family}, which this release does not train yet" if family else "of no model family this release knows"
    raise UserError(f"model.pretrained: {path} is {what} ({found}); sdtrain trains Stable Diffusion 1.x and 2.x "
                    "(StableDiffusionPipeline folders and single files in the original SD layout)")
