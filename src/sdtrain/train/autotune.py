"""Settings decided by measuring this machine, not assumed: the compute precision, whether activation
checkpointing is needed, how the frozen autoencoder encodes, and on the tuned path (``train.tuned``) the denoiser's
memory layout.

Whether bf16 autocast pays differs between CPUs of one family (1.4x faster on one machine, 2x slower on
another, depending on avx512_bf16/AMX and on what the weight casts cost) and between model sizes on one
machine (on an AMX Xeon bf16 is 3x faster for SD2's UNet and 1.7x slower for the demo's tiny one, whose
step is mostly elementwise work and casts). So ``auto`` times the step itself: the model's forward and
backward on a synthetic batch of the configured micro-batch size, in fp32 and under bf16 autocast,
alternating, best of two each after a warm-up (one, when one precision is already twice as fast). That takes
a few of the run's steps, and the result is cached per machine, thread count, model and batch size. A
forward of one sample records every distinct layer call (with its real input shapes); their inputs give the
activation memory per sample that decides ``gradient_checkpointing: auto``.

Only the main rank measures; every rank takes its decision, so all ranks train alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from sdtrain.config import SWITCHES, RunConfig
from sdtrain.distributed import gather_objects, is_distributed
from sdtrain.errors import UserError
from sdtrain.flops import cpu_flags
from sdtrain.memory import TreePeak, own_peak_bytes, tree_bytes
from sdtrain.models import families
from sdtrain.paths import cache_dir
from sdtrain.utils import atomic_write_text

log = logging.getLogger(__name__)

# bf16 rounds every matmul input; it has to buy a clear gain, not a tie within timing noise.
BF16_MIN_GAIN = 1.05
# The recorded layer inputs miss the elementwise results autograd keeps between layers (activations, residual sums).
ELEMENTWISE = 1.5
DECISIVE_RATIO = 2.0
_LEAVES = (nn.Conv2d, nn.Linear, nn.GroupNorm, nn.LayerNorm)


@dataclass
class Tuning:
    """What a run trains with, and why; saved in every checkpoint's meta.json."""

    precision: str
    """fp32 or bf16."""
    checkpointing: bool
    precision_source: str
    """config, measured, cache or checkpoint."""
    fp32_ms: float | None = None
    bf16_ms: float | None = None
    estimated_gib: float | None = None
    """The run's expected peak on this machine: training (see `run_bytes`) or loading, whichever is higher."""
    available_gib: float | None = None
    loading_gib: float | None = None
    """What loading the models took at its peak (this process; every process of the machine when several)."""
    seconds: float = 0.0
    """What recording and timing the layers took at this start (0 when nothing was measured)."""
    training_gib: float | None = None
    """The training step's expected peak alone (see `run_bytes`), loading aside."""
    encode: str = "fp32"
    """How the frozen autoencoder encodes a step's images (``train.encode``)."""
    encode_source: str = "default"
    """config, measured, cache, checkpoint, or default (nothing to choose: encoded shards, clips)."""
    encode_ms: dict[str, float] | None = None
    """Milliseconds per sample of each way measured (`time_encodings`)."""
    compile: bool = False
    """Whether the trained modules' blocks are compiled (``train.compile``)."""
    channels_last: bool = False
    """Whether the denoiser trains in the channels_last layout (``train.channels_last``)."""
    channels_last_source: str = "default"
    """config, measured, cache, checkpoint, or default (off: not on the tuned path, or no convolutional denoiser)."""
    channels_last_ms: dict[str, float] | None = None
    """Milliseconds per sample of a step in each layout, where measured (`time_layouts`)."""
    cuda_graphs: bool = False
    """Whether compiled blocks replay as CUDA graphs (``train.cuda_graphs``)."""
    cudnn_benchmark: bool = False
    """Whether cuDNN times its convolution algorithms (``train.cudnn_benchmark``)."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class LayerCall:
    """One distinct layer call of the model (a layer and its input shapes) and how often it runs."""

    calls: int
    activation_bytes: int
    """Bytes of the call's tensor inputs per sample, about what autograd keeps for its backward."""


@dataclass
class LayerCalls:
    """A forward's distinct layer calls, and what activation checkpointing of its blocks would keep of them."""

    calls: dict[str, LayerCall]
    outside_bytes: int = 0
    """Per sample, the inputs of the layer calls outside every checkpointed block (embeddings, the final layers)."""
    block_input_bytes: int = 0
    """Per sample, the inputs of every checkpointed block call: what checkpointing keeps of the blocks."""
    largest_block_bytes: int = 0
    """Per sample, the layer inputs inside the largest block call: what its recomputation holds during backward."""
    spared_cast_bytes: int = 0
    """The bf16 copies of the blocks' fp32 weights that bf16 autocast keeps for backward without checkpointing, and
    with it not (each block's are cast again as it is recomputed), but for the largest block's."""

    def activation_bytes(self) -> int:
        """Per sample, the inputs of every layer call: about what autograd keeps without checkpointing."""
        return sum(c.activation_bytes * c.calls for c in self.calls.values())

    def checkpointed_bytes(self) -> int | None:
        """Per sample, what autograd keeps with the blocks checkpointed: their inputs, everything outside them, and
        one block's inside at a time as backward recomputes it (with the elementwise results between layers, see
        `ELEMENTWISE`); None where no block was seen."""
        if not self.block_input_bytes:
            return None
        return int(ELEMENTWISE * (self.outside_bytes + self.largest_block_bytes) + self.block_input_bytes)


def _machine_key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    model = cpu_flags().get("model") or platform.processor() or platform.machine()
    return f"cpu:{model}:threads={torch.get_num_threads()}"


def _tensors_bytes(values: Any) -> int:
    if isinstance(values, torch.Tensor):
        return values.numel() * values.element_size()
    if isinstance(values, (tuple, list)):
        return sum(_tensors_bytes(v) for v in values)
    if isinstance(values, dict):
        return sum(_tensors_bytes(v) for v in values.values())
    return 0


def _signature(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> str:
    def describe(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"T{tuple(value.shape)}{value.dtype}"
        if isinstance(value, (tuple, list)):
            return "(" + ",".join(describe(v) for v in value) + ")"
        return type(value).__name__
    shapes = describe(args) + describe(sorted(kwargs.items()))
    return f"{type(module).__name__}|{module.extra_repr()}|{sum(p.numel() for p in module.parameters())}|{shapes}"


def _is_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention")


def record_layer_calls(modules: dict[str, nn.Module], run_forward: Callable[[], Any],
                       blocks: list[nn.Module] = ()) -> LayerCalls:
    """Run `run_forward` once (no gradients) and collect the distinct calls of the modules' layers, and which run
    inside the `blocks` activation checkpointing would wrap.

    The forward runs on fake tensors, shapes without values: recording a 14B model's call on a 480p clip of 81
    frames then takes seconds and no memory, where a real forward takes an hour on a CPU. A forward that reads a
    value (an image processor turning a tensor into numbers, say) runs again for real.

    Attention modules count as one layer: their inner projections run inside them, and the attention
    product between does not belong to any leaf module."""
    try:
        return _record_layer_calls(modules, _on_fake_tensors(run_forward, modules), blocks)
    except Exception as exc:  # noqa: BLE001 - whatever an op without a shape rule raises, the real forward answers
        log.debug("recording the layer calls on fake tensors failed (%s: %s); recording a real forward",
                  type(exc).__name__, exc)
        return _record_layer_calls(modules, run_forward, blocks)


def _on_fake_tensors(run_forward: Callable[[], Any], modules: dict[str, nn.Module]) -> Callable[[], Any]:
    def fake_forward() -> Any:
        # Weights and the batch stay real; what the forward computes from them is fake.
        with _forgetting_caches(modules), FakeTensorMode(allow_non_fake_inputs=True):
            run_forward()
    return fake_forward


@contextlib.contextmanager
def _forgetting_caches(modules: dict[str, nn.Module]) -> Iterator[None]:
    """The modules' own state as it was before, afterwards: what a forward caches (rotary frequencies on an attribute,
    in a dict, or in an lru_cache of a method, as diffusers' Qwen-Image keeps them) would otherwise hand the fake
    tensors of a recording to the real steps after it."""
    layers = list({id(sub): sub for module in modules.values() for sub in module.modules()}.values())
    before = [(layer, dict(vars(layer)), {key: _shallow(value) for key, value in vars(layer).items()})
              for layer in layers]
    try:
        yield
    finally:
        for layer, attributes, contents in before:
            for key in [key for key in vars(layer) if key not in attributes]:
                delattr(layer, key)
            for key, value in attributes.items():
                object.__setattr__(layer, key, value)
                if isinstance(contents[key], dict):
                    value.clear()
                    value.update(contents[key])
                elif isinstance(contents[key], list):
                    value[:] = contents[key]
        for clear in _method_caches(layers):
            clear()


def _shallow(value: Any) -> Any:
    return dict(value) if type(value) is dict else list(value) if type(value) is list else None


def _method_caches(layers: list[nn.Module]) -> list[Callable[[], None]]:
    """The ``cache_clear`` of every lru_cache on the layers' classes' methods, wrapped or not."""
    found: dict[int, Callable[[], None]] = {}
    for cls in {klass for layer in layers for klass in type(layer).__mro__}:
        for attribute in vars(cls).values():
            for candidate in (attribute, *(cell.cell_contents for cell in getattr(attribute, "__closure__", None) or ()
                                           if _filled(cell))):
                clear = getattr(candidate, "cache_clear", None)
                if callable(clear):
                    found[id(candidate)] = clear
    return list(found.values())


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _per_sample_bytes(args: tuple, kwargs: dict[str, Any]) -> int:
    batch = next((a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() > 1), 1)
    return (_tensors_bytes(args) + _tensors_bytes(kwargs)) // max(batch, 1)


def _record_layer_calls(modules: dict[str, nn.Module], run_forward: Callable[[], Any],
                        blocks: list[nn.Module]) -> LayerCalls:
    record = LayerCalls({})
    inside_attention: set[int] = set()
    for module in modules.values():
        for sub in module.modules():
            if _is_attention(sub):
                inside_attention.update(id(m) for m in sub.modules() if m is not sub)
    # The block call running now (the outermost: checkpointing an outer block recomputes the inner ones with it).
    running: list[nn.Module] = []
    inside = [0]

    def enter_block(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        running.append(module)
        if len(running) == 1:
            record.block_input_bytes += _per_sample_bytes(args, kwargs)
            inside[0] = 0

    def leave_block(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        running.pop()
        if not running:
            record.largest_block_bytes = max(record.largest_block_bytes, inside[0])

    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        size = _per_sample_bytes(args, kwargs)
        if running:
            inside[0] += size
        else:
            record.outside_bytes += size
        key = _signature(module, args, kwargs)
        if key in record.calls:
            record.calls[key].calls += 1
        else:
            record.calls[key] = LayerCall(1, size)

    handles = [handle for block in blocks for handle in (
        block.register_forward_pre_hook(enter_block, with_kwargs=True),
        block.register_forward_hook(leave_block, with_kwargs=True))]
    for module in modules.values():
        for sub in module.modules():
            if id(sub) in inside_attention:
                continue
            if isinstance(sub, _LEAVES) or _is_attention(sub):
                handles.append(sub.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            run_forward()
    finally:
        for handle in handles:
            handle.remove()
    return record


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ways(step: Callable[[], torch.Tensor], params: list[nn.Parameter], device: torch.device,
               ways: dict[str, tuple[Callable[[], None], bool]], repeats: int, stop_when_decisive: bool = False
               ) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds of ``step()``'s forward and its backward in each of `ways` (name: what sets it up, and whether under
    bf16 autocast), alternating, so a change in the machine's load affects all; the first round only warms caches
    and allocators (unless it is the only one), then each way's best time is kept, over `repeats` rounds, or fewer
    with `stop_when_decisive` when one way is already twice as fast. Also each way's last loss. Gradients are left
    cleared."""
    best = dict.fromkeys(ways, float("inf"))
    losses: dict[str, float] = {}
    try:
        for attempt in range(repeats + 1):
            for name, (set_up, bf16) in ways.items():
                set_up()
                started = time.perf_counter()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = step()
                loss.backward()
                _synchronize(device)
                seconds = time.perf_counter() - started
                losses[name] = float(loss.detach().float())
                for p in params:
                    p.grad = None
                if attempt or not repeats:
                    best[name] = min(best[name], seconds)
            # A way twice as slow after a timed round cannot win the next one: stop there (bf16 is about 10x slower
            # for the demo's UNet on a CPU without bf16 units, and each of its rounds costs seconds).
            if stop_when_decisive and attempt and max(best.values()) > DECISIVE_RATIO * min(best.values()):
                break
    finally:
        for p in params:
            p.grad = None
    return best, losses


def time_precisions(step: Callable[[], torch.Tensor], params: list[nn.Parameter], device: torch.device,
                    samples: int, repeats: int = 2) -> dict[str, float]:
    """Milliseconds per sample of ``step()``'s forward and its backward in fp32 and under bf16 autocast
    (`_time_ways`, stopping early when one precision is twice as fast)."""
    def as_it_is() -> None:
        pass

    best, _ = _time_ways(step, params, device, {"fp32": (as_it_is, False), "bf16": (as_it_is, True)}, repeats,
                         stop_when_decisive=True)
    return {name: 1000 * seconds / samples for name, seconds in best.items()}


CONTENDED_SHARE = 0.75
"""Below this share of its threads' wall time spent on the CPU, a process timing precisions was not running alone."""


def _load_cache(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def measured_precision(fingerprint: list[Any], step: Callable[[], torch.Tensor], params: list[nn.Parameter],
                       device: torch.device, samples: int) -> tuple[dict[str, float], str]:
    """The fp32 and bf16 timings of ``step`` on this machine, from the cache when it has them for this
    ``fingerprint`` (what identifies the model and batch)."""
    # v4: timings taken on shared cores are no longer kept, so v3 entries may hold such; v3: the bf16 round under
    # bf16 autocast; v2 entries timed fp32 twice (the trial step switched autocast off), v1 ones single layers at a
    # batch of one.
    identity = json.dumps(["v4", _machine_key(device), torch.__version__, samples, fingerprint])
    key = hashlib.sha256(identity.encode()).hexdigest()[:24]
    path = cache_dir() / "precision.json"
    cached = _load_cache(path).get(key)
    if cached is not None:
        return cached, "cache"
    started = _clocks()
    timings = time_precisions(step, params, device, samples)
    if _ran_alone(started, device, "precision timings"):
        _cache(path, key, timings, "precision timings")
    return timings, "measured"


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _ran_alone(started: tuple[float, float], device: torch.device, what: str) -> bool:
    """Whether timings measured since `started` (`_clocks`) may be kept: on a CPU, timings taken while another job
    held the cores would decide every later run."""
    wall, cpu = started
    share = (time.process_time() - cpu) / max(time.perf_counter() - wall, 1e-9) / torch.get_num_threads()
    log.debug("%s took %.0f%% of %d threads' time", what, 100 * share, torch.get_num_threads())
    if device.type == "cpu" and share < CONTENDED_SHARE:
        log.warning("%s not cached: while measuring, this process ran %.0f%% of the time its %d threads had (another "
                    "job on the cores?)", what, 100 * share, torch.get_num_threads())
        return False
    return True


def _cache(path: Path, key: str, value: Any, what: str) -> None:
    """`value` under `key` in the JSON cache at `path`, beside what other runs keep there."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Re-read: another run may have added its own entry meanwhile.
        atomic_write_text(path, json.dumps({**_load_cache(path), key: value}, indent=1))
    except OSError as exc:
        log.warning("cannot cache the %s in %s (%s)", what, path, exc.strerror)


def bf16_supported(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.is_bf16_supported()


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _usable_bytes(device: torch.device) -> int:
    """What a plan may fill: the device's memory with a tenth kept free."""
    return int(_available_bytes(device) * 0.9)


# The optimizer's state per byte of fp32 trained weights: AdamW's two fp32 moments; 8-bit AdamW's two 1-byte
# moments of each 4-byte weight (their block scales are a rounding error); Adafactor's row and column vectors, next
# to nothing beside a matrix.
OPTIMIZER_STATE_RATIO = {"adamw": 2.0, "adamw8bit": 0.5, "adafactor": 0.0}


def training_bytes(trainable: list[nn.Parameter], frozen: list[nn.Parameter], activation_bytes_per_sample: int,
                   batch_size: int, ema: bool, checkpointing: bool, bf16: bool = False, optimizer: str = "adamw",
                   in_backward: bool = False, weight_size: int | None = None,
                   checkpointed_bytes_per_sample: int | None = None, spared_cast_bytes: int = 0) -> int:
    """Estimated peak of a training step: the trained weights and their gradients (none held together when stepped
    in backward), at `weight_size` bytes each (None: as they are now), the optimizer's state of the trained
    parameters (plus their average with EMA), the frozen weights, and the
    activations autograd keeps; under bf16 autocast also the bf16 copies of the weights it casts, which it keeps
    for the backward. The recorded layer inputs miss the elementwise results between layers (`ELEMENTWISE`); with
    checkpointing what `LayerCalls.checkpointed_bytes` says stays (`checkpointed_bytes_per_sample`), or where the
    blocks are unknown a quarter of it all, and of the bf16 copies all but `spared_cast_bytes`."""
    # The optimizer's state and the EMA are fp32 whatever the weights' precision (optim.weights).
    weights = sum(p.numel() * (weight_size or p.element_size()) for p in trainable) * (1 if in_backward else 2)
    state = weights + sum(p.numel() * 4 for p in trainable) * (OPTIMIZER_STATE_RATIO[optimizer] + (1 if ema else 0))
    state += sum(p.numel() * p.element_size() for p in frozen)
    if bf16:
        state += sum(p.numel() * 2 for p in [*trainable, *frozen] if p.dtype == torch.float32)
        state -= spared_cast_bytes if checkpointing else 0
    activations = ELEMENTWISE * activation_bytes_per_sample * batch_size
    if checkpointing:
        activations = activations / 4 if checkpointed_bytes_per_sample is None \
            else checkpointed_bytes_per_sample * batch_size
    return int(state + activations)


# At most this share of the memory for the stored frozen weights and the trained state, when the planner picks their
# precision (model.frozen_precision: auto), which it must before any weight loads, so before the activations can be
# measured: the rest is for activations (checkpointing, decided after loading from their measured size, can shrink
# them to about a block's), the step's transient full-precision weights and the allocator's slack.
STORED_SHARE = 0.6
FROZEN_ORDER = ("fp32", "bf16", "fp8", "nf4")
"""Frozen storage precisions from the most exact to the smallest: the planner takes the first that fits."""


class FrozenPlan(NamedTuple):
    precision: str
    why: str
    """The figures behind the choice, for the log."""
    fits: bool
    """Whether the frozen weights in that precision fit the budget (else model.offload_frozen: auto streams them)."""


def plan_frozen_precision(stored: dict[str, int], state: int, held: int, available: int,
                          fixed: str | None = None) -> FrozenPlan:
    """`model.frozen_precision: auto`: the most exact storage whose frozen weights (`stored`: bytes per precision),
    beside the trained weights' `state` (weights, gradients, optimizer state, EMA) and what the process `held`
    before loading, fit within STORED_SHARE of the `available` memory; NF4 when none does. A `fixed` precision (one
    the config sets) is only checked."""
    budget = STORED_SHARE * available - held - state
    # NF4 is bitsandbytes' storage: not offered where it is not installed.
    order = [p for p in FROZEN_ORDER if p != "nf4" or importlib.util.find_spec("bitsandbytes") is not None]
    precision = fixed or next((p for p in order if stored[p] <= budget), order[-1])
    sizes = ", ".join(f"{stored[p] / 2**30:.1f} GiB in {p}" for p in FROZEN_ORDER)
    why = (f"frozen weights take {sizes}; {STORED_SHARE:.0%} of the {available / 2**30:.1f} GiB available, less "
           f"{held / 2**30:.1f} GiB held before loading and {state / 2**30:.1f} GiB of trained state, leaves "
           f"{budget / 2**30:.1f} GiB")
    fits = stored[precision] <= budget
    if not fits:
        why += f"; {'even ' if precision == order[-1] else ''}{precision} does not fit"
    return FrozenPlan(precision, why, fits)


def memory_budget(device: torch.device, processes_per_machine: int = 1) -> tuple[int, int]:
    """This process's share of the usable memory, and what it holds now."""
    available = _usable_bytes(device) // max(1, processes_per_machine)
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else tree_bytes()
    return available, held


# Measured on a 2-core CPU at 256 px: a loader worker forked from the fork server holds about 100 MiB of its
# own (decoder, tokenizer, the pages it shares with its siblings), the server itself about as much.
LOADER_PROCESS_BYTES = 100 * 2**20


def loader_bytes(workers: int, batch_size: int, resolution: int) -> int:
    """Memory of the loader's processes: the fork server, and per worker its own pages plus the two batches
    it prefetches (as fp32 pixels, the largest a batch gets)."""
    if workers == 0:
        return 0
    batch = batch_size * 3 * resolution * resolution * 4
    return LOADER_PROCESS_BYTES + workers * (LOADER_PROCESS_BYTES + 2 * batch)


def run_bytes(step_bytes: int, held_bytes: int, model_bytes: int, baseline_bytes: int, loader: int) -> int:
    """A training process's expected peak: the step's own (`training_bytes`), what the process holds beside
    its models' weights, and the loader's processes. Beside the weights: what it held before building them
    (`baseline_bytes`: the interpreter, the libraries), or, when loading left more behind (allocator caches),
    `held_bytes` measured now less the weights. Not the latter alone: weights read from a safetensors file
    may be mapped and not yet resident."""
    return step_bytes + max(baseline_bytes, held_bytes - model_bytes) + loader


def decide(config: RunConfig, task: Any, encoded: bool, resumed_meta: dict[str, Any] | None, device: torch.device,
           is_main: bool, processes_per_machine: int = 1, baseline_bytes: int = 0, plan_only: bool = False) -> Tuning:
    """Precision and checkpointing for this run; the main rank measures, every rank gets its answer.
    `baseline_bytes`: what the process held before it built the models (see `run_bytes`). `plan_only`: the memory
    estimate whatever the config says of checkpointing, and no precision timed (that runs steps)."""
    tuning = None
    if is_main:
        tuning = _decide(config, task, encoded, resumed_meta, device, processes_per_machine, baseline_bytes,
                         plan_only)
        log.info("precision %s (%s%s); gradient checkpointing %s%s%s", tuning.precision, tuning.precision_source,
                 f": fp32 {tuning.fp32_ms:.0f} ms, bf16 {tuning.bf16_ms:.0f} ms per sample forward+backward"
                 if tuning.fp32_ms is not None else "",
                 "on" if tuning.checkpointing else "off",
                 f" (estimated peak {tuning.estimated_gib:.1f} GiB of {tuning.available_gib:.1f} GiB, loader workers "
                 f"included; loading took {tuning.loading_gib or 0:.1f} GiB)"
                 if tuning.estimated_gib is not None else "",
                 f"; measured in {tuning.seconds:.1f} s" if tuning.seconds else "")
        if config.train.tuned or config.train.cuda_graphs or any(getattr(config.train, name) is True
                                                                 for name in SWITCHES):
            log.info("tuned path: compiled blocks %s, channels_last %s (%s), CUDA graphs %s, cuDNN algorithm search %s",
                     *("on" if on else "off" for on in (tuning.compile, tuning.channels_last)),
                     tuning.channels_last_source,
                     *("on" if on else "off" for on in (tuning.cuda_graphs, tuning.cudnn_benchmark)))
    return gather_objects(tuning)[0]


def _decide(config: RunConfig, task: Any, encoded: bool, resumed_meta: dict[str, Any] | None,
            device: torch.device, processes_per_machine: int, baseline_bytes: int, plan_only: bool = False) -> Tuning:
    # bf16 weights (optim.weights) compute in bf16: nothing to measure.
    requested = "bf16" if config.optim.weights == "bf16" else config.train.mixed_precision
    previous = (resumed_meta or {}).get("tuning")
    if requested == "bf16" and not bf16_supported(device):
        raise UserError("train.mixed_precision: this GPU has no bf16; use fp32 or auto")
    # A model that reaches the device only sharded (task.staged_on_host) runs no step before: bf16 where the device
    # has it, and checkpointing, which keeps a base larger than one device within it, unless the config says.
    staged = task.staged_on_host()
    defaulted = staged and requested == "auto" and previous is None
    if defaulted:
        requested = "bf16" if bf16_supported(device) else "fp32"
    measure_precision = requested == "auto" and previous is None and bf16_supported(device) and not plan_only
    if plan_only and requested == "auto" and previous is None:
        defaulted, requested = True, "bf16" if bf16_supported(device) else "fp32"
    measure_memory = (config.train.gradient_checkpointing == "auto" or plan_only) and not staged
    start = time.perf_counter()
    loaded_peak = own_peak_bytes()  # before the layer pass below adds its own
    # Decided first, and applied: the precision timing below then times the step's encode the way it will run.
    encode, encode_source, encode_ms = _decide_encoding(config, task, encoded, previous, device) \
        if not plan_only else ("fp32", "default", None)
    if hasattr(task, "use_encoding"):
        task.use_encoding(encode)
    calls = _record(config, task, encoded) if measure_precision or measure_memory else LayerCalls({})

    estimated = available = loading = training_gib = None
    checkpointing = config.train.gradient_checkpointing
    if staged and checkpointing == "auto":
        checkpointing = True
    if checkpointing == "auto" or measure_memory:
        trainable = task.parameters()
        ids = {id(p) for p in trainable}
        # Frozen weights stored in low precision (model.frozen_precision) are buffers.
        frozen = [p for m in _all_modules(task) for p in (*m.parameters(), *m.buffers())
                  if id(p) not in ids and not p.is_meta]
        per_sample, checkpointed = calls.activation_bytes(), calls.checkpointed_bytes()
        data = config.data
        # Before precision is measured, bf16 stays possible: its weight copies are counted unless fp32 is certain.
        maybe_bf16 = bf16_supported(device) and requested != "fp32" and (previous or {}).get("precision") != "fp32"
        optimizer = dict(optimizer=config.optim.name, in_backward=config.optim.in_backward,
                         checkpointed_bytes_per_sample=checkpointed, spared_cast_bytes=calls.spared_cast_bytes)
        step = training_bytes(trainable, frozen, per_sample, data.batch_size, config.ema.enabled, checkpointing=False,
                              bf16=maybe_bf16, **optimizer)
        weights = sum(p.numel() * p.element_size() for p in [*trainable, *frozen])
        # On a GPU the step's memory is the device's; the host's share does not decide checkpointing there.
        host = device.type == "cpu"

        def whole_run(step: int) -> int:
            return processes_per_machine * run_bytes(
                step, tree_bytes() if host else 0, weights if host else 0, baseline_bytes if host else 0,
                loader_bytes(data.num_workers, data.batch_size, data.resolution) if host else 0)

        training = whole_run(step)
        available = _usable_bytes(device)
        if checkpointing == "auto":
            checkpointing = training > available
        if checkpointing:
            # What the run is then expected to take, logged and later compared with the first step's peak.
            training = least = whole_run(training_bytes(trainable, frozen, per_sample, data.batch_size,
                                                        config.ema.enabled, checkpointing=True, bf16=maybe_bf16,
                                                        **optimizer))
            if least > available:
                # Said before the first step, which the kernel would otherwise end minutes in, without a word.
                log.warning("this run needs about %.1f GiB even with gradient checkpointing, more than the %.1f GiB "
                            "available: it will likely be killed for memory. Train fewer weights (mode=lora), "
                            "lower data.batch_size, turn ema off, shrink the optimizer's state (optim.name="
                            "adamw8bit or adafactor, optim.in_backward=true) or halve the weights (optim.weights="
                            "bf16)", least / 2**30, available / 2**30)
        loading = processes_per_machine * loaded_peak if host else None
        estimated = max(training, loading or 0)
        training_gib = training / 2**30
        estimated, available = estimated / 2**30, available / 2**30
        loading = loading / 2**30 if loading is not None else None

    timings: dict[str, float] = {}
    if defaulted:
        precision, source = requested, ("not timed: a plan runs no step" if plan_only
                                        else "sharded as it reaches the device, so not measured")
    elif requested != "auto":
        precision, source = requested, "config"
        if previous is not None and previous["precision"] != requested:
            log.warning("train.mixed_precision=%s changes this run's precision from %s, the one it started with",
                        requested, previous["precision"])
    elif previous is not None:
        precision, source = previous["precision"], "checkpoint"
        timings = {"fp32": previous.get("fp32_ms"), "bf16": previous.get("bf16_ms")}
    elif not bf16_supported(device):
        precision, source = "fp32", "measured"
    else:
        # Where the full micro-batch would not fit without checkpointing, one sample stands in for it.
        samples = 1 if checkpointing else config.data.batch_size
        fingerprint = sorted((k, c.calls) for k, c in calls.calls.items())
        with _synthetic_step(config, task, encoded, samples) as step:
            timings, source = measured_precision(fingerprint, step, _parameters(task), device, samples)
        precision = "bf16" if timings["bf16"] * BF16_MIN_GAIN < timings["fp32"] else "fp32"
    tuning = Tuning(precision, bool(checkpointing), source, timings.get("fp32"), timings.get("bf16"), estimated,
                    available, loading, round(time.perf_counter() - start, 2) if calls.calls else 0.0, training_gib,
                    encode, encode_source, encode_ms)
    return _decide_tuned_path(config, task, encoded, previous, device, tuning, plan_only)


def _decide_tuned_path(config: RunConfig, task: Any, encoded: bool, previous: dict[str, Any] | None,
                       device: torch.device, tuning: Tuning, plan_only: bool) -> Tuning:
    """`tuning` with the tuned path's switches decided (``train.tuned`` and the keys it turns on)."""
    train = config.train
    cuda = device.type == "cuda"
    if train.cuda_graphs and tuning.checkpointing:
        raise UserError("train.cuda_graphs: gradient checkpointing runs each block again in backward, which a CUDA "
                        "graph replays only once a step; set train.gradient_checkpointing=false (if memory allows) or "
                        "turn cuda_graphs off")
    measured = train.tuned and train.channels_last == "auto" and previous is None
    if measured and (plan_only or task.staged_on_host()):
        # No step runs before the first on a plan, or on a model sharded as it reaches the device.
        layout, layout_source, layout_ms = False, "not timed: no step runs before the first", None
    else:
        layout, layout_source, layout_ms = _decide_layout(config, task, encoded, previous, device, tuning)
    return dataclasses.replace(
        tuning, compile=train.compiles(cuda), channels_last=layout, channels_last_source=layout_source,
        channels_last_ms=layout_ms, cuda_graphs=train.cuda_graphs and cuda and train.compiles(cuda),
        cudnn_benchmark=cuda and train.searches_convolutions(fixed_shapes=not config.data.aspect_buckets))


CONVOLUTIONAL_SHARE = 0.1
"""The share of a model's parameters in 2D convolutions above which it is convolutional (a UNet: most of them); a
transformer's patch embedding is a few thousandths."""
CHANNELS_LAST_TOLERANCE = 1e-2
"""The most a channels_last step's loss may differ from the contiguous layout's (relatively) and be kept: the layout
only changes the order of each convolution's sums."""


def is_convolutional(modules: list[nn.Module]) -> bool:
    """Whether `modules` (a task's trained modules) hold a convolutional denoiser, for which a memory layout is to be
    chosen."""
    total = conv = 0
    for module in modules:
        for layer in module.modules():
            own = sum(p.numel() for p in layer.parameters(recurse=False))
            total += own
            conv += own if isinstance(layer, nn.Conv2d) else 0
    return total > 0 and conv >= CONVOLUTIONAL_SHARE * total


def place_layout(modules: list[nn.Module], channels_last: bool) -> None:
    """The 2D convolutions of `modules` in the channels_last layout or the contiguous one; a convolution whose weight
    is channels_last gives its output in that layout, so the activations follow. (3D convolutions, a video
    transformer's patch embedding, have no such layout.)"""
    layout = torch.channels_last if channels_last else torch.contiguous_format
    for module in modules:
        for layer in module.modules():
            if isinstance(layer, nn.Conv2d):
                layer.to(memory_format=layout)


def time_layouts(step: Callable[[], torch.Tensor], modules: list[nn.Module], params: list[nn.Parameter],
                 device: torch.device, samples: int, bf16: bool, repeats: int = 1
                 ) -> tuple[dict[str, float], float]:
    """Milliseconds per sample of ``step()``'s forward and backward with `modules` contiguous and channels_last
    (`_time_ways`), and how far the channels_last loss is from the contiguous one's (relatively). `modules` are left
    contiguous."""
    ways = {layout: (functools.partial(place_layout, modules, layout == "channels_last"), bf16)
            for layout in ("contiguous", "channels_last")}
    try:
        best, losses = _time_ways(step, params, device, ways, repeats)
    finally:
        place_layout(modules, False)
    difference = abs(losses["channels_last"] - losses["contiguous"]) / max(abs(losses["contiguous"]), 1e-12)
    return {layout: 1000 * seconds / samples for layout, seconds in best.items()}, difference


def _decide_layout(config: RunConfig, task: Any, encoded: bool, previous: dict[str, Any] | None,
                   device: torch.device, tuning: Tuning) -> tuple[bool, str, dict[str, float] | None]:
    """``train.channels_last`` for this run: the config's, the run's first start's (a run started before the layout
    was chosen: contiguous), or on the tuned path for a convolutional denoiser, measured (cached per machine)."""
    requested = config.train.channels_last
    if config.parallel.strategy == "fsdp" and is_distributed():
        # FSDP2 shards each parameter along its first dimension as a flat, contiguous piece.
        if requested is True:
            raise UserError("train.channels_last: FSDP shards parameters in the contiguous layout; turn it off, or "
                            "train with parallel.strategy=ddp")
        return False, "default", None
    if requested != "auto":
        return bool(requested), "config", None
    if previous is not None:
        return bool(previous.get("channels_last", False)), "checkpoint", previous.get("channels_last_ms")
    if not config.train.tuned:
        return False, "default", None
    modules = list(task.parallel_modules().values())
    if not is_convolutional(modules):
        return False, "default", None
    samples = 1 if tuning.checkpointing else config.data.batch_size
    bf16 = tuning.precision == "bf16"
    identity = json.dumps(["layout-v1", _machine_key(device), torch.__version__, samples, config.data.resolution,
                           config.data.aspect_buckets, tuning.precision, config.optim.weights,
                           sorted(config.train.attention_kernels), encoded, [type(m).__name__ for m in modules],
                           sum(p.numel() for m in modules for p in m.parameters())])
    key = hashlib.sha256(identity.encode()).hexdigest()[:24]
    path = cache_dir() / "layout.json"
    cached = _load_cache(path).get(key)
    if cached is not None:
        return cached["choice"], "cache", cached["ms"]
    started = _clocks()
    with _synthetic_step(config, task, encoded, samples) as step:
        timings, difference = time_layouts(step, modules, _parameters(task), device, samples, bf16)
    choice = difference <= CHANNELS_LAST_TOLERANCE and \
        timings["channels_last"] * BF16_MIN_GAIN < timings["contiguous"]
    log.info("train.channels_last=auto: %s (ms per sample forward+backward: contiguous %.0f, channels_last %.0f; "
             "loss %.1e apart)", "on" if choice else "off", timings["contiguous"], timings["channels_last"],
             difference)
    if _ran_alone(started, device, "layout timings"):
        _cache(path, key, {"choice": choice, "ms": timings}, "layout timings")
    return choice, "measured", timings


ENCODE_TOLERANCE = 0.02
"""The most a way of encoding's latents may differ from fp32's (RMS of the difference over RMS of fp32's) and be
kept: bf16 rounds each conv's inputs to 8 bits of mantissa, channels_last sums in another order."""


@dataclass(frozen=True)
class Encoding:
    """A way for the frozen autoencoder to encode a step's images (``train.encode``): fp32 or bf16 autocast, in the
    contiguous or the channels_last layout."""

    way: str = "fp32"

    def place(self, vae: nn.Module) -> None:
        """The autoencoder's weights in this way's layout."""
        channels_last = self.way.endswith("+channels_last")
        if channels_last and self.way not in encoding_ways(vae):
            raise UserError(f"train.encode: {self.way}: this autoencoder's convolutions are 3D, which have no "
                            "channels_last layout; use fp32, bf16 or auto")
        vae.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)

    def encode(self, codec: Any, vae: nn.Module, pixels: torch.Tensor) -> Any:
        """`codec`'s posterior of `pixels` through `vae` (placed) this way."""
        if self.way.endswith("+channels_last"):
            pixels = pixels.contiguous(memory_format=torch.channels_last)
        with torch.autocast(pixels.device.type, dtype=torch.bfloat16, enabled=self.way.startswith("bf16")):
            return codec.encode(vae, pixels)


def encoding_ways(vae: nn.Module) -> tuple[str, ...]:
    """The ways `vae` can encode: channels_last only where its convolutions are 2D (a video codec's, 3D, have no
    such layout: Qwen-Image's and Wan's)."""
    from sdtrain.config import ENCODINGS

    planar = all(p.dim() != 5 for p in vae.parameters())
    return ENCODINGS if planar else tuple(way for way in ENCODINGS if not way.endswith("+channels_last"))


def time_encodings(encode_with: Callable[[str], torch.Tensor], device: torch.device, samples: int,
                   ways: tuple[str, ...], repeats: int = 2) -> tuple[dict[str, float], dict[str, float]]:
    """Milliseconds per sample of each of `ways` (the first fp32's; `encode_with(way)`: the latents), alternating,
    the first round a warm-up, each way's best kept; and each way's difference from fp32's latents (see
    ENCODE_TOLERANCE)."""
    best = dict.fromkeys(ways, float("inf"))
    errors: dict[str, float] = {}
    reference = None
    with torch.no_grad():
        for attempt in range(repeats + 1):
            for way in ways:
                started = time.perf_counter()
                latents = encode_with(way).float()
                _synchronize(device)
                seconds = time.perf_counter() - started
                if attempt:
                    best[way] = min(best[way], seconds)
                if reference is None:
                    reference = latents
                errors[way] = float((latents - reference).square().mean().sqrt()
                                    / reference.square().mean().sqrt().clamp_min(1e-12))
    return {way: 1000 * seconds / samples for way, seconds in best.items()}, errors


def choose_encoding(timings: dict[str, float], errors: dict[str, float]) -> str:
    """The fastest way whose latents agree with fp32's (ENCODE_TOLERANCE), by BF16_MIN_GAIN at least; else fp32."""
    agreeing = [way for way in timings if errors[way] <= ENCODE_TOLERANCE]
    fastest = min(agreeing, key=timings.__getitem__)
    return fastest if timings[fastest] * BF16_MIN_GAIN < timings["fp32"] else "fp32"


def _decide_encoding(config: RunConfig, task: Any, encoded: bool, previous: dict[str, Any] | None,
                     device: torch.device) -> tuple[str, str, dict[str, float] | None]:
    """`train.encode` for this run: the config's, the run's first start's, measured (cached per machine), or fp32
    where nothing is to choose (no encode in the step, clips)."""
    requested = config.train.encode
    if encoded or config.stage != "diffusion" or getattr(task, "vae", None) is None or task.clip_reading()["clips"]:
        return "fp32", "default", None
    if requested != "auto":
        return requested, "config", None
    if previous is not None:  # a run started before the encode was chosen encoded in fp32: it resumes so
        return previous.get("encode", "fp32"), "checkpoint", previous.get("encode_ms")
    data = config.data
    shape = (data.batch_size, 3, data.resolution, data.resolution)
    pixels = (torch.rand(shape, generator=torch.Generator().manual_seed(0)) * 2 - 1).to(task.device)
    vae = task.vae
    identity = json.dumps(["encode-v1", _machine_key(device), torch.__version__, data.batch_size, data.resolution,
                           type(vae).__name__, sum(p.numel() for p in vae.parameters())])
    key = hashlib.sha256(identity.encode()).hexdigest()[:24]
    path = cache_dir() / "encode.json"
    cached = _load_cache(path).get(key)
    if cached is not None:
        return cached["choice"], "cache", cached["ms"]

    def encode_with(way: str) -> torch.Tensor:
        Encoding(way).place(vae)
        return Encoding(way).encode(task.family.codec, vae, pixels).mode()

    started = _clocks()
    try:
        timings, errors = time_encodings(encode_with, device, data.batch_size, encoding_ways(vae))
    finally:
        Encoding().place(vae)  # back to the contiguous layout until the choice is applied
    choice = choose_encoding(timings, errors)
    log.info("train.encode=auto: %s (ms per image: %s; latents against fp32's: %s)", choice,
             ", ".join(f"{way} {ms:.0f}" for way, ms in timings.items()),
             ", ".join(f"{way} {error:.1e}" for way, error in errors.items()))
    if _ran_alone(started, device, "encode timings"):
        _cache(path, key, {"choice": choice, "ms": timings}, "encode timings")
    return choice, "measured", timings


def _all_modules(task: Any) -> list[nn.Module]:
    seen: dict[int, nn.Module] = {}
    for name in task.family.components:
        module = getattr(task, name, None)
        if isinstance(module, nn.Module):
            seen[id(module)] = module
    for module in task.trainable.values():
        seen[id(module)] = module
    return list(seen.values())


def _parameters(task: Any) -> list[nn.Parameter]:
    return [p for module in _all_modules(task) for p in module.parameters()]


@contextlib.contextmanager
def _synthetic_step(config: RunConfig, task: Any, encoded: bool, samples: int) -> Iterator[Callable[[], Any]]:
    """The task's loss on a fixed synthetic batch of ``samples``, as a callable; the task's statistics and the
    RNG are as they were afterwards, so measuring changes nothing the run computes."""
    from sdtrain.data.synthetic import SyntheticBatches  # deferred: diffusers and transformers, for a trial only

    data = dataclasses.replace(config.data, batch_size=samples)
    batch = SyntheticBatches(data, task, seed=config.seed, rank=0, encoded=encoded).next()
    generator = torch.Generator(task.device)
    extra, rng = task.extra_state(), torch.get_rng_state()
    # bf16 weights (optim.weights) compute under bf16 autocast only, as their training steps do. Otherwise no
    # autocast of its own: a disabled one would switch off the bf16 autocast that time_precisions times it under.
    bf16 = config.optim.weights == "bf16"

    def step() -> torch.Tensor:
        # The same noise every call, so that two ways of running the step give comparable losses.
        generator.manual_seed(0)
        torch.set_rng_state(rng)
        with torch.autocast(task.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            return task.loss(batch, generator)[0]

    try:
        yield step
    finally:
        task.load_extra_state(extra)
        torch.set_rng_state(rng)


def _record(config: RunConfig, task: Any, encoded: bool) -> LayerCalls:
    """The distinct layer calls of the modules backward runs through on one synthetic sample, and those inside the
    blocks of the trained modules, which activation checkpointing wraps (train/parallel.py)."""
    blocks = [block for module in task.parallel_modules().values() for block in families.blocks(module)]
    with _synthetic_step(config, task, encoded, 1) as step:
        record = record_layer_calls(task.backward_modules(), step, blocks)
    record.spared_cast_bytes = _spared_cast_bytes(blocks)
    return record


def _spared_cast_bytes(blocks: list[nn.Module]) -> int:
    """`LayerCalls.spared_cast_bytes` of the `blocks` (nested ones counted with the block around them)."""
    inner = {id(sub) for block in blocks for sub in block.modules() if sub is not block}
    casts = [sum(p.numel() * 2 for p in block.parameters() if p.dtype == torch.float32)
             for block in blocks if id(block) not in inner]
    return sum(casts) - max(casts, default=0)


class FirstStepMemory:
    """The first step's memory peak (the process tree's on a CPU, the device's on a GPU), logged beside the estimate
    the run was planned with, so a plan that ran low shows before a long run is killed."""

    def __init__(self, tuning: Tuning, device: torch.device, enabled: bool = True):
        self.tuning = tuning
        self.device = device
        self.watch: TreePeak | None = None
        self.pending = enabled
        if enabled and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        elif enabled:
            self.watch = TreePeak(phase="step").__enter__()

    def after_step(self) -> None:
        if not self.pending:
            return
        self.pending = False
        if self.watch is not None:
            self.watch.stop()
            peak = self.watch.peak("step")
        else:
            peak = torch.cuda.max_memory_allocated(self.device)
        estimate = self.tuning.estimated_gib
        log.info("first step: memory peak %.2f GiB%s", peak / 2**30,
                 f" (estimated {estimate:.2f} GiB before it)" if estimate is not None else "")
