"""FLOP counting checked against a count made by hand from a tiny UNet's layer shapes; peak measurement; cpu flags."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sdtrain.flops import count_flops, cpu_flags, measure_peak_flops, mfu, sdpa_backward_flops, sdpa_forward_flops


def tiny_unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64, 64),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8, norm_num_groups=8, cross_attention_dim=64,
    )


def unet_inputs(batch: int = 2, length: int = 77):
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(batch, 4, 16, 16, generator=generator)
    timesteps = torch.randint(0, 1000, (batch,), generator=generator)
    text = torch.randn(batch, length, 64, generator=generator)
    return sample, timesteps, text


def hand_count(unet, sample, timesteps, encoder_hidden_states) -> dict:
    """FLOPs of one forward, and of the backward that follows it, from layer shapes seen by hooks.

    Forward: a Conv2d costs 2 * output elements * (in_channels / groups) * kernel area, a Linear
    2 * output elements * in_features (bias adds are not counted, as torch does not count them), and each diffusers
    Attention's SDPA 2 * batch * heads * Lq * Lk * head_dim for q @ k^T and as much for the weights @ v.
    Backward, by torch's rules: a layer's weight gradient costs as much as its forward, and its input gradient as
    much again, but only when that input requires grad; SDPA's backward costs 2.5 forwards (scores recomputed,
    then dV, dP, dQ, dK: five matmuls of one forward matmul's size). Everything else (GroupNorm, SiLU, softmax,
    interpolation, the sinusoidal timestep features) is counted 0 in both directions.
    """
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    counts = {"forward": 0, "backward": 0, "no_input_grad": []}
    outputs: dict[torch.nn.Module, torch.Tensor] = {}
    names = {module: name for name, module in unet.named_modules()}

    def layer(module, inputs, output, flops: int) -> None:
        outputs[module] = output
        counts["forward"] += flops
        counts["backward"] += flops if module.weight.requires_grad else 0
        if inputs[0].requires_grad:
            counts["backward"] += flops
        else:
            counts["no_input_grad"].append(names[module])

    def conv(module, inputs, output) -> None:
        layer(module, inputs, output,
              2 * output.numel() * (module.in_channels // module.groups) * math.prod(module.kernel_size))

    def linear(module, inputs, output) -> None:
        layer(module, inputs, output, 2 * output.numel() * module.in_features)

    def attention(module, inputs, output) -> None:
        # AttnProcessor2_0 views to_q's (batch, Lq, inner) and to_k's (batch, Lk, inner) outputs as
        # (batch, heads, L, inner // heads) and hands them to F.scaled_dot_product_attention.
        assert isinstance(module.processor, AttnProcessor2_0), type(module.processor)
        query, key, value = outputs[module.to_q], outputs[module.to_k], outputs[module.to_v]
        batch, heads = query.shape[0], module.heads
        head_dim = key.shape[-1] // heads
        shapes = [(batch, heads, t.numel() // (batch * t.shape[-1]), head_dim) for t in (query, key, value)]
        counts["forward"] += sdpa_forward_flops(*shapes)
        counts["backward"] += sdpa_backward_flops(shapes[0], *shapes)
        assert sdpa_forward_flops(*shapes) == 2 * 2 * batch * heads * shapes[0][2] * shapes[1][2] * head_dim
        assert sdpa_backward_flops(shapes[0], *shapes) * 2 == 5 * sdpa_forward_flops(*shapes)

    handles = []
    for module in unet.modules():
        if isinstance(module, torch.nn.Conv2d):
            handles.append(module.register_forward_hook(conv))
        elif isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_hook(linear))
        elif isinstance(module, Attention):
            handles.append(module.register_forward_hook(attention))
    try:
        unet(sample, timesteps, encoder_hidden_states)
    finally:
        for handle in handles:
            handle.remove()
    return counts


@pytest.fixture(scope="module")
def unet_and_hand_count():
    unet = tiny_unet()
    inputs = unet_inputs()
    return unet, inputs, hand_count(unet, *inputs)


def test_forward_count_equals_hand_count(unet_and_hand_count):
    unet, inputs, hand = unet_and_hand_count
    with torch.no_grad():
        counted = count_flops(lambda: unet(*inputs))
    assert hand["forward"] > 0
    assert counted == hand["forward"]


def test_forward_backward_count_follows_torchs_backward_rules(unet_and_hand_count):
    unet, inputs, hand = unet_and_hand_count

    def step():
        unet.zero_grad(set_to_none=True)
        unet(*inputs).sample.float().pow(2).mean().backward()

    counted = count_flops(step)
    # Only the layers fed by data rather than by other layers skip their input gradient: the latents into conv_in,
    # the timestep features into the time MLP, the text embeddings into every cross-attention's key and value.
    skipped = set(hand["no_input_grad"])
    assert "conv_in" in skipped and "time_embedding.linear_1" in skipped
    assert all(name.endswith(("attn2.to_k", "attn2.to_v")) for name in skipped - {"conv_in", "time_embedding.linear_1"})
    assert len(skipped) == 2 + 2 * sum(name.endswith("attn2") for name, _ in unet.named_modules())
    assert counted == hand["forward"] + hand["backward"]
    # So a step costs about 3 forwards: 2 for the layers above, 3 for the other layers, 3.5 for attention (3.05 here).
    assert 2.5 < counted / hand["forward"] < 3.5


def test_cpu_attention_is_counted():
    # CPU SDPA dispatches to an op without a formula in torch's registry; count_flops supplies torch's own.
    q, k, v = (torch.randn(2, 4, length, 8, requires_grad=True) for length in (64, 77, 77))
    forward = 2 * 2 * 2 * 4 * 64 * 77 * 8
    assert count_flops(lambda: F.scaled_dot_product_attention(q, k, v)) == forward
    assert count_flops(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward()) == forward * 7 // 2
    # Which fused kernel ran, as `benchmark train` and `make gpu-check` record it: none where the math path ran.
    kernels: set[str] = set()
    count_flops(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward(), kernels)
    assert kernels == {"flash"}
    with sdpa_kernel([SDPBackend.MATH]):
        kernels.clear()
        count_flops(lambda: F.scaled_dot_product_attention(q, k, v), kernels)
    assert kernels == set()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measure_peak_flops(dtype):
    before = torch.get_num_threads()
    # One thread and a small budget: another process may be timing something on these two cores.
    result = measure_peak_flops(dtype, torch.device("cpu"), threads=1, budget_s=0.3)
    assert torch.get_num_threads() == before
    assert result["dtype"] == {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    assert result["threads"] == 1
    assert result["gemm_gflops"] > 0 and result["conv_gflops"] > 0
    assert result["peak_gflops"] == max(result["gemm_gflops"], result["conv_gflops"])
    assert result["measured"] and all(value > 0 for value in result["measured"].values())


def test_measure_peak_flops_refuses_fp16_on_cpu():
    with pytest.raises(ValueError, match="fp16"):
        measure_peak_flops(torch.float16, torch.device("cpu"), budget_s=0.1)


def test_mfu():
    assert mfu(1e12, 2.0, 1000.0) == pytest.approx(0.5)
    assert mfu(0, 1.0, 100.0) == 0
    with pytest.raises(ValueError):
        mfu(1e9, 0.0, 100.0)
    with pytest.raises(ValueError):
        mfu(1e9, 1.0, 0.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/cpuinfo")
def test_cpu_flags():
    flags = cpu_flags()
    assert set(flags) == {"model", "avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
    assert isinstance(flags["model"], str)
    assert all(isinstance(flags[key], bool) for key in flags if key != "model")


def test_cpu_flags_parses_first_processor(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512f amx_tile\n\n"
                       "processor\t: 1\nmodel name\t: Other\nflags\t\t: avx512_bf16\n")
    flags = cpu_flags(cpuinfo)
    if not flags:
        pytest.skip("not Linux")
    assert flags == {"model": "Some CPU", "avx2": True, "avx512f": True, "avx512_bf16": False, "amx_tile": True,
                     "amx_bf16": False}
    assert cpu_flags(tmp_path / "missing") == {}


def test_model_flops_of_a_checkpointed_step_leave_out_the_recomputation_but_keep_its_memory_saving():
    """The benchmark counts a step's model FLOPs with checkpointing still on: at SDXL 1024 px the step without it
    does not fit, and counting it plainly killed the benchmark for memory."""
    from sdtrain.config import ModelConfig
    from sdtrain.models import build
    from sdtrain.train.parallel import _checkpointed, shard_units, uncounted_recomputation

    torch.manual_seed(0)
    unet = build.build_unet(ModelConfig(), latent_channels=4, latent_size=8, cross_attention_dim=64)
    inputs = (torch.randn(2, 4, 8, 8), torch.tensor([1, 500]), torch.randn(2, 7, 64))

    def step() -> list[torch.Tensor]:
        unet.zero_grad()
        unet(inputs[0], inputs[1], encoder_hidden_states=inputs[2]).sample.square().mean().backward()
        return [p.grad.clone() for p in unet.parameters()]

    plain_flops, plain_grads = count_flops(step), step()
    for block in shard_units(unet):
        block.forward = _checkpointed(block.forward)
    assert count_flops(step) > plain_flops  # the recomputed forwards are work the machine does
    with uncounted_recomputation():
        assert count_flops(step) == plain_flops
        grads = step()
    for plain, checkpointed in zip(plain_grads, grads):
        torch.testing.assert_close(checkpointed, plain)
