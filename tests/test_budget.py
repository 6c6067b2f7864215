"""train.max_minutes: a run's steps planned from its own pace, its schedule decaying to the planned end, and a resume
that keeps the plan its checkpoint recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from .conftest import same_checkpoints, train

STEP_S = 0.5


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_a_fixed_plan_gives_diffusers_learning_rates_exactly(schedule):
    from diffusers.optimization import get_scheduler

    from sdtrain.config import OptimConfig
    from sdtrain.train.budget import StepPlan
    from sdtrain.train.optim import build_lr_schedule

    def rates(make) -> list[float]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
        lr_schedule = make(optimizer)
        out = []
        for _ in range(60):
            optimizer.step()
            lr_schedule.step()
            out.append(lr_schedule.get_last_lr()[0])
        return out

    config = OptimConfig(lr=3e-3, warmup_steps=7, schedule=schedule)
    name = "cosine" if schedule == "cosine" else "constant_with_warmup"
    ours = rates(lambda o: build_lr_schedule(o, config, StepPlan(50, 50)))
    theirs = rates(lambda o: get_scheduler(name, o, num_warmup_steps=7, num_training_steps=50))
    assert ours == theirs  # bit for bit: runs without a budget train as before


def _virtual_steps(monkeypatch, seconds_a_step: float) -> None:
    """Each training step takes `seconds_a_step` on the plan's clock, whatever the machine does."""
    from sdtrain.train import budget
    from sdtrain.train.trainer import Trainer

    now = [0.0]
    monkeypatch.setattr(budget, "clock", lambda: now[0])
    step = Trainer.train_step

    def timed_step(self):
        now[0] += seconds_a_step
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", timed_step)


def _budgeted(run: Path, shapes_dir: Path) -> list[str]:
    # 6 s at 0.5 s a step: 12 steps, far under max_steps.
    return [f"data.shards={shapes_dir}", "train.max_steps=1000", "train.max_minutes=0.1", "checkpoint.every=4",
            "logging.every=2", "optim.warmup_steps=2", "optim.schedule=cosine"]


def _logged(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_budgeted_run_plans_its_steps_from_its_pace_and_its_schedule_ends_at_the_last(tmp_path, shapes_dir,
                                                                                          monkeypatch):
    from sdtrain.checkpoint import latest_checkpoint

    _virtual_steps(monkeypatch, STEP_S)
    run = tmp_path / "ae"
    train("autoencoder.yaml", run, *_budgeted(run, shapes_dir))
    assert latest_checkpoint(run).name == "step_00000012"
    steps = [row for row in _logged(run) if "lr" in row]
    assert steps[-1]["step"] == 12
    assert steps[-1]["lr"] == 0.0  # the cosine reached zero at the planned end, not at train.max_steps
    assert 0 < steps[-2]["lr"] < steps[-3]["lr"]


def test_a_resumed_budgeted_run_trains_to_the_plan_its_checkpoint_recorded(tmp_path, shapes_dir, monkeypatch):
    import shutil

    _virtual_steps(monkeypatch, STEP_S)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train("autoencoder.yaml", straight, *_budgeted(straight, shapes_dir))
    train("autoencoder.yaml", resumed, *_budgeted(resumed, shapes_dir))
    # Step 8's checkpoint holds the plan made at step 6 (the first logging point after FIRST_PLAN_STEPS).
    shutil.rmtree(resumed / "checkpoints" / "step_00000012")
    # Four times slower now: a fresh plan would stop sooner, the recorded one stands.
    _virtual_steps(monkeypatch, 4 * STEP_S)
    train("autoencoder.yaml", resumed, *_budgeted(resumed, shapes_dir))
    same_checkpoints(straight / "checkpoints" / "step_00000012", resumed / "checkpoints" / "step_00000012")


def test_a_busier_machine_plans_fewer_steps_and_an_idler_one_more_up_to_max_steps(monkeypatch):
    from sdtrain.train import budget
    from sdtrain.train.budget import StepPlan

    now = [0.0]
    monkeypatch.setattr(budget, "clock", lambda: now[0])
    plan = StepPlan(total=100, most=150, seconds=60.0)
    plan.start(0)
    now[0] = 10.0
    plan.replan(20)  # 0.5 s a step, 50 s left
    assert plan.total == 120
    now[0] = 40.0
    plan.replan(40)  # slowed down: 1 s a step over the run so far, 20 s left
    assert plan.total == 60
    now[0] = 44.0
    plan.replan(80)  # much faster: 0.55 s a step, 16 s left; capped at max_steps
    assert plan.total == 80 + 29
    now[0] = 70.0
    plan.replan(110)  # over time: stop now
    assert plan.total == 110
