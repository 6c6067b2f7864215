"""Z-Image (Tongyi-MAI, 2025): Flux.1's 16-channel autoencoder, Qwen3 (a causal language model) as its one text
encoder, and a single-stream rectified-flow transformer (ZImageTransformer2DModel: refiner blocks over the image
tokens and over the caption's, then joint blocks over both, 3-axis RoPE).

The conditioner follows diffusers' ZImagePipeline: each caption is the user turn of Qwen3's chat template, and the
transformer reads the second-to-last hidden layer's states at the caption's own tokens (the attention mask drops the
padding, so captions keep their lengths); encoded shards store the states with that mask. Latents stay unpacked:
the transformer patchifies 2x2 itself, takes one latent per image as a list, and ``t = 1 - sigma``. It predicts
``x0 - noise``, the negative of the velocity the flow objective trains (``noise - x0``), so the adapter negates it,
as the pipeline does before each sampler step.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL, ZImagePipeline, ZImageTransformer2DModel
from torch import nn
from transformers import Qwen3Config, Qwen3Model

from sdtrain.errors import UserError
from sdtrain.models.families import causal_lm, spec
from sdtrain.models.families.autoencoder import FLUX_CODEC, FLUX_VAE, TINY_FLUX_VAE, vae_blocks
from sdtrain.models.families.spec import SingleFileLayout, construct, ids_key, mask_key
from sdtrain.models.families.transformer_file import read_transformer_file
from sdtrain.models.single_file import kohya
from sdtrain.models.single_file.write import LAYOUT_CONFIG_KEY, layout_metadata, write_tensors

# Z-Image's 6B transformer (Z-Image-Turbo's transformer/config.json; the caption width comes from the text
# encoder, see Call.settings).
_ZIMAGE = dict(all_patch_size=[2], all_f_patch_size=[1], dim=3840, n_layers=30, n_refiner_layers=2, n_heads=30,
               n_kv_heads=30, norm_eps=1e-5, qk_norm=True, rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48],
               axes_lens=[1536, 512, 512])
_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
# The released folders' schedulers differ where their configs do not: Z-Image-Turbo (distilled to 8 steps without
# guidance) shifts by 3, the base Z-Image by 6.
_TURBO_SHIFT = 3.0
TEXT_LAYER = -2
"""The hidden layer the transformer reads: the last decoder layer's input (ZImagePipeline's hidden_states[-2])."""

_TINY_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=512)
# The released structure (refiners, joint layers, RoPE axes adding up to the head width) at a size tests train.
_TINY_ZIMAGE = dict(all_patch_size=[2], all_f_patch_size=[1], dim=32, n_layers=2, n_refiner_layers=1, n_heads=2,
                    n_kv_heads=2, qk_norm=True, axes_dims=[8, 4, 4], axes_lens=[512, 64, 64])

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"vae": TINY_FLUX_VAE, "text_encoder": _TINY_TEXT, "transformer": _TINY_ZIMAGE, "scheduler": _SCHEDULER},
    "z-image": {"vae": FLUX_VAE, "text_encoder": causal_lm.QWEN3_4B, "transformer": _ZIMAGE, "scheduler": _SCHEDULER},
}


def transformer_blocks(transformer: ZImageTransformer2DModel) -> list[nn.Module]:
    return [*transformer.noise_refiner, *transformer.context_refiner, *transformer.layers]


# --------------------------------------------------------------------------------------------------- single files
# The transformer in its authors' original layout (Tongyi-MAI's release file, ComfyUI's diffusion_models/ file),
# against diffusers' ZImageTransformer2DModel: attention's to_q, to_k and to_v are one fused ``attention.qkv``
# (stacked along the output rows), ``to_out.0`` is ``out``, ``norm_q``/``norm_k`` are ``q_norm``/``k_norm``, and the
# patch embedder and final layer of diffusers' patch-size table (``all_x_embedder.2-1``, ``all_final_layer.2-1``: 2x2
# patches, one frame) are plain ``x_embedder`` and ``final_layer``. The authors' model also holds a ``norm_final`` no
# forward reads: written as ones, skipped when read (as diffusers' converter drops it). Keys are bare, or under
# ComfyUI's ``model.diffusion_model.``. A file sdtrain writes carries, in its metadata under ``transformer_config``,
# the settings its shapes cannot tell (RoPE axes and lengths, theta, the time scale); a released one takes the
# released model's.

CONFIG_KEY = LAYOUT_CONFIG_KEY
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


# --------------------------------------------------------------------------------------------------- LoRA files
# The transformer's adapters in kohya's layout, the one musubi-tuner's Z-Image converter writes for ComfyUI:
# ``lora_unet_<module path in the authors' layout, _ for .>.lora_down.weight / .lora_up.weight / .alpha`` (a 0-d
# alpha; the scale is alpha / rank). The paths are those of the single files above, so to_q, to_k and to_v are the
# fused ``attention.qkv``: their adapters become one on it, downs stacked (rank the sum of theirs), ups
# block-diagonal (zero rows for an unadapted part), the alpha keeping each part's alpha / rank; ``to_out.0`` is
# ``out``, the patch embedder and final layer ``x_embedder`` and ``final_layer``.
#
# ComfyUI reads every key: its Z-Image model (Lumina2's NextDiT) holds the authors' keys, and its LoRA key map has
# ``lora_unet_`` + each of its weights with dots as underscores (comfy/lora.py, model_lora_keys_unet). diffusers'
# ZImagePipeline.load_lora_weights reads the same file (lora_conversion_utils.
# _convert_non_diffusers_z_image_lora_to_diffusers: ``lora_unet_`` names back to dotted paths, a fused qkv split
# into to_q, to_k and to_v with its down shared, which gives each part the same delta), every module but the patch
# embedder and the final layer: it knows those by diffusers' names alone (``all_x_embedder.2-1``,
# ``all_final_layer.2-1``), and leaves them unloaded. Neither is adapted unless named in ``lora.target_modules``;
# diffusers' own LoRA file (pytorch_lora_weights) holds them for diffusers.


def lora_module(path: str) -> tuple[str, int | None]:
    """A module's path in ZImageTransformer2DModel (as peft names an adapted one) -> its path in the authors'
    layout, and which part of the fused ``attention.qkv`` it is (0, 1, 2 for to_q, to_k, to_v; None: a module of
    its own). ValueError for a module the layout has no place for (other patch sizes' embedders, SigLIP's)."""
    parent, _, leaf = path.rpartition(".")
    if parent.endswith(".attention") and leaf in _QKV:
        return f"{parent}.qkv", _QKV.index(leaf)
    original = _original_name(path + ".")[:-1]
    if original.startswith(("all_", "siglip")):
        raise ValueError(f"LoRA {path}: no module of Z-Image's original layout holds it (it holds 2x2 patches of one "
                         "frame alone, and no SigLIP embedder)")
    return original, None


def _qkv_rows(config: Mapping[str, Any]) -> tuple[int, int, int]:
    """The rows to_q, to_k and to_v hold in the fused qkv."""
    heads = int(config["n_heads"])
    head = int(config["dim"]) // heads
    kv = int(config.get("n_kv_heads") or heads)
    return heads * head, kv * head, kv * head


def kohya_lora_state(layers: Mapping[str, kohya.LoraFactors], config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The transformer's adapters (diffusers' module path -> factors) with its config -> kohya's keys in the
    authors' layout (see above). ValueError for factors that are no [rank, in] and [out, rank] pair, or a module
    the layout has no place for."""
    return kohya.grouped_keys(layers, lora_module, _QKV, _qkv_rows(config))


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


def save_original(path: str | Path, transformer: Any, half: bool = False) -> Path:
    """Write a ZImageTransformer2DModel as ONE safetensors file in the authors' layout, atomically (a temporary
    name, then os.replace), with `layout_metadata`; fp32, or bf16 with `half` (the released dtype). The settings
    it would read back as are checked against the model's first."""
    out = Path(path)
    config = dict(transformer.config)
    try:
        state = to_original(transformer.state_dict(), config)
        metadata = layout_metadata(config, "z-image", SHAPE_KEYS)
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


def load_transformer_file(path: str | Path, trust_pickle: bool | None = None, frozen_precision: str = "fp32",
                          weights: bool = True) -> ZImageTransformer2DModel:
    """A ZImageTransformer2DModel, in fp32, from a file of Z-Image's transformer in its authors' layout (bare keys,
    or under ComfyUI's ``model.diffusion_model.``): sizes from the tensor shapes, the other settings from the file's
    metadata, else the released model's. Built on the meta device and filled a tensor at a time, its linear weights
    stored in `frozen_precision` as they come; without `weights`, only the header is read."""
    return read_transformer_file(
        path, trust_pickle, title="Z-Image", cls=ZImageTransformer2DModel, mark=MARK, prefix_of=prefix_of,
        settings_of=lambda shapes, metadata: transformer_config(shapes, metadata, _ZIMAGE),
        convert=iter_from_original, frozen_precision=frozen_precision, weights=weights,
        fix="pass a Z-Image transformer file (the released z_image_*.safetensors, or `sdtrain export --single-file` "
            "of a Z-Image run) or a diffusers transformer folder")


class TransformerFile(SingleFileLayout):
    """Tongyi-MAI's release file (and ComfyUI's ``diffusion_models/`` one): the transformer alone, in its authors'
    layout (the section above). Its VAE (Flux.1's), Qwen3 text encoder and tokenizer are loaded
    separately, as Z-Image tools load them. bf16 with ``--half``, the released dtype."""

    holds = ("transformer",)
    half_dtype = "bf16"
    description = "The {title} transformer alone, in one file in its authors' layout"
    comfyui = ("put `{name}` in `ComfyUI/models/diffusion_models/` and load it with Load Diffusion Model, beside "
               "Z-Image's own Qwen3 text encoder (Load CLIP) and Flux.1's `ae` autoencoder (Load VAE).")

    def load(self, name: str, path: Path, *, trust_pickle: bool | None, frozen_precision: str, weights: bool,
             latent_constants: Callable[[], dict[str, float | None]]) -> nn.Module:
        return load_transformer_file(path, trust_pickle, frozen_precision=frozen_precision, weights=weights)

    def write(self, out: Path, components: dict[str, nn.Module], *, half: bool, scheduler: Any,
              text_layout: str, text_source: str | Path | None) -> None:
        save_original(out, components["transformer"], half=half)


class Conditioner(causal_lm.LanguageModelText, spec.Conditioner):
    def tokenize(self, tokenizer: Any, index: int, captions: list[str]) -> dict[str, torch.Tensor]:
        ids, mask = causal_lm.chat_tokens(tokenizer, captions)
        return {ids_key(index): ids, mask_key(index): mask}

    def build_text_encoder(self, name: str, settings: dict[str, Any], tokenizer: Any, key: str) -> nn.Module:
        return Qwen3Model(construct(Qwen3Config, key, {"vocab_size": len(tokenizer),
                                                       "pad_token_id": tokenizer.pad_token_id, **settings}))

    def unused_modules(self, name: str, module: nn.Module) -> list[str]:
        # The transformer reads the input of the language model's last layer: that layer and the final norm are
        # computed for nothing.
        if not isinstance(module, Qwen3Model):
            return []
        return [f"layers.{len(module.layers) - 1}", "norm"]

    def encode_text(self, encoders: list[nn.Module], ids: list[torch.Tensor], captions: list[str] | None,
                    masks: list[torch.Tensor | None] | None = None, sources: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
        mask = masks[0]  # `tokenize` makes one with every caption's ids
        states = causal_lm.hidden_states(encoders[0], ids[0], mask, TEXT_LAYER)
        return {"text_emb": states, "text_mask": mask.to(states.dtype)}

    def text_shapes(self, text_encoders: dict[str, Any], lengths: list[int]) -> dict[str, tuple[int, ...]]:
        return {"text_emb": (lengths[0], text_encoders["text_encoder"].hidden_size), "text_mask": (lengths[0],)}


class Call(spec.DenoiserCall):
    objective = "flow_matching"

    def settings(self, settings: dict[str, Any], text_encoders: dict[str, nn.Module]) -> dict[str, Any]:
        return {"cap_feat_dim": text_encoders["text_encoder"].config.hidden_size}

    def shape(self, latent_channels: int, latent_size: int) -> dict[str, Any]:
        # Any latent size the RoPE axes cover (max_latent_side); the transformer patchifies itself.
        return {"in_channels": latent_channels}

    def downsampling(self, denoiser_config: Any) -> int:
        return denoiser_config.all_patch_size[0]

    def max_latent_side(self, denoiser_config: Any) -> int | None:
        # An image token's row and column positions run over the patches: the RoPE tables' lengths bound them.
        return denoiser_config.all_patch_size[0] * min(denoiser_config.axes_lens[1:])

    def condition(self, text: dict[str, torch.Tensor], batch: dict[str, Any], device: torch.device
                  ) -> dict[str, Any]:
        # Each caption's own states, its padding dropped: the transformer pads every caption itself, with a token
        # it learns.
        keep = text["text_mask"].bool()
        return {"cap_feats": [states[kept] for states, kept in zip(text["text_emb"], keep)]}

    def denoise(self, denoiser: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                condition: dict[str, Any]) -> torch.Tensor:
        images = list(noisy.unsqueeze(2).unbind(0))  # one (C, frames=1, H, W) latent per image
        output = denoiser(images, 1 - timesteps / 1000, condition["cap_feats"], return_dict=False)[0]
        return -torch.stack(output).squeeze(2)


class Files(spec.FileInterchange):
    denoiser_lora_peft_names = True
    kohya_names_each_layer = False  # its kohya layout fuses q, k and v
    # The authors' files hold the transformer alone; ComfyUI's put it under model.diffusion_model.
    single_file_keys = tuple(prefix + MARK for prefix in PREFIXES)
    single_file = TransformerFile()

    def kohya_lora(self, component: str, layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]], config: Any
                   ) -> dict[str, torch.Tensor]:
        # The transformer's adapters in the authors' layout, q, k and v fused into qkv, as ComfyUI reads them.
        if component == "transformer":
            return kohya_lora_state(layers, dict(config))
        return super().kohya_lora(component, layers, config)


class Sampling(spec.Sampling):
    pipeline_class = ZImagePipeline
    pipeline_names = ("ZImagePipeline",)

    def assemble(self, components: dict[str, nn.Module], tokenizers: list[Any], scheduler: Any,
                 distilled: bool = False) -> Any:
        return ZImagePipeline(scheduler=scheduler, vae=components["vae"], text_encoder=components["text_encoder"],
                              tokenizer=tokenizers[0], transformer=components["transformer"])

    def distilled(self, source: str | Path | None) -> bool:
        # Z-Image-Turbo: by name (the Hub id Tongyi-MAI/Z-Image-Turbo, whose cache folder keeps it, or a folder
        # named so), else by its scheduler's shift, which the base model's folder does not share.
        if source is None:
            return False
        path = Path(source)
        folder = path if (path / "model_index.json").is_file() else path.parent
        names = [folder.name, folder.parent.parent.name if folder.parent.name == "snapshots" else ""]
        if any("z-image-turbo" in name.lower() for name in names):
            return True
        try:
            scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
        except (OSError, ValueError):
            return False
        return (isinstance(scheduler, dict) and not scheduler.get("use_dynamic_shifting")
                and scheduler.get("shift") == _TURBO_SHIFT)

    def defaults(self, denoiser_config: Any, distilled: bool = False) -> dict[str, Any]:
        # Turbo is distilled to 8 steps without guidance (ZImagePipeline's own example: guidance_scale=0.0,
        # sdtrain's 1); the base model samples with classifier-free guidance.
        return {"guidance": 1.0, "steps": 8} if distilled else {"guidance": 5.0}

    def arguments(self, pipe: Any, guidance: float, negative_prompt: str | None) -> dict[str, Any]:
        # ZImagePipeline's guidance_scale g is the step pos + g * (pos - neg): classifier-free guidance at g + 1,
        # off at 0. sdtrain's guidance is the usual scale (1: none), as for every other family.
        return {"guidance_scale": max(guidance - 1.0, 0.0), "negative_prompt": negative_prompt,
                "max_sequence_length": pipe.tokenizer.model_max_length}


ZIMAGE = spec.ModelFamily(
    name="z-image", title="Z-Image",
    components=spec.Components(
        vae=spec.Component(AutoencoderKL, "vae", blocks=vae_blocks),
        # The released text encoder is Qwen3ForCausalLM, read as its Qwen3Model. diffusers' Z-Image LoRA loader
        # adapts the transformer alone.
        text_encoder=causal_lm.text_encoder(Qwen3Model, (("model.", ""),)),
        # The transformer's adapters alone (no text encoder is adapted), named as the authors' modules: see LoRA
        # files.
        transformer=spec.Component(ZImageTransformer2DModel, "denoiser", kohya_prefix=kohya.PREFIX,
                                   blocks=transformer_blocks),
    ),
    presets=PRESETS, codec=FLUX_CODEC, conditioner=Conditioner(), denoising=Call(), files=Files(),
    sampling=Sampling(),
)
