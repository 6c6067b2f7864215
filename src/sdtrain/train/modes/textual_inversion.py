"""Textual inversion (Gal et al., 2022): learn the embedding vectors of a new token from a few images,
everything else frozen; the result is a small file any Stable Diffusion pipeline of the same text encoder
loads with ``load_textual_inversion``."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from sdtrain.config import DataConfig, RunConfig, TextualInversionConfig
from sdtrain.errors import UserError
from sdtrain.loaders.adapters import add_token_rows
from sdtrain.models.families.clip import pool_at_eos
from sdtrain.models.families.spec import ModelFamily
from sdtrain.train.parts import TrainedPart

# Caption templates: the concept in the varied contexts a few photos of it could be described in.
OBJECT_TEMPLATES = [
    "a photo of a {}", "a close-up photo of a {}", "a cropped photo of the {}", "a bright photo of a {}",
    "a dark photo of the {}", "a photo of my {}", "a photo of the small {}", "a photo of one {}",
    "a clean photo of a {}", "a rendition of the {}", "a good photo of a {}", "a blurry photo of the {}",
    "a photo of a nice {}", "a photo of the large {}", "an image of a {}", "a picture of the {}",
]
STYLE_TEMPLATES = [
    "a painting in the style of {}", "a rendering in the style of {}", "a picture in the style of {}",
    "a cropped painting in the style of {}", "the painting in the style of {}", "a clean painting in the style of {}",
    "a dark painting in the style of {}", "a bright painting in the style of {}", "artwork in the style of {}",
    "a small painting in the style of {}", "a large painting in the style of {}", "an illustration in the style of {}",
]


def placeholder_tokens(config: TextualInversionConfig) -> list[str]:
    """diffusers' multi-vector convention: ``<tok>``, ``<tok>_1``, ...; its loader expands ``<tok>`` in a
    prompt to all of them, as training does here."""
    token = config.placeholder_token
    return [token] + [f"{token}_{i}" for i in range(1, config.num_vectors)]


def _initial_vector(tokenizer: Any, text_encoder: nn.Module, tokens: list[str], initializer_token: str) -> torch.Tensor:
    """The embedding the new vectors start from, after checking the tokens are new and the initializer one token."""
    taken = [t for t in tokens if t in tokenizer.get_vocab()]
    if taken:
        raise UserError(f"textual_inversion.placeholder_token: {taken[0]} is already a token of this tokenizer; "
                        "choose a new word such as <my-concept>")
    initializer = tokenizer.encode(initializer_token, add_special_tokens=False)
    if len(initializer) != 1:
        raise UserError(f"textual_inversion.initializer_token: '{initializer_token}' is {len(initializer)} "
                        "tokens for this tokenizer; choose a word that is one token")
    table = text_encoder.get_input_embeddings()
    if table.num_embeddings != len(tokenizer):
        raise UserError(f"model.components.tokenizer.source: {len(tokenizer)} tokens, but the text encoder has "
                        f"{table.num_embeddings} embeddings; use the tokenizer that came with it")
    return table.weight[initializer[0]].detach().float().clone()


class NewTokens(TrainedPart):
    """New token vectors in every text encoder of the family (SDXL: one in CLIP-L's table, one in bigG's); the
    denoiser and every other weight stay frozen."""

    # The new vectors' gradient comes back through the whole frozen denoiser: most of the step's cost.
    through_frozen_denoiser = True
    tokens: list[str]
    vocab: int
    """The first tokenizer's size before the new tokens: a checkpoint's reader appends them after it."""

    def keeps_frozen(self, name: str) -> bool:
        # Only new rows of the token embedding train, which is no linear layer.
        return True

    def text_encoder_trains(self) -> bool:
        return True

    @classmethod
    def problems(cls, config: RunConfig, family: ModelFamily) -> list[str]:
        if not family.components.long_text_tokenizers:
            return []
        return [f"mode: textual_inversion learns CLIP token vectors (SD 1/2, SDXL); {family.title} conditions mostly "
                "on a T5 or language-model encoder: train a LoRA instead (mode: lora)"]

    def make_trainable(self, denoiser: nn.Module, text_encoders: dict[str, nn.Module],
                       tokenizers: list[Any], latent_factor: int = 8) -> dict[str, nn.Module]:
        cfg = self.config.textual_inversion
        self.tokens = placeholder_tokens(cfg)
        denoiser.eval().requires_grad_(False)
        self.vocab = len(tokenizers[0])
        trainable = {}
        for (name, text_encoder), tokenizer in zip(text_encoders.items(), tokenizers):
            start = _initial_vector(tokenizer, text_encoder, self.tokens, cfg.initializer_token)
            # A released config pools at the highest id, which would now be the placeholder: pool at end-of-text,
            # where the file's vectors are read by ComfyUI and SGM (SDXL's text_embeds).
            pool_at_eos(text_encoder, tokenizer.eos_token_id)
            tokenizer.add_tokens(self.tokens)
            text_encoder.requires_grad_(False)
            add_token_rows(text_encoder, start.repeat(cfg.num_vectors, 1))
            trainable[name] = text_encoder.train()
        return trainable

    @property
    def phrase(self) -> str:
        # From the config, not `tokens`: the data settings are read in setup, before make_trainable adds the tokens.
        return " ".join(placeholder_tokens(self.config.textual_inversion))

    def data_config(self, data: DataConfig) -> DataConfig:
        cfg = self.config.textual_inversion
        templates = cfg.templates or (STYLE_TEMPLATES if cfg.learnable_property == "style" else OBJECT_TEMPLATES)
        # Every caption names the concept: an empty one would teach the new vectors nothing.
        return dataclasses.replace(data, prompt_templates=[t.replace("{}", self.phrase) for t in templates],
                                   caption_dropout=0.0)

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"placeholder_token": self.config.textual_inversion.placeholder_token, "tokens": self.tokens,
                "vocab": self.vocab}

    def validation_prompts(self, prompts: list[str]) -> list[str]:
        token = self.config.textual_inversion.placeholder_token
        return [prompt.replace(token, self.phrase) for prompt in prompts]
