"""The sharded optimizer step in the planning model (``shard_optimizer``, issue 30): :class:`Sharding`.

With ``shard_optimizer`` the engine runs :func:`~lightning_pipedap.schedule.sharded_ops` of the planned schedule:
every gradient op in list order (an uncompressed bucket's ``AR`` becomes an ``RS``), then one ``AG`` per
uncompressed bucket in forward order. Each rank steps its ``1/N`` shard of bucket ``b`` on the communication
worker just before ``AG(b)``, once the step was recorded (after the whole backward), and ``AG(b)`` gathers the
updated *parameters*; the next forward copies them into the model ("lands" them) before the bucket's first
consumer. Compressed buckets are stepped unsharded (their update stays on the compute stream).

The simulator's model of that (:mod:`lightning_pipedap.plan.simulator`) takes these options; a planner, the
simulator or the bounds given ``sharded=True`` use ``Sharding()`` (no clip, free land).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

__all__ = ["PREPARE_BYTES_PER_LAYER", "Sharding", "assign_owners", "resolve_sharding"]

#: bytes per profile layer of the round's preparation all-reduce (float64 "used" flags, one per bucket slot; a
#: profile layer stands for its parameters): one all-reduce after the last gradient op, before the first step
PREPARE_BYTES_PER_LAYER = 8


@dataclass(frozen=True)
class Sharding:
    """Options of the sharded optimizer step's model.

    Attributes:
        clip_norm: the step clips by norm: before the first shard step every sharded bucket's averaged
            *gradients* are all-gathered (one extra ``AG`` per sharded bucket, the bucket's bytes in fp32), so that
            the clip factor is exactly the unsharded one.
        land_s_per_byte: seconds per byte of the land copy (gathered parameters into the model) that the compute
            stream pays before a sharded bucket's first forward, >= 0; the default 0 models the copy as free (a
            memory copy of the bucket, small beside its forward and far smaller than the update it replaces).
    """

    clip_norm: bool = False
    land_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.clip_norm, bool):
            raise TypeError(f"Sharding.clip_norm must be a bool, got {self.clip_norm!r}")
        v = self.land_s_per_byte
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"Sharding.land_s_per_byte must be a finite number >= 0 (s/byte), got {v!r}")


ShardingArg = Union[bool, Sharding, None]


def resolve_sharding(sharded: ShardingArg) -> Sharding | None:
    """``sharded`` as a :class:`Sharding`, or ``None`` for an unsharded model: ``False``/``None`` -> ``None``,
    ``True`` -> ``Sharding()``, a :class:`Sharding` -> itself.

    Raises:
        TypeError: for anything else (naming the valid choices).
    """
    if sharded is None or sharded is False:
        return None
    if sharded is True:
        return Sharding()
    if isinstance(sharded, Sharding):
        return sharded
    raise TypeError(f"sharded must be a bool or a Sharding(clip_norm=..., land_s_per_byte=...), got {sharded!r}")


def assign_owners(costs: Sequence[Optional[Sequence[float]]], world_size: int) -> list[Optional[list[int]]]:
    """Parameter ownership for a whole-tensor optimizer (``shard_optimizer`` with Muon, Adafactor): per bucket, the
    rank that steps each slot's whole parameter.

    Longest processing time first (Graham, 1969) inside each bucket, so every rank's region of the bucket (the
    reduce-scatter shard, padded to the largest) stays small; ties go to the rank with the least cost over the
    buckets assigned so far, so the optimizer state and step time spread over the ranks.

    Args:
        costs: per bucket, per slot the cost to balance (elements, or seconds of the parameter's optimizer step);
            None for a bucket that is not owned (compressed: stepped unsharded).
        world_size: ranks.

    Returns:
        Per bucket, per slot the owning rank (``0..world_size-1``), or None where ``costs`` has None.

    Raises:
        ValueError: if ``world_size < 1`` or a cost is negative or not finite.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    total = [0.0] * world_size
    out: list[Optional[list[int]]] = []
    for b, row in enumerate(costs):
        if row is None:
            out.append(None)
            continue
        for c in row:
            if not (math.isfinite(c) and c >= 0):
                raise ValueError(f"bucket {b}: costs must be finite and >= 0, got {c!r}")
        load = [0.0] * world_size
        owners = [0] * len(row)
        for slot in sorted(range(len(row)), key=lambda k: (-row[k], k)):
            r = min(range(world_size), key=lambda q: (load[q], total[q], q))
            owners[slot] = r
            load[r] += row[slot]
            total[r] += row[slot]
        out.append(owners)
    return out
