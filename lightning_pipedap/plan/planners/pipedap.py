"""PipeDAP (TETC 2025), its scheduling idea re-implemented with consistent costs.

Starting from DeAR's order (reduce-scatters in backward order, all-gathers in forward order),
PipeDAP moves all-gathers into the idle gaps of the communication channel during the backward pass,
and merges a reduce-scatter with its all-gather into one all-reduce where that saves a start-up.

Here, with costs that never change when an op moves (unlike the reference code's ``T_ar - alpha``):

1. Walk the buckets in backward order, tracking the channel's free time ``t``. Before issuing
   ``RS(b)`` (ready at ``r_b``), while the channel would idle (``t < r_b``), issue the pending
   all-gather (its RS already issued) of the lowest bucket index whose cost fits in the gap
   (``t + T_AG <= r_b``), so the gap filling never delays a reduce-scatter. The lowest index goes
   first because it is needed soonest by the next forward; the highest ones have the most slack
   and are the best to leave for the forward pass.
2. The all-gathers still pending after the last reduce-scatter follow in forward order (DeAR).
3. Every ``RS(b)`` directly followed by ``AG(b)`` becomes ``AR(b)`` when the cost model says the
   all-reduce is cheaper (start-up sharing, see :class:`~lightning_pipedap.plan.cost_model.CostModel`).

With the same fusion, steps 1 and 3 can only make the iteration faster than DeAR's.
Tensor fusion: as in DeAR's planner, the candidate fusions are evaluated and the fastest kept.
"""

from __future__ import annotations

from typing import Any

from lightning_pipedap.plan.compression import CompressionCost
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.evaluator import Evaluator
from lightning_pipedap.plan.planners._common import AG, RS, merge_adjacent, plan_over_fusions
from lightning_pipedap.plan.profile import ModelProfile
from lightning_pipedap.plan.sharding import ShardingArg
from lightning_pipedap.schedule import Schedule

_EPS = 1e-15


def pipedap_codes(ev: Evaluator, gap_fill: bool = True, merge: bool = True) -> list[int]:
    """PipeDAP op list (integer codes) for the evaluator's fusion; see the module docstring.

    Gap filling uses channel times of one channel (channel 0 with two channels, where the
    all-gathers then run on channel 1 and never delay a reduce-scatter anyway).
    """
    cost, ready = ev.cost, ev.ready
    one_channel = ev.channels == 1
    seq: list[int] = []
    pending: list[int] = []  # buckets whose RS is issued and AG is not, ascending
    t = 0.0
    for b in range(ev.B - 1, -1, -1):
        r = ready[b]
        if gap_fill:
            while pending and t < r:
                for x in pending:
                    if t + cost[3 * x + AG] <= r + _EPS:
                        break
                else:
                    break
                pending.remove(x)
                seq.append(3 * x + AG)
                if one_channel:
                    t += cost[3 * x + AG]
        seq.append(3 * b + RS)
        t = (t if t > r else r) + cost[3 * b + RS]
        pending.insert(0, b)
    seq += [3 * x + AG for x in pending]
    return merge_adjacent(ev, seq) if merge else seq


def plan(profile: ModelProfile, cost_model: CostModel, world_size: int, *, fusion: Any = "auto",
         channels: int = 1, compression: CompressionCost | None = None, gap_fill: bool = True,
         merge: bool = True, sharded: ShardingArg = False) -> Schedule:
    """PipeDAP schedule with consistent costs on the fastest fusion, named ``"pipedap"``.

    Args:
        gap_fill: move all-gathers into idle gaps of the backward-time channel (step 1).
        merge: merge adjacent RS + AG into an all-reduce where cheaper (step 3).

    The other arguments (``fusion``, ``channels``, ``compression``, ``sharded``, ...), the result and the errors:
    see :func:`~lightning_pipedap.plan.planners._common.plan_over_fusions`.
    """
    return plan_over_fusions("pipedap", lambda ev: pipedap_codes(ev, gap_fill, merge), profile, cost_model,
                             world_size, fusion, channels, compression, sharded=sharded)
