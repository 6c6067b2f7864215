"""Krea 2 (Krea AI, 2026): a 12B single-stream MMDiT (Krea2Transformer2DModel: a text-fusion stage, then one
sequence of text and image tokens through shared blocks with grouped-query, sigmoid-gated attention), Qwen3-VL-4B's
language tower as its one text encoder, and Wan-2.1's causal 3D autoencoder (Qwen-Image's: 16 channels, 8x
smaller, each channel normalised by its own mean and deviation).

The conditioner follows diffusers' Krea2Pipeline: each caption follows Qwen-Image's system turn and the user turn's
header, is padded (on the right) to a fixed length, and the turn's closing and the assistant's header come after the
padding (``[prefix | caption | padding | suffix]``, as the model was trained). The language model attends every
token but the padding, at positions that count real tokens alone (padding takes none, so the suffix sits right after
the caption on every RoPE axis). The transformer reads the hidden states of every third layer from the second
(``hidden_states`` 2, 5, ..., 35 of Qwen3-VL-4B's 36 layers), each token's twelve side by side, from the caption
on: the system turn is dropped, the padding masked. Encoded shards store them flattened, (tokens, layers x width),
as ComfyUI carries them; `denoise` gives the transformer its (tokens, layers, width) stack. Only the language tower
is read: the vision tower is never built.

The latents are packed 2x2 into tokens (the pipeline's ``patch_size``), text tokens at RoPE position (0, 0, 0) and
image tokens at (0, row, column). The transformer takes sigma in [0, 1] and predicts ``noise - x0``, the flow
objective's target. Its classifier-free guidance scale g is Krea's ``cond + g (cond - uncond)``: the usual scale
g + 1 (`sampling_arguments`). A step-distilled checkpoint says so in model_index.json (``is_distilled``): it samples
in 8 steps without guidance at a fixed shift mu = 1.15, the base model in 28 steps at guidance 4.5 (5.5 as sdtrain
counts it) with mu linear in the image tokens (0.5 at 256, 1.15 at 6,400).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLQwenImage, Krea2Pipeline, Krea2Transformer2DModel
from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers
from torch import nn
from transformers import Qwen3VLTextConfig, Qwen3VLTextModel

from sdtrain.errors import UserError
from sdtrain.models.families import causal_lm, spec
from sdtrain.models.families.patches import pack, unpack
from sdtrain.models.families.spec import construct, ids_key, index_says, mask_key
from sdtrain.models.families.transformer_file import TransformerAlone, read_transformer_file
from sdtrain.models.families.wan_vae import TINY_WAN_VAE, WAN_CODEC, WAN_VAE
from sdtrain.models.single_file.write import LAYOUT_CONFIG_KEY

PREFIX = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
          "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n")
"""What comes before each caption (Krea2Pipeline's ``prompt_template_encode_prefix``), read by the language model
and dropped from the conditioning (the released tokenizer's 34 tokens)."""
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
"""What comes after each caption's padding (the pipeline's ``prompt_template_encode_suffix``: 5 released tokens)."""
PREFIX_TOKEN, KEPT_TOKEN = 2, 1
"""The attention mask `tokenize` gives each token: read by the language model and dropped (the prefix), read and
kept; 0 is padding, neither."""


def text_layers(depth: int) -> tuple[int, ...]:
    """The hidden states the transformer reads of a language model `depth` layers deep (``hidden_states`` indices,
    the embeddings being 0): every third from the second, below the final norm's output (Krea2Pipeline's default
    ``text_encoder_select_layers`` for Qwen3-VL-4B's 36 layers: 2, 5, ..., 35)."""
    return tuple(range(2, depth, 3))


# Qwen3-VL-4B-Instruct's language tower (its text_config), read as Qwen3VLTextModel.
_QWEN3_VL_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-6,
                    vocab_size=151936, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                                     "mrope_interleaved": True})
# The released transformer (diffusers' defaults; the text width and the number of stacked layers come from the text
# encoder, the input channels from the latents: see denoiser_settings and denoiser_shape).
_KREA2 = dict(num_layers=28, attention_head_dim=128, num_attention_heads=48, num_key_value_heads=12,
              intermediate_size=16384, timestep_embed_dim=256, text_num_attention_heads=20,
              text_num_key_value_heads=20, text_intermediate_size=6912, num_layerwise_text_blocks=2,
              num_refiner_text_blocks=2, axes_dims_rope=[32, 48, 48], rope_theta=1000.0, norm_eps=1e-5)
# The scheduler Krea2Pipeline expects: a shift growing with the image, mu from 0.5 at 256 tokens to 1.15 at 6,400
# (the step-distilled model samples at mu = 1.15 whatever its size).
_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                  base_image_seq_len=256, max_image_seq_len=6400)
DISTILLED_MU = 1.15
"""The shift a step-distilled checkpoint samples at (the pipeline's, with ``is_distilled``)."""
PATCH = 2
"""The side of the latent patches tokens are made of (the pipeline's ``patch_size``)."""

# The released structure at a size tests train: six language-model layers (two read, 2 and 5, the last layer and
# the final norm above them), M-RoPE sections adding up to half the head width, grouped-query attention in the
# transformer's blocks.
_TINY_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                  rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [2, 3, 3],
                                   "mrope_interleaved": True})
_TINY_KREA2 = dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, num_key_value_heads=1,
                   intermediate_size=64, timestep_embed_dim=32, text_num_attention_heads=2,
                   text_num_key_value_heads=2, text_intermediate_size=64, num_layerwise_text_blocks=1,
                   num_refiner_text_blocks=1, axes_dims_rope=[4, 6, 6])

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"vae": TINY_WAN_VAE, "text_encoder": _TINY_TEXT, "transformer": _TINY_KREA2, "scheduler": _SCHEDULER},
    "krea2": {"vae": WAN_VAE, "text_encoder": _QWEN3_VL_4B, "transformer": _KREA2, "scheduler": _SCHEDULER},
}


def token_count(tokenizer: Any, text: str) -> int:
    """How many of `tokenizer`'s tokens `text` is."""
    return len(tokenizer(text).input_ids)


def _plain(text: str) -> str:
    """`text` without the chat markers (which a tokenizer keeps as special tokens)."""
    return text.replace(causal_lm.IM_START, "").replace(causal_lm.IM_END, "")


def transformer_blocks(transformer: Krea2Transformer2DModel) -> list[nn.Module]:
    fusion = transformer.text_fusion
    return [*fusion.layerwise_blocks, *fusion.refiner_blocks, *transformer.transformer_blocks]


def positions(text_tokens: int, rows: int, columns: int, device: torch.device) -> torch.Tensor:
    """Each token's RoPE position: (0, 0, 0) for the text's, (0, row, column) for the image's after them."""
    grid = torch.zeros(text_tokens + rows * columns, 3, device=device)
    grid[text_tokens:, 1] = torch.arange(rows, device=device).repeat_interleave(columns)
    grid[text_tokens:, 2] = torch.arange(columns, device=device).repeat(rows)
    return grid


# --------------------------------------------------------------------------------------------------- file layouts
# Krea's own module names (krea-ai/krea-2's, which ComfyUI's Krea 2 model keeps: comfy/ldm/krea2/model.py), against
# diffusers' Krea2Transformer2DModel: nothing is fused, every module is renamed. Attention's to_q, to_k, to_v,
# to_out.0 and to_gate are wq, wk, wv, wo and gate; the feed-forward's ff is mlp; a norm's weight is its scale; each
# block's (6, width) modulation table is one flat ``mod.lin``. A single file holds the transformer alone (ComfyUI's
# diffusion_models/ file, Krea's release), bare or under ComfyUI's ``model.diffusion_model.``; reading it is
# diffusers' own conversion (convert_krea2_transformer_checkpoint_to_diffusers), a tensor at a time, writing its
# inverse. kohya's LoRA names are ``lora_unet_`` and the module's path in Krea's names, dots as underscores: ComfyUI's
# key map makes that name of each weight of its model (comfy/lora.py, model_lora_keys_unet), one module a layer.

PREFIXES = ("model.diffusion_model.", "")
MARK = "txtfusion.projector.weight"
"""A key only Krea 2's layout holds (what diffusers tells a Krea 2 file by)."""
SHAPE_KEYS = frozenset({"in_channels", "num_layers", "attention_head_dim", "num_attention_heads",
                        "num_key_value_heads", "intermediate_size", "timestep_embed_dim", "text_hidden_dim",
                        "num_text_layers", "text_num_attention_heads", "text_num_key_value_heads",
                        "text_intermediate_size", "num_layerwise_text_blocks", "num_refiner_text_blocks"})
# diffusers' name -> Krea's: the top-level modules (a key starting so), then the parts of a block (anywhere).
_TOP = (("img_in.", "first."), ("time_embed.linear_1.", "tmlp.0."), ("time_embed.linear_2.", "tmlp.2."),
        ("time_mod_proj.", "tproj.1."), ("txt_in.norm.weight", "txtmlp.0.scale"), ("txt_in.linear_1.", "txtmlp.1."),
        ("txt_in.linear_2.", "txtmlp.3."), ("text_fusion.", "txtfusion."), ("transformer_blocks.", "blocks."),
        ("final_layer.linear.", "last.linear."), ("final_layer.norm.weight", "last.norm.scale"),
        ("final_layer.scale_shift_table", "last.modulation.lin"))
_INNER = ((".attn.to_q.", ".attn.wq."), (".attn.to_k.", ".attn.wk."), (".attn.to_v.", ".attn.wv."),
          (".attn.to_out.0.", ".attn.wo."), (".attn.to_gate.", ".attn.gate."),
          (".attn.norm_q.weight", ".attn.qknorm.qnorm.scale"), (".attn.norm_k.weight", ".attn.qknorm.knorm.scale"),
          (".ff.", ".mlp."), (".norm1.weight", ".prenorm.scale"), (".norm2.weight", ".postnorm.scale"),
          (".scale_shift_table", ".mod.lin"))
_BLOCK = re.compile(r"^(blocks|txtfusion\.layerwise_blocks|txtfusion\.refiner_blocks)\.(\d+)\.")


def original_name(key: str) -> str:
    """A Krea2Transformer2DModel weight's (or, with a trailing dot, module's) name in Krea's layout."""
    for ours, theirs in _TOP:
        if key.startswith(ours):
            key = theirs + key[len(ours):]
            break
    for ours, theirs in _INNER:
        key = key.replace(ours, theirs)
    return key


def to_original(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Krea2Transformer2DModel state dict -> Krea's keys (no prefix), each block's modulation table flat."""
    out = {}
    for key, tensor in state.items():
        name = original_name(key)
        out[name] = tensor.flatten() if name.startswith("blocks.") and name.endswith(".mod.lin") else tensor
    return out


def prefix_of(keys: Any) -> str | None:
    """The prefix a file holds Krea 2's transformer under, None when it holds none."""
    return next((prefix for prefix in PREFIXES if prefix + MARK in keys), None)


def transformer_config(shapes: Mapping[str, tuple[int, ...]], metadata: Mapping[str, str]) -> dict[str, Any]:
    """The Krea2Transformer2DModel settings of a file's transformer (`shapes`: Krea's keys, no prefix): sizes from the
    tensors; RoPE axes, theta and the norms' epsilon from what a file sdtrain writes carries, else the released
    model's (its axes split the head width as ComfyUI splits it)."""
    def need(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise ValueError(f"no {key}")
        return tuple(shapes[key])

    counts = {name: len({int(m.group(2)) for key in shapes if (m := _BLOCK.match(key)) and m.group(1) == name})
              for name in ("blocks", "txtfusion.layerwise_blocks", "txtfusion.refiner_blocks")}
    width, channels = need("first.weight")
    head = need("blocks.0.attn.qknorm.qnorm.scale")[0]
    text_width = need("txtmlp.0.scale")[0]
    text_head = need("txtfusion.refiner_blocks.0.attn.qknorm.qnorm.scale")[0]
    sixteenth = head // 16
    released = {**_KREA2, "axes_dims_rope": [head - 12 * sixteenth, 6 * sixteenth, 6 * sixteenth]}
    settings = {**released, **json.loads(metadata.get(LAYOUT_CONFIG_KEY) or "{}")}
    return {**{k: v for k, v in settings.items() if k not in SHAPE_KEYS}, "in_channels": channels,
            "num_layers": counts["blocks"], "attention_head_dim": head, "num_attention_heads": width // head,
            "num_key_value_heads": need("blocks.0.attn.wk.weight")[0] // head,
            "intermediate_size": need("blocks.0.mlp.gate.weight")[0], "timestep_embed_dim": need("tmlp.0.weight")[1],
            "text_hidden_dim": text_width, "num_text_layers": need(MARK)[1],
            "text_num_attention_heads": text_width // text_head,
            "text_num_key_value_heads": need("txtfusion.refiner_blocks.0.attn.wk.weight")[0] // text_head,
            "text_intermediate_size": need("txtfusion.refiner_blocks.0.mlp.gate.weight")[0],
            "num_layerwise_text_blocks": counts["txtfusion.layerwise_blocks"],
            "num_refiner_text_blocks": counts["txtfusion.refiner_blocks"]}


def _from_original(keys: list[str], read: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    for key in keys:
        yield from convert_krea2_transformer_checkpoint_to_diffusers({key: read(key)}).items()


def load_transformer_file(path: str | Path, trust_pickle: bool | None = None, frozen_precision: str = "fp32",
                          weights: bool = True) -> Krea2Transformer2DModel:
    """A Krea2Transformer2DModel, in fp32 (or its linear weights stored in `frozen_precision`), from a file of the
    transformer alone in Krea's layout; without `weights`, only the header is read."""
    return read_transformer_file(
        path, trust_pickle, title="Krea 2", cls=Krea2Transformer2DModel, mark=MARK, prefix_of=prefix_of,
        settings_of=transformer_config, convert=_from_original, frozen_precision=frozen_precision, weights=weights,
        fix="pass a Krea 2 transformer file (ComfyUI's diffusion_models/ file, or `sdtrain export --single-file` of "
            "a Krea 2 run) or a diffusers transformer folder")


class Conditioner(causal_lm.LanguageModelText, spec.Conditioner):
    # ------------------------------------------------------------------------------------------ tokens

    def tokenize(self, tokenizer: Any, index: int, captions: list[str]) -> dict[str, torch.Tensor]:
        # The pipeline's layout, [prefix | caption | padding | suffix], its length the prefix and the kept tokens
        # (the tokenizer's); the mask tells the prefix (read, then dropped) from what is kept, so `encode_text`
        # drops it whatever the captions (an empty one leaves no caption token to find it by). Padded on the right
        # whatever the tokenizer's folder says: the model was trained so.
        prefix, suffix = token_count(tokenizer, PREFIX), tokenizer(SUFFIX, return_tensors="pt")
        closing = suffix.input_ids.shape[1]
        if closing >= tokenizer.model_max_length:
            raise UserError(f"model.t5_text_length: {tokenizer.model_max_length} tokens leave no room for a caption "
                            f"before the template's {closing} closing tokens; set more")
        body = tokenizer([PREFIX + caption for caption in captions], padding="max_length", padding_side="right",
                         truncation=True, max_length=tokenizer.model_max_length + prefix - closing,
                         return_tensors="pt")
        rows = len(captions)
        ids = torch.cat([body.input_ids, suffix.input_ids.expand(rows, -1)], dim=1)
        mask = torch.cat([body.attention_mask, suffix.attention_mask.expand(rows, -1)], dim=1) * KEPT_TOKEN
        mask[:, :prefix] = PREFIX_TOKEN
        return {ids_key(index): ids, mask_key(index): mask}

    def train_tokenizer(self, captions: list[str], out_dir: Path, vocab_size: int, max_length: int) -> Any:
        # Learnt from the captions as the language model reads them, in the template (its chat markers apart, which
        # are special tokens): the template's words then take a token each, not a byte each, leaving the captions
        # their room before the closing tokens.
        return causal_lm.train_chat_tokenizer([_plain(PREFIX) + caption + _plain(SUFFIX) for caption in captions],
                                              out_dir, vocab_size, max_length)

    def build_text_encoder(self, name: str, settings: dict[str, Any], tokenizer: Any, key: str) -> nn.Module:
        return Qwen3VLTextModel(construct(Qwen3VLTextConfig, key, {
            "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, **settings}))

    def unused_modules(self, name: str, module: nn.Module) -> list[str]:
        # The language model's layers from the deepest one read up, and its final norm.
        if not isinstance(module, Qwen3VLTextModel):
            return []
        deepest = text_layers(len(module.layers))[-1]
        return [f"layers.{i}" for i in range(deepest, len(module.layers))] + ["norm"]

    # ------------------------------------------------------------------------------------------ the conditioning

    def encode_text(self, encoders: list[nn.Module], ids: list[torch.Tensor], captions: list[str] | None,
                    masks: list[torch.Tensor | None] | None = None) -> dict[str, torch.Tensor]:
        encoder, mask = encoders[0], masks[0]  # `tokenize` makes a mask with every caption's ids
        attended = mask > 0
        drop = int((mask[0] == PREFIX_TOKEN).sum())
        # Padding takes no position: each token's is the count of real tokens before it, on all three M-RoPE axes.
        position = (attended.long().cumsum(-1) - 1).clamp(min=0).expand(3, -1, -1)
        states = encoder(input_ids=ids[0], attention_mask=attended.long(), position_ids=position,
                         output_hidden_states=True).hidden_states
        # The tower's depth, or the whole Qwen3-VL's language tower's (the pipeline's text encoder).
        layers = text_layers(encoder.config.get_text_config().num_hidden_layers)
        stacked = torch.cat([states[layer][:, drop:] for layer in layers], dim=-1)
        kept = (mask[:, drop:] == KEPT_TOKEN).to(stacked.dtype)
        # Padding's states zeroed (the transformer masks them either way): shards of a caption are then its own.
        return {"text_emb": stacked * kept.unsqueeze(-1), "text_mask": kept}

    def text_shapes(self, text_encoders: dict[str, Any], lengths: list[int]) -> dict[str, tuple[int, ...]]:
        config = text_encoders["text_encoder"]
        return {"text_emb": (lengths[0], len(text_layers(config.num_hidden_layers)) * config.hidden_size),
                "text_mask": (lengths[0],)}


class Call(spec.DenoiserCall):
    objective = "flow_matching"

    def settings(self, settings: dict[str, Any], text_encoders: dict[str, nn.Module]) -> dict[str, Any]:
        config = text_encoders["text_encoder"].config
        return {"text_hidden_dim": config.hidden_size, "num_text_layers": len(text_layers(config.num_hidden_layers))}

    def shape(self, latent_channels: int, latent_size: int) -> dict[str, Any]:
        # Tokens are 2x2 patches of the latents; RoPE positions, no fixed table.
        return {"in_channels": latent_channels * PATCH * PATCH}

    def downsampling(self, denoiser_config: Any) -> int:
        return PATCH

    def condition(self, text: dict[str, torch.Tensor], batch: dict[str, Any], device: torch.device
                  ) -> dict[str, Any]:
        return {"encoder_hidden_states": text["text_emb"],
                "encoder_attention_mask": spec.mask_unless_full(text["text_mask"].bool())}

    def denoise(self, denoiser: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                condition: dict[str, Any]) -> torch.Tensor:
        height, width = noisy.shape[-2:]
        config = denoiser.config
        # Each token's layers side by side, back into the (tokens, layers, width) stack the transformer fuses.
        context = condition["encoder_hidden_states"]
        context = context.unflatten(-1, (config.num_text_layers, config.text_hidden_dim)).to(noisy.dtype)
        output = denoiser(
            hidden_states=pack(noisy), encoder_hidden_states=context, timestep=timesteps / 1000,
            position_ids=positions(context.shape[1], height // PATCH, width // PATCH, noisy.device),
            encoder_attention_mask=condition["encoder_attention_mask"], return_dict=False)[0]
        return unpack(output, height, width)


class Files(spec.FileInterchange):
    single_file_keys = tuple(prefix + MARK for prefix in PREFIXES)
    single_file = TransformerAlone(
        load_transformer_file, to_original, lambda config: "krea2", SHAPE_KEYS,
        description="The {title} transformer alone, in Krea's layout, in one file as ComfyUI loads it",
        comfyui="put `{name}` in `ComfyUI/models/diffusion_models/` and load it with Load Diffusion Model, beside "
                "Krea 2's Qwen3-VL-4B text encoder (Load CLIP, type krea2) and Wan 2.1's VAE (Load VAE).")
    denoiser_lora_peft_names = True

    def original_module_path(self, component: str, path: str, config: Any) -> str:
        return original_name(path + ".")[:-1] if component == "transformer" else path


class Sampling(spec.Sampling):
    pipeline_class = Krea2Pipeline
    pipeline_names = ("Krea2Pipeline",)

    def assemble(self, components: dict[str, nn.Module], tokenizers: list[Any], scheduler: Any,
                 distilled: bool = False) -> Any:
        text_encoder = components["text_encoder"]
        return self.prepare(Krea2Pipeline(
            scheduler=scheduler, vae=components["vae"], text_encoder=text_encoder, tokenizer=tokenizers[0],
            transformer=components["transformer"], is_distilled=distilled, patch_size=PATCH,
            text_encoder_select_layers=text_layers(text_encoder.config.get_text_config().num_hidden_layers)))

    def prepare(self, pipe: Any) -> Any:
        # The pipeline drops the released tokenizer's 34 prefix tokens and appends its 5 suffix tokens whatever its
        # tokenizer; a model trained from scratch has its own counts (no setting a folder keeps).
        pipe.prompt_template_encode_start_idx = token_count(pipe.tokenizer, PREFIX)
        pipe.prompt_template_encode_num_suffix_tokens = token_count(pipe.tokenizer, SUFFIX)
        return pipe

    def distilled(self, source: str | Path | None) -> bool:
        # The release's folders say it in model_index.json (is_distilled), as the pipeline reads it; the
        # transformer's config is the same for both. A single file does not say.
        return index_says(source, "is_distilled")

    def defaults(self, denoiser_config: Any, distilled: bool = False) -> dict[str, Any]:
        # The pipeline's: the distilled checkpoint in 8 steps without guidance, the base one in 28 at Krea's 4.5,
        # which is 5.5 as sdtrain (and every other pipeline) counts guidance.
        return {"guidance": 1.0, "steps": 8} if distilled else {"guidance": 5.5, "steps": 28}

    def arguments(self, pipe: Any, guidance: float, negative_prompt: str | None) -> dict[str, Any]:
        # Krea2Pipeline's guidance_scale g steps by cond + g (cond - uncond): classifier-free guidance at g + 1, off
        # at 0 (against the empty prompt where no negative is given). Caption tokens as training read them.
        return {"guidance_scale": max(guidance - 1.0, 0.0), "negative_prompt": negative_prompt,
                "max_sequence_length": pipe.tokenizer.model_max_length}


KREA2 = spec.ModelFamily(
    name="krea2", title="Krea 2",
    components=spec.Components(
        # The autoencoder lists no blocks: its causal convolutions carry a frame cache from call to call, which
        # recomputing a block (activation checkpointing) would advance twice.
        vae=spec.Component(AutoencoderKLQwenImage, "vae"),
        # The released text encoder is Qwen3-VL (Qwen3VLModel, or the whole Qwen3VLForConditionalGeneration), its
        # language tower under language_model. (model.language_model.), its vision tower beside it.
        text_encoder=causal_lm.text_encoder(Qwen3VLTextModel, (("model.language_model.", ""), ("language_model.", ""))),
        # The transformer's adapters in Krea's module names (see file layouts), as ComfyUI reads them.
        transformer=spec.Component(Krea2Transformer2DModel, "denoiser", kohya_prefix="lora_unet_",
                                   blocks=transformer_blocks),
    ),
    presets=PRESETS, codec=WAN_CODEC, conditioner=Conditioner(), denoising=Call(), files=Files(), sampling=Sampling(),
)
