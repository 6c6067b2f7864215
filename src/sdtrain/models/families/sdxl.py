"""Stable Diffusion XL (Podell et al., 2023), the base model: an AutoencoderKL, two text encoders (OpenAI
CLIP ViT-L and OpenCLIP ViT-bigG with its projection) and a UNet2DConditionModel with ``text_time``
micro-conditioning.

The conditioner follows SDXL's own: both encoders' penultimate hidden states concatenated (768 + 1280 =
2048 wide) for cross-attention, the projected pooled output of the second for the added embedding, and
each image's original size, crop corner and training size as six ids. An empty caption (caption dropout)
conditions on zeros, as SDXL was trained and as its pipeline samples the unconditional half
(``force_zeros_for_empty_prompt``).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    StableDiffusionXLControlNetPipeline,
    StableDiffusionXLInstructPix2PixPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from torch import nn
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from sdtrain.models.families import spec
from sdtrain.models.families.autoencoder import SD_VAE, TINY_VAE, vae_blocks
from sdtrain.models.families.clip import ClipTokenizerFromScratch
from sdtrain.models.families.codec import AutoencoderKLCodec
from sdtrain.models.families.ldm_checkpoint import ORIGINAL_CHECKPOINT, ScheduleInFile
from sdtrain.models.families.ldm_unet import original_unet_path
from sdtrain.models.families.text_towers import (
    CLIP_L,
    OPENCLIP_BIGG,
    TINY_CLIP,
    TINY_CLIP_WIDER,
    clip_text_config,
    penultimate_states,
    text_blocks,
)
from sdtrain.models.families.unet import UNetCall, unet_blocks, unet_control, unet_instruct

_SDXL_VAE = {**SD_VAE, "scaling_factor": 0.13025, "sample_size": 1024}
# The SDXL 1.0 base UNet: 2,567,463,684 parameters (its cross-attention width and added-embedding input
# come from the text encoders, see Call.settings).
_SDXL_UNET = dict(
    block_out_channels=[320, 640, 1280],
    layers_per_block=2,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    transformer_layers_per_block=[1, 2, 10],
    attention_head_dim=[5, 10, 20],
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    norm_num_groups=32,
)
# SDXL's structure (attention from the second level on, linear projections, text_time) at a size tests train.
_TINY_UNET = {**_SDXL_UNET, "block_out_channels": [32, 64, 64], "layers_per_block": 1,
              "transformer_layers_per_block": [1, 1, 2], "attention_head_dim": [2, 4, 4],
              "addition_time_embed_dim": 8, "norm_num_groups": 8}

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"vae": TINY_VAE, "text_encoder": TINY_CLIP, "text_encoder_2": TINY_CLIP_WIDER, "unet": _TINY_UNET},
    "sdxl": {"vae": _SDXL_VAE, "text_encoder": CLIP_L, "text_encoder_2": OPENCLIP_BIGG, "unet": _SDXL_UNET},
}

SIZE_IDS = 6
"""Original height and width, crop top and left, target height and width."""


class Conditioner(ClipTokenizerFromScratch, spec.Conditioner):
    def build_text_encoder(self, name: str, settings: dict[str, Any], tokenizer: Any, key: str) -> nn.Module:
        cls = self.family.components[name].cls
        return cls(clip_text_config(settings, tokenizer, key))

    def encode_text(self, encoders: list[nn.Module], ids: list[torch.Tensor], captions: list[str] | None,
                    masks: list[torch.Tensor | None] | None = None, sources: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
        states = []
        for encoder, tokens in zip(encoders, ids):
            output, penultimate = penultimate_states(encoder, tokens)
            # The last layer and the final norm take part with weight zero, so that every parameter of a trained
            # encoder gets a gradient each step, as DDP requires.
            states.append(penultimate + 0 * output.last_hidden_state)
        pooled = output.text_embeds  # the second encoder's projection of its eos state
        text_emb = torch.cat(states, dim=-1)
        if captions is None:
            return {"text_emb": text_emb, "text_pooled": pooled}
        keep = torch.tensor([bool(c) for c in captions], device=text_emb.device, dtype=text_emb.dtype)
        return {"text_emb": text_emb * keep[:, None, None], "text_pooled": pooled * keep[:, None]}

    def text_shapes(self, text_encoders: dict[str, Any], lengths: list[int]) -> dict[str, tuple[int, ...]]:
        first, second = (text_encoders[name] for name in self.family.components.text_encoders)
        return {"text_emb": (lengths[0], first.hidden_size + second.hidden_size),
                "text_pooled": (second.projection_dim,)}


class Call(UNetCall):
    objective = "noise_prediction"

    def settings(self, settings: dict[str, Any], text_encoders: dict[str, nn.Module]) -> dict[str, Any]:
        first, second = (text_encoders[name].config for name in self.family.components.text_encoders)
        return {"cross_attention_dim": first.hidden_size + second.hidden_size,
                "projection_class_embeddings_input_dim": SIZE_IDS * settings["addition_time_embed_dim"]
                + second.projection_dim}

    def condition(self, text: dict[str, torch.Tensor], batch: dict[str, Any], device: torch.device
                  ) -> dict[str, Any]:
        size_ids = batch["size_ids"].to(device, dtype=torch.float32, non_blocking=True)
        return {"encoder_hidden_states": text["text_emb"],
                "added_cond_kwargs": {"text_embeds": text["text_pooled"], "time_ids": size_ids}}


class Files(ScheduleInFile, spec.FileInterchange):
    single_file_keys = ("conditioner.embedders.",)
    single_file = ORIGINAL_CHECKPOINT
    # A1111's and ComfyUI's SDXL embeddings: one entry per text encoder.
    embedding_keys = ("clip_l", "clip_g")

    def original_module_path(self, component: str, path: str, config: Any) -> str:
        # kohya's SDXL LoRAs name UNet modules in the original (SGM) layout: input_blocks.4.1..., not down_blocks.
        return original_unet_path(path, config) if component == "unet" else path


class Sampling(spec.Sampling):
    pipeline_class = StableDiffusionXLPipeline
    pipeline_names = ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline")

    def assemble(self, components: dict[str, nn.Module], tokenizers: list[Any], scheduler: Any,
                 distilled: bool = False) -> Any:
        return StableDiffusionXLPipeline(
            vae=components["vae"], text_encoder=components["text_encoder"],
            text_encoder_2=components["text_encoder_2"], tokenizer=tokenizers[0], tokenizer_2=tokenizers[-1],
            unet=components["unet"], scheduler=scheduler, force_zeros_for_empty_prompt=True, add_watermarker=False)

    def defaults(self, denoiser_config: Any, distilled: bool = False) -> dict[str, Any]:
        return {"guidance": 5.0}


SDXL = spec.ModelFamily(
    name="sdxl", title="SDXL", hub_tags=("stable-diffusion-xl", "stable-diffusion-xl-diffusers"),
    components=spec.Components(
        vae=spec.Component(AutoencoderKL, "vae", blocks=vae_blocks),
        text_encoder=spec.Component(CLIPTextModel, "text_encoder", tokenizer="tokenizer", lora=True,
                                    kohya_prefix="lora_te1_", blocks=text_blocks),
        text_encoder_2=spec.Component(CLIPTextModelWithProjection, "text_encoder", tokenizer="tokenizer_2",
                                      lora=True, kohya_prefix="lora_te2_", blocks=text_blocks),
        unet=spec.Component(UNet2DConditionModel, "denoiser", kohya_prefix="lora_unet_", blocks=unet_blocks),
    ),
    presets=PRESETS, codec=AutoencoderKLCodec(scaling_factor=_SDXL_VAE["scaling_factor"]),
    conditioner=Conditioner(), denoising=Call(), files=Files(), sampling=Sampling(),
    controlnet=unet_control(StableDiffusionXLControlNetPipeline),
    instruct=unet_instruct(StableDiffusionXLInstructPix2PixPipeline),
)
