"""Latents as the token sequence a rectified-flow transformer reads when it does not patchify them itself (Flux.1's,
Qwen-Image's, Chroma's): 2x2 patches of every channel, row by row, in the order diffusers' pipelines pack them, and
the positions Flux.1's layout gives them."""

from __future__ import annotations

import torch


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) latents -> (B, H/2 * W/2, 4C) tokens, 2x2 patches in FluxPipeline's order."""
    b, c, h, w = latents.shape
    patches = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of `pack`, for latents of `height` x `width`."""
    b, _, packed = tokens.shape
    channels = packed // 4
    patches = tokens.view(b, height // 2, width // 2, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, channels, height, width)


def image_ids(rows: int, columns: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Each image token's RoPE position (0, row, column), as the Flux.1 layout's transformers (Flux.1's, Chroma's)
    read them."""
    ids = torch.zeros(rows, columns, 3, device=device, dtype=dtype)
    ids[..., 1] = torch.arange(rows, device=device, dtype=dtype)[:, None]
    ids[..., 2] = torch.arange(columns, device=device, dtype=dtype)[None, :]
    return ids.reshape(rows * columns, 3)
