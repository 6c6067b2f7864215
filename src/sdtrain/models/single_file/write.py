"""Writing a single file in the original layout: the diffusers -> original key mapping, the metadata a
file carries, and the check that what is written reads back as it is."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

import torch

from sdtrain.errors import UserError
from sdtrain.models.single_file.read import (
    _FORMAT_VERSIONS,
    _OPENCLIP_DROPPED_BLOCK,
    CLIP_PREFIX,
    FORMAT_KEY,
    FORMAT_VERSION,
    OPENCLIP_PREFIX,
    SDXL_CLIP_PREFIX,
    SDXL_OPENCLIP_PREFIX,
    TEXT_ENCODERS,
    TEXT_EXTRA_KEYS,
    TEXT_LAYOUTS,
    TEXT_SHAPE_KEYS,
    UNET_PREFIX,
    UNET_SHAPE_KEYS,
    VAE_PREFIX,
    VAE_SHAPE_KEYS,
    _infer,
    _past_layers,
    _read_safetensors,
    _Unrecognized,
    is_single_file,
    text_encoder_layout,
)

# The package's logger, named as before the module became a package.
log = logging.getLogger(__package__)


# --------------------------------------------------------------------------------------------------- writing

_UNET_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
                "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
_VAE_RESNET = {"conv_shortcut": "nin_shortcut"}
_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_OPENCLIP_LAYER = {"self_attn.out_proj": "attn.out_proj", "layer_norm1": "ln_1", "layer_norm2": "ln_2",
                   "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
# OpenCLIP's initial logit scale, log(1 / 0.07): no contrastive training is behind the identity projection either.
_OPENCLIP_LOGIT_SCALE = math.log(1 / 0.07)


def _rename(rest: str, table: dict[str, str]) -> str:
    for src, dst in table.items():
        if rest.startswith(src + "."):
            return dst + rest[len(src):]
    return rest


def _unet_blocks(config: dict[str, Any]) -> dict[str, tuple[str, dict[str, str]]]:
    """diffusers module prefix -> (original prefix, renames inside it), for any levels and layers_per_block."""
    layers = config["layers_per_block"]
    if isinstance(layers, (list, tuple)) and len(set(layers)) == 1:
        layers = layers[0]
    if not isinstance(layers, int):
        raise UserError(f"unet: layers_per_block={layers} per level cannot be written in the original layout")
    n = len(config["block_out_channels"])
    blocks: dict[str, tuple[str, dict[str, str]]] = {
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


def _vae_blocks(config: dict[str, Any]) -> dict[str, tuple[str, dict[str, str]]]:
    n, layers = len(config["block_out_channels"]), config["layers_per_block"]
    blocks: dict[str, tuple[str, dict[str, str]]] = {"quant_conv": ("quant_conv", {}),
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


def _original_key(key: str, blocks: dict[str, tuple[str, dict[str, str]]]) -> str | None:
    """`key` (a weight or module path) in the original layout, by its longest mapped prefix; None when unmapped."""
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in blocks:
            target, table = blocks[prefix]
            return target + "." + _rename(".".join(parts[cut:]), table)
    return None


def _map_by_blocks(name: str, state: dict[str, torch.Tensor], blocks: dict[str, tuple[str, dict[str, str]]]):
    out, unmapped = {}, []
    for key, tensor in state.items():
        original = _original_key(key, blocks)
        if original is None:
            unmapped.append(key)
        else:
            out[original] = tensor
    if unmapped:
        raise UserError(f"{name}: {len(unmapped)} weights have no place in the original layout (e.g. {unmapped[0]}); "
                        "this architecture cannot be written as a single file")
    return out


def original_unet_path(path: str, config: dict[str, Any]) -> str:
    """A diffusers UNet module's path in the original layout (``down_blocks.1.attentions.0.proj_in`` ->
    ``input_blocks.4.1.proj_in``), as kohya names SDXL LoRA modules; a path with no place there is kept."""
    original = _original_key(path + ".weight", _unet_blocks(dict(config)))
    return original.removesuffix(".weight") if original else path


def _vae_to_original(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = _map_by_blocks("vae", state, _vae_blocks(config))
    for key, tensor in out.items():
        # The original attention projections are 1x1 convolutions; diffusers' are linear layers.
        attention = ".mid.attn_1." in key and key.endswith(("q.weight", "k.weight", "v.weight", "proj_out.weight"))
        if attention and tensor.ndim == 2:
            out[key] = tensor[:, :, None, None]
    return out


def _text_to_original(state: dict[str, torch.Tensor], layout: str, whole: bool = False) -> dict[str, torch.Tensor]:
    """`whole`: SDXL's OpenCLIP tower, conditioned on as it is (every layer, and its projection), where SD 2.x's
    is completed by one block it does not use (`_complete_openclip_tower`)."""
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
            elif (renamed := _rename(rest, _OPENCLIP_LAYER)) != rest:
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


def _module_config(name: str, module: Any) -> dict[str, Any]:
    if name in TEXT_ENCODERS:
        config = module.config
        return {k: getattr(config, k) for k in (*TEXT_SHAPE_KEYS, *TEXT_EXTRA_KEYS) if hasattr(config, k)}
    return {k: v for k, v in dict(module.config).items() if not k.startswith("_")}


def _to_original(name: str, state: dict[str, torch.Tensor], config: dict[str, Any],
                 text_layout: str | None) -> dict[str, torch.Tensor]:
    """A component's diffusers state dict in the original layout, keys without the component prefix."""
    if name == "unet":
        return _map_by_blocks("unet", state, _unet_blocks(config))
    if name == "vae":
        return _vae_to_original(state, config)
    if name == "text_encoder_2":
        return _text_to_original(state, "openclip", whole=True)
    return _text_to_original(state, text_layout or "clip")


def choose_text_layout(text_encoder: Any, source: str | Path | None = None, requested: str = "auto") -> str:
    """'clip' or 'openclip' for writing `text_encoder`.

    Rule for 'auto': OpenCLIP (SD 2.x) when the text encoder was loaded from an SD 2.x-layout single file,
    or its hidden size is 1024 (SD 2.x's ViT-H); else CLIP (SD 1.x). An OpenCLIP layout holds at most 23
    layers (diffusers drops block 23 when reading), so a deeper encoder is written in the CLIP layout.
    """
    if requested not in ("auto", *TEXT_LAYOUTS):
        raise UserError(f"text layout '{requested}' is not one of auto, {', '.join(TEXT_LAYOUTS)}")
    layers = text_encoder.config.num_hidden_layers
    if requested != "auto":
        if requested == "openclip" and layers > _OPENCLIP_DROPPED_BLOCK:
            raise UserError(f"--text-layout openclip: a {layers}-layer text encoder does not fit the OpenCLIP "
                            f"layout, which diffusers reads up to {_OPENCLIP_DROPPED_BLOCK} layers; use clip")
        return requested
    from_sd2 = False
    if source is not None and is_single_file(source):
        try:
            from_sd2 = text_encoder_layout(source) == "openclip"
        except UserError:
            from_sd2 = False
    wants = from_sd2 or text_encoder.config.hidden_size == 1024
    if wants and layers > _OPENCLIP_DROPPED_BLOCK:
        log.warning("a %d-layer text encoder does not fit the OpenCLIP layout; writing it in the CLIP layout", layers)
        return "clip"
    return "openclip" if wants else "clip"


def _normalize(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_normalize(v) for v in value]
    return value


def _effective_depths(value: Any, down_block_types: list[str]) -> list[int | None]:
    """transformer_layers_per_block as diffusers uses it: one depth per level, None where a level has no
    attention; the last level's always counts (the middle block takes it)."""
    n = len(down_block_types)
    depths = list(value) if isinstance(value, (list, tuple)) else [value] * n
    return [d if "CrossAttn" in kind or i == n - 1 else None
            for i, (d, kind) in enumerate(zip(depths, down_block_types))]


def _sdxl(unet: Any = None, text_encoder_2: Any = None) -> bool:
    """Whether components are written in SDXL's layout: a second text encoder, or a UNet with SDXL's added
    embedding of the pooled text and sizes."""
    return text_encoder_2 is not None or (unet is not None and unet.config.get("addition_embed_type") == "text_time")


def _config_differences(expected: dict[str, Any], inferred: dict[str, Any]) -> list[str]:
    differ = []
    for key, value in expected.items():
        got = inferred.get(key)
        a, b = _normalize(value), _normalize(got)
        if key == "transformer_layers_per_block" and "down_block_types" in expected and got is not None:
            # A level without attention ignores its depth: [1, 2, 10] and [3, 2, 10] are the same SDXL UNet.
            a, b = (_effective_depths(v, expected["down_block_types"]) for v in (a, b))
        if key == "layers_per_block" and isinstance(a, list) and len(set(a)) == 1:
            a = a[0]
        if key == "time_embedding_dim" and a == 4 * expected["block_out_channels"][0]:
            a = None  # the default, spelled out
        if a != b:
            differ.append(f"{key}={value!r} reads back as {got!r}")
    return differ


def to_original_state_dict(unet: Any = None, vae: Any = None, text_encoder: Any = None,
                           text_layout: str = "clip", text_encoder_2: Any = None) -> dict[str, torch.Tensor]:
    """The components' weights in the original single-file layout (keys with their component prefix).

    With `text_encoder_2` (or a UNet with SDXL's ``text_time`` added embedding), SDXL's SGM layout: the text
    encoders at ``conditioner.embedders.0.transformer.text_model.*`` (CLIP) and ``conditioner.embedders.1.model.*``
    (OpenCLIP, whole, with its ``text_projection``). A VAE alone is written with bare keys (``encoder.*``,
    ``decoder.*``), as standalone VAE files are.
    """
    if text_encoder is not None and text_layout not in TEXT_LAYOUTS:
        raise UserError(f"text layout '{text_layout}' is not one of {', '.join(TEXT_LAYOUTS)}")
    sdxl = _sdxl(unet, text_encoder_2)
    if sdxl and text_encoder is not None and text_layout != "clip":
        raise UserError(f"text layout '{text_layout}': SDXL's first text encoder is written in the CLIP layout")
    out: dict[str, torch.Tensor] = {}
    vae_only = unet is None and text_encoder is None and text_encoder_2 is None
    text_prefix = SDXL_CLIP_PREFIX if sdxl else OPENCLIP_PREFIX if text_layout == "openclip" else CLIP_PREFIX
    for name, module, prefix in (("unet", unet, UNET_PREFIX), ("vae", vae, "" if vae_only else VAE_PREFIX),
                                 ("text_encoder", text_encoder, text_prefix),
                                 ("text_encoder_2", text_encoder_2, SDXL_OPENCLIP_PREFIX)):
        if module is None:
            continue
        mapped = _to_original(name, module.state_dict(), _module_config(name, module), text_layout)
        out.update({prefix + k: v for k, v in mapped.items()})
    return out


def single_file_metadata(unet: Any = None, vae: Any = None, text_encoder: Any = None, scheduler: Any = None,
                         text_layout: str | None = None, text_encoder_2: Any = None) -> dict[str, str]:
    """The metadata a written file carries: what its weights cannot tell (see the module docstring)."""
    metadata = {"format": "pt", FORMAT_KEY: FORMAT_VERSION}
    if _sdxl(unet, text_encoder_2):
        # The keys say it too; this is for readers that go by metadata (a VAE-only file, whose keys are SD's, says
        # it only when the caller's `metadata` does).
        metadata["model_family"] = "sdxl"
    if scheduler is not None:
        config = dict(scheduler.config)
        # Settings left at their defaults stay unsaid, as in a diffusers folder: a sampler made from the schedule
        # (from_config of another class) then takes its own defaults for them, the same either way.
        defaults = set(config.get("_use_default_values", []))
        settings = {k: v for k, v in config.items() if not k.startswith("_") and k not in defaults}
        metadata["prediction_type"] = str(settings.pop("prediction_type", "epsilon"))
        metadata["scheduler_config"] = json.dumps(settings, sort_keys=True)
    for name, module, shape_keys in (("unet", unet, UNET_SHAPE_KEYS), ("vae", vae, VAE_SHAPE_KEYS),
                                     ("text_encoder", text_encoder, TEXT_SHAPE_KEYS),
                                     ("text_encoder_2", text_encoder_2, TEXT_SHAPE_KEYS)):
        if module is not None:
            extras = {k: v for k, v in _module_config(name, module).items() if k not in shape_keys}
            metadata[f"{name}_config"] = json.dumps(extras, sort_keys=True)
    if text_encoder is not None and text_layout:
        metadata["text_encoder_layout"] = text_layout
    if text_encoder_2 is not None:
        metadata["text_encoder_2_layout"] = "openclip"
    return metadata


def _diffusers_converted_keys(name: str, state: dict[str, torch.Tensor], module: Any) -> set[str]:
    """The diffusers keys diffusers' own single-file converters make of `state` for this component."""
    from diffusers.loaders.single_file_utils import (
        convert_ldm_clip_checkpoint,
        convert_ldm_unet_checkpoint,
        convert_ldm_vae_checkpoint,
        convert_open_clip_checkpoint,
    )

    if name == "unet":
        config = dict(module.config)
        if isinstance(config["layers_per_block"], (list, tuple)):
            config["layers_per_block"] = config["layers_per_block"][0]  # uniform, or _unet_blocks refused it
        return set(convert_ldm_unet_checkpoint(state, config))
    if name == "vae":
        return set(convert_ldm_vae_checkpoint(state, dict(module.config)))
    if name == "text_encoder_2":
        converted = convert_open_clip_checkpoint(module, state, prefix=SDXL_OPENCLIP_PREFIX)
        return {k.removeprefix("text_model.") for k in converted}
    if OPENCLIP_PREFIX + "token_embedding.weight" in state:
        layers = module.config.num_hidden_layers
        # As the loader hands them: without the tower's unused last block.
        state = {k: v for k, v in state.items() if not _past_layers(k, OPENCLIP_PREFIX, layers)}
        converted = convert_open_clip_checkpoint(module, state, prefix=OPENCLIP_PREFIX)
    else:
        converted = convert_ldm_clip_checkpoint(state)
    return {k.removeprefix("text_model.") for k in converted}


def _check_reads_back(components: dict[str, Any], state: dict[str, torch.Tensor], metadata: dict[str, str],
                      out: Path) -> None:
    """What a reader will make of the written keys and metadata must be each module as it is: the configs our
    loader infers, and the keys diffusers' converters produce (on shapes only: meta tensors, no copies)."""
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    try:
        inferred = _infer(shapes, metadata)
    except _Unrecognized as exc:
        raise UserError(f"{out}: this model cannot be written in the original layout ({exc})") from exc
    configs, errors = inferred[0], inferred[-1]
    if errors:
        name, why = next(iter(errors.items()))
        raise UserError(f"{out}: the {name} cannot be written in the original layout ({why})")
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}
    for name, module in components.items():
        differ = _config_differences(_module_config(name, module), configs.get(name, {}))
        if differ:
            raise UserError(f"{out}: the {name} would not read back as it is ({differ[0]}); this architecture "
                            "cannot be written as a single file")
        # CLIPTextModel's keys have no text_model. prefix (transformers 5), CLIPTextModelWithProjection's do.
        wanted = {k.removeprefix("text_model.") for k in module.state_dict() if not k.endswith("position_ids")}
        converted = _diffusers_converted_keys(name, meta, module)
        if converted != wanted:
            odd = sorted(converted ^ wanted)
            raise UserError(f"{out}: diffusers would not read the {name} back ({len(odd)} weights differ, e.g. "
                            f"{odd[0]}); this architecture cannot be written as a single file")


def save_single_file(out: str | Path, *, unet: Any = None, vae: Any = None, text_encoder: Any = None,
                     text_encoder_2: Any = None, scheduler: Any = None, text_layout: str = "auto",
                     text_source: str | Path | None = None, half: bool = False,
                     metadata: dict[str, str] | None = None) -> Path:
    """Write the given components as ONE safetensors file in the original SD layout, atomically.

    With `text_encoder_2` (SDXL's CLIPTextModelWithProjection), or a UNet with SDXL's ``text_time`` added
    embedding, the file is in SDXL's SGM layout (see `to_original_state_dict`) and says ``model_family: sdxl``.
    `scheduler` (the training noise scheduler) gives ``prediction_type`` and ``scheduler_config``; without it
    the file says neither and readers assume SD's (v_prediction for an SD 2.x OpenCLIP file, else epsilon).
    `text_layout` is 'auto' (see `choose_text_layout`, `text_source` being where the text encoder came
    from), 'clip' or 'openclip' (never for SDXL, whose first text encoder is CLIP). fp32 unless `half`.
    Returns `out`.
    """

    out = Path(out)
    components = {n: m for n, m in (("unet", unet), ("vae", vae), ("text_encoder", text_encoder),
                                    ("text_encoder_2", text_encoder_2)) if m is not None}
    if not components:
        raise UserError(f"{out}: nothing to write (no UNet, VAE or text encoder)")
    if text_encoder is None:
        layout = None
    elif _sdxl(unet, text_encoder_2):
        if text_layout not in ("auto", "clip"):
            raise UserError(f"{out}: text layout '{text_layout}' does not apply to SDXL, whose first text encoder "
                            "is written in the CLIP layout; use auto or clip")
        layout = "clip"
    else:
        layout = choose_text_layout(text_encoder, text_source, text_layout)
    state = to_original_state_dict(unet, vae, text_encoder, layout or "clip", text_encoder_2)
    info = single_file_metadata(unet, vae, text_encoder, scheduler, layout, text_encoder_2)
    info.update(metadata or {})
    _check_reads_back(components, state, info, out)
    return write_tensors(out, state, torch.float16 if half else torch.float32, info)


LAYOUT_CONFIG_KEY = "transformer_config"
"""The metadata key of a transformer file in its authors' layout (Flux.1's, Z-Image's) that carries, as JSON, the
settings its tensor shapes cannot tell."""


def layout_metadata(config: Any, family: str, shape_keys: frozenset[str]) -> dict[str, str]:
    """The metadata such a file carries: our format, the `family` and the settings of `config` its shapes cannot tell
    (all but `shape_keys`)."""
    extras = {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()
              if not k.startswith("_") and k not in shape_keys}
    return {"format": "pt", FORMAT_KEY: FORMAT_VERSION, "model_family": family,
            LAYOUT_CONFIG_KEY: json.dumps(extras, sort_keys=True)}


def write_tensors(out: Path, state: dict[str, torch.Tensor], dtype: torch.dtype, metadata: dict[str, str]) -> Path:
    """`state` as one safetensors file at `out`, floating-point tensors in `dtype`: written under a temporary name,
    synced, then renamed into place, so an interrupted export never leaves half a file under the real name."""
    from safetensors.torch import save_file

    tensors = {k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu()).contiguous()
               for k, v in state.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


def written_by_sdtrain(path: str | Path) -> bool:
    """Whether `path` is a safetensors file ``sdtrain export --single-file`` wrote."""
    try:
        file = _read_safetensors(Path(path))
    except UserError:
        return False
    return file.metadata.get(FORMAT_KEY) in _FORMAT_VERSIONS
