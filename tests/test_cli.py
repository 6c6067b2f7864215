"""The CLI end to end at the tiny size, as a new user would run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sdtrain.cli.main import main

from .conftest import TINY, config_path


def sdtrain(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "sdtrain", *args], capture_output=True, text=True, env=env)


def test_prepare_train_export_generate(tmp_path):
    data, ae, sd = tmp_path / "data", tmp_path / "ae", tmp_path / "sd"
    # The entry point itself, in its own process; the heavier stages run in-process to keep CI fast.
    result = sdtrain("prepare", "shapes", "--out", str(data), "--num", "24", "--size", "32", "--seed", "1")
    assert result.returncode == 0, result.stderr
    assert (data / "manifest.json").is_file()
    assert main(["train", str(config_path("autoencoder.yaml")), f"run_dir={ae}", f"data.shards={data}",
                 *TINY, "train.max_steps=2"]) == 0
    assert main(["train", str(config_path("diffusion.yaml")), f"run_dir={sd}", f"data.shards={data}",
                 f"model.vae={ae}", *TINY, "train.max_steps=2", "validation.prompts=[]"]) == 0
    assert main(["export", str(sd), "--out", str(tmp_path / "pipe")]) == 0
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na green triangle\n")
    for model in (tmp_path / "pipe", sd):
        out = tmp_path / f"samples-{model.name}"
        assert main(["generate", "--model", str(model), "--prompts", str(prompts), "--steps", "2",
                     "--scheduler", "dpmpp", "--out", str(out)]) == 0
        assert sorted(p.name for p in out.iterdir()) == ["000-a-red-circle.png", "001-a-green-triangle.png", "grid.png"]


def test_user_errors_are_one_line_without_traceback(tmp_path):
    result = sdtrain("train", str(config_path("diffusion.yaml")), f"run_dir={tmp_path}", "data.shards=/nonexistent/x")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("sdtrain train: error:") and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_generate_names_a_missing_model_folder(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "a red circle"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sdtrain generate: error:") and "missing" in err and len(err.splitlines()) == 1


def test_demo_runs_end_to_end_at_a_few_steps(tmp_path):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--num", "32", "--autoencoder-steps", "2", "--diffusion-steps", "2",
                 "--adherence-prompts", "4", "--adherence-pairs", "2", "--sample-steps", "2"]) == 0
    scores = json.loads((out / "adherence.json").read_text())["adherence"]
    assert (scores["num_single"], scores["num_double"]) == (2, 2)
    assert (out / "samples.png").is_file()
    assert (out / "pipeline" / "model_index.json").is_file()
    assert (out / "diffusion" / "checkpoints" / "step_00000002").is_dir()


def test_overrides_may_follow_options(capsys):
    import pytest

    assert main(["params", str(config_path("diffusion.yaml")), "--json", "model.preset=small"]) == 0
    small = {r["name"]: r["parameters"] for r in json.loads(capsys.readouterr().out)}
    assert main(["params", str(config_path("diffusion.yaml")), "--json"]) == 0
    tiny = {r["name"]: r["parameters"] for r in json.loads(capsys.readouterr().out)}
    assert small["unet"] > tiny["unet"]  # the override after --json was applied
    with pytest.raises(SystemExit):
        main(["params", str(config_path("diffusion.yaml")), "--bogus"])


# Slow: the demo itself runs by default (above) and the budget's arithmetic below; this runs the demo twice.
@pytest.mark.slow
def test_the_demo_on_a_time_budget_records_its_budgets_and_a_rerun_keeps_them(tmp_path, monkeypatch, capsys):
    """`demo --minutes M` times each stage's step, gives the autoencoder its share of what is left of M and the
    diffusion stage what is left when it starts, each as train.max_minutes (steps planned as it trains, at most
    MOST times the config's) with a warmup of at most a tenth of the steps expected; the runs' config.yaml records
    them, where a rerun finds them: it does not time again, and passes the same budgets."""
    import pytest
    from omegaconf import OmegaConf

    from sdtrain.cli import demo_budget
    from sdtrain.cli.demo import config_path as demo_budget_config

    timed = []

    def step_seconds(config, overrides, encoded):
        timed.append(config.name)
        # Slow steps, so a budget of seconds expects a few steps of each stage.
        return (1.0, 16) if config.name == "autoencoder.yaml" else (1.5, 64)

    monkeypatch.setattr(demo_budget, "_timed_step", step_seconds)
    monkeypatch.setattr(demo_budget, "STARTUP_S", 0.0)
    monkeypatch.setattr(demo_budget, "LEAST_STEPS", 2)
    # Two steps of the autoencoder (of its config's 1,200), the diffusion stage in proportion, however fast they run.
    monkeypatch.setattr(demo_budget, "MOST", 2 / 1200)
    diffusion_most = round(OmegaConf.load(demo_budget_config("diffusion.yaml")).train.max_steps * 2 / 1200)
    out = tmp_path / "demo"
    argv = ["demo", "--out", str(out), "--num", "32", "--minutes", "0.3", "--adherence-prompts", "4",
            "--adherence-pairs", "2", "--sample-steps", "2"]
    assert main(argv) == 0
    assert timed == ["autoencoder.yaml", "diffusion.yaml"]
    printed = capsys.readouterr().out
    assert "min left for the diffusion stage's training" in printed
    overrides = {}
    for stage, most in (("autoencoder", 2), ("diffusion", diffusion_most)):
        config = OmegaConf.load(out / stage / "config.yaml")
        assert config.train.max_steps == most and 0 < config.train.max_minutes < 0.3
        assert config.optim.warmup_steps <= 50
        assert (out / stage / "checkpoints" / f"step_{most:08d}").is_dir()
        overrides[stage] = demo_budget.recorded(out / stage)
        assert f"train.max_minutes={config.train.max_minutes}" in overrides[stage]

    # A rerun plans from what the runs recorded, without timing again (the runs then resume to their plans).
    monkeypatch.setattr(demo_budget, "_timed_step", lambda *a: pytest.fail("a rerun timed the steps again"))
    from sdtrain.cli.demo import config_path
    from sdtrain.cli.main import build_parser

    args = build_parser().parse_args(argv)
    budget = demo_budget.plan_budget(args, 0.0, out / "data", (out / "autoencoder", out / "diffusion"),
                                     (config_path("autoencoder.yaml"), config_path("diffusion.yaml")), [])
    assert (budget.autoencoder, budget.diffusion()) == (overrides["autoencoder"], overrides["diffusion"])


def test_the_budget_scales_every_stage_by_one_factor_at_most_one_and_a_half():
    from sdtrain.cli.demo_budget import MOST, fit

    stages = {"autoencoder": (1200, 0.1), "diffusion": (2000, 0.3)}  # 120 s + 600 s at the configs' steps
    assert fit(360.0, stages) == 0.5
    assert fit(10_000.0, stages) == MOST
