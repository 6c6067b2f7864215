"""Wan-2.1's causal 3D autoencoder (diffusers' AutoencoderKLQwenImage) read as an image autoencoder, shared by the
families that condition their denoiser on its latents (Qwen-Image and its edit models, Krea 2): 16 channels, 8x
smaller, each channel normalised by its own mean and deviation, a still image a one-frame video."""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from torch import nn

from sdtrain.models.families.codec import ChannelStatistics, LatentCodec

WAN_VAE: dict[str, Any] = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                               temperal_downsample=[False, True, True])
"""The released autoencoder: diffusers' defaults, with the released latent statistics."""
TINY_WAN_VAE: dict[str, Any] = dict(base_dim=16, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1,
                                    temperal_downsample=[False, True], latents_mean=[0.0] * 16,
                                    latents_std=[1.0] * 16)
"""The released structure at a size tests train: 4x smaller latents (two of the downsamplings), neither shifted nor
scaled until an autoencoder run measures them."""


class WanImageCodec(ChannelStatistics, LatentCodec):
    """Wan's 3D autoencoder (AutoencoderKLQwenImage) read as an image one: each image a one-frame video, its latents
    normalised per channel by the config's ``latents_mean`` and ``latents_std``, as the pipelines normalise them."""

    released = {"scaling_factor": 1.0, "shift_factor": None}

    def channels(self, vae_config: Any) -> int:
        return vae_config.z_dim

    def downsampling(self, vae_config: Any) -> int:
        return 2 ** len(vae_config.temperal_downsample)

    def encode(self, vae: nn.Module, pixels: torch.Tensor) -> DiagonalGaussianDistribution:
        # A one-frame video in; the frame axis of the posterior's parameters taken out.
        posterior = vae.encode(pixels.unsqueeze(2)).latent_dist
        return DiagonalGaussianDistribution(posterior.parameters.squeeze(2))

    def decode(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return vae.decode(latents.unsqueeze(2)).sample.squeeze(2)



WAN_CODEC = WanImageCodec()
