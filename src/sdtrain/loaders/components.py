"""Materialising modules: a component from wherever a config points (a diffusers folder, a pipeline, a single
file, an sdtrain run or checkpoint), a run's trained modules from its checkpoint, and partly trained ones
(adapters, new tokens) rebuilt on their pinned base."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdtrain import sharded
from sdtrain.checkpoint import latest_checkpoint, read_meta, read_weights, require_intact
from sdtrain.errors import UserError, first_line
from sdtrain.loaders.adapters import add_lora, add_token_rows
from sdtrain.models import families, frozen, single_file
from sdtrain.models.build import source_kind
from sdtrain.models.families.clip import pool_at_eos
from sdtrain.models.families.spec import ModelFamily

log = logging.getLogger(__name__)


def load_component(name: str, source: str | Path, trust_pickle: bool | None = None,
                   family: ModelFamily | None = None, frozen_precision: str = "fp32", weights: bool = True,
                   served: Any = None) -> Any:
    """Load component `name` ('vae', 'unet', 'text_encoder', ...; of `family`, else of whichever family has it)
    from a local source folder or single file (Stable Diffusion's original layout, or a Flux.1 transformer in
    Black Forest Labs').

    `trust_pickle` lets a pickle single file (.ckpt, .pt...) be read with torch.load(weights_only=True);
    None: the SDTRAIN_TRUST_PICKLE environment variable decides. A `frozen_precision` other than fp32 loads a
    folder's weights (or a Flux.1 transformer file's) one tensor at a time, its linear weights stored in that
    precision as they are read (`load_frozen`); from other sources the module is loaded whole and stored low
    afterwards by the task.

    Without `weights`, the module and its config with every tensor on the meta device, for a component training
    never reads (a text encoder on pre-encoded shards): from a folder nothing but its config.json is read.

    `served`: the ModelConfig of the model the component serves. A VAE single file as released (Flux's
    ae.safetensors, sdxl_vae.safetensors) does not say how its latents are normalised: it takes that model's
    scaling and shift (`families.latent_constants`), and without a model that says which, loading it is an error.
    """
    kind = source_kind(source)
    if kind == "single_file":
        return _from_single_file(name, Path(source), trust_pickle, family, frozen_precision, weights, served)
    if not weights:
        if kind in ("component", "pipeline"):
            folder = Path(source) / name if kind == "pipeline" else Path(source)
            _require_config(folder, name)
            with torch.device("meta"):
                return _from_config(families.component_class(name, family), folder).eval()
        # A run's checkpoint: its config comes with its weights.
        return load_component(name, source, trust_pickle, family).to("meta")
    cls = families.component_class(name, family)
    if kind in ("run", "checkpoint"):
        checkpoint = Path(source) if kind == "checkpoint" else None
        run = Path(source).parent.parent if checkpoint else Path(source)
        modules = load_run_modules(run, names=[name], checkpoint=checkpoint)
        if name not in modules:
            raise UserError(f"{source}: this run did not train a {name}; point model.components.{name}.source at a "
                            "run that did")
        return modules[name]
    folder = Path(source) / name if kind == "pipeline" else Path(source)
    _require_config(folder, name)
    if frozen_precision != "fp32":
        return load_frozen(cls, name, folder, frozen_precision, _prefixes(family, name))
    trusted = trust_pickle or single_file.trust_pickle_from_env()
    try:
        # Safetensors only, unless the user trusts this folder's pickles (.bin): those load with
        # weights_only in today's diffusers and transformers, but a pickle is still code to be trusted.
        prefixes = _prefixes(family, name)
        # transformers reads a language model's tower from the whole model's folder under a key mapping.
        mapping = {"key_mapping": {f"^{re.escape(found)}": read for found, read in prefixes}} if prefixes else {}
        return cls.from_pretrained(folder, local_files_only=True, use_safetensors=not trusted or None, **mapping)
    except (OSError, ValueError) as exc:
        hint = "" if trusted else ("; a folder with only pickled .bin weights loads with model.trust_pickle=true "
                                   f"(or {single_file.TRUST_PICKLE_ENV}=1) if you trust it")
        raise UserError(f"{folder}: cannot load the {name} ({first_line(exc)}){hint}") from exc


def _from_single_file(name: str, path: Path, trust_pickle: bool | None, family: ModelFamily | None,
                      frozen_precision: str, weights: bool, served: Any) -> Any:
    """Component `name` of a single file, read by the layout of the family its keys name (`family_of_keys`; a
    VAE alone or a pickle checkpoint: Stable Diffusion's original layout, whose reader says what it cannot read),
    which must be the model's own family's layout (two families may share one: an editing model's and its base's)
    unless that layout serves any (`SingleFileLayout.family_bound`)."""
    keys: list[str] = []
    if path.suffix in single_file.SAFE_SUFFIXES or not (trust_pickle or single_file.trust_pickle_from_env()):
        # Its header (an unreadable file, or a pickle not trusted, is one line here); a trusted pickle is read
        # once, by its layout.
        keys = single_file.tensor_names(path, trust_pickle)
    found = families.family_of_keys(keys) or families.SD
    layout = found.files.single_file
    assert layout is not None  # a family is recognised from a single file only by its layout's keys
    if family is not None and layout is not family.files.single_file and layout.family_bound:
        raise UserError(f"{path}: a {found.title} file, but the model is {family.title}; set "
                        f"model.family={found.name}, or point model.components.{name}.source at a {family.title} "
                        "source")
    if name not in found.components or (layout.holds is not None and name not in layout.holds):
        what = f"{found.title}'s {' and '.join(layout.holds)} alone" if layout.holds else f"{found.title}'s model"
        wanted = f"{family.title} {name}" if family is not None else name
        raise UserError(f"{path}: holds {what}, no {wanted}; set model.components.{name}.source to a source that "
                        "has one (a pipeline folder, e.g. what `sdtrain export RUN OUT` writes, or a single file "
                        "that includes it)")
    return layout.load(name, path, trust_pickle=trust_pickle, frozen_precision=frozen_precision, weights=weights,
                       latent_constants=lambda: _served_latent_constants(path, served))


def _served_latent_constants(source: str | Path, served: Any) -> dict[str, float | None]:
    found = families.latent_constants(served) if served is not None else None
    if found is None:
        raise UserError(f"{source}: a VAE file that does not say how its latents are scaled (Flux.1, SDXL and SD3 "
                        f"each scale them differently); set model.family to the family it serves (one of "
                        f"{', '.join(families.FAMILIES)}), or model.pretrained to that model")
    constants, origin = found
    log.info("%s: a VAE file without latent constants; scaling %s, shift %s, from %s", source,
             constants["scaling_factor"], constants["shift_factor"] or 0, origin)
    return constants


def _require_config(folder: Path, name: str) -> None:
    if not (folder / "config.json").is_file():
        raise UserError(f"{folder}: no config.json for the {name}; point model.components.{name}.source at a "
                        "folder that has one")


def _from_config(cls: type[nn.Module], folder: Path) -> nn.Module:
    """A component folder's module, built from its config.json with whatever weights construction gives."""
    if hasattr(cls, "config_class"):  # transformers
        return cls(cls.config_class.from_pretrained(folder, local_files_only=True))
    return cls.from_config(cls.load_config(folder, local_files_only=True))


# A folder's weights: one file or numbered shards, not a variant (diffusion_pytorch_model.fp16.safetensors).
_WEIGHT_FILE = re.compile(r"[^.]+(-\d+-of-\d+)?\.safetensors")


def load_frozen(cls: type[nn.Module], name: str, folder: Path, precision: str,
                prefixes: tuple[tuple[str, str], ...] = ()) -> nn.Module:
    """A component folder's module built with its parameters on the meta device, then filled from its safetensors
    files a tensor at a time, linear weights stored in `precision` (see sdtrain.models.frozen), each key's prefix
    read as `prefixes` say (`Component.weight_prefixes`)."""
    files = sorted(str(p) for p in folder.glob("*.safetensors") if _WEIGHT_FILE.fullmatch(p.name))
    if not files:
        raise UserError(f"{folder}: no safetensors weights for the {name}, which model.frozen_precision loads a tensor "
                        "at a time; convert the folder's weights to safetensors, or set model.frozen_precision=fp32")
    with frozen.parameters_on_meta():
        module = _from_config(cls, folder)
    missing = frozen.load_streamed(module, files, precision, prefixes)
    if missing:
        raise UserError(f"{folder}: the {name}'s weights lack {len(missing)} tensors (e.g. {missing[0]}); the folder "
                        "is incomplete")
    return module.eval()


def _split_state(flat: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    cut = len(prefix) + 1
    return {k[cut:]: v for k, v in flat.items() if k.startswith(prefix + ".")}


def instantiate(spec: dict[str, Any]) -> nn.Module:
    """A module of a checkpoint's meta.json spec (class name and config), of a class some family has."""
    cls_name, config = spec["class"], spec["config"]
    classes = {cls.__name__: cls for family in families.FAMILIES.values() for cls in family.module_classes()}
    if cls_name not in classes:
        raise UserError(f"checkpoint names an unknown module class {cls_name}")
    cls = classes[cls_name]
    if hasattr(cls, "config_class"):  # transformers
        return cls(cls.config_class.from_dict(config))
    return cls.from_config(config)


def instantiate_with(spec: dict[str, Any], weights: dict[str, torch.Tensor]) -> nn.Module:
    """A module built around `weights` without allocating and initialising its own first (which, for
    an 866M UNet, costs seconds and 3.5 GB): built on the meta device, then given the tensors."""
    with torch.device("meta"):
        module = instantiate(spec)
    module.load_state_dict(weights, strict=True, assign=True)
    if any(t.is_meta for t in (*module.parameters(), *module.buffers(), *_plain_tensors(module))):
        # Buffers the state dict does not carry (non-persistent ones), and tensors a module keeps as plain
        # attributes (Qwen-Image's complex RoPE tables), need a real construction.
        module = instantiate(spec)
        module.load_state_dict(weights)
    return module


def _plain_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The tensors `module`'s submodules hold as plain attributes, neither parameters nor buffers."""
    return [value for m in module.modules() for value in vars(m).values() if isinstance(value, torch.Tensor)]


def rebuild_lora(name: str, source: str, task_meta: dict[str, Any]) -> nn.Module:
    family = families.get(task_meta.get("family", "sd"))
    module = load_component(name, source, trust_pickle=task_meta.get("trust_pickle"), family=family)
    module.requires_grad_(False)
    add_lora(module, task_meta["lora"][name], "checkpoint")
    return module


def rebuild_textual_inversion(name: str, source: str, task_meta: dict[str, Any]) -> nn.Module:
    family = families.get(task_meta.get("family", "sd"))
    module = load_component(name, source, trust_pickle=task_meta.get("trust_pickle"), family=family)
    module.requires_grad_(False)
    pool_at_eos(module)  # as training did: at end-of-text, not at the new tokens (before they are added)
    width = module.get_input_embeddings().embedding_dim
    add_token_rows(module, torch.zeros(len(task_meta["tokens"]), width))
    return module


_REBUILDERS = {"lora": rebuild_lora, "textual_inversion": rebuild_textual_inversion}


def rebuild_partial(name: str, meta: dict[str, Any]) -> nn.Module:
    """A partly trained module of a checkpoint (see meta.json), without its trained tensors yet: its base
    loaded from the pinned source, with the structure its mode added (adapters, new token rows)."""
    task = meta.get("task", {})
    mode = task.get("mode")
    if task.get("lora"):
        mode = "lora"  # DreamBooth with LoRA records its adapters the same way
    rebuild = _REBUILDERS.get(mode)
    source = meta.get("sources", {}).get(name)
    if rebuild is None or source is None:
        raise UserError(f"checkpoint: the {name} was partly trained in mode {mode!r}, which this sdtrain cannot "
                        "rebuild; use the sdtrain version that wrote it")
    return rebuild(name, source, task)


def load_run_modules(
    run_dir: Path, names: list[str] | None = None, ema: bool = True, checkpoint: Path | None = None
) -> dict[str, nn.Module]:
    """Rebuild the trained modules of a run from its newest (or a given) checkpoint, EMA weights by default."""
    path = checkpoint or latest_checkpoint(run_dir)
    if path is None:
        raise UserError(f"{run_dir}: no complete checkpoint yet; train the run first")
    meta = read_meta(path)
    use_ema = ema and meta.get("ema", False)
    # A sharded checkpoint keeps weights and optimizer state in the same files, so all are checked.
    require_intact(path, None if sharded.is_sharded(path) else
                   ["model.safetensors", "ema.safetensors"] if use_ema else ["model.safetensors"])
    weights = read_weights(path, "ema" if use_ema else "model")
    # The EMA holds trained parameters only; buffers come from the raw weights.
    raw_weights = read_weights(path, "model") if use_ema else {}
    modules = {}
    for name, spec in meta["modules"].items():
        if names is not None and name not in names:
            continue
        state = _split_state(weights, name)
        if use_ema:
            state = {**_split_state(raw_weights, name), **state}
        if spec.get("partial"):
            module = rebuild_partial(name, meta)
            missing = set(state) - set(module.state_dict())
            if missing:
                raise UserError(f"{path}: {name} weights {sorted(missing)[0]} do not fit its base; the run's "
                                "sources changed since it saved")
            module.load_state_dict(state, strict=False)
        else:
            module = instantiate(spec)
            module.load_state_dict(state)
        module.eval()
        modules[name] = module
    return modules


def _prefixes(family: ModelFamily | None, name: str) -> tuple[tuple[str, str], ...]:
    """How component `name`'s weights are named in `family`'s released folders (`Component.weight_prefixes`)."""
    return family.components[name].weight_prefixes if family is not None and name in family.components else ()
