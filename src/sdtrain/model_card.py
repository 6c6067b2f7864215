"""Model cards for exports: the ``README.md`` the Hugging Face Hub reads, beside what ``sdtrain export`` writes.

Its YAML front-matter names the base model (a Hub id only: a local path is never written there, see
`hub_model_id`), the library, the license when the base model's card on disk states one (or ``--license``), tags
(the family, the mode, sdtrain), ``instance_prompt`` (DreamBooth's prompt, a textual inversion's token) and a
``widget`` entry for the run's validation grid, copied beside the card. Its body says what the export is, how to
load it (diffusers, and ComfyUI for single files, kohya LoRA files and embeddings) and how it was trained, read from
the run's config and the exported checkpoint's meta.json.

A card is sdtrain's while it ends with the marker line holding the hash of all before it: an export replaces such a
card, and only such a card. One a user wrote, or edited since, stays where it is; the new card then goes aside
(``README.sdtrain.md``, a single file's ``NAME.sdtrain.md``) and the log says so in one line. Nothing here reaches
the network: huggingface_hub's ModelCard only parses and formats here (its validate(), which posts to the Hub, is
never called), and a base model's card is read only from disk (a local folder, or the Hub cache).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from huggingface_hub import ModelCard, ModelCardData, try_to_load_from_cache

from sdtrain.checkpoint import read_meta
from sdtrain.config import RunConfig, load_config
from sdtrain.loaders.writers import (
    CONTROLNET,
    KOHYA_LYCORIS_WEIGHTS,
    KOHYA_WEIGHTS,
    LEARNED_EMBEDS,
    LORA_WEIGHTS,
    lora_load_into,
)
from sdtrain.models import build, families, hub
from sdtrain.models.families.spec import ModelFamily
from sdtrain.models.single_file import tokenizer_folder
from sdtrain.train.modes import make_part
from sdtrain.train.parts import IMAGE_TO_IMAGE, CardExample
from sdtrain.utils import atomic_write_bytes, atomic_write_text

log = logging.getLogger(__name__)

CARD = "README.md"
"""The card of a folder export (and of a single file alone in its folder): the name the Hub reads."""
CARD_ASIDE = "README.sdtrain.md"
"""Where a folder export's card goes when the folder's README.md is not an unedited sdtrain card."""
IMAGE = "validation.png"
"""A folder export's copy of the run's validation grid (a single file's: NAME.validation.png)."""
FOLDER_FILES = frozenset({CARD, CARD_ASIDE, IMAGE})
"""What a card adds to an export folder."""

_MARKER = re.compile(r"<!-- sdtrain model card of (\S+) sha256:([0-9a-f]{64})\b.*-->")
_PNG_KEY, _PNG_VALUE = "sdtrain", "model card image"
_GRID = re.compile(r"step_(\d+)\.png")


# ------------------------------------------------------------------------------------------------ base model

def hub_model_id(source: str | Path | None) -> str | None:
    """The Hub repository a model source is, as ``org/name``: a path in the Hub's cache (what a run records for a Hub
    id it was given), or, when no such local path exists, a Hub id itself. None for any other path: the Hub takes
    only repository ids as base_model, and a path would also put the machine's folder names (a user name among
    them) in a card meant to be published."""
    if not source:
        return None
    cached = hub.cached_id(source)
    if cached is not None:
        return cached.repo
    if Path(str(source)).expanduser().exists():
        return None
    given = hub.parse(str(source))
    return given.repo if given is not None else None


@dataclass
class _Base:
    source: str | None
    """As the run's config names it; None for a model trained from scratch."""
    hub_id: str | None

    @property
    def label(self) -> str | None:
        """How the card names it: the Hub id, else the file or folder name alone (never the full path)."""
        if self.source is None:
            return None
        return self.hub_id or Path(self.source).name

    def markdown(self) -> str:
        if self.hub_id:
            return f"[{self.hub_id}](https://huggingface.co/{self.hub_id})"
        return f"`{self.label}` (a local model)"

    def code(self) -> str:
        """What the card's code passes to from_pretrained for it."""
        return self.hub_id or f"path/to/{self.label or 'pipeline'}"

    def license(self) -> dict[str, str]:
        """license, license_name and license_link from the base model's own card, where one lies on disk: a local
        folder's README.md, or the Hub cache's copy of the repository's (looked up offline)."""
        card: Path | None = None
        folder = Path(self.source).expanduser() if self.source else None
        if folder is not None and folder.exists():
            card = folder / CARD if (folder / CARD).is_file() else None
        elif self.hub_id:
            cached = try_to_load_from_cache(self.hub_id, CARD)
            card = Path(cached) if isinstance(cached, str) else None
        if card is None or _owner(card) is not None:  # an sdtrain card states only what was given it
            return {}
        try:
            data = ModelCard.load(card, ignore_metadata_errors=True).data
        except (OSError, ValueError):
            return {}
        return {key: str(value) for key in ("license", "license_name", "license_link")
                if (value := getattr(data, key, None))}


def _base(config: RunConfig, family: ModelFamily | None) -> _Base:
    """The model the run started from: its denoiser's source for diffusion runs (the autoencoder's otherwise)."""
    component = family.components.denoiser if family is not None else "vae"
    source = build.component_source(config.model, component)
    return _Base(str(source) if source else None, hub_model_id(source))


# ------------------------------------------------------------------------------------------------ ownership

def _owner(path: Path) -> str | None:
    """The exported name an unedited sdtrain card at `path` describes; None for any other file, or none."""
    try:
        text = path.read_text(encoding="utf-8").replace("\r\n", "\n")
    except (OSError, UnicodeDecodeError):
        return None
    body, _, last = text.rstrip("\n").rpartition("\n")
    found = _MARKER.fullmatch(last.strip())
    if found is None or hashlib.sha256(body.encode("utf-8")).hexdigest() != found[2]:
        return None
    return unquote(found[1])


def _signed(text: str, name: str) -> str:
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return (f"{text}\n<!-- sdtrain model card of {quote(name)} sha256:{digest} (sdtrain export replaces this file "
            "while it is unchanged; once edited it is yours and stays) -->\n")


def _own_image(path: Path) -> bool:
    from PIL import Image

    try:
        with Image.open(path) as image:
            return getattr(image, "text", {}).get(_PNG_KEY) == _PNG_VALUE
    except OSError:
        return False


def _copy_image(source: Path, target: Path) -> None:
    """The grid, re-encoded as PNG with a text chunk that marks it sdtrain's."""
    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text(_PNG_KEY, _PNG_VALUE)
    encoded = io.BytesIO()
    with Image.open(source) as image:
        image.save(encoded, format="PNG", pnginfo=info)
    atomic_write_bytes(target, encoded.getvalue())


def validation_grid(run_dir: Path, step: int) -> Path | None:
    """The run's newest validation grid (RUN/samples/step_N.png) at or before `step`."""
    grids = [(int(found[1]), path) for path in (Path(run_dir) / "samples").glob("step_*.png")
             if (found := _GRID.fullmatch(path.name)) and int(found[1]) <= step]
    return max(grids)[1] if grids else None


# ------------------------------------------------------------------------------------------------ the card

@dataclass
class _Export:
    name: str
    """The folder's name, or the single file's."""
    kind: str
    """pipeline, lora, embedding, controlnet, vae (folders), file (a single file)."""
    run_dir: Path
    checkpoint: Path
    ema: bool
    kohya: bool = False
    kohya_lycoris: bool = False
    """DoRA's kohya file for LyCORIS's reading beside ComfyUI's (``lora_kohya_lycoris.safetensors``)."""
    merged: bool = False
    """A LoRA or embedding folder with the whole pipeline, merged, under pipeline/."""
    half: bool = False
    image: str | None = None
    """The validation grid's name beside the card."""
    image_source: Path | None = None
    """The run's grid it is a copy of."""
    license: str | None = None

    def __post_init__(self) -> None:
        self.config = load_config(self.run_dir / "config.yaml")
        self.meta = read_meta(self.checkpoint)
        self.task = self.meta.get("task", {})
        diffusion = self.config.stage == "diffusion"
        self.family = families.get(self.task.get("family") or "sd") if diffusion else None
        self.base = _base(self.config, self.family)
        self.modes = self.config.modes if diffusion else ("full",)
        # What the run trained, as its modes have it: the card's task and code are theirs to say.
        self.part = make_part(self.config, self.family) if diffusion else None

    @property
    def example(self) -> CardExample | None:
        """How the card's code samples with what the run trained (an editor's pipeline given the image to edit, a
        ControlNet's given its map); None: the family's pipeline, from text alone."""
        return self.part.card_example() if self.part is not None else None

    @property
    def edits(self) -> bool:
        """Whether the run's model edits the image it is given (InstructPix2Pix's, editing by reference)."""
        return self.part is not None and self.part.hub_task == IMAGE_TO_IMAGE

    @property
    def lokr(self) -> bool:
        """LoKr adapters, which diffusers' load_lora_weights refuses for most families (load_lora_adapter reads
        them)."""
        return any(settings.get("adapter_type") == "lokr" for settings in (self.task.get("lora") or {}).values())

    @property
    def dora(self) -> bool:
        """DoRA adapters, whose magnitudes in a kohya file each tool reads by its own rule."""
        return any(settings.get("use_dora") for settings in (self.task.get("lora") or {}).values())


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _prompt(export: _Export) -> str:
    """A prompt for the card's code: DreamBooth's instance prompt, a validation prompt (with the embedding's
    token for textual inversion)."""
    config, prompts = export.config, list(export.config.validation.prompts)
    if "dreambooth" in export.modes and config.dreambooth.instance_prompt:
        return config.dreambooth.instance_prompt
    if "textual_inversion" in export.modes:
        token = export.task.get("placeholder_token") or config.textual_inversion.placeholder_token
        return next((p for p in prompts if token in p), f"a photo of {token}")
    return prompts[0] if prompts else "a photo of a cat"


def _instance_prompt(export: _Export) -> str | None:
    if "dreambooth" in export.modes:
        return export.config.dreambooth.instance_prompt or None
    if "textual_inversion" in export.modes:
        return export.task.get("placeholder_token") or export.config.textual_inversion.placeholder_token
    return None


def _tags(export: _Export) -> list[str]:
    if export.family is None:
        return ["diffusers", "vae", "sdtrain"]
    modes = []
    if "dreambooth" in export.modes:
        modes.append("dreambooth")
    if export.kind == "lora":
        modes += ["lora", "template:sd-lora"]
    if export.kind == "embedding":
        modes.append("textual-inversion")
    if export.kind == "controlnet":
        modes += ["controlnet", *(["lora"] if export.task.get("lora") else [])]
    tags = [tag for tag in export.family.hub_tags or [export.family.name] if tag != "text-to-video"]
    # Once each: a family's own tags may name its task too (Qwen-Image 2.1's text-to-image).
    return list(dict.fromkeys([_task(export), "diffusers", *tags, *modes, "sdtrain"]))


def _task(export: _Export) -> str:
    """The Hub's pipeline tag of the exported model: its trained part's task (an editor's image-to-image), else
    the family's: text-to-video where its tags say so (Wan's), else text-to-image."""
    own = export.part.hub_task if export.part is not None else None
    return own or ("text-to-video" if "text-to-video" in export.family.hub_tags else "text-to-image")


def _header(export: _Export) -> ModelCardData:
    licence = {"license": export.license} if export.license else export.base.license()
    prompt = _instance_prompt(export)
    extra: dict[str, Any] = {"instance_prompt": prompt} if prompt else {}
    if export.image and export.family is not None:
        extra["widget"] = [{"text": _prompt(export), "output": {"url": export.image}}]
    return ModelCardData(base_model=export.base.hub_id, library_name="diffusers", **licence, tags=_tags(export),
                         pipeline_tag=_task(export) if export.family is not None else None, **extra)


def _summary(export: _Export) -> str:
    """The card's first paragraph: what the export is, of which family, trained from what."""
    family, base = export.family, export.base
    start = f"from {base.markdown()}" if base.source else "from scratch"
    if family is None:
        what = "A single file of an autoencoder (VAE)" if export.kind == "file" else "An autoencoder (VAE)"
        return f"{what} trained {start} with sdtrain."
    prompt = _instance_prompt(export)
    target = base.markdown() if base.source else family.title
    if export.kind == "controlnet":
        adapters = export.task.get("lora")
        beside = (f", with the {_adapter_kind(next(iter(adapters.values())))} adapters trained on the base beside it"
                  if adapters else "")
        return (f"A ControlNet for {target} ({family.title}){beside}, trained with sdtrain: it steers the base model "
                "by a conditioning image.")
    if export.kind == "lora":
        ranks = sorted({settings.get("r") for settings in (export.task.get("lora") or {}).values()} - {None})
        rank = f" (rank {', '.join(map(str, ranks))})" if ranks else ""
        kind = next(iter({_adapter_kind(s) for s in (export.task.get("lora") or {}).values()}), "LoRA")
        what = f"DreamBooth {kind} adapters" if "dreambooth" in export.modes else f"{kind} adapters"
        subject = f" on a subject: prompt with `{prompt}`" if "dreambooth" in export.modes else ""
        edits = ", to edit an image as its prompt instructs" if export.edits else ""
        return f"{what}{rank} for {target} ({family.title}), trained with sdtrain{subject}{edits}."
    if export.kind == "embedding":
        vectors = len(export.task.get("tokens") or []) or export.config.textual_inversion.num_vectors
        return (f"A textual-inversion embedding for {target} ({family.title}), trained with sdtrain: the token "
                f"`{prompt}` ({vectors} vector{'s' if vectors != 1 else ''}).")
    how = {"dreambooth": f"DreamBooth-fine-tuned {start} with sdtrain on a subject: prompt with `{prompt}`",
           "lora": f"fine-tuned {start} with sdtrain, LoRA adapters merged in",
           "textual_inversion": f"fine-tuned {start} with sdtrain by textual inversion, the token `{prompt}` added",
           }.get(export.modes[0], f"{'fine-tuned' if base.source else 'trained'} {start} with sdtrain")
    if export.edits:
        how += ", to edit an image as its prompt instructs"
    if export.kind != "file":
        return f"A {family.title} pipeline for diffusers, {how}."
    layout = family.files.single_file
    assert layout is not None  # a file is exported only in a family's layout
    return f"{layout.description.format(title=family.title)}, {how}."


def _code(lines: list[str]) -> str:
    return "```python\n" + "\n".join(lines) + "\n```"


def _usage(export: _Export) -> list[str]:
    """The card's "Use it" section: diffusers code for the kind exported, then ComfyUI where it reads the files."""
    family, name = export.family, export.name
    here = json.dumps(name)
    prompt = json.dumps(_prompt(export), ensure_ascii=False)
    base = json.dumps(export.base.code())
    comment = "  # this folder, or its Hub id once uploaded"
    out = ["## Use it", ""]
    if family is None:
        if export.kind == "file":
            lines = ["from diffusers import AutoencoderKL", "",
                     f"vae = AutoencoderKL.from_single_file({here}, config=\"path/to/vae\")  "
                     "# config: the VAE folder `sdtrain export` writes from the same run"]
        else:
            lines = ["from diffusers import AutoencoderKL", "", f"vae = AutoencoderKL.from_pretrained({here}){comment}",
                     "# then: Pipeline.from_pretrained(BASE, vae=vae)"]
        out += [_code(lines), ""]
        if export.kind == "file":
            out += ["ComfyUI: put the file in `ComfyUI/models/vae/` and pick it in a Load VAE node.", ""]
        return out
    example = export.example
    pipeline = (example.pipeline_class if example is not None else family.sampling.pipeline_class).__name__
    head = [f"from diffusers import {pipeline}", ""]
    call = f"image = pipe({prompt}).images[0]"
    if example is not None:
        head = [f"from diffusers import {pipeline}", "from diffusers.utils import load_image", ""]
        call = (f"image = pipe(prompt={prompt}, {example.image_argument}="
                f"load_image({json.dumps(example.image_file)})).images[0]")
    if export.kind == "controlnet":
        assert example is not None and example.module is not None  # a ControlNet folder is a ControlNet run's
        model, folder = example.module[0].__name__, example.module[1]
        lines = [f"from diffusers import {model}, {pipeline}", "from diffusers.utils import load_image", "",
                 f"{folder} = {model}.from_pretrained({json.dumps(f'{name}/{folder}')}){comment}",
                 f"pipe = {pipeline}.from_pretrained({base}, {folder}={folder})",
                 *([f"pipe.load_lora_weights({here})  # the adapters trained beside it"]
                   if export.task.get("lora") else [])]
    elif export.kind == "pipeline":
        lines = [*head, f"pipe = {pipeline}.from_pretrained({here}){comment}"]
    elif export.kind == "lora" and export.lokr:
        lines = [*head, f"pipe = {pipeline}.from_pretrained({base})",
                 f"pipe.{family.components.denoiser}.load_lora_adapter({here}, "
                 f"prefix={json.dumps(family.components.denoiser)}, "
                 f"weight_name={json.dumps(LORA_WEIGHTS)}){comment}"]
    elif export.kind == "lora":
        # A model of experts' adapters are the trained expert's: loaded into its own folder's transformer.
        into = lora_load_into(family, export.config.model.expert)
        lines = [*head, f"pipe = {pipeline}.from_pretrained({base})",
                 f"pipe.load_lora_weights({here}{f', load_into_{into}=True' if into else ''}){comment}"]
    elif export.kind == "embedding":
        lines = [*head, f"pipe = {pipeline}.from_pretrained({base})"]
        token = json.dumps(_instance_prompt(export), ensure_ascii=False)
        if family.files.embedding_keys:
            lines[1:1] = ["from safetensors.torch import load_file"]
            lines.append(f"state = load_file({json.dumps(f'{name}/{LEARNED_EMBEDS}')})")
            lines += [f"pipe.load_textual_inversion(state[{json.dumps(key)}], token={token}, "
                      f"text_encoder=pipe.{encoder}, tokenizer=pipe.{tokenizer})"
                      for key, encoder, tokenizer in zip(family.files.embedding_keys, family.components.text_encoders,
                                                         family.components.tokenizers)]
        else:
            lines.append(f"pipe.load_textual_inversion({here}, weight_name={json.dumps(LEARNED_EMBEDS)}){comment}")
    else:
        lines = family.files.single_file.diffusers_code(pipeline, here, base, family.components.classes)
    lines.append(call)
    out += [_code(lines), ""]
    if export.kind == "file" and not export.base.hub_id:
        out += ["`config` is a pipeline folder of the same architecture: the one `sdtrain export RUN OUT` writes "
                "from this run will do.", ""]
    if export.kind == "file" and family.files.single_file.holds is None:
        tokenizers = ", ".join(f"`{tokenizer_folder(name, i).name}/`"
                               for i in range(1, len(family.components.tokenizers) + 1))
        out += [f"Tokenizer folders beside it: {tokenizers}. sdtrain reads the file as `model.pretrained` or "
                "`generate --model`.", ""]
    if export.merged:
        added = "the adapters merged in" if export.kind == "lora" else "the token added"
        out += [f"`pipeline/` holds the whole pipeline with {added}: `{pipeline}.from_pretrained(\"{name}/"
                "pipeline\")`.", ""]
    comfy = _comfyui(export)
    if comfy:
        out += [f"ComfyUI: {comfy}", ""]
    if export.kind == "lora" and export.dora and export.kohya:
        out += [_dora_readers(export), ""]
    return out


def _dora_readers(export: _Export) -> str:
    """Which tools each kohya DoRA file is for: they read its magnitudes (``dora_scale``) by different rules."""
    text = (f"DoRA's magnitudes (`dora_scale`) are read by different rules, so each kohya file is for the readers "
            f"named: `{KOHYA_WEIGHTS}` for ComfyUI (its builds since April 2025) and Forge, which normalise each "
            "row by the base weight's norm")
    if export.kohya_lycoris:
        text += (f"; `{KOHYA_LYCORIS_WEIGHTS}` for LyCORIS's own loader and the tools that follow it, which read "
                 "`dora_scale` as the magnitude itself and normalise each row by the updated weight's norm")
    return (text + f". diffusers' `load_lora_weights` drops `dora_scale` from a kohya file and applies the rest: "
            f"load `{LORA_WEIGHTS}` there, as above. A1111 and older ComfyUI builds normalise DoRA by each input "
            "column's norm instead, a decomposition these adapters did not train with: no file gives them these "
            "weights.")


def _comfyui(export: _Export) -> str | None:
    family, name = export.family, export.name
    if export.kind == "file":
        layout = family.files.single_file if family is not None else None
        return layout.comfyui.format(name=name) if layout else \
            f"put `{name}` in `ComfyUI/models/vae/` and load it with Load VAE."
    if export.kind == "lora" and (export.kohya or family.files.comfyui_reads_diffusers_lora):
        weights = KOHYA_WEIGHTS if export.kohya else LORA_WEIGHTS
        return (f"put `{weights}` (renamed as you like) in `ComfyUI/models/loras/` and apply it to the base model "
                "with a Load LoRA node.")
    if export.kind == "embedding":
        return (f"put `{LEARNED_EMBEDS}` in `ComfyUI/models/embeddings/` as `{Path(name).stem}.safetensors` and write "
                f"`embedding:{Path(name).stem}` in the prompt.")
    if export.kind == "controlnet":
        return (f"put `{CONTROLNET}/diffusion_pytorch_model.safetensors` (renamed as you like) in "
                "`ComfyUI/models/controlnet/` and load it with Load ControlNet Model.")
    return None


def _adapter_kind(settings: dict[str, Any]) -> str:
    """What adapters a module's settings in meta.json describe: LoRA, DoRA or LoKr."""
    return "LoKr" if settings.get("adapter_type") == "lokr" else "DoRA" if settings.get("use_dora") else "LoRA"


def training_settings(export: _Export) -> list[tuple[str, str]]:
    """The card's table: what the run trained with, from its config and the exported checkpoint's meta.json."""
    config, meta, task = export.config, export.meta, export.task
    optim, data = config.optim, config.data
    rows = [("Base model", export.base.label or "none (trained from scratch)")]
    if export.family is not None:
        rows.append(("Family", export.family.title))
    rows.append(("Mode", config.mode_name if export.family is not None else "autoencoder"))
    rows.append(("Resolution", f"{data.resolution}" + (" (aspect buckets)" if data.aspect_buckets else "")))
    steps = int(meta.get("step", 0))
    rows.append(("Steps", f"{steps}" + (f" of {config.train.max_steps}" if steps < config.train.max_steps else "")))
    rows.append(("Batch size", f"{data.batch_size} per device, gradient accumulation {config.train.grad_accum}"))
    if "samples" in meta:
        rows.append(("Samples seen", f"{int(meta['samples'])}"))
    schedule = f"{optim.lr:g}, {optim.schedule} schedule"
    rows.append(("Learning rate", schedule + (f", {optim.warmup_steps} warmup steps" if optim.warmup_steps else "")))
    rows.append(("Optimizer", f"{optim.name} (weight decay {optim.weight_decay:g})"))
    precision = (meta.get("tuning") or {}).get("precision") or config.train.mixed_precision
    rows.append(("Precision", f"{precision}"))
    if meta.get("ema"):
        rows.append(("EMA", f"decay {config.ema.decay:g}; exported: {'EMA' if export.ema else 'raw'} weights"))
    if export.family is not None and config.diffusion.ddpm.prediction_type:
        rows.append(("Prediction type", config.diffusion.ddpm.prediction_type))
    for module, settings in (task.get("lora") or {}).items():
        targets = ", ".join(settings.get("target_modules") or [])
        alpha = settings.get("lora_alpha", settings.get("alpha"))  # LoKr's settings call it alpha
        rows.append((f"{_adapter_kind(settings)} ({module})", f"rank {settings.get('r')}, alpha {_number(alpha)}"
                     + (f", dropout {settings['lora_dropout']:g}" if settings.get("lora_dropout") else "")
                     + (f" on {targets}" if targets else "")))
    if "textual_inversion" in export.modes:
        ti = config.textual_inversion
        vectors = len(task.get("tokens") or []) or ti.num_vectors
        rows.append(("Placeholder token", f"`{_instance_prompt(export)}` ({vectors} vector{'s' if vectors != 1 else ''}"
                     + (f", initialised from `{ti.initializer_token}`" if ti.initializer_token else "") + ")"))
    if "dreambooth" in export.modes:
        db = config.dreambooth
        rows.append(("Instance prompt", f"`{db.instance_prompt}`"))
        if db.class_prompt:
            rows.append(("Class prompt", f"`{db.class_prompt}` (prior loss weight {db.prior_loss_weight:g})"))
    if config.stage != "diffusion":
        rows.append(("KL weight", f"{config.autoencoder.kl_weight:g}"))
    rows.append(("Seed", f"{config.seed}"))
    if export.kind == "file":
        layout = export.family.files.single_file if export.family is not None else None
        stored = (layout.half_dtype if layout else "fp16") if export.half else "fp32"
        rows.append(("Stored as", stored))
    rows.append(("Checkpoint", export.checkpoint.name))
    return rows


def card_text(export: _Export) -> str:
    """The whole card, unsigned: front-matter and body."""
    title = Path(export.name).stem if export.kind == "file" else export.name
    body = [f"# {title}", "", _summary(export), ""]
    if export.image:
        what = "Reconstructions (top: inputs, bottom: the autoencoder's)" if export.family is None else \
            "Validation samples"
        step = validation_step(export.image_source) if export.image_source else None
        body += [f"![{what}]({quote(export.image)})", "", f"*{what} at step {step}.*", ""]
    body += _usage(export)
    body += ["## Training", "", "| Setting | Value |", "| --- | --- |"]
    body += [f"| {label} | {_cell(value)} |" for label, value in training_settings(export)]
    prompts = list(export.config.validation.prompts) if export.family is not None else []
    if prompts:
        body += ["", "Validation prompts: " + "; ".join(f"`{p}`" for p in prompts) + "."]
    if export.license is None and (licence := export.base.license()):
        body += ["", f"License: `{licence.get('license')}`, as the base model's card states."]
    card = ModelCard(f"---\n{_header(export).to_yaml()}\n---\n\n" + "\n".join(body) + "\n")
    return str(card)


def validation_step(path: Path) -> int | None:
    found = _GRID.fullmatch(path.name)
    return int(found[1]) if found else None


# ------------------------------------------------------------------------------------------------ writing

def _describe(folder: Path, name: str, run_dir: Path, checkpoint: Path, ema: bool, license: str | None) -> _Export:
    """What `folder` holds, as exported from the run: a VAE, LoRA files, an embedding, else a pipeline."""
    export = _Export(name, "pipeline", Path(run_dir), Path(checkpoint), ema, license=license,
                     kohya=(folder / KOHYA_WEIGHTS).is_file(),
                     kohya_lycoris=(folder / KOHYA_LYCORIS_WEIGHTS).is_file(),
                     merged=(folder / "pipeline" / "model_index.json").is_file())
    if export.family is None:
        export.kind = "vae"
    elif (folder / CONTROLNET / "config.json").is_file():
        export.kind = "controlnet"
    elif (folder / LORA_WEIGHTS).is_file():
        export.kind = "lora"
    elif (folder / LEARNED_EMBEDS).is_file():
        export.kind = "embedding"
    return export


def write_folder_card(folder: Path, out: Path, run_dir: Path, checkpoint: Path, ema: bool = True,
                      license: str | None = None) -> Path:
    """The card of the export in `folder`, the complete folder about to replace `out`: README.md and the run's
    validation grid as validation.png. A README.md in `out` that is not an unedited sdtrain card is carried into
    `folder` unchanged, and the card goes to README.sdtrain.md instead. Returns the card's path once `folder` is
    `out`."""
    export = _describe(folder, out.name, run_dir, checkpoint, ema, license)
    grid = validation_grid(run_dir, int(export.meta.get("step", 0)))
    if grid is not None:
        _copy_image(grid, folder / IMAGE)
        export.image = IMAGE
    export.image_source = grid
    name = CARD
    previous = out / CARD
    if previous.is_file() and _owner(previous) is None:
        shutil.copy2(previous, folder / CARD)
        name = CARD_ASIDE
        log.warning("%s was not written by sdtrain (or was edited since): kept; the model card went to %s",
                    previous, out / CARD_ASIDE)
    atomic_write_text(folder / name, _signed(card_text(export), out.name))
    return out / name


def _single_file_card(out: Path) -> Path:
    """README.md when the file has its folder to itself (or README.md is already its sdtrain card), else NAME.md."""
    readme = out.parent / CARD
    if readme.is_file():
        return readme if _owner(readme) == out.name else out.with_suffix(".md")
    own = {out.name, out.with_suffix(".md").name, out.with_suffix(".sdtrain.md").name,
           out.with_suffix(".validation.png").name, *(tokenizer_folder(out, i).name for i in (1, 2, 3))}
    alone = all(p.name in own or p.name.startswith(".") for p in out.parent.iterdir())
    return readme if alone and not readme.exists() else out.with_suffix(".md")


def write_file_card(out: Path, run_dir: Path, checkpoint: Path, ema: bool = True, half: bool = False,
                    license: str | None = None) -> Path | None:
    """The card of the single file `out` (see `_single_file_card` for its name), with the run's validation grid as
    NAME.validation.png. A file already at either name that sdtrain did not write is kept, the card going to
    NAME.sdtrain.md (and the grid left out); None when that name too is someone else's."""
    export = _describe(out.parent, out.name, run_dir, checkpoint, ema, license)
    export.kind, export.half, export.kohya, export.merged = "file", half, False, False
    export.kohya_lycoris = False
    target = _single_file_card(out)
    if target.exists() and _owner(target) != out.name:
        aside = out.with_suffix(".sdtrain.md")
        if aside.exists() and _owner(aside) != out.name:
            log.warning("%s and %s were not written by sdtrain: kept; no model card written", target, aside)
            return None
        log.warning("%s was not written by sdtrain (or was edited since): kept; the model card went to %s",
                    target, aside)
        target = aside
    grid = validation_grid(run_dir, int(export.meta.get("step", 0)))
    image = out.with_suffix(".validation.png")
    if grid is not None and image.exists() and not _own_image(image):
        log.warning("%s was not written by sdtrain: kept; the model card shows no validation grid", image)
        grid = None
    if grid is not None:
        _copy_image(grid, image)
        export.image = image.name
    export.image_source = grid
    atomic_write_text(target, _signed(card_text(export), out.name))
    stale = out.with_suffix(".md")
    if target.name == CARD and stale.is_file() and _owner(stale) == out.name:
        stale.unlink()  # an earlier export's card, from when the folder held more
    return target
