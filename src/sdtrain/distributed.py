"""Process-group set-up from whichever launcher started the process: torchrun, Slurm or mpirun.

The same ``sdtrain train CONFIG`` runs under all of them: the launcher is recognised from its
environment variables, never from a flag, so job scripts stay one line.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from sdtrain.errors import UserError

log = logging.getLogger(__name__)

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    launcher: str = "single"
    local_world_size: int = 1
    """Processes of this job on this machine: they share its memory."""

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list such as ``gpu[003-005,010],cpu1`` (-> ``gpu003``)."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise UserError(f"SLURM_JOB_NODELIST: cannot read '{nodelist}'; set MASTER_ADDR to the first node")
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def detect_topology(env: Mapping[str, str] | None = None) -> Topology:
    """Read rank, world size and rendezvous address from the launcher's environment."""
    env = os.environ if env is None else env

    def port() -> int:
        return int(env.get("MASTER_PORT", DEFAULT_PORT))

    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun, Kubeflow PyTorchJob
        return Topology(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                        env.get("MASTER_ADDR", "127.0.0.1"), port(), "torchrun",
                        int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:  # srun, one task per device
        addr = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        # A port derived from the job id lets several jobs share a node without colliding.
        default_port = 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000
        # SLURM_TASKS_PER_NODE reads like "2(x3),1": the first node's count is the usual one.
        per_node = re.match(r"\d+", env.get("SLURM_TASKS_PER_NODE", "")) or re.match(r"\d+", env["SLURM_NTASKS"])
        return Topology(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                        addr, int(env.get("MASTER_PORT", default_port)), "slurm", int(per_node.group()))
    if "OMPI_COMM_WORLD_RANK" in env:  # Open MPI's mpirun
        return Topology(int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"]),
                        int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)), env.get("MASTER_ADDR", "127.0.0.1"),
                        port(), "mpi", int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", env["OMPI_COMM_WORLD_SIZE"])))
    if "PMI_RANK" in env and "PMI_SIZE" in env:  # Intel MPI / MPICH hydra
        local = env.get("MPI_LOCALRANKID", env.get("PMI_LOCAL_RANK", "0"))
        return Topology(int(env["PMI_RANK"]), int(env["PMI_SIZE"]), int(local),
                        env.get("MASTER_ADDR", "127.0.0.1"), port(), "mpi",
                        int(env.get("MPI_LOCALNRANKS", env["PMI_SIZE"])))
    return Topology()


def choose_backend(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "nccl"
    try:  # Intel's collectives for CPU clusters, when their bindings are installed
        import oneccl_bindings_for_pytorch  # noqa: F401

        return "ccl"
    except ImportError:
        return "gloo"


def init_distributed(topology: Topology, device: torch.device, backend: str = "auto",
                     timeout_minutes: float = 30) -> None:
    """Join the process group (a no-op for a single process)."""
    if not topology.distributed or dist.is_initialized():
        return
    # env:// reads these; launchers other than torchrun do not set them.
    os.environ.setdefault("MASTER_ADDR", topology.master_addr)
    os.environ.setdefault("MASTER_PORT", str(topology.master_port))
    os.environ.setdefault("RANK", str(topology.rank))
    os.environ.setdefault("WORLD_SIZE", str(topology.world_size))
    os.environ.setdefault("LOCAL_RANK", str(topology.local_rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # object collectives stage on the current device
    chosen = choose_backend(backend, device)
    timeout = timedelta(minutes=timeout_minutes)
    dist.init_process_group(chosen, timeout=timeout, store=_attempt_store(topology, timeout),
                            rank=topology.rank, world_size=topology.world_size,
                            device_id=device if device.type == "cuda" else None)
    log.info("rank %d of %d (%s, backend %s)", topology.rank, topology.world_size, topology.launcher, chosen)


_store: dist.Store | None = None
"""The job's rendezvous store, kept for the progress records every rank leaves in it."""


def _attempt_store(topology: Topology, timeout: timedelta) -> dist.Store:
    """The rendezvous store, under a prefix of its own for each torchrun restart.

    torchrun keeps one store across `--max-restarts` attempts; without a prefix, the restarted
    ranks read the addresses their dead predecessors published and fail to connect.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), topology.world_size,
                          is_master=not agent_hosts_store and topology.rank == 0, timeout=timeout,
                          multi_tenant=True)
    global _store
    _store = dist.PrefixStore(f"sdtrain/attempt_{attempt}", store)
    return _store


def record_progress(step: int, finished: bool) -> None:
    """Leave where this rank is, starting or done with its share of ``step``, in the store (a few bytes over
    TCP, twice a step), so that when a collective times out the survivors can say which rank stopped where."""
    if _store is not None and dist.is_initialized():
        _store.set(f"progress/{dist.get_rank()}", f"{step}:{int(finished)}")


def describe_progress() -> str:
    """'rank 1 stopped during step 3 while rank 0 finished step 3', from the records; '' if unreadable."""
    if _store is None or not dist.is_initialized():
        return ""
    where: dict[int, tuple[int, int]] = {}
    try:
        for rank in range(dist.get_world_size()):
            key = f"progress/{rank}"
            step, _, finished = (_store.get(key).decode() if _store.check([key]) else "0:0").partition(":")
            where[rank] = (int(step), int(finished))
    except (RuntimeError, ValueError):  # the store's host may be the process that died
        return ""

    def say(point: tuple[int, int]) -> str:
        return f"{'finished' if point[1] else 'was in'} step {point[0]}"

    ahead = max(where.values())
    behind = sorted(r for r, point in where.items() if point < ahead)
    if not behind:
        return f"every rank {say(ahead)}"
    leaders = sorted(r for r, point in where.items() if point == ahead)
    lagging = ", ".join(f"rank {r} stopped while it {say(where[r])}" for r in behind)
    return f"{lagging}; rank{'s' if len(leaders) > 1 else ''} {', '.join(map(str, leaders))} {say(ahead)}"


class RankFailure(UserError):
    """A collective failed because another rank died or stalled: the job must end and restart."""


def is_collective_failure(exc: BaseException) -> bool:
    """A timeout or a lost peer in a collective, as gloo, NCCL or the store report it."""
    if not dist.is_initialized() or not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return isinstance(exc, dist.DistError) or any(
        needle in text for needle in ("timed out", "timeout", "connection closed", "connection reset",
                                      "broken pipe", "peer"))


def is_distributed() -> bool:
    return dist.is_initialized()


def exit_without_teardown(code: int) -> NoReturn:
    """End a finished multi-process run without tearing torch down.

    Destroying a gloo process group joins its worker threads while holding the GIL; a worker still
    releasing a finished collective's tensors waits for the GIL, and the process hangs at exit
    (seen here after a torchrun restart). Once the run has saved and passed its final barrier,
    nothing is left to tear down that the operating system does not reclaim.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def new_group(backend: str) -> dist.ProcessGroup | None:
    """Another group of all ranks, for collectives that run beside training's (every rank must call it)."""
    return dist.new_group(backend=backend) if dist.is_initialized() else None


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, on every rank (just [obj] for a single process)."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def any_ranks(flags: list[bool | torch.Tensor], device: torch.device) -> list[bool]:
    """For each flag (a bool, or a one-element tensor on `device`), True on every rank when it is true on at least
    one: several flags in one all-reduce, read with one device sync."""
    values = torch.stack([torch.as_tensor(flag, device=device).reshape(()).float() for flag in flags])
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(value) for value in values.tolist()]


def mean_over_ranks(values: dict[str, float], device: torch.device) -> dict[str, float]:
    if not dist.is_initialized() or not values:
        return values
    keys = sorted(values)
    tensor = torch.tensor([values[k] for k in keys], device=device, dtype=torch.float64)
    dist.all_reduce(tensor)
    tensor /= dist.get_world_size()
    return dict(zip(keys, tensor.tolist()))
