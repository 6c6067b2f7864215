"""Stable Diffusion 1.x and 2.x: an AutoencoderKL, one CLIP text encoder (OpenAI CLIP for 1.x, OpenCLIP
ViT-H for 2.x) and a UNet2DConditionModel conditioned on its hidden states."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    StableDiffusionControlNetPipeline,
    StableDiffusionInstructPix2PixPipeline,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from torch import nn
from transformers import CLIPTextModel

from sdtrain.models.families import spec
from sdtrain.models.families.autoencoder import SD_VAE, TINY_VAE, vae_blocks
from sdtrain.models.families.clip import ClipTokenizerFromScratch
from sdtrain.models.families.codec import AutoencoderKLCodec
from sdtrain.models.families.ldm_checkpoint import ORIGINAL_CHECKPOINT, ScheduleInFile
from sdtrain.models.families.text_towers import clip_text_config, text_blocks
from sdtrain.models.families.unet import UNetCall, unet_blocks, unet_control, unet_instruct

_TINY_UNET = dict(
    block_out_channels=[32, 64, 64],
    layers_per_block=1,
    down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    attention_head_dim=8,
    norm_num_groups=8,
)
_SMALL_UNET = {**_TINY_UNET, "block_out_channels": [64, 128, 128]}
# Stable Diffusion 2 base: 865.9M parameters.
_SD2_UNET = dict(
    block_out_channels=[320, 640, 1280, 1280],
    layers_per_block=2,
    down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
    attention_head_dim=[5, 10, 20, 20],
    use_linear_projection=True,
    norm_num_groups=32,
)
_TINY_TEXT = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, projection_dim=64)
_SMALL_TEXT = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                   projection_dim=128)
# The OpenCLIP ViT-H/14 text tower as SD2 uses it (penultimate layer, hence 23 layers).
_SD2_TEXT = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=23, num_attention_heads=16,
                 projection_dim=512, hidden_act="gelu")

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"vae": TINY_VAE, "unet": _TINY_UNET, "text_encoder": _TINY_TEXT},
    "small": {"vae": TINY_VAE, "unet": _SMALL_UNET, "text_encoder": _SMALL_TEXT},
    "sd2": {"vae": SD_VAE, "unet": _SD2_UNET, "text_encoder": _SD2_TEXT},
}


class Conditioner(ClipTokenizerFromScratch, spec.Conditioner):
    def build_text_encoder(self, name: str, settings: dict[str, Any], tokenizer: Any, key: str) -> nn.Module:
        return CLIPTextModel(clip_text_config(settings, tokenizer, key))

    def encode_text(self, encoders: list[nn.Module], ids: list[torch.Tensor], captions: list[str] | None,
                    masks: list[torch.Tensor | None] | None = None, sources: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
        # The last layer's states: SD 2's tower already ends at its penultimate layer (23 of 24 kept).
        return {"text_emb": encoders[0](ids[0])[0]}

    def text_shapes(self, text_encoders: dict[str, Any], lengths: list[int]) -> dict[str, tuple[int, ...]]:
        return {"text_emb": (lengths[0], text_encoders["text_encoder"].hidden_size)}


class Call(UNetCall):
    objective = "noise_prediction"

    def settings(self, settings: dict[str, Any], text_encoders: dict[str, nn.Module]) -> dict[str, Any]:
        return {"cross_attention_dim": text_encoders["text_encoder"].config.hidden_size}


class Files(ScheduleInFile, spec.FileInterchange):
    single_file_keys = ("model.diffusion_model.input_blocks.", "cond_stage_model.", "first_stage_model.")
    single_file = ORIGINAL_CHECKPOINT


class Sampling(spec.Sampling):
    pipeline_class = StableDiffusionPipeline
    # A released SD folder's safety checker is not part of a trained model.
    pipeline_loading = {"safety_checker": None, "requires_safety_checker": False}
    pipeline_names = ("StableDiffusionPipeline",)

    def assemble(self, components: dict[str, nn.Module], tokenizers: list[Any], scheduler: Any,
                 distilled: bool = False) -> Any:
        # Models trained here have no safety checker; the pipeline must be told so explicitly.
        return StableDiffusionPipeline(
            vae=components["vae"], text_encoder=components["text_encoder"], tokenizer=tokenizers[0],
            unet=components["unet"], scheduler=scheduler, safety_checker=None, feature_extractor=None,
            requires_safety_checker=False)

    def defaults(self, denoiser_config: Any, distilled: bool = False) -> dict[str, Any]:
        return {"guidance": 5.0}


SD = spec.ModelFamily(
    name="sd", title="Stable Diffusion 1.x/2.x", hub_tags=("stable-diffusion", "stable-diffusion-diffusers"),
    components=spec.Components(
        vae=spec.Component(AutoencoderKL, "vae", blocks=vae_blocks),
        text_encoder=spec.Component(CLIPTextModel, "text_encoder", tokenizer="tokenizer", lora=True,
                                    kohya_prefix="lora_te_", blocks=text_blocks),
        unet=spec.Component(UNet2DConditionModel, "denoiser", kohya_prefix="lora_unet_", blocks=unet_blocks),
    ),
    presets=PRESETS, codec=AutoencoderKLCodec(scaling_factor=0.18215), conditioner=Conditioner(), denoising=Call(),
    files=Files(), sampling=Sampling(),
    controlnet=unet_control(StableDiffusionControlNetPipeline),
    instruct=unet_instruct(StableDiffusionInstructPix2PixPipeline),
)
