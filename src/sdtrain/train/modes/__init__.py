"""Fine-tuning modes: each a small task over the diffusion task that overrides only the steps it changes
(what trains, the data's captions, the loss, what a checkpoint records), and the small files each exports.
What rebuilds their partly trained modules from a checkpoint is in sdtrain.loaders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdtrain.config import RunConfig
from sdtrain.models import families
from sdtrain.train.modes.dreambooth import DreamBoothRecipe
from sdtrain.train.modes.lora import LoraTask, save_lora
from sdtrain.train.modes.textual_inversion import (
    LEARNED_EMBEDS,
    TextualInversionTask,
    save_learned_embeds,
)
from sdtrain.train.tasks import TASKS, DataRecipe, DiffusionTask, Task

# What trains, by mode; DreamBooth trains the whole model, or adapters with dreambooth.lora.
TRAINED = {"full": DiffusionTask, "lora": LoraTask, "textual_inversion": TextualInversionTask,
           "dreambooth": DiffusionTask}
# What the run trains on, by mode: the data as it is, or DreamBooth's instance and class images.
RECIPES: dict[str, type[DataRecipe]] = {"dreambooth": DreamBoothRecipe}


def task_class(config: RunConfig) -> type[Task]:
    """What a run trains: a stage's task, or for the diffusion stage its mode's trained part."""
    if config.stage != "diffusion":
        return TASKS[config.stage]
    if config.mode == "dreambooth" and config.dreambooth.lora:
        return LoraTask
    return TRAINED[config.mode]


def recipe_class(config: RunConfig) -> type[DataRecipe]:
    """What a diffusion run trains on: its mode's data recipe, else the plain one."""
    return RECIPES.get(config.mode, DataRecipe)


def prepare_task(config: RunConfig, run_dir: Path) -> None:
    task_class(config).prepare(config, run_dir)
    if config.stage == "diffusion":
        recipe_class(config).prepare(config, run_dir)


def make_task(config: RunConfig, device: torch.device, run_dir: Path, resumed: dict[str, Any] | None = None) -> Task:
    """The run's task, its data recipe given to it; `resumed`: the meta.json of the checkpoint it resumes from."""
    cls = task_class(config)
    if config.stage != "diffusion":
        return cls(config, device, run_dir, resumed)
    return cls(config, device, run_dir, resumed, recipe=recipe_class(config)(config, run_dir))


def has_trained_parts(meta: dict[str, Any]) -> bool:
    """Whether `save_trained_parts` writes any file for a checkpoint of this meta.json: LoRA runs (DreamBooth's
    too) and textual-inversion runs."""
    task = meta.get("task", {})
    return bool(task.get("lora") or task.get("tokens"))


def save_trained_parts(modules: dict[str, nn.Module], meta: dict[str, Any], folder: Path) -> list[Path]:
    """The small files a fine-tuning mode produces, in the layouts diffusers' loaders read:
    ``pytorch_lora_weights.safetensors`` (``load_lora_weights``) and ``learned_embeds.safetensors``
    (``load_textual_inversion``). `sdtrain export` writes them from a checkpoint, and the trainer into every
    checkpoint folder it saves, with the same weights (EMA where the run keeps one)."""
    task = meta.get("task", {})
    family = families.get(task.get("family", "sd"))
    written = []
    if task.get("lora"):
        written.append(save_lora(modules, folder, family))
    if task.get("tokens"):
        written.append(save_learned_embeds(modules, family, task["placeholder_token"], folder / LEARNED_EMBEDS))
    return written
