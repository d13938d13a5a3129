"""The sharded optimizer step in the planning model (``shard_optimizer``, issue 30): :class:`Sharding`.

With ``shard_optimizer`` the engine runs :func:`~lightning_pipedap.schedule.sharded_ops` of the planned schedule:
every gradient op in list order (an uncompressed bucket's ``AR`` becomes an ``RS``), then one ``AG`` per
uncompressed bucket in forward order. Each rank steps its ``1/N`` shard of bucket ``b`` on the communication
worker just before ``AG(b)``, once the step was recorded (after the whole backward), and ``AG(b)`` gathers the
updated *parameters*; the next forward copies them into the model ("lands" them) before the bucket's first
consumer. Compressed buckets are stepped unsharded (their update stays on the compute stream).

The simulator's model of that (:mod:`lightning_pipedap.plan.simulator`) takes these options; a planner, the
simulator or the bounds given ``sharded=True`` use ``Sharding()`` (no clip, free land, element-wise shards). The
strategy passes the measured ones (:attr:`Sharding.land_s_per_byte` from its profiling steps' land copies,
:attr:`Sharding.owned` under parameter ownership): ``strategy/candidates.py``.

**Parameter ownership** (a whole-tensor optimizer: Muon, Adafactor; :attr:`Sharding.owned`). The engine lays each
sharded bucket out so that every parameter lies whole in its owner's region (:func:`assign_owners` over the
bucket's parameters, ``engine/buckets.py: _owned_layout``): every region is padded to the largest, so the
reduce-scatter and the all-gather move ``N x`` the largest rank's bytes, not the bucket's bytes, and the step of
the bucket takes as long as its slowest owner's share. :func:`owned_buckets` reproduces that layout from the
per-parameter sizes and costs, bucket by bucket in forward order as the engine assigns them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

__all__ = ["FLAG_BYTES", "PREPARE_BYTES_PER_LAYER", "OwnedBucket", "Sharding", "assign_owners", "owned_buckets",
           "resolve_sharding"]

#: bytes per profile layer of the round's preparation all-reduce (float64 "used" flags, one per bucket slot; a
#: profile layer stands for its parameters): one all-reduce after the last gradient op, before the first step
PREPARE_BYTES_PER_LAYER = 8

#: bytes of one used flag in a bucket's buffer (one element per slot after the last rank's slots; the buffer has the
#: parameters' dtype, fp32 assumed here): part of the last region under parameter ownership
FLAG_BYTES = 4

#: per profile layer, per parameter of it (engine order): ``(bytes, cost)``, the cost :func:`assign_owners` balances
OwnedSpec = tuple[tuple[tuple[int, float], ...], ...]


@dataclass(frozen=True)
class Sharding:
    """Options of the sharded optimizer step's model.

    Attributes:
        clip_norm: the step clips by norm: before the first shard step every sharded bucket's averaged
            *gradients* are all-gathered (one extra ``AG`` per sharded bucket, the bucket's bytes in fp32), so that
            the clip factor is exactly the unsharded one.
        land_s_per_byte: seconds per byte of the land copy (gathered parameters into the model) that the compute
            stream pays before a sharded bucket's first forward, >= 0; the default 0 models the copy as free. The
            strategy passes the rate measured in its profiling steps (the sync step's land copies, timed:
            :attr:`~lightning_pipedap.engine.shard_step.ShardedStep.sync_land`).
        owned: parameter ownership (whole-tensor optimizers): per profile layer, per parameter ``(bytes, cost)``
            (cost: what :func:`assign_owners` balances, the measured optimizer step seconds or the elements, as the
            engine is given); None: element-wise shards (``1/N`` of every bucket, negligible padding). With it a
            sharded bucket's RS and AG move the padded bytes and its step is the slowest owner's share
            (:func:`owned_buckets`).
    """

    clip_norm: bool = False
    land_s_per_byte: float = 0.0
    owned: Optional[OwnedSpec] = None

    def __post_init__(self) -> None:
        if not isinstance(self.clip_norm, bool):
            raise TypeError(f"Sharding.clip_norm must be a bool, got {self.clip_norm!r}")
        v = self.land_s_per_byte
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"Sharding.land_s_per_byte must be a finite number >= 0 (s/byte), got {v!r}")
        if self.owned is not None:
            try:
                owned = tuple(tuple((int(n), float(c)) for n, c in layer) for layer in self.owned)
            except (TypeError, ValueError) as exc:
                raise ValueError("Sharding.owned must give, per profile layer, per parameter a pair (bytes, cost), got "
                                 f"{self.owned!r}") from exc
            bad = [(n, c) for layer in owned for n, c in layer if n < 0 or not (math.isfinite(c) and c >= 0)]
            if bad:
                raise ValueError(f"Sharding.owned: bytes and costs must be >= 0 and finite, got {bad[0]!r}")
            object.__setattr__(self, "owned", owned)


@dataclass(frozen=True)
class OwnedBucket:
    """One sharded bucket under parameter ownership (:func:`owned_buckets`).

    Attributes:
        wire_bytes: bytes of the padded buffer, ``N x`` the largest region (what the RS and the AG move, as
            :attr:`~lightning_pipedap.engine.buckets.FlatBucket.nbytes`).
        data_bytes: the parameters' bytes (unpadded).
        step_share: the slowest owner's share of the bucket's optimizer step (its cost over the bucket's; ``1/N``
            when the bucket costs nothing).
    """

    wire_bytes: int
    data_bytes: int
    step_share: float

    @property
    def padding(self) -> float:
        """Share of :attr:`wire_bytes` that is padding (and used flags), 0..1."""
        return 1.0 - self.data_bytes / self.wire_bytes if self.wire_bytes > 0 else 0.0


def owned_buckets(owned: OwnedSpec, buckets: Sequence[Sequence[int]], sharded: Sequence[bool],
                  world_size: int) -> list[Optional[OwnedBucket]]:
    """The ownership layout of each sharded bucket, as the engine builds it: :func:`assign_owners` over every
    bucket's parameters in forward order (the profile layers' parameters concatenated), then each region padded to
    the largest (the used flags, :data:`FLAG_BYTES` each, after the last rank's parameters).

    Args:
        owned: :attr:`Sharding.owned` (per profile layer, per parameter ``(bytes, cost)``).
        buckets: profile layer indices per bucket.
        sharded: per bucket, whether it is stepped sharded (a compressed one is not: None in the result).
        world_size: ranks (>= 1).

    Returns:
        Per bucket an :class:`OwnedBucket`, or None for an unsharded one.

    Raises:
        ValueError: if a bucket names a layer ``owned`` does not have, or ``world_size < 1``.
    """
    rows: list[Optional[list[tuple[int, float]]]] = []
    for b, bk in enumerate(buckets):
        if not sharded[b]:
            rows.append(None)
            continue
        bad = [i for i in bk if not 0 <= i < len(owned)]
        if bad:
            raise ValueError(f"bucket {b} names layer {bad[0]}; Sharding.owned describes layers 0..{len(owned) - 1}")
        rows.append([pc for i in bk for pc in owned[i]])
    owners = assign_owners([None if r is None else [c for _, c in r] for r in rows], world_size)
    out: list[Optional[OwnedBucket]] = []
    for row, own in zip(rows, owners):
        if row is None or own is None:
            out.append(None)
            continue
        load, cost = [0] * world_size, [0.0] * world_size
        for (n, c), r in zip(row, own):
            load[r] += n
            cost[r] += c
        load[-1] += FLAG_BYTES * len(row)
        total = sum(cost)
        out.append(OwnedBucket(world_size * max(load), sum(n for n, _ in row),
                               max(cost) / total if total > 0 else 1.0 / world_size))
    return out


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
    raise TypeError(f"sharded must be a bool or a Sharding(clip_norm=..., land_s_per_byte=..., owned=...), got "
                    f"{sharded!r}")


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
