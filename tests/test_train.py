"""Training behaviour: the loss goes down, runs leave what users look for, checkpoints rotate."""

from __future__ import annotations

import json

import torch

from sdtrain.config import load_config
from sdtrain.train.trainer import Trainer

from .conftest import TINY, config_path


def _fixed_batch_loss(trainer: Trainer, batch) -> float:
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        loss, _ = trainer.task.loss(batch, generator)
    return loss.item()


def test_a_few_steps_reduce_the_loss_on_a_fixed_batch(tmp_path, shapes_dir, autoencoder_run):
    config = load_config(config_path("diffusion.yaml"), [
        f"run_dir={tmp_path / 'run'}", f"data.shards={shapes_dir}", f"model.vae={autoencoder_run}", *TINY,
        "data.caption_dropout=0", "train.max_steps=30", "optim.lr=2e-3", "optim.warmup_steps=0",
        "checkpoint.every=0", "ema.enabled=false", "validation.prompts=[]",
    ])
    trainer = Trainer(config)
    batch = trainer.data.next()
    before = _fixed_batch_loss(trainer, batch)
    for _ in range(30):
        trainer.train_step()
    after = _fixed_batch_loss(trainer, batch)
    assert after < 0.8 * before, (before, after)


def test_autoencoder_loss_goes_down(tmp_path, shapes_dir):
    config = load_config(config_path("autoencoder.yaml"), [
        f"run_dir={tmp_path / 'ae'}", f"data.shards={shapes_dir}", *TINY, "train.max_steps=25",
        "optim.warmup_steps=0", "checkpoint.every=0",
    ])
    trainer = Trainer(config)
    first = trainer.train_step()["loss"]
    for _ in range(24):
        last = trainer.train_step()["loss"]
    assert last < 0.7 * first, (first, last)


def test_run_folder_has_config_metrics_checkpoints_and_samples(diffusion_run):
    assert (diffusion_run / "config.yaml").is_file()
    records = [json.loads(line) for line in (diffusion_run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 4
    assert {"loss", "lr", "img_per_s", "samples", "epoch", "skipped_samples"} <= set(records[-1])
    checkpoints = sorted(p.name for p in (diffusion_run / "checkpoints").iterdir())
    assert checkpoints == ["step_00000002", "step_00000004"]
    assert (diffusion_run / "samples" / "step_00000004.png").is_file()
    assert (diffusion_run / "tokenizer" / "vocab.json").is_file()


def test_keep_last_prunes_old_checkpoints_and_leaves_no_temporaries(tmp_path, shapes_dir):
    from .conftest import train

    run = tmp_path / "ae"
    train("autoencoder.yaml", run, f"data.shards={shapes_dir}", "train.max_steps=4", "checkpoint.every=1",
          "checkpoint.keep_last=2")
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step_00000003", "step_00000004"]


def test_autoencoder_checkpoint_records_a_latent_scaling_factor(autoencoder_run):
    from sdtrain.checkpoint import load_run_modules

    vae = load_run_modules(autoencoder_run)["vae"]
    assert vae.config.scaling_factor != 0.18215 and vae.config.scaling_factor > 0
