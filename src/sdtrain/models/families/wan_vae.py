"""Wan-2.1's causal 3D autoencoder, shared by the families that condition their denoiser on its latents: read as an
image autoencoder (diffusers' AutoencoderKLQwenImage: Qwen-Image and its edit models, Krea 2), 16 channels, 8x
smaller, each channel normalised by its own mean and deviation, a still image a one-frame video; and read as the
video autoencoder it is (diffusers' AutoencoderKLWan: Wan 2.1), clips of 4n + 1 frames to 1 + n latent frames."""

from __future__ import annotations

import math
from typing import Any

import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from torch import nn

from sdtrain.errors import UserError
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


# ------------------------------------------------------------------------------------------------------- clips
WAN_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517,
                    -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
"""Each latent channel's mean over the released autoencoder's training videos (Wan-AI's vae/config.json)."""
WAN_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
                   1.6382, 1.1253, 2.8251, 1.9160]
"""Each latent channel's deviation, the same way."""
WAN_VIDEO_VAE: dict[str, Any] = dict(
    base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True],
    latents_mean=WAN_LATENTS_MEAN, latents_std=WAN_LATENTS_STD, scale_factor_temporal=4, scale_factor_spatial=8)
"""The released video autoencoder (Wan-AI/Wan2.1-T2V-1.3B-Diffusers' and -14B-Diffusers' vae/config.json, the
same): 8x smaller a side, 4x fewer frames after the first; the scale factors are what WanPipeline sizes latents by."""
TINY_WAN_VIDEO_VAE: dict[str, Any] = dict(
    base_dim=16, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True],
    latents_mean=[0.0] * 16, latents_std=[1.0] * 16, scale_factor_temporal=4, scale_factor_spatial=4)
"""The released structure at a size tests train: both of its two downsamplings halve the frames too (4x, as the
released one's two temporal ones do: diffusers' encoder reads 4 frames a chunk), 4x smaller a side; latents neither
shifted nor scaled until an autoencoder run measures them."""

CHUNK_FRAMES = 4
"""The frames AutoencoderKLWan encodes a chunk after the first frame (its ``_encode`` loop's fixed 4)."""


class WanVideoCodec(ChannelStatistics, LatentCodec):
    """Wan 2.1's causal 3D autoencoder (AutoencoderKLWan) as the video codec it is: clips (B, 3, T, H, W) in [-1, 1],
    T = 4n + 1 (a still image T = 1), to a posterior over latents (B, 16, 1 + n, H / 8, W / 8), each channel
    normalised by the config's ``latents_mean`` and ``latents_std`` as WanPipeline normalises them.

    A long clip's memory: the encoder reads the first frame, then 4 frames at a time, each chunk's causal
    convolutions given the cached last two frames of the chunk before (its decoder, one latent frame at a time), so
    what it computes at once is a chunk's activations at the clip's full size, whatever the clip's length; the clip
    and its latents are held whole. Spatial tiling (diffusers' ``enable_tiling``: 256 px tiles blended over 64 px) is
    not turned on here: it changes the latents at the seams from those the released pipeline's untiled encoder gives,
    and the sizes trained (480p, 720p) fit a chunk's activations in memory; a VAE the caller tiled is read tiled.
    """

    released = {"scaling_factor": 1.0, "shift_factor": None}

    def __init__(self, title: str = "Wan 2.1") -> None:
        self.title = title
        """Whose autoencoder it is, in messages (Wan 2.1's and Wan 2.2's are one class, AutoencoderKLWan)."""

    def clip_frames(self, vae_config: Any) -> int:
        # Each temporal downsampling halves the frames after the first.
        return 2 ** sum(bool(halves) for halves in vae_config.temperal_downsample)

    def channels(self, vae_config: Any) -> int:
        return vae_config.z_dim

    def downsampling(self, vae_config: Any) -> int:
        # Every level but the last halves the side; a patchifying autoencoder (Wan 2.2's) folds pixels first.
        return 2 ** len(vae_config.temperal_downsample) * (getattr(vae_config, "patch_size", None) or 1)

    def encode(self, vae: nn.Module, pixels: torch.Tensor) -> DiagonalGaussianDistribution:
        _check_clip(pixels, math.lcm(CHUNK_FRAMES, self.clip_frames(vae.config)), self.title)
        return vae.encode(pixels).latent_dist

    def decode(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        if latents.dim() != 5:
            raise UserError(f"{self.title}'s autoencoder decodes clips' latents (B, C, t, h, w), not a tensor of shape "
                            f"{tuple(latents.shape)}")
        return vae.decode(latents).sample


def _check_clip(pixels: torch.Tensor, step: int, title: str) -> None:
    """One line for what the autoencoder cannot read whole: no clip (B, 3, T, H, W), or T not 1 + k `step`."""
    if pixels.dim() != 5:
        raise UserError(f"{title}'s autoencoder reads clips (B, 3, T, H, W), a still image as T = 1, not a tensor of "
                        f"shape {tuple(pixels.shape)}")
    frames = pixels.shape[2]
    if (frames - 1) % step:
        raise UserError(f"a clip of {frames} frames: {title}'s autoencoder reads {step}n + 1 (1, {1 + step}, "
                        f"{1 + 2 * step}, ...), the frames after the first in whole chunks of {step}; trim it to "
                        f"{1 + (frames - 1) // step * step}")


WAN_VIDEO_CODEC = WanVideoCodec()
"""Wan 2.1's."""


# ------------------------------------------------------------------------------------------- Wan 2.2's clips
WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667]
"""Each of the 48 latent channels' mean over Wan 2.2's autoencoder's training videos (Wan-AI/Wan2.2-TI2V-5B-Diffusers'
vae/config.json)."""
WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744]
"""Each channel's deviation, the same way."""
WAN22_VIDEO_VAE: dict[str, Any] = dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
    temperal_downsample=[False, True, True], is_residual=True, patch_size=2, in_channels=12, out_channels=12,
    latents_mean=WAN22_LATENTS_MEAN, latents_std=WAN22_LATENTS_STD, scale_factor_temporal=4, scale_factor_spatial=16)
"""Wan 2.2's video autoencoder (the TI2V-5B's vae/config.json; 704,688,668 parameters): each frame's 2x2 pixel
patches folded into 12 channels first (``patch_size``), then residual down blocks (``is_residual``) with a wider
decoder, so 16x smaller a side and 4x fewer frames after the first, into 48 channels."""
TINY_WAN22_VIDEO_VAE: dict[str, Any] = dict(
    base_dim=16, decoder_base_dim=24, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True],
    is_residual=True, patch_size=2, in_channels=12, out_channels=12, latents_mean=[0.0] * 16, latents_std=[1.0] * 16,
    scale_factor_temporal=4, scale_factor_spatial=8)
"""Wan 2.2's structure at a size tests train: the patch fold, residual blocks and a decoder wider than the encoder,
both downsamplings halving the frames too (4x), 8x smaller a side (the patch's 2 times two halvings); latents neither
shifted nor scaled until an autoencoder run measures them."""

WAN22_VIDEO_CODEC = WanVideoCodec("Wan 2.2")
"""Wan 2.2's: the same causal chunks and normalisation as 2.1's; its `downsampling` counts the patch fold."""
