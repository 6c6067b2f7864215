"""Black Forest Labs' transformer layout, shared by the models built on Flux.1's transformer (Flux.1 itself, Chroma;
Flux.2 its final modulation's row order): the double- and single-stream blocks as BFL's files name them, against
diffusers' modules, and converting a state dict both ways and LoRA adapters to kohya's names from a table of such
modules. Flux.1's own modules are `bfl_flux`'s, Chroma's its family module's.

Layout: diffusers keeps apart what BFL fuses along the output rows of one Linear: a double block's
``img_attn.qkv`` is ``attn.to_q``, ``to_k``, ``to_v`` stacked (``txt_attn.qkv`` the ``add_*_proj``); a single
block's ``linear1`` is ``attn.to_q``, ``to_k``, ``to_v`` and ``proj_mlp``. The q and k norms' ``weight`` is the
original's ``scale``. A model's own modules (its embedders, Flux.1's per-block modulations, Chroma's approximator)
are the table its layout module adds to the blocks'.

A LoRA on a fused module must give exactly the delta the separate ones give: the parts' downs stacked (rank = the
sum of their ranks), the block-diagonal of their ups (zero rows for an unadapted part) and the alpha that keeps
each part's alpha / rank (`kohya.fuse`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sdtrain.models.single_file import kohya

MLP_RATIO = 4
"""diffusers' Flux-layout transformers build every MLP (double blocks' and single blocks' proj_mlp) 4 times as wide."""

Modules = dict[str, tuple[str, ...]]
"""Original module path -> the diffusers modules it holds, their output rows stacked in this order."""

PREFIXES = ("model.diffusion_model.", "diffusion_model.")
"""Where a transformer's keys in BFL's layout may stand in a file: ComfyUI's whole checkpoints, and bare."""


def original_prefix(keys: Iterable[str]) -> str | None:
    """The prefix of a transformer's keys in BFL's layout ('' in BFL's own files, ComfyUI's
    ``model.diffusion_model.`` in a whole checkpoint), or None when the keys hold none."""
    keys = list(keys)
    for prefix in ("", *PREFIXES):
        if any(k.startswith((f"{prefix}double_blocks.", f"{prefix}single_blocks.")) for k in keys):
            return prefix
    return None


def original_rows(path: str, rows: torch.Tensor) -> torch.Tensor:
    """A vector of one value per output row of the transformer's layer at `path` (diffusers' row order) in the order
    Black Forest Labs' layout keeps that layer's rows: its final modulation holds shift before scale (Flux.1's and
    Flux.2's alike)."""
    return swap_halves(rows) if path == "norm_out.linear" else rows


def block_modules(config: Mapping[str, Any], modulated: bool = True) -> Modules:
    """The double and single blocks' modules (`Modules`) for a config's ``num_layers`` and ``num_single_layers``;
    with each block's own adaLN modulation layer (`modulated`, Flux.1's) or without (Chroma's, which takes every
    block's modulation from one shared network)."""
    modules: Modules = {}
    for i in range(int(config["num_layers"])):
        d, o = f"transformer_blocks.{i}", f"double_blocks.{i}"
        if modulated:
            modules.update({f"{o}.img_mod.lin": (f"{d}.norm1.linear",),
                            f"{o}.txt_mod.lin": (f"{d}.norm1_context.linear",)})
        modules.update({
            f"{o}.img_attn.qkv": (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"),
            f"{o}.txt_attn.qkv": (f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj"),
            f"{o}.img_attn.proj": (f"{d}.attn.to_out.0",), f"{o}.txt_attn.proj": (f"{d}.attn.to_add_out",),
            f"{o}.img_mlp.0": (f"{d}.ff.net.0.proj",), f"{o}.img_mlp.2": (f"{d}.ff.net.2",),
            f"{o}.txt_mlp.0": (f"{d}.ff_context.net.0.proj",), f"{o}.txt_mlp.2": (f"{d}.ff_context.net.2",),
        })
    for i in range(int(config["num_single_layers"])):
        d, o = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        if modulated:
            modules[f"{o}.modulation.lin"] = (f"{d}.norm.linear",)
        modules.update({
            f"{o}.linear1": (f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v", f"{d}.proj_mlp"),
            f"{o}.linear2": (f"{d}.proj_out",),
        })
    return modules


def block_norms(config: Mapping[str, Any]) -> dict[str, str]:
    """diffusers key -> original key of the blocks' attention RMSNorm scales (parameters, not Linear modules)."""
    norms = {}
    for i in range(int(config["num_layers"])):
        d, o = f"transformer_blocks.{i}.attn", f"double_blocks.{i}"
        norms.update({f"{d}.norm_q.weight": f"{o}.img_attn.norm.query_norm.scale",
                      f"{d}.norm_k.weight": f"{o}.img_attn.norm.key_norm.scale",
                      f"{d}.norm_added_q.weight": f"{o}.txt_attn.norm.query_norm.scale",
                      f"{d}.norm_added_k.weight": f"{o}.txt_attn.norm.key_norm.scale"})
    for i in range(int(config["num_single_layers"])):
        d, o = f"single_transformer_blocks.{i}.attn", f"single_blocks.{i}"
        norms.update({f"{d}.norm_q.weight": f"{o}.norm.query_norm.scale",
                      f"{d}.norm_k.weight": f"{o}.norm.key_norm.scale"})
    return norms


def inner_dim(config: Mapping[str, Any]) -> int:
    return int(config["num_attention_heads"]) * int(config["attention_head_dim"])


def part_rows(parts: Sequence[str], config: Mapping[str, Any], total: int | None = None) -> list[int]:
    """Output rows of each part of a fused module: the attention width for q, k and v, the rest (or the MLP's
    width) for a single block's proj_mlp."""
    inner = inner_dim(config)
    rows = [inner] * len(parts)
    if parts[-1].endswith("proj_mlp"):
        rows[-1] = total - inner * (len(parts) - 1) if total is not None else inner * MLP_RATIO
    return rows


def swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    """(scale, shift) <-> (shift, scale) along the rows: its own inverse."""
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def block_count(keys: Sequence[str], name: str, title: str) -> int:
    """How many blocks ``name.<i>.`` the original `keys` hold; ValueError (`title`: the model's) for a gap."""
    indices = {int(m.group(1)) for k in keys if (m := re.match(rf"{name}\.(\d+)\.", k))}
    if indices and indices != set(range(max(indices) + 1)):
        raise ValueError(f"{title} transformer (original layout): {name} "
                         f"{sorted(set(range(max(indices) + 1)) - indices)} are missing")
    return len(indices)


def head_and_mlp(shapes: Mapping[str, tuple[int, ...]], hidden: int, num_layers: int, num_single_layers: int,
                 title: str, model: str, cls: str) -> int:
    """The attention head width of an original-layout transformer `hidden` wide (its q norm's length), checking
    that its MLPs are the 4x wide ones diffusers' `cls` builds; ValueError otherwise (`title`, `model`: how the
    messages name it, as `Layout`'s)."""
    norm = ("double_blocks.0.img_attn.norm.query_norm.scale" if num_layers
            else "single_blocks.0.norm.query_norm.scale")
    if norm not in shapes:
        raise ValueError(f"not a {model} transformer in the original layout: no {norm}")
    head_dim = shapes[norm][0]
    if hidden % head_dim:
        raise ValueError(f"{title} transformer: width {hidden} is not a whole number of {head_dim}-wide heads")
    if num_layers:
        mlp = shapes.get("double_blocks.0.img_mlp.0.weight", (0,))[0]
    else:
        mlp = shapes.get("single_blocks.0.linear1.weight", (0,))[0] - 3 * hidden
    if num_layers + num_single_layers and mlp != MLP_RATIO * hidden:
        raise ValueError(f"{title} transformer: MLP width {mlp} is not {MLP_RATIO} x {hidden}, the only ratio "
                         f"diffusers' {cls} builds")
    return head_dim


@dataclass(frozen=True)
class Layout:
    """One model's transformer in BFL's layout: its modules (`modules(config)`: its own and the blocks'), its norm
    scales (`norms(config)`), the module whose rows diffusers holds in the other order (`swapped`: a final
    modulation's (scale, shift)), and how its messages name it (`title`: "Flux" in "Flux transformer: ...",
    `model`: "Flux.1" in "not Flux.1's"; `settings`: the config settings that decide which weights it has)."""

    title: str
    model: str
    modules: Callable[[Mapping[str, Any]], Modules]
    norms: Callable[[Mapping[str, Any]], dict[str, str]]
    settings: str
    swapped: str | None = None

    def to_original(self, state: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """A state dict (diffusers keys) with its config -> BFL's original keys, no prefix. Every key must find its
        place and every module of the layout must be there (a file missing one would load with a hole):
        ValueError naming the first key otherwise."""
        state = dict(state)
        out: dict[str, torch.Tensor] = {}
        for original, parts in self.modules(config).items():
            for end in ("weight", "bias"):
                keys = [f"{part}.{end}" for part in parts]
                missing = [k for k in keys if k not in state]
                if missing:
                    raise ValueError(f"{self.title} transformer: {missing[0]} is missing (needed for {original}.{end})")
                tensors = [state.pop(k) for k in keys]
                tensor = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
                out[f"{original}.{end}"] = swap_halves(tensor) if original == self.swapped else tensor
        for key, original in self.norms(config).items():
            if key not in state:
                raise ValueError(f"{self.title} transformer: {key} is missing (needed for {original})")
            out[original] = state.pop(key)
        if state:
            raise ValueError(f"{self.title} transformer: {len(state)} weights have no place in the original layout "
                             f"(e.g. {next(iter(state))}); is the config's {self.settings} this model's?")
        return out

    def iter_from_original(self, keys: Collection[str], read: Callable[[str], torch.Tensor],
                           config: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """The inverse of `to_original` a tensor at a time: each of BFL's `keys` (no prefix) is read with `read`
        when its turn comes and its diffusers tensors (the parts of a fused one are views of it) are yielded at
        once, so a caller that stores them (say, in fp8) never holds more than one original tensor in full
        precision."""
        remaining = set(keys)
        for original, parts in self.modules(config).items():
            for end in ("weight", "bias"):
                key = f"{original}.{end}"
                if key not in remaining:
                    raise ValueError(f"{self.title} transformer (original layout): {key} is missing")
                remaining.discard(key)
                tensor = read(key)
                if original == self.swapped:
                    tensor = swap_halves(tensor)
                if len(parts) == 1:
                    yield f"{parts[0]}.{end}", tensor
                    continue
                rows = part_rows(parts, config, tensor.shape[0])
                if sum(rows) != tensor.shape[0] or min(rows) <= 0:
                    raise ValueError(f"{self.title} transformer (original layout): {key} has {tensor.shape[0]} rows, "
                                     f"not {' + '.join(map(str, rows))} for {', '.join(parts)}")
                yield from ((f"{part}.{end}", piece) for part, piece in zip(parts, tensor.split(rows, dim=0)))
        for key, original in self.norms(config).items():
            if original not in remaining:
                raise ValueError(f"{self.title} transformer (original layout): {original} is missing")
            remaining.discard(original)
            yield key, read(original)
        if remaining:
            raise ValueError(f"{self.title} transformer (original layout): {len(remaining)} weights are not "
                             f"{self.model}'s (e.g. {sorted(remaining)[0]})")

    def kohya_lora(self, layers: Mapping[str, kohya.LoraFactors], config: Mapping[str, Any]
                   ) -> dict[str, torch.Tensor]:
        """LoRA layers on diffusers' module paths (inside the transformer, as peft names them) -> kohya's keys in
        this layout (`kohya`'s). `layers` maps a path to (lora_A weight [r, in], lora_B weight [out, r],
        alpha). Parts BFL fuses are fused. A path without an original counterpart: ValueError."""
        modules = self.modules(config)
        owner = {part: (original, i) for original, parts in modules.items() for i, part in enumerate(parts)}
        groups: dict[str, dict[int, kohya.LoraFactors]] = {}
        for path, layer in layers.items():
            if path not in owner:
                raise ValueError(f"LoRA {path}: no module of {self.model}'s original layout holds it (or it is past "
                                 "the config's blocks)")
            original, i = owner[path]
            groups.setdefault(original, {})[i] = kohya.checked(path, layer)
        out: dict[str, torch.Tensor] = {}
        for original, present in groups.items():
            parts = modules[original]
            down, up, alpha = present[0] if len(parts) == 1 else kohya.fuse(original, parts, present,
                                                                            part_rows(parts, config))
            if original == self.swapped:
                up = swap_halves(up)
            if original.startswith("final_layer."):
                # diffusers' kohya reader drops final_layer's alphas (it reads those at scale 1): the scale goes
                # into up, which every reader then applies alike.
                up, alpha = up * (alpha / down.shape[0]), float(down.shape[0])
            out.update(kohya.keys(original, (down, up, alpha)))
        return out
