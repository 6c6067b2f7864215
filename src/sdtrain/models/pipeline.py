"""Choosing a pipeline's sampler, sampling images from it, and assembling a Stable Diffusion 1/2 pipeline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    StableDiffusionPipeline,
)
from PIL import Image

from sdtrain.errors import UserError
from sdtrain.models import families
from sdtrain.models.families.sd import SD

SAMPLERS = {
    "euler": EulerDiscreteScheduler,
    "ddim": DDIMScheduler,
    "dpmpp": DPMSolverMultistepScheduler,
}


def assemble_pipeline(
    vae: Any, text_encoder: Any, tokenizer: Any, unet: Any, scheduler: Any
) -> StableDiffusionPipeline:
    """A Stable Diffusion 1/2 pipeline of these components (other families: their spec's ``assemble``)."""
    return SD.assemble({"vae": vae, "text_encoder": text_encoder, "unet": unet}, [tokenizer], scheduler)


def sampler_from(scheduler: Any, name: str) -> Any:
    """A sampling scheduler of kind `name` sharing the training noise schedule of `scheduler`. A flow-matching
    schedule (SD3, Flux.1) is sampled by its own Euler sampler with its shift, whatever `name` says: the
    samplers named here integrate DDPM schedules."""
    if name not in SAMPLERS:
        raise UserError(f"--scheduler: '{name}' is not one of {', '.join(SAMPLERS)}")
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return FlowMatchEulerDiscreteScheduler.from_config(scheduler.config)
    # Keyword arguments, not config entries: from_config drops entries the source left at their defaults.
    settings: dict[str, Any] = {}
    if scheduler.config.get("rescale_betas_zero_snr"):
        # A schedule that ends in pure noise must be sampled from its last step (Lin et al., 2024, section 3.3).
        settings["timestep_spacing"] = "trailing"
    if name == "dpmpp":
        settings.update(algorithm_type="dpmsolver++", solver_order=2)
    return SAMPLERS[name].from_config(scheduler.config, **settings)


@torch.no_grad()
def sample_images(pipe: Any, prompts: Sequence[str], seed: int = 0, steps: int | None = None,
                  guidance: float | None = None, negative_prompt: str | None = None, batch: int = 1,
                  seeds: Sequence[int] | None = None, size: int | None = None, default_steps: int = 30
                  ) -> list[Image.Image]:
    """One image per prompt; prompt i uses seed + i (or ``seeds[i]``), so adding prompts never changes earlier
    images. ``batch`` prompts run through the model together, each from the noise of its own seed: the same
    images up to floating-point rounding, several times faster for small models on a CPU. `size`: the side in
    pixels (None: the pipeline's default, which for Flux.1 is 1024 px whatever the model trained on). `steps` and
    `guidance` None: the model's own (its family's `sampling_defaults`), else `default_steps` and SD's 5."""
    pipe.set_progress_bar_config(disable=True)
    family = families.of_pipeline(pipe)
    defaults = family.sampling_defaults(getattr(pipe, family.denoiser).config)
    steps = steps or defaults.get("steps", default_steps)
    guidance = defaults["guidance"] if guidance is None else guidance
    shape = {"height": size, "width": size} if size else {}
    seeds = list(seeds) if seeds is not None else [seed + i for i in range(len(prompts))]
    images = []
    for start in range(0, len(prompts), batch):
        chunk = list(prompts[start:start + batch])
        generators = [torch.Generator(pipe.device).manual_seed(s) for s in seeds[start:start + batch]]
        arguments = family.sampling_arguments(pipe, guidance, negative_prompt)
        if arguments.get("negative_prompt") is not None:
            arguments["negative_prompt"] = [arguments["negative_prompt"]] * len(chunk)
        result = pipe(chunk, num_inference_steps=steps, generator=generators, output_type="pil", **shape,
                      **arguments)
        images += result.images
    return images
