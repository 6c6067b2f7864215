"""The files a fine-tuned run's trained parts are written as, in the layouts the tools users load them with read:
LoRA adapters as diffusers' ``pytorch_lora_weights.safetensors`` (``load_lora_weights``) and kohya's
``lora_kohya.safetensors`` (A1111, ComfyUI), new token vectors as ``learned_embeds.safetensors``
(``load_textual_inversion``). The trainer writes them into every checkpoint folder and ``sdtrain export`` from a
checkpoint; loaders.adapters rebuilds the modules they come from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers.utils import convert_state_dict_to_diffusers
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file
from torch import nn

from sdtrain.loaders.adapters import has_lora
from sdtrain.models import families
from sdtrain.models.families.spec import ModelFamily

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
"""The file diffusers' ``load_lora_weights(DIR)`` looks for."""
KOHYA_WEIGHTS = "lora_kohya.safetensors"
LEARNED_EMBEDS = "learned_embeds.safetensors"
INSTRUCT_PIX2PIX = "instruct_pix2pix"
"""The task key of meta.json saying a run's denoiser learned InstructPix2Pix's editing (its pipeline is the
family's InstructPix2Pix one)."""
CONTROLNET = "controlnet"
"""A ControlNet run's trained module: its name in checkpoints (``controlnet.*``) and its export's folder
(``OUT/controlnet``, diffusers' ControlNetModel layout)."""


def lora_state(module: nn.Module, weights: dict[str, torch.Tensor], text_encoder: bool = False,
               peft_names: bool = False) -> dict[str, Any]:
    """The adapter weights in the key layout diffusers' loaders read: converted to diffusers' names, or with
    `peft_names` peft's own (see ModelFamily.denoiser_lora_peft_names). `weights` are the module's tensors by their
    names in it (whole ones: the module's own may be shards). A text encoder's keep CLIP's ``text_model.`` level,
    which transformers 5 dropped from CLIPTextModel: diffusers reads them either way, and ComfyUI and older
    diffusers only with it."""
    state = get_peft_model_state_dict(module, state_dict=weights)
    if peft_names:
        return state
    state = convert_state_dict_to_diffusers(state)
    if not text_encoder:
        return state
    return {key if key.startswith("text_model.") else f"text_model.{key}": value for key, value in state.items()}


def kohya_state(modules: dict[str, nn.Module], weights: dict[str, dict[str, torch.Tensor]],
                family: ModelFamily) -> dict[str, torch.Tensor]:
    """The same adapters in kohya's layout, the one A1111, ComfyUI and diffusers all read:
    ``<prefix><module path, dots as underscores>.lora_down.weight / .lora_up.weight / .alpha``, the prefix and
    the module paths the family's (``lora_unet_``, ``lora_te_`` for SD's one text encoder, ``lora_te1_`` and
    ``lora_te2_`` for SDXL's two; SDXL's UNet paths and Flux.1's and Z-Image's transformer paths in their original
    layouts, their fused projections fused), and a true scalar alpha per module (the scale is alpha / rank)."""
    def whole(tensors: dict[str, torch.Tensor], path: str, matrix: str) -> torch.Tensor:
        return tensors[f"{path}.{matrix}.default.weight"].detach().float().cpu().contiguous()

    state = {}
    for name, module in modules.items():
        tensors = weights[name]
        layers = {path: (whole(tensors, path, "lora_A"), whole(tensors, path, "lora_B"),
                         float(layer.lora_alpha["default"]))
                  for path, layer in module.named_modules()
                  if isinstance(layer, LoraLayer) and "default" in layer.lora_A}
        state.update(family.kohya_lora(name, layers, module.config))
    return state


def _is_up(key: str) -> bool:
    """Whether a diffusers LoRA key holds an up (B) weight, in peft's names or diffusers'."""
    return ".lora_B." in key or key.endswith(".up.weight")


def save_lora(modules: dict[str, nn.Module], weights: dict[str, dict[str, torch.Tensor]], folder: Path,
              family: ModelFamily) -> Path:
    """Write ``pytorch_lora_weights.safetensors``, which the family pipeline's ``load_lora_weights(folder)``
    loads, and the same adapters as ``lora_kohya.safetensors`` for A1111 and ComfyUI where the family has a kohya
    layout for every adapted component (ComfyUI reads SD3's diffusers file itself)."""
    adapted = {name: m for name, m in modules.items() if has_lora(m)}
    layers, metadata = {}, {}
    for name, module in adapted.items():
        settings = module.peft_config["default"]
        state = lora_state(module, weights[name], name in family.text_encoders,
                           peft_names=name == family.denoiser and family.denoiser_lora_peft_names)
        # The scale alpha / rank goes into the up weights, and the file says alpha = rank: readers that ignore the
        # metadata's alpha (ComfyUI reads only .alpha keys, which this layout has none of) apply the same delta.
        scale = settings.lora_alpha / settings.r
        layers[f"{name}_lora_layers"] = {key: value * scale if _is_up(key) else value for key, value in state.items()}
        metadata[f"{name}_lora_adapter_metadata"] = {**settings.to_dict(), "lora_alpha": settings.r}
    family.pipeline_class.save_lora_weights(folder, safe_serialization=True, weight_name=LORA_WEIGHTS, **layers,
                                            **metadata)
    if all(name in family.kohya_prefixes for name in adapted):
        tmp = folder / f".{KOHYA_WEIGHTS}.tmp"
        save_file(kohya_state(adapted, weights, family), str(tmp), metadata={"ss_network_module": "networks.lora"})
        tmp.replace(folder / KOHYA_WEIGHTS)
    return folder / LORA_WEIGHTS


def learned_embeds(modules: dict[str, nn.Module], weights: dict[str, dict[str, torch.Tensor]], family: ModelFamily,
                   placeholder: str) -> dict[str, torch.Tensor]:
    """The textual-inversion file's tensors: for one text encoder diffusers' layout, one key (the placeholder)
    holding all its vectors; for several, one key per text encoder as the family names them (SDXL: clip_l,
    clip_g, as A1111 and ComfyUI write SDXL embeddings)."""
    def vectors(name: str) -> torch.Tensor:
        table = modules[name].get_input_embeddings()
        path = next(path for path, layer in modules[name].named_modules() if layer is table)
        return weights[name][f"{path}.added"].detach().float().cpu().contiguous()

    if not family.embedding_keys:
        return {placeholder: vectors(family.text_encoders[0])}
    return {key: vectors(name) for key, name in zip(family.embedding_keys, family.text_encoders)}


def save_learned_embeds(modules: dict[str, nn.Module], weights: dict[str, dict[str, torch.Tensor]],
                        family: ModelFamily, placeholder: str, path: Path) -> Path:
    """The file, with the placeholder in its metadata: a file keyed by text encoder does not name its token."""
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(learned_embeds(modules, weights, family, placeholder), str(tmp),
              metadata={"placeholder_token": placeholder})
    tmp.replace(path)
    return path


def has_trained_parts(meta: dict[str, Any]) -> bool:
    """Whether `save_trained_parts` writes any file for a checkpoint of this meta.json: LoRA runs (DreamBooth's
    too) and textual-inversion runs."""
    task = meta.get("task", {})
    return bool(task.get("lora") or task.get("tokens"))


def save_trained_parts(modules: dict[str, nn.Module], meta: dict[str, Any], folder: Path,
                       weights: dict[str, dict[str, torch.Tensor]] | None = None) -> list[Path]:
    """The small files a fine-tuning mode produces, in the layouts diffusers' loaders read:
    ``pytorch_lora_weights.safetensors`` (``load_lora_weights``) and ``learned_embeds.safetensors``
    (``load_textual_inversion``). `sdtrain export` writes them from a checkpoint, and the trainer into every
    checkpoint folder it saves, with the same weights (EMA where the run keeps one). `weights` holds each module's
    trained tensors whole, by their names in it, when the modules' own are not (shards, live training weights);
    without it the modules' own are written. The modules give only the structure: which layers carry adapters,
    their settings and the model's config."""
    task = meta.get("task", {})
    family = families.get(task.get("family", "sd"))
    if weights is None:
        weights = {name: module.state_dict() for name, module in modules.items()}
    written = []
    if task.get("lora"):
        written.append(save_lora(modules, weights, folder, family))
    if task.get("tokens"):
        written.append(save_learned_embeds(modules, weights, family, task["placeholder_token"],
                                           folder / LEARNED_EMBEDS))
    return written
