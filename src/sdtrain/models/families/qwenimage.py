"""Qwen-Image (Alibaba's Qwen team, 2025): a 20B dual-stream MMDiT (QwenImageTransformer2DModel), Qwen2.5-VL-7B's
language tower as its one text encoder, and Wan-2.1's causal 3D autoencoder (AutoencoderKLQwenImage: 16 channels,
8x smaller, each channel normalised by its own mean and deviation).

The conditioner follows diffusers' QwenImagePipeline: each caption fills the user turn of a fixed chat prompt whose
system turn asks for a description of the image; the transformer reads the language model's last hidden states
(after its final norm) from the user turn on, the system turn dropped, under an attention mask (padding ignored).
Only the language tower is read: its vision tower and head are never built. Still images are one-frame videos to
the autoencoder, so the latent codec adds and removes the frame axis; the denoiser sees ordinary (B, 16, h, w)
latents, packed 2x2 into tokens as Flux.1's, with 3-axis RoPE over (frame, row, column). It predicts the velocity
``noise - x0`` at sigma, the flow objective's own target.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from torch import nn
from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

from sdtrain.models.families import causal_lm
from sdtrain.models.families.patches import pack, unpack
from sdtrain.models.families.spec import ModelFamily, construct
from sdtrain.models.families.transformer_file import TransformerAlone, read_transformer_file
from sdtrain.models.single_file.write import LAYOUT_CONFIG_KEY

TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")
"""QwenImagePipeline's prompt: the caption in the user turn."""
PREFIX = TEMPLATE.split("{}")[0]
"""What the conditioning drops: the system turn and the user turn's header (34 tokens of the released tokenizer,
the pipeline's ``prompt_template_encode_start_idx``)."""

# Qwen2.5-VL-7B-Instruct's language tower (its text_config), read as Qwen2_5_VLTextModel.
_QWEN25_VL_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6, vocab_size=152064,
                     rope_scaling={"rope_type": "default", "mrope_section": [16, 24, 24]},
                     tie_word_embeddings=False)
# The released transformer (Qwen/Qwen-Image transformer/config.json: diffusers' defaults; the text width comes from
# the text encoder, see denoiser_settings) and autoencoder (diffusers' defaults, the released latent statistics).
_QWEN_IMAGE = dict(patch_size=2, num_layers=60, attention_head_dim=128, num_attention_heads=24,
                   axes_dims_rope=[16, 56, 56])
_QWEN_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                 temperal_downsample=[False, True, True])
# The released scheduler: a shift growing with the image, mu from 0.5 at 256 tokens to 0.9 at 8192.
_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                  base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02)

# The released structure at a size tests train: M-RoPE sections adding up to half the head width, 4x smaller latents
# (two of the autoencoder's downsamplings), latents neither shifted nor scaled until an autoencoder run measures them.
_TINY_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=512,
                  rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]})
_TINY_VAE = dict(base_dim=16, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True],
                 latents_mean=[0.0] * 16, latents_std=[1.0] * 16)
_TINY_QWEN_IMAGE = dict(patch_size=2, num_layers=2, attention_head_dim=16, num_attention_heads=2,
                        axes_dims_rope=[4, 6, 6])

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"vae": _TINY_VAE, "text_encoder": _TINY_TEXT, "transformer": _TINY_QWEN_IMAGE, "scheduler": _SCHEDULER},
    "qwen-image": {"vae": _QWEN_VAE, "text_encoder": _QWEN25_VL_7B, "transformer": _QWEN_IMAGE,
                   "scheduler": _SCHEDULER},
}


def prefix_length(tokenizer: Any) -> int:
    """How many of `tokenizer`'s tokens the template's dropped prefix is."""
    return len(tokenizer(PREFIX).input_ids)


def transformer_blocks(transformer: QwenImageTransformer2DModel) -> list[nn.Module]:
    return list(transformer.transformer_blocks)


# --------------------------------------------------------------------------------------------------- single files
# The transformer alone in one file, the one ComfyUI loads from models/diffusion_models/ (Comfy-Org's repackaged
# qwen_image_*.safetensors): Qwen's own module names are diffusers', so the keys are the transformer's state dict,
# bare or under ComfyUI's ``model.diffusion_model.``. The sizes come from the tensors; the other settings (RoPE
# axes, the Edit variants' flags) from what a file sdtrain writes carries under LAYOUT_CONFIG_KEY, else the released
# model's.

PREFIXES = ("model.diffusion_model.", "")
MARK = "transformer_blocks.0.img_mod.1.weight"
"""A key no other family's transformer holds (with txt_norm, what ComfyUI tells a Qwen-Image model by)."""
SHAPE_KEYS = frozenset({"in_channels", "out_channels", "num_layers", "attention_head_dim", "num_attention_heads",
                        "joint_attention_dim"})
_BLOCK = re.compile(r"^transformer_blocks\.(\d+)\.")


def prefix_of(keys: Mapping[str, Any] | list[str]) -> str | None:
    """The prefix a file holds Qwen-Image's transformer under, None when it holds none."""
    return next((prefix for prefix in PREFIXES if prefix + MARK in keys and prefix + "txt_norm.weight" in keys), None)


def transformer_config(shapes: Mapping[str, tuple[int, ...]], metadata: Mapping[str, str]) -> dict[str, Any]:
    """The QwenImageTransformer2DModel settings of a file's transformer (`shapes`: its keys, no prefix)."""
    def need(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise ValueError(f"no {key}")
        return tuple(shapes[key])

    settings = {**_QWEN_IMAGE, **json.loads(metadata.get(LAYOUT_CONFIG_KEY) or "{}")}
    width, patched = need("img_in.weight")
    head = need("transformer_blocks.0.attn.norm_q.weight")[0]
    patch = int(settings.get("patch_size", 2))
    return {**{k: v for k, v in settings.items() if k not in SHAPE_KEYS}, "in_channels": patched,
            "out_channels": need("proj_out.weight")[0] // (patch * patch),
            "num_layers": len({int(m.group(1)) for key in shapes if (m := _BLOCK.match(key))}),
            "attention_head_dim": head, "num_attention_heads": width // head,
            "joint_attention_dim": need("txt_in.weight")[1]}


def load_transformer_file(path: str | Path, trust_pickle: bool | None = None, frozen_precision: str = "fp32",
                          weights: bool = True) -> QwenImageTransformer2DModel:
    """A QwenImageTransformer2DModel, in fp32 (or its linear weights stored in `frozen_precision`), from a file of
    the transformer alone (its keys are the model's own); without `weights`, only the header is read."""
    return read_transformer_file(
        path, trust_pickle, title="Qwen-Image", cls=QwenImageTransformer2DModel, mark=MARK, prefix_of=prefix_of,
        settings_of=transformer_config, frozen_precision=frozen_precision, weights=weights,
        fix="pass a Qwen-Image transformer file (ComfyUI's qwen_image_*.safetensors, or `sdtrain export "
            "--single-file` of a Qwen-Image run) or a diffusers transformer folder")


class QwenImage(causal_lm.LanguageModelText, ModelFamily):
    name = "qwen-image"
    title = "Qwen-Image"
    components = {"vae": AutoencoderKLQwenImage, "text_encoder": Qwen2_5_VLTextModel,
                  "transformer": QwenImageTransformer2DModel}
    # diffusers' Qwen-Image LoRA loader adapts the transformer alone.
    lora_text_encoders = ()
    # Each channel has its own mean and deviation, in the VAE's config (latents_mean, latents_std); no VAE file
    # without a config is read for this family.
    latent_constants = {"scaling_factor": 1.0, "shift_factor": None}
    denoiser = "transformer"
    denoiser_lora_peft_names = True
    objective = "flow_matching"
    pipeline_class = QwenImagePipeline
    pipeline_names = ("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline")
    single_file_keys = tuple(prefix + MARK for prefix in PREFIXES)
    # The transformer alone, as ComfyUI's diffusion_models/ file holds it (see above), its keys the model's own.
    single_file = TransformerAlone(
        load_transformer_file, dict, lambda config: "qwen-image", SHAPE_KEYS,
        description="The {title} transformer alone, in one file as ComfyUI loads it",
        comfyui="put `{name}` in `ComfyUI/models/diffusion_models/` and load it with Load Diffusion Model, beside "
                "Qwen-Image's Qwen2.5-VL text encoder (Load CLIP, type qwen_image) and its VAE (Load VAE).")
    # ComfyUI's Qwen-Image key map reads the diffusers file's ``transformer.`` names as well as kohya's.
    comfyui_reads_diffusers_lora = True
    # The autoencoder lists no blocks: its causal convolutions carry a frame cache from call to call, which
    # recomputing a block (activation checkpointing) would advance twice.
    block_lists = {QwenImageTransformer2DModel: transformer_blocks, Qwen2_5_VLTextModel: causal_lm.decoder_layers}
    presets = PRESETS
    # The released text encoder is the whole vision-language model (Qwen2_5_VLForConditionalGeneration), its
    # language tower under model. (or model.language_model. as transformers 5 names it).
    weight_prefixes = {"text_encoder": ("model.language_model.", "model.")}
    # Qwen's own module names are diffusers' (nothing fused): kohya's names are the paths, as diffusers' and
    # ComfyUI's Qwen-Image LoRA loaders read them.
    kohya_prefixes = {"transformer": "lora_unet_"}

    def tokenize(self, tokenizer: Any, index: int, captions: list[str]) -> dict[str, torch.Tensor]:
        # The prefix is read by the language model but not kept: the mask marks what the conditioning keeps (the
        # caption and the assistant's header), and `encode_text` attends the prefix as well.
        prefix = prefix_length(tokenizer)
        tokens = tokenizer([TEMPLATE.format(caption) for caption in captions], padding="max_length", truncation=True,
                           max_length=tokenizer.model_max_length + prefix, return_tensors="pt")
        kept = tokens.attention_mask.clone()
        kept[:, :prefix] = 0
        return {self.ids_key(index): tokens.input_ids, self.mask_key(index): kept}

    def build_text_encoder(self, name: str, settings: dict[str, Any], tokenizer: Any, key: str) -> nn.Module:
        return Qwen2_5_VLTextModel(construct(Qwen2_5_VLTextConfig, key, {
            "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, **settings}))

    def unused_modules(self, name: str, module: nn.Module) -> list[str]:
        # The last block's text stream after its attention: the transformer reads the image stream alone.
        if not isinstance(module, QwenImageTransformer2DModel):
            return []
        last = f"transformer_blocks.{len(module.transformer_blocks) - 1}"
        return [f"{last}.attn.to_add_out", f"{last}.txt_mlp"]

    def denoiser_settings(self, settings: dict[str, Any], text_encoders: dict[str, nn.Module]) -> dict[str, Any]:
        return {"joint_attention_dim": text_encoders["text_encoder"].config.hidden_size}

    # ------------------------------------------------------------------------------------------ the latent codec

    def latent_channels(self, vae_config: Any) -> int:
        return vae_config.z_dim

    def latent_downsampling(self, vae_config: Any) -> int:
        return 2 ** len(vae_config.temperal_downsample)

    def encode_latents(self, vae: nn.Module, pixels: torch.Tensor) -> DiagonalGaussianDistribution:
        # A one-frame video in; the frame axis of the posterior's parameters taken out.
        posterior = vae.encode(pixels.unsqueeze(2)).latent_dist
        return DiagonalGaussianDistribution(posterior.parameters.squeeze(2))

    def decode_latents(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return vae.decode(latents.unsqueeze(2)).sample.squeeze(2)

    def normalize_latents(self, latents: torch.Tensor, vae: nn.Module) -> torch.Tensor:
        # As the pipelines normalise them: minus each channel's mean, times the inverse of its deviation.
        shape = (1, -1, *([1] * (latents.dim() - 2)))
        mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(shape)
        inverse = 1.0 / torch.tensor(vae.config.latents_std, device=latents.device).view(shape)
        return (latents.float() - mean) * inverse

    def fit_latent_normalization(self, vae: nn.Module, channel_mean: torch.Tensor, channel_square: torch.Tensor
                                 ) -> None:
        deviation = (channel_square - channel_mean.square()).clamp_min(1e-12).sqrt()
        vae.register_to_config(latents_mean=channel_mean.tolist(), latents_std=deviation.tolist())

    def denoiser_shape(self, latent_channels: int, latent_size: int) -> dict[str, Any]:
        # Tokens are 2x2 patches of the latents, and the output is unpatched; RoPE positions, no fixed table.
        return {"in_channels": latent_channels * 4, "out_channels": latent_channels}

    def downsampling(self, denoiser_config: Any) -> int:
        return 2

    # ------------------------------------------------------------------------------------------ the conditioner

    def encode_text(self, encoders: list[nn.Module], ids: list[torch.Tensor], captions: list[str] | None,
                    masks: list[torch.Tensor | None] | None = None) -> dict[str, torch.Tensor]:
        kept = masks[0]  # `tokenize` makes one with every caption's ids
        # Every caption shares the prefix, and keeps at least the assistant's header after it.
        drop = int(kept[0].argmax())
        attended = kept.clone()
        attended[:, :drop] = 1
        states = causal_lm.hidden_states(encoders[0], ids[0], attended, -1)[:, drop:]
        mask = kept[:, drop:].to(states.dtype)
        # Padding's states zeroed, as the pipeline pads: the transformer masks them either way.
        return {"text_emb": states * mask.unsqueeze(-1), "text_mask": mask}

    def text_shapes(self, text_encoders: dict[str, Any], lengths: list[int]) -> dict[str, tuple[int, ...]]:
        return {"text_emb": (lengths[0], text_encoders["text_encoder"].hidden_size), "text_mask": (lengths[0],)}

    def condition(self, text: dict[str, torch.Tensor], batch: dict[str, Any], device: torch.device
                  ) -> dict[str, Any]:
        return {"encoder_hidden_states": text["text_emb"], "encoder_hidden_states_mask": text["text_mask"]}

    def denoise(self, denoiser: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                condition: dict[str, Any]) -> torch.Tensor:
        height, width = noisy.shape[-2:]
        output = denoiser(
            hidden_states=pack(noisy), encoder_hidden_states=condition["encoder_hidden_states"],
            encoder_hidden_states_mask=condition["encoder_hidden_states_mask"],
            # The transformer scales sigma by 1000 itself.
            timestep=timesteps / 1000, img_shapes=[(1, height // 2, width // 2)] * len(noisy), return_dict=False)[0]
        return unpack(output, height, width)

    # ------------------------------------------------------------------------------------------ the pipeline

    def assemble(self, components: dict[str, nn.Module], tokenizers: list[Any], scheduler: Any) -> Any:
        return self.prepare_pipeline(QwenImagePipeline(
            scheduler=scheduler, vae=components["vae"], text_encoder=components["text_encoder"],
            tokenizer=tokenizers[0], transformer=components["transformer"]))

    def prepare_pipeline(self, pipe: Any) -> Any:
        # The pipeline drops the released tokenizer's 34 prefix tokens whatever its tokenizer; a model trained from
        # scratch has its own (the count is no setting a folder keeps).
        pipe.prompt_template_encode_start_idx = prefix_length(pipe.tokenizer)
        return pipe

    def sampling_defaults(self, denoiser_config: Any) -> dict[str, Any]:
        return {"guidance": 4.0}

    def sampling_arguments(self, pipe: Any, guidance: float, negative_prompt: str | None) -> dict[str, Any]:
        # Classifier-free guidance is what the pipeline calls true_cfg_scale, on only with a negative prompt (the
        # empty caption, which caption dropout trains, where none is given). Caption tokens as training read them,
        # at most the pipeline's limit.
        arguments: dict[str, Any] = {"max_sequence_length": min(pipe.tokenizer.model_max_length, 1024)}
        if guidance <= 1:
            return {**arguments, "true_cfg_scale": 1.0, "negative_prompt": None}
        return {**arguments, "true_cfg_scale": guidance, "negative_prompt": negative_prompt or ""}


QWEN_IMAGE = QwenImage()
