"""Stable Diffusion's CLIP text towers in the original checkpoint layout, both ways: OpenAI's CLIP in transformers'
own key layout (SD 1.x's, SDXL's first), and OpenCLIP's (SD 2.x's ViT-H, SDXL's bigG): ``token_embedding``,
``positional_embedding``, ``transformer.resblocks.N`` with fused ``in_proj`` attention, ``ln_final`` and, in a
whole tower, ``text_projection`` and ``logit_scale``. Settings from the tensors' shapes, state dicts written in the
layout and read back through diffusers' converters. Where each tower stands in a file is `ldm_checkpoint`'s.

The OpenCLIP tower SD 2.x conditions on is its penultimate of 24 blocks (after ``ln_final``): a diffusers
CLIPTextModel keeps 23 layers, and diffusers' converter drops block 23 when reading, so the layout holds at most 23
layers. Readers of original checkpoints (ComfyUI, A1111) build the whole tower, so it is written whole (format 2):
the N layers as blocks 0..N-1, then

- block N, which SD 2.x does not use: a copy of block N-1 with its attention ``out_proj`` and MLP ``c_proj`` zeroed,
  so it passes its input through unchanged (a reader conditioning on the last block's output gets the same as on the
  penultimate's);
- ``text_projection``: an identity of [width, width] (OpenCLIP's ``x @ text_projection``): a CLIPTextModel has no
  projection and SD never uses CLIP's pooled embedding; square as SD 2.x's ViT-H one, and as ComfyUI loads it,
  whatever the config's ``projection_dim`` (which stays in the metadata);
- ``logit_scale``: OpenCLIP's initial log(1/0.07), a scalar; both in the dtype of the other text weights.

Reading, the number of layers: a tower with ``text_projection`` (Stability's files, sdtrain's since format 2) is one
block longer than the layers conditioned on; one without (format 1: N blocks for N layers) is all layers, except
that 24 blocks are SD 2.x's own (23 layers) either way. diffusers' converter is handed only the blocks conditioned
on: it drops block 23 alone, and would convert any other unused block as one more layer.

SDXL's bigG is conditioned on whole (the penultimate layer's output, and the last one's pooled through
``text_projection``): every block is a layer, written with its trained projection.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from sdtrain.errors import UserError
from sdtrain.models.single_file.read import Unrecognized, indices, need
from sdtrain.models.single_file.write import rename

TEXT_LAYOUTS = ("clip", "openclip")
"""The layouts a single text tower may be written in."""
# diffusers' converter drops block 23 of an OpenCLIP text tower: SD 2.x conditions on the penultimate
# of its 24 layers (diffusers' SD_2_TEXT_ENCODER_KEYS_TO_IGNORE). Files with more blocks would load with a hole.
OPENCLIP_DROPPED_BLOCK = 23
TEXT_SHAPE_KEYS = frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                             "max_position_embeddings"})
TEXT_EXTRA_KEYS = ("hidden_act", "num_attention_heads", "layer_norm_eps", "bos_token_id", "eos_token_id",
                   "pad_token_id", "projection_dim", "attention_dropout", "initializer_range", "initializer_factor")


_OPENCLIP_LAYER = {"self_attn.out_proj": "attn.out_proj", "layer_norm1": "ln_1", "layer_norm2": "ln_2",
                   "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
# OpenCLIP's initial logit scale, log(1 / 0.07): no contrastive training is behind the identity projection either.
_OPENCLIP_LOGIT_SCALE = math.log(1 / 0.07)


def clip_config(s: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """A CLIP tower's shape settings, from its keys without their ``text_model.`` prefix."""
    vocab, hidden = need(s, "embeddings.token_embedding.weight")
    layers = indices(s, "encoder.layers.")
    if not layers:
        raise Unrecognized("no encoder.layers")
    return {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": len(layers),
            "max_position_embeddings": need(s, "embeddings.position_embedding.weight")[0],
            "intermediate_size": need(s, "encoder.layers.0.mlp.fc1.weight")[0]}


def openclip_config(s: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """SD 2.x's OpenCLIP tower's shape settings (see the module docstring for its layers)."""
    vocab, hidden = need(s, "token_embedding.weight")
    blocks = len(indices(s, "transformer.resblocks."))
    if not blocks:
        raise Unrecognized("no transformer.resblocks")
    if blocks > OPENCLIP_DROPPED_BLOCK + 1:
        raise Unrecognized(f"an OpenCLIP text tower of {blocks} blocks: diffusers' converter drops block "
                            f"{OPENCLIP_DROPPED_BLOCK} (SD 2.x's unused last layer) and reads at most 24")
    need(s, "ln_final.weight")
    complete = "text_projection" in s
    # diffusers splits the fused in_proj at text_projection's first dimension: it must be the width.
    if complete and s["text_projection"][0] != hidden:
        raise Unrecognized(f"text_projection is {list(s['text_projection'])}, not [{hidden}, ...] (the width first)")
    # A complete tower (Stability's files, ours since format 2) ends on the block SD 2.x does not condition on.
    # Format 1 files stop before it, every block a layer; 24 blocks are SD 2.x's own tower either way (diffusers
    # drops block 23 whether or not text_projection is there).
    layers = blocks - 1 if complete or blocks == OPENCLIP_DROPPED_BLOCK + 1 else blocks
    if not layers:
        raise Unrecognized("the only transformer.resblocks is the tower's unused last block")
    return {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
            "max_position_embeddings": need(s, "positional_embedding")[0],
            "intermediate_size": need(s, "transformer.resblocks.0.mlp.c_fc.weight")[0]}


def bigg_config(s: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """SDXL's OpenCLIP tower: conditioned on whole (the penultimate layer's output, and the last one's pooled
    through ``text_projection``), so every block is a layer, and diffusers' converter drops none of them."""
    vocab, hidden = need(s, "token_embedding.weight")
    blocks = len(indices(s, "transformer.resblocks."))
    if not blocks:
        raise Unrecognized("no transformer.resblocks")
    need(s, "ln_final.weight")
    # OpenCLIP's x @ text_projection: [width, projection]; diffusers splits the fused in_proj at its first dimension.
    projection = need(s, "text_projection")
    if len(projection) != 2 or projection[0] != hidden:
        raise Unrecognized(f"text_projection is {list(projection)}, not [{hidden}, ...] (the width first)")
    return {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": blocks,
            "max_position_embeddings": need(s, "positional_embedding")[0],
            "intermediate_size": need(s, "transformer.resblocks.0.mlp.c_fc.weight")[0],
            "projection_dim": projection[1]}


def past_layers(key: str, prefix: str, layers: int) -> bool:
    """Whether `key` is of an OpenCLIP block past the encoder's `layers`: the tower's unused last block. diffusers'
    converter drops only block 23 (SD 2.x's) and would convert any other as one more layer: it is never handed these."""
    m = re.match(re.escape(prefix) + r"transformer\.resblocks\.(\d+)\.", key)
    return m is not None and int(m.group(1)) >= layers


def text_to_original(state: dict[str, torch.Tensor], layout: str, whole: bool = False) -> dict[str, torch.Tensor]:
    """`whole`: SDXL's OpenCLIP tower, conditioned on as it is (every layer, and its projection), where SD 2.x's
    is completed by one block it does not use (`_complete_openclip_tower`). Keys without a prefix.."""
    state = {k.removeprefix("text_model."): v for k, v in state.items() if not k.endswith("position_ids")}
    if layout == "clip":
        return dict(state)
    out: dict[str, torch.Tensor] = {}
    qkv: dict[int, dict[str, torch.Tensor]] = {}
    unmapped = []
    for key, tensor in state.items():
        if key == "embeddings.token_embedding.weight":
            out["token_embedding.weight"] = tensor
        elif key == "embeddings.position_embedding.weight":
            out["positional_embedding"] = tensor
        elif key.startswith("final_layer_norm."):
            out["ln_final." + key.removeprefix("final_layer_norm.")] = tensor
        elif key == "text_projection.weight" and whole:
            # A Linear's weight is [projection, width]; OpenCLIP multiplies by its transpose, x @ text_projection.
            out["text_projection"] = tensor.t().contiguous()
        elif m := re.match(r"encoder\.layers\.(\d+)\.(.+)$", key):
            layer, rest = int(m.group(1)), m.group(2)
            if q := re.match(r"self_attn\.([qkv])_proj\.(weight|bias)$", rest):
                qkv.setdefault(layer, {})[q.group(1) + q.group(2)] = tensor
            elif (renamed := rename(rest, _OPENCLIP_LAYER)) != rest:
                out[f"transformer.resblocks.{layer}.{renamed}"] = tensor
            else:
                unmapped.append(key)
        else:
            unmapped.append(key)
    for layer, parts in qkv.items():
        # OpenCLIP fuses the three projections into one in_proj, rows in q, k, v order.
        for kind in ("weight", "bias"):
            try:
                out[f"transformer.resblocks.{layer}.attn.in_proj_{kind}"] = torch.cat(
                    [parts["q" + kind], parts["k" + kind], parts["v" + kind]])
            except KeyError:
                unmapped.append(f"encoder.layers.{layer}.self_attn (incomplete q/k/v {kind})")
    if whole:
        if unmapped:
            raise UserError(f"text_encoder_2: {len(unmapped)} weights have no place in SDXL's OpenCLIP layout "
                            f"(e.g. {unmapped[0]}); this architecture cannot be written as a single file")
        if "text_projection" not in out:
            raise UserError("text_encoder_2: no text_projection; SDXL's second text encoder is a "
                            "CLIPTextModelWithProjection (its projected pooled output conditions the UNet)")
        embedding = out["token_embedding.weight"]
        out["logit_scale"] = torch.tensor(_OPENCLIP_LOGIT_SCALE, dtype=embedding.dtype, device=embedding.device)
        return out
    if unmapped:
        raise UserError(f"text_encoder: {len(unmapped)} weights have no place in the OpenCLIP layout "
                        f"(e.g. {unmapped[0]}); write it in the CLIP layout")
    if qkv:
        _complete_openclip_tower(out, max(qkv) + 1)
    return out


def _complete_openclip_tower(out: dict[str, torch.Tensor], layers: int) -> None:
    """Add what the original OpenCLIP tower has beyond the `layers` SD 2.x conditions on, so readers of
    original checkpoints (ComfyUI, A1111) find it whole: one more block, ``text_projection``, ``logit_scale``."""
    last = f"transformer.resblocks.{layers - 1}."
    for key, tensor in [(k, v) for k, v in out.items() if k.startswith(last)]:
        rest = key[len(last):]
        # A block adds attention and MLP outputs to its input: with those projections zero it passes its input
        # through, so even a reader conditioning on the last block's output gets the encoder's. The rest copies the
        # last layer (clones: safetensors refuses shared tensors) so the block can learn if it is ever trained.
        silent = rest.startswith(("attn.out_proj.", "mlp.c_proj."))
        out[f"transformer.resblocks.{layers}.{rest}"] = torch.zeros_like(tensor) if silent else tensor.clone()
    embedding = out["token_embedding.weight"]
    like = dict(dtype=embedding.dtype, device=embedding.device)
    # A CLIPTextModel has no projection (SD never uses CLIP's pooled embedding): an identity says so, square as
    # SD 2.x's (ViT-H's embed_dim is its width) and as ComfyUI's loader requires, whatever projection_dim says.
    width = embedding.shape[1]
    out["text_projection"] = torch.eye(width, **like)
    out["logit_scale"] = torch.tensor(_OPENCLIP_LOGIT_SCALE, **like)


def text_settings(module: Any) -> dict[str, Any]:
    """A text encoder's settings its single file keeps: its shape, and what the metadata carries beside."""
    config = module.config
    return {k: getattr(config, k) for k in (*TEXT_SHAPE_KEYS, *TEXT_EXTRA_KEYS) if hasattr(config, k)}


def text_from_original(module: Any, state: dict[str, torch.Tensor], openclip_prefix: str | None = None
                       ) -> dict[str, torch.Tensor]:
    """The inverse of `text_to_original`, by diffusers' own converters, into `module`'s keys: an OpenCLIP tower under
    `openclip_prefix`, handed as the loader hands it (without blocks past `module`'s layers), else a CLIP one under
    either of the original layout's prefixes."""
    from diffusers.loaders.single_file_utils import convert_ldm_clip_checkpoint, convert_open_clip_checkpoint

    if openclip_prefix is None:
        return convert_ldm_clip_checkpoint(state)
    layers = module.config.num_hidden_layers
    state = {k: v for k, v in state.items() if not past_layers(k, openclip_prefix, layers)}
    return convert_open_clip_checkpoint(module, state, prefix=openclip_prefix)
