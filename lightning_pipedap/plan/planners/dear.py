"""DeAR (Zhang et al., ICDCS 2023): decoupled all-reduce. Reduce-scatters run during the backward in
gradient-ready order; all-gathers run in forward order and overlap the next forward pass.

Tensor fusion: DeAR tunes one fusion buffer size online; here the planner instead evaluates the
candidate fusions of :func:`~lightning_pipedap.plan.planners._common.fusion_candidates` (greedy
caps at every power of two, the backward-order DP fusions, one bucket per layer, one bucket) with
the simulator and keeps the fastest, so the choice comes from the profile and the cost model.
"""

from __future__ import annotations

from typing import Any

from lightning_pipedap.plan.compression import CompressionCost
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.planners._common import dear_codes, plan_over_fusions
from lightning_pipedap.plan.profile import ModelProfile
from lightning_pipedap.plan.sharding import ShardingArg
from lightning_pipedap.schedule import Schedule


def plan(profile: ModelProfile, cost_model: CostModel, world_size: int, *, fusion: Any = "auto",
         channels: int = 1, compression: CompressionCost | None = None, sharded: ShardingArg = False) -> Schedule:
    """DeAR schedule ``RS(B-1) ... RS(0) AG(0) ... AG(B-1)`` on the fastest fusion, named ``"dear"``.

    Arguments (``fusion``, ``channels``, ``compression``, ``sharded``, ...), result and errors: see
    :func:`~lightning_pipedap.plan.planners._common.plan_over_fusions`.
    """
    return plan_over_fusions("dear", dear_codes, profile, cost_model, world_size, fusion, channels, compression,
                             sharded=sharded)
