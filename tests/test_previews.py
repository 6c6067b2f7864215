"""What the user sees is what they get: a run's validation images (RUN/samples/step_N/000-<prompt>.png, beside the
grid) are, prompt for prompt, what `sdtrain generate` draws from the run and from the folder `sdtrain export`
writes, with the validation settings given on the command line or left to their defaults there.

Tolerance: at most 2 of 255 per channel. Both sides run the same pipeline, sampler, seeds and size in fp32 and match
exactly on this machine; the margin is for the one thing that may differ, the order of floating-point operations in
weights the trainer rebuilt from its snapshot against weights read from the export (a LoRA merged, say), a rounding
the sampler carries through a few steps and the 8-bit quantisation turns into a level or two. A real difference
(other weights, sampler, seed, size, guidance or step count) moves pixels by tens of levels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdtrain.cli.main import main
from sdtrain.loaders.pipelines import run_config
from sdtrain.models.pipeline import SAMPLING_FILE, read_sampling, write_sampling
from sdtrain.utils import image_file_name

from .conftest import TINY, config_path

TOLERANCE = 2
"""Largest difference of any uint8 channel value between a preview and its generated image (see the docstring)."""


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(np.int16)


def _previews(run: Path, step: int) -> list[Path]:
    prompts = run_config(run).validation.prompts
    folder = run / "samples" / f"step_{step:08d}"
    return [folder / image_file_name(i, prompt) for i, prompt in enumerate(prompts)]


def _generate(model: Path, out: Path, prompts: list[str], *settings: str) -> list[Path]:
    args = ["generate", "--model", str(model), "--out", str(out), "--device", "cpu", *settings]
    assert main([*args, *(a for p in prompts for a in ("--prompt", p))]) == 0
    return [out / image_file_name(i, prompt) for i, prompt in enumerate(prompts)]


def _same(previews: list[Path], generated: list[Path]) -> None:
    for preview, image in zip(previews, generated, strict=True):
        a, b = _pixels(preview), _pixels(image)
        assert a.shape == b.shape, f"{image.name}: {b.shape[:2]} px, the preview is {a.shape[:2]}"
        worst = int(np.abs(a - b).max())
        assert worst <= TOLERANCE, f"{image.name}: differs from its preview by up to {worst}/255"


def _check(run: Path, step: int, tmp_path: Path) -> None:
    config = run_config(run)
    val, prompts = config.validation, config.validation.prompts
    previews = _previews(run, step)
    assert all(p.is_file() for p in previews), "validation writes each prompt's image beside its grid"
    grid = _pixels(run / "samples" / f"step_{step:08d}.png")
    first = _pixels(previews[0])
    side = first.shape[0]
    assert side == config.data.resolution
    assert np.array_equal(grid[: 2 * side: 2, : 2 * side: 2], first)  # the grid's first cell, shown twice as large

    exported = tmp_path / "export"
    assert main(["export", str(run), str(exported)]) == 0  # EMA weights, export's default
    explicit = ["--size", str(config.data.resolution)]
    explicit += ["--steps", str(val.steps)] if val.steps is not None else []
    explicit += ["--guidance", str(val.guidance)] if val.guidance is not None else []
    _same(previews, _generate(exported, tmp_path / "explicit", prompts, "--seed", str(val.seed), *explicit))
    # Prompt i draws from seed + i on both sides: the second prompt alone, from the seed after.
    _same(previews[1:], _generate(exported, tmp_path / "second", prompts[1:], "--seed", str(val.seed + 1), *explicit))
    # Left unset, generate samples a run as its previews were sampled, and an export that recorded them likewise.
    _same(previews, _generate(run, tmp_path / "run", prompts))
    if not (exported / SAMPLING_FILE).is_file():
        write_sampling(exported, config)  # what export records beside model_index.json
    assert read_sampling(exported)["size"] == config.data.resolution
    _same(previews, _generate(exported, tmp_path / "defaults", prompts))


def test_sd_previews_are_what_generate_draws_from_the_export(diffusion_run, tmp_path):
    """The demo's settings (guidance 7, not generate's 5) over EMA weights that differ from the raw ones."""
    _check(diffusion_run, 4, tmp_path)
    raw = _generate(diffusion_run, tmp_path / "raw", run_config(diffusion_run).validation.prompts[:1], "--no-ema")
    assert np.abs(_pixels(raw[0]) - _pixels(_previews(diffusion_run, 4)[0])).max() > TOLERANCE  # EMA is seen


@pytest.fixture(scope="module")
def flux_run(tmp_path_factory, shapes_dir) -> Path:
    """A tiny Flux.1-dev run with EMA and validation prompts, at 32 px where FluxPipeline's own default is 128
    latent rows."""
    root = tmp_path_factory.mktemp("flux-previews")
    common = [*TINY, "model.family=flux", f"data.shards={shapes_dir}", "evaluation.every_samples=0"]
    vae = root / "autoencoder"
    assert main(["train", str(config_path("autoencoder.yaml")), f"run_dir={vae}", *common, "train.max_steps=2"]) == 0
    run = root / "scratch"
    assert main(["train", str(config_path("diffusion.yaml")), f"run_dir={run}", *common, f"model.vae={vae}",
                 "data.batch_size=2", "model.t5_text_length=12", "model.denoiser_init=library", "train.max_steps=2",
                 "checkpoint.every=2", "validation.prompts=[a red circle,a blue square]", "validation.steps=2"]) == 0
    return run


def test_flux_previews_are_what_generate_draws_from_the_export(flux_run, tmp_path):
    """Flux.1: the flow sampler with its shift, the guidance embedding's default and the T5 length as trained."""
    _check(flux_run, 2, tmp_path)


def test_previews_sample_in_full_fp32_whatever_the_training_set(tmp_path):
    """``train.tf32`` and ``train.cudnn_benchmark`` are process-wide: validation sets them aside while it samples,
    as a fresh `sdtrain generate` process has them, and puts them back for training."""
    import torch

    from sdtrain.models.pipeline import exact_sampling

    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark
    try:
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.benchmark = True
        with exact_sampling():
            assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark) == ("highest", False)
        assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark) == ("high", True)
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.benchmark = before[1]
    (tmp_path / SAMPLING_FILE).write_text("not json")
    assert read_sampling(tmp_path) == {}  # an unreadable record: the pipeline's own defaults
