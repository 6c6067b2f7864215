"""Deliberate failures, to test that a job recovers as it would from a lost node.

``SDTRAIN_KILL_AT_STEP=STEP[:RANK]`` makes that rank (every rank when none is named) kill itself
with SIGKILL right after finishing optimizer step STEP, with no chance to save. It fires only in a
run that started fresh, so the restarted job, which resumes from a checkpoint, runs through.

``SDTRAIN_NAN_AT_STEPS=STEP[,STEP...]`` turns the loss of those optimizer steps into NaN on every rank, as
an overflow or a poisoned sample would; unlike the kill it fires again after a resume, so an interrupted
run sees the same faults as an uninterrupted one.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping

import torch

from sdtrain.errors import UserError

log = logging.getLogger(__name__)

KILL_AT_STEP = "SDTRAIN_KILL_AT_STEP"
NAN_AT_STEPS = "SDTRAIN_NAN_AT_STEPS"


class FaultInjector:
    def __init__(self, rank: int, resumed: bool, environ: Mapping[str, str] = os.environ):
        self.kill_step: int | None = None
        nan_spec = environ.get(NAN_AT_STEPS, "").strip()
        try:
            self.nan_steps = {int(s) for s in nan_spec.split(",") if s.strip()}
        except ValueError:
            raise UserError(f"{NAN_AT_STEPS}={nan_spec!r}: expected step numbers, e.g. 3 or 3,4,5") from None
        spec = environ.get(KILL_AT_STEP, "").strip()
        if not spec or resumed:
            return
        step, _, target = spec.partition(":")
        try:
            self.kill_step = int(step)
            target_rank = int(target) if target else rank
        except ValueError:
            raise UserError(f"{KILL_AT_STEP}={spec!r}: expected STEP or STEP:RANK, e.g. 3 or 3:1") from None
        if target_rank != rank:
            self.kill_step = None

    def after_step(self, step: int) -> None:
        if step == self.kill_step:
            log.warning("%s: killing this process after step %d", KILL_AT_STEP, step)
            os.kill(os.getpid(), signal.SIGKILL)

    def corrupt_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` itself, or NaN of its shape when this step is listed in SDTRAIN_NAN_AT_STEPS."""
        return loss * float("nan") if step in self.nan_steps else loss
