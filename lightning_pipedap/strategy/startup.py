"""Time to steady state and the start-up budget of one fit (:class:`StartupLedger`, kept by the
:class:`~lightning_pipedap.strategy.controller.Controller`), and the start-up line (:func:`describe_startup`).

No Lightning, torch or ``torch.distributed`` import; the clock is injected.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

#: start-up parts reported by :meth:`StartupLedger.account`, in the order of the start-up line, with their label
PARTS = (("helper_start", "compression helper start"), ("alpha_beta", "α-β model"),
         ("contention", "contention benchmark"))


def steps_text(n: Any) -> str:
    """``"1 step"``, ``"3 steps"``."""
    return f"{n} step{'' if n == 1 else 's'}"


def describe_startup(startup: dict[str, Any], digits: int = 2) -> str:
    """Every entry of :attr:`Controller.startup` in order, adding up to its ``total_s``:
    ``"trace 1 step 0.80 s, α-β model 0.01 s, contention benchmark 0.70 s, profile 3 steps 0.10 s, planning
    0.30 s, trials 40 steps 4.20 s"`` (a part appears only when it ran; ``digits`` decimals); after a plan cache
    hit ``"trace 1 step 0.80 s, verifying the cached plan 4 steps 0.05 s; plan cache hit"``, and the plan cache's
    status at the end whenever it was consulted (``"; plan cache miss"``)."""
    items = [f"trace {steps_text(startup.get('trace_steps', 0))} {startup.get('trace_s', 0.0):.{digits}f} s"]
    if "verify_steps" in startup:
        items += [f"verifying the cached plan {steps_text(startup['verify_steps'])} {startup['verify_s']:.{digits}f} s"]
    items += [f"{label} {startup[f'{k}_s']:.{digits}f} s" for k, label in PARTS if f"{k}_s" in startup]
    if "verify_steps" not in startup or startup.get("profile_steps") or startup.get("trial_steps"):
        items += [f"profile {steps_text(startup.get('profile_steps', 0))} {startup.get('profile_s', 0.0):.{digits}f} s"]
        items += [f"planning {startup['planning_s']:.{digits}f} s"] if "planning_s" in startup else []
        items += [f"trials {steps_text(startup.get('trial_steps', 0))} {startup.get('trial_s', 0.0):.{digits}f} s"]
    status = startup.get("plan_cache")
    return ", ".join(items) + (f"; plan cache {status}" if status and status != "off" else "")


class StartupLedger:
    """Seconds and steps of each phase until steady state (RUN first reached), and the steps a selection may take.

    Args:
        clock: time source in seconds.
        startup_budget: fraction of the fit's optimizer steps (:meth:`set_total_steps`) that one selection (trace
            or re-plan, profiling, trial windows) may take; None: no budget.

    Attributes:
        startup: time to steady state, filled when RUN is first reached: ``{"trace_s", "trace_steps",
            "profile_s", "profile_steps", "trial_s", "trial_steps", "total_s", "total_steps"}`` plus one
            ``"<part>_s"`` per part reported to :meth:`account` (``alpha_beta_s``, ``contention_s``,
            ``helper_start_s``), in s from the controller's creation at set-up. The phases exclude the
            parts, so ``total_s`` is the sum of the phases and parts; a phase holds everything else that
            ran while it was current (Lightning's own work between steps; in profile, planning with the
            compressor's cost measurement; in trials, the engine switches). After a plan cache hit,
            ``"verify_s"`` and ``"verify_steps"`` (the verification window) too, and the profile and trial
            entries are 0 unless the verification failed; ``"plan_cache"``: the controller's ``plan_cache``.
            Empty before.
        total_steps: the fit's optimizer steps, when known (:meth:`set_total_steps`); the budget applies only then.
        selection_steps: steps since this selection (start-up or re-plan) began.
        steps_done: optimizer steps reported so far (sync and final schedules).
    """

    def __init__(self, clock: Callable[[], float], startup_budget: Optional[float]) -> None:
        self.clock = clock
        self.startup_budget = startup_budget
        self.total_steps: Optional[int] = None
        self.selection_steps = 0
        self.steps_done = 0
        self.startup: dict[str, Any] = {}
        self._t_phase = clock()
        self._phase_steps = 0
        self._spent: dict[str, float] = {}

    def account(self, parts: Optional[dict[str, float]]) -> None:
        """Count ``parts`` (``name -> seconds`` spent inside the current phase: ``helper_start``,
        ``alpha_beta``, ``contention``, ``planning``) as their own entries of :attr:`startup` instead of the phase's.
        Ignored after steady state is reached (a re-plan's α-β work is not start-up)."""
        if self.startup or not parts:
            return
        for name, seconds in parts.items():
            self._spent[f"{name}_s"] = self._spent.get(f"{name}_s", 0.0) + seconds
            self._t_phase += seconds  # the phase's clock skips the part

    def selection_step(self) -> None:
        """A step of the current phase that counts against the selection's budget (TRACE, PROFILE, TRIAL, VERIFY)."""
        self._phase_steps += 1
        self.selection_steps += 1

    def set_total_steps(self, total: Optional[float]) -> None:
        """The fit's optimizer steps (Lightning's ``estimated_stepping_batches``); None or infinite: unknown."""
        self.total_steps = int(total) if total is not None and math.isfinite(total) and total > 0 else None

    @property
    def budget_steps(self) -> Optional[int]:
        """Steps one selection may take (``startup_budget`` x the fit's steps, at least 1), None without a budget."""
        if self.startup_budget is None or self.total_steps is None:
            return None
        return max(1, math.floor(self.startup_budget * self.total_steps))

    def steps_left(self) -> Optional[int]:
        """Optimizer steps of the fit still to come (:attr:`total_steps` - :attr:`steps_done`), None when unknown."""
        return None if self.total_steps is None else self.total_steps - self.steps_done

    def selection_left(self) -> Optional[int]:
        """Steps of its start-up budget this selection has left (may be negative), None without a budget."""
        budget = self.budget_steps
        return None if budget is None else budget - self.selection_steps

    def over_budget(self) -> bool:
        """Whether this selection has taken every step of its budget."""
        budget = self.budget_steps
        return budget is not None and self.selection_steps >= budget

    def budget_text(self) -> str:
        """``"the start-up budget (10 steps, startup_budget=0.1 of 100 steps)"``."""
        return (f"the start-up budget ({steps_text(self.budget_steps)}, startup_budget={self.startup_budget:g} of "
                f"{self.total_steps} steps)")

    def leave(self, phase: str, to_run: bool, plan_cache: str) -> bool:
        """Account the time and steps of the phase being left (its ``value``) until RUN is first reached
        (``to_run``: the phase entered is RUN; ``plan_cache``: the plan cache's status). Returns whether steady
        state was reached now (:attr:`startup` then filled)."""
        if self.startup:
            return False
        now = self.clock()
        self._spent[f"{phase}_s"] = self._spent.get(f"{phase}_s", 0.0) + now - self._t_phase
        self._spent[f"{phase}_steps"] = self._spent.get(f"{phase}_steps", 0) + self._phase_steps
        self._t_phase, self._phase_steps = now, 0
        if not to_run:
            return False
        phases = ("trace", "verify", "profile", "trial") if "verify_s" in self._spent else ("trace", "profile", "trial")
        out: dict[str, Any] = {f"{k}_{u}": self._spent.get(f"{k}_{u}", 0) for k in phases for u in ("s", "steps")}
        out.update({f"{k}_s": self._spent[f"{k}_s"] for k in [k for k, _ in PARTS] + ["planning"]
                    if f"{k}_s" in self._spent})
        out["total_s"] = sum(v for k, v in out.items() if k.endswith("_s"))
        out["total_steps"] = sum(out[f"{k}_steps"] for k in phases)
        out["plan_cache"] = plan_cache
        self.startup = out
        return True
