"""The autoencoders several families share, as presets, and their repeated blocks: Stable Diffusion's
AutoencoderKL (4 latent channels; SDXL's scales its latents differently) and Flux.1's (16 channels, no quant
convs, its latents centred and scaled; SD3 and Z-Image use its shape)."""

from __future__ import annotations

from diffusers import AutoencoderKL

from sdtrain.models.families.codec import AutoencoderKLCodec

# 4x downsampling: 64 px images become 16x16x4 latents. No mid-block attention: on a CPU it costs
# 15% of the step and flat shapes need no global context to reconstruct.
TINY_VAE = dict(
    down_block_types=["DownEncoderBlock2D"] * 3,
    up_block_types=["UpDecoderBlock2D"] * 3,
    block_out_channels=[32, 32, 64],
    layers_per_block=1,
    latent_channels=4,
    # 32 groups over 32 channels would normalise every channel on its own, which washes out colour.
    norm_num_groups=8,
    mid_block_add_attention=False,
)
SD_VAE = dict(
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 256, 512, 512],
    layers_per_block=2,
    latent_channels=4,
    norm_num_groups=32,
)
# Flux.1's autoencoder: SD's shape with 16 latent channels, no quant convs, its latents centred and scaled.
FLUX_VAE = dict(
    SD_VAE,
    latent_channels=16,
    use_quant_conv=False,
    use_post_quant_conv=False,
    shift_factor=0.1159,
    scaling_factor=0.3611,
    sample_size=1024,
)
# Flux.1's codec, which Z-Image's autoencoder shares.
FLUX_CODEC = AutoencoderKLCodec(scaling_factor=FLUX_VAE["scaling_factor"], shift_factor=FLUX_VAE["shift_factor"])
TINY_FLUX_VAE = {**TINY_VAE, "latent_channels": 16, "use_quant_conv": False, "use_post_quant_conv": False,
                 "shift_factor": 0.0, "scaling_factor": 1.0}


def vae_blocks(vae: AutoencoderKL) -> list:
    return [*vae.encoder.down_blocks, vae.encoder.mid_block, vae.decoder.mid_block, *vae.decoder.up_blocks]

