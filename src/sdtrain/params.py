"""Parameter counts of the model a config describes, per component, without training anything.

Components with a source are read from it; components built from a preset are built on the meta
device, so counting the 1.3B-parameter SD2 model takes no memory and well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sdtrain.config import RunConfig
from sdtrain.loaders.components import load_component
from sdtrain.models import build, families
from sdtrain.models.families.spec import ModelFamily


@dataclass
class ComponentCount:
    name: str
    cls: str
    parameters: int
    trainable: int
    source: str
    """The folder it was read from, or ``preset NAME``."""


def _vocab_size(config: RunConfig) -> int:
    source = build.tokenizer_source(config.model)
    if source is not None:
        return len(build.load_tokenizer(source))
    return config.model.tokenizer_vocab_size  # what a tokenizer trained on the captions aims for


class _TokenizerShape:
    """What building a text encoder asks of a tokenizer, for one that does not exist yet."""

    bos_token_id, eos_token_id, pad_token_id = 0, 1, 1

    def __init__(self, size: int, length: int):
        self.size, self.model_max_length = size, length

    def __len__(self) -> int:
        return self.size

    def convert_tokens_to_ids(self, token: str) -> int:
        """A special token's id (a vision-language model's image marker): which one changes no parameter count."""
        return 0


def _component(config: RunConfig, family: ModelFamily, name: str, built: dict[str, Any]) -> tuple[Any, str]:
    source = build.component_source(config.model, name)
    if source is not None:
        return load_component(name, source, trust_pickle=build.trusts_pickle(config.model), family=family,
                              served=config.model), source
    model = config.model
    with torch.device("meta"):
        if name == "vae":
            module = build.build_vae(model)
        elif name in family.components.text_encoders:
            shape = _TokenizerShape(_vocab_size(config), build.text_length(model))
            module = build.build_text_encoder(model, shape, name)
        else:
            vae = built["vae"]
            side = config.data.resolution // family.codec.downsampling(vae.config)
            module = build.build_denoiser(model, family.codec.channels(vae.config), side,
                                          text_encoders={te: built[te] for te in family.components.text_encoders})
    return module, f"preset {model.preset}"


def count(config: RunConfig) -> list[ComponentCount]:
    family = families.for_model(config.model)
    if config.stage == "autoencoder":
        names, trained = ["vae"], {"vae"}
    else:
        # The denoiser's shape depends on the others, so it is built last and listed first.
        names, trained = list(family.components), {family.components.denoiser}
        if config.diffusion.train_text_encoder:
            trained.update(family.components.text_encoders)
    built: dict[str, Any] = {}
    sources = {}
    for name in names:
        built[name], sources[name] = _component(config, family, name, built)
    rows = []
    for name in sorted(names, key=lambda n: n != family.components.denoiser):
        total = build.count_parameters(built[name])
        rows.append(ComponentCount(name, type(built[name]).__name__, total, total if name in trained else 0,
                                   sources[name]))
    return rows


def format_counts(rows: list[ComponentCount]) -> str:
    name_width = max(13, *(len(r.name) for r in rows))
    class_width = max(22, *(len(r.cls) for r in rows))
    lines = [f"{'component':<{name_width}} {'class':<{class_width}} {'parameters':>15} {'trainable':>15}  source"]
    for r in rows:
        lines.append(f"{r.name:<{name_width}} {r.cls:<{class_width}} {r.parameters:>15,} {r.trainable:>15,}  "
                     f"{r.source}")
    total, trainable = sum(r.parameters for r in rows), sum(r.trainable for r in rows)
    lines.append(f"{'total':<{name_width}} {'':<{class_width}} {total:>15,} {trainable:>15,}")
    # The MosaicML benchmark script's line, so figures can be compared with its published ones.
    lines.append(f"Model has {total / 1e6:.6f} M parameters and {trainable / 1e6:.6f} M trainable_params")
    return "\n".join(lines)
