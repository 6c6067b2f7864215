"""Writing a single file, whatever its layout: the tensors written atomically, the metadata a file in its authors'
layout carries, and the renaming of a state dict by a table of module prefixes that layouts are written with."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from sdtrain.errors import UserError
from sdtrain.models.single_file.read import FORMAT_KEY, FORMAT_VERSION, FORMAT_VERSIONS, _read_safetensors

Blocks = dict[str, tuple[str, dict[str, str]]]
"""diffusers module prefix -> (the original layout's prefix, renames of what is inside it)."""


def rename(rest: str, table: dict[str, str]) -> str:
    """`rest` (a path inside a block) with its first module renamed by `table`, when the table names it."""
    for src, dst in table.items():
        if rest.startswith(src + "."):
            return dst + rest[len(src):]
    return rest


def original_key(key: str, blocks: Blocks) -> str | None:
    """`key` (a weight or module path) in the original layout, by its longest mapped prefix; None when unmapped."""
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in blocks:
            target, table = blocks[prefix]
            return target + "." + rename(".".join(parts[cut:]), table)
    return None


def map_by_blocks(name: str, state: dict[str, torch.Tensor], blocks: Blocks) -> dict[str, torch.Tensor]:
    """`state` renamed by `blocks`; a weight with no place there is one line naming component `name`."""
    out, unmapped = {}, []
    for key, tensor in state.items():
        original = original_key(key, blocks)
        if original is None:
            unmapped.append(key)
        else:
            out[original] = tensor
    if unmapped:
        raise UserError(f"{name}: {len(unmapped)} weights have no place in the original layout (e.g. {unmapped[0]}); "
                        "this architecture cannot be written as a single file")
    return out


LAYOUT_CONFIG_KEY = "transformer_config"
"""The metadata key of a transformer file in its authors' layout (Flux.1's, Z-Image's) that carries, as JSON, the
settings its tensor shapes cannot tell."""


def layout_metadata(config: Any, family: str, shape_keys: frozenset[str]) -> dict[str, str]:
    """The metadata such a file carries: our format, the `family` and the settings of `config` its shapes cannot tell
    (all but `shape_keys`)."""
    extras = {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()
              if not k.startswith("_") and k not in shape_keys}
    return {"format": "pt", FORMAT_KEY: FORMAT_VERSION, "model_family": family,
            LAYOUT_CONFIG_KEY: json.dumps(extras, sort_keys=True)}


def write_tensors(out: Path, state: dict[str, torch.Tensor], dtype: torch.dtype, metadata: dict[str, str]) -> Path:
    """`state` as one safetensors file at `out`, floating-point tensors in `dtype`: written under a temporary name,
    synced, then renamed into place, so an interrupted export never leaves half a file under the real name."""
    from safetensors.torch import save_file

    tensors = {k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu()).contiguous()
               for k, v in state.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


def written_by_sdtrain(path: str | Path) -> bool:
    """Whether `path` is a safetensors file ``sdtrain export --single-file`` wrote."""
    try:
        file = _read_safetensors(Path(path))
    except UserError:
        return False
    return file.metadata.get(FORMAT_KEY) in FORMAT_VERSIONS
