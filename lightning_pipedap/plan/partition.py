"""Tensor partitioning for the planners: split large layers of a profile into piece-layers.

ByteScheduler (Peng et al., SOSP 2019) and PipeDAP (TETC 2025 §IV-C) partition a large gradient
tensor into pieces so that its communication can be fused with, and pipelined against, its
neighbours' at a finer grain. Here the planners stay as they are: :func:`partition_profile` turns a
:class:`~lightning_pipedap.plan.profile.ModelProfile` into one whose large layers are replaced by
consecutive *piece-layers*, the planners fuse and order piece-layers like any other layers, and
:func:`expand_pieces` turns the resulting schedule over piece-layers into an engine schedule over
parameters with :attr:`~lightning_pipedap.schedule.Schedule.pieces` (element ranges of parameters).

**Timing semantics** (so that the unchanged :class:`~lightning_pipedap.plan.evaluator.Evaluator`,
:func:`~lightning_pipedap.plan.simulator.simulate` and every planner model a split layer exactly).
A layer ``i`` of ``t_f``, ``t_b`` split into pieces ``i_0 .. i_{k-1}`` (forward order, element order):

* *Backward produces the gradient whole*: every piece's gradient is complete at the same moment, when
  the layer's backward ends. The evaluator's gradient-ready time of a bucket is
  ``suffix_tb[min(bucket)] = Σ_{j >= min(bucket)} t_b[j]`` (the backward runs layers ``L-1 .. 0``), so
  the whole ``t_b`` goes on the **last** piece ``i_{k-1}`` (the first one the backward walks) and the
  other pieces get ``t_b = 0``: then ``suffix_tb[i_0] = ... = suffix_tb[i_{k-1}]`` = the end of the
  layer's backward, whatever buckets the pieces land in, and the backward as a whole is unchanged
  (same Σ t_b, same ready times of every other layer).
* *Forward needs the weights whole*: the layer's forward can start only after every piece's bucket has
  been reduced (AG/AR done) and updated. The evaluator walks the layers in forward order and, at the
  first layer of a bucket not yet waited for, waits for that bucket's reduction and charges its update
  share, then runs the layer's ``t_f``. With the whole ``t_f`` on the **last** piece and ``t_f = 0``
  on the others, the walk waits for the buckets of ``i_0, i_1, ...`` in turn (each zero-time piece
  waits for its own bucket) and runs the layer's forward after the last of them: exactly "the layer
  starts when all its pieces are ready".
* *Optimizer update*: the profile has one ``t_update`` for the whole model, which the evaluator
  shares among buckets by bytes (``t_update * bytes(b) / total bytes``, charged on the compute stream
  at the bucket's first use in forward); piece-layers carry their share of the layer's bytes, so a
  split layer's update is split by bytes over its pieces' buckets. The engine, however, updates a
  split parameter once, when the last of its buckets is applied
  (:mod:`lightning_pipedap.schedule`), so where a piece's bucket is used before the layer's last
  bucket the evaluator charges part of that update too early and can be optimistic by at most the
  split layers' update share ``t_update * bytes(split layers) / total bytes`` (exact when
  ``t_update = 0``, as in the published profiles, or when a layer's pieces share one bucket).
  :func:`engine_period` recomputes the iteration time with the engine's rule; the strategy compares
  partitioned and unpartitioned plans with it.

Hence a schedule over the partitioned profile in which every piece of a layer shares one bucket has
the same simulated iteration time as the unpartitioned schedule with that layer in that bucket, and
partitioning can only help where a piece of a large layer can be fused with a neighbour's bucket
or its collectives be ordered apart; it cannot make a gradient ready earlier (see docs/PLANNERS.md).

**Elements.** Pieces split on element boundaries of the layer's gradient flattened (its parameters
concatenated in the layer's parameter order). A layer's element count is its ``numel`` when the
profile knows it, else ``nbytes // bytes_per_element`` with ``bytes_per_element`` from the argument,
the profile's ``meta["bytes_per_element"]``, or 4 (fp32). Piece ``j`` of ``k`` holds elements
``[floor(j * n / k), floor((j + 1) * n / k))`` and bytes ``floor(stop * nbytes / n) - floor(start *
nbytes / n)`` (sizes differ by at most one element; bytes add up to the layer's exactly).

Nothing here imports ``torch`` or ``torch.distributed``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Sequence

from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.evaluator import Evaluator
from lightning_pipedap.plan.profile import LayerProfile, ModelProfile
from lightning_pipedap.schedule import OpKind, Schedule, expand_layers, split_buckets

__all__ = ["MAX_BUDGET_SCALE", "PartitionChoice", "PieceMap", "choose_partition", "describe_partition", "engine_period",
           "expand_pieces", "fused_pieces", "is_split", "layer_numels", "partition_profile", "piece_schedule_to_layers"]

#: ``piece_map[j] = (layer, start, stop)``: piece-layer ``j`` of the partitioned profile is elements
#: ``[start, stop)`` of layer ``layer`` of the original profile (flattened); plain data (JSON-able as lists)
PieceMap = tuple[tuple[int, int, int], ...]


def layer_numels(profile: ModelProfile, bytes_per_element: int | None = None) -> tuple[int, ...]:
    """Element count of each layer of ``profile`` (forward order).

    ``layer.numel`` when known; else ``nbytes // bytes_per_element`` with ``bytes_per_element`` from the
    argument, ``profile.meta["bytes_per_element"]``, or 4 (fp32 gradients).

    Raises:
        ValueError: ``bytes_per_element`` not an int > 0, or a layer without ``numel`` whose ``nbytes``
            is not a multiple of it (the layer is named).
    """
    bpe = bytes_per_element if bytes_per_element is not None else profile.meta.get("bytes_per_element", 4)
    if isinstance(bpe, bool) or not isinstance(bpe, int) or bpe <= 0:
        raise ValueError(f"bytes_per_element must be an int > 0 (fp32: 4, fp16/bf16: 2), got {bpe!r}")
    out = []
    for layer in profile.layers:
        if layer.numel is not None:
            out.append(int(layer.numel))
        elif layer.nbytes % bpe:
            raise ValueError(f"layer {layer.name!r} has {layer.nbytes} bytes and no element count; "
                             f"{layer.nbytes} is not a "
                             f"multiple of bytes_per_element={bpe} (give the profile's numel or bytes_per_element)")
        else:
            out.append(layer.nbytes // bpe)
    return tuple(out)


def partition_profile(profile: ModelProfile, piece_bytes: float, *,
                      bytes_per_element: int | None = None) -> tuple[ModelProfile, PieceMap]:
    """Split every layer larger than ``piece_bytes`` into ``k = ceil(nbytes / piece_bytes)`` piece-layers.

    Args:
        profile: layers in forward order.
        piece_bytes: largest piece wanted, in bytes (> 0, finite); e.g. ``4 * 2**20`` for 4 MiB. A
            layer of ``nbytes <= piece_bytes`` is kept whole. A layer is never split into more pieces
            than it has elements.
        bytes_per_element: element size (bytes) for layers whose ``numel`` is unknown (see
            :func:`layer_numels`).

    Returns:
        ``(partitioned, piece_map)``: the partitioned profile (same name and ``t_update``; ``meta`` gets
        ``"partition": {"piece_bytes": ..., "split": {layer: k, ...}}``), whose piece-layers are named
        ``"<layer>#<j>/<k>"`` and follow the timing semantics of the module docstring (the layer's whole
        ``t_f`` and ``t_b`` on its last piece, 0 on the others, bytes split on element boundaries), and
        the :data:`PieceMap` ``piece_map[j] = (original layer, element start, element stop)`` of every
        piece-layer (a layer kept whole maps to ``(i, 0, numel)``).

    Raises:
        ValueError: ``piece_bytes`` not a finite number > 0; element counts as in :func:`layer_numels`.
    """
    if isinstance(piece_bytes, bool) or not isinstance(piece_bytes, (int, float)) \
            or not (piece_bytes > 0 and math.isfinite(piece_bytes)):
        raise ValueError(f"piece_bytes must be a finite number of bytes > 0 (e.g. 4 * 2**20 for 4 MiB), "
                         f"got {piece_bytes!r}")
    numels = layer_numels(profile, bytes_per_element)
    layers: list[LayerProfile] = []
    pmap: list[tuple[int, int, int]] = []
    split: dict[int, int] = {}
    for i, (layer, n) in enumerate(zip(profile.layers, numels)):
        k = min(math.ceil(layer.nbytes / piece_bytes), n) if layer.nbytes > piece_bytes else 1
        if k <= 1:
            layers.append(layer)
            pmap.append((i, 0, n))
            continue
        split[i] = k
        for j in range(k):
            start, stop = j * n // k, (j + 1) * n // k
            nbytes = stop * layer.nbytes // n - start * layer.nbytes // n
            last = j == k - 1
            layers.append(LayerProfile(f"{layer.name}#{j}/{k}", nbytes, layer.t_f if last else 0.0,
                                       layer.t_b if last else 0.0, stop - start))
            pmap.append((i, start, stop))
    if not split:
        return profile, tuple(pmap)
    meta = dict(profile.meta, partition={"piece_bytes": piece_bytes, "split": split})
    return ModelProfile(profile.name, tuple(layers), profile.t_update, meta), tuple(pmap)


def is_split(piece_map: PieceMap) -> bool:
    """Whether ``piece_map`` splits any layer (more than one piece-layer maps to one layer)."""
    return len({p[0] for p in piece_map}) != len(piece_map)


def describe_partition(piece_map: PieceMap, profile: ModelProfile | None = None) -> str:
    """One phrase for logs: ``"2 layers split into 9 pieces (fc1: 5, fc2: 4)"`` (names from the original
    ``profile`` when given, else layer indices), or ``"no layer split"``."""
    counts: dict[int, int] = {}
    for layer, _, _ in piece_map:
        counts[layer] = counts.get(layer, 0) + 1
    split = {i: k for i, k in counts.items() if k > 1}
    if not split:
        return "no layer split"
    names = [f"{profile.layers[i].name if profile is not None else i}: {k}" for i, k in split.items()]
    more = f", ... ({len(names) - 6} more)" if len(names) > 6 else ""
    return (f"{len(split)} layer{'s' * (len(split) != 1)} split into {sum(split.values())} pieces "
            f"({', '.join(names[:6])}{more})")


def fused_pieces(buckets: Sequence[Sequence[int]], piece_map: PieceMap) -> tuple[int, int]:
    """``(pieces, split layers)`` that a schedule over the piece-layers of ``piece_map`` really sends: the
    piece-layers of one layer that fall into the same bucket are one element range there (tensor fusion
    merges them), so a layer is split only when its piece-layers land in more than one bucket."""
    bucket_of = {j: b for b, bucket in enumerate(buckets) for j in bucket}
    holders: dict[int, set[int]] = {}
    for j, (layer, _, _) in enumerate(piece_map):
        holders.setdefault(layer, set()).add(bucket_of[j])
    split = [len(bs) for bs in holders.values() if len(bs) > 1]
    return sum(split), len(split)


def _check_piece_map(piece_map: PieceMap, layers: Sequence[Sequence[int]], numels: Sequence[int]) -> None:
    ends = [0] * len(layers)
    for j, pc in enumerate(piece_map):
        if not (len(pc) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in pc)):
            raise ValueError(f"piece_map[{j}] must be a (layer, start, stop) triple of ints, got {pc!r}")
        k, start, stop = pc
        if not 0 <= k < len(layers):
            raise ValueError(f"piece_map[{j}] = {pc} names layer {k}; valid layers are 0..{len(layers) - 1}")
        if start != ends[k] or stop < start:
            raise ValueError(f"piece_map[{j}] = {pc}: the pieces of layer {k} must be consecutive element ranges "
                             f"from 0 in piece order; expected start {ends[k]}")
        ends[k] = stop
    for k, layer in enumerate(layers):
        total = sum(numels[p] for p in layer)
        if ends[k] != total:
            raise ValueError(f"the pieces of layer {k} cover elements [0, {ends[k]}) "
                             f"but its parameters {list(layer)[:10]} "
                             f"have {total} elements; the piece map does not match the parameters")


def piece_schedule_to_layers(schedule: Schedule, piece_map: PieceMap) -> Schedule | None:
    """The same schedule over the original layers when every layer's pieces share one bucket (piece-layer
    indices replaced by their layer, each layer once, first occurrence order); ``None`` when some layer's
    pieces are in different buckets."""
    bucket_of: dict[int, int] = {}
    buckets = []
    for b, bk in enumerate(schedule.buckets):
        out: list[int] = []
        for j in bk:
            k = piece_map[j][0]
            if bucket_of.setdefault(k, b) != b:
                return None
            if k not in out:
                out.append(k)
        buckets.append(tuple(out))
    return Schedule(tuple(buckets), schedule.ops, schedule.name, schedule.predicted_iteration_s, schedule.compressed,
                    schedule.wire16)


def expand_pieces(schedule: Schedule, piece_map: PieceMap, layers: Sequence[Sequence[int]], numels: Sequence[int],
                  keys: Sequence[object] | None = None) -> Schedule:
    """Turn a schedule over piece-layers into an engine schedule over parameters with ``pieces``.

    The piece-aware form of :func:`~lightning_pipedap.schedule.expand_layers`. Piece-layer ``j`` covers
    elements ``[a, b)`` of layer ``piece_map[j][0]``'s parameters concatenated (``layers[k]`` order); it
    becomes one unit ``(param, lo, hi)`` per parameter it overlaps (``lo``, ``hi``: elements of that
    parameter flattened). In a bucket, units in bucket order; consecutive units of one parameter that
    touch are merged (a bucket holding all of a layer's pieces holds its parameters whole). Units are
    numbered by ``(param, lo)``, so each parameter's pieces are consecutive and in element order (what
    :meth:`Schedule.validate` requires). Buckets are split where ``keys`` change and ops repeated per part
    exactly as :func:`expand_layers` does.

    Args:
        schedule: buckets of piece-layer indices (a schedule planned on the :func:`partition_profile` profile).
        piece_map: the :data:`PieceMap` of that partition.
        layers: ``layers[k]`` = parameter indices of original layer ``k``.
        numels: ``numels[p]`` = element count of parameter ``p`` (``params[p].numel()``).
        keys: optional per-parameter key (for example ``(dtype, device)``).

    Returns:
        The validated engine schedule (``validate(len(numels), numels)``), same name, prediction and flags
        per part. When no parameter ends up split (every layer's pieces in one bucket, in particular an
        identity ``piece_map``), exactly what ``expand_layers`` returns for the same schedule over layers
        (``pieces`` None).

    Raises:
        ValueError: the piece map does not match ``layers``/``numels`` (pieces not consecutive from 0, or
            not covering a layer's elements), a bucket names a piece-layer outside the map, a parameter of
            0 elements when some parameter is split, or the result fails validation.
    """
    num_params = sum(len(layer_params) for layer_params in layers)
    if len(numels) != num_params:
        raise ValueError(f"numels has {len(numels)} entries; layers name {num_params} parameters")
    _check_piece_map(piece_map, layers, numels)
    for b, bk in enumerate(schedule.buckets):
        bad = [j for j in bk if not 0 <= j < len(piece_map)]
        if bad:
            raise ValueError(f"bucket {b} names piece-layer {bad[0]}; valid piece-layers are 0..{len(piece_map) - 1}")
    by_layer = piece_schedule_to_layers(schedule, piece_map)
    if by_layer is not None:
        return expand_layers(by_layer, layers, keys)
    empty = [p for p in range(num_params) if numels[p] == 0]
    if empty:
        raise ValueError(f"parameters {empty[:10]} have 0 elements; a schedule with pieces cannot hold them "
                         "(a piece is a non-empty element range), so this schedule cannot split layers")
    offsets: list[list[tuple[int, int]]] = []  # per layer: (param, first element in the layer)
    for layer in layers:
        off, row = 0, []
        for p in layer:
            row.append((p, off))
            off += numels[p]
        offsets.append(row)
    bucket_units: list[list[tuple[int, int, int]]] = []
    for bk in schedule.buckets:
        units: list[tuple[int, int, int]] = []
        for j in bk:
            k, a, b = piece_map[j]
            for p, off in offsets[k]:
                n = numels[p]
                lo, hi = max(a, off) - off, min(b, off + n) - off
                if lo >= hi:
                    continue
                if units and units[-1][0] == p and units[-1][2] == lo:
                    units[-1] = (p, units[-1][1], hi)
                else:
                    units.append((p, lo, hi))
        bucket_units.append(units)
    order = sorted(u for units in bucket_units for u in units)
    index = {u: i for i, u in enumerate(order)}
    parts: list[list[tuple[int, ...]]] = []
    for units in bucket_units:
        groups: list[list[int]] = []
        for u in units:
            if groups and (keys is None or keys[u[0]] == keys[order[groups[-1][-1]][0]]):
                groups[-1].append(index[u])
            else:
                groups.append([index[u]])
        parts.append([tuple(g) for g in groups])
    return split_buckets(schedule, parts, num_params, numels, tuple(order))


def engine_period(profile: ModelProfile, piece_map: PieceMap, cost_model: CostModel, schedule: Schedule, *,
                  channels: int = 1) -> float:
    """Steady-state iteration time (s) of a schedule over piece-layers with the engine's update rule.

    Same model as :func:`~lightning_pipedap.plan.simulator.simulate` (backward, op list, next forward; see
    that module), except for the optimizer update: the update share ``t_update * bytes / total bytes`` of a
    layer kept whole is charged when its bucket is first used in forward (as the simulator does), that of
    a *split* layer once, in full, when the last of its pieces' buckets is first used (the engine updates a
    split parameter once, from all its reduced pieces). Equals ``simulate(...).iteration_s`` when
    ``t_update = 0`` or when every split layer's pieces share one bucket; otherwise it is >= it (the
    simulator charges part of the update earlier, see the module docstring).

    Args:
        profile: the partitioned profile (:func:`partition_profile`).
        piece_map: its :data:`PieceMap`.
        cost_model: op costs.
        schedule: buckets of piece-layer indices and the op list (uncompressed; ``wire16`` honoured).
        channels: 1 or 2.

    Raises:
        ValueError: the schedule is not executable on the profile, compresses a bucket, or ``piece_map``
            does not have one entry per piece-layer.
    """
    if len(piece_map) != profile.num_layers:
        raise ValueError(f"piece_map has {len(piece_map)} entries for {profile.num_layers} piece-layers")
    if schedule.num_compressed:
        raise ValueError("engine_period models uncompressed schedules only (partitioning is off with compression)")
    schedule.validate(profile.num_layers)
    ev = Evaluator(profile, cost_model, schedule.buckets, channels, wire16=schedule.wire16)
    P, timings, _ = ev.run(schedule.ops)
    shift = P - ev.t_backward  # iteration-origin frame -> backward-start frame
    done = [0.0] * ev.B
    for t in timings:
        if t.op.kind is not OpKind.REDUCE_SCATTER:
            done[t.op.bucket] = t.end - shift
    total = profile.total_bytes
    share = [profile.t_update * layer.nbytes / total if total > 0 else 0.0 for layer in profile.layers]
    if total <= 0:
        return P  # no bytes: the update is shared per bucket, nothing is split
    bucket_of = {j: b for b, bk in enumerate(schedule.buckets) for j in bk}
    pieces_of: dict[int, list[int]] = {}
    for j, (k, _, _) in enumerate(piece_map):
        pieces_of.setdefault(k, []).append(j)
    split_buckets = {k: {bucket_of[j] for j in js} for k, js in pieces_of.items() if len(js) > 1}
    split_share = {k: sum(share[j] for j in pieces_of[k]) for k in split_buckets}
    whole_share = [0.0] * ev.B
    for j, (k, _, _) in enumerate(piece_map):
        if k not in split_buckets:
            whole_share[bucket_of[j]] += share[j]
    cur = ev.t_backward
    waited: set[int] = set()
    for j, layer in enumerate(profile.layers):
        b = bucket_of[j]
        if b not in waited:
            waited.add(b)
            cur = max(cur, done[b]) + whole_share[b]
            for k, bs in split_buckets.items():
                if b in bs and bs <= waited:
                    cur += split_share[k]
        cur += layer.t_f
    return cur


@dataclass(frozen=True)
class PartitionChoice:
    """What :func:`choose_partition` decided.

    Attributes:
        profile: the partitioned profile (the input profile itself when nothing was split).
        piece_map: its :data:`PieceMap`.
        schedule: the planner's schedule over the piece-layers, ``predicted_iteration_s`` from
            :func:`engine_period` (s), named ``"<planner>+pieces<MiB>MiB"``; ``None`` when no layer was split.
        unpartitioned_s: the unpartitioned plan's predicted iteration time (s).
        partitioned_s: ``schedule``'s predicted iteration time (s), or ``None``.
        keep: whether the partitioned plan is predicted faster by more than the margin.
        line: the log line (both predictions in ms, what was split into how many pieces, the choice).
    """

    profile: ModelProfile
    piece_map: PieceMap
    schedule: Schedule | None
    unpartitioned_s: float
    partitioned_s: float | None
    keep: bool
    line: str


#: ``optimal``'s budgets scaled by :func:`choose_partition` on a partitioned profile
_SCALED_BUDGETS = ("max_fusion_evals", "max_fusion_work")
#: largest scale factor of those budgets (planning time grows about linearly with it)
MAX_BUDGET_SCALE = 10
#: most piece-layers :func:`choose_partition` plans: a smaller ``piece_bytes`` is raised to keep within it (the
#: planners' time grows with the number of layers)
MAX_PIECE_LAYERS = 4096


def choose_partition(profile: ModelProfile, cost_model: CostModel, world_size: int, planner_name: str,
                     unpartitioned: Schedule, piece_bytes: float, *, wire16: bool = False,
                     margin: float = 0.01, channels: int = 1) -> PartitionChoice:
    """Plan on the partitioned profile too, and say whether that plan beats ``unpartitioned`` by > ``margin``.

    Args:
        profile: the (unpartitioned) profile, layers in forward order.
        cost_model: the α-β model planned with.
        world_size: ranks.
        planner_name: the planner (:func:`~lightning_pipedap.plan.planners.get_planner`) that made
            ``unpartitioned``; it plans the partitioned profile the same way (with ``wire16``: ``optimal``
            chooses the 16-bit wire format per bucket, the other planners get it on every bucket, as in
            :mod:`~lightning_pipedap.plan.candidates`). ``optimal``'s fusion-search budgets
            (``max_fusion_evals``, ``max_fusion_work``: counts, not time) are multiplied by
            ``min(MAX_BUDGET_SCALE, ceil(piece-layers / layers))``: its search is budgeted, and on many more
            layers the default budgets can end worse than the unpartitioned plan, although every
            unpartitioned plan is also a partitioned one (docs/PLANNERS.md, "Tensor partitioning").
        unpartitioned: its schedule over ``profile`` with ``predicted_iteration_s`` set (s).
        piece_bytes: :func:`partition_profile`'s piece size (bytes > 0).
        wire16: the 16-bit wire format is allowed.
        margin: relative gain needed to keep the partitioned plan (0.01: 1%).
        channels: communication channels of the model (1 or 2).

    Returns:
        A :class:`PartitionChoice`; ``keep`` iff ``partitioned_s < unpartitioned_s * (1 - margin)``, with
        ``partitioned_s`` from :func:`engine_period` (the engine's update rule for split layers).

    Raises:
        ValueError: ``piece_bytes`` or the element counts as in :func:`partition_profile`; ``unpartitioned``
            without a prediction; an unknown planner.
    """
    from lightning_pipedap.plan.candidates import wire16_everywhere  # noqa: PLC0415 (candidates imports planners)
    from lightning_pipedap.plan.planners import get_planner  # noqa: PLC0415

    if unpartitioned.predicted_iteration_s is None:
        raise ValueError("unpartitioned has no predicted_iteration_s; "
                         "give the planner's schedule (with its prediction)")
    u = unpartitioned.predicted_iteration_s
    asked = piece_bytes
    pieces = sum(max(1, math.ceil(layer.nbytes / piece_bytes)) for layer in profile.layers) if piece_bytes > 0 else 0
    if pieces > MAX_PIECE_LAYERS:  # (the planners' cost grows with the layers: keep the search bounded)
        piece_bytes = math.ceil(sum(layer.nbytes for layer in profile.layers) / (MAX_PIECE_LAYERS - profile.num_layers))
    pp, pmap = partition_profile(profile, piece_bytes)
    mib = f"{piece_bytes / 2**20:g}"
    if piece_bytes != asked:
        mib += f" (raised from {asked / 2**20:g}: at most {MAX_PIECE_LAYERS} piece-layers are planned)"
    if not is_split(pmap):
        return PartitionChoice(profile, pmap, None, u, None, False,
                               f"pipedap: partition_mb={mib}: no layer is larger than {mib} MiB, nothing to split; "
                               f"predicted iteration {u * 1e3:.1f} ms unpartitioned ({unpartitioned.name})")
    planner = get_planner(planner_name)
    kw: dict = {"wire16": True} if wire16 and planner_name == "optimal" else {}
    if planner_name == "optimal":
        scale = min(MAX_BUDGET_SCALE, math.ceil(pp.num_layers / profile.num_layers))
        defaults = inspect.signature(planner).parameters
        kw.update({k: defaults[k].default * scale for k in _SCALED_BUDGETS if k in defaults})
    s = planner(pp, cost_model, world_size, channels=channels, **kw)
    if wire16 and planner_name != "optimal":
        s = wire16_everywhere(pp, cost_model, s)
    p = engine_period(pp, pmap, cost_model, s, channels=channels)
    s = dataclasses.replace(s, name=f"{unpartitioned.name}+pieces{piece_bytes / 2**20:g}MiB", predicted_iteration_s=p)
    keep = p < u * (1.0 - margin)
    merged = piece_schedule_to_layers(s, pmap) is not None
    n_pieces, n_split = fused_pieces(s.buckets, pmap)
    line = (f"pipedap: partition_mb={mib}: {describe_partition(pmap, profile)} for planning; predicted iteration "
            f"{p * 1e3:.1f} ms partitioned ({s.name}, {len(s.buckets)} buckets, "
            + ("every layer whole in one bucket" if merged else
               f"after tensor fusion {n_split} layer{'s' * (n_split != 1)} in {n_pieces} pieces")
            + f") vs {u * 1e3:.1f} ms unpartitioned "
            f"({unpartitioned.name}, {len(unpartitioned.buckets)} buckets; α-β model with the engine's update rule, "
            "without the contention model of the candidates' predictions): keeping the "
            + ("partitioned plan" if keep else "unpartitioned plan (" + (
                "the partitioned one is not predicted faster)" if p >= u else f"the gain is not over {margin:.0%})")))
    return PartitionChoice(pp, pmap, s, u, p, keep, line)
