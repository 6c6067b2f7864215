"""`sdtrain launch`: job files a cluster accepts, running the unchanged train command."""

from __future__ import annotations

import os
import subprocess
from unittest import mock

import pytest
import yaml

from sdtrain.cli.main import main
from sdtrain.config import load_config

from .conftest import config_path

CONFIG = config_path("diffusion.yaml")
OVERRIDES = ["run_dir=/shared/runs/a", "data.shards=/shared/data", "model.components.vae.source=/shared/runs/ae"]


def test_slurm_script_runs_torchrun_per_node_and_requeues(tmp_path):
    out = tmp_path / "job.sbatch"
    assert main(["launch", "slurm", str(CONFIG), *OVERRIDES, "--nodes", "4", "--gpus-per-node", "8",
                 "--partition", "gpu", "--time", "12:00:00", "--container", "nvcr.io#nvidia/pytorch:24.01",
                 "--out", str(out)]) == 0
    text = out.read_text()
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --requeue", "#SBATCH --signal=B:USR1@90", "#SBATCH --partition=gpu",
                 "#SBATCH --time=12:00:00"):
        assert line in text.splitlines()
    assert "--nproc_per_node=8" in text and "--rdzv_backend=c10d" in text and '--nnodes="$SLURM_NNODES"' in text
    assert "--container-image='nvcr.io#nvidia/pytorch:24.01'" in text
    assert "-m sdtrain train env:SDTRAIN_JOB_CONFIG &" in text
    config = job_config_of(text)
    paths = (config.run_dir, config.data.shards, config.model.source("vae"))
    assert paths == ("/shared/runs/a", "/shared/data", "/shared/runs/ae")
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    # The time-limit warning reaches the ranks as USR1 through srun (a TERM to srun would abort the step
    # before the ranks save), and torchrun ignores it rather than die of it (tests/test_slurm.py).
    assert 'kill -USR1 "$step_pid"' in text and "kill -TERM" not in text
    assert """bash -c 'trap "" USR1; exec "$@"' torchrun python -m torch.distributed.run""" in text
    subprocess.run(["bash", "-n", str(out)], check=True)


def test_slurm_script_for_cpu_nodes_asks_for_no_gpus(tmp_path):
    out = tmp_path / "cpu.sbatch"
    assert main(["launch", "slurm", str(CONFIG), *OVERRIDES, "--nodes", "2", "--gpus-per-node", "0",
                 "--procs-per-node", "2", "--out", str(out)]) == 0
    text = out.read_text()
    assert "--gpus-per-node" not in text and "--nproc_per_node=2" in text and "container" not in text


def test_pytorchjob_manifest_has_what_kubeflow_requires(tmp_path):
    out = tmp_path / "job.yaml"
    assert main(["launch", "k8s", str(CONFIG), *OVERRIDES, "--nodes", "3", "--gpus-per-node", "4",
                 "--image", "registry/sdtrain:1", "--name", "sd-pretrain", "--out", str(out)]) == 0
    config_map, job = yaml.safe_load_all(out.read_text())
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert job["metadata"]["name"] == "sd-pretrain"
    spec = job["spec"]
    assert spec["elasticPolicy"]["rdzvBackend"] == "c10d"
    assert spec["elasticPolicy"]["minReplicas"] == spec["elasticPolicy"]["maxReplicas"] == 3
    assert spec["nprocPerNode"] == "4"
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 3
    container = worker["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch" and container["image"] == "registry/sdtrain:1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["command"][:4] == ["python", "-m", "torch.distributed.run", "-m"]
    assert container["command"][4:] == ["sdtrain", "train", "/etc/sdtrain/config.yaml"]
    volumes = worker["template"]["spec"]["volumes"]
    assert volumes[0]["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # The config travels in a ConfigMap the pods mount, not as a path on the machine that wrote the job.
    assert {"name": "config", "configMap": {"name": "sd-pretrain-config"}} in volumes
    assert {"name": "config", "mountPath": "/etc/sdtrain", "readOnly": True} in container["volumeMounts"]
    assert config_map["kind"] == "ConfigMap" and config_map["metadata"]["name"] == "sd-pretrain-config"
    written = tmp_path / "config.yaml"
    written.write_text(config_map["data"]["config.yaml"])
    assert load_config(written).run_dir == "/shared/runs/a"


def test_mpi_script_uses_the_host_file(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("10.0.0.1\n10.0.0.2\n10.0.0.3\n")
    out = tmp_path / "job.sh"
    assert main(["launch", "mpi", str(CONFIG), *OVERRIDES, "--nodes", "3", "--hosts", str(hosts),
                 "--procs-per-node", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert "-np 3" in text and "-n 3 -ppn 1" in text and "MASTER_ADDR" in text and str(hosts) in text
    assert "-x SDTRAIN_JOB_CONFIG" in text and "-genvlist SDTRAIN_JOB_CONFIG" in text
    assert job_config_of(text).run_dir == "/shared/runs/a"
    subprocess.run(["bash", "-n", str(out)], check=True)


def job_config_of(script: str):
    """The config a job script exports, read back by bash itself and loaded as a rank would."""
    start = script.index("export SDTRAIN_JOB_CONFIG=")
    end = script.index("SDTRAIN_CONFIG_END\n)\"", start) + len("SDTRAIN_CONFIG_END\n)\"")
    shell = script[start:end] + '\nprintf %s "$SDTRAIN_JOB_CONFIG"'
    text = subprocess.run(["bash", "-c", shell], check=True, capture_output=True, text=True).stdout
    with mock.patch.dict(os.environ, {"SDTRAIN_JOB_CONFIG": text}):
        return load_config("env:SDTRAIN_JOB_CONFIG")


def test_relative_paths_are_made_absolute_so_the_job_runs_from_any_folder(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "job.sbatch"
    assert main(["launch", "slurm", str(CONFIG), "run_dir=runs/a", "data.shards=data/shard-{000..009}.tar",
                 "model.vae=s3://bucket/ae", "--gpus-per-node", "0", "--out", str(out)]) == 0
    config = job_config_of(out.read_text())
    assert config.run_dir == str(tmp_path / "runs" / "a")
    assert config.data.shards == str(tmp_path / "data" / "shard-{000..009}.tar")
    assert config.model.source("vae") == "s3://bucket/ae"  # not a local path: left alone


@pytest.mark.parametrize("argv, fragment", [
    (["launch", "slurm", str(CONFIG), "optim.lrr=1"], "optim.lrr"),
    (["launch", "mpi", str(CONFIG), *OVERRIDES, "--hosts", "/nonexistent"], "--hosts"),
])
def test_launch_refuses_what_would_fail_on_the_cluster(argv, fragment, capsys):
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err
