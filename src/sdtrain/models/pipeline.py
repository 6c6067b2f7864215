"""Choosing a pipeline's sampler, sampling images from it, and assembling a Stable Diffusion 1/2 pipeline."""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
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

from sdtrain.config import RunConfig
from sdtrain.errors import UserError
from sdtrain.models import families
from sdtrain.models.families.sd import SD
from sdtrain.utils import atomic_write_text

SAMPLERS = {
    "euler": EulerDiscreteScheduler,
    "ddim": DDIMScheduler,
    "dpmpp": DPMSolverMultistepScheduler,
}


def assemble_pipeline(
    vae: Any, text_encoder: Any, tokenizer: Any, unet: Any, scheduler: Any
) -> StableDiffusionPipeline:
    """A Stable Diffusion 1/2 pipeline of these components (other families: their spec's ``assemble``)."""
    return SD.sampling.assemble({"vae": vae, "text_encoder": text_encoder, "unet": unet}, [tokenizer], scheduler)


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


DEFAULT_STEPS = 30
"""Sampling steps where neither the caller, the model nor a run's validation settings give a count."""


@torch.no_grad()
def sample_images(pipe: Any, prompts: Sequence[str], seed: int = 0, steps: int | None = None,
                  guidance: float | None = None, negative_prompt: str | None = None, batch: int = 1,
                  seeds: Sequence[int] | None = None, size: int | None = None,
                  default_steps: int = DEFAULT_STEPS, inputs: dict[str, Sequence[Any]] | None = None,
                  fixed: dict[str, Any] | None = None, edits_at_own_size: bool = False,
                  distilled: bool | None = None, frames: int | None = None) -> list[Image.Image | list[Image.Image]]:
    """One image per prompt; prompt i uses seed + i (or ``seeds[i]``), so adding prompts never changes earlier
    images. ``batch`` prompts run through the model together, each from the noise of its own seed: the same
    images up to floating-point rounding, several times faster for small models on a CPU. `size`: the side in
    pixels (None: the pipeline's default, which for Flux.1 is 1024 px whatever the model trained on). `steps` and
    `guidance` None: the model's own (its family's `Sampling.defaults`, a step-distilled model's where `distilled`,
    None: as the folder the pipeline loaded from says, `is_distilled`), else `default_steps` and SD's 5.
    `inputs`: a list per pipeline argument, one entry per prompt (a ControlNet pipeline's ``image``); `fixed`:
    arguments every call takes as they are (``controlnet_conditioning_scale``). `edits_at_own_size`: a pipeline that
    edits by reference edits each source (``inputs["image"]``) at the source's own size, drawing at that size,
    rather than resize it to the sizes its release prefers (a run's model, which learnt at its training size).
    A video pipeline (Wan's) draws a clip per prompt, a list of frames: `frames` of them (None: its own count)."""
    pipe.set_progress_bar_config(disable=True)
    family = families.of_pipeline(pipe)
    if distilled is None:
        distilled = is_distilled(family, pipe.name_or_path)
    defaults = family.sampling.defaults(getattr(pipe, family.components.denoiser).config, distilled)
    steps = steps or defaults.get("steps", default_steps)
    guidance = defaults["guidance"] if guidance is None else guidance
    # An editing pipeline (InstructPix2Pix's) draws at its source image's size and takes none.
    parameters = set(inspect.signature(pipe.__call__).parameters)
    reference = family.reference if family.reference and isinstance(pipe, family.reference.pipeline_class) else None
    if family.edits_only and not (inputs or {}).get("image"):
        raise UserError(f"{family.title} edits images and draws none from a prompt alone: give it the image to edit "
                        "(`generate --image BEFORE.png`)")
    shape = {"height": size, "width": size} if size and {"height", "width"} <= parameters else {}
    if frames and "num_frames" in parameters:
        shape["num_frames"] = frames
    seeds = list(seeds) if seeds is not None else [seed + i for i in range(len(prompts))]
    # An image-to-video pipeline (Wan 2.2 TI2V's) takes one first frame a call, not a list.
    first_frame = family.sampling.image_pipeline_class is not None \
        and isinstance(pipe, family.sampling.image_pipeline_class)
    batch = 1 if first_frame else batch
    images = []
    for start in range(0, len(prompts), batch):
        chunk = list(prompts[start:start + batch])
        generators = [torch.Generator(pipe.device).manual_seed(s) for s in seeds[start:start + batch]]
        arguments = family.sampling.arguments(pipe, guidance, negative_prompt)
        if arguments.get("negative_prompt") is not None:
            arguments["negative_prompt"] = [arguments["negative_prompt"]] * len(chunk)
        # By name: Flux.2's pipelines take reference images first.
        given = {name: values[start] if first_frame else list(values[start:start + batch])
                 for name, values in (inputs or {}).items()}
        drawn, editing = shape, contextlib.nullcontext({})
        if shape and "max_area" in parameters:
            # Kontext's pipeline scales its output to this area (a megapixel else), at the aspect of its height and
            # width: an edit's source's (a bucketed run's), else square.
            width, height = given["image"][0].size if given.get("image") else (size, size)
            drawn = {"height": height, "width": width, "max_area": size * size}
        if edits_at_own_size and given.get("image") and reference is not None:
            width, height = given["image"][0].size
            drawn = {**drawn, "height": height, "width": width}
            editing = reference.at_own_size(given["image"])
        with editing as own_size:
            result = pipe(prompt=chunk, num_inference_steps=steps, generator=generators, output_type="pil", **drawn,
                          **arguments, **given, **(fixed or {}), **own_size)
        # A video pipeline's output holds each prompt's frames.
        images += [list(clip) for clip in result.frames] if hasattr(result, "frames") else result.images
    return images


PREVIEW_STEPS = 20
"""Sampling steps of a run's validation images when ``validation.steps`` is unset and the model has no count of its
own; `generate` on the run (or on its export) takes the same default, other models get 30."""

SAMPLING_FILE = "sdtrain_sampling.json"
"""Beside an exported pipeline's model_index.json: the settings the run's validation images were sampled with
(`run_sampling`), which `generate` defaults to for that folder."""


def run_sampling(config: RunConfig, distilled: bool = False) -> dict[str, Any]:
    """What a run's validation images sample with where ``validation`` leaves it to the model, as `sample_images`
    takes it: the image side (the training resolution: a pipeline's own default, Flux.1's 1024 px or a pretrained
    UNet's sample_size, may differ), steps and guidance (None: the model's own), the step count without one, and
    whether the model is step-distilled (`distilled`: its base is, `is_distilled`)."""
    val = config.validation
    return {"size": config.data.resolution, "steps": val.steps, "guidance": val.guidance,
            "default_steps": PREVIEW_STEPS, "distilled": distilled, "frames": val.frames}


def sampling_steps(family: families.ModelFamily, denoiser_config: Any, settings: dict[str, Any]) -> int:
    """The step count `sample_images` samples with under `settings` (`run_sampling`'s)."""
    defaults = family.sampling.defaults(denoiser_config, bool(settings.get("distilled")))
    return settings.get("steps") or defaults.get("steps", settings.get("default_steps", DEFAULT_STEPS))


def is_distilled(family: families.ModelFamily, source: str | Path | None) -> bool:
    """Whether the model at `source` (a folder or file; None: none) is step-distilled (`ModelFamily.distilled`): as
    an sdtrain export recorded it (its run's base was), else as its family reads the folder."""
    if source is None:
        return False
    recorded = read_sampling(Path(source)) if Path(source).is_dir() else {}
    return recorded["distilled"] if "distilled" in recorded else family.sampling.distilled(source)


def write_sampling(folder: Path, config: RunConfig, distilled: bool = False) -> Path:
    """Record `run_sampling` in an exported pipeline `folder` (diffusers ignores the file)."""
    path = Path(folder) / SAMPLING_FILE
    atomic_write_text(path, json.dumps(run_sampling(config, distilled), indent=2) + "\n")
    return path


def read_sampling(folder: Path) -> dict[str, Any]:
    """The settings `write_sampling` recorded in a pipeline `folder`; empty when none were (a folder from elsewhere,
    or unreadable: the pipeline's own defaults then apply)."""
    path = Path(folder) / SAMPLING_FILE
    try:
        recorded = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    if not isinstance(recorded, dict):
        return {}
    keep = {"size": int, "steps": int, "guidance": (int, float), "default_steps": int, "frames": int}
    return {**{key: value for key, value in recorded.items()
               if key in keep and isinstance(value, keep[key]) and not isinstance(value, bool)},
            **({"distilled": recorded["distilled"]} if isinstance(recorded.get("distilled"), bool) else {})}


@contextlib.contextmanager
def exact_sampling() -> Iterator[None]:
    """Sampling inside a training process as a fresh one (`sdtrain generate`) does: fp32 matmuls in full precision
    (not TF32, ``train.tf32``) and cuDNN's default convolution algorithms (not the ones ``train.cudnn_benchmark``
    timed), both restored afterwards."""
    precision, benchmark = torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.benchmark = benchmark
