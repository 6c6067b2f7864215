"""Flux.1 in Black Forest Labs' original layout (flux1-dev.safetensors, ComfyUI, kohya): the transformer's state dict
both ways, its settings from tensor shapes, LoRA adapters as kohya's Flux files, and writing one file.

Layout: diffusers keeps apart what BFL fuses along the output rows of one Linear: a double block's
``img_attn.qkv`` is ``attn.to_q``, ``to_k``, ``to_v`` stacked (``txt_attn.qkv`` the ``add_*_proj``); a single
block's ``linear1`` is ``attn.to_q``, ``to_k``, ``to_v`` and ``proj_mlp``. The final modulation
``final_layer.adaLN_modulation.1`` holds (shift, scale) where diffusers' ``norm_out.linear`` holds (scale, shift).
The norms' ``weight`` is the original's ``scale``. Everything else is a renamed module.

A LoRA on a fused module must give exactly the delta the separate ones give: the parts' downs stacked (rank = the
sum of their ranks), the block-diagonal of their ups (zero rows for an unadapted part) and the alpha that keeps
each part's alpha / rank.

Metadata written with a file (`save_original`; all strings): ``sdtrain_format``; ``model_family``: ``flux``;
`CONFIG_KEY` (``transformer_config``): JSON of the settings shapes cannot tell (``axes_dims_rope``,
``patch_size``). Without it, a file is read with Flux.1's rope axes (16, 56, 56).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from sdtrain.errors import UserError
from sdtrain.models import frozen
from sdtrain.models.single_file import kohya
from sdtrain.models.single_file.read import FLUX_PREFIXES as _PREFIXES
from sdtrain.models.single_file.read import _File, _first_line, original_prefix
from sdtrain.models.single_file.write import LAYOUT_CONFIG_KEY, layout_metadata, write_tensors

CONFIG_KEY = LAYOUT_CONFIG_KEY
FAMILY = "flux"
# Flux.1's rope axes (time/id, height, width), for files that do not say theirs: every released Flux.1 model's.
DEFAULT_AXES_DIMS_ROPE = (16, 56, 56)
# Settings read from the tensors; the others are what CONFIG_KEY carries.
SHAPE_KEYS = frozenset({"in_channels", "out_channels", "num_layers", "num_single_layers", "attention_head_dim",
                        "num_attention_heads", "joint_attention_dim", "pooled_projection_dim", "guidance_embeds"})
# diffusers' FluxTransformer2DModel builds every MLP (double blocks' and single blocks' proj_mlp) 4 times as wide.
_MLP_RATIO = 4
# Its rows are (scale, shift) in diffusers, (shift, scale) originally.
_SWAPPED = "final_layer.adaLN_modulation.1"


# --------------------------------------------------------------------------------------------------- the layout

def _modules(config: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Original module path -> the diffusers modules it holds, their output rows stacked in this order."""
    modules: dict[str, tuple[str, ...]] = {
        "img_in": ("x_embedder",), "txt_in": ("context_embedder",),
        "time_in.in_layer": ("time_text_embed.timestep_embedder.linear_1",),
        "time_in.out_layer": ("time_text_embed.timestep_embedder.linear_2",),
        "vector_in.in_layer": ("time_text_embed.text_embedder.linear_1",),
        "vector_in.out_layer": ("time_text_embed.text_embedder.linear_2",),
        "final_layer.linear": ("proj_out",), _SWAPPED: ("norm_out.linear",),
    }
    if config.get("guidance_embeds"):
        modules["guidance_in.in_layer"] = ("time_text_embed.guidance_embedder.linear_1",)
        modules["guidance_in.out_layer"] = ("time_text_embed.guidance_embedder.linear_2",)
    for i in range(int(config["num_layers"])):
        d, o = f"transformer_blocks.{i}", f"double_blocks.{i}"
        modules.update({
            f"{o}.img_mod.lin": (f"{d}.norm1.linear",), f"{o}.txt_mod.lin": (f"{d}.norm1_context.linear",),
            f"{o}.img_attn.qkv": (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"),
            f"{o}.txt_attn.qkv": (f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj"),
            f"{o}.img_attn.proj": (f"{d}.attn.to_out.0",), f"{o}.txt_attn.proj": (f"{d}.attn.to_add_out",),
            f"{o}.img_mlp.0": (f"{d}.ff.net.0.proj",), f"{o}.img_mlp.2": (f"{d}.ff.net.2",),
            f"{o}.txt_mlp.0": (f"{d}.ff_context.net.0.proj",), f"{o}.txt_mlp.2": (f"{d}.ff_context.net.2",),
        })
    for i in range(int(config["num_single_layers"])):
        d, o = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        modules.update({
            f"{o}.modulation.lin": (f"{d}.norm.linear",),
            f"{o}.linear1": (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v", f"{d}.proj_mlp"),
            f"{o}.linear2": (f"{d}.proj_out",),
        })
    return modules


def _norms(config: Mapping[str, Any]) -> dict[str, str]:
    """diffusers key -> original key of the attention's RMSNorm scales (parameters, not Linear modules)."""
    norms = {}
    for i in range(int(config["num_layers"])):
        d, o = f"transformer_blocks.{i}.attn", f"double_blocks.{i}"
        norms.update({f"{d}.norm_q.weight": f"{o}.img_attn.norm.query_norm.scale",
                      f"{d}.norm_k.weight": f"{o}.img_attn.norm.key_norm.scale",
                      f"{d}.norm_added_q.weight": f"{o}.txt_attn.norm.query_norm.scale",
                      f"{d}.norm_added_k.weight": f"{o}.txt_attn.norm.key_norm.scale"})
    for i in range(int(config["num_single_layers"])):
        d, o = f"single_transformer_blocks.{i}.attn", f"single_blocks.{i}"
        norms.update({f"{d}.norm_q.weight": f"{o}.norm.query_norm.scale",
                      f"{d}.norm_k.weight": f"{o}.norm.key_norm.scale"})
    return norms


def _inner_dim(config: Mapping[str, Any]) -> int:
    return int(config["num_attention_heads"]) * int(config["attention_head_dim"])


def _part_rows(parts: Sequence[str], config: Mapping[str, Any], total: int | None = None) -> list[int]:
    """Output rows of each part of a fused module: the attention width for q, k and v, the rest (or the MLP's
    width) for a single block's proj_mlp."""
    inner = _inner_dim(config)
    rows = [inner] * len(parts)
    if parts[-1].endswith("proj_mlp"):
        rows[-1] = total - inner * (len(parts) - 1) if total is not None else inner * _MLP_RATIO
    return rows


def swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    """(scale, shift) <-> (shift, scale) along the rows: its own inverse."""
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def original_rows(path: str, rows: torch.Tensor) -> torch.Tensor:
    """A vector of one value per output row of the transformer's layer at `path` (diffusers' row order) in the order
    Black Forest Labs' layout keeps that layer's rows: its final modulation holds shift before scale (Flux.1's and
    Flux.2's alike)."""
    return swap_halves(rows) if path == "norm_out.linear" else rows


def _strip_prefix(state: Mapping[str, Any]) -> dict[str, Any]:
    for prefix in _PREFIXES:
        if any(k.startswith(prefix) for k in state):
            return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    return dict(state)


# --------------------------------------------------------------------------------------------------- state dicts

def to_original(state: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A FluxTransformer2DModel state dict (diffusers keys) with its config -> BFL's original keys, no prefix.

    Every key must find its place and every module of the layout must be there (a file missing one would load
    with a hole): ValueError naming the first key otherwise."""
    state = dict(state)
    out: dict[str, torch.Tensor] = {}
    for original, parts in _modules(config).items():
        for end in ("weight", "bias"):
            keys = [f"{part}.{end}" for part in parts]
            missing = [k for k in keys if k not in state]
            if missing:
                raise ValueError(f"Flux transformer: {missing[0]} is missing (needed for {original}.{end})")
            tensors = [state.pop(k) for k in keys]
            tensor = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
            out[f"{original}.{end}"] = swap_halves(tensor) if original == _SWAPPED else tensor
    for key, original in _norms(config).items():
        if key not in state:
            raise ValueError(f"Flux transformer: {key} is missing (needed for {original})")
        out[original] = state.pop(key)
    if state:
        raise ValueError(f"Flux transformer: {len(state)} weights have no place in the original layout "
                         f"(e.g. {next(iter(state))}); is the config's num_layers/num_single_layers/guidance_embeds "
                         "this model's?")
    return out


def from_original(state: Mapping[str, torch.Tensor], config: Mapping[str, Any] | None = None
                  ) -> dict[str, torch.Tensor]:
    """BFL's original keys (bare, or under ``model.diffusion_model.``/``diffusion_model.``) -> diffusers'
    FluxTransformer2DModel keys: the inverse of `to_original`. `config` defaults to what the shapes tell."""
    state = _strip_prefix(state)
    if config is None:
        config = transformer_config_from_original(state)
    return dict(iter_from_original(list(state), state.pop, config))


def iter_from_original(keys: Collection[str], read: Callable[[str], torch.Tensor], config: Mapping[str, Any]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """`from_original` a tensor at a time: each of BFL's `keys` (no prefix) is read with `read` when its turn comes
    and its diffusers tensors (the parts of a fused one are views of it) are yielded at once, so a caller that
    stores them (say, in fp8) never holds more than one original tensor in full precision."""
    remaining = set(keys)
    for original, parts in _modules(config).items():
        for end in ("weight", "bias"):
            key = f"{original}.{end}"
            if key not in remaining:
                raise ValueError(f"Flux transformer (original layout): {key} is missing")
            remaining.discard(key)
            tensor = read(key)
            if original == _SWAPPED:
                tensor = swap_halves(tensor)
            if len(parts) == 1:
                yield f"{parts[0]}.{end}", tensor
                continue
            rows = _part_rows(parts, config, tensor.shape[0])
            if sum(rows) != tensor.shape[0] or min(rows) <= 0:
                raise ValueError(f"Flux transformer (original layout): {key} has {tensor.shape[0]} rows, not "
                                 f"{' + '.join(map(str, rows))} for {', '.join(parts)}")
            yield from ((f"{part}.{end}", piece) for part, piece in zip(parts, tensor.split(rows, dim=0)))
    for key, original in _norms(config).items():
        if original not in remaining:
            raise ValueError(f"Flux transformer (original layout): {original} is missing")
        remaining.discard(original)
        yield key, read(original)
    if remaining:
        raise ValueError(f"Flux transformer (original layout): {len(remaining)} weights are not Flux.1's "
                         f"(e.g. {sorted(remaining)[0]})")


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape) if hasattr(value, "shape") else tuple(value)


def _block_count(keys: Sequence[str], name: str) -> int:
    indices = {int(m.group(1)) for k in keys if (m := re.match(rf"{name}\.(\d+)\.", k))}
    if indices and indices != set(range(max(indices) + 1)):
        raise ValueError(f"Flux transformer (original layout): {name} {sorted(set(range(max(indices) + 1)) - indices)}"
                         " are missing")
    return len(indices)


def transformer_config_from_original(state_or_shapes: Mapping[str, Any],
                                     metadata: Mapping[str, str] | None = None) -> dict[str, Any]:
    """FluxTransformer2DModel's settings from an original-layout state dict (tensors, or their shapes): sizes and
    block counts from the shapes, ``guidance_embeds`` from ``guidance_in.*``, and what shapes cannot tell
    (``axes_dims_rope``, ``patch_size``) from the metadata's `CONFIG_KEY`, else Flux.1's."""
    shapes = {k: _shape(v) for k, v in _strip_prefix(state_or_shapes).items()}
    try:
        hidden, in_channels = shapes["img_in.weight"]
        out_channels = shapes["final_layer.linear.weight"][0]
        joint_attention_dim = shapes["txt_in.weight"][1]
        pooled_projection_dim = shapes["vector_in.in_layer.weight"][1]
    except KeyError as exc:
        raise ValueError(f"not a Flux.1 transformer in the original layout: no {exc.args[0]}") from exc
    num_layers = _block_count(list(shapes), "double_blocks")
    num_single_layers = _block_count(list(shapes), "single_blocks")
    norm = ("double_blocks.0.img_attn.norm.query_norm.scale" if num_layers
            else "single_blocks.0.norm.query_norm.scale")
    if norm not in shapes:
        raise ValueError(f"not a Flux.1 transformer in the original layout: no {norm}")
    head_dim = shapes[norm][0]
    if hidden % head_dim:
        raise ValueError(f"Flux transformer: width {hidden} is not a whole number of {head_dim}-wide heads")
    # diffusers' model has no MLP ratio setting: a file with another one would not load into it.
    if num_layers:
        mlp = shapes.get("double_blocks.0.img_mlp.0.weight", (0,))[0]
    else:
        mlp = shapes.get("single_blocks.0.linear1.weight", (0,))[0] - 3 * hidden
    if num_layers + num_single_layers and mlp != _MLP_RATIO * hidden:
        raise ValueError(f"Flux transformer: MLP width {mlp} is not {_MLP_RATIO} x {hidden}, the only ratio "
                         "diffusers' FluxTransformer2DModel builds")
    extra: dict[str, Any] = {}
    if metadata and CONFIG_KEY in metadata:
        try:
            extra = json.loads(metadata[CONFIG_KEY])
        except json.JSONDecodeError as exc:
            raise ValueError(f"metadata {CONFIG_KEY} is not valid JSON ({exc})") from exc
        if not isinstance(extra, dict):
            raise ValueError(f"metadata {CONFIG_KEY} is not a JSON object")
    axes = tuple(int(a) for a in extra.get("axes_dims_rope", DEFAULT_AXES_DIMS_ROPE))
    if sum(axes) != head_dim:
        # The rope's axes split a head between them: any other sum fails at the first forward.
        raise ValueError(f"Flux transformer: rope axes {axes} do not add up to the {head_dim}-wide heads; a file "
                         f"of another head width must say its axes in the metadata {CONFIG_KEY}")
    config = {"patch_size": int(extra.get("patch_size", 1)), "in_channels": in_channels,
              "num_layers": num_layers, "num_single_layers": num_single_layers, "attention_head_dim": head_dim,
              "num_attention_heads": hidden // head_dim, "joint_attention_dim": joint_attention_dim,
              "pooled_projection_dim": pooled_projection_dim,
              "guidance_embeds": "guidance_in.in_layer.weight" in shapes, "axes_dims_rope": axes}
    if out_channels != in_channels:
        # diffusers' default (None) is in_channels; said only when different, as a config folder says it.
        config["out_channels"] = out_channels
    return config


# --------------------------------------------------------------------------------------------------- LoRA

def kohya_lora(layers: Mapping[str, kohya.LoraFactors], config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """LoRA layers on diffusers' module paths (inside the transformer, as peft names them) -> kohya's Flux keys
    (single_file.kohya's layout). `layers` maps a path to (lora_A weight [r, in], lora_B weight [out, r], alpha).
    Parts BFL fuses are fused (see the module docstring). A path without an original counterpart: ValueError."""
    modules = _modules(config)
    owner = {part: (original, i) for original, parts in modules.items() for i, part in enumerate(parts)}
    groups: dict[str, dict[int, kohya.LoraFactors]] = {}
    for path, layer in layers.items():
        if path not in owner:
            raise ValueError(f"LoRA {path}: no module of Flux.1's original layout holds it (or it is past the "
                             "config's blocks)")
        original, i = owner[path]
        groups.setdefault(original, {})[i] = kohya.checked(path, layer)
    out: dict[str, torch.Tensor] = {}
    for original, present in groups.items():
        parts = modules[original]
        down, up, alpha = present[0] if len(parts) == 1 else kohya.fuse(original, parts, present,
                                                                        _part_rows(parts, config))
        if original == _SWAPPED:
            up = swap_halves(up)
        if original.startswith("final_layer."):
            # diffusers' kohya reader drops final_layer's alphas (it reads those at scale 1): the scale goes into
            # up, which every reader then applies alike.
            up, alpha = up * (alpha / down.shape[0]), float(down.shape[0])
        out.update(kohya.keys(original, (down, up, alpha)))
    return out


# --------------------------------------------------------------------------------------------------- loading

def load_transformer(file: _File, frozen_precision: str = "fp32", weights: bool = True) -> Any:
    """A FluxTransformer2DModel, in fp32, from a file of Flux.1's transformer in BFL's original layout (bare keys as
    in flux1-dev.safetensors, or under ComfyUI's ``model.diffusion_model.``; other keys of such a checkpoint are
    left alone): its settings from the tensor shapes and the file's metadata (`flux.transformer_config_from_original`),
    its weights converted by `flux.from_original`. No config folder, no download; the model is built on the meta
    device and given the tensors, so a 12B transformer is never allocated twice.

    A `frozen_precision` other than fp32 reads the file a tensor at a time, its linear weights stored in that
    precision as they come (`frozen.fill_streamed`): a 24 GB bf16 file then loads as 12 GB of fp8, never 48 GB of
    fp32. Without `weights`, only the header is read and every tensor stays on the meta device."""
    from diffusers import FluxTransformer2DModel

    prefix = original_prefix(file.shapes)
    if prefix is None:
        raise UserError(f"{file.path}: holds no Flux.1 transformer in BFL's layout (double_blocks.*, single_blocks.*); "
                        "point model.transformer at one")
    keys = [k for k in file.shapes if k.startswith(prefix)]
    fix = ("pass a Flux.1 transformer file (flux1-dev/schnell.safetensors, or `sdtrain export --single-file` of a "
           "Flux run) or a diffusers transformer folder")
    try:
        config = transformer_config_from_original({k: file.shapes[k] for k in keys}, file.metadata)
    except ValueError as exc:
        raise UserError(f"{file.path}: cannot read it as a Flux.1 transformer ({_first_line(exc)}); {fix}") from exc
    # The rope axes as a list, as a config.json gives them: a checkpoint's spec is then the same either way.
    settings = {**config, "axes_dims_rope": list(config["axes_dims_rope"])}
    if not weights:
        with torch.device("meta"):
            return FluxTransformer2DModel(**settings).eval()
    try:
        if frozen_precision != "fp32":
            with frozen.parameters_on_meta():
                module = FluxTransformer2DModel(**settings)
            tensors = iter_from_original([k[len(prefix):] for k in keys],
                                              lambda key: file.floats([prefix + key])[prefix + key], config)
            frozen.fill_streamed(module, tensors, frozen_precision)
        else:
            module = _in_fp32(file, keys, config, settings)
    except ValueError as exc:  # the conversion: a key missing, or one that is not Flux.1's
        raise UserError(f"{file.path}: cannot read it as a Flux.1 transformer ({_first_line(exc)}); {fix}") from exc
    except (RuntimeError, TypeError) as exc:
        raise UserError(f"{file.path}: cannot load the Flux.1 transformer ({_first_line(exc)}); {fix}") from exc
    missing = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if missing:
        raise UserError(f"{file.path}: the Flux.1 transformer lacks {len(missing)} weights (e.g. {missing[0]}); the "
                        "file is incomplete")
    return module.eval()


def _in_fp32(file: _File, keys: list[str], config: dict[str, Any], settings: dict[str, Any]) -> Any:
    from diffusers import FluxTransformer2DModel

    state = from_original(file.floats(keys), config)
    # Each fused tensor is freed once its last part is copied (frozen.owned).
    separate = {key: frozen.owned(state.pop(key)) for key in list(state)}
    with torch.device("meta"):
        module = FluxTransformer2DModel(**settings)
    module.load_state_dict(separate, strict=True, assign=True)
    return module


# --------------------------------------------------------------------------------------------------- writing

def original_metadata(config: Mapping[str, Any]) -> dict[str, str]:
    """The metadata a written file carries: our format, the family and the settings its shapes cannot tell."""
    return layout_metadata(config, FAMILY, SHAPE_KEYS)


def _config_differences(config: Mapping[str, Any], read: Mapping[str, Any]) -> list[str]:
    """The settings a reader of the file would get otherwise than the model has them."""
    def plain(value: Any) -> Any:
        return list(value) if isinstance(value, (list, tuple)) else value

    mine = {**config, "out_channels": config.get("out_channels") or config.get("in_channels")}
    return [f"{key}: {mine.get(key)} would read as {value}" for key, value in read.items()
            if plain(mine.get(key)) != plain(value)]


def save_original(path: str | Path, transformer: Any, half: bool = False) -> Path:
    """Write a FluxTransformer2DModel as ONE safetensors file in BFL's original layout (flux1-dev.safetensors'),
    atomically (a temporary name, then os.replace), with `original_metadata`. fp32, or bf16 with `half`: Flux.1's
    own dtype (its activations overflow fp16). Returns the path."""
    out = Path(path)
    config = dict(transformer.config)
    try:
        state = to_original(transformer.state_dict(), config)
        metadata = original_metadata(config)
        read = transformer_config_from_original(state, metadata)
    except ValueError as exc:
        raise UserError(f"{out}: this transformer cannot be written in Flux.1's original layout ({exc})") from exc
    differ = _config_differences(config, read)
    if differ:
        raise UserError(f"{out}: the transformer would not read back as it is ({differ[0]})")
    return write_tensors(out, state, torch.bfloat16 if half else torch.float32, metadata)
