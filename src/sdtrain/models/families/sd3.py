"""Stable Diffusion 3 and 3.5 (Esser et al., 2024): a 16-channel AutoencoderKL with a shift, three text encoders
(OpenAI CLIP ViT-L and OpenCLIP ViT-bigG, both with their projections, and T5-XXL) and a rectified-flow MMDiT
(SD3Transformer2DModel: joint attention over image patches and text tokens; 3.5's extra image self-attention
and query-key norms are settings of the same class).

The conditioner follows StableDiffusion3Pipeline.encode_prompt: both CLIPs' penultimate hidden states side by side
(768 + 1280 = 2048 wide), zero-padded to T5's width (4096) and followed on the sequence axis by T5's last hidden
states (77 + 256 tokens); the two projected pooled outputs side by side (2048) as the global vector. An empty
caption (caption dropout) is encoded like any other, as the pipeline encodes its negative prompt "" (SD3 has no
``force_zeros_for_empty_prompt``). The transformer patches the latents itself (patch_size 2) and takes timesteps
on the 0..1000 scale, as the pipeline passes the scheduler's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKL,
    SD3ControlNetModel,
    SD3Transformer2DModel,
    StableDiffusion3ControlNetPipeline,
    StableDiffusion3Pipeline,
)
from torch import nn
from transformers import CLIPTextModelWithProjection, T5EncoderModel

from sdtrain.errors import UserError
from sdtrain.models.families import spec
from sdtrain.models.families.autoencoder import FLUX_VAE, TINY_FLUX_VAE, vae_blocks
from sdtrain.models.families.clip import ClipTokenizerFromScratch
from sdtrain.models.families.codec import AutoencoderKLCodec
from sdtrain.models.families.sd3_checkpoint import StabilityCheckpoint
from sdtrain.models.families.spec import ControlSpec
from sdtrain.models.families.text_towers import (
    CLIP_L,
    OPENCLIP_BIGG,
    T5_XXL,
    TINY_CLIP,
    TINY_CLIP_WIDER,
    TINY_T5,
    clip_text_config,
    penultimate_states,
    t5_blocks,
    t5_config,
    text_blocks,
)

# SD3's autoencoder: Flux.1's shape (16 channels, no quant convs) with its own centring and scale.
_SD3_VAE = {**FLUX_VAE, "shift_factor": 0.0609, "scaling_factor": 1.5305}
# SD3-medium: 2,028,328,000 parameters (its context and pooled widths come from T5 and the CLIPs, see
# Call.settings; in/out channels and sample_size from the latents, see Call.shape).
_SD3_MEDIUM = dict(patch_size=2, num_layers=24, attention_head_dim=64, num_attention_heads=24,
                   caption_projection_dim=1536, pos_embed_max_size=192)
# The scheduler SD3 was released with: a static shift of 3.
_SD3_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)

# T5 must be at least as wide as the two CLIPs side by side (32 + 48): their states are zero-padded to its width.
_TINY_T5 = {**TINY_T5, "d_model": 96, "d_kv": 16, "d_ff": 128}
# SD3.5-medium's structure (image self-attention in the first blocks, RMS query-key norms) at a size tests train;
# the caption projection is the transformer's width (heads x head width), as joint attention requires. 16
# positions a side cover 128 px square images through the 4x tiny VAE and 2x2 patches.
_TINY_SD3 = dict(patch_size=2, num_layers=2, attention_head_dim=16, num_attention_heads=2, caption_projection_dim=32,
                 pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm")

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"vae": TINY_FLUX_VAE, "text_encoder": TINY_CLIP, "text_encoder_2": TINY_CLIP_WIDER,
             "text_encoder_3": _TINY_T5, "transformer": _TINY_SD3, "scheduler": _SD3_SCHEDULER},
    "sd3-medium": {"vae": _SD3_VAE, "text_encoder": CLIP_L, "text_encoder_2": OPENCLIP_BIGG,
                   "text_encoder_3": T5_XXL, "transformer": _SD3_MEDIUM, "scheduler": _SD3_SCHEDULER},
}

T5_TEXT_LENGTH = 256
"""T5's tokens per caption when ``model.t5_text_length`` is unset: StableDiffusion3Pipeline's max_sequence_length."""


def transformer_blocks(transformer: SD3Transformer2DModel) -> list:
    return list(transformer.transformer_blocks)


def controlnet_from_transformer(transformer: SD3Transformer2DModel, latent_factor: int) -> SD3ControlNetModel:
    """An SD3ControlNetModel of the first half of `transformer`'s blocks (SD3-medium's 24 give diffusers' 12), their
    weights, the embedders' and the position table copied, its input and output layers zero: it starts by adding
    nothing. It reads the conditioning image's latents, as diffusers' SD3 ControlNet pipeline gives them."""
    # Built from a copy of the config: SD3ControlNetModel.from_transformer writes its settings into the
    # transformer's own. The last block's context is not carried on (context_pre_only), so it is never copied.
    if transformer.config.num_layers < 2:
        raise UserError(f"mode controlnet: SD3's ControlNet copies the transformer's first blocks but its last; this "
                        f"one has {transformer.config.num_layers} block")
    config = {**transformer.config, "num_layers": max(1, transformer.config.num_layers // 2),
              "extra_conditioning_channels": 0}
    controlnet = SD3ControlNetModel.from_config(config)
    for name in ("pos_embed", "time_text_embed", "context_embedder"):
        getattr(controlnet, name).load_state_dict(getattr(transformer, name).state_dict())
    controlnet.transformer_blocks.load_state_dict(transformer.transformer_blocks.state_dict(), strict=False)
    return controlnet.to(next(transformer.parameters()).dtype)


def control_latents(vae: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The conditioning images' latents as StableDiffusion3ControlNetPipeline gives them to a ControlNet that zeroes
    the pooled text (ours, InstantX's; ComfyUI likewise): scaled, not shifted."""
    return vae.encode(images * 2 - 1).latent_dist.mode() * vae.config.scaling_factor


def controlnet_residuals(controlnet: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                         condition: dict[str, Any], latents: torch.Tensor) -> dict[str, Any]:
    """What each of the transformer's first blocks adds, as StableDiffusion3ControlNetPipeline computes it: the
    ControlNet reads the text and, where its config says so (diffusers' default), zeros for the pooled text."""
    config = getattr(controlnet, "module", controlnet).config  # under DDP, the wrapped model's
    pooled = condition["pooled_projections"]
    samples = controlnet(hidden_states=noisy, controlnet_cond=latents.to(noisy.dtype), timestep=timesteps,
                         encoder_hidden_states=condition["encoder_hidden_states"],
                         pooled_projections=torch.zeros_like(pooled) if config.force_zeros_for_pooled_projection
                         else pooled, return_dict=False)[0]
    return {"block_controlnet_hidden_states": samples}


class Conditioner(ClipTokenizerFromScratch, spec.Conditioner):
    def long_text_length(self, preset: str, denoiser_source: str | Path | None = None) -> int:
        return T5_TEXT_LENGTH

    def build_text_encoder(self, name: str, settings: dict[str, Any], tokenizer: Any, key: str) -> nn.Module:
        if name == "text_encoder_3":
            return T5EncoderModel(t5_config(settings, tokenizer, key))
        return CLIPTextModelWithProjection(clip_text_config(settings, tokenizer, key))

    def encode_text(self, encoders: list[nn.Module], ids: list[torch.Tensor], captions: list[str] | None,
                    masks: list[torch.Tensor | None] | None = None, sources: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
        states, pooled = [], []
        for encoder, tokens in zip(encoders[:2], ids[:2]):
            output, penultimate = penultimate_states(encoder, tokens)
            # The last layer and the final norm take part with weight zero, so that every parameter of a trained
            # encoder gets a gradient each step, as DDP requires.
            states.append(penultimate + 0 * output.last_hidden_state)
            pooled.append(output.text_embeds)
        t5 = encoders[2](ids[2]).last_hidden_state
        clip = torch.cat(states, dim=-1)
        clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {"text_emb": torch.cat([clip, t5], dim=-2), "text_pooled": torch.cat(pooled, dim=-1)}

    def text_shapes(self, text_encoders: dict[str, Any], lengths: list[int]) -> dict[str, tuple[int, ...]]:
        # The CLIPs' states, then T5's on the sequence axis.
        first, second, t5 = (text_encoders[name] for name in self.family.components.text_encoders)
        return {"text_emb": (lengths[0] + lengths[2], t5.d_model),
                "text_pooled": (first.projection_dim + second.projection_dim,)}

    def unused_modules(self, name: str, module: nn.Module) -> list[str]:
        # Only image states leave a ControlNet: its last block's text path computes what nothing reads.
        if not isinstance(module, SD3ControlNetModel):
            return []
        last = f"transformer_blocks.{len(module.transformer_blocks) - 1}"
        return [f"{last}.attn.to_add_out", f"{last}.ff_context", f"{last}.norm2_context"]


class Call(spec.DenoiserCall):
    objective = "flow_matching"

    def settings(self, settings: dict[str, Any], text_encoders: dict[str, nn.Module]) -> dict[str, Any]:
        first, second, t5 = (text_encoders[name].config for name in self.family.components.text_encoders)
        clip_width = first.hidden_size + second.hidden_size
        if t5.d_model < clip_width:
            raise UserError(f"model.components.text_encoder_3.overrides: T5's d_model {t5.d_model} is narrower "
                            f"than the two CLIPs' states side by side ({first.hidden_size} + {second.hidden_size}), "
                            f"which SD3 zero-pads to T5's width; set d_model to {clip_width} or more")
        # The latents' patches must fit the position table; a preset's larger table (SD3's 192) is kept.
        patches = math.ceil(settings["sample_size"] / settings["patch_size"])
        return {"joint_attention_dim": t5.d_model,
                "pooled_projection_dim": first.projection_dim + second.projection_dim,
                "pos_embed_max_size": max(settings.get("pos_embed_max_size") or 0, patches)}

    def shape(self, latent_channels: int, latent_size: int) -> dict[str, Any]:
        # pos_embed_max_size, which must cover latent_size / patch_size, is raised in `settings`, which sees the
        # patch size and the preset's table.
        return {"in_channels": latent_channels, "out_channels": latent_channels, "sample_size": latent_size}

    def max_latent_side(self, denoiser_config: Any) -> int | None:
        return denoiser_config.pos_embed_max_size * denoiser_config.patch_size

    def downsampling(self, denoiser_config: Any) -> int:
        return denoiser_config.patch_size

    def condition(self, text: dict[str, torch.Tensor], batch: dict[str, Any], device: torch.device
                  ) -> dict[str, Any]:
        return {"encoder_hidden_states": text["text_emb"], "pooled_projections": text["text_pooled"]}

    def denoise(self, denoiser: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                condition: dict[str, Any]) -> torch.Tensor:
        # Timesteps as the pipeline passes them: sigma * 1000.
        return denoiser(hidden_states=noisy, timestep=timesteps,
                        encoder_hidden_states=condition["encoder_hidden_states"],
                        pooled_projections=condition["pooled_projections"],
                        block_controlnet_hidden_states=condition.get("block_controlnet_hidden_states"),
                        return_dict=False)[0]


class Files(spec.FileInterchange):
    single_file_keys = ("model.diffusion_model.joint_blocks.",)
    single_file = StabilityCheckpoint()
    denoiser_lora_peft_names = True
    # No kohya layout: sdtrain writes diffusers' LoRA file alone, which ComfyUI reads for SD3.
    comfyui_reads_diffusers_lora = True


class Sampling(spec.Sampling):
    pipeline_class = StableDiffusion3Pipeline
    pipeline_names = ("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline",
                      "StableDiffusion3InpaintPipeline")

    def assemble(self, components: dict[str, nn.Module], tokenizers: list[Any], scheduler: Any,
                 distilled: bool = False) -> Any:
        return StableDiffusion3Pipeline(
            transformer=components["transformer"], scheduler=scheduler, vae=components["vae"],
            text_encoder=components["text_encoder"], tokenizer=tokenizers[0],
            text_encoder_2=components["text_encoder_2"], tokenizer_2=tokenizers[1],
            text_encoder_3=components["text_encoder_3"], tokenizer_3=tokenizers[2])

    def defaults(self, denoiser_config: Any, distilled: bool = False) -> dict[str, Any]:
        return {"guidance": 5.0}

    def arguments(self, pipe: Any, guidance: float, negative_prompt: str | None) -> dict[str, Any]:
        # T5 reads as many tokens as it was trained with.
        tokenizer = getattr(pipe, "tokenizer_3", None)
        length = tokenizer.model_max_length if tokenizer is not None else T5_TEXT_LENGTH
        return {"guidance_scale": guidance, "negative_prompt": negative_prompt, "max_sequence_length": length}


SD3 = spec.ModelFamily(
    name="sd3", title="SD3", hub_tags=("sd3", "sd3-diffusers"),
    components=spec.Components(
        vae=spec.Component(AutoencoderKL, "vae", blocks=vae_blocks),
        # diffusers' SD3 LoRA loader (and its training script) adapts the two CLIPs; T5 stays frozen.
        text_encoder=spec.Component(CLIPTextModelWithProjection, "text_encoder", tokenizer="tokenizer", lora=True,
                                    blocks=text_blocks),
        text_encoder_2=spec.Component(CLIPTextModelWithProjection, "text_encoder", tokenizer="tokenizer_2",
                                      lora=True, blocks=text_blocks),
        text_encoder_3=spec.Component(T5EncoderModel, "text_encoder", tokenizer="tokenizer_3", long_text=True,
                                      blocks=t5_blocks),
        transformer=spec.Component(SD3Transformer2DModel, "denoiser", blocks=transformer_blocks),
    ),
    presets=PRESETS, codec=AutoencoderKLCodec(**{key: _SD3_VAE[key] for key in ("scaling_factor", "shift_factor")}),
    conditioner=Conditioner(), denoising=Call(), files=Files(), sampling=Sampling(),
    controlnet=ControlSpec(SD3ControlNetModel, StableDiffusion3ControlNetPipeline, controlnet_from_transformer,
                           controlnet_residuals, control_latents, image_argument="control_image",
                           blocks=transformer_blocks,
                           caption_dropout=0.0),  # diffusers' train_controlnet_sd3.py drops none
)
