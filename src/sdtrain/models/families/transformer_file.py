"""Reading a family's transformer from a file that holds it alone (ComfyUI's ``models/diffusion_models/`` files, the
authors' release files), the same way for every family whose single-file layout is its transformer: the settings
from the tensors' shapes and the file's metadata, the model built on the meta device and filled a tensor at a time,
so a 20-32B transformer stored low (``model.frozen_precision``) never exists in fp32, nor twice."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdtrain.errors import UserError, first_line
from sdtrain.models import frozen, single_file
from sdtrain.models.families.spec import SingleFileLayout, construct
from sdtrain.models.single_file.write import layout_metadata, write_tensors

Converter = Callable[[list[str], Callable[[str], torch.Tensor]], Iterable[tuple[str, torch.Tensor]]]
"""(the file's keys, no prefix; a function reading one) -> the model's (name, tensor) pairs, each read when its turn
comes: the file's own layout to diffusers'."""


def _as_is(keys: list[str], read: Callable[[str], torch.Tensor]) -> Iterable[tuple[str, torch.Tensor]]:
    return ((key, read(key)) for key in keys)


def read_transformer_file(path: str | Path, trust_pickle: bool | None, *, title: str, cls: type[nn.Module],
                          mark: str, prefix_of: Callable[[Iterable[str]], str | None],
                          settings_of: Callable[[Mapping[str, tuple[int, ...]], Mapping[str, str]], dict[str, Any]],
                          fix: str, convert: Converter = _as_is, frozen_precision: str = "fp32",
                          weights: bool = True) -> nn.Module:
    """A `cls` (the `title` family's transformer), in fp32 or its linear weights stored in `frozen_precision`, from
    the file at `path`: `prefix_of(keys)` finds the prefix its tensors are under (None: it holds none, `mark`
    missing), `settings_of(shapes, metadata)` the constructor's settings from their shapes without it (ValueError
    for what does not fit), `convert(keys, read)` the tensors' names and values in `cls` (the file's own layout to
    diffusers'). Without `weights`, only the header is read. Each failure is one line ending in `fix`."""
    file = single_file.open_file(path, trust_pickle)
    prefix = prefix_of(file.shapes)
    if prefix is None:
        raise UserError(f"{file.path}: holds no {title} transformer ({mark}); {fix}")
    keys = [k for k in file.shapes if k.startswith(prefix)]
    try:
        settings = settings_of({k[len(prefix):]: file.shapes[k] for k in keys}, file.metadata)
    except ValueError as exc:
        raise UserError(f"{file.path}: cannot read it as a {title} transformer ({first_line(exc)}); {fix}") from exc
    with frozen.parameters_on_meta():
        module = construct(cls, "components.transformer.overrides", settings)
    if not weights:
        return module.eval()
    tensors = convert([key[len(prefix):] for key in keys], lambda key: file.floats([prefix + key])[prefix + key])
    try:
        missing = frozen.fill(module, tensors, frozen_precision)
    except (RuntimeError, TypeError, ValueError, KeyError) as exc:
        raise UserError(f"{file.path}: cannot load the {title} transformer ({first_line(exc)}); {fix}") from exc
    if missing:
        raise UserError(f"{file.path}: the {title} transformer lacks {len(missing)} weights (e.g. {missing[0]}); the "
                        "file is incomplete")
    return module.eval()


class TransformerAlone(SingleFileLayout):
    """A single-file layout holding the transformer alone (its autoencoder, text encoder and tokenizer loaded
    separately, as ComfyUI and diffusers' from_single_file load them): read with `read(path, trust_pickle,
    frozen_precision=, weights=)` and written from the transformer's state dict by `to_layout` (ValueError for a
    weight the layout has no place for), with the family's name (`family(config)`) and the settings its shapes
    cannot tell (all but `shape_keys`) in the metadata. bf16 with ``--half``, the released dtype."""

    holds = ("transformer",)
    half_dtype = "bf16"

    def __init__(self, read: Callable[..., nn.Module], to_layout: Callable[[dict[str, torch.Tensor]], dict],
                 family: Callable[[Mapping[str, Any]], str], shape_keys: frozenset[str], description: str,
                 comfyui: str):
        self.read, self.to_layout, self.family, self.shape_keys = read, to_layout, family, shape_keys
        self.description, self.comfyui = description, comfyui

    def load(self, name: str, path: Path, *, trust_pickle: bool | None, frozen_precision: str, weights: bool,
             latent_constants: Callable[[], dict[str, float | None]]) -> nn.Module:
        return self.read(path, trust_pickle, frozen_precision=frozen_precision, weights=weights)

    def write(self, out: Path, components: dict[str, nn.Module], *, half: bool, scheduler: Any,
              text_layout: str, text_source: str | Path | None) -> None:
        transformer = components["transformer"]
        config = dict(transformer.config)
        try:
            state = self.to_layout(transformer.state_dict())
        except ValueError as exc:
            raise UserError(f"{out}: this transformer cannot be written in its single-file layout ({exc})") from exc
        write_tensors(out, state, torch.bfloat16 if half else torch.float32,
                      layout_metadata(config, self.family(config), self.shape_keys))
