"""WFBP: wait-free backpropagation with tensor fusion (Poseidon, Zhang et al. ATC 2017; MG-WFBP,
Shi et al. INFOCOM 2019): one all-reduce per bucket, issued in gradient-ready (backward) order.

With ``fusion="auto"`` the buckets come from the exact dynamic program
:func:`~lightning_pipedap.plan.planners._common.dp_backward_fusion` on all-reduce costs, which
minimises the end of the last all-reduce; for WFBP the iteration time is
``max(Σ t_b, that end) + t_update + Σ t_f``, so the fusion is optimal for this op order. The other
candidate fusions are evaluated too and the best kept (ties keep the DP's).
"""

from __future__ import annotations

from typing import Any

from lightning_pipedap.plan.compression import CompressionCost
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.planners._common import dp_backward_fusion, plan_over_fusions, wfbp_codes
from lightning_pipedap.plan.profile import ModelProfile
from lightning_pipedap.plan.sharding import ShardingArg
from lightning_pipedap.schedule import Schedule


def plan(profile: ModelProfile, cost_model: CostModel, world_size: int, *, fusion: Any = "auto",
         channels: int = 1, compression: CompressionCost | None = None, sharded: ShardingArg = False) -> Schedule:
    """WFBP schedule ``AR(B-1) ... AR(0)`` on the fastest fusion (the DP fusion first), named ``"wfbp"``.

    Arguments (``fusion``, ``channels``, ``compression``, ``sharded``, ...), result and errors: see
    :func:`~lightning_pipedap.plan.planners._common.plan_over_fusions`.
    """
    return plan_over_fusions("wfbp", wfbp_codes, profile, cost_model, world_size, fusion, channels, compression,
                             auto_first=lambda prof, cm: dp_backward_fusion(prof, cm.all_reduce), sharded=sharded)
