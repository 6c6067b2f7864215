"""`sdtrain demo --minutes M`: the demo's two training stages sized to finish in time on whatever machine runs it.

Each stage's step is timed first, as `sdtrain benchmark train` times it (the real trainer and loader, a few steps):
the autoencoder on the demo's own images, the diffusion stage on latents of the demo autoencoder's shape. Those
timings split the budget: what the commands after training cost (the images the demo draws, each command's
start-up) is set aside, and the autoencoder gets its share of the rest as the configs' step counts weigh it. Each
stage then trains on a time budget (`train.max_minutes`), its steps planned from its own pace as it runs (a timing
taken before a run can be a third off when the machine's load changes), at most 1.5 times the config's steps; the
diffusion stage's minutes are what is left when it starts. The runs' config.yaml records the budgets and their
checkpoints the planned steps, so a rerun passes the same budgets and the resumed runs keep the planned schedules.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MOST = 1.5
"""The largest multiple of a config's steps a fast machine gets: past it the demo gains little for its wait."""
LEAST_STEPS = 20
STARTUP_S = 8.0
"""What each of the demo's commands costs before its first step (imports, building models), measured on the demo."""
COMMANDS = 7
AFTER_TRAINING = 5
"""Commands from the diffusion stage's on (it, export, generate, evaluate, report): their start-ups come after the
stages before training, and are all the diffusion stage's budget must leave besides the images drawn."""
IN_RUN = 1.12
"""How much longer a step takes in the run than when timed alone (its checkpoints, previews and loader's epochs):
the demo's diffusion stage, timed at 0.382 s a step, trained at about 0.43."""
SAMPLING_COST = 0.6
"""Seconds of one sampling step of one image, as a fraction of one training step's seconds per image: a forward
pass with and without the caption (classifier-free guidance) against a forward and a backward of one, in batches of
18 against the training's 16 (the adherence score's 4,860 image steps took 0.63 of the timed training step's
seconds per image on an idle 2-core EPYC, 0.44 with a busy loop on one core)."""


def recorded(run: Path) -> list[str] | None:
    """The budget overrides a run's first start recorded in its config.yaml, if it started: a rerun passes the
    same ones, so the run resumes to the steps its checkpoint planned."""
    saved = run / "config.yaml"
    if not saved.is_file():
        return None
    from omegaconf import OmegaConf

    config = OmegaConf.load(saved)
    return [f"train.max_steps={config.train.max_steps}", f"train.max_minutes={config.train.max_minutes}",
            f"optim.warmup_steps={config.optim.warmup_steps}"]


def stage_overrides(configured_steps: int, minutes: float, expected_steps: int) -> list[str]:
    """A stage given `minutes` of training: at most MOST times its `configured_steps`, its warmup (the configs'
    50) at most a tenth of the `expected_steps`, so a short stage still decays."""
    return [f"train.max_steps={round(configured_steps * MOST)}", f"train.max_minutes={max(minutes, 0.01):.3f}",
            f"optim.warmup_steps={warmup_steps(max(expected_steps, LEAST_STEPS))}"]


def warmup_steps(steps: int) -> int:
    """A stage's warmup for about `steps` steps: the configs' 50, at most a tenth of them, so a short stage still
    decays."""
    return min(50, steps // 10)


def _timed_step(config: Path, overrides: list[str], encoded: bool) -> tuple[float, int]:
    """Seconds of one steady training step of this config, and its batch size."""
    from sdtrain.benchmark import benchmark_overrides, run_benchmark
    from sdtrain.config import load_config

    with tempfile.TemporaryDirectory(prefix="sdtrain-demo-timing-") as scratch:
        settings = load_config(config, benchmark_overrides(config, [*overrides, "checkpoint.every=0"], scratch))
        result = run_benchmark(settings, steps=6, warmup=2, encoded=encoded, peak_seconds=0.1)
    return result["step_ms"] / 1000, int(result["batch_size"])


def _demo_vae(ae_config: Path, autoencoder_overrides: list[str], folder: Path) -> Path:
    """An untrained autoencoder of the demo's architecture: what the diffusion stage's latents are shaped by."""
    from sdtrain.config import load_config
    from sdtrain.models import build

    config = load_config(ae_config, ["run_dir=unused", "data.shards=unused", *autoencoder_overrides])
    build.build_vae(config.model).save_pretrained(folder)
    return folder


@dataclass
class DemoBudget:
    """The two training stages' budget overrides: the autoencoder's, and the diffusion stage's as what is left when
    it starts (so that it absorbs whatever the stages before it took beyond their plan)."""

    autoencoder: list[str]
    deadline: float
    after_training: float
    """Seconds the demo needs after the diffusion stage's training: its start-up and the commands after it."""
    diffusion_default: int
    diffusion_step_s: float
    recorded_diffusion: list[str] | None

    def diffusion(self) -> list[str]:
        if self.recorded_diffusion is not None:
            return self.recorded_diffusion
        minutes = (self.deadline - time.perf_counter() - self.after_training) / 60
        steps = round(60 * minutes / self.diffusion_step_s)
        print(f"{minutes:.1f} min left for the diffusion stage's training (about {steps} steps at "
              f"{self.diffusion_step_s:.3f} s each, re-planned as it trains)", flush=True)
        return stage_overrides(self.diffusion_default, minutes, steps)


def plan_budget(args: argparse.Namespace, deadline: float, data: Path, runs: tuple[Path, Path],
                configs: tuple[Path, Path], autoencoder_overrides: list[str]) -> DemoBudget:
    """The budgets of the autoencoder's and the diffusion stage's `runs` (of their `configs`), sized to end by
    `deadline` (time.perf_counter()); those of stages that started, as they recorded them.
    `autoencoder_overrides`: the demo's settings of the autoencoder's model (its family)."""
    from omegaconf import OmegaConf

    (ae_run, sd_run), (ae_config, sd_config) = runs, configs
    ae_default = int(OmegaConf.load(ae_config).train.max_steps)
    sd_settings = OmegaConf.load(sd_config)
    sd_default = int(sd_settings.train.max_steps)
    recorded_ae, recorded_sd = recorded(ae_run), recorded(sd_run)
    if recorded_ae is not None and recorded_sd is not None:
        return DemoBudget(recorded_ae, deadline, 0.0, sd_default, 1.0, recorded_sd)
    print("\n== timing the training steps, to fit the demo in its minutes", flush=True)
    ae_s, _ = _timed_step(ae_config, [f"data.shards={data}", *autoencoder_overrides], encoded=False)
    with tempfile.TemporaryDirectory(prefix="sdtrain-demo-vae-") as scratch:
        vae = _demo_vae(ae_config, autoencoder_overrides, Path(scratch) / "vae")
        sd_s, batch = _timed_step(sd_config, [f"model.components.vae.source={vae}"], encoded=True)
    ae_s, sd_s = IN_RUN * ae_s, IN_RUN * sd_s
    # What the demo draws besides training, each image costing `sample_steps` sampling steps.
    image_s = args.sample_steps * SAMPLING_COST * sd_s / batch
    evaluation = OmegaConf.select(sd_settings, "evaluation", default={}) or {}
    every = int(evaluation.get("every_samples", 0) or 0)
    checkpoint_every = int(OmegaConf.select(sd_settings, "checkpoint.every", default=0) or 0)
    prompts = len(OmegaConf.select(sd_settings, "validation.prompts", default=[]) or [])
    # Per diffusion step: its share of the in-loop evaluations and of the validation grids at each checkpoint.
    per_sd_step = sd_s + (batch / every * int(evaluation.get("num", 0)) if every else 0) * image_s \
        + (prompts / checkpoint_every if checkpoint_every else 0) * image_s
    after_training = AFTER_TRAINING * STARTUP_S + (args.adherence_prompts + len(_grid_prompts())) * image_s
    left = max(deadline - time.perf_counter() - (COMMANDS - AFTER_TRAINING) * STARTUP_S - after_training, 0.0)
    scale = fit(left, {"autoencoder": (ae_default, ae_s), "diffusion": (sd_default, per_sd_step)})
    ae_steps = max(LEAST_STEPS, round(ae_default * scale))
    print(f"{left / 60:.1f} min for training: autoencoder {scale * ae_default * ae_s:.0f} s (about {ae_steps} "
          f"steps at {ae_s:.3f} s each), diffusion what is left when it starts (about "
          f"{round(sd_default * scale)} steps at {sd_s:.3f} s each; {scale:.2f} x the configs' {ae_default} and "
          f"{sd_default})", flush=True)
    autoencoder = recorded_ae or stage_overrides(ae_default, scale * ae_default * ae_s / 60, ae_steps)
    return DemoBudget(autoencoder, deadline, after_training, sd_default, per_sd_step, recorded_sd)


def fit(seconds: float, stages: dict[str, tuple[int, float]]) -> float:
    """The one factor that scales every stage's (configured steps, seconds per step) to take `seconds` in all, at
    most MOST."""
    return min(MOST, seconds / sum(steps * step_s for steps, step_s in stages.values()))


def _grid_prompts() -> list[Any]:
    from sdtrain.data.shapes import caption_prompts

    return list(caption_prompts())
