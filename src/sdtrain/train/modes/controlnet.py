"""ControlNet (Zhang et al., 2023): a trainable copy of the denoiser's encoding half, initialised from its weights
with zero convolutions on its outputs (so training starts exactly at the base model), reads each sample's
conditioning image (``KEY.cond.png``) and adds what it computes into the frozen denoiser. The family supplies how
(`ModelFamily.controlnet`), and how many captions drop where ``data.caption_dropout`` is unset; the base, text
encoders included, stays frozen (and may be stored low, ``model.frozen_precision``) and out of the checkpoints."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from sdtrain.config import DataConfig
from sdtrain.errors import UserError
from sdtrain.loaders.writers import CONTROLNET
from sdtrain.models.families.spec import ControlSpec
from sdtrain.train.parts import CardExample, TrainedPart
from sdtrain.utils import to_pil


class ControlNetPart(TrainedPart):
    """A ControlNet beside the frozen denoiser."""

    # The loss reaches the ControlNet through the frozen denoiser, which adds its outputs in.
    through_frozen_denoiser = True

    host = ("controlnet", "mode", "hosts no ControlNet")
    spec: ControlSpec
    # hub_task stays the family's: the Hub lists ControlNets under their base's task (text-to-image) with the tag
    # controlnet beside, as diffusers' own ControlNet training scripts write their cards.

    def keeps_frozen(self, name: str) -> bool:
        # The denoiser loads in full precision: the ControlNet copies its weights first; stored low afterwards.
        return name != self.family.components.denoiser

    def text_encoder_trains(self) -> bool:
        return False

    def make_trainable(self, denoiser: nn.Module, text_encoders: dict[str, nn.Module],
                       tokenizers: list[Any], latent_factor: int = 8) -> dict[str, nn.Module]:
        controlnet = self.spec.from_denoiser(denoiser, latent_factor).to(next(denoiser.parameters()).device)
        for module in (denoiser, *text_encoders.values()):
            module.eval().requires_grad_(False)
        return {CONTROLNET: controlnet.train()}

    def checkpoint_meta(self) -> dict[str, Any]:
        return {CONTROLNET: True}

    def data_config(self, data: DataConfig) -> DataConfig:
        """The family's caption dropout where the run sets none (`ControlSpec.caption_dropout`)."""
        if data.caption_dropout is not None:
            return data
        return dataclasses.replace(data, caption_dropout=self.spec.caption_dropout)

    def controls(self, trained: dict[str, nn.Module], batch: dict[str, Any], noisy: torch.Tensor,
                 timesteps: torch.Tensor, condition: dict[str, Any], vae: nn.Module) -> dict[str, Any]:
        images = batch.get("conditioning_pixels")
        if images is None:
            raise UserError("mode controlnet: the data has no conditioning images: put KEY.cond.png beside each image "
                            "(or `prepare folder --conditioning canny`, `prepare shapes --conditioning layout`; "
                            "`prepare encode` keeps them)")
        control = images.to(noisy.device)
        if self.spec.control_input is not None:
            with torch.no_grad(), torch.autocast(noisy.device.type, enabled=False):
                control = self.spec.control_input(vae, control)
        return self.spec.residuals(trained[CONTROLNET], noisy, timesteps, condition, control)

    def encodes_images(self) -> bool:
        return self.spec.control_input is not None

    def pipeline(self, pipe: Any, modules: dict[str, nn.Module]) -> Any:
        return self.spec.pipeline_class.from_pipe(pipe, controlnet=modules[CONTROLNET])

    def sampling_inputs(self, batch: dict[str, Any] | None, count: int) -> dict[str, list[Any]]:
        """The conditioning maps of the last batch's samples, one per validation prompt in turn: what the grid
        shows the ControlNet following."""
        if batch is None or "conditioning_pixels" not in batch:
            return {}
        maps = to_pil(batch["conditioning_pixels"] * 2 - 1)  # maps are in [0, 1]
        return {self.spec.image_argument: [maps[i % len(maps)] for i in range(count)]}

    def card_example(self) -> CardExample:
        """The family's ControlNet pipeline on the base, given the exported ControlNet and a conditioning map."""
        return CardExample(self.spec.pipeline_class, self.spec.image_argument, "map.png",
                           module=(self.spec.model_class, CONTROLNET))
