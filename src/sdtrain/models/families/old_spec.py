"""TEMPORARY: the one-class family spec, read through the parts by `legacy.adapt` until every family is parts."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from sdtrain.errors import UserError
from sdtrain.models.families.clip import pool_at_eos
from sdtrain.models.families.codec import LatentCodec
from sdtrain.models.families.spec import (
    ControlSpec,
    InstructSpec,
    ReferenceSpec,
    SingleFileLayout,
    ids_key,
    mask_key,
    text_model_path,
)
from sdtrain.models.tokenizer import train_clip_tokenizer


class LegacyFamily:
    name: str
    """The config's ``model.family`` value."""
    title: str
    """What users call it, in messages."""
    components: dict[str, type[nn.Module]]
    """Component name (vae, text_encoder, unet, ...) -> its class, in the order they are built."""
    text_encoders: tuple[str, ...] = ("text_encoder",)
    """The text encoder components, in the order the conditioner reads them."""
    tokenizers: tuple[str, ...] = ("tokenizer",)
    """The tokenizer folder of each text encoder (in a pipeline folder), same order."""
    denoiser: str = "unet"
    """The component trained to denoise (``unet``, ``transformer``)."""
    objective: str = "noise_prediction"
    """What the denoiser learns (train.objectives): ``noise_prediction`` on a DDPM schedule, or ``flow_matching``."""
    denoiser_lora_peft_names: bool = False
    """Whether diffusers' LoRA file keeps peft's own key names for the denoiser, as diffusers' SD3 and Flux scripts
    save a transformer's: its converter renames only the modules a UNet has (to_q, to_k, to_v, to_out.0), and the
    transformer loader, finding peft names in the first key, silently drops every renamed adapter."""
    lora_text_encoders: tuple[str, ...] | None = None
    """The text encoders ``lora.text_encoder`` adapts (None: all); T5 is left frozen, as kohya's and diffusers'
    scripts leave it."""
    long_text_tokenizers: tuple[str, ...] = ()
    """The tokenizers (of `tokenizers`) that feed a long-context encoder, T5 or a language model: their length is
    ``model.t5_text_length`` (the key keeps T5's name, the first such encoder), else the family's
    `long_text_length`, not CLIP's 77."""
    codec: LatentCodec
    """How its VAE encodes and decodes, and how the latents are normalised for the denoiser."""
    pipeline_class: type
    """The diffusers pipeline export writes and generate loads."""
    hub_tags: tuple[str, ...] = ()
    """The Hugging Face Hub tags a model card of this family carries (empty: its name), as the Hub's own cards of
    its models tag them."""
    pipeline_loading: dict[str, Any] = {}
    """What the pipeline class's from_pretrained is also given to load a pretrained folder of this family."""
    pipeline_names: tuple[str, ...] = ()
    """model_index.json ``_class_name`` values of pretrained folders of this family."""
    single_file_keys: tuple[str, ...] = ()
    """Key prefixes that mark a single file as this family's (the original layout)."""
    single_file: SingleFileLayout | None = None
    """The family's single-file layout, None where it has none this release writes or reads."""
    controlnet: ControlSpec | None = None
    """How the family hosts a ControlNet; None where this release trains none for it."""
    instruct: InstructSpec | None = None
    """How the family's denoiser learns InstructPix2Pix's editing; None where this release trains none for it."""
    reference: ReferenceSpec | None = None
    """How the family's denoiser learns to edit by reference; None where this release trains none for it."""
    block_lists: dict[type[nn.Module], Callable[[nn.Module], list[nn.Module | None]]] = {}
    """Component class -> its repeated blocks, in forward order (None entries, an absent mid block, are skipped)."""
    presets: dict[str, dict[str, dict[str, Any]]] = {}
    """Preset name -> component name -> constructor settings."""
    kohya_prefixes: dict[str, str] = {}
    """Component name -> the prefix of its modules in kohya's LoRA files (``lora_unet_``, ``lora_te_``)."""
    kohya_names_each_layer: bool = True
    """Whether kohya's layout names each adapted layer as a module of its own (SD's, SDXL's), so that LyCORIS
    adapters (DoRA's magnitudes, LoKr's factors) are written in it too; not where it fuses layers (Flux.1's q, k
    and v), whose DoRA and LoKr adapters go in diffusers' file alone."""
    comfyui_reads_diffusers_lora: bool = False
    """Whether ComfyUI's Load LoRA reads the diffusers LoRA file of this family's (it reads kohya's of every
    family that has `kohya_prefixes`)."""
    weight_prefixes: dict[str, tuple[tuple[str, str], ...]] = {}
    """Component name -> how the names of its weights in a released folder begin, and what the module calls them
    instead (the first pair a name starts with): a language model's tower read from a folder of the whole model
    (its head or vision tower beside it: ``model.`` read as ``""``), or a model saved under transformers' earlier
    names (``visual.`` read as ``model.visual.``)."""
    embedding_keys: tuple[str, ...] = ()
    """The key of each text encoder's vectors in a textual-inversion file, in text encoder order; empty: the file
    holds one key, the placeholder (diffusers' and A1111's layout for one text encoder)."""

    def blocks(self, root: nn.Module) -> list[nn.Module]:
        """The blocks of every component of this family inside `root` (a component itself, or a module that
        holds components), in the order of `root.modules()`."""
        listed: set[int] = set()
        for module in root.modules():
            lister = self.block_lists.get(type(module))
            if lister is not None:
                listed.update(id(block) for block in lister(module) if block is not None)
        return [module for module in root.modules() if id(module) in listed]

    def preset(self, preset: str, component: str) -> dict[str, Any]:
        """A copy of a preset's settings for one component; an unknown preset is one line listing this family's."""
        if preset not in self.presets:
            raise UserError(f"model.preset: '{preset}' is not a {self.title} preset; choose one of "
                            f"{', '.join(self.presets)} (or set model.family)")
        return copy.deepcopy(self.presets[preset][component])

    @property
    def text_reads_source(self) -> bool:
        """Whether the family's text encoder reads the reference it edits too (`ReferenceSpec.text_reads_source`)."""
        return self.reference is not None and self.reference.text_reads_source

    @property
    def edits_only(self) -> bool:
        """Whether the family's models only edit by reference: its pipeline is its editing one, which takes the
        source (Qwen-Image-Edit's)."""
        return self.reference is not None and self.reference.pipeline_class is self.pipeline_class

    def pipeline_classes(self) -> tuple[type, ...]:
        """Every diffusers pipeline class that samples this family's models: its own, and those of the modes it
        hosts (ControlNet's, InstructPix2Pix's, editing by reference)."""
        modes = (self.controlnet, self.instruct, self.reference)
        return (self.pipeline_class, *(mode.pipeline_class for mode in modes if mode is not None))

    def module_classes(self) -> list[type[nn.Module]]:
        """Every class a checkpoint of this family may hold a module of: its components', and its ControlNet's."""
        return [*self.components.values(), *([self.controlnet.model_class] if self.controlnet else [])]

    def holds_file(self, keys: list[str]) -> bool:
        """Whether a single file whose tensors are `keys` holds this family's model in its original layout: by
        default, a key under one of `single_file_keys`."""
        return any(key.startswith(self.single_file_keys) for key in keys) if self.single_file_keys else False

    def file_scheduler(self, keys: list[str]) -> dict[str, Any] | None:
        """The training schedule a single file of this family's was released with, told from its tensor `keys`;
        None: the preset's."""
        return None

    def long_text_length(self, preset: str, denoiser_source: str | Path | None = None) -> int:
        """Tokens per caption of the long-context encoder (T5, a language model) when ``model.t5_text_length`` is
        unset: what the released model samples with, for a denoiser built from `preset` or loaded from
        `denoiser_source` (a folder or file)."""
        return 256

    # ----------------------------------------------------------------------------- tokenizers

    def tokenize(self, tokenizer: Any, index: int, captions: list[str]) -> dict[str, torch.Tensor]:
        """Text encoder `index`'s batch entries for `captions`, which the loader makes as it collates: the token ids
        (under `ids_key`), padded to the tokenizer's length, and whatever else the encoder reads (an attention
        mask under `mask_key`). The captions as they are: a family whose encoder is a chat model templates them."""
        return {ids_key(index): tokenizer(captions, padding="max_length", truncation=True,
                                               max_length=tokenizer.model_max_length, return_tensors="pt").input_ids}

    def token_inputs(self, batch: dict[str, Any], device: torch.device | None = None
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Each text encoder's token ids and attention mask (None where it reads none) from a batch `tokenize`
        filled, moved to `device`."""
        def moved(value: Any) -> Any:
            return value if value is None or device is None else value.to(device, non_blocking=True)

        count = range(len(self.text_encoders))
        return [moved(batch[ids_key(i)]) for i in count], [moved(batch.get(mask_key(i))) for i in count]

    def train_tokenizer(self, captions: list[str], out_dir: Path, vocab_size: int, max_length: int) -> Any:
        """A tokenizer for a model trained from scratch, learnt from the run's captions and saved to `out_dir`
        (every text encoder of the family reads its ids): CLIP's byte-level BPE layout."""
        return train_clip_tokenizer(captions, out_dir, vocab_size, max_length)

    # ----------------------------------------------------------------------------- building from presets

    def build_text_encoder(self, name: str, settings: dict[str, Any], tokenizer: Any, key: str) -> nn.Module:
        """Text encoder `name` from a preset's settings, its ids those of `tokenizer` (the pooled output is read
        at the eos position, so they must agree)."""
        raise NotImplementedError

    def denoiser_settings(self, settings: dict[str, Any], text_encoders: dict[str, nn.Module]) -> dict[str, Any]:
        """What the denoiser's shape takes from the text encoders (the width it attends to, pooled sizes), given
        its other `settings` (preset and overrides)."""
        raise NotImplementedError

    def denoiser_shape(self, latent_channels: int, latent_size: int) -> dict[str, Any]:
        """What the denoiser's shape takes from the latents it denoises."""
        return {"in_channels": latent_channels, "out_channels": latent_channels, "sample_size": latent_size}

    def init_denoiser(self, denoiser: nn.Module) -> bool:
        """Re-initialise a trainable `denoiser` just built from a preset as the family's reference training code
        initialises it (``model.denoiser_init``), drawing from torch's default generator; False, with `denoiser`
        and the generator untouched, for a family that has no reference initialisation (diffusers' own stays)."""
        return False

    # ----------------------------------------------------------------------------- the conditioner

    def encode_text(self, encoders: list[nn.Module], ids: list[torch.Tensor], captions: list[str] | None,
                    masks: list[torch.Tensor | None] | None = None, sources: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
        """The text conditioning of a batch, from each text encoder's token ids (and attention mask, for an encoder
        that reads one: `token_inputs`): ``text_emb`` (the sequence the denoiser attends to) and any pooled vectors
        or mask, under the names pre-encoded shards store them by. `captions` (None when unknown) tell a family
        that conditions empty captions on zeros which rows are empty; `sources`, the edits' source images in
        [-1, 1], are read by a family whose text encoder reads them (`ReferenceSpec.text_reads_source`)."""
        raise NotImplementedError

    def text_shapes(self, text_encoders: dict[str, Any], lengths: list[int]) -> dict[str, tuple[int, ...]]:
        """The shape of one sample's entry of each `encode_text` output, from the encoders' configs (by name) and
        each tokenizer's tokens per caption (in `tokenizers` order)."""
        raise NotImplementedError

    def condition(self, text: dict[str, torch.Tensor], batch: dict[str, Any], device: torch.device
                  ) -> dict[str, Any]:
        """The denoiser's keyword arguments for a batch, from its text conditioning and what the batch carries
        (``size_ids``: each image's original size, crop corner and training size)."""
        return {"encoder_hidden_states": text["text_emb"]}

    def unused_modules(self, name: str, module: nn.Module) -> list[str]:
        """The paths of component `name`'s modules (in `module`) whose output nothing the family reads depends on
        (a text stream the last block computes and the model discards; a language model's layers above the one
        read): they still train and are saved (a model from scratch keeps what it drew for them), but get no
        gradient, which data-parallel training is told."""
        return []

    # ----------------------------------------------------------------------------- the backbone adapter

    def denoise(self, denoiser: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                condition: dict[str, Any]) -> torch.Tensor:
        """The denoiser's output for latents `noisy` at `timesteps` (on the schedule's 0..1000 scale)."""
        return denoiser(noisy, timesteps, **condition).sample

    def takes_guidance(self, denoiser_config: Any) -> bool:
        """Whether the denoiser has a guidance embedding (Flux.1-dev's), fed ``condition["guidance"]``."""
        return False

    def max_latent_side(self, denoiser_config: Any) -> int | None:
        """The longest latent side the denoiser's position table covers (SD3's ``pos_embed_max_size`` patches);
        None: any."""
        return None

    def downsampling(self, denoiser_config: Any) -> int:
        """How much smaller than the latent the denoiser's coarsest level is (bucket sides must survive it)."""
        return 2 ** (len(denoiser_config.block_out_channels) - 1)

    def image_token_side(self, denoiser_config: Any) -> int:
        """How many latent pixels a side of one image token spans, for the image's token count the dynamic shift
        reads: by default `downsampling` (the 2x2 patches of Flux.1's and SD3's transformers)."""
        return self.downsampling(denoiser_config)

    # ----------------------------------------------------------------------------- file layouts

    def kohya_lora(self, component: str, layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]], config: Any
                   ) -> dict[str, torch.Tensor]:
        """LoRA adapters of `component` (module path -> down weight, up weight, alpha) in kohya's layout:
        ``<name>.lora_down.weight / .lora_up.weight / .alpha``, with a true scalar alpha (scale alpha / rank)."""
        state = {}
        for path, (down, up, alpha) in layers.items():
            key = self.kohya_lora_name(component, path, config)
            state.update({f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up,
                          f"{key}.alpha": torch.tensor(float(alpha))})
        return state

    def kohya_lora_name(self, component: str, path: str, config: Any) -> str:
        """kohya's name of the adapted module at `path` in `component` (whose config is `config`)."""
        if component in self.text_encoders:
            path = text_model_path(path)
        return self.kohya_prefixes[component] + self.original_module_path(component, path, config).replace(".", "_")

    def original_rows(self, component: str, path: str, rows: torch.Tensor) -> torch.Tensor:
        """A vector of one value per output row of `component`'s layer at `path` (a DoRA magnitude, in diffusers'
        row order) in the order the original layout keeps that layer's rows; as it is by default."""
        return rows

    def original_module_path(self, component: str, path: str, config: Any) -> str:
        """A module's path in the layout kohya names it by; SD's kohya files use diffusers' own paths."""
        return path

    def load_embedding(self, pipe: Any, path: str) -> None:
        """A textual-inversion file into the family's pipeline through diffusers' loader: a one-key file as it is;
        a file keyed by text encoder (SDXL's clip_l/clip_g) one encoder at a time, under the token its metadata
        names, else its file name (A1111's convention). The encoders given the token then pool at end-of-text, as
        training did (`sd.pool_at_eos`), not at the new token a released CLIP config would pool at."""
        if not self.embedding_keys:
            pipe.load_textual_inversion(path, local_files_only=True)
            pool_at_eos(pipe.text_encoder, pipe.tokenizer.eos_token_id)
            return
        with safe_open(path, framework="pt") as file:
            missing = [key for key in self.embedding_keys if key not in file.keys()]  # noqa: SIM118 - safe_open is no dict
            if missing:
                raise KeyError(f"no '{missing[0]}' entry: a {self.title} embedding holds "
                               f"{', '.join(self.embedding_keys)}")
            vectors = {key: file.get_tensor(key) for key in self.embedding_keys}
            token = (file.metadata() or {}).get("placeholder_token") or Path(path).stem
        for key, encoder, tokenizer in zip(self.embedding_keys, self.text_encoders, self.tokenizers):
            pipe.load_textual_inversion(vectors[key], token=token, text_encoder=getattr(pipe, encoder),
                                        tokenizer=getattr(pipe, tokenizer))
            pool_at_eos(getattr(pipe, encoder), getattr(pipe, tokenizer).eos_token_id)

    # ----------------------------------------------------------------------------- the pipeline

    def assemble(self, components: dict[str, nn.Module], tokenizers: list[Any], scheduler: Any,
                 distilled: bool = False) -> Any:
        """The family's diffusers pipeline of these components; `distilled`: the model is step-distilled
        (`distilled`), which a pipeline that records it is told (Flux.2 klein's ``is_distilled``)."""
        raise NotImplementedError

    def pipeline_from_folder(self, folder: str | Path, **kwargs: Any) -> Any:
        """The family's pipeline diffusers loads from a pipeline folder (`kwargs`: from_pretrained's), given what
        loading it needs (`pipeline_loading`) and sampling needs that the folder cannot carry (`prepare_pipeline`)."""
        # A folder of one of the family's other pipelines (a Kontext model's, an InstructPix2Pix export) loads as
        # that pipeline, which takes what it edits.
        try:
            name = json.loads((Path(folder) / "model_index.json").read_text()).get("_class_name")
        except (OSError, ValueError):
            name = None  # the loader reports what is wrong with the folder
        cls = next((c for c in self.pipeline_classes() if c.__name__ == name), self.pipeline_class)
        return self.prepare_pipeline(cls.from_pretrained(folder, **self.pipeline_loading, **kwargs))

    def editing_pipeline(self, pipe: Any) -> Any:
        """`pipe` (the family's pipeline) as the one that edits by reference (`reference`'s), prepared as the family
        prepares its pipelines (`prepare_pipeline`)."""
        cls = self.reference.pipeline_class
        return pipe if isinstance(pipe, cls) else self.prepare_pipeline(cls.from_pipe(pipe))

    def prepare_pipeline(self, pipe: Any) -> Any:
        """`pipe` (the family's pipeline, assembled or loaded from a folder) with what its folder cannot carry and
        sampling needs (none by default); returns it."""
        return pipe

    def distilled(self, source: str | Path | None) -> bool:
        """Whether the pretrained model at `source` (a pipeline folder, a component folder in one, a single file;
        None: a model from scratch) is step-distilled, sampling in a few steps without classifier-free guidance,
        which its denoiser's config does not say: Flux.2 klein's model_index.json does, Z-Image-Turbo's folder
        does. False by default."""
        return False

    def sampling_defaults(self, denoiser_config: Any, distilled: bool = False) -> dict[str, Any]:
        """What the model samples with where the user sets nothing: ``guidance`` (its scale), and ``steps`` where
        the model has its own count (a distilled one: `distilled`, or one its denoiser's config tells)."""
        return {"guidance": 5.0}

    def sampling_mu(self, image_tokens: int, steps: int) -> float | None:
        """The dynamic shift's mu the family's pipeline samples `steps` steps of an image of `image_tokens` tokens
        with, where it is not the scheduler's (linear in the tokens, as diffusers' Flux.1 and Qwen-Image pipelines
        compute it): Flux.2's empirical one. None: the scheduler's."""
        return None

    def sampling_arguments(self, pipe: Any, guidance: float, negative_prompt: str | None) -> dict[str, Any]:
        """The pipeline call's guidance settings (classifier-free guidance at `guidance`, against
        `negative_prompt`; None: the empty prompt)."""
        return {"guidance_scale": guidance, "negative_prompt": negative_prompt}
