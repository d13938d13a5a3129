"""The run-time state machine (``lightning_pipedap.strategy.controller``) with a fake engine and clock.

Every transition of the diagram in the module docstring, in process and in milliseconds: no
Lightning, no processes, no torch.
"""

from dataclasses import dataclass

import pytest

from lightning_pipedap.strategy.controller import (DRIFT_CONFIRMATIONS, DRIFT_HOLDOFF_S, Controller, Phase,
                                                   choose_candidate, describe_startup, lower_quartile)


@dataclass
class Sched:
    name: str
    predicted_iteration_s: float

    def describe(self) -> str:
        return f"<{self.name}>"


class FakeEffects:
    """Records what the controller asks for; ``agree`` returns the value as rank 0 would."""

    def __init__(self, candidates=None, profiled=(1, 2, 3), busy=None, rescale_ok=True, floor=None,
                 profiling_parts=None, clock=None, plan_s=0.0):
        self.calls: list = []
        self.plan_s = plan_s
        self.profiling_parts, self.clock = profiling_parts, clock
        self.floor = floor
        self.candidates = candidates or [Sched("plan", 1.0)]
        self._profiled = iter(profiled)
        self.busy = busy
        self.rescale_ok = rescale_ok
        self.cache = ("off", None)
        self.stored: list = []

    def adopt_trace(self):
        self.calls.append("adopt_trace")

    def install_fixed(self, name=None):
        self.calls.append("install_fixed" if name is None else ("install_fixed", name))

    def start_profiling(self):
        self.calls.append("start_profiling")
        if self.profiling_parts and self.clock is not None:  # the α-β fit and contention take clock time
            self.clock.t += sum(self.profiling_parts.values())
        return self.profiling_parts

    def take_profile_step(self, t):
        return next(self._profiled)

    def plan(self):
        self.calls.append("plan")
        if self.clock is not None:  # the planners' search takes clock time
            self.clock.t += self.plan_s
        return list(self.candidates), [2.0 + i for i in range(len(self.candidates))]

    def install_run(self, schedule):
        self.calls.append(("install_run", schedule.name))
        return 0.5

    def flush(self):
        self.calls.append("flush")

    def agree(self, value):
        self.calls.append(("agree", value))
        return value

    def last_busy_s(self):
        return self.busy

    def comm_floor_s(self):
        return self.floor

    def rescale_cost_model(self, ratio):
        self.calls.append(("rescale", round(ratio, 3)))
        return self.rescale_ok

    def info(self, message):
        self.calls.append(("info", message))

    def cached_plan(self):  # (the plan cache: off unless a test gives an entry; not recorded in calls)
        return self.cache

    def store_plan(self, results, no_overlap_s, measured_s):
        self.stored.append(([r["name"] for r in results if r["chosen"]], no_overlap_s, measured_s))


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _ctl(effects, clock=None, **kw):
    kw.setdefault("planned", True)
    return Controller(effects, clock=clock or Clock(), **kw)


def _start_trial(ctl):
    """The trace and profiling steps end (at the clock's time), then the first trial step starts at once."""
    ctl.after_sync_step(0.0)
    ctl.after_sync_step(0.0)
    assert ctl.phase is Phase.TRIAL
    ctl.at_step_start()


def _names(calls):
    return [c for c in calls if not (isinstance(c, tuple) and c[0] == "info")]


def test_fixed_schedule_goes_from_trace_to_run_after_the_warmup_steps():
    fx = FakeEffects()
    ctl = _ctl(fx, planned=False, warmup_steps=2)
    assert ctl.phase is Phase.TRACE and not ctl.phase.deferrable
    ctl.after_sync_step(0.0)
    assert ctl.phase is Phase.TRACE and fx.calls == []
    ctl.after_sync_step(0.0)
    assert ctl.phase is Phase.RUN and ctl.phase.deferrable
    assert _names(fx.calls) == ["adopt_trace", "install_fixed"]
    assert ctl.startup["trace_steps"] == 2 and ctl.startup["total_steps"] == 2


def test_planned_schedule_profiles_then_runs_the_single_candidate():
    fx = FakeEffects(profiled=(None, 1, 2))  # the first profiling step was not profiled (no recorder)
    ctl = _ctl(fx, profile_steps=2)
    ctl.after_sync_step(0.0)
    assert ctl.phase is Phase.PROFILE and fx.calls == ["adopt_trace", "start_profiling"]
    ctl.after_sync_step(0.0)
    ctl.after_sync_step(0.0)
    assert ctl.phase is Phase.PROFILE  # 1 of 2 profiled
    ctl.after_sync_step(0.0)
    assert ctl.phase is Phase.RUN
    assert _names(fx.calls)[-2:] == ["plan", ("install_run", "plan")]
    assert (ctl.predicted_iteration_s, ctl.no_overlap_time_s) == (1.0, 2.0)


def test_profiling_that_never_profiles_a_step_installs_the_fixed_schedule_and_says_why():
    """A training loop whose steps cannot be profiled (no backward observed inside a step) must not run the
    profiling schedule for the rest of the fit: after max(8, 2 * profile_steps) unprofiled steps the fixed
    'dear' schedule is installed, final, with a log line."""
    fx = FakeEffects(profiled=[None, 0, 1] + [1] * 20)  # one step profiled, then none
    ctl = _ctl(fx, profile_steps=2)
    ctl.after_sync_step(0.0)  # trace -> profile
    for _ in range(8):
        assert ctl.phase is Phase.PROFILE
        ctl.after_sync_step(0.0)
    assert ctl.phase is Phase.PROFILE  # 8 profiling steps, 1 profiled: 7 unprofiled
    ctl.after_sync_step(0.0)  # the 8th unprofiled one
    assert ctl.phase is Phase.RUN and ctl.how == "unprofiled" and ctl.phase.deferrable
    assert _names(fx.calls)[-1] == ("install_fixed", "dear") and "plan" not in fx.calls
    note = [c[1] for c in fx.calls if isinstance(c, tuple) and c[0] == "info" and "profiling schedule" in c[1]]
    assert note and "9 steps of the profiling schedule" in note[0] and "only 1 of the 2" in note[0]
    assert ctl.unprofiled_note == note[0] and ctl.unfinished_trial() is None
    sel = ctl.plan_selection()
    assert sel["status"] == "not run" and "no step could be profiled" in sel["text"]
    assert ctl.startup["profile_steps"] == 9


def test_trial_measures_every_candidate_and_keeps_the_fastest():
    clock = Clock()
    cands = [Sched("a", 1.0), Sched("b", 0.9), Sched("c", 0.8)]
    fx = FakeEffects(candidates=cands, profiled=(1,))
    ctl = _ctl(fx, clock, profile_steps=1, trial_steps=2)
    _start_trial(ctl)
    assert ctl.phase is Phase.TRIAL and ("install_run", "a") in fx.calls
    step_s = {"a": 0.30, "b": 0.10, "c": 0.20}
    for name in ("a", "b", "c"):
        for k in range(3):  # the settling interval, then trial_steps measured ones (the last one switches)
            clock.t += step_s[name] if k else 5.0  # the settling interval is long and must not count
            ctl.at_step_start()
    assert ctl.phase is Phase.RUN and ctl.trial is None
    installs = [c[1] for c in fx.calls if isinstance(c, tuple) and c[0] == "install_run"]
    assert installs == ["a", "b", "c", "b"]  # b measured fastest, installed again at the end
    assert [round(r["measured_s"], 6) for r in ctl.trial_results] == [0.3, 0.1, 0.2]
    assert [r["chosen"] for r in ctl.trial_results] == [False, True, False]
    assert ctl.predicted_iteration_s == 0.9 and ctl.no_overlap_time_s == 3.0
    assert fx.calls.count("flush") == 3  # before every engine change
    # time to steady state: 1 trace + 1 profile step at t = 0, then 3 windows of 5 s + 2 measured steps (the
    # first window's first step start, at t = 0, is the 10th trial step)
    startup = dict(ctl.startup)
    assert startup.pop("plan_cache") == "off"
    assert startup == pytest.approx({"trace_s": 0.0, "trace_steps": 1, "profile_s": 0.0, "profile_steps": 1,
                                     "planning_s": 0.0, "trial_s": 16.2, "trial_steps": 10, "total_s": 16.2,
                                     "total_steps": 12})
    assert fx.stored == [(["b"], 3.0, pytest.approx(0.1))]  # the finished selection is offered to the plan cache
    assert any(isinstance(c, tuple) and c[0] == "info" and c[1].startswith("pipedap: steady state after 12 steps, "
                                                                          "16.20 s") for c in fx.calls)
    agreed = [c[1] for c in fx.calls if isinstance(c, tuple) and c[0] == "agree"]
    assert agreed == [([[pytest.approx(0.3)], [pytest.approx(0.1)], [pytest.approx(0.2)]], None)]


def _trial(fx, clock, step_s, rounds, trial_steps=2, race_drop=None):
    """Drive a whole trial: ``step_s[name]`` is a list of step intervals, one per round (no racing unless
    ``race_drop``: every candidate runs every round)."""
    ctl = _ctl(fx, clock, profile_steps=1, trial_steps=trial_steps, trial_rounds=rounds, race_drop=race_drop)
    _start_trial(ctl)
    for r in range(rounds):
        for name in [c.name for c in fx.candidates]:
            for k in range(trial_steps + 1):
                clock.t += step_s[name][r] if k else 5.0
                ctl.at_step_start()
    return ctl


def test_trial_rounds_interleave_candidates_and_pool_their_windows():
    clock = Clock()
    cands = [Sched("a", 1.0), Sched("b", 0.9)]
    fx = FakeEffects(candidates=cands, profiled=(1,))
    # a burst of load in b's first window: one round alone would choose a
    ctl = _trial(fx, clock, {"a": [0.20, 0.20], "b": [0.25, 0.10]}, rounds=2)
    installs = [c[1] for c in fx.calls if isinstance(c, tuple) and c[0] == "install_run"]
    assert installs == ["a", "b", "a", "b"]  # interleaved; b is installed last, so it stays
    assert [r["windows_s"] for r in ctl.trial_results] == [[pytest.approx(0.2)] * 2,
                                                           [pytest.approx(0.25), pytest.approx(0.1)]]
    # b's median 0.175 s beats a's 0.2 s by more than the noise band (clamped to 10 %)
    assert [r["chosen"] for r in ctl.trial_results] == [False, True]
    assert ctl.phase is Phase.RUN and fx.calls.count("flush") == 4


def test_a_fit_that_ends_mid_trial_says_so_and_sync_trial_steps_count_once():
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("a", 1.0), Sched("b", 0.9)], profiled=(1,))
    ctl = _ctl(fx, clock, profile_steps=1, trial_steps=2, trial_rounds=2)
    assert ctl.unfinished_trial() is None
    ctl.after_sync_step(0.0)
    ctl.after_sync_step(0.0)
    for _ in range(4):  # a's window: the first step's start, its settling step and 2 measured; then b is installed
        clock.t += 1.0
        ctl.at_step_start()
        ctl.after_sync_step(clock.t)  # (a sync-mode step also reports its end: not counted twice)
    note = ctl.unfinished_trial()
    assert note.startswith("pipedap: the fit ended during measured plan selection (1 of 4 windows measured, 2 measured "
                           "steps each after one settling step)")
    assert "b, ran last" in note
    for _ in range(3 * 3):
        clock.t += 1.0
        ctl.at_step_start()
        ctl.after_sync_step(clock.t)
    assert ctl.phase is Phase.RUN and ctl.unfinished_trial() is None
    assert ctl.startup["trial_steps"] == 13 and ctl.startup["total_steps"] == 15  # 4 + 3 + 3 + 3


def test_short_steps_get_longer_trial_windows():
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("a", 1.0), Sched("b", 0.9)], profiled=(1,))  # no-overlap time 2 s
    ctl = _ctl(fx, clock, profile_steps=1, trial_steps=2, trial_window_s=9.0)
    ctl.after_sync_step(0.0)
    ctl.after_sync_step(0.0)
    assert ctl.window_steps == 5  # ceil(9 s / 2 s) measured steps per window, more than trial_steps
    for _ in range(5 + 2):
        clock.t += 1.0
        ctl.at_step_start()
    assert ("install_run", "b") in fx.calls  # a's window ended after its settling step and 5 measured ones
    ctl = _ctl(FakeEffects(candidates=[Sched("a", 1.0), Sched("b", 0.9)], profiled=(1,)), clock, profile_steps=1,
               trial_steps=2, trial_window_s=1e6)
    ctl.after_sync_step(0.0)
    ctl.after_sync_step(0.0)
    assert ctl.window_steps == 50  # capped


def test_choose_candidate_decides_ties_by_preference_and_rejects_steps_below_the_floor():
    # DDP's reducer is kept unless another candidate is faster by more than 10 %
    best, med, notes = choose_candidate(["optimal", "torch_ddp"], [[0.100, 0.101], [0.105, 0.106]])
    assert best == 1 and med == [pytest.approx(0.1005), pytest.approx(0.1055)]
    assert "not faster than torch_ddp 105.5 ms by more than 10%" in notes[0]
    best, _, notes = choose_candidate(["optimal", "torch_ddp"], [[0.100, 0.101], [0.115, 0.116]])
    assert best == 0 and notes == []
    # among the others: within the noise band, the preferred (then trial order) wins
    best, _, notes = choose_candidate(["optimal", "dear"], [[0.100, 0.101], [0.101, 0.102]], prefer=("dear",),
                                      prefer_margin=0.0)
    assert best == 1 and "within noise (2%)" in notes[0] and "chose dear (by preference)" in notes[0]
    # outside the band (5 % slower, windows agree to 1 %): the fastest wins
    best, _, notes = choose_candidate(["optimal", "dear"], [[0.100, 0.101], [0.105, 0.106]], prefer=("dear",),
                                      prefer_margin=0.0)
    assert best == 0 and notes == []
    # a noisy fastest candidate widens the band (spread 8 %): a 6 % slower preferred one is a tie
    best, _, _ = choose_candidate(["optimal", "dear"], [[0.100, 0.108], [0.110, 0.110]], prefer=("dear",),
                                  prefer_margin=0.0)
    assert best == 1
    # below 0.9 x the communication floor: mismeasured, not chosen
    best, _, notes = choose_candidate(["dear", "wfbp"], [[0.50, 0.51], [0.60, 0.60]], floor_s=0.562)
    assert best == 1 and "below the physical floor 562.0 ms" in notes[0] and "dear 505.0 ms" in notes[0]
    # every candidate below the floor: the floor is not trusted, the fastest is chosen
    best, _, notes = choose_candidate(["dear", "wfbp"], [[0.40], [0.45]], floor_s=0.562)
    assert best == 0 and notes == []
    with pytest.raises(ValueError, match="at least one measured window"):
        choose_candidate(["a"], [[]])


def test_trial_floor_comes_from_the_effects_and_is_agreed():
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("a", 1.0), Sched("b", 0.9)], profiled=(1,), floor=0.3)
    ctl = _trial(fx, clock, {"a": [0.20], "b": [0.35]}, rounds=1)
    assert [r["chosen"] for r in ctl.trial_results] == [False, True]  # a's 0.2 s beats the 0.3 s floor
    assert any(isinstance(c, tuple) and c[0] == "info" and "below the physical floor" in c[1] for c in fx.calls)


def _run_phase(fx, clock, **kw):
    ctl = _ctl(fx, clock, profile_steps=1, **kw)
    ctl.after_sync_step(0.0)
    ctl.after_sync_step(0.0)
    assert ctl.phase is Phase.RUN
    return ctl


def test_drift_beyond_the_margin_rescales_and_replans_once():
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("plan", 1.0)], profiled=(1,), busy=0.8)  # busy 0.8 vs planned 0.5
    ctl = _run_phase(fx, clock, replan_every=4, replan_margin=0.15, max_replans=1)
    clock.t += DRIFT_HOLDOFF_S  # (none within the hold-off after the install)
    for _ in range(1 + 4 * DRIFT_CONFIRMATIONS):  # 3 checks in a row over the margin
        clock.t += 1.5  # 50% slower than predicted
        ctl.at_step_start()
    assert ctl.phase is Phase.PROFILE and ctl.replans_done == 1
    assert ("rescale", 1.6) in fx.calls
    assert _names(fx.calls)[-2:] == ["flush", "start_profiling"]
    assert ctl.measured_iteration_s == pytest.approx(1.5)


def test_no_replan_within_the_margin_or_past_max_replans():
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("plan", 1.0)], profiled=(1,))
    ctl = _run_phase(fx, clock, replan_every=4, replan_margin=0.15, max_replans=0)
    for _ in range(20):
        clock.t += 3.0
        ctl.at_step_start()
    assert ctl.phase is Phase.RUN and ctl.replans_done == 0
    fx2 = FakeEffects(candidates=[Sched("plan", 1.0)], profiled=(1,))
    ctl2 = _run_phase(fx2, clock, replan_every=4, replan_margin=0.15, max_replans=1)
    for _ in range(20):
        clock.t += 1.1  # 10% off: inside the margin
        ctl2.at_step_start()
    assert ctl2.phase is Phase.RUN and "start_profiling" not in fx2.calls[2:]
    assert ctl2.measured_iteration_s == pytest.approx(1.1)  # refreshed every 5 steps


def test_a_run_faster_than_predicted_never_replans():
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("plan", 1.0)], profiled=(1,))
    ctl = _run_phase(fx, clock, replan_every=4, replan_margin=0.15, max_replans=3)
    for _ in range(20):
        clock.t += 0.5  # 50% faster than predicted
        ctl.at_step_start()
    assert ctl.phase is Phase.RUN and ctl.replans_done == 0
    assert ctl.measured_iteration_s == pytest.approx(0.5)


def test_restart_returns_to_trace_and_resume_goes_straight_to_run():
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("plan", 1.0)], profiled=(1,))
    ctl = _run_phase(fx, clock)
    ctl.restart()
    assert ctl.phase is Phase.TRACE and ctl.sync_steps == 0
    ctl.after_sync_step(0.0)
    assert ctl.phase is Phase.PROFILE
    ctl2 = _ctl(FakeEffects())
    ctl2.resumed(0.7, 1.2, 0.3)
    assert ctl2.phase is Phase.RUN and (ctl2.predicted_iteration_s, ctl2.no_overlap_time_s) == (0.7, 1.2)


def test_trial_windows_are_summarised_by_their_lower_quartile():
    # a burst of load over half the window moves the median, not the lower quartile
    assert lower_quartile([3.0, 3.1, 3.2, 9.0, 9.5, 10.0, 3.0, 9.9]) == 3.0
    assert lower_quartile([5.0]) == 5.0 and lower_quartile([4.0, 1.0, 3.0, 2.0, 5.0]) == 2.0
    with pytest.raises(ValueError, match="no values"):
        lower_quartile([])


def test_after_a_trial_drift_is_checked_against_the_trial_measurement():
    clock = Clock()
    # the chosen b measured 0.1 s in its trial although predicted 0.9 s
    fx = FakeEffects(candidates=[Sched("a", 1.0), Sched("b", 0.9)], profiled=(1,))
    ctl = _trial(fx, clock, {"a": [0.30], "b": [0.10]}, rounds=1)
    ctl.replan_every, ctl.max_replans = 4, 1
    assert ctl.trial_reference_s == pytest.approx(0.1) and ctl.predicted_iteration_s == 0.9
    for _ in range(5):  # as fast as in the trial: no re-plan
        clock.t += 0.105
        ctl.at_step_start()
    assert ctl.phase is Phase.RUN and ctl.replans_done == 0
    ctl.drift.reset()
    clock.t += DRIFT_HOLDOFF_S
    for _ in range(1 + 4 * DRIFT_CONFIRMATIONS):  # 2x the trial, still far below the 0.9 s prediction: a re-plan
        clock.t += 0.2
        ctl.at_step_start()
    assert ctl.phase is Phase.PROFILE and ctl.replans_done == 1
    assert any(isinstance(c, tuple) and c[0] == "info" and "vs 100.0 ms in its trial" in c[1] for c in fx.calls)


def test_no_drift_replan_under_a_candidate_without_a_plan():
    @dataclass
    class Reducer:
        name: str = "torch_ddp"
        predicted_iteration_s: float = 0.5
        replannable: bool = False

        def describe(self) -> str:
            return "<reducer>"

    clock = Clock()
    fx = FakeEffects(candidates=[Sched("a", 1.0), Reducer()], profiled=(1,))
    ctl = _trial(fx, clock, {"a": [0.30], "torch_ddp": [0.10]}, rounds=1)
    ctl.replan_every, ctl.max_replans = 4, 1
    for _ in range(20):
        clock.t += 0.5  # 5x slower than in the trial
        ctl.at_step_start()
    assert ctl.phase is Phase.RUN and ctl.replans_done == 0


def _drive_windows(ctl, clock, per_window_s, trial_steps=2):
    """Run one trial window per entry of ``per_window_s``: the installed candidate's step interval."""
    for step_s in per_window_s:
        for k in range(trial_steps + 1):
            clock.t += step_s if k else 5.0
            ctl.at_step_start()


def _installs(fx):
    return [c[1] for c in fx.calls if isinstance(c, tuple) and c[0] == "install_run"]


def _b_against_ddp(rounds):
    """A controller in TRIAL with candidates b and torch_ddp (``trial_steps=2``, ``rounds`` rounds)."""
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("b", 0.9), Sched("torch_ddp", 1.0)], profiled=(1,))
    ctl = _ctl(fx, clock, profile_steps=1, trial_steps=2, trial_rounds=rounds, race_drop=None)
    _start_trial(ctl)
    return ctl, fx, clock


def test_a_winner_over_ddps_reducer_is_confirmed_in_more_rounds_and_a_burst_does_not_switch():
    # first pass (two rounds): torch_ddp's windows hit load bursts (0.30 s), b measured 0.20 s: b wins by 33 %
    ctl, fx, clock = _b_against_ddp(rounds=2)
    _drive_windows(ctl, clock, [0.20, 0.30, 0.20, 0.30])
    assert ctl.phase is Phase.TRIAL and ctl.trial.confirm == (0, 1, 2)  # not decided yet
    assert ctl.trial.order == [0, 1, 0, 1, 1, 0, 1, 0]  # torch_ddp is installed: it goes first, one switch less
    assert any(isinstance(c, tuple) and c[0] == "info" and "b measured 200.0 ms against torch_ddp 300.0 ms; "
               "confirming in 2 more interleaved round(s) of the two" in c[1] for c in fx.calls)
    # confirmation windows alone decide: both at 0.20 s -> DDP's reducer is kept (b not faster by > 10 %),
    # although over all windows torch_ddp's median (0.25 s) is still 25 % slower
    _drive_windows(ctl, clock, [0.20, 0.20, 0.20, 0.20])
    assert ctl.phase is Phase.RUN
    assert [len(r["windows_s"]) for r in ctl.trial_results] == [4, 4]
    assert [r["measured_s"] for r in ctl.trial_results] == [pytest.approx(0.2), pytest.approx(0.25)]
    assert [r["chosen"] for r in ctl.trial_results] == [False, True]
    assert any(isinstance(c, tuple) and c[0] == "info" and "confirmation: b 200.0 ms, torch_ddp 200.0 ms; chose "
               "torch_ddp" in c[1] for c in fx.calls)
    # b, ddp, b, ddp | (ddp), b, ddp, b, then torch_ddp again: the chosen one
    assert _installs(fx) == ["b", "torch_ddp", "b", "torch_ddp", "b", "torch_ddp", "b", "torch_ddp"]


def test_torch_ddp_margin_sets_how_much_faster_a_candidate_must_be_than_ddps_reducer():
    """b measured 7% faster than DDP's reducer in every window: the default margin (10%) keeps DDP's reducer
    without a confirmation; ``torch_ddp_margin=0.05`` lets b win the first pass, confirms it against DDP's
    reducer in 2 more rounds, and installs it."""
    ctl, fx, clock = _b_against_ddp(rounds=2)
    _drive_windows(ctl, clock, [0.186, 0.20, 0.186, 0.20])
    assert ctl.phase is Phase.RUN and [r["chosen"] for r in ctl.trial_results] == [False, True]
    assert _installs(fx)[-1] == "torch_ddp"
    ctl, fx, clock = _b_against_ddp(rounds=2)
    ctl.prefer_margin = 0.05
    _drive_windows(ctl, clock, [0.186, 0.20, 0.186, 0.20])
    assert ctl.phase is Phase.TRIAL and ctl.trial.confirm == (0, 1, 2)
    _drive_windows(ctl, clock, [0.20, 0.186, 0.20, 0.186])  # (torch_ddp installed: it goes first)
    assert ctl.phase is Phase.RUN and [r["chosen"] for r in ctl.trial_results] == [True, False]
    assert _installs(fx)[-1] == "b"


def test_trial_results_carry_the_numbers_the_choice_was_made_on():
    """After a confirmation the median of all windows can make the chosen candidate look slower (b 0.21 s,
    torch_ddp 0.24 s, torch_ddp chosen); ``deciding_s`` holds the confirmation medians that decided (b 0.22 s,
    torch_ddp 0.18 s) and, for a candidate out in the first pass, its first-pass median."""
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("a", 0.8), Sched("b", 0.9), Sched("torch_ddp", 1.0)], profiled=(1,))
    ctl = _ctl(fx, clock, profile_steps=1, trial_steps=2, trial_rounds=1)
    _start_trial(ctl)
    _drive_windows(ctl, clock, [0.40, 0.20, 0.30])  # first pass: b beats torch_ddp by 33 % -> confirmation
    assert ctl.trial.confirm == (1, 2, 1)
    _drive_windows(ctl, clock, [0.18, 0.22])  # (order: torch_ddp, b) torch_ddp faster: kept
    assert ctl.phase is Phase.RUN
    res = {r["name"]: r for r in ctl.trial_results}
    assert res["torch_ddp"]["chosen"] and not res["b"]["chosen"]
    assert res["b"]["measured_s"] == pytest.approx(0.21) and res["torch_ddp"]["measured_s"] == pytest.approx(0.24)
    assert res["b"]["deciding_s"] == pytest.approx(0.22) and res["torch_ddp"]["deciding_s"] == pytest.approx(0.18)
    assert res["a"]["deciding_s"] == pytest.approx(0.40) == res["a"]["measured_s"]
    assert [r["decided_in"] for r in ctl.trial_results] == ["first pass", "confirmation", "confirmation"]
    info = [c[1] for c in fx.calls if isinstance(c, tuple) and c[0] == "info" and "measured candidates" in c[1]]
    assert "torch_ddp 180.0 ms [confirmation, all windows 240.0 ms] (predicted 1000.0 ms) <- chosen" in info[0]


def test_without_confirmation_the_deciding_numbers_are_the_medians_of_all_windows():
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("b", 0.9), Sched("c", 1.0)], profiled=(1,))
    ctl = _trial(fx, clock, {"b": [0.20, 0.24], "c": [0.30, 0.36]}, rounds=2)
    assert [r["deciding_s"] for r in ctl.trial_results] == [pytest.approx(0.22), pytest.approx(0.33)]
    assert [r["deciding_s"] for r in ctl.trial_results] == [r["measured_s"] for r in ctl.trial_results]
    assert {r["decided_in"] for r in ctl.trial_results} == {"first pass"}


def test_a_confirmed_winner_over_ddps_reducer_is_kept():
    ctl, fx, clock = _b_against_ddp(rounds=1)
    _drive_windows(ctl, clock, [0.20, 0.30, 0.30, 0.20])  # (order: b, ddp | ddp, b)
    assert ctl.phase is Phase.RUN
    assert [r["measured_s"] for r in ctl.trial_results] == [pytest.approx(0.2), pytest.approx(0.3)]
    assert [r["chosen"] for r in ctl.trial_results] == [True, False]
    assert _installs(fx) == ["b", "torch_ddp", "b"]  # the last window ran b: kept as it is
    assert ctl.trial_reference_s == pytest.approx(0.2)


def test_no_confirmation_when_ddps_reducer_wins_or_is_not_a_candidate():
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("b", 0.9), Sched("torch_ddp", 1.0)], profiled=(1,))
    ctl = _trial(fx, clock, {"b": [0.30], "torch_ddp": [0.20]}, rounds=1)
    assert ctl.phase is Phase.RUN and [r["chosen"] for r in ctl.trial_results] == [False, True]
    fx = FakeEffects(candidates=[Sched("b", 0.9), Sched("c", 1.0)], profiled=(1,))
    ctl = _trial(fx, clock, {"b": [0.20], "c": [0.30]}, rounds=1)
    assert ctl.phase is Phase.RUN and [r["chosen"] for r in ctl.trial_results] == [True, False]


def test_the_short_first_step_after_profiling_is_the_first_windows_settling_step():
    """Regression from the profile replay (BENCHMARKS.md, "Why pipedap-optimal often does not run its own plan"):
    the first deferred step after the sync profiling steps starts with no communication pending, so it measured
    251 ms against 544 ms in steady state (vgg16, 2 ranks) and, as the first window's only other interval, made
    the planner's schedule look faster than the communication floor. It must be dropped like the first step of
    every later window."""
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("optimal", 0.5), Sched("dear", 0.6)], profiled=(1,), floor=0.5)
    ctl = _ctl(fx, clock, profile_steps=1, trial_steps=2)
    ctl.after_sync_step(0.0)
    ctl.after_sync_step(0.0)  # profiling ends: "optimal" installed
    clock.t += 0.058  # the loop's gap before the first trial step starts
    for step_s in (0.251, 0.544, 0.546):  # optimal: the short first step, then two steady ones
        ctl.at_step_start()
        clock.t += step_s
    for step_s in (0.218, 0.588, 0.607):  # dear: its settling step, then two steady ones
        ctl.at_step_start()
        clock.t += step_s
    ctl.at_step_start()
    assert ctl.phase is Phase.RUN
    assert [r["windows_s"] for r in ctl.trial_results] == [[pytest.approx(0.544)], [pytest.approx(0.588)]]
    assert [r["chosen"] for r in ctl.trial_results] == [True, False]
    assert not any(isinstance(c, tuple) and c[0] == "info" and "below the physical floor" in c[1] for c in fx.calls)


def test_a_replan_that_the_fit_does_not_finish_keeps_the_first_selection_and_says_unfinished():
    """Regression (the default ``pipedap-train`` run): a selection finishes, drift re-plans, and the fit ends in
    the middle of the second selection. The first selection's results used to be erased when the re-plan's
    candidates were planned, so the run reported ``candidates: []`` as if it had chosen nothing to measure."""
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("a", 1.0), Sched("b", 0.9)], profiled=(1, 1))
    ctl = _trial(fx, clock, {"a": [0.30], "b": [0.10]}, rounds=1)
    assert ctl.plan_selection()["status"] == "finished"
    assert ctl.plan_selection()["text"] == "finished (2 of 2 candidates measured)"
    first = ctl.trial_results
    assert [r["chosen"] for r in first] == [False, True]
    ctl.replan_every, ctl.max_replans = 4, 1
    clock.t += DRIFT_HOLDOFF_S
    for _ in range(1 + 4 * DRIFT_CONFIRMATIONS):  # 3x slower than b measured in its trial: re-plan
        clock.t += 0.3
        ctl.at_step_start()
    assert ctl.phase is Phase.PROFILE and ctl.replans_done == 1
    sel = ctl.plan_selection()
    assert (sel["status"], sel["text"]) == (
        "unfinished", "unfinished (the fit ended while profiling, before candidates were planned, after re-plan 1)")
    assert ctl.unfinished_trial() == (
        "pipedap: the fit ended while profiling for re-plan 1: no candidate was planned or measured, and the profiling "
        "schedule (sync mode) ran last (the finished selection before it chose b, its results are kept); train longer")
    ctl.run_noun = "run"  # (Fabric has no fit: its strategy says "run")
    assert ctl.unfinished_trial().startswith("pipedap: the run ended while profiling for re-plan 1")
    assert ctl.plan_selection()["text"].startswith("unfinished (the run ended while profiling")
    ctl.run_noun = "fit"
    ctl.after_sync_step(clock.t)  # the re-plan's profiling step: the second selection starts with a
    assert ctl.phase is Phase.TRIAL and ctl.trial_results is first  # not erased by the re-plan
    for step_s in (5.0, 0.4, 0.5, 0.6):  # a's window: settling, then 2 measured steps (the last start switches)
        clock.t += step_s
        ctl.at_step_start()
    clock.t += 5.0
    ctl.at_step_start()  # b's window has begun: the fit ends here
    sel = ctl.plan_selection()
    assert sel["status"] == "unfinished" and (sel["measured"], sel["candidates"]) == (1, 2)
    assert sel["text"] == "unfinished (1 of 2 candidates measured, 1 of 2 windows, after re-plan 1)"
    assert sel["selections_finished"] == 1
    assert [(p["name"], p["windows_s"], p["measured_s"]) for p in sel["partial"]] == [
        ("a", [pytest.approx(0.5)], pytest.approx(0.5)), ("b", [], None)]
    # the first selection's results are kept, whole
    assert ctl.trial_results is first and ctl.selections == [first]
    assert [round(r["measured_s"], 6) for r in ctl.trial_results] == [0.3, 0.1]
    note = ctl.unfinished_trial()
    assert "(1 of 2 windows measured, 2 measured steps each after one settling step)" in note
    assert "b, ran last (this was the selection after re-plan 1; the finished selection before it chose b" in note


def test_plan_selection_is_not_run_for_a_fixed_schedule_or_a_single_candidate():
    ctl = _ctl(FakeEffects(), planned=False)
    ctl.after_sync_step(0.0)
    assert ctl.plan_selection() == {"selections_finished": 0, "measured": None, "candidates": None, "partial": [],
                                    "status": "not run", "text": "not run (a fixed schedule)"}
    ctl = _run_phase(FakeEffects(profiled=(1,)), Clock())
    assert ctl.plan_selection()["text"] == "not run (one candidate, installed directly)"


def test_the_start_and_end_of_selection_name_the_same_window_length():
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("a", 1.0), Sched("b", 0.9)], profiled=(1,))
    ctl = _ctl(fx, clock, profile_steps=1, trial_steps=8)
    _start_trial(ctl)
    start = next(c[1] for c in fx.calls if isinstance(c, tuple) and c[0] == "info" and "measuring" in c[1])
    assert "for 8 measured steps each (after one settling step per window): a, b" in start
    assert "8 measured steps each after one settling step" in ctl.unfinished_trial()


def test_startup_lists_every_part_and_adds_up():
    """The α-β model, the contention benchmark and the compression helper's start are their own entries,
    no longer hidden in the trace phase (whose line said 'profile ... incl. the α-β fit')."""
    clock = Clock()
    fx = FakeEffects(profiled=(1,), profiling_parts={"alpha_beta": 0.02, "contention": 0.7}, clock=clock,
                     plan_s=0.25)
    ctl = _ctl(fx, clock, profile_steps=1)
    clock.t = 0.3
    ctl.account({"helper_start": 0.3})  # (the run-time's helper start, inside the trace phase)
    clock.t = 1.1  # the trace step ends at 1.1 s; the α-β model and contention then take 0.72 s
    ctl.after_sync_step(clock.t)
    assert ctl.phase is Phase.PROFILE
    clock.t += 0.5
    ctl.after_sync_step(clock.t)  # one profiled step of 0.5 s, planning 0.25 s, then a single candidate: RUN
    assert ctl.phase is Phase.RUN
    st = dict(ctl.startup)
    assert st.pop("plan_cache") == "off"
    assert st == pytest.approx({"trace_s": 0.8, "trace_steps": 1, "helper_start_s": 0.3, "alpha_beta_s": 0.02,
                                "contention_s": 0.7, "profile_s": 0.5, "profile_steps": 1, "planning_s": 0.25,
                                "trial_s": 0.0, "trial_steps": 0, "total_s": 2.57, "total_steps": 2})
    assert st["total_s"] == pytest.approx(clock.t)  # nothing unaccounted
    line = ("pipedap: steady state after 2 steps, 2.57 s since set-up: trace 1 step 0.80 s, compression helper "
            "start 0.30 s, α-β model 0.02 s, contention benchmark 0.70 s, profile 1 step 0.50 s, planning 0.25 s, "
            "trials 0 steps 0.00 s")
    assert ("info", line) in fx.calls
    ctl.account({"alpha_beta": 5.0})  # after steady state (a re-plan): not start-up
    assert ctl.startup["alpha_beta_s"] == pytest.approx(0.02)


def test_describe_startup_omits_parts_that_did_not_run():
    st = {"trace_s": 0.25, "trace_steps": 2, "profile_s": 0.0, "profile_steps": 0, "trial_s": 0.0, "trial_steps": 0}
    assert describe_startup(st, 1) == "trace 2 steps 0.2 s, profile 0 steps 0.0 s, trials 0 steps 0.0 s"


# ---------------------------------------------------------------------------------------- racing, budget, drift
def test_racing_drops_a_clearly_slower_candidate_after_the_first_round():
    """Successive rounds measure only the candidates within ``race_drop`` (25%) of the fastest: c (2x slower) is
    dropped after round 1 and measured once; a and b are measured in both rounds."""
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("a", 1.0), Sched("b", 0.9), Sched("c", 0.8)], profiled=(1,))
    ctl = _ctl(fx, clock, profile_steps=1, trial_steps=2, trial_rounds=2)
    _start_trial(ctl)
    _drive_windows(ctl, clock, [0.20, 0.21, 0.40])  # round 1
    assert ctl.phase is Phase.TRIAL and ctl.trial.order == [0, 1, 2, 0, 1]
    assert any(isinstance(c, tuple) and c[0] == "info" and "racing, after round 1: dropped c 400.0 ms" in c[1]
               for c in fx.calls)
    _drive_windows(ctl, clock, [0.20, 0.21])  # round 2: a and b only
    assert ctl.phase is Phase.RUN
    assert [len(r["windows_s"]) for r in ctl.trial_results] == [2, 2, 1]
    assert [r["chosen"] for r in ctl.trial_results] == [True, False, False]
    assert any("dropped c" in n for n in ctl.selection_notes)


def test_racing_with_one_candidate_left_decides_after_the_first_round():
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("a", 1.0), Sched("b", 0.9)], profiled=(1,))
    ctl = _ctl(fx, clock, profile_steps=1, trial_steps=2, trial_rounds=3)
    _start_trial(ctl)
    _drive_windows(ctl, clock, [0.50, 0.20])
    assert ctl.phase is Phase.RUN and [r["chosen"] for r in ctl.trial_results] == [False, True]
    assert ctl.startup["trial_steps"] == 1 + 2 * 3  # the first step, then two windows of a settling step and 2 measured


def test_noise_in_one_window_does_not_replan():
    """One slow drift window (load on a shared machine) is not a slower schedule: a re-plan needs
    ``DRIFT_CONFIRMATIONS`` windows in a row, and none comes within ``DRIFT_HOLDOFF_S`` of the install."""
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("plan", 1.0)], profiled=(1,))
    ctl = _run_phase(fx, clock, replan_every=4, replan_margin=0.15, max_replans=1)
    for _ in range(40):  # within the hold-off (40 s < 60 s): 50% slower, sustained, still no re-plan
        clock.t += 1.0 if _ % 8 else 1.5
        clock.t += 0.5
        ctl.at_step_start()
    assert ctl.phase is Phase.RUN and ctl.replans_done == 0
    clock.t += DRIFT_HOLDOFF_S
    for k in range(40):  # after it: a slow window every other check, never 3 in a row
        clock.t += 1.5 if (k // 4) % 2 == 0 else 1.0
        ctl.at_step_start()
    assert ctl.phase is Phase.RUN and ctl.replans_done == 0


def test_no_replan_when_the_rest_of_the_fit_is_too_short_to_pay_for_it():
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("plan", 1.0)], profiled=(1,))
    ctl = _ctl(fx, clock, profile_steps=1, replan_every=4, replan_margin=0.15, max_replans=1)
    ctl.set_total_steps(20)
    ctl.after_sync_step(0.0)
    ctl.after_sync_step(0.0)
    assert ctl.phase is Phase.RUN and ctl.startup["total_steps"] == 2
    clock.t += DRIFT_HOLDOFF_S
    for _ in range(1 + 4 * DRIFT_CONFIRMATIONS):
        clock.t += 1.5
        ctl.at_step_start()
    assert ctl.phase is Phase.RUN and ctl.replans_done == 0  # 5 steps left < 4 x the 2 start-up steps
    assert any(isinstance(c, tuple) and c[0] == "info" and "not re-planning" in c[1] for c in fx.calls)


def test_the_startup_budget_shortens_windows_and_installs_the_best_so_far():
    """``startup_budget`` x the fit's steps bounds one selection: windows are shortened to fit it (at least 2
    measured steps), and when it runs out mid-selection the fastest candidate measured so far is installed and the
    summary says so."""
    clock = Clock()
    names = ["a", "b", "c", "d", "e"]
    fx = FakeEffects(candidates=[Sched(n, 1.0) for n in names], profiled=(1,))
    ctl = _ctl(fx, clock, profile_steps=1, trial_steps=3, trial_rounds=2, trial_window_s=100.0, startup_budget=0.1)
    ctl.set_total_steps(300)  # budget: 30 steps; 2 used by trace and profile, 28 left for 5 x 2 windows
    ctl.after_sync_step(0.0)
    ctl.after_sync_step(0.0)
    assert ctl.phase is Phase.TRIAL and ctl.window_steps == 2  # 28 // 10 - 1 = 1, raised to 2 (window_s: 50)
    ctl.at_step_start()
    step = {"a": 0.22, "b": 0.21, "c": 0.20, "d": 0.205, "e": 0.215}  # (none dropped by racing)
    for _ in range(40):
        if ctl.phase is not Phase.TRIAL:
            break
        cur = fx.calls[[k for k, c in enumerate(fx.calls) if isinstance(c, tuple) and c[0] == "install_run"][-1]][1]
        clock.t += step[cur]
        ctl.at_step_start()
    assert ctl.phase is Phase.RUN and ctl.startup["total_steps"] == 30  # stopped exactly at the budget
    sel = ctl.plan_selection()
    assert sel["status"] == "finished" and sel["text"].startswith("finished at the start-up budget")
    assert "ran out after" in ctl.budget_note
    assert [r["name"] for r in ctl.trial_results if r["chosen"]] == ["c"]
    ctl2 = _ctl(FakeEffects(candidates=[Sched("a", 1.0), Sched("b", 0.9)], profiled=(1,)), Clock(), profile_steps=1,
                startup_budget=0.05)
    ctl2.set_total_steps(60)  # 3 steps: no room for trial windows after trace and profile
    ctl2.after_sync_step(0.0)
    ctl2.after_sync_step(0.0)
    assert ctl2.phase is Phase.RUN and ctl2.plan_selection()["text"] == (
        "not run (the start-up budget left no room for trials)")
    assert ("the planner's schedule 'a' was installed on its prediction alone, without measuring the other 1 "
            "candidate(s)") in ctl2.budget_note


def test_a_candidate_dropped_by_racing_is_never_chosen_and_ddps_reducer_is_never_dropped():
    """Regression (the README helper's main job): a candidate racing dropped after round 1 won at the end with its
    one window, because the α-β floor (fitted on a loaded machine) ruled the faster candidates mismeasured. The
    choice is made among the candidates still in the race. DDP's reducer is never dropped by racing (the fresh-user
    check: one noisy window removed it whatever torch_ddp_margin said): only the margin and a confirmation
    displace it."""
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("a", 1.0), Sched("b", 0.9), Sched("c", 1.0)], profiled=(1,), floor=0.3)
    ctl = _ctl(fx, clock, profile_steps=1, trial_steps=2, trial_rounds=2)
    _start_trial(ctl)
    _drive_windows(ctl, clock, [0.20, 0.21, 0.40])  # c 2x slower: dropped
    assert ctl.trial.alive == [0, 1]
    _drive_windows(ctl, clock, [0.20, 0.21])
    assert ctl.phase is Phase.RUN and [r["name"] for r in ctl.trial_results if r["chosen"]] == ["a"]
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("a", 1.0), Sched("torch_ddp", 1.0)], profiled=(1,))
    ctl = _ctl(fx, clock, profile_steps=1, trial_steps=2, trial_rounds=2)
    _start_trial(ctl)
    _drive_windows(ctl, clock, [0.20, 0.40])  # one noisy window of DDP's reducer: it stays in the race
    assert ctl.phase is Phase.TRIAL and ctl.trial.alive == [0, 1]
