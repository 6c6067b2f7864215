"""The pipeline of a diffusion run: its trained modules from a checkpoint, the rest from the sources it pinned, in
its family's diffusers pipeline."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from sdtrain.checkpoint import latest_checkpoint, pinned_sources, read_meta
from sdtrain.config import ComponentConfig, DiffusionConfig, ModelConfig, RunConfig, load_config
from sdtrain.errors import UserError
from sdtrain.loaders.adapters import merge_partial
from sdtrain.loaders.components import load_component, load_run_modules
from sdtrain.loaders.writers import INSTRUCT_PIX2PIX, REFERENCE_EDIT
from sdtrain.models import build, families
from sdtrain.models.pipeline import is_distilled, sampler_from


def run_config(run_dir: Path) -> RunConfig:
    return load_config(Path(run_dir) / "config.yaml")


def base_distilled(config: RunConfig, pinned: dict[str, str]) -> bool:
    """Whether the base a run's denoiser came from (its pinned source, else the config's) is step-distilled
    (models.pipeline.is_distilled): the run's model samples as it does."""
    family = families.for_model(config.model)
    denoiser = family.components.denoiser
    return is_distilled(family, pinned.get(denoiser) or build.component_source(config.model, denoiser))


def run_distilled(run_dir: Path) -> bool:
    """`base_distilled` of the run at `run_dir`, from the sources its newest checkpoint pinned."""
    return base_distilled(run_config(run_dir), pinned_sources(latest_checkpoint(Path(run_dir))))


def place_experts(family: families.ModelFamily, model: ModelConfig, components: dict[str, Any],
                  source: str | None, load: Callable[[str], Any]) -> tuple[dict[str, Any], float | None]:
    """For a family of experts (`ModelFamily.experts`), `components` (the trained expert under the denoiser's name)
    with each expert in its own folder's place: the trained one (`model.expert`) in its expert's, every other
    loaded with `load` from the base's folder of it (`build.other_experts`; `source`: the trained expert's), or,
    where the base holds none (a model from scratch), the trained one standing for it too. Returns them and the
    base's boundary (None: the family's, or a family without experts, whose `components` come back as they are)."""
    experts = family.experts
    if experts is None:
        return components, None
    trained = components[family.components.denoiser]
    placed = dict(components)
    for folder, other in build.other_experts(model, source).items():
        placed[folder] = trained if other is None else load(other)
    placed[experts.folder(model.expert)] = trained
    return placed, experts.boundary(source or model.pretrained)


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
    # A model of experts: the one the run trained in its own place, the others from the base it trained on.
    denoiser = family.components.denoiser
    components, boundary = place_experts(
        family, model, {name: component(name) for name in family.components},
        pinned.get(denoiser) or build.component_source(model, denoiser),
        lambda source: load_component(denoiser, source, trust_pickle=trust, family=family, served=model))
    pipe = family.sampling.assemble(components, tokenizers, sampler_from(noise, "euler"),
                                    distilled=base_distilled(config, pinned))
    if boundary is not None:
        pipe.register_to_config(**{family.experts.boundary_key: boundary})
    task = read_meta(checkpoint).get("task", {})
    if task.get(INSTRUCT_PIX2PIX):  # a denoiser that edits: its own pipeline
        pipe = family.instruct.pipeline_class.from_pipe(pipe)
    elif task.get(REFERENCE_EDIT):
        pipe = family.editing_pipeline(pipe)
    return pipe


def pipeline_from_file(path: str | Path, tokenizer: str | Path | None = None) -> Any:
    """The pipeline of ONE file holding a whole model in its family's original layout (Stable Diffusion's,
    SDXL's, SD3's): every component read from the file by its family's layout, the tokenizers from `tokenizer` or
    beside it (OUT.tokenizer/, OUT.tokenizer_2/...), the sampler of the noise schedule the file says or its family
    was released with. A file of part of a model (Flux.1's transformer alone) is one line saying what to use."""
    family = families.detect(path)
    layout = family.files.single_file
    if layout is None or layout.holds is not None:
        held = f"{family.title}'s {' and '.join(layout.holds)} alone" if layout else f"a {family.title} file"
        raise UserError(f"--model: {path} holds {held}, not a whole pipeline; pass a {family.title} pipeline folder "
                        "(for a trained file, the one `sdtrain export RUN OUT` writes from its run)")
    named = {"tokenizer": ComponentConfig(source=str(tokenizer))} if tokenizer else {}
    model = ModelConfig(pretrained=str(path), family=family.name, components=named)
    # The tokenizers first: a missing one is said before the weights are read.
    tokenizers = build.load_text_tokenizers(model)
    components = {name: load_component(name, path, family=family, served=model) for name in family.components}
    noise = build.build_noise_scheduler(DiffusionConfig(), model)
    pipe = family.sampling.assemble(components, tokenizers, sampler_from(noise, "euler"))
    denoiser = components[family.components.denoiser]
    if family.instruct is not None and denoiser.config.in_channels > family.codec.channels(components["vae"].config):
        # A denoiser that reads more than its latents was widened to edit (an InstructPix2Pix file).
        pipe = family.instruct.pipeline_class.from_pipe(pipe)
    return pipe
