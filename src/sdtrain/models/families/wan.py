"""Wan 2.1 text-to-video (Alibaba's Wan team, 2025): a causal 3D autoencoder (AutoencoderKLWan: 16 channels, 8x
smaller a side, 4x fewer frames after the first), umT5-XXL's encoder as its one text encoder (UMT5EncoderModel), and
a diffusion transformer over 1x2x2 patches of the latent clip (WanTransformer3DModel: self-attention with 3-axis
RoPE over frame, row and column, cross-attention to the text, a shared adaLN modulation of the timestep).

The conditioner follows diffusers' WanPipeline.encode_prompt: each caption cleaned as the pipeline cleans it, padded
on the right to a fixed length (512 tokens, ``max_sequence_length``), read by umT5 under its attention mask; the
transformer reads the last hidden states with the padding's zeroed (it takes no mask). The codec reads clips
(B, 3, 4n + 1, H, W), a still image a clip of one frame, into latents (B, 16, 1 + n, H / 8, W / 8) normalised per
channel; the transformer denoises those latents whole and predicts the velocity ``noise - x0`` at the timestep on
the schedule's 0..1000 scale, as the pipeline calls it: the flow objective's own target.
"""

from __future__ import annotations

from typing import Any

from diffusers import WanPipeline
from torch import nn

from sdtrain.errors import UserError
from sdtrain.models.families import spec, wan_file
from sdtrain.models.families.umt5 import TINY_UMT5, UMT5_XXL, UMT5Conditioner, umt5_component
from sdtrain.models.families.wan_transformer import (
    WanTransformerCall,
    WanTransformerFiles,
    check_scale_factors,
    guidance_arguments,
    transformer_component,
    video_vae_component,
)
from sdtrain.models.families.wan_vae import TINY_WAN_VIDEO_VAE, WAN_VIDEO_CODEC, WAN_VIDEO_VAE

# Wan2.1-T2V-1.3B's transformer (Wan-AI's transformer/config.json): 1,418,996,800 parameters, 1536 wide (12 heads of
# 128); its text width comes from umT5 (Call.settings), its channels from the latents (Call.shape).
_WAN_1_3B = dict(patch_size=[1, 2, 2], num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30,
                 freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
# Wan2.1-T2V-14B's: 14,288,491,584 parameters, 5120 wide (40 heads of 128).
_WAN_14B = {**_WAN_1_3B, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
# The schedules they train and sample at: flow matching under a static shift, the released folders' flow_shift
# (their UniPC sampler's): 3.0 for 1.3B at 480p, 5.0 for 14B at 720p.
_SCHEDULER_480P = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
_SCHEDULER_720P = {**_SCHEDULER_480P, "shift": 5.0}

# The released structure at a size tests train: a transformer whose head width splits into RoPE's three axes
# (8 + 4 + 4), with umT5's and the video autoencoder's tiny ones.
_TINY_WAN = dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=2,
                 freq_dim=32, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"vae": TINY_WAN_VIDEO_VAE, "text_encoder": TINY_UMT5, "transformer": _TINY_WAN,
             "scheduler": _SCHEDULER_480P},
    "wan2.1-t2v-1.3b": {"vae": WAN_VIDEO_VAE, "text_encoder": UMT5_XXL, "transformer": _WAN_1_3B,
                        "scheduler": _SCHEDULER_480P},
    "wan2.1-t2v-14b": {"vae": WAN_VIDEO_VAE, "text_encoder": UMT5_XXL, "transformer": _WAN_14B,
                       "scheduler": _SCHEDULER_720P},
}


class Files(WanTransformerFiles):
    single_file_keys = wan_file.SINGLE_FILE_KEYS


class Sampling(spec.Sampling):
    pipeline_class = WanPipeline
    # WanVideoToVideoPipeline holds the same components (a text-to-video model that edits clips too).
    pipeline_names = ("WanPipeline", "WanVideoToVideoPipeline")

    def assemble(self, components: dict[str, nn.Module], tokenizers: list[Any], scheduler: Any,
                 distilled: bool = False) -> Any:
        return self.prepare(WanPipeline(
            tokenizer=tokenizers[0], text_encoder=components["text_encoder"], vae=components["vae"],
            scheduler=scheduler, transformer=components["transformer"]))

    def prepare(self, pipe: Any) -> Any:
        # Wan 2.2's folders are WanPipeline's too: a second transformer for low noise, or a timestep per token.
        if getattr(pipe, "transformer_2", None) is not None or pipe.config.get("boundary_ratio") is not None \
                or pipe.config.get("expand_timesteps"):
            raise UserError("this WanPipeline folder is Wan 2.2's (two transformers, or a timestep per token); "
                            "sdtrain trains Wan 2.1 (a Wan2.1-T2V-1.3B or -14B folder)")
        check_scale_factors(pipe.vae, self.family.codec)
        return pipe

    def defaults(self, denoiser_config: Any, distilled: bool = False) -> dict[str, Any]:
        return {"guidance": 5.0, "steps": 50}

    def arguments(self, pipe: Any, guidance: float, negative_prompt: str | None) -> dict[str, Any]:
        return guidance_arguments(pipe, guidance, negative_prompt)


WAN = spec.ModelFamily(
    name="wan", title="Wan 2.1", hub_tags=("wan", "wan2.1", "text-to-video"),
    components=spec.Components(
        vae=video_vae_component(),
        # diffusers' Wan LoRA loader (and every Wan trainer) adapts the transformer alone; umT5 stays frozen.
        text_encoder=umt5_component(),
        transformer=transformer_component(),
    ),
    # Each channel has its own mean and deviation, in the VAE's config (latents_mean, latents_std).
    presets=PRESETS, codec=WAN_VIDEO_CODEC, conditioner=UMT5Conditioner(), denoising=WanTransformerCall(),
    files=Files(), sampling=Sampling(),
)
