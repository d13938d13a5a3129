"""Drift watching in RUN (:class:`DriftWatch`, kept by the :class:`~lightning_pipedap.strategy.controller.Controller`):
the installed schedule's step times against its reference, and when a sustained slowdown asks for a re-plan.
No Lightning, torch or ``torch.distributed`` import.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any, Callable, Optional

from lightning_pipedap.strategy.selection import lower_quartile
from lightning_pipedap.strategy.startup import steps_text

#: a drift re-plan needs this many consecutive drift checks over the margin (one slow window on a shared machine
#: is load, not a slower schedule)
DRIFT_CONFIRMATIONS = 3
#: and none within this many seconds after a schedule was installed (rank 0's clock)
DRIFT_HOLDOFF_S = 60.0


class DriftWatch:
    """Step times of the schedule running in RUN, checked every ``replan_every`` steps against a reference.

    Args:
        effects: the controller's :class:`~lightning_pipedap.strategy.controller.Effects` (``agree``,
            ``last_busy_s``).
        clock: time source in seconds.
        replan_every, replan_margin, max_replans: as the controller's arguments.

    Attributes:
        measured_iteration_s: median step interval of the last window (s), refreshed every 5 steps; None before.
        planned_busy_s: the installed schedule's predicted communication busy time (s), or None.
        replannable: False for a candidate without a plan (DDP's reducer): no drift re-plan.
        t_installed: clock when the schedule running now was installed (the hold-off's start).
        strikes: consecutive drift checks over the margin.
        replans_done: re-plans triggered by drift (:meth:`replan_due`).
        trial_reference_s: the chosen candidate's measured trial step time (s), the drift reference after a trial
            (the controller sets it; None: the plan's prediction is the reference).
    """

    def __init__(self, effects: Any, clock: Callable[[], float], *, replan_every: int, replan_margin: float,
                 max_replans: int = 1) -> None:
        self.effects, self.clock = effects, clock
        self.replan_every, self.replan_margin, self.max_replans = replan_every, replan_margin, max_replans
        self.replans_done = 0
        self.trial_reference_s: Optional[float] = None
        self.measured_iteration_s: Optional[float] = None
        self.planned_busy_s: Optional[float] = None
        self.replannable = True
        self.t_installed = clock()
        self.strikes = 0
        self._starts: deque[float] = deque(maxlen=replan_every + 1)
        self._busy: deque[float] = deque(maxlen=replan_every)
        self._run_steps = 0

    def watch(self, t_installed: float, planned_busy_s: Optional[float], replannable: bool) -> None:
        """A schedule was installed at ``t_installed`` (s): watch it from its next step."""
        self.t_installed, self.replannable = t_installed, replannable
        self.planned_busy_s = planned_busy_s
        self.reset()

    def reset(self) -> None:
        """Forget the steps and strikes so far (a new schedule, or one kept after a selection)."""
        self._starts.clear()
        self._busy.clear()
        self._run_steps = 0
        self.strikes = 0

    def step(self, ref: Optional[float], may_replan: bool) -> Optional[tuple[float, float, float]]:
        """A RUN step starts. Every ``replan_every`` steps (while ``may_replan`` and the schedule is replannable)
        compare the last window's lower-quartile step time with ``ref`` (s: the trial's measurement or the
        prediction). Returns ``(measured (s), drift (fraction slower), busy ratio)``, all rank 0's, when
        :data:`DRIFT_CONFIRMATIONS` checks in a row were slower than ``ref`` by more than ``replan_margin`` and
        :data:`DRIFT_HOLDOFF_S` passed since the install; else None."""
        self._starts.append(self.clock())  # bounded: the last replan_every + 1 starts
        busy = self.effects.last_busy_s()
        if busy is not None:
            self._busy.append(busy)
        self._run_steps += 1
        n = self._run_steps
        check = (ref is not None and self.replannable and n > self.replan_every and not (n - 1) % self.replan_every
                 and may_replan)
        if not check and (n < 6 or (n - 1) % 5):
            return None
        starts = list(self._starts)
        gaps = [b - a for a, b in zip(starts[:-1], starts[1:])]
        self.measured_iteration_s = statistics.median(gaps)  # median of the last window, refreshed every 5 steps
        if not check:
            return None
        assert ref is not None
        # the run's own speed (lower quartile: load bursts only add time) against what was measured in the
        # trial (the same statistic) or, without trials, the plan's prediction
        measured = lower_quartile(gaps)
        ratio = statistics.median(self._busy) / self.planned_busy_s if self._busy and self.planned_busy_s else 1.0
        # only a slower run re-plans: a faster one than predicted is not a reason to change the schedule; and only a
        # sustained slowdown (DRIFT_CONFIRMATIONS checks in a row), not within DRIFT_HOLDOFF_S of the install (rank
        # 0's clock)
        held = self.clock() - self.t_installed < DRIFT_HOLDOFF_S
        drift, ratio, held = self.effects.agree((measured / ref - 1.0, ratio, held))
        if drift <= self.replan_margin or held:
            self.strikes = 0
            return None
        self.strikes += 1
        if self.strikes < DRIFT_CONFIRMATIONS:
            return None
        return measured, drift, ratio

    def replan_due(self, predicted_s: Optional[float], left: Optional[int], used: Optional[int]) -> bool:
        """A RUN step starts: whether a re-plan is due now, counted in :attr:`replans_done` and said. :meth:`step`
        against :attr:`trial_reference_s`, else ``predicted_s`` (the plan's prediction, s), while fewer than
        ``max_replans`` re-plans ran; not when :meth:`too_late` (``left``, ``used``: steps; then no later re-plan
        either: the rest of the fit only gets shorter)."""
        ref = self.trial_reference_s or predicted_s
        slow = self.step(ref, self.replans_done < self.max_replans)
        if slow is None:
            return False
        if self.too_late(slow, left, used):
            self.max_replans = self.replans_done  # (the rest of the fit only gets shorter)
            return False
        assert ref is not None
        self.announce_replan(slow, ref, "in its trial" if self.trial_reference_s else "predicted")
        self.replans_done += 1
        return True

    def too_late(self, slow: tuple[float, float, float], left: Optional[int], used: Optional[int]) -> bool:
        """Whether the ``left`` steps of the fit (None: unknown) are fewer than 4x the ``used`` steps a selection
        took (None: unknown), too few to pay for a re-plan after the slowdown ``slow`` (:meth:`step`'s result);
        then the strikes are forgotten and it is said."""
        if left is None or not used or left >= 4 * used:
            return False
        self.strikes = 0
        self.effects.info(f"pipedap: measured iteration {slow[0] * 1e3:.1f} ms, {slow[1]:.0%} slower than the "
                          f"reference, but {left} steps are left, fewer than 4x "
                          f"the {steps_text(used)} a selection took: not re-planning")
        return True

    def announce_replan(self, slow: tuple[float, float, float], ref: float, what: str) -> None:
        """A re-plan follows the sustained slowdown ``slow`` (:meth:`step`'s result) against ``ref`` (s, ``what``:
        ``"in its trial"`` or ``"predicted"``): calibrate α-β first when communication is busier than predicted,
        and say so."""
        measured, drift, ratio = slow
        if ratio > 1.05 and self.effects.rescale_cost_model(ratio):
            # communication is slower during training than in the idle micro-benchmark (compute, gloo
            # threads and the ring's additions share the cores): calibrate α-β before re-planning
            self.effects.info(f"pipedap: communication busy {ratio:.2f}x the α-β prediction; scaling α and β")
        self.effects.info(f"pipedap: measured iteration {measured * 1e3:.1f} ms (lower quartile) vs "
                          f"{ref * 1e3:.1f} ms {what} ({drift:.0%} slower, more than the margin "
                          f"{self.replan_margin:.0%}): re-planning")
