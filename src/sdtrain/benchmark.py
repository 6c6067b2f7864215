"""Training speed and memory of a config: images/s, MFU, step and all-reduce time, and the peak memory of
loading and of training.

The benchmark runs what `sdtrain train` runs: the same model loading (pretrained components from
``model.pretrained`` when the config names them), parallel wrapping, precision and step, fed by the real
loader and its workers over shards: the config's own, or synthetic ones it writes (captioned images, or
with ``--encoded`` what ``sdtrain prepare encode`` writes). Memory is the whole process tree's (trainer,
fork server, loader workers), as the machine sees it. Only logging, checkpoints and validation are off.
Under torchrun every rank takes part; the main rank reports.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sdtrain import flops
from sdtrain.config import RunConfig
from sdtrain.data.pipeline import TrainBatches
from sdtrain.data.shards import write_manifest
from sdtrain.data.synthetic import write_synthetic_shards
from sdtrain.distributed import barrier, gather_objects
from sdtrain.errors import UserError
from sdtrain.memory import TreePeak, own_peak_bytes
from sdtrain.models import build, families
from sdtrain.train import autotune
from sdtrain.train.components import ComponentPlanner
from sdtrain.train.modes import make_part
from sdtrain.train.parallel import uncounted_recomputation
from sdtrain.train.tasks import text_reads_sources
from sdtrain.train.trainer import Trainer
from sdtrain.utils import atomic_write_text

log = logging.getLogger(__name__)

SYNTHETIC = "synthetic-shards"
"""Where in its run folder the benchmark writes shards, when a config names none."""
SYNTHETIC_SAMPLES = (64, 2048)
"""Least and most samples of synthetic shards: a few epochs of a short benchmark, written in seconds."""
RANDOM_VAE = "random-vae"
"""Where in its run folder the benchmark puts an untrained VAE of the preset, when a config names none."""
def random_text_encoder(name: str) -> str:
    """The same for each frozen text encoder a config does not name (text_encoder, text_encoder_2, ...)."""
    return f"random-{name.replace('_', '-')}"


class Benchmark(Trainer):
    def __init__(self, config: RunConfig, encoded: bool = False, plan_only: bool = False):
        self.encoded = encoded
        self.plan_only = plan_only
        self.losses: list[torch.Tensor] = []
        """The loss of every step taken since `measure` began."""
        # From before the first weight is loaded: loading has its own peak, which may be the run's highest.
        self.memory = TreePeak(phase="loading").__enter__()
        try:
            super().__init__(config)
        except BaseException:
            self.memory.stop()
            raise

    def _prepare(self) -> None:
        model = self.config.model
        if model.source("vae") == str(self.run_dir / RANDOM_VAE):
            build.build_vae(model).save_pretrained(model.source("vae"))
        stand_ins: dict[str, Any] = {}
        if self.config.stage == "diffusion" and model.source("tokenizer") is None \
                and self.config.model.pretrained is None:
            # No captions to learn from: a tokenizer of the configured size on generic text will do,
            # since only its length and vocabulary size shape the step.
            words = [f"token{i} word{i % 97} thing{i % 13}" for i in range(self.config.model.tokenizer_vocab_size)]
            tokenizer = families.for_model(model).conditioner.train_tokenizer(words, self.run_dir / "tokenizer",
                                                                  model.tokenizer_vocab_size, build.text_length(model))
            for name in families.for_model(model).components.text_encoders:
                if model.source(name) == str(self.run_dir / random_text_encoder(name)):
                    # Its config first: weights only if the step reads them (a 24B language model would not fit
                    # in memory in fp32).
                    with torch.device("meta"):
                        build.build_text_encoder(model, tokenizer, name).config.save_pretrained(model.source(name))
                    stand_ins[name] = tokenizer
        stood_in_for = self._announce_encoded_shards() if self.config.stage == "diffusion" else []
        for name, tokenizer in stand_ins.items():
            if name not in stood_in_for:
                build.build_text_encoder(model, tokenizer, name).save_pretrained(model.source(name))

    def _announce_encoded_shards(self) -> list[str]:
        """With ``--encoded`` and synthetic shards, say before the task is built which frozen components made them
        (the manifest's encoding, completed when the shards are written), so the task builds those the shards
        stand in for without weights, as it does on a user's encoded shards; returns them."""
        synthetic = self.run_dir / SYNTHETIC
        if not self.encoded or Path(self.config.data.shards) != synthetic:
            return []
        family = families.for_model(self.config.model)
        planner = ComponentPlanner(self.config, family, {})
        encoding = {name: planner.source(name) for name in ("vae", *family.components.text_encoders)}
        synthetic.mkdir(parents=True, exist_ok=True)
        write_manifest(synthetic, [], extra={"encoding": encoding})
        text_runs = (make_part(self.config, family).text_encoder_trains()
                     or text_reads_sources(self.config, family))
        return planner.stood_in_for(encoding, self.config.data, text_runs)

    def _tune(self) -> autotune.Tuning:
        # Loading ends here: what autotune measures next is a training step's memory, not loading's. The
        # process's own high-water mark covers any peak between two samples.
        self.loading_peak = max(self.memory.peak("loading"), own_peak_bytes())
        self.memory.phase("tuning")
        return super()._tune(plan_only=self.plan_only)

    def _make_data(self) -> TrainBatches:
        if self.encoded and not (self.task.reads_encoded and self.config.data.use_encoded):
            raise UserError(f"--encoded: the {self.config.stage} stage trains on images, not pre-encoded latents"
                            if not self.task.reads_encoded else "--encoded: data.use_encoded is false")
        synthetic = self.run_dir / SYNTHETIC
        self.synthetic_data = Path(self.config.data.shards) == synthetic
        if self.synthetic_data:
            if self.is_main:
                write_synthetic_shards(synthetic, self.config.data, self.task, self._synthetic_samples(),
                                       self.encoded, self.config.seed)
            barrier()
        data = super()._make_data()
        if self.encoded and data.encoding is None:
            raise UserError(f"--encoded: the shards of data.shards={self.config.data.shards} hold images; encode them "
                            "with `sdtrain prepare encode`, or drop --encoded")
        return data

    def _synthetic_samples(self) -> int:
        data, world = self.config.data, self.topology.world_size
        least = world * max(1, data.num_workers) * data.batch_size  # a batch for every loader slot
        if self.plan_only:  # no step reads them: a batch for the loader to open is enough
            return least
        wanted = 8 * world * data.batch_size * self.config.train.grad_accum
        return max(least, min(max(wanted, SYNTHETIC_SAMPLES[0]), SYNTHETIC_SAMPLES[1]))

    def memory_plan(self) -> dict[str, Any]:
        """The planner's figures for this config, as a run would log them before its first step: its expected
        peak (training or loading, whichever is higher), whether it needs activation checkpointing and the frozen
        weights' storage; no step runs, so a size whose step would take hours on this machine is planned in the
        time loading takes."""
        data, tuning = self.config.data, self.tuning
        return {
            "plan_only": True,
            "stage": self.config.stage,
            "encoded": self.encoded,
            "device": self.device.type,
            "resolution": data.resolution,
            "frames": data.frames,
            "batch_size": data.batch_size,
            "trainable_parameters": sum(p.numel() for p in self.task.parameters()),
            "frozen_precision": self.task.frozen_precision,
            "mixed_precision": tuning.precision,
            "gradient_checkpointing": tuning.checkpointing,
            "estimated_peak_gib": tuning.estimated_gib,
            "training_peak_gib": tuning.training_gib,
            "loading_peak_memory_gib": self._peak_memory_gib("loading"),
            "available_gib": tuning.available_gib,
            "fits": tuning.estimated_gib is not None and tuning.estimated_gib <= tuning.available_gib,
            "planned_in_s": tuning.seconds,
        }

    def measure(self, steps: int, warmup: int, peak_seconds: float = 2.0, save: bool = True) -> dict[str, Any]:
        """Time the first step on its own, then `steps` steady steps after `warmup` more; count the step's
        model FLOPs and measure this machine's peak for the step's dtype, before and after, for MFU; then
        time a checkpoint save and the memory it adds."""
        self.memory.phase("training")
        self.losses.clear()
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        threads = torch.get_num_threads()
        # Another job on the cores makes steps stall for seconds: the load shows whether figures can be trusted.
        load_before = os.getloadavg()[0]
        peaks = [flops.measure_peak_flops(dtype, self.device, threads, peak_seconds)]
        first = self._timed_step()
        for _ in range(max(warmup - 1, 0)):
            self.train_step()
        times = [self._timed_step() for _ in range(steps)]
        # Counted after the timed steps: compiled blocks run under the counter's dispatch mode stay slower
        # afterwards (pytorch/pytorch#140909).
        attention: set[str] = set()
        with uncounted_recomputation():  # model FLOPs: a checkpointed block's second forward is not the model's work
            step_flops = flops.count_flops(self.train_step, attention)
        training_peak = self._peak_memory_gib("training")
        peaks.append(flops.measure_peak_flops(dtype, self.device, threads, peak_seconds))
        step_s = statistics.median(times)
        world = self.topology.world_size
        global_batch = self.config.data.batch_size * self.config.train.grad_accum * world
        params = sum(p.numel() for p in self.task.parameters())
        per_image = step_flops * world / global_batch  # every rank counted its own share of the batch
        peak = max(p["peak_gflops"] for p in peaks)
        result = {
            "stage": self.config.stage,
            "encoded": self.encoded,
            "device": self.device.type,
            "cpu": flops.cpu_flags() if self.device.type == "cpu" else {},
            "threads": threads,
            "world_size": world,
            "strategy": self.config.parallel.strategy if world > 1 else "single",
            "mixed_precision": self.tuning.precision,
            "precision_choice": self.tuning.as_dict(),
            # The fused SDPA kernels the step ran (none: attention took the math path, or the model has none).
            "attention_kernels": sorted(attention),
            "attention_allowed": list(self.config.train.attention_kernels),
            "gradient_checkpointing": self.tuning.checkpointing,
            "ema": self.ema is not None,
            "ema_every": self.config.ema.every,
            "optimizer_in_backward": self.config.optim.in_backward,
            "resolution": self.config.data.resolution,
            "batch_size": self.config.data.batch_size,
            "global_batch": global_batch,
            "trainable_parameters": params,
            "steps_timed": steps,
            "first_step_ms": 1000 * first,
            "step_ms": 1000 * step_s,
            "step_ms_mean": 1000 * statistics.fmean(times),
            "first_step_ratio": first / step_s,
            "images_per_s": global_batch / step_s,
            "model_gflop_per_image": per_image / 1e9,
            "peak_gflops": peak,
            "peak_gflops_runs": [p["peak_gflops"] for p in peaks],
            # GEMMs and convolutions can differ 2x on one CPU (MKL against oneDNN): both, for reading the MFU.
            "gemm_gflops": max(p["gemm_gflops"] for p in peaks),
            "conv_gflops": max(p["conv_gflops"] for p in peaks),
            "achieved_gflops": step_flops / step_s / 1e9,
            "mfu": flops.mfu(step_flops, step_s, peak),
            "peak_memory_gib": training_peak,
            "loading_peak_memory_gib": self._peak_memory_gib("loading"),
            "loader_workers": self.config.data.num_workers,
            "synthetic_data": self.synthetic_data,
            "loadavg_1min_before_after": [load_before, os.getloadavg()[0]],
            # Every step's loss, the first and the warm-up ones included: two runs of one config (the tuned path
            # against eager) are compared by them.
            "losses": [float(loss) for loss in self.losses],
            "cpu_count": os.cpu_count(),
        }
        if self.device.type == "cuda":
            result["device_peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if save:
            self.memory.phase("save")
            start = time.perf_counter()
            saved = self.save()
            # The training stall: every rank waits until the slowest has written its part (or, with
            # checkpoint.async_save, has copied it aside).
            result["save_s"] = time.perf_counter() - start
            self.checkpointer.finish_writing()
            result["save_written_s"] = time.perf_counter() - start
            result["save_format"] = ("async " if self.checkpointer.async_save else "") + \
                ("sharded" if self.checkpointer.sharded else "full")
            result["save_peak_memory_gib"] = max(training_peak, self._peak_memory_gib("save"))
            result["save_peak_ratio"] = result["save_peak_memory_gib"] / training_peak
            if self.is_main:  # a timing artefact: the next benchmark in the same run_dir starts clean
                shutil.rmtree(saved, ignore_errors=True)
        result |= self._allreduce(params)
        return result

    def train_step(self) -> dict[str, torch.Tensor]:
        totals = super().train_step()
        self.losses.append(totals["loss"])  # read at the end: a read per step would sync the device
        return totals

    def _timed_step(self) -> float:
        start = time.perf_counter()
        self.train_step()
        self._synchronize()
        return time.perf_counter() - start

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _peak_memory_gib(self, phase: str) -> float:
        """The host memory peak of `phase` over every rank's process tree (loader workers included): a sum of
        each rank's peak, so at most what the ranks held together."""
        peak = self.loading_peak if phase == "loading" else self.memory.peak(phase)
        return sum(gather_objects(peak)) / 2**30

    def _allreduce(self, params: int, repeats: int = 5) -> dict[str, float]:
        """Time one all-reduce of a gradient-sized fp32 buffer: what DDP reduces every step, here
        without overlap with backward, so it bounds the communication cost of a step. Not under FSDP, which
        reduce-scatters block by block, and where a whole-model buffer is memory the ranks do not have."""
        if not dist.is_initialized() or self.config.parallel.strategy == "fsdp":
            return {}
        buffer = torch.zeros(params, dtype=torch.float32, device=self.device)
        times = []
        for attempt in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buffer)
            self._synchronize()
            if attempt:
                times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        world = self.topology.world_size
        # The bus bandwidth convention of nccl-tests: comparable across world sizes.
        bus_bytes = buffer.numel() * 4 * 2 * (world - 1) / world
        return {"allreduce_ms": 1000 * seconds, "allreduce_bus_gb_per_s": bus_bytes / seconds / 1e9}


def run_benchmark(config: RunConfig, steps: int, warmup: int, encoded: bool = False,
                  peak_seconds: float = 2.0, save: bool = True, plan_only: bool = False) -> dict[str, Any] | None:
    """Time the config's training step in this process (and its torchrun peers); the main rank's result.
    `plan_only`: the planner's figures instead (`Benchmark.memory_plan`), no step run."""
    benchmark = Benchmark(config, encoded, plan_only)
    try:
        result = benchmark.memory_plan() if plan_only else benchmark.measure(steps, warmup, peak_seconds, save=save)
    finally:
        benchmark.data.close()
        benchmark.memory.stop()
        benchmark.logger.close()
    return result if benchmark.is_main else None


def benchmark_overrides(config_path: Path, overrides: list[str], run_dir: str | None) -> list[str]:
    """The user's overrides plus what a benchmark needs: synthetic shards where the config names none, a
    throwaway run folder, an untrained VAE and frozen text encoder of the preset where neither the config nor
    a pretrained model gives them, and no logging, checkpoints or validation."""
    from omegaconf import OmegaConf

    from sdtrain.config import load_config_without, parse_overrides, read_layer

    given = OmegaConf.merge(read_layer(config_path)[0], parse_overrides(overrides))
    model = load_config_without(config_path, overrides).model
    filled = []
    # The benchmark does not evaluate: a recipe's held-out set (MLPerf Flux's val_loss) need not exist.
    for key, value in (("data.shards", "${run_dir}/" + SYNTHETIC), ("run_dir", run_dir),
                       ("evaluation.val_shards", "null")):
        if OmegaConf.select(given, key, default=None) is None or OmegaConf.is_missing(given, key):
            if value is None:
                raise UserError("run_dir: under a multi-process launcher give run_dir=FOLDER, a folder every rank "
                                "shares, for the benchmark's scratch files")
            filled.append(f"{key}={value}")
    if model.pretrained is None:
        frozen_text = not OmegaConf.select(given, "diffusion.train_text_encoder", default=False)
        stand_ins = {"vae": RANDOM_VAE, **{name: random_text_encoder(name) for name in
                                           families.for_model(model).components.text_encoders if frozen_text}}
        filled += [f"model.components.{name}.source=${{run_dir}}/{folder}" for name, folder in stand_ins.items()
                   if model.source(name) is None]
    quiet = ["logging.progress=false", "logging.tensorboard=false", "logging.wandb=false", "validation.prompts=[]",
             "checkpoint.every=0", "checkpoint.resume=never", "evaluation.every_samples=0"]
    return [*filled, *overrides, *quiet]


def compare_processes(config_path: Path, overrides: list[str], counts: list[int], steps: int,
                      warmup: int, encoded: bool = False, peak_seconds: float = 2.0) -> list[dict[str, Any]]:
    """Run the benchmark under torchrun with each number of processes on this machine, one after another."""
    cores = os.cpu_count() or 1
    results = []
    with tempfile.TemporaryDirectory(prefix="sdtrain-benchmark-") as scratch:
        for count in counts:
            out = Path(scratch) / f"{count}.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(count),
                       "-m", "sdtrain", "benchmark", "train", str(config_path), *overrides,
                       f"run_dir={Path(scratch) / f'run{count}'}", "--steps", str(steps), "--warmup", str(warmup),
                       "--peak-seconds", str(peak_seconds),
                       "--out", str(out), *(["--encoded"] if encoded else [])]
            # Processes sharing the cores share the threads: oversubscribing them is far slower.
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, cores // count)))}
            log.info("benchmarking %d process%s", count, "es" if count > 1 else "")
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                tail = "\n".join(done.stderr.strip().splitlines()[-15:])
                raise UserError(f"the {count}-process benchmark failed (exit {done.returncode}):\n{tail}")
            results.append(json.loads(out.read_text()))
    return results


def write_result(path: Path, result: Any) -> None:
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")


def format_plan(plan: dict[str, Any]) -> str:
    """The planner's figures (`Benchmark.memory_plan`), one per line."""
    frames = f" x {plan['frames']} frames" if plan["frames"] else ""
    loading = plan["loading_peak_memory_gib"]
    return "\n".join([
        f"plan for {plan['resolution']} px{frames}, batch {plan['batch_size']} ({plan['stage']}, "
        f"{'encoded' if plan['encoded'] else 'pixels'}, {plan['device']}; no step run)",
        f"  expected peak     {plan['estimated_peak_gib']:.2f} GiB of {plan['available_gib']:.2f} GiB usable"
        f" ({'fits' if plan['fits'] else 'does not fit'}): training {plan['training_peak_gib']:.2f} GiB, loading "
        f"took {loading:.2f} GiB",
        f"  checkpointing     {'on' if plan['gradient_checkpointing'] else 'off'}",
        f"  precision         {plan['mixed_precision']}; frozen weights stored in {plan['frozen_precision']}",
        f"  trainable         {plan['trainable_parameters']:,} parameters",
    ])


def format_results(results: list[dict[str, Any]], sweep_keys: list[str] = ()) -> str:
    """One row per result: the MosaicML benchmark's table (micro-batch, EMA, throughput) with MFU, the first
    step, memory and the save, and process scaling when several process counts were compared."""
    base = results[0]["images_per_s"] / results[0]["world_size"]
    extra = [k for k in sweep_keys if k not in ("data.batch_size", "ema.enabled")]
    head = [f"{'procs':>5}", f"{'strategy':>8}", f"{'micro bs':>8}", f"{'EMA':>3}", f"{'prec':>4}",
            *(f"{k.split('.')[-1]:>12}" for k in extra), f"{'img/s':>9}", f"{'MFU':>6}", f"{'step ms':>9}",
            f"{'first':>6}", f"{'allreduce ms':>12}", f"{'scaling':>7}", f"{'workers':>7}", f"{'load GiB':>8}",
            f"{'peak GiB':>8}", f"{'save as':>13}",
            f"{'save s':>7}", f"{'written s':>9}", f"{'save GiB':>8}"]
    lines = [" ".join(head)]
    for r in results:
        allreduce = f"{r['allreduce_ms']:.1f}" if "allreduce_ms" in r else "-"
        scaling = r["images_per_s"] / (base * r["world_size"])
        save_s = f"{r['save_s']:.1f}" if "save_s" in r else "-"
        save_gib = f"{r['save_peak_memory_gib']:.2f}" if "save_peak_memory_gib" in r else "-"
        written_s = f"{r['save_written_s']:.1f}" if "save_written_s" in r else "-"
        row = [f"{r['world_size']:>5}", f"{r['strategy']:>8}", f"{r['batch_size']:>8}",
               f"{'yes' if r['ema'] else 'no':>3}", f"{r['mixed_precision']:>4}",
               *(f"{str(r.get('sweep', {}).get(k, '-')):>12}" for k in extra),
               f"{r['images_per_s']:>9.3g}", f"{r['mfu']:>6.1%}", f"{r['step_ms']:>9.1f}",
               f"{r['first_step_ratio']:>5.1f}x", f"{allreduce:>12}", f"{scaling:>7.0%}",
               f"{r.get('loader_workers', '-'):>7}", f"{r.get('loading_peak_memory_gib', float('nan')):>8.2f}",
               f"{r['peak_memory_gib']:>8.2f}", f"{r.get('save_format', '-'):>13}", f"{save_s:>7}",
               f"{written_s:>9}", f"{save_gib:>8}"]
        lines.append(" ".join(row))
    first = results[0]
    cpu = first.get("cpu") or {}
    if cpu:
        flags = ", ".join(k for k in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if cpu.get(k))
        lines.append(f"cpu: {cpu.get('model', '?')} ({flags or 'no avx512/amx'}), {first['threads']} threads")
    lines.append("memory: the peak of every process of the run (trainer, loader workers, ranks) while loading the "
                 "models (load) and while training (peak)")
    lines.append(f"model FLOPs {first['model_gflop_per_image']:.3g} GFLOP/image (forward + backward); MFU against "
                 f"the best of {', '.join(f'{p:.0f}' for p in first['peak_gflops_runs'])} GFLOP/s measured here "
                 f"in {first['mixed_precision']}")
    return "\n".join(lines)


def sweep_combinations(sweeps: list[str]) -> tuple[list[str], list[list[str]]]:
    """`KEY=V1,V2` items -> the keys and one override list per combination (the first key varies slowest)."""
    import itertools

    keys, choices = [], []
    for item in sweeps:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise UserError(f"--sweep {item}: expected KEY=V1,V2,... e.g. data.batch_size=1,2,4")
        keys.append(key)
        choices.append([f"{key}={v}" for v in _split_top_level(values)])
    combos = [list(combo) for combo in itertools.product(*choices)]
    from sdtrain.config import parse_overrides

    for combo in combos:
        parse_overrides(combo)  # a malformed value is one line now, not a failed child process later
    return keys, combos


def _split_top_level(values: str) -> list[str]:
    """``1,2,4`` -> 1 / 2 / 4, keeping commas inside brackets: ``[a,b],[c]`` -> [a,b] / [c]."""
    parts, depth, current = [], 0, ""
    for char in values:
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


def run_sweep(config_path: Path, overrides: list[str], sweeps: list[str], steps: int, warmup: int,
              encoded: bool = False, peak_seconds: float = 2.0) -> tuple[list[str], list[dict[str, Any]]]:
    """Each combination in a process of its own, so each peak memory is that combination's alone."""
    keys, combos = sweep_combinations(sweeps)
    results = []
    with tempfile.TemporaryDirectory(prefix="sdtrain-sweep-") as scratch:
        for i, combo in enumerate(combos):
            out = Path(scratch) / f"{i}.json"
            command = [sys.executable, "-m", "sdtrain", "benchmark", "train", str(config_path), *overrides, *combo,
                       "--steps", str(steps), "--warmup", str(warmup), "--peak-seconds", str(peak_seconds),
                       "--out", str(out), *(["--encoded"] if encoded else [])]
            log.info("sweep %d/%d: %s", i + 1, len(combos), " ".join(combo))
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                tail = "\n".join(done.stderr.strip().splitlines()[-15:])
                raise UserError(f"sweep {' '.join(combo)} failed (exit {done.returncode}):\n{tail}")
            result = json.loads(out.read_text())
            result["sweep"] = dict(c.split("=", 1) for c in combo)
            results.append(result)
    return keys, results


def loader_rate(config: RunConfig, tokenizer: Any | None, batches: int, warmup: int, encoded: bool,
                clips: dict[str, Any] | None = None) -> dict[str, Any]:
    """Samples per second the configured loader delivers on its own (this rank of one); `clips`: what it is told of
    the clips the model reads (`Task.clip_reading`)."""
    data = TrainBatches(config.data, tokenizer, config.seed, encoded=encoded, **(clips or {}))
    try:
        for _ in range(warmup):
            data.next()
        start = time.perf_counter()
        samples = sum(len(data.next()["keys"]) for _ in range(batches))
        seconds = time.perf_counter() - start
    finally:
        data.close()
    return {"workers": config.data.num_workers, "samples_per_s": samples / seconds,
            "encoded": data.encoding is not None, "skipped": data.position.total_skipped,
            "filtered": data.position.total_filtered}


def benchmark_data(config: RunConfig, worker_counts: list[int], batches: int, train_steps: int) -> dict[str, Any]:
    """The loader's rate for each worker count beside the training step's consumption rate."""
    import dataclasses

    from sdtrain.data.encoded import dataset_encoding
    from sdtrain.train.tasks import TASKS

    stage_reads_encoded = TASKS[config.stage].reads_encoded and config.data.use_encoded
    encoded = stage_reads_encoded and dataset_encoding(config.data.shards) is not None
    # One model build serves both: its tokenizer for the loader, its step for the consumption rate.
    trainer = Benchmark(config, encoded=encoded)
    try:
        rates = []
        for workers in worker_counts:
            variant = dataclasses.replace(config, data=dataclasses.replace(config.data, num_workers=workers))
            log.info("loader with %d workers", workers)
            rates.append(loader_rate(variant, trainer.task.caption_tokenizer, batches, warmup=max(1, workers),
                                     encoded=stage_reads_encoded, clips=trainer.task.clip_reading()))
        consumption = trainer.measure(train_steps, warmup=2, peak_seconds=0.2, save=False)["images_per_s"] \
            if train_steps else None
    finally:
        trainer.data.close()
        trainer.memory.stop()
        trainer.logger.close()
    return {"loader": rates, "train_images_per_s": consumption, "batch_size": config.data.batch_size,
            "resolution": config.data.resolution}


def format_data_results(result: dict[str, Any]) -> str:
    lines = [f"{'workers':>7} {'samples/s':>10} {'x training':>11}"]
    train = result["train_images_per_s"]
    for r in result["loader"]:
        ratio = f"{r['samples_per_s'] / train:.1f}x" if train else "-"
        lines.append(f"{r['workers']:>7} {r['samples_per_s']:>10.1f} {ratio:>11}")
    if train:
        lines.append(f"training consumes {train:.1f} img/s (batch {result['batch_size']}, {result['resolution']} px)")
    return "\n".join(lines)
