"""The run-time of one fit as an explicit state machine: trace → profile → trial → run (→ profile ...).

::

             warm-up steps done            profile_steps done         every candidate measured
    TRACE ─────────────────────▶ PROFILE ─────────────────────▶ TRIAL ─────────────────────────▶ RUN
      │  (fixed schedule) ───────────────────────────────────────────────────────────────────▶ ▲ │
      │                            ▲  (one candidate) ─────────────────────────────────────────┘ │
      │                            └──────────────── drift > replan_margin (re-plan) ───────────┘
      │  (plan cache hit)          ▲ every window slower than                                    ▲
      └─────────────▶ VERIFY ──────┘ recorded by > replan_margin ── a window as fast as recorded ─┘
      └◀──────────── the trainable set changed (restart), from any phase
    (resume from a checkpoint whose plan fits: straight to RUN; PROFILE whose steps cannot be profiled: RUN with
    the fixed schedule FALLBACK_SCHEDULE, logged)

:class:`Controller` decides *when* to move; :class:`Effects` (implemented by the strategy's
run-time) does *what* a transition needs: install an engine, measure, plan, flush.
The controller keeps the phase machine and routes each step to the part that owns the phase's work:
:class:`~lightning_pipedap.strategy.selection.Selection` (TRIAL: windows, racing, confirmation, the choice),
:class:`~lightning_pipedap.strategy.verify.Verify` (VERIFY), :class:`~lightning_pipedap.strategy.drift.DriftWatch`
(RUN: drift, strikes, hold-off, re-plans), :class:`~lightning_pipedap.strategy.profiling.Profiling` (PROFILE: the
steps tried, giving up) and :class:`~lightning_pipedap.strategy.startup.StartupLedger` (time to steady state, the
start-up budget). The controller has no Lightning, torch or ``torch.distributed`` import, takes an injectable clock,
and every decision that must be identical on all ranks goes through :meth:`Effects.agree` (rank 0's value).
Steps of the warm-up schedules (TRACE, PROFILE) report :meth:`Controller.after_sync_step`; steps
with a final schedule installed (TRIAL, RUN; deferred where the step allows it, else in sync mode)
report :meth:`Controller.at_step_start`. A step is one optimizer step with automatic optimization, one
``training_step`` under manual optimization (whatever backward passes and optimizer steps it runs).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Protocol

from lightning_pipedap.strategy import selection_report
from lightning_pipedap.strategy.drift import DRIFT_CONFIRMATIONS, DRIFT_HOLDOFF_S, DriftWatch
from lightning_pipedap.strategy.phase import FALLBACK_SCHEDULE, Phase
from lightning_pipedap.strategy.profiling import UNPROFILED_STEPS, Profiling
from lightning_pipedap.strategy.selection import (MAX_WINDOW_STEPS, MIN_BUDGET_WINDOW, PREFERRED, RACE_DROP,
                                                  Selection, Trial, choose_candidate, lower_quartile)
from lightning_pipedap.strategy.startup import PARTS, StartupLedger, describe_startup, steps_text
from lightning_pipedap.strategy.verify import Verify

__all__ = ["DRIFT_CONFIRMATIONS", "DRIFT_HOLDOFF_S", "FALLBACK_SCHEDULE", "MAX_WINDOW_STEPS",
           "MIN_BUDGET_WINDOW", "PREFERRED", "RACE_DROP", "UNPROFILED_STEPS", "Controller", "Effects", "Phase",
           "Trial", "Verify", "choose_candidate", "describe_startup", "lower_quartile", "steps_text"]



class Effects(Protocol):
    """What a transition needs done (the strategy's run-time implements it; tests use a fake)."""

    def adopt_trace(self) -> None:
        """Turn the traced step into the parameter order and owners (all ranks, one collective)."""

    def install_fixed(self, name: Optional[str] = None) -> None:
        """Install the fixed (built-in) schedule over the traced order, final: the configured one, or ``name``."""

    def start_profiling(self) -> Optional[dict[str, float]]:
        """Install the profiling schedule and measure the cost model (first time only); returns the seconds
        spent on named parts (``{"alpha_beta": 0.02, "contention": 0.7}``, see :meth:`Controller.account`)
        or None."""

    def take_profile_step(self, t_step_end: float) -> Optional[int]:
        """Keep this sync step's profile; the number of profiled steps so far, None if it was not profiled."""

    def plan(self) -> tuple[list[Any], list[float]]:
        """Candidate engine schedules (the planner's first) and their no-overlap times (s); collective."""

    def install_run(self, schedule: Any) -> Optional[float]:
        """Install a planned schedule, final; returns its predicted communication busy time (s) or None."""

    def flush(self) -> None:
        """Apply every pending update (before an engine changes)."""

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a broadcast)."""

    def last_busy_s(self) -> Optional[float]:
        """The engine's communication busy time of its last round (s), or None."""

    def comm_floor_s(self) -> Optional[float]:
        """Lower bound of a step's communication (s): the α-β all-reduce of every gradient byte measured
        alone, None when unknown. A dense candidate measured faster than this is a bad measurement."""

    def rescale_cost_model(self, ratio: float) -> bool:
        """Scale α and β by ``ratio`` (communication slower in training than measured); False if not allowed."""

    def info(self, message: str) -> None:
        """Log on rank 0."""

    def cached_plan(self) -> tuple[str, Optional[tuple[Any, float, float]]]:
        """After the trace (planned schedules): look this run up in the plan cache; collective. Returns
        ``(status, plan)``: ``("off" | "miss", None)`` or ``("hit", (candidate, no_overlap_s, recorded_s))``,
        the remembered candidate, its no-overlap time and the time measured for it in its trial (s)."""

    def store_plan(self, results: list[dict[str, Any]], no_overlap_s: float, measured_s: float) -> None:
        """A selection finished (its choice installed): remember it in the plan cache (rank 0 writes)."""



def _choose(*args: Any, **kwargs: Any) -> tuple[int, list[float], list[str]]:
    """:func:`choose_candidate`, looked up in this module at each call (tests replace
    ``controller.choose_candidate``)."""
    return choose_candidate(*args, **kwargs)


class _Part:
    """An attribute of the :class:`Controller` kept by one of its parts (``part``: the controller's attribute
    holding it), read and written through under the same name."""

    def __init__(self, part: str) -> None:
        self.part = part

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type) -> Any:
        return self if obj is None else getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(getattr(obj, self.part), self.name, value)


class Controller:
    """Phase transitions of one fit (see the module docstring for the diagram).

    Args:
        effects: what transitions do.
        planned: the schedule is planned (else a fixed schedule is installed after the trace).
        warmup_steps: sync steps in TRACE (>= 1).
        profile_steps: profiled steps in PROFILE (>= 1).
        trial_steps: measured steps per candidate and round in TRIAL (each window after one settling step),
            at least; more when the steps are short (``trial_window_s``).
        trial_window_s: shortest measured window (s): a window has ``ceil(trial_window_s / t)`` steps
            (at most :data:`MAX_WINDOW_STEPS`), ``t`` the first candidate's no-overlap time, identical on
            every rank, so that short steps are measured over enough of them for a stable median.
        trial_rounds: interleaved rounds over the candidates in TRIAL (>= 1), and the rounds of a winner
            against DDP's reducer when it displaces it (a confirmation, decided on its windows alone).
        replan_every, replan_margin, max_replans: drift check in RUN (every ``replan_every``
            steps of the final schedule; re-plan when the lower-quartile step time of the last window is
            slower than the chosen candidate's trial measurement, or without trials than the prediction,
            by more than ``replan_margin``, at most ``max_replans`` times; faster never re-plans).
        clock: time source in seconds (``time.perf_counter``).
        run_noun: what the end-of-training messages call one training run (``"fit"``; Fabric: ``"run"``).
        prefer_margin: DDP's reducer (``torch_ddp``) is kept unless a candidate is faster by more than this
            fraction (``torch_ddp_margin``; :func:`choose_candidate`'s ``prefer_margin``).
        startup_budget: fraction of the fit's optimizer steps (:meth:`set_total_steps`) that one selection (trace or
            re-plan, profiling, trial windows) may take; past it the fastest candidate measured so far is installed.
            Trial windows are shortened to fit it. None: no budget.
        asked: the schedule name the user gave (``"optimal"``), for the line that says what runs.
        race_drop: after each round of trial windows, stop measuring a candidate slower than the fastest by more
            than this fraction (:data:`RACE_DROP`); None: every candidate runs every round.

    Attributes (read by the strategy and the measurement callbacks):
        selection, drift, ledger, profiling: the parts (:class:`Selection`, :class:`DriftWatch`,
            :class:`StartupLedger`, :class:`~lightning_pipedap.strategy.profiling.Profiling`); the options and results
            they keep are read and written here under the controller's names too, documented by the part:
            ``trial_results``, ``selections``, ``selection_notes`` (the last *finished* selection's measurements, every
            finished selection's, why the last one chose as it did), ``measured_iteration_s``, ``replans_done``,
            ``trial_reference_s``, ``startup`` (time to steady state, empty before RUN), ``unprofiled_note``.
        verify: the :class:`Verify` of a cached plan in progress (VERIFY only).
        phase: the current :class:`Phase`.
        sync_steps: sync steps since TRACE began.
        trial: the :class:`Trial` in progress (TRIAL only).
        predicted_iteration_s, no_overlap_time_s: of the installed plan (s).
        predictions: rank 0's predictions per candidate name (filled by the planner side).
        plan_cache: ``"off"``, ``"miss"``, ``"hit"`` (a remembered plan was installed after the trace:
            being verified, or verified) or ``"stale (re-selected)"`` (it measured slower than recorded by
            more than ``replan_margin``: selected again), as of the last trace.
    """

    def __init__(self, effects: Effects, *, planned: bool, warmup_steps: int = 1, profile_steps: int = 3,
                 trial_steps: int = 3, trial_rounds: int = 1, trial_window_s: float = 0.0, replan_every: int = 50,
                 replan_margin: float = 0.15, max_replans: int = 1,
                 clock: Callable[[], float] = time.perf_counter, run_noun: str = "fit",
                 prefer_margin: float = 0.10, startup_budget: Optional[float] = None,
                 race_drop: Optional[float] = RACE_DROP, asked: str = "") -> None:
        self.effects, self.clock = effects, clock
        self.selection = Selection(effects, _choose, trial_steps=trial_steps, trial_window_s=trial_window_s,
                                   trial_rounds=trial_rounds, race_drop=race_drop, prefer_margin=prefer_margin,
                                   asked=asked)
        self.drift = DriftWatch(effects, clock, replan_every=replan_every, replan_margin=replan_margin,
                                max_replans=max_replans)
        self.ledger = StartupLedger(clock, startup_budget)
        #: why the last selection stopped early (the start-up budget), in words; None when it did not
        self.budget_note: Optional[str] = None
        self.run_noun = run_noun  # what the end-of-training messages call it: "fit" (Trainer), "run" (Fabric)
        self.planned = planned
        self.warmup_steps = warmup_steps
        self.profiling = Profiling(profile_steps)
        self.phase, self.sync_steps = Phase.TRACE, 0
        self.trial: Optional[Trial] = None
        self.verify: Optional[Verify] = None
        self.plan_cache = "off"
        #: how the schedule running now was reached: "trace" (nothing final yet), "fixed", "resumed",
        #: "single" (one candidate, installed directly), "trial" (measuring), "selected" (a finished selection),
        #: "budget" (a selection the start-up budget stopped), "no_room" (the budget left no room for trials),
        #: "unprofiled" (the fixed schedule: profiling could not profile a step, :attr:`unprofiled_note` says why),
        #: "cached" (from the plan cache: verifying, or verified)
        self.how = "trace"
        self.predictions: dict[str, dict[str, float]] = {}
        self.predicted_iteration_s: Optional[float] = None
        self.no_overlap_time_s: Optional[float] = None

    # the options and results kept by the parts, under the controller's names (read and written through)
    trial_steps, trial_window_s, trial_rounds = _Part("selection"), _Part("selection"), _Part("selection")
    race_drop, prefer_margin, asked = _Part("selection"), _Part("selection"), _Part("selection")
    window_steps, trial_results = _Part("selection"), _Part("selection")
    selections, selection_notes = _Part("selection"), _Part("selection")
    replan_every, replan_margin, measured_iteration_s = _Part("drift"), _Part("drift"), _Part("drift")
    max_replans, replans_done, trial_reference_s = _Part("drift"), _Part("drift"), _Part("drift")
    startup, startup_budget, total_steps = _Part("ledger"), _Part("ledger"), _Part("ledger")
    # the ledger's verbs: account(parts) (seconds spent inside the current phase on named parts: their own entries
    # of startup), set_total_steps(total) (the fit's optimizer steps), budget_steps (steps one selection may take)
    account, set_total_steps, budget_steps = _Part("ledger"), _Part("ledger"), _Part("ledger")
    profile_steps, unprofiled_note = _Part("profiling"), _Part("profiling")

    #: start-up parts reported by :meth:`account`, in the order of the start-up line, with their label
    PARTS = PARTS

    def _leave(self, new: Phase) -> None:
        """Account the time and steps of the phase being left (until RUN is first reached)."""
        if self.ledger.leave(self.phase.value, new is Phase.RUN, self.plan_cache):
            out = self.startup
            self.effects.info(f"pipedap: steady state after {steps_text(out['total_steps'])}, "
                              f"{out['total_s']:.2f} s since set-up: {describe_startup(out)}")
        if new is Phase.PROFILE:
            self.profiling.tries = 0
        self.phase = new

    # ------------------------------------------------------------------ transitions
    def restart(self) -> None:
        """Back to TRACE (the trainable set changed): the next sync steps trace and plan again."""
        self._leave(Phase.TRACE)
        self.sync_steps, self.trial, self.verify, self.how = 0, None, None, "trace"
        self.ledger.selection_steps = 0

    def resumed(self, predicted_s: Optional[float], no_overlap_s: Optional[float],
                planned_busy_s: Optional[float]) -> None:
        """A checkpoint's final schedule was installed: straight to RUN."""
        self.predicted_iteration_s, self.no_overlap_time_s = predicted_s, no_overlap_s
        self.drift.planned_busy_s = planned_busy_s
        self.how = "resumed"
        self.drift.reset()
        self._leave(Phase.RUN)

    def after_sync_step(self, t_step_end: float) -> None:
        """A sync step ended (TRACE or PROFILE): advance warm-up identically on every rank."""
        self.sync_steps += 1
        if not self.phase.deferrable:  # (a sync-mode TRIAL step is counted by at_step_start)
            self.ledger.selection_step()
            self.ledger.steps_done += 1
        if self.phase is Phase.TRACE and self.sync_steps >= self.warmup_steps:
            self.effects.adopt_trace()
            if self.planned and self._install_cached():
                return
            if self.planned:
                self.account(self.effects.start_profiling())
                self._leave(Phase.PROFILE)
            else:
                self.effects.install_fixed()
                self.how = "fixed"
                self._leave(Phase.RUN)
        elif self.phase is Phase.PROFILE:
            done = self.effects.take_profile_step(t_step_end) or 0
            verdict = self.profiling.step(done)
            if verdict:
                self._finish_profiling()
            elif verdict is not None:
                self._give_up_profiling(done)

    def at_step_start(self) -> None:
        """A step of a final schedule starts (TRIAL or RUN): time it; switch candidates or re-plan when due."""
        if self.phase.deferrable:  # (TRACE and PROFILE steps are counted by after_sync_step)
            self.ledger.steps_done += 1
        if self.phase is Phase.TRIAL:
            self.ledger.selection_step()
            self._trial_step()
        elif self.phase is Phase.VERIFY:
            self.ledger.selection_step()  # (a stale verdict's selection shares the start-up budget with it)
            self._verify_step()
        elif self.phase is Phase.RUN:
            self._drift_step()

    # ------------------------------------------------------------------ TRACE -> VERIFY (plan cache)
    def _install_cached(self) -> bool:
        """After the trace: install the plan cache's candidate for this run, if any, and verify it (VERIFY)."""
        self.plan_cache, cached = self.effects.cached_plan()
        if cached is None:
            return False
        schedule, no_overlap_s, recorded_s = cached
        self.how = "cached"
        self._enter(schedule, no_overlap_s)
        # short windows (MIN_BUDGET_WINDOW = 2 measured steps; a hit is in steady state 5 steps after set-up):
        # verifying is not selecting; the first window within the margin ends it, a slow one is measured again, and
        # only every one of 2+ windows slow makes the plan stale
        self.window_steps = min(self.trial_steps, MIN_BUDGET_WINDOW)
        self.verify = Verify(recorded_s, windows=max(2, self.trial_rounds))
        self._leave(Phase.VERIFY)
        return True

    def _verify_step(self) -> None:
        """A step of the cached plan (:meth:`Verify.step`): verified -> RUN, its trial's time the drift reference;
        stale -> profile and select again (and remember the new choice)."""
        v = self.verify
        assert v is not None
        verdict = v.step(self.clock(), self.window_steps, self.replan_margin, self.effects)
        if verdict is None:
            return
        self.verify = None
        if verdict:
            self.drift.reset()
            self.trial_reference_s = v.reference_s  # drift is checked against what its trial measured
            self._leave(Phase.RUN)
            return
        self.plan_cache, self.how = "stale (re-selected)", "trace"
        self._profile_again()

    def _profile_again(self) -> None:
        """VERIFY (stale) or RUN (drift) -> PROFILE: a new selection starts."""
        self.effects.flush()
        self.account(self.effects.start_profiling())
        self._leave(Phase.PROFILE)

    # ------------------------------------------------------------------ PROFILE -> TRIAL / RUN
    def _finish_profiling(self) -> None:
        t0 = self.clock()
        schedules, no_overlap = self.effects.plan()
        self.account({"planning": self.clock() - t0})  # the planners' search and the plan broadcast
        # (trial_results keep the last finished selection: a re-plan that the fit does not finish must not
        # erase what was measured and chosen before it)
        self.budget_note = None
        n, left = len(schedules), self.ledger.selection_left()
        if n > 1 and left is not None and left < n * (MIN_BUDGET_WINDOW + 1):
            self.budget_note = _no_room_note(self.ledger.budget_text(), schedules)
            self.effects.info(f"pipedap: {self.budget_note}")
            schedules, no_overlap = schedules[:1], no_overlap[:1]
        if len(schedules) > 1:
            self.how = "trial"
            self.trial = self.selection.begin(schedules, no_overlap, left, self.budget_steps)
            self._enter(schedules[0], no_overlap[0])
            self._leave(Phase.TRIAL)
            # The first window starts with the first step of the candidate, as every later one does (the step
            # that switched): that step starts with nothing pending, so it is short and must be its settling
            # interval; the time from here to it (the loop's gap between steps) is no step and is not counted.
            self.trial.starts = []
        else:
            self.how = "no_room" if self.budget_note else "single"
            self._enter(schedules[0], no_overlap[0])
            self._leave(Phase.RUN)

    def _give_up_profiling(self, done: int) -> None:
        """Too many profiling steps without a forward and a backward pass observed in the same step (a training
        loop whose steps cannot be profiled): install the fixed schedule, final, and say why, rather than run
        the profiling schedule for the rest of the fit."""
        self.effects.info(self.profiling.give_up(done, self.replans_done))
        self.effects.install_fixed(FALLBACK_SCHEDULE)
        self.how = "unprofiled"
        self._leave(Phase.RUN)

    def _enter(self, schedule: Any, no_overlap_s: float) -> None:
        self.trial_reference_s = None
        t_installed = self.clock()
        busy = self.effects.install_run(schedule)
        self.predicted_iteration_s = schedule.predicted_iteration_s
        self.no_overlap_time_s = no_overlap_s
        self.drift.watch(t_installed, busy, getattr(schedule, "replannable", True))

    # ------------------------------------------------------------------ TRIAL
    def _trial_step(self) -> None:
        """The choice is rank 0's (its iteration time is the group's: the ranks are coupled by collectives). Every
        rank counts the same steps, so the start-up budget stops the selection at the same step everywhere."""
        tr = self.trial
        assert tr is not None
        now, over = self.clock(), self.ledger.over_budget()
        if not self.selection.window_over(tr, now, over):
            return
        self.effects.flush()  # the previous step's updates, before the engine changes
        if self.selection.next_window(tr, over):
            self._next_window(tr)
            return
        installed = tr.order[tr.window - 1]
        choice, windows, note = self.selection.finish(tr, over, self.ledger.budget_text() if over else "")
        if note is not None:
            self.budget_note = note
        if choice is None:  # confirmation windows appended
            self._next_window(tr)
            return
        self.trial = None
        self.selection.record(tr, choice, windows, self.predictions)
        self.how = "budget" if over else "selected"
        best, measured = choice[0], choice[1]
        if best != installed:  # the last window's candidate is the one installed now
            self._enter(tr.schedules[best], tr.no_overlap_s[best])
        else:
            self.effects.info(f"pipedap: keeping the installed candidate {tr.schedules[best].name}")
            self.drift.reset()
        self.trial_reference_s = measured[best]  # drift is checked against what the trial measured
        self.effects.store_plan(self.trial_results, tr.no_overlap_s[best], measured[best])
        self._leave(Phase.RUN)

    def _next_window(self, tr: Trial) -> None:
        nxt = tr.order[tr.window]
        if nxt != tr.order[tr.window - 1]:
            self._enter(tr.schedules[nxt], tr.no_overlap_s[nxt])
        tr.starts = [self.clock()]

    # the reporting views (read-only, in selection_report): unfinished_trial() (a sentence for the end of a fit that
    # stopped during measured plan selection or profiling, else None), partial_trial_results() (the measurements of
    # the selection in progress), plan_selection() (where measured plan selection stands, as plain data)
    unfinished_trial = selection_report.unfinished_trial
    partial_trial_results = selection_report.partial_trial_results
    plan_selection = selection_report.plan_selection

    # ------------------------------------------------------------------ RUN: drift
    def _drift_step(self) -> None:
        """A RUN step (:meth:`DriftWatch.replan_due`): a sustained slowdown re-plans (PROFILE), unless the rest of
        the fit is too short to pay for another selection."""
        ledger = self.ledger
        if self.drift.replan_due(self.predicted_iteration_s, ledger.steps_left(), ledger.startup.get("total_steps")):
            self.ledger.selection_steps = 0
            self._profile_again()


def _no_room_note(budget_text: str, schedules: list) -> str:
    """The start-up's note when ``budget_text`` leaves no room for trial windows: the first of ``schedules`` (the
    planner's) is installed on its prediction alone."""
    first = schedules[0]
    return (f"{budget_text} left no room for trial windows: the planner's schedule {first.name!r}"
            f"{' (sharded)' if getattr(first, 'sharded', False) else ''} was installed on its prediction alone, "
            f"without measuring the other {len(schedules) - 1} candidate(s)")
