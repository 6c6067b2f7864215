"""Reading a single-file checkpoint: opening it (safetensors, or trusted pickle), inferring the diffusers
configs of its components from tensor shapes and metadata, and the cached config folder diffusers'
loaders read them from. See the package docstring for the layout and metadata."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sdtrain.errors import UserError
from sdtrain.paths import cache_dir

SAFE_SUFFIXES = (".safetensors",)
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
SUFFIXES = SAFE_SUFFIXES + PICKLE_SUFFIXES
TRUST_PICKLE_ENV = "SDTRAIN_TRUST_PICKLE"
FORMAT_KEY, FORMAT_VERSION = "sdtrain_format", "2"
# Every format sdtrain has written: "1" had no OpenCLIP text_projection and one block fewer (see the package
# docstring); the inference below tells them apart by their keys alone.
_FORMAT_VERSIONS = ("1", FORMAT_VERSION)
TEXT_LAYOUTS = ("clip", "openclip")

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
CLIP_PREFIX = "cond_stage_model.transformer.text_model."
OPENCLIP_PREFIX = "cond_stage_model.model."
# SDXL (Stability's SGM layout): CLIP ViT-L in the transformers key layout, then OpenCLIP bigG.
SDXL_CLIP_PREFIX = "conditioner.embedders.0.transformer.text_model."
SDXL_OPENCLIP_PREFIX = "conditioner.embedders.1.model."
_VAE_PREFIXES = (VAE_PREFIX, "vae.", "")
FLUX_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
"""Where a Flux.1 transformer's keys in BFL's layout may stand in a file: ComfyUI's whole checkpoints, and bare."""
FAMILIES = ("sd", "sdxl")
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")
# Bumped when the inference below changes, so a cached config folder is never reused across versions.
_CONFIG_VERSION = "3"
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
# SDXL base's: the same betas, sampled with "leading" spacing (its EulerDiscreteScheduler config), which a sampler
# made from_config would otherwise replace with its own default.
SDXL_SCHEDULER = {**SD_SCHEDULER, "timestep_spacing": "leading"}
# SDXL's UNet settings its weights cannot tell, for files without our metadata (stable-diffusion-xl-base-1.0's).
_SDXL_TIME_EMBED_DIM, _SDXL_POOLED_DIM = 256, 1280
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


def tokenizer_folder(path: str | Path, index: int = 1) -> Path:
    """Where ``sdtrain export --single-file`` puts the tokenizers of OUT.safetensors: OUT.tokenizer/ for the first
    text encoder, OUT.tokenizer_2/ for SDXL's and SD3's second (`index` 2), OUT.tokenizer_3/ for SD3's T5, named as
    a diffusers pipeline's folders."""
    if index not in (1, 2, 3):
        raise ValueError(f"tokenizer index {index} is not 1, 2 or 3")
    return Path(path).with_suffix(".tokenizer" if index == 1 else f".tokenizer_{index}")


def tokenizer_for(path: str | Path, index: int = 1) -> str:
    """The tokenizer folder beside a single file; a UserError says how to name one otherwise."""
    folder = tokenizer_folder(path, index)
    if folder.is_dir():
        return str(folder)
    setting, pipeline_folder = ("model.tokenizer", "tokenizer/") if index == 1 else \
        (f"model.tokenizer_{index}", f"tokenizer_{index}/")
    raise UserError(
        f"{path}: a single-file checkpoint holds no tokenizer; set {setting} to a tokenizer folder "
        f"(e.g. the {pipeline_folder} of a diffusers pipeline), or put one at {folder}"
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

    def floats(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors `keys`, floating ones in fp32 (a file in fp16, bf16 or fp8 trains from fp32 master weights
        like any other source), read one at a time so a half-precision file is never in memory twice over."""
        state = {}
        for key in keys:
            tensor = self.tensors([key])[key]
            state[key] = tensor.float() if tensor.is_floating_point() else tensor
        return state

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


def open_file(path: str | Path, trust_pickle: bool | None = None) -> _File:
    """A single file's tensor names and shapes (`shapes`), its safetensors metadata and its tensors on demand
    (`floats`, read one at a time): what a family's own layout reads a file through. A pickle is read whole, and
    only when trusted; an unreadable file is one line."""
    return _open(path, trust_pickle)


def tensor_names(path: str | Path, trust_pickle: bool | None = None) -> list[str]:
    """The keys of a single file's tensors, from its header (a pickle file, once trusted, is read whole)."""
    return list(_open(path, trust_pickle).shapes)


# --------------------------------------------------------------------------------------------------- inference


@dataclass
class SingleFileInfo:
    """What a single file holds, as diffusers configs."""

    path: Path
    configs: dict[str, dict[str, Any]]
    """Component name ('unet', 'vae', 'text_encoder', SDXL's 'text_encoder_2') -> its diffusers/transformers
    config."""
    prefixes: dict[str, str]
    """Component name -> the key prefix of its tensors in the file."""
    text_layout: str | None
    """The first text encoder's: 'clip' (SD 1.x, SDXL), 'openclip' (SD 2.x) or None without one. SDXL's second
    text encoder is always OpenCLIP."""
    prediction_type: str
    scheduler_config: dict[str, Any]
    """A DDPMScheduler config: the metadata's schedule, else Stable Diffusion's."""
    metadata: dict[str, str]
    fingerprint: str
    errors: dict[str, str] = field(default_factory=dict)
    """Components the file has keys of but in a structure the converters do not read: name -> why. Only
    loading that component fails (a VAE can still be read from a checkpoint whose UNet is not SD's)."""
    family: str = "sd"
    """'sdxl' (Stable Diffusion XL base: SGM layout, two text encoders) or 'sd' (1.x/2.x)."""


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


def _unet_shape_config(s: dict[str, tuple[int, ...]], family: str = "sd") -> dict[str, Any]:
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
    channels, down_depths = [], []
    for level in levels:
        if len({c for c, _ in level}) != 1 or len({d for _, d in level}) != 1:
            raise _Unrecognized("a level mixes channel counts or transformer depths")
        channels.append(level[0][0])
        down_depths.append(level[0][1])
    attention = [d > 0 for d in down_depths]
    n = len(levels)
    outputs = _indices(s, "output_blocks.")
    if len(outputs) != n * (layers + 1):
        raise _Unrecognized(f"{len(outputs)} output blocks for {n} levels of {layers} layers")
    up_attention = []
    for u in range(n):
        blocks = range(u * (layers + 1), (u + 1) * (layers + 1))
        found = [depth(f"output_blocks.{k}.1.") for k in blocks]
        # diffusers' up levels take the down levels' depths in reverse (reverse_transformer_layers_per_block unset).
        if set(found) != {down_depths[n - 1 - u]}:
            raise _Unrecognized(f"up level {u}: transformer depths {found} do not mirror down level {n - 1 - u}'s")
        for k in blocks:
            if _need(s, f"output_blocks.{k}.0.out_layers.3.weight")[0] != channels[n - 1 - u]:
                raise _Unrecognized(f"output_blocks.{k}: channels do not mirror the down levels")
        last = blocks[-1]
        upsample = f"output_blocks.{last}.{2 if found[0] else 1}.conv.weight" in s
        if upsample != (u < n - 1):
            raise _Unrecognized(f"output_blocks.{last}: an upsample where none belongs, or none where one does")
        up_attention.append(found[0] > 0)
    _need(s, "middle_block.0.in_layers.0.weight")
    _need(s, "middle_block.2.in_layers.0.weight")
    mid_depth = depth("middle_block.1.")
    if not mid_depth:
        raise _Unrecognized("the middle block has no cross-attention (only UNetMidBlock2DCrossAttn is supported)")
    # diffusers' middle block takes the last level's depth: they can differ only when that level has no attention.
    if attention[-1] and down_depths[-1] != mid_depth:
        raise _Unrecognized(f"the middle block's transformer depth {mid_depth} differs from the last level's "
                            f"{down_depths[-1]}")
    # A level without attention ignores its entry; 1 there, as SDXL's own config has it.
    per_block = [d or 1 for d in down_depths[:-1]] + [mid_depth]
    uniform = {d for d in down_depths if d} | {mid_depth} == {mid_depth}
    attn = "middle_block.1."
    time_embed = _need(s, "time_embed.0.weight")[0]
    extra: dict[str, Any] = {}
    if family == "sdxl":
        # The added (pooled text + size) embedding's projection; its time-embedding width is not in the weights.
        extra = {"addition_embed_type": "text_time",
                 "projection_class_embeddings_input_dim": _need(s, "label_emb.0.0.weight")[1]}
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
        # SD's own configs say one depth, SDXL's one per level.
        "transformer_layers_per_block": mid_depth if uniform and family == "sd" else per_block,
        "time_embedding_dim": None if time_embed == 4 * channels[0] else time_embed,
        "conv_in_kernel": conv_in[-1],
        "conv_out_kernel": _need(s, "out.2.weight")[-1],
        **extra,
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
    complete = "text_projection" in s
    # diffusers splits the fused in_proj at text_projection's first dimension: it must be the width.
    if complete and s["text_projection"][0] != hidden:
        raise _Unrecognized(f"text_projection is {list(s['text_projection'])}, not [{hidden}, ...] (the width first)")
    # A complete tower (Stability's files, ours since format 2) ends on the block SD 2.x does not condition on.
    # Format 1 files stop before it, every block a layer; 24 blocks are SD 2.x's own tower either way (diffusers
    # drops block 23 whether or not text_projection is there).
    layers = blocks - 1 if complete or blocks == _OPENCLIP_DROPPED_BLOCK + 1 else blocks
    if not layers:
        raise _Unrecognized("the only transformer.resblocks is the tower's unused last block")
    return {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
            "max_position_embeddings": _need(s, "positional_embedding")[0],
            "intermediate_size": _need(s, "transformer.resblocks.0.mlp.c_fc.weight")[0]}


def _bigg_shape_config(s: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """SDXL's OpenCLIP tower: conditioned on whole (the penultimate layer's output, and the last one's pooled
    through ``text_projection``), so every block is a layer, and diffusers' converter drops none of them."""
    vocab, hidden = _need(s, "token_embedding.weight")
    blocks = len(_indices(s, "transformer.resblocks."))
    if not blocks:
        raise _Unrecognized("no transformer.resblocks")
    _need(s, "ln_final.weight")
    # OpenCLIP's x @ text_projection: [width, projection]; diffusers splits the fused in_proj at its first dimension.
    projection = _need(s, "text_projection")
    if len(projection) != 2 or projection[0] != hidden:
        raise _Unrecognized(f"text_projection is {list(projection)}, not [{hidden}, ...] (the width first)")
    return {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": blocks,
            "max_position_embeddings": _need(s, "positional_embedding")[0],
            "intermediate_size": _need(s, "transformer.resblocks.0.mlp.c_fc.weight")[0],
            "projection_dim": projection[1]}


def _past_layers(key: str, prefix: str, layers: int) -> bool:
    """Whether `key` is of an OpenCLIP block past the encoder's `layers`: the tower's unused last block. diffusers'
    converter drops only block 23 (SD 2.x's) and would convert any other as one more layer: it is never handed these."""
    m = re.match(re.escape(prefix) + r"transformer\.resblocks\.(\d+)\.", key)
    return m is not None and int(m.group(1)) >= layers


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


def family_of(shapes: Iterable[str], metadata: dict[str, str] | None = None) -> str:
    """'sdxl' or 'sd' for a file of these keys: SDXL's SGM text encoders (``conditioner.embedders.*``), or a UNet
    with SDXL's added embedding (``label_emb``) and no SD text encoder beside it; else the metadata's
    ``model_family`` (a VAE alone), else 'sd'."""
    keys = set(shapes)
    if any(k.startswith("conditioner.embedders.") for k in keys):
        return "sdxl"
    if not any(k.startswith("cond_stage_model.") for k in keys):
        if UNET_PREFIX + "label_emb.0.0.weight" in keys:
            return "sdxl"
        if (metadata or {}).get("model_family") in FAMILIES:
            return (metadata or {})["model_family"]
    return "sd"


def _time_embed_dim(projection_input: int, pooled: int) -> int:
    """SDXL's added embedding takes the pooled text embedding and 6 sinusoidal embeddings of the sizes and crop:
    the time width is what remains of the projection's input, when that divides evenly."""
    rest = projection_input - pooled
    return rest // 6 if rest > 0 and rest % 6 == 0 else _SDXL_TIME_EMBED_DIM


def _infer(shapes: dict[str, tuple[int, ...]], metadata: dict[str, str], file: _File | None = None):
    """(configs, prefixes, text_layout, prediction_type, scheduler, errors); raises _Unrecognized when the file
    holds no component at all."""
    prefixes: dict[str, str] = {}
    errors: dict[str, str] = {}
    shape_configs: dict[str, dict[str, Any]] = {}
    text_layout = None
    family = family_of(shapes, metadata)
    if any(k.startswith(UNET_PREFIX) for k in shapes):
        prefixes["unet"] = UNET_PREFIX
    for prefix in _VAE_PREFIXES:
        if prefix + "encoder.conv_in.weight" in shapes and prefix + "decoder.conv_in.weight" in shapes:
            prefixes["vae"] = prefix
            break
    if family == "sdxl":
        if any(k.startswith(SDXL_CLIP_PREFIX) for k in shapes):
            prefixes["text_encoder"], text_layout = SDXL_CLIP_PREFIX, "clip"
        if any(k.startswith(SDXL_OPENCLIP_PREFIX) for k in shapes):
            prefixes["text_encoder_2"] = SDXL_OPENCLIP_PREFIX
    elif OPENCLIP_PREFIX + "token_embedding.weight" in shapes:
        prefixes["text_encoder"], text_layout = OPENCLIP_PREFIX, "openclip"
    elif any(k.startswith(CLIP_PREFIX) for k in shapes):
        prefixes["text_encoder"], text_layout = CLIP_PREFIX, "clip"
    if not prefixes:
        raise _Unrecognized("none of model.diffusion_model.*, first_stage_model.*, cond_stage_model.*, "
                            "conditioner.embedders.* (not a Stable Diffusion checkpoint in the original layout)")
    for name, prefix in prefixes.items():
        part = _strip(shapes, prefix) if prefix else shapes
        try:
            if name == "unet":
                shape_configs[name] = _unet_shape_config(part, family)
            elif name == "vae":
                shape_configs[name] = _vae_shape_config(part)
            elif name == "text_encoder_2":
                shape_configs[name] = _bigg_shape_config(part)
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
    xl = family == "sdxl"
    configs: dict[str, dict[str, Any]] = {}
    if "unet" in shape_configs:
        shape = shape_configs["unet"]
        # SDXL's heads are 64 wide at every level, as SD 2.x's (linear projections); SD 1.x has 8 heads.
        linear = shape["use_linear_projection"] or xl
        heads = [max(c // 64, 1) for c in shape["block_out_channels"]] if linear else 8
        defaults: dict[str, Any] = {"sample_size": 128 if xl else 96 if sd2 else 64, "attention_head_dim": heads}
        if xl:
            pooled = shape_configs.get("text_encoder_2", {}).get("projection_dim", _SDXL_POOLED_DIM)
            defaults["addition_time_embed_dim"] = _time_embed_dim(shape["projection_class_embeddings_input_dim"],
                                                                  pooled)
        configs["unet"] = {**defaults, **_metadata_json(file, metadata, "unet_config"), **shape}
    if "vae" in shape_configs:
        configs["vae"] = {"sample_size": 1024 if xl else 768 if sd2 else 512,
                          "scaling_factor": 0.13025 if xl else 0.18215,
                          **_metadata_json(file, metadata, "vae_config"), **shape_configs["vae"]}
    for name in TEXT_ENCODERS:
        if name not in shape_configs:
            continue
        shape = shape_configs[name]
        # SD's own text encoder configs (SDXL's too): ids 0/2 (pooling at the highest token id), CLIP's quick_gelu,
        # OpenCLIP's gelu.
        openclip = sd2 or name == "text_encoder_2"
        configs[name] = {
            "hidden_act": "gelu" if openclip else "quick_gelu",
            "num_attention_heads": _default_heads(shape["hidden_size"]),
            "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1, "projection_dim": shape["hidden_size"],
            **_metadata_json(file, metadata, f"{name}_config"), **shape,
        }
    base = SDXL_SCHEDULER if xl else SD_SCHEDULER
    scheduler = {**base, **_metadata_json(file, metadata, "scheduler_config"), "prediction_type": prediction}
    return configs, prefixes, text_layout, prediction, scheduler, errors


def original_prefix(keys: Iterable[str]) -> str | None:
    """The prefix of a Flux.1 transformer's keys in BFL's layout ('' in BFL's own files, ComfyUI's
    ``model.diffusion_model.`` in a whole checkpoint), or None when the keys hold none."""
    keys = list(keys)
    for prefix in ("", *FLUX_PREFIXES):
        if any(k.startswith((f"{prefix}double_blocks.", f"{prefix}single_blocks.")) for k in keys):
            return prefix
    return None


def _info(file: _File) -> SingleFileInfo:
    if file._info is None:
        try:
            configs, prefixes, layout, prediction, scheduler, errors = _infer(file.shapes, file.metadata, file)
        except _Unrecognized as exc:
            if original_prefix(file.shapes) is not None:
                raise UserError(f"{file.path}: holds a Flux.1 transformer alone (BFL's layout), read only as "
                                "model.transformer (or model.pretrained, with model.vae, model.text_encoder, "
                                "model.text_encoder_2 and model.tokenizer naming the rest); for a whole model pass a "
                                "Flux pipeline folder") from exc
            raise UserError(f"{file.path}: unrecognized checkpoint layout ({exc}); pass a Stable Diffusion 1.x/2.x "
                            "or SDXL checkpoint in the original layout") from exc
        file._info = SingleFileInfo(file.path, configs, prefixes, layout, prediction, scheduler, file.metadata,
                                    hashlib.sha256(f"{_CONFIG_VERSION}:{file.fingerprint}".encode()).hexdigest()[:24],
                                    errors, family_of(file.shapes, file.metadata))
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


def model_family(path: str | Path, trust_pickle: bool | None = None) -> str:
    """'sdxl' or 'sd' (see `family_of`)."""
    return inspect_single_file(path, trust_pickle).family


# --------------------------------------------------------------------------------------------------- config folder


def _cache_root() -> Path:
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
    pipeline = "StableDiffusionXLPipeline" if info.family == "sdxl" else "StableDiffusionPipeline"
    index: dict[str, Any] = {"_class_name": pipeline, "_diffusers_version": diffusers.__version__}
    classes = {"unet": "UNet2DConditionModel", "vae": "AutoencoderKL", "text_encoder": "CLIPTextModel",
               "text_encoder_2": "CLIPTextModelWithProjection"}
    for name, config in info.configs.items():
        if name in TEXT_ENCODERS:
            try:
                text_config = CLIPTextConfig(**config)
            except (TypeError, ValueError) as exc:
                label = "text encoder" if name == "text_encoder" else "second text encoder"
                raise UserError(f"{info.path}: {label} settings are invalid ({_first_line(exc)})") from exc
            text_config.architectures = [classes[name]]
            (tmp / name).mkdir(parents=True, exist_ok=True)
            text_config.to_json_file(str(tmp / name / "config.json"))
            index[name] = ["transformers", classes[name]]
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
