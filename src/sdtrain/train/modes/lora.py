"""LoRA (Hu et al., 2021) through peft: low-rank adapters on the UNet's attention projections and,
optionally, the text encoder's; the base weights stay frozen and out of the checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdtrain.config import LoraConfig
from sdtrain.errors import UserError, first_line
from sdtrain.models import build, families
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


def add_lora(module: nn.Module, settings: dict[str, Any], key: str) -> None:
    """Adapters on `module` through peft itself. transformers' own add_adapter (its text encoders') refuses every
    peft release before 0.22, which PyPI does not carry; peft's injection is what both libraries call anyway."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    config = PeftLoraConfig(**settings)
    try:
        inject_adapter_in_model(config, module, adapter_name="default")
    except ValueError as exc:
        raise UserError(f"{key}: {first_line(exc)}; name modules the model has, e.g. to_q") from exc
    # What peft's state-dict helpers and the savers read the adapter's settings from.
    module.peft_config = {"default": config}


class LoraTask(DiffusionTask):
    def make_trainable(self) -> dict[str, nn.Module]:
        cfg = self.config.lora
        self.adapters = {"unet": lora_settings(cfg)}
        self.unet.requires_grad_(False)
        add_lora(self.unet, self.adapters["unet"], "lora.target_modules")
        self.unet.train()
        trainable = {"unet": self.unet}
        for name, text_encoder in self.text_encoders.items():
            text_encoder.requires_grad_(False)
            if not cfg.text_encoder:
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


def rebuild_lora(name: str, source: str, task_meta: dict[str, Any]) -> nn.Module:
    family = families.get(task_meta.get("family", "sd"))
    module = build.load_component(name, source, trust_pickle=task_meta.get("trust_pickle"), family=family)
    module.requires_grad_(False)
    add_lora(module, task_meta["lora"][name], "checkpoint")
    return module


def lora_state(module: nn.Module) -> dict[str, Any]:
    """The adapter weights in the key layout diffusers' loaders read."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    return convert_state_dict_to_diffusers(get_peft_model_state_dict(module))


def kohya_state(modules: dict[str, nn.Module], family: ModelFamily) -> dict[str, torch.Tensor]:
    """The same adapters in kohya's layout, the one A1111, ComfyUI and diffusers all read:
    ``<prefix><module path, dots as underscores>.lora_down.weight / .lora_up.weight / .alpha``, the prefix and
    the module paths the family's (``lora_unet_``, ``lora_te_`` for SD's one text encoder, ``lora_te1_`` and
    ``lora_te2_`` for SDXL's two; SDXL's UNet paths in its original layout), and a true scalar alpha per module
    (the scale is alpha / rank)."""
    from peft.tuners.lora import LoraLayer

    state = {}
    for name, module in modules.items():
        for path, layer in module.named_modules():
            if not isinstance(layer, LoraLayer) or "default" not in layer.lora_A:
                continue
            key = family.kohya_lora_name(name, path, module.config)
            state[f"{key}.lora_down.weight"] = layer.lora_A["default"].weight.detach().float().cpu().contiguous()
            state[f"{key}.lora_up.weight"] = layer.lora_B["default"].weight.detach().float().cpu().contiguous()
            state[f"{key}.alpha"] = torch.tensor(float(layer.lora_alpha["default"]))
    return state


def save_lora(modules: dict[str, nn.Module], folder: Path, family: ModelFamily) -> Path:
    """Write ``pytorch_lora_weights.safetensors``, which the family pipeline's ``load_lora_weights(folder)``
    loads, and the same adapters as ``lora_kohya.safetensors`` for A1111 and ComfyUI."""
    from safetensors.torch import save_file

    adapted = {name: m for name, m in modules.items() if _has_lora(m)}
    layers = {f"{name}_lora_layers": lora_state(m) for name, m in adapted.items()}
    # Without its config in the file, diffusers' loader takes alpha = rank: wrong whenever lora.alpha differs.
    metadata = {f"{name}_lora_adapter_metadata": m.peft_config["default"].to_dict() for name, m in adapted.items()}
    family.pipeline_class.save_lora_weights(folder, safe_serialization=True, weight_name=LORA_WEIGHTS, **layers,
                                            **metadata)
    tmp = folder / f".{KOHYA_WEIGHTS}.tmp"
    save_file(kohya_state(adapted, family), str(tmp), metadata={"ss_network_module": "networks.lora"})
    tmp.replace(folder / KOHYA_WEIGHTS)
    return folder / LORA_WEIGHTS


def _has_lora(module: nn.Module) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in module.modules())


def merge_lora(module: nn.Module) -> nn.Module:
    """Fold every adapter into its base layer and put the plain layer back, so the module saves and loads
    as an ordinary model."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, child in list(module.named_modules()):
        if isinstance(child, BaseTunerLayer):
            child.merge()
            parent_name, _, attr = name.rpartition(".")
            setattr(module.get_submodule(parent_name) if parent_name else module, attr, child.get_base_layer())
    for attr in ("peft_config", "_hf_peft_config_loaded"):
        if hasattr(module, attr):
            try:
                delattr(module, attr)
            except AttributeError:
                pass
    return module
