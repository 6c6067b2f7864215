"""How many steps a run trains: ``train.max_steps``, or under ``train.max_minutes`` as many as fit in that time.

A time budget is planned from the run's own steps, not from a timing taken before it: the machine may be busier or
idler while the run trains than when it was timed (a step timed at 0.81 s on a loaded machine ran at about 0.6 s
in the run that followed, so a plan made up front left a third of the time unused). The plan is the learning-rate
schedule's length, so the cosine decay still ends at the run's last step whatever that turns out to be.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

clock = time.perf_counter
"""What a plan times steps by (a test may stand in its own)."""

FIRST_PLAN_STEPS = 5
"""Steps a start trains before its own pace replaces train.max_steps as the plan: the first step carries one-time
costs (memory first touched, lazy initialisation) that would make an earlier estimate pessimistic."""


@dataclass
class StepPlan:
    """The planned length of the run in optimizer steps, which the learning-rate schedule spans.

    With a budget (`seconds` > 0), `replan` sets `total` to the steps done plus as many as the time left allows at
    the pace of this start so far (its evaluations, validation grids and saves included, as they recur), never past
    `most` (train.max_steps) nor below the steps done. A resumed run keeps the plan its checkpoint recorded: the
    steps it trains, and so its learning rates, follow from the checkpoint alone, as for any resume.
    """

    total: int
    most: int
    seconds: float = 0.0
    planned: bool = False
    """Whether `total` comes from a plan (the run's pace, or a checkpoint's plan) rather than train.max_steps: a
    checkpoint saved before the first plan records none, and its resume plans afresh from the time left."""
    frozen: bool = False
    """Set on resume (`resume`): the recorded plan stands."""
    started: tuple[int, float] = (0, 0.0)
    """The step this start began at, and when."""

    @property
    def budgeted(self) -> bool:
        return self.seconds > 0 and not self.frozen

    def start(self, step: int) -> None:
        self.started = (step, clock())

    def replan(self, step: int, seconds_before: float = 0.0) -> tuple[float, float] | None:
        """Re-plan after `step`, `seconds_before` of training having gone to earlier starts of the run; the pace
        (seconds a step) and the seconds left it planned by, or None when it did not re-plan."""
        first, since = self.started
        steps, seconds = step - first, clock() - since
        if not self.budgeted or steps < FIRST_PLAN_STEPS:
            return None
        pace, left = seconds / steps, self.seconds - seconds_before - seconds
        self.total = min(self.most, step + max(0, math.floor(left / pace)))
        self.planned = True
        return pace, left

    def resume(self, recorded: int) -> None:
        """A budgeted run resumed from a checkpoint that planned `recorded` steps: trains to them (at most
        train.max_steps), re-planning no more."""
        self.total, self.planned, self.frozen = min(self.most, recorded), True, True


def lr_factor(schedule: str, warmup: int, plan: StepPlan):
    """The learning-rate multiplier at a step: a linear warmup over `warmup` steps, then ``constant`` or a
    ``cosine`` to zero at the plan's total (read at each step, so a re-planned run decays to its new end). The same
    values as diffusers' ``constant_with_warmup`` and ``cosine`` schedules for a fixed plan."""

    def factor(step: int) -> float:
        if step < warmup:
            return float(step) / float(max(1, warmup))
        if schedule != "cosine":
            return 1.0
        progress = float(step - warmup) / float(max(1, plan.total - warmup))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    return factor
