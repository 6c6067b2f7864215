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

VIDEO_FPS = 16
"""The frame rate sampled clips are written at: the rate ``prepare folder`` resamples clips to by default (Wan's)."""


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


def save_images(images: Sequence[Image.Image | Sequence[Image.Image]], prompts: Sequence[str], folder: Path,
                fps: int = VIDEO_FPS) -> list[Path]:
    """Each image into `folder` under `image_file_name` of its prompt; a clip (a list of frames) as an mp4 of the
    same name at `fps`, or a PNG when it has one frame."""
    paths = []
    for i, (sample, prompt) in enumerate(zip(images, prompts)):
        path = Path(folder) / image_file_name(i, prompt)
        if isinstance(sample, Image.Image) or len(sample) == 1:
            paths.append(save_image_atomic(sample if isinstance(sample, Image.Image) else sample[0], path))
        else:
            paths.append(save_video(sample, path.with_suffix(".mp4"), fps))
    return paths


def save_video(frames: Sequence[Image.Image], path: Path, fps: int = VIDEO_FPS) -> Path:
    """`frames` as an H.264 mp4 at `path` (written under a temporary name, then renamed), which browsers, players
    and the report play: sides cropped to even numbers (4:2:0 chroma halves them), near-lossless quality."""
    import av  # noqa: PLC0415 - decoding and encoding clips only

    width, height = frames[0].width // 2 * 2, frames[0].height // 2 * 2
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": "12"}
        for frame in frames:
            picture = av.VideoFrame.from_image(frame.convert("RGB").crop((0, 0, width, height)))
            container.mux(stream.encode(picture))
        container.mux(stream.encode())
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(Path(path), buffer.getvalue())
    return Path(path)


def still(sample: Image.Image | Sequence[Image.Image], count: int = 4) -> Image.Image:
    """An image, or a clip as a strip of `count` evenly spaced frames side by side (the first and the last among
    them): what a grid or a report shows of it."""
    if isinstance(sample, Image.Image):
        return sample
    picked = [sample[round(i * (len(sample) - 1) / max(count - 1, 1))] for i in range(min(count, len(sample)))]
    strip = Image.new("RGB", (sum(frame.width for frame in picked), picked[0].height))
    for index, frame in enumerate(picked):
        strip.paste(frame.convert("RGB"), (index * picked[0].width, 0))
    return strip


def to_pil(images: torch.Tensor | Sequence[Image.Image]) -> list[Image.Image]:
    """Tensors in [-1, 1] (N, 3, H, W) or PIL images -> PIL images; clips (N, 3, T, H, W) -> a list of frames
    each."""
    if isinstance(images, torch.Tensor):
        if images.dim() == 5:
            return [to_pil(clip.transpose(0, 1)) for clip in images]
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
    """A grid of images (tensors or PIL) or clips (each shown as a strip of its frames, `still`) at `path`."""
    pil = [still(image) for image in to_pil(images)]
    return save_image_atomic(make_grid(pil, rows=min(rows, len(pil)), labels=labels), path)

