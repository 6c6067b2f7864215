"""Single files, whatever their layout: a model (or part of one) kept as ONE checkpoint file, as ComfyUI, A1111
and diffusers' ``from_single_file`` load them. What a file's keys mean is its layout's, and each layout is its
family's (a part of `sdtrain.models.families`: `SingleFileLayout`, with converters shared by the families that share
a component, such as Stable Diffusion's original checkpoint, SD3's Stability layout and Black Forest Labs' Flux.1
layout). This package is what every layout reads and writes files through, and names no family:

- opening a file (`open_file`, `tensor_names`): a safetensors file's header, its tensors read one at a time on
  demand; pickle checkpoints (``.ckpt``, ``.pt``, ``.pth``, ``.bin``) can run code when unpickled, so they are
  refused unless trusted (``trust_pickle=True``, or ``SDTRAIN_TRUST_PICKLE=1``), and even then read with
  ``torch.load(weights_only=True)``, which refuses anything but tensors and plain containers;
- the tokenizers beside a file: a single file holds none, so ``sdtrain export --single-file`` writes them beside
  OUT.safetensors as OUT.tokenizer/, OUT.tokenizer_2/... (`tokenizer_folder`), which the loader finds
  (`tokenizer_for`); otherwise ``model.components.tokenizer.source`` must name one;
- helpers a layout infers settings from shapes and metadata with (`need`, `indices`, `strip`, `metadata_json`),
  and the cache of config folders it hands diffusers' loaders (`cached_folder`: in
  ``<sdtrain cache dir>/single_file/<fingerprint of keys, shapes and metadata>``, the cache dir being
  ``SDTRAIN_CACHE_DIR``, else ``~/.cache/sdtrain``);
- writing (`write_tensors`: under a temporary name, synced, renamed into place), the metadata a transformer file
  in its authors' layout carries (`layout_metadata`, `LAYOUT_CONFIG_KEY`), the mark of a file sdtrain wrote
  (``sdtrain_format``, `written_by_sdtrain`), and renaming a state dict by module prefix (`map_by_blocks`);
- kohya's LoRA key layout (`kohya`).
"""

from __future__ import annotations

from sdtrain.models.single_file.read import (
    FORMAT_KEY,
    FORMAT_VERSION,
    FORMAT_VERSIONS,
    PICKLE_SUFFIXES,
    SAFE_SUFFIXES,
    SUFFIXES,
    TRUST_PICKLE_ENV,
    OpenFile,
    Unrecognized,
    cached_folder,
    default_heads,
    error_line,
    fingerprint,
    indices,
    is_single_file,
    looks_like_single_file,
    metadata_json,
    need,
    open_file,
    strip,
    tensor_names,
    tokenizer_folder,
    tokenizer_for,
    trust_pickle_from_env,
    write_json,
)
from sdtrain.models.single_file.write import (
    LAYOUT_CONFIG_KEY,
    layout_metadata,
    map_by_blocks,
    original_key,
    write_tensors,
    written_by_sdtrain,
)

__all__ = [
    "FORMAT_KEY", "FORMAT_VERSION", "FORMAT_VERSIONS", "LAYOUT_CONFIG_KEY", "PICKLE_SUFFIXES", "SAFE_SUFFIXES",
    "SUFFIXES", "TRUST_PICKLE_ENV", "OpenFile", "Unrecognized", "cached_folder", "default_heads", "error_line",
    "fingerprint", "indices", "is_single_file", "layout_metadata",
    "looks_like_single_file", "map_by_blocks", "metadata_json", "need", "open_file", "original_key",
    "strip", "tensor_names", "tokenizer_folder", "tokenizer_for", "trust_pickle_from_env",
    "write_json", "write_tensors", "written_by_sdtrain",
]
