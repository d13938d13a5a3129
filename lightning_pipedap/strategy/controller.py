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
run-time) does *what* a transition needs: install an engine, measure, plan, flush. The controller
has no Lightning, torch or ``torch.distributed`` import, takes an injectable clock, and every
decision that must be identical on all ranks goes through :meth:`Effects.agree` (rank 0's value).
Steps of the warm-up schedules (TRACE, PROFILE) report :meth:`Controller.after_sync_step`; steps
with a final schedule installed (TRIAL, RUN; deferred where the step allows it, else in sync mode)
report :meth:`Controller.at_step_start`. A step is one optimizer step with automatic optimization, one
``training_step`` under manual optimization (whatever backward passes and optimizer steps it runs).
"""

from __future__ import annotations

import enum
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence


#: most measured steps of one trial window (short steps are measured over ``trial_window_s``)
MAX_WINDOW_STEPS = 50
#: candidates kept unless another is faster by more than ``choose_candidate``'s ``prefer_margin``
PREFERRED = ("torch_ddp",)
#: racing: after each round of trial windows, a candidate whose median so far is slower than the leader's by more
#: than this fraction is measured no more (successive halving's idea, with a noise-sized margin)
RACE_DROP = 0.25
#: a drift re-plan needs this many consecutive drift checks over the margin (one slow window on a shared machine
#: is load, not a slower schedule)
DRIFT_CONFIRMATIONS = 3
#: and none within this many seconds after a schedule was installed (rank 0's clock)
DRIFT_HOLDOFF_S = 60.0
#: fewest measured steps of a trial window when the start-up budget shortens the windows
MIN_BUDGET_WINDOW = 2
#: profiling steps that may end unprofiled (no forward with a backward pass observed in the step) before the
#: fixed schedule is installed instead of a plan: ``max(UNPROFILED_STEPS, 2 * profile_steps)``
UNPROFILED_STEPS = 8
#: the fixed schedule installed when profiling cannot profile a step
FALLBACK_SCHEDULE = "dear"


class Phase(enum.Enum):
    """Where the run-time is: what the next step does."""

    TRACE = "trace"  #: sync steps of the warm-up schedule; the first one traces the forward
    PROFILE = "profile"  #: sync steps of the profiling schedule, per-layer times measured
    TRIAL = "trial"  #: steps of measured plan selection, candidates in interleaved rounds
    VERIFY = "verify"  #: steps of a plan from the plan cache, timed in windows against its recorded time
    RUN = "run"  #: steps of the installed schedule, drift checked

    @property
    def deferrable(self) -> bool:
        """Whether steps of this phase may defer updates (a final schedule is installed)."""
        return self in (Phase.TRIAL, Phase.VERIFY, Phase.RUN)


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


@dataclass
class Trial:
    """Measured plan selection in progress.

    Attributes:
        schedules: candidate engine schedules (``name``, ``describe()``, ``predicted_iteration_s``).
        no_overlap_s: no-overlap time of each candidate (s).
        order: the candidate index of each measurement window, one round at a time (racing appends the next
            round of the candidates still in the race).
        window: the window being measured (index into ``order``).
        starts: clock at each step start of the current window (s).
        gaps_s: per candidate, every step interval of each of its windows, the settling one first (s).
        confirm: ``(winner, preferred, first_pass_windows)`` while the windows after ``order``'s first pass
            measure the first pass's winner against the preferred candidate it displaced (indices; the
            number of windows each had before), else None.
    """

    schedules: list[Any]
    no_overlap_s: list[float]
    order: list[int] = field(default_factory=list)
    window: int = 0
    starts: list[float] = field(default_factory=list)
    gaps_s: list[list[list[float]]] = field(default_factory=list)
    confirm: Optional[tuple[int, int, int]] = None
    #: candidates still raced (indices); rounds of windows finished
    alive: list[int] = field(default_factory=list)
    rounds_done: int = 0
    #: racing notes (which candidate was dropped after which round, with the numbers)
    dropped: list[str] = field(default_factory=list)


def lower_quartile(values: Sequence[float]) -> float:
    """The 25th percentile (nearest rank) of ``values``: a trial window's step time. On a shared machine
    load only adds time, in bursts that can cover half a window; the lower quartile follows the
    candidate's own speed where the median follows the bursts.

    Raises:
        ValueError: no values.
    """
    if not values:
        raise ValueError("lower_quartile of no values")
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4]


def choose_candidate(names: Sequence[str], windows_s: Sequence[Sequence[float]], floor_s: Optional[float] = None,
                     *, min_tolerance: float = 0.02, max_tolerance: float = 0.10,
                     prefer: Sequence[str] = PREFERRED,
                     prefer_margin: float = 0.10) -> tuple[int, list[float], list[str]]:
    """Pick the fastest candidate from interleaved trial windows, robust to a noisy machine.

    Args:
        names: candidate names, in trial order (the planner's first).
        windows_s: per candidate, the step time of each of its measurement windows (s; the strategy gives
            each window's :func:`lower_quartile`).
        floor_s: physical lower bound of a dense step (s, see :meth:`Effects.comm_floor_s`); a candidate
            whose median is below ``0.9 * floor_s`` was mismeasured and is not chosen while another one
            was measured at or above it.
        min_tolerance, max_tolerance: the noise band, as a fraction of the fastest median: the spread
            between the windows of the two fastest candidates (max/min - 1), clamped to this range.
        prefer: names chosen first among candidates within the noise band of the fastest (then trial
            order): a tie is decided the same way on every rerun.
        prefer_margin: a preferred candidate (DDP's reducer: DDP's results and speed by construction) is
            also kept against any candidate not faster by more than this fraction, whatever the noise:
            a wrong switch away from it can cost more than the margin, as trial windows on a shared
            machine can mislead by more than their spread.
    Returns:
        ``(chosen index, median of each candidate's windows (s), notes)``: notes say which candidates
        were rejected below the floor and which were within noise of the fastest.

    Raises:
        ValueError: no candidate, or a candidate without a window.
    """
    if not names or len(names) != len(windows_s) or any(not w for w in windows_s):
        raise ValueError(f"every candidate needs at least one measured window, got {list(windows_s)!r} for {names!r}")
    medians = [statistics.median(w) for w in windows_s]
    notes: list[str] = []
    valid = list(range(len(names)))
    if floor_s is not None and floor_s > 0:
        low = [i for i in valid if medians[i] < 0.9 * floor_s]
        if low and len(low) < len(valid):
            valid = [i for i in valid if i not in low]
            notes.append("below the physical floor " + f"{floor_s * 1e3:.1f} ms, not chosen: "
                         + ", ".join(f"{names[i]} {medians[i] * 1e3:.1f} ms" for i in low))
    ranked = sorted(valid, key=medians.__getitem__)
    best = ranked[0]

    def spread(i: int) -> float:
        w = windows_s[i]
        return max(w) / min(w) - 1.0 if min(w) > 0 else 0.0

    noise = max(spread(i) for i in ranked[:2])
    tol = min(max_tolerance, max(min_tolerance, noise))
    held = [i for i in ranked if names[i] in prefer and medians[i] <= medians[best] * (1.0 + prefer_margin)]
    if held and held[0] != best:  # the preferred (DDP's reducer) is kept unless beaten by more than the margin
        chosen = min(held, key=lambda i: (list(prefer).index(names[i]), i))
        notes.append(f"{names[best]} {medians[best] * 1e3:.1f} ms is not faster than {names[chosen]} "
                     f"{medians[chosen] * 1e3:.1f} ms by more than {prefer_margin:.0%}: chose {names[chosen]}")
        return chosen, medians, notes
    tied = [i for i in ranked if medians[i] <= medians[best] * (1.0 + tol)]
    if len(tied) > 1:
        rank_of = {n: k for k, n in enumerate(prefer)}
        chosen = min(tied, key=lambda i: (rank_of.get(names[i], len(prefer)), i))
        why = "the fastest" if chosen == best else "by preference"
        notes.append(f"within noise ({tol:.0%}) of the fastest: " + ", ".join(
            f"{names[i]} {medians[i] * 1e3:.1f} ms" for i in tied) + f"; chose {names[chosen]} ({why})")
        best = chosen
    return best, medians, notes


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
    items += [f"{label} {startup[f'{k}_s']:.{digits}f} s" for k, label in Controller.PARTS if f"{k}_s" in startup]
    if "verify_steps" not in startup or startup.get("profile_steps") or startup.get("trial_steps"):
        items += [f"profile {steps_text(startup.get('profile_steps', 0))} {startup.get('profile_s', 0.0):.{digits}f} s"]
        items += [f"planning {startup['planning_s']:.{digits}f} s"] if "planning_s" in startup else []
        items += [f"trials {steps_text(startup.get('trial_steps', 0))} {startup.get('trial_s', 0.0):.{digits}f} s"]
    status = startup.get("plan_cache")
    return ", ".join(items) + (f"; plan cache {status}" if status and status != "off" else "")


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
        phase: the current :class:`Phase`.
        sync_steps: sync steps since TRACE began.
        trial: the :class:`Trial` in progress (TRIAL only).
        trial_results: one dict per measured candidate of the last *finished* selection (name, describe,
            predicted_s, measured_s (median of all its windows, s), deciding_s (the median the choice was made
            on, s: of the confirmation windows for the two candidates a confirmation compared, else of all
            windows), decided_in (``"first pass"`` or ``"confirmation"``), chosen, windows_s, steps_s, plus
            ``predictions[name]``); kept across a re-plan
            until the next selection finishes (see :meth:`plan_selection` for one left unfinished).
        selections: ``trial_results`` of every finished selection of this fit, oldest first.
        selection_notes: why the last finished selection chose as it did, in words (:func:`choose_candidate`'s
            notes: a confirmation's numbers, DDP's reducer kept within its margin, ties within noise, candidates
            below the physical floor); kept with ``trial_results``.
        predicted_iteration_s, measured_iteration_s, no_overlap_time_s: of the installed plan (s).
        replans_done: re-plans triggered by drift.
        predictions: rank 0's predictions per candidate name (filled by the planner side).
        startup: time to steady state, filled when RUN is first reached: ``{"trace_s", "trace_steps",
            "profile_s", "profile_steps", "trial_s", "trial_steps", "total_s", "total_steps"}`` plus one
            ``"<part>_s"`` per part reported to :meth:`account` (``alpha_beta_s``, ``contention_s``,
            ``helper_start_s``), in s from the controller's creation at set-up. The phases exclude the
            parts, so ``total_s`` is the sum of the phases and parts; a phase holds everything else that
            ran while it was current (Lightning's own work between steps; in profile, planning with the
            compressor's cost measurement; in trials, the engine switches). After a plan cache hit,
            ``"verify_s"`` and ``"verify_steps"`` (the verification window) too, and the profile and trial
            entries are 0 unless the verification failed; ``"plan_cache"``: :attr:`plan_cache`.
            Empty before.
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
        self.effects = effects
        self.asked = asked  # the schedule the user named (for "asked: X -> running: Y")
        self.race_drop = race_drop
        self.startup_budget = startup_budget
        #: the fit's optimizer steps, when known (:meth:`set_total_steps`); the budget applies only then
        self.total_steps: Optional[int] = None
        self._selection_steps = 0  # steps since this selection (start-up or re-plan) began
        self._steps_done = 0  # optimizer steps reported so far (sync and final schedules)
        #: why the last selection stopped early (the start-up budget), in words; None when it did not
        self.budget_note: Optional[str] = None
        self._drift_strikes = 0  # consecutive drift checks over the margin
        self._t_installed = clock()  # when the schedule running now was installed (drift hold-off)
        self.run_noun = run_noun  # what the end-of-training messages call it: "fit" (Trainer), "run" (Fabric)
        self.prefer_margin = prefer_margin
        self.planned = planned
        self.warmup_steps, self.profile_steps, self.trial_steps = warmup_steps, profile_steps, trial_steps
        self.trial_rounds, self.trial_window_s = trial_rounds, trial_window_s
        self.window_steps = trial_steps  # measured steps per trial window (set when TRIAL starts)
        self.replan_every, self.replan_margin, self.max_replans = replan_every, replan_margin, max_replans
        self.clock = clock
        self.phase = Phase.TRACE
        self.sync_steps = 0
        self.trial: Optional[Trial] = None
        self.verify: Optional[Verify] = None
        self.plan_cache = "off"
        self.trial_results: list[dict[str, Any]] = []
        self.selections: list[list[dict[str, Any]]] = []
        self.selection_notes: list[str] = []
        #: how the schedule running now was reached: "trace" (nothing final yet), "fixed", "resumed",
        #: "single" (one candidate, installed directly), "trial" (measuring), "selected" (a finished selection),
        #: "budget" (a selection the start-up budget stopped), "no_room" (the budget left no room for trials),
        #: "unprofiled" (the fixed schedule: profiling could not profile a step, :attr:`unprofiled_note` says why),
        #: "cached" (from the plan cache: verifying, or verified)
        self.how = "trace"
        #: why the fixed schedule replaced a plan ("unprofiled"), in words; None otherwise
        self.unprofiled_note: Optional[str] = None
        self._profile_tries = 0  # steps of the current PROFILE phase
        self.predictions: dict[str, dict[str, float]] = {}
        self.predicted_iteration_s: Optional[float] = None
        self.measured_iteration_s: Optional[float] = None
        self.no_overlap_time_s: Optional[float] = None
        self.replans_done = 0
        self._planned_busy_s: Optional[float] = None
        self._starts: deque[float] = deque(maxlen=replan_every + 1)
        self._busy: deque[float] = deque(maxlen=replan_every)
        self._run_steps = 0
        #: the chosen candidate's measured trial step time (s), the drift reference after a trial
        self.trial_reference_s: Optional[float] = None
        self._replannable = True  # False for a candidate without a plan (DDP's reducer): no drift re-plan
        self.startup: dict[str, Any] = {}
        self._t_phase = clock()
        self._phase_steps = 0
        self._spent: dict[str, float] = {}

    #: start-up parts reported by :meth:`account`, in the order of the start-up line, with their label
    PARTS = (("helper_start", "compression helper start"), ("alpha_beta", "α-β model"),
             ("contention", "contention benchmark"))

    def account(self, parts: Optional[dict[str, float]]) -> None:
        """Count ``parts`` (``name -> seconds`` spent inside the current phase: ``helper_start``,
        ``alpha_beta``, ``contention``, ``planning``) as their own entries of :attr:`startup` instead of the phase's.
        Ignored after steady state is reached (a re-plan's α-β work is not start-up)."""
        if self.startup or not parts:
            return
        for name, seconds in parts.items():
            self._spent[f"{name}_s"] = self._spent.get(f"{name}_s", 0.0) + seconds
            self._t_phase += seconds  # the phase's clock skips the part

    def set_total_steps(self, total: Optional[float]) -> None:
        """The fit's optimizer steps (Lightning's ``estimated_stepping_batches``); None or infinite: unknown."""
        self.total_steps = int(total) if total is not None and math.isfinite(total) and total > 0 else None

    @property
    def budget_steps(self) -> Optional[int]:
        """Steps one selection may take (``startup_budget`` x the fit's steps, at least 1), None without a budget."""
        if self.startup_budget is None or self.total_steps is None:
            return None
        return max(1, math.floor(self.startup_budget * self.total_steps))

    def _over_budget(self) -> bool:
        budget = self.budget_steps
        return budget is not None and self._selection_steps >= budget

    def _leave(self, new: Phase) -> None:
        """Account the time and steps of the phase being left (until RUN is first reached)."""
        if not self.startup:
            key = self.phase.value
            now = self.clock()
            self._spent[f"{key}_s"] = self._spent.get(f"{key}_s", 0.0) + now - self._t_phase
            self._spent[f"{key}_steps"] = self._spent.get(f"{key}_steps", 0) + self._phase_steps
            self._t_phase, self._phase_steps = now, 0
            if new is Phase.RUN:
                phases = ("trace", "verify", "profile", "trial") if "verify_s" in self._spent else \
                    ("trace", "profile", "trial")
                out: dict[str, Any] = {f"{k}_{u}": self._spent.get(f"{k}_{u}", 0) for k in phases for u in ("s", "steps")}
                out.update({f"{k}_s": self._spent[f"{k}_s"] for k in [k for k, _ in self.PARTS] + ["planning"]
                            if f"{k}_s" in self._spent})
                out["total_s"] = sum(v for k, v in out.items() if k.endswith("_s"))
                out["total_steps"] = sum(out[f"{k}_steps"] for k in phases)
                out["plan_cache"] = self.plan_cache
                self.startup = out
                self.effects.info(f"pipedap: steady state after {steps_text(out['total_steps'])}, "
                                  f"{out['total_s']:.2f} s since set-up: {describe_startup(out)}")
        if new is Phase.PROFILE:
            self._profile_tries = 0
        self.phase = new

    # ------------------------------------------------------------------ transitions
    def restart(self) -> None:
        """Back to TRACE (the trainable set changed): the next sync steps trace and plan again."""
        self._leave(Phase.TRACE)
        self.sync_steps, self.trial, self.verify, self.how = 0, None, None, "trace"
        self._selection_steps = 0

    def resumed(self, predicted_s: Optional[float], no_overlap_s: Optional[float],
                planned_busy_s: Optional[float]) -> None:
        """A checkpoint's final schedule was installed: straight to RUN."""
        self.predicted_iteration_s, self.no_overlap_time_s = predicted_s, no_overlap_s
        self._planned_busy_s = planned_busy_s
        self.how = "resumed"
        self._reset_drift()
        self._leave(Phase.RUN)

    def after_sync_step(self, t_step_end: float) -> None:
        """A sync step ended (TRACE or PROFILE): advance warm-up identically on every rank."""
        self.sync_steps += 1
        if not self.phase.deferrable:  # (a sync-mode TRIAL step is counted by at_step_start)
            self._phase_steps += 1
            self._selection_steps += 1
            self._steps_done += 1
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
            self._profile_tries += 1
            done = self.effects.take_profile_step(t_step_end) or 0
            if done >= self.profile_steps:
                self._finish_profiling()
            elif self._profile_tries - done >= max(UNPROFILED_STEPS, 2 * self.profile_steps):
                self._give_up_profiling(done)

    def at_step_start(self) -> None:
        """A step of a final schedule starts (TRIAL or RUN): time it; switch candidates or re-plan when due."""
        if self.phase.deferrable:  # (TRACE and PROFILE steps are counted by after_sync_step)
            self._steps_done += 1
        if self.phase is Phase.TRIAL:
            self._phase_steps += 1
            self._selection_steps += 1
            self._trial_step()
        elif self.phase is Phase.VERIFY:
            self._phase_steps += 1
            self._selection_steps += 1  # (a stale verdict's selection shares the start-up budget with it)
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
        """Windows of the cached plan, each timed as a trial window is (the lower quartile of ``window_steps``
        intervals, the first window after one settling step; rank 0's): the first one within ``replan_margin``
        of the recorded time (or faster) -> RUN; every one of ``verify.windows`` slower -> stale: profile and
        select again (and remember the new choice)."""
        v = self.verify
        assert v is not None
        v.starts.append(self.clock())
        settle = 1 if not v.measured_s else 0  # (the first interval after the install settles, not counted)
        if len(v.starts) < self.window_steps + 1 + settle:
            return
        gaps = [b - a for a, b in zip(v.starts[:-1], v.starts[1:])]
        measured = self.effects.agree(lower_quartile(gaps[settle:]))
        v.measured_s.append(measured)
        v.starts = [v.starts[-1]]
        drift = measured / v.reference_s - 1.0 if v.reference_s > 0 else float("inf")
        what = (f"{measured * 1e3:.1f} ms (lower quartile of {steps_text(self.window_steps)}) vs "
                f"{v.reference_s * 1e3:.1f} ms recorded in its trial")
        if drift <= self.replan_margin:
            self.verify = None
            self.effects.info(f"pipedap: cached plan verified: {what}")
            self._reset_drift()
            self.trial_reference_s = v.reference_s  # drift is checked against what its trial measured
            self._leave(Phase.RUN)
            return
        if len(v.measured_s) < v.windows:
            self.effects.info(f"pipedap: cached plan measured {what} ({drift:.0%} slower, more than replan_margin "
                              f"{self.replan_margin:.0%}); measuring another window")
            return
        self.verify = None
        self.effects.info(f"pipedap: cached plan measured {what} ({drift:.0%} slower, more than replan_margin "
                          f"{self.replan_margin:.0%}, in each of {len(v.measured_s)} windows: "
                          + ", ".join(f"{m * 1e3:.1f} ms" for m in v.measured_s) + "): stale, selecting again")
        self.plan_cache, self.how = "stale (re-selected)", "trace"
        self.effects.flush()
        self.account(self.effects.start_profiling())
        self._leave(Phase.PROFILE)

    def _window_steps(self, step_s: Optional[float]) -> int:
        """Measured steps of one trial (or verification) window: ``trial_steps``, more for short steps
        (``trial_window_s``), at most :data:`MAX_WINDOW_STEPS` (``step_s``: the no-overlap time, identical on every rank)."""
        longer = math.ceil(self.trial_window_s / step_s) if step_s and step_s > 0 and self.trial_window_s > 0 else 0
        return max(self.trial_steps, min(MAX_WINDOW_STEPS, longer))

    # ------------------------------------------------------------------ PROFILE -> TRIAL / RUN
    def _finish_profiling(self) -> None:
        t0 = self.clock()
        schedules, no_overlap = self.effects.plan()
        self.account({"planning": self.clock() - t0})  # the planners' search and the plan broadcast
        # (trial_results keep the last finished selection: a re-plan that the fit does not finish must not
        # erase what was measured and chosen before it)
        self.budget_note = None
        n = len(schedules)
        budget = self.budget_steps
        left = None if budget is None else budget - self._selection_steps
        if n > 1 and left is not None and left < n * (MIN_BUDGET_WINDOW + 1):
            self.budget_note = (f"the start-up budget ({steps_text(budget)}, startup_budget={self.startup_budget:g} of "
                                f"{self.total_steps} steps) left no room for trial windows: the planner's schedule "
                                "was installed without measuring")
            self.effects.info(f"pipedap: {self.budget_note}")
            schedules, no_overlap = schedules[:1], no_overlap[:1]
        if len(schedules) > 1:
            rounds = self.trial_rounds
            self.window_steps = self._window_steps(no_overlap[0])
            fits = ""
            if left is not None and n * rounds * (self.window_steps + 1) > left:  # (shorter windows fit the budget)
                self.window_steps = max(MIN_BUDGET_WINDOW, min(self.window_steps, left // (n * rounds) - 1))
                fits = f", shortened to fit the start-up budget of {steps_text(budget)}"
            self.how = "trial"
            self.effects.info(f"pipedap: measuring {n} candidate schedules for {self.window_steps} "
                              f"measured steps each (after one settling step per window{fits})"
                              f"{self._rounds_text(rounds)}: "
                              f"{', '.join(s.name for s in schedules)}")
            self.trial = Trial(list(schedules), list(no_overlap), order=list(range(n)), gaps_s=[[] for _ in range(n)],
                               alive=list(range(n)))
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
        tries = self._profile_tries
        what = f"re-plan {self.replans_done}" if self.replans_done else "the plan"
        self.unprofiled_note = (
            f"pipedap: {tries} steps of the profiling schedule for {what} and only {done} of the {self.profile_steps} "
            "profiled steps needed: a profiled step is a training step whose forward and a backward pass with "
            "gradient sync are both observed (none here: no backward inside the step, or only under "
            f"no_sync/accumulation); installing the fixed schedule {FALLBACK_SCHEDULE!r} instead of a plan "
            "(no candidate planned or measured)")
        self.effects.info(self.unprofiled_note)
        self.effects.install_fixed(FALLBACK_SCHEDULE)
        self.how = "unprofiled"
        self._leave(Phase.RUN)

    def _enter(self, schedule: Any, no_overlap_s: float) -> None:
        self.trial_reference_s = None
        self._t_installed = self.clock()
        self._replannable = getattr(schedule, "replannable", True)
        self._planned_busy_s = self.effects.install_run(schedule)
        self.predicted_iteration_s = schedule.predicted_iteration_s
        self.no_overlap_time_s = no_overlap_s
        self._reset_drift()

    def _reset_drift(self) -> None:
        self._starts.clear()
        self._busy.clear()
        self._run_steps = 0
        self._drift_strikes = 0

    # ------------------------------------------------------------------ TRIAL
    def _trial_step(self) -> None:
        """The choice is rank 0's (its iteration time is the group's: the ranks are coupled by collectives). Every
        rank counts the same steps, so the start-up budget stops the selection at the same step everywhere."""
        tr = self.trial
        assert tr is not None
        tr.starts.append(self.clock())
        over = self._over_budget()
        if len(tr.starts) < self.window_steps + 2 and not over:  # the first interval after a switch settles
            return
        if len(tr.starts) >= 3:  # (a window cut by the budget counts if it measured a step after settling)
            tr.gaps_s[tr.order[tr.window]].append([b - a for a, b in zip(tr.starts[:-1], tr.starts[1:])])
        self.effects.flush()  # the previous step's updates, before the engine changes
        tr.window += 1
        if not over and (tr.window < len(tr.order) or (tr.confirm is None and self._race(tr))):
            self._next_window(tr)
            return
        windows = [[lower_quartile(g[1:]) for g in per] for per in tr.gaps_s]
        windows, floor = self.effects.agree((windows, self.effects.comm_floor_s()))
        names = [s.name for s in tr.schedules]
        installed = tr.order[tr.window - 1]
        if over:
            measured_k = sum(1 for w in windows if w)
            self.budget_note = (f"the start-up budget ({steps_text(self.budget_steps)}, startup_budget="
                                f"{self.startup_budget:g} of {self.total_steps} steps) ran out after {tr.window} of "
                                f"{self._planned_windows(tr)} windows ({measured_k} of {len(names)} candidates measured): the fastest "
                                "measured so far is installed")
            self.effects.info(f"pipedap: {self.budget_note}")
        if over and (tr.confirm is not None or sum(1 for w in windows if w) < len(names)):
            best, measured, deciding, notes = self._choose_measured(tr, names, windows, floor, installed)
            decided_in = ["start-up budget"] * len(names)
        elif tr.confirm is None:
            best, measured, notes = self._choose_alive(tr, names, windows, floor)
            if self._confirm(tr, names, best, measured):
                self._next_window(tr)
                return
            deciding, decided_in = list(measured), ["first pass"] * len(names)
        else:
            best, measured, deciding, notes = self._confirmed(tr, names, windows, floor)
            decided_in = ["confirmation" if i in tr.confirm[:2] else "first pass" for i in range(len(names))]
        notes = tr.dropped + notes
        self.trial = None
        self.trial_results = [
            {"name": s.name, "describe": s.describe(), "predicted_s": s.predicted_iteration_s,
             "measured_s": m if math.isfinite(m) else None,
             "deciding_s": deciding[i] if math.isfinite(deciding[i]) else None, "decided_in": decided_in[i],
             "chosen": i == best, "windows_s": windows[i], "steps_s": tr.gaps_s[i],
             **self.predictions.get(s.name, {})}
            for i, (s, m) in enumerate(zip(tr.schedules, measured))
        ]
        self.selections.append(self.trial_results)
        self.selection_notes = list(notes)
        self.how = "budget" if over else "selected"
        confirmed = tr.confirm is not None
        self.effects.info("pipedap: measured candidates (lower-quartile step of each window; the median the choice "
                          "was made on" + (", confirmation rounds for the two confirmed" if confirmed else "")
                          + "): " + "; ".join(
            f"{r['name']} " + ("not measured " if r["deciding_s"] is None else f"{r['deciding_s'] * 1e3:.1f} ms ")
            + (f"[{r['decided_in']}, all windows {r['measured_s'] * 1e3:.1f} ms] "
               if confirmed and r["measured_s"] is not None else "")
            + (f"(predicted {r['predicted_s'] * 1e3:.1f} ms)" if r["predicted_s"] is not None else "(no prediction)")
            + (" <- chosen" if r["chosen"] else "") for r in self.trial_results))
        for note in notes[len(tr.dropped):]:  # (the racing notes were logged when they happened)
            self.effects.info(f"pipedap: {note}")
        first, chosen = self.trial_results[0], self.trial_results[best]
        gain = " (the planner's own plan)" if best == 0 else ""
        if best != 0 and first["deciding_s"] and chosen["deciding_s"]:
            ratio = first["deciding_s"] / chosen["deciding_s"] - 1
            gain = (f" (measured {ratio:.0%} faster than {first['name']})" if ratio > 0 else
                    f" ({first['name']} measured {-ratio:.0%} faster, within the noise or the margin that keeps "
                    f"{chosen['name']}: see the notes above)")
        self.effects.info(f"pipedap: asked: {self.asked or tr.schedules[0].name} -> running: "
                          f"{tr.schedules[best].name}{gain}")
        if best != installed:  # the last window's candidate is the one installed now
            self._enter(tr.schedules[best], tr.no_overlap_s[best])
        else:
            self.effects.info(f"pipedap: keeping the installed candidate {tr.schedules[best].name}")
            self._reset_drift()
        self.trial_reference_s = measured[best]  # drift is checked against what the trial measured
        self.effects.store_plan(self.trial_results, tr.no_overlap_s[best], measured[best])
        self._leave(Phase.RUN)

    def _rounds_text(self, rounds: int) -> str:
        if rounds < 2:
            return ""
        if self.race_drop is None:
            return f" in {rounds} interleaved rounds"
        return (f" in up to {rounds} interleaved rounds, a candidate dropped once it is more than "
                f"{self.race_drop:.0%} slower than the fastest")

    def _planned_windows(self, tr: Trial) -> int:
        """Windows of the selection as planned now: those in ``order`` plus the rounds still to come of the
        candidates left in the race (before a confirmation adds any)."""
        if tr.confirm is not None:
            return len(tr.order)
        return len(tr.order) + max(0, self.trial_rounds - tr.rounds_done - 1) * len(tr.alive)

    def _race(self, tr: Trial) -> bool:
        """After a round of windows: drop the candidates slower than the fastest by more than :data:`RACE_DROP`
        (medians of their windows so far, rank 0's), and append another round of those left while fewer than
        ``trial_rounds`` rounds ran and two or more are left (in trial order).
        Returns whether a round was appended."""
        tr.rounds_done += 1
        if tr.rounds_done >= self.trial_rounds or len(tr.alive) < 2:
            return False
        out: list[int] = []
        if self.race_drop is not None:
            windows = self.effects.agree([[lower_quartile(g[1:]) for g in per] for per in tr.gaps_s])
            med = {i: statistics.median(windows[i]) for i in tr.alive if windows[i]}
            lead = min(med, key=med.__getitem__) if med else None
            if lead is not None:  # (never DDP's reducer: only torch_ddp_margin and a confirmation displace it)
                out = [i for i in tr.alive if i in med and med[i] > med[lead] * (1.0 + self.race_drop)
                       and tr.schedules[i].name not in PREFERRED]
        if out:
            assert lead is not None and self.race_drop is not None
            note = (f"racing, after round {tr.rounds_done}: dropped " + ", ".join(
                f"{tr.schedules[i].name} {med[i] * 1e3:.1f} ms" for i in out)
                + f" (more than {self.race_drop:.0%} slower than {tr.schedules[lead].name} {med[lead] * 1e3:.1f} ms)")
            tr.dropped.append(note)
            self.effects.info(f"pipedap: {note}")
        tr.alive = [i for i in tr.alive if i not in out]
        if len(tr.alive) < 2:
            return False
        tr.order += list(tr.alive)  # (trial order again: a rerun interleaves alike)
        return True

    def _choose_measured(self, tr: Trial, names: list[str], windows: list[list[float]], floor: Optional[float],
                         installed: int) -> tuple[int, list[float], list[float], list[str]]:
        """The choice when the start-up budget stops a selection: among the candidates measured so far (with
        :func:`choose_candidate`); a confirmation cut short keeps the preferred candidate (DDP's reducer), the
        first pass's winner not having beaten it twice; nothing measured keeps the installed one. Returns
        ``(chosen, median per candidate (s; inf when unmeasured), deciding (s), notes)``."""
        measured = [statistics.median(w) if w else math.inf for w in windows]
        if tr.confirm is not None:
            winner, pref, first = tr.confirm
            if not windows[winner][first:] or not windows[pref][first:]:
                return pref, measured, list(measured), [f"confirmation cut by the start-up budget: kept {names[pref]}"]
            best, _, deciding, notes = self._confirmed(tr, names, windows, floor)
            return best, measured, deciding, notes
        if not any(windows):
            return installed, measured, list(measured), [f"nothing measured: kept {names[installed]}"]
        best, measured, notes = self._choose_alive(tr, names, windows, floor)
        return best, measured, list(measured), notes

    def _choose_alive(self, tr: Trial, names: list[str], windows: list[list[float]],
                      floor: Optional[float]) -> tuple[int, list[float], list[str]]:
        """:func:`choose_candidate` among the measured candidates racing did not drop (a dropped one was clearly
        slower; its one window must not win through the floor or a tie rule). Returns ``(chosen, median of every
        candidate's windows (s; inf when unmeasured), notes)``."""
        idx = [i for i in tr.alive if windows[i]] or [i for i, w in enumerate(windows) if w]
        k, _, notes = choose_candidate([names[i] for i in idx], [windows[i] for i in idx], floor,
                                       prefer_margin=self.prefer_margin)
        return idx[k], [statistics.median(w) if w else math.inf for w in windows], notes

    def _confirm(self, tr: Trial, names: list[str], best: int, measured: list[float]) -> bool:
        """When the first pass's winner displaces a preferred candidate (DDP's reducer), measure the two again
        in ``trial_rounds`` more interleaved rounds; :meth:`_confirmed` then decides between them on those
        windows alone, so the winner must win twice: a load burst on a shared machine can favour one
        candidate's windows for a whole pass, and a wrong switch away from DDP's reducer costs more than it
        could gain. Returns whether confirmation windows were added."""
        pref = [i for i, n in enumerate(names) if n in PREFERRED]
        if not pref or best in pref or pref[0] not in tr.alive:  # (racing dropped it: > race_drop slower already)
            return False
        tr.confirm = (best, pref[0], self.trial_rounds)
        pair = [pref[0], best] if tr.order[-1] == pref[0] else [best, pref[0]]  # (the installed one first)
        tr.order += pair * self.trial_rounds
        self.effects.info(f"pipedap: {names[best]} measured {measured[best] * 1e3:.1f} ms against "
                          f"{names[pref[0]]} {measured[pref[0]] * 1e3:.1f} ms; confirming in {self.trial_rounds} more "
                          "interleaved round(s) of the two")
        return True

    def _confirmed(self, tr: Trial, names: list[str], windows: list[list[float]],
                   floor: Optional[float]) -> tuple[int, list[float], list[float], list[str]]:
        """The choice after confirmation windows: between the first pass's winner and the preferred candidate,
        from the confirmation windows only. Returns ``(chosen, median of all windows (s), deciding (s), notes)``:
        ``deciding`` is the median of the confirmation windows for the two, of the first pass (their only
        windows) for the others: the numbers the choice was made on."""
        assert tr.confirm is not None
        winner, pref, first = tr.confirm
        pair = [winner, pref]
        k, again, notes = choose_candidate([names[i] for i in pair], [windows[i][first:] for i in pair], floor,
                                           prefer_margin=self.prefer_margin)
        notes.insert(0, f"confirmation: {names[winner]} {again[0] * 1e3:.1f} ms, {names[pref]} "
                        f"{again[1] * 1e3:.1f} ms; chose {names[pair[k]]}")
        measured = [statistics.median(w) for w in windows]
        deciding = list(measured)
        deciding[winner], deciding[pref] = again
        return pair[k], measured, deciding, notes

    def _next_window(self, tr: Trial) -> None:
        nxt = tr.order[tr.window]
        if nxt != tr.order[tr.window - 1]:
            self._enter(tr.schedules[nxt], tr.no_overlap_s[nxt])
        tr.starts = [self.clock()]

    def unfinished_trial(self) -> Optional[str]:
        """A sentence for the end of a fit that stopped during measured plan selection (or while profiling for a
        plan), else None."""
        tr = self.trial
        if self.phase is Phase.PROFILE:
            chosen = next((r["name"] for r in self.selections[-1] if r["chosen"]), "?") if self.selections else None
            what = f"re-plan {self.replans_done}" if self.replans_done else "the plan"
            return (f"pipedap: the {self.run_noun} ended while profiling for {what}: no candidate was planned or "
                    "measured, and the profiling schedule (sync mode) ran last"
                    + (f" (the finished selection before it chose {chosen}, its results are kept)" if chosen else "")
                    + "; train longer")
        if self.phase is not Phase.TRIAL or tr is None:
            return None
        cur = tr.schedules[tr.order[min(tr.window, len(tr.order) - 1)]]
        kept = ""
        if self.selections:
            chosen = next((r["name"] for r in self.selections[-1] if r["chosen"]), "?")
            kept = (f" (this was the selection after re-plan {self.replans_done}; the finished selection before it "
                    f"chose {chosen}, its results are kept)")
        return (f"pipedap: the {self.run_noun} ended during measured plan selection ({tr.window} of "
                f"{self._planned_windows(tr)} windows measured, {self.window_steps} measured steps each after one settling step): no candidate was "
                f"chosen, and the one being measured, {cur.name}, ran last{kept}; train longer, or set "
                "plan_trials=1 (the plan directly) or fewer trial_rounds / a smaller trial_window_s")

    def partial_trial_results(self) -> list[dict[str, Any]]:
        """The measurements of the selection in progress (TRIAL only, else []): one dict per candidate with
        ``name``, ``predicted_s``, ``windows_s`` (the lower-quartile step of each of its windows measured so far,
        this rank's clock) and ``measured_s`` (their median, None before its first window ended)."""
        tr = self.trial
        if self.phase is not Phase.TRIAL or tr is None:
            return []
        out = []
        for s, per in zip(tr.schedules, tr.gaps_s):
            windows = [lower_quartile(g[1:]) for g in per if len(g) > 1]
            out.append({"name": s.name, "predicted_s": s.predicted_iteration_s, "windows_s": windows,
                        "measured_s": statistics.median(windows) if windows else None, "chosen": False})
        return out

    def plan_selection(self) -> dict[str, Any]:
        """Where measured plan selection stands (at the end of a fit: whether it finished), as plain data.

        Returns:
            ``{"status", "text", "selections_finished", "measured", "candidates", "partial"}``: ``status`` is
            ``"finished"`` (the schedule running was chosen by a finished selection), ``"unfinished"`` (the
            fit is, or ended, in the middle of planning or measuring candidates: no candidate was chosen for
            the schedule running now), or ``"not run"`` (a fixed schedule, a single candidate, a checkpoint's
            plan); ``text`` says so in words, e.g. ``"unfinished (3 of 5 candidates measured, after re-plan
            1)"``; ``measured`` / ``candidates`` count the selection in progress or the last finished one
            (None when there is none); ``partial`` is :meth:`partial_trial_results`.
        """
        after = f", after re-plan {self.replans_done}" if self.replans_done else ""
        out: dict[str, Any] = {"selections_finished": len(self.selections), "measured": None, "candidates": None,
                               "partial": self.partial_trial_results()}
        if self.phase is Phase.TRIAL and self.trial is not None:
            tr = self.trial
            n = len(tr.schedules)
            k = sum(1 for per in tr.gaps_s if per)
            out.update(status="unfinished", measured=k, candidates=n,
                       text=f"unfinished ({k} of {n} candidates measured, {tr.window} of {self._planned_windows(tr)} "
                            f"windows{after})")
        elif self.planned and self.phase in (Phase.TRACE, Phase.PROFILE):
            where = "tracing" if self.phase is Phase.TRACE else "profiling"
            out.update(status="unfinished", text=f"unfinished (the {self.run_noun} ended while {where}, before "
                                                 f"candidates were planned{after})")
        elif self.how == "selected":
            n = len(self.trial_results)
            out.update(status="finished", measured=n, candidates=n,
                       text=f"finished ({n} of {n} candidates measured{after})")
        elif self.how == "budget":
            n = len(self.trial_results)
            k = sum(1 for r in self.trial_results if r["measured_s"] is not None)
            out.update(status="finished", measured=k, candidates=n,
                       text=f"finished at the start-up budget ({k} of {n} candidates measured{after}; the fastest "
                            "measured was installed)")
        else:
            why = {"fixed": "a fixed schedule", "resumed": "the plan came from the checkpoint",
                   "single": "one candidate, installed directly",
                   "no_room": "the start-up budget left no room for trials",
                   "unprofiled": f"the fixed schedule {FALLBACK_SCHEDULE!r}: no step could be profiled",
                   "cached": "the plan came from the plan cache"}.get(self.how, "no plan yet")
            out.update(status="not run", text=f"not run ({why}{after})")
        return out

    # ------------------------------------------------------------------ RUN: drift
    def _drift_step(self) -> None:
        self._starts.append(self.clock())  # bounded: the last replan_every + 1 starts
        busy = self.effects.last_busy_s()
        if busy is not None:
            self._busy.append(busy)
        self._run_steps += 1
        n = self._run_steps
        ref = self.trial_reference_s or self.predicted_iteration_s
        check = (ref is not None and self._replannable and n > self.replan_every and not (n - 1) % self.replan_every
                 and self.replans_done < self.max_replans)
        if not check and (n < 6 or (n - 1) % 5):
            return
        starts = list(self._starts)
        gaps = [b - a for a, b in zip(starts[:-1], starts[1:])]
        self.measured_iteration_s = statistics.median(gaps)  # median of the last window, refreshed every 5 steps
        if not check:
            return
        assert ref is not None
        # the run's own speed (lower quartile: load bursts only add time) against what was measured in the
        # trial (the same statistic) or, without trials, the plan's prediction
        measured = lower_quartile(gaps)
        ratio = statistics.median(self._busy) / self._planned_busy_s if self._busy and self._planned_busy_s else 1.0
        # only a slower run re-plans: a faster one than predicted is not a reason to change the schedule; and only a
        # sustained slowdown (DRIFT_CONFIRMATIONS checks in a row), not within DRIFT_HOLDOFF_S of the install (rank
        # 0's clock), and only while the rest of the fit is long enough to pay for another selection
        held = self.clock() - self._t_installed < DRIFT_HOLDOFF_S
        drift, ratio, held = self.effects.agree((measured / ref - 1.0, ratio, held))
        if drift <= self.replan_margin or held:
            self._drift_strikes = 0
            return
        self._drift_strikes += 1
        if self._drift_strikes < DRIFT_CONFIRMATIONS:
            return
        used = self.startup.get("total_steps") if self.startup else None
        if self.total_steps is not None and used and self.total_steps - self._steps_done < 4 * used:
            self._drift_strikes = 0
            self.effects.info(f"pipedap: measured iteration {measured * 1e3:.1f} ms, {drift:.0%} slower than the "
                              f"reference, but {self.total_steps - self._steps_done} steps are left, fewer than 4x "
                              f"the {steps_text(used)} a selection took: not re-planning")
            self.max_replans = self.replans_done  # (the rest of the fit only gets shorter)
            return
        if ratio > 1.05 and self.effects.rescale_cost_model(ratio):
            # communication is slower during training than in the idle micro-benchmark (compute, gloo
            # threads and the ring's additions share the cores): calibrate α-β before re-planning
            self.effects.info(f"pipedap: communication busy {ratio:.2f}x the α-β prediction; scaling α and β")
        what = "in its trial" if self.trial_reference_s else "predicted"
        self.effects.info(f"pipedap: measured iteration {measured * 1e3:.1f} ms (lower quartile) vs "
                          f"{ref * 1e3:.1f} ms {what} ({drift:.0%} slower, more than the margin "
                          f"{self.replan_margin:.0%}): re-planning")
        self.replans_done += 1
        self._selection_steps = 0
        self.effects.flush()
        self.account(self.effects.start_profiling())
        self._leave(Phase.PROFILE)

