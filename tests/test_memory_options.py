"""Options that make big models fit, through the CLI at tiny size: 8-bit AdamW and Adafactor train with the state
they promise and resume bitwise after kill -9, their state restored exactly; asking for one the installed libraries
cannot do is one line before any weight loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from sdtrain.cli.main import main

from .conftest import TINY, config_path, flat_tensors, resumes_bitwise_after_kill_9

CONFIGS = config_path("diffusion.yaml").parents[1]
COMMON = [*TINY, "data.batch_size=2", "validation.prompts=[]", "evaluation.every_samples=0"]


def _full_fine_tune(run: Path, pretrained: Path, shapes_dir: Path, *extra: str) -> list[str]:
    # The UNet's convolutions are large enough (4,096 values and more) for bitsandbytes to keep their moments in
    # 8 bits; it keeps smaller tensors' in fp32.
    return ["train", str(CONFIGS / "finetune-full.yaml"), f"run_dir={run}", *COMMON, f"model.pretrained={pretrained}",
            f"data.shards={shapes_dir}", "train.max_steps=3", "checkpoint.every=1", "optim.warmup_steps=0", *extra]


# Both slow (the suite's time): the 4-bit base's resume below keeps a low-precision state's resume by default.
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) for name in ("adamw8bit", "adafactor")])
def test_optimizers_that_fit_resume_bitwise_after_kill_9_with_their_state(name, tmp_path, pretrained, shapes_dir):
    resumes_bitwise_after_kill_9(lambda run: _full_fine_tune(run, pretrained, shapes_dir, f"optim.name={name}"),
                                 tmp_path)
    final = "checkpoints/step_00000003/optimizer.pt"
    straight, resumed = (flat_tensors(torch.load(tmp_path / run / final, weights_only=True)["state"])
                         for run in ("straight", "killed"))
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    if name == "adamw8bit":  # both moments of the large tensors in 8 bits, with their block scales
        assert any(k.endswith("/state1") and v.dtype == torch.uint8 for k, v in straight.items())
        assert any(k.endswith("/absmax2") for k in straight)
    else:  # factored second moments: a row and a column vector for each matrix, no first moment
        assert any(k.endswith("/row_var") for k in straight) and not any(k.endswith("exp_avg") for k in straight)


def test_an_optimizer_the_installed_libraries_cannot_run_is_one_line(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    # Nothing is read: the model source and the data do not exist.
    assert main(["train", str(CONFIGS / "finetune-full.yaml"), f"run_dir={tmp_path / 'run'}", *COMMON,
                 f"model.pretrained={tmp_path / 'absent'}", "data.shards=absent", "optim.name=adamw8bit"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "error: optim.name: adamw8bit" in error[0]
    assert "pip install 'sdtrain[memory]'" in error[0]
    # A 4-bit base is stored through bitsandbytes too; without it, the planner keeps to fp8.
    assert main(["train", str(CONFIGS / "lora.yaml"), f"run_dir={tmp_path / 'run'}", *COMMON,
                 f"model.pretrained={tmp_path / 'absent'}", "data.shards=absent", "model.frozen_precision=nf4"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "error: model.frozen_precision: nf4" in error[0]
    assert "pip install 'sdtrain[memory]'" in error[0]
    from sdtrain.train.autotune import plan_frozen_precision

    gib = 2**30
    assert plan_frozen_precision({"fp32": 40 * gib, "bf16": 20 * gib, "fp8": 10 * gib, "nf4": 5 * gib}, 0, 0,
                                 10 * gib).precision == "fp8"
    assert main(["train", str(CONFIGS / "finetune-full.yaml"), f"run_dir={tmp_path / 'run'}", "data.shards=absent",
                 f"model.pretrained={tmp_path / 'absent'}", "optim.name=lion"]) == 2
    assert "optim.name: must be one of adamw, adamw8bit, adafactor" in capsys.readouterr().err
    # One rank of an FSDP2 launch: bitsandbytes cannot step its shards, said before any rank connects or loads.
    monkeypatch.setattr(importlib.util, "find_spec", real)
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    assert main(["train", str(CONFIGS / "finetune-full.yaml"), f"run_dir={tmp_path / 'run'}", *COMMON,
                 f"model.pretrained={tmp_path / 'absent'}", "data.shards=absent", "optim.name=adamw8bit",
                 "parallel.strategy=fsdp"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "adamw8bit cannot step FSDP2's sharded parameters" in error[0]


@pytest.mark.parametrize("name", ["adamw8bit", "adafactor"])
def test_stepped_in_backward_they_update_as_when_stepped_after_it(name):
    """optim.in_backward frees each gradient once its parameter has stepped: with 8-bit AdamW or Adafactor the
    full set of gradients then never exists either, and the weights come out the same."""
    from sdtrain.config import OptimConfig
    from sdtrain.train.optim import allocate_state, build_optimizer

    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    in_backward = build_optimizer(list(models[0].parameters()), OptimConfig(name=name, in_backward=True, grad_clip=0))
    after = build_optimizer(list(models[1].parameters()), OptimConfig(name=name))
    for optimizer in (in_backward, after):
        allocate_state(optimizer)
    x = torch.randn(8, 128)
    for _ in range(3):
        models[0](x).pow(2).sum().backward()
        assert all(p.grad is None for p in models[0].parameters())
        models[1](x).pow(2).sum().backward()
        after.step()
        after.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[1].parameters()))


def test_the_memory_estimate_counts_the_state_each_optimizer_keeps():
    """What gradient_checkpointing: auto decides from: per trained fp32 weight, its gradient and AdamW's two moments
    (4 + 4 + 8 bytes), 8-bit AdamW's two bytes, Adafactor's next to nothing; no gradients held when stepped in
    backward."""
    from sdtrain.train.autotune import training_bytes

    weights = [torch.nn.Parameter(torch.zeros(1000, 1000))]

    def state(**options) -> float:
        return training_bytes(weights, [], 0, 1, ema=False, checkpointing=False, **options) / 4e6

    assert state() == 4
    assert state(optimizer="adamw8bit") == 2.5 and state(optimizer="adafactor") == 2
    assert state(optimizer="adafactor", in_backward=True) == 1


def _lora(run: Path, pretrained: Path, shapes_dir: Path, *extra: str) -> list[str]:
    return ["train", str(CONFIGS / "lora.yaml"), f"run_dir={run}", *COMMON, f"model.pretrained={pretrained}",
            f"data.shards={shapes_dir}", "train.max_steps=2", "optim.lr=0.01", "lora.text_encoder=true",
            "train.mixed_precision=fp32", *extra]


def test_lora_over_a_low_precision_base_trains_as_over_fp32_and_writes_the_same_file(tmp_path, pretrained,
                                                                                   shapes_dir):
    """The frozen UNet and text encoder stored in bf16, fp8 or nf4 (model.frozen_precision): the adapters learn what
    they learn over the fp32 base, within the rounding of the stored weights, and the LoRA file has the same keys,
    shapes and dtypes.

    Tolerance, on all up weights together after two steps at lr 0.01 (measured: bf16 2.1-2.4%, fp8 22-25%, nf4 55%;
    cosine 0.9998, 0.97-0.976, 0.847): bf16 within 5%, fp8 within 35% and nf4 within 80% of the fp32 base's
    adapters, in the same direction (cosine above 0.95 for bf16 and fp8, 0.75 for nf4). For scale, the same fp32 run
    from another seed differs by 139%. fp8 e4m3 keeps 3 mantissa bits (a weight is off by up to 6%), NF4 16 levels
    per 64 weights (9% relative error on a Gaussian weight), and Adam's first steps move each weight by about the
    learning rate whatever the gradient's size, so a sign that rounding flips moves a weight the other way."""
    from safetensors.torch import load_file

    files = {}
    for precision in ("fp32", "bf16", "fp8", "nf4"):
        run = tmp_path / precision
        assert main(_lora(run, pretrained, shapes_dir, f"model.frozen_precision={precision}")) == 0
        assert main(["export", str(run), str(tmp_path / f"{precision}-out")]) == 0
        files[precision] = load_file(str(tmp_path / f"{precision}-out" / "pytorch_lora_weights.safetensors"))
    reference = files["fp32"]
    ups = [k for k in reference if "lora.up" in k or "lora_B" in k]
    assert ups and all(reference[k].abs().sum() > 0 for k in ups)  # the adapters trained

    def flat(lora: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([lora[k].flatten() for k in ups])

    for precision, tolerance, cosine in (("bf16", 0.05, 0.95), ("fp8", 0.35, 0.95), ("nf4", 0.8, 0.75)):
        lora = files[precision]
        assert lora.keys() == reference.keys()
        assert all(lora[k].shape == reference[k].shape and lora[k].dtype == reference[k].dtype for k in reference)
        error = ((flat(lora) - flat(reference)).norm() / flat(reference).norm()).item()
        assert error < tolerance, (precision, error)
        assert torch.nn.functional.cosine_similarity(flat(lora), flat(reference), dim=0) > cosine, precision


@pytest.mark.parametrize("precision", ["bf16", "fp8", "nf4"])
def test_a_low_precision_layer_keeps_only_its_stored_bits_for_the_backward(precision):
    """The point of a low-precision base when training: autograd keeps the stored bits, not a full-precision copy
    of each weight, and the input's gradient is the one the rounded weight gives, under autocast too."""
    from sdtrain.models.frozen import store_frozen

    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 256).requires_grad_(False)
    model = torch.nn.Sequential(layer, torch.nn.Linear(256, 4))
    reference = torch.nn.Linear(256, 256).requires_grad_(False)
    saved_bytes = store_frozen(model, precision)
    assert saved_bytes == 256 * 256 * {"bf16": 2, "fp8": 3, "nf4": 3.5}[precision] and layer.weight.numel() == 0
    assert model.state_dict()["0.weight"].numel() == 0 and model.state_dict()["1.weight"].numel() == 256 * 4
    assert model.to(torch.float64)[0].weight_stored.dtype in (torch.int16, torch.uint8)  # casts leave it alone
    model.float()
    with torch.no_grad():  # the weight it computes with, for the reference
        reference.weight.copy_(layer(torch.eye(256)).T - layer.bias[:, None])
        reference.bias.copy_(layer.bias)

    x = torch.randn(8, 256, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = model(x)
    assert not any(t.dtype.is_floating_point and t.shape == (256, 256) for t in kept)
    out.sum().backward()
    expected = x.detach().clone().requires_grad_(True)
    model[1](reference(expected)).sum().backward()
    torch.testing.assert_close(x.grad, expected.grad, rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16


@pytest.mark.parametrize("precision", ["bf16", "fp8", "nf4"])
def test_stored_bits_become_frozen_parameters_fsdp_shards_and_compute_the_same(precision):
    """FSDP2 shards parameters and leaves buffers whole on every rank: under it the stored bits and scales become
    frozen parameters, integers all (its mixed precision casts floating ones), and the layer computes the same."""
    from sdtrain.models.frozen import as_parameters, store_frozen

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 4)).requires_grad_(False)
    store_frozen(model, precision)
    x = torch.randn(3, 128)
    before = model(x)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert as_parameters(model) == buffers > 0 and not list(model.buffers())
    stored = [p for name, p in model.named_parameters() if "weight_s" in name]
    assert stored and all(not p.requires_grad and not p.dtype.is_floating_point for p in stored)
    torch.testing.assert_close(model.float()(x), before, rtol=0, atol=0)
    assert as_parameters(model) == 0  # once


@pytest.mark.parametrize("precision", ["fp8", "nf4"])
def test_a_frozen_base_loads_and_builds_a_tensor_at_a_time_into_what_storing_after_gives(pretrained, precision):
    """From a folder, the linear weights are stored low as they are read (a 12B transformer never exists in fp32);
    built from a preset, a layer at a time. The model is the one loading it whole and storing it afterwards
    gives, bit for bit."""
    from sdtrain.config import ModelConfig
    from sdtrain.loaders.components import load_component
    from sdtrain.models import build
    from sdtrain.models.frozen import store_frozen

    streamed = load_component("unet", pretrained, frozen_precision=precision)
    whole = load_component("unet", pretrained).requires_grad_(False)
    store_frozen(whole, precision)
    assert not any(p.requires_grad for p in streamed.parameters())
    assert {k: v.dtype for k, v in streamed.state_dict().items()} == {k: v.dtype for k, v in whole.state_dict().items()}
    for (name, a), (_, b) in zip(sorted(streamed.named_buffers()), sorted(whole.named_buffers())):
        assert torch.equal(a, b), name
    assert all(torch.equal(streamed.state_dict()[k], v) for k, v in whole.state_dict().items())

    built = build.build_denoiser(ModelConfig(preset="tiny"), 4, 8, derived={"cross_attention_dim": 32},
                                 frozen_precision=precision)
    linears = [m for m in built.modules() if type(m) is torch.nn.Linear]
    assert linears and all(m.weight.numel() == 0 and m.weight_stored.dtype == torch.uint8 for m in linears)
    assert not any(p.is_meta for p in built.parameters())
    out = built(torch.randn(1, 4, 8, 8), 10, encoder_hidden_states=torch.randn(1, 5, 32)).sample
    assert out.shape == (1, 4, 8, 8) and torch.isfinite(out).all()


def test_the_planner_picks_the_most_exact_storage_that_fits():
    from sdtrain.train.autotune import plan_frozen_precision

    gib = 2**30
    stored = {"fp32": 40 * gib, "bf16": 20 * gib, "fp8": 10 * gib, "nf4": 5 * gib}
    assert plan_frozen_precision(stored, 0, 0, 80 * gib)[0] == "fp32"
    assert plan_frozen_precision(stored, 0, 0, 40 * gib)[0] == "bf16"
    # What the process holds and the trained state come out of the same budget.
    precision, why, fits = plan_frozen_precision(stored, 3 * gib, 2 * gib, 40 * gib)
    assert precision == "fp8" and fits and "40.0 GiB in fp32, 20.0 GiB in bf16, 10.0 GiB in fp8, 5.0 GiB in nf4" in why
    # 4-bit only when fp8 does not fit.
    assert plan_frozen_precision(stored, 0, 0, 10 * gib)[:3:2] == ("nf4", True)
    tight = plan_frozen_precision(stored, 0, 0, 5 * gib)
    assert tight.precision == "nf4" and not tight.fits and "even nf4 does not fit" in tight.why
    # A precision the config sets is checked, not changed: model.offload_frozen=auto streams what does not fit.
    fixed = plan_frozen_precision(stored, 0, 0, 40 * gib, fixed="fp32")
    assert fixed.precision == "fp32" and not fixed.fits and "fp32 does not fit" in fixed.why


def test_auto_storage_is_planned_before_loading_logged_and_kept_on_resume(tmp_path, pretrained, shapes_dir,
                                                                         monkeypatch, caplog):
    """model.frozen_precision=auto on a machine with little memory stores the LoRA base in fp8, says why in the
    log, and a resumed run keeps it even where memory would now allow fp32: its adapters trained over that base."""
    import json
    import logging

    from sdtrain.models.frozen import storage_bytes
    from sdtrain.train import autotune

    run = tmp_path / "run"
    auto = ["model.frozen_precision=auto", "lora.text_encoder=false", "train.gradient_checkpointing=auto"]
    # The tiny UNet and text encoder's linear weights, as the planner counts them: a budget that fits only fp8.
    from sdtrain.loaders.components import load_component

    sizes = [storage_bytes(load_component(name, pretrained, weights=False)) for name in ("unet", "text_encoder")]
    stored = {p: sum(size[p] for size in sizes) for p in sizes[0]}
    real = autotune.memory_budget
    monkeypatch.setattr(autotune, "memory_budget", lambda device, processes=1: (
        int((stored["bf16"] + stored["fp8"]) / 2 / autotune.STORED_SHARE), 0))
    with caplog.at_level(logging.INFO, logger="sdtrain"):
        assert main(_lora(run, pretrained, shapes_dir, *auto,
                          "checkpoint.every=1")) == 0
    assert "model.frozen_precision=auto: fp8 (frozen weights take" in caplog.text
    # The plan's estimate beside what the first step then took, before a long run could be killed for memory.
    assert re.search(r"first step: memory peak \d+\.\d\d GiB \(estimated \d+\.\d\d GiB before it\)", caplog.text)
    meta = json.loads((run / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert meta["task"]["frozen_precision"] == "fp8"
    caplog.clear()
    monkeypatch.setattr(autotune, "memory_budget", real)
    with caplog.at_level(logging.INFO, logger="sdtrain"):
        assert main(_lora(run, pretrained, shapes_dir, *auto,
                          "checkpoint.every=1", "train.max_steps=3")) == 0
    assert "model.frozen_precision=auto:" not in caplog.text  # not planned again
    assert "model.frozen_precision=fp8: frozen linear weights take" in caplog.text
    meta = json.loads((run / "checkpoints" / "step_00000003" / "meta.json").read_text())
    assert meta["task"]["frozen_precision"] == "fp8"


def test_lora_over_a_4_bit_base_resumes_bitwise_after_kill_9(tmp_path, pretrained, shapes_dir):
    """NF4 storage is deterministic: a LoRA over the 4-bit base killed after its second checkpoint resumes onto the
    checkpoint of a run never stopped, bit for bit."""
    resumes_bitwise_after_kill_9(
        lambda run: _lora(run, pretrained, shapes_dir, "model.frozen_precision=nf4", "train.max_steps=3",
                          "checkpoint.every=1"), tmp_path)
