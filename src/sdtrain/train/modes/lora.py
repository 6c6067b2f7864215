"""LoRA (Hu et al., 2021) through peft: low-rank adapters on the UNet's attention projections and,
optionally, the text encoder's, or their LyCORIS kin (``lora.type``: DoRA, LoKr); the base weights stay frozen and
out of the checkpoints."""

from __future__ import annotations

from typing import Any

from torch import nn

from sdtrain.config import LoraConfig
from sdtrain.loaders.adapters import ADAPTER_TYPE, add_lora
from sdtrain.models.families.spec import ModelFamily
from sdtrain.train.parts import TrainedPart


def lora_settings(config: LoraConfig, text_encoder: bool = False) -> dict[str, Any]:
    """The adapters' peft settings (loaders.adapters.add_lora's); kept in meta.json so a checkpoint rebuilds the
    same adapters."""
    targets = list(config.text_encoder_target_modules if text_encoder else config.target_modules)
    if config.type == "lokr":
        # One factor starts at zero: the adapted model starts exactly as the base. Dropout drops a module's whole
        # adapter for the step (LyCORIS's module dropout).
        return {ADAPTER_TYPE: "lokr", "r": config.rank, "alpha": config.alpha or config.rank,
                "module_dropout": config.dropout, "decompose_factor": config.lokr_factor, "init_weights": True,
                "target_modules": targets}
    return {
        "r": config.rank,
        "lora_alpha": config.alpha or config.rank,
        "lora_dropout": config.dropout,
        # Gaussian A, zero B: the adapted model starts exactly as the base (DoRA's magnitudes start at the base
        # weights' row norms).
        "init_lora_weights": "gaussian",
        "use_dora": config.type == "dora",
        "target_modules": targets,
    }


class Adapters(TrainedPart):
    """LoRA adapters on the denoiser's layers ``lora.target_modules`` names, and with ``lora.text_encoder`` on the
    text encoders the family adapts; every base weight stays frozen."""

    adapters: dict[str, dict[str, Any]]
    """The peft settings of each adapted component, by name: what a checkpoint's reader rebuilds them with."""

    @classmethod
    def problems(cls, config: Any, family: ModelFamily) -> list[str]:
        if config.lora.text_encoder and not family.components.lora_text_encoders:
            return [f"lora.text_encoder: {family.title}'s text encoders take no LoRA here (kohya's and diffusers' "
                    "scripts leave them frozen); set lora.text_encoder=false"]
        return []

    def keeps_frozen(self, name: str) -> bool:
        # Every base stays frozen: adapters train beside its linear layers.
        return True

    def text_encoder_trains(self) -> bool:
        return self.config.lora.text_encoder

    def make_trainable(self, denoiser: nn.Module, text_encoders: dict[str, nn.Module],
                       tokenizers: list[Any], latent_factor: int = 8) -> dict[str, nn.Module]:
        cfg = self.config.lora
        name = self.family.components.denoiser
        self.adapters = {name: lora_settings(cfg)}
        denoiser.requires_grad_(False)
        add_lora(denoiser, self.adapters[name], "lora.target_modules")
        trainable = {name: denoiser.train()}
        adapted = self.family.components.lora_text_encoders
        for name, text_encoder in text_encoders.items():
            text_encoder.requires_grad_(False)
            if not cfg.text_encoder or name not in adapted:
                text_encoder.eval()
                continue
            self.adapters[name] = lora_settings(cfg, text_encoder=True)
            add_lora(text_encoder, self.adapters[name], "lora.text_encoder_target_modules")
            trainable[name] = text_encoder.train()
        return trainable

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"lora": self.adapters}
