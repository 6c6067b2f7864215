"""TEMPORARY: families still declared as one class read through the parts (removed once every family is parts)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from sdtrain.models.families import spec
from sdtrain.models.families.old_spec import LegacyFamily

__all__ = ["LegacyFamily", "adapt"]

_METHODS = {
    spec.Conditioner: {"tokenize": "tokenize", "train_tokenizer": "train_tokenizer",
                       "long_text_length": "long_text_length", "build_text_encoder": "build_text_encoder",
                       "encode_text": "encode_text", "text_shapes": "text_shapes",
                       "unused_modules": "unused_modules"},
    spec.DenoiserCall: {"settings": "denoiser_settings", "shape": "denoiser_shape", "initialise": "init_denoiser",
                        "condition": "condition", "denoise": "denoise", "takes_guidance": "takes_guidance",
                        "max_latent_side": "max_latent_side", "downsampling": "downsampling",
                        "image_token_side": "image_token_side"},
    spec.FileInterchange: {"holds_file": "holds_file", "file_scheduler": "file_scheduler",
                           "kohya_lora": "kohya_lora", "kohya_lora_name": "kohya_lora_name",
                           "original_rows": "original_rows", "original_module_path": "original_module_path",
                           "load_embedding": "load_embedding"},
    spec.Sampling: {"assemble": "assemble", "pipeline_from_folder": "pipeline_from_folder",
                    "prepare": "prepare_pipeline", "distilled": "distilled", "defaults": "sampling_defaults",
                    "mu": "sampling_mu", "arguments": "sampling_arguments"},
}
_FIELDS = {
    spec.DenoiserCall: ("objective",),
    spec.FileInterchange: ("single_file_keys", "single_file", "denoiser_lora_peft_names", "kohya_names_each_layer",
                           "comfyui_reads_diffusers_lora", "embedding_keys"),
    spec.Sampling: ("pipeline_class", "pipeline_loading", "pipeline_names"),
}


def _forwarding(base: type, old: Any) -> Any:
    def forward(old_name: str) -> Any:
        return lambda self, *args, **kwargs: getattr(self._old, old_name)(*args, **kwargs)

    namespace: dict[str, Any] = {new: forward(old_name) for new, old_name in _METHODS[base].items()}
    namespace["__module__"] = type(old).__module__
    name = f"_Legacy{type(old).__name__}{base.__name__}"
    namespace["__qualname__"] = name
    namespace.update({field: getattr(old, field) for field in _FIELDS.get(base, ())})
    namespace["_old"] = old
    cls = type(name, (base,), namespace)
    setattr(sys.modules[type(old).__module__], name, cls)  # pickled by reference, as loader workers receive it
    return cls()


def adapt(old: LegacyFamily) -> spec.ModelFamily:
    adapted = old.lora_text_encoders or old.text_encoders
    records = {}
    for name, cls in old.components.items():
        role = ("denoiser" if name == old.denoiser else "text_encoder" if name in old.text_encoders else "vae")
        tokenizer = old.tokenizers[old.text_encoders.index(name)] if role == "text_encoder" else None
        records[name] = spec.Component(
            cls, role, tokenizer=tokenizer, long_text=tokenizer in old.long_text_tokenizers,
            lora=role == "text_encoder" and name in adapted, kohya_prefix=old.kohya_prefixes.get(name),
            weight_prefixes=tuple(old.weight_prefixes.get(name, ())), blocks=old.block_lists.get(cls))
    controlnet = old.controlnet
    if controlnet is not None:
        controlnet = dataclasses.replace(controlnet, blocks=old.block_lists.get(controlnet.model_class))
    family = spec.ModelFamily(
        name=old.name, title=old.title, components=spec.Components(**records), presets=old.presets,
        codec=old.codec, conditioner=_forwarding(spec.Conditioner, old), denoising=_forwarding(spec.DenoiserCall, old),
        files=_forwarding(spec.FileInterchange, old), sampling=_forwarding(spec.Sampling, old),
        hub_tags=old.hub_tags, controlnet=controlnet, instruct=old.instruct, reference=old.reference)
    old.adapted = family
    return family
