"""Images from prompts, with a pipeline folder or straight from a run."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sdtrain.errors import UserError, first_line
from sdtrain.loaders.pipelines import pipeline_from_file, pipeline_from_run, run_config, run_distilled
from sdtrain.loaders.writers import LOAD_INTO_KEY, LORA_WEIGHTS
from sdtrain.models import build, families, hub
from sdtrain.models.pipeline import DEFAULT_STEPS, read_sampling, run_sampling, sample_images, sampler_from
from sdtrain.models.single_file import TRUST_PICKLE_ENV, trust_pickle_from_env
from sdtrain.run import resolve_device
from sdtrain.utils import make_grid, save_image_atomic, save_images, still


def local_model(model: str | Path, tokenizer: str | Path | None = None) -> tuple[str, str | None]:
    """`model` (and a single file's `tokenizer`) as local paths: a Hub id (org/name[@revision], or a file in it)
    becomes its folder in the Hugging Face cache, fetched if it is not cached (``sdtrain.models.hub``)."""
    local = hub.resolve(str(model), "--model", pickles=hub.pickles_trusted())
    assert local is not None
    return local, hub.resolve(str(tokenizer), "--tokenizer", weights=()) if tokenizer is not None else None


def load_pipeline(model: str | Path, ema: bool = True, device: str = "auto",
                  tokenizer: str | Path | None = None) -> Any:
    """The pipeline of a pipeline folder, single file or diffusion run, or of a Hub id (see `local_model`)."""
    model, tokenizer = local_model(model, tokenizer)
    kind = build.source_kind(model)
    if kind == "run":
        pipe = pipeline_from_run(Path(model), ema=ema)
    elif kind == "single_file":
        pipe = pipeline_from_file(model, tokenizer)
    elif kind == "pipeline":
        trusted = trust_pickle_from_env()
        try:
            family = families.detect(model)
            pipe = family.sampling.pipeline_from_folder(model, local_files_only=True,
                                                        use_safetensors=not trusted or None)
        except (OSError, ValueError) as exc:
            hint = "" if trusted else (f"; a pipeline with pickled .bin weights loads with {TRUST_PICKLE_ENV}=1 "
                                       "if you trust it")
            raise UserError(f"--model: {model}: cannot load the pipeline ({first_line(exc)}){hint}") from exc
    else:
        raise UserError(f"--model: {model} is a single component; pass a pipeline folder, a single-file "
                        "checkpoint or a diffusion run")
    return pipe.to(resolve_device(device))


def load_adapters(pipe: Any, folder: Path, weight: str | None, name: str) -> None:
    """The adapters of `folder`'s file `weight` (None: diffusers' default name) into `pipe` as adapter `name`: the
    pipeline's load_lora_weights, or for a LoKr file (which it refuses for most families) each adapted component's
    load_lora_adapter, which rebuilds LoKr from the file's metadata. A file with DoRA's ``dora_scale`` is refused:
    load_lora_weights drops those magnitudes and applies the rest."""
    from safetensors import SafetensorError, safe_open

    file = folder / (weight or LORA_WEIGHTS)
    into: dict[str, bool] = {}
    if file.suffix == ".safetensors" and file.is_file():
        try:
            with safe_open(str(file), framework="pt") as handle:
                keys = list(handle.keys())
                target = (handle.metadata() or {}).get(LOAD_INTO_KEY)
        except SafetensorError as exc:
            raise ValueError(f"unreadable ({first_line(exc)})") from exc
        if any(key.endswith(".dora_scale") for key in keys):
            raise ValueError(f"diffusers drops its DoRA magnitudes (dora_scale) and would apply the rest; pass "
                             f"the folder `sdtrain export` wrote, whose {LORA_WEIGHTS} diffusers reads whole")
        components = list(dict.fromkeys(key.split(".", 1)[0] for key in keys))
        # A LoKr file of component names (diffusers'; a kohya one goes to load_lora_weights, which names it).
        if any(".lokr_" in key for key in keys) and all(hasattr(pipe, c) for c in components):
            for component in components:
                getattr(pipe, component).load_lora_adapter(folder, prefix=component, weight_name=file.name,
                                                          adapter_name=name, local_files_only=True)
            return
        if target is not None:
            if not hasattr(pipe, target):
                raise ValueError(f"its adapters belong to the pipeline's {target}, which this pipeline has not")
            into = {f"load_into_{target}": True}  # a model of experts' second expert (diffusers' keyword)
    pipe.load_lora_weights(folder, weight_name=weight, adapter_name=name, local_files_only=True, **into)


def apply_additions(pipe: Any, loras: Sequence[str | Path] = (), lora_scale: float = 1.0,
                    embeddings: Sequence[str | Path] = ()) -> None:
    """LoRA adapters (a folder with pytorch_lora_weights.safetensors, or any LoRA .safetensors file diffusers
    reads, kohya's included) and textual-inversion embeddings, as diffusers' own loaders apply them."""
    names = []
    for i, lora in enumerate(loras):
        path = Path(lora)
        if not path.exists():
            raise UserError(f"--lora: {path} not found; pass the folder `sdtrain export` wrote or a .safetensors file")
        folder, weight = (path.parent, path.name) if path.is_file() else (path, None)
        try:
            load_adapters(pipe, folder, weight, f"lora{i}")
        except (OSError, ValueError, KeyError) as exc:
            raise UserError(f"--lora: {path}: not a LoRA diffusers can load ({first_line(exc)})") from exc
        names.append(f"lora{i}")
    if names:
        pipe.set_adapters(names, adapter_weights=[lora_scale] * len(names))
    for embedding in embeddings:
        path = Path(embedding)
        if path.is_dir():
            path = path / "learned_embeds.safetensors"
        if not path.is_file():
            raise UserError(f"--embedding: {path} not found; pass a learned_embeds.safetensors file or its folder")
        if path.suffix != ".safetensors":
            raise UserError(f"--embedding: {path}: only .safetensors embeddings are read (pickle files can run code)")
        try:
            families.of_pipeline(pipe).files.load_embedding(pipe, str(path))
        except (OSError, ValueError, KeyError) as exc:
            raise UserError(f"--embedding: {path}: cannot load ({first_line(exc)})") from exc


def open_images(option: str, paths: Sequence[str | Path]) -> list[Any]:
    """The images at `paths` as RGB; one that is not an image is one line naming it and `option`."""
    from PIL import Image

    opened = []
    for path in map(Path, paths):
        try:
            with Image.open(path) as img:
                opened.append(img.convert("RGB"))
        except (OSError, Image.DecompressionBombError) as exc:
            raise UserError(f"{option}: {path}: not an image ({first_line(exc)})") from exc
    return opened


def fit_area(image: Any, side: int, multiple: int = 16) -> Any:
    """`image` resized to about `side` x `side` pixels of area at its own aspect, each side a multiple of
    `multiple` (what the editing pipelines round to)."""
    scale = side / (image.width * image.height) ** 0.5
    width, height = (max(multiple, round(v * scale / multiple) * multiple) for v in (image.width, image.height))
    return image if (width, height) == image.size else image.resize((width, height))


def with_controlnet(pipe: Any, controlnet: str | Path, images: Sequence[str | Path]) -> tuple[Any, list[Any]]:
    """`pipe` as its family's ControlNet pipeline with the ControlNet folder `controlnet` (what `sdtrain export` of a
    ControlNet run writes as OUT/controlnet), and the conditioning `images`, opened as RGB."""
    family = families.of_pipeline(pipe)
    spec = families.mode_spec(family, "controlnet", "--controlnet", "hosts no ControlNet")
    if not images:
        raise UserError("--controlnet: pass the conditioning image(s) it follows with --control-image PNG")
    folder = Path(controlnet)
    if not (folder / "config.json").is_file():
        raise UserError(f"--controlnet: {folder} is not a ControlNet folder (no config.json); pass OUT/controlnet "
                        "that `sdtrain export` wrote")
    maps = open_images("--control-image", images)
    model = spec.model_class.from_pretrained(folder, local_files_only=True).to(pipe.device)
    return spec.pipeline_class.from_pipe(pipe, controlnet=model), maps


def run_sampling_of(model: str | Path) -> dict[str, Any]:
    """What the run behind `model` sampled its validation images with (models.pipeline.run_sampling): read from the
    run itself, or as its export recorded it in a pipeline folder; empty for other models, whose pipeline knows its
    own defaults (a Hub id among them)."""
    if not Path(model).exists():
        return {}  # a Hub id, or a path load_pipeline names as missing
    kind = build.source_kind(model)
    if kind == "run":
        return run_sampling(run_config(Path(model)), run_distilled(Path(model)))
    return read_sampling(Path(model)) if kind == "pipeline" else {}


def training_size(model: str | Path) -> int | None:
    """The image side a run trained at (its images are sampled at it), for the run or its exported pipeline; None
    for other sources, whose pipeline knows its own default."""
    return run_sampling_of(model).get("size")


def generate(model: str | Path, prompts: Sequence[str], out: Path, steps: int | None = None,
             guidance: float | None = None,
             seed: int = 0, scheduler: str = "euler", ema: bool = True, device: str = "auto",
             negative_prompt: str | None = None, loras: Sequence[str | Path] = (), lora_scale: float = 1.0,
             embeddings: Sequence[str | Path] = (), tokenizer: str | Path | None = None,
             size: int | None = None, controlnet: str | Path | None = None,
             control_images: Sequence[str | Path] = (), control_scale: float = 1.0,
             images: Sequence[str | Path] = (), frames: int | None = None) -> list[Path]:
    """Images of `prompts` into `out`, one file each plus a grid. Unset `size`, `steps` and `guidance` are, for a run
    or a pipeline its export recorded them in, those its validation images sampled with (so they match image for
    image: prompt i from seed + i), else the pipeline's default size and the model's own (see sample_images). With
    `controlnet` (a ControlNetModel folder), each prompt is drawn following one of `control_images` in turn; with
    `images`, a model that edits (Flux.1 Kontext's pipeline, InstructPix2Pix's) edits one of them per prompt in
    turn. A video model draws a clip per prompt (`frames` of them; unset: what the run's validation drew, else its
    pipeline's count), written as an mp4, the grid showing a strip of its frames."""
    if not prompts:
        raise UserError("no prompts: pass --prompt TEXT or --prompts FILE with one prompt per line")
    recorded = run_sampling_of(model)
    size = size or recorded.get("size")
    steps = steps or recorded.get("steps")
    guidance = recorded.get("guidance") if guidance is None else guidance
    pipe = load_pipeline(model, ema=ema, device=device, tokenizer=tokenizer)
    apply_additions(pipe, loras, lora_scale, embeddings)
    pipe.scheduler = sampler_from(pipe.scheduler, scheduler)
    inputs = fixed = None
    if controlnet is not None:
        pipe, maps = with_controlnet(pipe, controlnet, control_images)
        inputs = {families.of_pipeline(pipe).controlnet.image_argument: [maps[i % len(maps)]
                                                                        for i in range(len(prompts))]}
        fixed = {"controlnet_conditioning_scale": control_scale}
    if images:
        if controlnet is not None:
            raise UserError("--image: a ControlNet draws from text and its maps (--control-image); --image is for a "
                            "model that edits: pass one of the two")
        drawing = families.of_pipeline(pipe).sampling.image_pipeline_class
        if "image" not in inspect.signature(pipe.__call__).parameters and drawing is not None:
            pipe = drawing.from_pipe(pipe)  # image-to-video from the same components (Wan 2.2 TI2V's)
        if "image" not in inspect.signature(pipe.__call__).parameters:
            raise UserError(f"--image: {type(pipe).__name__} edits no image; pass a model that edits (a Flux.1 "
                            "Kontext or InstructPix2Pix one, or a run trained with edit.reference)")
        sources = open_images("--image", images)
        if recorded and size:
            # A run (or its export) learnt to edit images of its training size: each is fitted to that area, and
            # a pipeline that would resize it to its release's preferred sizes (Kontext's) is told not to.
            sources = [fit_area(source, size) for source in sources]
        inputs = {"image": [sources[i % len(sources)] for i in range(len(prompts))]}
    images = sample_images(pipe, prompts, seed=seed, steps=steps, guidance=guidance,
                           negative_prompt=negative_prompt, size=size,
                           default_steps=recorded.get("default_steps", DEFAULT_STEPS), inputs=inputs, fixed=fixed,
                           edits_at_own_size=bool(recorded and size), distilled=recorded.get("distilled"),
                           frames=frames or recorded.get("frames"))
    out = Path(out)
    paths = save_images(images, prompts, out)
    rows = max(1, round(len(images) ** 0.5))
    paths.append(save_image_atomic(make_grid([still(image) for image in images], rows=rows, labels=prompts),
                                   out / "grid.png"))
    return paths
