"""What a diffusion run trains: a component the diffusion task is given, beside its data recipe, so that any trained
part (the whole model here; LoRA adapters and textual inversion's new tokens in train/modes/) takes any recipe
(plain data, DreamBooth's) without a class per pair. A part says which weights stay frozen (so the storage planner
can keep them low), makes its modules trainable, and adds what a checkpoint's reader needs to rebuild them; the
files each part exports are written in the loaders layer (loaders/writers.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sdtrain.config import DataConfig, RunConfig
from sdtrain.models import families
from sdtrain.models.families.spec import ModelFamily

IMAGE_TO_IMAGE = "image-to-image"
"""The Hub's task of a model that edits the image it is given (`TrainedPart.hub_task`)."""


@dataclass(frozen=True)
class CardExample:
    """How a model card's code samples with what a part trained: the pipeline it loads, and the image it gives it."""

    pipeline_class: type
    """The diffusers pipeline the code loads the base (or the exported pipeline) with."""
    image_argument: str = "image"
    """The pipeline call's argument for the image."""
    image_file: str = "before.png"
    """What the code calls the image it loads."""
    module: tuple[type, str] | None = None
    """A model of the part's own (its class, and the export's folder of it, also the pipeline's argument for it),
    loaded beside the base: a ControlNet; None: the base's components or the exported pipeline hold it all."""


class TrainedPart:
    """The whole denoiser, and with ``diffusion.train_text_encoder`` the text encoders too (full fine-tuning,
    DreamBooth without adapters, training from scratch)."""

    through_frozen_denoiser = False
    """Whether gradients flow back through the frozen denoiser to trained modules upstream of it (new token
    vectors in the text encoders), which makes the denoiser part of the backward pass."""

    host: tuple[str, str, str] | None = None
    """What a family must host for this part: its spec attribute (``controlnet``, ``instruct``, ``reference``), the
    config key a family without one is told of, and what such a family cannot do (`families.unhosted`); None: every
    family can train it."""

    gives_source = False
    """Whether the denoiser's call is given a source image's latents beside the noisy ones (`denoiser_extra`,
    InstructPix2Pix's), which a released editing denoiser reads: without them only one that reads the latents alone
    trains."""

    hub_task: str | None = None
    """The Hub's task of what the part makes of the family's model, a model card's ``pipeline_tag``: an editor's
    `IMAGE_TO_IMAGE`; None: the family's own (text-to-image, or text-to-video)."""

    def __init__(self, config: RunConfig, family: ModelFamily):
        self.config = config
        self.family = family

    @property
    def pieces(self) -> list[TrainedPart]:
        """The parts this one is made of: itself alone (`Together`'s, its parts)."""
        return [self]

    @classmethod
    def problems(cls, config: RunConfig, family: ModelFamily) -> list[str]:
        """What of `config` this part cannot take on `family`, one line each, read from the config and the family's
        spec alone, before any weight loads (`sdtrain train --check` and the start of every run report them): by
        default, a family that does not host it."""
        line = families.unhosted(family, *cls.host) if cls.host else None
        return [line] if line else []

    @property
    def spec(self) -> Any:
        """The family's spec of the mode this part trains (`host`); a family without one is one line."""
        assert self.host is not None, f"{type(self).__name__} needs no family spec"
        return families.mode_spec(self.family, *self.host)

    def keeps_frozen(self, name: str) -> bool:
        """Whether this part trains none of component `name`'s linear weights (their storage may then be low)."""
        return name in self.family.components.text_encoders and not self.config.diffusion.train_text_encoder

    def text_encoder_trains(self) -> bool:
        """Whether any text encoder weight trains, so the text conditioning cannot be computed once ahead."""
        return self.config.diffusion.train_text_encoder

    def make_trainable(self, denoiser: nn.Module, text_encoders: dict[str, nn.Module],
                       tokenizers: list[Any], latent_factor: int = 8) -> dict[str, nn.Module]:
        """Set what trains in the given modules, freeze the rest; the trained ones by component name.
        `latent_factor`: how many image pixels a latent pixel stands for, a side (what a module of the part's own
        that reads images, a ControlNet's, is sized by)."""
        denoiser.train()
        if not self.config.diffusion.train_text_encoder:
            for text_encoder in text_encoders.values():
                text_encoder.eval().requires_grad_(False)
            return {self.family.components.denoiser: denoiser}
        for text_encoder in text_encoders.values():
            text_encoder.train()
        return {self.family.components.denoiser: denoiser, **text_encoders}

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint's reader needs to rebuild partly trained modules on their base (meta.json's task)."""
        return {}

    def data_config(self, data: DataConfig) -> DataConfig:
        """The loader's settings, from the run's (`data`): a part whose captions must name what it learns
        supplies its own templates."""
        return data

    def validation_prompts(self, prompts: list[str]) -> list[str]:
        """The prompts validation samples for the configured `prompts` (labelled by those)."""
        return prompts

    def controls(self, trained: dict[str, nn.Module], batch: dict[str, Any], noisy: torch.Tensor,
                 timesteps: torch.Tensor, condition: dict[str, Any], vae: nn.Module) -> dict[str, Any]:
        """What the denoiser's call is given beside its `condition`, computed by the `trained` modules (as the loss
        calls them: under their parallel wrappers) from the `batch`, with the frozen `vae` where they read latents
        (a ControlNet's residuals); nothing here."""
        return {}

    def denoiser_extra(self, batch: dict[str, Any], vae: nn.Module, generator: torch.Generator | None
                       ) -> torch.Tensor | None:
        """Latents the denoiser reads beside the noisy ones, on extra input channels (InstructPix2Pix's source
        image's), from the `batch` with the frozen `vae`; drawn from `generator` where random. None here."""
        return None

    def encodes_images(self) -> bool:
        """Whether the part runs the frozen VAE's encoder on images a sample carries beside its own (a ControlNet's
        maps, an edit's sources): pre-encoded shards then leave the VAE loaded. Not here."""
        return False

    def pipeline(self, pipe: Any, modules: dict[str, nn.Module]) -> Any:
        """The pipeline that samples from the family's `pipe` with the trained `modules` (a ControlNet's own)."""
        return pipe

    def sampling_inputs(self, batch: dict[str, Any] | None, count: int) -> dict[str, list[Any]]:
        """What each of `count` validation prompts is sampled with beside it, by pipeline argument (a ControlNet's
        maps, from the last `batch`); nothing here."""
        return {}

    def card_example(self) -> CardExample | None:
        """How a model card's code samples with what this part trained; None: the family's own pipeline, from text
        alone."""
        return None


class Together(TrainedPart):
    """Several trained parts in one run (``mode: [controlnet, lora]``): each hook asks every part, in the order of the
    run's modes (adapters last, on what the others made), and combines their answers."""

    def __init__(self, config: RunConfig, family: ModelFamily, parts: list[TrainedPart]):
        super().__init__(config, family)
        self.parts = parts
        self.through_frozen_denoiser = any(part.through_frozen_denoiser for part in parts)
        self.gives_source = any(part.gives_source for part in parts)
        self.hub_task = next((part.hub_task for part in parts if part.hub_task), None)

    @property
    def pieces(self) -> list[TrainedPart]:
        return self.parts

    def keeps_frozen(self, name: str) -> bool:
        return all(part.keeps_frozen(name) for part in self.parts)

    def text_encoder_trains(self) -> bool:
        return any(part.text_encoder_trains() for part in self.parts)

    def make_trainable(self, denoiser: nn.Module, text_encoders: dict[str, nn.Module],
                       tokenizers: list[Any], latent_factor: int = 8) -> dict[str, nn.Module]:
        trainable: dict[str, nn.Module] = {}
        for part in self.parts:
            trainable.update(part.make_trainable(denoiser, text_encoders, tokenizers, latent_factor))
        return trainable

    def checkpoint_meta(self) -> dict[str, Any]:
        return {key: value for part in self.parts for key, value in part.checkpoint_meta().items()}

    def data_config(self, data: DataConfig) -> DataConfig:
        for part in self.parts:
            data = part.data_config(data)
        return data

    def validation_prompts(self, prompts: list[str]) -> list[str]:
        for part in self.parts:
            prompts = part.validation_prompts(prompts)
        return prompts

    def controls(self, trained: dict[str, nn.Module], batch: dict[str, Any], noisy: torch.Tensor,
                 timesteps: torch.Tensor, condition: dict[str, Any], vae: nn.Module) -> dict[str, Any]:
        return {key: value for part in self.parts
                for key, value in part.controls(trained, batch, noisy, timesteps, condition, vae).items()}

    def denoiser_extra(self, batch: dict[str, Any], vae: nn.Module, generator: torch.Generator | None
                       ) -> torch.Tensor | None:
        return next((extra for part in self.parts
                     if (extra := part.denoiser_extra(batch, vae, generator)) is not None), None)

    def encodes_images(self) -> bool:
        return any(part.encodes_images() for part in self.parts)

    def pipeline(self, pipe: Any, modules: dict[str, nn.Module]) -> Any:
        for part in self.parts:
            pipe = part.pipeline(pipe, modules)
        return pipe

    def sampling_inputs(self, batch: dict[str, Any] | None, count: int) -> dict[str, list[Any]]:
        return {key: value for part in self.parts for key, value in part.sampling_inputs(batch, count).items()}

    def card_example(self) -> CardExample | None:
        return next((example for part in self.parts if (example := part.card_example()) is not None), None)
