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

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL, ZImagePipeline, ZImageTransformer2DModel
from torch import nn
from transformers import Qwen3Config, Qwen3Model

from sdtrain.models import single_file
from sdtrain.models.families import causal_lm
from sdtrain.models.families.autoencoder import FLUX_VAE, TINY_FLUX_VAE, vae_blocks
from sdtrain.models.families.spec import ModelFamily, SingleFileLayout, construct
from sdtrain.models.single_file import zimage as original_layout

# Qwen3-4B, the released text encoder (read as Qwen3Model: no language-model head).
_QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=True, vocab_size=151936)
# Z-Image's 6B transformer (Z-Image-Turbo's transformer/config.json; the caption width comes from the text
# encoder, see denoiser_settings).
_ZIMAGE = dict(all_patch_size=[2], all_f_patch_size=[1], dim=3840, n_layers=30, n_refiner_layers=2, n_heads=30,
               n_kv_heads=30, norm_eps=1e-5, qk_norm=True, rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48],
               axes_lens=[1536, 512, 512])
_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
TEXT_LAYER = -2
"""The hidden layer the transformer reads: the last decoder layer's input (ZImagePipeline's hidden_states[-2])."""
TEXT_LENGTH = 512
"""Tokens per templated caption when ``model.t5_text_length`` is unset: ZImagePipeline's max_sequence_length."""

_TINY_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=512)
# The released structure (refiners, joint layers, RoPE axes adding up to the head width) at a size tests train.
_TINY_ZIMAGE = dict(all_patch_size=[2], all_f_patch_size=[1], dim=32, n_layers=2, n_refiner_layers=1, n_heads=2,
                    n_kv_heads=2, qk_norm=True, axes_dims=[8, 4, 4], axes_lens=[512, 64, 64])

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"vae": TINY_FLUX_VAE, "text_encoder": _TINY_TEXT, "transformer": _TINY_ZIMAGE, "scheduler": _SCHEDULER},
    "z-image": {"vae": FLUX_VAE, "text_encoder": _QWEN3_4B, "transformer": _ZIMAGE, "scheduler": _SCHEDULER},
}


def transformer_blocks(transformer: ZImageTransformer2DModel) -> list[nn.Module]:
    return [*transformer.noise_refiner, *transformer.context_refiner, *transformer.layers]


class TransformerFile(SingleFileLayout):
    """Tongyi-MAI's release file (and ComfyUI's ``diffusion_models/`` one): the transformer alone, in its authors'
    layout (`sdtrain.models.single_file.zimage`). Its VAE (Flux.1's), Qwen3 text encoder and tokenizer are loaded
    separately, as Z-Image tools load them. bf16 with ``--half``, the released dtype."""

    holds = ("transformer",)
    half_dtype = "bf16"
    description = "The {title} transformer alone, in one file in its authors' layout"
    comfyui = ("put `{name}` in `ComfyUI/models/diffusion_models/` and load it with Load Diffusion Model, beside "
               "Z-Image's own Qwen3 text encoder (Load CLIP) and Flux.1's `ae` autoencoder (Load VAE).")

    def load(self, name: str, path: Path, *, trust_pickle: bool | None, frozen_precision: str, weights: bool,
             latent_constants: Callable[[], dict[str, float | None]]) -> nn.Module:
        # A released file carries no settings beyond its shapes: the released model's.
        return single_file.load_zimage_transformer(path, trust_pickle, frozen_precision=frozen_precision,
                                                   weights=weights, defaults=_ZIMAGE)

    def write(self, out: Path, components: dict[str, nn.Module], *, half: bool, scheduler: Any,
              text_layout: str, text_source: str | Path | None) -> None:
        original_layout.save_original(out, components["transformer"], half=half)

    def diffusers_code(self, pipeline: str, file: str, base: str) -> list[str]:
        return [f"from diffusers import ZImageTransformer2DModel, {pipeline}", "",
                f"transformer = ZImageTransformer2DModel.from_single_file({file}, config={base}, "
                "subfolder=\"transformer\")",
                f"pipe = {pipeline}.from_pretrained({base}, transformer=transformer)"]


class ZImage(ModelFamily):
    name = "z-image"
    title = "Z-Image"
    latent_constants = {key: FLUX_VAE[key] for key in ("scaling_factor", "shift_factor")}
    components = {"vae": AutoencoderKL, "text_encoder": Qwen3Model, "transformer": ZImageTransformer2DModel}
    long_text_tokenizers = ("tokenizer",)
    # diffusers' Z-Image LoRA loader adapts the transformer alone.
    lora_text_encoders = ()
    denoiser = "transformer"
    denoiser_lora_peft_names = True
    objective = "flow_matching"
    pipeline_class = ZImagePipeline
    pipeline_names = ("ZImagePipeline",)
    # The authors' files hold the transformer alone; ComfyUI's put it under model.diffusion_model.
    single_file_keys = ("layers.0.adaLN_modulation.", "model.diffusion_model.layers.0.adaLN_modulation.")
    single_file = TransformerFile()
    block_lists = {ZImageTransformer2DModel: transformer_blocks, Qwen3Model: causal_lm.decoder_layers,
                   AutoencoderKL: vae_blocks}
    presets = PRESETS

    def long_text_length(self, preset: str, denoiser_source: str | Path | None = None) -> int:
        return TEXT_LENGTH

    def train_tokenizer(self, captions: list[str], out_dir: Path, vocab_size: int, max_length: int) -> Any:
        return causal_lm.train_chat_tokenizer(captions, out_dir, vocab_size, max_length)

    def tokenize(self, tokenizer: Any, index: int, captions: list[str]) -> dict[str, torch.Tensor]:
        ids, mask = causal_lm.chat_tokens(tokenizer, captions)
        return {self.ids_key(index): ids, self.mask_key(index): mask}

    def build_text_encoder(self, name: str, settings: dict[str, Any], tokenizer: Any, key: str) -> nn.Module:
        return Qwen3Model(construct(Qwen3Config, key, {"vocab_size": len(tokenizer),
                                                       "pad_token_id": tokenizer.pad_token_id, **settings}))

    def denoiser_settings(self, settings: dict[str, Any], text_encoders: dict[str, nn.Module]) -> dict[str, Any]:
        return {"cap_feat_dim": text_encoders["text_encoder"].config.hidden_size}

    def denoiser_shape(self, latent_channels: int, latent_size: int) -> dict[str, Any]:
        # Any latent size the RoPE axes cover (max_latent_side); the transformer patchifies itself.
        return {"in_channels": latent_channels}

    def downsampling(self, denoiser_config: Any) -> int:
        return denoiser_config.all_patch_size[0]

    def max_latent_side(self, denoiser_config: Any) -> int | None:
        # An image token's row and column positions run over the patches: the RoPE tables' lengths bound them.
        return denoiser_config.all_patch_size[0] * min(denoiser_config.axes_lens[1:])

    def encode_text(self, encoders: list[nn.Module], ids: list[torch.Tensor], captions: list[str] | None,
                    masks: list[torch.Tensor | None] | None = None) -> dict[str, torch.Tensor]:
        mask = masks[0]  # `tokenize` makes one with every caption's ids
        states = causal_lm.hidden_states(encoders[0], ids[0], mask, TEXT_LAYER)
        return {"text_emb": states, "text_mask": mask.to(states.dtype)}

    def text_shapes(self, text_encoders: dict[str, Any], lengths: list[int]) -> dict[str, tuple[int, ...]]:
        return {"text_emb": (lengths[0], text_encoders["text_encoder"].hidden_size), "text_mask": (lengths[0],)}

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

    def assemble(self, components: dict[str, nn.Module], tokenizers: list[Any], scheduler: Any) -> Any:
        return ZImagePipeline(scheduler=scheduler, vae=components["vae"], text_encoder=components["text_encoder"],
                              tokenizer=tokenizers[0], transformer=components["transformer"])

    def sampling_arguments(self, pipe: Any, guidance: float, negative_prompt: str | None) -> dict[str, Any]:
        # ZImagePipeline's guidance_scale g is the step pos + g * (pos - neg): classifier-free guidance at g + 1,
        # off at 0. sdtrain's guidance is the usual scale (1: none), as for every other family.
        return {"guidance_scale": max(guidance - 1.0, 0.0), "negative_prompt": negative_prompt,
                "max_sequence_length": pipe.tokenizer.model_max_length}


ZIMAGE = ZImage()
