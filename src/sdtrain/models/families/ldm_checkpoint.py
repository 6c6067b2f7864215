"""Stable Diffusion (1.x, 2.x, XL base) checkpoints as ONE file, in the original (CompVis/LDM and Stability's
SGM, A1111/ComfyUI) layout: where each component stands in such a file, what the file says beside its weights, and
reading and writing it whole. Each component's converter is its own module (`ldm_unet`, `ldm_vae`, `ldm_text`);
SD and SDXL name this layout (`ORIGINAL_CHECKPOINT`), and its VAE-only files serve every family.

Reading: the diffusers configs of the UNet, VAE and text encoder are inferred from the file's tensor
shapes and key names (plus the settings weights cannot tell, from the file's safetensors metadata when
it has them), written into a local cache folder, and the weights are converted by diffusers' own
single-file loaders with ``config=`` that folder and ``local_files_only=True``: nothing is downloaded.

Writing: our own diffusers -> original key mapping (any number of levels, any layers_per_block), with
the settings the loader needs in the metadata, so a file written here loads back exactly.

Original layout, by component:

- UNet: ``model.diffusion_model.*``
- VAE: ``first_stage_model.*`` (a VAE-only file, as A1111 keeps them, has the same keys without prefix)
- text encoder: ``cond_stage_model.transformer.text_model.*`` (CLIP, SD 1.x) or ``cond_stage_model.model.*``
  (OpenCLIP, SD 2.x: fused ``in_proj`` attention, ``transformer.resblocks.N``; see `ldm_text`)

SDXL (``info.family == "sdxl"``; ``"sd"`` otherwise), told by its ``conditioner.embedders.*`` keys (or, for a
UNet alone, by SDXL's added embedding ``label_emb.0.*``): the same UNet and VAE prefixes, the UNet with
``label_emb.0.0``/``label_emb.0.2`` (diffusers' ``add_embedding``, addition_embed_type ``text_time``) and a
transformer depth per level; the text encoders at

- ``conditioner.embedders.0.transformer.text_model.*``: CLIP ViT-L, in the transformers key layout;
- ``conditioner.embedders.1.model.*``: OpenCLIP bigG (diffusers' CLIPTextModelWithProjection ``text_encoder_2``),
  every layer a block (SDXL conditions on the whole tower: the penultimate layer's output, and the pooled last
  one), ``text_projection`` as OpenCLIP multiplies by it (the transpose of the Linear's weight), ``logit_scale``.

Read without metadata, an SDXL file gets SDXL base's settings: 64-wide UNet heads, the time width of the added
embedding from what its projection's input leaves beside the pooled width (else 256), VAE scaling 0.13025,
``gelu`` for bigG, the schedule `SDXL_SCHEDULER` (SD's betas, "leading" timesteps) and epsilon prediction.

Metadata keys written (all strings, as safetensors requires):

- ``prediction_type``: ``epsilon`` / ``v_prediction`` / ``sample``. Without it (nor a ModelSpec
  ``modelspec.prediction_type``), an OpenCLIP (SD 2.x) file is read as ``v_prediction`` and any other as
  ``epsilon``, as diffusers assumes.
- ``scheduler_config``: JSON of the training noise scheduler (beta schedule, betas, timesteps...).
- ``unet_config``, ``vae_config``, ``text_encoder_config``: JSON of each component's settings that its
  weights cannot tell (attention heads, norm groups, the VAE's ``scaling_factor``, activation, token ids...).
  Sizes (channels, levels, layers, vocabulary...) are always read from the tensors, never from these.
- ``text_encoder_layout``: ``clip`` or ``openclip``, informative (the keys say it too).
- SDXL only: ``text_encoder_2_config``; ``text_encoder_2_layout`` (``openclip``); ``model_family``: ``sdxl``
  (the keys say it too; a VAE-only file, whose keys are SD's, is read as SDXL's when its metadata says so).
- ``sdtrain_format``: ``2``; marks a file ``sdtrain export --single-file`` wrote (and may replace). Files of
  format ``1`` (earlier sdtrain) are read and replaced as well: they differ only in the OpenCLIP text tower.

Text encoder layout when writing (`choose_text_layout`): OpenCLIP when the text encoder was loaded from an
SD 2.x-layout single file or is 1024 wide (SD 2.x's ViT-H), else CLIP. The OpenCLIP tower is written whole, one
block beyond the layers SD 2.x conditions on (see `ldm_text`).

A single file holds no tokenizer: ``sdtrain export --single-file`` writes it beside OUT.safetensors as
OUT.tokenizer/ (and SDXL's second as OUT.tokenizer_2/, `single_file.tokenizer_folder(path, 2)`), which the loader finds;
otherwise ``model.components.tokenizer.source`` must name one. The inferred configs
are cached in ``<sdtrain cache dir>/single_file/<fingerprint of keys, shapes and metadata>`` (the cache dir
is ``SDTRAIN_CACHE_DIR``, else ``~/.cache/sdtrain``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdtrain.errors import UserError
from sdtrain.models import single_file
from sdtrain.models.families.bfl import original_prefix
from sdtrain.models.families.ldm_text import (
    OPENCLIP_DROPPED_BLOCK,
    TEXT_LAYOUTS,
    TEXT_SHAPE_KEYS,
    bigg_config,
    clip_config,
    openclip_config,
    past_layers,
    text_from_original,
    text_settings,
    text_to_original,
)
from sdtrain.models.families.ldm_unet import (
    UNET_SHAPE_KEYS,
    effective_depths,
    unet_config,
    unet_from_original,
    unet_to_original,
)
from sdtrain.models.families.ldm_vae import VAE_SHAPE_KEYS, vae_config, vae_from_original, vae_to_original
from sdtrain.models.families.spec import SingleFileLayout
from sdtrain.models.single_file.read import (
    FORMAT_KEY,
    FORMAT_VERSION,
    OpenFile,
    Unrecognized,
    default_heads,
    error_line,
    metadata_json,
    strip,
)

log = logging.getLogger(__name__)

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
CLIP_PREFIX = "cond_stage_model.transformer.text_model."
OPENCLIP_PREFIX = "cond_stage_model.model."
# SDXL (Stability's SGM layout): CLIP ViT-L in the transformers key layout, then OpenCLIP bigG.
SDXL_CLIP_PREFIX = "conditioner.embedders.0.transformer.text_model."
SDXL_OPENCLIP_PREFIX = "conditioner.embedders.1.model."
_VAE_PREFIXES = (VAE_PREFIX, "vae.", "")
# The families whose files this layout holds, as a file's metadata names them.
_SD, _SDXL = "sd", "sdxl"
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")
# Bumped when the inference below changes, so a cached config folder is never reused across versions.
_CONFIG_VERSION = "3"
# Stable Diffusion's training schedule, for files that do not say theirs.
SD_SCHEDULER = dict(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                    clip_sample=False, steps_offset=1)
# SDXL base's: the same betas, sampled with "leading" spacing (its EulerDiscreteScheduler config), which a sampler
# made from_config would otherwise replace with its own default.
SDXL_SCHEDULER = {**SD_SCHEDULER, "timestep_spacing": "leading"}
# SDXL's UNet settings its weights cannot tell, for files without our metadata (stable-diffusion-xl-base-1.0's).
_SDXL_TIME_EMBED_DIM, _SDXL_POOLED_DIM = 256, 1280
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")


@dataclass
class SingleFileInfo:
    """What a single file holds, as diffusers configs."""

    path: Path
    configs: dict[str, dict[str, Any]]
    """Component name ('unet', 'vae', 'text_encoder', SDXL's 'text_encoder_2') -> its diffusers/transformers
    config."""
    prefixes: dict[str, str]
    """Component name -> the key prefix of its tensors in the file."""
    text_layout: str | None
    """The first text encoder's: 'clip' (SD 1.x, SDXL), 'openclip' (SD 2.x) or None without one. SDXL's second
    text encoder is always OpenCLIP."""
    prediction_type: str
    scheduler_config: dict[str, Any]
    """A DDPMScheduler config: the metadata's schedule, else Stable Diffusion's."""
    metadata: dict[str, str]
    fingerprint: str
    errors: dict[str, str] = field(default_factory=dict)
    """Components the file has keys of but in a structure the converters do not read: name -> why. Only
    loading that component fails (a VAE can still be read from a checkpoint whose UNet is not SD's)."""
    family: str = _SD
    """'sdxl' (Stable Diffusion XL base: SGM layout, two text encoders) or 'sd' (1.x/2.x)."""


def file_family(shapes: Iterable[str], metadata: dict[str, str] | None = None) -> str:
    """'sdxl' or 'sd' for a file of these keys: SDXL's SGM text encoders (``conditioner.embedders.*``), or a UNet
    with SDXL's added embedding (``label_emb``) and no SD text encoder beside it; else the metadata's
    ``model_family`` (a VAE alone), else 'sd'."""
    keys = set(shapes)
    if any(k.startswith("conditioner.embedders.") for k in keys):
        return _SDXL
    if not any(k.startswith("cond_stage_model.") for k in keys):
        if UNET_PREFIX + "label_emb.0.0.weight" in keys:
            return _SDXL
        if (metadata or {}).get("model_family") in (_SD, _SDXL):
            return (metadata or {})["model_family"]
    return _SD


def _time_embed_dim(projection_input: int, pooled: int) -> int:
    """SDXL's added embedding takes the pooled text embedding and 6 sinusoidal embeddings of the sizes and crop:
    the time width is what remains of the projection's input, when that divides evenly."""
    rest = projection_input - pooled
    return rest // 6 if rest > 0 and rest % 6 == 0 else _SDXL_TIME_EMBED_DIM


def _infer(shapes: dict[str, tuple[int, ...]], metadata: dict[str, str], file: OpenFile | None = None
           ) -> tuple[dict[str, dict[str, Any]], dict[str, str], str | None, str, dict[str, Any], dict[str, str]]:
    """(configs, prefixes, text_layout, prediction_type, scheduler, errors); raises Unrecognized when the file
    holds no component at all."""
    prefixes: dict[str, str] = {}
    errors: dict[str, str] = {}
    shape_configs: dict[str, dict[str, Any]] = {}
    text_layout = None
    family = file_family(shapes, metadata)
    if any(k.startswith(UNET_PREFIX) for k in shapes):
        prefixes["unet"] = UNET_PREFIX
    for prefix in _VAE_PREFIXES:
        if prefix + "encoder.conv_in.weight" in shapes and prefix + "decoder.conv_in.weight" in shapes:
            prefixes["vae"] = prefix
            break
    if family == _SDXL:
        if any(k.startswith(SDXL_CLIP_PREFIX) for k in shapes):
            prefixes["text_encoder"], text_layout = SDXL_CLIP_PREFIX, "clip"
        if any(k.startswith(SDXL_OPENCLIP_PREFIX) for k in shapes):
            prefixes["text_encoder_2"] = SDXL_OPENCLIP_PREFIX
    elif OPENCLIP_PREFIX + "token_embedding.weight" in shapes:
        prefixes["text_encoder"], text_layout = OPENCLIP_PREFIX, "openclip"
    elif any(k.startswith(CLIP_PREFIX) for k in shapes):
        prefixes["text_encoder"], text_layout = CLIP_PREFIX, "clip"
    if not prefixes:
        raise Unrecognized("none of model.diffusion_model.*, first_stage_model.*, cond_stage_model.*, "
                            "conditioner.embedders.* (not a Stable Diffusion checkpoint in the original layout)")
    for name, prefix in prefixes.items():
        part = strip(shapes, prefix) if prefix else shapes
        try:
            if name == "unet":
                shape_configs[name] = unet_config(part, family == "sdxl")
            elif name == "vae":
                shape_configs[name] = vae_config(part)
            elif name == "text_encoder_2":
                shape_configs[name] = bigg_config(part)
            elif text_layout == "openclip":
                shape_configs[name] = openclip_config(part)
            else:
                shape_configs[name] = clip_config(part)
        except Unrecognized as exc:
            errors[name] = str(exc)

    # Stability's ModelSpec metadata (kohya, ComfyUI) says "v" or "epsilon" under its own key.
    modelspec = {"v": "v_prediction", "epsilon": "epsilon"}.get(metadata.get("modelspec.prediction_type", ""))
    prediction = (metadata.get("prediction_type") or modelspec
                  or ("v_prediction" if text_layout == "openclip" else "epsilon"))
    if prediction not in PREDICTION_TYPES:
        raise UserError(f"{file.path if file else 'file'}: metadata prediction_type '{prediction}' is not one of "
                        f"{', '.join(PREDICTION_TYPES)}")
    sd2 = text_layout == "openclip"
    xl = family == _SDXL
    configs: dict[str, dict[str, Any]] = {}
    if "unet" in shape_configs:
        shape = shape_configs["unet"]
        # SDXL's heads are 64 wide at every level, as SD 2.x's (linear projections); SD 1.x has 8 heads.
        linear = shape["use_linear_projection"] or xl
        heads = [max(c // 64, 1) for c in shape["block_out_channels"]] if linear else 8
        defaults: dict[str, Any] = {"sample_size": 128 if xl else 96 if sd2 else 64, "attention_head_dim": heads}
        if xl:
            pooled = shape_configs.get("text_encoder_2", {}).get("projection_dim", _SDXL_POOLED_DIM)
            defaults["addition_time_embed_dim"] = _time_embed_dim(shape["projection_class_embeddings_input_dim"],
                                                                  pooled)
        configs["unet"] = {**defaults, **metadata_json(file, metadata, "unet_config"), **shape}
    if "vae" in shape_configs:
        configs["vae"] = {"sample_size": 1024 if xl else 768 if sd2 else 512,
                          "scaling_factor": 0.13025 if xl else 0.18215,
                          **metadata_json(file, metadata, "vae_config"), **shape_configs["vae"]}
    for name in TEXT_ENCODERS:
        if name not in shape_configs:
            continue
        shape = shape_configs[name]
        # SD's own text encoder configs (SDXL's too): ids 0/2 (pooling at the highest token id), CLIP's quick_gelu,
        # OpenCLIP's gelu.
        openclip = sd2 or name == "text_encoder_2"
        configs[name] = {
            "hidden_act": "gelu" if openclip else "quick_gelu",
            "num_attention_heads": default_heads(shape["hidden_size"]),
            "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1, "projection_dim": shape["hidden_size"],
            **metadata_json(file, metadata, f"{name}_config"), **shape,
        }
    base = SDXL_SCHEDULER if xl else SD_SCHEDULER
    scheduler = {**base, **metadata_json(file, metadata, "scheduler_config"), "prediction_type": prediction}
    return configs, prefixes, text_layout, prediction, scheduler, errors


def _info(file: OpenFile) -> SingleFileInfo:
    """What `file` holds, inferred once per file."""
    if file.inferred is None:
        try:
            configs, prefixes, layout, prediction, scheduler, errors = _infer(file.shapes, file.metadata, file)
        except Unrecognized as exc:
            if original_prefix(file.shapes) is not None:
                raise UserError(f"{file.path}: holds a Flux.1 transformer alone (BFL's layout), read only as "
                                "model.components.transformer.source (or model.pretrained, with the sources of "
                                "model.components vae, text_encoder, text_encoder_2 and tokenizer naming the rest); "
                                "for a whole model pass a Flux pipeline folder") from exc
            raise UserError(f"{file.path}: unrecognized checkpoint layout ({exc}); pass a Stable Diffusion 1.x/2.x "
                            "or SDXL checkpoint in the original layout") from exc
        file.inferred = SingleFileInfo(file.path, configs, prefixes, layout, prediction, scheduler, file.metadata,
                                    single_file.fingerprint(file, _CONFIG_VERSION),
                                    errors, file_family(file.shapes, file.metadata))
    return file.inferred


def inspect(path: str | Path, trust_pickle: bool | None = None) -> SingleFileInfo:
    """Read what a single file holds (its header only, for safetensors) as diffusers configs."""
    return _info(single_file.open_file(path, trust_pickle))


def prediction_type(path: str | Path, trust_pickle: bool | None = None) -> str:
    return inspect(path, trust_pickle).prediction_type


def scheduler_config(path: str | Path, trust_pickle: bool | None = None) -> dict[str, Any]:
    """The DDPMScheduler config of a single file, prediction type included."""
    return dict(inspect(path, trust_pickle).scheduler_config)


def text_encoder_layout(path: str | Path, trust_pickle: bool | None = None) -> str | None:
    return inspect(path, trust_pickle).text_layout


def model_family(path: str | Path, trust_pickle: bool | None = None) -> str:
    """'sdxl' or 'sd' (see `file_family`)."""
    return inspect(path, trust_pickle).family


# --------------------------------------------------------------------------------------------------- config folder


def config_folder(info: SingleFileInfo) -> Path:
    """A local diffusers folder with the configs of `info` (``unet/config.json``...), cached by the file's header."""
    return single_file.cached_folder(info.fingerprint, lambda tmp: _fill_config_folder(tmp, info))


def _fill_config_folder(tmp: Path, info: SingleFileInfo) -> None:
    import diffusers
    from transformers import CLIPTextConfig

    pipeline = "StableDiffusionXLPipeline" if info.family == _SDXL else "StableDiffusionPipeline"
    index: dict[str, Any] = {"_class_name": pipeline, "_diffusers_version": diffusers.__version__}
    classes = {"unet": "UNet2DConditionModel", "vae": "AutoencoderKL", "text_encoder": "CLIPTextModel",
               "text_encoder_2": "CLIPTextModelWithProjection"}
    for name, config in info.configs.items():
        if name in TEXT_ENCODERS:
            try:
                text_config = CLIPTextConfig(**config)
            except (TypeError, ValueError) as exc:
                label = "text encoder" if name == "text_encoder" else "second text encoder"
                raise UserError(f"{info.path}: {label} settings are invalid ({error_line(exc)})") from exc
            text_config.architectures = [classes[name]]
            (tmp / name).mkdir(parents=True, exist_ok=True)
            text_config.to_json_file(str(tmp / name / "config.json"))
            index[name] = ["transformers", classes[name]]
        else:
            single_file.write_json(tmp / name / "config.json", {
                "_class_name": classes[name], "_diffusers_version": diffusers.__version__, **config})
            index[name] = ["diffusers", classes[name]]
    single_file.write_json(tmp / "scheduler" / "scheduler_config.json", {
        "_class_name": "DDPMScheduler", "_diffusers_version": diffusers.__version__, **info.scheduler_config})
    index["scheduler"] = ["diffusers", "DDPMScheduler"]
    single_file.write_json(tmp / "model_index.json", index)  # last: a folder with it is complete


# --------------------------------------------------------------------------------------------------- loading


_COMPONENT_LABELS = {"unet": "UNet (model.diffusion_model.*)", "vae": "VAE (first_stage_model.*)",
                     "text_encoder": "text encoder (cond_stage_model.* or conditioner.embedders.0.*)",
                     "text_encoder_2": "second text encoder (SDXL's conditioner.embedders.1.model.*)"}


def _missing_parameters(module: torch.nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters() if p.is_meta]


def load_component(name: str, path: str | Path, trust_pickle: bool | None = None, weights: bool = True,
                   latent_constants: Callable[[], dict[str, float | None]] | None = None) -> Any:
    """Component `name` ('unet', 'vae', 'text_encoder', or SDXL's 'text_encoder_2') of a Stable Diffusion file in
    the original layout, in fp32, through diffusers' single-file loaders with a local config folder; never a
    download. Without `weights`, moved to the meta device.

    A VAE file that does not say how its latents are normalised (`_states_latent_constants`) takes the scaling and
    shift `latent_constants()` gives (the model it serves says them); without it, the ones SD's layout implies."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.loaders.single_file_utils import SingleFileComponentError, create_diffusers_clip_model_from_ldm
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    if not weights:
        return load_component(name, path, trust_pickle, latent_constants=latent_constants).to("meta")
    file = single_file.open_file(path, trust_pickle)
    if name not in _COMPONENT_LABELS:
        raise UserError(f"{path}: no component '{name}' in a single file; use one of {', '.join(_COMPONENT_LABELS)}")
    info = _info(file)
    if name in info.errors:
        raise UserError(f"{path}: unrecognized {name} layout ({info.errors[name]}); pass a Stable Diffusion "
                        "1.x/2.x or SDXL checkpoint in the original layout")
    if name not in info.configs:
        raise UserError(f"{path}: holds no {_COMPONENT_LABELS[name]}; point model.components.{name}.source at a "
                        "file or folder that has one")
    prefix = info.prefixes[name]
    if name == "vae" and prefix == "":
        keys = [k for k in file.shapes if k.startswith(("encoder.", "decoder.", "quant_conv.", "post_quant_conv."))]
    elif name == "text_encoder" and info.family == _SD:
        keys = [k for k in file.shapes if k.startswith("cond_stage_model.")]
    elif name in ("text_encoder", "text_encoder_2"):
        # Only this encoder's keys: diffusers tells SDXL's two apart by width, which tiny models may share.
        embedder = prefix[: prefix.index(".", len("conditioner.embedders.")) + 1]
        keys = [k for k in file.shapes if k.startswith(embedder)]
    else:
        keys = [k for k in file.shapes if k.startswith(prefix)]
    handed = keys
    if name == "text_encoder" and info.family == _SD and info.text_layout == "openclip":
        layers = info.configs[name]["num_hidden_layers"]
        handed = [k for k in keys if not past_layers(k, prefix, layers)]
    # fp32 whatever the file stores (an fp16 file trains from fp32 master weights like any other source).
    tensors = {k: v.float() if v.is_floating_point() else v for k, v in file.tensors(handed).items()}
    folder = str(config_folder(info))
    common = dict(config=folder, subfolder=name, local_files_only=True)
    try:
        if name == "unet":
            module = UNet2DConditionModel.from_single_file(tensors, **common)
        elif name == "vae":
            module = AutoencoderKL.from_single_file(tensors, **common)
        else:
            cls = CLIPTextModelWithProjection if name == "text_encoder_2" else CLIPTextModel
            module = create_diffusers_clip_model_from_ldm(cls, checkpoint=tensors, **common)
    except (ValueError, KeyError, RuntimeError, OSError, TypeError, SingleFileComponentError) as exc:
        raise UserError(f"{path}: cannot load the {name} ({error_line(exc)})") from exc
    missing = _missing_parameters(module)
    if missing:
        raise UserError(f"{path}: the {name} lacks {len(missing)} weights (e.g. {missing[0]}); the file is "
                        "incomplete or in a layout diffusers does not read")
    _warn_unused(name, module, keys, info, path)
    if name == "vae" and latent_constants is not None and not _states_latent_constants(file, info):
        module.register_to_config(**latent_constants())
    return module


def _states_latent_constants(file: OpenFile, info: SingleFileInfo) -> bool:
    """Whether a single file (not SD3's, whose reader knows its constants) says how its VAE's latents are normalised:
    in its metadata (``vae_config``, as sdtrain writes it), or by holding the model the VAE serves (an SD or SDXL
    checkpoint, whose keys tell the family). A VAE file as released (Flux's ae.safetensors, sdxl_vae.safetensors,
    SD3's VAE) says nothing: its constants are those of the model it is used with."""
    if set(info.prefixes) - {"vae"}:
        return True
    return "scaling_factor" in metadata_json(file, file.metadata, "vae_config")


def _warn_unused(name: str, module: Any, keys: list[str], info: SingleFileInfo, path: str | Path) -> None:
    """Say so when the file has tensors of this component that no weight was loaded from."""
    shapes_only = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in module.state_dict().items()}
    try:
        expected = set(_to_original(name, shapes_only, _module_config(name, module), info.text_layout))
    except UserError:
        return
    prefix = info.prefixes[name]
    # An OpenCLIP tower's unused last block is in `expected`, as written; CLIP's contrastive head is never used,
    # whatever part of it a file has.
    ignorable = re.compile(r"(position_ids|text_projection|logit_scale)$")
    unused = sorted(k for k in keys if not (k.startswith(prefix) and k[len(prefix):] in expected)
                    and not ignorable.search(k))
    if unused:
        log.warning("%s: %d tensors of the %s were not used (e.g. %s)", path, len(unused), name, unused[0])


# --------------------------------------------------------------------------------------------------- writing


def _module_config(name: str, module: Any) -> dict[str, Any]:
    if name in TEXT_ENCODERS:
        return text_settings(module)
    return {k: v for k, v in dict(module.config).items() if not k.startswith("_")}


def _to_original(name: str, state: dict[str, torch.Tensor], config: dict[str, Any],
                 text_layout: str | None) -> dict[str, torch.Tensor]:
    """A component's diffusers state dict in the original layout, keys without the component prefix."""
    if name == "unet":
        return unet_to_original(state, config)
    if name == "vae":
        return vae_to_original(state, config)
    if name == "text_encoder_2":
        return text_to_original(state, "openclip", whole=True)
    return text_to_original(state, text_layout or "clip")


def choose_text_layout(text_encoder: Any, source: str | Path | None = None, requested: str = "auto") -> str:
    """'clip' or 'openclip' for writing `text_encoder`.

    Rule for 'auto': OpenCLIP (SD 2.x) when the text encoder was loaded from an SD 2.x-layout single file,
    or its hidden size is 1024 (SD 2.x's ViT-H); else CLIP (SD 1.x). An OpenCLIP layout holds at most 23
    layers (diffusers drops block 23 when reading), so a deeper encoder is written in the CLIP layout.
    """
    if requested not in ("auto", *TEXT_LAYOUTS):
        raise UserError(f"text layout '{requested}' is not one of auto, {', '.join(TEXT_LAYOUTS)}")
    layers = text_encoder.config.num_hidden_layers
    if requested != "auto":
        if requested == "openclip" and layers > OPENCLIP_DROPPED_BLOCK:
            raise UserError(f"--text-layout openclip: a {layers}-layer text encoder does not fit the OpenCLIP "
                            f"layout, which diffusers reads up to {OPENCLIP_DROPPED_BLOCK} layers; use clip")
        return requested
    from_sd2 = False
    if source is not None and single_file.is_single_file(source):
        try:
            from_sd2 = text_encoder_layout(source) == "openclip"
        except UserError:
            from_sd2 = False
    wants = from_sd2 or text_encoder.config.hidden_size == 1024
    if wants and layers > OPENCLIP_DROPPED_BLOCK:
        log.warning("a %d-layer text encoder does not fit the OpenCLIP layout; writing it in the CLIP layout", layers)
        return "clip"
    return "openclip" if wants else "clip"


def _normalize(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_normalize(v) for v in value]
    return value


def _sdxl(unet: Any = None, text_encoder_2: Any = None) -> bool:
    """Whether components are written in SDXL's layout: a second text encoder, or a UNet with SDXL's added
    embedding of the pooled text and sizes."""
    return text_encoder_2 is not None or (unet is not None and unet.config.get("addition_embed_type") == "text_time")


def _config_differences(expected: dict[str, Any], inferred: dict[str, Any]) -> list[str]:
    differ = []
    for key, value in expected.items():
        got = inferred.get(key)
        a, b = _normalize(value), _normalize(got)
        if key == "transformer_layers_per_block" and "down_block_types" in expected and got is not None:
            # A level without attention ignores its depth: [1, 2, 10] and [3, 2, 10] are the same SDXL UNet.
            a, b = (effective_depths(v, expected["down_block_types"]) for v in (a, b))
        if key == "layers_per_block" and isinstance(a, list) and len(set(a)) == 1:
            a = a[0]
        if key == "time_embedding_dim" and a == 4 * expected["block_out_channels"][0]:
            a = None  # the default, spelled out
        if a != b:
            differ.append(f"{key}={value!r} reads back as {got!r}")
    return differ


def to_original_state_dict(unet: Any = None, vae: Any = None, text_encoder: Any = None,
                           text_layout: str = "clip", text_encoder_2: Any = None) -> dict[str, torch.Tensor]:
    """The components' weights in the original single-file layout (keys with their component prefix).

    With `text_encoder_2` (or a UNet with SDXL's ``text_time`` added embedding), SDXL's SGM layout: the text
    encoders at ``conditioner.embedders.0.transformer.text_model.*`` (CLIP) and ``conditioner.embedders.1.model.*``
    (OpenCLIP, whole, with its ``text_projection``). A VAE alone is written with bare keys (``encoder.*``,
    ``decoder.*``), as standalone VAE files are.
    """
    if text_encoder is not None and text_layout not in TEXT_LAYOUTS:
        raise UserError(f"text layout '{text_layout}' is not one of {', '.join(TEXT_LAYOUTS)}")
    sdxl = _sdxl(unet, text_encoder_2)
    if sdxl and text_encoder is not None and text_layout != "clip":
        raise UserError(f"text layout '{text_layout}': SDXL's first text encoder is written in the CLIP layout")
    out: dict[str, torch.Tensor] = {}
    vae_only = unet is None and text_encoder is None and text_encoder_2 is None
    text_prefix = SDXL_CLIP_PREFIX if sdxl else OPENCLIP_PREFIX if text_layout == "openclip" else CLIP_PREFIX
    for name, module, prefix in (("unet", unet, UNET_PREFIX), ("vae", vae, "" if vae_only else VAE_PREFIX),
                                 ("text_encoder", text_encoder, text_prefix),
                                 ("text_encoder_2", text_encoder_2, SDXL_OPENCLIP_PREFIX)):
        if module is None:
            continue
        mapped = _to_original(name, module.state_dict(), _module_config(name, module), text_layout)
        out.update({prefix + k: v for k, v in mapped.items()})
    return out


def single_file_metadata(unet: Any = None, vae: Any = None, text_encoder: Any = None, scheduler: Any = None,
                         text_layout: str | None = None, text_encoder_2: Any = None) -> dict[str, str]:
    """The metadata a written file carries: what its weights cannot tell (see the module docstring)."""
    metadata = {"format": "pt", FORMAT_KEY: FORMAT_VERSION}
    if _sdxl(unet, text_encoder_2):
        # The keys say it too; this is for readers that go by metadata (a VAE-only file, whose keys are SD's, says
        # it only when the caller's `metadata` does).
        metadata["model_family"] = _SDXL
    if scheduler is not None:
        config = dict(scheduler.config)
        # Settings left at their defaults stay unsaid, as in a diffusers folder: a sampler made from the schedule
        # (from_config of another class) then takes its own defaults for them, the same either way.
        defaults = set(config.get("_use_default_values", []))
        settings = {k: v for k, v in config.items() if not k.startswith("_") and k not in defaults}
        metadata["prediction_type"] = str(settings.pop("prediction_type", "epsilon"))
        metadata["scheduler_config"] = json.dumps(settings, sort_keys=True)
    for name, module, shape_keys in (("unet", unet, UNET_SHAPE_KEYS), ("vae", vae, VAE_SHAPE_KEYS),
                                     ("text_encoder", text_encoder, TEXT_SHAPE_KEYS),
                                     ("text_encoder_2", text_encoder_2, TEXT_SHAPE_KEYS)):
        if module is not None:
            extras = {k: v for k, v in _module_config(name, module).items() if k not in shape_keys}
            metadata[f"{name}_config"] = json.dumps(extras, sort_keys=True)
    if text_encoder is not None and text_layout:
        metadata["text_encoder_layout"] = text_layout
    if text_encoder_2 is not None:
        metadata["text_encoder_2_layout"] = "openclip"
    return metadata


def _diffusers_converted_keys(name: str, state: dict[str, torch.Tensor], module: Any) -> set[str]:
    """The diffusers keys diffusers' own single-file converters make of `state` for this component."""
    if name == "unet":
        return set(unet_from_original(state, dict(module.config)))
    if name == "vae":
        return set(vae_from_original(state, dict(module.config)))
    if name == "text_encoder_2":
        prefix = SDXL_OPENCLIP_PREFIX
    else:
        prefix = OPENCLIP_PREFIX if OPENCLIP_PREFIX + "token_embedding.weight" in state else None
    return {k.removeprefix("text_model.") for k in text_from_original(module, state, prefix)}


def _check_reads_back(components: dict[str, Any], state: dict[str, torch.Tensor], metadata: dict[str, str],
                      out: Path) -> None:
    """What a reader will make of the written keys and metadata must be each module as it is: the configs our
    loader infers, and the keys diffusers' converters produce (on shapes only: meta tensors, no copies)."""
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    try:
        inferred = _infer(shapes, metadata)
    except Unrecognized as exc:
        raise UserError(f"{out}: this model cannot be written in the original layout ({exc})") from exc
    configs, errors = inferred[0], inferred[-1]
    if errors:
        name, why = next(iter(errors.items()))
        raise UserError(f"{out}: the {name} cannot be written in the original layout ({why})")
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}
    for name, module in components.items():
        differ = _config_differences(_module_config(name, module), configs.get(name, {}))
        if differ:
            raise UserError(f"{out}: the {name} would not read back as it is ({differ[0]}); this architecture "
                            "cannot be written as a single file")
        # CLIPTextModel's keys have no text_model. prefix (transformers 5), CLIPTextModelWithProjection's do.
        wanted = {k.removeprefix("text_model.") for k in module.state_dict() if not k.endswith("position_ids")}
        converted = _diffusers_converted_keys(name, meta, module)
        if converted != wanted:
            odd = sorted(converted ^ wanted)
            raise UserError(f"{out}: diffusers would not read the {name} back ({len(odd)} weights differ, e.g. "
                            f"{odd[0]}); this architecture cannot be written as a single file")


def save(out: str | Path, *, unet: Any = None, vae: Any = None, text_encoder: Any = None,
         text_encoder_2: Any = None, scheduler: Any = None, text_layout: str = "auto",
         text_source: str | Path | None = None, half: bool = False, metadata: dict[str, str] | None = None) -> Path:
    """Write the given components as ONE safetensors file in the original SD layout, atomically.

    With `text_encoder_2` (SDXL's CLIPTextModelWithProjection), or a UNet with SDXL's ``text_time`` added
    embedding, the file is in SDXL's SGM layout (see `to_original_state_dict`) and says ``model_family: sdxl``.
    `scheduler` (the training noise scheduler) gives ``prediction_type`` and ``scheduler_config``; without it
    the file says neither and readers assume SD's (v_prediction for an SD 2.x OpenCLIP file, else epsilon).
    `text_layout` is 'auto' (see `choose_text_layout`, `text_source` being where the text encoder came
    from), 'clip' or 'openclip' (never for SDXL, whose first text encoder is CLIP). fp32 unless `half`.
    Returns `out`.
    """

    out = Path(out)
    components = {n: m for n, m in (("unet", unet), ("vae", vae), ("text_encoder", text_encoder),
                                    ("text_encoder_2", text_encoder_2)) if m is not None}
    if not components:
        raise UserError(f"{out}: nothing to write (no UNet, VAE or text encoder)")
    if text_encoder is None:
        layout = None
    elif _sdxl(unet, text_encoder_2):
        if text_layout not in ("auto", "clip"):
            raise UserError(f"{out}: text layout '{text_layout}' does not apply to SDXL, whose first text encoder "
                            "is written in the CLIP layout; use auto or clip")
        layout = "clip"
    else:
        layout = choose_text_layout(text_encoder, text_source, text_layout)
    state = to_original_state_dict(unet, vae, text_encoder, layout or "clip", text_encoder_2)
    info = single_file_metadata(unet, vae, text_encoder, scheduler, layout, text_encoder_2)
    info.update(metadata or {})
    _check_reads_back(components, state, info, out)
    return single_file.write_tensors(out, state, torch.float16 if half else torch.float32, info)


class OriginalCheckpoint(SingleFileLayout):
    """Stable Diffusion's original checkpoint (CompVis/LDM, Stability's SGM for SDXL): UNet, VAE and text
    encoders in one file, as A1111 and ComfyUI load it. Its VAE-only files (Flux's ae.safetensors,
    sdxl_vae.safetensors) serve every family."""

    family_bound = False
    text_layouts = TEXT_LAYOUTS

    def load(self, name: str, path: Path, *, trust_pickle: bool | None, frozen_precision: str, weights: bool,
             latent_constants: Callable[[], dict[str, float | None]]) -> nn.Module:
        return load_component(name, path, trust_pickle, weights=weights, latent_constants=latent_constants)

    def write(self, out: Path, components: dict[str, nn.Module], *, half: bool, scheduler: Any,
              text_layout: str, text_source: str | Path | None) -> None:
        save(out, unet=components.get("unet"), vae=components.get("vae"),
             text_encoder=components.get("text_encoder"), text_encoder_2=components.get("text_encoder_2"),
             scheduler=scheduler, text_layout=text_layout, text_source=text_source, half=half)


ORIGINAL_CHECKPOINT = OriginalCheckpoint()


class ScheduleInFile:
    """The `FileInterchange.file_scheduler` of a family whose files are in this layout: the schedule the file's
    metadata records, else its release's (SD's, SDXL's)."""

    def file_scheduler(self, path: str | Path, trust_pickle: bool | None) -> dict[str, Any] | None:
        return scheduler_config(path, trust_pickle)
