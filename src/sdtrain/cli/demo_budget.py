"""`sdtrain demo --minutes M`: the demo's two training stages sized to finish in time on whatever machine runs it.

Each stage's step is timed first, as `sdtrain benchmark train` times it (the real trainer and loader, a few steps):
the autoencoder on the demo's own images, the diffusion stage on latents of the demo autoencoder's shape. What is
left of the budget, after what the other steps cost (encoding, sampling the validation grids, the in-loop and final
adherence scores, exporting), goes to training, the two stages scaled alike from the configs' step counts (at most
1.5 times them, at least 20 steps each). The counts become the runs' `train.max_steps`, so their cosine schedules
span them and their config.yaml records them; a rerun finds them there and keeps them, so a resume repeats the same
schedule exactly.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

MOST = 1.5
"""The largest multiple of a config's steps a fast machine gets: past it the demo gains little for its wait."""
LEAST_STEPS = 20
STARTUP_S = 8.0
"""What each of the demo's commands costs before its first step (imports, building models), measured on the demo."""
COMMANDS = 7
IN_RUN = 1.12
"""How much longer a step takes in the run than when timed alone (its checkpoints, previews and loader's epochs):
the demo's diffusion stage, timed at 0.382 s a step, trained at about 0.43."""
SAMPLING_COST = 1.0
"""Seconds of one sampling step of one image, as a fraction of one training step's seconds per image: a forward
pass with and without the caption (classifier-free guidance) against a forward and a backward of one."""


def _recorded_steps(run: Path) -> int | None:
    """The step count a run's first start recorded in its config.yaml, if it started."""
    saved = run / "config.yaml"
    if not saved.is_file():
        return None
    from omegaconf import OmegaConf

    return int(OmegaConf.load(saved).train.max_steps)


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


def plan_steps(args: argparse.Namespace, deadline: float, data: Path, runs: tuple[Path, Path],
               configs: tuple[Path, Path], autoencoder_overrides: list[str]) -> dict[str, int]:
    """The step counts of the stages that have not started (the autoencoder's and the diffusion stage's `runs`, of
    their `configs`), sized to end by `deadline` (time.perf_counter()); those of stages that started, as they
    recorded them. `autoencoder_overrides`: the demo's settings of the autoencoder's model (its family)."""
    from omegaconf import OmegaConf

    (ae_run, sd_run), (ae_config, sd_config) = runs, configs
    recorded = {"autoencoder": _recorded_steps(ae_run), "diffusion": _recorded_steps(sd_run)}
    if all(steps is not None for steps in recorded.values()):
        return recorded
    ae_default = int(OmegaConf.load(ae_config).train.max_steps)
    sd_settings = OmegaConf.load(sd_config)
    sd_default = int(sd_settings.train.max_steps)
    print("\n== timing the training steps, to fit the demo in its minutes", flush=True)
    ae_s, _ = _timed_step(ae_config, [f"data.shards={data}", *autoencoder_overrides], encoded=False)
    with tempfile.TemporaryDirectory(prefix="sdtrain-demo-vae-") as scratch:
        vae = _demo_vae(ae_config, autoencoder_overrides, Path(scratch) / "vae")
        sd_s, batch = _timed_step(sd_config, [f"model.vae={vae}"], encoded=True)
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
    fixed = COMMANDS * STARTUP_S + (args.adherence_prompts + len(_grid_prompts())) * image_s + args.num / 300
    left = max(deadline - time.perf_counter() - fixed, 0.0)
    scale = fit(left, {"autoencoder": (ae_default, ae_s), "diffusion": (sd_default, per_sd_step)})
    planned = {"autoencoder": max(LEAST_STEPS, round(ae_default * scale)),
               "diffusion": max(LEAST_STEPS, round(sd_default * scale))}
    planned.update({stage: steps for stage, steps in recorded.items() if steps is not None})
    print(f"{left / 60:.1f} min for training: autoencoder {planned['autoencoder']} steps "
          f"({ae_s:.3f} s each), diffusion {planned['diffusion']} steps ({sd_s:.3f} s each; {scale:.2f} x the "
          f"configs' {ae_default} and {sd_default})", flush=True)
    return planned


def fit(seconds: float, stages: dict[str, tuple[int, float]]) -> float:
    """The one factor that scales every stage's (configured steps, seconds per step) to take `seconds` in all, at
    most MOST."""
    return min(MOST, seconds / sum(steps * step_s for steps, step_s in stages.values()))


def _grid_prompts() -> list[Any]:
    from sdtrain.data.shapes import caption_prompts

    return list(caption_prompts())
