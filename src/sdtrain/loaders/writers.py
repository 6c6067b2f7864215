"""The files a fine-tuned run's trained parts are written as, in the layouts the tools users load them with read:
LoRA adapters as diffusers' ``pytorch_lora_weights.safetensors`` (``load_lora_weights``) and kohya's
``lora_kohya.safetensors`` (A1111, ComfyUI; DoRA's also as ``lora_kohya_lycoris.safetensors`` for LyCORIS's
reading), new token vectors as ``learned_embeds.safetensors``
(``load_textual_inversion``). The trainer writes them into every checkpoint folder and ``sdtrain export`` from a
checkpoint; loaders.adapters rebuilds the modules they come from."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoKrConfig
from peft.tuners.lokr import LoKrLayer
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from sdtrain.loaders.adapters import has_lora
from sdtrain.models import families
from sdtrain.models.families.spec import ModelFamily, text_model_path

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
"""The file diffusers' ``load_lora_weights(DIR)`` looks for."""
KOHYA_WEIGHTS = "lora_kohya.safetensors"
KOHYA_LYCORIS_WEIGHTS = "lora_kohya_lycoris.safetensors"
"""DoRA's kohya file with ``dora_scale`` as LyCORIS reads it (the magnitude itself); KOHYA_WEIGHTS has it as
ComfyUI reads it (see `kohya_lycoris`)."""
LEARNED_EMBEDS = "learned_embeds.safetensors"
INSTRUCT_PIX2PIX = "instruct_pix2pix"
"""The task key of meta.json saying a run's denoiser learned InstructPix2Pix's editing (its pipeline is the
family's InstructPix2Pix one)."""
REFERENCE_EDIT = "reference_edit"
"""The task key of meta.json saying a run's denoiser learned to edit by reference (``edit.reference``: its pipeline
is the family's editing one)."""
CONTROLNET = "controlnet"
"""A ControlNet run's trained module: its name in checkpoints (``controlnet.*``) and its export's folder
(``OUT/controlnet``, diffusers' ControlNetModel layout)."""


def lora_state(module: nn.Module, weights: dict[str, torch.Tensor], text_encoder: bool = False,
               peft_names: bool = False) -> dict[str, Any]:
    """The adapter weights in the key layout diffusers' loaders read: converted to diffusers' names, or with
    `peft_names` peft's own (see ModelFamily.denoiser_lora_peft_names; a denoiser's too where diffusers' names
    would cover only some of its adapted layers). `weights` are the module's tensors by their names in it (whole
    ones: the module's own may be shards). A text encoder's keep CLIP's ``text_model.`` level, which transformers 5
    dropped from CLIPTextModel: diffusers reads them either way, and ComfyUI and older diffusers only with it."""
    state = get_peft_model_state_dict(module, state_dict=weights)
    if peft_names:
        return state
    converted = convert_state_dict_to_diffusers(state)
    if not text_encoder:
        # diffusers' names exist for attention projections alone: a denoiser's file mixing them with peft's names
        # of other layers (convolutions, feed-forwards) loads with the renamed layers' adapters left unset, one of
        # peft's names whole.
        return state if any(".lora_A." in key or ".lora_B." in key for key in converted) else converted
    return {text_model_path(key): value for key, value in converted.items()}


def kohya_state(modules: dict[str, nn.Module], weights: dict[str, dict[str, torch.Tensor]],
                family: ModelFamily, dora_reader: str = "comfyui") -> dict[str, torch.Tensor]:
    """The same adapters in kohya's layout, the one A1111, ComfyUI and diffusers all read:
    ``<prefix><module path, dots as underscores>.lora_down.weight / .lora_up.weight / .alpha``, the prefix and
    the module paths the family's (``lora_unet_``, ``lora_te_`` for SD's one text encoder, ``lora_te1_`` and
    ``lora_te2_`` for SDXL's two; SDXL's UNet paths and Flux.1's and Z-Image's transformer paths in their original
    layouts, their fused projections fused), and a true scalar alpha per module (the scale is alpha / rank).
    DoRA adds each module's ``.dora_scale``, as `dora_reader` reads it; LoKr writes LyCORIS's ``.lokr_w1``
    (``_a``/``_b``) and ``.lokr_w2`` factors instead (see `kohya_lycoris`)."""
    state = {}
    for name, module in modules.items():
        tensors = weights[name]
        layers = {path: (_whole(tensors, f"{path}.lora_A.default.weight"),
                         _whole(tensors, f"{path}.lora_B.default.weight"), float(layer.lora_alpha["default"]))
                  for path, layer in module.named_modules()
                  if isinstance(layer, LoraLayer) and "default" in layer.lora_A}
        state.update(family.files.kohya_lora(name, layers, module.config))
        state.update(kohya_lycoris(module, tensors, lambda path, name=name, module=module:
                                   family.files.kohya_lora_name(name, path, module.config), dora_reader))
    return state


def comfyui_dora_state(modules: dict[str, nn.Module], weights: dict[str, dict[str, torch.Tensor]],
                       family: ModelFamily) -> dict[str, torch.Tensor]:
    """DoRA adapters as ComfyUI reads them under diffusers' module names (``transformer.<path>``: the names it maps
    onto a fused layer's rows, Flux.1's q, k, v in qkv, where kohya's layout would have to fuse DoRA's per-layer
    magnitudes): ``.lora_down.weight / .lora_up.weight / .alpha`` and ``.dora_scale`` (see `kohya_lycoris`), whose
    rows ComfyUI takes in the order the original layout keeps the weight's (`ModelFamily.original_rows`). A text
    encoder's keep CLIP's ``text_model.`` level, as ComfyUI names them (see `lora_state`)."""
    state = {}
    for name, module in modules.items():
        tensors = weights[name]

        def key_of(path: str, name: str = name) -> str:
            return f"{name}.{text_model_path(path) if name in family.components.text_encoders else path}"

        for path, layer in module.named_modules():
            if isinstance(layer, LoraLayer) and "default" in layer.lora_A:
                state.update({f"{key_of(path)}.lora_down.weight": _whole(tensors, f"{path}.lora_A.default.weight"),
                              f"{key_of(path)}.lora_up.weight": _whole(tensors, f"{path}.lora_B.default.weight"),
                              f"{key_of(path)}.alpha": torch.tensor(float(layer.lora_alpha["default"]))})
                if layer.use_dora.get("default"):
                    state[f"{key_of(path)}.dora_scale"] = family.files.original_rows(name, path,
                                                                               _dora_scale(layer, tensors, path))
    return state


def kohya_lycoris(module: nn.Module, tensors: dict[str, torch.Tensor], key_of: Callable[[str], str],
                  dora_reader: str = "comfyui") -> dict[str, torch.Tensor]:
    """What kohya's layout holds of a component's DoRA and LoKr adapters beyond LoRA's keys, as LyCORIS writes them
    and ComfyUI applies them, under `key_of(module path)`. DoRA: ``.dora_scale`` per module, one value per output
    row, shaped (out, 1, ...) as LyCORIS keeps it (its wd_on_out; ComfyUI tells that axis by the first side), for
    the `dora_reader`. Both scale the row of the updated weight W0 + dW by dora_scale over a row norm, LyCORIS (as
    peft does with the magnitude m) by |row of W0 + dW|: its dora_scale is m; ComfyUI by |row of W0|: its
    dora_scale is m * |W0| / |W0 + dW|, of the base weight as the file's reader holds it. LoKr: the factors, the
    scale alpha / rank in the first (ComfyUI reads an alpha only where a factor is split, peft scales every product
    by it), and no alpha."""
    state = {}
    for path, layer in module.named_modules():
        if isinstance(layer, LoraLayer) and layer.use_dora.get("default"):
            state[f"{key_of(path)}.dora_scale"] = _dora_scale(layer, tensors, path, dora_reader)
        elif isinstance(layer, LoKrLayer) and ("default" in layer.lokr_w1 or "default" in layer.lokr_w1_a):
            key = key_of(path)
            first = "lokr_w1" if "default" in layer.lokr_w1 else "lokr_w1_a"
            for factor in ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"):
                if "default" in getattr(layer, factor):
                    value = _whole(tensors, f"{path}.{factor}.default")
                    state[f"{key}.{factor}"] = value * layer.scaling["default"] if factor == first else value
    return state


def _dora_scale(layer: LoraLayer, tensors: dict[str, torch.Tensor], path: str, reader: str = "comfyui"
                ) -> torch.Tensor:
    """The DoRA layer at `path`'s magnitudes as `reader` (comfyui, lycoris) applies them (see `kohya_lycoris`),
    from its trained `tensors` (the component's, by name) and its base weight."""
    base = layer.get_base_layer().weight.detach().float().cpu()
    scale = _whole(tensors, f"{path}.lora_magnitude_vector.default.weight").reshape(-1)
    if reader == "comfyui":
        down = _whole(tensors, f"{path}.lora_A.default.weight").flatten(1)
        up = _whole(tensors, f"{path}.lora_B.default.weight").flatten(1)
        updated = base + (up @ down).reshape(base.shape) * layer.scaling["default"]
        scale = scale * base.flatten(1).norm(dim=1) / updated.flatten(1).norm(dim=1)
    return scale.reshape(-1, *[1] * (base.dim() - 1)).contiguous()


def _whole(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    return tensors[key].detach().float().cpu().contiguous()


def _is_up(key: str) -> bool:
    """Whether a diffusers LoRA key holds an up (B) weight, in peft's names or diffusers'."""
    return ".lora_B." in key or key.endswith(".up.weight")


LOAD_INTO_KEY = "sdtrain.load_into"
"""The LoRA file's metadata key naming the pipeline attribute its denoiser adapters belong to, where that is not the
pipeline's first denoiser (a model of experts' second: diffusers' ``load_into_transformer_2``)."""


def lora_load_into(family: ModelFamily, expert: str | None) -> str | None:
    """The pipeline attribute the LoRA of `family`'s `expert` (None: its default) loads into where that is not the
    pipeline's first denoiser (Wan 2.2 A14B's low-noise expert: diffusers' ``load_into_transformer_2``); None for
    the first, and for a family of one denoiser."""
    experts = family.experts
    if experts is None:
        return None
    folder = experts.folder(expert)
    return None if folder == experts.folders[0] else folder


def save_lora(modules: dict[str, nn.Module], weights: dict[str, dict[str, torch.Tensor]], folder: Path,
              family: ModelFamily, load_into: str | None = None) -> Path:
    """Write ``pytorch_lora_weights.safetensors``, which the family pipeline's ``load_lora_weights(folder)``
    loads, and the same adapters as ``lora_kohya.safetensors`` for A1111 and ComfyUI where the family has a kohya
    layout for every adapted component (ComfyUI reads SD3's diffusers file itself); DoRA's in that layout also as
    ``lora_kohya_lycoris.safetensors``, its magnitudes as LyCORIS reads them. `load_into`: the pipeline attribute
    the denoiser's adapters load into where it is not the first (recorded in the file, `LOAD_INTO_KEY`)."""
    adapted = {name: m for name, m in modules.items() if has_lora(m)}
    layers, metadata = {}, {}
    lokr = any(isinstance(m.peft_config["default"], LoKrConfig) for m in adapted.values())
    for name, module in adapted.items():
        settings = module.peft_config["default"]
        if lokr:
            # peft's names (diffusers converts none of LoKr's), the scale alpha / rank in the first factor of each
            # module, the file saying alpha = rank: what diffusers' load_lora_adapter rebuilds from the metadata.
            state = get_peft_model_state_dict(module, state_dict=weights[name])
            scale = settings.alpha / settings.r
            layers[f"{name}_lora_layers"] = {key: value * scale if _is_first_factor(key, state) else value
                                             for key, value in state.items()}
            metadata[f"{name}_lora_adapter_metadata"] = {**settings.to_dict(), "alpha": settings.r}
            continue
        state = lora_state(module, weights[name], name in family.components.text_encoders,
                           peft_names=name == family.components.denoiser and family.files.denoiser_lora_peft_names)
        # The scale alpha / rank goes into the up weights, and the file says alpha = rank: readers that ignore the
        # metadata's alpha (ComfyUI reads only .alpha keys, which this layout has none of) apply the same delta.
        # DoRA's magnitudes are the same for the folded update.
        scale = settings.lora_alpha / settings.r
        layers[f"{name}_lora_layers"] = {key: value * scale if _is_up(key) else value for key, value in state.items()}
        metadata[f"{name}_lora_adapter_metadata"] = {**settings.to_dict(), "lora_alpha": settings.r}
    family.sampling.pipeline_class.save_lora_weights(folder, safe_serialization=True, weight_name=LORA_WEIGHTS,
                                                     **layers,
                                            **metadata)
    if load_into is not None:
        _add_metadata(folder / LORA_WEIGHTS, {LOAD_INTO_KEY: load_into})
    dora = any(getattr(m.peft_config["default"], "use_dora", False) for m in adapted.values())
    kohya = all(name in family.components.kohya_prefixes for name in adapted)
    if kohya and (family.files.kohya_names_each_layer or not (lokr or dora)):
        state = kohya_state(adapted, weights, family)
    elif dora and (kohya or family.files.comfyui_reads_diffusers_lora):
        # ComfyUI reads diffusers' module names but DoRA's magnitudes only as dora_scale (SD3's, Flux.1's).
        state = comfyui_dora_state(adapted, weights, family)
    else:
        # ComfyUI reads diffusers' file as it is (LoKr's: peft's names, the scale in the first factor), or nothing.
        return folder / LORA_WEIGHTS
    _save_atomically(state, folder / KOHYA_WEIGHTS, {"ss_network_module": "lycoris.kohya" if lokr else "networks.lora"})
    if dora and kohya and family.files.kohya_names_each_layer:
        # ComfyUI's dora_scale is not the magnitude LyCORIS's own loader reads; each reader gets a file of its own.
        _save_atomically(kohya_state(adapted, weights, family, dora_reader="lycoris"), folder / KOHYA_LYCORIS_WEIGHTS,
                    {"ss_network_module": "lycoris.kohya",
                     "ss_network_args": json.dumps({"algo": "lora", "dora_wd": "True", "wd_on_output": "True"})})
    return folder / LORA_WEIGHTS


def _add_metadata(path: Path, extra: dict[str, str]) -> None:
    """`path`'s safetensors file again with `extra` in its metadata (diffusers' writer takes no metadata of ours)."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = {**(handle.metadata() or {}), **extra}
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 - a file, not a dict
    _save_atomically(tensors, path, metadata)


def _save_atomically(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(state, str(tmp), metadata=metadata)
    tmp.replace(path)


def _is_first_factor(key: str, state: dict[str, torch.Tensor]) -> bool:
    """Whether a LoKr key holds its module's first factor whole, or that factor's first half where it is split."""
    if key.endswith(".lokr_w1"):
        return True
    return key.endswith(".lokr_w1_a") and key.removesuffix("_a") not in state


def learned_embeds(modules: dict[str, nn.Module], weights: dict[str, dict[str, torch.Tensor]], family: ModelFamily,
                   placeholder: str) -> dict[str, torch.Tensor]:
    """The textual-inversion file's tensors: for one text encoder diffusers' layout, one key (the placeholder)
    holding all its vectors; for several, one key per text encoder as the family names them (SDXL: clip_l,
    clip_g, as A1111 and ComfyUI write SDXL embeddings)."""
    def vectors(name: str) -> torch.Tensor:
        table = modules[name].get_input_embeddings()
        path = next(path for path, layer in modules[name].named_modules() if layer is table)
        return weights[name][f"{path}.added"].detach().float().cpu().contiguous()

    if not family.files.embedding_keys:
        return {placeholder: vectors(family.components.text_encoders[0])}
    return {key: vectors(name) for key, name in zip(family.files.embedding_keys, family.components.text_encoders)}


def save_learned_embeds(modules: dict[str, nn.Module], weights: dict[str, dict[str, torch.Tensor]],
                        family: ModelFamily, placeholder: str, path: Path) -> Path:
    """The file, with the placeholder in its metadata: a file keyed by text encoder does not name its token."""
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(learned_embeds(modules, weights, family, placeholder), str(tmp),
              metadata={"placeholder_token": placeholder})
    tmp.replace(path)
    return path


def has_trained_parts(meta: dict[str, Any]) -> bool:
    """Whether `save_trained_parts` writes any file for a checkpoint of this meta.json: LoRA runs (DreamBooth's
    too) and textual-inversion runs."""
    task = meta.get("task", {})
    return bool(task.get("lora") or task.get("tokens"))


def save_trained_parts(modules: dict[str, nn.Module], meta: dict[str, Any], folder: Path,
                       weights: dict[str, dict[str, torch.Tensor]] | None = None) -> list[Path]:
    """The small files a fine-tuning mode produces, in the layouts diffusers' loaders read:
    ``pytorch_lora_weights.safetensors`` (``load_lora_weights``) and ``learned_embeds.safetensors``
    (``load_textual_inversion``). `sdtrain export` writes them from a checkpoint, and the trainer into every
    checkpoint folder it saves, with the same weights (EMA where the run keeps one). `weights` holds each module's
    trained tensors whole, by their names in it, when the modules' own are not (shards, live training weights);
    without it the modules' own are written. The modules give only the structure: which layers carry adapters,
    their settings and the model's config."""
    task = meta.get("task", {})
    family = families.get(task.get("family", "sd"))
    if weights is None:
        weights = {name: module.state_dict() for name, module in modules.items()}
    written = []
    if task.get("lora"):
        into = lora_load_into(family, task.get("expert"))
        written.append(save_lora(modules, weights, folder, family, load_into=into))
    if task.get("tokens"):
        written.append(save_learned_embeds(modules, weights, family, task["placeholder_token"],
                                           folder / LEARNED_EMBEDS))
    return written
