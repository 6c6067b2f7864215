"""The run folder and the device: set up once per run, shared by every stage."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from sdtrain.config import RunConfig, to_yaml
from sdtrain.errors import UserError
from sdtrain.paths import LOCK
from sdtrain.utils import atomic_write_text

log = logging.getLogger(__name__)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """`auto` is this process's GPU (one per local rank) when there are GPUs, else the CPU."""
    if name == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if name == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device: {name} requested but no CUDA device is visible; use cpu")
    try:
        return torch.device(name)
    except RuntimeError as exc:
        raise UserError(f"device: '{name}' is not a device; use auto, cpu, cuda or cuda:N") from exc


def _make_run_dir(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"run_dir: cannot create {run_dir} ({exc.strerror}); choose a writable folder") from exc
    return run_dir


def prepare_run_dir(config: RunConfig) -> Path:
    """Create the run folder and record the resolved config.

    The first start writes config.yaml; it is never rewritten. A restart with a different config
    (say a longer max_steps) keeps the original and records the new one beside it.
    """
    run_dir = _make_run_dir(config.run_dir)
    text = to_yaml(config)
    first = run_dir / "config.yaml"
    if not first.exists():
        atomic_write_text(first, text)
    elif first.read_text() != text:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        changed = run_dir / f"config.{stamp}.yaml"
        n = 1
        while changed.exists():
            n += 1
            changed = run_dir / f"config.{stamp}-{n}.yaml"
        atomic_write_text(changed, text)
        log.warning("config differs from %s; this start's config is saved as %s", first, changed)
    return run_dir




@contextlib.contextmanager
def run_dir_lock(run_dir: str | Path) -> Iterator[None]:
    """Hold the run folder for one training job at a time.

    An advisory ``flock`` on ``RUN/.sdtrain.lock``: the kernel drops it when the holder exits in any way,
    kill -9 and a lost node's NFS client included, so a crashed run never leaves it stuck. The file
    names the holder for the refusal message; its contents are not what locks.
    """
    run_dir = _make_run_dir(run_dir)
    try:
        handle = open(run_dir / LOCK, "a+")  # noqa: SIM115 - held open for the whole run: it is the lock
    except OSError as exc:
        raise UserError(f"run_dir: cannot write in {run_dir} ({exc.strerror}); choose a writable folder") from exc
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise UserError(f"run_dir {run_dir} is in use by {holder}; wait for that run to end, stop it, "
                            "or choose another run_dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"sdtrain train (pid {os.getpid()} on {socket.gethostname()}, "
                     f"since {time.strftime('%Y-%m-%d %H:%M:%S')})\n")
        handle.flush()
        yield
    finally:
        handle.close()  # closing releases the lock
