"""Wan 2.2 TI2V-5B (Alibaba's Wan team, 2025): text-to-video and image-to-video from one model. umT5-XXL's encoder
reads the caption as Wan 2.1's does (see umt5); Wan 2.2's autoencoder (AutoencoderKLWan with a 2x2 patch fold and
residual blocks: 48 channels, 16x smaller a side, 4x fewer frames after the first) makes the latents; a 5B
transformer (WanTransformer3DModel, 3072 wide, 30 layers, 48 channels in and out) denoises them.

What sets it apart is its denoiser call, diffusers' WanPipeline with ``expand_timesteps``: the transformer is given
a timestep for every latent token (1x2x2 patch) rather than one per clip. Drawing from text every token has the
step's; drawing from an image (WanImageToVideoPipeline in that mode) the first latent frame is the image's clean
latents and its tokens' timesteps are 0, the model denoising the frames after it. Training teaches both (see
`Call.conditioned`): a sample is, by an even draw, conditioned on its own first frame, which then stays clean, is
given timestep 0, and is left out of the loss.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import WanImageToVideoPipeline, WanPipeline
from torch import nn

from sdtrain.errors import UserError
from sdtrain.models.families import spec
from sdtrain.models.families.umt5 import TINY_UMT5, UMT5_XXL, UMT5Conditioner, umt5_component
from sdtrain.models.families.wan_transformer import (
    WanTransformerCall,
    WanTransformerFiles,
    check_clip_latents,
    check_scale_factors,
    guidance_arguments,
    transformer_component,
    video_vae_component,
)
from sdtrain.models.families.wan_vae import TINY_WAN22_VIDEO_VAE, WAN22_VIDEO_CODEC, WAN22_VIDEO_VAE

FIRST_FRAME_SHARE = 0.5
"""The share of training clips conditioned on their own first frame (image-to-video); the rest learn text-to-video.
Half and half: one model does both, and Wan's report trains them jointly without publishing a ratio, so neither
task is favoured. Not a config key: a run that wants one task alone trains a model the pipeline then misuses."""
FIRST_FRAME = "first_frame"
"""The conditioning key of each sample's flag (B,) saying its first latent frame is the clean image it is drawn
from: its tokens are given timestep 0 (`Call.denoise`)."""
PATCH = 2
"""The token grid's stride over the latents, as WanPipeline strides its per-token mask (``[:, ::2, ::2]``): the
transformer's 1x2x2 patch, the same in every Wan release."""

# Wan2.2-TI2V-5B's transformer (Wan-AI's transformer/config.json): 4,999,787,712 parameters, 3072 wide (24 heads of
# 128); its text width comes from umT5 (settings), its 48 channels from the latents (shape).
_TI2V_5B = dict(patch_size=[1, 2, 2], num_attention_heads=24, attention_head_dim=128, ffn_dim=14336, num_layers=30,
                freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
# Its schedule: flow matching under the static shift its folder's UniPC sampler has (flow_shift 5.0, for 720p).
_SCHEDULER = dict(num_train_timesteps=1000, shift=5.0, use_dynamic_shifting=False)
# The released structure at a size tests train: a head width that splits into RoPE's three axes (8 + 4 + 4).
_TINY = dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=2,
             freq_dim=32, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"vae": TINY_WAN22_VIDEO_VAE, "text_encoder": TINY_UMT5, "transformer": _TINY, "scheduler": _SCHEDULER},
    "wan2.2-ti2v-5b": {"vae": WAN22_VIDEO_VAE, "text_encoder": UMT5_XXL, "transformer": _TI2V_5B,
                       "scheduler": _SCHEDULER},
}

GUIDANCE = 5.0
"""Classifier-free guidance the release samples with (Wan's ti2v_5B config: sample_guide_scale)."""
STEPS = 50
"""Its sampling steps (sample_steps)."""


def token_timesteps(timesteps: torch.Tensor, latents: torch.Tensor, first_frame: torch.Tensor | None) -> torch.Tensor:
    """The timestep of every token of `latents` (B, C, t, h, w), (B, t * h/2 * w/2), as WanPipeline with
    ``expand_timesteps`` gives them: each sample's (`timesteps`, (B,) or one for all) everywhere, but 0 on the first
    latent frame of the samples `first_frame` (B,) flags."""
    batch, _, frames, height, width = latents.shape
    scale = torch.ones(batch, frames, height // PATCH, width // PATCH, device=latents.device, dtype=torch.float32)
    if first_frame is not None:
        scale[:, 0] = (~first_frame.to(latents.device, torch.bool)).float().view(-1, 1, 1)
    steps = timesteps.to(latents.device, torch.float32).reshape(-1, 1, 1, 1).expand(batch, 1, 1, 1)
    return (scale * steps).flatten(1)


class Call(WanTransformerCall):
    """The transformer called as WanPipeline calls it with ``expand_timesteps``: a timestep per token."""

    def denoise(self, denoiser: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                condition: dict[str, Any]) -> torch.Tensor:
        check_clip_latents(noisy, self.family.title)
        return denoiser(hidden_states=noisy, timestep=token_timesteps(timesteps, noisy, condition.get(FIRST_FRAME)),
                        encoder_hidden_states=condition["encoder_hidden_states"], return_dict=False)[0]

    def conditioned(self, latents: torch.Tensor, noisy: torch.Tensor, generator: torch.Generator | None
                    ) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor | None]:
        """Image-to-video in training, as WanImageToVideoPipeline draws it: from `generator`, one uniform per sample
        after the objective's draws; a clip (more than one latent frame: a still image has nothing after its
        first) whose draw falls below `FIRST_FRAME_SHARE` is conditioned on its first frame. Returns the noisy
        latents with those clips' first latent frame replaced by the clean `latents`' (no noise mixed in), the
        conditioning's `FIRST_FRAME` flags (their timesteps there 0), and the loss weight on the latents' frames
        (B, 1, t, 1, 1): 0 on those frames, which the model is given rather than asked for, 1 elsewhere."""
        batch, frames = latents.shape[0], latents.shape[2]
        draws = torch.rand(batch, generator=generator, device=generator.device if generator is not None else None)
        flags = (draws.to(latents.device) < FIRST_FRAME_SHARE) & (frames > 1)
        kept = flags.view(-1, 1, 1, 1).to(noisy.dtype)
        noisy = noisy.clone()
        noisy[:, :, 0] = kept * latents[:, :, 0].to(noisy.dtype) + (1 - kept) * noisy[:, :, 0]
        weights = torch.ones(batch, 1, frames, 1, 1, device=latents.device)
        weights[:, :, 0] = (~flags).float().view(-1, 1, 1, 1)
        return noisy, {FIRST_FRAME: flags}, weights


class Files(WanTransformerFiles):
    # Wan 2.1's and 2.2's transformer files share Wan's original layout and its key names: a single file names no
    # release, so this family claims none (a TI2V-5B file loads by naming its folder's family, see the docs).
    single_file_keys = ()


class Sampling(spec.Sampling):
    pipeline_class = WanPipeline
    pipeline_names = ("WanPipeline",)
    # From a first frame (``image=``): the same components, with ``expand_timesteps``, which from_pipe carries over.
    image_pipeline_class = WanImageToVideoPipeline
    index_marks = ("expand_timesteps",)
    """What a model_index.json of this family's sets and one of another WanPipeline model (Wan 2.1's, 2.2 A14B's)
    does not: the pipeline's per-token timesteps."""

    def assemble(self, components: dict[str, nn.Module], tokenizers: list[Any], scheduler: Any,
                 distilled: bool = False) -> Any:
        return self.prepare(WanPipeline(
            tokenizer=tokenizers[0], text_encoder=components["text_encoder"], vae=components["vae"],
            scheduler=scheduler, transformer=components["transformer"], expand_timesteps=True))

    def prepare(self, pipe: Any) -> Any:
        # Without per-token timesteps the pipeline would call the transformer as Wan 2.1's, one timestep a clip.
        if not pipe.config.get("expand_timesteps") or getattr(pipe, "transformer_2", None) is not None:
            raise UserError("this WanPipeline folder is not Wan 2.2 TI2V's (its model_index.json does not set "
                            "expand_timesteps, or it holds two experts); pass a Wan2.2-TI2V-5B folder, or set "
                            "model.family to the folder's own")
        check_scale_factors(pipe.vae, self.family.codec)
        return pipe

    def defaults(self, denoiser_config: Any, distilled: bool = False) -> dict[str, Any]:
        return {"guidance": GUIDANCE, "steps": STEPS}

    def arguments(self, pipe: Any, guidance: float, negative_prompt: str | None) -> dict[str, Any]:
        return guidance_arguments(pipe, guidance, negative_prompt)


WAN22_TI2V = spec.ModelFamily(
    name="wan2.2-ti2v", title="Wan 2.2 TI2V-5B", hub_tags=("wan", "wan2.2", "text-to-video", "image-to-video"),
    components=spec.Components(
        vae=video_vae_component(),
        text_encoder=umt5_component(),
        transformer=transformer_component(),
    ),
    presets=PRESETS, codec=WAN22_VIDEO_CODEC, conditioner=UMT5Conditioner(), denoising=Call(), files=Files(),
    sampling=Sampling(),
)
