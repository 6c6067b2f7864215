"""Editing by reference (``edit.reference``, as Flux.1 Kontext and Qwen-Image-Edit learn it): a part that trains
nothing of its own, beside the whole denoiser or its adapters, and gives the denoiser's call each sample's source
image's latents beside the noisy ones (``reference_latents``), which the family's denoiser call reads. The run's
pipeline is the family's editing one, validation edits the last batch's sources, and checkpoints say the denoiser
edits."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sdtrain.loaders.writers import REFERENCE_EDIT
from sdtrain.models.families.spec import ReferenceSpec
from sdtrain.train.parts import IMAGE_TO_IMAGE, CardExample, TrainedPart
from sdtrain.train.tasks import sources_of
from sdtrain.utils import to_pil


class ReferencePart(TrainedPart):
    """What editing by reference adds to the run's trained part (the whole denoiser, or adapters on it)."""

    host = ("reference", "edit.reference", "learns no editing by reference")
    spec: ReferenceSpec
    hub_task = IMAGE_TO_IMAGE

    def keeps_frozen(self, name: str) -> bool:
        return True  # it trains nothing: what trains is the other part's to say

    def text_encoder_trains(self) -> bool:
        return False

    def make_trainable(self, denoiser: nn.Module, text_encoders: dict[str, nn.Module],
                       tokenizers: list[Any], latent_factor: int = 8) -> dict[str, nn.Module]:
        return {}

    def checkpoint_meta(self) -> dict[str, Any]:
        return {REFERENCE_EDIT: True}

    def controls(self, trained: dict[str, nn.Module], batch: dict[str, Any], noisy: torch.Tensor,
                 timesteps: torch.Tensor, condition: dict[str, Any], vae: nn.Module) -> dict[str, Any]:
        pixels = sources_of(batch).to(noisy.device, non_blocking=True)
        with torch.no_grad(), torch.autocast(noisy.device.type, enabled=False):
            return {"reference_latents": self.spec.latents(vae, pixels)}

    def encodes_images(self) -> bool:
        return True

    def pipeline(self, pipe: Any, modules: dict[str, nn.Module]) -> Any:
        return self.family.editing_pipeline(pipe)

    def sampling_inputs(self, batch: dict[str, Any] | None, count: int) -> dict[str, list[Any]]:
        """The last batch's sources, one per validation instruction in turn, edited at the training size."""
        if batch is None or "source_pixels" not in batch:
            return {}
        sources = to_pil(batch["source_pixels"])
        return {"image": [sources[i % len(sources)] for i in range(count)]}

    def card_example(self) -> CardExample:
        """The family's editing pipeline (Kontext's, Qwen-Image-Edit's), given the reference to edit."""
        return CardExample(self.spec.pipeline_class)
