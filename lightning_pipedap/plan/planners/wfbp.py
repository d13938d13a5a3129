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
from lightning_pipedap.plan.planners._common import (
    best_over_fusions, check_common, dp_backward_fusion, finish, resolve_fusion, wfbp_codes,
)
from lightning_pipedap.plan.profile import ModelProfile
from lightning_pipedap.schedule import Schedule


def plan(profile: ModelProfile, cost_model: CostModel, world_size: int, *, fusion: Any = "auto",
         channels: int = 1, compression: CompressionCost | None = None) -> Schedule:
    """WFBP schedule: ``AR(B-1) ... AR(0)``.

    Args:
        profile: layers in forward order.
        cost_model: op costs.
        world_size: number of data-parallel workers (checked against ``cost_model.meta``).
        fusion: ``"auto"``, ``"none"``, ``"single"``, a cap in bytes or explicit buckets
            (see :func:`~lightning_pipedap.plan.planners._common.resolve_fusion`).
        channels: 1 or 2 communication channels for the prediction.
        compression: optional compression cost; when given every bucket is compressed.

    Returns:
        The schedule, ``name="wfbp"``, with ``predicted_iteration_s`` set.

    Raises:
        ValueError: for a bad ``fusion``, ``world_size`` or ``channels``.
    """
    check_common(profile, cost_model, world_size, channels, compression)
    fusions = resolve_fusion(fusion, profile, cost_model)
    if fusion == "auto":
        fusions = [dp_backward_fusion(profile, cost_model.all_reduce)] + fusions
    p, ev, codes = best_over_fusions(profile, cost_model, channels, fusions, wfbp_codes, compression=compression,
                                     world_size=world_size)
    return finish("wfbp", profile, ev, codes, p)
