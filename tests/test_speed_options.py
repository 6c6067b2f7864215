"""Options that make training faster or lighter must not change what it computes: fused AdamW, the
optimizer step inside backward, EMA every N steps, the precision and checkpointing chosen by measurement,
and parameter counts that match the published ones."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from sdtrain.checkpoint import latest_checkpoint, read_meta
from sdtrain.cli.main import main
from sdtrain.config import EMAConfig, OptimConfig, RunConfig
from sdtrain.train import autotune
from sdtrain.train.ema import EMA
from sdtrain.train.optim import allocate_state, build_optimizer

from .conftest import TINY, config_path


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _train(model: nn.Module, config: OptimConfig, steps: int = 5, eager: bool = False) -> list[torch.Tensor]:
    optimizer = build_optimizer(list(model.parameters()), config)
    if eager:
        before = [p.detach().clone() for p in model.parameters()]
        allocate_state(optimizer)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing moved
        assert all("exp_avg" in optimizer.state[p] for p in model.parameters())
    generator = torch.Generator().manual_seed(1)
    device = next(model.parameters()).device
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(4, 8, generator=generator).to(device)).pow(2).mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_fused_adamw_matches_the_default_loop():
    fused = _train(_model(), OptimConfig(lr=1e-2, fused=True))
    plain = _train(_model(), OptimConfig(lr=1e-2, fused=False))
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert build_optimizer(list(_model().parameters()), OptimConfig()).defaults["fused"]


@pytest.mark.parametrize("config", [OptimConfig(lr=1e-2, weight_decay=0.1), OptimConfig(lr=1e-2, fused=False),
                                    OptimConfig(lr=1e-2, in_backward=True, grad_clip=0)])
def test_optimizer_state_made_before_the_first_step_changes_nothing(config):
    eager = _train(_model(), config, eager=True)
    lazy = _train(_model(), config)
    assert all(torch.equal(a, b) for a, b in zip(eager, lazy))


def test_optimizer_in_backward_matches_a_step_after_backward_and_frees_gradients():
    model = _model()
    in_backward = _train(model, OptimConfig(lr=1e-2, in_backward=True, grad_clip=0))
    after = _train(_model(), OptimConfig(lr=1e-2, grad_clip=0))
    for a, b in zip(in_backward, after):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert all(p.grad is None for p in model.parameters())  # each gradient was dropped once used


def test_ema_every_n_steps_equals_the_per_step_average_of_weights_held_for_n_steps():
    every, steps = 3, 12
    param = nn.Parameter(torch.zeros(5))
    module = nn.Module()
    module.w = param
    sparse = EMA({"m": module}, EMAConfig(decay=0.9, warmup=True, every=every))
    reference = torch.zeros(5)
    values = [torch.full((5,), float(v)) for v in range(1, steps + 1)]
    for step, value in enumerate(values, start=1):
        with torch.no_grad():
            param.copy_(value)
        if sparse.due(step):
            sparse.update(step)
            # Per-step EMA of the weights as they stand now, applied for each step of the period.
            for past in range(step - every, step):
                decay = min(0.9, (1 + past) / (10 + past))
                reference = decay * reference + (1 - decay) * value
    torch.testing.assert_close(sparse.shadow["m.w"], reference)
    assert sparse.updates == steps // every


def test_ema_every_one_is_the_ordinary_per_step_average():
    param = nn.Parameter(torch.zeros(3))
    module = nn.Module()
    module.w = param
    ema = EMA({"m": module}, EMAConfig(decay=0.5, warmup=False))
    expected = torch.zeros(3)
    for step in range(1, 5):
        with torch.no_grad():
            param.add_(1.0)
        ema.update(step)
        expected = 0.5 * expected + 0.5 * param.detach()
    torch.testing.assert_close(ema.shadow["m.w"], expected)


def test_sd2_params_print_the_published_counts(capsys):
    root = config_path("diffusion.yaml").parents[1]
    assert main(["params", str(root / "sd2-256.yaml")]) == 0
    out = capsys.readouterr().out
    # The MosaicML benchmark script's figures for SD2 base.
    assert "Model has 1289.952427 M parameters and 865.910724 M trainable_params" in out
    assert "865,910,724" in out


def test_params_counts_what_a_stage_trains(capsys):
    assert main(["params", str(config_path("autoencoder.yaml")), "--json"]) == 0
    (vae,) = json.loads(capsys.readouterr().out)
    assert vae["name"] == "vae" and vae["trainable"] == vae["parameters"] > 0


def test_mixed_precision_no_on_the_command_line_means_fp32(tmp_path):
    from sdtrain.config import load_config

    config = load_config(config_path("diffusion.yaml"), [f"run_dir={tmp_path}", "data.shards=x", "model.vae=x",
                                                          "train.mixed_precision=no"])
    assert config.train.mixed_precision == "fp32"


def _slow(precision: str, factor: float = 1000.0):
    real = autotune.time_precisions

    def timed(step, params, device, samples, repeats=2):
        timings = real(step, params, device, samples, repeats)
        return {**timings, precision: timings[precision] * factor}

    return timed


AUTO = [*TINY, "train.mixed_precision=auto", "train.max_steps=2", "checkpoint.every=1", "validation.prompts=[]"]


@pytest.mark.parametrize("slow, expected", [("bf16", "fp32"), ("fp32", "bf16")])
def test_auto_precision_picks_the_faster_and_a_resume_keeps_it(tmp_path, shapes_dir, autoencoder_run, monkeypatch,
                                                                caplog, slow, expected):
    monkeypatch.setenv("SDTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(autotune, "time_precisions", _slow(slow))
    run = tmp_path / "run"
    args = ["train", str(config_path("diffusion.yaml")), f"run_dir={run}", f"data.shards={shapes_dir}",
            f"model.vae={autoencoder_run}", *AUTO]
    with caplog.at_level(logging.INFO, logger="sdtrain.train.autotune"):
        assert main(args) == 0
    assert f"precision {expected} (measured: fp32" in caplog.text
    tuning = read_meta(latest_checkpoint(run))["tuning"]
    assert tuning["precision"] == expected and tuning["precision_source"] == "measured"
    assert tuning["fp32_ms"] > 0 and tuning["bf16_ms"] > 0
    # Resumed on the same machine with the other dtype now the faster: the run keeps its choice.
    monkeypatch.setattr(autotune, "time_precisions", _slow(expected))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sdtrain.train.autotune"):
        assert main([*args, "train.max_steps=3"]) == 0
    assert f"precision {expected} (checkpoint" in caplog.text
    assert read_meta(latest_checkpoint(run))["tuning"]["precision"] == expected


def test_a_precision_twice_as_slow_is_timed_once_not_twice(tmp_path):
    model = nn.Linear(64, 64)
    batch = torch.randn(32, 64)
    rounds = []

    def step():
        bf16 = torch.is_autocast_enabled("cpu")
        rounds.append(bf16)
        out = model(batch)
        # The bf16 round does 50 times the work: far past the 2x that settles the choice.
        for _ in range(50 if bf16 else 1):
            out = model(out)
        return out.float().square().mean()

    timings = autotune.time_precisions(step, list(model.parameters()), torch.device("cpu"), samples=32)
    assert timings["bf16"] > 2 * timings["fp32"]
    # The warm-up round and one timed round; a second could not change the answer.
    assert rounds == [False, True] * 2


def test_auto_precision_times_the_bf16_round_in_bf16(tmp_path, shapes_dir, autoencoder_run, monkeypatch):
    # The trial step is the task's own loss; the bf16 round must reach its layers in bf16, or auto compares
    # fp32 with fp32 and picks by noise (on a CPU without bf16 units that can make a run 7x slower).
    monkeypatch.setenv("SDTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    real = autotune.time_precisions
    rounds: list[set[torch.dtype]] = []

    def recording(step, params, device, samples, repeats=2):
        def observed_step():
            dtypes: set[torch.dtype] = set()

            def hook(module, args, output):
                if isinstance(module, (nn.Linear, nn.Conv2d)) and isinstance(output, torch.Tensor):
                    dtypes.add(output.dtype)

            handle = nn.modules.module.register_module_forward_hook(hook)
            try:
                return step()
            finally:
                handle.remove()
                rounds.append(dtypes)

        return real(observed_step, params, device, samples, repeats)

    monkeypatch.setattr(autotune, "time_precisions", recording)
    assert main(["train", str(config_path("diffusion.yaml")), f"run_dir={tmp_path / 'run'}",
                 f"data.shards={shapes_dir}", f"model.vae={autoencoder_run}", *AUTO]) == 0
    # A warm-up round and one or two timed ones, fp32 then bf16 each time; the bf16 rounds compute the layers
    # autocast covers in bf16 (a few, such as the noise mixing, stay fp32 on purpose).
    assert len(rounds) in (4, 6)
    assert all(dtypes == {torch.float32} for dtypes in rounds[0::2])
    assert all(torch.bfloat16 in dtypes for dtypes in rounds[1::2])


def test_forcing_another_precision_on_resume_says_so(tmp_path, shapes_dir, autoencoder_run, caplog):
    run = tmp_path / "run"
    args = ["train", str(config_path("diffusion.yaml")), f"run_dir={run}", f"data.shards={shapes_dir}",
            f"model.vae={autoencoder_run}", *TINY, "train.max_steps=1", "validation.prompts=[]"]
    assert main(args) == 0
    with caplog.at_level(logging.WARNING):
        assert main([*args, "train.max_steps=2", "train.mixed_precision=bf16"]) == 0
    assert "changes this run's precision from fp32" in caplog.text


def test_layer_calls_are_recorded_on_fake_tensors_and_on_real_ones_where_a_forward_reads_a_value():
    """The planner records a model's layer calls without computing them (a 480p clip of 81 frames through a 14B
    model is an hour's forward on a CPU); a forward that needs a value (`.item()`) is recorded from a real run, with
    the same calls."""
    from torch._subclasses.fake_tensor import FakeTensor

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(), nn.Conv2d(8, 8, 3, padding=1))
    batch = torch.randn(1, 3, 16, 16)
    seen = []

    def forward():
        out = model(batch)
        seen.append(isinstance(out, FakeTensor))
        return out

    def reading_forward():
        out = forward()
        return out * out.mean().item()

    calls = autotune.record_layer_calls({"m": model}, forward).calls
    assert seen == [True]
    assert sorted(c.calls for c in calls.values()) == [1, 1, 1]
    # The norm's input, the largest: 8 x 16 x 16 fp32 values a sample.
    assert max(c.activation_bytes for c in calls.values()) == 8 * 16 * 16 * 4
    assert autotune.record_layer_calls({"m": model}, reading_forward).calls.keys() == calls.keys()
    assert seen == [True, True, False]


def test_a_recording_on_fake_tensors_leaves_no_fake_tensor_in_a_models_caches():
    """Diffusers' Qwen-Image caches its rotary frequencies in an lru_cache of a method; others on an attribute or in
    a dict: the real steps after a recording must not read the recording's fake tensors from them."""
    import functools

    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.table: dict[int, torch.Tensor] = {}

        @functools.cache  # noqa: B019 - as diffusers caches, by instance
        def frequencies(self, n: int) -> torch.Tensor:
            return torch.arange(n, dtype=torch.float32)

        def forward(self, x):
            self.last = self.table.setdefault(x.shape[0], torch.ones(x.shape[0], 1))
            return self.proj(x) * self.frequencies(x.shape[-1]) * self.last

    model = Cached()
    x = torch.randn(2, 4)
    autotune.record_layer_calls({"m": model}, lambda: model(x))
    torch.testing.assert_close(model(x), model.proj(x) * torch.arange(4.0))
    assert not hasattr(Cached, "last") and type(model.table[2]) is torch.Tensor


def test_with_checkpointing_the_plan_keeps_each_blocks_input_and_one_blocks_inside():
    """What checkpointing keeps is each block's input plus one block's activations as backward recomputes it, not a
    fixed share of them all: for a deep model at a long sequence the share said 48 GiB where the blocks need 15."""
    blocks = [nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3)]
    model = nn.Sequential(nn.Linear(4, 64), *blocks, nn.Linear(64, 2))
    record = autotune.record_layer_calls({"m": model}, lambda: model(torch.randn(5, 10, 4)), blocks)
    row = 10 * 4  # bytes of one fp32 value for each of a sample's 10 tokens
    assert record.outside_bytes == (4 + 64) * row and record.block_input_bytes == 3 * 64 * row
    assert record.largest_block_bytes == (64 + 256) * row
    assert record.activation_bytes() == (4 + 64 + 3 * (64 + 256)) * row
    assert record.checkpointed_bytes() == int(autotune.ELEMENTWISE * (4 + 64 + 64 + 256) * row) + 3 * 64 * row
    assert autotune.record_layer_calls({"m": model}, lambda: model(torch.randn(5, 10, 4))).checkpointed_bytes() is None
    # Under bf16 autocast each block's weight copies are cast again as it is recomputed: one block's stay, not all.
    block_casts = 2 * sum(p.numel() for p in blocks[0].parameters())
    assert autotune._spared_cast_bytes(blocks) == 2 * block_casts
    params = list(model.parameters())
    plain, checkpointed = (autotune.training_bytes(
        [], params, 0, 1, ema=False, checkpointing=on, bf16=True, checkpointed_bytes_per_sample=0,
        spared_cast_bytes=2 * block_casts) for on in (False, True))
    assert plain - checkpointed == 2 * block_casts


def test_measured_precision_times_the_whole_step_and_is_cached_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("SDTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "CONTENDED_SHARE", 0.0)  # whatever else the test machine runs meanwhile
    # Every round, however the timings fall: a precision twice as fast as the other would end the rounds early.
    monkeypatch.setattr(autotune, "DECISIVE_RATIO", float("inf"))
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(), nn.Conv2d(8, 8, 3, padding=1))
    batch = torch.randn(4, 3, 16, 16)
    calls = autotune.record_layer_calls({"m": model}, lambda: model(batch[:1])).calls
    # Two distinct convolutions and one norm; the layer calls keep their real input shapes.
    assert sorted(c.calls for c in calls.values()) == [1, 1, 1]
    fingerprint = sorted((k, c.calls) for k, c in calls.items())
    steps = []

    def step():
        steps.append(torch.is_autocast_enabled("cpu"))
        return model(batch).square().mean()

    params = list(model.parameters())
    first, source = autotune.measured_precision(fingerprint, step, params, torch.device("cpu"), samples=4)
    assert source == "measured" and first["fp32"] > 0 and first["bf16"] > 0
    # A warm-up round and two timed ones, the precisions alternating.
    assert steps == [False, True] * 3
    again, source = autotune.measured_precision(fingerprint, step, params, torch.device("cpu"), samples=4)
    assert source == "cache" and again == first and len(steps) == 6
    # Another batch size is another measurement: what is fastest depends on it.
    _, source = autotune.measured_precision(fingerprint, step, params, torch.device("cpu"), samples=2)
    assert source == "measured"
    assert all(p.grad is None for p in model.parameters())


def test_precision_timings_taken_while_another_job_held_the_cores_are_not_cached(tmp_path, monkeypatch, caplog):
    """Timings measured on shared cores (this process getting half its threads' time made bf16 5x slower than fp32
    for the demo's autoencoder, against 1.5x faster alone) would decide every later run on the machine."""
    monkeypatch.setenv("SDTRAIN_CACHE_DIR", str(tmp_path))
    model = nn.Linear(8, 8)
    clock = iter([0.0, 0.1])  # the process's CPU seconds before and after: a tenth of the wall time below
    monkeypatch.setattr(autotune.time, "process_time", lambda: next(clock))
    monkeypatch.setattr(autotune, "time_precisions", lambda *a: {"fp32": 1.0, "bf16": 2.0})
    wall = iter([0.0, 1.0])
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: next(wall))
    timings, source = autotune.measured_precision(["x"], lambda: model(torch.ones(1, 8)).sum(),
                                                  list(model.parameters()), torch.device("cpu"), samples=1)
    assert source == "measured" and timings == {"fp32": 1.0, "bf16": 2.0}
    assert not (tmp_path / "precision.json").exists() and "not cached" in caplog.text


def test_checkpointing_auto_turns_on_only_when_memory_would_not_fit():
    big = [nn.Parameter(torch.empty(1000))]
    fits = autotune.training_bytes(big, [], activation_bytes_per_sample=10_000, batch_size=2, ema=True,
                                   checkpointing=False)
    assert fits == 1000 * 4 * 5 + 1.5 * 10_000 * 2
    lighter = autotune.training_bytes(big, [], 10_000, 2, ema=True, checkpointing=True)
    assert lighter < fits


def test_resume_is_bitwise_with_every_speed_option_on(tmp_path, shapes_dir, autoencoder_run, monkeypatch):
    # The straight run's measured precision and encode are cached for the stopped one however busy the machine is:
    # measured twice on shared cores, the two could choose differently (and differ by design, not by their resume).
    monkeypatch.setattr(autotune, "CONTENDED_SHARE", 0.0)
    monkeypatch.setenv("SDTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    options = ["optim.fused=true", "ema.every=2", "train.mixed_precision=auto", "train.gradient_checkpointing=auto",
               "optim.in_backward=true", "optim.grad_clip=0", "validation.prompts=[]", "checkpoint.every=3",
               "train.encode=auto"]

    def run(folder, steps):
        assert main(["train", str(config_path("diffusion.yaml")), f"run_dir={folder}", f"data.shards={shapes_dir}",
                     f"model.vae={autoencoder_run}", *TINY, *options, f"train.max_steps={steps}"]) == 0

    run(tmp_path / "straight", 6)
    run(tmp_path / "stopped", 3)
    run(tmp_path / "stopped", 6)
    for name in ("model.safetensors", "ema.safetensors"):
        a = load_file(str(latest_checkpoint(tmp_path / "straight") / name))
        b = load_file(str(latest_checkpoint(tmp_path / "stopped") / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_checkpointing_auto_turns_on_when_the_machine_is_too_small(tmp_path, shapes_dir, autoencoder_run, monkeypatch,
                                                                   caplog):
    caplog.set_level("WARNING")
    monkeypatch.setattr(autotune, "_available_bytes", lambda device: 2**20)  # a 1 MiB machine
    run = tmp_path / "run"
    assert main(["train", str(config_path("diffusion.yaml")), f"run_dir={run}", f"data.shards={shapes_dir}",
                 f"model.vae={autoencoder_run}", *TINY, "train.gradient_checkpointing=auto", "train.max_steps=1",
                 "validation.prompts=[]"]) == 0
    tuning = read_meta(latest_checkpoint(run))["tuning"]
    assert tuning["checkpointing"] is True and tuning["estimated_gib"] > tuning["available_gib"]
    # Even checkpointed it cannot fit in 1 MiB: said before the first step, not left to the kernel's OOM killer.
    assert "even with gradient checkpointing" in caplog.text and "likely be killed for memory" in caplog.text


def test_a_save_without_validation_builds_no_second_model(tmp_path, shapes_dir, autoencoder_run, monkeypatch):
    import sdtrain.train.trainer as trainer

    built = []
    real = trainer.instantiate_with
    monkeypatch.setattr(trainer, "instantiate_with", lambda *a: built.append(a) or real(*a))
    base = ["train", str(config_path("diffusion.yaml")), f"data.shards={shapes_dir}", f"model.vae={autoencoder_run}",
            *TINY, "train.max_steps=1"]
    assert main([*base, f"run_dir={tmp_path / 'quiet'}", "validation.prompts=[]"]) == 0
    assert built == []
    assert main([*base, f"run_dir={tmp_path / 'grid'}", "validation.prompts=[a red circle]", "validation.steps=2"]) == 0
    # One module per trained component (this config trains the text encoder too), sharing the saved tensors.
    assert sorted(spec["class"] for spec, _ in built) == ["CLIPTextModel", "UNet2DConditionModel"]
    assert (tmp_path / "grid" / "samples").is_dir()


@pytest.mark.parametrize(("bf16", "expected"), [(True, "bf16"), (False, "fp32")])
def test_a_model_sharded_as_it_reaches_the_device_is_not_measured_before_its_first_step(monkeypatch, bf16, expected):
    """Under FSDP on GPUs the denoiser waits in host memory until sharding moves each block's shard to its GPU: no
    step can run on the whole model first, so auto precision is the device's bf16 (fp32 without it) and auto
    checkpointing is on, neither measured; what the config sets is kept."""
    from sdtrain.config import RunConfig

    class Staged:
        def staged_on_host(self):
            return True

    monkeypatch.setattr(autotune, "bf16_supported", lambda device: bf16)
    monkeypatch.setattr(autotune, "_record", lambda *_: pytest.fail("a step ran on the staged model"))
    monkeypatch.setattr(autotune, "measured_precision", lambda *_: pytest.fail("a precision was timed"))
    config = RunConfig()
    tuning = autotune._decide(config, Staged(), False, None, torch.device("cpu"), 1, 0)
    assert (tuning.precision, tuning.checkpointing) == (expected, True)
    assert "not measured" in tuning.precision_source
    config.train.gradient_checkpointing, config.train.mixed_precision = False, "fp32"
    tuning = autotune._decide(config, Staged(), False, None, torch.device("cpu"), 1, 0)
    assert (tuning.precision, tuning.checkpointing, tuning.precision_source) == ("fp32", False, "config")


def test_only_the_denoiser_fsdp_shards_on_gpus_waits_in_host_memory(monkeypatch):
    from sdtrain.config import RunConfig
    from sdtrain.models.families.flux2 import FLUX2
    from sdtrain.train.storage import FrozenStorage

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    config = RunConfig()
    config.parallel.strategy = "fsdp"
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    staged = FrozenStorage(config, cuda, FLUX2, lambda name: True, {})
    assert staged.stages("transformer") and not staged.stages("vae") and not staged.stages("text_encoder")
    assert not FrozenStorage(config, cpu, FLUX2, lambda name: True, {}).stages("transformer")  # already there
    config.parallel.strategy = "ddp"
    assert not FrozenStorage(config, cuda, FLUX2, lambda name: True, {}).stages("transformer")


def test_a_training_step_allows_no_cudnn_attention_unless_asked(tmp_path, shapes_dir, monkeypatch):
    """cuDNN's SDPA backward returns NaN gradients on H100/H200 with a mask at sequence lengths of 64 mod 128
    (pytorch/pytorch#196678): a step allows flash, efficient and math attention on CUDA, what the config lists."""
    from sdtrain.train.trainer import Trainer, allow_attention_kernels

    cuda = torch.backends.cuda
    seen = []
    step = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self: seen.append(
        (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.cudnn_sdp_enabled(),
         cuda.math_sdp_enabled())) or step(self))
    common = ["train", str(config_path("autoencoder.yaml")), f"data.shards={shapes_dir}", *TINY, "train.max_steps=1"]
    try:
        assert main([*common, f"run_dir={tmp_path / 'default'}"]) == 0
        assert main([*common, f"run_dir={tmp_path / 'math'}", "train.attention_kernels=[math,cudnn]"]) == 0
    finally:
        allow_attention_kernels(RunConfig().train.attention_kernels)  # the switches are process-wide
    assert seen == [(True, True, False, True), (False, False, True, True)]
    assert main([*common, f"run_dir={tmp_path / 'bad'}", "train.attention_kernels=[fast]"]) == 2


def test_the_encode_is_the_fastest_way_whose_latents_agree_with_fp32s():
    timings = {"fp32": 100.0, "bf16": 60.0, "fp32+channels_last": 80.0, "bf16+channels_last": 40.0}
    errors = {"fp32": 0.0, "bf16": 0.004, "fp32+channels_last": 1e-7, "bf16+channels_last": 0.004}
    assert autotune.choose_encoding(timings, errors) == "bf16+channels_last"
    # Latents too far from fp32's are not kept however fast; a gain within timing noise does not switch.
    assert autotune.choose_encoding(timings, {**errors, "bf16+channels_last": 0.05}) == "bf16"
    assert autotune.choose_encoding({**timings, "bf16": 97.0, "fp32+channels_last": 99.0,
                                     "bf16+channels_last": 98.0}, errors) == "fp32"


def test_an_autoencoder_of_3d_convolutions_encodes_in_the_contiguous_layout_alone():
    """A video codec's (Qwen-Image's, Wan's) 3D convolutions have no channels_last layout: auto does not time it, and
    asking for it is one line."""
    from sdtrain.errors import UserError

    planar, volumetric = nn.Sequential(nn.Conv2d(3, 4, 3)), nn.Sequential(nn.Conv3d(3, 4, 3))
    assert autotune.encoding_ways(planar) == ("fp32", "bf16", "fp32+channels_last", "bf16+channels_last")
    assert autotune.encoding_ways(volumetric) == ("fp32", "bf16")
    with pytest.raises(UserError, match="3D"):
        autotune.Encoding("bf16+channels_last").place(volumetric)
    autotune.Encoding("bf16").place(volumetric)


def test_a_run_started_before_the_encode_was_chosen_resumes_encoding_in_fp32(monkeypatch):
    """Its checkpoint's tuning names no encode: it encoded in fp32, and resumes so, measuring nothing."""
    class Task:
        vae = nn.Conv2d(3, 4, 3)

        def clip_reading(self):
            return {"clips": False, "frame_step": 1}

    monkeypatch.setattr(autotune, "time_encodings", lambda *a, **k: pytest.fail("measured on resume"))
    config = RunConfig()
    config.stage, config.train.encode = "diffusion", "auto"
    assert autotune._decide_encoding(config, Task(), False, {"precision": "bf16"}, torch.device("cpu")) == \
        ("fp32", "checkpoint", None)


def test_a_run_measures_its_encode_records_it_and_a_resume_keeps_it(tmp_path, shapes_dir, autoencoder_run,
                                                                    monkeypatch, caplog):
    monkeypatch.setenv("SDTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    # Whatever this machine measures, bf16 in the channels_last layout is made the fastest.
    real = autotune.time_encodings

    def timed(encode_with, device, samples, ways, repeats=2):
        timings, errors = real(encode_with, device, samples, ways, repeats=0)
        return {**timings, "bf16+channels_last": 0.0}, errors

    monkeypatch.setattr(autotune, "time_encodings", timed)
    run = tmp_path / "run"
    args = ["train", str(config_path("diffusion.yaml")), f"run_dir={run}", f"data.shards={shapes_dir}",
            f"model.vae={autoencoder_run}", *TINY, "train.encode=auto", "validation.prompts=[]", "checkpoint.every=1"]
    with caplog.at_level("INFO", logger="sdtrain"):
        assert main([*args, "train.max_steps=1"]) == 0
    tuning = read_meta(latest_checkpoint(run))["tuning"]
    assert (tuning["encode"], tuning["encode_source"]) == ("bf16+channels_last", "measured")
    assert "train.encode=auto: bf16+channels_last" in caplog.text
    monkeypatch.setattr(autotune, "time_encodings", lambda *a, **k: pytest.fail("measured again on resume"))
    assert main([*args, "train.max_steps=2"]) == 0
    tuning = read_meta(latest_checkpoint(run))["tuning"]
    assert (tuning["encode"], tuning["encode_source"]) == ("bf16+channels_last", "checkpoint")


def test_the_tuned_switch_turns_on_each_speed_key_that_is_not_set():
    from sdtrain.config import TrainConfig
    from sdtrain.errors import UserError

    plain = TrainConfig()
    assert not plain.compiles(cuda=True) and not plain.searches_convolutions(fixed_shapes=True)
    tuned = TrainConfig(tuned=True)
    assert tuned.compiles(cuda=True) and tuned.searches_convolutions(fixed_shapes=True)
    assert not tuned.compiles(cuda=False)  # measured slower on CPUs: compiled there only when asked
    assert not tuned.searches_convolutions(fixed_shapes=False)  # aspect buckets: one search per shape
    assert not TrainConfig(tuned=True, compile=False).compiles(cuda=True)
    assert TrainConfig(compile=True).compiles(cuda=False)
    TrainConfig(tuned=True, cuda_graphs=True).validate()
    assert not TrainConfig(tuned=True, deterministic=True).searches_convolutions(fixed_shapes=True)
    with pytest.raises(UserError, match=r"^train.cuda_graphs: .*train.compile=true"):
        TrainConfig(cuda_graphs=True).validate()
    with pytest.raises(UserError, match=r"^train.cuda_graphs: .*train.grad_accum=1"):
        TrainConfig(tuned=True, cuda_graphs=True, grad_accum=2).validate()
    with pytest.raises(UserError, match=r"^train.channels_last: must be auto, true or false"):
        TrainConfig(channels_last="yes").validate()


def test_a_layout_is_chosen_for_convolutional_denoisers_only():
    from diffusers import FluxTransformer2DModel, UNet2DConditionModel

    unet = UNet2DConditionModel(block_out_channels=(8, 16), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), layers_per_block=1,
                                cross_attention_dim=8, norm_num_groups=4, attention_head_dim=2, sample_size=8)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                         attention_head_dim=4, num_attention_heads=2, joint_attention_dim=8,
                                         pooled_projection_dim=8, axes_dims_rope=(2, 2, 0))
    assert autotune.is_convolutional([unet]) and not autotune.is_convolutional([transformer])


def test_channels_last_is_timed_against_the_contiguous_layout_with_the_same_loss():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(), nn.Conv2d(8, 3, 3, padding=1))
    pixels = torch.randn(2, 3, 16, 16)
    timings, difference = autotune.time_layouts(lambda: model(pixels).square().mean(), [model],
                                                list(model.parameters()), torch.device("cpu"), samples=2, bf16=False)
    assert set(timings) == {"contiguous", "channels_last"} and all(ms > 0 for ms in timings.values())
    assert difference < autotune.CHANNELS_LAST_TOLERANCE
    # Left as found: contiguous weights, no gradient.
    assert model[0].weight.is_contiguous() and all(p.grad is None for p in model.parameters())


def test_a_tuned_run_measures_its_layout_trains_in_it_and_resumes_bitwise(tmp_path, shapes_dir, autoencoder_run,
                                                                          monkeypatch, caplog):
    # Compilation is the slow tests' (test_train.py); here the layout the tuned path measures, records and keeps.
    monkeypatch.setenv("SDTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(autotune, "CONTENDED_SHARE", 0.0)  # cached however busy the cores
    real = autotune.time_layouts

    def timed(step, modules, params, device, samples, bf16, repeats=1):  # channels_last made the faster
        timings, difference = real(step, modules, params, device, samples, bf16, repeats=0)
        return {**timings, "channels_last": 0.0}, difference

    monkeypatch.setattr(autotune, "time_layouts", timed)
    layouts = []
    real_place = autotune.place_layout
    monkeypatch.setattr(autotune, "place_layout", lambda modules, channels_last: layouts.append(channels_last)
                        or real_place(modules, channels_last))
    args = ["train", str(config_path("diffusion.yaml")), f"data.shards={shapes_dir}", f"model.vae={autoencoder_run}",
            *TINY, "train.tuned=true", "validation.prompts=[]", "checkpoint.every=2"]
    with caplog.at_level("INFO", logger="sdtrain"):
        assert main([*args, f"run_dir={tmp_path / 'straight'}", "train.max_steps=4"]) == 0
    tuning = read_meta(latest_checkpoint(tmp_path / "straight"))["tuning"]
    assert (tuning["channels_last"], tuning["channels_last_source"]) == (True, "measured")
    assert (tuning["compile"], tuning["cuda_graphs"], tuning["cudnn_benchmark"]) == (False, False, False)
    assert layouts[-1] is True and "tuned path: compiled blocks off, channels_last on (measured)" in caplog.text
    monkeypatch.setattr(autotune, "time_layouts", lambda *a, **k: pytest.fail("measured again on resume"))
    stopped = tmp_path / "stopped"
    assert main([*args, f"run_dir={stopped}", "train.max_steps=2"]) == 0  # from the cache
    assert main([*args, f"run_dir={stopped}", "train.max_steps=4"]) == 0  # from its checkpoint
    assert read_meta(latest_checkpoint(stopped))["tuning"]["channels_last_source"] == "checkpoint"
    for name in ("model.safetensors", "ema.safetensors"):
        a = load_file(str(latest_checkpoint(tmp_path / "straight") / name))
        b = load_file(str(latest_checkpoint(stopped) / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_tuned_path_decides_each_switch_for_the_device_and_the_run():
    """What train.tuned turns on where, decided on a CPU as a GPU run would decide it."""
    import dataclasses

    from diffusers import UNet2DConditionModel

    from sdtrain.config import RunConfig
    from sdtrain.errors import UserError

    unet = UNet2DConditionModel(block_out_channels=(8, 16), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), layers_per_block=1,
                                cross_attention_dim=8, norm_num_groups=4, attention_head_dim=2, sample_size=8)

    class Task:
        def parallel_modules(self):
            return {"unet": unet}

        def staged_on_host(self):
            return False

    def decide(device="cuda", checkpointing=False, buckets=False, **train):
        config = RunConfig()
        config.train = dataclasses.replace(config.train, tuned=True, channels_last=False, **train)
        config.data = dataclasses.replace(config.data, aspect_buckets=buckets)
        tuning = autotune.Tuning("bf16", checkpointing, "config")
        return autotune._decide_tuned_path(config, Task(), False, None, torch.device(device), tuning, False)

    gpu = decide()
    assert (gpu.compile, gpu.cuda_graphs, gpu.cudnn_benchmark) == (True, False, True)  # graphs: asked for alone
    cpu = decide("cpu", cuda_graphs=True)
    assert (cpu.compile, cpu.cuda_graphs, cpu.cudnn_benchmark) == (False, False, False)
    bucketed = decide(buckets=True)  # a shape per bucket: an algorithm search per shape
    assert bucketed.compile and not bucketed.cudnn_benchmark
    assert decide(cuda_graphs=True).cuda_graphs and not decide(compile=False, cuda_graphs=False).compile
    with pytest.raises(UserError, match=r"^train.cuda_graphs: gradient checkpointing runs each block again"):
        decide(checkpointing=True, cuda_graphs=True)  # a recomputed block would replay twice a step


def test_a_run_resumed_in_another_layout_steps_its_optimizer_as_before(tmp_path, shapes_dir, autoencoder_run):
    """A checkpoint saved in channels_last resumed contiguous (the layout forced off): the optimizer's moments are
    laid out as the weights again, or the fused AdamW pairs each weight with another's moments."""
    args = ["train", str(config_path("diffusion.yaml")), f"data.shards={shapes_dir}", f"model.vae={autoencoder_run}",
            *TINY, "validation.prompts=[]", "checkpoint.every=2", "optim.fused=true"]
    assert main([*args, f"run_dir={tmp_path / 'straight'}", "train.channels_last=true", "train.max_steps=4"]) == 0
    switched = tmp_path / "switched"
    assert main([*args, f"run_dir={switched}", "train.channels_last=true", "train.max_steps=2"]) == 0
    assert main([*args, f"run_dir={switched}", "train.channels_last=false", "train.max_steps=4"]) == 0
    a = load_file(str(latest_checkpoint(tmp_path / "straight") / "model.safetensors"))
    b = load_file(str(latest_checkpoint(switched) / "model.safetensors"))
    for key in a:  # the same arithmetic summed in another order: equal to rounding
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)
