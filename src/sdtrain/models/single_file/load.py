"""Loading components (and a pipeline) of a single file through diffusers' from_single_file, with the
local config folder `read` infers; never a download."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sdtrain.errors import UserError
from sdtrain.models.single_file.read import (
    SingleFileInfo,
    _File,
    _first_line,
    _info,
    _metadata_json,
    _open,
    _past_layers,
    config_folder,
)
from sdtrain.models.single_file.write import _module_config, _to_original

# The package's logger, named as before the module became a package.
log = logging.getLogger(__package__)

_COMPONENT_LABELS = {"unet": "UNet (model.diffusion_model.*)", "vae": "VAE (first_stage_model.*)",
                     "text_encoder": "text encoder (cond_stage_model.* or conditioner.embedders.0.*)",
                     "text_encoder_2": "second text encoder (SDXL's conditioner.embedders.1.model.*)"}


# --------------------------------------------------------------------------------------------------- loading


def _missing_parameters(module: torch.nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters() if p.is_meta]


def load_single_file_component(name: str, path: str | Path, trust_pickle: bool | None = None,
                               weights: bool = True,
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
        return load_single_file_component(name, path, trust_pickle, latent_constants=latent_constants).to("meta")
    file = _open(path, trust_pickle)
    if name not in _COMPONENT_LABELS:
        raise UserError(f"{path}: no component '{name}' in a single file; use one of {', '.join(_COMPONENT_LABELS)}")
    info = _info(file)
    if name in info.errors:
        raise UserError(f"{path}: unrecognized {name} layout ({info.errors[name]}); pass a Stable Diffusion "
                        "1.x/2.x or SDXL checkpoint in the original layout")
    if name not in info.configs:
        raise UserError(f"{path}: holds no {_COMPONENT_LABELS[name]}; point model.{name} at a file or folder "
                        "that has one")
    prefix = info.prefixes[name]
    if name == "vae" and prefix == "":
        keys = [k for k in file.shapes if k.startswith(("encoder.", "decoder.", "quant_conv.", "post_quant_conv."))]
    elif name == "text_encoder" and info.family == "sd":
        keys = [k for k in file.shapes if k.startswith("cond_stage_model.")]
    elif name in ("text_encoder", "text_encoder_2"):
        # Only this encoder's keys: diffusers tells SDXL's two apart by width, which tiny models may share.
        embedder = prefix[: prefix.index(".", len("conditioner.embedders.")) + 1]
        keys = [k for k in file.shapes if k.startswith(embedder)]
    else:
        keys = [k for k in file.shapes if k.startswith(prefix)]
    handed = keys
    if name == "text_encoder" and info.family == "sd" and info.text_layout == "openclip":
        layers = info.configs[name]["num_hidden_layers"]
        handed = [k for k in keys if not _past_layers(k, prefix, layers)]
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
        raise UserError(f"{path}: cannot load the {name} ({_first_line(exc)})") from exc
    missing = _missing_parameters(module)
    if missing:
        raise UserError(f"{path}: the {name} lacks {len(missing)} weights (e.g. {missing[0]}); the file is "
                        "incomplete or in a layout diffusers does not read")
    _warn_unused(name, module, keys, info, path)
    if name == "vae" and latent_constants is not None and not _states_latent_constants(file, info):
        module.register_to_config(**latent_constants())
    return module


def _states_latent_constants(file: _File, info: SingleFileInfo) -> bool:
    """Whether a single file (not SD3's, whose reader knows its constants) says how its VAE's latents are normalised:
    in its metadata (``vae_config``, as sdtrain writes it), or by holding the model the VAE serves (an SD or SDXL
    checkpoint, whose keys tell the family). A VAE file as released (Flux's ae.safetensors, sdxl_vae.safetensors,
    SD3's VAE) says nothing: its constants are those of the model it is used with."""
    if set(info.prefixes) - {"vae"}:
        return True
    return "scaling_factor" in _metadata_json(file, file.metadata, "vae_config")


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
