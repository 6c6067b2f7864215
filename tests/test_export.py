"""Export and generation: what leaves sdtrain must work in plain diffusers, offline."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sdtrain.errors import UserError
from sdtrain.export import export_run


def test_exported_pipeline_loads_in_plain_diffusers_offline(tmp_path, diffusion_run, monkeypatch):
    from diffusers import StableDiffusionPipeline

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = export_run(diffusion_run, tmp_path / "pipeline")
    index = json.loads((out / "model_index.json").read_text())
    assert {"unet", "vae", "text_encoder", "tokenizer", "scheduler"} <= set(index)
    assert list(out.glob("unet/*.safetensors")) and not list(out.rglob("*.bin"))
    pipe = StableDiffusionPipeline.from_pretrained(out, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a red circle", num_inference_steps=2, output_type="np").images[0]
    assert image.shape == (32, 32, 3) and np.isfinite(image).all()


def test_export_uses_ema_weights_by_default(tmp_path, diffusion_run):
    from diffusers import UNet2DConditionModel

    ema = UNet2DConditionModel.from_pretrained(export_run(diffusion_run, tmp_path / "ema") / "unet")
    raw = UNet2DConditionModel.from_pretrained(export_run(diffusion_run, tmp_path / "raw", ema=False) / "unet")
    assert any((a != b).any() for a, b in zip(ema.parameters(), raw.parameters()))


def test_autoencoder_run_exports_a_vae_folder(tmp_path, autoencoder_run):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(export_run(autoencoder_run, tmp_path / "vae"))
    assert vae.config.latent_channels == 4


def test_export_of_a_folder_that_is_not_a_run_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="not an sdtrain run folder"):
        export_run(tmp_path, tmp_path / "out")


def test_generate_is_reproducible_for_a_seed(tmp_path, diffusion_run):
    from sdtrain.generate import generate

    first = generate(diffusion_run, ["a red circle", "a blue square"], tmp_path / "a", steps=2, seed=3)
    again = generate(diffusion_run, ["a red circle"], tmp_path / "b", steps=2, seed=3, scheduler="euler")
    from PIL import Image

    assert np.array_equal(np.asarray(Image.open(first[0])), np.asarray(Image.open(again[0])))
    assert (tmp_path / "a" / "grid.png").is_file()


def test_images_generated_together_are_those_of_their_own_seeds(diffusion_run):
    from sdtrain.generate import load_pipeline, sample_images

    pipe = load_pipeline(diffusion_run)
    prompts = ["a red circle", "a blue square", "a green triangle"]
    alone = sample_images(pipe, prompts, seed=5, steps=2, batch=1)
    together = sample_images(pipe, prompts, seed=5, steps=2, batch=2)
    for a, b in zip(alone, together):
        assert np.abs(np.asarray(a, dtype=int) - np.asarray(b, dtype=int)).max() <= 2  # rounding only
    picked = sample_images(pipe, prompts[1:], seeds=[6, 7], steps=2, batch=2)
    assert np.abs(np.asarray(picked[1], dtype=int) - np.asarray(alone[2], dtype=int)).max() <= 2


def test_export_never_deletes_the_run_or_an_unrelated_folder(tmp_path, autoencoder_run):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.txt").write_text("keep me")
    for out in (autoencoder_run, precious, autoencoder_run / "checkpoints" / "x"):
        with pytest.raises(UserError, match="--out"):
            export_run(autoencoder_run, out)
    assert (precious / "thesis.txt").is_file() and (autoencoder_run / "checkpoints").is_dir()
    first = export_run(autoencoder_run, tmp_path / "vae")
    assert export_run(autoencoder_run, first) == first  # an earlier export may be replaced


def test_frozen_autoencoder_stays_the_one_the_run_trained_with(tmp_path, shapes_dir):
    import torch

    from sdtrain.loaders.components import load_run_modules

    from .conftest import train

    ae, sd = tmp_path / "ae", tmp_path / "sd"
    train("autoencoder.yaml", ae, f"data.shards={shapes_dir}", "train.max_steps=2")
    used = load_run_modules(ae)["vae"]
    train("diffusion.yaml", sd, f"data.shards={shapes_dir}", f"model.vae={ae}", "train.max_steps=1",
          "validation.prompts=[]")
    train("autoencoder.yaml", ae, f"data.shards={shapes_dir}", "train.max_steps=4")  # the autoencoder trains on
    exported = export_run(sd, tmp_path / "pipe")
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(exported / "vae")
    assert all(torch.equal(a, b) for a, b in zip(vae.state_dict().values(), used.state_dict().values()))
    assert vae.config.scaling_factor == used.config.scaling_factor


def test_grid_labels_wrap_so_long_prompts_are_shown_whole():
    from PIL import Image

    from sdtrain.utils import make_grid

    tiles = [Image.new("RGB", (64, 64), "red")] * 2
    short = make_grid(tiles, rows=1, labels=["a red circle", "a blue square"])
    long = make_grid(tiles, rows=1, labels=["a red square and a blue circle", "a blue square"])
    # 128 px tiles fit about 20 characters a line: the two-shape prompt takes a second line, not a cut.
    assert long.height == short.height + 12
    text_rows = np.asarray(long.convert("L"))[short.height - 2:, :128] < 128
    assert text_rows.any()
