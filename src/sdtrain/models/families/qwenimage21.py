"""Qwen-Image 2.1 (Alibaba's Qwen team, 2026): a single-stream transformer (QwenImage21Transformer2DModel, 32 blocks
of width 4096 sharing one modulation), Qwen3-VL-8B as its text encoder, and a 2D image autoencoder
(AutoencoderKLQwenImage21: RGBA in and out, 64 latent channels, 16x smaller, each channel normalised by its own
mean and deviation).

Text-to-image only in this release: the pipeline's condition images (which the vision-language model reads beside
the prompt and whose latents join the sequence) are not trained. The conditioning follows diffusers'
QwenImage21Pipeline: each caption fills the user turn of a fixed chat prompt whose system turn asks to comprehend the
prompt; the transformer reads the language model's last layer before its final norm (as the checkpoint was trained)
from the user turn's header on, the system turn dropped, under an attention mask. The transformer reads text and
image as one sequence: the caption's tokens, then one token per latent pixel (no 2x2 patches), text attending
causally and the image to everything; it predicts the velocity ``noise - x0`` at sigma.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLQwenImage21, QwenImage21Pipeline, QwenImage21Transformer2DModel
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from torch import nn
from transformers import (
    AutoTokenizer,
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
)

from sdtrain.models.families import causal_lm, spec
from sdtrain.models.families.codec import ChannelStatistics, LatentCodec
from sdtrain.models.families.spec import construct, ids_key, mask_key

SYSTEM = "Comprehend and analyze the provided prompt."
"""QwenImage21Pipeline's system prompt."""
PREFIX = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
"""What the conditioning drops: the system turn, as the chat template renders it (the pipeline's ``_drop_idx``
tokens, which it counts by rendering the system message alone)."""
TEMPLATE = PREFIX + "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
"""QwenImage21Pipeline's text-to-image prompt, the caption at ``{}``: a raw string, not the chat template's
rendering (the pipeline's own choice, which the checkpoint was trained with)."""
VISION_MARKERS = {"vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>", "image": "<|image_pad|>",
                  "video": "<|video_pad|>"}
"""Qwen3-VL's vision tokens by the name its config gives each id (``image_token_id``, ...): the processor and the
pipeline look them up even for a prompt alone."""

# Qwen3-VL-8B-Instruct (Qwen/Qwen-Image-2.1 text_encoder/config.json is the whole model): its language tower and its
# vision tower, which text-to-image never runs.
_QWEN3_VL_8B_TEXT = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-6,
                         vocab_size=151936,
                         rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                          "mrope_section": [24, 20, 20], "mrope_interleaved": True})
_QWEN3_VL_8B_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                           deepstack_visual_indexes=[8, 16, 24])
# The released transformer and autoencoder: diffusers' defaults (their docstrings name the release's shapes; the
# autoencoder's defaults carry the released latent statistics).
_TRANSFORMER = dict(patch_size=1, num_layers=32, attention_head_dim=128, num_attention_heads=32, mlp_ratio=3,
                    axes_dims_rope=[16, 56, 56], causal_condition=True)
_VAE = dict(base_dim=96, decoder_base_dim=144, z_dim=64, dim_mult=[1, 2, 4, 8, 8], num_res_blocks=2,
            temperal_downsample=[False, True, True, True], in_channels=4, out_channels=4, is_residual=True)
# The released scheduler as the pipeline and ComfyUI read it: an exponential shift whose mu grows with the image's
# tokens (one per latent pixel) and a terminal sigma of 0.02. The mu range is the pipeline's fallback; a pretrained
# folder's own scheduler_config.json wins when fine-tuning.
_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, time_shift_type="exponential",
                  base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096, shift_terminal=0.02)

# The released structure at a size tests train: M-RoPE sections adding up to half the head width, a two-block vision
# tower, the autoencoder's four 2x downsamplings (the pipeline assumes 16x) on narrow channels, reading and writing
# RGB (a model from scratch learns no alpha it would then emit), latents neither shifted nor scaled until an
# autoencoder run measures them.
_TINY_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                  rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [2, 3, 3],
                                   "mrope_interleaved": True})
_TINY_VISION = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                    num_position_embeddings=64, deepstack_visual_indexes=[0])
_TINY_VAE = dict(base_dim=8, decoder_base_dim=8, z_dim=16, dim_mult=[1, 1, 2, 2, 2], num_res_blocks=1,
                 temperal_downsample=[False, True, True, True], in_channels=3, out_channels=3,
                 latents_mean=[0.0] * 16, latents_std=[1.0] * 16)
_TINY_TRANSFORMER = dict(patch_size=1, num_layers=2, attention_head_dim=16, num_attention_heads=2, mlp_ratio=3,
                         axes_dims_rope=[4, 6, 6], causal_condition=True)

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"vae": _TINY_VAE, "text_encoder": {**_TINY_TEXT, "vision_config": _TINY_VISION},
             "transformer": _TINY_TRANSFORMER, "scheduler": _SCHEDULER},
    "qwen-image-2.1": {"vae": _VAE, "text_encoder": {**_QWEN3_VL_8B_TEXT, "vision_config": _QWEN3_VL_8B_VISION},
                       "transformer": _TRANSFORMER, "scheduler": _SCHEDULER},
}

IMAGE_SETTINGS = dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                      size={"shortest_edge": 65536, "longest_edge": 16777216})
"""Qwen3-VL's image processor (its preprocessor_config.json): the processor a pipeline folder holds beside the
tokenizer, which text-to-image never runs; a folder sdtrain assembles (a run's export) writes these."""


def prefix_length(tokenizer: Any) -> int:
    """How many of `tokenizer`'s tokens the dropped system turn (`PREFIX`) is."""
    return len(tokenizer(PREFIX).input_ids)


def transformer_blocks(transformer: QwenImage21Transformer2DModel) -> list[nn.Module]:
    return list(transformer.transformer_blocks)


def vision_language_blocks(model: Qwen3VLForConditionalGeneration) -> list[nn.Module]:
    """The vision tower's blocks, then the language tower's decoder layers."""
    return [*model.model.visual.blocks, *model.model.language_model.layers]


def last_layer_states(model: Qwen3VLForConditionalGeneration, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The language tower's last decoder layer's output (before its final norm: what the transformer was trained on)
    for token ids under their attention mask. Its final norm is bypassed for the call, as the pipeline bypasses it,
    whatever transformers ties its last hidden state to."""
    tower = model.model.language_model
    handle = tower.norm.register_forward_hook(lambda module, args, output: args[0])
    try:
        return tower(input_ids=ids, attention_mask=mask).last_hidden_state
    finally:
        handle.remove()


class TextProcessor(causal_lm.WithoutVideo, Qwen3VLProcessor):
    """Qwen3VLProcessor of an image processor and a tokenizer alone: the pipeline reads no video, and transformers
    cannot build (nor save) one with its video processor without torchvision. Saved, it is the processor folder
    Qwen3VLProcessor loads (the image settings in preprocessor_config.json, the tokenizer and chat template beside
    them)."""


def text_processor(tokenizer: Any, image_processor: Any = None) -> TextProcessor:
    """The pipeline's processor around `tokenizer`, its chat template the tokenizer's (else Qwen3's layout, which
    renders the system turn the pipeline counts as the released template does: a Hub download keeps no
    chat_template.jinja)."""
    return TextProcessor(image_processor or Qwen2VLImageProcessorPil(**IMAGE_SETTINGS), tokenizer,
                         chat_template=tokenizer.chat_template or causal_lm.CHAT_TEMPLATE)


class RGBAImageCodec(ChannelStatistics, LatentCodec):
    """AutoencoderKLQwenImage21 read as an image autoencoder: each image a one-frame video (its convolutions are 2D,
    the frame axis kept for Wan's interface), opaque (the released model reads and writes RGBA: the images get an
    alpha of one, the decoded colour channels are read back), its latents normalised per channel by the config's
    ``latents_mean`` and ``latents_std``, as the pipeline normalises them."""

    released = {"scaling_factor": 1.0, "shift_factor": None}

    def channels(self, vae_config: Any) -> int:
        return vae_config.z_dim

    def downsampling(self, vae_config: Any) -> int:
        # Every level but the last halves the resolution; a patchified variant folds patches in first.
        return 2 ** (len(vae_config.dim_mult) - 1) * (vae_config.patch_size or 1)

    def encode(self, vae: nn.Module, pixels: torch.Tensor) -> DiagonalGaussianDistribution:
        if vae.config.in_channels == 4 and pixels.shape[1] == 3:
            pixels = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)
        posterior = vae.encode(pixels.unsqueeze(2)).latent_dist
        return DiagonalGaussianDistribution(posterior.parameters.squeeze(2))

    def decode(self, vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        return vae.decode(latents.unsqueeze(2)).sample.squeeze(2)[:, :3]


RGBA_CODEC = RGBAImageCodec()


class Conditioner(causal_lm.LanguageModelText, spec.Conditioner):
    def train_tokenizer(self, captions: list[str], out_dir: Path, vocab_size: int, max_length: int) -> Any:
        return causal_lm.train_chat_tokenizer(captions, out_dir, vocab_size, max_length,
                                              tuple(VISION_MARKERS.values()))

    def tokenize(self, tokenizer: Any, index: int, captions: list[str]) -> dict[str, torch.Tensor]:
        # The system turn is read by the language model but not kept: the mask marks what the conditioning keeps
        # (the user turn and the assistant's header). Padded on the right to a fixed length (the pipeline pads a
        # batch on the left to its longest), so the system turn is every row's first tokens; a token's position is
        # the same either way, as Qwen3-VL counts positions from the first unpadded token. An empty caption is a
        # space, as the pipeline reads it (Qwen has no bos token to stand for it).
        prefix = prefix_length(tokenizer)
        texts = [TEMPLATE.format(caption or " ") for caption in captions]
        tokens = tokenizer(texts, padding="max_length", padding_side="right", truncation=True,
                           max_length=tokenizer.model_max_length + prefix, return_tensors="pt")
        kept = tokens.attention_mask.clone()
        kept[:, :prefix] = 0
        return {ids_key(index): tokens.input_ids, mask_key(index): kept}

    def build_text_encoder(self, name: str, settings: dict[str, Any], tokenizer: Any, key: str) -> nn.Module:
        text = {k: v for k, v in settings.items() if k != "vision_config"}
        markers = {f"{role}_token_id": tokenizer.convert_tokens_to_ids(token) for role, token in VISION_MARKERS.items()}
        return Qwen3VLForConditionalGeneration(construct(Qwen3VLConfig, key, {
            "text_config": {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id, **text},
            "vision_config": settings.get("vision_config", {}), **markers}))

    def unused_modules(self, name: str, module: nn.Module) -> list[str]:
        # The conditioning is the language tower's last layer before its norm: the vision tower (no condition
        # images), the final norm and the head compute nothing that is read.
        if isinstance(module, Qwen3VLForConditionalGeneration):
            return ["model.visual", "model.language_model.norm", "lm_head"]
        return []

    def encode_text(self, encoders: list[nn.Module], ids: list[torch.Tensor], captions: list[str] | None,
                    masks: list[torch.Tensor | None] | None = None, sources: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
        kept = masks[0]  # `tokenize` makes one with every caption's ids
        # Every caption shares the system turn, and keeps at least the user turn's header after it.
        drop = int(kept[0].argmax())
        attended = kept.clone()
        attended[:, :drop] = 1
        states = last_layer_states(encoders[0], ids[0], attended)[:, drop:]
        mask = kept[:, drop:].to(states.dtype)
        # Padding's states zeroed, as the pipeline pads: the transformer masks them either way.
        return {"text_emb": states * mask.unsqueeze(-1), "text_mask": mask}

    def text_shapes(self, text_encoders: dict[str, Any], lengths: list[int]) -> dict[str, tuple[int, ...]]:
        width = text_encoders["text_encoder"].get_text_config().hidden_size
        return {"text_emb": (lengths[0], width), "text_mask": (lengths[0],)}


class Call(spec.DenoiserCall):
    objective = "flow_matching"

    def settings(self, settings: dict[str, Any], text_encoders: dict[str, nn.Module]) -> dict[str, Any]:
        return {"context_in_dim": text_encoders["text_encoder"].config.get_text_config().hidden_size}

    def shape(self, latent_channels: int, latent_size: int) -> dict[str, Any]:
        # One token per latent pixel; RoPE positions, no fixed table.
        return {"in_channels": latent_channels, "out_channels": latent_channels}

    def downsampling(self, denoiser_config: Any) -> int:
        # Each of the vision-language model's image slots stands for 2x2 latent pixels: sides must be even.
        return 2

    def image_token_side(self, denoiser_config: Any) -> int:
        # The shift's token count is the latent's pixels (the pipeline's sequence length), not 2x2 slots.
        return 1

    def condition(self, text: dict[str, torch.Tensor], batch: dict[str, Any], device: torch.device
                  ) -> dict[str, Any]:
        return {"encoder_hidden_states": text["text_emb"], "encoder_hidden_states_mask": text["text_mask"]}

    def denoise(self, denoiser: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                condition: dict[str, Any]) -> torch.Tensor:
        batch, channels, height, width = noisy.shape
        # The image's positions follow the text's (RoPE's first axis counts the text tokens before it), so the text
        # is cut to the batch's longest caption: each caption's image sits where the pipeline puts it for this batch
        # of prompts (for one prompt, right after it).
        mask = condition["encoder_hidden_states_mask"]
        length = max(int(mask.sum(dim=1).max()), 1)
        text, mask = condition["encoder_hidden_states"][:, :length], mask[:, :length]
        # The image's slots after the text, one per 2x2 latent pixels, which the transformer widens to the tokens.
        slots = torch.cat([torch.zeros(batch, length, dtype=torch.bool, device=noisy.device),
                           torch.ones(batch, height * width // 4, dtype=torch.bool, device=noisy.device)], dim=1)
        output = denoiser(
            hidden_states=noisy.flatten(2).transpose(1, 2), encoder_hidden_states=text,
            # Cut to the longest caption, a batch of one (or of equal lengths) masks nothing.
            encoder_hidden_states_mask=spec.mask_unless_full(mask), img_shapes=[[(1, height, width)]] * batch,
            img_mask=slots,
            # The transformer scales sigma by 1000 itself.
            timestep=timesteps / 1000, return_dict=False)[0]
        # The output covers the whole sequence: the image's tokens are its last.
        return output[:, -height * width:].transpose(1, 2).reshape(batch, channels, height, width)


class Files(spec.FileInterchange):
    denoiser_lora_peft_names = True
    # ComfyUI's Qwen-Image 2.1 model maps diffusers' module names onto its own (its fused feed-forward included).
    comfyui_reads_diffusers_lora = True


class Sampling(spec.Sampling):
    pipeline_class = QwenImage21Pipeline
    pipeline_names = ("QwenImage21Pipeline",)

    def assemble(self, components: dict[str, nn.Module], tokenizers: list[Any], scheduler: Any,
                 distilled: bool = False) -> Any:
        return self.prepare(QwenImage21Pipeline(
            scheduler=scheduler, vae=components["vae"], text_encoder=components["text_encoder"],
            processor=text_processor(tokenizers[0]), transformer=components["transformer"]))

    def prepare(self, pipe: Any) -> Any:
        # A folder names transformers' own processor class, which is what this one saves.
        pipe.register_to_config(processor=("transformers", "Qwen3VLProcessor"))
        return pipe

    def pipeline_from_folder(self, folder: str | Path, **kwargs: Any) -> Any:
        # Its processor given, built from the folder's image settings and tokenizer: transformers cannot load a
        # Qwen3VLProcessor without torchvision (its video half).
        processor = Path(folder) / "processor"
        given = text_processor(AutoTokenizer.from_pretrained(processor, local_files_only=True),
                               Qwen2VLImageProcessorPil.from_pretrained(processor, local_files_only=True))
        return super().pipeline_from_folder(folder, processor=given, **kwargs)

    def distilled(self, source: str | Path | None) -> bool:
        # The Turbo release samples its own sigmas (model_index.json's sample_sigmas) without guidance.
        index = Path(source) / "model_index.json" if source is not None else None
        if index is None or not index.is_file():
            return False
        try:
            return bool(json.loads(index.read_text()).get("sample_sigmas"))
        except (OSError, ValueError):
            return False

    def defaults(self, denoiser_config: Any, distilled: bool = False) -> dict[str, Any]:
        # Without guidance, as the pipeline samples (its true_cfg_scale of 1); the Turbo model in its 8 steps (the
        # pipeline takes its sigmas' count whatever it is asked), the base model at sdtrain's default count rather
        # than the pipeline's 40, as every family without a count of its own.
        return {"guidance": 1.0, "steps": 8} if distilled else {"guidance": 1.0}

    def arguments(self, pipe: Any, guidance: float, negative_prompt: str | None) -> dict[str, Any]:
        # Classifier-free guidance is what the pipeline calls true_cfg_scale, on only with a negative prompt (the
        # empty caption, which caption dropout trains, where none is given). The pipeline reads a prompt whole.
        if guidance <= 1:
            return {"true_cfg_scale": 1.0, "negative_prompt": None}
        return {"true_cfg_scale": guidance, "negative_prompt": negative_prompt or ""}


QWEN_IMAGE_21 = spec.ModelFamily(
    name="qwen-image-2.1", title="Qwen-Image 2.1", hub_tags=("qwen-image-2.1", "text-to-image"),
    components=spec.Components(
        # The autoencoder lists no blocks: it is frozen or trained whole, as Qwen-Image's.
        vae=spec.Component(AutoencoderKLQwenImage21, "vae"),
        # The release has no tokenizer folder: the prompt is tokenized by the processor, whose folder holds the
        # tokenizer. Qwen3-VL's checkpoints use transformers' current names; an earlier save's are read as them.
        text_encoder=spec.Component(
            Qwen3VLForConditionalGeneration, "text_encoder", tokenizer="processor", long_text=True, lora=True,
            weight_prefixes=(("model.language_model.", "model.language_model."), ("model.visual.", "model.visual."),
                             ("model.", "model.language_model."), ("visual.", "model.visual.")),
            blocks=vision_language_blocks),
        transformer=spec.Component(QwenImage21Transformer2DModel, "denoiser", kohya_prefix="lora_unet_",
                                   blocks=transformer_blocks),
    ),
    presets=PRESETS, codec=RGBA_CODEC, conditioner=Conditioner(), denoising=Call(), files=Files(),
    sampling=Sampling(),
)
