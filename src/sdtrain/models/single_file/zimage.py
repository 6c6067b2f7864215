"""Z-Image's transformer in its authors' original layout (Tongyi-MAI's release file, ComfyUI's
``models/diffusion_models/`` file): the state dict both ways, its settings from tensor shapes, and writing one file.

Layout, against diffusers' ZImageTransformer2DModel: attention's ``to_q``, ``to_k`` and ``to_v`` are one fused
``attention.qkv`` (stacked along the output rows), ``to_out.0`` is ``out``, ``norm_q``/``norm_k`` are
``q_norm``/``k_norm``, and the patch embedder and final layer of diffusers' patch-size table (``all_x_embedder.2-1``,
``all_final_layer.2-1``: 2x2 patches, one frame) are plain ``x_embedder`` and ``final_layer``. The authors' model
also holds a ``norm_final`` no forward reads; it is written as ones and skipped when read (as diffusers' converter
drops it). Keys are bare, or under ComfyUI's ``model.diffusion_model.``.

Metadata written with a file (`save_original`; all strings): ``sdtrain_format``; ``model_family``: ``z-image``;
`CONFIG_KEY` (``transformer_config``): JSON of the settings shapes cannot tell (RoPE axes and lengths, theta, the
time scale, the norm's epsilon). Without it, a file takes those of the released model (`defaults` of the reader).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from sdtrain.errors import UserError
from sdtrain.models.single_file.read import FORMAT_KEY, FORMAT_VERSION
from sdtrain.models.single_file.write import write_tensors

FAMILY = "z-image"
CONFIG_KEY = "transformer_config"
PREFIXES = ("model.diffusion_model.", "")
# The key diffusers tells a Z-Image file by (`infer_diffusers_model_type`), under either prefix.
MARK = "layers.0.adaLN_modulation.0.weight"
# Settings read from the tensors; the others are what CONFIG_KEY carries.
SHAPE_KEYS = frozenset({"all_patch_size", "all_f_patch_size", "in_channels", "dim", "n_layers", "n_refiner_layers",
                        "n_heads", "n_kv_heads", "qk_norm", "cap_feat_dim", "siglip_feat_dim"})
# diffusers' name -> the authors', for every module whose name differs (the fused qkv apart).
_RENAMES = (("all_x_embedder.2-1.", "x_embedder."), ("all_final_layer.2-1.", "final_layer."),
            (".attention.to_out.0.", ".attention.out."), (".attention.norm_q.", ".attention.q_norm."),
            (".attention.norm_k.", ".attention.k_norm."))
_QKV = ("to_q", "to_k", "to_v")
_UNUSED = "norm_final.weight"
_BLOCK = re.compile(r"^(layers|noise_refiner|context_refiner)\.(\d+)\.")


def prefix_of(keys: Collection[str]) -> str | None:
    """The prefix a file holds Z-Image's transformer under, None when it holds none."""
    return next((prefix for prefix in PREFIXES if prefix + MARK in keys), None)


def _original_name(key: str) -> str:
    for ours, theirs in _RENAMES:
        key = key.replace(ours, theirs)
    return key


def _diffusers_name(key: str) -> str:
    for ours, theirs in _RENAMES:
        key = key.replace(theirs, ours)
    return key


def to_original(state: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A ZImageTransformer2DModel state dict (diffusers keys) with its config -> the authors' keys, no prefix.
    ValueError for what the layout cannot hold: other patch sizes, fewer key/value heads than query heads (the
    fused qkv is read back as three equal parts), a SigLIP embedder."""
    if list(config.get("all_patch_size", [2])) != [2] or list(config.get("all_f_patch_size", [1])) != [1]:
        raise ValueError("the original layout holds 2x2 patches of one frame alone")
    if config.get("n_kv_heads", config.get("n_heads")) != config.get("n_heads"):
        raise ValueError("the original layout fuses q, k and v into equal parts: n_kv_heads must be n_heads")
    if config.get("siglip_feat_dim"):
        raise ValueError("a SigLIP image embedder (Z-Image-Omni's) has no place in the original layout")
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        module, _, end = key.rpartition(".")
        if module.endswith(".attention.to_q") and end == "weight":
            attention = module[: -len(".to_q")]
            out[f"{attention}.qkv.weight"] = torch.cat([state[f"{attention}.{part}.weight"] for part in _QKV])
        elif not (module.endswith((".attention.to_k", ".attention.to_v")) and end == "weight"):
            out[_original_name(key)] = tensor
    out[_UNUSED] = torch.ones(config["dim"])
    return out


def iter_from_original(keys: Collection[str], read: Callable[[str], torch.Tensor]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """The authors' `keys` (no prefix) -> diffusers' (key, tensor) pairs, each original tensor read with `read` when
    its turn comes (the parts of a fused qkv are views of it), so a caller that stores them low never holds more
    than one in full precision."""
    for key in sorted(keys):
        if key == _UNUSED:
            continue
        if key.endswith(".attention.qkv.weight"):
            attention = key[: -len(".qkv.weight")]
            yield from ((f"{attention}.{part}.weight", piece) for part, piece in zip(_QKV, read(key).chunk(3)))
        else:
            yield _diffusers_name(key), read(key)


def transformer_config(shapes: Mapping[str, tuple[int, ...]], metadata: Mapping[str, str],
                       defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The ZImageTransformer2DModel settings of a file's transformer (`shapes`: its original keys, no prefix):
    sizes from the tensors, the rest from its metadata, else `defaults` (the released model's)."""
    def need(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise ValueError(f"no {key}")
        return tuple(shapes[key])

    if any(key.startswith("siglip_") for key in shapes):
        raise ValueError("a SigLIP image embedder (Z-Image-Omni's) is not read")
    dim, patch_in = need("x_embedder.weight")
    counts = {name: len({int(m.group(2)) for key in shapes if (m := _BLOCK.match(key)) and m.group(1) == name})
              for name in ("layers", "noise_refiner", "context_refiner")}
    qk_norm = "layers.0.attention.q_norm.weight" in shapes
    settings = {**defaults, **json.loads(metadata.get(CONFIG_KEY) or "{}")}
    # Without query norms the head width is not in the tensors: the heads the metadata or the defaults say.
    head_dim = need("layers.0.attention.q_norm.weight")[0] if qk_norm else dim // int(settings["n_heads"])
    heads = dim // head_dim
    rows = need("layers.0.attention.qkv.weight")[0]
    return {**{k: v for k, v in settings.items() if k not in SHAPE_KEYS}, "all_patch_size": [2],
            "all_f_patch_size": [1], "in_channels": patch_in // 4, "dim": dim, "n_layers": counts["layers"],
            "n_refiner_layers": counts["noise_refiner"], "n_heads": heads,
            "n_kv_heads": (rows - dim) // 2 // head_dim, "qk_norm": qk_norm,
            "cap_feat_dim": need("cap_embedder.0.weight")[0]}


def original_metadata(config: Mapping[str, Any]) -> dict[str, str]:
    """The metadata a written file carries: our format, the family and the settings its shapes cannot tell."""
    extras = {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()
              if not k.startswith("_") and k not in SHAPE_KEYS}
    return {"format": "pt", FORMAT_KEY: FORMAT_VERSION, "model_family": FAMILY,
            CONFIG_KEY: json.dumps(extras, sort_keys=True)}


def save_original(path: str | Path, transformer: Any, half: bool = False) -> Path:
    """Write a ZImageTransformer2DModel as ONE safetensors file in the authors' layout, atomically (a temporary
    name, then os.replace), with `original_metadata`; fp32, or bf16 with `half` (the released dtype). The settings
    it would read back as are checked against the model's first."""
    out = Path(path)
    config = dict(transformer.config)
    try:
        state = to_original(transformer.state_dict(), config)
        metadata = original_metadata(config)
        read = transformer_config({k: tuple(v.shape) for k, v in state.items()}, metadata, config)
    except ValueError as exc:
        raise UserError(f"{out}: this transformer cannot be written in Z-Image's original layout ({exc})") from exc
    differ = [f"{key}: {config.get(key)} would read as {value}" for key, value in read.items()
              if key in SHAPE_KEYS and _plain(config.get(key)) != _plain(value)]
    if differ:
        raise UserError(f"{out}: the transformer would not read back as it is ({differ[0]})")
    return write_tensors(out, state, torch.bfloat16 if half else torch.float32, metadata)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value
