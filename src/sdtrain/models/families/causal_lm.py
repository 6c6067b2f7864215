"""A causal language model as a text encoder, the building block of the families that condition on one (Z-Image's
Qwen3; Qwen-Image's Qwen2.5-VL and Flux.2's Mistral are the same pattern): captions go through the model's chat
template, and the denoiser reads a hidden layer's states at the caption's own positions (an attention mask, not
padding). Here: the chat tokenizer a model trained from scratch learns from its captions, the template, and the
hidden states."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

from sdtrain.errors import UserError
from sdtrain.models.families import spec

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK = ("<think>", "</think>")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{{- part['text'] }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
"""Qwen3's chat layout for the turns a text-to-image pipeline renders (a system turn, the user's, the assistant's
opening): ``<|im_start|>user\\n{caption}<|im_end|>\\n<|im_start|>assistant\\n``; a turn's content is text or a
list of text parts (Flux.2's messages)."""
QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
                rms_norm_eps=1e-6, tie_word_embeddings=True, vocab_size=151936)
"""Qwen3-4B (read as Qwen3Model: no language-model head), Z-Image's and Flux.2 klein-4B's text encoder."""


class LanguageModelText:
    """What a family conditioned on a causal language model takes from here, mixed in before `spec.Conditioner`
    (its text encoder's record says ``long_text=True``): captions default to the 512 tokens the pipelines read
    (Z-Image's, Qwen-Image's, Flux.2's max_sequence_length), and a model trained from scratch learns a chat
    tokenizer."""

    def long_text_length(self, preset: str, denoiser_source: str | Path | None = None) -> int:
        return TEXT_LENGTH

    def train_tokenizer(self, captions: list[str], out_dir: Path, vocab_size: int, max_length: int) -> Any:
        return train_chat_tokenizer(captions, out_dir, vocab_size, max_length)


TEXT_LENGTH = 512
"""Tokens per templated caption when ``model.t5_text_length`` is unset (Qwen-Image's: after its dropped system
turn)."""


def chat_texts(tokenizer: Any, captions: list[str], thinking: bool = True) -> list[str]:
    """Each caption as the user turn of the tokenizer's chat template, the assistant's turn opened after it, as
    diffusers' Z-Image pipeline renders prompts (thinking left on: no empty think block) and Flux.2 klein's (off:
    an empty one)."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": caption}], tokenize=False,
                                          add_generation_prompt=True, enable_thinking=thinking)
            for caption in captions]


def chat_tokens(tokenizer: Any, captions: list[str], thinking: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of the templated captions (`chat_texts`), padded to the tokenizer's length on its
    padding side, as the Z-Image and Flux.2 klein pipelines pad them (each caption's states are then at the
    positions sampling gives them)."""
    tokens = tokenizer(chat_texts(tokenizer, captions, thinking), padding="max_length", truncation=True,
                       max_length=tokenizer.model_max_length, return_tensors="pt")
    return tokens.input_ids, tokens.attention_mask


def hidden_states(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, layer: int) -> torch.Tensor:
    """The output of hidden layer `layer` (Python indexing over the embeddings and every layer's output: -2 is the
    last layer's input, before the final norm) for token ids under their attention mask."""
    return model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[layer]


def stacked_hidden_states(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, layers: tuple[int, ...]
                          ) -> torch.Tensor:
    """The outputs of hidden layers `layers` side by side for each token: (B, L, len(layers) x hidden), each
    token's states in `layers` order, as Flux.2's pipelines read them."""
    states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    return torch.cat([states[layer] for layer in layers], dim=-1)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers of a transformers language model (its base model's ``layers``)."""
    return list(getattr(model, "model", model).layers)


def text_encoder(cls: type[nn.Module], weight_prefixes: tuple[tuple[str, str], ...]) -> spec.Component:
    """The component record of a language model read as a family's text encoder: long captions under its
    ``tokenizer``, its decoder layers as blocks, adapted by ``lora.text_encoder``; `weight_prefixes` say where a
    released checkpoint keeps its language tower (a vision-language model's beside its vision tower)."""
    return spec.Component(cls, "text_encoder", tokenizer="tokenizer", long_text=True, lora=True,
                          weight_prefixes=weight_prefixes, blocks=decoder_layers)


def train_chat_tokenizer(captions: Iterable[str], out_dir: str | Path, vocab_size: int, max_length: int,
                         markers: tuple[str, ...] = ()) -> Any:
    """A byte-level BPE tokenizer in Qwen2's layout (the pad, chat and think markers and `markers` as special
    tokens, the chat template), learnt from `captions` and saved to `out_dir`, which a model trained from scratch
    reads its ids from. Written in a temporary sibling and renamed into place: an interrupted run never leaves half a
    folder."""
    from transformers import Qwen2Tokenizer

    specials = [PAD, IM_START, IM_END, *THINK, *markers]
    smallest = len(pre_tokenizers.ByteLevel.alphabet()) + len(specials)
    if vocab_size <= smallest:
        raise UserError(f"model.tokenizer_vocab_size: {vocab_size} is too small for a byte-level tokenizer; use "
                        f"more than {smallest}")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(list(captions), trainer)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(bpe.to_str())["model"]["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=bpe.get_vocab(), merges=merges, model_max_length=max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END, *markers]})
    tokenizer.chat_template = CHAT_TEMPLATE
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return tokenizer


class WithoutVideo:
    """A mixin for a vision-language processor class (transformers' Qwen2VLProcessor, Qwen3VLProcessor) made of an
    image processor and a tokenizer alone: a text-to-image pipeline reads no video, and transformers cannot build
    (nor save) the processor with its video processor without torchvision. Saved, the image settings are written
    beside the tokenizer (preprocessor_config.json), where the processor class loads them."""

    @classmethod
    def get_attributes(cls) -> list[str]:
        return ["image_processor", "tokenizer"]

    def save_pretrained(self, save_directory: str | Path, **kwargs: Any) -> list[str]:
        written = super().save_pretrained(save_directory, **kwargs)
        return [*written, *self.image_processor.save_pretrained(save_directory)]
