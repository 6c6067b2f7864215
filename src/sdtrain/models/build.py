"""Model components, built from a named preset or loaded from a local folder, through one path.

A component source is one of: nothing (build the preset from scratch), a diffusers component
folder (has config.json), a diffusers pipeline folder (has model_index.json), an sdtrain run
folder (its newest checkpoint, EMA weights when it kept them), or a single-file checkpoint in the
original Stable Diffusion layout (``.safetensors``; pickles only when trusted, see
``sdtrain.models.single_file``). No function here downloads: every load is local, so an offline
cluster node behaves exactly like a laptop. A Hugging Face Hub id (``org/name``) is resolved to its snapshot
folder in the Hub cache before it gets here (``sdtrain.models.hub``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler
from torch import nn

from sdtrain.checkpoint import latest_checkpoint, read_meta
from sdtrain.config import DiffusionConfig, ModelConfig
from sdtrain.errors import UserError
from sdtrain.models import families, frozen, hub, single_file
from sdtrain.models.families.spec import construct
from sdtrain.models.tokenizer import load_tokenizer_folder

log = logging.getLogger(__name__)


def build_vae(config: ModelConfig) -> nn.Module:
    family = families.for_model(config)
    kwargs = {**family.preset(config.preset, "vae"), **config.overrides("vae")}
    return construct(family.components.classes["vae"], overrides_key("vae"), kwargs)


def build_text_encoder(config: ModelConfig, tokenizer: Any, name: str = "text_encoder") -> nn.Module:
    """Text encoder `name` of the model's family from its preset, its ids those of `tokenizer`."""
    family = families.for_model(config)
    settings = {**family.preset(config.preset, name), **config.overrides(name)}
    return family.conditioner.build_text_encoder(name, settings, tokenizer, overrides_key(name))


def build_denoiser(config: ModelConfig, latent_channels: int, latent_size: int,
                   text_encoders: dict[str, nn.Module] | None = None, derived: dict[str, Any] | None = None,
                   frozen_precision: str = "fp32") -> nn.Module:
    """The family's denoiser (UNet, transformer) from its preset, shaped for the latents and for the text encoders
    it reads (the family says what it takes from either), or with the `derived` settings given instead. With a
    `frozen_precision` other than fp32 it is a base that stays frozen, built a layer at a time with its linear
    weights stored low (`frozen.materialize`): a 12B transformer never exists in fp32. A trainable one (fp32) is
    initialised as ``model.denoiser_init`` says."""
    family = families.for_model(config)
    name = family.components.denoiser
    overrides = config.overrides(name)
    kwargs = {**family.preset(config.preset, name), **family.denoising.shape(latent_channels, latent_size)}
    if derived is None:
        derived = family.denoising.settings({**kwargs, **overrides}, text_encoders)
    settings = {**kwargs, **derived, **overrides}
    if frozen_precision == "fp32":
        module = construct(family.components.classes[name], overrides_key(name), settings)
        # A trainable denoiser from scratch: ``model.denoiser_init`` picks diffusers' layer defaults (drawn as it
        # was constructed) or, on top of them, the family's reference initialisation (Flux.1's, from the same
        # generator, seeded by the run's seed). A family without one draws nothing more.
        applied = config.denoiser_init != "library" and family.denoising.initialise(module)
        if not applied and config.denoiser_init == "reference":
            log.warning("model.denoiser_init=reference: %s has no reference initialisation; its %s keeps "
                        "diffusers' defaults", family.title, name)
        return module
    with frozen.parameters_on_meta():
        module = construct(family.components.classes[name], overrides_key(name), settings)
    return frozen.materialize(module, frozen_precision)


def build_unet(config: ModelConfig, latent_channels: int, latent_size: int, cross_attention_dim: int) -> nn.Module:
    """A UNet family's denoiser for text of width `cross_attention_dim`, with no text encoder at hand."""
    return build_denoiser(config, latent_channels, latent_size, derived={"cross_attention_dim": cross_attention_dim})


def build_noise_scheduler(config: DiffusionConfig, model: ModelConfig | None = None
                          ) -> DDPMScheduler | FlowMatchEulerDiscreteScheduler:
    """The training noise schedule: a pretrained pipeline's own when there is one (a single file's from its
    metadata, else Stable Diffusion's), else the preset's or the config's. ``diffusion.ddpm.prediction_type`` (and
    for flow matching ``diffusion.flow.shift`` and ``dynamic_shift``) override either."""
    model = model or ModelConfig()
    family = families.for_model(model)
    if family.denoising.objective == "flow_matching":
        return _flow_scheduler(config, model, family)
    pretrained, trust_pickle = model.pretrained, trusts_pickle(model)
    ddpm = config.ddpm
    overrides = {"prediction_type": ddpm.prediction_type} if ddpm.prediction_type else {}
    if ddpm.zero_terminal_snr:
        overrides["rescale_betas_zero_snr"] = True
    settings = pretrained and single_file.looks_like_single_file(pretrained) and \
        family.files.file_scheduler(pretrained, trust_pickle)
    if settings:
        return DDPMScheduler.from_config({**settings, **overrides})
    if pretrained and (Path(pretrained) / "scheduler").is_dir():
        return DDPMScheduler.from_pretrained(Path(pretrained) / "scheduler", local_files_only=True, **overrides)
    return DDPMScheduler(
        num_train_timesteps=ddpm.num_train_timesteps,
        beta_schedule=ddpm.beta_schedule,
        beta_start=ddpm.beta_start,
        beta_end=ddpm.beta_end,
        prediction_type=ddpm.prediction_type or "epsilon",
        clip_sample=False,
        steps_offset=1,
        rescale_betas_zero_snr=ddpm.zero_terminal_snr,
    )


def _flow_scheduler(config: DiffusionConfig, model: ModelConfig, family: families.ModelFamily
                    ) -> FlowMatchEulerDiscreteScheduler:
    """A flow-matching schedule: the pretrained pipeline's scheduler settings, else the preset's, with the
    config's shift on top (a static ``diffusion.flow.shift`` alone turns the dynamic shift off)."""
    folder = Path(model.pretrained) / "scheduler" if model.pretrained else None
    if folder is not None and (folder / "scheduler_config.json").is_file():
        settings = dict(FlowMatchEulerDiscreteScheduler.load_config(folder))
        if "shift" not in settings and settings.get("flow_shift") is not None:
            # A flow sampler of another class (Wan's UniPC) keeps the shift its model trained at as flow_shift.
            settings["shift"] = settings["flow_shift"]
    elif model.pretrained and single_file.looks_like_single_file(model.pretrained):
        # A single file holds no scheduler: the one its model was released with, which its keys tell.
        settings = family.files.file_scheduler(model.pretrained, trusts_pickle(model)) or \
            family.preset(model.preset, "scheduler")
    else:
        settings = family.preset(model.preset, "scheduler")
    flow = config.flow
    if flow.shift is not None:
        settings.update(shift=flow.shift, use_dynamic_shifting=bool(flow.dynamic_shift))
    elif flow.dynamic_shift is not None:
        settings["use_dynamic_shifting"] = bool(flow.dynamic_shift)
    return FlowMatchEulerDiscreteScheduler.from_config(settings)


def source_kind(path: str | Path) -> str:
    """'component', 'pipeline', 'checkpoint', 'run' or 'single_file'; a UserError names the path otherwise."""
    path = Path(path)
    if single_file.looks_like_single_file(path):
        if path.is_file():
            return "single_file"
        raise UserError(f"{path}: no such file; fix the path")
    if (path / "model_index.json").is_file():
        return "pipeline"
    if (path / "meta.json").is_file() and ((path / "model.safetensors").is_file() or (path / "sharded").is_dir()):
        return "checkpoint"
    if (path / "config.json").is_file():
        return "component"
    if (path / "config.yaml").is_file() and (path / "checkpoints").is_dir():
        return "run"
    raise UserError(
        f"{path}: not a diffusers component folder (config.json), pipeline folder (model_index.json), "
        "sdtrain run folder (config.yaml + checkpoints/) or single-file checkpoint (.safetensors); fix the path"
    )


def _tokenizer_folder(source: str | Path, folder: str = "tokenizer") -> Path:
    """A tokenizer folder, or the `folder` (tokenizer/, tokenizer_2/) inside a pipeline or run folder, or beside a
    single file. A second tokenizer falls back to the first: a run trained from scratch trains one for both."""
    path = Path(source)
    if single_file.looks_like_single_file(path):
        beside = path.with_suffix(f".{folder}")  # OUT.tokenizer/, OUT.tokenizer_2/, as export writes them
        if beside.is_dir():
            return beside
        # SDXL's second CLIP tokenizer may stand in for the first; a T5's (Flux's second, SD3's third) never does.
        if folder in families.detect(path).components.long_text_tokenizers:
            return Path(single_file.tokenizer_for(path, int(folder.rpartition("_")[2])))
        return Path(single_file.tokenizer_for(path))
    for name in dict.fromkeys((folder, "tokenizer")):
        if (path / name).is_dir():
            return path / name
    return path


def load_tokenizer(source: str | Path, max_length: int | None = None, folder: str = "tokenizer") -> Any:
    """From a tokenizer folder, or the `folder` inside a pipeline or run folder (or beside a single file);
    `max_length` replaces its saved model_max_length. A run's tokenizers are `load_text_tokenizers`'."""
    return load_tokenizer_folder(_tokenizer_folder(source, folder), max_length=max_length)


DEFAULT_TEXT_LENGTH = 77
"""CLIP's tokens per caption: the length of a tokenizer trained from scratch when model.max_text_length is unset."""
# Some tokenizer_config.json files write "no limit" as a huge number (transformers' VERY_LARGE_INTEGER).
_NO_LIMIT = 100_000


def _json_value(path: Path, key: str) -> Any:
    try:
        return json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None  # the loader of that file reports what is wrong with it


def _saved_length(tokenizer_file: Path | None) -> int | None:
    """A tokenizer_config.json's model_max_length, unless absent or "no limit"."""
    saved = _json_value(tokenizer_file, "model_max_length") if tokenizer_file else None
    return saved if isinstance(saved, int) and saved < _NO_LIMIT else None


def text_encoder_positions(source: str | Path | None, trust_pickle: bool | None = None) -> tuple[int, str] | None:
    """The tokens a text encoder reads (its max_position_embeddings) and the file that says so, from its
    config alone, never its weights (a single file's header; a pickle single file is read whole, once
    trusted). None without a source, or when that source has no text encoder config to read: loading it
    then fails with the loader's own message."""
    if source is None or not Path(source).exists():
        return None
    path = Path(source)
    kind = source_kind(path)
    if kind == "single_file":
        found, where = _file_text_positions(path, trust_pickle), f"the tensor shapes of {path}"
    elif kind in ("pipeline", "component"):
        file = path / "text_encoder" / "config.json" if kind == "pipeline" else path / "config.json"
        found, where = _json_value(file, "max_position_embeddings"), str(file)
    else:
        checkpoint = path if kind == "checkpoint" else latest_checkpoint(path)
        if checkpoint is None:
            return None
        spec = read_meta(checkpoint).get("modules", {}).get("text_encoder", {})
        found, where = spec.get("config", {}).get("max_position_embeddings"), str(checkpoint / "meta.json")
    return (int(found), where) if found else None


def _file_text_positions(path: Path, trust_pickle: bool | None) -> int | None:
    """The positions of the text encoder a single file holds, built without weights by the layout its keys name."""
    family = families.family_of_keys(single_file.tensor_names(path, trust_pickle))
    layout = family.files.single_file if family is not None else None
    if layout is None or "text_encoder" not in (layout.holds or family.components):
        return None
    try:
        encoder = layout.load("text_encoder", path, trust_pickle=trust_pickle, frozen_precision="fp32",
                              weights=False, latent_constants=dict)
    except UserError:  # a file without one: loading the text encoder says so, with what to set
        return None
    return getattr(encoder.config, "max_position_embeddings", None)


def text_length(config: ModelConfig, fallback: str | Path | None = None,
                text_encoder: str | Path | None = None) -> int:
    """Tokens per caption: model.max_text_length when set, else the pretrained tokenizer's model_max_length
    (tokenizer_config.json) capped at the text encoder's max_position_embeddings, since the encoder reads no
    more; DEFAULT_TEXT_LENGTH when neither exists (a tokenizer and text encoder trained from scratch).

    The tokenizer is `tokenizer_source(config)`'s, else `fallback`'s (a run folder holding the tokenizer it
    trained); the text encoder is `text_encoder` (a run's pinned source) or the config's. A set length
    longer than the text encoder's positions is a UserError naming both. The config is never changed.
    """
    source = tokenizer_source(config) or fallback
    tokenizer_file = _tokenizer_folder(source) / "tokenizer_config.json" if source else None
    saved = _saved_length(tokenizer_file)
    encoder = text_encoder_positions(text_encoder or component_source(config, "text_encoder"), trusts_pickle(config))
    if config.max_text_length is not None:
        if encoder and config.max_text_length > encoder[0]:
            positions, where = encoder
            tokenizer = f"; its tokenizer's model_max_length in {tokenizer_file} is {saved}" if saved else ""
            raise UserError(
                f"model.max_text_length: {config.max_text_length} tokens, but the pretrained text encoder reads at "
                f"most {positions} (max_position_embeddings in {where}{tokenizer}); set model.max_text_length="
                f"{positions} or less, or leave it unset to take the pretrained length")
        return config.max_text_length
    lengths = [n for n in (saved, encoder and encoder[0]) if n]
    return min(lengths) if lengths else DEFAULT_TEXT_LENGTH


def load_text_tokenizers(config: ModelConfig, fallback: str | Path | None = None,
                         text_encoder: str | Path | None = None) -> list[Any]:
    """The tokenizers a run encodes captions with, one per text encoder of its family, each's model_max_length
    the run's `text_length` (same arguments)."""
    source = tokenizer_source(config) or fallback
    if source is None:
        raise UserError("model.components.tokenizer.source: no tokenizer to load; set it, or model.pretrained")
    length = text_length(config, fallback, text_encoder)
    family = families.for_model(config)
    tokenizers = []
    for folder in family.components.tokenizers:
        named = config.source(folder) if folder != family.components.tokenizers[0] else None
        if folder in family.components.long_text_tokenizers:
            tokenizers.append(load_tokenizer(named or source, long_text_length(config, family, named or source, folder),
                                             folder))
        else:
            tokenizers.append(load_tokenizer(named or source, length, folder))
    return tokenizers


def long_text_length(config: ModelConfig, family: families.ModelFamily, tokenizer_source: str | Path | None = None,
                   folder: str = "tokenizer_2") -> int:
    """T5's tokens per caption: ``model.t5_text_length``, else what the family's model samples with, or the length
    the tokenizer at `tokenizer_source` (its `folder`) saves when shorter (a model exported after training at
    that length). A released T5 tokenizer saves the encoder's limit (512), not the model's: T5's relative positions
    read any length, and without an attention mask every padding state joins attention, so a longer saved
    length never wins."""
    if config.t5_text_length:
        return config.t5_text_length
    default = family.conditioner.long_text_length(config.preset, component_source(config, family.components.denoiser))
    found = _tokenizer_folder(tokenizer_source, folder) if tokenizer_source else None
    # Not the first tokenizer's, where a run from scratch keeps the one it trained for every encoder.
    saved = _saved_length(found / "tokenizer_config.json") if found and found.name != "tokenizer" else None
    return min(saved, default) if saved else default


def load_text_tokenizer(config: ModelConfig, fallback: str | Path | None = None,
                        text_encoder: str | Path | None = None) -> Any:
    """The first of `load_text_tokenizers` (a family with one text encoder has only that one)."""
    return load_text_tokenizers(config, fallback, text_encoder)[0]


def tokenizer_source(config: ModelConfig) -> str | None:
    """The tokenizer belongs with the text encoder: loaded from wherever that comes from, unless named.

    A single file holds no tokenizer: its OUT.tokenizer/ sibling (and OUT.tokenizer_2/, which ``sdtrain export
    --single-file`` writes) is used, so the file itself is returned; without one a UserError asks for
    ``model.components.tokenizer.source``.
    """
    first = families.for_model(config).components.tokenizers[:1] or ("tokenizer",)
    named = config.source(first[0]) or config.source("tokenizer")
    if named:
        return named
    text_encoder = component_source(config, "text_encoder")
    if text_encoder and single_file.looks_like_single_file(text_encoder):
        single_file.tokenizer_for(text_encoder)
        return text_encoder
    if text_encoder and (Path(text_encoder) / "tokenizer").is_dir():
        return text_encoder
    if config.pretrained and single_file.looks_like_single_file(config.pretrained):
        single_file.tokenizer_for(config.pretrained)
        return config.pretrained
    return config.pretrained


def pin_source(source: str | Path) -> str:
    """An absolute path that keeps meaning the same weights: a run is pinned to its newest checkpoint, so a
    resumed or exported run keeps the autoencoder it trained with even after that run trains on. A single
    file is pinned to its absolute path under its own name, its folder's links resolved but not its own (a
    file in the Hugging Face cache links to a blob named by its hash). A Hub id's source is its snapshot folder
    (``.../snapshots/<commit>``, see ``sdtrain.models.hub``): the same commit's weights, read from the cache
    offline too."""
    given = Path(source)
    path = given.parent.resolve() / given.name if given.is_file() else given.resolve()
    if source_kind(path) == "run":
        newest = latest_checkpoint(path)
        if newest is None:
            raise UserError(f"{source}: this run has no complete checkpoint yet; train it first")
        return str(newest)
    return str(path)


def trusts_pickle(config: ModelConfig) -> bool | None:
    """``model.trust_pickle`` as the loaders take it: True when set, else None, which defers to
    SDTRAIN_TRUST_PICKLE (False would override the user's environment)."""
    return True if config.trust_pickle else None


def component_source(config: ModelConfig, name: str) -> str | None:
    """The folder (or single file) a component loads from, or None when it is built from the preset."""
    explicit = config.source(name)
    if explicit is not None or config.pretrained is None:
        return explicit
    # The trained expert, in the denoiser's place, loads from its own folder of a pipeline folder of experts.
    experts = families.for_model(config).experts
    if experts is not None and name == experts.folders[0] and (Path(config.pretrained) / "model_index.json").is_file():
        return str(Path(config.pretrained) / experts.folder(config.expert))
    return config.pretrained


def other_experts(config: ModelConfig, source: str | None) -> dict[str, str | None]:
    """For a model of experts, each expert's folder but the run's (`model.expert`) -> where it loads from: that
    folder of the pipeline folder holding `source` (the trained expert's pinned source, else `pretrained`); None
    where none holds it (a model from scratch: the trained expert then samples its share too). Empty for a model
    without experts."""
    experts = families.for_model(config).experts
    if experts is None:
        return {}
    trained = experts.folder(config.expert)
    folders = [folder for given in (source, config.pretrained) if given and Path(given).is_dir()
               for folder in (Path(given), Path(given).parent)]  # a pipeline folder, or an expert's folder in one
    pipeline = next((folder for folder in folders if (folder / "model_index.json").is_file()), None)
    return {folder: str(pipeline / folder) if pipeline is not None and (pipeline / folder).is_dir() else None
            for folder in experts.folders if folder != trained}


def resolve_sources(config: Any, fetch_weights: bool = True) -> Any:
    """A copy of RunConfig `config` with its model's Hub ids resolved to local folders (`hub.resolve_model`),
    fetching the weights of its family's components alone: the family is read from the configs and tokenizers,
    fetched first, so a family's own components (an image encoder, a second transformer) need no list here. The
    copy names the family and variant recognised (`families.recognise`), which is logged: a run's config.yaml then
    says what it trained, and the model's files, read again on resume or export, agree with it."""
    resolved = hub.resolve_model(config, fetch_weights=False)
    recognised = families.recognise(resolved.model)
    log.info("%s", recognised.line())
    if fetch_weights:
        family = recognised.family
        experts = family.experts.folders if family.experts is not None else ()
        resolved = hub.resolve_model(config, weighted=tuple(dict.fromkeys((*family.components, *experts))))
    variant = recognised.variant.name if recognised.variant is not None else None
    model = dataclasses.replace(resolved.model, family=recognised.family.name, variant=variant)
    return dataclasses.replace(resolved, model=model)


def overrides_key(name: str) -> str:
    """The key under ``model.`` of component `name`'s preset overrides, as `construct` names it in a message."""
    return f"components.{name}.overrides"


def count_parameters(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())
