"""Flux.2 (Black Forest Labs, 2025): a 32-channel autoencoder whose latents the transformer reads as 2x2 patches of
128 channels, normalised by statistics the autoencoder holds in a BatchNorm's buffers; a rectified-flow transformer
(Flux2Transformer2DModel: double-stream then single-stream blocks, no biases, one modulation shared by all blocks
of a kind, 4-axis RoPE); and a language model read at three depths. Two families share this module, as diffusers
has two pipelines: Flux.2-dev (Flux2Pipeline: Mistral-Small-3.1's language tower, guidance-distilled) and Flux.2
klein (Flux2KleinPipeline: Qwen3, 4B and 9B, no guidance embedding).

The conditioner follows the pipelines: dev puts each caption in the user turn after a fixed system message, klein
in Qwen3's chat template with thinking off; either pads to a fixed length, and the transformer reads the hidden
states of the layers at a quarter, half and three quarters of the model's depth (dev's 10, 20 and 30 of 40,
klein's 9, 18 and 27 of 36), each token's three states side by side, padding included (no mask reaches it). The
latent codec patchifies the posterior (32 channels at 1/8 the side become 128 at 1/16), so shards and the denoiser
see 128-channel latents, one token each. The transformer takes sigma and predicts ``noise - x0``, the objective's
target.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel
from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
from torch import nn
from transformers import AutoTokenizer, MistralConfig, MistralModel, Qwen3Config, Qwen3Model

from sdtrain.models.families import causal_lm, spec
from sdtrain.models.families.autoencoder import TINY_VAE, vae_blocks
from sdtrain.models.families.bfl import original_rows
from sdtrain.models.families.codec import LatentCodec
from sdtrain.models.families.spec import construct, ids_key, index_says, mask_key
from sdtrain.models.families.transformer_file import TransformerAlone, read_transformer_file
from sdtrain.models.single_file import kohya
from sdtrain.models.single_file.write import LAYOUT_CONFIG_KEY

SYSTEM_MESSAGE = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
                  "object relationships, object\nattribution and actions without speculation.")
"""Flux2Pipeline's system turn (diffusers' flux2/system_messages.py, from Black Forest Labs' reference code)."""

# Mistral-Small-3.1-24B's language tower (its text_config), read as MistralModel.
_MISTRAL_SMALL_31 = dict(hidden_size=5120, intermediate_size=32768, num_hidden_layers=40, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
                         rope_theta=1_000_000_000.0, sliding_window=None, vocab_size=131072, tie_word_embeddings=False)
_QWEN3_8B = dict(causal_lm.QWEN3_4B, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                 tie_word_embeddings=False)
# The released transformers (diffusers' defaults are dev's; the text width comes from the text encoder, see
# Call.settings) and autoencoder (diffusers' defaults).
_DEV = dict(patch_size=1, num_layers=8, num_single_layers=48, attention_head_dim=128, num_attention_heads=48,
            mlp_ratio=3.0, axes_dims_rope=[32, 32, 32, 32], rope_theta=2000, guidance_embeds=True)
_KLEIN_4B = dict(_DEV, num_layers=5, num_single_layers=20, num_attention_heads=24, guidance_embeds=False)
_KLEIN_9B = dict(_DEV, num_layers=8, num_single_layers=24, num_attention_heads=32, guidance_embeds=False)
_VAE = dict(latent_channels=32, use_quant_conv=True, use_post_quant_conv=True)
# The released schedulers' dynamic shift, whose mu is the limit of the pipelines' empirical mu at many sampling
# steps (mu = 0.00016927 tokens + 0.45667: 0.5 at 256 image tokens, 1.15 at 4,096). The pipelines sample with the
# empirical mu at their step count (`Sampling.mu`: 1.70 at 512 px and 50 steps), which training matches with
# diffusion.flow.dynamic_shift: sampling.
_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                  base_image_seq_len=256, max_image_seq_len=4096)

# The released structures at a size tests train: four text layers (the three read at 1, 2, 3 and one above, so the
# last read is not the final norm's output), 4x smaller latents before the 2x2 patches.
_TINY_MISTRAL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, max_position_embeddings=512, sliding_window=None)
_TINY_QWEN3 = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=16, max_position_embeddings=512)
_TINY_VAE = {**TINY_VAE, "latent_channels": 32, "use_quant_conv": False, "use_post_quant_conv": False}
_TINY_DEV = dict(patch_size=1, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                 axes_dims_rope=[4, 4, 4, 4], timestep_guidance_channels=32, guidance_embeds=True)
_TINY_KLEIN = dict(_TINY_DEV, guidance_embeds=False)


def text_layers(depth: int) -> tuple[int, ...]:
    """The hidden layers the transformer reads of a language model `depth` layers deep: a quarter, half and three
    quarters of the way (hidden_states indices, the embeddings being 0)."""
    return tuple(depth * k // 4 for k in (1, 2, 3))


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, 4C, H/2, W/2): each 2x2 patch's values as channels c*4 + dy*2 + dx, the pipelines' order."""
    b, c, h, w = latents.shape
    patches = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return patches.reshape(b, c * 4, h // 2, w // 2)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """The inverse of `patchify`."""
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return patches.reshape(b, c // 4, h * 2, w * 2)


def positions(rows: int, columns: int, device: torch.device) -> torch.Tensor:
    """Each image token's RoPE position (0, row, column, 0)."""
    grid = torch.zeros(rows, columns, 4, device=device)
    grid[..., 1] = torch.arange(rows, device=device)[:, None]
    grid[..., 2] = torch.arange(columns, device=device)[None, :]
    return grid.reshape(rows * columns, 4)


def transformer_blocks(transformer: Flux2Transformer2DModel) -> list[nn.Module]:
    return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]


# --------------------------------------------------------------------------------------------------- LoRA files
# kohya's layout, in Black Forest Labs' module names (diffusers' _convert_kohya_flux2_lora_to_diffusers reads it):
# a double block's q, k and v are one fused ``img_attn.qkv`` (its text stream's ``txt_attn.qkv``), their adapters
# fused as Flux.1's are; the single blocks' fused projections keep diffusers' shapes under other names. Modulation
# and guidance layers have no kohya name diffusers reads.

_QKV = {"to_q": ("img_attn_qkv", 0), "to_k": ("img_attn_qkv", 1), "to_v": ("img_attn_qkv", 2),
        "add_q_proj": ("txt_attn_qkv", 0), "add_k_proj": ("txt_attn_qkv", 1), "add_v_proj": ("txt_attn_qkv", 2)}
_DOUBLE = {"attn.to_out.0": "img_attn_proj", "attn.to_add_out": "txt_attn_proj", "ff.linear_in": "img_mlp_0",
           "ff.linear_out": "img_mlp_2", "ff_context.linear_in": "txt_mlp_0", "ff_context.linear_out": "txt_mlp_2"}
_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}
_TOP = {"x_embedder": "img_in", "context_embedder": "txt_in",
        "time_guidance_embed.timestep_embedder.linear_1": "time_in_in_layer",
        "time_guidance_embed.timestep_embedder.linear_2": "time_in_out_layer", "proj_out": "final_layer_linear"}


def lora_module(path: str) -> tuple[str, int | None]:
    """A module's path in Flux2Transformer2DModel -> its kohya name (after ``lora_unet_``, dots as underscores), and
    which third of a fused qkv it is (None: a module of its own). ValueError for a module no kohya name reads."""
    parts = path.split(".")
    if parts[0] == "transformer_blocks" and len(parts) > 2:
        block, rest = f"double_blocks_{parts[1]}", ".".join(parts[2:])
        if rest.startswith("attn.") and rest[5:] in _QKV:
            name, third = _QKV[rest[5:]]
            return f"{block}_{name}", third
        if rest in _DOUBLE:
            return f"{block}_{_DOUBLE[rest]}", None
    elif parts[0] == "single_transformer_blocks" and len(parts) > 2 and ".".join(parts[2:]) in _SINGLE:
        return f"single_blocks_{parts[1]}_{_SINGLE['.'.join(parts[2:])]}", None
    elif path in _TOP:
        return _TOP[path], None
    raise ValueError(f"LoRA {path}: no module of Flux.2's kohya layout holds it (modulation and guidance layers have "
                     "none); leave it out of lora.target_modules for a kohya file")


def kohya_lora_state(layers: dict[str, kohya.LoraFactors], config: Any) -> dict[str, torch.Tensor]:
    """The transformer's adapters (diffusers' module path -> factors) in kohya's keys (see above)."""
    width = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    return kohya.grouped_keys(layers, lora_module, ("q", "k", "v"), (width,) * 3)


# --------------------------------------------------------------------------------------------------- single files
# The transformer alone in Black Forest Labs' layout (flux2-dev.safetensors, flux-2-klein-*.safetensors: ComfyUI's
# diffusion_models/ files), bare or under ComfyUI's ``model.diffusion_model.``. It fuses each double block's q, k and
# v into one ``qkv`` (its text stream's too), names the norms' weights ``scale`` and keeps the final modulation's
# rows as (shift, scale) where diffusers has (scale, shift). Reading is diffusers' own conversion
# (convert_flux2_transformer_checkpoint_to_diffusers), applied a tensor at a time; writing is its inverse. The sizes
# come from the tensors, the other settings (RoPE axes and theta, the norms' eps) from what a file sdtrain writes
# carries under LAYOUT_CONFIG_KEY, else the released models'. dev holds a guidance embedding, klein none.

BFL_PREFIXES = ("model.diffusion_model.", "")
BFL_MARK = "double_stream_modulation_img.lin.weight"
"""A key only Flux.2's original layout holds."""
SHAPE_KEYS = frozenset({"in_channels", "out_channels", "num_layers", "num_single_layers", "attention_head_dim",
                        "num_attention_heads", "joint_attention_dim", "timestep_guidance_channels", "mlp_ratio",
                        "guidance_embeds"})
_BFL_TOP = {"x_embedder": "img_in", "context_embedder": "txt_in",
            "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
            "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
            "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
            "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
            "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
            "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
            "single_stream_modulation.linear": "single_stream_modulation.lin", "proj_out": "final_layer.linear",
            "norm_out.linear": "final_layer.adaLN_modulation.1"}
_BFL_DOUBLE = {"attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
               "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm",
               "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj", "ff.linear_in": "img_mlp.0",
               "ff.linear_out": "img_mlp.2", "ff_context.linear_in": "txt_mlp.0", "ff_context.linear_out": "txt_mlp.2"}
_BFL_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2", "attn.norm_q": "norm.query_norm",
               "attn.norm_k": "norm.key_norm"}
_BFL_QKV = {("to_q", "to_k", "to_v"): "img_attn.qkv", ("add_q_proj", "add_k_proj", "add_v_proj"): "txt_attn.qkv"}


def bfl_prefix(keys: Iterable[str]) -> str | None:
    """The prefix a file holds Flux.2's transformer under in BFL's layout, None when it holds none."""
    keys = set(keys)
    return next((prefix for prefix in BFL_PREFIXES if prefix + BFL_MARK in keys), None)


def to_bfl(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Flux2Transformer2DModel state dict -> BFL's keys (no prefix); ValueError for a key with no place there."""
    state, out = dict(state), {}
    for key in [k for k in state if k.startswith("transformer_blocks.")]:
        block, rest = key.split(".", 2)[1], key.split(".", 2)[2]
        module, end = rest.rsplit(".", 1)
        fused = next((parts for parts in _BFL_QKV if module in (f"attn.{p}" for p in parts)), None)
        if fused is not None:
            if module == f"attn.{fused[0]}":
                out[f"double_blocks.{block}.{_BFL_QKV[fused]}.{end}"] = torch.cat(
                    [state.pop(f"transformer_blocks.{block}.attn.{part}.{end}") for part in fused])
        elif module in _BFL_DOUBLE:
            out[f"double_blocks.{block}.{_BFL_DOUBLE[module]}.{_bfl_end(module, end)}"] = state.pop(key)
    for key in list(state):
        module, end = key.rsplit(".", 1)
        if module.startswith("single_transformer_blocks."):
            _, block, inner = module.split(".", 2)
            if inner in _BFL_SINGLE:
                out[f"single_blocks.{block}.{_BFL_SINGLE[inner]}.{_bfl_end(inner, end)}"] = state.pop(key)
        elif module in _BFL_TOP:
            tensor = state.pop(key)
            out[f"{_BFL_TOP[module]}.{end}"] = original_rows(module, tensor)
    if state:
        raise ValueError(f"{len(state)} weights have no place in Flux.2's original layout (e.g. {next(iter(state))})")
    return out


def _bfl_end(module: str, end: str) -> str:
    return "scale" if module.rsplit(".", 1)[-1].startswith("norm") and end == "weight" else end


def from_bfl(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """One tensor under BFL's `key` (no prefix) -> its diffusers tensors, by diffusers' own conversion."""
    return convert_flux2_transformer_checkpoint_to_diffusers({key: tensor})


def iter_from_bfl(keys: list[str], read: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """BFL's `keys` (no prefix) -> diffusers' (key, tensor) pairs, each original read with `read` when its turn comes,
    so a caller storing them low never holds more than one in full precision."""
    for key in keys:
        yield from from_bfl(key, read(key)).items()


def bfl_config(shapes: Mapping[str, tuple[int, ...]], metadata: Mapping[str, str]) -> dict[str, Any]:
    """The Flux2Transformer2DModel settings of a file's transformer (`shapes`: its BFL keys, no prefix)."""
    def need(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise ValueError(f"no {key}")
        return tuple(shapes[key])

    def count(name: str) -> int:
        return len({key.split(".")[1] for key in shapes if key.startswith(name + ".")})

    settings = {**{k: v for k, v in _DEV.items() if k not in SHAPE_KEYS},
                **json.loads(metadata.get(LAYOUT_CONFIG_KEY) or "{}")}
    width, channels = need("img_in.weight")
    layers, single = count("double_blocks"), count("single_blocks")
    head = need("double_blocks.0.img_attn.norm.query_norm.scale" if layers else
                "single_blocks.0.norm.query_norm.scale")[0]
    mlp = need("double_blocks.0.img_mlp.2.weight")[1] if layers else need("single_blocks.0.linear2.weight")[1] - width
    patch = int(settings.get("patch_size", 1))
    if sum(settings["axes_dims_rope"]) != head:
        # The RoPE axes split a head between them: any other sum fails at the first forward.
        raise ValueError(f"RoPE axes {settings['axes_dims_rope']} do not add up to the {head}-wide heads; a file of "
                         f"another head width must say its axes in the metadata {LAYOUT_CONFIG_KEY}")
    out_channels = need("final_layer.linear.weight")[0] // (patch * patch)
    # diffusers' default (None) is in_channels: said only when different, as a config folder says it.
    return {**{k: v for k, v in settings.items() if k not in SHAPE_KEYS}, "in_channels": channels,
            "out_channels": out_channels if out_channels != channels else None, "num_layers": layers,
            "num_single_layers": single, "attention_head_dim": head, "num_attention_heads": width // head,
            "joint_attention_dim": need("txt_in.weight")[1],
            "timestep_guidance_channels": need("time_in.in_layer.weight")[1], "mlp_ratio": mlp / width,
            "guidance_embeds": "guidance_in.in_layer.weight" in shapes}


def load_transformer_file(path: str | Path, trust_pickle: bool | None = None, frozen_precision: str = "fp32",
                          weights: bool = True) -> Flux2Transformer2DModel:
    """A Flux2Transformer2DModel, in fp32 (or its linear weights stored in `frozen_precision`), from a file of the
    transformer alone in BFL's layout, a tensor at a time: a 64 GB bf16 file stored in NF4 never exists in fp32.
    Without `weights`, only the header is read."""
    return read_transformer_file(
        path, trust_pickle, title="Flux.2", cls=Flux2Transformer2DModel, mark=BFL_MARK, prefix_of=bfl_prefix,
        settings_of=bfl_config, convert=iter_from_bfl,
        frozen_precision=frozen_precision, weights=weights,
        fix="pass a Flux.2 transformer file (flux2-dev.safetensors, flux-2-klein-*.safetensors, or `sdtrain export "
            "--single-file` of a Flux.2 run) or a diffusers transformer folder")


class Flux2Codec(LatentCodec):
    """Flux.2's autoencoder (AutoencoderKLFlux2): its latents patchified 2x2 into four times the channels and
    normalised by the running statistics of its BatchNorm, per patch channel, as the pipelines normalise them."""

    released = {"scaling_factor": 1.0, "shift_factor": None}
    reads_vae_weights = True

    def channels(self, vae_config: Any) -> int:
        return 4 * vae_config.latent_channels

    def downsampling(self, vae_config: Any) -> int:
        return 2 ** len(vae_config.block_out_channels)

    def encode(self, vae: nn.Module, pixels: torch.Tensor) -> DiagonalGaussianDistribution:
        # The posterior's mean and log-variance patchified alike: a permutation of its elements.
        posterior = vae.encode(pixels).latent_dist
        return DiagonalGaussianDistribution(torch.cat([patchify(posterior.mean), patchify(posterior.logvar)], dim=1))

    def decode(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return vae.decode(unpatchify(latents)).sample

    def normalize(self, latents: torch.Tensor, vae: nn.Module) -> torch.Tensor:
        mean = vae.bn.running_mean.float().view(1, -1, 1, 1).to(latents.device)
        std = torch.sqrt(vae.bn.running_var.float().view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device)
        return (latents.float() - mean) / std

    def fit_normalization(self, vae: nn.Module, channel_mean: torch.Tensor, channel_square: torch.Tensor) -> None:
        variance = (channel_square - channel_mean.square() - vae.config.batch_norm_eps).clamp_min(1e-6)
        with torch.no_grad():
            vae.bn.running_mean.copy_(channel_mean)
            vae.bn.running_var.copy_(variance)


FLUX2_CODEC = Flux2Codec()


class Conditioner(causal_lm.LanguageModelText, spec.Conditioner):
    """Flux.2-dev's: Mistral-Small-3.1's language tower, each caption after a fixed system turn."""

    text_encoder_config = MistralConfig

    def tokenize(self, tokenizer: Any, index: int, captions: list[str]) -> dict[str, torch.Tensor]:
        conversations = [[{"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
                          {"role": "user", "content": [{"type": "text", "text": caption.replace("[IMG]", "")}]}]
                         for caption in captions]
        tokens = tokenizer.apply_chat_template(conversations, add_generation_prompt=False, tokenize=True,
                                               return_dict=True, return_tensors="pt", padding="max_length",
                                               truncation=True, max_length=tokenizer.model_max_length)
        return {ids_key(index): tokens["input_ids"], mask_key(index): tokens["attention_mask"]}

    def build_text_encoder(self, name: str, settings: dict[str, Any], tokenizer: Any, key: str) -> nn.Module:
        config = construct(self.text_encoder_config, key, {"vocab_size": len(tokenizer),
                                                           "pad_token_id": tokenizer.pad_token_id, **settings})
        return self.family.components["text_encoder"].cls(config)

    def unused_modules(self, name: str, module: nn.Module) -> list[str]:
        # The language model's layers above the deepest one read, and its final norm.
        if name not in self.family.components.text_encoders:
            return []
        deepest = text_layers(len(module.layers))[-1]
        return [f"layers.{i}" for i in range(deepest, len(module.layers))] + ["norm"]

    def encode_text(self, encoders: list[nn.Module], ids: list[torch.Tensor], captions: list[str] | None,
                    masks: list[torch.Tensor | None] | None = None, sources: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
        encoder = encoders[0]
        layers = text_layers(encoder.config.num_hidden_layers)
        return {"text_emb": causal_lm.stacked_hidden_states(encoder, ids[0], masks[0], layers)}

    def text_shapes(self, text_encoders: dict[str, Any], lengths: list[int]) -> dict[str, tuple[int, ...]]:
        config = text_encoders["text_encoder"]
        return {"text_emb": (lengths[0], len(text_layers(config.num_hidden_layers)) * config.hidden_size)}


class Call(spec.DenoiserCall):
    objective = "flow_matching"

    def settings(self, settings: dict[str, Any], text_encoders: dict[str, nn.Module]) -> dict[str, Any]:
        config = text_encoders["text_encoder"].config
        return {"joint_attention_dim": len(text_layers(config.num_hidden_layers)) * config.hidden_size}

    def shape(self, latent_channels: int, latent_size: int) -> dict[str, Any]:
        # One token per patchified latent pixel; RoPE positions, no fixed table.
        return {"in_channels": latent_channels}

    def downsampling(self, denoiser_config: Any) -> int:
        return 1

    def condition(self, text: dict[str, torch.Tensor], batch: dict[str, Any], device: torch.device
                  ) -> dict[str, Any]:
        return {"encoder_hidden_states": text["text_emb"]}

    def takes_guidance(self, denoiser_config: Any) -> bool:
        return bool(denoiser_config.guidance_embeds)

    def denoise(self, denoiser: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                condition: dict[str, Any]) -> torch.Tensor:
        b, c, h, w = noisy.shape
        context = condition["encoder_hidden_states"]
        text_positions = torch.zeros(context.shape[1], 4, device=noisy.device)
        text_positions[:, 3] = torch.arange(context.shape[1], device=noisy.device)
        output = denoiser(
            hidden_states=noisy.reshape(b, c, h * w).transpose(1, 2), encoder_hidden_states=context,
            # The transformer scales sigma (and guidance) by 1000 itself.
            timestep=timesteps / 1000, guidance=condition.get("guidance"), img_ids=positions(h, w, noisy.device),
            txt_ids=text_positions, return_dict=False)[0]
        return output.transpose(1, 2).reshape(b, c, h, w)


class Files(spec.FileInterchange):
    guidance_distilled = True
    """Whether the family's transformer embeds the guidance (dev's), which tells its files from klein's."""
    denoiser_lora_peft_names = True
    kohya_names_each_layer = False  # its kohya layout fuses q, k and v
    # BFL's release file (see above): the transformer alone.
    single_file = TransformerAlone(
        load_transformer_file, to_bfl, lambda config: "flux2" if config["guidance_embeds"] else "flux2-klein",
        SHAPE_KEYS, description="The {title} transformer alone, in one file in Black Forest Labs' layout",
        comfyui="put `{name}` in `ComfyUI/models/diffusion_models/` and load it with Load Diffusion Model, beside the "
                "model's own text encoder (Load CLIP, type flux2) and `flux2-vae` (Load VAE) files.")

    def holds_file(self, keys: list[str]) -> bool:
        # dev's transformer embeds the guidance, klein's does not: the same layout otherwise.
        prefix = bfl_prefix(keys)
        return prefix is not None and (prefix + "guidance_in.in_layer.weight" in keys) == self.guidance_distilled

    def original_rows(self, component: str, path: str, rows: torch.Tensor) -> torch.Tensor:
        # Black Forest Labs' layout, as Flux.1's.
        return original_rows(path, rows) if component == "transformer" else rows

    def kohya_lora(self, component: str, layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]], config: Any
                   ) -> dict[str, torch.Tensor]:
        if component == "transformer":
            return kohya_lora_state(layers, config)
        return super().kohya_lora(component, layers, config)


class Sampling(spec.Sampling):
    pipeline_class = Flux2Pipeline
    pipeline_names = ("Flux2Pipeline",)

    def pipeline_from_folder(self, folder: str | Path, **kwargs: Any) -> Any:
        # The release's folder names a PixtralProcessor, which transformers builds only with torchvision (and which
        # diffusers checks a passed tokenizer against): the pipeline loads without it and is given the tokenizer
        # alone, all it reads.
        tokenizer = AutoTokenizer.from_pretrained(Path(folder) / self.family.components.tokenizers[0],
                                                  local_files_only=True)
        pipe = super().pipeline_from_folder(folder, tokenizer=None, **kwargs)
        pipe.register_modules(tokenizer=tokenizer)
        return pipe

    def assemble(self, components: dict[str, nn.Module], tokenizers: list[Any], scheduler: Any,
                 distilled: bool = False) -> Any:
        return self.pipeline_class(scheduler=scheduler, vae=components["vae"], text_encoder=components["text_encoder"],
                                   tokenizer=tokenizers[0], transformer=components["transformer"])

    def defaults(self, denoiser_config: Any, distilled: bool = False) -> dict[str, Any]:
        return {"guidance": 4.0}

    def mu(self, image_tokens: int, steps: int) -> float | None:
        # Both pipelines shift by Black Forest Labs' empirical fit over tokens and steps.
        return compute_empirical_mu(image_seq_len=image_tokens, num_steps=steps)

    def arguments(self, pipe: Any, guidance: float, negative_prompt: str | None) -> dict[str, Any]:
        # dev samples with its guidance embedding alone: Flux2Pipeline takes no negative prompt.
        return {**self._text_arguments(pipe), "guidance_scale": guidance}

    def _text_arguments(self, pipe: Any) -> dict[str, Any]:
        # The pipelines' layer defaults are the released depth's; a model of another depth names its own.
        return {"max_sequence_length": min(pipe.tokenizer.model_max_length, causal_lm.TEXT_LENGTH),
                "text_encoder_out_layers": text_layers(pipe.text_encoder.config.get_text_config().num_hidden_layers)}


FLUX2 = spec.ModelFamily(
    name="flux2", title="Flux.2", hub_tags=("flux2", "flux2-diffusers"),
    components=spec.Components(
        vae=spec.Component(AutoencoderKLFlux2, "vae", blocks=vae_blocks),
        # The released text encoder is the whole vision-language model (Mistral3ForConditionalGeneration), its
        # language tower under language_model.model. (model.language_model. as transformers 5 names it).
        # diffusers' Flux.2 LoRA loader adapts the transformer alone.
        text_encoder=causal_lm.text_encoder(MistralModel,
                                            (("model.language_model.", ""), ("language_model.model.", ""))),
        transformer=spec.Component(Flux2Transformer2DModel, "denoiser", kohya_prefix=kohya.PREFIX,
                                   blocks=transformer_blocks),
    ),
    presets={
        "tiny": {"vae": _TINY_VAE, "text_encoder": _TINY_MISTRAL, "transformer": _TINY_DEV, "scheduler": _SCHEDULER},
        "flux2-dev": {"vae": _VAE, "text_encoder": _MISTRAL_SMALL_31, "transformer": _DEV, "scheduler": _SCHEDULER},
    },
    codec=FLUX2_CODEC, conditioner=Conditioner(), denoising=Call(), files=Files(), sampling=Sampling(),
)


class KleinConditioner(Conditioner):
    """Flux.2 klein's: Qwen3, each caption in its chat template with thinking off."""

    text_encoder_config = Qwen3Config

    def tokenize(self, tokenizer: Any, index: int, captions: list[str]) -> dict[str, torch.Tensor]:
        ids, mask = causal_lm.chat_tokens(tokenizer, captions, thinking=False)
        return {ids_key(index): ids, mask_key(index): mask}


class KleinFiles(Files):
    guidance_distilled = False


class KleinSampling(Sampling):
    pipeline_class = Flux2KleinPipeline
    pipeline_names = ("Flux2KleinPipeline",)

    def assemble(self, components: dict[str, nn.Module], tokenizers: list[Any], scheduler: Any,
                 distilled: bool = False) -> Any:
        return Flux2KleinPipeline(scheduler=scheduler, vae=components["vae"], text_encoder=components["text_encoder"],
                                  tokenizer=tokenizers[0], transformer=components["transformer"],
                                  is_distilled=distilled)

    def distilled(self, source: str | Path | None) -> bool:
        # The released folders say it in model_index.json (true for FLUX.2-klein-4B and 9B, false for the -base
        # models); the transformer's config is the same for both. A single file does not say.
        return index_says(source, "is_distilled")

    def defaults(self, denoiser_config: Any, distilled: bool = False) -> dict[str, Any]:
        # The distilled models sample in 4 steps without guidance (Black Forest Labs'), the base models as dev's
        # pipeline default; guidance at 4 on a distilled one would be ignored by the pipeline, or if it were not
        # told, run classifier-free guidance at twice the cost and over-saturate.
        return {"guidance": 1.0, "steps": 4} if distilled else {"guidance": 4.0}

    def arguments(self, pipe: Any, guidance: float, negative_prompt: str | None) -> dict[str, Any]:
        # Classifier-free guidance against the empty prompt (the pipeline takes no other negative); a distilled
        # klein samples without it (its pipeline's is_distilled).
        return {**self._text_arguments(pipe), "guidance_scale": guidance}


FLUX2_KLEIN = spec.ModelFamily(
    name="flux2-klein", title="Flux.2 klein", hub_tags=("flux2", "flux2-klein", "flux2-diffusers"),
    components=spec.Components(
        vae=spec.Component(AutoencoderKLFlux2, "vae", blocks=vae_blocks),
        # The released text encoder is Qwen3ForCausalLM, read as its Qwen3Model. diffusers' Flux.2 LoRA loader
        # adapts the transformer alone.
        text_encoder=causal_lm.text_encoder(Qwen3Model, (("model.", ""),)),
        transformer=spec.Component(Flux2Transformer2DModel, "denoiser", kohya_prefix=kohya.PREFIX,
                                   blocks=transformer_blocks),
    ),
    presets={
        "tiny": {"vae": _TINY_VAE, "text_encoder": _TINY_QWEN3, "transformer": _TINY_KLEIN, "scheduler": _SCHEDULER},
        "flux2-klein-4b": {"vae": _VAE, "text_encoder": causal_lm.QWEN3_4B, "transformer": _KLEIN_4B,
                           "scheduler": _SCHEDULER},
        "flux2-klein-9b": {"vae": _VAE, "text_encoder": _QWEN3_8B, "transformer": _KLEIN_9B, "scheduler": _SCHEDULER},
    },
    codec=FLUX2_CODEC, conditioner=KleinConditioner(), denoising=Call(), files=KleinFiles(), sampling=KleinSampling(),
)
