"""Wan 2.1's transformer in its authors' original layout (Wan-AI's release files, ComfyUI's
``models/diffusion_models/`` files), read and written, and Wan LoRA files in the names ComfyUI's Wan loader applies
whole. Interface first; the mapping follows."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from torch import Tensor

PREFIXES = ("model.diffusion_model.", "")
MARK = "head.modulation"
"""A key no other family's transformer holds (what ComfyUI tells a Wan model by)."""
SINGLE_FILE_KEYS = tuple(prefix + MARK for prefix in PREFIXES)

TRANSFORMER_FILE = None  # the SingleFileLayout, built below once the mapping lands


def original_module_path(path: str) -> str:
    """A diffusers WanTransformer3DModel module path -> Wan's original module path."""
    raise NotImplementedError


def lora_name(path: str) -> str:
    """The module name ComfyUI's Wan LoRA loader applies for the diffusers module at `path`."""
    raise NotImplementedError


def lora_state(layers: Mapping[str, tuple[Tensor, Tensor, float]]) -> dict[str, Tensor]:
    """LoRA factors (down, up, alpha) by diffusers module path -> a state dict in ComfyUI's Wan names."""
    raise NotImplementedError


def load_transformer_file(path: str | Path, trust_pickle: bool | None = None, frozen_precision: str = "fp32",
                          weights: bool = True):
    """A WanTransformer3DModel from a file of Wan's original layout."""
    raise NotImplementedError
