"""The training loop. It coordinates; every concern lives in its own object."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from sdtrain import sharded
from sdtrain.checkpoint import (
    Checkpointer,
    Snapshot,
    capture,
    is_partial,
    module_spec,
    read_meta,
)
from sdtrain.config import DataConfig, RunConfig, to_dict
from sdtrain.data.pipeline import TrainBatches
from sdtrain.data.preview import batch_grid
from sdtrain.distributed import (
    RankFailure,
    any_ranks,
    barrier,
    describe_progress,
    detect_topology,
    gather_objects,
    init_distributed,
    is_collective_failure,
    mean_over_ranks,
    new_group,
    record_progress,
)
from sdtrain.errors import UserError, first_line
from sdtrain.evaluate.adherence import adherence_prompt_set
from sdtrain.evaluate.run import EvalSettings, Evaluator, flat_metrics, read_prompts, target_met
from sdtrain.evaluate.val_loss import ValLoss
from sdtrain.faults import FaultInjector
from sdtrain.loaders.components import instantiate_with
from sdtrain.loaders.writers import has_trained_parts, save_trained_parts
from sdtrain.memory import tree_bytes
from sdtrain.paths import FIRST_BATCH, STOP_REQUEST
from sdtrain.run import prepare_run_dir, resolve_device
from sdtrain.train import autotune
from sdtrain.train.budget import StepPlan
from sdtrain.train.ema import EMA
from sdtrain.train.logger import RunLogger
from sdtrain.train.modes import make_task, prepare_task
from sdtrain.train.optim import (
    allocate_state,
    build_lr_schedule,
    build_optimizer,
    check_optimizer,
    keep_in_bf16,
    match_parameter_layouts,
    optimizer_settings,
)
from sdtrain.train.parallel import DataParallel
from sdtrain.train.tasks import Task
from sdtrain.train.threads import ThreadTuner
from sdtrain.utils import atomic_write_text

log = logging.getLogger(__name__)


class Preempted(Exception):
    """Training stopped on a signal after saving; running the same command again resumes."""

    exit_code = 75  # EX_TEMPFAIL: "try again", which is what a requeue does


def noise_seed(seed: int, step: int, micro: int) -> int:
    """The noise of a micro-batch depends only on its place in training, not on RNG history: a resumed
    run and a run split differently over ranks and accumulation steps draw the same noise."""
    digest = hashlib.blake2b(f"{seed}/{step}/{micro}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class TrainState:
    """The one registry of everything a resumed run needs to continue exactly."""

    def __init__(self, stage: str, modules: dict[str, nn.Module], ema: EMA | None, optimizer, lr_schedule,
                 plan: StepPlan, data: TrainBatches, task: Task, rank: int, tuning: autotune.Tuning):
        self.stage = stage
        self.tuning = tuning
        self.modules = modules
        self.ema = ema
        self.optimizer = optimizer
        self.lr_schedule = lr_schedule
        self.plan = plan
        self.data = data
        self.task = task
        self.rank = rank
        self.step = 0
        self.samples = 0
        self.evaluations = 0
        """Evaluation points passed (one per evaluation.every_samples samples)."""
        self.skipped_steps = 0
        """Steps skipped for a non-finite loss or gradient, over the whole run."""
        self.bad_in_a_row = 0
        self.seconds = 0.0
        """Training wall time before this start, for time-to-target across restarts."""
        self.started: float | None = None

    def rank_state(self) -> dict[str, Any]:
        """What differs between ranks: each one's data position and RNG streams."""
        return {
            "data": self.data.state_dict(),
            "rng": {
                "python": random.getstate(),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            },
        }

    def trainer_state(self, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "step": self.step,
            "samples": self.samples,
            "evaluations": self.evaluations,
            "skipped_steps": self.skipped_steps,
            "bad_in_a_row": self.bad_in_a_row,
            "seconds": self.elapsed(),
            "lr_schedule": self.lr_schedule.state_dict(),
            "ema_updates": self.ema.updates if self.ema is not None else 0,
            "task": self.task.extra_state(),
            "ranks": ranks,
        } | ({"planned_steps": self.plan.total} if self.plan.planned else {})

    def elapsed(self) -> float:
        """Seconds of training, every start of the run included."""
        return self.seconds + (time.perf_counter() - self.started if self.started is not None else 0.0)

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        ranks = state["ranks"]
        self.step, self.samples = int(state["step"]), int(state["samples"])
        self.evaluations, self.seconds = int(state.get("evaluations", 0)), float(state.get("seconds", 0.0))
        self.skipped_steps, self.bad_in_a_row = int(state.get("skipped_steps", 0)), int(state.get("bad_in_a_row", 0))
        self.lr_schedule.load_state_dict(state["lr_schedule"])
        if self.plan.seconds > 0 and "planned_steps" in state:
            self.plan.resume(int(state["planned_steps"]))
        self.task.load_extra_state(state["task"])
        self.data.load_state_dict([r["data"] for r in ranks])
        # A job with more ranks than the one that saved gives the extra ranks the last saved streams;
        # training noise does not depend on them (see noise_seed).
        rng = ranks[min(self.rank, len(ranks) - 1)]["rng"]
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])


def allow_attention_kernels(kernels: list[str]) -> None:
    """`train.attention_kernels`: the SDPA kernels torch may dispatch a CUDA attention call to, process-wide (the
    flags are the CUDA dispatcher's, set alike on a machine without a GPU)."""
    cuda = torch.backends.cuda
    switches = {"flash": cuda.enable_flash_sdp, "efficient": cuda.enable_mem_efficient_sdp,
                "cudnn": cuda.enable_cudnn_sdp, "math": cuda.enable_math_sdp}
    for name, switch in switches.items():
        switch(name in kernels)


class Trainer:
    def __init__(self, config: RunConfig):
        # What the process holds before any model: the floor of what it holds beside them while training.
        self.baseline_bytes = tree_bytes()
        self.config = config
        self.topology = detect_topology()
        check_optimizer(config.optim, sharded=self.topology.distributed and config.parallel.strategy == "fsdp")
        self.device = resolve_device(config.train.device, self.topology.local_rank)
        if config.train.threads != "auto" and config.train.threads and self.device.type == "cpu":
            torch.set_num_threads(config.train.threads)
        self.threads = ThreadTuner.for_run(config.train.threads, self.device)
        allow_attention_kernels(config.train.attention_kernels)
        if self.device.type == "cuda":
            # Process-wide; off unless asked for (`make gpu-check` measures what each pays).
            torch.set_float32_matmul_precision("high" if config.train.tf32 else "highest")
            torch.backends.cudnn.benchmark = config.train.searches_convolutions(not config.data.aspect_buckets)
            if config.train.deterministic:
                # cuBLAS reads its workspace setting when first used: set before any matmul of this process.
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
                torch.backends.cudnn.deterministic = True
                torch.use_deterministic_algorithms(True)
        init_distributed(self.topology, self.device, config.parallel.backend, config.parallel.timeout_minutes)
        self.is_main = self.topology.is_main
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        self.run_dir = Path(config.run_dir)
        if self.is_main:
            prepare_run_dir(config)
            self._prepare()
        barrier()
        sharded_saves = self._sharded_saves()
        # Background writes run their own collectives: on the training group they would interleave with the
        # step's. gloo, as DCP's metadata exchange needs a CPU backend whatever the device.
        async_group = new_group(backend="gloo") if sharded_saves and config.checkpoint.async_save and \
            self.topology.distributed else None
        self.checkpointer = Checkpointer(self.run_dir, config.checkpoint, sharded_saves, async_group)
        self.resume_from = self._resume_point()
        self.faults = FaultInjector(self.topology.rank, resumed=self.resume_from is not None)
        self.resumed_meta = read_meta(self.resume_from) if self.resume_from is not None else None
        self.task = make_task(config, self.device, self.run_dir, self.resumed_meta)
        if config.optim.weights == "bf16":
            keep_in_bf16(self.task.parameters())
        self.data = self._make_data()
        self.tuning = self._tune()
        if hasattr(self.task, "use_encoding"):  # on every rank, as the main rank decided it
            self.task.use_encoding(self.tuning.encode)
        self.bf16 = self.tuning.precision == "bf16"
        evaluation = config.evaluation
        # Built now, so that held-out shards that do not fit the run stop it before its first step.
        self.val_loss = ValLoss(self.task, evaluation, self.device, self.topology.rank, self.topology.world_size,
                                bf16=self.bf16) if evaluation.every_samples and "val_loss" in evaluation.metrics \
            else None
        if self.tuning.channels_last:
            autotune.place_layout(list(self.task.parallel_modules().values()), channels_last=True)
        self.parallel = DataParallel(config.parallel, self.topology, self.device)
        self.parallel.apply(self.task, bf16=self.bf16, checkpointing=self.tuning.checkpointing,
                            compile=self.tuning.compile, cuda_graphs=self.tuning.cuda_graphs)
        if config.optim.in_backward and self.topology.distributed:
            raise UserError("optim.in_backward: steps each parameter before the gradients of all ranks are "
                            "averaged, so it runs in one process only; turn it off under torchrun")
        self.optimizer = build_optimizer(self.task.parameters(), config.optim, seed=config.seed)
        train = config.train
        self.plan = StepPlan(train.max_steps, train.max_steps, 60 * train.max_minutes)
        self.lr_schedule = build_lr_schedule(self.optimizer, config.optim, self.plan)
        # A resumed run's state comes from its checkpoint; a sharded one loads into existing state in place.
        if self.resume_from is None or sharded.is_sharded(self.resume_from):
            allocate_state(self.optimizer)
        self.ema = EMA(self.task.trainable, config.ema) if config.ema.enabled else None
        self.noise = torch.Generator(self.device)
        self.state = TrainState(config.stage, self.task.trainable, self.ema, self.optimizer, self.lr_schedule,
                                self.plan, self.data, self.task, self.topology.rank, self.tuning)
        self.logger = RunLogger(config.logging, self.run_dir, config.train.max_steps, to_dict(config),
                                enabled=self.is_main)
        self.last_batch: dict[str, Any] | None = None
        self.saved: tuple[int, Path] | None = None
        self.stop_signal: int | None = None
        self.stop_heard = False
        """Whether any rank was asked to stop by the last step's exchange (`_agree`)."""
        self.evaluator: Evaluator | None = None
        """Scores generated images (fid, clip, adherence); built at the first evaluation point that needs it."""

    def train(self) -> Path:
        with self._stop_on_signals():
            try:
                final = self._train()
            except Preempted as stop:
                self.logger.event("stop", self.state.step, message=str(stop))
                raise
            except BaseException as exc:
                self.logger.event("error", self.state.step, message=first_line(exc)[:500] or type(exc).__name__)
                raise
        self.logger.event("end", self.state.step, checkpoint=str(final))
        return final

    def _stop_requested(self) -> bool:
        """Whether a reader of the run (the UI, `runview.request_stop`) asked it to stop; taken back as it is
        read, so the resumed run does not stop at once."""
        request = self.run_dir / STOP_REQUEST
        if not self.is_main or not request.exists():
            return False
        request.unlink(missing_ok=True)
        return True

    def _stop_now(self) -> bool:
        """Whether the run stops after this step. Ranks must stop together: what the step's exchange heard
        (`_agree`), a signal or request after it waiting for the next step's; a process alone stops at once."""
        if self.topology.distributed:
            return self.stop_heard
        return self.stop_heard or self.stop_signal is not None or self._stop_requested()

    def _train(self) -> Path:
        resume = self.resume_from
        if resume is not None:
            self.checkpointer.load(resume, self.state)
            match_parameter_layouts(self.optimizer)
            self._apply_optimizer_config()
        self.logger.start(self.state.step, self.state.samples, self.plan.total)
        log.info("run %s: %s stage, %d trainable parameters, %d samples in %d shards", self.run_dir,
                 self.config.stage, sum(p.numel() for p in self.task.parameters()), self.data.num_samples,
                 len(self.data.shards))
        if self.is_main:  # a request left from before this start (the run was not running) asks nothing of it
            (self.run_dir / STOP_REQUEST).unlink(missing_ok=True)
        self.logger.event("start", self.state.step, planned_steps=self.plan.total, resumed=resume is not None,
                          world_size=self.topology.world_size)
        self.state.started = time.perf_counter()
        self.plan.start(self.state.step)
        self._new_window()
        memory = autotune.FirstStepMemory(self.tuning, self.device, enabled=self.is_main)
        try:
            while self.state.step < self.plan.total:
                record_progress(self.state.step + 1, finished=False)
                metrics = self.train_step()
                memory.after_step()
                self._show_first_batch()
                self.state.step += 1
                # Checkpoint steps are always logged: the metrics then show what each checkpoint holds.
                self.report(metrics, force=self.checkpointer.due(self.state.step))
                # Before the save, so a resumed run neither repeats nor skips an evaluation point.
                if self.evaluation_due() and self.evaluate():
                    break
                if self.checkpointer.due(self.state.step):
                    self.save()
                self.faults.after_step(self.state.step)
                self.checkpointer.poll()
                record_progress(self.state.step, finished=True)
                if self._stop_now():
                    self.save()
                    self.checkpointer.finish_writing()
                    cause = "by a signal" if self.stop_signal is not None else "on request"
                    raise Preempted(f"stopped {cause} at step {self.state.step} after saving; "
                                    "run the same command to resume")
            final = self.save()
            self.checkpointer.finish_writing()
            self.checkpointer.wait_for_checksums()
        except RuntimeError as exc:
            if not is_collective_failure(exc):
                raise
            where = describe_progress()
            raise RankFailure(
                f"rank {self.topology.rank}: a collective failed ({first_line(exc)[:200]})"
                f"{'; ' + where if where else ''}. Another rank died or stalled for parallel.timeout_minutes="
                f"{self.config.parallel.timeout_minutes:g}; run the same command to resume from "
                f"{self.checkpointer.folder}") from exc
        finally:
            self.data.close()
            self.logger.close()
            if self.threads is not None:
                self.threads.finish()
        return final

    def _sharded_saves(self) -> bool:
        layout = self.config.checkpoint.format
        if layout == "auto":
            return self.config.parallel.strategy == "fsdp" and self.topology.distributed
        return layout == "sharded"

    def _resume_point(self) -> Path | None:
        """The main rank alone checks the checkpoints (and moves a damaged one aside); every rank resumes
        from its pick, or fails with its error."""
        choice: Path | UserError | None = None
        if self.is_main:
            try:
                choice = self.checkpointer.resume_path()
            except UserError as exc:
                choice = exc
        choice = gather_objects(choice)[0]
        if isinstance(choice, UserError):
            raise choice
        return choice

    def _prepare(self) -> None:
        """One-time work on the main rank before the others build the task (say, a tokenizer)."""
        prepare_task(self.config, self.run_dir)

    def _tune(self, plan_only: bool = False) -> autotune.Tuning:
        """Precision and activation checkpointing: forced by the config, kept from the run's first start, or
        measured on this machine (`plan_only`: the memory plan alone, see `autotune.decide`)."""
        return autotune.decide(self.config, self.task, self.data.encoding is not None, self.resumed_meta, self.device,
                               self.is_main, self.topology.local_world_size, self.baseline_bytes, plan_only)

    def _make_data(self) -> TrainBatches:
        def batches(config: DataConfig) -> TrainBatches:
            return TrainBatches(config, self.task.caption_tokenizer, self.config.seed, self.topology.rank,
                                self.topology.world_size, pin_memory=self.device.type == "cuda",
                                encoded=self.task.reads_encoded and config.use_encoded, **self.task.clip_reading())

        data = self.task.make_data(batches)
        self.task.use_encoded(data.encoding)
        return data

    def _apply_optimizer_config(self) -> None:
        """A resumed optimizer carries the old run's hyperparameters; this start's config decides them."""
        optim = self.config.optim
        schedule = self.lr_schedule
        schedule.base_lrs = [optim.lr for _ in schedule.base_lrs]
        settings = optimizer_settings(optim)
        for group, factor in zip(self.optimizer.param_groups, schedule.lr_lambdas):
            group.update(settings, initial_lr=optim.lr, lr=optim.lr * factor(schedule.last_epoch))
        schedule._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    @contextlib.contextmanager
    def _stop_on_signals(self) -> Iterator[None]:
        """SIGTERM (preemption, torchrun shutting down) and SIGUSR1 (Slurm's warning before the time
        limit) finish the current step, save on every rank together, then stop."""

        def handler(signum: int, _frame: Any) -> None:
            # Repeats are expected, not an escalation: Slurm signals every process of a step, torchrun
            # passes the same signal on, so a rank hears it twice. The launchers follow with SIGKILL
            # after their grace period if the save takes too long.
            if self.stop_signal is None:
                self.stop_signal = signum

        signals = [signal.SIGTERM, signal.SIGUSR1]
        previous = {s: signal.signal(s, handler) for s in signals}
        try:
            yield
        finally:
            for s, old in previous.items():
                signal.signal(s, old)

    def train_step(self) -> dict[str, torch.Tensor]:
        """One optimizer step over grad_accum micro-batches. Metrics stay tensors: reading them
        every step would stall an accelerator for nothing."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.tuning.cuda_graphs:  # the graphs' outputs of the last step may be overwritten from here on
            torch.compiler.cudagraph_mark_step_begin()
        accum = self.config.train.grad_accum
        totals: dict[str, torch.Tensor] = {}
        world, rank = self.topology.world_size, self.topology.rank
        for micro in range(accum):
            batch = self.data.next()
            self.last_batch = batch
            self.noise.manual_seed(noise_seed(self.config.seed, self.state.step, micro * world + rank))
            with self.parallel.no_sync(skip=micro < accum - 1):
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                    loss, metrics = self.task.loss(batch, self.noise)
                loss = self.faults.corrupt_loss(self.state.step + 1, loss)
                (loss / accum).backward()
            self.state.samples += len(batch["keys"]) * world
            for key, value in {"loss": loss, **metrics}.items():
                totals[key] = totals.get(key, 0) + value.detach().float() / accum
        if self.config.optim.grad_clip > 0:
            totals["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.task.parameters(), self.config.optim.grad_clip)
        step = self.state.step + 1
        if self.config.optim.in_backward:  # each parameter was stepped during backward: nothing to skip
            self._count_bad_step(step, not self._agree(totals["loss"]), can_skip=False)
        elif self._count_bad_step(step, not self._agree(totals["loss"], totals.get("grad_norm"))):
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
        # The schedule follows the step count, skipped steps included, like the data position.
        self.lr_schedule.step()
        if self.state.bad_in_a_row == 0 and self.ema is not None and self.ema.due(step):
            self.ema.update(step)
        return totals

    def _show_first_batch(self) -> None:
        """At a run's first step, its batch as the model received it (samples/first_batch.png, in the report)."""
        batch = self.last_batch
        if self.state.step != 0 or not self.is_main or batch is None or "pixel_values" not in batch:
            return
        batch_grid(list(batch["pixel_values"]), list(batch.get("captions", [""] * len(batch["pixel_values"]))),
                   self.run_dir / FIRST_BATCH, list(batch["mask"]) if "mask" in batch else None)

    def _agree(self, loss: torch.Tensor, grad_norm: torch.Tensor | None = None) -> bool:
        """Whether this step's loss and gradients are finite on every rank; in the same all-reduce, whether any rank
        was asked to stop (a signal, a stop request), which the step's end reads (`stop_heard`). One collective and
        one device sync a step, as a loss scaler's check costs."""
        if grad_norm is None and not self.config.optim.in_backward:
            grads = [p.grad for p in self.task.parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        values = [loss] + ([grad_norm] if grad_norm is not None else [])
        values = [v.full_tensor() if isinstance(v, DTensor) else v for v in values]
        finite = torch.stack([v.detach().float().to(self.device) for v in values]).isfinite().all()
        broken, self.stop_heard = any_ranks([~finite, self.stop_signal is not None or self._stop_requested()],
                                            self.device)
        return not broken

    def _count_bad_step(self, step: int, bad: bool, can_skip: bool = True) -> bool:
        """Count a non-finite step; True when it is to be skipped. Stops the run when too many come in a row."""
        state = self.state
        if not bad:
            state.bad_in_a_row = 0
            return False
        state.skipped_steps += 1
        state.bad_in_a_row += 1
        limit = self.config.train.max_bad_steps if can_skip else 1
        last = self.saved[1] if self.saved else (self.resume_from or "none yet")
        if state.bad_in_a_row >= limit:
            raise UserError(f"step {step}: loss or gradients not finite for {state.bad_in_a_row} step(s) in a row "
                            f"(train.max_bad_steps={limit}); the last good checkpoint is {last}. Lower optim.lr, "
                            "set optim.grad_clip, or look for bad samples near this point")
        log.warning("step %d: loss or gradients not finite; update skipped (%d in a row, %d this run)",
                    step, state.bad_in_a_row, state.skipped_steps)
        return True

    def report(self, metrics: dict[str, torch.Tensor], force: bool = False) -> None:
        step = self.state.step
        final = step == self.plan.total
        self.logger.advance(step)
        if not (force or final or step % self.config.logging.every == 0):
            return
        self._replan()
        if self.threads is not None:
            self.threads.observe(step)
        local = {key: float(v.full_tensor() if isinstance(v, DTensor) else v) for key, v in metrics.items()}
        values = mean_over_ranks(local, self.device)
        values["skipped_steps"] = self.state.skipped_steps
        values["lr"] = self.lr_schedule.get_last_lr()[0]
        values["epoch"] = self.data.position.epoch
        values["skipped_samples"] = self.data.position.total_skipped
        values["filtered_samples"] = self.data.position.total_filtered
        self.logger.log(step, self.state.samples, values)

    def _replan(self) -> None:
        """Under train.max_minutes, the steps left as the pace so far allows; every rank takes the main rank's plan,
        so that all stop at the same step."""
        if not self.plan.budgeted:
            return
        before, first = self.plan.total, not self.plan.planned
        paced = self.plan.replan(self.state.step, self.state.seconds)
        planned = gather_objects(self.plan.total)[0]
        # The progress bar follows every re-plan; the log only the first and those that move the end by a twentieth.
        if paced is not None and (first or abs(planned - before) > before / 20):
            log.info("train.max_minutes=%g: %d steps planned (%.2f s a step, %.0f s left)",
                     self.config.train.max_minutes, planned, *paced)
        self.plan.total = planned
        self.logger.plan(planned)

    def evaluation_due(self) -> bool:
        every = self.config.evaluation.every_samples
        return every > 0 and self.state.samples // every > self.state.evaluations

    def evaluate(self) -> bool:
        """Score the averaged weights on every rank (each generates or reads its share); True once the target is
        met."""
        cfg = self.config.evaluation
        self.state.evaluations = self.state.samples // cfg.every_samples
        sampled = [m for m in cfg.metrics if m != "val_loss"]
        if sampled and self.evaluator is None:
            self.evaluator = self._make_evaluator(sampled)
        start = time.perf_counter()
        result: dict[str, Any] = {}
        if self.evaluator is not None:
            with self.whole_modules() as modules:
                result |= self.evaluator(self.task.pipeline(modules))
        if self.val_loss is not None:
            # A loss needs only forward passes, which sharded modules run as they train: no whole copy anywhere.
            with self.averaged_in_place() as modules:
                result |= self.val_loss(modules)
        metrics = flat_metrics(result) | {"eval_seconds": round(time.perf_counter() - start, 2)}
        self.logger.evaluation(self.state.step, self.state.samples, metrics)
        log.info("evaluation at step %d: %s", self.state.step,
                 ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        self._new_window()
        if not target_met(metrics, cfg.target):
            return False
        reached = {"target": cfg.target, "metrics": metrics, "step": self.state.step, "samples": self.state.samples,
                   "seconds": round(self.state.elapsed(), 1)}
        if self.is_main:
            atomic_write_text(self.run_dir / "target.json", json.dumps(reached, indent=1) + "\n")
        log.info("target %s reached at step %d after %d samples, %.0f s of training", cfg.target,
                 self.state.step, self.state.samples, reached["seconds"])
        return True

    def _make_evaluator(self, metrics: list[str]) -> Evaluator:
        cfg = self.config.evaluation
        prompts = read_prompts(cfg.prompts) if cfg.prompts else adherence_prompt_set(cfg.num)
        settings = EvalSettings(metrics, num=cfg.num or None, steps=cfg.steps, guidance=cfg.guidance,
                                seed=cfg.seed, batch=cfg.batch, inception=cfg.inception, clip=cfg.clip,
                                reference=cfg.reference, scheduler=cfg.scheduler, size=self.config.data.resolution,
                                extra={"resolution": self.config.data.resolution})
        if self.adapters_over_shards:  # every rank runs every forward of the sharded base, so draws every image
            return Evaluator(prompts, settings, self.device)
        return Evaluator(prompts, settings, self.device, self.topology.rank, self.topology.world_size)

    @property
    def adapters_over_shards(self) -> bool:
        """Whether adapters (or new vectors) train over a frozen base FSDP shards: no rank ever holds the whole
        model, so sampling from it is a collective each rank runs in step, the same forwards on every rank."""
        return bool(self.parallel.sharded) and any(is_partial(m) for m in self.task.trainable.values())

    @contextlib.contextmanager
    def whole_modules(self) -> Iterator[dict[str, nn.Module]]:
        """Every rank enters: the averaged modules a pipeline samples from, whole on every rank, or over a sharded
        frozen base the live sharded modules with their averaged weights in place."""
        if self.adapters_over_shards:
            with self.averaged_in_place() as modules:
                yield modules
        else:
            with self.averaged_modules(capture(self.task.trainable, self.ema, None)) as modules:
                yield modules

    def save(self) -> Path:
        if self.saved is not None and self.saved[0] == self.state.step:
            return self.saved[1]  # the last periodic save was also the final step
        self.task.before_save()
        # Every rank enters: each contributes its data position and RNG states.
        ranks = gather_objects(self.state.rank_state())
        path = self.checkpointer.path_for(self.state.step)
        meta = {"task": self.task.checkpoint_meta()}
        parts = has_trained_parts(meta)
        if self.checkpointer.sharded:
            # Whole weights (no optimizer state) for the mode's files, before the write that holds them (small: only
            # adapters or new vectors train), or for the validation grid, and only if it draws one.
            snapshot = capture(self.task.trainable, self.ema, None) if parts else None
            self.checkpointer.save_sharded(self.state, ranks, sharded.live_state(self.task.trainable, self.ema,
                                                                                 self.optimizer), self.is_main,
                                           extra=self._trained_parts(snapshot, meta) if parts else None)
            if snapshot is None and self.task.validates(self.last_batch):
                snapshot = capture(self.task.trainable, self.ema, None)
        else:
            snapshot = capture(self.task.trainable, self.ema, self.optimizer, keep=self.is_main)
            if self.is_main:
                self.checkpointer.save(self.state, ranks, snapshot,
                                       extra=self._trained_parts(snapshot, meta) if parts else None)
        self.logger.event("save", self.state.step, checkpoint=str(path))
        self.validate(snapshot)
        barrier()
        self.saved = (self.state.step, path)
        self._new_window()
        return path

    def _new_window(self) -> None:
        """Under train.threads=auto, the steps from here on are what the next thread count is judged by, not the
        save or evaluation before them."""
        if self.threads is not None:
            self.threads.restart(self.state.step)

    def _trained_parts(self, snapshot: Snapshot, meta: dict[str, Any]) -> Callable[[Path], list[Path]]:
        """What writes a LoRA or textual-inversion run's own files into a checkpoint folder: those `sdtrain export`
        writes from that checkpoint (not its merged pipeline/), by the same function and from the same weights,
        the EMA ones where the run keeps an EMA (export's default)."""
        def write(folder: Path) -> list[Path]:
            # From the snapshot's whole tensors, never through the live modules: under FSDP theirs are shards.
            return save_trained_parts(self.task.trainable, meta, folder,
                                      {name: snapshot.averaged(name) for name in self.task.trainable})

        return write

    @contextlib.contextmanager
    def averaged_modules(self, snapshot: Snapshot) -> Iterator[dict[str, nn.Module]]:
        """Modules with the EMA weights (raw ones without EMA), whatever the parallel wrapping of the live
        modules. A whole trained module is rebuilt around the snapshot's tensors instead of copying them
        (an 866M UNet copy is 3.5 GB that a machine training near its memory limit does not have); a
        partly trained one (adapters, new embeddings) is the live module with its averaged tensors swapped
        in, in fp32 as an export rebuilds them (bf16 weights, optim.weights, included), until the block ends."""
        modules: dict[str, nn.Module] = {}
        swapped: list[tuple[nn.Module, dict[str, torch.Tensor], bool]] = []
        try:
            for name, module in self.task.trainable.items():
                weights = snapshot.averaged(name)
                if not is_partial(module):
                    # Weights trained in bf16 (optim.weights) sample in fp32, as exports do.
                    modules[name] = instantiate_with(module_spec(module), weights).float().to(self.device).eval()
                    continue
                params = {k: p for k, p in module.named_parameters() if p.requires_grad}
                live = {k: param.data for k, param in params.items()}
                swapped.append((module, live, module.training))
                for k, param in params.items():
                    param.data = weights[k].to(param.device, torch.float32)
                modules[name] = module.eval()
            yield modules
        finally:
            for module, live, training in swapped:
                for k, param in module.named_parameters():
                    if k in live:
                        param.data = live[k]
                module.train(training)

    @contextlib.contextmanager
    def averaged_in_place(self) -> Iterator[dict[str, nn.Module]]:
        """The trained modules themselves (unwrapped from DDP, still sharded under FSDP) in eval mode, with the EMA
        weights copied into their parameters until the block ends (this rank's shards only, so the live weights
        set aside cost a shard each); without EMA, the trained weights as they are."""
        modules = dict(self.task.trainable)
        training = {name: module.training for name, module in modules.items()}
        live: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            with torch.no_grad():
                shadow = self.ema.shadow if self.ema is not None else {}
                for name, module in modules.items():
                    module.eval()
                    for key, param in module.named_parameters():
                        average = shadow.get(f"{name}.{key}")
                        if average is not None:
                            live.append((param, param.detach().clone()))
                            param.copy_(average)
            yield modules
        finally:
            with torch.no_grad():
                for param, weights in live:
                    param.copy_(weights)
            for name, module in modules.items():
                module.train(training[name])

    def validate(self, snapshot: Snapshot | None) -> None:
        """Every rank calls it; the main rank draws the validation images from `snapshot` and writes them, or over a
        sharded frozen base every rank draws them (see `adapters_over_shards`) and the main rank writes them."""
        if not self.task.validates(self.last_batch):
            return
        out = self.run_dir / "samples" / f"step_{self.state.step:08d}.png"
        if self.adapters_over_shards:
            with self.averaged_in_place() as modules:
                path = self.task.validate(modules, out if self.is_main else None, self.last_batch)
        elif self.is_main and snapshot is not None:
            with self.averaged_modules(snapshot) as modules:
                path = self.task.validate(modules, out, self.last_batch)
        else:
            return
        if path is not None:
            log.info("validation images: %s", path)
            self.logger.image("validation", path, self.state.step)
            self.logger.event("validation", self.state.step, images=f"samples/{Path(path).name}")
