"""Candidate schedules for measured plan selection ("trials").

The α-β model and the simulator rank schedules well when communication is wire-bound, but on a
CPU whose cores also run gloo's ring additions, memory copies and TCP stack, every extra
operation costs more than its α predicts while compute runs, and a plan with many small buckets
can measure *slower* than a coarse one that the model ranks behind it (mlp, 2 ranks, loopback:
17-bucket ``optimal`` 834 ms measured vs 638 ms predicted; 3-bucket DeAR 673 ms). The strategy
therefore runs the few best-looking candidates for a handful of steps each and keeps the one
with the lowest *measured* iteration time. This module picks those candidates; it is pure
Python over plain data (no torch, no torch.distributed).

Candidate order (first ``k`` distinct schedules):

1. the configured planner's schedule (the model's choice);
2. ``dear`` with the greedy ``cap_bytes`` fusion (DeAR with DDP-sized buckets: few operations);
3. ``wfbp`` with the same fusion (the DDP-like baseline, one all-reduce per bucket in backward);
4. the other planners with model-chosen fusion, in order of predicted iteration time.

Two schedules are the same candidate when their buckets, op lists, compression and 16-bit wire flags
agree. With ``wire16`` the configured planner's schedule keeps its own per-bucket choice and every
other candidate sends every uncompressed bucket 16-bit (:func:`wire16_everywhere`). With ``sharded`` (the sharded
optimizer step) every candidate is planned and predicted for it (its op list is the engine's sharded one).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from lightning_pipedap.plan.compression import CompressionCost
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.planners import get_planner
from lightning_pipedap.plan.profile import ModelProfile
from lightning_pipedap.plan.sharding import ShardingArg
from lightning_pipedap.plan.simulator import simulate
from lightning_pipedap.schedule import Schedule

__all__ = ["trial_candidates", "wire16_everywhere"]

#: planners tried with their own (model-chosen) fusion after the fixed-fusion candidates
_AUTO_FUSION_PLANNERS: tuple[str, ...] = ("pipedap", "optimal", "dear", "wfbp")


def _key(s: Schedule) -> tuple:
    return (s.buckets, tuple((o.kind, o.bucket) for o in s.ops), s.compressed, s.wire16)


def wire16_everywhere(profile: ModelProfile, cost_model: CostModel, schedule: Schedule,
                      compression: CompressionCost | None = None, sharded: ShardingArg = False) -> Schedule:
    """``schedule`` with every uncompressed bucket in the 16-bit wire format, re-predicted by the simulator
    (the fixed-idea planners' way of using the wire format, as they compress every bucket); ``sharded``: with
    the sharded step's model."""
    flags = tuple(not schedule.is_compressed(b) for b in range(len(schedule.buckets)))
    out = dataclasses.replace(schedule, wire16=flags if any(flags) else None)
    return dataclasses.replace(out, predicted_iteration_s=simulate(profile, cost_model, out, compression=compression,
                                                                   sharded=sharded).iteration_s)


def trial_candidates(profile: ModelProfile, cost_model: CostModel, world_size: int, planned: Schedule, *,
                     cap_bytes: int, k: int, compression: CompressionCost | None = None,
                     exclude: Sequence[str] = ("no_overlap",), wire16: bool = False,
                     sharded: ShardingArg = False) -> list[Schedule]:
    """The first ``k`` distinct candidate schedules, ``planned`` first (see the module docstring).

    Args:
        profile: the measured profile (layers in forward order).
        cost_model: the α-β model the plan was made with.
        world_size: number of data-parallel ranks.
        planned: the configured planner's schedule over the profile's layers; always candidate 0.
        cap_bytes: greedy fusion cap (bytes) of the fixed-fusion candidates, e.g. the strategy's
            ``bucket_cap_mb`` x 2**20.
        k: number of candidates wanted (>= 1); fewer are returned when fewer are distinct.
        compression: compression cost passed to every planner (``None``: dense).
        exclude: planner names never used as candidates.
        wire16: the 16-bit wire format is allowed: ``optimal`` chooses it per bucket, the other
            planners' schedules get it on every bucket (:func:`wire16_everywhere`).
        sharded: plan and predict every candidate for the sharded optimizer step (``True`` or a
            :class:`~lightning_pipedap.plan.sharding.Sharding`); ``planned`` should be planned so too.

    Returns:
        Schedules over the profile's layers, each with ``predicted_iteration_s`` set; fixed-fusion
        ones are named ``"<planner>@<cap>MiB"``.

    Raises:
        ValueError: ``k < 1`` or ``cap_bytes <= 0`` (the values are named).
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if not cap_bytes > 0:
        raise ValueError(f"cap_bytes must be > 0, got {cap_bytes!r}")
    out: list[Schedule] = [planned]
    seen = {_key(planned)}

    def add(s: Schedule) -> None:
        if wire16 and s.name.split("@")[0] != "optimal":
            s = wire16_everywhere(profile, cost_model, s, compression, sharded)
        if len(out) < k and _key(s) not in seen:
            seen.add(_key(s))
            out.append(s)

    cap_label = f"{cap_bytes / 2**20:.3g}MiB"
    for name in ("dear", "wfbp"):
        if len(out) >= k or name in exclude:
            continue
        s = get_planner(name)(profile, cost_model, world_size, fusion=int(cap_bytes), compression=compression,
                              sharded=sharded)
        add(dataclasses.replace(s, name=f"{name}@{cap_label}"))
    auto = []
    for name in _AUTO_FUSION_PLANNERS:
        if len(out) >= k or name in exclude or name == planned.name:  # the planned one is already candidate 0
            continue
        kw = {"wire16": True} if wire16 and name == "optimal" else {}
        auto.append(get_planner(name)(profile, cost_model, world_size, compression=compression, sharded=sharded, **kw))
    for s in sorted(auto,
                    key=lambda s: s.predicted_iteration_s if s.predicted_iteration_s is not None else float("inf")):
        add(s)
    return out
