"""What a model family is: the spec every family module fills in (see the package docstring).

A family is composed of small parts, each with one concern: its component table (one record per component:
class, role, tokenizer, LoRA and kohya names, weight prefixes, repeated blocks), its latent codec
(`codec.LatentCodec`), its conditioner (captions -> text conditioning), its denoiser call (how the denoiser is
built, conditioned and called, and what it learns), its file interchange (single files, kohya names,
embeddings) and its sampling (pipelines and their defaults); and the specs of the modes it hosts. The trainer,
EMA, checkpoints, data order and evaluation ask the parts and name no family's classes.
"""

from __future__ import annotations

import copy
import importlib
import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from sdtrain.errors import UserError, first_line
from sdtrain.models.families.clip import pool_at_eos
from sdtrain.models.families.codec import LatentCodec


def text_model_path(path: str) -> str:
    """A CLIP text encoder's module or weight path under its ``text_model.`` level, which transformers 5 dropped
    from CLIPTextModel and kohya's, ComfyUI's and older diffusers' names keep."""
    return path if path.startswith("text_model.") else f"text_model.{path}"


def ids_key(index: int) -> str:
    """The batch key of the token ids for text encoder `index` (diffusers' names: input_ids, input_ids_2): the same
    for every family, as the loader collates them."""
    return "input_ids" if index == 0 else f"input_ids_{index + 1}"


def mask_key(index: int) -> str:
    """The batch key of the attention mask for text encoder `index`, for an encoder that reads one."""
    return "attention_mask" if index == 0 else f"attention_mask_{index + 1}"


def mask_unless_full(mask: torch.Tensor) -> torch.Tensor | None:
    """An attention mask to pass to a denoiser, or none where it masks nothing (as the pipelines pass it): an
    explicit mask, all True included, is what cuDNN's SDPA backward on Hopper answers with NaN gradients at some
    lengths (pytorch/pytorch#196678). Reading it costs a device sync."""
    return None if bool(mask.all()) else mask


def index_says(source: str | Path | None, key: str) -> bool:
    """Whether the model_index.json of the pipeline folder at `source` (or of the one holding the component folder
    `source`) sets `key` true, as a pipeline reads a flag its components' configs do not carry (Flux.2 klein's and
    Krea 2's ``is_distilled``). False for a single file, a model from scratch or a folder without one."""
    index = _index_of(source)
    return index is not None and index.get(key) is True


def construct(cls: Any, key: str, kwargs: dict[str, Any]) -> Any:
    """``cls(**kwargs)``; settings the class refuses are one line naming the config key that gave them."""
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise UserError(f"model.{key}: {first_line(exc)}; fix the override") from exc


class SingleFileLayout:
    """How a family's model is kept as ONE file in its authors' original layout, the file ComfyUI and A1111 load
    (the role of torchtitan's ``state_dict_adapter``): which components such a file holds, how each is read, and
    how a trained model is written. A family without one exports diffusers folders alone."""

    holds: tuple[str, ...] | None = None
    """The components a file of this layout holds (Flux.1's: its transformer alone); None: the whole model."""
    family_bound: bool = True
    """Whether a file of this layout serves its own family's models only. False for Stable Diffusion's original
    layout, whose files' components (a VAE alone, SDXL's UNet) other families read too."""
    text_layouts: tuple[str, ...] = ()
    """The layouts its text encoder can be written in (``--text-layout``); empty: the layout has one."""
    half_dtype: str = "fp16"
    """What ``--half`` stores: ``fp16``, or ``bf16`` for a model whose activations overflow fp16."""
    description: str = "A {title} model in one file in the original layout (A1111, ComfyUI, diffusers)"
    """What such a file is, as a model card says it (``{title}``: the family's)."""
    comfyui: str = "put `{name}` in `ComfyUI/models/checkpoints/` and load it with Load Checkpoint."
    """How ComfyUI loads such a file named `{name}`, as a model card says it."""

    def diffusers_code(self, pipeline: str, file: str, base: str, classes: dict[str, type]) -> list[str]:
        """Python lines that load the file (`file`, a quoted path) into diffusers' `pipeline` class, with `base`
        (quoted) a pipeline folder or Hub id of the same architecture, into ``pipe``: the whole pipeline from the
        file, or the part it holds (of its class in `classes`, the family's components) into `base`'s pipeline."""
        if self.holds is None:
            return [f"from diffusers import {pipeline}", "",
                    f"pipe = {pipeline}.from_single_file({file}, config={base})"]
        names = {name: classes[name].__name__ for name in self.holds}
        return [f"from diffusers import {', '.join([*names.values(), pipeline])}", "",
                *(f"{name} = {cls}.from_single_file({file}, config={base}, subfolder=\"{name}\")"
                  for name, cls in names.items()),
                f"pipe = {pipeline}.from_pretrained({base}, {', '.join(f'{name}={name}' for name in names)})"]

    def load(self, name: str, path: Path, *, trust_pickle: bool | None, frozen_precision: str, weights: bool,
             latent_constants: Callable[[], dict[str, float | None]]) -> nn.Module:
        """Component `name` of the file at `path`, in fp32 (or its linear weights in `frozen_precision`, where the
        layout reads tensor by tensor); without `weights`, every tensor on the meta device. A VAE whose file does
        not say how its latents are normalised takes `latent_constants()` (the served model's)."""
        raise NotImplementedError

    def write(self, out: Path, components: dict[str, nn.Module], *, half: bool, scheduler: Any,
              text_layout: str, text_source: str | Path | None) -> None:
        """Write `components` (those of `holds`, or all) as one file at `out`, under a temporary name renamed
        into place: `scheduler` is the training noise schedule, `text_layout` the one asked for (``auto`` or one
        of `text_layouts`), `text_source` where the text encoder was loaded from (a file's layout is kept)."""
        raise NotImplementedError


@dataclass(frozen=True)
class ControlSpec:
    """How a family hosts a ControlNet (``mode: controlnet``): a trainable copy of the denoiser's encoding half that
    reads a conditioning image and adds what it computes into the frozen denoiser."""

    model_class: type[nn.Module]
    """The ControlNet's class (diffusers' ControlNetModel for the UNets)."""
    pipeline_class: type
    """The diffusers pipeline that samples with it (``from_pipe`` of the family's pipeline, ``controlnet=``)."""
    from_denoiser: Callable[[nn.Module, int], nn.Module]
    """(denoiser, how many image pixels a latent pixel stands for, a side) -> a new ControlNet initialised from the
    denoiser's own weights, its output layers zero, as the paper does, reading images of the latents' size times
    that."""
    residuals: Callable[[nn.Module, torch.Tensor, torch.Tensor, dict[str, Any], torch.Tensor], dict[str, Any]]
    """(controlnet, noisy latents, timesteps, the denoiser's conditioning, the control: conditioning images in
    [0, 1], or what `control_input` makes of them) -> what the denoiser's call is given beside its conditioning
    (`ModelFamily.denoise` passes it on)."""
    control_input: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    """(VAE, conditioning images in [0, 1]) -> what the ControlNet reads of them: their latents, as the family's
    ControlNet pipeline encodes them (SD3's, Flux.1's); None: the images themselves (the UNets')."""
    image_argument: str = "image"
    """The ControlNet pipeline's argument for the conditioning image (``control_image`` for SD3's and Flux.1's)."""
    blocks: Callable[[nn.Module], list[nn.Module | None]] | None = None
    """The ControlNet's repeated blocks, in forward order (as `Component.blocks`)."""
    caption_dropout: float = 0.5
    """``data.caption_dropout`` of a ControlNet run that leaves it unset: the paper's half (the ControlNet must then
    read the map where the caption says nothing), or none, as diffusers' SD3 and Flux.1 ControlNet scripts drop."""


@dataclass(frozen=True)
class InstructSpec:
    """How a family's denoiser learns to edit as InstructPix2Pix does (``mode: instruct_pix2pix``): the source
    image's latents beside the noisy ones, on extra input channels."""

    pipeline_class: type
    """The diffusers pipeline that edits with the widened denoiser (``from_pipe`` of the family's pipeline)."""
    widen: Callable[[nn.Module], None]
    """(denoiser) -> it reads the source's latents too: one that reads the noisy latents alone gains as many input
    channels, their weights zero (so it starts as the base model), its config saying so; one that reads both already
    (a released editing model) is kept; any other is a UserError."""
    source_latents: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    """(VAE, source images in [-1, 1]) -> the latents the pipeline gives the denoiser beside the noisy ones."""


@dataclass(frozen=True)
class ReferenceSpec:
    """How a family's denoiser learns to edit by reference (``edit.reference``, as Flux.1 Kontext does): the
    reference image's latents given beside the noisy ones (``reference_latents`` in the conditioning, which
    `ModelFamily.denoise` reads), the prediction the noisy ones' alone."""

    pipeline_class: type
    """The diffusers pipeline that edits with the denoiser (``from_pipe`` of the family's pipeline, ``image=``)."""
    latents: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    """(VAE, reference images in [-1, 1]) -> their latents as the pipeline gives them to the denoiser."""
    at_own_size: Callable[[list[Any]], AbstractContextManager[dict[str, Any]]] = lambda sources: nullcontext({})
    """(the reference images a call edits) -> a context in which the pipeline edits each at its own size rather than
    resize it to the sizes its release prefers, yielding what the call is given to (Kontext's
    ``_auto_resize=False``): validation's and `generate`'s on a run, whose references are at the training size."""
    text_reads_source: bool = False
    """Whether the text encoder reads the reference too (Qwen-Image-Edit's vision-language model): the conditioning
    is then each sample's own, given the sources (`ModelFamily.encode_text`'s `sources`), never one computed from
    the captions alone (encoded shards' text embeddings, a recipe's fixed prompts)."""


@dataclass(frozen=True)
class Variant:
    """One of the released models a family's title stands for (`Sampling.variant`): what a run records of it. It
    changes nothing a run does; the model's files do."""

    name: str
    """Its ``model.variant`` value (``kontext``)."""
    title: str
    """What users call it (Flux.1 Kontext)."""


@dataclass(frozen=True)
class ExpertSpec:
    """How a family's denoiser is two experts over shares of the timesteps (a mixture of experts in time, as Wan 2.2
    A14B's): a pipeline folder keeps each in a folder of its own, and its sampler hands a step to the first expert
    at a sigma at or above the boundary, else to the second. A run trains ONE (``model.expert``), in the component
    table's denoiser's place and under its name, on sigmas drawn from that expert's share alone; the other stays
    frozen and is loaded only where a pipeline samples (validation, export, generate), from the base's folder of
    it."""

    folders: tuple[str, str]
    """Each expert's folder in a pipeline folder (and the pipeline's attribute), the high-noise one first; the first
    is the component table's denoiser."""
    names: tuple[str, str]
    """What ``model.expert`` calls each expert, same order."""
    default: str
    """The expert a run trains when ``model.expert`` is unset (one of `names`)."""
    released_boundary: float
    """The boundary, as a fraction of the schedule's timesteps, where the pipeline folder says none (a model from
    scratch)."""
    boundary_key: str = "boundary_ratio"
    """The model_index.json key the pipeline keeps the boundary under."""

    def folder(self, expert: str | None) -> str:
        """The pipeline folder of the expert `model.expert` names (None: `default`)."""
        return self.folders[self._index(expert)]

    def _index(self, expert: str | None) -> int:
        problem = self.problem(expert)
        if problem is not None:
            raise UserError(problem)
        return self.names.index(expert or self.default)

    def problem(self, expert: str | None) -> str | None:
        """The line that says `expert` names none of the experts; None when it names one (or is unset)."""
        if expert is None or expert in self.names:
            return None
        return f"model.expert: '{expert}' is none of this model's experts; choose {' or '.join(self.names)}"

    def boundary(self, source: str | Path | None) -> float:
        """The boundary of the model at `source` (a pipeline folder, or an expert's folder in one): its
        model_index.json's, else `released_boundary`."""
        index = _index_of(source)
        value = index.get(self.boundary_key) if index else None
        return float(value) if isinstance(value, (int, float)) else self.released_boundary

    def share(self, expert: str | None, boundary: float) -> tuple[float, float]:
        """The sigmas expert `expert` denoises, [low, high): the high-noise one [boundary, 1] (1 included), the
        other [0, boundary), as the pipeline hands each step over."""
        return (boundary, 1.0) if self._index(expert) == 0 else (0.0, boundary)

    def marks(self) -> tuple[str, ...]:
        """The model_index.json entries a pipeline folder of such a model sets and one of a single denoiser does not:
        every expert's folder but the first, and the boundary."""
        return (*self.folders[1:], self.boundary_key)


def _index_of(source: str | Path | None) -> dict[str, Any] | None:
    """The model_index.json of the pipeline folder at `source`, or of the one holding the component folder
    `source`; None without one (a single file, a model from scratch)."""
    if source is None or not Path(source).is_dir():
        return None
    folder = Path(source)
    if not (folder / "model_index.json").is_file():
        folder = folder.parent  # a component folder inside a pipeline folder
    try:
        index = json.loads((folder / "model_index.json").read_text())
    except (OSError, ValueError):
        return None
    return index if isinstance(index, dict) else None


def pipeline_name(source: str | Path | None) -> str | None:
    """The pipeline class (``_class_name``) the model_index.json of the pipeline folder at `source` names; None
    without one."""
    name = (_index_of(source) or {}).get("_class_name")
    return name if isinstance(name, str) else None


def component_settings(source: str | Path | None, name: str) -> dict[str, Any] | None:
    """The config.json of component `name` in the pipeline folder at `source`; None without one (a single file, a
    run, a model from scratch) or where it cannot be read (its loader says why)."""
    if source is None or not (Path(source) / "model_index.json").is_file():
        return None
    try:
        settings = json.loads((Path(source) / name / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return settings if isinstance(settings, dict) else None


def of_index(candidates: list[ModelFamily], index: Mapping[str, Any]) -> ModelFamily | None:
    """Of the families whose pipeline class a pipeline folder's is (`candidates`, in registry order), the one its
    model_index.json (`index`, or a loaded pipeline's config) describes: one whose marks (its experts'
    `ExpertSpec.marks` and its `Sampling.index_marks`) it all sets, else the first that has none. Folders of one
    pipeline class hold different models (WanPipeline's: one transformer, two experts, or timesteps per token)."""
    def setting(key: str) -> bool:
        value = index.get(key)
        return value not in (None, False) and not (isinstance(value, (list, tuple)) and not any(value))

    def marks(family: ModelFamily) -> tuple[str, ...]:
        return (*(family.experts.marks() if family.experts is not None else ()), *family.sampling.index_marks)

    marked = [f for f in candidates if marks(f) and all(setting(k) for k in marks(f))]
    return next(iter(marked or [f for f in candidates if not marks(f)]), None)


ROLES = ("vae", "text_encoder", "denoiser", "image_encoder")
"""What a component does in a family: the VAE its codec reads, a text encoder its conditioner reads (in table
order), the denoiser its call trains, an image encoder a conditioner reads beside the text."""


@dataclass(frozen=True)
class Component:
    """One component of a family: a diffusers pipeline folder keeps it in the subfolder of its name."""

    cls: type[nn.Module]
    """Its class (a diffusers model, a transformers model)."""
    role: str
    """One of `ROLES`."""
    tokenizer: str | None = None
    """A text encoder's tokenizer (or processor) folder in a pipeline folder."""
    long_text: bool = False
    """Whether a text encoder reads long captions (T5, a language model): its tokenizer's length is then
    ``model.t5_text_length`` (the key keeps T5's name), else the conditioner's `long_text_length`, not CLIP's 77."""
    lora: bool = False
    """Whether ``lora.text_encoder`` adapts this text encoder (kohya's and diffusers' scripts leave T5 and the
    language models frozen)."""
    kohya_prefix: str | None = None
    """The prefix of its modules in kohya's LoRA files (``lora_unet_``, ``lora_te1_``); None: kohya's layout
    names none of them."""
    weight_prefixes: tuple[tuple[str, str], ...] = ()
    """How the names of its weights in a released folder begin, and what the module calls them instead (the first
    pair a name starts with): a language model's tower read from a folder of the whole model (``model.`` read as
    ``""``), or a model saved under transformers' earlier names."""
    blocks: Callable[[nn.Module], list[nn.Module | None]] | None = None
    """Its repeated blocks in forward order (None entries, an absent mid block, are skipped): the units of
    activation checkpointing, compilation and FSDP."""


class Components(Mapping[str, Component]):
    """A family's component table: name -> record, in the order they are built."""

    def __init__(self, **records: Component) -> None:
        self._records = dict(records)
        unknown = {name: r.role for name, r in records.items() if r.role not in ROLES}
        if unknown:
            raise TypeError(f"component roles {unknown} are not among {ROLES}")
        denoisers = [name for name, r in records.items() if r.role == "denoiser"]
        if len(denoisers) != 1:
            raise TypeError(f"a component table names one denoiser, not {denoisers}")
        untokenized = [name for name, r in records.items() if r.role == "text_encoder" and not r.tokenizer]
        if untokenized:
            raise TypeError(f"text encoders {untokenized} name no tokenizer")

    def __getitem__(self, name: str) -> Component:
        return self._records[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def _named(self, role: str) -> tuple[str, ...]:
        return tuple(name for name, record in self._records.items() if record.role == role)

    @property
    def classes(self) -> dict[str, type[nn.Module]]:
        """Component name -> its class."""
        return {name: record.cls for name, record in self._records.items()}

    @property
    def denoiser(self) -> str:
        """The component trained to denoise (``unet``, ``transformer``)."""
        return self._named("denoiser")[0]

    @property
    def text_encoders(self) -> tuple[str, ...]:
        """The text encoders, in the order the conditioner reads them."""
        return self._named("text_encoder")

    @property
    def tokenizers(self) -> tuple[str, ...]:
        """Each text encoder's tokenizer folder, same order."""
        return tuple(self._records[name].tokenizer for name in self.text_encoders)

    @property
    def long_text_tokenizers(self) -> tuple[str, ...]:
        """The tokenizers of the text encoders that read long captions (`Component.long_text`)."""
        return tuple(self._records[name].tokenizer for name in self.text_encoders if self._records[name].long_text)

    @property
    def lora_text_encoders(self) -> tuple[str, ...]:
        """The text encoders ``lora.text_encoder`` adapts."""
        return tuple(name for name in self.text_encoders if self._records[name].lora)

    @property
    def kohya_prefixes(self) -> dict[str, str]:
        """Component name -> the prefix kohya's LoRA files give its modules."""
        return {name: r.kohya_prefix for name, r in self._records.items() if r.kohya_prefix is not None}


class Part:
    """A part of a family: `ModelFamily` gives each its own copy, bound to the family (``self.family``), whose
    other parts a part may read."""

    family: ModelFamily
    concern: str = "part"
    """What the part is, in a message about what it does not declare."""

    def bound(self, family: ModelFamily) -> Part:
        part = copy.copy(self)
        part.family = family
        return part


class Conditioner(Part):
    """How captions become the text conditioning: tokenizing them, building the text encoders from a preset, and
    reading their outputs. Shared implementations: `sdtrain.models.families.clip.ClipText` (a CLIP-tokenized
    family's tokenizer from scratch) and `causal_lm.LanguageModelText` (a chat model's)."""

    concern = "conditioner"

    def tokenize(self, tokenizer: Any, index: int, captions: list[str]) -> dict[str, torch.Tensor]:
        """Text encoder `index`'s batch entries for `captions`, which the loader makes as it collates: the token ids
        (under `ids_key`), padded to the tokenizer's length, and whatever else the encoder reads (an attention
        mask under `mask_key`). The captions as they are: a family whose encoder is a chat model templates them."""
        return {ids_key(index): tokenizer(captions, padding="max_length", truncation=True,
                                          max_length=tokenizer.model_max_length, return_tensors="pt").input_ids}

    def train_tokenizer(self, captions: list[str], out_dir: Path, vocab_size: int, max_length: int) -> Any:
        """A tokenizer for a model trained from scratch, learnt from the run's captions and saved to `out_dir`
        (every text encoder of the family reads its ids)."""
        raise _undeclared(self, "trains no tokenizer from scratch")

    def long_text_length(self, preset: str, denoiser_source: str | Path | None = None) -> int:
        """Tokens per caption of the long-context encoder (T5, a language model) when ``model.t5_text_length`` is
        unset: what the released model samples with, for a denoiser built from `preset` or loaded from
        `denoiser_source` (a folder or file)."""
        raise _undeclared(self, "says no caption length for its long-text encoder")

    def build_text_encoder(self, name: str, settings: dict[str, Any], tokenizer: Any, key: str) -> nn.Module:
        """Text encoder `name` from a preset's settings, its ids those of `tokenizer`; `key` is the config key
        named in a message about the settings."""
        raise _undeclared(self, "builds no text encoder from a preset")

    def encode_text(self, encoders: list[nn.Module], ids: list[torch.Tensor], captions: list[str] | None,
                    masks: list[torch.Tensor | None] | None = None, sources: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
        """The text conditioning of a batch, from each text encoder's token ids (and attention mask, for an encoder
        that reads one: `ModelFamily.token_inputs`): ``text_emb`` (the sequence the denoiser attends to) and any
        pooled vectors or mask, under the names pre-encoded shards store them by. `captions` (None when unknown)
        tell a family that conditions empty captions on zeros which rows are empty; `sources`, the edits' source
        images in [-1, 1], are read by a family whose text encoder reads them (`ReferenceSpec.text_reads_source`)."""
        raise _undeclared(self, "reads no text encoder")

    def text_shapes(self, text_encoders: dict[str, Any], lengths: list[int]) -> dict[str, tuple[int, ...]]:
        """The shape of one sample's entry of each `encode_text` output, from the encoders' configs (by name) and
        each tokenizer's tokens per caption (in table order)."""
        raise _undeclared(self, "says no text conditioning shapes")

    def unused_modules(self, name: str, module: nn.Module) -> list[str]:
        """The paths of component `name`'s modules (in `module`) whose output nothing the family reads depends on
        (a text stream the last block computes and the model discards; a language model's layers above the one
        read): they still train and are saved, but get no gradient, which data-parallel training is told."""
        return []


class DenoiserCall(Part):
    """How the denoiser is built, conditioned and called, and what it learns."""

    concern = "denoiser call"

    objective: str
    """What the denoiser learns (train.objectives): ``noise_prediction`` on a DDPM schedule, or ``flow_matching``."""

    def settings(self, settings: dict[str, Any], text_encoders: dict[str, nn.Module]) -> dict[str, Any]:
        """What the denoiser's shape takes from the text encoders (the width it attends to, pooled sizes), given
        its other `settings` (preset and overrides)."""
        raise _undeclared(self, "says nothing of what its denoiser takes from the text encoders")

    def shape(self, latent_channels: int, latent_size: int) -> dict[str, Any]:
        """What the denoiser's shape takes from the latents it denoises."""
        raise _undeclared(self, "says nothing of what its denoiser takes from the latents")

    def initialise(self, denoiser: nn.Module) -> bool:
        """Re-initialise a trainable `denoiser` just built from a preset as the family's reference training code
        initialises it (``model.denoiser_init``), drawing from torch's default generator; False, with `denoiser`
        and the generator untouched, for a family that has no reference initialisation (diffusers' own stays)."""
        return False

    def condition(self, text: dict[str, torch.Tensor], batch: dict[str, Any], device: torch.device
                  ) -> dict[str, Any]:
        """The denoiser's keyword arguments for a batch, from its text conditioning and what the batch carries
        (``size_ids``: each image's original size, crop corner and training size)."""
        raise _undeclared(self, "gives its denoiser no conditioning")

    def denoise(self, denoiser: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                condition: dict[str, Any]) -> torch.Tensor:
        """The denoiser's output for latents `noisy` at `timesteps` (on the schedule's 0..1000 scale): a diffusers
        model's ``sample`` for its keyword arguments."""
        return denoiser(noisy, timesteps, **condition).sample

    def conditioned(self, latents: torch.Tensor, noisy: torch.Tensor, generator: torch.Generator | None
                    ) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor | None]:
        """What a family conditions its denoiser on of the clean `latents` themselves (Wan 2.2 TI2V's first frame):
        the noisy latents the denoiser then reads, what its conditioning gains, and a loss weight on the latents'
        grid (None: all count), which multiplies the batch's mask; drawn from `generator` after the objective's
        draws. By default nothing: `noisy` as it is, and no draw."""
        return noisy, {}, None

    def takes_guidance(self, denoiser_config: Any) -> bool:
        """Whether the denoiser has a guidance embedding (Flux.1-dev's), fed ``condition["guidance"]``."""
        return False

    def max_latent_side(self, denoiser_config: Any) -> int | None:
        """The longest latent side the denoiser's position table covers (SD3's ``pos_embed_max_size`` patches);
        None: any."""
        return None

    def downsampling(self, denoiser_config: Any) -> int:
        """How much smaller than the latent the denoiser's coarsest level is (bucket sides must survive it)."""
        raise _undeclared(self, "says not how much its denoiser downsamples")

    def image_token_side(self, denoiser_config: Any) -> int:
        """How many latent pixels a side of one image token spans, for the image's token count the dynamic shift
        reads: by default `downsampling` (the 2x2 patches of Flux.1's and SD3's transformers)."""
        return self.downsampling(denoiser_config)


class FileInterchange(Part):
    """How the family's weights are kept in files other tools read: its single-file layout, kohya's LoRA names,
    textual-inversion files. What a family leaves out has none: no single file, names as diffusers keeps them."""

    concern = "file interchange"

    single_file_keys: tuple[str, ...] = ()
    """Key prefixes that mark a single file as this family's (the original layout)."""
    single_file: SingleFileLayout | None = None
    """The family's single-file layout, None where it has none this release writes or reads."""
    denoiser_lora_peft_names: bool = False
    """Whether diffusers' LoRA file keeps peft's own key names for the denoiser, as diffusers' SD3 and Flux scripts
    save a transformer's: its converter renames only the modules a UNet has (to_q, to_k, to_v, to_out.0), and the
    transformer loader, finding peft names in the first key, silently drops every renamed adapter."""
    kohya_names_each_layer: bool = True
    """Whether kohya's layout names each adapted layer as a module of its own (SD's, SDXL's), so that LyCORIS
    adapters (DoRA's magnitudes, LoKr's factors) are written in it too; not where it fuses layers (Flux.1's q, k
    and v), whose DoRA and LoKr adapters go in diffusers' file alone."""
    comfyui_reads_diffusers_lora: bool = False
    """Whether ComfyUI's Load LoRA reads the diffusers LoRA file of this family's (it reads kohya's of every
    family whose components have kohya prefixes)."""
    embedding_keys: tuple[str, ...] = ()
    """The key of each text encoder's vectors in a textual-inversion file, in text encoder order; empty: the file
    holds one key, the placeholder (diffusers' and A1111's layout for one text encoder)."""

    def holds_file(self, keys: list[str]) -> bool:
        """Whether a single file whose tensors are `keys` holds this family's model in its original layout: by
        default, a key under one of `single_file_keys`."""
        return any(key.startswith(self.single_file_keys) for key in keys) if self.single_file_keys else False

    def file_scheduler(self, path: str | Path, trust_pickle: bool | None) -> dict[str, Any] | None:
        """The training schedule the single file of this family's at `path` was released with, as its metadata or
        its tensors tell it; None: the preset's."""
        return None

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
        if component in self.family.components.text_encoders:
            path = text_model_path(path)
        prefix = self.family.components[component].kohya_prefix
        return prefix + self.original_module_path(component, path, config).replace(".", "_")

    def original_rows(self, component: str, path: str, rows: torch.Tensor) -> torch.Tensor:
        """A vector of one value per output row of `component`'s layer at `path` (a DoRA magnitude, in diffusers'
        row order) in the order the original layout keeps that layer's rows; as it is by default."""
        return rows

    def original_module_path(self, component: str, path: str, config: Any) -> str:
        """A module's path in the layout kohya names it by; diffusers' own paths by default."""
        return path

    def load_embedding(self, pipe: Any, path: str) -> None:
        """A textual-inversion file into the family's pipeline through diffusers' loader: a one-key file as it is;
        a file keyed by text encoder (SDXL's clip_l/clip_g) one encoder at a time, under the token its metadata
        names, else its file name (A1111's convention). The encoders given the token then pool at end-of-text, as
        training did (`clip.pool_at_eos`), not at the new token a released CLIP config would pool at."""
        components = self.family.components
        if not self.embedding_keys:
            pipe.load_textual_inversion(path, local_files_only=True)
            pool_at_eos(pipe.text_encoder, pipe.tokenizer.eos_token_id)
            return
        with safe_open(path, framework="pt") as file:
            missing = [key for key in self.embedding_keys if key not in file.keys()]  # noqa: SIM118 - safe_open is no dict
            if missing:
                raise KeyError(f"no '{missing[0]}' entry: a {self.family.title} embedding holds "
                               f"{', '.join(self.embedding_keys)}")
            vectors = {key: file.get_tensor(key) for key in self.embedding_keys}
            token = (file.metadata() or {}).get("placeholder_token") or Path(path).stem
        for key, encoder, tokenizer in zip(self.embedding_keys, components.text_encoders, components.tokenizers):
            pipe.load_textual_inversion(vectors[key], token=token, text_encoder=getattr(pipe, encoder),
                                        tokenizer=getattr(pipe, tokenizer))
            pool_at_eos(getattr(pipe, encoder), getattr(pipe, tokenizer).eos_token_id)


class Sampling(Part):
    """The diffusers pipeline that holds and samples the family's models, and what it samples with."""

    concern = "sampling"

    pipeline_class: type
    """The diffusers pipeline export writes and generate loads."""
    pipeline_loading: dict[str, Any] = {}
    """What the pipeline class's from_pretrained is also given to load a pretrained folder of this family."""
    pipeline_names: tuple[str, ...] = ()
    """model_index.json ``_class_name`` values of pretrained folders of this family, beside its pipelines'."""
    image_pipeline_class: type | None = None
    """The pipeline that draws from a first image too (image-to-video: Wan 2.2 TI2V's WanImageToVideoPipeline),
    made from the same components by its ``from_pipe``; None where the family's models draw from text alone."""
    index_marks: tuple[str, ...] = ()
    """model_index.json settings a folder of this family sets and one of another family of the same pipeline class
    does not (Wan 2.2 TI2V's ``expand_timesteps`` among WanPipeline folders; see `of_index`)."""

    def assemble(self, components: dict[str, nn.Module], tokenizers: list[Any], scheduler: Any,
                 distilled: bool = False) -> Any:
        """The family's diffusers pipeline of these components; `distilled`: the model is step-distilled
        (`distilled`), which a pipeline that records it is told (Flux.2 klein's ``is_distilled``)."""
        raise _undeclared(self, "assembles no pipeline")

    def pipeline_from_folder(self, folder: str | Path, **kwargs: Any) -> Any:
        """The family's pipeline diffusers loads from a pipeline folder (`kwargs`: from_pretrained's), given what
        loading it needs (`pipeline_loading`) and sampling needs that the folder cannot carry (`prepare`)."""
        # A folder of one of the family's other pipelines (a Kontext model's, an InstructPix2Pix export) loads as
        # that pipeline, which takes what it edits.
        try:
            name = json.loads((Path(folder) / "model_index.json").read_text()).get("_class_name")
        except (OSError, ValueError):
            name = None  # the loader reports what is wrong with the folder
        classes = self.family.pipeline_classes()
        cls = next((c for c in classes if c.__name__ == name), self.pipeline_class)
        return self.prepare(cls.from_pretrained(folder, **self.pipeline_loading, **kwargs))

    def prepare(self, pipe: Any) -> Any:
        """`pipe` (the family's pipeline, assembled or loaded from a folder) with what its folder cannot carry and
        sampling needs (none by default); returns it."""
        return pipe

    def distilled(self, source: str | Path | None) -> bool:
        """Whether the pretrained model at `source` (a pipeline folder, a component folder in one, a single file;
        None: a model from scratch) is step-distilled, sampling in a few steps without classifier-free guidance,
        which its denoiser's config does not say. False by default."""
        return False

    def variant(self, source: str | Path) -> Variant | None:
        """Which of the released models the family's title stands for the pretrained model at `source` (a pipeline
        folder, a single file, a run) is, from its files alone, where the title stands for several (Flux.1's dev,
        schnell and Kontext); None where it names one, or the files do not tell (a file two of them share)."""
        return None

    def defaults(self, denoiser_config: Any, distilled: bool = False) -> dict[str, Any]:
        """What the model samples with where the user sets nothing: ``guidance`` (its scale), and ``steps`` where
        the model has its own count (a distilled one: `distilled`, or one its denoiser's config tells)."""
        raise _undeclared(self, "says not what its models sample with")

    def mu(self, image_tokens: int, steps: int) -> float | None:
        """The dynamic shift's mu the family's pipeline samples `steps` steps of an image of `image_tokens` tokens
        with, where it is not the scheduler's (linear in the tokens, as diffusers' Flux.1 and Qwen-Image pipelines
        compute it): Flux.2's empirical one. None: the scheduler's."""
        return None

    def arguments(self, pipe: Any, guidance: float, negative_prompt: str | None) -> dict[str, Any]:
        """The pipeline call's guidance settings (classifier-free guidance at `guidance`, against
        `negative_prompt`; None: the empty prompt)."""
        return {"guidance_scale": guidance, "negative_prompt": negative_prompt}


def _undeclared(part: Part, says: str) -> UserError:
    family = getattr(part, "family", None)
    title = family.title if family is not None else type(part).__name__
    return UserError(f"model family {title}: its {part.concern} {says}; this release cannot do that with it")


class ModelFamily:
    """A model family, composed of its parts: nothing is inherited from another family, and a part it does not
    declare is one line naming the family and the part."""

    PARTS: dict[str, type] = {"codec": LatentCodec, "conditioner": Conditioner, "denoising": DenoiserCall,
                              "files": FileInterchange, "sampling": Sampling}

    def __init__(self, *, name: str, title: str, components: Components, presets: dict[str, dict[str, dict]],
                 codec: LatentCodec, conditioner: Conditioner, denoising: DenoiserCall, files: FileInterchange,
                 sampling: Sampling, hub_tags: tuple[str, ...] = (), controlnet: ControlSpec | None = None,
                 instruct: InstructSpec | None = None, reference: ReferenceSpec | None = None,
                 experts: ExpertSpec | None = None) -> None:
        self.name = name
        self.title = title
        self.hub_tags = hub_tags
        self.components = components
        self.presets = presets
        self.controlnet, self.instruct, self.reference = controlnet, instruct, reference
        self.experts = experts
        if experts is not None and (experts.folders[0] != components.denoiser or experts.default not in experts.names):
            raise TypeError(f"model family {name}: its first expert is its denoiser ({components.denoiser}) and its "
                            f"default expert one of {experts.names}")
        given = {"codec": codec, "conditioner": conditioner, "denoising": denoising, "files": files,
                 "sampling": sampling}
        for part, kind in self.PARTS.items():
            if not isinstance(given[part], kind):
                raise TypeError(f"model family {name}: declares no {part} (a {kind.__name__}: "
                                f"{first_line(kind.__doc__ or '')})")
        self.codec = codec
        self.conditioner = conditioner.bound(self)
        self.denoising = denoising.bound(self)
        self.files = files.bound(self)
        self.sampling = sampling.bound(self)
        if not isinstance(getattr(self.denoising, "objective", None), str):
            raise TypeError(f"model family {name}: its denoiser call names no objective")
        if not isinstance(getattr(self.sampling, "pipeline_class", None), type):
            raise TypeError(f"model family {name}: its sampling names no pipeline class")

    name: str
    """The config's ``model.family`` value."""
    title: str
    """What users call it, in messages."""
    hub_tags: tuple[str, ...]
    """The Hugging Face Hub tags a model card of this family carries (empty: its name)."""
    components: Components
    """Its component table."""
    presets: dict[str, dict[str, dict[str, Any]]]
    """Preset name -> component name -> constructor settings."""
    codec: LatentCodec
    """How its VAE encodes and decodes, and how the latents are normalised for the denoiser."""
    conditioner: Conditioner
    """How captions become the denoiser's text conditioning."""
    denoising: DenoiserCall
    """How its denoiser is built, conditioned and called, and what it learns."""
    files: FileInterchange
    """How its weights are kept in other tools' files."""
    sampling: Sampling
    """Its pipeline, and what it samples with."""
    controlnet: ControlSpec | None
    """How the family hosts a ControlNet; None where this release trains none for it."""
    instruct: InstructSpec | None
    """How the family's denoiser learns InstructPix2Pix's editing; None where this release trains none for it."""
    reference: ReferenceSpec | None
    """How the family's denoiser learns to edit by reference; None where this release trains none for it."""
    experts: ExpertSpec | None
    """How its denoiser is experts over shares of the timesteps, a run training one; None: one denoiser for all."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled by name (loader workers receive the conditioner's family): its parts hold callables and lambdas,
        # and a copy would not be the registered family.
        return _family_in, (type(self.sampling).__module__, self.name)

    def blocks(self, root: nn.Module) -> list[nn.Module]:
        """The blocks of every component of this family (and of its ControlNet) inside `root` (a component itself,
        or a module that holds components), in the order of `root.modules()`."""
        listers = {record.cls: record.blocks for record in self.components.values() if record.blocks is not None}
        if self.controlnet is not None and self.controlnet.blocks is not None:
            listers[self.controlnet.model_class] = self.controlnet.blocks
        listed: set[int] = set()
        for module in root.modules():
            lister = listers.get(type(module))
            if lister is not None:
                listed.update(id(block) for block in lister(module) if block is not None)
        return [module for module in root.modules() if id(module) in listed]

    def preset(self, preset: str, component: str) -> dict[str, Any]:
        """A copy of a preset's settings for one component; an unknown preset is one line listing this family's."""
        if preset not in self.presets:
            raise UserError(f"model.preset: '{preset}' is not a {self.title} preset; choose one of "
                            f"{', '.join(self.presets)} (or set model.family)")
        return copy.deepcopy(self.presets[preset][component])

    def token_inputs(self, batch: dict[str, Any], device: torch.device | None = None
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Each text encoder's token ids and attention mask (None where it reads none) from a batch the
        conditioner's `tokenize` filled, moved to `device`."""
        def moved(value: Any) -> Any:
            return value if value is None or device is None else value.to(device, non_blocking=True)

        count = range(len(self.components.text_encoders))
        return [moved(batch[ids_key(i)]) for i in count], [moved(batch.get(mask_key(i))) for i in count]

    @property
    def text_reads_source(self) -> bool:
        """Whether the family's text encoder reads the reference it edits too (`ReferenceSpec.text_reads_source`)."""
        return self.reference is not None and self.reference.text_reads_source

    @property
    def edits_only(self) -> bool:
        """Whether the family's models only edit by reference: its pipeline is its editing one, which takes the
        source (Qwen-Image-Edit's)."""
        return self.reference is not None and self.reference.pipeline_class is self.sampling.pipeline_class

    def pipeline_classes(self) -> tuple[type, ...]:
        """Every diffusers pipeline class that samples this family's models: its own, those of the modes it hosts
        (ControlNet's, InstructPix2Pix's, editing by reference) and the one that draws from a first image."""
        modes = (self.controlnet, self.instruct, self.reference)
        return (self.sampling.pipeline_class, *(mode.pipeline_class for mode in modes if mode is not None),
                *((self.sampling.image_pipeline_class,) if self.sampling.image_pipeline_class is not None else ()))

    def module_classes(self) -> list[type[nn.Module]]:
        """Every class a checkpoint of this family may hold a module of: its components', and its ControlNet's."""
        return [*self.components.classes.values(), *([self.controlnet.model_class] if self.controlnet else [])]

    def editing_pipeline(self, pipe: Any) -> Any:
        """`pipe` (the family's pipeline) as the one that edits by reference (`reference`'s), prepared as the family
        prepares its pipelines (`Sampling.prepare`)."""
        cls = self.reference.pipeline_class
        return pipe if isinstance(pipe, cls) else self.sampling.prepare(cls.from_pipe(pipe))


def _family_in(module: str, name: str) -> ModelFamily:
    """The family named `name` that module `module` (its own) declares."""
    return next(value for value in vars(importlib.import_module(module)).values()
                if isinstance(value, ModelFamily) and value.name == name)
