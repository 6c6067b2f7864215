"""Turning a run into files other tools read: a diffusers pipeline folder (or a VAE folder), or one
``.safetensors`` file in the original layout that A1111/ComfyUI and diffusers' from_single_file read (Stable
Diffusion's whole model; Flux.1's transformer alone, as Black Forest Labs ship it).

Export is not checkpointing: a checkpoint is for resuming a run, an export is for using the model. Every export
has its model card beside it (README.md, see sdtrain.model_card).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sdtrain.checkpoint import latest_checkpoint, pinned_sources, read_meta
from sdtrain.config import RunConfig
from sdtrain.errors import UserError
from sdtrain.loaders.adapters import merge_partial
from sdtrain.loaders.components import load_run_modules
from sdtrain.loaders.pipelines import base_distilled, pipeline_from_run, run_config
from sdtrain.loaders.writers import CONTROLNET, LEARNED_EMBEDS, LORA_WEIGHTS, save_trained_parts
from sdtrain.model_card import FOLDER_FILES, write_file_card, write_folder_card
from sdtrain.models import build, families, single_file
from sdtrain.models.pipeline import write_sampling

log = logging.getLogger(__name__)


def _check_replaceable(out: Path, run_dir: Path) -> None:
    """Only an earlier export may be replaced: never the run itself, nor a folder holding anything else."""
    resolved, run = out.resolve(), run_dir.resolve()
    if resolved == run or run.is_relative_to(resolved) or resolved.is_relative_to(run / "checkpoints"):
        raise UserError(f"--out: {out} would overwrite the run {run_dir}; choose a folder outside it")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out: {out} is a file; choose a folder name")
    if out.is_dir() and any(out.iterdir()):
        is_export = (out / "model_index.json").is_file() or any((out / f).is_file() for f in _PART_FILES) or (
            (out / "config.json").is_file() and all(p.name in _VAE_FILES for p in out.iterdir()))
        if not is_export:
            raise UserError(f"--out: {out} is a folder with other contents; choose a new or empty folder")


_VAE_FILES = {"config.json", "diffusion_pytorch_model.safetensors", *FOLDER_FILES}
_PART_FILES = (LORA_WEIGHTS, LEARNED_EMBEDS)


def is_partial_run(checkpoint: Path) -> bool:
    """Whether the run trained only parts of its modules (adapters, embeddings)."""
    return any(spec.get("partial") for spec in read_meta(checkpoint)["modules"].values())


def _export_trained_parts(run_dir: Path, config: RunConfig, folder: Path, ema: bool, checkpoint: Path,
                          full_pipeline: bool | None) -> None:
    """A fine-tuning run's own files (LoRA adapters, learned embeddings), and the whole pipeline with them
    merged in under ``pipeline/`` when asked."""
    folder.mkdir(parents=True)
    modules = load_run_modules(run_dir, ema=ema, checkpoint=checkpoint)
    save_trained_parts(modules, read_meta(checkpoint), folder)
    if full_pipeline is None:
        full_pipeline = config.textual_inversion.save_as_full_pipeline if "textual_inversion" in config.modes \
            else config.lora.save_merged
    if full_pipeline:
        pipeline_from_run(run_dir, ema=ema, checkpoint=checkpoint, trained=modules).save_pretrained(
            folder / "pipeline", safe_serialization=True)
        write_sampling(folder / "pipeline", config, base_distilled(config, pinned_sources(checkpoint)))


def export_run(run_dir: Path, out: Path, ema: bool = True, checkpoint: Path | None = None,
               full_pipeline: bool | None = None, card: bool = True, license: str | None = None) -> Path:
    """Write the run's model to `out`: a pipeline folder for diffusion runs (the adapter or embedding files
    for LoRA and textual-inversion runs, plus the merged pipeline when `full_pipeline` or the run's config
    asks), a VAE folder for autoencoder runs; with its model card (README.md, unless not `card`; `license` a Hub
    license id, else the base model's when its card is on disk)."""
    run_dir, out = Path(run_dir), Path(out)
    checkpoint = _checkpoint_to_export(run_dir, checkpoint)
    _check_replaceable(out, run_dir)
    config = run_config(run_dir)

    def write(tmp: Path) -> None:
        if config.stage == "diffusion" and read_meta(checkpoint).get("task", {}).get(CONTROLNET):
            # A ControlNet is used beside its base: its folder, as diffusers' ControlNetModel.from_pretrained and
            # ComfyUI's ControlNet loader read it, and the files of the adapters trained on the base beside it
            # (mode [controlnet, lora]), which the base's pipeline loads.
            modules = load_run_modules(run_dir, ema=ema, checkpoint=checkpoint)
            modules.pop(CONTROLNET).save_pretrained(tmp / CONTROLNET, safe_serialization=True)
            save_trained_parts(modules, read_meta(checkpoint), tmp)
        elif config.stage == "diffusion" and is_partial_run(checkpoint):
            _export_trained_parts(run_dir, config, tmp, ema, checkpoint, full_pipeline)
        elif config.stage == "diffusion":
            pipeline_from_run(run_dir, ema=ema, checkpoint=checkpoint).save_pretrained(tmp, safe_serialization=True)
            # generate's defaults from the folder are then those of the run's previews (size, steps, guidance).
            write_sampling(tmp, config, base_distilled(config, pinned_sources(checkpoint)))
        else:
            load_run_modules(run_dir, ["vae"], ema=ema, checkpoint=checkpoint)["vae"].save_pretrained(
                tmp, safe_serialization=True)
        if card:
            log.info("model card: %s", write_folder_card(tmp, out, run_dir, checkpoint, ema=ema, license=license))

    _swap_in_folder(out, write)
    log.info("exported %s -> %s", run_dir, out)
    return out


def _checkpoint_to_export(run_dir: Path, checkpoint: Path | None) -> Path:
    """The given checkpoint, or the run's newest; a UserError naming what is wrong otherwise."""
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"{run_dir}: not an sdtrain run folder (no config.yaml); pass the run_dir of a training run")
    if checkpoint is not None and not (Path(checkpoint) / "meta.json").is_file():
        raise UserError(f"--checkpoint: {checkpoint} is not a checkpoint folder (no meta.json)")
    checkpoint = checkpoint or latest_checkpoint(run_dir)
    if checkpoint is None:
        raise UserError(f"{run_dir}: no complete checkpoint yet; train the run first")
    return Path(checkpoint)


def _swap_in_folder(out: Path, write: Callable[[Path], None]) -> None:
    """`write` fills a temporary sibling folder; it replaces `out` only once complete."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)


def _check_replaceable_file(out: Path, run_dir: Path) -> None:
    """A single file may replace only an earlier single-file export, never the run or anything else."""
    if out.resolve().is_relative_to(run_dir.resolve() / "checkpoints"):
        raise UserError(f"--out: {out} is inside the run's checkpoints; choose a path outside them")
    if out.suffix.lower() != ".safetensors":
        raise UserError(f"--out: {out}: a single file is written as .safetensors; name it OUT.safetensors")
    if out.is_dir():
        raise UserError(f"--out: {out} is a folder; choose a file name")
    if out.exists() and not single_file.written_by_sdtrain(out):
        raise UserError(f"--out: {out} exists and is not an earlier sdtrain single-file export; choose a new name")
    tokenizer = single_file.tokenizer_folder(out)
    if tokenizer.exists() and not (tokenizer / "tokenizer_config.json").is_file():
        raise UserError(f"--out: {tokenizer} exists and is not a tokenizer folder; move it or choose another name")


def export_single_file(run_dir: Path, out: Path, ema: bool = True, checkpoint: Path | None = None,
                       half: bool = False, text_layout: str = "auto", card: bool = True,
                       license: str | None = None) -> Path:
    """`_write_single_file`, then its model card: README.md when the file has its folder to itself, else
    OUT.md (see sdtrain.model_card.write_file_card), unless not `card`."""
    run_dir, out = Path(run_dir), Path(out)
    checkpoint = _checkpoint_to_export(run_dir, checkpoint)
    _write_single_file(run_dir, out, ema, checkpoint, half, text_layout)
    if card:
        written = write_file_card(out, run_dir, checkpoint, ema=ema, half=half, license=license)
        if written is not None:
            log.info("model card: %s", written)
    return out


def _write_single_file(run_dir: Path, out: Path, ema: bool = True, checkpoint: Path | None = None,
                       half: bool = False, text_layout: str = "auto") -> Path:
    """Write the run's model as ONE .safetensors file in its family's original layout (`SingleFileLayout`): the
    whole model (Stable Diffusion's, SDXL's, SD3's), its tokenizers beside it as OUT.tokenizer/, OUT.tokenizer_2/...,
    or the part a layout holds (Flux.1's and Z-Image's transformer alone, adapters merged in). `text_layout` picks
    the text encoder's layout where the family has several (SD's CLIP or OpenCLIP; 'auto' as the text encoder came).
    An autoencoder run gives a VAE-only file (bare ``encoder.*``/``decoder.*`` keys). EMA weights by default, fp32
    unless `half` (the layout's half dtype). The file is written under a temporary name and renamed.
    """
    run_dir, out = Path(run_dir), Path(out)
    checkpoint = _checkpoint_to_export(run_dir, checkpoint)
    _check_replaceable_file(out, run_dir)
    config = run_config(run_dir)
    if config.stage != "diffusion":
        vae = load_run_modules(run_dir, ["vae"], ema=ema, checkpoint=checkpoint)["vae"]
        # A VAE alone is kept as every family's VAE files are: in Stable Diffusion's original layout.
        families.SD.files.single_file.write(out, {"vae": vae}, half=half, scheduler=None, text_layout="auto",
                                            text_source=None)
        log.info("exported %s -> %s", run_dir, out)
        return out
    # The family the run trained, as its checkpoint records it (the config's sources may have moved since).
    family = families.detect(checkpoint)
    layout = family.files.single_file
    if layout is None:
        raise UserError(f"{run_dir}: a {family.title} run; {family.title} has no single-file layout sdtrain writes: "
                        "export the diffusers folder (sdtrain export RUN OUT)")
    if text_layout != "auto" and not layout.text_layouts:
        holds_text = layout.holds is None or any(name in family.components.text_encoders for name in layout.holds)
        what = "keeps its text encoders in one layout" if holds_text else \
            f"holds the {' and '.join(layout.holds or ())} alone, no text encoder"
        raise UserError(f"--text-layout: a {family.title} single file {what}; drop the option")
    model = config.model
    out.parent.mkdir(parents=True, exist_ok=True)
    if layout.holds is not None:
        components = _held_components(run_dir, family, layout.holds, ema, checkpoint)
    else:
        pipe = pipeline_from_run(run_dir, ema=ema, checkpoint=checkpoint)
        components = {name: getattr(pipe, name) for name in family.components}
        # Beside the file, as OUT.tokenizer/, OUT.tokenizer_2/...: a single file holds none.
        _write_tokenizers(out, [getattr(pipe, name) for name in family.components.tokenizers])
    # The training noise schedule (not the pipeline's sampler): a DDPM file keeps its prediction type and betas.
    noise = build.build_noise_scheduler(config.diffusion, model)
    text_source = pinned_sources(checkpoint).get("text_encoder") or build.component_source(model, "text_encoder")
    layout.write(out, components, half=half, scheduler=noise, text_layout=text_layout, text_source=text_source)
    held = "" if layout.holds is None else f" ({' and '.join(layout.holds)} alone; the rest is the pipeline folder's " \
        f"`sdtrain export {run_dir} OUT` writes)"
    log.info("exported %s -> %s%s", run_dir, out, held)
    return out


def _held_components(run_dir: Path, family: families.ModelFamily, held: tuple[str, ...], ema: bool,
                     checkpoint: Path) -> dict[str, Any]:
    """The components a partial single file holds (Flux.1's transformer alone), as the run trained them, adapters
    merged in; a run that trained none of them, or more than they are, is said."""
    trained = list(read_meta(checkpoint)["modules"])
    missing = [name for name in held if name not in trained]
    if missing:
        raise UserError(f"{run_dir}: this run trained {', '.join(trained)}, not the {' and '.join(missing)}, which "
                        f"is what a {family.title} single file holds; export the diffusers folder instead "
                        "(sdtrain export RUN OUT)")
    others = [name for name in trained if name not in held]
    if others:
        log.warning("%s: the run also trained %s, which a %s single file does not hold; use them from the "
                    "diffusers folder `sdtrain export %s OUT` writes", run_dir, ", ".join(others), family.title,
                    run_dir)
    modules = load_run_modules(run_dir, list(held), ema=ema, checkpoint=checkpoint)
    return {name: merge_partial(module) for name, module in modules.items()}


def _write_tokenizers(out: Path, tokenizers: list) -> None:
    for index, tokenizer in enumerate(tokenizers, 1):
        _swap_in_folder(single_file.tokenizer_folder(out, index), tokenizer.save_pretrained)
