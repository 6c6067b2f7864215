"""Checkpoints: everything a run needs to continue exactly, written so that none is ever half there.

A checkpoint is a folder ``RUN/checkpoints/step_NNNNNNNN`` holding
- ``model.safetensors`` and ``ema.safetensors``: the trained modules' weights (keys ``unet.*``, ...);
- ``optimizer.pt``: the optimizer state (tensors and numbers only, loaded with weights_only=True);
- ``trainer.pt``: LR schedule, data position, RNG states and counters (also weights_only-safe);
- ``meta.json``: step, samples seen and each module's class and config, so the weights can be
  rebuilt into models without the run's config (export, generate, a later stage), and the size and
  sha256 of every other file;
- for LoRA and textual-inversion runs (DreamBooth with LoRA too), the files ``sdtrain export`` writes for them
  (``pytorch_lora_weights.safetensors`` and ``lora_kohya.safetensors``, or ``learned_embeds.safetensors``), for
  use mid-run: written into the folder before it is renamed into place, so covered by its checksums and pruned
  with it.
A sharded checkpoint (``checkpoint.format``) holds the weights, EMA and optimizer state as every rank's own
part in ``sharded/`` instead (see :mod:`sdtrain.sharded`); the other files are the same.
The folder is written under a temporary name and renamed into place, so a crash mid-save leaves
the previous checkpoint as the newest complete one. The checksums catch what renaming cannot: a file
damaged afterwards (a bad disk, a partial copy between clusters, a truncating sync) still parses, and
would otherwise be trained on. ``resume=auto`` then falls back to the previous good checkpoint; export,
generate and later stages refuse it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from sdtrain import sharded
from sdtrain.config import CheckpointConfig
from sdtrain.distributed import gather_objects
from sdtrain.errors import UserError, first_line
from sdtrain.paths import checkpoint_folders
from sdtrain.utils import atomic_write_text

log = logging.getLogger(__name__)



@dataclass
class Snapshot:
    """Full (unsharded) CPU copies of the weights, EMA and optimizer state, taken on every rank."""

    model: dict[str, torch.Tensor]
    ema: dict[str, torch.Tensor] | None
    optimizer: dict[str, Any]

    def averaged(self, name: str) -> dict[str, torch.Tensor]:
        """Module `name`'s trained tensors by their names in it: the EMA's where the run keeps one, else the raw
        ones."""
        prefix = name + "."
        weights = {k[len(prefix):]: v for k, v in self.model.items() if k.startswith(prefix)}
        if self.ema is not None:
            weights |= {k[len(prefix):]: v for k, v in self.ema.items() if k.startswith(prefix)}
        return weights


# Frozen parameters inside a trained module (a LoRA'd UNet's base weights) are not the run's to save:
# they come back from the module's pinned source, so a checkpoint is the size of what trains.
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)


def is_partial(module: nn.Module) -> bool:
    """Whether only some of a trained module's parameters train (adapters, new embeddings)."""
    return any(not p.requires_grad for p in module.parameters())


def capture(modules: dict[str, nn.Module], ema: Any, optimizer: torch.optim.Optimizer | None,
            keep: bool = True) -> Snapshot:
    """Every rank must call this: gathering sharded parameters is a collective. The optimizer state is
    keyed by parameter name, so it loads under any parallel strategy and number of ranks; without an
    optimizer (evaluation needs only the weights) none is gathered. Only the first rank keeps the gathered
    weights and optimizer state (``cpu_offload``); a rank that only helps gather (``keep`` false) keeps no
    EMA either."""
    if optimizer is None:
        model, optim = get_model_state_dict(nn.ModuleDict(modules), options=_FULL), {}
    else:
        model, optim = get_state_dict(nn.ModuleDict(modules), optimizer, options=_FULL)
    return Snapshot(_untied(model), ema.full_state(keep) if ema else None, optim)


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state with tied weights (T5's shared and encoder.embed_tokens) stored once each under both names:
    safetensors refuses tensors that share memory, and loading either name restores the tie's one tensor."""
    seen: set[int] = set()
    untied = {}
    for key, value in state.items():
        value = value.contiguous()
        pointer = value.data_ptr()
        untied[key] = value.clone() if pointer in seen and value.numel() else value
        seen.add(pointer)
    return untied


def _class_name(module: nn.Module) -> str:
    # FSDP2 swaps in a subclass named FSDP<class>; checkpoints name the model's own class.
    return type(module).__name__.removeprefix("FSDP")


def module_spec(module: nn.Module) -> dict[str, Any]:
    if hasattr(module, "config") and hasattr(module.config, "to_dict"):  # transformers
        return {"class": _class_name(module), "config": module.config.to_dict()}
    # diffusers resets keys listed in _use_default_values on load, which would undo values set after
    # construction (the autoencoder's measured scaling_factor).
    config = {k: v for k, v in dict(module.config).items() if k != "_use_default_values"}
    return {"class": _class_name(module), "config": config}  # diffusers


def list_checkpoints(run_dir: Path) -> list[Path]:
    return checkpoint_folders(run_dir)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


class Checkpointer:
    """Saves and restores the TrainState registry under a run folder.

    ``sharded``: the saves are sharded (every rank calls :meth:`save_sharded`) rather than full (the main
    rank calls :meth:`save` with a gathered snapshot). ``async_group``: the process group background sharded
    writes use (None in one process) when ``config.async_save``."""

    def __init__(self, run_dir: Path, config: CheckpointConfig, sharded: bool = False, async_group: Any = None):
        self.run_dir = Path(run_dir)
        self.config = config
        self.sharded = sharded
        self.async_save = sharded and config.async_save
        self.async_group = async_group
        self.folder = self.run_dir / "checkpoints"
        self._digesting: threading.Thread | None = None
        # A background sharded write: (its future, temporary folder, final folder, whether this rank commits).
        self._writing: tuple[Any, Path, Path, bool] | None = None
        if config.async_save and not sharded:
            log.warning("checkpoint.async_save applies to sharded checkpoints; this run saves full ones in the "
                        "foreground")

    def wait_for_checksums(self) -> None:
        """Until the last save's checksums are in its meta.json (the run's final save waits; a preempted
        run need not, and its newest checkpoint is then complete but unverified)."""
        if self._digesting is not None:
            self._digesting.join()
            self._digesting = None

    def due(self, step: int) -> bool:
        return self.config.every > 0 and step % self.config.every == 0

    def path_for(self, step: int) -> Path:
        return self.folder / f"step_{step:08d}"

    def save(self, state: Any, ranks: list[dict[str, Any]], snapshot: Snapshot,
             extra: Callable[[Path], Any] | None = None) -> Path:
        """Write a full checkpoint (main rank); `ranks` holds every rank's own state (data position, RNG);
        `extra` writes further files into the (temporary) checkpoint folder (a mode's adapter files).

        A failed write (disk full, quota, a read-only or vanished folder) removes its temporary folder and
        is one UserError: the previous checkpoint stays the newest, intact."""
        final = self.path_for(state.step)
        tmp = self._start(final)
        try:
            save_file(snapshot.model, str(tmp / "model.safetensors"))
            if snapshot.ema is not None:
                save_file(snapshot.ema, str(tmp / "ema.safetensors"))
            torch.save(snapshot.optimizer, tmp / "optimizer.pt")
            if extra is not None:
                extra(tmp)
            self._write_rest(tmp, state, ranks, "full")
        except (OSError, SafetensorError, RuntimeError) as exc:
            # safetensors and torch.save wrap the OSError of a failed write in their own types.
            raise self._failed(final, tmp, exc) from exc
        return self._commit(tmp, final)

    def save_sharded(self, state: Any, ranks: list[dict[str, Any]], tensors: dict[str, Any], is_main: bool,
                     extra: Callable[[Path], Any] | None = None) -> Path:
        """Write a sharded checkpoint: every rank calls this with its own shards (:func:`sharded.live_state`)
        and writes them; the main rank then adds the rest (and what its `extra` writes, as for :meth:`save`) and
        renames the folder into place. Any rank's failure is the same UserError on every rank, with nothing
        replaced."""
        self.finish_writing()  # every rank: the previous background write must be whole before the next
        final = self.path_for(state.step)
        started: Path | UserError | None = None
        if is_main:
            try:
                started = self._start(final)
            except UserError as exc:
                started = exc
        started = gather_objects(started)[0]  # every rank writes into the main rank's temporary folder
        if isinstance(started, UserError):
            raise started
        tmp = started
        failure: BaseException | None = None
        try:
            if is_main:  # the small files first: only the rename marks the checkpoint complete
                if extra is not None:
                    extra(tmp)
                self._write_rest(tmp, state, ranks, "sharded")
            if self.async_save:
                self._writing = (sharded.save_async(tensors, tmp / sharded.FOLDER, self.async_group), tmp, final,
                                 is_main)
            else:
                sharded.save(tensors, tmp / sharded.FOLDER)
        except (OSError, SafetensorError, RuntimeError) as exc:  # safetensors: `extra`'s failed write
            failure = exc
        errors = gather_objects(None if failure is None else first_line(failure)[:300])
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            error = self._failed(final, tmp, failure or RuntimeError(first), cleanup=is_main)
            raise error from failure
        if self.async_save:
            return final
        return self._commit(tmp, final) if is_main else final

    def poll(self) -> None:
        """Commit a background write that has finished well (cheap; call after every step). A failed one is
        left for the next save or the run's end, which all ranks reach together: raised here, on one rank at
        a time, it would leave the others waiting in the next collective."""
        if self._writing is None:
            return
        future = self._writing[0]
        if future.done() and future.exception() is None:
            self.finish_writing()

    def finish_writing(self) -> None:
        """Wait for the background write, if any, and commit it; its failure is one UserError, on every rank
        (DCP's collectives share it), with nothing replaced."""
        if self._writing is None:
            return
        future, tmp, final, commits = self._writing
        self._writing = None
        try:
            sharded.wait(future)
        except (OSError, RuntimeError) as exc:
            raise self._failed(final, tmp, exc, cleanup=commits) from exc
        if commits:
            self._commit(tmp, final)

    def _start(self, final: Path) -> Path:
        """An empty temporary folder for the checkpoint ``final``, once the previous save's checksums are in
        (a background sharded write is waited for by :meth:`save_sharded`, on every rank)."""
        tmp = self.folder / f".{final.name}.tmp-{os.getpid()}"
        self.wait_for_checksums()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as exc:
            raise self._failed(final, tmp, exc) from exc
        return tmp

    def _failed(self, final: Path, tmp: Path, exc: BaseException, cleanup: bool = True) -> UserError:
        if cleanup:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(self.run_dir)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else first_line(exc)
        return UserError(
            f"{final}: cannot write the checkpoint ({reason}); nothing was replaced, the newest "
            f"checkpoint is still {previous or 'none'}. Free space or fix the folder's permissions and run "
            "the same command to resume")

    def _commit(self, tmp: Path, final: Path) -> Path:
        if final.exists():
            # Left by an earlier attempt that went further than the point this run resumed from.
            stale = final.with_name(f".{final.name}.stale-{os.getpid()}")
            os.replace(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, final)
        self._prune()
        log.info("saved checkpoint %s", final)
        # Hashing ~14 GB (SD2 with EMA and AdamW) would double the training stall of a save; it runs beside
        # the next steps instead and lands in meta.json by an atomic replace.
        self._digesting = threading.Thread(target=record_checksums, args=(final,), name="sdtrain-checksums",
                                           daemon=True)
        self._digesting.start()
        return final

    @staticmethod
    def _write_rest(tmp: Path, state: Any, ranks: list[dict[str, Any]], layout: str) -> None:
        torch.save(state.trainer_state(ranks), tmp / "trainer.pt")
        meta = {
            "step": state.step,
            "samples": state.samples,
            "stage": state.stage,
            "format": layout,
            "ema": state.ema is not None,
            "modules": {name: {**module_spec(m), "partial": is_partial(m)} for name, m in state.modules.items()},
            "sources": state.task.sources,
            "task": state.task.checkpoint_meta(),
            "tuning": state.tuning.as_dict(),
        }
        # meta.json last: its presence is what marks a checkpoint folder complete.
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
        _fsync_tree(tmp)

    def _prune(self) -> None:
        for old in list_checkpoints(self.run_dir)[: -self.config.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def resume_path(self) -> Path | None:
        """The checkpoint to start from under the configured resume policy, or None for a fresh start."""
        # Temporary folders are what a crash mid-save leaves; the run has one writer, so any found at
        # start are dead.
        for partial in self.folder.glob(".step_*.*-*") if self.folder.is_dir() else ():
            shutil.rmtree(partial, ignore_errors=True)
        policy = self.config.resume
        if policy == "auto":
            return newest_intact(self.run_dir)
        newest = latest_checkpoint(self.run_dir)
        if policy == "never":
            if newest is not None:
                raise UserError(
                    f"{self.run_dir}: already holds checkpoints; use checkpoint.resume=auto to continue "
                    "or another run_dir to start over"
                )
            return None
        path = Path(policy)
        if not (path / "meta.json").is_file():
            raise UserError(f"checkpoint.resume: {path} is not a checkpoint folder (no meta.json)")
        require_intact(path)
        return path

    def load(self, path: Path, state: Any) -> None:
        """Every rank restores the registry from a full or a sharded checkpoint (a collective for sharded)."""
        try:
            trainer = torch.load(path / "trainer.pt", weights_only=True, map_location="cpu")
            if sharded.is_sharded(path):
                sharded.load(path, state.modules, state.ema, state.optimizer)
                if state.ema is not None:
                    state.ema.updates = trainer["ema_updates"]
            else:
                self._load_full(path, state, trainer)
            state.load_trainer_state(trainer)
        except (OSError, RuntimeError, KeyError, ValueError, SafetensorError, pickle.UnpicklingError) as exc:
            raise UserError(
                f"{path}: cannot resume from this checkpoint ({first_line(exc)}); "
                "delete it to fall back to the previous one, or set checkpoint.resume=never with a new run_dir"
            ) from exc
        log.info("resumed from %s at step %d", path, state.step)

    @staticmethod
    def _load_full(path: Path, state: Any, trainer: dict[str, Any]) -> None:
        model = load_file(str(path / "model.safetensors"))
        optimizer = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
        # Every rank holds the full state and keeps its own shard of it.
        strict = not any(is_partial(m) for m in state.modules.values())
        set_state_dict(nn.ModuleDict(state.modules), state.optimizer, model_state_dict=model,
                       optim_state_dict=optimizer, options=StateDictOptions(full_state_dict=True, strict=strict))
        if not strict:
            _check_partial(model, state.modules, path)
        if state.ema is not None:
            state.ema.load_state_dict(load_file(str(path / "ema.safetensors")), trainer["ema_updates"])


def _check_partial(saved: dict[str, torch.Tensor], modules: dict[str, nn.Module], path: Path) -> None:
    """A partial load must still restore every trained tensor (adapters of another rank, say, would not)."""
    trained = {f"{name}.{k}" for name, m in modules.items() for k, p in m.named_parameters() if p.requires_grad}
    missing = sorted(trained - set(saved))
    if missing:
        raise KeyError(f"the checkpoint lacks {missing[0]}: it was saved with other adapter or token settings")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256s(paths: list[Path]) -> list[str]:
    """The files' sha256s, hashed side by side: hashlib releases the GIL, and a checkpoint's few large
    files (weights, EMA, optimizer state) would otherwise hash one after another at ~1 GB/s."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(paths), os.cpu_count() or 1))) as pool:
        return list(pool.map(_sha256, paths))


def file_digests(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file a checkpoint holds but meta.json, by relative path (``sha256sum`` can
    check them too)."""
    files = [item for item in sorted(folder.rglob("*")) if item.is_file() and item.name != "meta.json"]
    return {item.relative_to(folder).as_posix(): {"bytes": item.stat().st_size, "sha256": digest}
            for item, digest in zip(files, _sha256s(files))}


def record_checksums(checkpoint: Path) -> None:
    """Add the size and sha256 of every file to a saved checkpoint's meta.json, replacing it atomically so a
    reader always finds a whole one. A checkpoint pruned meanwhile is left alone."""
    try:
        meta = json.loads((checkpoint / "meta.json").read_text())
        meta["files"] = file_digests(checkpoint)
        atomic_write_text(checkpoint / "meta.json", json.dumps(meta, indent=1, default=str))
    except OSError as exc:
        log.debug("no checksums for %s (%s)", checkpoint, exc)


def damage(checkpoint: Path, names: list[str] | None = None) -> str | None:
    """What is wrong with a checkpoint's files (all, or just ``names``) against the checksums its meta.json
    recorded at save time, or None when they match. Checkpoints without checksums (saved by an older
    sdtrain, or by a process killed in the seconds before they were recorded) cannot be checked and pass."""
    try:
        meta = json.loads((checkpoint / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        return f"meta.json is unreadable ({exc})"
    recorded = meta.get("files")
    if recorded is None:
        return None
    checked = {name: expected for name, expected in recorded.items() if names is None or name in names}
    for name, expected in checked.items():  # the cheap checks first
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["bytes"]:
            return f"{name} has {size} bytes, {expected['bytes']} when saved (truncated or overwritten)"
    digests = _sha256s([checkpoint / name for name in checked])
    for (name, expected), digest in zip(checked.items(), digests):
        if digest != expected["sha256"]:
            return f"{name} does not match the sha256 recorded when it was saved (its bytes changed)"
    return None


def require_intact(checkpoint: Path, names: list[str] | None = None) -> None:
    """A UserError naming the damaged file, for commands that must not read a damaged checkpoint."""
    problem = damage(checkpoint, names)
    if problem:
        raise UserError(f"{checkpoint}: damaged checkpoint: {problem}; use an earlier checkpoint of the run "
                        "(pass its folder) or delete this one")


def newest_intact(run_dir: Path) -> Path | None:
    """The newest checkpoint whose files match their checksums. A damaged newer one is moved aside to
    ``step_N.damaged`` (kept for inspection, never listed again), with a warning naming what was wrong."""
    for checkpoint in reversed(list_checkpoints(run_dir)):
        problem = damage(checkpoint)
        if problem is None:
            return checkpoint
        aside = checkpoint.with_name(f"{checkpoint.name}.damaged")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(checkpoint, aside)
        log.warning("%s is damaged (%s); moved it to %s and falling back to the previous checkpoint",
                    checkpoint, problem, aside.name)
    return None


def read_meta(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's meta.json; an unreadable one is a UserError naming it."""
    try:
        return json.loads((checkpoint / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{checkpoint}/meta.json: unreadable ({exc}); delete this checkpoint folder") from exc


def pinned_sources(checkpoint: Path | None) -> dict[str, str]:
    """The exact folders the frozen components of a checkpoint's run were loaded from."""
    if checkpoint is None:
        return {}
    return dict(read_meta(checkpoint).get("sources", {}))


def _fsync_tree(folder: Path) -> None:
    for item in folder.rglob("*"):
        if item.is_file():
            with open(item, "rb") as f:
                os.fsync(f.fileno())


def read_weights(checkpoint: Path, group: str) -> dict[str, torch.Tensor]:
    """A checkpoint's ``model`` or ``ema`` weights as whole tensors, full or sharded (consolidated here)."""
    try:
        if sharded.is_sharded(checkpoint):
            return sharded.read_group(checkpoint, group)
        return load_file(str(checkpoint / f"{group}.safetensors"))
    except (OSError, RuntimeError, KeyError, ValueError, SafetensorError, pickle.UnpicklingError) as exc:
        raise UserError(f"{checkpoint}: cannot read its {group} weights ({first_line(exc)}); "
                        "use an earlier checkpoint of the run") from exc


