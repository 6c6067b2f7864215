"""Frozen weights stored in low precision and cast per layer just in time for its matmul (``model.frozen_precision``):
the base under LoRA, textual inversion or DreamBooth-LoRA, and frozen text encoders, at half (bf16), a quarter
(float8 e4m3, with one fp32 scale per output row) or about an eighth (NF4: 4-bit NormalFloat codes with one fp32
absmax per 64 weights, QLoRA's storage, by bitsandbytes) of their fp32 size. Trained weights (adapters, new embeddings)
and their optimizer state stay in fp32, and so do the outputs: a LoRA file holds the adapters only, and exports
rebuild the base from its source.

Why not a quantisation library's weight-only layers: torchao's (0.18) keep, for the backward, the full-precision
weight they dequantise for each layer's forward, so a training step holds every frozen weight in full precision
again until its backward reaches it (measured: four 1024x1024 fp32 weights saved for four fp8 layers). Here the
backward dequantises the stored weight a second time instead, so only one layer's full-precision weight exists at
once, in forward as in backward: the point of a low-precision base when training, what kohya's ``--fp8_base``
does. For NF4 the quantisation and dequantisation are bitsandbytes' own (``quantize_4bit`` / ``dequantize_4bit``,
maintained for CPUs and CUDA alike, and the format QLoRA and the trainers users know store 4-bit bases in); only
its linear layer is not used, for the reason above.

Only ``nn.Linear`` layers are stored low (they hold nearly all of a transformer's weights, and most of a UNet's);
convolutions, norms and embeddings stay as they are. A stored weight is a buffer of integers of the same width
(uint8 for fp8, int16 for bf16; NF4's two codes a byte), viewed as its float type when used: ``module.to(dtype)``
and ``.float()`` leave integer buffers alone, so no cast elsewhere can silently widen or corrupt it. The layer's
``weight`` becomes an empty fp32 parameter, so a model's ``dtype`` (which diffusers casts inputs to) and what peft
and transformers read off a layer stay those of the full-precision model.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_FP8 = torch.float8_e4m3fn
_STORED = {"bf16": (torch.bfloat16, torch.int16), "fp8": (_FP8, torch.uint8), "nf4": (None, torch.uint8)}
NF4_BLOCK = 64
"""Weights per NF4 absmax (QLoRA's block size, bitsandbytes' default)."""


@functools.cache
def _nf4_code(device: torch.device) -> torch.Tensor:
    from bitsandbytes.functional import get_4bit_type

    return get_4bit_type("nf4", device=device)


def _quantize(weight: torch.Tensor, precision: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The stored bits of `weight` (as integers) and, for fp8, the per-row scale that maps its range onto e4m3's;
    for NF4, the packed codes and each block's absmax."""
    dtype, bits = _STORED[precision]
    weight = weight.detach().float()
    if precision == "nf4":
        from bitsandbytes.functional import quantize_4bit

        codes, state = quantize_4bit(weight, blocksize=NF4_BLOCK, quant_type="nf4")
        return codes, state.absmax
    if precision == "bf16":
        return weight.to(dtype).view(bits), None
    # One scale per output row: a row's largest value becomes e4m3's largest (448); an all-zero row keeps scale 1.
    amax = weight.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / torch.finfo(_FP8).max, torch.ones_like(amax))
    return (weight / scale).to(dtype).view(bits), scale


def _dequantize(stored: torch.Tensor, scale: torch.Tensor | None, precision: str, dtype: torch.dtype,
                shape: torch.Size) -> torch.Tensor:
    """The weight of `shape` from its stored bits and scale, in `dtype`."""
    if precision == "nf4":
        from bitsandbytes.functional import QuantState, dequantize_4bit

        state = QuantState(absmax=scale, shape=shape, code=_nf4_code(stored.device), blocksize=NF4_BLOCK,
                           quant_type="nf4", dtype=dtype)
        return dequantize_4bit(stored, state)
    weight = stored.view(_STORED[precision][0]).to(dtype)
    return weight if scale is None else weight * scale.to(dtype)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _bits(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`layer`'s stored bits and scale where its input is: streamed from the host when offloaded (models/offload.py)."""
    stream = getattr(layer, "weight_stream", None)
    stored, scale = (layer.weight_stored, layer.weight_scale) if stream is None else stream.fetch(layer)
    # A scale held as its int32 bits (`as_parameters`) is read back as the fp32 it is.
    return stored, scale if scale is None or scale.is_floating_point() else scale.view(torch.float32)


class _FrozenLinear(torch.autograd.Function):
    """``x @ W.T + b`` with W dequantised from its stored bits in the forward and again in the backward, so that
    autograd keeps no weight at all, neither in full precision nor, for an offloaded layer, its bits on the device.
    W gets no gradient (it is frozen); a bias that trains gets its own."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, layer: nn.Module, dtype: torch.dtype
                ) -> torch.Tensor:
        ctx.layer, ctx.dtype, ctx.input_dtype = layer, dtype, x.dtype
        weight = _dequantize(*_bits(layer), layer.weight_precision, dtype, layer.weight_shape)
        return F.linear(x.to(dtype), weight, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            weight = _dequantize(*_bits(ctx.layer), ctx.layer.weight_precision, ctx.dtype, ctx.layer.weight_shape)
            grad_x = (grad.to(ctx.dtype) @ weight).to(ctx.input_dtype)
        if ctx.needs_input_grad[1]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, grad_bias, None, None


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # Autocast does not reach inside a custom autograd function: its dtype, read before it is turned off, is
    # applied there, as autocast would to F.linear.
    dtype = _compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        return _FrozenLinear.apply(x, self.bias, self, dtype)


def _store(layer: nn.Linear, weight: torch.Tensor, precision: str) -> int:
    """`weight` as `layer`'s stored bits; returns the bytes saved against fp32."""
    stored, scale = _quantize(weight, precision)
    # In place of the weight, an empty fp32 one, frozen: code that asks a layer for its weight's device and dtype
    # (peft placing adapters beside it, transformers' T5 matching its input to it) finds the full-precision
    # layer's, and the stored bits are the layer's buffers. A frozen weight is never checkpointed (it comes back
    # from its source), and nothing trains it.
    del layer.weight
    layer.weight = nn.Parameter(torch.empty(0, device=stored.device), requires_grad=False)
    layer.register_buffer("weight_stored", stored, persistent=False)
    layer.register_buffer("weight_scale", scale, persistent=False)
    layer.weight_precision = precision
    layer.weight_shape = weight.shape
    layer.forward = types.MethodType(_forward, layer)
    return weight.numel() * 4 - stored.numel() * stored.element_size()


def store_frozen(module: nn.Module, precision: str) -> int:
    """Store the frozen weight of every ``nn.Linear`` in `module` in `precision` ('bf16', 'fp8' or 'nf4'; 'fp32' leaves
    them), cast per layer just in time (see the module's docstring). Returns the bytes saved."""
    if precision == "fp32":
        return 0
    if precision not in _STORED:
        raise ValueError(f"precision {precision!r} is not one of fp32, {', '.join(_STORED)}")
    saved = 0
    for layer in module.modules():
        # A layer stored as it was built or loaded (`materialize`, `load_streamed`) is skipped.
        if type(layer) is nn.Linear and not hasattr(layer, "weight_stored") and not layer.weight.requires_grad \
                and not layer.weight.is_meta:
            saved += _store(layer, layer.weight, precision)
    return saved


def as_parameters(module: nn.Module) -> int:
    """The stored bits and scales of `module`'s low-precision linear layers as frozen parameters instead of buffers,
    for FSDP2, which shards a module's parameters across the ranks and leaves its buffers whole on every one. A scale
    keeps its fp32 bits as int32: FSDP's mixed precision casts floating parameters for the all-gather (to bf16 when
    training in bf16) and leaves integer ones as they are. Returns the bytes that became parameters."""
    moved = 0
    for layer in module.modules():
        if not hasattr(layer, "weight_stored") or "weight_stored" not in layer._buffers:
            continue
        stored, scale = layer._buffers.pop("weight_stored"), layer._buffers.pop("weight_scale")
        layer.weight_stored = nn.Parameter(stored, requires_grad=False)
        moved += stored.numel() * stored.element_size()
        if scale is None:
            layer.register_buffer("weight_scale", None, persistent=False)
        else:
            layer.weight_scale = nn.Parameter(scale.float().view(torch.int32), requires_grad=False)
            moved += scale.numel() * 4
    return moved


# --------------------------------------------------------------------------------------------------- building

def parameters_on_meta() -> Any:
    """A context in which modules get their parameters on the meta device and their buffers for real (computed
    tables: positions, frequencies), for `materialize` or `load_streamed` to fill."""
    from accelerate import init_empty_weights

    return init_empty_weights(include_buffers=False)


def owned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with storage of its own: a part of a fused tensor read from a file (a view) is copied, so the whole
    is freed with its last part and checkpoints (safetensors, which write no shared tensors) can save it."""
    return tensor.clone() if tensor._base is not None else tensor


def _set(layer: nn.Module, name: str, tensor: torch.Tensor, precision: str) -> None:
    if name == "weight" and type(layer) is nn.Linear and precision != "fp32":
        _store(layer, tensor, precision)
    else:
        tensor = tensor.float() if tensor.is_floating_point() else tensor
        setattr(layer, name, nn.Parameter(owned(tensor), requires_grad=False))


def materialize(module: nn.Module, precision: str) -> nn.Module:
    """Initialise the parameters a module got on the meta device, a layer at a time, its linear weights stored in
    `precision` as each is made: a from-scratch base that will stay frozen, whose full-precision weights never
    exist together. Each layer initialises itself (``reset_parameters``); a parameter a layer holds without one
    gets N(0, 0.02). Every parameter comes out frozen."""
    for layer in module.modules():
        names = [n for n, p in layer.named_parameters(recurse=False) if p.is_meta]
        if not names:
            continue
        for name in names:
            setattr(layer, name, nn.Parameter(torch.empty_like(getattr(layer, name), device="cpu"),
                                              requires_grad=False))
        with torch.no_grad():
            if hasattr(layer, "reset_parameters"):
                layer.reset_parameters()
            else:
                for name in names:
                    nn.init.normal_(getattr(layer, name), std=0.02)
        if "weight" in names and type(layer) is nn.Linear and precision != "fp32":
            _store(layer, layer.weight.detach(), precision)
    return module


def load_streamed(module: nn.Module, files: list[str], precision: str,
                  prefixes: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """Fill a module built with `parameters_on_meta` from safetensors `files`, one tensor at a time (see
    `fill_streamed`); a key starting with the first of a pair of `prefixes` (the first such pair) is read with the
    second in its place, as a language model's tower is read from a folder of the whole model (``model.`` read as
    ``""``). Returns the state-dict names no file held (still on meta)."""
    from safetensors import safe_open

    def name(key: str) -> str:
        return next((read + key[len(found):] for found, read in prefixes if key.startswith(found)), key)

    def tensors():
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as file:
                yield from ((name(key), file.get_tensor(key)) for key in file.keys())  # noqa: SIM118 (not a dict)

    return fill_streamed(module, tensors(), precision)


def fill_streamed(module: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], precision: str) -> list[str]:
    """Fill a module built with `parameters_on_meta` from (state-dict name, tensor) pairs as they come: linear
    weights stored in `precision` as they arrive, everything else in fp32, all frozen. A 12B transformer then
    never exists in full precision, nor twice. Returns the state-dict names no pair held (still on meta)."""
    layers = dict(module.named_modules())
    for key, tensor in tensors:
        owner, _, name = key.rpartition(".")
        layer = layers.get(owner)
        if layer is None:
            continue
        if name in layer._buffers:
            layer._buffers[name] = tensor
        elif name in layer._parameters:
            _set(layer, name, tensor, precision)
    if hasattr(module, "tie_weights"):  # transformers: T5's embedding is shared with its encoder's
        module.tie_weights()
    return [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]


def fill(module: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], precision: str) -> list[str]:
    """Fill a module built with `parameters_on_meta` from (state-dict name, tensor) pairs, as a file in a family's
    own layout is read: a frozen base in a `precision` other than fp32 stored low as they come
    (`fill_streamed`), a trainable one in fp32 strictly, each tensor with storage of its own (`owned`: the parts of
    a fused tensor are views of it). Returns the names no pair held."""
    if precision != "fp32":
        return fill_streamed(module, tensors, precision)
    module.load_state_dict({key: owned(tensor) for key, tensor in tensors}, strict=True, assign=True)
    return []


def stored_bytes(module: nn.Module) -> tuple[int, int]:
    """The bytes of `module`'s linear weights stored low, and what they would take in fp32."""
    layers = [m for m in module.modules() if hasattr(m, "weight_stored")]
    stored = sum(m.weight_stored.numel() * m.weight_stored.element_size() + (
        m.weight_scale.numel() * 4 if m.weight_scale is not None else 0) for m in layers)
    return stored, sum(m.weight_shape.numel() * 4 for m in layers)


def storage_bytes(module: nn.Module) -> dict[str, int]:
    """What `module`'s weights would take with its linear weights stored in each precision (fp8 with its row scales, NF4
    with its block absmaxes) and the rest as they are: read off the shapes alone, so a module built on the meta
    device plans a load before any weight is read."""
    linear = [m.weight for m in module.modules() if type(m) is nn.Linear and not hasattr(m, "weight_stored")]
    ids = {id(w) for w in linear}
    rest = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()) if id(t) not in ids)
    weights = sum(w.numel() for w in linear)
    rows = sum(w.shape[0] for w in linear)
    blocks = sum(-(-w.numel() // NF4_BLOCK) for w in linear)
    return {"fp32": rest + 4 * weights, "bf16": rest + 2 * weights, "fp8": rest + weights + 4 * rows,
            "nf4": rest + sum((w.numel() + 1) // 2 for w in linear) + 4 * blocks}
