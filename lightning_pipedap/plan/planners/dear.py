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
from lightning_pipedap.plan.planners._common import best_over_fusions, check_common, dear_codes, finish, resolve_fusion
from lightning_pipedap.plan.profile import ModelProfile
from lightning_pipedap.schedule import Schedule


def plan(profile: ModelProfile, cost_model: CostModel, world_size: int, *, fusion: Any = "auto",
         channels: int = 1, compression: CompressionCost | None = None) -> Schedule:
    """DeAR schedule: ``RS(B-1) ... RS(0) AG(0) ... AG(B-1)``.

    Args:
        profile: layers in forward order.
        cost_model: op costs.
        world_size: number of data-parallel workers (checked against ``cost_model.meta``).
        fusion: ``"auto"``, ``"none"``, ``"single"``, a cap in bytes or explicit buckets.
        channels: 1 or 2 communication channels for the prediction.
        compression: optional compression cost; when given every bucket is compressed.

    Returns:
        The schedule, ``name="dear"``, with ``predicted_iteration_s`` set.

    Raises:
        ValueError: for a bad ``fusion``, ``world_size`` or ``channels``.
    """
    check_common(profile, cost_model, world_size, channels, compression)
    fusions = resolve_fusion(fusion, profile, cost_model)
    p, ev, codes = best_over_fusions(profile, cost_model, channels, fusions, dear_codes, compression=compression,
                                     world_size=world_size)
    return finish("dear", profile, ev, codes, p)
