"""Training behaviour: the loss goes down, runs leave what users look for, checkpoints rotate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sdtrain.cli.main import main
from sdtrain.config import load_config
from sdtrain.train.trainer import Trainer

from .conftest import TINY, config_path, train


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
    trainer.data.next = lambda: batch  # the classic sanity check: fit one batch
    before = _fixed_batch_loss(trainer, batch)
    for _ in range(30):
        trainer.train_step()
    after = _fixed_batch_loss(trainer, batch)
    assert after < 0.7 * before, (before, after)


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
    run = tmp_path / "ae"
    train("autoencoder.yaml", run, f"data.shards={shapes_dir}", "train.max_steps=4", "checkpoint.every=1",
          "checkpoint.keep_last=2", "logging.tensorboard=true")
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step_00000003", "step_00000004"]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_autoencoder_checkpoint_records_a_latent_scaling_factor(autoencoder_run):
    from sdtrain.loaders.components import load_run_modules

    vae = load_run_modules(autoencoder_run)["vae"]
    assert vae.config.scaling_factor != 0.18215 and vae.config.scaling_factor > 0


def test_bf16_checkpointing_accumulation_and_v_prediction_train(tmp_path, shapes_dir, autoencoder_run):
    run = tmp_path / "sd"
    train("diffusion.yaml", run, f"data.shards={shapes_dir}", f"model.vae={autoencoder_run}",
          "train.max_steps=2", "train.mixed_precision=bf16", "train.gradient_checkpointing=true",
          "train.grad_accum=2", "diffusion.ddpm.prediction_type=v_prediction", "validation.prompts=[a red circle]",
          "validation.steps=2")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["samples"] == 2 * 2 * 4  # steps x accumulation x batch
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    from sdtrain.export import pipeline_from_run

    assert pipeline_from_run(run).scheduler.config.prediction_type == "v_prediction"


@pytest.mark.parametrize("config", ["autoencoder.yaml", "diffusion.yaml"])
def test_gradient_checkpointing_recomputes_without_changing_training(tmp_path, shapes_dir, autoencoder_run,
                                                                     config):
    from safetensors.torch import load_file

    runs = {}
    for checkpointing in (False, True):
        run = runs[checkpointing] = tmp_path / f"ckpt-{checkpointing}"
        train(config, run, f"data.shards={shapes_dir}", f"model.vae={autoencoder_run}", "train.max_steps=2",
              f"train.gradient_checkpointing={str(checkpointing).lower()}", "validation.prompts=[]",
              "logging.every=1")
    plain, recomputed = (load_file(str(runs[c] / "checkpoints" / "step_00000002" / "model.safetensors"))
                         for c in (False, True))
    assert plain.keys() == recomputed.keys()  # names as the plain model's: checkpoints stay interchangeable
    for key in plain:
        torch.testing.assert_close(recomputed[key], plain[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow  # inductor compiles the blocks for minutes on a cold cache
def test_the_tuned_path_trains_like_eager_and_resumes_bitwise(tmp_path, shapes_dir, autoencoder_run, monkeypatch):
    """train.tuned with its blocks compiled (on a GPU it compiles; on a CPU only when asked) and channels_last forced:
    the loss curve eager's within 0.1%, and a stopped run resumes to the straight run's weights bit for bit."""
    from safetensors.torch import load_file

    from sdtrain.checkpoint import latest_checkpoint, read_meta

    monkeypatch.setenv("SDTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    common = [f"data.shards={shapes_dir}", f"model.vae={autoencoder_run}", "validation.prompts=[]", "logging.every=1",
              "checkpoint.every=2"]
    tuned = ["train.tuned=true", "train.compile=true", "train.channels_last=true"]
    train("diffusion.yaml", tmp_path / "eager", *common, "train.max_steps=4")
    train("diffusion.yaml", tmp_path / "tuned", *common, *tuned, "train.max_steps=4")
    eager, compiled = ([json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text()
                        .splitlines()] for run in ("eager", "tuned"))
    assert len(compiled) == 4 and compiled == pytest.approx(eager, rel=1e-3)
    tuning = read_meta(latest_checkpoint(tmp_path / "tuned"))["tuning"]
    assert tuning["compile"] and tuning["channels_last"]
    train("diffusion.yaml", tmp_path / "stopped", *common, *tuned, "train.max_steps=2")
    train("diffusion.yaml", tmp_path / "stopped", *common, *tuned, "train.max_steps=4")
    for name in ("model.safetensors", "ema.safetensors"):
        a = load_file(str(latest_checkpoint(tmp_path / "tuned") / name))
        b = load_file(str(latest_checkpoint(tmp_path / "stopped") / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_checkpointing_wraps_each_block_outside_the_model():
    from sdtrain.config import ParallelConfig
    from sdtrain.distributed import Topology
    from sdtrain.models import build
    from sdtrain.train.parallel import DataParallel, shard_units

    class Task:
        unet = build.build_unet(load_config(config_path("diffusion.yaml"), ["run_dir=x", "data.shards=x",
                                                                            "model.vae=x"]).model,
                                latent_channels=4, latent_size=8, cross_attention_dim=64)

        def parallel_modules(self):
            return {"unet": self.unet}

    task = Task()
    DataParallel(ParallelConfig(), Topology(), torch.device("cpu")).apply(task, checkpointing=True)
    blocks = shard_units(task.unet)
    assert len(blocks) == 7  # 3 down, mid, 3 up
    assert all("forward" in vars(block) for block in blocks)  # the instance's, not the class's
    assert "forward" not in vars(task.unet)
    calls = []
    blocks[0].resnets[0].register_forward_pre_hook(lambda *_: calls.append(1))
    out = task.unet(torch.randn(1, 4, 8, 8), torch.tensor([10]), encoder_hidden_states=torch.randn(1, 3, 64)).sample
    out.sum().backward()
    assert len(calls) == 2  # run in forward, run again in backward


def test_training_runs_on_through_damaged_shards(tmp_path):
    from .test_data import write_damaged

    data = tmp_path / "damaged"
    write_damaged(data)
    run = tmp_path / "ae"
    train("autoencoder.yaml", run, f"data.shards={data}", "train.max_steps=8")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 8 and records[-1]["skipped_samples"] >= 2


def test_fine_tune_from_a_pipeline_folder(tmp_path, shapes_dir, diffusion_run):
    from sdtrain.export import export_run

    pipeline = export_run(diffusion_run, tmp_path / "base")
    scheduler_config = pipeline / "scheduler" / "scheduler_config.json"
    scheduler = json.loads(scheduler_config.read_text())
    scheduler_config.write_text(json.dumps({**scheduler, "prediction_type": "v_prediction"}))
    run = tmp_path / "finetune"
    train("diffusion.yaml", run, f"data.shards={shapes_dir}", f"model.pretrained={pipeline}", "model.vae=null",
          "diffusion.train_text_encoder=false", "diffusion.ddpm.prediction_type=null", "train.max_steps=2",
          "validation.prompts=[]")
    assert not (run / "tokenizer").exists()  # the pipeline's own tokenizer was used
    tuned = export_run(run, tmp_path / "tuned")
    assert (tuned / "text_encoder").is_dir() and (tuned / "unet").is_dir()
    # The objective is the pretrained model's own unless the config names one.
    assert json.loads((tuned / "scheduler" / "scheduler_config.json").read_text())["prediction_type"] == "v_prediction"


@pytest.mark.slow  # the default suite's 15 minutes: tensorboard's logging runs by default
def test_wandb_offline_logs_without_network_or_key(tmp_path, shapes_dir):
    pytest.importorskip("wandb")
    # Its own process: wandb starts a service that outlives the run, and the test session must not wait on it.
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", OMP_NUM_THREADS="2")
    run = tmp_path / "ae"
    subprocess.run(
        [sys.executable, "-m", "sdtrain", "train", str(config_path("autoencoder.yaml")), f"run_dir={run}",
         f"data.shards={shapes_dir}", *TINY, "train.max_steps=2", "logging.wandb=true", "logging.every=1"],
        env=env, check=True, timeout=600,
    )
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb"))


def test_wandb_online_without_a_key_is_one_clear_error(tmp_path, shapes_dir, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    code = main(["train", str(config_path("autoencoder.yaml")), f"run_dir={tmp_path / 'ae'}",
                 f"data.shards={shapes_dir}", *TINY, "train.max_steps=1", "logging.wandb=true"])
    assert code == 2


def test_the_diffusion_stage_trains_on_aspect_buckets(tmp_path, autoencoder_run, capsys):
    from sdtrain.data.shards import ShardWriter

    from .test_data import png

    data = tmp_path / "mixed"
    with ShardWriter(data, samples_per_shard=8) as writer:
        for i, size in enumerate([(120, 40), (40, 120), (64, 64)] * 4):
            writer.write({"__key__": f"s{i:02d}", "png": png(i, size), "txt": f"a shape {i % 3}"})
    common = [f"data.shards={data}", f"model.vae={autoencoder_run}", "data.resolution=64",
              "data.aspect_buckets=true", "data.max_aspect=3", "data.batch_size=2", "validation.prompts=[]"]
    run = tmp_path / "sd"
    train("diffusion.yaml", run, *common, "data.bucket_step=32", "train.max_steps=3", "logging.every=1")
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
    # 4x VAE and a 3-level UNet: sides must be multiples of 16.
    assert main(["train", str(config_path("diffusion.yaml")), f"run_dir={tmp_path / 'bad'}", *TINY, *common,
                 "data.bucket_step=8"]) == 2
    assert "data.bucket_step: 8 is not a multiple of 16" in capsys.readouterr().err


def test_the_autoencoder_trains_on_aspect_buckets(tmp_path):
    from sdtrain.data.shards import ShardWriter

    from .test_data import png

    data = tmp_path / "mixed"
    with ShardWriter(data, samples_per_shard=8) as writer:
        for i, size in enumerate([(96, 48), (48, 96), (64, 64)] * 4):
            writer.write({"__key__": f"s{i:02d}", "png": png(i, size), "txt": f"caption {i}"})
    run = tmp_path / "ae"
    train("autoencoder.yaml", run, f"data.shards={data}", "data.resolution=64", "data.aspect_buckets=true",
          "data.bucket_step=16", "data.batch_size=2", "train.max_steps=4", "logging.every=1")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
