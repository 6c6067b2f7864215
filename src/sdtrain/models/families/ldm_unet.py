"""Stable Diffusion's UNet (a UNet2DConditionModel) in the original checkpoint layout (CompVis/LDM, Stability's SGM
for SDXL), both ways: its settings from the tensors' shapes, its state dict written in the layout, and read back
through diffusers' converter. Every file of that layout holds it under ``model.diffusion_model.`` (`ldm_checkpoint`).

SDXL's UNet (the SGM layout) adds ``label_emb.0.0``/``label_emb.0.2``, diffusers' ``add_embedding`` of the pooled
text and the image sizes (addition_embed_type ``text_time``), and says a transformer depth per level."""

from __future__ import annotations

from typing import Any

import torch

from sdtrain.errors import UserError
from sdtrain.models.single_file.read import Unrecognized, indices, need
from sdtrain.models.single_file.write import Blocks, map_by_blocks, original_key

UNET_SHAPE_KEYS = frozenset({
    "in_channels", "out_channels", "block_out_channels", "layers_per_block", "down_block_types",
    "up_block_types", "mid_block_type", "cross_attention_dim", "use_linear_projection",
    "transformer_layers_per_block", "time_embedding_dim", "conv_in_kernel", "conv_out_kernel",
})


def unet_config(s: dict[str, tuple[int, ...]], sgm: bool = False) -> dict[str, Any]:
    """The UNet2DConditionModel settings its tensors `s` (keys without ``model.diffusion_model.``) tell; `sgm`:
    SDXL's layout. Unrecognized when they are not a UNet diffusers' converter reads."""
    conv_in = need(s, "input_blocks.0.0.weight")

    def depth(prefix: str) -> int:
        return len(indices(s, prefix + "transformer_blocks.")) if prefix + "proj_in.weight" in s else 0

    levels: list[list[tuple[int, int]]] = [[]]  # per level: (channels, transformer depth) of each layer
    inputs = indices(s, "input_blocks.")
    for i in inputs[1:]:
        p = f"input_blocks.{i}."
        if p + "0.op.weight" in s:
            if not levels[-1]:
                raise Unrecognized(f"{p}0.op: a downsample with no layers before it")
            levels.append([])
            continue
        levels[-1].append((need(s, p + "0.out_layers.3.weight")[0], depth(p + "1.")))
    if not levels[-1]:
        raise Unrecognized("the UNet ends on a downsample")
    per_level = {len(level) for level in levels}
    if len(per_level) != 1:
        raise Unrecognized(f"levels have different numbers of layers ({sorted(per_level)})")
    layers = per_level.pop()
    channels, down_depths = [], []
    for level in levels:
        if len({c for c, _ in level}) != 1 or len({d for _, d in level}) != 1:
            raise Unrecognized("a level mixes channel counts or transformer depths")
        channels.append(level[0][0])
        down_depths.append(level[0][1])
    attention = [d > 0 for d in down_depths]
    n = len(levels)
    outputs = indices(s, "output_blocks.")
    if len(outputs) != n * (layers + 1):
        raise Unrecognized(f"{len(outputs)} output blocks for {n} levels of {layers} layers")
    up_attention = []
    for u in range(n):
        blocks = range(u * (layers + 1), (u + 1) * (layers + 1))
        found = [depth(f"output_blocks.{k}.1.") for k in blocks]
        # diffusers' up levels take the down levels' depths in reverse (reverse_transformer_layers_per_block unset).
        if set(found) != {down_depths[n - 1 - u]}:
            raise Unrecognized(f"up level {u}: transformer depths {found} do not mirror down level {n - 1 - u}'s")
        for k in blocks:
            if need(s, f"output_blocks.{k}.0.out_layers.3.weight")[0] != channels[n - 1 - u]:
                raise Unrecognized(f"output_blocks.{k}: channels do not mirror the down levels")
        last = blocks[-1]
        upsample = f"output_blocks.{last}.{2 if found[0] else 1}.conv.weight" in s
        if upsample != (u < n - 1):
            raise Unrecognized(f"output_blocks.{last}: an upsample where none belongs, or none where one does")
        up_attention.append(found[0] > 0)
    need(s, "middle_block.0.in_layers.0.weight")
    need(s, "middle_block.2.in_layers.0.weight")
    mid_depth = depth("middle_block.1.")
    if not mid_depth:
        raise Unrecognized("the middle block has no cross-attention (only UNetMidBlock2DCrossAttn is supported)")
    # diffusers' middle block takes the last level's depth: they can differ only when that level has no attention.
    if attention[-1] and down_depths[-1] != mid_depth:
        raise Unrecognized(f"the middle block's transformer depth {mid_depth} differs from the last level's "
                            f"{down_depths[-1]}")
    # A level without attention ignores its entry; 1 there, as SDXL's own config has it.
    per_block = [d or 1 for d in down_depths[:-1]] + [mid_depth]
    uniform = {d for d in down_depths if d} | {mid_depth} == {mid_depth}
    attn = "middle_block.1."
    time_embed = need(s, "time_embed.0.weight")[0]
    extra: dict[str, Any] = {}
    if sgm:
        # The added (pooled text + size) embedding's projection; its time-embedding width is not in the weights.
        extra = {"addition_embed_type": "text_time",
                 "projection_class_embeddings_input_dim": need(s, "label_emb.0.0.weight")[1]}
    return {
        "in_channels": conv_in[1],
        "out_channels": need(s, "out.2.weight")[0],
        "block_out_channels": channels,
        "layers_per_block": layers,
        "down_block_types": ["CrossAttnDownBlock2D" if a else "DownBlock2D" for a in attention],
        "up_block_types": ["CrossAttnUpBlock2D" if a else "UpBlock2D" for a in up_attention],
        "mid_block_type": "UNetMidBlock2DCrossAttn",
        "cross_attention_dim": need(s, attn + "transformer_blocks.0.attn2.to_k.weight")[1],
        "use_linear_projection": len(need(s, attn + "proj_in.weight")) == 2,
        # SD's own configs say one depth, SDXL's one per level.
        "transformer_layers_per_block": mid_depth if uniform and not sgm else per_block,
        "time_embedding_dim": None if time_embed == 4 * channels[0] else time_embed,
        "conv_in_kernel": conv_in[-1],
        "conv_out_kernel": need(s, "out.2.weight")[-1],
        **extra,
    }


_UNET_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
                "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}


def original_blocks(config: dict[str, Any]) -> Blocks:
    """diffusers module prefix -> (original prefix, renames inside it), for any levels and layers_per_block."""
    layers = config["layers_per_block"]
    if isinstance(layers, (list, tuple)) and len(set(layers)) == 1:
        layers = layers[0]
    if not isinstance(layers, int):
        raise UserError(f"unet: layers_per_block={layers} per level cannot be written in the original layout")
    n = len(config["block_out_channels"])
    blocks: Blocks = {
        "time_embedding.linear_1": ("time_embed.0", {}), "time_embedding.linear_2": ("time_embed.2", {}),
        "conv_in": ("input_blocks.0.0", {}), "conv_norm_out": ("out.0", {}), "conv_out": ("out.2", {}),
        "mid_block.resnets.0": ("middle_block.0", _UNET_RESNET), "mid_block.attentions.0": ("middle_block.1", {}),
        "mid_block.resnets.1": ("middle_block.2", _UNET_RESNET),
    }
    if config.get("addition_embed_type") == "text_time":
        # SDXL's embedding of the pooled text and the image sizes, added to the time embedding.
        blocks["add_embedding.linear_1"] = ("label_emb.0.0", {})
        blocks["add_embedding.linear_2"] = ("label_emb.0.2", {})
    k = 1
    for b in range(n):
        for j in range(layers):
            blocks[f"down_blocks.{b}.resnets.{j}"] = (f"input_blocks.{k}.0", _UNET_RESNET)
            blocks[f"down_blocks.{b}.attentions.{j}"] = (f"input_blocks.{k}.1", {})
            k += 1
        if b < n - 1:
            blocks[f"down_blocks.{b}.downsamplers.0.conv"] = (f"input_blocks.{k}.0.op", {})
            k += 1
    k = 0
    for b, kind in enumerate(config["up_block_types"]):
        for j in range(layers + 1):
            blocks[f"up_blocks.{b}.resnets.{j}"] = (f"output_blocks.{k}.0", _UNET_RESNET)
            blocks[f"up_blocks.{b}.attentions.{j}"] = (f"output_blocks.{k}.1", {})
            if j == layers and b < n - 1:
                # The upsampler follows the attention when the level has one.
                slot = 2 if "CrossAttn" in kind else 1
                blocks[f"up_blocks.{b}.upsamplers.0.conv"] = (f"output_blocks.{k}.{slot}.conv", {})
            k += 1
    return blocks


def original_unet_path(path: str, config: dict[str, Any]) -> str:
    """A diffusers UNet module's path in the original layout (``down_blocks.1.attentions.0.proj_in`` ->
    ``input_blocks.4.1.proj_in``), as kohya names SDXL LoRA modules; a path with no place there is kept."""
    original = original_key(path + ".weight", original_blocks(dict(config)))
    return original.removesuffix(".weight") if original else path


def unet_to_original(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A UNet's state dict (diffusers keys) in the original layout, keys without ``model.diffusion_model.``."""
    return map_by_blocks("unet", state, original_blocks(config))


def unet_from_original(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The inverse of `unet_to_original`, as diffusers' own converter reads a file (keys under their prefix)."""
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    config = dict(config)
    if isinstance(config["layers_per_block"], (list, tuple)):
        config["layers_per_block"] = config["layers_per_block"][0]  # uniform, or original_blocks refused it
    return convert_ldm_unet_checkpoint(state, config)


def effective_depths(value: Any, down_block_types: list[str]) -> list[int | None]:
    """transformer_layers_per_block as diffusers uses it: one depth per level, None where a level has no
    attention; the last level's always counts (the middle block takes it)."""
    n = len(down_block_types)
    depths = list(value) if isinstance(value, (list, tuple)) else [value] * n
    return [d if "CrossAttn" in kind or i == n - 1 else None
            for i, (d, kind) in enumerate(zip(depths, down_block_types))]

