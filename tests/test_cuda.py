"""The CUDA paths, one test each: what only a GPU runs (bf16 autocast on CUDA, fused AdamW's CUDA kernel, the fp8
base and block swap on a side stream, NCCL, asynchronous DCP saves, pinned non-blocking batches, compiled blocks).

`make gpu-check` runs them on a GPU (``pytest -m cuda``); elsewhere each is skipped with the reason. Their CPU
counterparts are in the rest of the suite; these compare the CUDA path with them or with another CUDA path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sdtrain.checkpoint import latest_checkpoint, read_weights
from sdtrain.cli.main import main
from sdtrain.config import OptimConfig

from .conftest import TINY, config_path, same_checkpoints
from .test_offload import BLOCKS, _pair
from .test_speed_options import _model, _train

pytestmark = pytest.mark.cuda

CONFIGS = config_path("diffusion.yaml").parents[1]
ON_CUDA = [*TINY, "train.device=cuda", "validation.prompts=[]", "evaluation.every_samples=0", "logging.every=1"]


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; `make gpu-check` runs these on one")
    yield torch.device("cuda")
    # train.deterministic is process-wide: the next test starts from torch's defaults.
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False


def _update_cosine(pretrained: Path, a: Path, b: Path) -> float:
    """The cosine between two runs' whole updates of the UNet (from the same pretrained weights). Adam moves each
    weight by about lr whatever its gradient's size, so a weight whose gradient is near zero flips direction under
    any rounding change: compare updates as a whole, not weight by weight."""
    base = load_file(str(pretrained / "unet" / "diffusion_pytorch_model.safetensors"))
    after = [read_weights(run, "model") for run in (a, b)]
    keys = [k for k in after[0] if k.startswith("unet.") and k[len("unet."):] in base]
    delta = [torch.cat([(w[k].float() - base[k[len("unet."):]].float()).flatten() for k in keys]) for w in after]
    return float(torch.nn.functional.cosine_similarity(delta[0], delta[1], dim=0))


def _finetune(config: str, run: Path, pretrained: Path, shapes_dir: Path, *extra: str) -> Path:
    assert main(["train", str(CONFIGS / config), f"run_dir={run}", *ON_CUDA, f"model.pretrained={pretrained}",
                 f"data.shards={shapes_dir}", *extra]) == 0
    return latest_checkpoint(run)


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if "loss" in line]


def test_a_bf16_step_matches_fp32_within_bf16s_precision(cuda, tmp_path, pretrained, shapes_dir):
    """The first step's loss (the same weights and batch) agrees within 2% (bf16 keeps about 3 significant digits
    in every matmul); the two runs' updates point the same way (cosine above 0.9: Adam's early steps are close to
    the gradient's sign, which rounding flips only where the gradient is near zero)."""
    runs = {}
    for precision in ("fp32", "bf16"):
        runs[precision] = tmp_path / precision
        _finetune("finetune-full.yaml", runs[precision], pretrained, shapes_dir, "train.max_steps=2",
                  "ema.enabled=false", f"train.mixed_precision={precision}", "optim.warmup_steps=0")
    fp32, bf16 = (_losses(runs[p]) for p in ("fp32", "bf16"))
    assert bf16[0] == pytest.approx(fp32[0], rel=2e-2)
    assert _update_cosine(pretrained, latest_checkpoint(runs["fp32"]), latest_checkpoint(runs["bf16"])) > 0.9


def test_fused_adamw_on_cuda_steps_as_the_cpu_loop_does(cuda):
    on_cuda = _train(_model().to(cuda), OptimConfig(lr=1e-2, fused=True))
    on_cpu = _train(_model(), OptimConfig(lr=1e-2, fused=False))
    for a, b in zip(on_cuda, on_cpu):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp8", "nf4"])
def test_block_swap_streams_on_a_side_stream_with_two_blocks_on_the_gpu(cuda, precision):
    plain, streamed = _pair(precision)
    plain.to(cuda)
    from sdtrain.models.offload import WeightStream

    stream = WeightStream(list(streamed.blocks), cuda)
    streamed.to(cuda)
    assert stream.copy_stream is not None
    assert all(m.weight_stored.device.type == "cpu" and m.weight_stored.is_pinned()
               for layers in stream.layers for m in layers)
    x = torch.randn(4, 16, device=cuda)
    expected = plain(x, False)
    expected.square().sum().backward()
    out = streamed(x, False, None, stream)
    out.square().sum().backward()
    torch.cuda.synchronize()
    assert torch.equal(out, expected) and torch.equal(streamed.scales.grad, plain.scales.grad)
    assert stream.most_resident == 2 and stream.copies == 2 * BLOCKS - 1


def test_fp8_base_and_block_swap_train_the_lora_of_a_resident_bf16_base(cuda, tmp_path, pretrained, shapes_dir):
    """Streaming changes nothing (the same bits reach the same matmuls); fp8 rounds the frozen weights to about two
    significant digits, so its adapters follow the bf16 base's closely, not exactly."""
    common = ["train.max_steps=2", "optim.lr=0.01", "train.mixed_precision=bf16", "ema.enabled=false"]
    files = {}
    for name, extra in (("bf16", ["model.frozen_precision=bf16", "model.offload_frozen=false"]),
                        ("bf16-swap", ["model.frozen_precision=bf16", "model.offload_frozen=true"]),
                        ("fp8", ["model.frozen_precision=fp8", "model.offload_frozen=false"])):
        checkpoint = _finetune("lora.yaml", tmp_path / name, pretrained, shapes_dir, *common, *extra)
        files[name] = read_weights(checkpoint, "model")
    assert files["bf16-swap"].keys() == files["bf16"].keys()
    assert all(torch.equal(files["bf16-swap"][k], files["bf16"][k]) for k in files["bf16"])
    for key in files["bf16"]:
        torch.testing.assert_close(files["fp8"][key].float(), files["bf16"][key].float(), rtol=0.1, atol=2e-3)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_step_over_nccl_at_world_size_one_matches_one_process(cuda, tmp_path, pretrained, shapes_dir, strategy):
    common = ["train.max_steps=2", "optim.lr=0.01", "ema.enabled=false", "checkpoint.every=2",
              "train.deterministic=true"]
    single = _finetune("finetune-full.yaml", tmp_path / "single", pretrained, shapes_dir, *common)
    run = tmp_path / strategy
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m", "sdtrain",
               "train", str(CONFIGS / "finetune-full.yaml"), f"run_dir={run}", *ON_CUDA,
               f"model.pretrained={pretrained}", f"data.shards={shapes_dir}", *common,
               f"parallel.strategy={strategy}", "parallel.backend=nccl"]
    result = subprocess.run(command, env=os.environ.copy(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _losses(run) == pytest.approx(_losses(tmp_path / "single"), rel=1e-4)
    got, expected = read_weights(latest_checkpoint(run), "model"), read_weights(single, "model")
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5, msg=key)


def test_an_async_sharded_save_on_cuda_resumes_bitwise(cuda, tmp_path, pretrained, shapes_dir):
    """Bitwise needs deterministic kernels on CUDA (train.deterministic): cuDNN's and attention's backward
    kernels otherwise sum in a different order on every run, resumed or not."""
    common = ["optim.lr=0.01", "checkpoint.every=1", "checkpoint.format=sharded", "checkpoint.async_save=true",
              "train.deterministic=true"]
    straight = _finetune("finetune-full.yaml", tmp_path / "straight", pretrained, shapes_dir, "train.max_steps=4",
                         *common)
    resumed = tmp_path / "resumed"
    _finetune("finetune-full.yaml", resumed, pretrained, shapes_dir, "train.max_steps=2", *common)
    last = _finetune("finetune-full.yaml", resumed, pretrained, shapes_dir, "train.max_steps=4", *common)
    same_checkpoints(straight, last)


def test_the_loader_pins_batches_and_the_step_copies_them_without_blocking(cuda, tmp_path, pretrained, shapes_dir,
                                                                           monkeypatch):
    from sdtrain.train import tasks

    seen: list[tuple[bool, bool]] = []
    latents = tasks.DiffusionTask._latents

    def record(task, batch, generator):
        pixels = batch.get("pixel_values")
        if pixels is not None:
            seen.append((pixels.is_pinned(), pixels.device.type == "cpu"))
        return latents(task, batch, generator)

    monkeypatch.setattr(tasks.DiffusionTask, "_latents", record)
    _finetune("finetune-full.yaml", tmp_path / "run", pretrained, shapes_dir, "train.max_steps=2",
              "data.num_workers=1")
    assert seen and all(pinned and on_host for pinned, on_host in seen)


def test_compiled_blocks_train_as_eager_ones(cuda, tmp_path, pretrained, shapes_dir):
    """torch.compile of each repeated block (train.compile): the same losses within kernel rounding, and the same
    update (fused kernels round differently, which Adam turns into sign flips where gradients are near zero)."""
    common = ["train.max_steps=3", "optim.lr=0.01", "ema.enabled=false"]
    eager = _finetune("finetune-full.yaml", tmp_path / "eager", pretrained, shapes_dir, *common)
    compiled = _finetune("finetune-full.yaml", tmp_path / "compiled", pretrained, shapes_dir, *common,
                         "train.compile=true")
    assert _losses(tmp_path / "compiled") == pytest.approx(_losses(tmp_path / "eager"), rel=1e-3)
    assert _update_cosine(pretrained, eager, compiled) > 0.99
