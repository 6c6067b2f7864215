"""Where training metrics go: a progress bar, metrics.jsonl, TensorBoard and optionally W&B; and what happens to
the run (events.jsonl, train.log), which the run view (`sdtrain.runview`) follows live."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from sdtrain.config import LoggingConfig
from sdtrain.errors import UserError
from sdtrain.paths import EVENTS, TRAIN_LOG

log = logging.getLogger(__name__)


class RunLogger:
    def __init__(self, config: LoggingConfig, run_dir: Path, max_steps: int, run_config: dict[str, Any],
                 enabled: bool = True):
        self.config = config
        self.run_dir = Path(run_dir)
        self.max_steps = max_steps
        self.run_config = run_config
        self.enabled = enabled
        self.bar: tqdm | None = None
        self.tb = None
        self.wandb = None
        self.jsonl = None
        self.log_file: logging.Handler | None = None
        self._last_time = time.perf_counter()
        self._last_samples = 0

    def start(self, step: int, samples: int, planned_steps: int | None = None) -> None:
        self._last_time, self._last_samples = time.perf_counter(), samples
        self.max_steps = planned_steps or self.max_steps
        if not self.enabled:
            return
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115 - open for the whole run
        self.log_file = logging.FileHandler(self.run_dir / TRAIN_LOG)
        self.log_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        logging.getLogger("sdtrain").addHandler(self.log_file)
        if self.config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=step or None)
        if self.config.wandb:
            self.wandb = self._start_wandb()
        if self.config.progress:
            # Redirected to a file (a batch job, `make demo | tee`), every redraw would be kept: every 30 s is plenty.
            redraw_every = 0.1 if sys.stderr.isatty() else 30.0
            self.bar = tqdm(total=self.max_steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
                            mininterval=redraw_every)

    def _start_wandb(self) -> Any:
        try:
            import wandb
        except ImportError as exc:
            raise UserError("logging.wandb: wandb is not installed; pip install 'sdtrain[wandb]'") from exc
        # The key is read by wandb itself from WANDB_API_KEY; offline mode needs none.
        if os.environ.get("WANDB_MODE") != "offline" and not os.environ.get("WANDB_API_KEY"):
            raise UserError("logging.wandb: set WANDB_API_KEY in the environment, or WANDB_MODE=offline")
        return wandb.init(project=self.config.wandb_project, dir=str(self.run_dir), config=self.run_config,
                          name=self.run_dir.name, resume="allow", id=self.run_dir.name.replace("/", "-"))

    def throughput(self, samples: int) -> float:
        now = time.perf_counter()
        rate = (samples - self._last_samples) / max(now - self._last_time, 1e-9)
        self._last_time, self._last_samples = now, samples
        return rate

    def plan(self, steps: int) -> None:
        """The run's planned length changed (train.max_minutes): the progress bar's total follows it."""
        self.max_steps = steps
        if self.bar is not None:
            self.bar.total = steps

    def advance(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def log(self, step: int, samples: int, metrics: dict[str, float]) -> None:
        metrics = {**metrics, "samples": samples, "img_per_s": self.throughput(samples)}
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", img_s=f"{metrics['img_per_s']:.1f}",
                                 lr=f"{metrics['lr']:.2e}", seen=samples, refresh=False)
        self._write(step, metrics, "train")

    def evaluation(self, step: int, samples: int, metrics: dict[str, float]) -> None:
        """Evaluation results: their own line in metrics.jsonl (the training rate is not touched)."""
        if self.enabled:
            self._write(step, {"samples": samples, **metrics}, "eval")

    def _write(self, step: int, metrics: dict[str, float], group: str) -> None:
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(f"{group}/{key}", value, step)
        if self.wandb is not None:
            # W&B keeps training metrics unprefixed, as the runs before evaluation existed did.
            self.wandb.log(metrics if group == "train" else {f"{group}/{k}": v for k, v in metrics.items()}, step=step)

    def event(self, name: str, step: int, **details: Any) -> None:
        """One line of events.jsonl, written as it happens: ``start``, ``save``, ``validation``, ``stop``,
        ``error``, ``end``. Opened for each (they are few), so the run's end is recorded after the logger closed."""
        if self.enabled:
            record = {"time": round(time.time(), 3), "event": name, "step": step, **details}
            with open(self.run_dir / EVENTS, "a") as events:
                events.write(json.dumps(record) + "\n")

    def image(self, tag: str, path: Path, step: int) -> None:
        if self.wandb is not None:
            import wandb

            self.wandb.log({tag: wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.log_file is not None:
            logging.getLogger("sdtrain").removeHandler(self.log_file)
            self.log_file.close()
            self.log_file = None
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
