"""umT5-XXL's encoder as a video family's one text encoder (UMT5EncoderModel), as diffusers' WanPipeline reads it:
shared by every Wan family (2.1, 2.2 TI2V-5B, 2.2 A14B), which all condition on it the same way.

The conditioner follows WanPipeline.encode_prompt: each caption cleaned as the pipeline cleans it, padded on the right
to a fixed length (512 tokens, ``max_sequence_length``), read by umT5 under its attention mask; the transformer reads
the last hidden states with the padding's zeroed (it takes no mask).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from torch import nn
from transformers import UMT5Config, UMT5EncoderModel

from sdtrain.models.families import spec
from sdtrain.models.families.clip import ClipTokenizerFromScratch
from sdtrain.models.families.spec import construct, ids_key, mask_key

TEXT_LENGTH = 512
"""umT5's tokens per caption when ``model.t5_text_length`` is unset: WanPipeline's ``max_sequence_length``."""

UMT5_XXL: dict[str, Any] = dict(
    vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
    dropout_rate=0.0, layer_norm_epsilon=1e-6)
"""umT5-XXL's encoder (google/umt5-xxl; Wan-AI's text_encoder/config.json, the same in every Wan release):
5,680,910,336 parameters. Trained without dropout, as the other T5 towers here (the released config's 0.1 is for
pretraining)."""
TINY_UMT5: dict[str, Any] = dict(
    d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
    relative_attention_max_distance=32, feed_forward_proj="gated-gelu", dropout_rate=0.0)
"""The released structure at a size tests train: gated-GELU blocks with per-layer relative attention."""


def umt5_blocks(encoder: UMT5EncoderModel) -> list[nn.Module]:
    """The encoder's repeated blocks, in forward order (`spec.Component.blocks`)."""
    return list(encoder.encoder.block)


def umt5_config(settings: dict[str, Any], tokenizer: Any, key: str) -> UMT5Config:
    """An umT5 encoder's config from preset settings; the vocabulary is the tokenizer's unless the preset names
    umT5's own (the released encoder keeps its 256,384 rows)."""
    return construct(UMT5Config, key, {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
                                       "eos_token_id": tokenizer.eos_token_id, "is_encoder_decoder": False,
                                       "use_cache": False, **settings})


class UMT5Conditioner(ClipTokenizerFromScratch, spec.Conditioner):
    """Captions to umT5's masked last hidden states, as WanPipeline.encode_prompt computes them (``text_emb``, the
    padding's states zero, and ``text_mask``).

    A model from scratch learns CLIP's byte-level BPE from its captions and umT5 reads its ids, as SD3's and Flux.1's
    T5 do: the released umT5 SentencePiece model is no layout a run's captions train."""

    def tokenize(self, tokenizer: Any, index: int, captions: list[str]) -> dict[str, torch.Tensor]:
        # As the pipeline tokenizes a prompt: cleaned by its own function (HTML entities, whitespace; ftfy's fixes
        # where ftfy is installed), its special tokens, padded on the right to the length (whatever the folder's
        # padding side: the pipeline keeps each caption's first states, which right padding makes the caption's).
        tokens = tokenizer([prompt_clean(caption) for caption in captions], padding="max_length",
                           padding_side="right", truncation=True, max_length=tokenizer.model_max_length,
                           add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        return {ids_key(index): tokens.input_ids, mask_key(index): tokens.attention_mask}

    def long_text_length(self, preset: str, denoiser_source: str | Path | None = None) -> int:
        return TEXT_LENGTH

    def build_text_encoder(self, name: str, settings: dict[str, Any], tokenizer: Any, key: str) -> nn.Module:
        return UMT5EncoderModel(umt5_config(settings, tokenizer, key))

    def encode_text(self, encoders: list[nn.Module], ids: list[torch.Tensor], captions: list[str] | None,
                    masks: list[torch.Tensor | None] | None = None, sources: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
        mask = masks[0] if masks else None
        if mask is None:
            raise ValueError(f"{self.family.title}'s conditioning reads umT5 under its attention mask: pass the masks "
                             "`tokenize` makes (ModelFamily.token_inputs)")
        states = encoders[0](input_ids=ids[0], attention_mask=mask).last_hidden_state
        mask = mask.to(states.dtype)
        # The padding's states zeroed, as the pipeline pads each caption's own with zeros: the transformer, which
        # takes no mask, attends to them as it did in training.
        return {"text_emb": states * mask.unsqueeze(-1), "text_mask": mask}

    def text_shapes(self, text_encoders: dict[str, Any], lengths: list[int]) -> dict[str, tuple[int, ...]]:
        return {"text_emb": (lengths[0], text_encoders["text_encoder"].d_model), "text_mask": (lengths[0],)}


def umt5_component() -> spec.Component:
    """umT5's record in a Wan family's component table: frozen (diffusers' Wan LoRA loader, and every Wan trainer,
    adapts the transformer alone), read at the long-caption length, its blocks those of `umt5_blocks`."""
    return spec.Component(UMT5EncoderModel, "text_encoder", tokenizer="tokenizer", long_text=True,
                          blocks=umt5_blocks)
