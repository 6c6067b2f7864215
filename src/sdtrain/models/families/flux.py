"""Flux.1 (Black Forest Labs, 2024): a 16-channel AutoencoderKL with a shift, CLIP ViT-L for one pooled vector,
T5-XXL for the sequence attended to, and a rectified-flow transformer (FluxTransformer2DModel: double-stream
blocks over image and text, then single-stream blocks over both).

The conditioner follows Flux's own: T5's last hidden states as the context and CLIP's pooled output as the
global vector; text positions are all zero and image positions are (0, row, column) for 3-axis RoPE. The
latents are packed 2x2 into tokens of 4 x 16 channels before the transformer and unpacked after. Flux.1-dev
was distilled with a guidance embedding, fed a constant while training (``diffusion.flow.guidance``); schnell has
none. An empty caption (caption dropout) is encoded like any other, as the pipeline encodes it.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    FluxControlNetModel,
    FluxControlNetPipeline,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
)
from diffusers.configuration_utils import FrozenDict
from diffusers.models.normalization import RMSNorm
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import CLIPTextModel, T5EncoderModel

from sdtrain.models import single_file
from sdtrain.models.families import bfl_flux, spec
from sdtrain.models.families.autoencoder import FLUX_CODEC, FLUX_VAE, TINY_FLUX_VAE, vae_blocks
from sdtrain.models.families.bfl import original_prefix, original_rows
from sdtrain.models.families.clip import ClipTokenizerFromScratch
from sdtrain.models.families.patches import image_ids, pack, unpack
from sdtrain.models.families.spec import ControlSpec, ReferenceSpec, SingleFileLayout
from sdtrain.models.families.text_towers import (
    CLIP_L,
    T5_XXL,
    TINY_CLIP,
    TINY_T5,
    clip_text_config,
    t5_blocks,
    t5_config,
    text_blocks,
)

# Flux.1-dev: 11,901,408,320 parameters (its context and pooled widths come from T5 and CLIP, see
# Call.settings).
_FLUX_DEV = dict(patch_size=1, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
                 guidance_embeds=True, axes_dims_rope=[16, 56, 56])
_FLUX_SCHNELL = {**_FLUX_DEV, "guidance_embeds": False}
# The scheduler each was released with: dev's shift grows with the image (mu from 0.5 at 256 tokens to 1.15 at
# 4096), schnell's is none.
_DEV_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                      base_image_seq_len=256, max_image_seq_len=4096)
_SCHNELL_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)

# dev's structure (guidance embedding, double and single blocks) at a size tests train; the RoPE axes add up to
# the head width.
_TINY_FLUX = dict(patch_size=1, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                  guidance_embeds=True, axes_dims_rope=[4, 6, 6])

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"vae": TINY_FLUX_VAE, "text_encoder": TINY_CLIP, "text_encoder_2": TINY_T5,
             "transformer": _TINY_FLUX, "scheduler": _DEV_SCHEDULER},
    "flux-dev": {"vae": FLUX_VAE, "text_encoder": CLIP_L, "text_encoder_2": T5_XXL, "transformer": _FLUX_DEV,
                 "scheduler": _DEV_SCHEDULER},
    "flux-schnell": {"vae": FLUX_VAE, "text_encoder": CLIP_L, "text_encoder_2": T5_XXL,
                     "transformer": _FLUX_SCHNELL, "scheduler": _SCHNELL_SCHEDULER},
}


def _guidance_embedding(source: str | Path) -> bool | None:
    """Whether the transformer at `source` has dev's guidance embedding, from its config or its file's keys alone;
    None when neither says (a run, or no such file)."""
    path = Path(source)
    if path.is_file() and path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt") as file:
                keys = list(file.keys())
        except (OSError, SafetensorError):
            return None  # the loader reports what is wrong with the file
        prefix = original_prefix(keys)
        return None if prefix is None else f"{prefix}guidance_in.in_layer.weight" in keys
    for config in (path / "transformer" / "config.json", path / "config.json"):
        if config.is_file():
            try:
                return bool(json.loads(config.read_text()).get("guidance_embeds", False))
            except (OSError, ValueError):
                return None  # the loader reports what is wrong with the file
    return None


def transformer_blocks(transformer: nn.Module) -> list:
    return [*transformer.transformer_blocks, *getattr(transformer, "single_transformer_blocks", [])]


def controlnet_from_transformer(transformer: FluxTransformer2DModel, latent_factor: int) -> FluxControlNetModel:
    """A FluxControlNetModel of `transformer`'s first 4 double and 10 single blocks (fewer where the transformer has
    fewer), their weights and the embedders' copied, its input and output layers zero: it starts by adding nothing.
    The depth is sdtrain's, between the two ControlNets users compare with: the double blocks of diffusers'
    ``train_controlnet_flux.py`` (4 double and 4 single by default; its README trains 4 and 0) and the single
    blocks of InstantX's released Flux.1-dev ControlNets (5 double and 10 single), so the map's residuals reach as
    many single blocks as those do. It reads the conditioning image's packed latents, as diffusers' Flux ControlNet
    pipeline gives them to a ControlNet without a hint block."""
    config = transformer.config
    controlnet = FluxControlNetModel.from_transformer(
        transformer, num_layers=min(4, config.num_layers), num_single_layers=min(10, config.num_single_layers),
        attention_head_dim=config.attention_head_dim, num_attention_heads=config.num_attention_heads)
    # from_transformer builds it from the transformer's whole config, and diffusers keeps the settings the ControlNet
    # does not take beside its own (out_channels, null in a transformer read from a folder): saved with them, the
    # ControlNet's folder would warn at every load. Its config is replaced as register_to_config replaces it.
    takes = inspect.signature(FluxControlNetModel.__init__).parameters
    controlnet._internal_dict = FrozenDict({key: value for key, value in controlnet.config.items()
                                            if key in takes or key.startswith("_")})
    return controlnet.to(next(transformer.parameters()).dtype)


def control_latents(vae: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The conditioning images' latents as FluxControlNetPipeline gives them: normalised as the denoiser's are."""
    latents = vae.encode(images * 2 - 1).latent_dist.mode()
    return (latents - vae.config.shift_factor) * vae.config.scaling_factor


def reference_latents(vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """A reference image's latents as FluxKontextPipeline gives them: the posterior's mode, normalised as the
    denoiser's latents are."""
    latents = vae.encode(pixels).latent_dist.mode()
    return (latents - vae.config.shift_factor) * vae.config.scaling_factor


def controlnet_residuals(controlnet: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                         condition: dict[str, Any], latents: torch.Tensor) -> dict[str, Any]:
    """What the ControlNet adds after each double and single block, as FluxControlNetPipeline computes it: from the
    packed noisy and conditioning latents at the same positions, the text, and dev's guidance."""
    height, width = noisy.shape[-2:]
    context = condition["encoder_hidden_states"]
    double, single = controlnet(
        hidden_states=pack(noisy), controlnet_cond=pack(latents.to(noisy.dtype)), timestep=timesteps / 1000,
        guidance=condition.get("guidance"), pooled_projections=condition["pooled_projections"],
        encoder_hidden_states=context, img_ids=image_ids(height // 2, width // 2, noisy.device, noisy.dtype),
        txt_ids=torch.zeros(context.shape[1], 3, device=noisy.device, dtype=noisy.dtype), return_dict=False)
    return {"controlnet_block_samples": double, "controlnet_single_block_samples": single}


def _xavier(*layers: nn.Linear) -> None:
    """Xavier-uniform weights and zero biases for `layers` taken as one Linear, their outputs stacked: BFL's layout
    fuses q, k and v (in a single block also the MLP's input) into one layer, and the reference draws its bound
    from that layer's fans."""
    fan_in, fan_out = layers[0].in_features, sum(layer.out_features for layer in layers)
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    for layer in layers:
        nn.init.uniform_(layer.weight, -bound, bound)
        if layer.bias is not None:
            nn.init.zeros_(layer.bias)


def _normal(*layers: nn.Linear, std: float = 0.02) -> None:
    for layer in layers:
        nn.init.normal_(layer.weight, std=std)
        if layer.bias is not None:
            nn.init.zeros_(layer.bias)


def _zero(*layers: nn.Linear) -> None:
    for layer in layers:
        nn.init.zeros_(layer.weight)
        if layer.bias is not None:
            nn.init.zeros_(layer.bias)


def reference_init(transformer: FluxTransformer2DModel) -> None:
    """Flux.1's reference initialisation (MLPerf's torchtitan FluxModel.init_weights, after DiT's), on diffusers'
    modules, in its order: Xavier-uniform weights and zero biases for every linear layer (the image and text
    inputs, attention and MLP layers, a fused layer's bound from its whole shape); N(0, 0.02) for the timestep,
    pooled-text (vector) and guidance embedders' MLPs; zeros for every adaLN modulation (each block starts as the
    identity) and for the final adaLN and output projection (the output starts at zero); RMSNorm scales at one."""
    _xavier(transformer.x_embedder)  # img_in
    _xavier(transformer.context_embedder)  # txt_in
    embedders = transformer.time_text_embed
    # time_in, vector_in, guidance_in (dev's alone).
    for mlp in (embedders.timestep_embedder, embedders.text_embedder, getattr(embedders, "guidance_embedder", None)):
        if mlp is not None:
            _normal(mlp.linear_1, mlp.linear_2)
    for block in transformer.single_transformer_blocks:
        attn = block.attn
        _xavier(attn.to_q, attn.to_k, attn.to_v, block.proj_mlp)  # linear1
        _xavier(block.proj_out)  # linear2
        _zero(block.norm.linear)  # modulation
    for block in transformer.transformer_blocks:
        attn = block.attn
        for mlp in (block.ff, block.ff_context):  # img_mlp, txt_mlp
            _xavier(mlp.net[0].proj)
            _xavier(mlp.net[2])
        _xavier(attn.to_q, attn.to_k, attn.to_v)  # img_attn.qkv
        _xavier(attn.to_out[0])  # img_attn.proj
        _zero(block.norm1.linear)  # img_mod
        _xavier(attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)  # txt_attn.qkv
        _xavier(attn.to_add_out)  # txt_attn.proj
        _zero(block.norm1_context.linear)  # txt_mod
    _zero(transformer.norm_out.linear, transformer.proj_out)  # final_layer
    for module in transformer.modules():  # the q and k norms (the LayerNorms have no parameters)
        if isinstance(module, (RMSNorm, nn.RMSNorm)) and module.weight is not None:
            nn.init.ones_(module.weight)


class TransformerFile(SingleFileLayout):
    """Black Forest Labs' release file (flux1-dev.safetensors'): the transformer alone, in their layout, bare or
    under ComfyUI's ``model.diffusion_model.`` (`bfl_flux`). Its VAE, text encoders and
    tokenizers are loaded separately, as Flux.1 tools load them. Written in bf16 with ``--half``: Flux.1's
    activations overflow fp16."""

    holds = ("transformer",)
    half_dtype = "bf16"
    description = "The {title} transformer alone, in one file in Black Forest Labs' layout"
    comfyui = ("put `{name}` in `ComfyUI/models/diffusion_models/` and load it with Load Diffusion Model, beside "
               "Flux.1's own `clip_l` and `t5xxl` (DualCLIPLoader) and `ae` (Load VAE) files.")

    def load(self, name: str, path: Path, *, trust_pickle: bool | None, frozen_precision: str, weights: bool,
             latent_constants: Callable[[], dict[str, float | None]]) -> nn.Module:
        return bfl_flux.load_transformer(single_file.open_file(path, trust_pickle),
                                         frozen_precision=frozen_precision, weights=weights)

    def write(self, out: Path, components: dict[str, nn.Module], *, half: bool, scheduler: Any,
              text_layout: str, text_source: str | Path | None) -> None:
        bfl_flux.save_original(out, components["transformer"], half=half)


class Conditioner(ClipTokenizerFromScratch, spec.Conditioner):
    def long_text_length(self, preset: str, denoiser_source: str | Path | None = None) -> int:
        # What each was released to sample with: dev 512, schnell 256 (Black Forest Labs' and kohya's); a
        # pretrained transformer is dev's when it has the guidance embedding.
        distilled = _guidance_embedding(denoiser_source) if denoiser_source else None
        if distilled is None:
            distilled = preset != "flux-schnell"
        return 512 if distilled else 256

    def build_text_encoder(self, name: str, settings: dict[str, Any], tokenizer: Any, key: str) -> nn.Module:
        if name == "text_encoder_2":
            return T5EncoderModel(t5_config(settings, tokenizer, key))
        return CLIPTextModel(clip_text_config(settings, tokenizer, key))

    def encode_text(self, encoders: list[nn.Module], ids: list[torch.Tensor], captions: list[str] | None,
                    masks: list[torch.Tensor | None] | None = None, sources: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
        clip, t5 = encoders
        return {"text_emb": t5(ids[1]).last_hidden_state, "text_pooled": clip(ids[0]).pooler_output}

    def text_shapes(self, text_encoders: dict[str, Any], lengths: list[int]) -> dict[str, tuple[int, ...]]:
        return {"text_emb": (lengths[1], text_encoders["text_encoder_2"].d_model),
                "text_pooled": (text_encoders["text_encoder"].hidden_size,)}


class Call(spec.DenoiserCall):
    objective = "flow_matching"

    def settings(self, settings: dict[str, Any], text_encoders: dict[str, nn.Module]) -> dict[str, Any]:
        return {"joint_attention_dim": text_encoders["text_encoder_2"].config.d_model,
                "pooled_projection_dim": text_encoders["text_encoder"].config.hidden_size}

    def shape(self, latent_channels: int, latent_size: int) -> dict[str, Any]:
        # Tokens are 2x2 patches of the latents; any latent size works (RoPE positions, no fixed table).
        return {"in_channels": latent_channels * 4}

    def downsampling(self, denoiser_config: Any) -> int:
        return 2

    def initialise(self, denoiser: nn.Module) -> bool:
        if not isinstance(denoiser, FluxTransformer2DModel):
            return False
        reference_init(denoiser)
        return True

    def condition(self, text: dict[str, torch.Tensor], batch: dict[str, Any], device: torch.device
                  ) -> dict[str, Any]:
        return {"encoder_hidden_states": text["text_emb"], "pooled_projections": text["text_pooled"]}

    def takes_guidance(self, denoiser_config: Any) -> bool:
        return bool(denoiser_config.guidance_embeds)

    def denoise(self, denoiser: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                condition: dict[str, Any]) -> torch.Tensor:
        height, width = noisy.shape[-2:]
        context = condition["encoder_hidden_states"]
        dtype = noisy.dtype
        tokens, ids = pack(noisy), image_ids(height // 2, width // 2, noisy.device, dtype)
        reference = condition.get("reference_latents")
        if reference is not None:
            # Kontext's: the reference's tokens after the noisy ones, at the same rows and columns on a second
            # frame (the first position 1), the prediction the noisy ones' alone.
            reference_ids = image_ids(reference.shape[-2] // 2, reference.shape[-1] // 2, noisy.device, dtype)
            reference_ids[:, 0] = 1
            tokens = torch.cat([tokens, pack(reference.to(dtype))], dim=1)
            ids = torch.cat([ids, reference_ids])
        output = denoiser(
            hidden_states=tokens, encoder_hidden_states=context,
            pooled_projections=condition["pooled_projections"],
            # The transformer multiplies both by 1000 itself: it takes sigma, and guidance as the user gives it.
            timestep=timesteps / 1000, guidance=condition.get("guidance"), img_ids=ids,
            txt_ids=torch.zeros(context.shape[1], 3, device=noisy.device, dtype=dtype),
            controlnet_block_samples=condition.get("controlnet_block_samples"),
            controlnet_single_block_samples=condition.get("controlnet_single_block_samples"),
            return_dict=False)[0]
        return unpack(output[:, :(height // 2) * (width // 2)], height, width)


class Files(spec.FileInterchange):
    # BFL's own files hold the transformer alone; ComfyUI's all-in-one files put it under model.diffusion_model.
    single_file_keys = ("double_blocks.", "model.diffusion_model.double_blocks.")
    single_file = TransformerFile()
    denoiser_lora_peft_names = True
    kohya_names_each_layer = False  # its kohya layout fuses q, k and v

    def holds_file(self, keys: list[str]) -> bool:
        # Other layouts share the block names: Flux.1's modulates each block with its own layers, never with one
        # shared by all the double blocks (Flux.2's) or one network for every block (Chroma's approximator).
        return super().holds_file(keys) and not any(
            "double_stream_modulation_img." in key or "distilled_guidance_layer." in key for key in keys)

    def file_scheduler(self, path: str | Path, trust_pickle: bool | None) -> dict[str, Any] | None:
        # dev's guidance embedding (guidance_in) marks the guidance-distilled model, sampled with the dynamic shift.
        keys = single_file.tensor_names(path, trust_pickle)
        prefix = original_prefix(keys) or ""
        dev = any(key.startswith(f"{prefix}guidance_in.") for key in keys)
        return dict(_DEV_SCHEDULER if dev else _SCHNELL_SCHEDULER)

    def kohya_lora(self, component: str, layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]], config: Any
                   ) -> dict[str, torch.Tensor]:
        # The transformer's adapters are named in BFL's layout, where q, k, v (and a single block's MLP input)
        # are one fused Linear: the layout module fuses their adapters too, as ComfyUI and kohya expect.
        if component == "transformer":
            return bfl_flux.kohya_lora(layers, dict(config))
        return super().kohya_lora(component, layers, config)

    def original_rows(self, component: str, path: str, rows: torch.Tensor) -> torch.Tensor:
        return original_rows(path, rows) if component == "transformer" else rows


class Sampling(spec.Sampling):
    pipeline_class = FluxPipeline
    pipeline_names = ("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline")

    def variant(self, source: str | Path) -> spec.Variant | None:
        # Kontext's folder names its editing pipeline; its transformer is dev's architecture, so a file with the
        # guidance embedding is dev's or Kontext's and says not which. Schnell's has none.
        if spec.pipeline_name(source) == FluxKontextPipeline.__name__:
            return spec.Variant("kontext", "Flux.1 Kontext")
        guided = _guidance_embedding(source)
        if guided is False:
            return spec.Variant("schnell", "Flux.1-schnell")
        return spec.Variant("dev", "Flux.1-dev") if guided and spec.pipeline_name(source) is not None else None

    def assemble(self, components: dict[str, nn.Module], tokenizers: list[Any], scheduler: Any,
                 distilled: bool = False) -> Any:
        return FluxPipeline(scheduler=scheduler, vae=components["vae"], text_encoder=components["text_encoder"],
                            tokenizer=tokenizers[0], text_encoder_2=components["text_encoder_2"],
                            tokenizer_2=tokenizers[-1], transformer=components["transformer"])

    def defaults(self, denoiser_config: Any, distilled: bool = False) -> dict[str, Any]:
        # dev's pipeline default; schnell (no guidance embedding) is distilled to 4 steps without guidance, which
        # at 5 would run true classifier-free guidance: twice the cost and over-saturated images.
        if denoiser_config.guidance_embeds:
            return {"guidance": 3.5}
        return {"guidance": 1.0, "steps": 4}

    def arguments(self, pipe: Any, guidance: float, negative_prompt: str | None) -> dict[str, Any]:
        # T5 reads as many tokens as it was trained with. A guidance-distilled model takes the scale as its
        # embedding's input; one without (schnell's architecture trained here with caption dropout) gets
        # classifier-free guidance above 1, which FluxPipeline calls true_cfg_scale and runs only with a negative
        # prompt. Released schnell is distilled to sample without either: give it a guidance of 1 or less.
        arguments: dict[str, Any] = {"max_sequence_length": pipe.tokenizer_2.model_max_length}
        if pipe.transformer.config.guidance_embeds:
            return {**arguments, "guidance_scale": guidance, "negative_prompt": negative_prompt}
        if guidance <= 1:
            return {**arguments, "negative_prompt": None}
        return {**arguments, "true_cfg_scale": guidance, "negative_prompt": negative_prompt or ""}


FLUX = spec.ModelFamily(
    name="flux", title="Flux.1", hub_tags=("flux", "flux-diffusers"),
    components=spec.Components(
        vae=spec.Component(AutoencoderKL, "vae", blocks=vae_blocks),
        text_encoder=spec.Component(CLIPTextModel, "text_encoder", tokenizer="tokenizer", lora=True,
                                    kohya_prefix="lora_te1_", blocks=text_blocks),
        text_encoder_2=spec.Component(T5EncoderModel, "text_encoder", tokenizer="tokenizer_2", long_text=True,
                                      blocks=t5_blocks),
        transformer=spec.Component(FluxTransformer2DModel, "denoiser", kohya_prefix="lora_unet_",
                                   blocks=transformer_blocks),
    ),
    presets=PRESETS, codec=FLUX_CODEC, conditioner=Conditioner(), denoising=Call(), files=Files(),
    sampling=Sampling(),
    controlnet=ControlSpec(FluxControlNetModel, FluxControlNetPipeline, controlnet_from_transformer,
                           controlnet_residuals, control_latents, image_argument="control_image",
                           blocks=transformer_blocks,
                           # As diffusers' train_controlnet_flux.py: Flux.1-dev is guidance-distilled and is never
                           # sampled on an empty prompt.
                           caption_dropout=0.0),
    reference=ReferenceSpec(FluxKontextPipeline, reference_latents,
                            at_own_size=lambda sources: nullcontext({"_auto_resize": False})),
)
