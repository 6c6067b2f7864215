"""SD3 and SD3.5 checkpoints as ONE file, in Stability's original layout (sd3_medium.safetensors,
sd3_medium_incl_clips_t5xxlfp8.safetensors, sd3.5_*.safetensors; what ComfyUI's Load Checkpoint reads):

- the MMDiT under ``model.diffusion_model.`` (``x_embedder``, ``pos_embed``, ``t_embedder``, ``y_embedder``,
  ``context_embedder``, ``joint_blocks.N.{x_block,context_block}`` with fused ``attn.qkv``, ``final_layer``);
- the 16-channel VAE under ``first_stage_model.`` in the LDM layout, without quant convs;
- when included, the text encoders in transformers' own layout under ``text_encoders.clip_l.transformer.``,
  ``text_encoders.clip_g.transformer.`` and ``text_encoders.t5xxl.transformer.``.

Reading converts through diffusers' own single-file converters (`convert_sd3_transformer_checkpoint_to_diffusers`;
the VAE by `ldm_vae`, the converter Stable Diffusion's files share) into modules built on the meta device from
settings read off the tensor shapes: nothing is downloaded, and a 2B transformer or a 4.7B T5 is never allocated
twice. A file without some component (most have no T5; sd3_medium.safetensors has no text encoder at all) says which
setting names it instead.

Settings shapes cannot tell come from the file's metadata (``<component>_config``, JSON, as `save_original` writes
them), else SD3's: 64-wide attention heads (or the query norm's width, in SD3.5), a 128-latent sample size, the
VAE's scale 1.5305 and shift 0.0609, CLIP-L's quick_gelu and CLIP-G's gelu.

Writing (`save_original`, for ``sdtrain export --single-file`` of an SD3 run) is the inverse mapping of diffusers'
converter, with every component the pipeline has, so diffusers and ComfyUI read back what was trained. One weight
is ours alone: CLIP-L's ``text_projection``. SD3 pools CLIP-L unprojected; diffusers' SD3 folders hold an identity
there, and its single-file reader (like ComfyUI) puts the identity in place of whatever the file holds. sdtrain
writes and reads the trained one, and says so when it is not the identity.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdtrain.errors import UserError
from sdtrain.models import single_file
from sdtrain.models.families.ldm_vae import vae_config, vae_from_original, vae_to_original
from sdtrain.models.families.spec import SingleFileLayout
from sdtrain.models.single_file.read import (
    FORMAT_KEY,
    FORMAT_VERSION,
    OpenFile,
    Unrecognized,
    default_heads,
    error_line,
    strip,
)
from sdtrain.models.single_file.write import write_tensors

log = logging.getLogger(__name__)

FAMILY = "sd3"
PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
TEXT_PREFIXES = {"text_encoder": "text_encoders.clip_l.transformer.",
                 "text_encoder_2": "text_encoders.clip_g.transformer.",
                 "text_encoder_3": "text_encoders.t5xxl.transformer."}
COMPONENTS = ("transformer", "vae", *TEXT_PREFIXES)
_LABELS = {"transformer": "MMDiT (model.diffusion_model.*)", "vae": "VAE (first_stage_model.*)",
           "text_encoder": "CLIP-L (text_encoders.clip_l.*)", "text_encoder_2": "CLIP-G (text_encoders.clip_g.*)",
           "text_encoder_3": "T5 (text_encoders.t5xxl.*)"}
# SD3's settings that no tensor tells, for files without our metadata.
_HEAD_WIDTH = 64
_SAMPLE_SIZE = 128
_VAE = dict(scaling_factor=1.5305, shift_factor=0.0609, norm_num_groups=32, act_fn="silu", sample_size=1024)
_CLIP_ACT = {"text_encoder": "quick_gelu", "text_encoder_2": "gelu"}


def _metadata_config(file: OpenFile, name: str) -> dict[str, Any]:
    raw = file.metadata.get(f"{name}_config")
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise UserError(f"{file.path}: its metadata {name}_config is not JSON ({exc}); export the file again") from exc
    return value if isinstance(value, dict) else {}


def _count(shapes: Iterable[str], pattern: str) -> int:
    found = {int(m.group(1)) for key in shapes if (m := re.match(pattern, key))}
    if found != set(range(len(found))):
        raise Unrecognized(f"blocks {sorted(found)} are not numbered 0..{len(found) - 1}")
    return len(found)


# --------------------------------------------------------------------------------------------------- settings

def transformer_config(shapes: Mapping[str, tuple[int, ...]], metadata: Mapping[str, Any]) -> dict[str, Any]:
    """SD3Transformer2DModel settings of an MMDiT's tensors (keys without ``model.diffusion_model.``)."""
    s = shapes
    try:
        width, in_channels, patch, _ = s["x_embedder.proj.weight"]
        positions = s["pos_embed"][1]
        caption_width, joint_width = s["context_embedder.weight"]
        layers = _count(s, r"joint_blocks\.(\d+)\.")
        out_rows = s["final_layer.linear.weight"][0]
        norm = s.get("joint_blocks.0.x_block.attn.ln_q.weight")
        head = metadata.get("attention_head_dim") or (norm[0] if norm else _HEAD_WIDTH)
        config = {
            "sample_size": metadata.get("sample_size", _SAMPLE_SIZE), "patch_size": patch,
            "in_channels": in_channels, "out_channels": out_rows // (patch * patch), "num_layers": layers,
            "attention_head_dim": head, "num_attention_heads": width // head, "joint_attention_dim": joint_width,
            "caption_projection_dim": caption_width, "pooled_projection_dim": s["y_embedder.mlp.0.weight"][1],
            "pos_embed_max_size": math.isqrt(positions),
            "dual_attention_layers": tuple(i for i in range(layers)
                                           if f"joint_blocks.{i}.x_block.attn2.qkv.weight" in s),
            "qk_norm": "rms_norm" if norm else None,
        }
    except KeyError as exc:
        raise Unrecognized(f"no {exc.args[0]}") from exc
    if width % head or config["pos_embed_max_size"] ** 2 != positions:
        raise Unrecognized(f"width {width} in heads of {head}, {positions} positions")
    return config


def _clip_config(name: str, s: Mapping[str, tuple[int, ...]], metadata: Mapping[str, Any]) -> Any:
    from transformers import CLIPTextConfig

    try:
        vocab, width = s["text_model.embeddings.token_embedding.weight"]
        shape = {"vocab_size": vocab, "hidden_size": width,
                 "max_position_embeddings": s["text_model.embeddings.position_embedding.weight"][0],
                 "intermediate_size": s["text_model.encoder.layers.0.mlp.fc1.weight"][0],
                 "num_hidden_layers": _count(s, r"text_model\.encoder\.layers\.(\d+)\."),
                 "projection_dim": s["text_projection.weight"][0]}
    except KeyError as exc:
        raise Unrecognized(f"no {exc.args[0]}") from exc
    # Real CLIPs' eos id 2 makes transformers pool at the highest token id, which is CLIP's end token.
    defaults = {"hidden_act": _CLIP_ACT[name], "num_attention_heads": default_heads(width),
                "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1}
    return CLIPTextConfig(**{**defaults, **metadata, **shape})


def _t5_config(s: Mapping[str, tuple[int, ...]], metadata: Mapping[str, Any]) -> Any:
    from transformers import T5Config

    attention = "encoder.block.0.layer.0.SelfAttention."
    ff = "encoder.block.0.layer.1.DenseReluDense."
    try:
        vocab, width = s["shared.weight"]
        buckets, heads = s[attention + "relative_attention_bias.weight"]
        gated = ff + "wi_0.weight" in s
        shape = {"vocab_size": vocab, "d_model": width, "num_heads": heads, "relative_attention_num_buckets": buckets,
                 "d_kv": s[attention + "q.weight"][0] // heads, "num_layers": _count(s, r"encoder\.block\.(\d+)\."),
                 "d_ff": s[ff + ("wi_0.weight" if gated else "wi.weight")][0]}
    except KeyError as exc:
        raise Unrecognized(f"no {exc.args[0]}") from exc
    defaults = {"feed_forward_proj": "gated-gelu" if gated else "relu", "relative_attention_max_distance": 128,
                "layer_norm_epsilon": 1e-6, "dropout_rate": 0.0, "is_encoder_decoder": False, "use_cache": False}
    return T5Config(**{**defaults, **metadata, **shape})


# --------------------------------------------------------------------------------------------------- reading

def _on_meta(cls: Any, config: Any, state: dict[str, torch.Tensor], strict: bool = True) -> Any:
    with torch.device("meta"):
        module = cls(config) if hasattr(cls, "config_class") else cls(**config)
    module.load_state_dict(state, strict=strict, assign=True)
    return module


def load_component(file: OpenFile, name: str) -> Any:
    """Component `name` of the SD3 file, in fp32 (see the module's docstring)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    if name not in COMPONENTS:
        raise UserError(f"{file.path}: an SD3 file has no component '{name}'; SD3's are {', '.join(COMPONENTS)}")
    prefix = {"transformer": PREFIX, "vae": VAE_PREFIX, **TEXT_PREFIXES}[name]
    shapes = strip(file.shapes, prefix)
    if not shapes:
        raise UserError(f"{file.path}: this SD3 file holds no {_LABELS[name]}; set model.components.{name}.source "
                        "to a source that has one (an SD3 pipeline folder, or a file that includes it, such as "
                        "sd3_medium_incl_clips_t5xxlfp8.safetensors)")
    metadata = _metadata_config(file, name)
    keys = [prefix + key for key in shapes]
    try:
        if name == "transformer":
            config = transformer_config(shapes, metadata)
            state = convert_sd3_transformer_checkpoint_to_diffusers(file.floats(keys))
            module = _on_meta(SD3Transformer2DModel, config, state)
        elif name == "vae":
            config = {**_VAE, **metadata, **vae_config(shapes)}
            state = vae_from_original(file.floats(keys), config)
            module = _on_meta(AutoencoderKL, config, state)
        elif name == "text_encoder_3":
            state = strip(file.floats(keys), prefix)
            # The embedding is shared with the encoder's: a file may hold it under both names, or as shared alone.
            state.pop("encoder.embed_tokens.weight", None)
            module = _on_meta(T5EncoderModel, _t5_config(shapes, metadata), state, strict=False)
            module.encoder.embed_tokens.weight = module.shared.weight
        else:
            state = strip(file.floats(keys), prefix)
            state.pop("text_model.embeddings.position_ids", None)
            config = _clip_config(name, shapes, metadata)
            module = _on_meta(CLIPTextModelWithProjection, config, state)
            # Not in any state dict: the positions 0..n-1 transformers registers as a non-persistent buffer.
            module.text_model.embeddings.register_buffer(
                "position_ids", torch.arange(config.max_position_embeddings).expand((1, -1)), persistent=False)
    except Unrecognized as exc:
        raise UserError(f"{file.path}: unrecognized SD3 {name} layout ({exc}); pass SD3's original layout "
                        "(sd3_medium*.safetensors, sd3.5_*.safetensors) or an SD3 pipeline folder") from exc
    except (KeyError, RuntimeError, ValueError, TypeError) as exc:
        raise UserError(f"{file.path}: cannot load the SD3 {name} ({error_line(exc)}); the file is incomplete or "
                        "not SD3's layout") from exc
    missing = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if missing:
        raise UserError(f"{file.path}: the SD3 {name} lacks {len(missing)} weights (e.g. {missing[0]}); the file is "
                        "incomplete")
    return module.eval()


# --------------------------------------------------------------------------------------------------- writing

def _swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    # diffusers' AdaLayerNormContinuous holds (scale, shift) where the original holds (shift, scale).
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


_EMBEDDINGS = {"pos_embed.proj": "x_embedder.proj",
               "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
               "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
               "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
               "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
               "context_embedder": "context_embedder", "proj_out": "final_layer.linear"}
_BLOCK = {"attn.to_out.0": "x_block.attn.proj", "attn.to_add_out": "context_block.attn.proj",
          "attn2.to_out.0": "x_block.attn2.proj", "norm1.linear": "x_block.adaLN_modulation.1",
          "norm1_context.linear": "context_block.adaLN_modulation.1", "ff.net.0.proj": "x_block.mlp.fc1",
          "ff.net.2": "x_block.mlp.fc2", "ff_context.net.0.proj": "context_block.mlp.fc1",
          "ff_context.net.2": "context_block.mlp.fc2", "attn.norm_q": "x_block.attn.ln_q",
          "attn.norm_k": "x_block.attn.ln_k", "attn.norm_added_q": "context_block.attn.ln_q",
          "attn.norm_added_k": "context_block.attn.ln_k", "attn2.norm_q": "x_block.attn2.ln_q",
          "attn2.norm_k": "x_block.attn2.ln_k"}
# diffusers keeps apart the query, key and value projections the original stacks on the output rows of one qkv.
_FUSED = {**{f"attn.to_{p}": ("x_block.attn.qkv", i) for i, p in enumerate("qkv")},
          **{f"attn.add_{p}_proj": ("context_block.attn.qkv", i) for i, p in enumerate("qkv")},
          **{f"attn2.to_{p}": ("x_block.attn2.qkv", i) for i, p in enumerate("qkv")}}


def transformer_to_original(state: Mapping[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """An SD3Transformer2DModel's state dict in the original layout (keys without ``model.diffusion_model.``)."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, list[torch.Tensor | None]] = {}
    for key, tensor in state.items():
        module, _, kind = key.rpartition(".")
        block = re.match(r"transformer_blocks\.(\d+)\.(.+)$", module)
        if key == "pos_embed.pos_embed":
            out["pos_embed"] = tensor
        elif module == "norm_out.linear":
            out[f"final_layer.adaLN_modulation.1.{kind}"] = _swap_halves(tensor)
        elif module in _EMBEDDINGS:
            out[f"{_EMBEDDINGS[module]}.{kind}"] = tensor
        elif block and block.group(2) in _FUSED:
            target, index = _FUSED[block.group(2)]
            fused.setdefault(f"joint_blocks.{block.group(1)}.{target}.{kind}", [None] * 3)[index] = tensor
        elif block and block.group(2) in _BLOCK:
            rest = block.group(2)
            # The last block's context half only modulates its input (shift, scale): diffusers' swapped order.
            last = rest == "norm1_context.linear" and int(block.group(1)) == layers - 1
            out[f"joint_blocks.{block.group(1)}.{_BLOCK[rest]}.{kind}"] = _swap_halves(tensor) if last else tensor
        else:
            raise ValueError(f"no original name for {key}")
    for key, parts in fused.items():
        if any(part is None for part in parts):
            raise ValueError(f"{key}: not all of query, key and value")
        out[key] = torch.cat(parts, dim=0)
    return out


def _text_state(module: Any) -> dict[str, torch.Tensor]:
    state = {k: v for k, v in module.state_dict().items() if not k.endswith("position_ids")}
    if "encoder.embed_tokens.weight" in state:
        # T5's embedding is one tensor under two names; both are written (diffusers' reader loads each name, and
        # safetensors stores no aliases), so the second is a copy.
        state["encoder.embed_tokens.weight"] = state["encoder.embed_tokens.weight"].clone()
    return state


def _plain(config: Mapping[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items() if not k.startswith("_")}


def to_original(components: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of one file holding SD3 `components` (transformer, vae, text_encoder,
    text_encoder_2, text_encoder_3; each optional)."""
    state: dict[str, torch.Tensor] = {}
    metadata = {"format": "pt", FORMAT_KEY: FORMAT_VERSION, "model_family": FAMILY}
    for name, module in components.items():
        if module is None:
            continue
        if name == "transformer":
            config = dict(module.config)
            tensors = transformer_to_original(module.state_dict(), config["num_layers"])
        elif name == "vae":
            config = dict(module.config)
            tensors = vae_to_original(module.state_dict(), config)
        else:
            config = module.config.to_diff_dict() if hasattr(module.config, "to_diff_dict") else dict(module.config)
            tensors = _text_state(module)
        prefix = {"transformer": PREFIX, "vae": VAE_PREFIX, **TEXT_PREFIXES}[name]
        state.update({prefix + k: v for k, v in tensors.items()})
        metadata[f"{name}_config"] = json.dumps(_plain(config), sort_keys=True, default=str)
    return state, metadata


def _is_identity(weight: torch.Tensor) -> bool:
    return weight.shape[0] == weight.shape[1] and torch.equal(weight.detach().cpu(), torch.eye(weight.shape[0]))


def save_original(path: str | Path, components: Mapping[str, Any], half: bool = False) -> Path:
    """Write SD3 `components` as ONE safetensors file in Stability's layout, atomically (a temporary name, then
    os.replace); fp32, or fp16 with `half` (SD3's released dtype). The settings shapes cannot tell go in the
    metadata, and the file is checked to read back as the modules are before it is written."""
    out = Path(path)
    try:
        state, metadata = to_original(components)
    except (ValueError, KeyError) as exc:
        raise UserError(f"{out}: this model cannot be written in SD3's original layout ({exc})") from exc
    clip_l = components.get("text_encoder")
    projection = getattr(clip_l, "text_projection", None)
    if projection is not None and not _is_identity(projection.weight):
        log.warning("%s: CLIP-L's projection is not the identity SD3's has; diffusers and ComfyUI read an SD3 file's "
                    "CLIP-L without one (sdtrain reads it), so their pooled vector differs from the run's: for exact "
                    "results use the pipeline folder `sdtrain export RUN OUT` writes", out)
    transformer = components.get("transformer")
    if transformer is not None:
        shapes = {k[len(PREFIX):]: tuple(v.shape) for k, v in state.items() if k.startswith(PREFIX)}
        read = transformer_config(shapes, json.loads(metadata["transformer_config"]))
        mine = _plain(dict(transformer.config))
        differ = [f"{k}: {mine.get(k)} would read as {v}" for k, v in _plain(read).items() if mine.get(k) != v]
        if differ:
            raise UserError(f"{out}: the transformer would not read back as it is ({differ[0]})")
    return write_tensors(out, state, torch.float16 if half else torch.float32, metadata)


class StabilityCheckpoint(SingleFileLayout):
    """SD3's and SD3.5's release file (sd3_medium_incl_clips_t5xxlfp8.safetensors'): the MMDiT, the VAE and all
    three text encoders in Stability's layout."""

    def load(self, name: str, path: Path, *, trust_pickle: bool | None, frozen_precision: str, weights: bool,
             latent_constants: Callable[[], dict[str, float | None]]) -> nn.Module:
        module = load_component(single_file.open_file(path, trust_pickle), name)
        return module if weights else module.to("meta")

    def write(self, out: Path, components: dict[str, nn.Module], *, half: bool, scheduler: Any,
              text_layout: str, text_source: str | Path | None) -> None:
        save_original(out, components, half=half)
