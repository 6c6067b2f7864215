"""Assembling trained components into a diffusers StableDiffusionPipeline, and choosing its sampler."""

from __future__ import annotations

from typing import Any

from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    StableDiffusionPipeline,
)

SAMPLERS = {
    "euler": EulerDiscreteScheduler,
    "ddim": DDIMScheduler,
    "dpmpp": DPMSolverMultistepScheduler,
}


def assemble_pipeline(
    vae: Any, text_encoder: Any, tokenizer: Any, unet: Any, scheduler: Any
) -> StableDiffusionPipeline:
    # Models trained here have no safety checker; the pipeline must be told so explicitly.
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def sampler_from(scheduler: Any, name: str) -> Any:
    """A sampling scheduler of kind `name` sharing the training noise schedule of `scheduler`."""
    if name not in SAMPLERS:
        from sdtrain.errors import UserError

        raise UserError(f"--scheduler: '{name}' is not one of {', '.join(SAMPLERS)}")
    # Keyword arguments, not config entries: from_config drops entries the source left at their defaults.
    settings: dict[str, Any] = {}
    if scheduler.config.get("rescale_betas_zero_snr"):
        # A schedule that ends in pure noise must be sampled from its last step (Lin et al., 2024, section 3.3).
        settings["timestep_spacing"] = "trailing"
    if name == "dpmpp":
        settings.update(algorithm_type="dpmsolver++", solver_order=2)
    return SAMPLERS[name].from_config(scheduler.config, **settings)
