"""Wan 2.1's transformer in its authors' original layout, the role of torchtitan's ``state_dict_adapter`` for it:
Wan-AI's release files and ComfyUI's ``models/diffusion_models/`` files hold the transformer alone under Wan's own
module names (``blocks.N.self_attn.q``, ``head.head``, ...), bare or under ComfyUI's ``model.diffusion_model.``.
Here: the names both ways, such a file read into diffusers' WanTransformer3DModel and a trained one written in it,
and LoRA files in the names ComfyUI's Wan loader applies whole, which diffusers' Wan loader reads as well.

The mapping is by module, so one table serves the state dict (a module's ``.weight``/``.bias``), a LoRA's module
names and the few bare parameters (the modulation tables): every tensor keeps its shape and row order, only its
name changes."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from diffusers import WanTransformer3DModel
from torch import Tensor

from sdtrain.models.families.transformer_file import TransformerAlone, read_transformer_file
from sdtrain.models.single_file.write import LAYOUT_CONFIG_KEY

PREFIXES = ("model.diffusion_model.", "")
"""The prefixes a file holds the transformer under: ComfyUI's full-model one, and none (Wan-AI's files)."""
MARK = "head.modulation"
"""A key only Wan's transformer holds, what ComfyUI and diffusers both tell a Wan file by."""
SINGLE_FILE_KEYS = tuple(prefix + MARK for prefix in PREFIXES)
"""Keys that mark a file as a Wan transformer in its original layout (``FileInterchange.single_file_keys``)."""
FAMILY = "wan2.1"
"""What a file sdtrain writes says it holds (``model_family`` in its metadata)."""

LORA_PREFIX = "diffusion_model."
"""What ComfyUI's LoRA key map puts before a module's original path (its model's own state-dict names), and what
diffusers' Wan loader takes a file in the original names by."""

# ------------------------------------------------------------------------------------------------------ the names
# diffusers' module (or bare parameter) -> Wan's. Outside the blocks:
_TOP = {
    "patch_embedding": "patch_embedding",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    # I2V and FLF2V: the CLIP image tokens' projection, and FLF2V's position table of its two frames' tokens.
    "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
    "condition_embedder.image_embedder.norm2": "img_emb.proj.4",
    "condition_embedder.image_embedder.pos_embed": "img_emb.emb_pos",
    "proj_out": "head.head",
    "scale_shift_table": "head.modulation",
}
# Inside ``blocks.N.``: diffusers counts the block's affine LayerNorm (before cross-attention) as its second, Wan
# as its third (Wan's norm2, before the FFN, has no weights), so norm2 is Wan's norm3.
_BLOCK = {
    **{f"{ours}.{part}": f"{theirs}.{wan}" for ours, theirs in (("attn1", "self_attn"), ("attn2", "cross_attn"))
       for part, wan in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o"), ("norm_q", "norm_q"),
                         ("norm_k", "norm_k"))},
    "attn2.add_k_proj": "cross_attn.k_img",
    "attn2.add_v_proj": "cross_attn.v_img",
    "attn2.norm_added_k": "cross_attn.norm_k_img",
    "norm2": "norm3",
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
    "scale_shift_table": "modulation",
}
_TOP_BACK = {wan: ours for ours, wan in _TOP.items()}
_BLOCK_BACK = {wan: ours for ours, wan in _BLOCK.items()}
_IN_BLOCK = re.compile(r"^(blocks\.\d+\.)(.+)$")


def _rename(path: str, top: Mapping[str, str], block: Mapping[str, str], side: str) -> str:
    """`path` (a module, a bare parameter, or a module's parameter) renamed by the tables; ValueError where neither
    names it (`side`: whose names `path` is in, for the message)."""
    match = _IN_BLOCK.match(path)
    head, rest, table = (match[1], match[2], block) if match else ("", path, top)
    if rest in table:
        return head + table[rest]
    module, _, leaf = rest.rpartition(".")
    if module in table:
        return f"{head}{table[module]}.{leaf}"
    raise ValueError(f"{path} is not a {side} module of Wan 2.1's transformer")


def original_module_path(path: str) -> str:
    """A diffusers WanTransformer3DModel module path (or state-dict key) -> Wan's original one; ValueError for one
    the original layout has no place for (a fused projection, VACE's blocks)."""
    return _rename(path, _TOP, _BLOCK, "diffusers")


def diffusers_module_path(path: str) -> str:
    """Wan's original module path (or state-dict key, no prefix) -> diffusers'; ValueError for one diffusers'
    WanTransformer3DModel has no place for."""
    return _rename(path, _TOP_BACK, _BLOCK_BACK, "original")


def to_original(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A WanTransformer3DModel state dict -> Wan's keys (no prefix); ValueError for a weight with no place there."""
    return {original_module_path(key): tensor for key, tensor in state.items()}


def from_original(keys: list[str], read: Callable[[str], Tensor]) -> Iterator[tuple[str, Tensor]]:
    """Wan's `keys` (no prefix) -> diffusers' (key, tensor) pairs, each read with `read` when its turn comes, so a
    caller storing them low never holds more than one in full precision."""
    for key in keys:
        yield diffusers_module_path(key), read(key)


# -------------------------------------------------------------------------------------------------- single files
SHAPE_KEYS = frozenset({"patch_size", "num_attention_heads", "in_channels", "out_channels", "text_dim", "freq_dim",
                        "ffn_dim", "num_layers", "cross_attn_norm", "image_dim", "added_kv_proj_dim",
                        "pos_embed_seq_len"})
"""The settings a file's tensors tell; the rest (the head width, qk_norm, eps, RoPE's length) a file sdtrain
writes carries in its metadata, and a release file has the released models' values."""
_RELEASED = {"attention_head_dim": 128, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}
"""What every Wan 2.1 release (1.3B and 14B, T2V, I2V, FLF2V) has, and its files cannot tell: 128-wide heads."""
_BLOCK_INDEX = re.compile(r"^blocks\.(\d+)\.")


def prefix_of(keys: Iterable[str]) -> str | None:
    """The prefix a file holds Wan's transformer under, None when it holds none."""
    keys = set(keys)
    return next((prefix for prefix in PREFIXES if prefix + MARK in keys and prefix + "head.head.weight" in keys),
                None)


def transformer_config(shapes: Mapping[str, tuple[int, ...]], metadata: Mapping[str, str]) -> dict[str, Any]:
    """The WanTransformer3DModel settings of a file's transformer (`shapes`: its original keys, no prefix); ValueError
    for a key diffusers' model has no place for, or a weight the file lacks."""
    def need(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise ValueError(f"no {key}")
        return tuple(shapes[key])

    unplaced = [key for key in shapes if not _placed(key)]
    if unplaced:
        raise ValueError(f"{len(unplaced)} tensors have no place in Wan 2.1's transformer (e.g. {unplaced[0]}); "
                         "VACE, Fun-control and Wan 2.2 S2V/Animate files are other models")
    settings = {**_RELEASED, **json.loads(metadata.get(LAYOUT_CONFIG_KEY) or "{}")}
    width, channels, *patch = need("patch_embedding.weight")
    head = int(settings["attention_head_dim"])
    if width % head:
        raise ValueError(f"its width {width} is not a whole number of {head}-wide heads, and its metadata "
                         f"{LAYOUT_CONFIG_KEY} says no other attention_head_dim")
    image = "img_emb.proj.1.weight" in shapes
    config = {**{k: v for k, v in settings.items() if k not in SHAPE_KEYS},
              "patch_size": tuple(patch), "num_attention_heads": width // head, "in_channels": channels,
              "out_channels": need("head.head.weight")[0] // math.prod(patch),
              "text_dim": need("text_embedding.0.weight")[1], "freq_dim": need("time_embedding.0.weight")[1],
              "ffn_dim": need("blocks.0.ffn.0.weight")[0],
              "num_layers": len({int(m[1]) for key in shapes if (m := _BLOCK_INDEX.match(key))}),
              "cross_attn_norm": "blocks.0.norm3.weight" in shapes,
              "image_dim": need("img_emb.proj.1.weight")[1] if image else None,
              "added_kv_proj_dim": need("blocks.0.cross_attn.k_img.weight")[1] if image else None,
              "pos_embed_seq_len": need("img_emb.emb_pos")[1] if "img_emb.emb_pos" in shapes else None}
    with torch.device("meta"):
        expected = WanTransformer3DModel(**config).state_dict()
    lacking = [key for key in map(original_module_path, expected) if key not in shapes]
    if lacking:
        raise ValueError(f"it lacks {len(lacking)} weights (e.g. {lacking[0]}); the file is incomplete")
    return config


def _placed(key: str) -> bool:
    try:
        diffusers_module_path(key)
    except ValueError:
        return False
    return True


def load_transformer_file(path: str | Path, trust_pickle: bool | None = None, frozen_precision: str = "fp32",
                          weights: bool = True) -> WanTransformer3DModel:
    """A WanTransformer3DModel, in fp32 (or its linear weights stored in `frozen_precision`), from a file of the
    transformer alone in Wan's original layout, a tensor at a time: a 14B file stored low never exists in fp32.
    Without `weights`, only the header is read."""
    return read_transformer_file(
        path, trust_pickle, title="Wan 2.1", cls=WanTransformer3DModel, mark=MARK, prefix_of=prefix_of,
        settings_of=transformer_config, convert=from_original, frozen_precision=frozen_precision, weights=weights,
        fix="pass a Wan 2.1 transformer file (Wan-AI's diffusion_pytorch_model*.safetensors merged into one, "
            "ComfyUI's wan2.1_*.safetensors, or `sdtrain export --single-file` of a Wan run) or a diffusers "
            "transformer folder")


TRANSFORMER_FILE = TransformerAlone(
    load_transformer_file, to_original, lambda config: FAMILY, SHAPE_KEYS,
    description="The {title} transformer alone, in one file in Wan's original layout as ComfyUI loads it",
    comfyui="put `{name}` in `ComfyUI/models/diffusion_models/` and load it with Load Diffusion Model, beside "
            "Wan's umT5-XXL text encoder (Load CLIP, type wan) and its VAE (Load VAE).")
"""Wan's single-file layout: the transformer alone, read with its settings from the shapes and the metadata, and
written (``sdtrain export --single-file``) in Wan's names, bare as Wan-AI's files are."""


# ----------------------------------------------------------------------------------------------------------- LoRA
# Which names: ComfyUI's Wan model keeps Wan's module names, and its LoRA key map takes every weight of the model
# as ``diffusion_model.<module>`` (and kohya's ``lora_unet_<module with _>``); it has no map of diffusers' Wan names,
# so a file in those leaves every key "not loaded". diffusers' Wan loader converts a file whose keys start with
# ``diffusion_model.`` from the same names. Both read ``lora_down``/``lora_up`` with an ``.alpha`` (scale alpha /
# rank), but diffusers reads that alpha only inside the blocks: outside them (the embeddings, time projection and
# head) an alpha key is left over and refused, so there the scale is folded into the down factor and no alpha
# written, which both then read at scale 1.

def lora_name(path: str) -> str:
    """The module name ComfyUI's Wan LoRA loader applies for the diffusers module at `path` (e.g.
    ``blocks.0.attn1.to_q`` -> ``diffusion_model.blocks.0.self_attn.q``); ValueError for one Wan has no place for."""
    return LORA_PREFIX + original_module_path(path)


def lora_state(layers: Mapping[str, tuple[Tensor, Tensor, float]]) -> dict[str, Tensor]:
    """LoRA factors (down, up, alpha; scale alpha / rank) by diffusers module path -> a LoRA file's state dict in the
    names ComfyUI's Wan loader applies whole and diffusers' Wan loader converts: ``<name>.lora_down.weight``,
    ``.lora_up.weight`` and, in the blocks, ``.alpha``. ComfyUI applies any layer's; diffusers' converter knows the
    blocks' attention (I2V's image keys as a pair) and FFN layers, the text, time and image embeddings, the time
    projection and the head, and refuses a file with any other (the patch embedding's); ValueError for a module
    Wan's layout has no place for."""
    state = {}
    for path, (down, up, alpha) in layers.items():
        name = lora_name(path)
        if _IN_BLOCK.match(path):
            state[f"{name}.alpha"] = torch.tensor(float(alpha))
        else:
            down = down * (float(alpha) / down.shape[0])
        state[f"{name}.lora_down.weight"], state[f"{name}.lora_up.weight"] = down, up
    return state
