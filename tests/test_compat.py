"""Runs written by the previous release (before model families) still resume, export and generate with this
one: the redesign must keep every user's run folders working. The runs are a committed fixture
(tests/fixtures/previous-release/README.md says how they were made)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sdtrain.checkpoint import latest_checkpoint
from sdtrain.cli.main import main

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "previous-release"
MADE_AT = "/tmp/sdtrain-compat-fixture"
# The files that name the folder the runs were made in: each run's config, and the pinned sources.
PATHS_IN = ["autoencoder/config.yaml", "diffusion/config.yaml", "diffusion/checkpoints/step_00000002/meta.json"]


@pytest.fixture
def old_runs(tmp_path: Path) -> Path:
    runs = Path(shutil.copytree(FIXTURE, tmp_path / "old"))
    for name in PATHS_IN:
        path = runs / name
        path.write_text(path.read_text().replace(MADE_AT, str(runs)))
    return runs


@pytest.mark.parametrize("stage", ["autoencoder", "diffusion"])
def test_a_run_of_the_previous_release_resumes(old_runs, stage):
    run = old_runs / stage
    assert main(["train", str(run / "config.yaml"), "train.max_steps=4"]) == 0
    assert latest_checkpoint(run).name == "step_00000004"


def test_a_run_of_the_previous_release_exports_and_generates(old_runs, tmp_path):
    from diffusers import StableDiffusionPipeline

    pipeline = tmp_path / "pipeline"
    assert main(["export", str(old_runs / "diffusion"), "--out", str(pipeline)]) == 0
    assert isinstance(StableDiffusionPipeline.from_pretrained(pipeline), StableDiffusionPipeline)
    out = tmp_path / "images"
    assert main(["generate", "--model", str(pipeline), "--prompt", "a red circle", "--steps", "2",
                 "--out", str(out)]) == 0
    assert any(out.glob("*.png"))
    # Straight from the run folder, too.
    assert main(["generate", "--model", str(old_runs / "diffusion"), "--prompt", "a red circle", "--steps", "2",
                 "--out", str(tmp_path / "from-run")]) == 0
