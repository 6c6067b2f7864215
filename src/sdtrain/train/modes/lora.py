"""LoRA (Hu et al., 2021) through peft: low-rank adapters on the UNet's attention projections and,
optionally, the text encoder's; the base weights stay frozen and out of the checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers.utils import convert_state_dict_to_diffusers
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file
from torch import nn

from sdtrain.config import LoraConfig
from sdtrain.loaders.adapters import add_lora, has_lora
from sdtrain.models.families.spec import ModelFamily
from sdtrain.train.tasks import DiffusionTask

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
"""The file diffusers' ``load_lora_weights(DIR)`` looks for."""
KOHYA_WEIGHTS = "lora_kohya.safetensors"


def lora_settings(config: LoraConfig, text_encoder: bool = False) -> dict[str, Any]:
    """peft LoraConfig arguments; kept in meta.json so a checkpoint rebuilds the same adapters."""
    return {
        "r": config.rank,
        "lora_alpha": config.alpha or config.rank,
        "lora_dropout": config.dropout,
        # Gaussian A, zero B: the adapted model starts exactly as the base.
        "init_lora_weights": "gaussian",
        "target_modules": list(config.text_encoder_target_modules if text_encoder else config.target_modules),
    }


class LoraTask(DiffusionTask):
    def keeps_frozen(self, name: str) -> bool:
        # Every base stays frozen: adapters train beside its linear layers.
        return True

    def make_trainable(self) -> dict[str, nn.Module]:
        cfg = self.config.lora
        denoiser = self.family.denoiser
        self.adapters = {denoiser: lora_settings(cfg)}
        self.denoiser.requires_grad_(False)
        add_lora(self.denoiser, self.adapters[denoiser], "lora.target_modules")
        self.denoiser.train()
        trainable = {denoiser: self.denoiser}
        adapted = self.family.lora_text_encoders or self.family.text_encoders
        for name, text_encoder in self.text_encoders.items():
            text_encoder.requires_grad_(False)
            if not cfg.text_encoder or name not in adapted:
                text_encoder.eval()
                continue
            self.adapters[name] = lora_settings(cfg, text_encoder=True)
            add_lora(text_encoder, self.adapters[name], "lora.text_encoder_target_modules")
            text_encoder.train()
            trainable[name] = text_encoder
        return trainable

    def text_encoder_trains(self) -> bool:
        return self.config.lora.text_encoder

    def checkpoint_meta(self) -> dict[str, Any]:
        return {**super().checkpoint_meta(), "lora": self.adapters}


def lora_state(module: nn.Module, text_encoder: bool = False, peft_names: bool = False) -> dict[str, Any]:
    """The adapter weights in the key layout diffusers' loaders read: converted to diffusers' names, or with
    `peft_names` peft's own (see ModelFamily.denoiser_lora_peft_names). A text encoder's keep CLIP's
    ``text_model.`` level, which transformers 5 dropped from CLIPTextModel: diffusers reads them either way, and
    ComfyUI and older diffusers only with it."""
    state = get_peft_model_state_dict(module)
    if peft_names:
        return state
    state = convert_state_dict_to_diffusers(state)
    if not text_encoder:
        return state
    return {key if key.startswith("text_model.") else f"text_model.{key}": value for key, value in state.items()}


def kohya_state(modules: dict[str, nn.Module], family: ModelFamily) -> dict[str, torch.Tensor]:
    """The same adapters in kohya's layout, the one A1111, ComfyUI and diffusers all read:
    ``<prefix><module path, dots as underscores>.lora_down.weight / .lora_up.weight / .alpha``, the prefix and
    the module paths the family's (``lora_unet_``, ``lora_te_`` for SD's one text encoder, ``lora_te1_`` and
    ``lora_te2_`` for SDXL's two; SDXL's UNet paths and Flux.1's transformer paths in their original layouts,
    Flux.1's fused projections fused), and a true scalar alpha per module (the scale is alpha / rank)."""
    state = {}
    for name, module in modules.items():
        layers = {path: (layer.lora_A["default"].weight.detach().float().cpu().contiguous(),
                         layer.lora_B["default"].weight.detach().float().cpu().contiguous(),
                         float(layer.lora_alpha["default"]))
                  for path, layer in module.named_modules()
                  if isinstance(layer, LoraLayer) and "default" in layer.lora_A}
        state.update(family.kohya_lora(name, layers, module.config))
    return state


def _is_up(key: str) -> bool:
    """Whether a diffusers LoRA key holds an up (B) weight, in peft's names or diffusers'."""
    return ".lora_B." in key or key.endswith(".up.weight")


def save_lora(modules: dict[str, nn.Module], folder: Path, family: ModelFamily) -> Path:
    """Write ``pytorch_lora_weights.safetensors``, which the family pipeline's ``load_lora_weights(folder)``
    loads, and the same adapters as ``lora_kohya.safetensors`` for A1111 and ComfyUI where the family has a kohya
    layout for every adapted component (ComfyUI reads SD3's diffusers file itself)."""
    adapted = {name: m for name, m in modules.items() if has_lora(m)}
    layers, metadata = {}, {}
    for name, module in adapted.items():
        settings = module.peft_config["default"]
        state = lora_state(module, name in family.text_encoders,
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
        save_file(kohya_state(adapted, family), str(tmp), metadata={"ss_network_module": "networks.lora"})
        tmp.replace(folder / KOHYA_WEIGHTS)
    return folder / LORA_WEIGHTS


