"""Flux.1 in Black Forest Labs' original layout (flux1-dev.safetensors, ComfyUI, kohya): the transformer's state dict
both ways, its settings from tensor shapes, LoRA adapters as kohya's Flux files, and writing one file.

The layout of the double and single blocks is `bfl`'s, which Chroma shares; Flux.1 adds its own modules: each
block's adaLN modulation, the timestep, pooled-text (vector) and guidance embedders, and the final modulation
``final_layer.adaLN_modulation.1``, which holds (shift, scale) where diffusers' ``norm_out.linear`` holds (scale,
shift). Everything else is a renamed module.

Metadata written with a file (`save_original`; all strings): ``sdtrain_format``; ``model_family``: ``flux``;
`CONFIG_KEY` (``transformer_config``): JSON of the settings shapes cannot tell (``axes_dims_rope``,
``patch_size``). Without it, a file is read with Flux.1's rope axes (16, 56, 56).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from sdtrain.errors import UserError
from sdtrain.models import frozen
from sdtrain.models.families import bfl
from sdtrain.models.families.bfl import PREFIXES as _PREFIXES
from sdtrain.models.families.bfl import original_prefix
from sdtrain.models.single_file import kohya
from sdtrain.models.single_file.read import OpenFile, error_line
from sdtrain.models.single_file.write import LAYOUT_CONFIG_KEY, layout_metadata, write_tensors

CONFIG_KEY = LAYOUT_CONFIG_KEY
FAMILY = "flux"
# Flux.1's rope axes (time/id, height, width), for files that do not say theirs: every released Flux.1 model's.
DEFAULT_AXES_DIMS_ROPE = (16, 56, 56)
# Settings read from the tensors; the others are what CONFIG_KEY carries.
SHAPE_KEYS = frozenset({"in_channels", "out_channels", "num_layers", "num_single_layers", "attention_head_dim",
                        "num_attention_heads", "joint_attention_dim", "pooled_projection_dim", "guidance_embeds"})
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
    return {**modules, **bfl.block_modules(config, modulated=True)}


_LAYOUT = bfl.Layout(title="Flux", model="Flux.1", modules=_modules, norms=bfl.block_norms,
                     settings="num_layers/num_single_layers/guidance_embeds", swapped=_SWAPPED)


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
    return _LAYOUT.to_original(state, config)


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
    return _LAYOUT.iter_from_original(keys, read, config)


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape) if hasattr(value, "shape") else tuple(value)


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
    num_layers = bfl.block_count(list(shapes), "double_blocks", "Flux")
    num_single_layers = bfl.block_count(list(shapes), "single_blocks", "Flux")
    head_dim = bfl.head_and_mlp(shapes, hidden, num_layers, num_single_layers, "Flux", "Flux.1",
                                "FluxTransformer2DModel")
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
    (`kohya`'s layout). `layers` maps a path to (lora_A weight [r, in], lora_B weight [out, r], alpha).
    Parts BFL fuses are fused (see `bfl`). A path without an original counterpart: ValueError."""
    return _LAYOUT.kohya_lora(layers, config)


# --------------------------------------------------------------------------------------------------- loading

def load_transformer(file: OpenFile, frozen_precision: str = "fp32", weights: bool = True) -> Any:
    """A FluxTransformer2DModel, in fp32, from a file of Flux.1's transformer in BFL's original layout (bare keys as
    in flux1-dev.safetensors, or under ComfyUI's ``model.diffusion_model.``; other keys of such a checkpoint are
    left alone): its settings from the tensor shapes and the file's metadata (`transformer_config_from_original`),
    its weights converted by `from_original`. No config folder, no download; the model is built on the meta
    device and given the tensors, so a 12B transformer is never allocated twice.

    A `frozen_precision` other than fp32 reads the file a tensor at a time, its linear weights stored in that
    precision as they come (`frozen.fill_streamed`): a 24 GB bf16 file then loads as 12 GB of fp8, never 48 GB of
    fp32. Without `weights`, only the header is read and every tensor stays on the meta device."""
    from diffusers import FluxTransformer2DModel

    prefix = original_prefix(file.shapes)
    if prefix is None:
        raise UserError(f"{file.path}: holds no Flux.1 transformer in BFL's layout (double_blocks.*, single_blocks.*); "
                        "point model.components.transformer.source at one")
    keys = [k for k in file.shapes if k.startswith(prefix)]
    fix = ("pass a Flux.1 transformer file (flux1-dev/schnell.safetensors, or `sdtrain export --single-file` of a "
           "Flux run) or a diffusers transformer folder")
    try:
        config = transformer_config_from_original({k: file.shapes[k] for k in keys}, file.metadata)
    except ValueError as exc:
        raise UserError(f"{file.path}: cannot read it as a Flux.1 transformer ({error_line(exc)}); {fix}") from exc
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
        raise UserError(f"{file.path}: cannot read it as a Flux.1 transformer ({error_line(exc)}); {fix}") from exc
    except (RuntimeError, TypeError) as exc:
        raise UserError(f"{file.path}: cannot load the Flux.1 transformer ({error_line(exc)}); {fix}") from exc
    missing = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if missing:
        raise UserError(f"{file.path}: the Flux.1 transformer lacks {len(missing)} weights (e.g. {missing[0]}); the "
                        "file is incomplete")
    return module.eval()


def _in_fp32(file: OpenFile, keys: list[str], config: dict[str, Any], settings: dict[str, Any]) -> Any:
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
