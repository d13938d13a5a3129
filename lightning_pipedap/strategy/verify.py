"""Verification of a plan from the plan cache (the VERIFY phase of the
:class:`~lightning_pipedap.strategy.controller.Controller`): windows of the cached plan timed against the step time
recorded in the trial that selected it. No Lightning, torch or ``torch.distributed`` import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_pipedap.strategy.selection import lower_quartile
from lightning_pipedap.strategy.startup import steps_text


@dataclass
class Verify:
    """A plan from the plan cache being verified (VERIFY only).

    Attributes:
        reference_s: the chosen candidate's time measured in the trial that selected it (s).
        windows: how many windows may be measured (``trial_rounds``, at least 2): a load burst on a shared
            machine can slow one window by more than the margin.
        starts: clock at each step start of the current window (s); the first window's first interval settles.
        measured_s: the lower-quartile step time of each window measured so far (s, rank 0's).
    """

    reference_s: float
    windows: int = 2
    starts: list[float] = field(default_factory=list)
    measured_s: list[float] = field(default_factory=list)

    def step(self, now: float, window_steps: int, margin: float, effects: Any) -> Optional[bool]:
        """A step of the cached plan starts at ``now`` (s). Windows are timed as a trial window is (the lower
        quartile of ``window_steps`` intervals, the first window after one settling step; rank 0's through
        ``effects.agree``). Returns True when a window is within ``margin`` of the recorded time (or faster):
        verified; False when every one of :attr:`windows` was slower: stale; None while measuring (a window not
        full yet, or another window after a slow one). Says each verdict with ``effects.info``."""
        self.starts.append(now)
        settle = 1 if not self.measured_s else 0  # (the first interval after the install settles, not counted)
        if len(self.starts) < window_steps + 1 + settle:
            return None
        gaps = [b - a for a, b in zip(self.starts[:-1], self.starts[1:])]
        measured = effects.agree(lower_quartile(gaps[settle:]))
        self.measured_s.append(measured)
        self.starts = [self.starts[-1]]
        drift = measured / self.reference_s - 1.0 if self.reference_s > 0 else float("inf")
        what = (f"{measured * 1e3:.1f} ms (lower quartile of {steps_text(window_steps)}) vs "
                f"{self.reference_s * 1e3:.1f} ms recorded in its trial")
        if drift <= margin:
            effects.info(f"pipedap: cached plan verified: {what}")
            return True
        if len(self.measured_s) < self.windows:
            effects.info(f"pipedap: cached plan measured {what} ({drift:.0%} slower, more than replan_margin "
                         f"{margin:.0%}); measuring another window")
            return None
        effects.info(f"pipedap: cached plan measured {what} ({drift:.0%} slower, more than replan_margin "
                     f"{margin:.0%}, in each of {len(self.measured_s)} windows: "
                     + ", ".join(f"{m * 1e3:.1f} ms" for m in self.measured_s) + "): stale, selecting again")
        return False
