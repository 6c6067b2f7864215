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

import math
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from torch import nn
from transformers import UMT5Config, UMT5EncoderModel

from sdtrain.errors import UserError
from sdtrain.models.families import spec, wan_file
from sdtrain.models.families.clip import ClipTokenizerFromScratch
from sdtrain.models.families.spec import construct, ids_key, mask_key
from sdtrain.models.families.wan_vae import TINY_WAN_VIDEO_VAE, WAN_VIDEO_CODEC, WAN_VIDEO_VAE

TEXT_LENGTH = 512
"""umT5's tokens per caption when ``model.t5_text_length`` is unset: WanPipeline's ``max_sequence_length``."""

# umT5-XXL's encoder (google/umt5-xxl; Wan-AI's text_encoder/config.json): 5,680,910,336 parameters. Trained without
# dropout, as the other T5 towers here (the released config's 0.1 is for pretraining).
_UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                 relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
                 dropout_rate=0.0, layer_norm_epsilon=1e-6)
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

# The released structure at a size tests train: umT5's gated-GELU blocks with per-layer relative attention, a
# transformer whose head width splits into RoPE's three axes (8 + 4 + 4), and the tiny video autoencoder.
_TINY_UMT5 = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                  relative_attention_max_distance=32, feed_forward_proj="gated-gelu", dropout_rate=0.0)
_TINY_WAN = dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=2,
                 freq_dim=32, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"vae": TINY_WAN_VIDEO_VAE, "text_encoder": _TINY_UMT5, "transformer": _TINY_WAN,
             "scheduler": _SCHEDULER_480P},
    "wan2.1-t2v-1.3b": {"vae": WAN_VIDEO_VAE, "text_encoder": _UMT5_XXL, "transformer": _WAN_1_3B,
                        "scheduler": _SCHEDULER_480P},
    "wan2.1-t2v-14b": {"vae": WAN_VIDEO_VAE, "text_encoder": _UMT5_XXL, "transformer": _WAN_14B,
                       "scheduler": _SCHEDULER_720P},
}


def transformer_blocks(transformer: WanTransformer3DModel) -> list[nn.Module]:
    return list(transformer.blocks)


def umt5_blocks(encoder: UMT5EncoderModel) -> list[nn.Module]:
    return list(encoder.encoder.block)


def umt5_config(settings: dict[str, Any], tokenizer: Any, key: str) -> UMT5Config:
    """An umT5 encoder's config from preset settings; the vocabulary is the tokenizer's unless the preset names
    umT5's own (the released encoder keeps its 256,384 rows)."""
    return construct(UMT5Config, key, {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
                                       "eos_token_id": tokenizer.eos_token_id, "is_encoder_decoder": False,
                                       "use_cache": False, **settings})


class Conditioner(ClipTokenizerFromScratch, spec.Conditioner):
    # A model from scratch learns CLIP's byte-level BPE from its captions and umT5 reads its ids, as SD3's and
    # Flux.1's T5 do: the released umT5 SentencePiece model is no layout a run's captions train.

    def tokenize(self, tokenizer: Any, index: int, captions: list[str]) -> dict[str, torch.Tensor]:
        # As the pipeline tokenizes a prompt: cleaned by its own function (HTML entities, whitespace; ftfy's fixes
        # where ftfy is installed), its special tokens, padded on the right to the length (whatever the folder's
        # padding side: the pipeline keeps each caption's first states, which right padding makes the caption's).
        tokens = tokenizer([prompt_clean(caption) for caption in captions], padding="max_length",
                           padding_side="right", truncation=True, max_length=tokenizer.model_max_length,
                           add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        return {ids_key(index): tokens.input_ids, mask_key(index): tokens.attention_mask}

    def long_text_length(self, preset: str, denoiser_source: str | Path | None = None) -> int:
        return TEXT_LENGTH

    def build_text_encoder(self, name: str, settings: dict[str, Any], tokenizer: Any, key: str) -> nn.Module:
        return UMT5EncoderModel(umt5_config(settings, tokenizer, key))

    def encode_text(self, encoders: list[nn.Module], ids: list[torch.Tensor], captions: list[str] | None,
                    masks: list[torch.Tensor | None] | None = None, sources: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
        mask = masks[0] if masks else None
        if mask is None:
            raise ValueError("Wan 2.1's conditioning reads umT5 under its attention mask: pass the masks `tokenize` "
                             "makes (ModelFamily.token_inputs)")
        states = encoders[0](input_ids=ids[0], attention_mask=mask).last_hidden_state
        mask = mask.to(states.dtype)
        # The padding's states zeroed, as the pipeline pads each caption's own with zeros: the transformer, which
        # takes no mask, attends to them as it did in training.
        return {"text_emb": states * mask.unsqueeze(-1), "text_mask": mask}

    def text_shapes(self, text_encoders: dict[str, Any], lengths: list[int]) -> dict[str, tuple[int, ...]]:
        return {"text_emb": (lengths[0], text_encoders["text_encoder"].d_model), "text_mask": (lengths[0],)}


class Call(spec.DenoiserCall):
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
        if noisy.dim() != 5:
            raise UserError(f"Wan 2.1 denoises clips' latents (B, C, t, h, w), a still image's as t = 1, not a "
                            f"tensor of shape {tuple(noisy.shape)}")
        # Timesteps as the pipeline passes them: sigma * 1000, one per sample.
        return denoiser(hidden_states=noisy, timestep=timesteps,
                        encoder_hidden_states=condition["encoder_hidden_states"], return_dict=False)[0]


class Files(spec.FileInterchange):
    single_file_keys = wan_file.SINGLE_FILE_KEYS
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
        # The pipeline sizes its latents by the config's scale factors, not the autoencoder's structure.
        vae, codec = pipe.vae, self.family.codec
        told = (vae.config.scale_factor_spatial, vae.config.scale_factor_temporal)
        built = (codec.downsampling(vae.config), codec.clip_frames(vae.config))
        if told != built:
            raise UserError(f"model.components.vae.overrides: the autoencoder downsamples {built[0]}x a side and "
                            f"{built[1]}x in time, but its scale_factor_spatial and scale_factor_temporal say "
                            f"{told[0]} and {told[1]}, which WanPipeline sizes latents by; set them to {built[0]} "
                            f"and {built[1]}")
        return pipe

    def defaults(self, denoiser_config: Any, distilled: bool = False) -> dict[str, Any]:
        return {"guidance": 5.0, "steps": 50}

    def arguments(self, pipe: Any, guidance: float, negative_prompt: str | None) -> dict[str, Any]:
        # Classifier-free guidance against the negative prompt (None: the empty caption, which caption dropout
        # trains); caption tokens as training read them (a folder's tokenizer saying "no limit": the release's 512).
        length = pipe.tokenizer.model_max_length
        return {"guidance_scale": guidance, "negative_prompt": negative_prompt,
                "max_sequence_length": length if length < 100_000 else TEXT_LENGTH}


WAN = spec.ModelFamily(
    name="wan", title="Wan 2.1", hub_tags=("wan", "wan2.1", "text-to-video"),
    components=spec.Components(
        # The autoencoder lists no blocks: its causal convolutions carry a frame cache from call to call, which
        # recomputing a block (activation checkpointing) would advance twice.
        vae=spec.Component(AutoencoderKLWan, "vae"),
        # diffusers' Wan LoRA loader (and every Wan trainer) adapts the transformer alone; umT5 stays frozen.
        text_encoder=spec.Component(UMT5EncoderModel, "text_encoder", tokenizer="tokenizer", long_text=True,
                                    blocks=umt5_blocks),
        # Its adapters' second file names them as ComfyUI does, diffusion_model.<Wan's path> (see Files).
        transformer=spec.Component(WanTransformer3DModel, "denoiser", kohya_prefix=wan_file.LORA_PREFIX,
                                   blocks=transformer_blocks),
    ),
    # Each channel has its own mean and deviation, in the VAE's config (latents_mean, latents_std).
    presets=PRESETS, codec=WAN_VIDEO_CODEC, conditioner=Conditioner(), denoising=Call(), files=Files(),
    sampling=Sampling(),
)
