"""The PROFILE phase's count (:class:`Profiling`, kept by the
:class:`~lightning_pipedap.strategy.controller.Controller`): profiled steps needed, steps tried, and when to give up
on a training loop whose steps cannot be profiled. No Lightning, torch or ``torch.distributed`` import.
"""

from __future__ import annotations

from typing import Optional

from lightning_pipedap.strategy import selection_report

#: profiling steps that may end unprofiled (no forward with a backward pass observed in the step) before the
#: fixed schedule is installed instead of a plan: ``max(UNPROFILED_STEPS, 2 * profile_steps)``
UNPROFILED_STEPS = 8


class Profiling:
    """Steps of the current PROFILE phase against the profiled steps a plan needs.

    Args:
        profile_steps: profiled steps in PROFILE (>= 1).

    Attributes:
        tries: steps of the current PROFILE phase (the controller sets 0 when PROFILE is entered).
        unprofiled_note: why the fixed schedule replaced a plan (:meth:`give_up`), in words; None otherwise.
    """

    def __init__(self, profile_steps: int) -> None:
        self.profile_steps = profile_steps
        self.tries = 0
        self.unprofiled_note: Optional[str] = None

    def step(self, done: int) -> Optional[bool]:
        """A PROFILE step ended with ``done`` profiled steps so far. Returns True when enough were profiled (plan
        now), False when ``max(UNPROFILED_STEPS, 2 * profile_steps)`` steps ended unprofiled (give up), else None."""
        self.tries += 1
        if done >= self.profile_steps:
            return True
        if self.tries - done >= max(UNPROFILED_STEPS, 2 * self.profile_steps):
            return False
        return None

    def give_up(self, done: int, replans_done: int) -> str:
        """Profiling gave up after ``done`` profiled steps (for the plan, or re-plan ``replans_done``): keep and
        return :attr:`unprofiled_note` (:func:`~lightning_pipedap.strategy.selection_report.unprofiled`)."""
        self.unprofiled_note = selection_report.unprofiled(self.tries, done, self.profile_steps, replans_done)
        return self.unprofiled_note
