"""Planners: pure functions ``(profile, cost_model, world_size, **options) -> Schedule``.

Each returns a validated :class:`~lightning_pipedap.schedule.Schedule` (tensor fusion + ordered op
list, buckets = tuples of profile layer indices) with ``predicted_iteration_s`` from the timeline
simulator. One planner per module:

* ``no_overlap`` -- one bucket reduced after the backward (the baseline of speedups);
* ``wfbp`` -- all-reduce per bucket in backward order, DP-optimal fusion;
* ``dear`` -- RS in backward order, AG in forward order (DeAR, ICDCS 2023);
* ``pipedap`` -- DeAR + all-gathers in idle backward gaps + RS/AG -> AR where cheaper (PipeDAP, TETC 2025);
* ``optimal`` -- search over fusion, order and mode; never worse than the others.
"""

from __future__ import annotations

from typing import Any, Callable

from lightning_pipedap.plan.planners import dear, no_overlap, optimal, pipedap, wfbp

Planner = Callable[..., Any]

PLANNERS: dict[str, Planner] = {
    "no_overlap": no_overlap.plan,
    "wfbp": wfbp.plan,
    "dear": dear.plan,
    "pipedap": pipedap.plan,
    "optimal": optimal.plan,
}


def get_planner(name: str) -> Planner:
    """The planner function registered as ``name``.

    Raises:
        ValueError: for an unknown name; the message lists the valid names.
    """
    try:
        return PLANNERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown planner {name!r}; valid: {sorted(PLANNERS)}") from None


__all__ = ["PLANNERS", "Planner", "get_planner"]
