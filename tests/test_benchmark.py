"""`sdtrain benchmark train`: the path `sdtrain train` runs, timed, with the memory of its whole process tree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sdtrain.cli.main import main

from .conftest import config_path

SMALL = ["data.resolution=32", "data.batch_size=2"]
FEW = ["--steps", "2", "--warmup", "1", "--peak-seconds", "0.2"]


@pytest.mark.slow  # the default suite's 15 minutes: the benchmarks of runs on data run by default
def test_benchmark_times_a_config_that_names_no_data_or_vae(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "result.json"
    # The demo config leaves run_dir, data.shards and model.vae open: the benchmark fills them itself.
    assert main(["benchmark", "train", str(config_path("diffusion.yaml")), *SMALL, *FEW, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["world_size"] == 1 and result["global_batch"] == 2 and result["steps_timed"] == 2
    assert result["images_per_s"] > 0 and result["step_ms"] > 0 and result["peak_memory_gib"] > 0
    assert result["trainable_parameters"] > 1_000_000  # UNet and text encoder
    table = capsys.readouterr().out
    assert "img/s" in table and "MFU" in table
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # scratch files are gone
    # MFU: the step's counted model FLOPs against this machine's peak, measured before and after.
    assert result["model_gflop_per_image"] > 0 and len(result["peak_gflops_runs"]) == 2
    assert 0 < result["mfu"] == pytest.approx(
        result["model_gflop_per_image"] * 1e9 * result["global_batch"] / (result["step_ms"] / 1000)
        / (result["peak_gflops"] * 1e9))
    assert result["first_step_ms"] > 0 and result["mixed_precision"] in ("fp32", "bf16")
    # A checkpoint save, timed, with the peak memory it reaches.
    assert result["save_s"] > 0 and result["save_peak_memory_gib"] >= result["peak_memory_gib"]


def test_benchmark_keeps_the_users_settings(tmp_path):
    out = tmp_path / "result.json"
    assert main(["benchmark", "train", str(config_path("autoencoder.yaml")), *SMALL, "train.grad_accum=3", *FEW,
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["stage"] == "autoencoder" and result["global_batch"] == 6


@pytest.mark.slow
@pytest.mark.dist
def test_benchmark_compares_process_counts_with_allreduce_time(tmp_path, capsys):
    out = tmp_path / "scaling.json"
    assert main(["benchmark", "train", str(config_path("diffusion.yaml")), *SMALL, *FEW, "--nproc", "1,2",
                 "--out", str(out)]) == 0
    single, double = json.loads(out.read_text())
    assert (single["world_size"], double["world_size"]) == (1, 2)
    assert double["strategy"] == "ddp" and double["global_batch"] == 4
    assert "allreduce_ms" not in single and double["allreduce_ms"] > 0
    table = capsys.readouterr().out
    assert "scaling" in table and "allreduce ms" in table


# FSDP2's sharded saves are exercised by the distributed and chaos tests; this times them, at 40 s.
@pytest.mark.slow
@pytest.mark.dist
def test_benchmark_times_a_sharded_save_under_fsdp(tmp_path, capsys):
    out = tmp_path / "fsdp.json"
    assert main(["benchmark", "train", str(config_path("diffusion.yaml")), *SMALL, *FEW, "--nproc", "2",
                 "parallel.strategy=fsdp", "--out", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    assert result["strategy"] == "fsdp" and result["save_format"] == "sharded"
    assert result["save_written_s"] >= result["save_s"] > 0
    assert "sharded" in capsys.readouterr().out


@pytest.mark.slow  # the loader benchmark's own path; the default suite times the real loader in the step
def test_benchmark_data_reports_loader_rate_beside_training(tmp_path, shapes_dir, capsys):
    out = tmp_path / "data.json"
    assert main(["benchmark", "data", str(config_path("diffusion.yaml")), f"data.shards={shapes_dir}", *SMALL,
                 "--workers", "0", "--batches", "3", "--train-steps", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["workers"] for r in result["loader"]] == [0]
    assert result["loader"][0]["samples_per_s"] > 0 and result["train_images_per_s"] > 0
    assert "x training" in capsys.readouterr().out


@pytest.mark.slow
def test_benchmark_sweep_prints_one_row_per_combination(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert main(["benchmark", "train", str(config_path("diffusion.yaml")), *SMALL, *FEW,
                 "--sweep", "ema.enabled=true,false", "--sweep", "ema.every=2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["ema"], r["ema_every"], r["sweep"]["ema.every"]) for r in rows] == [(True, 2, "2"), (False, 2, "2")]
    table = capsys.readouterr().out.splitlines()
    assert "EMA" in table[0] and "every" in table[0] and len([line for line in table if "single" in line]) == 2


def test_benchmark_sweep_needs_values():
    assert main(["benchmark", "train", str(config_path("diffusion.yaml")), "--sweep", "ema.enabled"]) == 2


def test_a_sweep_takes_list_values_and_names_a_malformed_one():
    from sdtrain.benchmark import sweep_combinations
    from sdtrain.errors import UserError

    keys, combos = sweep_combinations(["model.unet_overrides.block_out_channels=[32,64],[64,64]",
                                       "data.batch_size=1,2"])
    assert keys == ["model.unet_overrides.block_out_channels", "data.batch_size"]
    assert combos[0] == ["model.unet_overrides.block_out_channels=[32,64]", "data.batch_size=1"]
    assert len(combos) == 4
    with pytest.raises(UserError, match=r"override 'optim.lr=\[1,': cannot parse it"):
        sweep_combinations(["optim.lr=[1,"])


def test_benchmark_runs_the_real_loader_and_counts_its_workers(tmp_path):
    out = tmp_path / "result.json"
    run = tmp_path / "run"
    assert main(["benchmark", "train", str(config_path("diffusion.yaml")), *SMALL, "data.num_workers=2",
                 f"run_dir={run}", *FEW, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    # Shards written for the benchmark and read through the loader, as `sdtrain train` reads a user's.
    assert result["synthetic_data"] and result["loader_workers"] == 2
    manifest = json.loads((run / "synthetic-shards" / "manifest.json").read_text())
    assert manifest["total"] >= 2 * 2 and "encoding" not in manifest
    assert result["loading_peak_memory_gib"] > 0 and result["peak_memory_gib"] > 0


# A minute: the path `benchmark --encoded` shares with training is in test_encode; this adds the pretrained source.
@pytest.mark.slow
def test_benchmark_loads_a_pretrained_model_and_reads_encoded_shards(tmp_path, pretrained):
    out = tmp_path / "result.json"
    run = tmp_path / "run"
    finetune = Path(__file__).resolve().parents[1] / "configs" / "finetune-full.yaml"
    assert main(["benchmark", "train", str(finetune), *SMALL, f"model.pretrained={pretrained}", f"run_dir={run}",
                 "--encoded", *FEW, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["encoded"] and result["synthetic_data"]
    # Every component comes from the pretrained folder, as in training: no stand-in VAE or text encoder.
    assert not (run / "random-vae").exists() and not (run / "random-text-encoder").exists()
    encoding = json.loads((run / "synthetic-shards" / "manifest.json").read_text())["encoding"]
    assert encoding["vae"] == str(pretrained.resolve()) and encoding["text_encoder"] == str(pretrained.resolve())
    assert (run / "synthetic-shards" / "empty_caption.npy").is_file()
    assert result["trainable_parameters"] < 2_000_000  # the UNet alone: the text encoder is frozen


def test_benchmark_encoded_needs_encoded_shards(tmp_path, shapes_dir, capsys):
    assert main(["benchmark", "train", str(config_path("diffusion.yaml")), *SMALL, f"data.shards={shapes_dir}",
                 "--encoded", *FEW]) == 2
    assert "--encoded: the shards of data.shards" in capsys.readouterr().err


def test_an_encoded_benchmark_never_builds_the_weights_of_the_text_encoders_its_shards_stand_in_for(tmp_path):
    """With --encoded, the synthetic shards' embeddings stand in for the frozen text encoders from the start: a
    released-size language model (7-24B) is never built, its stand-in folder holds its config alone."""
    out, run = tmp_path / "result.json", tmp_path / "run"
    lora = Path(__file__).resolve().parents[1] / "configs" / "lora.yaml"
    assert main(["benchmark", "train", str(lora), *SMALL, "model.family=qwen-image", "model.pretrained=null",
                 "model.t5_text_length=8", f"run_dir={run}", "--encoded", *FEW, "--out", str(out)]) == 0
    assert json.loads(out.read_text())["encoded"]
    stand_in = run / "random-text-encoder"
    assert (stand_in / "config.json").is_file() and not list(stand_in.glob("*.safetensors"))
    encoding = json.loads((run / "synthetic-shards" / "manifest.json").read_text())["encoding"]
    assert encoding["text_encoder"] == str(stand_in.resolve()) and encoding["latent_channels"] == 16


def test_a_plan_says_the_expected_peak_of_a_clip_size_without_running_a_step(tmp_path, capsys, monkeypatch):
    """`--plan`: the memory planner's figures for a size whose step would take hours here, in the time loading
    takes: the expected peak grows with the clip, checkpointing is planned where it is auto, no step runs."""
    from sdtrain.train.trainer import Trainer

    monkeypatch.setattr(Trainer, "train_step", lambda self: pytest.fail("a plan ran a training step"))
    wan = ["model.pretrained=null", "model.family=wan", "model.preset=tiny", "data.aspect_buckets=false",
           "data.batch_size=1", "data.num_workers=0", "train.gradient_checkpointing=auto", "--encoded", "--plan"]
    recipe = Path(__file__).resolve().parents[1] / "configs" / "wan-lora.yaml"
    peaks = []
    for size, frames in ((32, 5), (96, 17)):
        out = tmp_path / f"{size}.json"
        assert main(["benchmark", "train", str(recipe), f"run_dir={tmp_path / str(size)}",
                     f"data.resolution={size}", f"data.frames={frames}", *wan, "--out", str(out)]) == 0
        plan = json.loads(out.read_text())
        assert plan["plan_only"] and plan["frames"] == frames and plan["fits"]
        assert plan["gradient_checkpointing"] is False and plan["available_gib"] > plan["estimated_peak_gib"] > 0
        assert plan["estimated_peak_gib"] >= plan["training_peak_gib"]
        peaks.append(plan["training_peak_gib"])
        assert f"plan for {size} px x {frames} frames" in capsys.readouterr().out
    assert peaks[1] > peaks[0]
    assert main(["benchmark", "train", str(recipe), *wan, "--sweep", "data.frames=5,9"]) == 2
