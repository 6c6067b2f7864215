"""Scale-out on CPU with gloo: torchrun DDP against one process, launcher detection, preemption."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sdtrain.checkpoint import read_weights
from sdtrain.cli.main import main
from sdtrain.distributed import detect_topology, first_slurm_host

from .conftest import TINY, config_path


def _overrides(run: Path, shapes_dir: Path, autoencoder_run: Path, *extra: str) -> list[str]:
    return [f"run_dir={run}", f"data.shards={shapes_dir}", f"model.vae={autoencoder_run}", *TINY,
            "validation.prompts=[]", "train.max_steps=3", "checkpoint.every=0", "data.caption_dropout=0.2", *extra]


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
# SD's parity covers the wrapping, sharding and checkpoint paths every family shares; the other families' (each a
# denoiser under the same wrappers) run with the slow tests, which keeps the default suite within 15 minutes.
@pytest.mark.parametrize("family", ["sd", *(pytest.param(f, marks=pytest.mark.slow) for f in ("flux", "sdxl", "sd3"))])
def test_torchrun_ddp_and_fsdp_match_one_process_at_the_same_global_batch(tmp_path, shapes_dir,
                                                                          autoencoder_run, family):
    single = tmp_path / "single"
    config = str(config_path("diffusion.yaml"))
    # One process, two micro-batches per step, with the ranks' data.num_workers: the same samples whatever the
    # number of ranks and workers.
    assert main(["train", config, *_overrides(single, shapes_dir, autoencoder_run, "data.num_workers=0",
                                              "train.grad_accum=2", "logging.every=1", f"model.family={family}")]) == 0
    expected = load_file(str(single / "checkpoints" / "step_00000003" / "model.safetensors"))
    for strategy in ("ddp", "fsdp"):
        run = tmp_path / strategy
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   "-m", "sdtrain", "train", config,
                   *_overrides(run, shapes_dir, autoencoder_run, "data.num_workers=0", "logging.every=1",
                               f"parallel.strategy={strategy}", f"model.family={family}")]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        assert _losses(single) == pytest.approx(_losses(run), rel=1e-4), strategy
        # DDP writes full tensors; FSDP has each rank write its own shards, read back whole in one process.
        checkpoint = run / "checkpoints" / "step_00000003"
        assert (checkpoint / "sharded").is_dir() == (strategy == "fsdp")
        got = read_weights(checkpoint, "model")
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5, msg=f"{strategy} {key}")
    from sdtrain.export import export_run

    denoiser = "transformer" if family in ("flux", "sd3") else "unet"
    assert (export_run(tmp_path / "fsdp", tmp_path / "pipe") / denoiser).is_dir()


@pytest.mark.slow
def test_sigterm_saves_stops_and_the_rerun_ends_equal_to_an_uninterrupted_run(tmp_path, shapes_dir,
                                                                              autoencoder_run):
    config = str(config_path("diffusion.yaml"))
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    steps = ["train.max_steps=40", "data.num_workers=2"]
    assert main(["train", config, *_overrides(straight, shapes_dir, autoencoder_run, *steps)]) == 0
    command = [sys.executable, "-m", "sdtrain", "train", config,
               *_overrides(stopped, shapes_dir, autoencoder_run, *steps)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               env={**os.environ, "OMP_NUM_THREADS": "2"})
    for line in process.stderr:  # the first log line of the training loop
        if "diffusion stage" in line:
            # As launchers do: the whole process group, loader workers included, and twice, as a rank
            # under torchrun in a Slurm step hears it (from Slurm and again from torchrun).
            os.killpg(process.pid, signal.SIGTERM)
            os.killpg(process.pid, signal.SIGTERM)
            break
    err = process.stderr.read()
    assert process.wait(timeout=300) == 75, err
    assert "run the same command to resume" in err
    saved = sorted((stopped / "checkpoints").iterdir())
    assert len(saved) == 1 and saved[0].name != "step_00000040"
    assert main(["train", config, *_overrides(stopped, shapes_dir, autoencoder_run, *steps)]) == 0
    a = load_file(str(straight / "checkpoints" / "step_00000040" / "model.safetensors"))
    b = load_file(str(stopped / "checkpoints" / "step_00000040" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.dist
def test_torchrun_ddp_trains_the_autoencoder(tmp_path, shapes_dir):
    run = tmp_path / "ae"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "sdtrain", "train", str(config_path("autoencoder.yaml")), f"run_dir={run}",
               f"data.shards={shapes_dir}", *TINY, "train.max_steps=2"]
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run / "checkpoints" / "step_00000002" / "meta.json").is_file()


def _torchrun(run: Path, shapes_dir: Path, autoencoder_run: Path, *extra: str, torchrun_args: tuple[str, ...] = (),
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               *torchrun_args, "-m", "sdtrain", "train", str(config_path("diffusion.yaml")),
               *_overrides(run, shapes_dir, autoencoder_run, *extra)]
    # Its own session, so a hung job is killed with every rank, not just torchrun.
    process = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, out, err)


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_restarts_a_killed_worker_from_the_last_checkpoint(tmp_path, shapes_dir, autoencoder_run):
    steps = ("train.max_steps=4", "checkpoint.every=2", "checkpoint.keep_last=5")
    straight = _torchrun(tmp_path / "straight", shapes_dir, autoencoder_run, *steps)
    assert straight.returncode == 0, straight.stderr[-3000:]
    # Rank 1 dies without warning after step 3, past the step-2 checkpoint, as a lost node would.
    killed = _torchrun(tmp_path / "killed", shapes_dir, autoencoder_run, *steps, torchrun_args=("--max-restarts", "1"),
                       env={"SDTRAIN_KILL_AT_STEP": "3:1"})
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "SDTRAIN_KILL_AT_STEP: killing this process after step 3" in killed.stderr
    assert "resumed from" in killed.stderr
    names = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir())
    assert names == ["step_00000002", "step_00000004"]
    a = load_file(str(tmp_path / "straight" / "checkpoints" / "step_00000004" / "model.safetensors"))
    b = load_file(str(tmp_path / "killed" / "checkpoints" / "step_00000004" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # the restart repeated step 3 exactly


@pytest.mark.slow
@pytest.mark.dist
def test_sharded_checkpoints_resume_exactly_on_the_same_ranks_and_reshard_onto_one_process(
        tmp_path, shapes_dir, autoencoder_run, caplog):
    steps = ("parallel.strategy=fsdp", "train.max_steps=4", "checkpoint.every=2", "checkpoint.keep_last=5",
             "data.caption_dropout=0")
    straight = _torchrun(tmp_path / "straight", shapes_dir, autoencoder_run, *steps)
    assert straight.returncode == 0, straight.stderr[-3000:]
    end = tmp_path / "straight" / "checkpoints" / "step_00000004"
    # Every rank wrote its own part; no rank gathered the model.
    assert sorted(p.name for p in (end / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (end / "model.safetensors").exists()
    meta = json.loads((end / "meta.json").read_text())
    assert meta["format"] == "sharded" and "sharded/__1_0.distcp" in meta["files"]
    killed = _torchrun(tmp_path / "killed", shapes_dir, autoencoder_run, *steps, torchrun_args=("--max-restarts", "1"),
                       env={"SDTRAIN_KILL_AT_STEP": "3:1"})
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "resumed from" in killed.stderr
    # Written in the background (on a second gloo group) while the next steps run: the same checkpoints.
    background = _torchrun(tmp_path / "async", shapes_dir, autoencoder_run, *steps, "checkpoint.async_save=true")
    assert background.returncode == 0, background.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "async" / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    for again in (tmp_path / "killed" / "checkpoints" / "step_00000004",
                  tmp_path / "async" / "checkpoints" / "step_00000004"):
        for group in ("model", "ema"):
            a, b = read_weights(end, group), read_weights(again, group)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (again, group)

    # The two-rank shards load into one process (two micro-batches per step: the same global batch).
    run = tmp_path / "straight"
    caplog.set_level("INFO", logger="sdtrain")
    assert main(["train", str(config_path("diffusion.yaml")),
                 *_overrides(run, shapes_dir, autoencoder_run, "train.max_steps=6", "train.grad_accum=2",
                             "data.caption_dropout=0", "checkpoint.every=2", "checkpoint.format=sharded")]) == 0
    assert f"resumed from {end} at step 4" in caplog.text
    assert main(["export", str(run), "--out", str(tmp_path / "pipe")]) == 0
    exported = load_file(str(tmp_path / "pipe" / "unet" / "diffusion_pytorch_model.safetensors"))
    ema = read_weights(run / "checkpoints" / "step_00000006", "ema")
    assert all(torch.equal(exported[k.removeprefix("unet.")], v) for k, v in ema.items() if k.startswith("unet."))


@pytest.mark.slow
@pytest.mark.dist
def test_a_stalled_rank_fails_the_job_within_the_timeout_naming_it_and_the_rerun_resumes(
        tmp_path, shapes_dir, autoencoder_run):
    run = tmp_path / "run"
    steps = ("train.max_steps=4", "checkpoint.every=2", "parallel.timeout_minutes=0.1")
    # Rank 1 stops responding at the end of step 3, past the step-2 checkpoint: rank 0 waits in the
    # step's last collective until the 6 s timeout, then names it.
    stalled = _torchrun(run, shapes_dir, autoencoder_run, *steps, env={"SDTRAIN_STALL_AT_STEP": "3:1"})
    assert stalled.returncode != 0, stalled.stderr[-3000:]
    errors = [line for line in stalled.stderr.splitlines() if line.startswith("sdtrain train: error: rank 0")]
    assert errors, stalled.stderr[-3000:]
    assert "rank 1 stopped while it was in step 3; rank 0 finished step 3" in errors[0], errors[0]
    assert "parallel.timeout_minutes=0.1" in errors[0], errors[0]
    rerun = _torchrun(run, shapes_dir, autoencoder_run, *steps)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resumed from" in rerun.stderr and (run / "checkpoints" / "step_00000004").is_dir()


@pytest.mark.dist
def test_a_two_rank_run_resumes_on_one_process(tmp_path, shapes_dir, autoencoder_run, caplog):
    run = tmp_path / "run"
    first = _torchrun(run, shapes_dir, autoencoder_run, "train.max_steps=2", "data.caption_dropout=0")
    assert first.returncode == 0, first.stderr[-3000:]
    # One process, two micro-batches per step: the same global batch as two ranks.
    assert main(["train", str(config_path("diffusion.yaml")),
                 *_overrides(run, shapes_dir, autoencoder_run, "train.max_steps=4", "train.grad_accum=2",
                             "data.caption_dropout=0")]) == 0
    assert "resuming a run of 2 ranks on 1" in caplog.text
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4] and records[-1]["samples"] == 4 * 2 * 4
    state = torch.load(run / "checkpoints" / "step_00000004" / "trainer.pt", weights_only=True)
    assert len(state["ranks"]) == 1


def test_launcher_environments_are_recognised():
    torchrun = detect_topology({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n0",
                                "MASTER_PORT": "1234"})
    assert (torchrun.rank, torchrun.world_size, torchrun.local_rank, torchrun.launcher) == (3, 8, 1, "torchrun")
    slurm = detect_topology({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                             "SLURM_JOB_NODELIST": "gpu[007-010,012]", "SLURM_JOB_ID": "42"})
    assert (slurm.rank, slurm.world_size, slurm.local_rank, slurm.master_addr) == (5, 16, 1, "gpu007")
    assert slurm.master_port == 20042
    mpi = detect_topology({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3",
                           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.1"})
    assert (mpi.rank, mpi.world_size, mpi.master_addr, mpi.launcher) == (2, 3, "10.0.0.1", "mpi")
    hydra = detect_topology({"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0"})
    assert (hydra.rank, hydra.world_size) == (1, 3)
    # The processes sharing one machine's memory, for the memory estimate, under every launcher.
    assert detect_topology({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}).local_world_size == 4
    assert detect_topology({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_TASKS_PER_NODE": "4(x4)"}
                           ).local_world_size == 4
    assert detect_topology({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "6",
                            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}).local_world_size == 2
    assert not detect_topology({}).distributed
    # A one-task Slurm allocation running torchrun inside is torchrun's, not Slurm's.
    assert detect_topology({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).launcher == "single"


@pytest.mark.parametrize("nodelist, first", [("node1", "node1"), ("a[01-04]", "a01"), ("x[3,5-7],y2", "x3"),
                                             ("cpu-2,cpu-3", "cpu-2")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


@pytest.mark.dist
def test_a_ddp_step_runs_one_collective_of_its_own(tmp_path, shapes_dir):
    """The step's non-finite check and the loop's stop signal travel in one all-reduce (one device sync): each
    collective a step costs every rank a round trip, which at many ranks is most of a small model's step."""
    run, counts = tmp_path / "ae", tmp_path / "counts"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "tests.collectives", str(counts), "train", str(config_path("autoencoder.yaml")),
               f"run_dir={run}", f"data.shards={shapes_dir}", *TINY, "train.max_steps=4", "checkpoint.every=0",
               "logging.every=100"]
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        steps = json.loads((counts / f"rank{rank}.json").read_text())
        assert steps == [["all_reduce"]] * 3  # the steps before the last, whose window holds the run's end
