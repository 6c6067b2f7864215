"""Fine-tuning modes over several processes on CPU: textual inversion under Open MPI's mpirun from the job
file `sdtrain launch mpi` writes, and LoRA and textual inversion under torchrun (gloo) against one process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from sdtrain.checkpoint import read_weights
from sdtrain.cli.main import main
from sdtrain.export import export_run
from sdtrain.launch import RDZV_PORT

from .conftest import TINY, config_path
from .test_distributed import _losses
from .test_finetune import TI

CONFIG = config_path("diffusion.yaml")
TIMEOUT = 600


def _overrides(run: Path, base: Path, shapes_dir: Path, mode: str, *extra: str) -> list[str]:
    """A fine-tuning run of the pipeline `base` as tests/test_finetune.py's `finetune` trains it, with one
    checkpoint, at the end."""
    return [f"run_dir={run}", *TINY, f"data.shards={shapes_dir}", f"model.pretrained={base}", "model.vae=null",
            f"mode={mode}", "validation.prompts=[]", "logging.every=1", "checkpoint.every=0", *extra]


def _session_processes(sid: int) -> list[int]:
    """Every live process of a session: mpirun and torchrun start ranks that may leave the launcher's process
    group, never its session."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The fields after the command's closing parenthesis: state ppid pgrp session ...
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def _kill_session(sid: int) -> None:
    for pid in _session_processes(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """Run a launcher in a session of its own; whichever way this ends (a timeout, an interrupted test),
    nothing it started outlives it."""
    process = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        _kill_session(process.pid)
        try:
            out, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process that left the session holds the pipes
            out, err = "", ""
        err += f"\n[test] killed after {TIMEOUT} s"
    finally:
        _kill_session(process.pid)  # ranks a launcher left behind, even when it exited
        if process.poll() is None:
            process.kill()
            process.wait()
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.dist
@pytest.mark.skipif(shutil.which("mpirun") is None,
                    reason="mpirun is not installed (Debian: apt-get install openmpi-bin; .ci/run does it as root)")
def test_textual_inversion_in_bf16_under_mpirun_from_the_launch_job_file(tmp_path, pretrained, shapes_dir):  # noqa: F811
    from diffusers import StableDiffusionPipeline

    version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    if "Open MPI" not in version:
        pytest.skip(f"mpirun is not Open MPI's ({version.splitlines()[:1]}); this test runs Open MPI")
    if not _port_free(RDZV_PORT):
        # The job file sets MASTER_PORT itself; a second rendezvous there could join another job's ranks.
        pytest.skip(f"port {RDZV_PORT}, the job file's rendezvous port, is in use on this machine")
    run, hosts, job = tmp_path / "run", tmp_path / "hosts", tmp_path / "job.sh"
    hosts.write_text("localhost slots=2\n")
    # The run shape of the report: textual inversion in bf16, 2 ranks on one CPU node. bf16 comes after TINY's fp32.
    overrides = _overrides(run, pretrained, shapes_dir, "textual_inversion", "train.mixed_precision=bf16",
                           "train.max_steps=2", *TI)
    assert main(["launch", "mpi", str(CONFIG), *overrides, "--hosts", str(hosts), "--procs-per-node", "2",
                 "--nodes", "1", "--out", str(job)]) == 0
    env = {**os.environ,
           # The job runs `python`: this venv's, as a cluster node's PATH would give its own.
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           # Open MPI refuses to run as root without both (CI containers run as root).
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    result = _run(["bash", str(job)], env, tmp_path)
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    # Recognised as Open MPI's ranks (OMPI_COMM_WORLD_*), not as two single-process runs in one folder.
    assert "rank 1 of 2 (mpi" in result.stderr, result.stderr[-4000:]
    checkpoints = sorted((run / "checkpoints").iterdir())
    assert [c.name for c in checkpoints] == ["step_00000002"]
    # Every step counts both ranks' batches.
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records[-1]["samples"] == 2 * 2 * 4
    meta = json.loads((checkpoints[0] / "meta.json").read_text())
    assert meta["tuning"]["precision"] == "bf16"

    out = tmp_path / "embeds"
    assert main(["export", str(run), str(out)]) == 0
    learned = load_file(str(out / "learned_embeds.safetensors"))
    assert list(learned) == ["<shape>"] and learned["<shape>"].shape[0] == 2
    assert torch.isfinite(learned["<shape>"]).all()
    pipe = StableDiffusionPipeline.from_pretrained(pretrained, local_files_only=True, safety_checker=None)
    vocab = len(pipe.tokenizer)
    pipe.load_textual_inversion(str(out / "learned_embeds.safetensors"))
    assert len(pipe.tokenizer) == vocab + 2
    table = pipe.text_encoder.get_input_embeddings().weight
    torch.testing.assert_close(table[vocab:].detach(), learned["<shape>"], rtol=0, atol=0)


# LoRA at 64 px: at TINY's 32 the UNet's mid block sees one latent pixel, where self-attention's softmax over
# one key is 1 whatever q and k are. The gradients of its to_q/to_k adapters are then rounding noise (~1e-11),
# which AdamW (eps 1e-8) turns into steps of up to lr, different in each summation order: nothing to compare.
LORA = ["lora.rank=2", "optim.lr=0.01", "data.resolution=64"]


@pytest.mark.dist
# Textual inversion over two ranks also runs under mpirun below; its gloo twin runs with the slow tests.
@pytest.mark.parametrize("mode,extra", [("lora", LORA), pytest.param("textual_inversion", TI, marks=pytest.mark.slow)])
def test_two_gloo_ranks_fine_tune_like_one_process_at_the_same_global_batch(tmp_path, pretrained, shapes_dir,  # noqa: F811
                                                                           mode, extra):
    single, ranks = _single_and_two_ranks(tmp_path, pretrained, shapes_dir, mode, extra)
    expected = load_file(str(single / "checkpoints" / "step_00000003" / "model.safetensors"))
    got = load_file(str(ranks / "checkpoints" / "step_00000003" / "model.safetensors"))
    assert got.keys() == expected.keys()
    # Only the mode's own tensors, and trained: equal by accident they would prove nothing.
    assert all(("lora_" in k) if mode == "lora" else k.endswith("token_embedding.added") for k in expected)
    if mode == "lora":
        assert any(".lora_B." in k and v.abs().max() > 0 for k, v in expected.items())
        # The main rank alone wrote the adapter file into the checkpoint, its checksums with it.
        checkpoint = ranks / "checkpoints" / "step_00000003"
        assert "pytorch_lora_weights.safetensors" in json.loads((checkpoint / "meta.json").read_text())["files"]
    else:  # both vectors start as the initializer's; their places in the caption set them apart
        assert all(not torch.equal(v[0], v[1]) for v in expected.values())
    # Not bitwise: DDP sums the two ranks' gradients in gloo's all-reduce, one process sums its two
    # micro-batches in backward, in another order; fp32 rounding differences of ~1e-7 stay that small over a
    # few Adam steps. A data or noise mix-up, or a gradient missing its average, is off by far more.
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=f"{mode} {key}")


def _single_and_two_ranks(tmp_path: Path, base: Path, shapes_dir: Path, mode: str, extra: list[str],
                          *ranks_only: str) -> tuple[Path, Path]:
    """The same fine-tuning run, 3 steps, in one process and over two torchrun ranks (with `ranks_only` too), at
    the same global batch."""
    steps = ["train.max_steps=3", "data.batch_size=2", *extra]
    single = tmp_path / "single"
    # One process, as tests/test_distributed.py compares full training: two micro-batches of 2 per step, the
    # samples and noise streams of two ranks of 2 (data.batch_size=4 in one process would draw other noise: it
    # follows the micro-batch, not the sample).
    assert main(["train", str(CONFIG), *_overrides(single, base, shapes_dir, mode, *steps,
                                                    "train.grad_accum=2")]) == 0
    ranks = tmp_path / "ranks"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "sdtrain", "train", str(CONFIG), *_overrides(ranks, base, shapes_dir, mode, *steps, *ranks_only)]
    result = _run(command, {**os.environ, "OMP_NUM_THREADS": "1"}, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    (ranks / "stderr.txt").write_text(result.stderr)
    assert _losses(ranks) == pytest.approx(_losses(single), rel=1e-5)
    return single, ranks


@pytest.mark.dist
# fp8 stores bits and per-row scales, both sharded as integer parameters; fp32 and bf16 run with the slow tests.
@pytest.mark.parametrize("frozen", ["fp8", *(pytest.param(p, marks=pytest.mark.slow) for p in ("fp32", "bf16"))])
def test_lora_under_fsdp_shards_the_frozen_base_and_trains_like_one_process(tmp_path, pretrained, shapes_dir,  # noqa: F811
                                                                            frozen):
    """A base too large for one device trains adapters over several: FSDP2 shards the frozen base with the adapters
    (stored low too), the checkpoint is sharded, and the adapter files, the validation images (every rank running
    the sharded base, the main one writing) and the export are those of one process."""
    prompts = "validation.prompts=[a red circle]"
    single, ranks = _single_and_two_ranks(tmp_path, pretrained, shapes_dir, "lora",
                                          [*LORA, f"model.frozen_precision={frozen}", prompts],
                                          "parallel.strategy=fsdp")
    log = (ranks / "stderr.txt").read_text()
    assert "FSDP2 shards the unet over 2 ranks" in log, log[-3000:]
    expected_checkpoint = single / "checkpoints" / "step_00000003"
    checkpoint = ranks / "checkpoints" / "step_00000003"
    assert (checkpoint / "sharded").is_dir() and not (checkpoint / "model.safetensors").exists()
    expected, got = read_weights(expected_checkpoint, "model"), read_weights(checkpoint, "model")
    assert got.keys() == expected.keys() and all("lora_" in k for k in expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)
    # The files a user loads, written by the main rank from the gathered adapters.
    for name in ("pytorch_lora_weights.safetensors", "lora_kohya.safetensors"):
        want, have = load_file(str(expected_checkpoint / name)), load_file(str(checkpoint / name))
        assert have.keys() == want.keys(), name
        for key in want:
            torch.testing.assert_close(have[key], want[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
    grid = np.asarray(Image.open(ranks / "samples" / "step_00000003.png"), dtype=np.float32)
    want_grid = np.asarray(Image.open(single / "samples" / "step_00000003.png"), dtype=np.float32)
    assert grid.shape == want_grid.shape and np.abs(grid - want_grid).mean() < 2.0
    assert (export_run(ranks, tmp_path / "export") / "pytorch_lora_weights.safetensors").is_file()
