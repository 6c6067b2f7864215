"""The typed configuration tree.

A run is described by one ``RunConfig``: YAML files merged over these defaults, then dotted
``key=value`` overrides from the command line. Loading validates everything up front, so a
typo fails in the first second with one line naming the key instead of an hour into a job.
The resolved config is written into the run folder and never changed afterwards.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sdtrain.data.filters import parse_filters
from sdtrain.data.images import parse_background
from sdtrain.errors import UserError

log = logging.getLogger(__name__)

STAGES = ("autoencoder", "diffusion")
LORA_TYPES = ("lora", "dora", "lokr")
"""The adapters ``lora.type`` names."""
MODES = ("full", "lora", "textual_inversion", "dreambooth", "controlnet", "instruct_pix2pix")
COMBINED = (("controlnet", "lora"), ("instruct_pix2pix", "lora"))
"""The modes a run may train together (``mode: [controlnet, lora]``), each pair in MODES' order: LoRA adapters on
the frozen denoiser beside a ControlNet, or on a denoiser that edits as InstructPix2Pix does."""
PRECISIONS = ("auto", "fp32", "bf16")
# YAML 1.1 reads a bare `no` as false, which OmegaConf then stores as the string "False".
_FP32_ALIASES = ("no", "False", "false")


CAPTION_DROPOUT = 0.1
"""``data.caption_dropout`` where a run leaves it unset and its mode has no default of its own."""


@dataclass
class DataConfig:
    shards: str = MISSING
    """Training shards: a directory (every .tar in it), a glob, or a brace pattern such as
    ``data/shard-{000000..000009}.tar``."""
    resolution: int = 64
    """Square side in pixels that images are resized (shorter side) and cropped to."""
    frames: int = 17
    """For a video family (Wan): the frames of each clip of the synthetic data a benchmark serves or writes (4n+1
    for Wan). Real clips keep the frames ``prepare folder --frames`` gave them."""
    resize: bool = True
    """Resize the shorter side to ``resolution`` before cropping. False crops windows of the images at
    their own size: autoencoders train on such crops several times faster and still work at full size."""
    center_crop: bool = True
    """Crop the centre; false crops at a random (seeded, resumable) position."""
    random_flip: bool = False
    """Flip half of the images horizontally. Off by default: captions may say left and right."""
    batch_size: int = 16
    """Samples per micro-batch on each process."""
    num_workers: int = 2
    """DataLoader worker processes; 0 loads in the training process. They only share the decoding: any number
    reads the same samples in the same order, and a run may resume with another."""
    caption_dropout: float | None = None
    """Fraction of captions replaced by the empty string, so the model also learns the
    unconditional prediction that classifier-free guidance needs. Unset: 0.1, except where the mode has its own:
    a ControlNet takes its family's (``mode: controlnet``: half for SD 1/2 and SDXL, none for SD3 and Flux.1), and
    InstructPix2Pix drops the caption and the source image together by ``instruct_pix2pix.source_dropout``, which
    leaves this unset."""
    image_key: str = "png;jpg;jpeg;webp;gif;tif;tiff"
    """Sample fields tried in order for the image."""
    caption_key: str = "txt"
    """Sample field holding the caption."""
    aspect_buckets: bool = False
    """Group images into aspect-ratio buckets of about resolution^2 pixels each (sides multiples of
    ``bucket_step``, aspects up to ``max_aspect``); every batch comes from one bucket, so mixed-size
    images train at their own shape instead of a square crop."""
    bucket_step: int = 64
    """Bucket sides are multiples of this (a multiple of the VAE's downsampling factor)."""
    max_aspect: float = 2.0
    """The widest (and, inverted, the tallest) bucket's width/height."""
    filters: dict[str, Any] = field(default_factory=dict)
    """Keep only samples whose json metadata passes these conditions, e.g. ``{pwatermark: "<=0.5",
    original_width: ">=512", min_aspect: 0.5}`` (the forms of ``sdtrain prepare --filter``); a sample
    missing a field is filtered. Filtered samples are counted (``filtered_samples`` in the metrics)."""
    class_key: str | None = None
    """Class-conditional data (ImageNet style): the sample field holding a class index, e.g. ``cls``.
    Captions then come from ``class_prompts`` instead of ``caption_key``."""
    class_prompts: str | None = None
    """JSON file mapping each class index to a prompt, or to a list of prompts one of which is drawn
    per sample (open-diffusion's ``idx_to_prompt``)."""
    prompt_templates: list[str] = field(default_factory=list)
    """Replace each sample's caption with one of these, drawn per sample (seeded by its place in the epoch,
    so resume is exact); ``{caption}`` in a template stands for the sample's own caption. Textual
    inversion and DreamBooth fill this from their own settings."""
    shuffle_tags: bool = False
    """Captions written as comma-separated tags (``1girl, red hair, smiling``, as taggers and boorus write them):
    shuffle the tags after the first ``keep_tags`` each time a sample is drawn (seeded by its place, so resume is
    exact), so the model does not learn their order (kohya's ``--shuffle_caption``)."""
    keep_tags: int = 0
    """With ``shuffle_tags``: how many leading tags stay in place (a trigger word, the subject; kohya's
    ``--keep_tokens``)."""
    background: str = "white"
    """What transparent pixels (RGBA, LA and palette images with transparency: cut-outs, stickers, icons) are
    composited on: ``white``, ``black``, ``grey``, ``#rrggbb`` (``rrggbb`` on a command line, where ``#`` starts a
    comment), or ``random`` (a colour drawn per sample, seeded by
    its place, so resume is exact, and the model learns no background colour). Dropping alpha instead, as a plain
    RGB conversion does, paints them the colour their clear pixels happen to store: usually black."""
    alpha_mask: bool = False
    """Use each image's transparency as its loss mask (kohya's ``--alpha_mask``): transparent areas contribute no
    loss, half-transparent ones half, so a cut-out subject trains without its background being learned. A sample's
    own mask (``{key}.mask.png`` beside its image, white counts, black does not) is used whatever this says. The
    mask gets the image's crop and flip, is averaged down to the latents' grid and weights the loss there, in every
    mode and family."""
    use_encoded: bool = True
    """Read the latents (and, with a frozen text encoder, the text embeddings) that shards from
    ``sdtrain prepare encode`` carry, instead of encoding images every step. Those shards are
    centre-cropped at one resolution: set false to train on their images with augmentation."""

    def dropped_captions(self) -> float:
        """The share of captions the loader drops: ``caption_dropout``, or its default where it is unset."""
        return CAPTION_DROPOUT if self.caption_dropout is None else self.caption_dropout

    def validate(self) -> None:
        _check(self.resolution >= 8, "data.resolution", "must be at least 8 pixels")
        _check(self.batch_size >= 1, "data.batch_size", "must be at least 1")
        _check(self.num_workers >= 0, "data.num_workers", "must be 0 or more")
        _check(self.caption_dropout is None or 0.0 <= self.caption_dropout < 1.0, "data.caption_dropout",
               "must be in [0, 1)")
        _check(self.keep_tags >= 0, "data.keep_tags", "must be 0 or more")
        if self.aspect_buckets:
            _check(8 <= self.bucket_step <= self.resolution, "data.bucket_step",
                   "must be between 8 and data.resolution")
            _check(self.max_aspect >= 1.0, "data.max_aspect", "must be at least 1")
        try:
            parse_background(self.background)
        except ValueError:
            raise UserError(f"data.background: {self.background!r} is not a colour; use white, black, grey, "
                            "#rrggbb (rrggbb on a command line) or random") from None
        try:
            parse_filters(self.filters)
        except UserError as exc:
            raise UserError(f"data.filters: {exc}") from None
        _check((self.class_key is None) == (self.class_prompts is None), "data.class_prompts",
               "class_key and class_prompts go together: set both (e.g. cls and a JSON of index -> prompt) or neither")


@dataclass
class ComponentConfig:
    """One component of the model: where it loads from, and what replaces its preset's settings."""

    source: str | None = None
    """Where it loads from: its diffusers or transformers folder (``vae/``, ``text_encoder/``...), a pipeline folder
    (its subfolder of this name), an sdtrain run (its newest checkpoint: an autoencoder run for ``vae``), or a
    single file of it (a transformer or UNet file in its original layout); or a Hub id of any of these (see
    ``pretrained``), of which only this component's configs and weights are fetched. A tokenizer (``tokenizer``,
    ``tokenizer_2``...) names its folder, or a pipeline folder holding it; unset, it lies beside its text encoder,
    else in ``pretrained``, else the first tokenizer is used, and with neither a BPE tokenizer is trained on the
    training captions and saved in the run folder."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments that replace the preset's settings of the component's class (UNet2DConditionModel,
    AutoencoderKL, CLIPTextConfig...) when it is built from scratch."""


@dataclass
class ModelConfig:
    family: str | None = None
    """The model family, one of those docs/families/ describes (``sd`` for Stable Diffusion 1.x/2.x, ``sdxl``,
    ``sd3``, ``flux``, ...; an unknown name is one line listing them).
    Unset: the pretrained model's own (from its model_index.json or single-file keys), else the family whose
    presets alone name ``preset`` (``sdxl``, ``sd3-medium``, ``flux-dev``...), else ``sd``. A run logs the family
    it recognised, and what told it, and its config.yaml records it."""
    variant: str | None = None
    """Which released model ``pretrained`` is, where the family stands for several: ``dev``, ``schnell`` or
    ``kontext`` for ``flux``, ``2509`` or ``2511`` for ``qwen-image-edit-plus``, as the model's files tell it. A run
    logs it and records it beside the family in its config.yaml; it changes nothing the run does (the files do). Set
    (a run's saved config given again), it must be what the files tell. Unset: what they tell, or nothing (a single
    file two of them share, a model from scratch, a family of one model)."""
    preset: str = "tiny"
    """Architecture for components built from scratch, one of the family's presets: ``tiny`` (tests, demo) in
    every family, and the released architectures its page in docs/families/ lists (``sd2``: the Stable Diffusion 2
    base UNet; ``sdxl``, ``sd3-medium``, ``flux-dev``, ...; an unknown one is one line listing the family's).
    `sdtrain params` counts any of them without building it."""
    frozen_precision: str = "fp32"
    """How the frozen weights of trained modules' linear layers are stored (the base under LoRA, textual inversion or
    DreamBooth-LoRA, and frozen text encoders): ``fp32``; ``bf16`` (half the memory); ``fp8`` (float8 e4m3 with a
    scale per output row: a quarter); ``nf4`` (QLoRA's 4-bit NormalFloat with an absmax per 64 weights, through
    bitsandbytes: about an eighth). Each layer's weight is cast back just in time for its matmul, in forward and
    backward alike, so only one layer's full-precision weight exists at a time; a diffusers folder's (or a Flux.1
    single file's) weights are stored low as they are read, a tensor at a time. Trained weights, their optimizer
    state, LoRA files and exports are unchanged by it; what the model computes is rounded as the stored weights are
    (bf16 about 3 significant digits, fp8 about 2, nf4 16 levels a block). ``auto``: the most exact of the four
    whose frozen weights, beside the trained weights' state, take at most 60% of the memory (the GPU's, or the
    machine's RAM on a CPU), planned from the models' shapes before any weight loads and logged with its figures; a
    resumed run keeps its first choice."""
    offload_frozen: Union[bool, str] = "auto"  # noqa: UP007 (OmegaConf reads typing.Union)
    """Keep the frozen weights stored in low precision (``frozen_precision`` bf16, fp8 or nf4) in host memory, and copy
    each block's to the GPU while the block before it computes, dropping it after use (kohya's block swap): the GPU
    then holds about two blocks of the frozen base instead of all of it, for a copy per block in forward and again
    in backward, overlapped with the computation on a side CUDA stream. What is computed is unchanged. ``auto``: on
    a GPU, when the frozen weights in their planned storage do not fit beside the trained state (see
    ``frozen_precision: auto``; planned whenever this is auto); never on a CPU, where the weights are in host
    memory already (true runs the same path there, copying nothing)."""
    pretrained: str | None = None
    """A local diffusers pipeline folder, or a single-file checkpoint in the original Stable Diffusion layout
    (``.safetensors``: SD 1.x, 2.x or SDXL, sizes and prediction type read from the file; set
    ``components.tokenizer.source`` unless a ``NAME.tokenizer/`` folder lies beside it), or a Flux.1 transformer
    file in Black Forest Labs' layout (bare or under ComfyUI's ``model.diffusion_model.``; name the VAE, text
    encoders and tokenizer in ``components``), or an
    SD3/3.5 file in Stability's layout (sd3_medium*.safetensors; name in ``components`` what it lacks, and the
    tokenizers unless ``NAME.tokenizer/``, ``NAME.tokenizer_2/`` and ``NAME.tokenizer_3/`` lie beside it).
    Components ``components`` names no source for load from it.

    This and every component's source may also be a Hugging Face Hub id: ``org/name``, ``org/name@REVISION`` (a branch,
    tag or commit), or ``org/name/FILE.safetensors`` for one single file in it. It is fetched into the Hub cache
    (``HF_HUB_CACHE``) unless cached already; ``HF_HUB_OFFLINE=1`` reads the cache only, and a gated or private
    repository takes its token from ``HF_TOKEN``, never from a config. Only configs, tokenizer files and the
    safetensors weights of the components loaded from it are fetched. A local path of the same spelling always
    wins. The run records the snapshot folder the id resolved to (``.../snapshots/<commit>``), so resuming and
    exporting read the same weights, offline too."""
    components: dict[str, ComponentConfig] = field(default_factory=dict)
    """The model's components by the names of their pipeline folders, as the family's table declares them (its
    page in docs/families/): ``vae``, ``text_encoder``, ``tokenizer`` and ``unet`` for Stable Diffusion,
    ``text_encoder_2``/``tokenizer_2`` beside them for SDXL, ``transformer`` for SD3 and later, and whatever a
    family adds (Qwen-Image 2.1's ``processor``): each's ``source`` and ``overrides``, e.g.
    ``model.components.vae.source=madebyollin/sdxl-vae-fp16-fix``. A name the family does not declare is one
    line listing those it does. A component no source names loads from ``pretrained``, else is built from the
    preset. The flat keys of earlier configs (``model.vae``, ``model.tokenizer_2``, ``model.unet_overrides``...)
    are read as ``model.components.NAME.source`` and ``.overrides``, with a note."""
    trust_pickle: bool = False
    """Allow ``.ckpt``/``.pt``/``.bin`` checkpoints (pickle files) as sources. They are still read with
    ``torch.load(weights_only=True)``, which refuses code, but convert them to safetensors if you can."""
    tokenizer_vocab_size: int = 1024
    """Vocabulary size of a tokenizer trained from captions."""
    max_text_length: int | None = None
    """Tokens per caption. Unset: the pretrained tokenizer's ``model_max_length`` (no more than its text encoder's
    ``max_position_embeddings``), or 77 (CLIP's) for a tokenizer trained from scratch; a set value longer than
    the pretrained text encoder's positions is an error."""
    denoiser_init: str = "auto"
    """How a denoiser built from scratch (no pretrained weights) is initialised: ``library`` (diffusers' own
    layer defaults); ``reference`` (the family's reference training code, where it has one: for Flux.1, Black
    Forest Labs' and the MLPerf reference's zero-initialised adaLN modulation, final adaLN and output projection,
    Xavier-uniform linear weights with zero biases, N(0, 0.02) timestep, guidance and vector embedders); ``auto``:
    ``reference`` for a family that defines one, else ``library``. Weights loaded from a source are never
    re-initialised."""
    expert: str | None = None
    """Which expert a run trains, for a model whose denoiser is experts over shares of the timesteps (Wan 2.2 A14B:
    ``high_noise``, the ``transformer`` that denoises the steps at or above its ``boundary_ratio``, or
    ``low_noise``, its ``transformer_2``, the rest). Unset: the family's default (``low_noise`` for Wan 2.2 A14B).
    The expert trains in the denoiser's place (its LoRA and checkpoints under ``transformer``), on sigmas drawn
    from its share alone; the other is never loaded for training, and comes from ``pretrained`` where the model
    samples (validation, export, generate). Both experts are two runs. A model without experts refuses it."""
    t5_text_length: int | None = None
    """Tokens per caption for a T5 text encoder (Flux.1's, SD3's). Unset: what the model samples with, 512 for
    Flux.1-dev (a transformer with the guidance embedding), 256 for Flux.1-schnell (Black Forest Labs', kohya's and
    MLPerf's) and SD3 (its pipeline's), or the pretrained tokenizer's saved length when shorter (a model sdtrain
    exported after training at that length); never the 512 a released T5 tokenizer saves, which is T5's limit, not
    the model's. CLIP encoders keep their 77."""
    def source(self, name: str) -> str | None:
        """Where component `name` is named to load from (None: from ``pretrained``, or built)."""
        component = self.components.get(name)
        return component.source if component is not None else None

    def overrides(self, name: str) -> dict[str, Any]:
        """The settings that replace the preset's for component `name`."""
        component = self.components.get(name)
        return dict(component.overrides) if component is not None else {}

    def validate(self) -> None:
        # Which names exist is the family's to say (models.families): an unknown one is refused there, with the
        # family's own list, when the model is built.
        _check(isinstance(self.preset, str) and bool(self.preset), "model.preset", "must name a preset, e.g. tiny")
        _check(self.frozen_precision in FROZEN_PRECISIONS, "model.frozen_precision",
               f"must be one of {', '.join(FROZEN_PRECISIONS)}")
        if self.frozen_precision == "nf4":
            _check(importlib.util.find_spec("bitsandbytes") is not None, "model.frozen_precision",
                   "nf4 is stored through bitsandbytes, which is not installed: pip install 'sdtrain[memory]', or "
                   "set model.frozen_precision=fp8")
        _check(self.offload_frozen in (True, False, "auto"), "model.offload_frozen", "must be true, false or auto")
        _check(self.offload_frozen is not True or self.frozen_precision != "fp32", "model.offload_frozen",
               "streams the weights frozen_precision stores low: set model.frozen_precision=bf16, fp8, nf4 or auto")
        _check(self.denoiser_init in ("auto", "library", "reference"), "model.denoiser_init",
               "must be auto, library or reference")
        _check(self.variant is None or (isinstance(self.variant, str) and bool(self.variant)), "model.variant",
               "must name a variant, e.g. kontext (or be unset: the pretrained model's own)")
        _check(self.expert is None or (isinstance(self.expert, str) and bool(self.expert)), "model.expert",
               "must name an expert, e.g. low_noise (or be unset: the family's default)")
        _check(self.t5_text_length is None or self.t5_text_length >= 4, "model.t5_text_length",
               "must be at least 4 (or unset: the family's length)")
        _check(self.max_text_length is None or self.max_text_length >= 4, "model.max_text_length",
               "must be at least 4 (or unset: the pretrained length, else 77)")
        for name in self.components:
            _check(name.isidentifier(), f"model.components.{name}",
                   "must be a component's folder name, e.g. vae, text_encoder_2 or transformer")


@dataclass
class DdpmConfig:
    """Noise prediction on a DDPM schedule, the objective of SD 1/2 and SDXL: the schedule, what the UNet predicts,
    and the noise and loss options the field trains it with. A flow-matching model refuses them (the noise options
    are warned about and ignored, since shared recipes set them)."""

    prediction_type: str | None = None
    """What the UNet predicts: ``epsilon`` or ``v_prediction``. Unset: what the pretrained pipeline's
    scheduler says (SD 2.x 768 px models predict v), else epsilon."""
    num_train_timesteps: int = 1000
    """Length of the noise schedule."""
    beta_schedule: str = "scaled_linear"
    """Noise schedule of the DDPM scheduler (Stable Diffusion's is scaled_linear)."""
    beta_start: float = 0.00085
    """First beta of the schedule."""
    beta_end: float = 0.012
    """Last beta of the schedule."""
    zero_terminal_snr: bool = False
    """Rescale the noise schedule so its last timestep is pure noise (Lin et al., 2024); train with
    v_prediction then, since epsilon carries no information at zero SNR."""
    snr_gamma: float = 0.0
    """Min-SNR loss weighting (Hang et al., 2023): clamp each timestep's weight at this signal-to-noise
    ratio, so the many easy low-noise steps stop dominating; 5 is the paper's value, 0 turns it off."""
    noise_offset: float = 0.0
    """Offset noise (Guttenberg, 2023): add this times a per-channel constant to the noise, so the model can
    learn to change an image's mean brightness (very dark or bright images); 0.05-0.1 is usual, 0 is off."""
    multires_noise_iterations: int = 0
    """Multi-resolution ("pyramid") noise, kohya's ``--multires_noise_iterations`` as sd-scripts defines it: add
    this many levels of noise, level i drawn on a grid r**i times smaller (r uniform in [2, 4), drawn per level;
    level 0 at full resolution) and upsampled, so the noise has power at the scale of the whole image, where plain
    noise has almost none. At high noise the layout then cannot be read from the latents and must come from the
    caption; 6-10 is usual, 0 is off."""
    multires_noise_discount: float = 0.3
    """Multi-resolution noise: level i is scaled by this to the power i before the sum is divided by its standard
    deviation over the batch (kohya's ``--multires_noise_discount``; 0.1-0.3 is usual, higher weights the coarse
    levels more)."""
    input_perturbation: float = 0.0
    """Input perturbation (Ning et al., 2023): noise the latents with noise + this times fresh noise while
    the target stays the plain noise, which reduces exposure bias; 0.1 is the paper's value, 0 is off."""

    def validate(self) -> None:
        _check(self.prediction_type in (None, "epsilon", "v_prediction"), "diffusion.ddpm.prediction_type",
               "must be epsilon or v_prediction")
        _check(self.num_train_timesteps >= 2, "diffusion.ddpm.num_train_timesteps", "must be at least 2")
        _check(self.beta_schedule in ("linear", "scaled_linear", "squaredcos_cap_v2"), "diffusion.ddpm.beta_schedule",
               "must be linear, scaled_linear or squaredcos_cap_v2")
        _check(self.snr_gamma >= 0, "diffusion.ddpm.snr_gamma", "must be 0 (off) or positive")
        _check(self.noise_offset >= 0, "diffusion.ddpm.noise_offset", "must be 0 (off) or positive")
        _check(self.input_perturbation >= 0, "diffusion.ddpm.input_perturbation", "must be 0 (off) or positive")
        _check(self.multires_noise_iterations >= 0, "diffusion.ddpm.multires_noise_iterations",
               "must be 0 (off) or positive")
        _check(0 < self.multires_noise_discount <= 1, "diffusion.ddpm.multires_noise_discount", "must be in (0, 1]")


@dataclass
class FlowConfig:
    """Flow matching (rectified flow), the objective of SD3, Flux.1 and the transformers after them: the sigma shift
    training and sampling share, the loss weighting, and the guidance a guidance-distilled denoiser is fed. A
    noise-prediction model refuses them."""

    shift: float | None = None
    """The static shift s of the sigmas, sigma' = s sigma / (1 + (s - 1) sigma), in training and sampling alike
    (SD3: 3.0; Flux.1-schnell: 1.0, none). Unset: the pretrained scheduler's, else the preset's."""
    dynamic_shift: Union[bool, str, None] = None  # noqa: UP007 (OmegaConf reads typing.Union)
    """Flux.1-dev's resolution-dependent shift instead of ``shift`` (exp(mu), mu rising linearly from 0.5 at 256
    image tokens to 1.15 at 4096). ``sampling``: the dynamic shift the model's pipeline samples with at the run's
    sampling step count (``validation.steps``, else the model's own, else 20), where its mu is not the scheduler's:
    Flux.2's pipelines fit mu to the step count too (1.70 at 512 px and 50 steps, where the scheduler's is 0.63);
    for other models the same as true. Unset: the pretrained scheduler's, else the preset's."""
    loss_weighting: str = "none"
    """Each sample's loss weight by its sigma: ``none``, ``sigma_sqrt`` (1 / sigma^2) or ``cosmap``
    (2 / (pi (1 - 2 sigma + 2 sigma^2))), as diffusers' SD3 scripts offer."""
    precondition_outputs: bool = False
    """SD3's output preconditioning: the prediction becomes x_t - sigma * output and is compared with the clean
    latents (the same optimum, weighted by sigma^2)."""
    guidance: float = 3.5
    """A guidance-distilled denoiser's guidance embedding (Flux.1-dev's) during training: the constant it is fed
    (kohya's and diffusers' scripts default to 3.5; 1.0 is also common). Ignored by models without one (schnell,
    SD3, most others)."""
    guidance_range: list[float] = field(default_factory=list)
    """[low, high]: draw the guidance per sample uniformly from this range instead of ``guidance``; a model
    without a guidance embedding refuses it."""

    def validate(self) -> None:
        _check(self.shift is None or self.shift > 0, "diffusion.flow.shift", "must be positive")
        _check(self.dynamic_shift in (None, True, False, "sampling"), "diffusion.flow.dynamic_shift",
               "must be true, false or sampling")
        _check(self.loss_weighting in ("none", "sigma_sqrt", "cosmap"), "diffusion.flow.loss_weighting",
               "must be none, sigma_sqrt or cosmap")
        _check(not self.guidance_range or (len(self.guidance_range) == 2
                                           and 0 <= self.guidance_range[0] <= self.guidance_range[1]),
               "diffusion.flow.guidance_range", "must be [low, high] with 0 <= low <= high (or empty)")


@dataclass
class DiffusionConfig:
    """The diffusion stage's objective: what both objectives share here, each objective's own options in its
    section (``ddpm`` for noise prediction, ``flow`` for flow matching); the model's family says which one
    trains."""

    timestep_sampling: str = "uniform"
    """How training draws timesteps (for flow matching, as SD3 and Flux.1 train: sigmas): ``uniform`` over the
    schedule, ``logit_normal`` (Esser et al., 2024, as SD3 trains): t / T = sigmoid(x) with
    x ~ N(timestep_mean, timestep_std), which spends the steps on the middle of the schedule, and with a positive
    mean on the noisier part, where layout and count are decided; flow matching also ``mode`` (the SD3 paper's
    mode sampling, scale ``mode_scale``) and ``cosmap``."""
    timestep_mean: float = 0.0
    """Mean of the logit-normal draw; positive favours noisier timesteps, negative cleaner ones."""
    timestep_std: float = 1.0
    """Spread of the logit-normal draw; larger approaches uniform with heavier ends."""
    mode_scale: float = 1.29
    """Scale of ``mode`` timestep sampling (SD3's paper: 1.29); 0 is uniform."""
    sample_latents: bool = True
    """Train on samples of the autoencoder's posterior (as Stable Diffusion does); false uses its mean,
    which suits an autoencoder trained with ``autoencoder.sample_posterior: false``."""
    train_text_encoder: bool = False
    """Train the text encoder with the UNet (needed from scratch) instead of freezing it."""
    ddpm: DdpmConfig = field(default_factory=DdpmConfig)
    """Noise prediction on a DDPM schedule (SD 1/2, SDXL)."""
    flow: FlowConfig = field(default_factory=FlowConfig)
    """Flow matching (SD3, Flux.1 and the families after them)."""

    def validate(self) -> None:
        _check(self.timestep_sampling in ("uniform", "logit_normal", "mode", "cosmap"), "diffusion.timestep_sampling",
               "must be uniform, logit_normal, mode or cosmap")
        _check(self.timestep_std > 0, "diffusion.timestep_std", "must be positive")
        self.ddpm.validate()
        self.flow.validate()


# Keys the flat diffusion section had before its objectives' options moved to their own sections, and the fixed
# component slots the model section had before its components were open: still read, each moved where it lives
# now, so older configs and the runs they made load as they did.
FLAT_COMPONENTS = ("vae", "unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer",
                   "tokenizer_2", "tokenizer_3")
MOVED_KEYS = {
    **{f"diffusion.{name}": f"diffusion.ddpm.{name}" for name in (
        "prediction_type", "num_train_timesteps", "beta_schedule", "beta_start", "beta_end", "zero_terminal_snr",
        "snr_gamma", "noise_offset", "multires_noise_iterations", "multires_noise_discount", "input_perturbation")},
    "diffusion.flow_shift": "diffusion.flow.shift",
    "diffusion.flow_dynamic_shift": "diffusion.flow.dynamic_shift",
    **{f"diffusion.{name}": f"diffusion.flow.{name}" for name in (
        "loss_weighting", "precondition_outputs", "guidance", "guidance_range")},
    **{f"model.{name}": f"model.components.{name}.source" for name in FLAT_COMPONENTS},
    **{f"model.{name}_overrides": f"model.components.{name}.overrides" for name in FLAT_COMPONENTS
       if not name.startswith("tokenizer")},
}


@dataclass
class LoraConfig:
    type: str = "lora"
    """The adapter: ``lora`` (low-rank down and up projections), ``dora`` (LoRA with a learned magnitude per output
    row, Liu et al., 2024) or ``lokr`` (LyCORIS's Kronecker product of two small factors, the denoiser's alone),
    all through peft; DoRA and LoKr with the base stored in fp32 (``model.frozen_precision``) and DDP."""
    rank: int = 4
    """Rank of each adapter: the width of its down and up projections (LoKr: of a factor's low-rank split, where a
    factor is larger than twice it)."""
    alpha: float = 0.0
    """Scale numerator: the adapter's output is multiplied by alpha / rank; 0 means alpha = rank (scale 1)."""
    lokr_factor: int = -1
    """LoKr only: the side of the Kronecker product's first factor (LyCORIS's ``factor``); -1 splits each dimension
    into its two most balanced factors."""
    dropout: float = 0.0
    """Dropout on the adapter's input (LoKr: the share of steps each module's adapter is left out)."""
    target_modules: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    """Module names (or name suffixes) in the UNet that get adapters: by default every attention projection."""
    text_encoder: bool = False
    """Also train adapters on the text encoder's attention projections."""
    text_encoder_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj",
                                                                            "out_proj"])
    """Module names in the text encoder that get adapters when ``text_encoder`` is on."""
    save_merged: bool = False
    """Also export a full pipeline with the adapters merged into the weights."""

    def validate(self) -> None:
        _check(self.type in LORA_TYPES, "lora.type", f"'{self.type}' is not one of {', '.join(LORA_TYPES)}")
        _check(self.lokr_factor == -1 or self.lokr_factor >= 1, "lora.lokr_factor", "must be -1 or at least 1")
        _check(self.type != "lokr" or not self.text_encoder, "lora.text_encoder",
               "LoKr adapts the denoiser alone in this release (diffusers loads no text encoder's): set it to false "
               "or use lora.type=lora")
        _check(self.rank >= 1, "lora.rank", "must be at least 1")
        _check(self.alpha >= 0, "lora.alpha", "must be 0 (= rank) or positive")
        _check(0 <= self.dropout < 1, "lora.dropout", "must be in [0, 1)")
        _check(bool(self.target_modules), "lora.target_modules", "needs at least one module name")


@dataclass
class TextualInversionConfig:
    placeholder_token: str = "<concept>"
    """The new token the prompts use for the learned concept; it must not be in the vocabulary already."""
    initializer_token: str = ""
    """Required: a single-token word close to the concept (``cat``, ``painting``); the new vectors start
    as its embedding."""
    num_vectors: int = 1
    """Embedding vectors the concept is given; more capture more detail and overfit sooner."""
    learnable_property: str = "object"
    """``object`` or ``style``: which set of caption templates trains the token ("a photo of a {}" or "a
    painting in the style of {}")."""
    templates: list[str] = field(default_factory=list)
    """Caption templates of your own instead of the built-in ones; ``{}`` stands for the placeholder."""
    save_as_full_pipeline: bool = False
    """Also export the whole pipeline with the new token in its tokenizer and text encoder."""

    def validate(self, trained: bool) -> None:
        """`trained`: this run is a textual-inversion run, which needs the token settings."""
        _check(self.num_vectors >= 1, "textual_inversion.num_vectors", "must be at least 1")
        _check(self.learnable_property in ("object", "style"), "textual_inversion.learnable_property",
               "must be object or style")
        _check(all("{}" in t for t in self.templates), "textual_inversion.templates",
               "every template needs {} where the placeholder goes, e.g. 'a photo of {}'")
        if trained:
            _check(bool(self.placeholder_token.strip()) and " " not in self.placeholder_token,
                   "textual_inversion.placeholder_token", "must be one word without spaces, e.g. <my-cat>")
            _check(bool(self.initializer_token.strip()), "textual_inversion.initializer_token",
                   "required: a word close to the concept, e.g. cat")


@dataclass
class InstructPix2PixConfig:
    source_dropout: float = 0.05
    """The paper's q: one draw per sample drops its caption alone for q of the samples, its source image alone (its
    latents zero) for q, and both for q, as InstructPix2Pix and diffusers' ``train_instruct_pix2pix.py`` do, so
    that sampling can weigh each (``guidance_scale``, ``image_guidance_scale``: what the latter subtracts is the
    prediction with both dropped). It takes the place of ``data.caption_dropout``, which stays unset."""

    def validate(self) -> None:
        _check(0.0 <= self.source_dropout <= 1 / 3, "instruct_pix2pix.source_dropout",
               "must be in [0, 1/3]: q of the samples lose their caption, q their source, q both")


@dataclass
class EditConfig:
    reference: bool = False
    """Train the denoiser to edit by reference, as Flux.1 Kontext and Qwen-Image-Edit do: each sample's source image
    (``KEY.src.png`` beside the edited one, its caption the instruction) is encoded by the VAE and its latent tokens
    sit beside the noisy ones, the loss on the noisy ones alone (Qwen-Image-Edit's text encoder reads the source
    too); with ``mode`` full or lora (a Kontext model's LoRA, say). The run samples, and a full run exports, the
    family's editing pipeline (FluxKontextPipeline, QwenImageEditPipeline, QwenImageEditPlusPipeline), which takes
    ``image=``. Required for a family whose models only edit (Qwen-Image-Edit's)."""


@dataclass
class DreamBoothConfig:
    instance_prompt: str = ""
    """Required: the caption of every instance image, with a rare identifier for the subject, e.g.
    ``a photo of sks dog``."""
    class_prompt: str = ""
    """The subject's class without the identifier (``a photo of a dog``): the prompt of the class images
    that prior preservation trains on. Empty turns prior preservation off."""
    class_data: str | None = None
    """Folder of class images; when it holds fewer than ``num_class_images``, the base model generates the
    rest into it (once, before training). Unset: ``class_images/`` in the run folder."""
    num_class_images: int = 100
    """Class images prior preservation needs."""
    prior_loss_weight: float = 1.0
    """Weight of the class images' loss beside the instance images' loss."""
    class_batch_size: int = 0
    """Class images per micro-batch; 0 means as many as data.batch_size instance images."""
    generation_steps: int = 25
    """Sampling steps when generating class images."""
    lora: bool = False
    """Train LoRA adapters (the ``lora`` settings) instead of the whole UNet."""
    cache_latents: bool = False
    """Encode the instance and class images with the VAE once, before training (the scripts' ``--cache_latents``),
    into ``cached_latents/`` in the run folder: steps read the latents and the VAE encoder never loads for
    training. Each image's latent is its centre crop's, so ``data.random_flip``, ``data.aspect_buckets`` must be
    off and ``data.center_crop`` on."""

    def validate(self) -> None:
        """Only for a DreamBooth run: the settings are unused otherwise."""
        _check(bool(self.instance_prompt.strip()), "dreambooth.instance_prompt",
               "required: the instance images' caption with a rare identifier, e.g. 'a photo of sks dog'")
        _check(self.num_class_images >= 1, "dreambooth.num_class_images", "must be at least 1")
        _check(self.prior_loss_weight >= 0, "dreambooth.prior_loss_weight", "must be 0 or positive")
        _check(self.class_batch_size >= 0, "dreambooth.class_batch_size", "must be 0 (= data.batch_size) or more")


@dataclass
class AutoencoderLossConfig:
    reconstruction: str = "l1"
    """Pixel loss: ``l1`` (sharper edges), ``mse`` (punishes large colour errors hardest) or ``l1+mse``."""
    kl_weight: float = 1.0e-6
    """Weight of the KL term that keeps the latent distribution close to a unit Gaussian."""
    sample_posterior: bool = True
    """Decode a sample of the posterior (true) or its mean."""

    def validate(self) -> None:
        _check(self.reconstruction in ("l1", "mse", "l1+mse"), "autoencoder.reconstruction",
               "must be l1, mse or l1+mse")


OPTIMIZERS = ("adamw", "adamw8bit", "adafactor")
FROZEN_PRECISIONS = ("fp32", "bf16", "fp8", "nf4", "auto")


@dataclass
class OptimConfig:
    name: str = "adamw"
    """``adamw``: torch's AdamW (two fp32 moments: twice the trained weights). ``adamw8bit``: AdamW with both
    moments stored in 8 bits, quantised block by block (bitsandbytes' AdamW8bit, as kohya's and diffusers' scripts
    use it: about a quarter of AdamW's state; needs ``pip install 'sdtrain[memory]'``). ``adafactor``: factored
    second moments and no first moment (torch.optim.Adafactor: state the size of each weight's rows plus its
    columns; ``lr`` caps its relative step, ``betas`` and ``eps`` are not used)."""
    lr: float = 1.0e-4
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    eps: float = 1.0e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from zero."""
    schedule: str = "constant"
    """After warmup: ``constant`` or ``cosine`` (to zero at max_steps)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this once per optimizer step; 0 disables."""
    fused: bool = True
    """``adamw``'s fused kernels (one multi-tensor kernel for all parameters, on CPU as on CUDA) instead of
    its per-parameter loop; the same update to float tolerance."""
    in_backward: bool = False
    """Apply each parameter's AdamW step inside the backward pass, as soon as its gradient is complete,
    and free that gradient at once, so full gradients never all exist together (PyTorch's
    optimizer-in-backward recipe). Needs train.grad_accum: 1 and grad_clip: 0 (both need every gradient
    at once) and a single process."""
    weights: str = "fp32"
    """The precision the trained weights are kept in. ``fp32``: as trained everywhere. ``bf16``: the weights and
    their gradients in bf16, half their fp32 size, with no fp32 master copy (kohya's ``--full_bf16``), for full
    fine-tuning where fp32 weights and their state do not fit. Each update is computed in fp32 a few tensors at a
    time and rounded back stochastically, so updates below bf16's resolution are not lost; the optimizer's state
    and the EMA stay fp32 (turn ema off, and pick adafactor or adamw8bit, for the smallest footprint). Training
    then runs under bf16 autocast (train.mixed_precision auto or bf16). Not with parallel.strategy=fsdp, which
    shards fp32 weights instead."""

    def validate(self) -> None:
        _check(self.name in OPTIMIZERS, "optim.name", f"must be one of {', '.join(OPTIMIZERS)}")
        _check(self.weights in ("fp32", "bf16"), "optim.weights", "must be fp32 or bf16")
        if self.name == "adamw8bit":
            _check(importlib.util.find_spec("bitsandbytes") is not None, "optim.name",
                   "adamw8bit needs bitsandbytes, which is not installed: pip install 'sdtrain[memory]', or set "
                   "optim.name=adamw or adafactor")
        _check(self.lr > 0, "optim.lr", "must be positive")
        _check(len(self.betas) == 2, "optim.betas", "needs two values, e.g. [0.9, 0.999]")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", "must be 0 or more")
        _check(self.schedule in ("constant", "cosine"), "optim.schedule", "must be constant or cosine")
        _check(self.grad_clip >= 0, "optim.grad_clip", "must be 0 (off) or positive")
        if self.in_backward:
            _check(self.grad_clip == 0, "optim.in_backward",
                   "clipping needs the norm of every gradient before any step: set optim.grad_clip=0")


@dataclass
class EMAConfig:
    enabled: bool = True
    """Keep an exponential moving average of the trained weights (exported by default)."""
    decay: float = 0.999
    """Upper bound of the EMA decay."""
    warmup: bool = True
    """Ramp the decay as (1 + step) / (10 + step) so early averages are not dominated by the random init."""
    every: int = 1
    """Update the average every this many optimizer steps, with the decay raised to this power so the
    average spans as many steps as an update per step would. Large models spend less time in EMA."""

    def validate(self) -> None:
        _check(0.0 < self.decay < 1.0, "ema.decay", "must be in (0, 1)")
        _check(self.every >= 1, "ema.every", "must be at least 1")


ENCODINGS = ("fp32", "bf16", "fp32+channels_last", "bf16+channels_last")
"""`TrainConfig.encode`'s ways for the autoencoder to encode a step's images."""
SWITCHES = ("compile", "channels_last", "cudnn_benchmark")
"""`TrainConfig`'s keys that take ``auto`` (follow ``train.tuned``), true or false."""
ATTENTION_KERNELS = ("flash", "efficient", "cudnn", "math")
"""`TrainConfig.attention_kernels`' names of torch's SDPA kernels."""


@dataclass
class TrainConfig:
    max_steps: int = 1000
    """Optimizer steps to train for (with ``max_minutes``, at most this many)."""
    max_minutes: float = 0.0
    """Train for about this many minutes instead of a fixed step count (0: off). The steps are planned from the
    run's own pace, its evaluations and saves included, and re-planned at every logging point, so a machine that
    gets busier or idler while it trains still ends on time; the learning-rate schedule spans the planned steps, so
    its decay ends at the last one. ``max_steps`` stays the upper bound. The plan is saved with each checkpoint and
    a resumed run trains to the plan its checkpoint holds."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    max_bad_steps: int = 10
    """A step whose loss or gradients are NaN or infinite is skipped (no update, no EMA; counted as
    ``skipped_steps`` in the metrics); this many in a row stop the run, its last checkpoint intact. 1 stops
    at the first. With optim.in_backward the update has happened before the loss can be checked, so the
    first one stops the run."""
    mixed_precision: str = "auto"
    """``auto`` times bf16 autocast against fp32 on this machine for the model's own layer shapes at the
    first start (a few seconds, cached per machine) and trains in the faster; the choice is kept for
    the life of the run. ``fp32`` (or ``no``) and ``bf16`` force one. fp16 is not offered: it needs loss
    scaling and is slow on CPUs."""
    gradient_checkpointing: Union[bool, str] = "auto"  # noqa: UP007 (OmegaConf reads typing.Union)
    """Recompute each block's activations in backward instead of storing them: less memory, a fifth to a
    third more compute. ``auto`` turns it on only when the estimated training memory would not fit
    the device (GPU memory, or the machine's RAM on a CPU); true/false force it. Applied per UNet/VAE
    block and text-encoder layer of the trained modules."""
    tuned: bool = False
    """The tuned path, one switch: on a GPU each repeated block of the trained modules compiled (``train.compile``), a
    convolutional denoiser in the channels_last layout where that measures faster (``train.channels_last``), and on
    a GPU at one resolution, cuDNN's algorithm search (``train.cudnn_benchmark``). Each of those keys set to true or
    false overrides it; CUDA graphs (``train.cuda_graphs``) are asked for on their own. What a run chose is logged at
    its start and saved with every checkpoint (meta.json, ``tuning``). On a GPU the first step is slow while the
    blocks compile (minutes for a large model), so it pays on long runs."""
    compile: Union[bool, str] = "auto"  # noqa: UP007 (OmegaConf reads typing.Union)
    """Compile each block of the trained modules with torch.compile (regional compilation: a repeated block's code
    is compiled once and reused). ``auto``: with ``train.tuned`` on a GPU. Not on a CPU unless set: there SD2's
    compiled UNet stepped within a few percent of eager after five minutes of compiling, whose workers raised the
    run's peak memory by 13 GiB (benchmarks/results)."""
    channels_last: Union[bool, str] = "auto"  # noqa: UP007 (OmegaConf reads typing.Union)
    """Keep a convolutional denoiser's (a UNet's) weights, and with them its activations, in the channels_last
    layout, which some convolution kernels run faster. ``auto``: with ``train.tuned``, a step in each layout is timed
    at the first start (a batch of the run's size, in its precision) and channels_last kept where it is 5% faster
    and its loss agrees with the contiguous layout's; cached per machine, kept for the life of the run. Transformers
    have no such layout to choose; FSDP on several ranks keeps its shards contiguous."""
    cuda_graphs: bool = False
    """On CUDA, replay each compiled block's kernels as one CUDA graph (torch.compile's ``reduce-overhead`` mode): less
    launch overhead for the many small kernels of a UNet, some memory for the graphs' buffers. Needs
    ``train.compile``, one resolution (a new shape records a new graph), one micro-batch a step and no gradient
    checkpointing. Not turned on by ``train.tuned``: blocks graphed one by one, each feeding the next, can find their
    input overwritten by a later replay (pytorch/pytorch#152887), and evaluation between steps runs the blocks
    outside training; `make gpu-check` measures it on its own. Nothing on a CPU."""
    cudnn_benchmark: Union[bool, str] = "auto"  # noqa: UP007 (OmegaConf reads typing.Union)
    """On CUDA, let cuDNN time its algorithms for each new convolution shape and keep the fastest
    (``torch.backends.cudnn.benchmark``): a slower first step per shape, and aspect buckets bring several shapes.
    ``auto``: with ``train.tuned`` at one resolution (``data.aspect_buckets`` off)."""
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda``."""
    tf32: bool = False
    """On CUDA, compute fp32 matmuls (those outside bf16 autocast) in TF32: faster, about 3 significant digits
    (``torch.set_float32_matmul_precision("high")``)."""
    deterministic: bool = False
    """On CUDA, only deterministic kernels (``torch.use_deterministic_algorithms``, cuDNN's deterministic
    convolutions, cuBLAS's fixed workspace): two runs, or a run and its resume, agree bit for bit, at some speed.
    An operation with no deterministic kernel stops the run and is named. CPU kernels are deterministic already."""
    encode: str = "auto"
    """How the frozen autoencoder encodes the images of a step that reads pixels: ``fp32``, ``bf16`` (under
    autocast), or either with ``+channels_last`` (``fp32+channels_last``). ``auto`` times the four on this machine
    at the first start, on a batch of the run's size, and keeps the fastest whose latents agree with fp32's within
    2% (RMS), by 5% or more; cached per machine, kept for the life of the run. Clips, and steps on encoded shards,
    encode in fp32 (nothing to choose)."""
    attention_kernels: list[str] = field(default_factory=lambda: ["flash", "efficient", "math"])
    """The scaled-dot-product attention kernels a run may use on CUDA (``flash``, ``efficient``, ``cudnn``,
    ``math``; torch picks the fastest of them for each call). cuDNN's is left out by default: on H100 and H200 its
    backward returns NaN query gradients for a call with an explicit mask at sequence lengths of 64 mod 128
    (pytorch/pytorch#196678, torch 2.11 to 2.13; trl and pocket-tts leave it out too, pocket-tts measuring no loss of
    throughput). Set process-wide as a run starts; CPUs read the flash and math switches too."""
    threads: Union[int, str] = 0  # noqa: UP007 (OmegaConf reads typing.Union)
    """torch intra-op threads on CPU; 0 keeps torch's default. ``auto`` starts at torch's default and, between
    logging points, moves the count as other processes take or free the run's cores, keeping a change only when
    its steps are faster (with another job on one of two cores, one thread trains twice as fast as two). A run
    whose count changed is not bitwise repeatable: CPU sums split over other thread counts round differently."""

    def validate(self) -> None:
        _check(self.max_steps >= 1, "train.max_steps", "must be at least 1")
        _check(self.max_minutes >= 0, "train.max_minutes", "must be 0 (off) or positive")
        _check(self.grad_accum >= 1, "train.grad_accum", "must be at least 1")
        _check(self.max_bad_steps >= 1, "train.max_bad_steps", "must be at least 1")
        _check(self.mixed_precision in PRECISIONS, "train.mixed_precision", "must be auto, fp32 (or no) or bf16")
        _check(self.gradient_checkpointing in (True, False, "auto"), "train.gradient_checkpointing",
               "must be auto, true or false")
        _check(self.device in ("auto", "cpu", "cuda"), "train.device", "must be auto, cpu or cuda")
        for name in SWITCHES:
            _check(getattr(self, name) in (True, False, "auto"), f"train.{name}", "must be auto, true or false")
        _check(not self.cuda_graphs or self.compile is True or (self.compile == "auto" and self.tuned),
               "train.cuda_graphs",
               "replays compiled blocks: set train.compile=true (or train.tuned=true), or turn cuda_graphs off")
        # A graph's outputs live until its next replay: a second micro-batch would overwrite the gradients the
        # first left (a parameter's gradient takes over the output's memory).
        _check(not self.cuda_graphs or self.grad_accum == 1, "train.cuda_graphs",
               "replays each block's graph once a step: set train.grad_accum=1, or turn cuda_graphs off")
        _check(self.encode == "auto" or self.encode in ENCODINGS, "train.encode",
               f"must be auto or one of {', '.join(ENCODINGS)}")
        _check(bool(self.attention_kernels) and set(self.attention_kernels) <= set(ATTENTION_KERNELS),
               "train.attention_kernels", f"must list some of {', '.join(ATTENTION_KERNELS)}")
        _check(self.threads == "auto" or (isinstance(self.threads, int) and self.threads >= 0), "train.threads",
               "must be a thread count, 0 (torch's default) or auto")

    def compiles(self, cuda: bool) -> bool:
        """Whether the trained modules' blocks are compiled (``train.compile``), on a GPU or not."""
        return self.tuned and cuda if self.compile == "auto" else bool(self.compile)

    def searches_convolutions(self, fixed_shapes: bool) -> bool:
        """Whether cuDNN times its convolution algorithms (``train.cudnn_benchmark``), for a run whose step shapes
        are fixed or not."""
        chosen = self.tuned and fixed_shapes if self.cudnn_benchmark == "auto" else bool(self.cudnn_benchmark)
        return chosen and not self.deterministic


@dataclass
class ParallelConfig:
    strategy: str = "ddp"
    """How several processes share the work: ``ddp`` (every rank holds the whole model) or ``fsdp``
    (FSDP2, parameters sharded per block; under LoRA the frozen base too, so a base larger than one device trains
    across several). A single process ignores it."""
    backend: str = "auto"
    """Collectives: ``auto`` (nccl on GPUs; ccl when Intel's bindings are installed, else gloo, on CPUs),
    ``nccl``, ``gloo`` or ``ccl``."""
    timeout_minutes: float = 30.0
    """How long a collective may wait for the slowest rank before the job fails."""

    def validate(self) -> None:
        _check(self.strategy in ("ddp", "fsdp"), "parallel.strategy", "must be ddp or fsdp")
        _check(self.backend in ("auto", "nccl", "gloo", "ccl"), "parallel.backend", "must be auto, nccl, gloo or ccl")


@dataclass
class CheckpointConfig:
    every: int = 500
    """Save every this many optimizer steps (and always at the end); 0 saves only at the end."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted after a newer one is complete."""
    resume: str = "auto"
    """``auto`` continues from the newest checkpoint in the run folder, ``never`` refuses to start
    over an existing one, or a path to a checkpoint folder."""
    format: str = "auto"
    """``full``: the weights, EMA and optimizer state gathered onto the main rank and written as safetensors
    (readable by any tool); ``sharded``: every rank writes its own part with torch.distributed.checkpoint,
    nothing is gathered, and it loads on any number of ranks (export and generate consolidate it);
    ``auto``: sharded when parameters are sharded (``parallel.strategy=fsdp`` on several ranks), else full."""
    async_save: bool = False
    """Sharded saves only: training continues once the state is copied aside in memory (one more copy of each
    rank's shards), while the files are written in the background; the checkpoint appears when they are
    all written. A failed write stops the run at the next save or at the end, with nothing replaced."""

    def validate(self) -> None:
        _check(self.every >= 0, "checkpoint.every", "must be 0 (end only) or positive")
        _check(self.keep_last >= 1, "checkpoint.keep_last", "must be at least 1")
        _check(self.format in ("auto", "full", "sharded"), "checkpoint.format", "must be auto, full or sharded")
        _check(not self.async_save or self.format != "full", "checkpoint.async_save",
               "needs sharded checkpoints (checkpoint.format: sharded or auto under FSDP); turn it off for full ones")


@dataclass
class LoggingConfig:
    every: int = 10
    """Log metrics every this many optimizer steps."""
    progress: bool = True
    """Show a progress bar."""
    tensorboard: bool = True
    """Write TensorBoard events under the run folder."""
    wandb: bool = False
    """Log to Weights & Biases; the key comes from WANDB_API_KEY, WANDB_MODE=offline works without network."""
    wandb_project: str = "sdtrain"
    """W&B project name."""

    def validate(self) -> None:
        _check(self.every >= 1, "logging.every", "must be at least 1")


@dataclass
class ValidationConfig:
    prompts: list[str] = field(default_factory=list)
    """Prompts of the sample grid written at each checkpoint and at the end (diffusion stage)."""
    seed: int = 0
    """Seed of the first prompt's image; prompt i uses seed + i."""
    steps: int | None = None
    """Sampling steps. Unset: the model's own where it has one (a step-distilled model's: 4 for Flux.1-schnell and a
    distilled Flux.2 klein, 8 for Z-Image-Turbo), else 20."""
    guidance: float | None = None
    """Guidance scale: classifier-free, or the input of a guidance embedding (Flux.1-dev). Unset: the model's own:
    3.5 for a Flux.1 transformer with a guidance embedding, none (1) for a step-distilled model (Flux.1-schnell, a
    distilled Flux.2 klein, Z-Image-Turbo: classifier-free guidance would double the cost and over-saturate), else
    the family's (4 for Flux.2 and Qwen-Image, 5 for the others)."""
    frames: int | None = None
    """Frames of each validation clip, for a video family (Wan: 4n+1). Unset: as many as the run's clips (those of
    the batch validation sees); 1 draws a still image per prompt instead of a clip, the cheap preview where a clip's
    sampling costs too much."""


@dataclass
class EvaluationConfig:
    every_samples: int = 0
    """Evaluate the current (EMA) weights every this many training samples, on every rank (MLPerf: 512,000 for
    SD2, 262,144 for Flux.1); 0 turns it off. Results go to the metrics (metrics.jsonl, TensorBoard, W&B) as fid,
    clip, adherence_*, val_loss."""
    prompts: str | None = None
    """Prompt file: one per line, or a TSV/CSV with a caption column. Unset with metrics [adherence]: the
    shapes demo's prompt set."""
    num: int = 0
    """Prompts used (the first N), or for val_loss samples of ``val_shards`` (the first N in shard order);
    0 uses all."""
    metrics: list[str] = field(default_factory=lambda: ["fid", "clip"])
    """Any of fid, clip, adherence (scored on generated images) and val_loss (the training loss on
    ``val_shards`` at fixed timesteps and noise: MLPerf's Flux.1 metric, no images generated)."""
    steps: int = 50
    """Sampling steps (MLPerf: DDIM, 50)."""
    guidance: float = 8.0
    """Classifier-free guidance scale (MLPerf: 8)."""
    scheduler: str = "ddim"
    """Sampler: ddim, euler or dpmpp."""
    seed: int = 0
    """Prompt i is generated from seed + i, on whichever rank draws it; for val_loss, sample i's noise is drawn
    from (seed, i) alone, so the value does not depend on batch size or rank count."""
    batch: int = 8
    """Images generated together (each from its own seed) and added to the metrics at once; for val_loss, the
    held-out samples per forward pass."""
    reference: str | None = None
    """FID reference: statistics (.npz with mu and sigma, e.g. MLPerf's val2014_512x512_30k_stats.npz) or images."""
    inception: str | None = None
    """Path of the FID Inception weights (pt_inception-2015-12-05-6726825d.pth)."""
    clip: str | None = None
    """A transformers CLIP model folder for the CLIP score (MLPerf: CLIP-ViT-H-14-laion2B-s32B-b79K)."""
    val_shards: str | None = None
    """Held-out shards for val_loss (folder, glob or brace pattern): image shards, encoded online, or shards from
    ``sdtrain prepare encode`` with the run's autoencoder (their latents, and with frozen text encoders their
    embeddings, are used). MLPerf's Flux.1: the 29,696-image COCO-2014 subset at 256 px."""
    val_timesteps: int = 8
    """val_loss evaluates sample i at timestep t = (i mod N) / N of the schedule (flow matching: sigma = t;
    noise prediction: timestep t * num_train_timesteps) and reports the mean of the N per-timestep means
    (MLPerf's Flux.1: 8, t = 0, 1/8, ..., 7/8)."""
    val_posterior: str = "mean"
    """The latent val_loss scores each held-out image by: ``mean``, the VAE posterior's mean (the same value at
    every evaluation of the same weights); ``sample``, a draw from the posterior as MLPerf's Flux.1 reference takes
    it (for a compliance claim), drawn from (seed, sample index) alone so it stays repeatable. The metrics say which
    (``val_posterior_sampled`` 0 or 1)."""
    target: dict[str, float] = field(default_factory=dict)
    """Stop training once every metric here meets its target: fid and val_loss at most, the others at least,
    e.g. MLPerf's {fid: 90, clip: 0.15}, MLPerf Flux.1's {val_loss: 0.586} or {adherence_overall: 0.9}. The
    step, samples and wall time of that point are recorded in target.json and the metrics."""

    def validate(self) -> None:
        _check(self.every_samples >= 0, "evaluation.every_samples", "must be 0 (off) or positive")
        _check(set(self.metrics) <= {"fid", "clip", "adherence", "val_loss"} and bool(self.metrics),
               "evaluation.metrics", "choose from fid, clip, adherence, val_loss")
        _check(self.scheduler in ("ddim", "euler", "dpmpp"), "evaluation.scheduler", "must be ddim, euler or dpmpp")
        _check(self.steps >= 1 and self.batch >= 1 and self.num >= 0, "evaluation",
               "steps and batch at least 1, num 0 or more")
        _check(self.val_timesteps >= 1, "evaluation.val_timesteps", "must be at least 1 (MLPerf's Flux.1: 8)")
        _check(self.val_posterior in ("mean", "sample"), "evaluation.val_posterior",
               "must be mean or sample (MLPerf's reference samples the posterior)")
        if self.every_samples:
            _check(self.prompts is not None or not {"fid", "clip"} & set(self.metrics), "evaluation.prompts",
                   "required for fid and clip: a prompt file (MLPerf: the COCO-2014 captions TSV)")
            _check(self.val_shards is not None or "val_loss" not in self.metrics, "evaluation.val_shards",
                   "required for val_loss: the held-out shards (MLPerf's Flux.1: the COCO-2014 subset, encoded)")
        known = {"fid", "clip", "val_loss"} | {f"adherence_{k}" for k in (
            "colour_accuracy", "shape_accuracy", "two_shape_accuracy", "pairs_drawn_accuracy", "pairs_sides_accuracy",
            "pairs_sides_reversed_accuracy", "pairs_plain_accuracy", "count_accuracy", "overall")}
        _check(set(self.target) <= known, "evaluation.target", f"keys must be among {', '.join(sorted(known))}")


@dataclass
class RunConfig:
    stage: str = MISSING
    """What to train: ``autoencoder`` or ``diffusion`` (UNet, optionally with the text encoder)."""
    run_dir: str = MISSING
    """Folder for the resolved config, checkpoints, logs and samples."""
    mode: Any = "full"
    """What the diffusion stage trains: ``full`` (all UNet weights, optionally the text encoder), ``lora``
    (low-rank adapters only), ``textual_inversion`` (new token embeddings only), ``dreambooth``, or
    ``controlnet`` (a ControlNet made from the frozen denoiser, reading each sample's conditioning image) or
    ``instruct_pix2pix`` (the whole denoiser, given each sample's source image's latents beside the noisy ones).
    A list trains parts together: ``[controlnet, lora]`` (a ControlNet and LoRA adapters on the frozen denoiser it
    steers), ``[instruct_pix2pix, lora]`` (adapters on a denoiser that already edits, an InstructPix2Pix model)."""
    seed: int = 0
    """Seeds initialisation, data order, augmentation and noise."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    autoencoder: AutoencoderLossConfig = field(default_factory=AutoencoderLossConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    textual_inversion: TextualInversionConfig = field(default_factory=TextualInversionConfig)
    dreambooth: DreamBoothConfig = field(default_factory=DreamBoothConfig)
    instruct_pix2pix: InstructPix2PixConfig = field(default_factory=InstructPix2PixConfig)
    edit: EditConfig = field(default_factory=EditConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes the run trains: ``mode`` itself, or the list it gives, in MODES' order but adapters last (they
        go on what the other parts made: a ControlNet copies the denoiser before adapters wrap its layers)."""
        given = [self.mode] if isinstance(self.mode, str) else list(self.mode)
        return tuple(sorted(given, key=lambda m: (m == "lora", MODES.index(m) if m in MODES else len(MODES))))

    @property
    def mode_name(self) -> str:
        """The run's modes as a card or a log line names them: ``lora``, ``controlnet + lora``."""
        return " + ".join(self.modes)

    def validate(self) -> None:
        """Checks OmegaConf's types cannot express; each failure names its key. Each section checks its own
        fields, and what spans sections is checked here: every failing section is reported, a line each (its first
        problem), and what spans sections once they all pass."""
        problems = []
        for check in (self._validate_modes, *(section.validate for section in (
                self.diffusion, self.data, self.model, self.autoencoder, self.optim, self.ema, self.train,
                self.parallel, self.checkpoint, self.logging, self.evaluation))):
            try:
                check()
            except UserError as exc:
                problems.append(str(exc))
        if problems:
            raise UserError("\n".join(problems))
        self._validate_across()

    def _validate_modes(self) -> None:
        _check(self.stage in STAGES, "stage", f"'{self.stage}' is not one of {', '.join(STAGES)}")
        _check(isinstance(self.mode, str) or (isinstance(self.mode, list) and bool(self.mode)
                                              and all(isinstance(m, str) for m in self.mode)),
               "mode", f"{self.mode!r}: give one mode (mode: lora) or a list of modes (mode: [controlnet, lora])")
        modes = self.modes
        unknown = [m for m in modes if m not in MODES]
        _check(not unknown, "mode", f"'{unknown[0] if unknown else ''}' is not one of {', '.join(MODES)}")
        _check(len(modes) == 1 or modes in COMBINED, "mode",
               f"[{', '.join(modes)}] do not train together; modes that do: "
               f"{'; '.join(f'[{a}, {b}]' for a, b in COMBINED)}")
        _check(modes == ("full",) or self.stage == "diffusion", "mode",
               f"{self.mode_name} fine-tunes the diffusion stage; set stage: diffusion")
        self.lora.validate()
        self.instruct_pix2pix.validate()
        _check(not self.edit.reference or modes in (("full",), ("lora",)), "edit.reference",
               f"trains the denoiser to edit by reference with mode full or lora, not {self.mode_name}")
        self.textual_inversion.validate(trained="textual_inversion" in modes)
        if "dreambooth" in modes:
            self.dreambooth.validate()
            if self.dreambooth.cache_latents:
                for key, value, wanted in (("random_flip", self.data.random_flip, False),
                                           ("aspect_buckets", self.data.aspect_buckets, False),
                                           ("center_crop", self.data.center_crop, True)):
                    _check(value == wanted, f"data.{key}", f"dreambooth.cache_latents encodes each image once, from "
                           f"its centre crop: set data.{key}={str(wanted).lower()}, or dreambooth.cache_latents=false")
        if self.lora.type != "lora" and ("lora" in modes or self.dreambooth.lora):
            # DoRA divides by the norm of the base weight plus the update, LoKr reshapes its product to the base
            # weight's: both read the weight as a plain tensor outside its layer's matmul.
            _check(self.model.frozen_precision == "fp32", "model.frozen_precision",
                   f"lora.type={self.lora.type} reads each base weight whole outside its matmul, where low-precision "
                   "storage has none: set fp32 (or lora.type=lora)")
            _check(self.parallel.strategy == "ddp", "parallel.strategy",
                   f"lora.type={self.lora.type} reads each base weight whole, which FSDP shards: set ddp (or "
                   "lora.type=lora)")
        _check(self.model.offload_frozen is not True or self.parallel.strategy == "ddp", "model.offload_frozen",
               "streams the whole frozen base from host memory, which parallel.strategy=fsdp shards across the ranks "
               "instead: use one or the other")
        if "textual_inversion" in modes:
            _check(self.parallel.strategy == "ddp", "parallel.strategy",
                   "textual_inversion trains a few vectors of a text encoder every rank holds whole: use ddp")

    def _validate_across(self) -> None:
        modes = self.modes
        if self.optim.weights == "bf16":
            _check(self.train.mixed_precision in ("auto", "bf16"), "optim.weights",
                   "bf16 weights compute under bf16 autocast: set train.mixed_precision=bf16 (or auto)")
        if self.optim.in_backward:
            _check(self.train.grad_accum == 1, "optim.in_backward",
                   "steps each parameter during backward, so it cannot accumulate: set train.grad_accum=1")
        if self.evaluation.every_samples:
            _check(self.stage == "diffusion", "evaluation.every_samples", "evaluates generated images: diffusion only")
            _check(not {"controlnet", "instruct_pix2pix"} & set(modes), "evaluation.every_samples",
                   f"mode {self.mode_name} samples from each prompt's image, which evaluation has none of: set it to 0 "
                   "and judge the validation images (validation.prompts), drawn from the last batch's images")
            _check(not self.edit.reference or set(self.evaluation.metrics) <= {"val_loss"}, "evaluation.metrics",
                   "an edit by reference draws from each prompt's source image, which FID, CLIP score and adherence "
                   "have none of: keep val_loss alone, and judge the validation images (validation.prompts), which "
                   "edit the last batch's sources")


def _describe(exc: OmegaConfBaseException) -> str:
    """OmegaConf's messages span several lines; keep the first and name the key."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    message = lines[0] if lines else type(exc).__name__
    key = getattr(exc, "full_key", None)
    if key and key not in message:
        message = f"{key}: {message}"
    # Keys come from the user's file and may hold any character; the error stays one line.
    return _printable(message)


def _merge(base: DictConfig, layer: Any, where: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, layer)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise UserError(f"{where}{_describe(exc)}") from exc
    except (TypeError, ValueError) as exc:
        # OmegaConf says "Cannot merge incompatible container types" without a key: find it.
        raise UserError(f"{where}{_clashing_key(base, layer)}: {exc} (a mapping where a list or a value "
                        "belongs, or the reverse); fix its type") from exc


def _clashing_key(base: DictConfig, layer: DictConfig, prefix: str = "") -> str:
    """The first key of ``layer`` that cannot merge into ``base`` on its own."""
    for key in list(layer):
        name = f"{prefix}{key}"
        try:
            child, target = layer._get_node(key), base._get_node(key)
            if isinstance(child, DictConfig) and isinstance(target, DictConfig):
                return _clashing_key(target, child, f"{name}.")
            OmegaConf.merge(base, OmegaConf.create({key: child}))
        except Exception:  # noqa: BLE001 - whatever reading or merging raises marks this key
            return name
    return prefix.rstrip(".") or "the config"


def _check_sections(layer: DictConfig, where: str) -> None:
    """OmegaConf reports a scalar given for a whole section without naming it; name it here."""
    sections = {f.name for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(f.default_factory)}
    for key in sections & set(layer.keys()):
        value = layer._get_node(key)._value()
        if value is not None and not isinstance(value, (dict, DictConfig)) and not OmegaConf.is_missing(layer, key):
            raise UserError(f"{where}{key}: must be a mapping of {key} settings, got {value!r}")


ENV_PREFIX = "env:"


def _config_text(path: str | Path) -> tuple[str, str]:
    """The YAML of a config argument and the name to report it by: a file, or ``env:NAME`` for a config
    carried in an environment variable (how cluster job files bring their resolved config to every node)."""
    name = str(path)
    if name.startswith(ENV_PREFIX):
        variable = name[len(ENV_PREFIX):]
        if variable not in os.environ:
            raise UserError(f"{name}: the environment variable {variable} is not set; it should hold the "
                            "YAML config (the job files of `sdtrain launch` export it)")
        return os.environ[variable], f"${variable}"
    if not Path(path).is_file():
        raise UserError(f"{path}: config file not found; pass the path of a YAML config")
    try:
        return Path(path).read_text(), name
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read the config ({exc}); pass a UTF-8 YAML file") from exc


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Merge YAML then ``key=value`` overrides over the defaults and validate the result."""
    try:
        return _load_config(path, overrides)
    except OmegaConfBaseException as exc:  # interpolations are resolved late, wherever a value is read
        raise UserError(_describe(exc)) from exc


def load_config_without(path: str | Path, overrides: list[str] | tuple[str, ...], keep: tuple[str, ...] = ()
                        ) -> RunConfig:
    """`load_config` for a command that needs only part of a run (counting parameters, previewing data): the keys
    the config leaves open (run_dir, data.shards, model sources it asks for) are filled with placeholders, model
    sources as unset (so presets build), except those in `keep` (keys, or sections whose keys are all kept), which
    the user must still give."""
    given = OmegaConf.merge(read_layer(path)[0], parse_overrides(overrides))
    open_keys = {key for key in {"run_dir", "data.shards"} | set(OmegaConf.missing_keys(given))
                 if not any(key == kept or key.startswith(f"{kept}.") for kept in keep)}
    filled = [f"{key}={'null' if key.startswith('model.') else 'unused'}" for key in sorted(open_keys)
              if OmegaConf.select(given, key, default=None) is None or OmegaConf.is_missing(given, key)]
    return load_config(path, [*filled, *overrides])


def _printable(text: str) -> str:
    """``text`` with control characters escaped, so an error quoting the user's input stays one line."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _one_line(exc: BaseException) -> str:
    return _printable((str(exc).strip().splitlines() or [type(exc).__name__])[0])


def read_layer(path: str | Path) -> tuple[DictConfig, str]:
    """A config file's (or ``env:NAME``'s) YAML as it stands, unmerged, and the name to report it by."""
    text, name = _config_text(path)
    try:
        layer = OmegaConf.load(io.StringIO(text))
    except Exception as exc:  # yaml raises many types; all mean "not valid YAML"
        raise UserError(f"{name}: not valid YAML ({_one_line(exc)}); fix the file") from exc
    if not isinstance(layer, DictConfig):
        raise UserError(f"{name}: the top level must be a mapping of config keys (stage:, data:, ...)")
    return layer, name


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> DictConfig:
    """``key=value`` overrides as one config layer; a malformed one is a UserError naming it."""
    layer = OmegaConf.create()
    for item in overrides:
        shown = _printable(item)
        if "=" not in item:
            raise UserError(f"override '{shown}' is not key=value; write e.g. train.max_steps=100")
        try:
            layer = OmegaConf.merge(layer, OmegaConf.from_dotlist([item]))
        except Exception as exc:  # yaml and OmegaConf raise many types; all mean this override is malformed
            raise UserError(f"override '{shown}': cannot parse it ({_one_line(exc)}); write key=value, quoting "
                            "the value if it holds YAML characters") from exc
    return layer  # type: ignore[return-value]


def _move_keys(layer: DictConfig, where: str, keep_unset: bool = False) -> DictConfig:
    """`layer` with the keys of MOVED_KEYS it sets under their names now, said in one warning line; a key set
    under both names is a UserError. An old key left unset (null, or ``{}``: a saved run's resolved config holds
    every slot) moves without a word with `keep_unset` (a command line's null clears a ``???``), else is
    dropped (a file's null is the default)."""
    tree = OmegaConf.to_container(layer, resolve=False)
    # (Read from the plain tree: a DictConfig says a key whose value is ??? is not in it.)
    found = [key for key in MOVED_KEYS if isinstance(tree.get(key.split(".")[0]), dict)
             and key.split(".", 1)[1] in tree[key.split(".")[0]]]
    if not found:
        return layer
    moved = []
    for key in found:
        section, old_name = key.split(".", 1)
        value = tree[section].pop(old_name)
        unset = value is None or value == {}
        if unset and not keep_unset:
            continue
        new = MOVED_KEYS[key]
        *parents, name = new.split(".")
        target = tree
        for depth, part in enumerate(parents):
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                place = ".".join(parents[:depth + 1])
                raise UserError(f"{where}{place}: must be a mapping, got {target!r}")
        if unset and name in target:
            continue
        if name in target and target[name] is not None:
            raise UserError(f"{where}{key}: set again as {new}, its name now; keep only {new}")
        target[name] = value
        if not unset:
            moved.append(key)
    if moved:
        log.warning("%s%s: moved to %s; read as such (rename %s)", where, ", ".join(moved),
                    ", ".join(MOVED_KEYS[key] for key in moved), "them" if len(moved) > 1 else "it")
    return OmegaConf.create(tree)


def _load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...]) -> RunConfig:
    merged = OmegaConf.structured(RunConfig)
    if path is not None:
        layer, name = read_layer(path)
        layer = _move_keys(layer, f"{name}: ")
        _check_sections(layer, f"{name}: ")
        required = OmegaConf.missing_keys(layer)
        merged = _merge(merged, layer, f"{name}: ")
        # Merging never replaces a value with ???, so a key the YAML asks for would keep its default (None
        # for most paths) and fail late, or not at all: mark it missing again until the command line sets it.
        for key in required:
            OmegaConf.update(merged, key, MISSING, merge=False)
    dotlist = _move_keys(parse_overrides(overrides), "command line: ", keep_unset=True)
    _check_sections(dotlist, "command line: ")
    merged = _merge(merged, dotlist, "command line: ")
    if OmegaConf.select(merged, "train.mixed_precision") in _FP32_ALIASES:
        merged.train.mixed_precision = "fp32"
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        raise UserError(f"{missing[0]}: required value missing (???); set it in the YAML or as {missing[0]}=...")
    config: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    validate(config)
    return config


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise UserError(f"{key}: {message}")


def validate(config: RunConfig) -> None:
    """Checks OmegaConf's types cannot express; each failure names its key (see RunConfig.validate)."""
    config.validate()


def to_yaml(config: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)

