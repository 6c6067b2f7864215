"""Job files for clusters: a Slurm batch script, a Kubeflow PyTorchJob, an mpirun script.

Each runs the unchanged ``sdtrain train`` on every node; sdtrain recognises the launcher from the
environment. The files are plain text for a user to read, edit and submit, and self-contained: they carry
the run's resolved config (overrides applied, relative paths made absolute), so no node or container
needs the file it was written from. The scripts export it in ``SDTRAIN_JOB_CONFIG`` (srun, torchrun and
mpirun pass the environment to every rank) and train ``env:SDTRAIN_JOB_CONFIG``; the PyTorchJob mounts it
from a ConfigMap.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sdtrain.config import to_yaml
from sdtrain.utils import atomic_write_text

RDZV_PORT = 29500
CONFIG_VARIABLE = "SDTRAIN_JOB_CONFIG"
_END = "SDTRAIN_CONFIG_END"
K8S_CONFIG_DIR = "/etc/sdtrain"


@dataclass
class Job:
    config_yaml: str
    """The resolved config the job trains, as YAML."""
    nodes: int = 1
    procs_per_node: int = 1
    gpus: bool = True
    name: str = "sdtrain"

    def train_args(self, config: str = f"env:{CONFIG_VARIABLE}") -> str:
        return f"train {shlex.quote(config)}"

    def config_export(self) -> str:
        """Bash that exports the config, quoted so nothing in it expands."""
        if any(line.strip() == _END for line in self.config_yaml.splitlines()):
            raise ValueError(f"the config holds a line {_END}, which ends the script's here-document")
        return (f"# The run's resolved config, overrides applied: every rank reads it from ${CONFIG_VARIABLE},\n"
                f"# so no node needs a config file. Edit it here to change the run.\n"
                f"export {CONFIG_VARIABLE}=\"$(cat <<'{_END}'\n{self.config_yaml.rstrip()}\n{_END}\n)\"")


def slurm_script(job: Job, partition: str | None = None, time: str | None = None, account: str | None = None,
                 container: str | None = None, mounts: str | None = None, cpus_per_task: int | None = None,
                 log_dir: str = ".") -> str:
    """One torchrun per node, rendezvous on the first node, requeue on preemption or time limit."""
    directives = [
        f"--job-name={job.name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
        f"--output={log_dir}/{job.name}-%j.out",
        # Slurm requeues a preempted job; the time-limit warning goes to this script (B:), which asks
        # sdtrain to save and requeues the job itself.
        "--requeue",
        "--signal=B:USR1@90",
        "--open-mode=append",
    ]
    if job.gpus:
        directives.append(f"--gpus-per-node={job.procs_per_node}")
    if cpus_per_task:
        directives.append(f"--cpus-per-task={cpus_per_task}")
    for flag, value in (("partition", partition), ("time", time), ("account", account)):
        if value:
            directives.append(f"--{flag}={value}")
    container_flags = ""
    if container:
        # pyxis/enroot: the same image on every node, the working directory mounted at the same path.
        container_flags = f"--container-image={shlex.quote(container)} --container-workdir=\"$PWD\" " + (
            f"--container-mounts={shlex.quote(mounts)}" if mounts else '--container-mounts="$PWD:$PWD"')
    header = "\n".join(f"#SBATCH {d}" for d in directives)
    threads = "1" if job.gpus else "$(( ${SLURM_CPUS_PER_TASK:-2} / " + str(job.procs_per_node) + " ))"
    return f"""#!/bin/bash
{header}
# Written by `sdtrain launch slurm`. Submit with: sbatch THIS_FILE
set -uo pipefail

{job.config_export()}

head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# The address, not the name: node names do not resolve everywhere.
head_addr=$(srun --nodes=1 --ntasks=1 --nodelist="$head_node" hostname --ip-address | awk '{{print $1}}')
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{threads}}}

stop_requested=0
step_pid=""
on_time_limit() {{
    echo "time limit near: asking sdtrain to save and stop"
    stop_requested=1
    # srun passes USR1 on to every process of the step, once: each rank saves and stops. (TERM would
    # make srun abort the step and kill the ranks before they save.)
    if [ -n "$step_pid" ]; then kill -USR1 "$step_pid" 2>/dev/null; fi
}}
trap on_time_limit USR1

# torchrun ignores USR1 (its default action would kill it, and with it the step); the ranks it
# starts set their own handler.
srun --kill-on-bad-exit=1 {container_flags} \\
    bash -c 'trap "" USR1; exec "$@"' torchrun python -m torch.distributed.run \\
        --nnodes="$SLURM_NNODES" --nproc_per_node={job.procs_per_node} \\
        --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d --rdzv_endpoint="$head_addr:{RDZV_PORT}" \\
        -m sdtrain {job.train_args()} &
step_pid=$!
wait "$step_pid"; status=$?
# `wait` returns early when a signal arrives; keep waiting until the step has really ended.
while kill -0 "$step_pid" 2>/dev/null; do
    wait "$step_pid"; status=$?
done
if [ "$stop_requested" = 1 ]; then
    echo "saved; requeueing job $SLURM_JOB_ID to resume"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$status"
"""


def pytorchjob_manifest(job: Job, image: str, shm_size: str = "16Gi", max_restarts: int = 3) -> str:
    """A Kubeflow training-operator PyTorchJob with an elastic (c10d) rendezvous."""
    resources = {"limits": {"nvidia.com/gpu": job.procs_per_node}} if job.gpus else {}
    container = {
        "name": "pytorch",  # the training operator looks for this container name
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        # The operator sets PET_NNODES, PET_RDZV_ENDPOINT, ... which torchrun reads.
        "command": ["python", "-m", "torch.distributed.run", "-m", "sdtrain",
                    *shlex.split(job.train_args(f"{K8S_CONFIG_DIR}/config.yaml"))],
        "env": [{"name": "OMP_NUM_THREADS", "value": "1" if job.gpus else "2"}],
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "config", "mountPath": K8S_CONFIG_DIR, "readOnly": True}],
    }
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{job.name}-config"},
        "data": {"config.yaml": job.config_yaml},
    }
    if resources:
        container["resources"] = resources
    manifest = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": job.name},
        "spec": {
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                "minReplicas": job.nodes,
                "maxReplicas": job.nodes,
                "maxRestarts": max_restarts,
            },
            "nprocPerNode": str(job.procs_per_node),
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": job.nodes,
                    "restartPolicy": "OnFailure",
                    "template": {
                        "spec": {
                            "containers": [container],
                            # DataLoader workers share batches through /dev/shm; the default 64 MB is too small.
                            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}},
                                        {"name": "config", "configMap": {"name": f"{job.name}-config"}}],
                        }
                    },
                }
            },
        },
    }
    # The config first: the pods mount it.
    return ("# Written by `sdtrain launch k8s`: the run's resolved config and the job. Submit with: kubectl apply "
            "-f THIS_FILE\n" + yaml.safe_dump_all([config_map, manifest], sort_keys=False))


def mpi_script(job: Job, hosts: Path, threads_per_proc: int = 1) -> str:
    """mpirun over a host file, for CPU clusters (Open MPI or Intel MPI / MPICH)."""
    total = job.nodes * job.procs_per_node
    return f"""#!/bin/bash
# Written by `sdtrain launch mpi`. Run it on the first host of {hosts}.
set -euo pipefail

{job.config_export()}

hostfile={shlex.quote(str(hosts))}
master_addr=$(head -n 1 "$hostfile" | awk '{{print $1}}')
# Two jobs on one host need two ports: set MASTER_PORT before running this file.
master_port=${{MASTER_PORT:-{RDZV_PORT}}}
args=(-m sdtrain {job.train_args()})
if mpirun --version 2>&1 | grep -q "Open MPI"; then
    exec mpirun -np {total} --hostfile "$hostfile" --map-by ppr:{job.procs_per_node}:node --bind-to none \\
        -x MASTER_ADDR="$master_addr" -x MASTER_PORT="$master_port" -x OMP_NUM_THREADS={threads_per_proc} -x PATH \\
        -x {CONFIG_VARIABLE} \\
        python "${{args[@]}}"
else  # Intel MPI, MPICH
    exec mpirun -n {total} -ppn {job.procs_per_node} -f "$hostfile" \\
        -genv MASTER_ADDR "$master_addr" -genv MASTER_PORT "$master_port" -genv OMP_NUM_THREADS {threads_per_proc} \\
        -genvlist {CONFIG_VARIABLE} \\
        python "${{args[@]}}"
fi
"""


def write(text: str, out: Path, executable: bool) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text)
    if executable:
        out.chmod(0o755)
    return out


# Config keys that name files or folders; in a job they must not depend on the submitting shell's directory.
PATH_KEYS = ("run_dir", "data.shards", "model.pretrained", "dreambooth.class_data", "evaluation.prompts",
             "evaluation.reference", "evaluation.inception", "evaluation.clip", "checkpoint.resume")
"""Besides every component's source, ``model.components.NAME.source``."""


def job_config(config: Any, base: Path) -> str:
    """The resolved config as YAML, its relative paths made absolute against ``base`` (where ``sdtrain
    launch`` ran): a relative run_dir always, other keys when they (or their leading folder) exist there.
    URLs, ``pipe:`` commands and ``checkpoint.resume``'s words (auto, never) are left as they are."""
    tree = yaml.safe_load(to_yaml(config))
    for key in (*PATH_KEYS, *(f"model.components.{name}.source" for name in tree["model"]["components"])):
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.get(part) or {}
        value = node.get(leaf)
        if not isinstance(value, str) or not value or "://" in value or value.startswith(("pipe:", "/")):
            continue
        if key == "checkpoint.resume" and value in ("auto", "never"):
            continue
        # A pattern (shard-{000..009}.tar, *.tar) exists only through its leading folder.
        if key == "run_dir" or (base / value).exists() or (base / Path(value).parts[0]).is_dir():
            node[leaf] = str((base / value).absolute())
    return yaml.safe_dump(tree, sort_keys=False)
