"""No-overlap baseline: all communication after the backward, before the next forward.

One bucket holds every layer and is reduced by one all-reduce (or RS + AG if that is cheaper), so
the iteration time is ``Σ t_b + min(T_AR, T_RS + T_AG)(model bytes) + t_update + Σ t_f``: the best
schedule that overlaps nothing (one bucket minimises the communication time, the alpha-beta cost
being subadditive). This is the reference for speedups of the overlapping planners.
"""

from __future__ import annotations

from lightning_pipedap.plan.compression import CompressionCost
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.planners._common import AG, AR, RS, check_common, evaluator, finish
from lightning_pipedap.plan.profile import ModelProfile
from lightning_pipedap.plan.sharding import ShardingArg
from lightning_pipedap.schedule import Schedule


def plan(profile: ModelProfile, cost_model: CostModel, world_size: int, *, channels: int = 1,
         compression: CompressionCost | None = None, sharded: ShardingArg = False) -> Schedule:
    """One bucket, reduced after the whole backward.

    Args:
        profile: layers in forward order.
        cost_model: op costs.
        world_size: number of data-parallel workers (checked against ``cost_model.meta``).
        channels: 1 or 2 communication channels for the prediction.
        compression: optional compression cost; when given the one bucket is compressed.
        sharded: the sharded optimizer step's model (``True`` or a ``Sharding``): the one bucket is
            reduce-scattered, stepped and its parameters all-gathered after the backward.

    Returns:
        The schedule, ``name="no_overlap"``, with ``predicted_iteration_s`` set.

    Raises:
        ValueError: see :func:`lightning_pipedap.plan.planners._common.check_common`.
    """
    check_common(profile, cost_model, world_size, channels, compression, sharded)
    ev = evaluator(profile, cost_model, (tuple(range(profile.num_layers)),), channels, world_size, compression,
                   sharded=sharded)
    codes = [AR] if ev.cost[AR] <= ev.cost[RS] + ev.cost[AG] else [RS, AG]
    return finish("no_overlap", profile, ev, codes)
