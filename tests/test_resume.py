"""Exact resume: an interrupted run that resumes in a fresh process ends bitwise equal to a straight run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from sdtrain.cli.main import main

from .conftest import TINY, config_path


def _overrides(run_dir: Path, steps: int, shapes_dir: Path, autoencoder_run: Path, workers: int) -> list[str]:
    return [
        f"run_dir={run_dir}", f"data.shards={shapes_dir}", f"model.vae={autoencoder_run}", *TINY,
        f"data.num_workers={workers}", f"train.max_steps={steps}", "checkpoint.every=3",
        "optim.schedule=constant", "optim.warmup_steps=2", "validation.prompts=[]",
        "data.caption_dropout=0.25", "data.random_flip=true",
    ]


# Both loaders' resume runs with the slow tests: every family's kill -9 resume in the conformance suite, on loader
# workers, holds the default suite's bitwise guarantee (which keeps it within 15 minutes).
@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_resumed_run_is_bitwise_equal_to_a_straight_run(tmp_path, shapes_dir, autoencoder_run, workers):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    config = str(config_path("diffusion.yaml"))
    assert main(["train", config, *_overrides(straight, 7, shapes_dir, autoencoder_run, workers)]) == 0
    assert main(["train", config, *_overrides(resumed, 3, shapes_dir, autoencoder_run, workers)]) == 0
    # The second half in a separate interpreter: nothing may survive in memory between the halves.
    command = [sys.executable, "-m", "sdtrain", "train", config,
               *_overrides(resumed, 7, shapes_dir, autoencoder_run, workers)]
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "2"}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stderr
    for name in ("model.safetensors", "ema.safetensors"):
        a = load_file(str(straight / "checkpoints" / "step_00000007" / name))
        b = load_file(str(resumed / "checkpoints" / "step_00000007" / name))
        assert a.keys() == b.keys()
        different = [k for k in a if not (a[k] == b[k]).all()]
        assert not different, f"{name}: {len(different)} tensors differ, e.g. {different[:3]}"


def test_a_corrupt_checkpoint_without_checksums_is_one_clear_error_naming_it(tmp_path, shapes_dir, capsys):
    import json

    from .conftest import train

    run = tmp_path / "ae"
    train("autoencoder.yaml", run, f"data.shards={shapes_dir}", "train.max_steps=2", "checkpoint.every=1")
    newest = run / "checkpoints" / "step_00000002"
    # As saved before checkpoints recorded checksums (test_reliability covers those): caught when read.
    meta = json.loads((newest / "meta.json").read_text())
    del meta["files"]
    (newest / "meta.json").write_text(json.dumps(meta))
    (newest / "model.safetensors").write_bytes(b"not safetensors")
    code = main(["train", str(config_path("autoencoder.yaml")), f"run_dir={run}", f"data.shards={shapes_dir}",
                 *TINY, "train.max_steps=3"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("sdtrain train: error:") and "step_00000002" in err


def test_an_interrupted_save_leaves_the_previous_checkpoint_newest(tmp_path, shapes_dir):
    from sdtrain.checkpoint import latest_checkpoint

    from .conftest import train

    run = tmp_path / "ae"
    train("autoencoder.yaml", run, f"data.shards={shapes_dir}", "train.max_steps=2", "checkpoint.every=1")
    # What a crash mid-save leaves: a temporary folder without meta.json.
    partial = run / "checkpoints" / ".step_00000003.tmp-999"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(run).name == "step_00000002"
    train("autoencoder.yaml", run, f"data.shards={shapes_dir}", "train.max_steps=3", "checkpoint.every=1")
    assert latest_checkpoint(run).name == "step_00000003"
    assert not partial.exists()  # cleaned up by the restart


def test_a_resume_takes_this_starts_optimizer_settings(tmp_path, shapes_dir):
    import json

    from .conftest import train

    run = tmp_path / "ae"
    train("autoencoder.yaml", run, f"data.shards={shapes_dir}", "train.max_steps=2", "optim.schedule=constant",
          "optim.warmup_steps=0", "logging.every=1")
    train("autoencoder.yaml", run, f"data.shards={shapes_dir}", "train.max_steps=3", "optim.schedule=constant",
          "optim.warmup_steps=0", "logging.every=1", "optim.lr=1e-5")
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3 and last["lr"] == pytest.approx(1e-5)
