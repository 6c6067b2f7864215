"""CLIP text towers as the released models use them, shared by every family that has one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from sdtrain.models.tokenizer import train_clip_tokenizer

LEGACY_EOS_ID = 2
"""The ``eos_token_id`` of the released CLIP text configs (SD, SDXL, SD3, Flux.1), which transformers reads as
"pool at the highest id in the caption" rather than at an eos id."""


def pool_at_eos(text_encoder: nn.Module, eos_token_id: int | None = None) -> None:
    """Make a CLIP text encoder pool (``pooler_output``, and through its projection ``text_embeds``) at the first
    `eos_token_id` of each caption, as SGM, OpenCLIP and ComfyUI do, wherever it runs: the conditioner, prepare
    encode, the pipelines sampling it and any pipeline saved from it (its config.json says the id).

    The released configs' legacy id pools at the highest id, which is end-of-text only while the vocabulary has
    nothing after it: once a token is added (textual inversion's placeholder) a caption naming it would pool
    there. Without new tokens both rules pick the same position, so this changes nothing until tokens are added;
    call it before adding them. `eos_token_id` None: the config's own, or for a legacy one the highest id of the
    vocabulary it was released with (the token the legacy rule pooled at). Other encoders (T5) are left as they are.
    """
    config = getattr(text_encoder, "config", None)
    if getattr(config, "model_type", None) != "clip_text_model":
        return
    if eos_token_id is None:
        eos_token_id = config.vocab_size - 1 if config.eos_token_id == LEGACY_EOS_ID else config.eos_token_id
    # transformers 5 pools in the model itself, 4.x in its text_model; each keeps the id it was built with.
    for module in (text_encoder, getattr(text_encoder, "text_model", None)):
        if hasattr(module, "eos_token_id"):
            module.eos_token_id = eos_token_id
        if getattr(module, "config", None) is not None:
            module.config.eos_token_id = eos_token_id


class ClipTokenizerFromScratch:
    """Mixed in before `spec.Conditioner` by a family whose text encoders all read CLIP's ids: a model trained
    from scratch learns CLIP's byte-level BPE layout from the run's captions."""

    def train_tokenizer(self, captions: list[str], out_dir: Path, vocab_size: int, max_length: int) -> Any:
        return train_clip_tokenizer(captions, out_dir, vocab_size, max_length)
