"""The training loop. It coordinates; every concern lives in its own object."""

from __future__ import annotations

import copy
import logging
import math
import random
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdtrain.checkpoint import Checkpointer
from sdtrain.config import RunConfig, to_dict
from sdtrain.data.pipeline import TrainBatches
from sdtrain.errors import UserError
from sdtrain.run import prepare_run_dir, resolve_device
from sdtrain.train.ema import EMA
from sdtrain.train.logger import RunLogger
from sdtrain.train.optim import build_lr_schedule, build_optimizer
from sdtrain.train.tasks import Task, make_task

log = logging.getLogger(__name__)


class TrainState:
    """The one registry of everything a resumed run needs to continue exactly."""

    def __init__(self, stage: str, modules: dict[str, nn.Module], ema: EMA | None, optimizer, lr_schedule,
                 data: TrainBatches, noise: torch.Generator, task: Task):
        self.stage = stage
        self.modules = modules
        self.ema = ema
        self.optimizer = optimizer
        self.lr_schedule = lr_schedule
        self.data = data
        self.noise = noise
        self.task = task
        self.step = 0
        self.samples = 0

    def trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "samples": self.samples,
            "lr_schedule": self.lr_schedule.state_dict(),
            "data": self.data.state_dict(),
            "ema_updates": self.ema.updates if self.ema is not None else 0,
            "task": self.task.extra_state(),
            "rng": {
                "python": random.getstate(),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                "noise": self.noise.get_state(),
            },
        }

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.step, self.samples = int(state["step"]), int(state["samples"])
        self.lr_schedule.load_state_dict(state["lr_schedule"])
        self.data.load_state_dict(state["data"])
        self.task.load_extra_state(state["task"])
        rng = state["rng"]
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.noise.set_state(rng["noise"])


class Trainer:
    def __init__(self, config: RunConfig):
        self.config = config
        self.device = resolve_device(config.train.device)
        if config.train.threads and self.device.type == "cpu":
            torch.set_num_threads(config.train.threads)
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        self.run_dir = prepare_run_dir(config)
        self.task = make_task(config, self.device, self.run_dir)
        self.data = TrainBatches(config.data, self.task.tokenizer, config.seed)
        self.optimizer = build_optimizer(self.task.parameters(), config.optim)
        self.lr_schedule = build_lr_schedule(self.optimizer, config.optim, config.train.max_steps)
        self.ema = EMA(self.task.trainable, config.ema) if config.ema.enabled else None
        noise = torch.Generator(self.device).manual_seed(config.seed + 1)
        self.state = TrainState(config.stage, self.task.trainable, self.ema, self.optimizer, self.lr_schedule,
                                self.data, noise, self.task)
        self.checkpointer = Checkpointer(self.run_dir, config.checkpoint)
        self.logger = RunLogger(config.logging, self.run_dir, config.train.max_steps, to_dict(config))
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16,
                                       enabled=config.train.mixed_precision == "bf16")
        self.last_batch: dict[str, Any] | None = None
        self.saved: tuple[int, Path] | None = None

    def train(self) -> Path:
        resume = self.checkpointer.resume_path()
        if resume is not None:
            self.checkpointer.load(resume, self.state)
        log.info("run %s: %s stage, %d trainable parameters, %d samples in %d shards", self.run_dir,
                 self.config.stage, sum(p.numel() for p in self.task.parameters()), self.data.num_samples,
                 len(self.data.shards))
        self.logger.start(self.state.step, self.state.samples)
        try:
            while self.state.step < self.config.train.max_steps:
                metrics = self.train_step()
                self.state.step += 1
                self.report(metrics)
                if self.checkpointer.due(self.state.step):
                    self.save()
            final = self.save()
        finally:
            self.logger.close()
        return final

    def train_step(self) -> dict[str, torch.Tensor]:
        """One optimizer step over grad_accum micro-batches. Metrics stay tensors: reading them
        every step would stall an accelerator for nothing."""
        self.optimizer.zero_grad(set_to_none=True)
        accum = self.config.train.grad_accum
        totals: dict[str, torch.Tensor] = {}
        for _ in range(accum):
            batch = self.data.next()
            self.last_batch = batch
            with self.autocast:
                loss, metrics = self.task.loss(batch, self.state.noise)
            (loss / accum).backward()
            self.state.samples += batch["pixel_values"].shape[0]
            for key, value in {"loss": loss, **metrics}.items():
                totals[key] = totals.get(key, 0) + value.detach().float() / accum
        if self.config.optim.grad_clip > 0:
            totals["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.task.parameters(), self.config.optim.grad_clip)
        self.optimizer.step()
        self.lr_schedule.step()
        if self.ema is not None:
            self.ema.update()
        return totals

    def report(self, metrics: dict[str, torch.Tensor]) -> None:
        step = self.state.step
        final = step == self.config.train.max_steps
        self.logger.advance(step)
        if not (final or step % self.config.logging.every == 0):
            return
        values = {key: float(value) for key, value in metrics.items()}
        if not math.isfinite(values["loss"]):
            raise UserError(f"step {step}: loss is {values['loss']}; lower optim.lr or enable optim.grad_clip")
        values["lr"] = self.lr_schedule.get_last_lr()[0]
        values["epoch"] = self.data.position.epoch
        values["skipped_samples"] = self.data.position.total_skipped
        self.logger.log(step, self.state.samples, values)

    def save(self) -> Path:
        if self.saved is not None and self.saved[0] == self.state.step:
            return self.saved[1]  # the last periodic save was also the final step
        self.task.before_save()
        path = self.checkpointer.save(self.state)
        self.validate()
        self.saved = (self.state.step, path)
        return path

    def averaged_modules(self) -> dict[str, nn.Module]:
        """The trained modules with EMA weights (copies), or the live ones without EMA."""
        if self.ema is None:
            return dict(self.task.trainable)
        averaged = {}
        for name, module in self.task.trainable.items():
            clone = copy.deepcopy(module)
            clone.load_state_dict(self.ema.module_state(name), strict=False)
            averaged[name] = clone.eval()
        return averaged

    def validate(self) -> None:
        out = self.run_dir / "samples" / f"step_{self.state.step:08d}.png"
        modules = self.averaged_modules()
        for module in modules.values():
            module.eval()
        try:
            path = self.task.validate(modules, out, self.last_batch)
        finally:
            for module in self.task.trainable.values():
                module.train()
        if path is not None:
            log.info("validation images: %s", path)
            self.logger.image("validation", path, self.state.step)
