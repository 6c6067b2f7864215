"""Stable Diffusion checkpoints as ONE file, in the original (CompVis/LDM, A1111/ComfyUI) layout.

Reading: the diffusers configs of the UNet, VAE and text encoder are inferred from the file's tensor
shapes and key names (plus the settings weights cannot tell, from the file's safetensors metadata when
it has them), written into a local cache folder, and the weights are converted by diffusers' own
single-file loaders with ``config=`` that folder and ``local_files_only=True``: nothing is downloaded.

Writing: our own diffusers -> original key mapping (any number of levels, any layers_per_block), with
the settings the loader needs in the metadata, so a file written here loads back exactly.

Original layout, by component:

- UNet: ``model.diffusion_model.*``
- VAE: ``first_stage_model.*`` (a VAE-only file, as A1111 keeps them, has the same keys without prefix)
- text encoder: ``cond_stage_model.transformer.text_model.*`` (CLIP, SD 1.x) or ``cond_stage_model.model.*``
  (OpenCLIP, SD 2.x: fused ``in_proj`` attention, ``transformer.resblocks.N``)

Metadata keys written (all strings, as safetensors requires):

- ``prediction_type``: ``epsilon`` / ``v_prediction`` / ``sample``. Without it (nor a ModelSpec
  ``modelspec.prediction_type``), an OpenCLIP (SD 2.x) file is read as ``v_prediction`` and any other as
  ``epsilon``, as diffusers assumes.
- ``scheduler_config``: JSON of the training noise scheduler (beta schedule, betas, timesteps...).
- ``unet_config``, ``vae_config``, ``text_encoder_config``: JSON of each component's settings that its
  weights cannot tell (attention heads, norm groups, the VAE's ``scaling_factor``, activation, token ids...).
  Sizes (channels, levels, layers, vocabulary...) are always read from the tensors, never from these.
- ``text_encoder_layout``: ``clip`` or ``openclip``, informative (the keys say it too).
- ``sdtrain_format``: ``1``; marks a file ``sdtrain export --single-file`` wrote (and may replace).

Text encoder layout when writing (`choose_text_layout`): OpenCLIP when the text encoder was loaded from an
SD 2.x-layout single file or is 1024 wide (SD 2.x's ViT-H), else CLIP. diffusers drops an OpenCLIP tower's
block 23 when reading (SD 2.x conditions on the penultimate of 24 layers), so the OpenCLIP layout holds at
most 23 layers: a 24-block file reads as 23 layers, and we write exactly the encoder's own layers (neither
SD 2's unused 24th block nor its unused ``text_projection``).

A single file holds no tokenizer: ``sdtrain export --single-file`` writes it beside OUT.safetensors as
OUT.tokenizer/, which the loader finds; otherwise ``model.tokenizer`` must name one. The inferred configs
are cached in ``<sdtrain cache dir>/single_file/<fingerprint of keys, shapes and metadata>`` (the cache dir
is ``SDTRAIN_CACHE_DIR``, else ``~/.cache/sdtrain``).

Pickle checkpoints (``.ckpt``, ``.pt``, ``.pth``, ``.bin``) can run code when unpickled: they are refused
unless trusted (``trust_pickle=True``, or ``SDTRAIN_TRUST_PICKLE=1``), and even then read with
``torch.load(weights_only=True)``, which refuses anything but tensors and plain containers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sdtrain.errors import UserError

log = logging.getLogger(__name__)

SAFE_SUFFIXES = (".safetensors",)
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
SUFFIXES = SAFE_SUFFIXES + PICKLE_SUFFIXES
TRUST_PICKLE_ENV = "SDTRAIN_TRUST_PICKLE"
FORMAT_KEY, FORMAT_VERSION = "sdtrain_format", "1"
TEXT_LAYOUTS = ("clip", "openclip")

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
CLIP_PREFIX = "cond_stage_model.transformer.text_model."
OPENCLIP_PREFIX = "cond_stage_model.model."
_VAE_PREFIXES = (VAE_PREFIX, "vae.", "")
_COMPONENT_LABELS = {"unet": "UNet (model.diffusion_model.*)", "vae": "VAE (first_stage_model.*)",
                     "text_encoder": "text encoder (cond_stage_model.*)"}
# Bumped when the inference below changes, so a cached config folder is never reused across versions.
_CONFIG_VERSION = "1"
# diffusers' converter drops block 23 of an OpenCLIP text tower: SD 2.x conditions on the penultimate
# of its 24 layers (diffusers' SD_2_TEXT_ENCODER_KEYS_TO_IGNORE). Files with more blocks would load with a hole.
_OPENCLIP_DROPPED_BLOCK = 23

# Settings read from the tensors; everything else in a config is metadata (or an SD default).
UNET_SHAPE_KEYS = frozenset({
    "in_channels", "out_channels", "block_out_channels", "layers_per_block", "down_block_types",
    "up_block_types", "mid_block_type", "cross_attention_dim", "use_linear_projection",
    "transformer_layers_per_block", "time_embedding_dim", "conv_in_kernel", "conv_out_kernel",
})
VAE_SHAPE_KEYS = frozenset({
    "in_channels", "out_channels", "latent_channels", "block_out_channels", "layers_per_block",
    "down_block_types", "up_block_types", "mid_block_add_attention", "use_quant_conv", "use_post_quant_conv",
})
TEXT_SHAPE_KEYS = frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                             "max_position_embeddings"})
TEXT_EXTRA_KEYS = ("hidden_act", "num_attention_heads", "layer_norm_eps", "bos_token_id", "eos_token_id",
                   "pad_token_id", "projection_dim", "attention_dropout", "initializer_range", "initializer_factor")

# Stable Diffusion's training schedule, for files that do not say theirs.
SD_SCHEDULER = dict(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                    clip_sample=False, steps_offset=1)
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")


class _Unrecognized(Exception):
    """A key the layout needs is missing, or the structure is not one the converters handle."""


# --------------------------------------------------------------------------------------------------- files


def is_single_file(path: str | Path) -> bool:
    """Whether `path` is an existing file with a single-file checkpoint suffix."""
    path = Path(path)
    return path.suffix.lower() in SUFFIXES and path.is_file()


def looks_like_single_file(path: str | Path) -> bool:
    """Whether `path` is named like a single-file checkpoint (it may not exist)."""
    return Path(path).suffix.lower() in SUFFIXES and not Path(path).is_dir()


def trust_pickle_from_env() -> bool:
    """The only switch for now: ``SDTRAIN_TRUST_PICKLE=1``."""
    return os.environ.get(TRUST_PICKLE_ENV, "").strip() == "1"


def tokenizer_folder(path: str | Path) -> Path:
    """Where ``sdtrain export --single-file`` puts the tokenizer of OUT.safetensors: OUT.tokenizer/."""
    return Path(path).with_suffix(".tokenizer")


def tokenizer_for(path: str | Path) -> str:
    """The tokenizer folder beside a single file; a UserError says how to name one otherwise."""
    folder = tokenizer_folder(path)
    if folder.is_dir():
        return str(folder)
    raise UserError(
        f"{path}: a single-file checkpoint holds no tokenizer; set model.tokenizer to a CLIP tokenizer folder "
        f"(e.g. the tokenizer/ of a diffusers pipeline), or put one at {folder}"
    )


@dataclass
class _File:
    path: Path
    shapes: dict[str, tuple[int, ...]]
    metadata: dict[str, str]
    fingerprint: str
    state: dict[str, torch.Tensor] | None = None
    """The tensors of a pickle file (a safetensors file is read lazily)."""
    _info: SingleFileInfo | None = field(default=None, repr=False)

    def tensors(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        if self.state is not None:
            return {k: self.state[k] for k in keys}
        from safetensors import safe_open

        try:
            with safe_open(str(self.path), framework="pt", device="cpu") as f:
                return {k: f.get_tensor(k) for k in keys}
        except Exception as exc:  # the Rust error type has no stable import path
            raise UserError(f"{self.path}: cannot read its tensors ({_first_line(exc)}); the file may be damaged, "
                            "download or export it again") from exc


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # torch.load's weights_only refusal puts the reason on a later line.
    reason = next((line for line in lines if "WeightsUnpickler error" in line), None)
    return reason or (lines[0] if lines else type(exc).__name__)


def _fingerprint(shapes: dict[str, tuple[int, ...]], metadata: dict[str, str]) -> str:
    """What the inferred configs depend on: key names, shapes and metadata (not the weights' values)."""
    text = json.dumps([sorted((k, list(v)) for k, v in shapes.items()), sorted(metadata.items())])
    return hashlib.sha256(text.encode()).hexdigest()


def _read_safetensors(path: Path) -> _File:
    from safetensors import safe_open

    try:
        # Checks the header against the file size too, so a truncated download stops here.
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except Exception as exc:  # SafetensorError, or OSError when unreadable
        raise UserError(f"{path}: not a readable safetensors file ({_first_line(exc)}); the file may be truncated, "
                        "download or export it again") from exc
    return _File(path, shapes, metadata, _fingerprint(shapes, metadata))


def _read_pickle(path: Path, trust_pickle: bool | None) -> _File:
    trusted = trust_pickle_from_env() if trust_pickle is None else trust_pickle
    if not trusted:
        raise UserError(
            f"{path}: a pickle checkpoint ({path.suffix}) can run code when loaded; convert it to .safetensors, "
            f"or set {TRUST_PICKLE_ENV}=1 to read its tensors with torch.load(weights_only=True)"
        )
    import pickle

    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UserError(f"{path}: holds more than tensors, so it was not loaded ({_first_line(exc)}); convert it "
                        "to .safetensors with a tool you trust") from exc
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise UserError(f"{path}: not a readable torch checkpoint ({_first_line(exc)}); the file may be "
                        "truncated, download it again") from exc
    while isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, dict):
        raise UserError(f"{path}: holds a {type(loaded).__name__}, not a dictionary of tensors")
    state = {k: v for k, v in loaded.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    return _File(path, shapes, {}, _fingerprint(shapes, {}), state=state)


def _open(path: str | Path, trust_pickle: bool | None = None) -> _File:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file; fix the path")
    suffix = path.suffix.lower()
    if suffix in SAFE_SUFFIXES:
        return _read_safetensors(path)
    if suffix in PICKLE_SUFFIXES:
        return _read_pickle(path, trust_pickle)
    raise UserError(f"{path}: not a single-file checkpoint; use a {', '.join(SUFFIXES)} file")


# --------------------------------------------------------------------------------------------------- inference


@dataclass
class SingleFileInfo:
    """What a single file holds, as diffusers configs."""

    path: Path
    configs: dict[str, dict[str, Any]]
    """Component name ('unet', 'vae', 'text_encoder') -> its diffusers/transformers config."""
    prefixes: dict[str, str]
    """Component name -> the key prefix of its tensors in the file."""
    text_layout: str | None
    """'clip' (SD 1.x), 'openclip' (SD 2.x) or None without a text encoder."""
    prediction_type: str
    scheduler_config: dict[str, Any]
    """A DDPMScheduler config: the metadata's schedule, else Stable Diffusion's."""
    metadata: dict[str, str]
    fingerprint: str
    errors: dict[str, str] = field(default_factory=dict)
    """Components the file has keys of but in a structure the converters do not read: name -> why. Only
    loading that component fails (a VAE can still be read from a checkpoint whose UNet is not SD's)."""


def _indices(shapes: dict[str, Any], prefix: str) -> list[int]:
    """The sorted numbers N of keys `prefix`N.*; they must run 0, 1, 2... ."""
    found = sorted({int(m.group(1)) for k in shapes if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))})
    if found != list(range(len(found))):
        raise _Unrecognized(f"{prefix}N numbering has gaps: {found}")
    return found


def _need(shapes: dict[str, tuple[int, ...]], key: str) -> tuple[int, ...]:
    if key not in shapes:
        raise _Unrecognized(f"no {key}")
    return shapes[key]


def _unet_shape_config(s: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    conv_in = _need(s, "input_blocks.0.0.weight")

    def depth(prefix: str) -> int:
        return len(_indices(s, prefix + "transformer_blocks.")) if prefix + "proj_in.weight" in s else 0

    levels: list[list[tuple[int, int]]] = [[]]  # per level: (channels, transformer depth) of each layer
    inputs = _indices(s, "input_blocks.")
    for i in inputs[1:]:
        p = f"input_blocks.{i}."
        if p + "0.op.weight" in s:
            if not levels[-1]:
                raise _Unrecognized(f"{p}0.op: a downsample with no layers before it")
            levels.append([])
            continue
        levels[-1].append((_need(s, p + "0.out_layers.3.weight")[0], depth(p + "1.")))
    if not levels[-1]:
        raise _Unrecognized("the UNet ends on a downsample")
    per_level = {len(level) for level in levels}
    if len(per_level) != 1:
        raise _Unrecognized(f"levels have different numbers of layers ({sorted(per_level)})")
    layers = per_level.pop()
    channels, attention, depths = [], [], set()
    for level in levels:
        if len({c for c, _ in level}) != 1 or len({d > 0 for _, d in level}) != 1:
            raise _Unrecognized("a level mixes channel counts or attention")
        channels.append(level[0][0])
        attention.append(level[0][1] > 0)
        depths |= {d for _, d in level if d}
    n = len(levels)
    outputs = _indices(s, "output_blocks.")
    if len(outputs) != n * (layers + 1):
        raise _Unrecognized(f"{len(outputs)} output blocks for {n} levels of {layers} layers")
    up_attention = []
    for u in range(n):
        blocks = range(u * (layers + 1), (u + 1) * (layers + 1))
        found = [depth(f"output_blocks.{k}.1.") for k in blocks]
        if len({d > 0 for d in found}) != 1:
            raise _Unrecognized(f"up level {u} mixes attention")
        for k in blocks:
            if _need(s, f"output_blocks.{k}.0.out_layers.3.weight")[0] != channels[n - 1 - u]:
                raise _Unrecognized(f"output_blocks.{k}: channels do not mirror the down levels")
        last = blocks[-1]
        upsample = f"output_blocks.{last}.{2 if found[0] else 1}.conv.weight" in s
        if upsample != (u < n - 1):
            raise _Unrecognized(f"output_blocks.{last}: an upsample where none belongs, or none where one does")
        up_attention.append(found[0] > 0)
        depths |= {d for d in found if d}
    _need(s, "middle_block.0.in_layers.0.weight")
    _need(s, "middle_block.2.in_layers.0.weight")
    mid_depth = depth("middle_block.1.")
    if not mid_depth:
        raise _Unrecognized("the middle block has no cross-attention (only UNetMidBlock2DCrossAttn is supported)")
    depths.add(mid_depth)
    if len(depths) != 1:
        raise _Unrecognized(f"transformer depths differ between blocks ({sorted(depths)})")
    attn = "middle_block.1."
    time_embed = _need(s, "time_embed.0.weight")[0]
    return {
        "in_channels": conv_in[1],
        "out_channels": _need(s, "out.2.weight")[0],
        "block_out_channels": channels,
        "layers_per_block": layers,
        "down_block_types": ["CrossAttnDownBlock2D" if a else "DownBlock2D" for a in attention],
        "up_block_types": ["CrossAttnUpBlock2D" if a else "UpBlock2D" for a in up_attention],
        "mid_block_type": "UNetMidBlock2DCrossAttn",
        "cross_attention_dim": _need(s, attn + "transformer_blocks.0.attn2.to_k.weight")[1],
        "use_linear_projection": len(_need(s, attn + "proj_in.weight")) == 2,
        "transformer_layers_per_block": mid_depth,
        "time_embedding_dim": None if time_embed == 4 * channels[0] else time_embed,
        "conv_in_kernel": conv_in[-1],
        "conv_out_kernel": _need(s, "out.2.weight")[-1],
    }


def _vae_shape_config(s: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    downs = _indices(s, "encoder.down.")
    ups = _indices(s, "decoder.up.")
    if not downs or len(ups) != len(downs):
        raise _Unrecognized(f"{len(downs)} encoder levels but {len(ups)} decoder levels")
    encoder_layers = {len(_indices(s, f"encoder.down.{i}.block.")) for i in downs}
    decoder_layers = {len(_indices(s, f"decoder.up.{i}.block.")) for i in ups}
    # The decoder has one layer more per level than the encoder.
    if len(encoder_layers) != 1 or decoder_layers != {min(encoder_layers) + 1}:
        raise _Unrecognized("encoder and decoder levels have different numbers of layers")
    layers = encoder_layers.pop()
    n = len(downs)
    for i in downs:
        if (f"encoder.down.{i}.downsample.conv.weight" in s) != (i < n - 1):
            raise _Unrecognized(f"encoder.down.{i}: downsample where none belongs, or none where one does")
        if (f"decoder.up.{i}.upsample.conv.weight" in s) != (i > 0):
            raise _Unrecognized(f"decoder.up.{i}: upsample where none belongs, or none where one does")
    mid_attention = "encoder.mid.attn_1.q.weight" in s
    if mid_attention != ("decoder.mid.attn_1.q.weight" in s):
        raise _Unrecognized("mid-block attention in only one of encoder and decoder")
    return {
        "in_channels": _need(s, "encoder.conv_in.weight")[1],
        "out_channels": _need(s, "decoder.conv_out.weight")[0],
        "latent_channels": _need(s, "decoder.conv_in.weight")[1],
        "block_out_channels": [_need(s, f"encoder.down.{i}.block.0.conv2.weight")[0] for i in downs],
        "layers_per_block": layers,
        "down_block_types": ["DownEncoderBlock2D"] * n,
        "up_block_types": ["UpDecoderBlock2D"] * n,
        "mid_block_add_attention": mid_attention,
        "use_quant_conv": "quant_conv.weight" in s,
        "use_post_quant_conv": "post_quant_conv.weight" in s,
    }


def _clip_shape_config(s: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    vocab, hidden = _need(s, "embeddings.token_embedding.weight")
    layers = _indices(s, "encoder.layers.")
    if not layers:
        raise _Unrecognized("no encoder.layers")
    return {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": len(layers),
            "max_position_embeddings": _need(s, "embeddings.position_embedding.weight")[0],
            "intermediate_size": _need(s, "encoder.layers.0.mlp.fc1.weight")[0]}


def _openclip_shape_config(s: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    vocab, hidden = _need(s, "token_embedding.weight")
    blocks = len(_indices(s, "transformer.resblocks."))
    if not blocks:
        raise _Unrecognized("no transformer.resblocks")
    if blocks > _OPENCLIP_DROPPED_BLOCK + 1:
        raise _Unrecognized(f"an OpenCLIP text tower of {blocks} blocks: diffusers' converter drops block "
                            f"{_OPENCLIP_DROPPED_BLOCK} (SD 2.x's unused last layer) and reads at most 24")
    _need(s, "ln_final.weight")
    return {"vocab_size": vocab, "hidden_size": hidden,
            # Mirror diffusers: of SD 2.x's 24 blocks, the 24th (index 23) is dropped.
            "num_hidden_layers": blocks - 1 if blocks == _OPENCLIP_DROPPED_BLOCK + 1 else blocks,
            "max_position_embeddings": _need(s, "positional_embedding")[0],
            "intermediate_size": _need(s, "transformer.resblocks.0.mlp.c_fc.weight")[0]}


def _strip(shapes: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)}


def _metadata_json(file: _File | None, metadata: dict[str, str], key: str) -> dict[str, Any]:
    if key not in metadata:
        return {}
    try:
        value = json.loads(metadata[key])
    except json.JSONDecodeError as exc:
        raise UserError(f"{file.path if file else 'file'}: metadata {key} is not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise UserError(f"{file.path if file else 'file'}: metadata {key} is not a JSON object")
    return value


def _default_heads(hidden: int) -> int:
    return hidden // 64 if hidden % 64 == 0 else 1


def _infer(shapes: dict[str, tuple[int, ...]], metadata: dict[str, str], file: _File | None = None):
    """(configs, prefixes, text_layout, prediction_type, scheduler, errors); raises _Unrecognized when the file
    holds no component at all."""
    prefixes: dict[str, str] = {}
    errors: dict[str, str] = {}
    shape_configs: dict[str, dict[str, Any]] = {}
    text_layout = None
    if any(k.startswith(UNET_PREFIX) for k in shapes):
        prefixes["unet"] = UNET_PREFIX
    for prefix in _VAE_PREFIXES:
        if prefix + "encoder.conv_in.weight" in shapes and prefix + "decoder.conv_in.weight" in shapes:
            prefixes["vae"] = prefix
            break
    if OPENCLIP_PREFIX + "token_embedding.weight" in shapes:
        prefixes["text_encoder"], text_layout = OPENCLIP_PREFIX, "openclip"
    elif any(k.startswith(CLIP_PREFIX) for k in shapes):
        prefixes["text_encoder"], text_layout = CLIP_PREFIX, "clip"
    if not prefixes:
        raise _Unrecognized("none of model.diffusion_model.*, first_stage_model.*, cond_stage_model.* "
                            "(not a Stable Diffusion checkpoint in the original layout)")
    for name, prefix in prefixes.items():
        part = _strip(shapes, prefix) if prefix else shapes
        try:
            if name == "unet":
                shape_configs[name] = _unet_shape_config(part)
            elif name == "vae":
                shape_configs[name] = _vae_shape_config(part)
            elif text_layout == "openclip":
                shape_configs[name] = _openclip_shape_config(part)
            else:
                shape_configs[name] = _clip_shape_config(part)
        except _Unrecognized as exc:
            errors[name] = str(exc)

    # Stability's ModelSpec metadata (kohya, ComfyUI) says "v" or "epsilon" under its own key.
    modelspec = {"v": "v_prediction", "epsilon": "epsilon"}.get(metadata.get("modelspec.prediction_type", ""))
    prediction = (metadata.get("prediction_type") or modelspec
                  or ("v_prediction" if text_layout == "openclip" else "epsilon"))
    if prediction not in PREDICTION_TYPES:
        raise UserError(f"{file.path if file else 'file'}: metadata prediction_type '{prediction}' is not one of "
                        f"{', '.join(PREDICTION_TYPES)}")
    sd2 = text_layout == "openclip"
    configs: dict[str, dict[str, Any]] = {}
    if "unet" in shape_configs:
        shape = shape_configs["unet"]
        heads = ([max(c // 64, 1) for c in shape["block_out_channels"]] if shape["use_linear_projection"] else 8)
        configs["unet"] = {"sample_size": 96 if sd2 else 64, "attention_head_dim": heads,
                           **_metadata_json(file, metadata, "unet_config"), **shape}
    if "vae" in shape_configs:
        configs["vae"] = {"sample_size": 768 if sd2 else 512, "scaling_factor": 0.18215,
                          **_metadata_json(file, metadata, "vae_config"), **shape_configs["vae"]}
    if "text_encoder" in shape_configs:
        shape = shape_configs["text_encoder"]
        # SD's own text encoder configs: ids 0/2 (pooling at the highest token id), CLIP's quick_gelu, OpenCLIP's gelu.
        configs["text_encoder"] = {
            "hidden_act": "gelu" if sd2 else "quick_gelu", "num_attention_heads": _default_heads(shape["hidden_size"]),
            "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1, "projection_dim": shape["hidden_size"],
            **_metadata_json(file, metadata, "text_encoder_config"), **shape,
        }
    scheduler = {**SD_SCHEDULER, **_metadata_json(file, metadata, "scheduler_config"), "prediction_type": prediction}
    return configs, prefixes, text_layout, prediction, scheduler, errors


def _info(file: _File) -> SingleFileInfo:
    if file._info is None:
        try:
            configs, prefixes, layout, prediction, scheduler, errors = _infer(file.shapes, file.metadata, file)
        except _Unrecognized as exc:
            raise UserError(f"{file.path}: unrecognized checkpoint layout ({exc}); pass a Stable Diffusion 1.x/2.x "
                            "checkpoint in the original layout") from exc
        file._info = SingleFileInfo(file.path, configs, prefixes, layout, prediction, scheduler, file.metadata,
                                    hashlib.sha256(f"{_CONFIG_VERSION}:{file.fingerprint}".encode()).hexdigest()[:24],
                                    errors)
    return file._info


def inspect_single_file(path: str | Path, trust_pickle: bool | None = None) -> SingleFileInfo:
    """Read what a single file holds (its header only, for safetensors) as diffusers configs."""
    return _info(_open(path, trust_pickle))


def prediction_type(path: str | Path, trust_pickle: bool | None = None) -> str:
    return inspect_single_file(path, trust_pickle).prediction_type


def scheduler_config(path: str | Path, trust_pickle: bool | None = None) -> dict[str, Any]:
    """The DDPMScheduler config of a single file, prediction type included."""
    return dict(inspect_single_file(path, trust_pickle).scheduler_config)


def text_encoder_layout(path: str | Path, trust_pickle: bool | None = None) -> str | None:
    return inspect_single_file(path, trust_pickle).text_layout


# --------------------------------------------------------------------------------------------------- loading


def _cache_root() -> Path:
    from sdtrain.train.autotune import cache_dir

    return cache_dir() / "single_file"


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def config_folder(info: SingleFileInfo) -> Path:
    """A local diffusers folder with the configs of `info` (``unet/config.json``...), cached by the file's header."""
    import diffusers
    from transformers import CLIPTextConfig

    final = _cache_root() / info.fingerprint
    if (final / "model_index.json").is_file():
        return final
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    except OSError:
        # An unwritable cache (a read-only home on a cluster node): a private temporary folder does as well.
        import tempfile

        final = Path(tempfile.mkdtemp(prefix="sdtrain-single-file-")) / info.fingerprint
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        tmp.mkdir()
    index: dict[str, Any] = {"_class_name": "StableDiffusionPipeline", "_diffusers_version": diffusers.__version__}
    classes = {"unet": "UNet2DConditionModel", "vae": "AutoencoderKL"}
    for name, config in info.configs.items():
        if name == "text_encoder":
            try:
                text_config = CLIPTextConfig(**config)
            except (TypeError, ValueError) as exc:
                raise UserError(f"{info.path}: text encoder settings are invalid ({_first_line(exc)})") from exc
            text_config.architectures = ["CLIPTextModel"]
            (tmp / name).mkdir(parents=True, exist_ok=True)
            text_config.to_json_file(str(tmp / name / "config.json"))
            index[name] = ["transformers", "CLIPTextModel"]
        else:
            _write_json(tmp / name / "config.json",
                        {"_class_name": classes[name], "_diffusers_version": diffusers.__version__, **config})
            index[name] = ["diffusers", classes[name]]
    _write_json(tmp / "scheduler" / "scheduler_config.json",
                {"_class_name": "DDPMScheduler", "_diffusers_version": diffusers.__version__, **info.scheduler_config})
    index["scheduler"] = ["diffusers", "DDPMScheduler"]
    _write_json(tmp / "model_index.json", index)  # last: a folder with it is complete
    try:
        os.replace(tmp, final)
    except OSError:
        # Another process finished the same folder first.
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "model_index.json").is_file():
            raise
    return final


def _missing_parameters(module: torch.nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters() if p.is_meta]


def load_single_file_component(name: str, path: str | Path, trust_pickle: bool | None = None) -> Any:
    """Component `name` ('unet', 'vae', 'text_encoder') of a single file, in fp32, through diffusers'
    single-file loaders with a local config folder; never a download."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.loaders.single_file_utils import SingleFileComponentError, create_diffusers_clip_model_from_ldm
    from transformers import CLIPTextModel

    file = _open(path, trust_pickle)
    info = _info(file)
    if name in info.errors:
        raise UserError(f"{path}: unrecognized {name} layout ({info.errors[name]}); pass a Stable Diffusion "
                        "1.x/2.x checkpoint in the original layout")
    if name not in info.configs:
        raise UserError(f"{path}: holds no {_COMPONENT_LABELS[name]}; point model.{name} at a file or folder "
                        "that has one")
    prefix = info.prefixes[name]
    if name == "vae" and prefix == "":
        keys = [k for k in file.shapes if k.startswith(("encoder.", "decoder.", "quant_conv.", "post_quant_conv."))]
    elif name == "text_encoder":
        keys = [k for k in file.shapes if k.startswith("cond_stage_model.")]
    else:
        keys = [k for k in file.shapes if k.startswith(prefix)]
    # fp32 whatever the file stores (an fp16 file trains from fp32 master weights like any other source).
    tensors = {k: v.float() if v.is_floating_point() else v for k, v in file.tensors(keys).items()}
    folder = str(config_folder(info))
    common = dict(config=folder, subfolder=name, local_files_only=True)
    try:
        if name == "unet":
            module = UNet2DConditionModel.from_single_file(tensors, **common)
        elif name == "vae":
            module = AutoencoderKL.from_single_file(tensors, **common)
        else:
            module = create_diffusers_clip_model_from_ldm(CLIPTextModel, checkpoint=tensors, **common)
    except (ValueError, KeyError, RuntimeError, OSError, TypeError, SingleFileComponentError) as exc:
        raise UserError(f"{path}: cannot load the {name} ({_first_line(exc)})") from exc
    missing = _missing_parameters(module)
    if missing:
        raise UserError(f"{path}: the {name} lacks {len(missing)} weights (e.g. {missing[0]}); the file is "
                        "incomplete or in a layout diffusers does not read")
    _warn_unused(name, module, keys, info, path)
    return module


def _warn_unused(name: str, module: Any, keys: list[str], info: SingleFileInfo, path: str | Path) -> None:
    """Say so when the file has tensors of this component that no weight was loaded from."""
    shapes_only = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in module.state_dict().items()}
    try:
        expected = set(_to_original(name, shapes_only, _module_config(name, module), info.text_layout))
    except UserError:
        return
    prefix = info.prefixes[name]
    ignorable = re.compile(r"(position_ids|text_projection|logit_scale|transformer\.resblocks\.23\..*)$")
    unused = sorted(k for k in keys if not (k.startswith(prefix) and k[len(prefix):] in expected)
                    and not ignorable.search(k))
    if unused:
        log.warning("%s: %d tensors of the %s were not used (e.g. %s)", path, len(unused), name, unused[0])


def load_single_file_pipeline(path: str | Path, tokenizer: str | Path | None = None,
                              trust_pickle: bool | None = None) -> Any:
    """A StableDiffusionPipeline from a single file: its components as `load_single_file_component` reads
    them, the tokenizer from `tokenizer` (or the file's OUT.tokenizer/ sibling), an Euler sampler on its
    noise schedule."""
    from diffusers import DDPMScheduler

    from sdtrain.models.pipeline import assemble_pipeline, sampler_from
    from sdtrain.models.tokenizer import load_clip_tokenizer

    modules = {name: load_single_file_component(name, path, trust_pickle) for name in ("vae", "text_encoder", "unet")}
    noise = DDPMScheduler.from_config(scheduler_config(path, trust_pickle))
    tok = load_clip_tokenizer(Path(tokenizer or tokenizer_for(path)))
    return assemble_pipeline(modules["vae"], modules["text_encoder"], tok, modules["unet"],
                             sampler_from(noise, "euler"))


# --------------------------------------------------------------------------------------------------- writing

_UNET_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
                "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
_VAE_RESNET = {"conv_shortcut": "nin_shortcut"}
_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_OPENCLIP_LAYER = {"self_attn.out_proj": "attn.out_proj", "layer_norm1": "ln_1", "layer_norm2": "ln_2",
                   "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}


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


def _map_by_blocks(name: str, state: dict[str, torch.Tensor], blocks: dict[str, tuple[str, dict[str, str]]]):
    out, unmapped = {}, []
    for key, tensor in state.items():
        parts = key.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:cut])
            if prefix in blocks:
                target, table = blocks[prefix]
                out[target + "." + _rename(".".join(parts[cut:]), table)] = tensor
                break
        else:
            unmapped.append(key)
    if unmapped:
        raise UserError(f"{name}: {len(unmapped)} weights have no place in the original layout (e.g. {unmapped[0]}); "
                        "this architecture cannot be written as a single file")
    return out


def _vae_to_original(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = _map_by_blocks("vae", state, _vae_blocks(config))
    for key, tensor in out.items():
        # The original attention projections are 1x1 convolutions; diffusers' are linear layers.
        attention = ".mid.attn_1." in key and key.endswith(("q.weight", "k.weight", "v.weight", "proj_out.weight"))
        if attention and tensor.ndim == 2:
            out[key] = tensor[:, :, None, None]
    return out


def _text_to_original(state: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
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
    if unmapped:
        raise UserError(f"text_encoder: {len(unmapped)} weights have no place in the OpenCLIP layout "
                        f"(e.g. {unmapped[0]}); write it in the CLIP layout")
    return out


def _module_config(name: str, module: Any) -> dict[str, Any]:
    if name == "text_encoder":
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


def _config_differences(expected: dict[str, Any], inferred: dict[str, Any]) -> list[str]:
    differ = []
    for key, value in expected.items():
        got = inferred.get(key)
        a, b = _normalize(value), _normalize(got)
        if key in ("transformer_layers_per_block", "layers_per_block") and isinstance(a, list) and len(set(a)) == 1:
            a = a[0]
        if key == "time_embedding_dim" and a == 4 * expected["block_out_channels"][0]:
            a = None  # the default, spelled out
        if a != b:
            differ.append(f"{key}={value!r} reads back as {got!r}")
    return differ


def to_original_state_dict(unet: Any = None, vae: Any = None, text_encoder: Any = None,
                           text_layout: str = "clip") -> dict[str, torch.Tensor]:
    """The components' weights in the original single-file layout (keys with their component prefix).

    A VAE alone is written with bare keys (``encoder.*``, ``decoder.*``), as standalone VAE files are.
    """
    if text_encoder is not None and text_layout not in TEXT_LAYOUTS:
        raise UserError(f"text layout '{text_layout}' is not one of {', '.join(TEXT_LAYOUTS)}")
    out: dict[str, torch.Tensor] = {}
    vae_only = unet is None and text_encoder is None
    for name, module, prefix in (("unet", unet, UNET_PREFIX), ("vae", vae, "" if vae_only else VAE_PREFIX),
                                 ("text_encoder", text_encoder,
                                  OPENCLIP_PREFIX if text_layout == "openclip" else CLIP_PREFIX)):
        if module is None:
            continue
        mapped = _to_original(name, module.state_dict(), _module_config(name, module), text_layout)
        out.update({prefix + k: v for k, v in mapped.items()})
    return out


def single_file_metadata(unet: Any = None, vae: Any = None, text_encoder: Any = None, scheduler: Any = None,
                         text_layout: str | None = None) -> dict[str, str]:
    """The metadata a written file carries: what its weights cannot tell (see the module docstring)."""
    metadata = {"format": "pt", FORMAT_KEY: FORMAT_VERSION}
    if scheduler is not None:
        config = dict(scheduler.config)
        # Settings left at their defaults stay unsaid, as in a diffusers folder: a sampler made from the schedule
        # (from_config of another class) then takes its own defaults for them, the same either way.
        defaults = set(config.get("_use_default_values", []))
        settings = {k: v for k, v in config.items() if not k.startswith("_") and k not in defaults}
        metadata["prediction_type"] = str(settings.pop("prediction_type", "epsilon"))
        metadata["scheduler_config"] = json.dumps(settings, sort_keys=True)
    for name, module, shape_keys in (("unet", unet, UNET_SHAPE_KEYS), ("vae", vae, VAE_SHAPE_KEYS),
                                     ("text_encoder", text_encoder, TEXT_SHAPE_KEYS)):
        if module is not None:
            extras = {k: v for k, v in _module_config(name, module).items() if k not in shape_keys}
            metadata[f"{name}_config"] = json.dumps(extras, sort_keys=True)
    if text_encoder is not None and text_layout:
        metadata["text_encoder_layout"] = text_layout
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
    if OPENCLIP_PREFIX + "token_embedding.weight" in state:
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
        wanted = {k for k in module.state_dict() if not k.endswith("position_ids")}
        converted = _diffusers_converted_keys(name, meta, module)
        if converted != wanted:
            odd = sorted(converted ^ wanted)
            raise UserError(f"{out}: diffusers would not read the {name} back ({len(odd)} weights differ, e.g. "
                            f"{odd[0]}); this architecture cannot be written as a single file")


def save_single_file(out: str | Path, *, unet: Any = None, vae: Any = None, text_encoder: Any = None,
                     scheduler: Any = None, text_layout: str = "auto", text_source: str | Path | None = None,
                     half: bool = False, metadata: dict[str, str] | None = None) -> Path:
    """Write the given components as ONE safetensors file in the original SD layout, atomically.

    `scheduler` (the training noise scheduler) gives ``prediction_type`` and ``scheduler_config``; without it
    the file says neither and readers assume SD's (v_prediction for an OpenCLIP file, else epsilon).
    `text_layout` is 'auto' (see `choose_text_layout`, `text_source` being where the text encoder came
    from), 'clip' or 'openclip'. fp32 unless `half`. Returns `out`.
    """
    from safetensors.torch import save_file

    out = Path(out)
    components = {n: m for n, m in (("unet", unet), ("vae", vae), ("text_encoder", text_encoder)) if m is not None}
    if not components:
        raise UserError(f"{out}: nothing to write (no UNet, VAE or text encoder)")
    layout = choose_text_layout(text_encoder, text_source, text_layout) if text_encoder is not None else None
    state = to_original_state_dict(unet, vae, text_encoder, layout or "clip")
    info = single_file_metadata(unet, vae, text_encoder, scheduler, layout)
    info.update(metadata or {})
    _check_reads_back(components, state, info, out)
    dtype = torch.float16 if half else torch.float32
    tensors = {k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu()).contiguous()
               for k, v in state.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=info)
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
    return file.metadata.get(FORMAT_KEY) == FORMAT_VERSION
