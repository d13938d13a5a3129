"""What measured plan selection says at the end of a fit (or now): read-only views of a
:class:`~lightning_pipedap.strategy.controller.Controller` (``ctl``) for the end-of-training messages, the results
and the summary. No Lightning, torch or ``torch.distributed`` import.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_pipedap.strategy.phase import FALLBACK_SCHEDULE, Phase
from lightning_pipedap.strategy.selection import Selection


def unfinished_trial(ctl: Any) -> Optional[str]:
    """A sentence for the end of a fit that stopped during measured plan selection (or while profiling for a
    plan), else None."""
    tr = ctl.trial
    if ctl.phase is Phase.PROFILE:
        chosen = next((r["name"] for r in ctl.selections[-1] if r["chosen"]), "?") if ctl.selections else None
        what = f"re-plan {ctl.replans_done}" if ctl.replans_done else "the plan"
        return (f"pipedap: the {ctl.run_noun} ended while profiling for {what}: no candidate was planned or "
                "measured, and the profiling schedule (sync mode) ran last"
                + (f" (the finished selection before it chose {chosen}, its results are kept)" if chosen else "")
                + "; train longer")
    if ctl.phase is not Phase.TRIAL or tr is None:
        return None
    cur = tr.schedules[tr.order[min(tr.window, len(tr.order) - 1)]]
    kept = ""
    if ctl.selections:
        chosen = next((r["name"] for r in ctl.selections[-1] if r["chosen"]), "?")
        kept = (f" (this was the selection after re-plan {ctl.replans_done}; the finished selection before it "
                f"chose {chosen}, its results are kept)")
    return (f"pipedap: the {ctl.run_noun} ended during measured plan selection ({tr.window} of "
            f"{ctl.selection.planned_windows(tr)} windows measured, {ctl.window_steps} measured steps each after "
            "one settling step): no candidate was "
            f"chosen, and the one being measured, {cur.name}, ran last{kept}; train longer, or set "
            "plan_trials=1 (the plan directly) or fewer trial_rounds / a smaller trial_window_s")


def partial_trial_results(ctl: Any) -> list[dict[str, Any]]:
    """The measurements of the selection in progress (TRIAL only, else []): one dict per candidate with
    ``name``, ``predicted_s``, ``windows_s`` (the lower-quartile step of each of its windows measured so far,
    this rank's clock) and ``measured_s`` (their median, None before its first window ended)."""
    tr = ctl.trial
    if ctl.phase is not Phase.TRIAL or tr is None:
        return []
    return Selection.partial_results(tr)


def plan_selection(ctl: Any) -> dict[str, Any]:
    """Where measured plan selection stands (at the end of a fit: whether it finished), as plain data.

    Returns:
        ``{"status", "text", "selections_finished", "measured", "candidates", "partial"}``: ``status`` is
        ``"finished"`` (the schedule running was chosen by a finished selection), ``"unfinished"`` (the
        fit is, or ended, in the middle of planning or measuring candidates: no candidate was chosen for
        the schedule running now), or ``"not run"`` (a fixed schedule, a single candidate, a checkpoint's
        plan); ``text`` says so in words, e.g. ``"unfinished (3 of 5 candidates measured, after re-plan
        1)"``; ``measured`` / ``candidates`` count the selection in progress or the last finished one
        (None when there is none); ``partial`` is :func:`partial_trial_results`.
    """
    after = f", after re-plan {ctl.replans_done}" if ctl.replans_done else ""
    out: dict[str, Any] = {"selections_finished": len(ctl.selections), "measured": None, "candidates": None,
                           "partial": ctl.partial_trial_results()}
    if ctl.phase is Phase.TRIAL and ctl.trial is not None:
        tr = ctl.trial
        n = len(tr.schedules)
        k = sum(1 for per in tr.gaps_s if per)
        out.update(status="unfinished", measured=k, candidates=n,
                   text=f"unfinished ({k} of {n} candidates measured, {tr.window} of "
                        f"{ctl.selection.planned_windows(tr)} windows{after})")
    elif ctl.planned and ctl.phase in (Phase.TRACE, Phase.PROFILE):
        where = "tracing" if ctl.phase is Phase.TRACE else "profiling"
        out.update(status="unfinished", text=f"unfinished (the {ctl.run_noun} ended while {where}, before "
                                             f"candidates were planned{after})")
    elif ctl.how == "selected":
        n = len(ctl.trial_results)
        out.update(status="finished", measured=n, candidates=n,
                   text=f"finished ({n} of {n} candidates measured{after})")
    elif ctl.how == "budget":
        n = len(ctl.trial_results)
        k = sum(1 for r in ctl.trial_results if r["measured_s"] is not None)
        out.update(status="finished", measured=k, candidates=n,
                   text=f"finished at the start-up budget ({k} of {n} candidates measured{after}; the fastest "
                        "measured was installed)")
    else:
        why = {"fixed": "a fixed schedule", "resumed": "the plan came from the checkpoint",
               "single": "one candidate, installed directly",
               "no_room": "the start-up budget left no room for trials",
               "unprofiled": f"the fixed schedule {FALLBACK_SCHEDULE!r}: no step could be profiled",
               "cached": "the plan came from the plan cache"}.get(ctl.how, "no plan yet")
        out.update(status="not run", text=f"not run ({why}{after})")
    return out


def unprofiled(tries: int, done: int, profile_steps: int, replans_done: int) -> str:
    """Why the fixed schedule :data:`FALLBACK_SCHEDULE` replaces a plan: ``tries`` steps of the profiling schedule
    gave only ``done`` of the ``profile_steps`` profiled steps (for the plan, or re-plan ``replans_done``)."""
    what = f"re-plan {replans_done}" if replans_done else "the plan"
    return (f"pipedap: {tries} steps of the profiling schedule for {what} and only {done} of the {profile_steps} "
            "profiled steps needed: a profiled step is a training step whose forward and a backward pass with "
            "gradient sync are both observed (none here: no backward inside the step, or only under "
            f"no_sync/accumulation); installing the fixed schedule {FALLBACK_SCHEDULE!r} instead of a plan "
            "(no candidate planned or measured)")
