"""`sdtrain launch slurm|k8s|mpi CONFIG ...`: write a job file that runs `sdtrain train CONFIG` on a cluster."""

from __future__ import annotations

# Commands import what they run inside their functions: `sdtrain --help` and a mistyped argument answer
# without loading torch, diffusers or the data stack.
import argparse
import shutil
import subprocess
from pathlib import Path

from sdtrain.errors import UserError


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="the training YAML config")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides passed to every rank")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--name", default="sdtrain", help="job name")
    parser.add_argument("--out", type=Path, help="where to write the job file")


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("launch", help="write a Slurm, Kubernetes or mpirun job for a training config")
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="LAUNCHER")
    slurm = kinds.add_parser("slurm", help="an sbatch script: torchrun per node, requeue on preemption")
    _common(slurm)
    slurm.add_argument("--gpus-per-node", type=int, default=8, help="0 for CPU nodes")
    slurm.add_argument("--procs-per-node", type=int, help="processes per node on CPU nodes (default 1)")
    slurm.add_argument("--cpus-per-task", type=int)
    slurm.add_argument("--partition")
    slurm.add_argument("--time", help="time limit, e.g. 24:00:00")
    slurm.add_argument("--account")
    slurm.add_argument("--container", help="a pyxis/enroot image (e.g. a .sqsh file or registry#image)")
    slurm.add_argument("--container-mounts", help="pyxis mounts (default: the working directory)")
    slurm.add_argument("--submit", action="store_true", help="also run sbatch on it")
    slurm.set_defaults(run=run_slurm)
    k8s = kinds.add_parser("k8s", help="a Kubeflow PyTorchJob manifest with an elastic c10d rendezvous")
    _common(k8s)
    k8s.add_argument("--gpus-per-node", type=int, default=8, help="0 for CPU nodes")
    k8s.add_argument("--procs-per-node", type=int, help="processes per pod on CPU nodes (default 1)")
    k8s.add_argument("--image", required=True, help="container image with sdtrain installed")
    k8s.add_argument("--shm-size", default="16Gi", help="shared memory for DataLoader workers")
    k8s.set_defaults(run=run_k8s)
    mpi = kinds.add_parser("mpi", help="an mpirun script over a host file, for CPU clusters")
    _common(mpi)
    mpi.add_argument("--hosts", type=Path, required=True, help="host file, one host per line, first is the master")
    mpi.add_argument("--procs-per-node", type=int, default=1)
    mpi.add_argument("--threads-per-proc", type=int, default=1)
    mpi.set_defaults(run=run_mpi)


def _job(args: argparse.Namespace, procs: int, gpus: bool):
    from sdtrain.config import load_config
    from sdtrain.launch import Job, job_config

    if args.nodes < 1 or procs < 1:
        raise UserError("--nodes and the processes per node must be at least 1")
    # Loaded here, so a config that cannot load fails now, not on the cluster; the job carries it resolved.
    config = load_config(args.config, args.overrides)
    return Job(job_config(config, Path.cwd()), args.nodes, procs, gpus, args.name)


def _procs(args: argparse.Namespace) -> tuple[int, bool]:
    gpus = args.gpus_per_node > 0
    return (args.gpus_per_node if gpus else (args.procs_per_node or 1)), gpus


def run_slurm(args: argparse.Namespace) -> int:
    from sdtrain.launch import slurm_script, write

    job = _job(args, *_procs(args))
    text = slurm_script(job, args.partition, args.time, args.account, args.container, args.container_mounts,
                        args.cpus_per_task)
    out = write(text, args.out or Path(f"{args.name}.sbatch"), executable=True)
    print(f"wrote {out}")
    if args.submit:
        if shutil.which("sbatch") is None:
            raise UserError("--submit: sbatch is not on PATH; submit the script from a Slurm login node")
        subprocess.run(["sbatch", str(out)], check=True)
    return 0


def run_k8s(args: argparse.Namespace) -> int:
    from sdtrain.launch import pytorchjob_manifest, write

    job = _job(args, *_procs(args))
    out = write(pytorchjob_manifest(job, args.image, args.shm_size), args.out or Path(f"{args.name}.yaml"), False)
    print(f"wrote {out}")
    return 0


def run_mpi(args: argparse.Namespace) -> int:
    from sdtrain.launch import mpi_script, write

    if not args.hosts.is_file():
        raise UserError(f"--hosts: {args.hosts} not found; write one host per line, the master first")
    job = _job(args, args.procs_per_node, gpus=False)
    out = write(mpi_script(job, args.hosts.resolve(), args.threads_per_proc), args.out or Path(f"{args.name}.mpi.sh"),
                executable=True)
    print(f"wrote {out}")
    return 0
