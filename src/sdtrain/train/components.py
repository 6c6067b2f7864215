"""Where a run's components come from and which of them load: each component's source (pinned at the run's first
start, so a resume reads the same weights), which frozen ones pre-encoded shards stand in for (training never runs
them, so they are built without weights), and the text encoders and denoiser built from their sources or from the
preset. A component of the training tasks; how the loaded weights are stored (precision, offload) is
train/storage.py's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sdtrain.config import DataConfig, RunConfig
from sdtrain.errors import UserError
from sdtrain.loaders.components import load_component
from sdtrain.models import build
from sdtrain.models.families.spec import ModelFamily


class ComponentPlanner:
    """The run's components. `pinned`: the sources a resumed run's checkpoint recorded, which it keeps."""

    def __init__(self, config: RunConfig, family: ModelFamily, pinned: dict[str, str]):
        self.config = config
        self.family = family
        self.pinned = pinned
        self.sources: dict[str, str] = {}
        """Each loaded component's source as the run pinned it: what checkpoints record and encoded shards are
        checked against."""
        self.trust_pickle = build.trusts_pickle(config.model)

    def source(self, name: str) -> str | None:
        """Component `name`'s source, pinned at the run's first start; None when the config names none."""
        if name not in self.sources:
            source = self.pinned.get(name) or build.component_source(self.config.model, name)
            if source is None:
                return None
            self.sources[name] = build.pin_source(source)
        return self.sources[name]

    def load(self, name: str, frozen_precision: str = "fp32", weights: bool = True) -> Any | None:
        """Component `name` from its source (`source`); None when the config names no source.
        `frozen_precision`, `weights`: see load_component."""
        source = self.source(name)
        if source is None:
            return None
        return load_component(name, source, trust_pickle=self.trust_pickle, family=self.family,
                              frozen_precision=frozen_precision, weights=weights, served=self.config.model)

    def stood_in_for(self, encoding: dict[str, Any], data: DataConfig, text_runs: bool,
                     encodes_images: bool = False) -> list[str]:
        """The frozen components that reading shards of this `encoding` never runs: the VAE that encoded their
        latents (none when it is not this run's VAE: such shards are refused, nor when the run `encodes_images`
        beside them: a ControlNet's maps, an edit's sources), and the text encoders when the shards' embeddings can
        stand in for them (these encoders made them, training does not run them anyway (`text_runs`: one trains,
        or they read each edit's source), and the captions are the shards' own, which prompt templates would
        replace and tag shuffling would reorder)."""
        if encoding.get("vae") != self.source("vae"):
            return []
        text = list(self.family.components.text_encoders)
        embeddings = (not text_runs and not data.prompt_templates and not data.shuffle_tags
                      and all(encoding.get(name) == self.source(name) for name in text))
        vae = [] if self.family.codec.reads_vae_weights or encodes_images else ["vae"]
        return [*vae, *(text if embeddings else [])]

    def build(self, tokenizers: list[Any], latent: tuple[int, int], stored_as: Callable[[str], str],
              unread: list[str], weights: bool = True) -> dict[str, nn.Module]:
        """The text encoders and the denoiser, from their sources or built from the preset (the denoiser shaped by
        the `latent` channels and size, the text encoders by the `tokenizers`), frozen ones stored as `stored_as`
        says; the `unread` ones, or all without `weights`, with their tensors on the meta device."""
        model = self.config.model
        built: dict[str, nn.Module] = {}
        meta = contextlib.nullcontext() if weights else torch.device("meta")
        for name, tokenizer in zip(self.family.components.text_encoders, tokenizers):
            module = self.load(name, stored_as(name), weights=weights and name not in unread)
            if module is None:
                if not self.config.diffusion.train_text_encoder:
                    raise UserError(
                        "diffusion.train_text_encoder: a text encoder built from scratch must be trained; set it to "
                        f"true, or load one with model.components.{name}.source or model.pretrained"
                    )
                with meta:
                    module = build.build_text_encoder(model, tokenizer, name)
            built[name] = module
        name = self.family.components.denoiser
        module = self.load(name, stored_as(name), weights=weights)
        if module is None:
            with meta:
                module = build.build_denoiser(model, *latent, text_encoders=built,
                                              frozen_precision=stored_as(name) if weights else "fp32")
        return {**built, name: module}
