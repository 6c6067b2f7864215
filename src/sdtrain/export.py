"""Turning a run into files other tools read: a diffusers pipeline folder (or a VAE folder).

Export is not checkpointing: a checkpoint is for resuming a run, an export is for using the model.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from sdtrain.checkpoint import latest_checkpoint, load_run_modules, pinned_sources
from sdtrain.config import RunConfig, load_config
from sdtrain.errors import UserError
from sdtrain.models import build
from sdtrain.models.pipeline import assemble_pipeline, sampler_from

log = logging.getLogger(__name__)


def run_config(run_dir: Path) -> RunConfig:
    return load_config(Path(run_dir) / "config.yaml")


def pipeline_from_run(run_dir: Path, ema: bool = True, checkpoint: Path | None = None) -> Any:
    """A StableDiffusionPipeline from a diffusion run: trained weights from its checkpoint, the rest
    from the sources its config names."""
    run_dir = Path(run_dir)
    config = run_config(run_dir)
    if config.stage != "diffusion":
        raise UserError(f"{run_dir}: a {config.stage} run has no pipeline; export it to get its {config.stage} folder")
    checkpoint = checkpoint or latest_checkpoint(run_dir)
    trained = load_run_modules(run_dir, ema=ema, checkpoint=checkpoint)
    pinned = pinned_sources(checkpoint)
    model = config.model

    def component(name: str) -> Any:
        if name in trained:
            return trained[name]
        source = pinned.get(name) or build.component_source(model, name)
        if source is None:
            raise UserError(f"{run_dir}: the {name} was neither trained nor loaded from a folder")
        return build.load_component(name, source)

    tokenizer_source = build.tokenizer_source(model) or run_dir
    tokenizer = build.load_tokenizer(tokenizer_source, model.max_text_length)
    noise = build.build_noise_scheduler(config.diffusion, model.pretrained)
    return assemble_pipeline(component("vae"), component("text_encoder"), tokenizer, component("unet"),
                             sampler_from(noise, "euler"))


def _check_replaceable(out: Path, run_dir: Path) -> None:
    """Only an earlier export may be replaced: never the run itself, nor a folder holding anything else."""
    resolved, run = out.resolve(), run_dir.resolve()
    if resolved == run or run.is_relative_to(resolved) or resolved.is_relative_to(run / "checkpoints"):
        raise UserError(f"--out: {out} would overwrite the run {run_dir}; choose a folder outside it")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out: {out} is a file; choose a folder name")
    if out.is_dir() and any(out.iterdir()):
        is_export = (out / "model_index.json").is_file() or (
            (out / "config.json").is_file() and all(p.name in _VAE_FILES for p in out.iterdir()))
        if not is_export:
            raise UserError(f"--out: {out} is a folder with other contents; choose a new or empty folder")


_VAE_FILES = {"config.json", "diffusion_pytorch_model.safetensors"}


def export_run(run_dir: Path, out: Path, ema: bool = True, checkpoint: Path | None = None) -> Path:
    """Write the run's model to `out`: a pipeline folder for diffusion runs, a VAE folder for autoencoder runs."""
    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"{run_dir}: not an sdtrain run folder (no config.yaml); pass the run_dir of a training run")
    if checkpoint is not None and not (Path(checkpoint) / "meta.json").is_file():
        raise UserError(f"--checkpoint: {checkpoint} is not a checkpoint folder (no meta.json)")
    if checkpoint is None and latest_checkpoint(run_dir) is None:
        raise UserError(f"{run_dir}: no complete checkpoint yet; train the run first")
    _check_replaceable(out, run_dir)
    config = run_config(run_dir)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if config.stage == "diffusion":
        pipeline_from_run(run_dir, ema=ema, checkpoint=checkpoint).save_pretrained(tmp, safe_serialization=True)
    else:
        load_run_modules(run_dir, ["vae"], ema=ema, checkpoint=checkpoint)["vae"].save_pretrained(
            tmp, safe_serialization=True)
    # Swap in the new export only once it is complete.
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    log.info("exported %s -> %s", run_dir, out)
    return out
