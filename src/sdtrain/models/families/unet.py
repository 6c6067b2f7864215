"""What Stable Diffusion's UNet families (1.x/2.x, SDXL) share: the UNet2DConditionModel's repeated blocks, its
call, its ControlNet and its InstructPix2Pix widening (the original checkpoint layout their single files are in is
`ldm_checkpoint`'s)."""

from __future__ import annotations

import math
from typing import Any

import torch
from diffusers import ControlNetModel, UNet2DConditionModel
from torch import nn

from sdtrain.errors import UserError
from sdtrain.models.families.spec import ControlSpec, DenoiserCall, InstructSpec


def unet_blocks(unet: UNet2DConditionModel) -> list:
    """Its levels in forward order: each down block, the mid block (None when the config has none), each up block."""
    return [*unet.down_blocks, unet.mid_block, *unet.up_blocks]


def controlnet_blocks(controlnet: ControlNetModel) -> list:
    """A ControlNet's levels in forward order: the UNet's down blocks and mid block it copies."""
    return [*controlnet.down_blocks, controlnet.mid_block]


def unet_residuals(controlnet: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor, condition: dict[str, Any],
                   image: torch.Tensor) -> dict[str, Any]:
    """The ControlNet's outputs for each down block and the mid block, as the UNet's call adds them (what diffusers'
    ControlNet pipelines and training examples pass); the ControlNet reads what the UNet reads (text, SDXL's size
    ids and pooled text) and the conditioning image."""
    down, mid = controlnet(noisy, timesteps, controlnet_cond=image.to(noisy.dtype), return_dict=False, **condition)
    return {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}


# The conditioning image's encoder in diffusers' ControlNetModel (and the paper's): a stride-2 convolution between
# each pair of widths, three for the released VAEs' 8x smaller latents.
_CONDITIONING_WIDTHS = (16, 32, 96, 256)


def controlnet_from_unet(unet: UNet2DConditionModel, latent_factor: int) -> ControlNetModel:
    """A ControlNetModel made from `unet` (its encoder's weights copied, zero convolutions out) whose conditioning
    encoder halves the image's side as often as the VAE does: the released widths for 8x, fewer (or more) else."""
    halvings = max(0, round(math.log2(latent_factor)))
    widths = (*_CONDITIONING_WIDTHS, *(_CONDITIONING_WIDTHS[-1:] * halvings))[:halvings + 1]
    return ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=widths)


def widen_unet(unet: UNet2DConditionModel) -> None:
    """`unet` reads a source image's latents beside the noisy ones, as InstructPix2Pix's does: a UNet that reads the
    latents alone gains as many input channels, their weights zero (the paper's initialisation: it starts as it was),
    its config saying so; one that reads both already (a released InstructPix2Pix model, an InstructPix2Pix run's
    export) is kept as it is; any other (an inpainting UNet's 9 inputs) is one line."""
    old, latents = unet.conv_in, unet.config.out_channels
    if old.in_channels == 2 * latents:
        return
    if old.in_channels != latents:
        raise UserError(f"mode instruct_pix2pix: this UNet reads {old.in_channels} input channels, neither its "
                        f"{latents} latents alone (a text-to-image model, which it widens) nor {2 * latents} (the "
                        "latents and a source image's, an InstructPix2Pix model); start from one of those")
    new = nn.Conv2d(2 * latents, old.out_channels, old.kernel_size, old.stride, old.padding,
                    device=old.weight.device, dtype=old.weight.dtype)
    with torch.no_grad():
        new.weight.zero_()
        new.weight[:, :latents].copy_(old.weight)
        new.bias.copy_(old.bias)
    unet.conv_in = new
    unet.register_to_config(in_channels=new.in_channels)


def unet_source_latents(vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """The source image's latents as diffusers' InstructPix2Pix pipelines give them: the posterior's mode, not
    scaled."""
    return vae.encode(pixels).latent_dist.mode()


def unet_instruct(pipeline_class: type) -> InstructSpec:
    return InstructSpec(pipeline_class, widen_unet, unet_source_latents)


def unet_control(pipeline_class: type) -> ControlSpec:
    """The ControlNet of a UNet family whose ControlNet pipeline is `pipeline_class`: diffusers' ControlNetModel,
    made from the UNet."""
    return ControlSpec(ControlNetModel, pipeline_class, controlnet_from_unet, unet_residuals, blocks=controlnet_blocks)


class UNetCall(DenoiserCall):
    """A UNet2DConditionModel's call, for a family to build on: conditioned on its text encoders' states by
    cross-attention, sized by the latents, a level coarser per block after the first."""

    def shape(self, latent_channels: int, latent_size: int) -> dict[str, Any]:
        return {"in_channels": latent_channels, "out_channels": latent_channels, "sample_size": latent_size}

    def downsampling(self, denoiser_config: Any) -> int:
        return 2 ** (len(denoiser_config.block_out_channels) - 1)

    def condition(self, text: dict[str, torch.Tensor], batch: dict[str, Any], device: torch.device
                  ) -> dict[str, Any]:
        return {"encoder_hidden_states": text["text_emb"]}
