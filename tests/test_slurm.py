"""`sdtrain launch slurm` on a real Slurm: a one-node cluster on localhost runs the written sbatch script.

The cluster (munged, slurmctld, slurmd from Debian's slurm-wlm and munge packages) lives in a
private folder for this module only; see tests/slurm_cluster.py. `.ci/run` installs the packages;
without them the tests skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sdtrain.cli.main import main

from .conftest import TINY, config_path
from .slurm_cluster import SlurmCluster, missing_programs


@pytest.fixture(scope="module")
def slurm_cluster():
    if missing_programs():
        pytest.skip("Slurm (Debian slurm-wlm, munge) is not installed; .ci/run installs it")
    with SlurmCluster() as cluster:
        yield cluster


def _job_env(cluster: SlurmCluster) -> dict[str, str]:
    # sbatch exports the submitting environment to the job: `python` there must be this venv's.
    venv_bin = str(Path(sys.executable).parent)
    return {**cluster.env, "PATH": venv_bin + os.pathsep + cluster.env.get("PATH", ""), "OMP_NUM_THREADS": "1"}


def _write_job(script: Path, run: Path, shapes_dir: Path, autoencoder_run: Path, steps: int) -> None:
    assert main(["launch", "slurm", str(config_path("diffusion.yaml")), f"run_dir={run}",
                 f"data.shards={shapes_dir}", f"model.vae={autoencoder_run}", *TINY, "validation.prompts=[]",
                 f"train.max_steps={steps}", "checkpoint.every=0", "--nodes", "1", "--gpus-per-node", "0",
                 "--procs-per-node", "2", "--out", str(script)]) == 0


def _read(path: Path) -> str:
    return path.read_text() if path.is_file() else "(no job log)"


@pytest.mark.slow
def test_the_written_sbatch_script_trains_two_ranks_under_slurm(slurm_cluster, tmp_path, shapes_dir,
                                                                 autoencoder_run, monkeypatch):
    # Written from one folder with relative paths and a config file that is gone by the time the job runs,
    # submitted from another: the script carries its resolved config.
    written_in, submitted_from = tmp_path / "project", tmp_path / "elsewhere"
    written_in.mkdir()
    submitted_from.mkdir()
    config = written_in / "my.yaml"
    shutil.copy(config_path("diffusion.yaml"), config)
    (written_in / "shapes").symlink_to(shapes_dir)
    monkeypatch.chdir(written_in)
    script = written_in / "job.sbatch"
    assert main(["launch", "slurm", "my.yaml", "run_dir=run", "data.shards=shapes", f"model.vae={autoencoder_run}",
                 *TINY, "validation.prompts=[]", "train.max_steps=3", "checkpoint.every=0", "--nodes", "1",
                 "--gpus-per-node", "0", "--procs-per-node", "2", "--out", str(script)]) == 0
    config.unlink()
    # --wait: sbatch returns when the job has ended, with the job script's exit code.
    result = subprocess.run(["sbatch", "--wait", "--parsable", str(script)], cwd=submitted_from,
                            env=_job_env(slurm_cluster), capture_output=True, text=True, timeout=600)
    job_id = result.stdout.strip().split(";")[0]
    log = _read(submitted_from / f"sdtrain-{job_id}.out")
    context = f"sbatch: {result.stderr}\njob log:\n{log[-6000:]}\n{slurm_cluster.describe()}"
    assert result.returncode == 0, context
    assert job_id.isdigit(), context
    for rank in (0, 1):
        assert f"rank {rank} of 2 (torchrun, backend gloo)" in log, context
    final = written_in / "run" / "checkpoints" / "step_00000003"
    assert (final / "model.safetensors").is_file() and (final / "meta.json").is_file(), context


def _wait_for_lines(path: Path, needle: str, count: int, while_running: subprocess.Popen, timeout: float) -> None:
    """Block until `needle` shows on `count` lines of the growing file `path`; give up when the
    process `while_running` ends (tail --pid) or after `timeout` seconds."""
    tail = subprocess.Popen(["tail", f"--pid={while_running.pid}", "-F", "-n", "+1", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    watchdog = threading.Timer(timeout, tail.kill)
    watchdog.start()
    seen = 0
    try:
        for line in tail.stdout:
            seen += needle in line
            if seen == count:
                return
    finally:
        watchdog.cancel()
        tail.kill()
        tail.wait()
    raise AssertionError(f"{needle!r} not seen {count} times within {timeout} s:\n{_read(path)[-6000:]}")


@pytest.mark.slow  # 40 s of a live Slurm job: the default run keeps under CI's 15 minutes
def test_usr1_to_the_batch_script_saves_requeues_and_the_job_resumes(slurm_cluster, tmp_path, shapes_dir,
                                                                      autoencoder_run):
    """What Slurm does at `--signal=B:USR1@90` before the time limit, sent at once with scancel."""
    run, script, steps = tmp_path / "run", tmp_path / "job.sbatch", 30
    _write_job(script, run, shapes_dir, autoencoder_run, steps=steps)
    sbatch = subprocess.Popen(["sbatch", "--wait", "--parsable", str(script)], cwd=tmp_path,
                              env=_job_env(slurm_cluster), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        job_id = sbatch.stdout.readline().strip().split(";")[0]  # printed on submission, before the wait
        if not job_id.isdigit():
            pytest.fail(f"sbatch did not submit the job: {sbatch.communicate(timeout=60)[1]}")
        log_file = tmp_path / f"sdtrain-{job_id}.out"
        # Each rank logs the start of its training loop after it has set its signal handlers.
        _wait_for_lines(log_file, "diffusion stage", count=2, while_running=sbatch, timeout=300)
        sent = slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job_id])
        assert sent.returncode == 0, sent.stderr
        _, err = sbatch.communicate(timeout=600)
    finally:
        if sbatch.poll() is None:
            sbatch.kill()
            sbatch.communicate()
    log = _read(log_file)
    context = f"sbatch: {err}\njob log:\n{log[-8000:]}\n{slurm_cluster.describe()}"
    assert sbatch.returncode == 0, context
    assert "time limit near: asking sdtrain to save and stop" in log, context
    assert log.count("stopped by a signal at step") == 2, context  # both ranks saved together
    assert f"saved; requeueing job {job_id} to resume" in log, context
    assert log.count("resumed from") == 2, context
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(saved) == 2 and saved[-1] == f"step_{steps:08d}", (saved, context)
