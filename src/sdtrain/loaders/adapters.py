"""The structure fine-tuning adds to a model, kept apart from training so that loading a checkpoint can rebuild it:
LoRA adapters (through peft), new token rows of a text encoder's embedding table, and folding either back into a
plain module."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from peft import LoKrConfig, inject_adapter_in_model
from peft import LoraConfig as PeftLoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from sdtrain.errors import UserError, first_line

ADAPTER_TYPE = "adapter_type"
"""The key of an adapter's settings (`add_lora`'s) naming a kind other than LoRA (``lokr``); DoRA is LoRA's
``use_dora``."""
_PEFT_CONFIGS = {"lora": PeftLoraConfig, "lokr": LoKrConfig}


def add_lora(module: nn.Module, settings: dict[str, Any], key: str) -> None:
    """Adapters on `module` through peft itself: LoRA's (DoRA with ``use_dora``), or LoKr's where the settings'
    `ADAPTER_TYPE` says so. transformers' own add_adapter (its text encoders') refuses every peft release before
    0.22, which PyPI does not carry; peft's injection is what both libraries call anyway."""
    settings = dict(settings)
    config_class = _PEFT_CONFIGS[settings.pop(ADAPTER_TYPE, "lora")]
    names = settings.get("target_modules")
    if isinstance(names, (list, tuple)) and "exclude_modules" not in settings:
        # A name peft matches may also end a container's path (Flux.2's attn.to_out: a single block's Linear, a
        # double block's ModuleList); the containers are left out rather than refused.
        containers = [path for path, child in module.named_modules()
                      if isinstance(child, (nn.ModuleList, nn.ModuleDict, nn.Sequential))
                      and any(path == name or path.endswith("." + name) for name in names)]
        settings = {**settings, **({"exclude_modules": containers} if containers else {})}
    config = config_class(**settings)
    try:
        with warnings.catch_warnings():
            # peft counts as excluded only modules it would otherwise have adapted, which containers never are.
            warnings.filterwarnings("ignore", message="You have passed exclude_modules")
            inject_adapter_in_model(config, module, adapter_name="default")
    except ValueError as exc:
        raise UserError(f"{key}: {first_line(exc)}; name modules the model has, e.g. to_q") from exc
    if config.exclude_modules:
        # What the saved settings name: the adapted modules themselves, which a loader (diffusers') matches as
        # they are, with no containers to leave out.
        adapted = {path for path, child in module.named_modules() if isinstance(child, BaseTunerLayer)}
        config = config_class(**{**settings, "target_modules": sorted(adapted), "exclude_modules": None})
    # What peft's state-dict helpers and the savers read the adapter's settings from.
    module.peft_config = {"default": config}


def has_lora(module: nn.Module) -> bool:
    return any(isinstance(m, BaseTunerLayer) for m in module.modules())


def merge_lora(module: nn.Module) -> nn.Module:
    """Fold every adapter into its base layer and put the plain layer back, so the module saves and loads
    as an ordinary model."""
    for name, child in list(module.named_modules()):
        if isinstance(child, BaseTunerLayer):
            child.merge()
            parent_name, _, attr = name.rpartition(".")
            setattr(module.get_submodule(parent_name) if parent_name else module, attr, child.get_base_layer())
    for attr in ("peft_config", "_hf_peft_config_loaded"):
        if hasattr(module, attr):
            try:
                delattr(module, attr)
            except AttributeError:
                pass
    return module


class AddedTokens(nn.Module):
    """A frozen token embedding with trainable rows for tokens appended after its vocabulary. The base
    table never receives a gradient, so it stays bitwise what it was, and only the new rows are trained,
    saved and averaged."""

    def __init__(self, base: nn.Embedding, added: torch.Tensor):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.added = nn.Parameter(added)

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([self.base.weight, self.added])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        vocab = self.base.num_embeddings
        is_new = (ids >= vocab).unsqueeze(-1)
        old = self.base(ids.clamp(max=vocab - 1))
        new = F.embedding((ids - vocab).clamp(min=0), self.added)
        return torch.where(is_new, new.to(old.dtype), old)


def add_token_rows(text_encoder: nn.Module, rows: torch.Tensor) -> AddedTokens:
    embedding = AddedTokens(text_encoder.get_input_embeddings(), rows)
    text_encoder.set_input_embeddings(embedding)
    return embedding


def merge_token_rows(text_encoder: nn.Module) -> nn.Module:
    """Back to a plain text encoder whose vocabulary includes the new tokens (for a full pipeline)."""
    embedding = text_encoder.get_input_embeddings()
    if not isinstance(embedding, AddedTokens):
        return text_encoder
    text_encoder.set_input_embeddings(embedding.base)
    vocab = embedding.base.num_embeddings
    text_encoder.resize_token_embeddings(vocab + embedding.added.shape[0])
    with torch.no_grad():
        text_encoder.get_input_embeddings().weight[vocab:] = embedding.added.detach()
    return text_encoder


def merge_partial(module: nn.Module) -> nn.Module:
    """A partly trained module as a plain one: adapters folded into their layers, new token rows appended
    to the embedding table."""
    module = merge_lora(module)
    return merge_token_rows(module) if hasattr(module, "get_input_embeddings") else module
