"""Small helpers shared across commands: atomic writes and image grids."""

from __future__ import annotations

import io
import os
import re
import textwrap
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image, ImageDraw


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write through a temporary name and rename into place, so readers never see half a file.

    The temporary name carries the pid: processes finishing at the same moment (the last encoders of a
    dataset, say) each rename a whole file instead of writing into one shared temporary.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def save_image_atomic(image: Image.Image, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    encoded = io.BytesIO()
    image.save(encoded, format=Image.registered_extensions()[path.suffix.lower()])
    atomic_write_bytes(path, encoded.getvalue())
    return path


def image_file_name(index: int, prompt: str) -> str:
    """The file of prompt `index`'s image, ``000-a-red-circle.png``: what `sdtrain generate` writes, and validation
    beside its grid, so the two compare file by file."""
    slug = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:60] or "empty"
    return f"{index:03d}-{slug}.png"


def save_images(images: Sequence[Image.Image], prompts: Sequence[str], folder: Path) -> list[Path]:
    """Each image into `folder` under `image_file_name` of its prompt."""
    return [save_image_atomic(image, Path(folder) / image_file_name(i, prompt))
            for i, (image, prompt) in enumerate(zip(images, prompts))]


def to_pil(images: torch.Tensor | Sequence[Image.Image]) -> list[Image.Image]:
    """Tensors in [-1, 1] (N, 3, H, W) or PIL images -> PIL images."""
    if isinstance(images, torch.Tensor):
        array = ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().byte()
        return [Image.fromarray(a.permute(1, 2, 0).numpy()) for a in array]
    return list(images)


def make_grid(images: list[Image.Image], rows: int, labels: Sequence[str] | None = None, scale: int = 2) -> Image.Image:
    """Tile images row-major; small images are upscaled so a person can see them, labels go underneath.

    Labels wrap rather than being cut, so a two-shape prompt stays readable under a 128 px tile.
    """
    cols = max(1, -(-len(images) // rows))
    w, h = images[0].width * scale, images[0].height * scale
    # PIL's default bitmap font is about 6 px wide and 11 px high per character.
    lines = [textwrap.wrap(str(label), width=max(4, (w - 4) // 6)) or [""] for label in labels or []]
    label_h = 12 * max((len(wrapped) for wrapped in lines), default=0) + (2 if lines else 0)
    grid = Image.new("RGB", (cols * w, rows * (h + label_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i, img in enumerate(images):
        x, y = (i % cols) * w, (i // cols) * (h + label_h)
        grid.paste(img.convert("RGB").resize((w, h), Image.Resampling.NEAREST), (x, y))
        for line_number, line in enumerate(lines[i] if lines else []):
            draw.text((x + 2, y + h + 1 + 12 * line_number), line, fill="black")
    return grid


def save_grid(images, path: Path, rows: int = 1, labels: Sequence[str] | None = None) -> Path:
    pil = to_pil(images)
    return save_image_atomic(make_grid(pil, rows=min(rows, len(pil)), labels=labels), path)

