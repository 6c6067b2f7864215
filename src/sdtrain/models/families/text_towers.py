"""The text encoders several families share, as the released models use them, at released and tiny sizes: CLIP
ViT-L/14 (SDXL, SD3, Flux.1), OpenCLIP ViT-bigG/14 (SDXL, SD3) and T5 v1.1 XXL's encoder (SD3, Flux.1); their configs
from a preset and a tokenizer, their repeated blocks, and the penultimate layer's states SDXL and SD3 condition on."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from sdtrain.models.families.spec import construct

# CLIP ViT-L/14's text tower, whole (SDXL and SD3 read its penultimate layer's states, Flux.1 its pooled output).
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              projection_dim=768, hidden_act="quick_gelu")
# OpenCLIP ViT-bigG/14's text tower with its projection.
OPENCLIP_BIGG = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
                     projection_dim=1280, hidden_act="gelu")
TINY_CLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, projection_dim=32)
# Wider than the first, as bigG is than ViT-L: diffusers' single-file loader tells the two towers apart by width.
TINY_CLIP_WIDER = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       projection_dim=48)
# T5 v1.1 XXL's encoder.
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              relative_attention_num_buckets=32, relative_attention_max_distance=128,
              feed_forward_proj="gated-gelu", dropout_rate=0.0, layer_norm_epsilon=1e-6)
TINY_T5 = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
               relative_attention_max_distance=32, feed_forward_proj="gated-gelu", dropout_rate=0.0)


def clip_text_config(settings: dict[str, Any], tokenizer: Any, key: str) -> CLIPTextConfig:
    """A CLIP text tower's config from preset settings, its vocabulary, length and special ids the tokenizer's
    (the pooled output is read at the eos position, so the ids must be the tokenizer's own)."""
    return construct(CLIPTextConfig, key, dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **settings,
    ))


def t5_config(settings: dict[str, Any], tokenizer: Any, key: str) -> T5Config:
    """A T5 encoder's config from preset settings; the vocabulary is the tokenizer's unless the preset names
    T5's own (a pretrained-size T5 keeps its 32,128 rows)."""
    return construct(T5Config, key, {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
                                     "eos_token_id": tokenizer.eos_token_id, "is_encoder_decoder": False,
                                     "use_cache": False, **settings})


def text_blocks(text_encoder: CLIPTextModel) -> list:
    # transformers 5 holds the transformer directly; 4.x under text_model.
    return list(getattr(text_encoder, "text_model", text_encoder).encoder.layers)


def t5_blocks(encoder: T5EncoderModel) -> list:
    return list(encoder.encoder.block)


def penultimate_states(encoder: nn.Module, tokens: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """A CLIP encoder's output and its penultimate layer's states (what ``output_hidden_states`` gives as
    hidden_states[-2]), read by a hook on that layer: transformers collects hidden states by layer class, which
    FSDP2 replaces, and a wrapped encoder (DDP) forwards no such option."""
    layers = text_blocks(getattr(encoder, "module", encoder))
    captured = []
    handle = layers[-2].register_forward_hook(
        lambda _module, _inputs, out: captured.append(out[0] if isinstance(out, tuple) else out))
    try:
        output = encoder(tokens)
    finally:
        # Before backward: a checkpointed layer runs again there, and must not be captured twice.
        handle.remove()
    return output, captured[0]
