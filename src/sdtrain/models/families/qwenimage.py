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

import functools
import json
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus
from PIL import Image
from torch import nn
from transformers import (
    AutoTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
)

from sdtrain.models.families import causal_lm, spec
from sdtrain.models.families.patches import pack, unpack
from sdtrain.models.families.spec import ReferenceSpec, construct, ids_key, mask_key
from sdtrain.models.families.transformer_file import TransformerAlone, read_transformer_file
from sdtrain.models.families.wan_vae import TINY_WAN_VAE, WAN_CODEC, WAN_VAE
from sdtrain.models.single_file.write import LAYOUT_CONFIG_KEY
from sdtrain.utils import to_pil

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
_QWEN_VAE = WAN_VAE
# The released scheduler: a shift growing with the image, mu from 0.5 at 256 tokens to 0.9 at 8192.
_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                  base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02)

# The released structure at a size tests train: M-RoPE sections adding up to half the head width, 4x smaller latents
# (two of the autoencoder's downsamplings), latents neither shifted nor scaled until an autoencoder run measures them.
_TINY_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=512,
                  rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]})
_TINY_VAE = TINY_WAN_VAE
_TINY_QWEN_IMAGE = dict(patch_size=2, num_layers=2, attention_head_dim=16, num_attention_heads=2,
                        axes_dims_rope=[4, 6, 6])

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"vae": _TINY_VAE, "text_encoder": _TINY_TEXT, "transformer": _TINY_QWEN_IMAGE, "scheduler": _SCHEDULER},
    "qwen-image": {"vae": _QWEN_VAE, "text_encoder": _QWEN25_VL_7B, "transformer": _QWEN_IMAGE,
                   "scheduler": _SCHEDULER},
}


def prefix_length(tokenizer: Any, prefix: str) -> int:
    """How many of `tokenizer`'s tokens a template's dropped `prefix` is."""
    return len(tokenizer(prefix).input_ids)


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


class Conditioner(causal_lm.LanguageModelText, spec.Conditioner):
    template = TEMPLATE
    """The pipeline's prompt, the caption at ``{}``."""
    prefix = PREFIX
    """What of `template` the conditioning drops (the pipeline's ``prompt_template_encode_start_idx`` tokens)."""

    def tokenize(self, tokenizer: Any, index: int, captions: list[str]) -> dict[str, torch.Tensor]:
        # The prefix is read by the language model but not kept: the mask marks what the conditioning keeps (the
        # caption and the assistant's header), and `encode_text` attends the prefix as well. Padded on the right
        # whatever the tokenizer's folder says, so the prefix is every row's first tokens and each token's position
        # is the one the pipeline gives a prompt on its own (it pads a batch only to its longest).
        prefix = prefix_length(tokenizer, self.prefix)
        tokens = tokenizer([self.template.format(caption) for caption in captions], padding="max_length",
                           padding_side="right", truncation=True, max_length=tokenizer.model_max_length + prefix,
                           return_tensors="pt")
        kept = tokens.attention_mask.clone()
        kept[:, :prefix] = 0
        return {ids_key(index): tokens.input_ids, mask_key(index): kept}

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


class Call(spec.DenoiserCall):
    objective = "flow_matching"

    def settings(self, settings: dict[str, Any], text_encoders: dict[str, nn.Module]) -> dict[str, Any]:
        return {"joint_attention_dim": text_encoders["text_encoder"].config.hidden_size}

    def shape(self, latent_channels: int, latent_size: int) -> dict[str, Any]:
        # Tokens are 2x2 patches of the latents, and the output is unpatched; RoPE positions, no fixed table.
        return {"in_channels": latent_channels * 4, "out_channels": latent_channels}

    def downsampling(self, denoiser_config: Any) -> int:
        return 2

    def condition(self, text: dict[str, torch.Tensor], batch: dict[str, Any], device: torch.device
                  ) -> dict[str, Any]:
        return {"encoder_hidden_states": text["text_emb"],
                "encoder_hidden_states_mask": spec.mask_unless_full(text["text_mask"])}

    def denoise(self, denoiser: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                condition: dict[str, Any]) -> torch.Tensor:
        height, width = noisy.shape[-2:]
        tokens, shapes = pack(noisy), [(1, height // 2, width // 2)]
        reference = condition.get("reference_latents")
        if reference is not None:
            # Qwen-Image-Edit's: the source's tokens after the noisy ones, the next frame of RoPE's first axis.
            tokens = torch.cat([tokens, pack(reference.to(noisy.dtype))], dim=1)
            shapes.append((1, reference.shape[-2] // 2, reference.shape[-1] // 2))
        output = denoiser(
            hidden_states=tokens, encoder_hidden_states=condition["encoder_hidden_states"],
            encoder_hidden_states_mask=condition["encoder_hidden_states_mask"],
            # The transformer scales sigma by 1000 itself.
            timestep=timesteps / 1000, img_shapes=[shapes] * len(noisy), return_dict=False)[0]
        return unpack(output[:, :(height // 2) * (width // 2)], height, width)


class Files(spec.FileInterchange):
    single_file_keys = tuple(prefix + MARK for prefix in PREFIXES)
    # The transformer alone, as ComfyUI's diffusion_models/ file holds it (see above), its keys the model's own.
    single_file = TransformerAlone(
        load_transformer_file, dict, lambda config: "qwen-image", SHAPE_KEYS,
        description="The {title} transformer alone, in one file as ComfyUI loads it",
        comfyui="put `{name}` in `ComfyUI/models/diffusion_models/` and load it with Load Diffusion Model, beside "
                "Qwen-Image's Qwen2.5-VL text encoder (Load CLIP, type qwen_image) and its VAE (Load VAE).")
    denoiser_lora_peft_names = True
    # ComfyUI's Qwen-Image key map reads the diffusers file's ``transformer.`` names as well as kohya's.
    comfyui_reads_diffusers_lora = True


class Sampling(spec.Sampling):
    pipeline_class = QwenImagePipeline
    pipeline_names = ("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline")

    def assemble(self, components: dict[str, nn.Module], tokenizers: list[Any], scheduler: Any,
                 distilled: bool = False) -> Any:
        return self.prepare(QwenImagePipeline(
            scheduler=scheduler, vae=components["vae"], text_encoder=components["text_encoder"],
            tokenizer=tokenizers[0], transformer=components["transformer"]))

    def prepare(self, pipe: Any) -> Any:
        # The pipeline drops the released tokenizer's 34 prefix tokens whatever its tokenizer; a model trained from
        # scratch has its own (the count is no setting a folder keeps).
        pipe.prompt_template_encode_start_idx = prefix_length(pipe.tokenizer, self.family.conditioner.prefix)
        return pipe

    def defaults(self, denoiser_config: Any, distilled: bool = False) -> dict[str, Any]:
        return {"guidance": 4.0}

    def arguments(self, pipe: Any, guidance: float, negative_prompt: str | None) -> dict[str, Any]:
        # Classifier-free guidance is what the pipeline calls true_cfg_scale, on only with a negative prompt (the
        # empty caption, which caption dropout trains, where none is given). Caption tokens as training read them,
        # at most the pipeline's limit.
        arguments: dict[str, Any] = {"max_sequence_length": min(pipe.tokenizer.model_max_length, 1024)}
        if guidance <= 1:
            return {**arguments, "true_cfg_scale": 1.0, "negative_prompt": None}
        return {**arguments, "true_cfg_scale": guidance, "negative_prompt": negative_prompt or ""}


QWEN_IMAGE = spec.ModelFamily(
    name="qwen-image", title="Qwen-Image",
    components=spec.Components(
        # The autoencoder lists no blocks: its causal convolutions carry a frame cache from call to call, which
        # recomputing a block (activation checkpointing) would advance twice.
        vae=spec.Component(AutoencoderKLQwenImage, "vae"),
        # The released text encoder is the whole vision-language model (Qwen2_5_VLForConditionalGeneration), its
        # language tower under model. (or model.language_model. as transformers 5 names it).
        text_encoder=causal_lm.text_encoder(Qwen2_5_VLTextModel, (("model.language_model.", ""), ("model.", ""))),
        # Qwen's own module names are diffusers' (nothing fused): kohya's names are the paths, as diffusers' and
        # ComfyUI's Qwen-Image LoRA loaders read them.
        transformer=spec.Component(QwenImageTransformer2DModel, "denoiser", kohya_prefix="lora_unet_",
                                   blocks=transformer_blocks),
    ),
    # Each channel has its own mean and deviation, in the VAE's config (latents_mean, latents_std); no VAE file
    # without a config is read for this family.
    presets=PRESETS, codec=WAN_CODEC, conditioner=Conditioner(), denoising=Call(), files=Files(), sampling=Sampling(),
)


# ------------------------------------------------------------------------------------------ Qwen-Image-Edit
# The same transformer and autoencoder, fine-tuned to edit (Qwen/Qwen-Image-Edit): the source image's latents are
# tokens after the noisy ones (a second frame on RoPE's first axis), and the text encoder is the whole
# Qwen2.5-VL, which reads the source as well: the user turn opens with the image's vision tokens, which the
# conditioning keeps with the caption.

EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                 "objects, background), then explain how the user's text instruction should alter or modify the "
                 "image. Generate a new image that meets the user's requirements while maintaining consistency with "
                 "the original input where appropriate.<|im_end|>\n<|im_start|>user\n"
                 "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n")
"""QwenImageEditPipeline's prompt: one image placeholder, which the processor widens to the image's tokens."""
EDIT_PREFIX = EDIT_TEMPLATE.split("<|vision_start|>")[0]
"""What the edit conditioning drops: the system turn and the user turn's header (the pipeline's 64 tokens)."""
VISION_MARKERS = {"vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>", "image": "<|image_pad|>",
                  "video": "<|video_pad|>"}
"""Qwen2.5-VL's vision tokens by the name its config gives each id (``image_token_id``, ...)."""
IMAGE_PIXELS = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384}
"""The fewest and most pixels Qwen2.5-VL's processor resizes an image to (the released processor's min_pixels and
max_pixels)."""

# Qwen2.5-VL-7B-Instruct's vision tower (its vision_config).
_QWEN25_VL_7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                            fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu")
_TINY_VISION = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                    fullatt_block_indexes=[1])

EDIT_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    preset: {**settings, "text_encoder": {**settings["text_encoder"], "vision_config": vision}}
    for (preset, settings), vision in zip(
        {"tiny": PRESETS["tiny"], "qwen-image-edit": PRESETS["qwen-image"]}.items(),
        (_TINY_VISION, _QWEN25_VL_7B_VISION))
}


class VisionTextProcessor(causal_lm.WithoutVideo, Qwen2VLProcessor):
    """Qwen2VLProcessor of an image processor and a tokenizer alone: the pipeline reads no video, and transformers
    cannot build (nor save) one without its video processor, which needs torchvision. Saved, it is the processor
    folder Qwen2VLProcessor loads: the image settings are also written where earlier releases kept them
    (preprocessor_config.json), which transformers makes the video processor of where the folder has none."""


@functools.cache
def image_processor(patch: int, merge: int, temporal: int) -> Qwen2VLImageProcessorPil:
    """The released processor's image half, for a vision tower of these patch sides and merge (PIL's resizing,
    which needs no torchvision)."""
    return Qwen2VLImageProcessorPil(patch_size=patch, merge_size=merge, temporal_patch_size=temporal,
                                    size=IMAGE_PIXELS)


def image_processor_of(config: Any) -> Qwen2VLImageProcessorPil:
    """`image_processor` for the vision tower of a Qwen2.5-VL whose config is `config`."""
    vision = config.vision_config
    return image_processor(vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)


def vision_images(config: Any, sources: list[Image.Image]) -> Any:
    """`sources` as the vision tower of a Qwen2.5-VL whose config is `config` reads them: resized to whole merged
    patches, normalised and cut into patches (pixel_values, image_grid_thw)."""
    return image_processor_of(config)(images=sources, return_tensors="pt")


def reference_latents_of(vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """A source image's latents as QwenImageEditPipeline gives them: the posterior's mode, each channel normalised."""
    return WAN_CODEC.normalize(WAN_CODEC.encode(vae, pixels).mode(), vae)


@contextmanager
def edits_at_own_size(module: Any, kept_areas: tuple[int, ...], sources: list[Image.Image]
                      ) -> Iterator[dict[str, Any]]:
    """Qwen-Image-Edit's pipelines (in `module`) resize each source to about a megapixel at its aspect, and no
    argument says otherwise: in this context, the size their `calculate_dimensions` computes for each of `sources`
    is that source's own, but for the areas the pipeline keeps whatever the size (`kept_areas`: the Plus pipeline's
    vision-language input)."""
    sizes = {width / height: (width, height) for width, height in (source.size for source in sources)}
    released = module.calculate_dimensions

    def own_size(target_area: int, ratio: float) -> tuple[Any, ...]:
        computed = released(target_area, ratio)
        if target_area in kept_areas or ratio not in sizes:
            return computed
        return (*sizes[ratio], *computed[2:])

    module.calculate_dimensions = own_size
    try:
        yield {}
    finally:
        module.calculate_dimensions = released


def vision_language_blocks(model: Qwen2_5_VLForConditionalGeneration) -> list[nn.Module]:
    """The vision tower's blocks, then the language tower's decoder layers."""
    return [*model.model.visual.blocks, *model.model.language_model.layers]


class EditConditioner(Conditioner):
    template = EDIT_TEMPLATE
    prefix = EDIT_PREFIX

    def train_tokenizer(self, captions: list[str], out_dir: Path, vocab_size: int, max_length: int) -> Any:
        return causal_lm.train_chat_tokenizer(captions, out_dir, vocab_size, max_length,
                                              tuple(VISION_MARKERS.values()))

    def build_text_encoder(self, name: str, settings: dict[str, Any], tokenizer: Any, key: str) -> nn.Module:
        text = {key: value for key, value in settings.items() if key != "vision_config"}
        markers = {f"{role}_token_id": tokenizer.convert_tokens_to_ids(token) for role, token in VISION_MARKERS.items()}
        return Qwen2_5_VLForConditionalGeneration(construct(Qwen2_5_VLConfig, key, {
            "text_config": {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
                            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, **text},
            "vision_config": settings.get("vision_config", {}), **markers}))

    def unused_modules(self, name: str, module: nn.Module) -> list[str]:
        # The conditioning is the language tower's last states: its head computes nothing that is read.
        if isinstance(module, Qwen2_5_VLForConditionalGeneration):
            return ["lm_head"]
        return super().unused_modules(name, module)

    def text_shapes(self, text_encoders: dict[str, Any], lengths: list[int]) -> dict[str, tuple[int, ...]]:
        return super().text_shapes({"text_encoder": text_encoders["text_encoder"].text_config}, lengths)

    def encode_text(self, encoders: list[nn.Module], ids: list[torch.Tensor], captions: list[str] | None,
                    masks: list[torch.Tensor | None] | None = None, sources: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
        if sources is None:
            raise ValueError("Qwen-Image-Edit's conditioning reads each caption's source image: pass `sources`")
        model = encoders[0]
        images = vision_images(model.config, self.vision_sources(sources))
        grid = images["image_grid_thw"]
        # Each sample's one image placeholder widened to its image's tokens (one per merged patch), as the
        # processor does; a batch's sources share a size, so its rows stay of one length.
        count = int(grid[0].prod()) // model.config.vision_config.spatial_merge_size ** 2
        placeholder = ids[0] == model.config.image_token_id
        repeats = torch.where(placeholder, count, 1).flatten()

        def widened(tokens: torch.Tensor) -> torch.Tensor:
            return tokens.flatten().repeat_interleave(repeats).view(len(tokens), -1)

        kept = widened(masks[0])
        drop = int(kept[0].argmax())
        attended = kept.clone()
        attended[:, :drop] = 1
        device = next(model.parameters()).device
        states = model.model(input_ids=widened(ids[0]), attention_mask=attended,
                             pixel_values=images["pixel_values"].to(device), image_grid_thw=grid.to(device),
                             output_hidden_states=True).hidden_states[-1][:, drop:]
        mask = kept[:, drop:].to(states.dtype)
        return {"text_emb": states * mask.unsqueeze(-1), "text_mask": mask}

    def vision_sources(self, sources: torch.Tensor) -> list[Image.Image]:
        """The sources (in [-1, 1]) as the pipeline gives them to the vision-language model: as they are."""
        return to_pil(sources)


class EditCall(Call):
    def settings(self, settings: dict[str, Any], text_encoders: dict[str, nn.Module]) -> dict[str, Any]:
        return {"joint_attention_dim": text_encoders["text_encoder"].config.text_config.hidden_size}


class EditFiles(Files):
    # Its transformer file is Qwen-Image's layout (ComfyUI loads either as the same model), which a file alone does
    # not tell apart: one is read as the edit model's transformer (model.transformer) where the family is set.
    single_file_keys = ()


class EditSampling(Sampling):
    pipeline_class = QwenImageEditPipeline
    pipeline_names = ("QwenImageEditPipeline",)

    def assemble(self, components: dict[str, nn.Module], tokenizers: list[Any], scheduler: Any,
                 distilled: bool = False) -> Any:
        text_encoder = components["text_encoder"]
        processor = VisionTextProcessor(image_processor_of(text_encoder.config), tokenizers[0])
        return self.prepare(self.pipeline_class(
            scheduler=scheduler, vae=components["vae"], text_encoder=text_encoder, tokenizer=tokenizers[0],
            processor=processor, transformer=components["transformer"]))

    def prepare(self, pipe: Any) -> Any:
        # A folder names transformers' own processor class, which is what this one saves.
        pipe.register_to_config(processor=("transformers", "Qwen2VLProcessor"))
        return super().prepare(pipe)

    def pipeline_from_folder(self, folder: str | Path, **kwargs: Any) -> Any:
        # Its processor given, built from the folder's image settings and tokenizer: transformers cannot load a
        # Qwen2VLProcessor without torchvision (its video half), and the training path resizes with PIL.
        folder = Path(folder)
        processor = VisionTextProcessor(Qwen2VLImageProcessorPil.from_pretrained(folder / "processor"),
                                        AutoTokenizer.from_pretrained(folder / "tokenizer"))
        return super().pipeline_from_folder(folder, processor=processor, **kwargs)


def edit_components() -> spec.Components:
    """Qwen-Image-Edit's component table: Qwen-Image's, its text encoder the whole vision-language model."""
    return spec.Components(
        vae=QWEN_IMAGE.components["vae"],
        # The released checkpoint keeps transformers' earlier names (model.layers, visual.blocks).
        text_encoder=spec.Component(
            Qwen2_5_VLForConditionalGeneration, "text_encoder", tokenizer="tokenizer", long_text=True, lora=True,
            weight_prefixes=(("model.language_model.", "model.language_model."), ("model.visual.", "model.visual."),
                             ("model.", "model.language_model."), ("visual.", "model.visual.")),
            blocks=vision_language_blocks),
        transformer=QWEN_IMAGE.components["transformer"],
    )


# Qwen-Image fine-tuned to edit by reference (see above); trained with ``edit.reference``.
QWEN_IMAGE_EDIT = spec.ModelFamily(
    name="qwen-image-edit", title="Qwen-Image-Edit", hub_tags=("qwen-image-edit", "image-editing"),
    components=edit_components(), presets=EDIT_PRESETS, codec=WAN_CODEC, conditioner=EditConditioner(),
    denoising=EditCall(), files=EditFiles(), sampling=EditSampling(),
    reference=ReferenceSpec(QwenImageEditPipeline, reference_latents_of,
                            at_own_size=functools.partial(edits_at_own_size, pipeline_qwenimage_edit, ()),
                            text_reads_source=True),
)


# ------------------------------------------------------------------------------------------ Qwen-Image-Edit-2509/2511
# The Plus pipeline's models (Qwen/Qwen-Image-Edit-2509, -2511): the source is named in the instruction ("Picture 1:"
# before its vision tokens), the vision-language model sees it at about 384x384 whatever its size, and 2511's
# transformer modulates the source's tokens at timestep zero (its config's zero_cond_t, which diffusers reads).

PLUS_TEMPLATE = EDIT_TEMPLATE.replace("<|vision_start|>", "Picture 1: <|vision_start|>")
"""QwenImageEditPlusPipeline's prompt for one source image."""


class PlusConditioner(EditConditioner):
    template = PLUS_TEMPLATE

    def vision_sources(self, sources: torch.Tensor) -> list[Image.Image]:
        # As the pipeline resizes them (its own size computation and resampling) to its condition area.
        resizer = VaeImageProcessor()
        images = []
        for image in to_pil(sources):
            width, height = pipeline_qwenimage_edit_plus.calculate_dimensions(
                pipeline_qwenimage_edit_plus.CONDITION_IMAGE_SIZE, image.width / image.height)
            images.append(resizer.resize(image, height, width))
        return images


class PlusSampling(EditSampling):
    pipeline_class = QwenImageEditPlusPipeline
    pipeline_names = ("QwenImageEditPlusPipeline",)

    def variant(self, source: str | Path) -> spec.Variant | None:
        # Both name the Plus pipeline: 2511's transformer is the one that modulates the source at timestep zero.
        settings = spec.component_settings(source, "transformer")
        if settings is None:
            return None
        release = "2511" if settings.get("zero_cond_t") else "2509"
        return spec.Variant(release, f"Qwen-Image-Edit-{release}")


# Qwen-Image-Edit's Plus models (2509, 2511), one source image an edit; trained with ``edit.reference``.
QWEN_IMAGE_EDIT_PLUS = spec.ModelFamily(
    name="qwen-image-edit-plus", title="Qwen-Image-Edit-2509/2511", hub_tags=("qwen-image-edit", "image-editing"),
    components=edit_components(),
    presets={**EDIT_PRESETS, "qwen-image-edit-2511": {
        **EDIT_PRESETS["qwen-image-edit"],
        "transformer": {**EDIT_PRESETS["qwen-image-edit"]["transformer"], "zero_cond_t": True}}},
    codec=WAN_CODEC, conditioner=PlusConditioner(), denoising=EditCall(), files=EditFiles(), sampling=PlusSampling(),
    reference=ReferenceSpec(
        QwenImageEditPlusPipeline, reference_latents_of, text_reads_source=True,
        at_own_size=functools.partial(edits_at_own_size, pipeline_qwenimage_edit_plus,
                                      (pipeline_qwenimage_edit_plus.CONDITION_IMAGE_SIZE,))),
)
