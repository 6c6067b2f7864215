"""Training tasks: what a stage trains and how its loss is computed.

The Trainer owns the loop, optimizer, EMA, checkpoints and logging; a task only builds its
models, names the trainable ones, computes the loss of a batch and renders validation images.
For the diffusion stage, what trains (the whole model, LoRA adapters, textual inversion's tokens: a TrainedPart,
train/parts.py) and what it trains on (DreamBooth's class images and prior loss: a DataRecipe) are components its
mode supplies, so any trained part takes any recipe.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import FrozenDict
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from torch import nn

from sdtrain.config import DataConfig, DiffusionConfig, ModelConfig, RunConfig
from sdtrain.data.decode import make_buckets, present
from sdtrain.data.encoded import TEXT_FIELDS, dataset_encoding
from sdtrain.errors import UserError
from sdtrain.loaders.components import load_component
from sdtrain.loaders.pipelines import place_experts
from sdtrain.models import build, families
from sdtrain.models.pipeline import (
    PREVIEW_STEPS,
    exact_sampling,
    is_distilled,
    run_sampling,
    sample_images,
    sampler_from,
    sampling_steps,
)
from sdtrain.models.tokenizer import CaptionTokenizer
from sdtrain.train import autotune
from sdtrain.train.components import ComponentPlanner
from sdtrain.train.objectives import FlowMatching, NoisePrediction, option_problems
from sdtrain.train.parts import TrainedPart
from sdtrain.train.storage import FrozenStorage, on_meta
from sdtrain.utils import save_grid, save_images

log = logging.getLogger(__name__)


def make_objective(family: families.ModelFamily, config: DiffusionConfig, scheduler: Any, device: torch.device,
                   denoiser_config: Any, sampling_steps: int = PREVIEW_STEPS, share: tuple[float, float] | None = None
                   ) -> NoisePrediction | FlowMatching:
    """The family's training objective, on `scheduler` (the training noise schedule build_noise_scheduler gives);
    `sampling_steps`: the step count the run's images sample with, whose shift ``diffusion.flow.dynamic_shift:
    sampling`` trains at; `share`: the sigmas the trained expert takes (`expert_share`), None: all."""
    if family.denoising.objective == "flow_matching":
        sampling_mu = None
        if config.flow.dynamic_shift == "sampling":
            def sampling_mu(tokens: int) -> float | None:
                return family.sampling.mu(tokens, sampling_steps)
        return FlowMatching(config, scheduler, device, patch_size=family.denoising.image_token_side(denoiser_config),
                            sampling_mu=sampling_mu, share=share)
    return NoisePrediction(config, scheduler, device)


def expert_share(model: ModelConfig, family: families.ModelFamily, source: str | None) -> tuple[float, float] | None:
    """The shifted sigmas the run's expert (``model.expert``) denoises, at the boundary of the model its weights
    come from (`source`, else the family's released one); None for a family without experts."""
    if family.experts is None:
        return None
    return family.experts.share(model.expert, family.experts.boundary(source))


def expert_problems(model: ModelConfig, family: families.ModelFamily) -> list[str]:
    """What ``model.expert`` names that `family` has not: an expert of a family without experts, or none of its."""
    if family.experts is None:
        return [] if model.expert is None else [
            f"model.expert: {family.title} has one denoiser for every timestep, no experts to choose from; remove "
            "model.expert"]
    problem = family.experts.problem(model.expert)
    return [problem] if problem else []


def capability_problems(config: RunConfig, family: families.ModelFamily, parts: list[type[TrainedPart]]
                        ) -> list[str]:
    """Every key of a diffusion run's `config` that its `family` or its trained `parts` cannot take, one line each,
    from the config, the family's spec and the pretrained denoiser's config.json alone: no weight loads."""
    model = config.model
    found = expert_problems(model, family)
    if found:  # the components' sources depend on which expert trains
        return found
    found += component_problems(model, family)
    built = [name for name in family.components if build.component_source(model, name) is None]
    if built:
        try:
            family.preset(model.preset, built[0])
        except UserError as exc:
            found.append(str(exc))
    if family.edits_only and not config.edit.reference:
        found.append(f"edit.reference: {family.title} edits images by reference and draws none from text alone; set "
                     "edit.reference=true, with each image's source beside it (KEY.src.png)")
    found += option_problems(family.denoising.objective, config.diffusion)
    denoiser_config = _pretrained_config(model, family.components.denoiser)
    vae_config = _pretrained_config(model, "vae")
    if vae_config is not None:
        found += shape_problems(config, family, vae_config, denoiser_config,
                                str(build.component_source(model, family.components.denoiser)))
    if config.diffusion.flow.guidance_range and denoiser_config is not None \
            and not family.denoising.takes_guidance(denoiser_config):
        found.append(GUIDANCE_RANGE_UNREAD)
    for part in parts:
        found += part.problems(config, family)
    return [line for line in found if line]


def component_problems(model: ModelConfig, family: families.ModelFamily) -> list[str]:
    """The ``model.components`` entries `family` has no such component for, or that a tokenizer cannot take. Another
    family's component given only overrides (a config written for Stable Diffusion's UNet, run as Flux.1) is a
    warning: nothing reads them, and nothing is loaded from where the user meant."""
    tokenizers = family.components.tokenizers
    declared = [*family.components, *tokenizers]
    known = {name for other in families.FAMILIES.values() for name in (*other.components, *other.components.tokenizers)}
    found = []
    for name, component in model.components.items():
        if name in declared or name == "tokenizer" or not (component.source or component.overrides):
            continue
        line = f"model.components.{name}: {family.title} has no component {name}; its components are " \
               f"{', '.join(declared)}"
        if component.source is None and name in known:
            log.warning("%s: its overrides are not read", line)
        else:
            found.append(line)
    found += [f"model.components.{name}.overrides: a tokenizer is loaded, never built from settings; remove them"
              for name in model.components if (name in tokenizers or name == "tokenizer") and model.overrides(name)]
    return found


def shape_problems(config: RunConfig, family: families.ModelFamily, vae_config: Any, denoiser_config: Any = None,
                   where: str = "the denoiser") -> list[str]:
    """What of the run's image sizes the model's shapes cannot take, one line each: the resolution against the VAE's
    downsampling (`vae_config`), and with the `denoiser_config` the bucket step against both downsamplings together
    and the largest side against the denoiser's position table (SD3's pos_embed_max_size; `where`: the denoiser's
    source, as the line names it)."""
    data = config.data
    scale = family.codec.downsampling(vae_config)
    if data.resolution % scale:
        return [f"data.resolution: {data.resolution} is not a multiple of the VAE's factor {scale}"]
    if denoiser_config is None:
        return []
    found = []
    factor = scale * family.denoising.downsampling(denoiser_config)
    if data.aspect_buckets and data.bucket_step % factor:
        found.append(f"data.bucket_step: {data.bucket_step} is not a multiple of {factor}, the VAE and UNet's "
                     f"combined downsampling; use {factor} or a multiple of it")
    longest = family.denoising.max_latent_side(denoiser_config)
    side = max(max(bucket) for bucket in make_buckets(data)) if data.aspect_buckets else data.resolution
    if longest is not None and side > longest * scale:
        # A traceback in the first step otherwise.
        found.append(f"data.resolution: {where} takes images of at most {longest * scale} px a side (its position "
                     f"table covers {longest} latent rows), but this run trains at {side} px; set data.resolution "
                     f"(and with aspect buckets data.max_aspect) so no side exceeds {longest * scale}")
    return found


GUIDANCE_RANGE_UNREAD = ("diffusion.flow.guidance_range: this model's denoiser has no guidance embedding (a "
                         "guidance-distilled model's, as Flux.1-dev has), so nothing would read it; remove it")


def _pretrained_config(model: Any, name: str) -> FrozenDict | None:
    """Component `name`'s config.json in the folder it loads from (its own, or the pipeline's subfolder); None when
    it builds from the preset or loads from a single file or a run."""
    source = build.component_source(model, name)
    if source is None or (Path(source) / "meta.json").is_file():
        return None
    for candidate in (Path(source) / "config.json", Path(source) / name / "config.json"):
        if candidate.is_file():
            try:
                return FrozenDict(json.loads(candidate.read_text()))
            except (OSError, ValueError):
                return None  # the loader reports what is wrong with the file
    return None


class Task:
    """Base: subclasses set ``trainable`` (name -> module) and implement ``loss``."""

    needs_captions = False
    reads_encoded = False
    """Whether the loss can take pre-encoded samples (latents, text embeddings) instead of pixels."""
    text_embeddings = False
    """Whether batches carry text embeddings in place of the text encoders' output (see use_encoded)."""
    trainable: dict[str, nn.Module]
    tokenizer: Any = None
    caption_tokenizer: Any = None
    """What the loader tokenizes captions with (models.tokenizer.CaptionTokenizer), or None."""
    frozen_precision = "fp32"
    """``model.frozen_precision`` as this run applies it: the planner's choice for ``auto``, and on resume the
    run's first choice."""

    def __init__(self, config: RunConfig, device: torch.device, run_dir: Path, resumed: dict[str, Any] | None = None):
        """`resumed`: the meta.json of the checkpoint the run resumes from, whose sources and choices it keeps."""
        self.config = config
        self.device = device
        self.run_dir = run_dir
        self.pinned: dict[str, str] = dict((resumed or {}).get("sources", {}))
        self.resumed: dict[str, Any] = dict((resumed or {}).get("task", {}))
        self.family = families.for_model(config.model)
        self._check_resumed_expert()
        self.components = ComponentPlanner(config, self.family, self.pinned)

    @property
    def expert(self) -> str | None:
        """The expert this run trains, for a family of experts (``model.expert``, else the family's default)."""
        experts = self.family.experts
        return None if experts is None else self.config.model.expert or experts.default

    def _check_resumed_expert(self) -> None:
        # The checkpoints hold one expert's weights (or adapters): trained on as the other's, over the other's share
        # of the timesteps, they would become neither.
        started = self.resumed.get("expert")
        if started is not None and self.expert is not None and started != self.expert:
            raise UserError(f"model.expert: this run trains the {started} expert (its checkpoints hold it); resume "
                            f"with model.expert={started}, or train the {self.expert} one in a new run_dir")

    @property
    def sources(self) -> dict[str, str]:
        """Each loaded component's pinned source (ComponentPlanner.sources)."""
        return self.components.sources

    def parallel_modules(self) -> dict[str, nn.Module]:
        """The attributes the loss calls the trained modules through, for a data-parallel wrapper."""
        return dict(self.trainable)

    def backward_modules(self) -> dict[str, nn.Module]:
        """The modules gradients flow through: the trained ones, and frozen ones upstream of them."""
        return dict(self.trainable)

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.trainable.values() for p in m.parameters() if p.requires_grad]

    def loss(self, batch: dict[str, Any], generator: torch.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError

    @staticmethod
    def prepare(config: RunConfig, run_dir: Path) -> None:
        """One-off work before every rank builds the task, done once by the main rank."""

    def data_config(self) -> DataConfig:
        """The data settings the loader gets: the run's own, or a copy a mode derives from them (its
        caption templates, say); the run's config itself is never changed."""
        return self.config.data

    def make_data(self, batches: Callable[[DataConfig], Any]) -> Any:
        """The training batches, from `batches(data_config)`; a mode that reads two datasets combines two."""
        return batches(self.data_config())

    def use_encoded(self, encoding: dict[str, Any] | None) -> None:
        """Told what the pre-encoded shards hold (None: plain images)."""

    def extra_state(self) -> dict[str, Any]:
        return {}

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint's reader needs to rebuild partly trained modules on their base (meta.json)."""
        return {"mode": self.config.mode_name, "family": self.family.name,
                **({"expert": self.expert} if self.expert is not None else {}),
                **({"trust_pickle": True} if self.components.trust_pickle else {}),
                **({"frozen_precision": self.frozen_precision} if self.config.model.frozen_precision == "auto" else {})}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def before_save(self) -> None:
        """Called on every rank before a checkpoint is written."""

    def validates(self, batch: dict[str, Any] | None) -> bool:
        """Whether `validate` would render anything, so the trainer builds its modules only then."""
        return False

    @property
    def clip_step(self) -> int | None:
        """None for a model of still images; for one of clips (B, 3, T, H, W), a still image being a clip of one
        frame, the frame step of their lengths (1 + k times it): its VAE's codec says (`LatentCodec.clip_frames`)."""
        vae = getattr(self, "vae", None)
        return None if vae is None else self.family.codec.clip_frames(vae.config)

    def clip_reading(self) -> dict[str, Any]:
        """What the loader is told of the clips the model reads (`TrainBatches`' and `SampleDecoder`'s arguments)."""
        step = self.clip_step
        return {"clips": step is not None, "frame_step": step or 1}

    def encodes_images(self) -> bool:
        """Whether training reads images the samples carry beside their own (a ControlNet's maps, an edit's
        sources)."""
        return False

    def staged_on_host(self) -> bool:
        """Whether a trained module waits in host memory for the parallel wrapper to place it (FSDP moving each
        block's shard to the GPU): no step can run before the wrapping, nor the whole model on one device."""
        return False

    @torch.no_grad()
    def validate(self, modules: dict[str, nn.Module], out: Path | None, batch: dict[str, Any] | None) -> Path | None:
        """Draw the validation images from `modules` and write them at `out`; with `out` None draw them only (a rank
        helping the main one run a sharded model)."""
        return None

    def _check_resolution(self, vae: nn.Module) -> int:
        """The VAE's downsampling factor, which the training resolution must be a multiple of."""
        problems = shape_problems(self.config, self.family, vae.config)
        if problems:
            raise UserError(problems[0])
        return self.family.codec.downsampling(vae.config)


class Reconstruct(nn.Module):
    """Encode and decode in one forward, so a data-parallel wrapper sees the whole autoencoder step."""

    def __init__(self, vae: nn.Module, family: families.ModelFamily):
        super().__init__()
        self.vae = vae
        self.family = family

    def forward(self, pixels: torch.Tensor, sample_posterior: bool, generator: torch.Generator | None):
        posterior = self.family.codec.encode(self.vae, pixels)
        latents = posterior.sample(generator) if sample_posterior else posterior.mode()
        return self.family.codec.decode(self.vae, latents), posterior.mean, posterior.logvar


class AutoencoderTask(Task):
    """Reconstruction plus a small KL term, as in the latent diffusion paper's autoencoder (without the GAN)."""

    def __init__(self, config: RunConfig, device: torch.device, run_dir: Path, resumed: dict[str, Any] | None = None):
        super().__init__(config, device, run_dir, resumed)
        vae = self.components.load("vae") or build.build_vae(config.model)
        self._check_resolution(vae)
        vae.to(device).train()
        self.vae = vae
        self.trainable = {"vae": vae}
        self.reconstruct = Reconstruct(vae, self.family)
        # Running mean and second moment of each latent channel, for how the family normalises them.
        channels = self.family.codec.channels(vae.config)
        self.channel_moments = torch.zeros(2, channels, device=device)
        self.latent_batches = 0

    def parallel_modules(self) -> dict[str, nn.Module]:
        return {"reconstruct": self.reconstruct}

    def loss(self, batch, generator):
        pixels = batch["pixel_values"].to(self.device, non_blocking=True)
        cfg = self.config.autoencoder
        reconstruction, mean, logvar = self.reconstruct(pixels, cfg.sample_posterior, generator)
        rec = reconstruction.float()
        rec = sum(loss(rec, pixels.float()) for name, loss in (("l1", F.l1_loss), ("mse", F.mse_loss))
                  if name in cfg.reconstruction.split("+"))
        # The LDM recipe weights a per-sample KL sum against a per-sample pixel sum; dividing both by
        # the pixel count keeps that balance with a mean-reduced reconstruction loss.
        mean, logvar = mean.float(), logvar.float()
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).sum(dim=_sample_dims(mean)).mean() / pixels[0].numel()
        loss = rec + cfg.kl_weight * kl
        with torch.no_grad():
            axes = [0, *range(2, mean.dim())]
            moments = torch.stack([mean.mean(dim=axes), mean.pow(2).mean(dim=axes)])
            self.latent_batches += 1
            self.channel_moments += (moments - self.channel_moments) / min(self.latent_batches, 100)
        return loss, {"reconstruction": rec, "kl": kl}

    def before_save(self) -> None:
        # How the latents seen so far are normalised, recorded in the VAE as the family keeps it.
        if self.latent_batches:
            self.family.codec.fit_normalization(self.vae, *self.channel_moments.cpu())

    def extra_state(self):
        return {"channel_moments": self.channel_moments.tolist(), "latent_batches": self.latent_batches}

    def load_extra_state(self, state):
        if "channel_moments" in state:
            moments = torch.tensor(state["channel_moments"])
        else:  # an earlier release kept the overall second moment alone
            moments = torch.zeros_like(self.channel_moments).index_fill_(0, torch.tensor([1]),
                                                                           float(state["latent_moment"]))
        self.channel_moments = moments.to(self.device, torch.float32)
        self.latent_batches = int(state["latent_batches"])

    def validates(self, batch):
        return batch is not None

    @torch.no_grad()
    def validate(self, modules, out, batch):
        if batch is None:
            return None
        vae = modules["vae"]
        pixels = batch["pixel_values"][:8].to(self.device)
        reconstruction = self.family.codec.decode(vae, self.family.codec.encode(vae, pixels).mode())
        return save_grid(torch.cat([pixels, reconstruction]).clamp(-1, 1), out, rows=2)


class DataRecipe:
    """What a diffusion run trains on and how its samples' losses combine: the component a data mode supplies to
    the task, beside what trains (the whole model, adapters or new tokens, each a task of its own), so any of those
    combines with any recipe. The plain recipe reads ``data`` as the trained part asks for it and averages;
    DreamBooth's adds its class images for prior preservation (train/modes/dreambooth.py)."""

    def __init__(self, config: RunConfig, run_dir: Path):
        self.config = config
        self.run_dir = run_dir

    @staticmethod
    def prepare(config: RunConfig, run_dir: Path) -> None:
        """One-off work before every rank builds the task, done once by the main rank (after the task's own)."""

    def data_config(self, data: DataConfig) -> DataConfig:
        """The loader's settings, from those the trained part asks for (`data`)."""
        return data

    def make_data(self, data: DataConfig, batches: Callable[[DataConfig], Any]) -> Any:
        """The training batches, from `batches(config)` for each dataset the recipe reads."""
        return batches(data)

    def fixed_prompts(self) -> list[str]:
        """Every caption the batches carry, when they are a few known before training; empty when the captions
        are the data's own."""
        return []

    def loss(self, per_sample: torch.Tensor, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The step's loss from each sample's, and what else to log."""
        return per_sample.mean(), {}


class DiffusionTask(Task):
    """Denoising loss of a text-conditioned denoiser in the latent space of a frozen autoencoder; what the model
    is (its components, conditioning and denoiser call) comes from its family's spec, what trains in it from its
    trained part, what it trains on from its data recipe."""

    needs_captions = True
    reads_encoded = True
    encoding = autotune.Encoding()
    """How the frozen autoencoder encodes a step's images (`use_encoding`)."""

    def __init__(self, config: RunConfig, device: torch.device, run_dir: Path, resumed: dict[str, Any] | None, *,
                 part: TrainedPart, recipe: DataRecipe):
        """`part`: what trains (train.modes.make_part); `recipe`: what it trains on."""
        super().__init__(config, device, run_dir, resumed)
        self.part = part
        self.recipe = recipe
        model, family = config.model, self.family
        problems = capability_problems(config, family, [type(piece) for piece in self.part.pieces])
        if problems:  # every one, before any weight loads
            raise UserError("\n".join(problems))
        self.tokenizers = self._tokenizers()
        self.tokenizer = self.tokenizers[0]
        # What the pre-encoded shards stand in for is built without weights: T5-XXL alone is 19 GB in fp32.
        data = self.data_config()
        found = dataset_encoding(data.shards) if data.use_encoded else None
        unread = (self.components.stood_in_for(found[0], data, self.text_encoder_runs(), self.encodes_images())
                  if found else [])
        vae = self.components.load("vae", weights="vae" not in unread)
        if vae is None:
            raise UserError(
                "model.components.vae.source: the diffusion stage needs a trained autoencoder; set it to an "
                "autoencoder run or a diffusers folder, or model.pretrained to a pipeline"
            )
        self.vae = _placed(vae, device).eval().requires_grad_(False)
        scale = self._check_resolution(self.vae)
        latent = (family.codec.channels(self.vae.config), config.data.resolution // scale)
        self.storage = FrozenStorage(config, device, family, self.part.keeps_frozen, self.resumed)
        if self.storage.needs_plan:
            # Planned from the shapes alone, before any weight loads, since weights are stored low as they load.
            self.storage.plan(self.components.build(self.tokenizers, latent, self.stored_as, unread, weights=False),
                              unread)
        # The denoiser under the family's name (unet, transformer): the trainer wraps and checkpoints modules by name.
        for name, module in self.components.build(self.tokenizers, latent, self.stored_as, unread).items():
            self.storage.offload(module)  # before placing: streamed weights never all reach the device
            setattr(self, name, module if self.storage.stages(name) else _placed(module, device))
        denoiser = self.denoiser
        problems = shape_problems(config, family, self.vae.config, denoiser.config,
                                  self.components.source(family.components.denoiser) or "the denoiser")
        if problems:
            raise UserError("\n".join(problems))
        # Read before the trainer wraps the denoiser (DDP, FSDP), whose wrapper has no config.
        self.takes_guidance = family.denoising.takes_guidance(denoiser.config)
        if config.diffusion.flow.guidance_range and not self.takes_guidance:  # a denoiser from a file or a run
            raise UserError(GUIDANCE_RANGE_UNREAD)
        # The run's model samples as its base does: a step-distilled one in its few steps without guidance.
        self.distilled = is_distilled(family, self.components.source(family.components.denoiser))
        self.noise_scheduler = build.build_noise_scheduler(config.diffusion, model)
        self.objective = make_objective(family, config.diffusion, self.noise_scheduler, device, denoiser.config,
                                        sampling_steps(family, denoiser.config, run_sampling(config, self.distilled)),
                                        expert_share(model, family, self.components.source(family.components.denoiser)))
        self.caption_tokenizer = CaptionTokenizer(self.tokenizers, family)
        if family.instruct is not None and denoiser.config.in_channels > latent[0] and not self.part.gives_source:
            # An InstructPix2Pix (or inpainting) UNet: fed the latents alone, its first step is a shape traceback.
            raise UserError(f"mode {config.mode_name}: this {family.components.denoiser} reads "
                            f"{denoiser.config.in_channels} "
                            f"input channels, more than the {latent[0]} of its latents: it edits, reading an image "
                            "beside them; fine-tune an InstructPix2Pix model with mode instruct_pix2pix "
                            "(configs/instruct-pix2pix.yaml; adapters on it: mode [instruct_pix2pix, lora]), or start "
                            "from a text-to-image one")
        self.trainable = self.part.make_trainable(self.denoiser, self.text_encoders, self.tokenizers,
                                                  latent_factor=scale)
        for name, module in self.trainable.items():  # a module of the part's own (a ControlNet), called by name
            if not hasattr(self, name):
                setattr(self, name, module)
        self.storage.store([self.denoiser, *self.text_encoders.values()])

    def staged_on_host(self) -> bool:
        return self.storage.stages(self.family.components.denoiser)

    @property
    def frozen_precision(self) -> str:
        return self.storage.precision

    def stored_as(self, name: str) -> str:
        """How component `name`'s linear weights are stored as it loads (see FrozenStorage.stored_as)."""
        return self.storage.stored_as(name)

    takes_guidance = False
    """Whether the denoiser has a guidance embedding (Flux.1-dev's), read in setup before any wrapper hides its
    config."""

    @property
    def denoiser(self) -> nn.Module:
        """The family's denoiser (its UNet or transformer), as the loss calls it (wrapped when it trains)."""
        return getattr(self, self.family.components.denoiser)

    @property
    def long_text_length(self) -> int | None:
        """The long-context encoder's tokens per caption (T5's, a language model's), None for families without one."""
        lengths = [tokenizer.model_max_length
                   for folder, tokenizer in zip(self.family.components.tokenizers, self.tokenizers)
                   if folder in self.family.components.long_text_tokenizers]
        return lengths[0] if lengths else None

    @property
    def text_encoders(self) -> dict[str, nn.Module]:
        """The family's text encoders, by component name, as the loss calls them (wrapped when they train)."""
        return {name: getattr(self, name) for name in self.family.components.text_encoders}

    def _tokenizers(self) -> list[Any]:
        return build.load_text_tokenizers(self.config.model, self.run_dir, self.pinned.get("text_encoder"))

    @staticmethod
    def prepare(config: RunConfig, run_dir: Path) -> None:
        """Train the run's tokenizer on the captions when no tokenizer is given (main rank only)."""
        model = config.model
        saved = run_dir / "tokenizer"
        if build.tokenizer_source(model) or (saved / "tokenizer_config.json").is_file():
            return
        from sdtrain.data.pipeline import read_captions

        if config.data.class_prompts:
            from sdtrain.data.decode import load_class_prompts

            captions = [p for ps in load_class_prompts(config.data.class_prompts).values() for p in ps]
        else:
            captions = read_captions(config.data.shards, config.data.caption_key)
        log.info("training a %d-token BPE tokenizer on %d captions", model.tokenizer_vocab_size, len(captions))
        families.for_model(model).conditioner.train_tokenizer(captions, saved, model.tokenizer_vocab_size,
                                                              build.text_length(model))

    def encode_text(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The batch's text conditioning from its token ids, through the family's conditioner."""
        encoders = []
        for name in self.family.components.text_encoders:
            if next(getattr(self, name).parameters()).is_meta:
                log.warning("a batch without text embeddings: loading the released %s back", name)
                setattr(self, name, self.frozen(name))
            encoders.append(getattr(self, name))
        ids, masks = self.family.token_inputs(batch, self.device)
        if not text_reads_sources(self.config, self.family):
            return self.family.conditioner.encode_text(encoders, ids, batch.get("captions"), masks)
        return self.family.conditioner.encode_text(encoders, ids, batch.get("captions"), masks,
                                                   sources=sources_of(batch))

    def use_encoded(self, encoding: dict[str, Any] | None) -> None:
        """Check pre-encoded shards against this task's frozen weights; text embeddings are used only
        when the text encoder is frozen and is the one that produced them."""
        unread = []
        if encoding is not None:
            if encoding["vae"] != self.sources.get("vae"):
                raise UserError(
                    f"data.shards: the latents were encoded with the VAE {encoding['vae']} but "
                    f"model.components.vae.source is {self.sources.get('vae')}; point it there, encode again, or set "
                    "data.use_encoded=false"
                )
            unread = self.components.stood_in_for(encoding, self.data_config(), self.text_encoder_runs(),
                                                  self.encodes_images())
        self.text_embeddings = any(name in unread for name in self.family.components.text_encoders)
        encoded_t5 = (encoding or {}).get("t5_text_length")
        if self.text_embeddings and encoded_t5 and encoded_t5 != self.long_text_length:
            raise UserError(
                f"data.shards: the long-context text encoder's states were encoded at {encoded_t5} tokens per "
                f"caption but this run reads {self.long_text_length}; set model.t5_text_length={encoded_t5}, or "
                f"encode again with `prepare encode --t5-text-length {self.long_text_length}`")
        if encoding is not None:
            skipped = [*([] if self.encodes_images() else ["VAE encoder skipped"]),
                       *(["text encoder skipped"] if self.text_embeddings else [])]
            log.info("pre-encoded shards: %s", ", ".join(skipped) or "latents read")
        prompts = self.fixed_prompts()
        if prompts and not self.text_embeddings and not self.text_encoder_runs():
            self.prompt_embeddings = self._encode_prompts(prompts)
            self.text_embeddings = True
            unread = [*unread, *self.family.components.text_encoders]
            log.info("%d fixed prompt(s) encoded once: the text encoders stay unloaded until validation", len(prompts))
        self._hold_read(unread)

    prompt_embeddings: dict[str, dict[str, torch.Tensor]] = {}
    """The text conditioning of each of `fixed_prompts`, computed once at start."""

    def fixed_prompts(self) -> list[str]:
        """Every caption the batches carry, when the recipe knows them before training (DreamBooth's prompts):
        with frozen text encoders, each is encoded once and the encoders are released, as the scripts users
        compare with do. Empty when the captions are the data's own."""
        return self.recipe.fixed_prompts()

    def data_config(self) -> DataConfig:
        return self.recipe.data_config(self.part.data_config(super().data_config()))

    def make_data(self, batches: Callable[[DataConfig], Any]) -> Any:
        return self.recipe.make_data(self.data_config(), batches)

    @torch.no_grad()
    def _encode_prompts(self, prompts: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        # One at a time, in fp32 even when steps run under bf16 autocast: a prompt is encoded once, so its most
        # exact conditioning costs nothing per step.
        encoded = {}
        for prompt in dict.fromkeys(prompts):
            ids = self.caption_tokenizer([prompt])
            text = self.encode_text({**ids, "captions": [prompt]})
            encoded[prompt] = {key: value.detach() for key, value in text.items()}
        return encoded

    def _hold_read(self, unread: list[str]) -> None:
        """Only what training reads keeps its weights. The `unread` components (built without weights when the
        shards' manifest said so before loading) serve validation only, which loads them again from their pinned
        sources: moved to the meta device, keeping module and config, they free SD2's 1.7 GB wherever they were
        read into memory (from a run's checkpoint, say). The other frozen ones are loaded if they were skipped."""
        for name in ("vae", *self.family.components.text_encoders):
            if name in self.trainable:
                continue
            if name in unread:
                getattr(self, name).to("meta")
            elif on_meta(getattr(self, name)):
                setattr(self, name, self.frozen(name))

    def frozen(self, name: str) -> nn.Module:
        """A frozen component with its weights, loaded again from its source if they were released."""
        module = getattr(self, name)
        if not on_meta(module):
            return module
        # Stored as training stores it: validation then costs no more memory than the step.
        module = self.components.load(name, self.stored_as(name))
        return module.to(self.device).eval().requires_grad_(False)

    def _latents(self, batch, generator) -> torch.Tensor:
        sample = self.config.diffusion.sample_latents
        if "latent_mean" in batch:
            latents = batch["latent_mean"].to(self.device, non_blocking=True)
            if sample:
                std = batch["latent_std"].to(self.device, non_blocking=True)
                latents = latents + std * torch.randn(latents.shape, generator=generator, device=self.device)
        else:
            pixels = batch["pixel_values"].to(self.device, non_blocking=True)
            posterior = self.encoding.encode(self.family.codec, self.vae, pixels)
            if isinstance(posterior, DiagonalGaussianDistribution) and posterior.parameters.dtype != torch.float32:
                # Drawn from in fp32 whatever the encode's precision: the noise of a bf16 draw is quantised.
                posterior = DiagonalGaussianDistribution(posterior.parameters.float())
            latents = posterior.sample(generator) if sample else posterior.mode()
        return self.family.codec.normalize(latents, self.vae)

    def use_encoding(self, way: str) -> None:
        """Encode each step's images `way` (``train.encode``, as autotune decided it)."""
        self.encoding = autotune.Encoding(way)
        self.encoding.place(self.vae)

    def loss(self, batch, generator):
        return self.recipe.loss(self.denoising_loss(batch, generator), batch)

    def denoising_loss(self, batch, generator) -> torch.Tensor:
        """The per-sample loss of the denoiser's prediction against the objective's target, weighted by it."""
        # Latents, noise and their mix stay in fp32 under bf16 autocast: in bf16 the noise coefficient
        # of the lowest timesteps rounds to zero and the target is quantised.
        with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
            latents = self._latents(batch, generator)
            noisy, timesteps, target = self.objective.draw(latents, generator)
            # What the family conditions on of the clean latents (a first frame), and what then leaves the loss.
            noisy, given, weights = self.family.denoising.conditioned(latents, noisy, generator)
        condition, extra = self.denoiser_inputs(batch, noisy, timesteps, generator)
        mask = latent_mask(batch, latents)
        if weights is not None:
            mask = weights if mask is None else mask * weights
        return self.denoising_loss_at(noisy, timesteps, target, {**condition, **given}, mask, extra)

    def denoiser_inputs(self, batch: dict[str, Any], noisy: torch.Tensor, timesteps: torch.Tensor,
                        generator: torch.Generator | None = None) -> tuple[dict[str, Any], torch.Tensor | None]:
        """What the denoiser's call on `noisy` at `timesteps` is given beside them: its conditioning with what the
        trained part adds to it (a ControlNet's residuals, an edit's reference latents), and latents it reads on
        extra input channels (InstructPix2Pix's source's), or None."""
        condition = self.conditioning(batch, generator)
        trained = {name: getattr(self, name) for name in self.trainable}
        condition = {**condition, **self.part.controls(trained, batch, noisy, timesteps, condition, self.vae)}
        return condition, self.part.denoiser_extra(batch, self.vae, generator)

    def denoising_loss_at(self, noisy: torch.Tensor, timesteps: torch.Tensor, target: torch.Tensor,
                          condition: dict[str, Any], mask: torch.Tensor | None = None,
                          extra: torch.Tensor | None = None) -> torch.Tensor:
        """The weighted per-sample loss of the denoiser's prediction at given noisy latents and timesteps; with a
        `mask` (Bx1xhxw on the latents' grid), the mean of the squared error over what the mask counts; `extra`:
        latents the denoiser reads beside the noisy ones (the trained part's `denoiser_extra`)."""
        given = noisy if extra is None else torch.cat([noisy, extra.to(noisy.dtype)], dim=1)
        output = self.family.denoising.denoise(self.denoiser, given, timesteps, condition)
        prediction = self.objective.prediction(output.float(), noisy, timesteps)
        error = F.mse_loss(prediction, target.float(), reduction="none")
        dims = _sample_dims(error)
        if mask is None:
            loss = error.mean(dim=dims)
        else:
            # A sample whose mask counts nothing adds no loss (rather than dividing by zero). A clip's mask spans
            # its frames: each latent frame counts where it does.
            counted = mask.expand(*mask.shape[:2], *error.shape[2:]).sum(dim=dims) * error.shape[1]
            loss = (error * mask).sum(dim=dims) / counted.clamp_min(1e-6)
        return self.objective.weight(loss, timesteps)

    def conditioning(self, batch, generator: torch.Generator | None = None) -> dict[str, Any]:
        """The denoiser's conditioning: the shards' text embeddings when they can stand in for the frozen text
        encoders, else the encoders' output, with what else the family conditions on (and Flux.1-dev's
        guidance, drawn from `generator` when ``diffusion.flow.guidance_range`` is set)."""
        captions = batch.get("captions") or []
        if self.text_embeddings and "text_emb" in batch:
            text = {key: batch[key].to(self.device, non_blocking=True) for key in TEXT_FIELDS if key in batch}
        elif self.prompt_embeddings and captions and all(c in self.prompt_embeddings for c in captions):
            text = {key: torch.cat([self.prompt_embeddings[c][key] for c in captions])
                    for key in self.prompt_embeddings[captions[0]]}
        else:
            with torch.set_grad_enabled(self.text_encoder_trains()):
                text = self.encode_text(batch)
        condition = self.family.denoising.condition(text, batch, self.device)
        if self.takes_guidance:
            condition["guidance"] = self.guidance(len(text["text_emb"]), generator)
        return condition

    def encodes_images(self) -> bool:
        """Whether training runs the VAE's encoder on images the samples carry beside their own (see
        `TrainedPart.encodes_images`)."""
        return self.part.encodes_images()

    def text_encoder_runs(self) -> bool:
        """Whether training runs the text encoders whatever the data holds: one trains, or they read the sources."""
        return self.text_encoder_trains() or text_reads_sources(self.config, self.family)

    def guidance(self, count: int, generator: torch.Generator | None) -> torch.Tensor:
        """The guidance values a guidance-distilled denoiser is trained with: ``diffusion.flow.guidance``, or draws
        from ``diffusion.flow.guidance_range``."""
        cfg = self.config.diffusion.flow
        if cfg.guidance_range and generator is not None:
            low, high = cfg.guidance_range
            return low + (high - low) * torch.rand(count, generator=generator, device=self.device)
        return torch.full((count,), cfg.guidance, device=self.device)

    def text_encoder_trains(self) -> bool:
        return self.part.text_encoder_trains()

    def backward_modules(self) -> dict[str, nn.Module]:
        if not self.part.through_frozen_denoiser:
            return super().backward_modules()
        return {self.family.components.denoiser: self.denoiser, **self.trainable}

    def checkpoint_meta(self) -> dict[str, Any]:
        return {**super().checkpoint_meta(), **self.part.checkpoint_meta()}

    _told_stored_low = False

    def validates(self, batch):
        return bool(self.config.validation.prompts)

    clip_length: int | None = None
    """The frames of the run's clips, as validation last saw them (None: a family of still images)."""

    def validate(self, modules, out, batch):
        prompts = self.config.validation.prompts
        if not prompts:
            return None
        self.clip_length = self.frames_of(batch) or self.clip_length
        inputs = self.part.sampling_inputs(batch, len(prompts))
        return self.render(modules, out, self.part.validation_prompts(prompts), prompts, inputs)

    def frames_of(self, batch: dict[str, Any] | None) -> int | None:
        """The frames of a batch's clips (its pixels', or those its latents encode); None for images or no batch."""
        step = self.clip_step
        if step is None or batch is None:
            return None
        if "pixel_values" in batch:
            return batch["pixel_values"].shape[2]
        return (batch["latent_mean"].shape[2] - 1) * step + 1 if "latent_mean" in batch else None

    def pipeline(self, modules: dict[str, nn.Module]) -> Any:
        """A pipeline of the given trained modules and this task's frozen ones."""
        components = {name: modules[name] if name in modules else self.frozen(name)
                      for name in ("vae", *self.family.components.text_encoders)}
        denoiser = self.family.components.denoiser
        components[denoiser] = modules.get(denoiser, self.denoiser)
        # A model of experts samples with the others too, loaded for this pipeline alone (training never holds them).
        components, boundary = place_experts(
            self.family, self.config.model, components, self.components.source(denoiser),
            lambda source: load_component(denoiser, source, trust_pickle=self.components.trust_pickle,
                                          family=self.family, frozen_precision=self.stored_as(denoiser),
                                          served=self.config.model).to(self.device).eval().requires_grad_(False))
        pipe = self.family.sampling.assemble(components, self.tokenizers, sampler_from(self.noise_scheduler, "euler"),
                                    distilled=self.distilled)
        if boundary is not None:
            pipe.register_to_config(**{self.family.experts.boundary_key: boundary})
        return self.part.pipeline(pipe, modules)

    @torch.no_grad()
    def render(self, modules: dict[str, nn.Module], out: Path | None, prompts: list[str],
               labels: list[str], inputs: dict[str, list[Any]] | None = None) -> Path | None:
        """A grid of the prompts' images from the given trained modules and this task's frozen ones at `out`
        (RUN/samples/step_N.png), and each image beside it (step_N/000-<label>.png). They are what `sdtrain
        generate` draws from the run or its export with the validation settings (its defaults there) and the
        labels as prompts: the same pipeline, sampler, seeds and size, in fp32 as a fresh process samples. `inputs`:
        what each prompt is sampled with beside it (a ControlNet's maps, an edit's sources, which it edits at their
        own size), by pipeline argument."""
        pipe = self.pipeline(modules)
        val = self.config.validation
        stored_low = sorted(name for name in ("vae", *self.family.components.text_encoders,
                                              self.family.components.denoiser)
                            if self.stored_as(name) != "fp32")
        if stored_low and not self._told_stored_low:
            self._told_stored_low = True
            log.info("validation samples with the frozen %s stored in %s (model.frozen_precision), its export in "
                     "fp32: their images can differ slightly", ", ".join(stored_low), self.frozen_precision)
        settings = run_sampling(self.config, self.distilled)
        with exact_sampling():
            images = sample_images(pipe, prompts, seed=val.seed, steps=settings["steps"],
                                   guidance=settings["guidance"], size=settings["size"],
                                   default_steps=settings["default_steps"], inputs=inputs, edits_at_own_size=True,
                                   distilled=self.distilled, frames=settings["frames"] or self.clip_length)
        if out is None:
            return None
        save_images(images, labels, out.with_suffix(""))
        return save_grid(images, out, rows=max(1, len(prompts) // 4), labels=labels)


TASKS: dict[str, type[Task]] = {"autoencoder": AutoencoderTask, "diffusion": DiffusionTask}


def text_reads_sources(config: RunConfig, family: families.ModelFamily) -> bool:
    """Whether a run's text conditioning reads each edit's source as well (``edit.reference`` on a family whose
    `ReferenceSpec.text_reads_source`)."""
    return config.edit.reference and family.text_reads_source


def sources_of(batch: dict[str, Any]) -> torch.Tensor:
    """The batch's source images (``edit.reference``), in [-1, 1]."""
    pixels = batch.get("source_pixels")
    if pixels is None:
        raise UserError("edit.reference: the data has no source images: put KEY.src.png (the image before the "
                        "edit) beside each edited image, its caption the instruction (`prepare encode` keeps them)")
    given = batch.get(present("source_pixels"))
    if given is not None and not given.all():
        # The loader's zeros would be a grey image to edit, not the absence of one.
        missing = [key for key, has in zip(batch["keys"], given.tolist(), strict=True) if not has]
        raise UserError(f"edit.reference: no source image (KEY.src.png beside the edited image) for "
                        f"{', '.join(missing)}, and an edit by reference learns from none: add theirs, or leave "
                        "those samples out of the shards")
    return pixels


def latent_mask(batch: dict[str, Any], latents: torch.Tensor) -> torch.Tensor | None:
    """The batch's loss masks (data.alpha_mask, ``mask.png``) averaged down to the `latents`' grid, or None: (B, 1,
    h, w) for images; for clips (B, 1, t, h, w), a mask of every frame or one mask for all (B, 1, 1, h, w)."""
    mask = batch.get("mask")
    if mask is None:
        return None
    mask = mask.to(latents.device, torch.float32, non_blocking=True)
    if latents.dim() == 5:
        if mask.dim() == 4:
            mask = mask.unsqueeze(2)  # one mask for every frame
        size = (mask.shape[2] if mask.shape[2] == 1 else latents.shape[2], *latents.shape[-2:])
        return mask if mask.shape[2:] == size else F.interpolate(mask, size=size, mode="area")
    return mask if mask.shape[-2:] == latents.shape[-2:] else F.interpolate(mask, size=latents.shape[-2:], mode="area")


def _sample_dims(values: torch.Tensor) -> tuple[int, ...]:
    """Every dimension of `values` but the batch's: (C, H, W) of images, (C, T, H, W) of clips."""
    return tuple(range(1, values.dim()))


def _placed(module: nn.Module, device: torch.device) -> nn.Module:
    """`module` on `device`, unless it has no weights to move (see `load_component`'s `weights`)."""
    return module if on_meta(module) else module.to(device)
