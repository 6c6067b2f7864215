"""The AutoencoderKL in the original checkpoint layout (CompVis/LDM), both ways: its settings from the tensors'
shapes, its state dict written in the layout, and read back through diffusers' converter. Stable Diffusion's and
SDXL's files (`ldm_checkpoint`) and SD3's (`sd3_checkpoint`) hold it alike; a VAE-only file (sdxl_vae.safetensors,
Flux.1's ae.safetensors) has the same keys without a prefix."""

from __future__ import annotations

from typing import Any

import torch

from sdtrain.models.single_file.read import Unrecognized, indices, need
from sdtrain.models.single_file.write import Blocks, map_by_blocks

VAE_SHAPE_KEYS = frozenset({
    "in_channels", "out_channels", "latent_channels", "block_out_channels", "layers_per_block",
    "down_block_types", "up_block_types", "mid_block_add_attention", "use_quant_conv", "use_post_quant_conv",
})


def vae_config(s: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The AutoencoderKL settings its tensors `s` (keys without a prefix) tell; Unrecognized otherwise."""
    downs = indices(s, "encoder.down.")
    ups = indices(s, "decoder.up.")
    if not downs or len(ups) != len(downs):
        raise Unrecognized(f"{len(downs)} encoder levels but {len(ups)} decoder levels")
    encoder_layers = {len(indices(s, f"encoder.down.{i}.block.")) for i in downs}
    decoder_layers = {len(indices(s, f"decoder.up.{i}.block.")) for i in ups}
    # The decoder has one layer more per level than the encoder.
    if len(encoder_layers) != 1 or decoder_layers != {min(encoder_layers) + 1}:
        raise Unrecognized("encoder and decoder levels have different numbers of layers")
    layers = encoder_layers.pop()
    n = len(downs)
    for i in downs:
        if (f"encoder.down.{i}.downsample.conv.weight" in s) != (i < n - 1):
            raise Unrecognized(f"encoder.down.{i}: downsample where none belongs, or none where one does")
        if (f"decoder.up.{i}.upsample.conv.weight" in s) != (i > 0):
            raise Unrecognized(f"decoder.up.{i}: upsample where none belongs, or none where one does")
    mid_attention = "encoder.mid.attn_1.q.weight" in s
    if mid_attention != ("decoder.mid.attn_1.q.weight" in s):
        raise Unrecognized("mid-block attention in only one of encoder and decoder")
    return {
        "in_channels": need(s, "encoder.conv_in.weight")[1],
        "out_channels": need(s, "decoder.conv_out.weight")[0],
        "latent_channels": need(s, "decoder.conv_in.weight")[1],
        "block_out_channels": [need(s, f"encoder.down.{i}.block.0.conv2.weight")[0] for i in downs],
        "layers_per_block": layers,
        "down_block_types": ["DownEncoderBlock2D"] * n,
        "up_block_types": ["UpDecoderBlock2D"] * n,
        "mid_block_add_attention": mid_attention,
        "use_quant_conv": "quant_conv.weight" in s,
        "use_post_quant_conv": "post_quant_conv.weight" in s,
    }


_VAE_RESNET = {"conv_shortcut": "nin_shortcut"}
_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def original_blocks(config: dict[str, Any]) -> Blocks:
    n, layers = len(config["block_out_channels"]), config["layers_per_block"]
    blocks: Blocks = {"quant_conv": ("quant_conv", {}),
                                                     "post_quant_conv": ("post_quant_conv", {})}
    for side in ("encoder", "decoder"):
        blocks.update({
            f"{side}.conv_in": (f"{side}.conv_in", {}), f"{side}.conv_norm_out": (f"{side}.norm_out", {}),
            f"{side}.conv_out": (f"{side}.conv_out", {}),
            f"{side}.mid_block.resnets.0": (f"{side}.mid.block_1", _VAE_RESNET),
            f"{side}.mid_block.resnets.1": (f"{side}.mid.block_2", _VAE_RESNET),
            f"{side}.mid_block.attentions.0": (f"{side}.mid.attn_1", _VAE_ATTENTION),
        })
    for i in range(n):
        for j in range(layers):
            blocks[f"encoder.down_blocks.{i}.resnets.{j}"] = (f"encoder.down.{i}.block.{j}", _VAE_RESNET)
        blocks[f"encoder.down_blocks.{i}.downsamplers.0.conv"] = (f"encoder.down.{i}.downsample.conv", {})
        # The decoder's levels are numbered from the lowest resolution up in diffusers, the other way originally.
        for j in range(layers + 1):
            blocks[f"decoder.up_blocks.{i}.resnets.{j}"] = (f"decoder.up.{n - 1 - i}.block.{j}", _VAE_RESNET)
        blocks[f"decoder.up_blocks.{i}.upsamplers.0.conv"] = (f"decoder.up.{n - 1 - i}.upsample.conv", {})
    return blocks


def vae_to_original(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A VAE's state dict (diffusers keys) in the original layout, keys without a prefix."""
    out = map_by_blocks("vae", state, original_blocks(config))
    for key, tensor in out.items():
        # The original attention projections are 1x1 convolutions; diffusers' are linear layers.
        attention = ".mid.attn_1." in key and key.endswith(("q.weight", "k.weight", "v.weight", "proj_out.weight"))
        if attention and tensor.ndim == 2:
            out[key] = tensor[:, :, None, None]
    return out


def vae_from_original(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The inverse of `vae_to_original`, by diffusers' own converter (keys under ``first_stage_model.``, ``vae.`` or
    none)."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    return convert_ldm_vae_checkpoint(state, dict(config))
