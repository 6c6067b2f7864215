"""Training speed of a config on synthetic batches: images/s, step time, all-reduce time, peak memory.

The benchmark is the real trainer (same model building, parallel wrapping, precision and step) fed
fixed random batches, so what it measures is the model step alone: no loader, no checkpoints, no
validation. Under torchrun every rank takes part; the main rank reports.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sdtrain.config import DataConfig, RunConfig
from sdtrain.errors import UserError
from sdtrain.models import build
from sdtrain.models.tokenizer import train_clip_tokenizer
from sdtrain.train.trainer import Trainer
from sdtrain.utils import atomic_write_text

log = logging.getLogger(__name__)

SYNTHETIC = "synthetic"
"""The `data.shards` value the benchmark fills in when a config leaves it open."""
RANDOM_VAE = "random-vae"
"""Where in its run folder the benchmark puts an untrained VAE of the preset, when a config names none."""
RANDOM_TEXT_ENCODER = "random-text-encoder"
"""The same for a frozen text encoder a config does not name."""


class SyntheticBatches:
    """One fixed random batch per rank, served forever: the data side of the step costs nothing.

    `encoded` batches look like pre-encoded shards: latents (and, for a frozen text encoder, text
    embeddings) instead of pixels, so the step skips the encoders as it would on such shards.
    """

    def __init__(self, config: DataConfig, task: Any, seed: int, rank: int, encoded: bool = False):
        generator = torch.Generator().manual_seed(seed * 1000 + rank)
        size, count = config.resolution, config.batch_size
        self.shards: list = []
        self.num_samples = 0
        self.batch: dict[str, Any] = {
            "captions": ["synthetic"] * count,
            "keys": [f"synthetic-{i}" for i in range(count)],
        }
        tokenizer = task.tokenizer
        if tokenizer is not None:
            length = tokenizer.model_max_length
            self.batch["input_ids"] = torch.randint(0, len(tokenizer), (count, length), generator=generator)
        if not encoded:
            self.batch["pixel_values"] = torch.rand(count, 3, size, size, generator=generator) * 2 - 1
            return
        vae = task.vae.config
        side = size // build.vae_scale(vae.block_out_channels)
        self.batch["latent_mean"] = torch.randn(count, vae.latent_channels, side, side, generator=generator)
        self.batch["latent_std"] = torch.full_like(self.batch["latent_mean"], 0.1)
        if task.text_embeddings:
            hidden = task.text_encoder.config.hidden_size
            self.batch["text_emb"] = torch.randn(count, tokenizer.model_max_length, hidden, generator=generator)

    def next(self) -> dict[str, Any]:
        return self.batch

    def close(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}


class Benchmark(Trainer):
    def __init__(self, config: RunConfig, encoded: bool = False):
        self.encoded = encoded
        super().__init__(config)

    def _prepare(self) -> None:
        model = self.config.model
        if model.vae == str(self.run_dir / RANDOM_VAE):
            build.build_vae(model).save_pretrained(model.vae)
        if self.config.stage == "diffusion" and self.config.model.tokenizer is None \
                and self.config.model.pretrained is None:
            # No captions to learn from: a tokenizer of the configured size on generic text will do,
            # since only its length and vocabulary size shape the step.
            words = [f"token{i} word{i % 97} thing{i % 13}" for i in range(self.config.model.tokenizer_vocab_size)]
            tokenizer = train_clip_tokenizer(words, self.run_dir / "tokenizer", self.config.model.tokenizer_vocab_size,
                                             self.config.model.max_text_length)
            if model.text_encoder == str(self.run_dir / RANDOM_TEXT_ENCODER):
                build.build_text_encoder(model, tokenizer).save_pretrained(model.text_encoder)

    def _make_data(self) -> SyntheticBatches:
        if self.encoded and not self.task.reads_encoded:
            raise UserError(f"--encoded: the {self.config.stage} stage trains on images, not pre-encoded latents")
        if self.encoded:
            self.task.text_embeddings = not self.config.diffusion.train_text_encoder
        return SyntheticBatches(self.config.data, self.task, self.config.seed, self.topology.rank, self.encoded)

    def measure(self, steps: int, warmup: int) -> dict[str, Any]:
        times = []
        for step in range(warmup + steps):
            start = time.perf_counter()
            self.train_step()
            self._synchronize()
            if step >= warmup:
                times.append(time.perf_counter() - start)
        step_s = statistics.median(times)
        world = self.topology.world_size
        global_batch = self.config.data.batch_size * self.config.train.grad_accum * world
        params = sum(p.numel() for p in self.task.parameters())
        result = {
            "stage": self.config.stage,
            "encoded": self.encoded,
            "device": self.device.type,
            "world_size": world,
            "strategy": self.config.parallel.strategy if world > 1 else "single",
            "mixed_precision": self.config.train.mixed_precision,
            "resolution": self.config.data.resolution,
            "global_batch": global_batch,
            "trainable_parameters": params,
            "steps_timed": steps,
            "step_ms": 1000 * step_s,
            "step_ms_mean": 1000 * statistics.fmean(times),
            "images_per_s": global_batch / step_s,
            "peak_memory_gib": self._peak_memory_gib(),
        }
        result |= self._allreduce(params)
        return result

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _peak_memory_gib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux

    def _allreduce(self, params: int, repeats: int = 5) -> dict[str, float]:
        """Time one all-reduce of a gradient-sized fp32 buffer: what DDP reduces every step, here
        without overlap with backward, so it bounds the communication cost of a step."""
        if not dist.is_initialized():
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


def run_benchmark(config: RunConfig, steps: int, warmup: int, encoded: bool = False) -> dict[str, Any] | None:
    """Time the config's training step in this process (and its torchrun peers); the main rank's result."""
    benchmark = Benchmark(config, encoded)
    try:
        result = benchmark.measure(steps, warmup)
    finally:
        benchmark.logger.close()
    return result if benchmark.is_main else None


def benchmark_overrides(config_path: Path, overrides: list[str], run_dir: str | None) -> list[str]:
    """The user's overrides plus what a benchmark needs: synthetic data where the config names none,
    a throwaway run folder, untrained VAE and frozen text encoder of the preset where the config leaves
    them open, and no
    logging, checkpoints or validation."""
    from omegaconf import OmegaConf

    given = OmegaConf.merge(OmegaConf.load(config_path), OmegaConf.from_dotlist(overrides))
    filled = []
    for key, value in (("data.shards", SYNTHETIC), ("model.vae", "${run_dir}/" + RANDOM_VAE), ("run_dir", run_dir)):
        if OmegaConf.select(given, key, default=None) is None or OmegaConf.is_missing(given, key):
            if value is None:
                raise UserError("run_dir: under a multi-process launcher give run_dir=FOLDER, a folder every rank "
                                "shares, for the benchmark's scratch files")
            filled.append(f"{key}={value}")
    frozen_text = not OmegaConf.select(given, "diffusion.train_text_encoder", default=False)
    if frozen_text and all(OmegaConf.select(given, k, default=None) is None for k in ("model.text_encoder",
                                                                                       "model.pretrained")):
        filled.append("model.text_encoder=${run_dir}/" + RANDOM_TEXT_ENCODER)
    quiet = ["logging.progress=false", "logging.tensorboard=false", "logging.wandb=false", "validation.prompts=[]",
             "checkpoint.every=0", "checkpoint.resume=never"]
    return [*filled, *overrides, *quiet]


def compare_processes(config_path: Path, overrides: list[str], counts: list[int], steps: int,
                      warmup: int, encoded: bool = False) -> list[dict[str, Any]]:
    """Run the benchmark under torchrun with each number of processes on this machine, one after another."""
    cores = os.cpu_count() or 1
    results = []
    with tempfile.TemporaryDirectory(prefix="sdtrain-benchmark-") as scratch:
        for count in counts:
            out = Path(scratch) / f"{count}.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(count),
                       "-m", "sdtrain", "benchmark", "train", str(config_path), *overrides,
                       f"run_dir={Path(scratch) / f'run{count}'}", "--steps", str(steps), "--warmup", str(warmup),
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


def format_results(results: list[dict[str, Any]]) -> str:
    base = results[0]["images_per_s"] / results[0]["world_size"]
    lines = [f"{'procs':>5} {'strategy':>8} {'img/s':>9} {'step ms':>9} {'allreduce ms':>13} {'scaling':>8} "
             f"{'peak GiB':>9}"]
    for r in results:
        allreduce = f"{r['allreduce_ms']:.1f}" if "allreduce_ms" in r else "-"
        scaling = r["images_per_s"] / (base * r["world_size"])
        lines.append(f"{r['world_size']:>5} {r['strategy']:>8} {r['images_per_s']:>9.3g} {r['step_ms']:>9.1f} "
                     f"{allreduce:>13} {scaling:>7.0%} {r['peak_memory_gib']:>9.2f}")
    return "\n".join(lines)


def loader_rate(config: RunConfig, tokenizer: Any | None, batches: int, warmup: int, encoded: bool) -> dict[str, Any]:
    """Samples per second the configured loader delivers on its own (this rank of one)."""
    from sdtrain.data.pipeline import TrainBatches

    data = TrainBatches(config.data, tokenizer, config.seed, encoded=encoded)
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
            rates.append(loader_rate(variant, trainer.task.tokenizer, batches, warmup=max(1, workers),
                                     encoded=stage_reads_encoded))
        consumption = trainer.measure(train_steps, warmup=2)["images_per_s"] if train_steps else None
    finally:
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
