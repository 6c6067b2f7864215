"""Fine-tuning modes: each supplies the diffusion task the components it changes: what trains (the whole model,
LoRA adapters, textual inversion's new tokens: train.parts and this package) and what it trains on (the data as it
is, or DreamBooth's instance and class images: a data recipe), so any trained part combines with any recipe. The
files each trained part exports are written, and its modules rebuilt from a checkpoint, in sdtrain.loaders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from sdtrain.config import RunConfig
from sdtrain.models import families
from sdtrain.train.modes.controlnet import ControlNetPart
from sdtrain.train.modes.dreambooth import DreamBoothRecipe
from sdtrain.train.modes.instruct_pix2pix import InstructPix2PixPart
from sdtrain.train.modes.lora import Adapters
from sdtrain.train.modes.reference import ReferencePart
from sdtrain.train.modes.textual_inversion import NewTokens
from sdtrain.train.parts import Together, TrainedPart
from sdtrain.train.tasks import TASKS, DataRecipe, DiffusionTask, Task, capability_problems

# What trains, by mode; DreamBooth trains the whole model, or adapters with dreambooth.lora.
TRAINED: dict[str, type[TrainedPart]] = {"lora": Adapters, "textual_inversion": NewTokens,
                                         "controlnet": ControlNetPart, "instruct_pix2pix": InstructPix2PixPart}
# What the run trains on, by mode: the data as it is, or DreamBooth's instance and class images.
RECIPES: dict[str, type[DataRecipe]] = {"dreambooth": DreamBoothRecipe}


def part_classes(config: RunConfig) -> list[type[TrainedPart]]:
    """What a diffusion run trains, a part per mode that trains one (adapters last), else the whole model."""
    parts = [TRAINED[mode] for mode in config.modes if mode in TRAINED]
    if "dreambooth" in config.modes and config.dreambooth.lora:
        parts.append(Adapters)
    # Editing by reference trains nothing of its own: it is given beside what trains (the whole model by default).
    return [*(parts or [TrainedPart]), *([ReferencePart] if config.edit.reference else [])]


def make_part(config: RunConfig, family: families.ModelFamily) -> TrainedPart:
    """The run's trained part: its one part, or its parts together."""
    parts = [cls(config, family) for cls in part_classes(config)]
    return parts[0] if len(parts) == 1 else Together(config, family, parts)


def recipe_class(config: RunConfig) -> type[DataRecipe]:
    """What a diffusion run trains on: its mode's data recipe, else the plain one."""
    return next((RECIPES[mode] for mode in config.modes if mode in RECIPES), DataRecipe)


def capability(config: RunConfig) -> tuple[str, list[str]]:
    """What the run trains, in words, and every key of `config` its model's family or its mode cannot take, one
    line each, read from the config, the families' specs and the pretrained models' config files: no weight loads
    (`sdtrain train --check`; every run checks the same as its task is built)."""
    if config.stage != "diffusion":
        return f"stage {config.stage}", []
    family = families.for_model(config.model)
    parts = part_classes(config)
    trains = f"{family.title}, mode {config.mode_name}" + (
        " (adapters)" if "dreambooth" in config.modes and Adapters in parts else "") + (
        ", editing by reference" if ReferencePart in parts else "")
    return trains, capability_problems(config, family, parts)


def prepare_task(config: RunConfig, run_dir: Path) -> None:
    TASKS[config.stage].prepare(config, run_dir)
    if config.stage == "diffusion":
        recipe_class(config).prepare(config, run_dir)


def make_task(config: RunConfig, device: torch.device, run_dir: Path, resumed: dict[str, Any] | None = None) -> Task:
    """The run's task, given its trained part and data recipe; `resumed`: the meta.json of the checkpoint it resumes
    from."""
    if config.stage != "diffusion":
        return TASKS[config.stage](config, device, run_dir, resumed)
    part = make_part(config, families.for_model(config.model))
    return DiffusionTask(config, device, run_dir, resumed, part=part, recipe=recipe_class(config)(config, run_dir))
