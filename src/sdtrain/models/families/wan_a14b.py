"""Wan 2.2 A14B text-to-video (Alibaba's Wan team, 2025): Wan 2.1's autoencoder and umT5 conditioner, and two
WanTransformer3DModel experts of Wan 2.1 14B's shape over shares of the timesteps (a mixture of experts in time).
The high-noise expert (``transformer``) denoises every step whose timestep is at or above ``boundary_ratio`` x 1000
(0.875 for T2V), laying out the clip; the low-noise expert (``transformer_2``) the rest, its detail. diffusers'
WanPipeline samples it from one folder holding both, handing each step to its expert and guiding each at its own
scale (``guidance_scale``, ``guidance_scale_2``).

A run trains ONE expert (``model.expert``: ``low_noise`` unless set, or ``high_noise``) in the denoiser's place,
its sigmas drawn from that expert's share alone (`spec.ExpertSpec`), as Wan's and musubi-tuner's trainers train
each expert on its own timesteps; the other is frozen, never loaded for training, and comes from the base's folder
wherever a pipeline samples. Each expert is called, conditioned and initialised as Wan 2.1's transformer is, and
kept in the same files (its single file and LoRA names are Wan's own, one file per expert as ComfyUI loads each).
"""

from __future__ import annotations

from typing import Any

from diffusers import WanPipeline
from torch import nn

from sdtrain.models.families import spec
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

BOUNDARY = 0.875
"""Wan2.2-T2V-A14B's ``boundary_ratio`` (its model_index.json; Wan's wan_t2v_A14B config's ``boundary``)."""
GUIDANCE = 4.0
"""The high-noise expert's classifier-free guidance scale (Wan's ``sample_guide_scale``, high noise)."""
GUIDANCE_2 = 3.0
"""The low-noise expert's (WanPipeline's ``guidance_scale_2``)."""
STEPS = 40
"""Wan's ``sample_steps`` for T2V A14B."""

# The released scheduler's flow_shift (Wan2.2-T2V-A14B-Diffusers' UniPC, 3.0; Wan's own sampler uses 12.0 on its
# own schedule) is the shift training draws sigmas under, as for Wan 2.1 (a folder's own is read where one is given).
_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)

# Each expert as Wan-AI's transformer/ and transformer_2/config.json give it, Wan 2.1 14B's shape: 5120 wide (40 heads
# of 128), 40 layers, ffn 13824; its text width comes from umT5, its channels from the latents (the call's settings).
_EXPERT_14B = dict(patch_size=[1, 2, 2], num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40,
                   freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
# The same structure at a size tests train (a head width RoPE's three axes split 8 + 4 + 4).
_TINY_EXPERT = {**_EXPERT_14B, "num_attention_heads": 2, "attention_head_dim": 16, "ffn_dim": 64, "num_layers": 2,
                "freq_dim": 32}

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"vae": TINY_WAN_VIDEO_VAE, "text_encoder": TINY_UMT5, "transformer": _TINY_EXPERT,
             "scheduler": _SCHEDULER},
    "wan2.2-t2v-a14b": {"vae": WAN_VIDEO_VAE, "text_encoder": UMT5_XXL, "transformer": _EXPERT_14B,
                        "scheduler": _SCHEDULER},
}

EXPERTS = spec.ExpertSpec(
    folders=("transformer", "transformer_2"), names=("high_noise", "low_noise"),
    # The low-noise expert renders the detail and likeness most adapters are trained for, and samples every clip's
    # last steps; the high-noise expert's layout and motion are the second run's.
    default="low_noise", released_boundary=BOUNDARY)


class Files(WanTransformerFiles):
    # Each expert's single file is Wan's transformer file (`export --single-file` of a run: the expert it trained).
    # A file of one expert cannot tell which it is, so files are never taken for this family: Wan 2.1 reads them.
    single_file_keys = ()


class Sampling(spec.Sampling):
    pipeline_class = WanPipeline
    # Wan 2.1's and Wan 2.2 TI2V-5B's folders are WanPipeline's too: this family's sets its experts (`spec.of_index`).
    pipeline_names = ("WanPipeline",)

    def assemble(self, components: dict[str, nn.Module], tokenizers: list[Any], scheduler: Any,
                 distilled: bool = False) -> Any:
        # Given one denoiser (a model from scratch, which has no second expert), it samples both shares.
        first, second = self.family.experts.folders
        return self.prepare(WanPipeline(
            tokenizer=tokenizers[0], text_encoder=components["text_encoder"], vae=components["vae"],
            scheduler=scheduler, transformer=components[first],
            transformer_2=components.get(second, components[first]),
            boundary_ratio=self.family.experts.released_boundary))

    def prepare(self, pipe: Any) -> Any:
        check_scale_factors(pipe.vae, self.family.codec)
        return pipe

    def defaults(self, denoiser_config: Any, distilled: bool = False) -> dict[str, Any]:
        return {"guidance": GUIDANCE, "steps": STEPS}

    def arguments(self, pipe: Any, guidance: float, negative_prompt: str | None) -> dict[str, Any]:
        # The low-noise expert guided at the release's ratio of the two scales (3.0 to 4.0) of the one set.
        return {**guidance_arguments(pipe, guidance, negative_prompt),
                "guidance_scale_2": guidance * GUIDANCE_2 / GUIDANCE}


WAN22_A14B = spec.ModelFamily(
    name="wan2.2-a14b", title="Wan 2.2 A14B", hub_tags=("wan", "wan2.2", "text-to-video"),
    components=spec.Components(
        vae=video_vae_component(),
        text_encoder=umt5_component(),
        # The expert a run trains, whichever it is (EXPERTS), under this name.
        transformer=transformer_component(),
    ),
    presets=PRESETS, codec=WAN_VIDEO_CODEC, conditioner=UMT5Conditioner(), denoising=WanTransformerCall(),
    files=Files(), sampling=Sampling(), experts=EXPERTS,
)
