"""What the model is fed: the first samples of a run's data exactly as training receives them (decoded, composited,
cropped, flipped, bucketed, captions drawn, loss masks tinted, source images and conditioning maps beside them),
tiled with their captions (``sdtrain data preview``,
and the run's first batch in its folder). A clip shows as a strip of its frames, evenly spaced, side by side."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from sdtrain.config import DataConfig
from sdtrain.data.decode import SIGNED_COMPANIONS
from sdtrain.data.pipeline import TrainBatches
from sdtrain.utils import make_grid, save_image_atomic, to_pil

DROPPED = "(caption dropped)"


MASKED = torch.tensor([1.0, -1.0, -1.0]).view(3, 1, 1)
"""What the parts a loss mask leaves out are tinted towards (red), half and half."""
STRIP_FRAMES = 5
"""The most frames of a clip its strip shows."""
STRIP_GAP = 2
"""Pixels between a strip's frames."""


def strip(values: torch.Tensor, gap: float = 0.0) -> torch.Tensor:
    """A sample's pixels (or mask) as one picture: an image's (C, H, W) as they are; a clip's (C, T, H, W) as up to
    `STRIP_FRAMES` of its frames, evenly spaced from the first to the last, side by side with `gap` (grey for pixels)
    between them."""
    if values.dim() == 3:
        return values
    frames = values.shape[1]
    picks = sorted({round(i * (frames - 1) / (STRIP_FRAMES - 1)) for i in range(STRIP_FRAMES)})
    between = torch.full((values.shape[0], values.shape[2], STRIP_GAP), gap, dtype=values.dtype)
    parts = [part for i in picks for part in (between, values[:, i])][1:]
    return torch.cat(parts, dim=2)


def batch_grid(pixels: list[torch.Tensor], captions: list[str], path: Path,
               masks: list[torch.Tensor] | None = None, beside: list[list[torch.Tensor]] | None = None) -> Path:
    """`pixels` (each 3xHxW in [-1, 1], or a clip's 3xTxHxW shown as a `strip`; sizes may differ between buckets)
    tiled with their `captions` under them, each letterboxed into a square cell so every bucket's shape shows as it
    is; with `masks` (1xHxW, 1 counts; a clip's spans its frames), what a mask leaves out of the loss is tinted red;
    `beside` each image, the images of its size shown to its right (a sample's source image and conditioning map, in
    [-1, 1])."""
    if masks is not None:
        masks = [strip(m.unsqueeze(1).expand(-1, p.shape[1], -1, -1) if p.dim() == 4 and m.dim() == 3 else m, 1.0)
                 for p, m in zip(pixels, masks)]
    pixels = [strip(p) for p in pixels]
    if masks is not None:
        pixels = [p * (1 + m) / 2 + MASKED * (1 - m) / 2 for p, m in zip(pixels, masks)]
    if beside is not None:
        pixels = [torch.cat([p, *others], dim=2) for p, others in zip(pixels, beside)]
    images = [to_pil(p.unsqueeze(0))[0] for p in pixels]
    side = max(max(img.size) for img in images)
    cells = []
    for img in images:
        cell = Image.new("RGB", (side, side), (128, 128, 128))
        cell.paste(img, ((side - img.width) // 2, (side - img.height) // 2))
        cells.append(cell)
    rows = max(1, round(math.sqrt(len(cells))))
    # Small images are magnified for the eye; large ones are shown at their size.
    scale = max(1, 192 // side)
    labels = [caption or DROPPED for caption in captions]
    return save_image_atomic(make_grid(cells, rows=rows, labels=labels, scale=scale), path)


def preview_data(config: DataConfig, seed: int, num: int, out: Path, clips: bool = True) -> dict[str, Any]:
    """Draw the first `num` samples of the data as a run of `seed` reads them (in the training process: the
    workers change nothing a run reads), write their grid to `out`, and count what was skipped on the way.
    `clips`: read clips, as a model of clips does (each shows as a strip of frames; images are the same either way);
    False refuses them in one line, as a model of still images does."""
    loader = TrainBatches(dataclasses.replace(config, num_workers=0), None, seed, encoded=False, clips=clips)
    pixels: list[torch.Tensor] = []
    captions: list[str] = []
    masks: list[torch.Tensor] = []
    beside: list[list[torch.Tensor]] = []
    try:
        while len(pixels) < num:
            batch = loader.next()
            pixels += list(batch["pixel_values"])
            captions += list(batch["captions"])
            masks += list(batch["mask"]) if "mask" in batch else [torch.ones(1, *p.shape[-2:])
                                                                   for p in batch["pixel_values"]]
            # The source image, then the conditioning map (shown in [-1, 1] like the image), to the image's right.
            companions = [batch[f] if f in SIGNED_COMPANIONS else batch[f] * 2 - 1
                          for f in ("source_pixels", "conditioning_pixels") if f in batch]
            beside += [list(others) for others in zip(*companions)] if companions else [[] for _ in batch["captions"]]
        position = loader.position
        counts = {"samples": num, "skipped": position.total_skipped, "filtered": position.total_filtered}
    finally:
        loader.close()
    return {**counts, "grid": str(batch_grid(pixels[:num], captions[:num], out, masks[:num], beside[:num]))}
