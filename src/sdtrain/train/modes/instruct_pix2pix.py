"""InstructPix2Pix (Brooks et al., 2023): the denoiser learns to edit a source image as its caption instructs, reading
the source's latents on extra input channels beside the noisy latents (their first-layer weights start at zero, so
training starts at the base model). Each sample's source image is ``KEY.src.png`` beside its edited image, its
caption the instruction; the source is dropped for ``instruct_pix2pix.source_dropout`` of the samples and the
caption for ``data.caption_dropout``, so that sampling can weigh each (the pipeline's ``image_guidance_scale`` and
``guidance_scale``). The whole denoiser trains, as in the paper; the family supplies how (`ModelFamily.instruct`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sdtrain.errors import UserError
from sdtrain.loaders.writers import INSTRUCT_PIX2PIX
from sdtrain.models import families
from sdtrain.models.families.spec import InstructSpec
from sdtrain.train.parts import TrainedPart
from sdtrain.utils import to_pil


class InstructPix2PixPart(TrainedPart):
    """The whole denoiser (and with ``diffusion.train_text_encoder`` the text encoders), widened to read the source
    image's latents."""

    @property
    def spec(self) -> InstructSpec:
        return families.mode_spec(self.family, "instruct", "mode", "learns no InstructPix2Pix editing")

    def make_trainable(self, denoiser: nn.Module, text_encoders: dict[str, nn.Module],
                       tokenizers: list[Any], latent_factor: int = 8) -> dict[str, nn.Module]:
        self.spec.widen(denoiser, denoiser.config.in_channels)
        return super().make_trainable(denoiser, text_encoders, tokenizers, latent_factor)

    def checkpoint_meta(self) -> dict[str, Any]:
        return {INSTRUCT_PIX2PIX: True}

    def denoiser_extra(self, batch: dict[str, Any], vae: nn.Module, generator: torch.Generator | None
                       ) -> torch.Tensor | None:
        pixels = batch.get("source_pixels")
        if pixels is None:
            raise UserError("mode instruct_pix2pix: the data has no source images: put KEY.src.png (the image before "
                            "the edit) beside each edited image, its caption the instruction (`prepare encode` keeps "
                            "them)")
        device = next(vae.parameters()).device
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            latents = self.spec.source_latents(vae, pixels.to(device))
        kept = torch.rand(len(latents), generator=generator, device=generator.device if generator else device)
        kept = (kept >= self.config.instruct_pix2pix.source_dropout).to(latents.dtype)
        return latents * kept.to(latents.device).view(-1, 1, 1, 1)

    def encodes_images(self) -> bool:
        return True

    def pipeline(self, pipe: Any, modules: dict[str, nn.Module]) -> Any:
        return self.spec.pipeline_class.from_pipe(pipe)

    def sampling_inputs(self, batch: dict[str, Any] | None, count: int) -> dict[str, list[Any]]:
        """The source images of the last batch's samples, one per validation instruction in turn."""
        if batch is None or "source_pixels" not in batch:
            return {}
        sources = to_pil(batch["source_pixels"])
        return {"image": [sources[i % len(sources)] for i in range(count)]}
