"""Chroma (lodestones, 2025; Chroma1-HD, Chroma1-Base, Chroma1-Flash): Flux.1-schnell's transformer with its
per-block modulation layers and its timestep, pooled-text and guidance embedders pruned, every block modulated by
one small network instead (the "approximator", diffusers' ``distilled_guidance_layer``, fed the timestep alone);
Flux.1's 16-channel autoencoder, and T5-XXL alone for the text (no CLIP, no pooled vector).

The conditioner follows diffusers' ChromaPipeline: T5 reads each caption with its tokenizer's attention mask (T5's
padding masked), and the transformer attends to the caption's tokens and ONE padding token after them, the rest of
the padding masked out of every attention, the image tokens all kept. Encoded shards store T5's states with the
tokenizer's mask (``text_mask``); the transformer's mask is made from it. Latents are packed 2x2 into tokens, at
positions (0, row, column), as Flux.1's are; text positions are zero. There is no guidance embedding: sampling
runs true classifier-free guidance against a negative prompt (the empty one by default), as the pipeline does.

One difference from diffusers' pipeline is deliberate: ChromaPipeline (diffusers 0.42) hands the transformer a
floating-point 0/1 mask, which scaled_dot_product_attention adds to the scores rather than masks with
(huggingface/diffusers#12116, reopened as #13619), so it attends to all the padding. Chroma's authors and ComfyUI
mask it; so does training here, and the pipelines sdtrain samples with (validation, ``generate``) are given the
same boolean mask (`Sampling.prepare`). A plain ChromaPipeline loading the export samples as diffusers samples
every Chroma model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    ChromaImg2ImgPipeline,
    ChromaInpaintPipeline,
    ChromaPipeline,
    ChromaTransformer2DModel,
)
from torch import nn
from transformers import T5EncoderModel

from sdtrain.models.families import bfl, spec
from sdtrain.models.families.autoencoder import FLUX_CODEC, FLUX_VAE, TINY_FLUX_VAE, vae_blocks
from sdtrain.models.families.clip import ClipTokenizerFromScratch
from sdtrain.models.families.patches import image_ids, pack, unpack
from sdtrain.models.families.spec import ids_key, mask_key
from sdtrain.models.families.text_towers import T5_XXL, TINY_T5, t5_blocks, t5_config
from sdtrain.models.families.transformer_file import TransformerAlone, read_transformer_file
from sdtrain.models.single_file import kohya
from sdtrain.models.single_file.write import LAYOUT_CONFIG_KEY

# Chroma1-HD's 8.9B transformer (the width it attends to comes from T5, see Call.settings).
_CHROMA = dict(patch_size=1, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
               axes_dims_rope=[16, 56, 56], approximator_num_channels=64, approximator_hidden_dim=5120,
               approximator_layers=5)
# Its structure at a size tests train: the approximator reads 4 timestep, 4 guidance and 8 modulation-index
# channels; the RoPE axes add up to the head width.
_TINY_CHROMA = dict(patch_size=1, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                    axes_dims_rope=[4, 6, 6], approximator_num_channels=16, approximator_hidden_dim=32,
                    approximator_layers=2)
# ChromaPipeline computes the dynamic shift's mu from these settings (Flux.1-dev's) at every call. The released
# folders' scheduler_config.json could not be read here: a pretrained folder's own scheduler is what trains and
# samples; this preset's serves models from scratch and single files.
_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                  base_image_seq_len=256, max_image_seq_len=4096)

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"vae": TINY_FLUX_VAE, "text_encoder": TINY_T5, "transformer": _TINY_CHROMA, "scheduler": _SCHEDULER},
    "chroma": {"vae": FLUX_VAE, "text_encoder": T5_XXL, "transformer": _CHROMA, "scheduler": _SCHEDULER},
}

_PIPELINES = (ChromaPipeline, ChromaImg2ImgPipeline, ChromaInpaintPipeline)
MAX_TEXT_LENGTH = 512
"""T5 tokens per caption ChromaPipeline samples with (its default, and the most it takes)."""


def transformer_blocks(transformer: nn.Module) -> list[nn.Module]:
    return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]


def attended(tokenizer_mask: torch.Tensor) -> torch.Tensor:
    """The text tokens the transformer attends to, from the tokenizer's mask (B, T): the caption's and the first
    padding token after them (none where the caption fills every position), as a boolean (B, T)."""
    lengths = tokenizer_mask.sum(dim=1, keepdim=True)
    return torch.arange(tokenizer_mask.shape[1], device=tokenizer_mask.device)[None, :] <= lengths


# --------------------------------------------------------------------------------------------------- single files
# Chroma's release file (Chroma1-HD.safetensors, ComfyUI's diffusion_models/ file) holds the transformer alone in
# Black Forest Labs' layout: Flux.1's double and single blocks without their modulation layers (`bfl`, modulated
# False), ``img_in``, ``txt_in``, ``final_layer.linear`` (no final modulation), and the approximator under
# ``distilled_guidance_layer.``: ``in_proj``, ``layers.<i>.in_layer``/``out_layer`` (diffusers' linear_1/linear_2),
# ``norms.<i>.scale``, ``out_proj``. Keys are bare, or under ComfyUI's ``model.diffusion_model.``. A file sdtrain
# writes carries in its metadata (``transformer_config``) what its shapes cannot tell (RoPE axes, patch size); a
# released one takes the released model's. diffusers reads such files with ChromaTransformer2DModel.from_single_file
# (its converter splits a single block's linear1 at the released 3,072 width, so it reads full-size models alone).

CONFIG_KEY = LAYOUT_CONFIG_KEY
PREFIXES = ("", "model.diffusion_model.", "diffusion_model.")
MARK = "distilled_guidance_layer.in_proj.weight"
"""The key a Chroma file is told by (diffusers' `infer_diffusers_model_type` looks for the approximator too)."""
SHAPE_KEYS = frozenset({"in_channels", "out_channels", "num_layers", "num_single_layers", "attention_head_dim",
                        "num_attention_heads", "joint_attention_dim", "approximator_num_channels",
                        "approximator_hidden_dim", "approximator_layers"})
_APPROXIMATOR = "distilled_guidance_layer"


def _modules(config: Mapping[str, Any]) -> bfl.Modules:
    modules: bfl.Modules = {"img_in": ("x_embedder",), "txt_in": ("context_embedder",),
                            "final_layer.linear": ("proj_out",),
                            f"{_APPROXIMATOR}.in_proj": (f"{_APPROXIMATOR}.in_proj",),
                            f"{_APPROXIMATOR}.out_proj": (f"{_APPROXIMATOR}.out_proj",)}
    for i in range(int(config["approximator_layers"])):
        layer = f"{_APPROXIMATOR}.layers.{i}"
        modules.update({f"{layer}.in_layer": (f"{layer}.linear_1",), f"{layer}.out_layer": (f"{layer}.linear_2",)})
    return {**modules, **bfl.block_modules(config, modulated=False)}


def _norms(config: Mapping[str, Any]) -> dict[str, str]:
    approximator = {f"{_APPROXIMATOR}.norms.{i}.weight": f"{_APPROXIMATOR}.norms.{i}.scale"
                    for i in range(int(config["approximator_layers"]))}
    return {**approximator, **bfl.block_norms(config)}


LAYOUT = bfl.Layout(title="Chroma", model="Chroma", modules=_modules, norms=_norms,
                    settings="num_layers/num_single_layers/approximator_layers")


def prefix_of(keys: Collection[str]) -> str | None:
    """The prefix a file holds Chroma's transformer under, None when it holds none."""
    return next((prefix for prefix in PREFIXES if prefix + MARK in keys), None)


def _counts(keys: Iterable[str], double: str, single: str, approximator: str) -> dict[str, int]:
    keys = list(keys)
    return {"num_layers": bfl.block_count(keys, double, "Chroma"),
            "num_single_layers": bfl.block_count(keys, single, "Chroma"),
            "approximator_layers": bfl.block_count(keys, approximator, "Chroma")}


def to_original(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ChromaTransformer2DModel state dict (diffusers keys) -> the original keys, no prefix (its block counts
    from its keys); ValueError for a weight with no place there, or a module missing."""
    config = _counts(state, "transformer_blocks", "single_transformer_blocks", f"{_APPROXIMATOR}.layers")
    return LAYOUT.to_original(state, config)


def iter_from_original(keys: Collection[str], read: Callable[[str], torch.Tensor]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """The original `keys` (no prefix) -> diffusers' (key, tensor) pairs, each read with `read` when its turn comes
    (a fused tensor's parts are views of it)."""
    config = _counts(keys, "double_blocks", "single_blocks", f"{_APPROXIMATOR}.layers")
    # Splitting a fused layer needs the attention width alone: the image input's rows.
    width = read("img_in.weight").shape[0]
    return LAYOUT.iter_from_original(keys, read, {**config, "num_attention_heads": 1, "attention_head_dim": width})


def transformer_config(shapes: Mapping[str, tuple[int, ...]], metadata: Mapping[str, str]) -> dict[str, Any]:
    """ChromaTransformer2DModel's settings of a file's transformer (`shapes`: its original keys, no prefix): sizes
    and counts from the tensors, the RoPE axes and patch size from the metadata, else the released model's.
    ValueError for what does not fit."""
    def need(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise ValueError(f"no {key}")
        return tuple(shapes[key])

    hidden, in_channels = need("img_in.weight")
    counts = _counts(shapes, "double_blocks", "single_blocks", f"{_APPROXIMATOR}.layers")
    head_dim = bfl.head_and_mlp(shapes, hidden, counts["num_layers"], counts["num_single_layers"], "Chroma",
                                "Chroma", "ChromaTransformer2DModel")
    approximator_hidden, approximator_in = need(f"{_APPROXIMATOR}.in_proj.weight")
    extra = json.loads(metadata.get(CONFIG_KEY) or "{}")
    axes = [int(a) for a in extra.get("axes_dims_rope", _CHROMA["axes_dims_rope"])]
    if sum(axes) != head_dim:
        raise ValueError(f"rope axes {axes} do not add up to the {head_dim}-wide heads; a file of another head width "
                         f"must say its axes in the metadata {CONFIG_KEY}")
    config = {"patch_size": int(extra.get("patch_size", 1)), "in_channels": in_channels, **counts,
              "attention_head_dim": head_dim, "num_attention_heads": hidden // head_dim,
              "joint_attention_dim": need("txt_in.weight")[1], "axes_dims_rope": axes,
              "approximator_num_channels": approximator_in, "approximator_hidden_dim": approximator_hidden}
    out_channels = need("final_layer.linear.weight")[0]
    if out_channels != in_channels:
        config["out_channels"] = out_channels
    return config


def load_transformer_file(path: str | Path, trust_pickle: bool | None = None, frozen_precision: str = "fp32",
                          weights: bool = True) -> ChromaTransformer2DModel:
    """A ChromaTransformer2DModel, in fp32 (or its linear weights in `frozen_precision`), from a file of Chroma's
    transformer in the original layout; without `weights`, only the header is read."""
    return read_transformer_file(
        path, trust_pickle, title="Chroma", cls=ChromaTransformer2DModel, mark=MARK, prefix_of=prefix_of,
        settings_of=transformer_config, convert=iter_from_original, frozen_precision=frozen_precision,
        weights=weights,
        fix="pass a Chroma transformer file (Chroma1-HD.safetensors, or `sdtrain export --single-file` of a Chroma "
            "run) or a diffusers transformer folder")


class Conditioner(ClipTokenizerFromScratch, spec.Conditioner):
    def long_text_length(self, preset: str, denoiser_source: str | Path | None = None) -> int:
        # What the pipeline samples with. The padding is masked, so a shorter model.t5_text_length changes nothing
        # for the captions that fit in it, and saves T5's and the transformer's time.
        return MAX_TEXT_LENGTH

    def tokenize(self, tokenizer: Any, index: int, captions: list[str]) -> dict[str, torch.Tensor]:
        tokens = tokenizer(captions, padding="max_length", truncation=True, max_length=tokenizer.model_max_length,
                           return_tensors="pt")
        return {ids_key(index): tokens.input_ids, mask_key(index): tokens.attention_mask}

    def build_text_encoder(self, name: str, settings: dict[str, Any], tokenizer: Any, key: str) -> nn.Module:
        return T5EncoderModel(t5_config(settings, tokenizer, key))

    def encode_text(self, encoders: list[nn.Module], ids: list[torch.Tensor], captions: list[str] | None,
                    masks: list[torch.Tensor | None] | None = None, sources: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
        mask = masks[0]  # `tokenize` makes one with every caption's ids
        states = encoders[0](ids[0], attention_mask=mask).last_hidden_state
        return {"text_emb": states, "text_mask": mask.to(states.dtype)}

    def text_shapes(self, text_encoders: dict[str, Any], lengths: list[int]) -> dict[str, tuple[int, ...]]:
        return {"text_emb": (lengths[0], text_encoders["text_encoder"].d_model), "text_mask": (lengths[0],)}


class Call(spec.DenoiserCall):
    objective = "flow_matching"

    def settings(self, settings: dict[str, Any], text_encoders: dict[str, nn.Module]) -> dict[str, Any]:
        return {"joint_attention_dim": text_encoders["text_encoder"].config.d_model}

    def shape(self, latent_channels: int, latent_size: int) -> dict[str, Any]:
        # Tokens are 2x2 patches of the latents; any latent size works (RoPE positions, no fixed table).
        return {"in_channels": latent_channels * 4}

    def downsampling(self, denoiser_config: Any) -> int:
        return 2

    def condition(self, text: dict[str, torch.Tensor], batch: dict[str, Any], device: torch.device
                  ) -> dict[str, Any]:
        return {"encoder_hidden_states": text["text_emb"], "text_attended": attended(text["text_mask"])}

    def denoise(self, denoiser: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                condition: dict[str, Any]) -> torch.Tensor:
        height, width = noisy.shape[-2:]
        context = condition["encoder_hidden_states"]
        tokens = pack(noisy)
        text = condition["text_attended"].to(noisy.device)
        # Every image token is attended, after the text's (the transformer's order).
        mask = torch.cat([text, text.new_ones(len(text), tokens.shape[1])], dim=1)
        output = denoiser(
            hidden_states=tokens, encoder_hidden_states=context,
            # The transformer multiplies it by 1000 itself: it takes sigma.
            timestep=timesteps / 1000,
            img_ids=image_ids(height // 2, width // 2, noisy.device, noisy.dtype),
            txt_ids=torch.zeros(context.shape[1], 3, device=noisy.device, dtype=noisy.dtype),
            # Captions that fill T5's length mask nothing.
            attention_mask=spec.mask_unless_full(mask), return_dict=False)[0]
        return unpack(output, height, width)


class Files(spec.FileInterchange):
    single_file_keys = tuple(prefix + MARK for prefix in PREFIXES)
    single_file = TransformerAlone(
        load_transformer_file, to_original, lambda config: "chroma", SHAPE_KEYS,
        description="The {title} transformer alone, in one file in Black Forest Labs' layout (Chroma's release)",
        comfyui="put `{name}` in `ComfyUI/models/diffusion_models/` and load it with Load Diffusion Model, beside "
                "`t5xxl` (Load CLIP, type chroma) and Flux.1's `ae` (Load VAE) files.")
    denoiser_lora_peft_names = True
    kohya_names_each_layer = False  # its kohya layout fuses q, k and v

    def kohya_lora(self, component: str, layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]], config: Any
                   ) -> dict[str, torch.Tensor]:
        if component == "transformer":
            return LAYOUT.kohya_lora(layers, dict(config))
        return super().kohya_lora(component, layers, config)


class Sampling(spec.Sampling):
    pipeline_class = ChromaPipeline
    pipeline_names = tuple(cls.__name__ for cls in _PIPELINES)

    def assemble(self, components: dict[str, nn.Module], tokenizers: list[Any], scheduler: Any,
                 distilled: bool = False) -> Any:
        return self.prepare(ChromaPipeline(
            scheduler=scheduler, vae=components["vae"], text_encoder=components["text_encoder"],
            tokenizer=tokenizers[0], transformer=components["transformer"]))

    def prepare(self, pipe: Any) -> Any:
        # The transformer's mask as training gives it, boolean (see the module docstring): the pipeline's own
        # floating-point one would be added to the attention scores, masking nothing.
        if isinstance(pipe, _PIPELINES) and "_get_t5_prompt_embeds" not in vars(pipe):
            encode = pipe._get_t5_prompt_embeds

            def boolean_mask(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
                states, mask = encode(*args, **kwargs)
                return states, mask.bool()

            pipe._get_t5_prompt_embeds = boolean_mask
        return pipe

    def defaults(self, denoiser_config: Any, distilled: bool = False) -> dict[str, Any]:
        # ChromaPipeline's guidance_scale (5); its 35 steps are not taken, as Flux.1-dev's 28 are not: sdtrain's
        # own step counts apply.
        return {"guidance": 5.0}

    def arguments(self, pipe: Any, guidance: float, negative_prompt: str | None) -> dict[str, Any]:
        # True classifier-free guidance above 1 against the negative prompt (None: the pipeline's empty one); T5
        # reads as many tokens as it trained with.
        return {"guidance_scale": guidance, "negative_prompt": negative_prompt,
                "max_sequence_length": min(pipe.tokenizer.model_max_length, MAX_TEXT_LENGTH)}


CHROMA = spec.ModelFamily(
    name="chroma", title="Chroma", hub_tags=("chroma",),
    components=spec.Components(
        vae=spec.Component(AutoencoderKL, "vae", blocks=vae_blocks),
        text_encoder=spec.Component(T5EncoderModel, "text_encoder", tokenizer="tokenizer", long_text=True,
                                    lora=True, blocks=t5_blocks),
        # The transformer's adapters in BFL's layout, q, k, v (and a single block's MLP input) fused, as ComfyUI's
        # Chroma model names its weights.
        transformer=spec.Component(ChromaTransformer2DModel, "denoiser", kohya_prefix=kohya.PREFIX,
                                   blocks=transformer_blocks),
    ),
    presets=PRESETS, codec=FLUX_CODEC, conditioner=Conditioner(), denoising=Call(), files=Files(),
    sampling=Sampling(),
)
