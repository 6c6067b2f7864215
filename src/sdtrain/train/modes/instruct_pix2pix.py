"""InstructPix2Pix (Brooks et al., 2023): the denoiser learns to edit a source image as its caption instructs, reading
the source's latents on extra input channels beside the noisy latents (their first-layer weights start at zero, so
training starts at the base model; a released editor, or this mode's export, already reads them). Each sample's
source image is ``KEY.src.png`` beside its edited image, its caption the instruction. One draw per sample, the
loader's (so a resumed run draws the same), drops what it is conditioned on as the paper and diffusers'
``train_instruct_pix2pix.py`` do: with ``instruct_pix2pix.source_dropout`` q, draws below q drop the caption,
those in [q, 2q) the caption and the source, those in [2q, 3q) the source, so that sampling can weigh each (the
pipeline's ``guidance_scale`` and ``image_guidance_scale``, which subtracts the prediction with both dropped). A
dropped source, or a sample without one, gives zero latents: "no image". The whole denoiser trains, as in the
paper; the family supplies how (`ModelFamily.instruct`)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from sdtrain.config import DataConfig
from sdtrain.data.decode import present
from sdtrain.errors import UserError
from sdtrain.loaders.writers import INSTRUCT_PIX2PIX
from sdtrain.models.families.spec import InstructSpec
from sdtrain.train.parts import IMAGE_TO_IMAGE, CardExample, TrainedPart
from sdtrain.utils import to_pil

log = logging.getLogger(__name__)


class InstructPix2PixPart(TrainedPart):
    """The whole denoiser (and with ``diffusion.train_text_encoder`` the text encoders), widened to read the source
    image's latents."""

    gives_source = True
    hub_task = IMAGE_TO_IMAGE

    host = ("instruct", "mode", "learns no InstructPix2Pix editing")
    spec: InstructSpec

    def make_trainable(self, denoiser: nn.Module, text_encoders: dict[str, nn.Module],
                       tokenizers: list[Any], latent_factor: int = 8) -> dict[str, nn.Module]:
        reads = denoiser.config.in_channels
        self.spec.widen(denoiser)  # a released editor, or this mode's export, reads the source already
        if denoiser.config.in_channels != reads and len(self.config.modes) > 1:
            # The new input weights start at zero and must train, which parts beside this one (adapters) freeze.
            raise UserError(f"mode {self.config.mode_name}: this {self.family.components.denoiser} reads its latents "
                            "alone, and "
                            "only mode instruct_pix2pix by itself trains the inputs it gains for the source image: "
                            "train that first, then the other parts on its export")
        return super().make_trainable(denoiser, text_encoders, tokenizers, latent_factor)

    def checkpoint_meta(self) -> dict[str, Any]:
        return {INSTRUCT_PIX2PIX: True}

    def data_config(self, data: DataConfig) -> DataConfig:
        """The loader drops the caption of the draws below 2q: those of the caption alone and of both."""
        if data.caption_dropout is not None:
            raise UserError("data.caption_dropout: mode instruct_pix2pix drops the caption and the source together, "
                            "by instruct_pix2pix.source_dropout (q: q of the samples lose their caption, q their "
                            "source, q both, as the paper does); remove data.caption_dropout")
        return dataclasses.replace(data, caption_dropout=2 * self.config.instruct_pix2pix.source_dropout)

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
        kept = torch.ones(len(latents), dtype=torch.bool)
        draws = batch.get("caption_draws")  # none in synthetic batches, which keep every source
        if draws is not None:
            q = self.config.instruct_pix2pix.source_dropout
            kept &= (draws < q) | (draws >= 3 * q)
        given = batch.get(present("source_pixels"))
        if given is not None and not given.all():
            if not self._told_missing:
                log.warning("mode instruct_pix2pix: %s without a source image (KEY.src.png) train as edits of no "
                            "image (zero source latents), as a dropped source does", ", ".join(
                                key for key, has in zip(batch["keys"], given.tolist(), strict=True) if not has))
                self._told_missing = True
            kept &= given
        return latents * kept.to(latents.device, latents.dtype).view(-1, 1, 1, 1)

    _told_missing = False

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

    def card_example(self) -> CardExample:
        """The family's InstructPix2Pix pipeline, given the image to edit."""
        return CardExample(self.spec.pipeline_class)
