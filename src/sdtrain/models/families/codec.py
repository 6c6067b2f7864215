"""The latent codec, one part of a model family: how its VAE turns images into the latents its denoiser reads and
back. A family names one; `AutoencoderKLCodec` is the shared one for diffusers' AutoencoderKL (Stable Diffusion's,
SDXL's, SD3's and Flux.1's), each family giving its released normalisation."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from torch import nn


class LatentCodec(ABC):
    """How a family's VAE encodes and decodes, and how its latents are normalised for the denoiser."""

    released: dict[str, float | None]
    """How the released models' latents are normalised, ``(latent - shift_factor) * scaling_factor``: what a VAE
    file that does not say it takes when this family's model is trained or encoded."""
    reads_vae_weights: bool = False
    """Whether `normalize` reads statistics the VAE holds in its weights (Flux.2's BatchNorm buffers), not its
    config: training on encoded shards then keeps the VAE's weights."""

    def clip_frames(self, vae_config: Any) -> int | None:
        """None for a codec of still images; for one of clips (pixels (B, 3, T, H, W) in, latents (B, C, t, h, w)
        out), how many frames one latent frame spans after the first: a clip has 1 + k times that many frames (Wan's
        4n + 1). A still image is then a clip of one frame."""
        return None

    @abstractmethod
    def channels(self, vae_config: Any) -> int:
        """The channels of the latents `encode` gives."""

    @abstractmethod
    def downsampling(self, vae_config: Any) -> int:
        """How many pixels one latent pixel spans on a side."""

    @abstractmethod
    def encode(self, vae: nn.Module, pixels: torch.Tensor) -> DiagonalGaussianDistribution:
        """The VAE's posterior over the latents of images `pixels` (B, 3, H, W), with (B, C, h, w) parameters: what
        the denoiser's latents are drawn from and encoded shards store."""

    @abstractmethod
    def decode(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) of raw (not normalised) latents (B, C, h, w), as `encode` gives them."""

    @abstractmethod
    def normalize(self, latents: torch.Tensor, vae: nn.Module) -> torch.Tensor:
        """The VAE's latents as the denoiser reads them, in fp32."""

    @abstractmethod
    def fit_normalization(self, vae: nn.Module, channel_mean: torch.Tensor, channel_square: torch.Tensor) -> None:
        """Record in a VAE trained from scratch how its latents are normalised, from the mean and mean square of
        each channel of its posterior means over training."""


@dataclass(frozen=True)
class AutoencoderKLCodec(LatentCodec):
    """diffusers' AutoencoderKL: its latents centred by the config's ``shift_factor`` (SD3's, Flux.1's) and scaled
    by its ``scaling_factor``; a VAE from scratch fits the scale that gives them unit variance about zero (the
    latent diffusion paper's)."""

    scaling_factor: float
    """The released models' ``scaling_factor``."""
    shift_factor: float | None = None
    """The released models' ``shift_factor``; None: their latents are not centred."""

    @property
    def released(self) -> dict[str, float | None]:  # type: ignore[override]
        return {"scaling_factor": self.scaling_factor, "shift_factor": self.shift_factor}

    def channels(self, vae_config: Any) -> int:
        return vae_config.latent_channels

    def downsampling(self, vae_config: Any) -> int:
        # The resolution halves at every level but the last.
        return 2 ** (len(vae_config.block_out_channels) - 1)

    def encode(self, vae: nn.Module, pixels: torch.Tensor) -> DiagonalGaussianDistribution:
        return vae.encode(pixels).latent_dist

    def decode(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return vae.decode(latents).sample

    def normalize(self, latents: torch.Tensor, vae: nn.Module) -> torch.Tensor:
        shift = vae.config.get("shift_factor") or 0.0
        return (latents.float() - shift) * vae.config.scaling_factor

    def fit_normalization(self, vae: nn.Module, channel_mean: torch.Tensor, channel_square: torch.Tensor) -> None:
        vae.register_to_config(scaling_factor=float(1.0 / max(channel_square.mean().sqrt().item(), 1e-6)))


class ChannelStatistics:
    """Latents normalised per channel by the VAE config's ``latents_mean`` and ``latents_std`` (Wan's autoencoders'
    and those after them), as their pipelines normalise them; a VAE from scratch records the statistics of its
    posterior means. A mixin of a `LatentCodec` that reads such a VAE."""

    def normalize(self, latents: torch.Tensor, vae: nn.Module) -> torch.Tensor:
        # Minus each channel's mean, times the inverse of its deviation.
        shape = (1, -1, *([1] * (latents.dim() - 2)))
        mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(shape)
        inverse = 1.0 / torch.tensor(vae.config.latents_std, device=latents.device).view(shape)
        return (latents.float() - mean) * inverse

    def fit_normalization(self, vae: nn.Module, channel_mean: torch.Tensor, channel_square: torch.Tensor) -> None:
        deviation = (channel_square - channel_mean.square()).clamp_min(1e-12).sqrt()
        vae.register_to_config(latents_mean=channel_mean.tolist(), latents_std=deviation.tolist())
