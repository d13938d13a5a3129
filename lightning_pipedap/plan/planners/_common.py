"""Helpers shared by the planners: contiguous tensor fusion, candidate fusions, op-list builders.

Fusions here are *contiguous*: a fusion is given by the sorted start layers of its buckets
(``starts[0] == 0``); bucket ``b`` holds layers ``starts[b] .. starts[b+1]-1`` (forward order).
Op lists are built as the evaluator's integer codes of :class:`~lightning_pipedap.schedule.Op`
(``3 * bucket + k``, k: 0 RS, 1 AG, 2 AR; see :mod:`lightning_pipedap.plan.evaluator`; ``RS``,
``AG`` and ``AR`` here are its ``K_RS``, ``K_AG`` and ``K_AR``) and evaluated with
:class:`~lightning_pipedap.plan.evaluator.Evaluator`.

Compression: every planner takes an optional
:class:`~lightning_pipedap.plan.compression.CompressionCost`. The fixed-idea planners (``wfbp``,
``dear``, ``pipedap``, ``no_overlap``) then compress every bucket (their op builders run unchanged;
a compressed bucket's RS becomes its one AR and its AG is dropped, see :func:`finish`); ``optimal``
decides per bucket.

Sharded optimizer step: every planner takes ``sharded`` (``True`` or a
:class:`~lightning_pipedap.plan.sharding.Sharding`): its candidates are evaluated with the sharded model
(:mod:`lightning_pipedap.plan.simulator`) and the schedule it returns is the op list the engine runs then,
:func:`~lightning_pipedap.schedule.sharded_ops` order (:func:`finish`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

from lightning_pipedap.plan.compression import CompressionCost
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.evaluator import K_AG as AG
from lightning_pipedap.plan.evaluator import K_AR as AR
from lightning_pipedap.plan.evaluator import K_RS as RS
from lightning_pipedap.plan.evaluator import Evaluator, code_op
from lightning_pipedap.plan.profile import ModelProfile
from lightning_pipedap.plan.sharding import ShardingArg, resolve_sharding
from lightning_pipedap.schedule import Schedule, fuse_by_size

Starts = tuple[int, ...]
OpsBuilder = Callable[[Evaluator], list[int]]
#: relative improvement a search needs to replace its incumbent (keeps ties deterministic)
TOL = 1e-12


def check_common(profile: ModelProfile, cost_model: CostModel, world_size: int, channels: int,
                 compression: CompressionCost | None = None, sharded: ShardingArg = False) -> None:
    """Validate the arguments every planner shares.

    Raises:
        ValueError: if ``world_size`` is not an int >= 1, disagrees with ``cost_model.meta['world_size']``,
            ``channels`` is not 1 or 2, or the compression's per-layer payloads do not fit the profile.
        TypeError: if ``profile``, ``cost_model``, ``compression`` or ``sharded`` has the wrong type.
    """
    resolve_sharding(sharded)
    if not isinstance(profile, ModelProfile):
        raise TypeError(f"profile must be a ModelProfile, got {type(profile).__name__}")
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    ws = cost_model.meta.get("world_size")
    if ws is not None and int(ws) != world_size:
        raise ValueError(f"cost model was built for world size {ws}, but world_size={world_size}")
    if channels not in (1, 2):
        raise ValueError(f"channels must be 1 or 2, got {channels!r}")
    if compression is not None:
        if not isinstance(compression, CompressionCost):
            raise TypeError(f"compression must be a CompressionCost or None, got {type(compression).__name__}")
        compression.check_layers(profile.num_layers)


def evaluator(profile: ModelProfile, cost_model: CostModel, buckets: Sequence[Sequence[int]], channels: int,
              world_size: int, compression: CompressionCost | None = None,
              compressed: Sequence[bool] | bool = True, wire16: Sequence[bool] | bool = False,
              sharded: ShardingArg = False) -> Evaluator:
    """An :class:`Evaluator` for ``buckets``; with ``compression``, ``compressed`` is a flag per bucket
    or one bool for all of them (default: all compressed). Without ``compression`` nothing is.
    ``wire16``: 16-bit wire flags, per bucket or one bool for every bucket not compressed. ``sharded``: the
    sharded step's model (every uncompressed bucket sharded)."""
    flags = None
    if compression is not None:
        flags = (bool(compressed),) * len(buckets) if isinstance(compressed, bool) else tuple(compressed)
    if isinstance(wire16, bool):
        half = tuple(wire16 and not (flags is not None and flags[b]) for b in range(len(buckets)))
    else:
        half = tuple(wire16)
    return Evaluator(profile, cost_model, buckets, channels, compressed=flags, compression=compression,
                     world_size=world_size, wire16=half, sharded=sharded)


def normalize_compressed(ev: Evaluator, codes: Sequence[int]) -> list[int]:
    """The op list the engine runs: a compressed bucket's RS becomes its AR (same slot) and its AG
    is dropped. The prediction does not change (the simulator treats both forms alike)."""
    if not any(ev.compressed):
        return list(codes)
    out = []
    for c in codes:
        b, k = divmod(c, 3)
        if ev.compressed[b]:
            if k == AG:
                continue
            c = 3 * b + AR
        out.append(c)
    return out


def buckets_of(starts: Starts, num_layers: int) -> tuple[tuple[int, ...], ...]:
    """Buckets (tuples of layer indices) of a contiguous fusion given by its start layers."""
    ends = list(starts[1:]) + [num_layers]
    return tuple(tuple(range(s, e)) for s, e in zip(starts, ends))


def starts_of(buckets: Sequence[Sequence[int]]) -> Starts:
    """Start layers of contiguous buckets (inverse of :func:`buckets_of`)."""
    return tuple(bk[0] for bk in buckets)


def _prefix_bytes(profile: ModelProfile) -> list[int]:
    pre = [0]
    for layer in profile.layers:
        pre.append(pre[-1] + layer.nbytes)
    return pre


def dp_backward_fusion(profile: ModelProfile, cost: Callable[[float], float]) -> Starts:
    """Contiguous fusion that minimises the end of a channel running one op per bucket in backward order.

    Exact dynamic program in O(L²): ``E[i]`` = least channel end time once layers ``i .. L-1`` are
    reduced, ``E[L] = 0``, ``E[i] = min_{j>i} max(E[j], ready(i)) + cost(bytes(i..j-1))`` with
    ``ready(i) = Σ_{k>=i} t_b(k)``. Optimal substructure holds because the end time of a bucket is
    non-decreasing in the channel's free time (the recursion of MG-WFBP, Shi et al. INFOCOM 2019,
    written for contiguous buckets). For WFBP (all-reduce per bucket) the iteration time is
    ``max(Σ t_b, E[0]) + Σ t_f + t_update``, so this fusion is the best WFBP fusion.

    Args:
        profile: layers in forward order.
        cost: seconds of the one op of a bucket of the given bytes.

    Returns:
        Bucket start layers.
    """
    L = profile.num_layers
    pre = _prefix_bytes(profile)
    suffix_tb = [0.0] * (L + 1)
    for i in range(L - 1, -1, -1):
        suffix_tb[i] = suffix_tb[i + 1] + profile.layers[i].t_b
    E = [0.0] * (L + 1)
    nxt = [L] * (L + 1)
    for i in range(L - 1, -1, -1):
        r = suffix_tb[i]
        best, arg = math.inf, L
        pi = pre[i]
        for j in range(i + 1, L + 1):
            e = E[j]
            v = (e if e > r else r) + cost(pre[j] - pi)
            if v < best:
                best, arg = v, j
        E[i], nxt[i] = best, arg
    starts, i = [], 0
    while i < L:
        starts.append(i)
        i = nxt[i]
    return tuple(starts)


def fusion_candidates(profile: ModelProfile, cost_model: CostModel, *, max_buckets: int = 512) -> list[Starts]:
    """Candidate contiguous fusions, chosen from the profile and the cost model.

    The candidates: one bucket per layer (when ``L <= max_buckets``), one bucket for the whole
    model, the DP fusions of :func:`dp_backward_fusion` for all-reduce and for reduce-scatter costs,
    and greedy size caps (:func:`lightning_pipedap.schedule.fuse_by_size`) at every power of two
    from 4 KiB to the model size. Duplicates are removed; order is deterministic.
    """
    L = profile.num_layers
    out: list[Starts] = []
    if L <= max_buckets:
        out.append(tuple(range(L)))
    out.append((0,))
    out.append(dp_backward_fusion(profile, cost_model.all_reduce))
    out.append(dp_backward_fusion(profile, cost_model.reduce_scatter))
    total = max(1, profile.total_bytes)
    cap = 4096
    sizes = profile.sizes_bytes
    while cap < 2 * total:
        out.append(starts_of(fuse_by_size(sizes, cap)))
        cap *= 2
    seen, uniq = set(), []
    for s in out:
        if s not in seen:
            seen.add(s)
            uniq.append(s)
    return uniq


def resolve_fusion(fusion: Any, profile: ModelProfile, cost_model: CostModel) -> list[Starts]:
    """Turn a planner's ``fusion`` option into candidate fusions.

    Args:
        fusion: ``"auto"`` (every candidate of :func:`fusion_candidates`; the planner keeps the best),
            ``"none"`` (one bucket per layer), ``"single"`` (one bucket), an int (greedy cap in bytes),
            or explicit contiguous buckets (a sequence of tuples of layer indices).

    Raises:
        ValueError: for an unknown string, a non-positive cap or buckets that are not contiguous
            in forward order and a partition of the layers.
    """
    L = profile.num_layers
    if isinstance(fusion, str):
        if fusion == "auto":
            return fusion_candidates(profile, cost_model)
        if fusion == "none":
            return [tuple(range(L))]
        if fusion == "single":
            return [(0,)]
        raise ValueError(f"unknown fusion {fusion!r}; valid: 'auto', 'none', 'single', a cap in bytes, or buckets")
    if isinstance(fusion, bool):
        raise ValueError(f"fusion must be 'auto', 'none', 'single', a cap in bytes or buckets, got {fusion!r}")
    if isinstance(fusion, (int, float)):
        if fusion <= 0:
            raise ValueError(f"fusion cap must be > 0 bytes, got {fusion}")
        return [starts_of(fuse_by_size(profile.sizes_bytes, int(fusion)))]
    buckets = tuple(tuple(int(i) for i in bk) for bk in fusion)
    flat = [i for bk in buckets for i in bk]
    if flat != list(range(L)):
        raise ValueError(
            f"explicit fusion must list layers 0..{L - 1} in order as contiguous buckets; got {buckets[:5]}..."
        )
    if any(not bk for bk in buckets):
        raise ValueError("explicit fusion has an empty bucket")
    return [starts_of(buckets)]


def merge_adjacent(ev: Evaluator, codes: list[int]) -> list[int]:
    """Replace every ``RS(b)`` directly followed by ``AG(b)`` with ``AR(b)`` where that is cheaper.

    Never makes the iteration slower: the AR waits for the same gradients as the RS, the channel
    order is unchanged and the AR ends no later than the AG would have (op durations enter the
    timeline only through ``max`` and ``+``, so shorter durations never delay anything).
    """
    out: list[int] = []
    i, n = 0, len(codes)
    cost = ev.cost
    while i < n:
        c = codes[i]
        if c % 3 == RS and i + 1 < n and codes[i + 1] == c + 1 and cost[c + 2] < cost[c] + cost[c + 1]:
            out.append(c + 2)
            i += 2
        else:
            out.append(c)
            i += 1
    return out


def wfbp_codes(ev: Evaluator) -> list[int]:
    """WFBP: one all-reduce per bucket in gradient-ready (backward) order ``B-1 .. 0``."""
    return [3 * b + AR for b in range(ev.B - 1, -1, -1)]


def dear_codes(ev: Evaluator) -> list[int]:
    """DeAR: reduce-scatters in backward order, then all-gathers in forward order."""
    return [3 * b + RS for b in range(ev.B - 1, -1, -1)] + [3 * b + AG for b in range(ev.B)]


def finish(name: str, profile: ModelProfile, ev: Evaluator, codes: Sequence[int],
           predicted: float | None = None) -> Schedule:
    """Build, validate and return the :class:`Schedule` with its predicted iteration time.

    With a compression cost in ``ev`` the schedule carries its flags (one per bucket) and the op
    list is normalised (:func:`normalize_compressed`); with a 16-bit wire bucket in ``ev`` it carries
    the ``wire16`` flags; with a sharded model the op list is the engine's (:meth:`Evaluator.executed_codes`).
    """
    if predicted is None:
        predicted = ev.period_codes(codes)
    codes = ev.executed_codes(normalize_compressed(ev, codes))
    sched = Schedule(buckets=ev.buckets, ops=tuple(code_op(c) for c in codes), name=name,
                     predicted_iteration_s=predicted,
                     compressed=tuple(ev.compressed) if ev.compression is not None else None,
                     wire16=tuple(ev.wire16) if any(ev.wire16) else None)
    return sched.validate(profile.num_layers)


def best_over_fusions(profile: ModelProfile, cost_model: CostModel, channels: int, fusions: Iterable[Starts],
                      builder: OpsBuilder, *, compression: CompressionCost | None = None,
                      world_size: int | None = None,
                      sharded: ShardingArg = False) -> tuple[float, Evaluator, list[int]]:
    """Evaluate ``builder`` on every fusion; return ``(iteration s, evaluator, codes)`` of the best.

    With ``compression`` every bucket is compressed; ``sharded``: the sharded model. Ties keep the earlier
    fusion (deterministic).
    """
    L = profile.num_layers
    best: tuple[float, Evaluator, list[int]] | None = None
    for st in fusions:
        ev = evaluator(profile, cost_model, buckets_of(st, L), channels, world_size, compression, sharded=sharded)
        codes = builder(ev)
        p = ev.period_codes(codes)
        if best is None or p < best[0]:
            best = (p, ev, codes)
    assert best is not None
    return best


def plan_over_fusions(name: str, builder: OpsBuilder, profile: ModelProfile, cost_model: CostModel,
                      world_size: int, fusion: Any, channels: int, compression: CompressionCost | None,
                      auto_first: Callable[[ModelProfile, CostModel], Starts] | None = None,
                      sharded: ShardingArg = False) -> Schedule:
    """The ``plan()`` of the fixed-order planners (``wfbp``, ``dear``, ``pipedap``): check the
    arguments, evaluate the op list of ``builder`` on every fusion of :func:`resolve_fusion` and
    return the fastest as a schedule.

    Args:
        name: the schedule's name (the planner's).
        builder: op list (integer codes) for an evaluator's fusion.
        profile: layers in forward order.
        cost_model: op costs.
        world_size: number of data-parallel workers (checked against ``cost_model.meta``).
        fusion: ``"auto"``, ``"none"``, ``"single"``, a cap in bytes or explicit buckets
            (see :func:`resolve_fusion`).
        channels: 1 or 2 communication channels for the prediction.
        compression: optional compression cost; when given every bucket is compressed.
        auto_first: with ``fusion="auto"``, a fusion evaluated before the candidates (ties keep it).
        sharded: plan for the sharded optimizer step (``True`` or a
            :class:`~lightning_pipedap.plan.sharding.Sharding`): every candidate evaluated with the sharded model,
            the op list returned in the engine's sharded order.

    Returns:
        The validated schedule, named ``name``, with ``predicted_iteration_s`` set.

    Raises:
        ValueError: for a bad ``fusion``, ``world_size`` or ``channels``.
        TypeError: see :func:`check_common`.
    """
    check_common(profile, cost_model, world_size, channels, compression, sharded)
    fusions = resolve_fusion(fusion, profile, cost_model)
    if auto_first is not None and fusion == "auto":
        fusions = [auto_first(profile, cost_model)] + fusions
    p, ev, codes = best_over_fusions(profile, cost_model, channels, fusions, builder, compression=compression,
                                     world_size=world_size, sharded=sharded)
    return finish(name, profile, ev, codes, p)
