"""Deliberate failures, to test that a job recovers as it would from a lost node.

``SDTRAIN_KILL_AT_STEP=STEP[:RANK]`` makes that rank (every rank when none is named) kill itself
with SIGKILL right after finishing optimizer step STEP, with no chance to save. It fires only in a
run that started fresh, so the restarted job, which resumes from a checkpoint, runs through.

``SDTRAIN_STALL_AT_STEP=STEP[:RANK]`` makes that rank stop responding after step STEP, as a hung GPU or
a swapping node does, until a signal ends it; the other ranks' next collective then times out.

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
STALL_AT_STEP = "SDTRAIN_STALL_AT_STEP"
NAN_AT_STEPS = "SDTRAIN_NAN_AT_STEPS"


def _step_for_rank(environ: Mapping[str, str], name: str, rank: int) -> int | None:
    """The step of a ``STEP[:RANK]`` fault meant for this rank (every rank when none is named), or None."""
    spec = environ.get(name, "").strip()
    if not spec:
        return None
    step, _, target = spec.partition(":")
    try:
        chosen = int(step)
        target_rank = int(target) if target else rank
    except ValueError:
        raise UserError(f"{name}={spec!r}: expected STEP or STEP:RANK, e.g. 3 or 3:1") from None
    return chosen if target_rank == rank else None


class FaultInjector:
    def __init__(self, rank: int, resumed: bool, environ: Mapping[str, str] = os.environ):
        nan_spec = environ.get(NAN_AT_STEPS, "").strip()
        try:
            self.nan_steps = {int(s) for s in nan_spec.split(",") if s.strip()}
        except ValueError:
            raise UserError(f"{NAN_AT_STEPS}={nan_spec!r}: expected step numbers, e.g. 3 or 3,4,5") from None
        # Only in a run that started fresh: the restarted job, which resumes from a checkpoint, runs through.
        self.kill_step = None if resumed else _step_for_rank(environ, KILL_AT_STEP, rank)
        self.stall_step = None if resumed else _step_for_rank(environ, STALL_AT_STEP, rank)

    def after_step(self, step: int) -> None:
        if step == self.kill_step:
            log.warning("%s: killing this process after step %d", KILL_AT_STEP, step)
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.stall_step:
            log.warning("%s: this process stops responding after step %d", STALL_AT_STEP, step)
            # A hung process still dies of the launcher's SIGTERM; the trainer's own handler would only
            # note it and wait for a step that never ends.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            while True:
                signal.pause()

    def corrupt_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` itself, or NaN of its shape when this step is listed in SDTRAIN_NAN_AT_STEPS."""
        return loss * float("nan") if step in self.nan_steps else loss
