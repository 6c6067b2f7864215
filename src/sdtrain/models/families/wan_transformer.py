"""What every Wan model's transformer (diffusers' WanTransformer3DModel) shares, whichever release: its blocks, how a
preset's shape and Wan's own initialisation apply to it, how much it downsamples, its file names (Wan's original
layout, see wan_file), and the check that a pipeline sizes latents as its autoencoder makes them. The families
opt in to these parts; what differs (the timesteps it is given, a second expert) stays in each family's module.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from torch import nn

from sdtrain.errors import UserError
from sdtrain.models.families import spec, wan_file
from sdtrain.models.families.codec import LatentCodec
from sdtrain.models.families.umt5 import TEXT_LENGTH


def transformer_blocks(transformer: WanTransformer3DModel) -> list[nn.Module]:
    """The transformer's repeated blocks, in forward order (`spec.Component.blocks`)."""
    return list(transformer.blocks)


def transformer_component() -> spec.Component:
    """A Wan transformer's record: the denoiser, its blocks, and its adapters' second LoRA file in the names ComfyUI
    gives Wan's modules, diffusion_model.<Wan's path> (see WanTransformerFiles)."""
    return spec.Component(WanTransformer3DModel, "denoiser", kohya_prefix=wan_file.LORA_PREFIX,
                          blocks=transformer_blocks)


def video_vae_component() -> spec.Component:
    """A Wan video autoencoder's record. It lists no blocks: its causal convolutions carry a frame cache from call
    to call, which recomputing a block (activation checkpointing) would advance twice."""
    return spec.Component(AutoencoderKLWan, "vae")


class WanTransformerCall(spec.DenoiserCall):
    """A Wan transformer's build, initialisation and conditioning; a family gives its own `denoise`."""

    objective = "flow_matching"

    def settings(self, settings: dict[str, Any], text_encoders: dict[str, nn.Module]) -> dict[str, Any]:
        return {"text_dim": text_encoders["text_encoder"].config.d_model}

    def shape(self, latent_channels: int, latent_size: int) -> dict[str, Any]:
        # The transformer patches the latents itself, and RoPE has no fixed table of sizes (see max_latent_side).
        return {"in_channels": latent_channels, "out_channels": latent_channels}

    def initialise(self, denoiser: nn.Module) -> bool:
        # Wan's own (WanModel.init_weights) on diffusers' modules, in their order: Xavier-uniform weights and zero
        # biases for every linear layer; the patch embedding Xavier-uniform over its flattened kernel (its bias
        # kept); N(0, 0.02) for the text and time embedders' layers; the output projection (head.head) zero. The
        # modulation tables keep the N(0, 1 / width) they are built with, as Wan's are.
        for module in denoiser.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        with torch.no_grad():
            nn.init.xavier_uniform_(denoiser.patch_embedding.weight.view(denoiser.patch_embedding.weight.shape[0], -1))
        embedders = denoiser.condition_embedder
        for module in (*embedders.text_embedder.modules(), *embedders.time_embedder.modules()):
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        nn.init.zeros_(denoiser.proj_out.weight)
        return True

    def downsampling(self, denoiser_config: Any) -> int:
        # A latent side must be whole patches (1x2x2: the frames are not patched).
        _, height, width = denoiser_config.patch_size
        return math.lcm(height, width)

    def max_latent_side(self, denoiser_config: Any) -> int | None:
        # RoPE's tables cover rope_max_seq_len patches along each axis.
        return denoiser_config.rope_max_seq_len * min(denoiser_config.patch_size[1:])

    def condition(self, text: dict[str, torch.Tensor], batch: dict[str, Any], device: torch.device
                  ) -> dict[str, Any]:
        return {"encoder_hidden_states": text["text_emb"]}

    def denoise(self, denoiser: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                condition: dict[str, Any]) -> torch.Tensor:
        # One timestep per sample, sigma * 1000, as WanPipeline gives its transformer (or either expert).
        check_clip_latents(noisy, self.family.title)
        return denoiser(hidden_states=noisy, timestep=timesteps,
                        encoder_hidden_states=condition["encoder_hidden_states"], return_dict=False)[0]


def check_clip_latents(noisy: torch.Tensor, title: str) -> None:
    """One line where a Wan transformer is given anything but clips' latents (B, C, t, h, w)."""
    if noisy.dim() != 5:
        raise UserError(f"{title} denoises clips' latents (B, C, t, h, w), a still image's as t = 1, not a tensor "
                        f"of shape {tuple(noisy.shape)}")


def guidance_arguments(pipe: Any, guidance: float, negative_prompt: str | None) -> dict[str, Any]:
    """A WanPipeline call's guidance settings: classifier-free guidance against the negative prompt (None: the empty
    caption, which caption dropout trains), and caption tokens as training read them (a folder's tokenizer saying
    "no limit": the release's 512)."""
    length = pipe.tokenizer.model_max_length
    return {"guidance_scale": guidance, "negative_prompt": negative_prompt,
            "max_sequence_length": length if length < 100_000 else TEXT_LENGTH}


class WanTransformerFiles(spec.FileInterchange):
    """A Wan transformer's files: alone in Wan's original layout (Wan-AI's and ComfyUI's, see wan_file), its LoRA's
    second file in the names ComfyUI's Wan loader applies whole and diffusers' converts."""

    # The transformer alone in Wan's original layout, as Wan-AI's and ComfyUI's files hold it (see wan_file).
    single_file = wan_file.TRANSFORMER_FILE
    # The diffusers file keeps peft's names: diffusers' converter renames attention projections alone, which would
    # leave the feed-forward's adapters (ffn.net.0.proj, ffn.net.2) in another naming the loader drops.
    denoiser_lora_peft_names = True

    # The second file (lora_kohya.safetensors) is in the names ComfyUI's Wan loader applies whole and diffusers' Wan
    # loader converts: diffusion_model.<Wan's module path> (wan_file), not kohya's underscored ones.
    def kohya_lora(self, component: str, layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]], config: Any
                   ) -> dict[str, torch.Tensor]:
        if component == self.family.components.denoiser:
            return wan_file.lora_state(layers)
        return super().kohya_lora(component, layers, config)

    def kohya_lora_name(self, component: str, path: str, config: Any) -> str:
        if component == self.family.components.denoiser:
            return wan_file.lora_name(path)
        return super().kohya_lora_name(component, path, config)

    def original_module_path(self, component: str, path: str, config: Any) -> str:
        if component == self.family.components.denoiser:
            return wan_file.original_module_path(path)
        return path


def check_scale_factors(vae: nn.Module, codec: LatentCodec) -> None:
    """One line where the autoencoder's config says scale factors other than its structure's: WanPipeline sizes its
    latents by the config's (``scale_factor_spatial``, ``scale_factor_temporal``), not by the autoencoder's blocks."""
    told = (vae.config.scale_factor_spatial, vae.config.scale_factor_temporal)
    built = (codec.downsampling(vae.config), codec.clip_frames(vae.config))
    if told != built:
        raise UserError(f"model.components.vae.overrides: the autoencoder downsamples {built[0]}x a side and "
                        f"{built[1]}x in time, but its scale_factor_spatial and scale_factor_temporal say "
                        f"{told[0]} and {told[1]}, which WanPipeline sizes latents by; set them to {built[0]} "
                        f"and {built[1]}")
