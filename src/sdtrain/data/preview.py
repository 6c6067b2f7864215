"""What the model is fed: the first samples of a run's data exactly as training receives them (decoded, composited,
cropped, flipped, bucketed, captions drawn, loss masks tinted, source images and conditioning maps beside them),
tiled with their captions (``sdtrain data preview``,
and the run's first batch in its folder)."""

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


def batch_grid(pixels: list[torch.Tensor], captions: list[str], path: Path,
               masks: list[torch.Tensor] | None = None, beside: list[list[torch.Tensor]] | None = None) -> Path:
    """`pixels` (each 3xHxW in [-1, 1], sizes may differ between buckets) tiled with their `captions` under them,
    each letterboxed into a square cell so every bucket's shape shows as it is; with `masks` (1xHxW, 1 counts), what
    a mask leaves out of the loss is tinted red; `beside` each image, the images of its size shown to its right (a
    sample's source image and conditioning map, in [-1, 1])."""
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


def preview_data(config: DataConfig, seed: int, num: int, out: Path) -> dict[str, Any]:
    """Draw the first `num` samples of the data as a run of `seed` reads them (in the training process: the
    workers change nothing a run reads), write their grid to `out`, and count what was skipped on the way."""
    loader = TrainBatches(dataclasses.replace(config, num_workers=0), None, seed, encoded=False)
    pixels: list[torch.Tensor] = []
    captions: list[str] = []
    masks: list[torch.Tensor] = []
    beside: list[list[torch.Tensor]] = []
    try:
        while len(pixels) < num:
            batch = loader.next()
            pixels += list(batch["pixel_values"])
            captions += list(batch["captions"])
            masks += list(batch["mask"]) if "mask" in batch else [torch.ones_like(p[:1]) for p in batch["pixel_values"]]
            # The source image, then the conditioning map (shown in [-1, 1] like the image), to the image's right.
            companions = [batch[f] if f in SIGNED_COMPANIONS else batch[f] * 2 - 1
                          for f in ("source_pixels", "conditioning_pixels") if f in batch]
            beside += [list(others) for others in zip(*companions)] if companions else [[] for _ in batch["captions"]]
        position = loader.position
        counts = {"samples": num, "skipped": position.total_skipped, "filtered": position.total_filtered}
    finally:
        loader.close()
    return {**counts, "grid": str(batch_grid(pixels[:num], captions[:num], out, masks[:num], beside[:num]))}
