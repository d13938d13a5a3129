"""The end-of-run summary, results.json's ``pipedap`` entry and the sweep table when a fit ends in the middle of
measured plan selection (pure: a controller driven by a fake clock, fake results dicts)."""

from __future__ import annotations

import csv
import json
import os
from types import SimpleNamespace

import pytest

from lightning_pipedap.app.sweep import write_summary
from lightning_pipedap.app.train import format_summary, startup_cost_s, what_ran_markdown
from lightning_pipedap.strategy import PipeDAPStrategy
from lightning_pipedap.strategy.controller import Phase
from lightning_pipedap.strategy.controller import DRIFT_CONFIRMATIONS, DRIFT_HOLDOFF_S
from tests.test_strategy_controller import Clock, FakeEffects, Sched, _trial


def _replanned_mid_trial():
    """A selection finishes (b chosen), drift re-plans, and the fit ends in the second selection's second window."""
    clock = Clock()
    fx = FakeEffects(candidates=[Sched("a", 1.0), Sched("b", 0.9)], profiled=(1, 1))
    ctl = _trial(fx, clock, {"a": [0.30], "b": [0.10]}, rounds=1)
    ctl.replan_every, ctl.max_replans = 4, 1
    clock.t += DRIFT_HOLDOFF_S
    for _ in range(1 + 4 * DRIFT_CONFIRMATIONS):
        clock.t += 0.3
        ctl.at_step_start()
    ctl.after_sync_step(clock.t)
    for step_s in (5.0, 0.4, 0.5, 0.6, 5.0):
        clock.t += step_s
        ctl.at_step_start()
    assert ctl.phase is Phase.TRIAL
    return ctl


def _what_ran(ctl, running="b"):
    strategy = PipeDAPStrategy(schedule="optimal")
    strategy._last = SimpleNamespace(controller=ctl, final_schedule=None, running_schedule=running,
                                     installed_schedule=None)
    return strategy, strategy.what_ran()


def test_what_ran_keeps_the_first_selection_and_marks_the_unfinished_one():
    strategy, ran = _what_ran(_replanned_mid_trial())
    assert ran["plan_selection"] == "unfinished (1 of 2 candidates measured, 1 of 2 windows, after re-plan 1)"
    assert ran["plan_selection_status"] == "unfinished" and ran["ran_at_end"] == "b"
    # the finished first selection, not []
    assert [(c["name"], round(c["measured_s"], 6), c["chosen"]) for c in ran["candidates"]] == [
        ("a", 0.3, False), ("b", 0.1, True)]
    assert [(c["name"], c["measured_s"]) for c in ran["unfinished_candidates"]] == [("a", pytest.approx(0.5)),
                                                                                    ("b", None)]
    assert [r["name"] for r in strategy.trial_results] == ["a", "b"]
    json.dumps(ran)  # results.json-able


def _res(ran, **kw):
    res = {"strategy": "pipedap", "schedule": "optimal", "processes": 2, "accelerator": "cpu", "model": "DigitsCNN",
           "val_acc": 0.98, "val_loss": 0.1, "iteration_ms": 15.0, "fit_s": 30.0, "output_dir": "/tmp/x",
           "compression": None, "pipedap": ran, "speedup_vs_reference": None}
    res.update(kw)
    return res


def test_the_summary_says_selection_was_unfinished_instead_of_installed():
    _, ran = _what_ran(_replanned_mid_trial())
    text = format_summary(_res(ran))
    assert "-> installed" not in text
    assert ("(schedule optimal -> plan selection unfinished (1 of 2 candidates measured, 1 of 2 windows, after "
            "re-plan 1), b ran at the end)") in text
    assert "plan selection  unfinished (1 of 2 candidates measured" in text
    assert ("(b ran last), so the iteration time is that of the schedule before the re-plan (the re-plan's profiling "
            "and trial steps are left out)") in text
    assert "earlier choice  a 300.0 ms, b 100.0 ms (chosen)" in text
    assert "measured so far a 500.0 ms" in text
    md = what_ran_markdown(ran)
    assert "plan selection: unfinished (1 of 2 candidates measured" in md and "`b` ran at the end" in md


def test_the_summary_names_a_16_bit_wire_format():
    ran = {"installed": {"name": "optimal"}, "buckets": 4, "wire_dtype": "bf16", "wire16_buckets": 3,
           "plan_selection": "finished (4 of 4 candidates measured)", "plan_selection_status": "finished"}
    assert ("(schedule optimal -> installed optimal, 4 buckets, wire bf16 on 3 of 4 buckets)"
            in format_summary(_res(ran)))
    ran["wire_dtype"] = "fp32"
    assert "wire" not in format_summary(_res(ran)).splitlines()[3]


def test_the_summary_accounts_for_every_start_up_part_and_says_where_the_model_came_from():
    """The start-up line used to list profile and trials only (the trace, the contention benchmark and the
    α-β model were unaccounted) and never said that the α-β model was read from the cache."""
    st = {"trace_s": 0.8, "trace_steps": 1, "alpha_beta_s": 0.01, "contention_s": 0.7, "profile_s": 0.1,
          "profile_steps": 3, "trial_s": 3.5, "trial_steps": 40, "total_s": 5.11, "total_steps": 44}
    origin = "cached α-β model from /home/u/.cache/lightning_pipedap/alpha_beta-x.json (fitted 2026-12-01 10:00:00 UTC)"
    ran = {"installed": {"name": "optimal"}, "buckets": 4, "startup": st, "cost_model_origin": origin}
    text = format_summary(_res(ran))
    assert ("start-up        44 steps, 5.1 s to steady state (trace 1 step 0.8 s, α-β model 0.0 s, contention "
            "benchmark 0.7 s, profile 3 steps 0.1 s, trials 40 steps 3.5 s)") in text
    assert f"cost model      {origin}" in text
    md = what_ran_markdown(ran)
    assert ("steady state after 44 steps, 5.11 s: trace 1 step 0.80 s, α-β model 0.01 s, contention benchmark "
            "0.70 s, profile 3 steps 0.10 s, trials 40 steps 3.50 s") in md
    assert f"cost model: {origin}" in md


def test_the_sweep_table_flags_a_speedup_from_an_unfinished_selection(tmp_path):
    _, unfinished = _what_ran(_replanned_mid_trial())
    for num, strategy, it_ms, ran in ((0, "ddp", 12.0, None), (1, "pipedap", 8.0, unfinished)):
        d = os.path.join(str(tmp_path), str(num))
        os.makedirs(d)
        with open(os.path.join(d, "results.json"), "w") as f:
            json.dump({"job_num": num, "strategy": strategy, "schedule": None if ran is None else "optimal",
                       "overrides": [f"strategy={strategy}"], "processes": 2, "val_acc": 0.9, "iteration_ms": it_ms,
                       "fit_s": 1.0, "metrics": {}, "pipedap": ran}, f)
    paths = write_summary(str(tmp_path), tensorboard=False)
    with open(paths["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert [r["plan_selection"] for r in rows] == ["", unfinished["plan_selection"]]
    assert float(rows[1]["speedup_vs_ddp"]) == 1.5  # (the CSV stays numeric)
    md = open(paths["md"]).read()
    assert "| 1.5 (selection unfinished) |" in md
    assert "Job(s) #1: the fit ended during measured plan selection" in md


def test_the_summary_says_which_steps_the_iteration_time_covers():
    ran = {"installed": {"name": "optimal"}, "buckets": 4, "plan_selection": "finished (4 of 4 candidates measured)",
           "plan_selection_status": "finished"}
    text = format_summary(_res(ran, iteration_ms=9.6, iteration_steps=37, iteration_from_step=147, startup_steps=145,
                               startup_s=2.04, warmup_steps=5, startup_cost_s=startup_cost_s(2.04, 145, 0.0096)))
    # 2.04 s - 145 x 9.6 ms = 0.648 s over steady state; 0.648 / 30 s fit = 2.2%; 0.648 / 300 s = 0.2%
    assert ("iteration time  9.60 ms median of 37 steady-state steps (from step 147, after 145 start-up steps in "
            "2.0 s, +0.6 s over steady state = 2.2% of this fit, 0.2% of a 5-minute run)") in text
    assert startup_cost_s(2.04, 145, 0.0096) == pytest.approx(0.648)
    assert startup_cost_s(None, 145, 0.0096) is None
    replanned = format_summary(_res(ran, iteration_ms=9.6, iteration_steps=37, iteration_from_step=147,
                                    startup_steps=145, startup_s=2.04, warmup_steps=5, replan_steps=40))
    assert "(from step 147, after 145 start-up steps in 2.0 s; 40 steps of a drift re-plan left out)" in replanned
    ddp = format_summary(_res(None, strategy="ddp", schedule=None, iteration_ms=12.0, iteration_steps=178,
                              iteration_from_step=5, startup_steps=None, warmup_steps=5))
    assert "iteration time  12.00 ms median of 178 steps (after 5 warm-up steps)" in ddp


def test_the_summary_has_no_iteration_time_when_the_fit_ended_before_steady_state():
    _, ran = _what_ran(_replanned_mid_trial())
    note = "the fit ended before steady state (during the strategy's start-up: trace, profiling, trials)"
    text = format_summary(_res(ran, iteration_ms=None, iteration_steps=0, iteration_from_step=None,
                               iteration_note=note))
    assert f"iteration time  n/a: {note}; no steady-state time (train longer)" in text
    assert "ms median" not in text


def test_the_summary_lists_the_numbers_the_choice_was_made_on():
    # the fresh-user run: over all windows torch_ddp (chosen) looked slower; the confirmation decided
    ran = {"installed": {"name": "torch_ddp"}, "buckets": None,
           "plan_selection": "finished (3 of 3 candidates measured)",
           "plan_selection_status": "finished", "candidates": [
               {"name": "optimal", "measured_s": 0.0125, "deciding_s": 0.0125, "decided_in": "first pass",
                "chosen": False},
               {"name": "dear@25MiB", "measured_s": 0.0101, "deciding_s": 0.0100, "decided_in": "confirmation",
                "chosen": False},
               {"name": "torch_ddp", "measured_s": 0.0111, "deciding_s": 0.0096, "decided_in": "confirmation",
                "chosen": True}]}
    text = format_summary(_res(ran))
    assert ("candidates      optimal 12.5 ms, dear@25MiB 10.0 ms, torch_ddp 9.6 ms (chosen); decided on the "
            "confirmation rounds of dear@25MiB and torch_ddp (the others on the first pass); median of all windows: "
            "optimal 12.5 ms, dear@25MiB 10.1 ms, torch_ddp 11.1 ms") in text
    md = what_ran_markdown(ran)
    assert "| torch_ddp | n/a | 9.60 | confirmation | 11.10 | yes |" in md


def test_what_ran_lists_deciding_and_all_window_medians():
    from tests.test_strategy_controller import _ctl, _drive_windows, _start_trial  # noqa: PLC0415

    clock = Clock()
    fx = FakeEffects(candidates=[Sched("b", 0.9), Sched("torch_ddp", 1.0)], profiled=(1,))
    ctl = _ctl(fx, clock, profile_steps=1, trial_steps=2, trial_rounds=1)
    _start_trial(ctl)
    _drive_windows(ctl, clock, [0.20, 0.30, 0.18, 0.22])  # b wins the first pass; torch_ddp the confirmation
    _, ran = _what_ran(ctl, running="torch_ddp")
    got = [(c["name"], round(c["deciding_s"], 6), round(c["measured_s"], 6), c["decided_in"], c["chosen"])
           for c in ran["candidates"]]
    assert got == [("b", 0.22, 0.21, "confirmation", False), ("torch_ddp", 0.18, 0.24, "confirmation", True)]
    json.dumps(ran)


def test_the_summary_says_a_speedup_came_from_ddps_reducer():
    ran = {"installed": {"name": "torch_ddp"}, "buckets": None,
           "plan_selection": "finished (3 of 3 candidates measured)", "plan_selection_status": "finished"}
    text = format_summary(_res(ran, speedup_vs_reference=1.013))
    assert "speedup         1.013x vs the reference run (installed torch_ddp: DDP's reducer, not a pipedap schedule)" \
        in text
    ran["installed"] = {"name": "optimal"}
    ran["buckets"] = 4
    assert "DDP's reducer" not in format_summary(_res(ran, speedup_vs_reference=1.2))


def test_the_summary_says_why_a_slower_looking_candidate_was_chosen():
    from tests.test_strategy_controller import _ctl, _drive_windows, _start_trial  # noqa: PLC0415

    clock = Clock()
    fx = FakeEffects(candidates=[Sched("b", 0.9), Sched("torch_ddp", 1.0)], profiled=(1,))
    ctl = _ctl(fx, clock, profile_steps=1, trial_steps=2, trial_rounds=1)
    _start_trial(ctl)
    _drive_windows(ctl, clock, [0.19, 0.20])  # b 5 % faster: DDP's reducer is kept (margin 10 %), no confirmation
    _, ran = _what_ran(ctl, running="torch_ddp")
    assert ran["selection_notes"] == ["b 190.0 ms is not faster than torch_ddp 200.0 ms by more than 10%: chose "
                                      "torch_ddp"]
    text = format_summary(_res(ran))
    assert "candidates      b 190.0 ms, torch_ddp 200.0 ms (chosen)\n" in text
    assert "why             b 190.0 ms is not faster than torch_ddp 200.0 ms by more than 10%: chose torch_ddp" in text
    assert "why: b 190.0 ms is not faster than torch_ddp 200.0 ms by more than 10%" in what_ran_markdown(ran)


def test_the_summary_says_how_little_communication_there_is_to_hide_and_where_the_gain_appears():
    """Measured while profiling: a few % of a step on one machine over loopback. The summary says so plainly and
    names a command that shows where the gain appears (the what-if simulator on a published profile)."""
    from lightning_pipedap.app.train import WHAT_IF_COMMAND, communication_text

    ran = {"installed": {"name": "torch_ddp"}, "buckets": None,
           "communication": {"busy_s": 0.0004, "compute_s": 0.0080, "share": 0.0476}}
    text = format_summary(_res(ran))
    assert "communication   0.4 ms busy per step beside 8.0 ms of forward + backward (5% of the two)" in text
    assert "little communication to hide" in text and WHAT_IF_COMMAND in text
    busy = communication_text({"busy_s": 0.05, "compute_s": 0.05, "share": 0.5}, 8)
    assert "(50% of the two)" in busy and "little" not in busy


def test_the_summary_flags_a_speedup_below_one_and_a_large_prediction_error_with_reasons():
    """TensorBoard showed speedup_vs_no_overlap 0.60 and prediction_error_pct 82 and the summary said nothing."""
    ran = {"schedule": "optimal", "installed": {"name": "dear"}, "buckets": 2, "predicted_iteration_s": 0.0055,
           "no_overlap_time_s": 0.006, "profiled_compute_s": 0.0058, "contention": {"compute_slowdown": 0.3,
                                                                                    "comm_slowdown": 0.1},
           "cost_model_origin": "α-β model fitted on the live group in 2.1 s"}
    res = _res(ran, iteration_ms=10.0, speedup_vs_no_overlap=0.6, no_overlap_time_s=0.006,
               predicted_iteration_s=0.0055, prediction_error_pct=81.8, host_cpus=2)
    lines = [line for line in format_summary(res).splitlines() if line.startswith("check")]
    assert len(lines) == 2, format_summary(res)
    speed, err = lines
    assert speed.startswith("check           speedup vs no overlap 0.60 (< 1.0): the step (10.0 ms) is slower than "
                            "the no-overlap reference (6.0 ms), which is not a measured run but a prediction")
    assert "all-reduce of every bucket (0.2 ms, 3% of it)" in speed and "a few % of the step" in speed
    assert "loopback" in speed and "compute ran slower than in the profiling steps" in speed
    assert "2 training processes and their communication threads share 2 CPU cores" in speed
    assert "measured compute 30% slower while communication runs" in speed
    assert err.startswith("check           prediction error +82% (more than 25%): measured 10.0 ms per step, the plan "
                          "predicted 5.5 ms")
    assert "more than all the communication the model predicts (0.2 ms)" in err and "compute ran slower" in err
    # nothing surprising: no line
    calm = _res(ran, iteration_ms=5.6, speedup_vs_no_overlap=1.07, no_overlap_time_s=0.006,
                predicted_iteration_s=0.0055, prediction_error_pct=1.8, host_cpus=2)
    assert "check" not in format_summary(calm)


def test_the_summary_of_one_process_says_nothing_was_synchronised():
    ran = {"schedule": "optimal", "installed": None, "single_process": True}
    text = format_summary(_res(ran, processes=1))
    assert ("strategy        pipedap (schedule optimal: not used, one process has nothing to synchronise), "
            "1 process(es), cpu") in text


def test_a_run_into_a_directory_that_holds_one_writes_a_fresh_version_folder(tmp_path, monkeypatch):
    """A second run into the same output directory overwrote results.json and mixed two runs in one TensorBoard
    folder: the directory is left as it is and the run writes into <dir>/version_N, said in the log and summary."""
    from lightning_pipedap.app.train import RUN_DIR_ENV, earlier_run, run_dir

    job = str(tmp_path / "run")
    os.makedirs(os.path.join(job, ".hydra"))
    (tmp_path / "run" / "train.log").write_text("Hydra's log of this run\n")
    assert earlier_run(job) == [] and run_dir(job) == (job, None)  # Hydra's own files are not a run
    (tmp_path / "run" / "results.json").write_text("{}")
    os.makedirs(os.path.join(job, "tensorboard"))
    (tmp_path / "run" / "tensorboard" / "events.out.tfevents.1").write_text("")
    where, why = run_dir(job)
    assert where == os.path.join(job, "version_1")
    assert why.startswith(f"{job} already holds a run (results.json, tensorboard): its results are kept, and this "
                          f"run writes its results, TensorBoard logs and checkpoints into {where}; Hydra's own log")
    assert "hydra.run.dir=<dir>" in why
    os.makedirs(where)
    assert run_dir(job)[0] == os.path.join(job, "version_2")
    # a rank started by Lightning's popen launcher writes where the launching process chose
    monkeypatch.setenv(RUN_DIR_ENV, where)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert run_dir(job) == (where, None)
    text = format_summary(_res({}, output_dir=where, earlier_run=why))
    assert f"results         {where}/results.json" in text and f"output dir      {why}" in text
