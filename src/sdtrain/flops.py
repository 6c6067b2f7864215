"""FLOP counts and measured peak throughput, for model FLOPs utilisation (MFU) in `sdtrain benchmark train`.

Images per second says how fast a step is on this machine; MFU says how far it is from what the machine could do,
which is what tells an optimisation worth chasing from one that is not. Both halves of the ratio are measured
rather than assumed:

- The numerator is torch's own `FlopCounterMode` run over a real step, so it follows whatever the model does
  (cross-attention lengths, GEGLU widths, skipped input gradients) instead of a formula kept by hand. On CPU,
  `scaled_dot_product_attention` dispatches to an op torch's counter has no formula for and silently counts as 0
  (a third of a small UNet's step time); `count_flops` adds torch's own SDPA formulas for that op.
- The denominator is measured: vendor peaks mean little on these CPUs. On one 2-core EPYC the fp32 GEMM (MKL)
  reached about 210 GFLOP/s while fp32 convolutions (oneDNN, AVX-512) reached about 500 and bf16 about 950; on
  other machines bf16 was slower than fp32. `measure_peak_flops` times large GEMMs and 3x3 convolutions in the
  step's dtype with the step's thread count, and reports the best of both as the peak.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["count_flops", "cpu_flags", "measure_peak_flops", "mfu", "sdpa_backward_flops", "sdpa_forward_flops"]

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# (m, k, n) of torch.mm, cheapest first: the first one doubles as the probe that tells how fast this
# dtype is here, so a machine that emulates bf16 slowly does not spend its whole budget on one 4096^3 product.
# The rectangular ones are the shapes of SD's attention and feed-forward projections at 256-512 px.
GEMM_SHAPES = ((512, 512, 512), (1024, 1024, 1024), (2048, 1024, 2048), (2048, 2048, 2048), (4096, 1024, 4096),
               (4096, 4096, 4096))
# (batch, in channels, out channels, size) of a 3x3 convolution with padding 1: SD2's UNet levels at 256 px.
CONV_SHAPES = ((2, 640, 640, 16), (2, 320, 320, 32), (2, 640, 640, 32))
# Share of the budget the GEMMs get before the convolutions start; the convolutions get the rest.
GEMM_SHARE = 0.6
MAX_REPEATS = 10


def sdpa_forward_flops(query_shape, key_shape, value_shape) -> int:
    """FLOPs of attention's two matmuls, q @ k^T and softmax(..) @ v, counted as torch counts them.

    Shapes are (batch, heads, length, head_dim); key/value may have fewer heads (grouped-query attention).
    """
    b, h, s_q, d_q = query_shape
    s_k, d_v = key_shape[2], value_shape[3]
    return 2 * b * h * s_q * s_k * d_q + 2 * b * h * s_q * s_k * d_v


def sdpa_backward_flops(grad_out_shape, query_shape, key_shape, value_shape) -> int:
    """FLOPs of attention's backward by torch's rule: the scores recomputed, then dV, dP, dQ and dK.

    That is 2.5 times the forward when the query and value head dims are equal.
    """
    b, h, s_q, d_q = query_shape
    s_k, d_v = key_shape[2], value_shape[3]
    return 2 * b * h * s_q * s_k * (3 * d_q + 2 * d_v)


def _forward_formula(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_forward_flops(query_shape, key_shape, value_shape)


def _backward_formula(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flops(grad_out_shape, query_shape, key_shape, value_shape)


def _missing_formulas() -> dict[Any, Callable[..., int]]:
    # CPU's fused attention ops are absent from torch's flop registry (torch 2.4-2.13 at least). Formulas for them
    # are passed per counter, not registered globally, so nothing changes for other users of FlopCounterMode;
    # if torch adds its own, these give the same numbers.
    formulas = {}
    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", _forward_formula),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward", _backward_formula)):
        if hasattr(torch.ops.aten, name):
            formulas[getattr(torch.ops.aten, name)] = formula
    return formulas


SDPA_KERNELS = {
    "_scaled_dot_product_flash_attention": "flash", "_scaled_dot_product_flash_attention_for_cpu": "flash",
    "_scaled_dot_product_efficient_attention": "efficient", "_scaled_dot_product_cudnn_attention": "cudnn",
    "_flash_attention_forward": "flash", "_efficient_attention_forward": "efficient",
}
"""The fused attention kernel each of torch's SDPA ops (forward, and with ``_backward`` its backward) runs: a call
none of them ran went through the math path, as a plain softmax of matmuls."""


def count_flops(fn: Callable[[], Any], attention: set[str] | None = None) -> int:
    """Run `fn()` and return the FLOPs torch counts in it: matmuls, convolutions and attention, forward and backward.
    `attention`, where given, gets the fused SDPA kernels that ran (`SDPA_KERNELS`' names).

    A multiply-add counts as 2 FLOPs; normalisations, activations, softmax and optimizer updates count as 0.
    Run it on a step after warm-up, outside timing: the counter's dispatch mode slows every op down.
    """
    counter = FlopCounterMode(display=False, custom_mapping=_missing_formulas())
    counter.mod_tracker = _TotalsOnly()
    with counter:
        fn()
    if attention is not None:
        for op in counter.get_flop_counts().get("Global", {}):
            name = str(op).removeprefix("aten.").removesuffix("_backward")
            if name in SDPA_KERNELS:
                attention.add(SDPA_KERNELS[name])
    return int(counter.get_total_flops())


class _TotalsOnly:
    """Stands in for FlopCounterMode's per-module tracker, which a total does not need. The tracker's global module
    hooks also fire on a checkpointed block's recomputation in backward, and the gradient hooks they put on its
    outputs, which no backward reaches, keep that block's recomputed graph until the count ends: 140 MB per
    Flux.1-dev block at 256 px, so the counted step of Flux.1-dev LoRA peaked at 22.3 GiB where its steps take
    14.2 GiB."""

    parents = ("Global",)

    def __enter__(self) -> _TotalsOnly:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def mfu(flops_per_step: float, step_seconds: float, peak_gflops: float) -> float:
    """Fraction of the measured peak a step achieves. Above 1 means the peak was measured under other load."""
    if step_seconds <= 0 or peak_gflops <= 0:
        raise ValueError(f"step_seconds ({step_seconds}) and peak_gflops ({peak_gflops}) must be positive")
    return flops_per_step / step_seconds / (peak_gflops * 1e9)


def _synchronizer(device: torch.device) -> Callable[[], None]:
    backend = getattr(torch, device.type, None)
    if device.type != "cpu" and backend is not None and hasattr(backend, "synchronize"):
        return lambda: backend.synchronize(device)
    return lambda: None


def _best_gflops(run: Callable[[], Any], flops: int, share: float, sync: Callable[[], None]) -> float:
    # At least two runs: the first pays for oneDNN's kernel generation and the first touch of the output.
    best, spent, repeats = math.inf, 0.0, 0
    while repeats < 2 or (spent + best <= share and repeats < MAX_REPEATS):
        sync()
        start = time.perf_counter()
        run()
        sync()
        elapsed = time.perf_counter() - start
        best, spent, repeats = min(best, elapsed), spent + elapsed, repeats + 1
    return flops / best / 1e9


def _run_phase(workloads: list[tuple[str, int, Callable[[], Callable[[], Any]]]], deadline: float,
               sync: Callable[[], None], rate_guess: float | None, results: dict[str, float]) -> float:
    """Time workloads (name, flops, setup returning the runnable) until `deadline`; return the best GFLOP/s.

    Each workload gets an equal share of the time left; one whose two runs would not fit at the best rate seen
    so far is skipped, except the first of a phase, so every phase measures something.
    """
    best = 0.0
    for index, (name, flops, setup) in enumerate(workloads):
        left = deadline - time.perf_counter()
        rate = max(best, rate_guess or 0.0)
        if index > 0 and (left <= 0 or (rate > 0 and 2 * flops / (rate * 1e9) > left)):
            continue
        run = setup()
        gflops = _best_gflops(run, flops, max(left, 0.0) / (len(workloads) - index), sync)
        results[name] = round(gflops, 1)
        best = max(best, gflops)
        del run
    return best


def measure_peak_flops(dtype: torch.dtype, device: torch.device, threads: int | None = None,
                       budget_s: float = 2.0) -> dict[str, Any]:
    """Best GFLOP/s this machine reaches in `dtype`, over large GEMMs and 3x3 convolutions, within about `budget_s`.

    `threads` sets torch's thread count for the measurement (it is restored after): measure with the count the
    step runs with. Returns {"dtype", "peak_gflops", "gemm_gflops", "conv_gflops", "threads", "measured"}, where
    `measured` maps each shape timed to its GFLOP/s. The GEMMs take about 60% of the budget, the convolutions the
    rest; shapes too large for what is left are skipped, so a small budget measures small shapes only.
    """
    device = torch.device(device)
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(f"no peak measurement for {dtype}; use one of {sorted(DTYPE_NAMES.values())}")
    if device.type == "cpu" and dtype == torch.float16:
        # fp16 matmuls on CPUs without AVX512-FP16 run at well under 1 GFLOP/s: a budget would buy nothing.
        raise ValueError("fp16 is not measured on CPU (it runs at under 1 GFLOP/s there): use bf16 or fp32")
    if budget_s <= 0:
        raise ValueError(f"budget_s must be positive, got {budget_s}")

    def filled(*shape: int, channels_last: bool = False) -> torch.Tensor:
        # Uniform values in [-1, 1]: no denormals or infinities that could slow a kernel down.
        tensor = torch.empty(shape, dtype=dtype, device=device).uniform_(-1, 1)
        return tensor.to(memory_format=torch.channels_last) if channels_last else tensor

    def gemm(m: int, k: int, n: int) -> Callable[[], Any]:
        a, b = filled(m, k), filled(k, n)
        return lambda: torch.mm(a, b)

    def conv(batch: int, c_in: int, c_out: int, size: int) -> Callable[[], Any]:
        # channels_last is oneDNN's native layout: a contiguous input is reordered on every call.
        x, w = filled(batch, c_in, size, size, channels_last=True), filled(c_out, c_in, 3, 3, channels_last=True)
        return lambda: F.conv2d(x, w, padding=1)

    gemms = [(f"mm {m}x{k}x{n}", 2 * m * k * n, lambda shape=(m, k, n): gemm(*shape)) for m, k, n in GEMM_SHAPES]
    convs = [(f"conv3x3 {b}x{ci}->{co} {s}x{s}", 2 * b * co * ci * 9 * s * s, lambda shape=(b, ci, co, s): conv(*shape))
             for b, ci, co, s in CONV_SHAPES]

    previous = torch.get_num_threads()
    measured: dict[str, float] = {}
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        used = torch.get_num_threads()
        sync = _synchronizer(device)
        start = time.perf_counter()
        with torch.inference_mode():
            gemm_gflops = _run_phase(gemms, start + GEMM_SHARE * budget_s, sync, None, measured)
            conv_gflops = _run_phase(convs, start + budget_s, sync, gemm_gflops, measured)
    finally:
        torch.set_num_threads(previous)
    return {
        "dtype": name,
        "peak_gflops": round(max(gemm_gflops, conv_gflops), 1),
        "gemm_gflops": round(gemm_gflops, 1),
        "conv_gflops": round(conv_gflops, 1),
        "threads": used,
        "measured": measured,
    }


def cpu_flags(path: str | Path = "/proc/cpuinfo") -> dict[str, Any]:
    """The CPU's model name and the vector extensions that decide whether bf16 pays off here (Linux; else {}).

    Returns {"model", "avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}.
    """
    if not sys.platform.startswith("linux"):
        return {}
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    # Every processor repeats the same block; the first is enough.
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    # x86 calls them flags, ARM features; some ARM kernels give no model name, only part numbers.
    flags = set((fields.get("flags") or fields.get("features") or "").split())
    model = fields.get("model name") or fields.get("hardware") or ""
    return {
        "model": model,
        **{flag: flag in flags for flag in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")},
    }
