"""Sharded checkpoints: every rank writes its own part of the weights, EMA and optimizer state with
torch.distributed.checkpoint (DCP), and nothing is gathered onto one rank.

A full checkpoint gathers the whole model, EMA and AdamW state into the main rank's memory (about 42 GB at
SDXL size) and stalls every rank while one writes. A sharded one is written by all ranks side by side, and
DCP's metadata records every tensor's global shape, so it loads on any number of ranks and under any
parallel strategy, or into a single process with no process group (export, generate, a later stage).

The folder ``STEP/sharded`` holds DCP's files; the rest of the checkpoint (``trainer.pt``, ``meta.json``) is
as in a full checkpoint. Keys are those of the full format, grouped: ``model.unet.conv_in.weight``,
``ema.unet.conv_in.weight``, ``optimizer.state.unet.conv_in.weight.exp_avg``.

DCP reads its ``.metadata`` with ``pickle.load`` and its non-tensor values with ``torch.load(weights_only=
False)``: a checkpoint folder copied from elsewhere could run code. sdtrain reads both through allow-lists
instead (:class:`SafeReader`, :class:`SafePlanner`), as it reads every other file of a checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pathlib
import pickle
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch import nn
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from sdtrain.errors import first_line

FOLDER = "sharded"

# Frozen parameters inside a trained module come back from the run's pinned sources, as in full checkpoints.
_OPTIONS = StateDictOptions(ignore_frozen_params=True)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP's metadata is made of: its own record classes, tensor sizes, dtypes, layouts
    and paths. Anything else (``os.system``, ``builtins.open``) is refused before it can be called."""

    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                ("pathlib", "PureWindowsPath")}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        found = getattr(dcp_metadata, name, None) if module == dcp_metadata.__name__ else None
        if isinstance(found, type) and found.__module__ == dcp_metadata.__name__:  # defined there, not imported
            return found
        if (module, name) in self._ALLOWED:
            return pathlib.PurePath if module == "pathlib" else super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read through :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with open(Path(self.path) / name, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise pickle.UnpicklingError(f"{name} holds no checkpoint metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor values (learning rates, betas) read with weights_only=True."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        # Once read safely, the value is re-serialised: the base class's unrestricted read of it is harmless.
        checked = io.BytesIO()
        torch.save(torch.load(value, weights_only=True), checked)
        checked.seek(0)
        super().load_bytes(read_item, checked)


def is_sharded(checkpoint: Path) -> bool:
    return (Path(checkpoint) / FOLDER).is_dir()


def live_state(modules: dict[str, nn.Module], ema: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The run's tensors as each rank holds them (its shards under FSDP): what DCP writes, and what it loads
    into in place. The optimizer's state must already exist to be loaded into (``allocate_state``)."""
    model, optim = get_state_dict(nn.ModuleDict(modules), optimizer, options=_OPTIONS)
    state = {"model": model, "optimizer": optim}
    if ema is not None:
        state["ema"] = ema.shadow
    return state


def _first_failure(exc: CheckpointException) -> Exception:
    """The error a rank hit, out of DCP's wrapper (a BaseException that ``except Exception`` would miss): an
    OSError as it was (a full disk keeps its reason), anything else as a RuntimeError with its message."""
    for failure in exc.failures.values():
        original = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(original, OSError):
            return original
        if isinstance(original, BaseException):
            return RuntimeError(first_line(original))
    return RuntimeError(str(exc))


# One process saving or loading is intended (export, generate, a single-process run), also in the thread of
# a background save, where a catch_warnings block would not reach.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)


@contextlib.contextmanager
def _dcp_errors() -> Iterator[None]:
    """DCP's failures as plain errors."""
    try:
        yield
    except CheckpointException as exc:
        raise _first_failure(exc) from exc


def save(state: dict[str, Any], folder: Path) -> None:
    """A collective: every rank writes its shards into ``folder``; the first rank also writes the metadata.
    A failure on any rank raises on all of them, as the error that rank hit (an OSError for a full disk)."""
    with _dcp_errors():
        dcp.save(state, checkpoint_id=folder, no_dist=not dist.is_initialized())


def save_async(state: dict[str, Any], folder: Path, group: dist.ProcessGroup | None) -> Future:
    """Like :func:`save`, but returns once the tensors are copied aside (DCP's staging); the writing and its
    collectives run in a background thread on ``group``, which must not be the group training uses. The
    future's ``result()`` raises what :func:`save` would (through :func:`wait`)."""
    with _dcp_errors():
        response = dcp.async_save(state, checkpoint_id=folder, process_group=group,
                                  no_dist=not dist.is_initialized())
    # Newer torch may answer with a response holding the staging and the upload futures.
    return getattr(response, "upload_completion", response)


def wait(future: Future) -> None:
    with _dcp_errors():
        future.result()


def load(checkpoint: Path, modules: dict[str, nn.Module], ema: Any, optimizer: torch.optim.Optimizer) -> None:
    """Restore weights, EMA and optimizer state from a sharded checkpoint, whatever the number of ranks and
    the parallel strategy it was written under (a collective when there is a process group)."""
    state = live_state(modules, ema, optimizer)
    with _dcp_errors():
        dcp.load(state, storage_reader=SafeReader(Path(checkpoint) / FOLDER), planner=SafePlanner(),
                 no_dist=not dist.is_initialized())
    # Not strict: the model state holds only the trained parameters (frozen ones are left out, a LoRA base among
    # them), and DCP has already filled every one of those or failed.
    set_state_dict(nn.ModuleDict(modules), optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=dataclasses.replace(_OPTIONS, strict=False))


def read_group(checkpoint: Path, group: str) -> dict[str, torch.Tensor]:
    """One group (``model`` or ``ema``) consolidated into whole CPU tensors in this process, keyed as in a
    full checkpoint's safetensors file: what export and generate read. Needs no process group."""
    reader = SafeReader(Path(checkpoint) / FOLDER)
    prefix = group + "."
    tensors = {
        key[len(prefix):]: torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for key, item in reader.read_metadata().state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }
    if not tensors:
        raise KeyError(f"the sharded checkpoint holds no {group} tensors")
    with _dcp_errors():
        dcp.load({group: tensors}, storage_reader=reader, planner=SafePlanner(), no_dist=True)
    return tensors
