"""Images from prompts, with a pipeline folder or straight from a run."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from sdtrain.errors import UserError
from sdtrain.models import build
from sdtrain.models.pipeline import sampler_from
from sdtrain.run import resolve_device
from sdtrain.utils import make_grid, save_image_atomic


def load_pipeline(model: str | Path, ema: bool = True, device: str = "auto") -> Any:
    from diffusers import StableDiffusionPipeline

    kind = build.source_kind(model)
    if kind == "run":
        from sdtrain.export import pipeline_from_run

        pipe = pipeline_from_run(Path(model), ema=ema)
    elif kind == "pipeline":
        pipe = StableDiffusionPipeline.from_pretrained(
            model, local_files_only=True, safety_checker=None, requires_safety_checker=False
        )
    else:
        raise UserError(f"--model: {model} is a single component; pass a pipeline folder or a diffusion run")
    return pipe.to(resolve_device(device))


@torch.no_grad()
def sample_images(pipe: Any, prompts: Sequence[str], seed: int = 0, steps: int = 30, guidance: float = 5.0,
                  negative_prompt: str | None = None) -> list[Image.Image]:
    """One image per prompt; prompt i uses seed + i, so adding prompts never changes earlier images."""
    pipe.set_progress_bar_config(disable=True)
    images = []
    for i, prompt in enumerate(prompts):
        generator = torch.Generator(pipe.device).manual_seed(seed + i)
        result = pipe(prompt, num_inference_steps=steps, guidance_scale=guidance, generator=generator,
                      negative_prompt=negative_prompt, output_type="pil")
        images.append(result.images[0])
    return images


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "empty"


def generate(model: str | Path, prompts: Sequence[str], out: Path, steps: int = 30, guidance: float = 5.0,
             seed: int = 0, scheduler: str = "euler", ema: bool = True, device: str = "auto",
             negative_prompt: str | None = None) -> list[Path]:
    if not prompts:
        raise UserError("no prompts: pass --prompt TEXT or --prompts FILE with one prompt per line")
    pipe = load_pipeline(model, ema=ema, device=device)
    pipe.scheduler = sampler_from(pipe.scheduler, scheduler)
    images = sample_images(pipe, prompts, seed=seed, steps=steps, guidance=guidance,
                           negative_prompt=negative_prompt)
    out = Path(out)
    paths = [save_image_atomic(img, out / f"{i:03d}-{_slug(p)}.png") for i, (img, p) in enumerate(zip(images, prompts))]
    rows = max(1, round(len(images) ** 0.5))
    paths.append(save_image_atomic(make_grid(images, rows=rows, labels=prompts), out / "grid.png"))
    return paths
