"""kohya's LoRA key layout, shared by the families whose files fuse modules diffusers keeps apart (Flux.1's and
Z-Image's attention qkv): ``lora_unet_<module path in the original layout, _ for .>.lora_down.weight`` /
``.lora_up.weight`` / ``.alpha`` (a 0-d tensor; the scale is alpha / rank), and one adapter on a fused module with
the delta its parts' adapters make."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

PREFIX = "lora_unet_"
LoraFactors = tuple[torch.Tensor, torch.Tensor, float]
"""One adapter: its down (lora_A) weight [rank, in], up (lora_B) weight [out, rank] and alpha."""


def checked(path: str, factors: LoraFactors) -> LoraFactors:
    """`factors` with a float alpha; ValueError naming `path` when they are no [rank, in] and [out, rank] pair."""
    down, up, alpha = factors
    if down.ndim != 2 or up.ndim != 2 or up.shape[1] != down.shape[0]:
        raise ValueError(f"LoRA {path}: lora_A {tuple(down.shape)} and lora_B {tuple(up.shape)} are not a "
                         "[rank, in] and [out, rank] pair")
    return down, up, float(alpha)


def fuse(original: str, parts: Sequence[str], present: Mapping[int, LoraFactors], rows: Sequence[int]
         ) -> LoraFactors:
    """One adapter on the fused module `original` (its `parts` holding `rows` rows each) with the delta the adapters
    `present` on some of them make: downs stacked (the rank is their sum), ups block-diagonal with zero rows for a
    part without one. With one scale (alpha / rank) among them the weights stay as trained and the alpha is that
    scale x the summed rank; else each part's scale goes into its up, at alpha = rank."""
    order = sorted(present)
    ins = {present[i][0].shape[1] for i in order}
    if len(ins) != 1:
        raise ValueError(f"LoRA {original}: its parts {', '.join(parts[i] for i in order)} read inputs of "
                         f"different widths {sorted(ins)}")
    for i in order:
        if present[i][1].shape[0] != rows[i]:
            raise ValueError(f"LoRA {parts[i]}: lora_B has {present[i][1].shape[0]} rows, the config's model "
                             f"{rows[i]}")
    scales = {present[i][2] / present[i][0].shape[0] for i in order}
    common = next(iter(scales)) if len(scales) == 1 else None
    rank = sum(present[i][0].shape[0] for i in order)
    first_down = present[order[0]][0]
    up = first_down.new_zeros((sum(rows), rank))
    downs, col = [], 0
    for i in order:
        down, part_up, alpha = present[i]
        r, row = down.shape[0], sum(rows[:i])
        up[row:row + rows[i], col:col + r] = part_up if common is not None else part_up * (alpha / r)
        downs.append(down.to(first_down.dtype))
        col += r
    return torch.cat(downs, dim=0), up, (common * rank if common is not None else float(rank))


def grouped_keys(layers: Mapping[str, LoraFactors], locate: Callable[[str], tuple[str, int | None]],
                 parts: Sequence[str], rows: Sequence[int]) -> dict[str, torch.Tensor]:
    """kohya's keys of adapters named by their module path, `locate(path)` giving the module's name in the original
    layout and which of a fused module's `parts` (of `rows` rows each) it is, None for a module of its own: the parts
    of one fused module become one adapter (`fuse`)."""
    groups: dict[str, dict[int | None, LoraFactors]] = {}
    for path, factors in layers.items():
        original, part = locate(path)
        groups.setdefault(original, {})[part] = checked(path, factors)
    out: dict[str, torch.Tensor] = {}
    for original, present in sorted(groups.items()):
        factors = present[None] if None in present else fuse(original, parts, present, rows)  # type: ignore[arg-type]
        out.update(keys(original, factors))
    return out


def keys(original: str, factors: LoraFactors) -> dict[str, torch.Tensor]:
    """The three keys of the adapter on module `original` (its path in the original layout)."""
    down, up, alpha = factors
    name = PREFIX + original.replace(".", "_")
    return {f"{name}.lora_down.weight": down.contiguous(), f"{name}.lora_up.weight": up.contiguous(),
            f"{name}.alpha": torch.tensor(alpha, dtype=torch.float32)}
