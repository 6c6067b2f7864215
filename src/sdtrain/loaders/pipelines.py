"""The pipeline of a diffusion run: its trained modules from a checkpoint, the rest from the sources it pinned, in
its family's diffusers pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sdtrain.checkpoint import latest_checkpoint, pinned_sources, read_meta
from sdtrain.config import DiffusionConfig, ModelConfig, RunConfig, load_config
from sdtrain.errors import UserError
from sdtrain.loaders.adapters import merge_partial
from sdtrain.loaders.components import load_component, load_run_modules
from sdtrain.models import build, families, single_file
from sdtrain.models.pipeline import assemble_pipeline, sampler_from
from sdtrain.models.tokenizer import load_clip_tokenizer


def run_config(run_dir: Path) -> RunConfig:
    return load_config(Path(run_dir) / "config.yaml")


def pipeline_from_run(run_dir: Path, ema: bool = True, checkpoint: Path | None = None,
                      trained: dict[str, Any] | None = None) -> Any:
    """The family's pipeline (StableDiffusionPipeline, StableDiffusionXLPipeline) from a diffusion run: trained
    weights from its checkpoint (or `trained`, the checkpoint's modules already loaded), the rest from the sources
    its config names."""
    run_dir = Path(run_dir)
    config = run_config(run_dir)
    if config.stage != "diffusion":
        raise UserError(f"{run_dir}: a {config.stage} run has no pipeline; export it to get its {config.stage} folder")
    checkpoint = checkpoint or latest_checkpoint(run_dir)
    if trained is None:
        trained = load_run_modules(run_dir, ema=ema, checkpoint=checkpoint)
    trained = {name: merge_partial(m) for name, m in trained.items()}
    pinned = pinned_sources(checkpoint)
    model = config.model
    trust = build.trusts_pickle(model)
    family = families.for_model(model)

    def component(name: str) -> Any:
        if name in trained:
            return trained[name]
        source = pinned.get(name) or build.component_source(model, name)
        if source is None:
            raise UserError(f"{run_dir}: the {name} was neither trained nor loaded from a folder")
        return load_component(name, source, trust_pickle=trust, family=family, served=model)

    tokenizers = build.load_text_tokenizers(model, run_dir, pinned.get("text_encoder"))
    added_tokens = read_meta(checkpoint).get("task", {}).get("tokens")
    if added_tokens:  # textual inversion: the merged text encoders' new rows belong to these
        for tokenizer in tokenizers:
            tokenizer.add_tokens(added_tokens)
    noise = build.build_noise_scheduler(config.diffusion, model)
    return family.assemble({name: component(name) for name in family.components}, tokenizers,
                           sampler_from(noise, "euler"))


def pipeline_from_file(path: str | Path, family: families.ModelFamily, tokenizer: str | Path | None = None) -> Any:
    """The family's pipeline from ONE file holding the whole model (SD3's, with its text encoders): every component
    from the file, the tokenizers from `tokenizer` or beside it (OUT.tokenizer/, OUT.tokenizer_2/...), the sampler
    of the schedule its family was released with."""
    model = ModelConfig(pretrained=str(path), tokenizer=str(tokenizer) if tokenizer else None)
    # The tokenizers first: a missing one is said before the weights are read.
    tokenizers = build.load_text_tokenizers(model)
    components = {name: load_component(name, path, family=family, served=model) for name in family.components}
    noise = build.build_noise_scheduler(DiffusionConfig(), model)
    return family.assemble(components, tokenizers, sampler_from(noise, "euler"))


def load_single_file_pipeline(path: str | Path, tokenizer: str | Path | None = None,
                              trust_pickle: bool | None = None, tokenizer_2: str | Path | None = None) -> Any:
    """A StableDiffusionPipeline (StableDiffusionXLPipeline for an SDXL file) from a single file: its components
    as `load_single_file_component` reads them, the tokenizers from `tokenizer` and `tokenizer_2` (or the file's
    OUT.tokenizer/ and OUT.tokenizer_2/ siblings), an Euler sampler on its noise schedule."""
    from diffusers import DDPMScheduler

    xl = single_file.inspect_single_file(path, trust_pickle).family == "sdxl"
    # The tokenizers first: a missing one is said before the weights are read.
    tok = load_clip_tokenizer(Path(tokenizer or single_file.tokenizer_for(path)))
    tok_2 = load_clip_tokenizer(Path(tokenizer_2 or single_file.tokenizer_for(path, 2))) if xl else None
    names = ("vae", "text_encoder", "text_encoder_2", "unet") if xl else ("vae", "text_encoder", "unet")
    modules = {name: single_file.load_single_file_component(name, path, trust_pickle) for name in names}
    noise = DDPMScheduler.from_config(single_file.scheduler_config(path, trust_pickle))
    sampler = sampler_from(noise, "euler")
    if not xl:
        return assemble_pipeline(modules["vae"], modules["text_encoder"], tok, modules["unet"], sampler)
    from diffusers import StableDiffusionXLPipeline

    # No invisible watermark: it needs a package sdtrain does not install, and changes the images it returns.
    return StableDiffusionXLPipeline(vae=modules["vae"], text_encoder=modules["text_encoder"],
                                     text_encoder_2=modules["text_encoder_2"], tokenizer=tok, tokenizer_2=tok_2,
                                     unet=modules["unet"], scheduler=sampler, add_watermarker=False)
