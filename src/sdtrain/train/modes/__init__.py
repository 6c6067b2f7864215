"""Fine-tuning modes: each a small task over the diffusion task that overrides only the steps it changes
(what trains, the data's captions, the loss, what a checkpoint records), plus what rebuilds its partly
trained modules from a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdtrain.config import RunConfig
from sdtrain.errors import UserError
from sdtrain.models import families
from sdtrain.train.modes.dreambooth import DreamBoothLoraTask, DreamBoothTask
from sdtrain.train.modes.lora import LoraTask, merge_lora, rebuild_lora, save_lora
from sdtrain.train.modes.textual_inversion import (
    LEARNED_EMBEDS,
    TextualInversionTask,
    merge_token_rows,
    rebuild_textual_inversion,
    save_learned_embeds,
)
from sdtrain.train.tasks import TASKS, Task

MODES = {"lora": LoraTask, "textual_inversion": TextualInversionTask, "dreambooth": DreamBoothTask}


def mode_task(config: Any) -> type:
    if config.mode == "dreambooth" and config.dreambooth.lora:
        return DreamBoothLoraTask
    return MODES[config.mode]


def task_class(config: RunConfig) -> type[Task]:
    """What a run trains: a stage's task, or for fine-tuning the diffusion stage, its mode's."""
    if config.stage == "diffusion" and config.mode != "full":
        return mode_task(config)
    return TASKS[config.stage]


def prepare_task(config: RunConfig, run_dir: Path) -> None:
    task_class(config).prepare(config, run_dir)


def make_task(config: RunConfig, device: torch.device, run_dir: Path, pinned: dict[str, str] | None = None) -> Task:
    return task_class(config)(config, device, run_dir, pinned)

_REBUILDERS = {"lora": rebuild_lora, "textual_inversion": rebuild_textual_inversion}


def rebuild_partial(name: str, meta: dict[str, Any]) -> nn.Module:
    """A partly trained module of a checkpoint (see meta.json), without its trained tensors yet: its base
    loaded from the pinned source, with the structure its mode added (adapters, new token rows)."""
    task = meta.get("task", {})
    mode = task.get("mode")
    if task.get("lora"):
        mode = "lora"  # DreamBooth with LoRA records its adapters the same way
    rebuild = _REBUILDERS.get(mode)
    source = meta.get("sources", {}).get(name)
    if rebuild is None or source is None:
        raise UserError(f"checkpoint: the {name} was partly trained in mode {mode!r}, which this sdtrain cannot "
                        "rebuild; use the sdtrain version that wrote it")
    return rebuild(name, source, task)


def merge_partial(module: nn.Module) -> nn.Module:
    """A partly trained module as a plain one: adapters folded into their layers, new token rows appended
    to the embedding table."""
    module = merge_lora(module)
    return merge_token_rows(module) if hasattr(module, "get_input_embeddings") else module


def save_trained_parts(modules: dict[str, nn.Module], meta: dict[str, Any], folder: Path) -> list[Path]:
    """The small files a fine-tuning mode produces, in the layouts diffusers' loaders read:
    ``pytorch_lora_weights.safetensors`` (``load_lora_weights``) and ``learned_embeds.safetensors``
    (``load_textual_inversion``)."""
    task = meta.get("task", {})
    family = families.get(task.get("family", "sd"))
    written = []
    if task.get("lora"):
        written.append(save_lora(modules, folder, family))
    if task.get("tokens"):
        written.append(save_learned_embeds(modules, family, task["placeholder_token"], folder / LEARNED_EMBEDS))
    return written
