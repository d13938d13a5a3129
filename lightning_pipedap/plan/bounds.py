"""Lower bounds on the steady-state iteration time of :mod:`lightning_pipedap.plan.simulator`'s model.

Two bounds, valid for any schedule with the given profile and cost model (:func:`lower_bounds`):

* sum bound: ``max(Σ compute, Σ comm)``;
* window bound: ``max_j [ Σ_{k>=j} (t_f + t_b)(k) + comm(0..j) ]``: the communication of every
  bucket holding one of the layers ``0..j`` must run between the end of layer ``j``'s backward and
  the start of its next forward.

With no schedule given, ``comm`` is the least possible: ``g(bytes)`` with
``g = CostModel.min_reduce``, which is concave and >= 0, hence subadditive, so no fusion or mode
choice can communicate those bytes in less time (divided by the number of channels). With a
compression cost, some layers may travel compressed: a compressed bucket holding layer set ``S``
occupies the channel ``f(S) = A + Σ_{k∈S} w_k`` (:meth:`CompressionCost.channel_terms`), so any set
of buckets covering layers ``0..j`` costs at least
``min( g(B_j), f(0..j), min_i [ α_i + β_i B_j + A + Σ_{k<=j} min(0, w_k - β_i n_k) ] )`` where
``B_j`` = bytes of layers ``0..j`` and ``(α_i, β_i)`` are the two affine pieces of ``g`` (AR and
RS + AG): the dense buckets cost at least ``g`` of their total bytes (subadditivity), the compressed
ones at least one ``A`` plus their ``w``; the last term relaxes the choice of compressed layers.

**Sharded optimizer step** (``sharded``, see :mod:`lightning_pipedap.plan.simulator`). The compute of the sum
bound is the compute stream's: Σ t_f + Σ t_b + the unsharded buckets' update shares + the land copies. Every
channel second of a sharded bucket holding one of the layers ``0..j`` (its RS, step, parameter AG and, with
``clip_norm``, gradient AG) and the preparation all-reduce (after the backward, before the first parameter AG)
still lie between the end of layer ``j``'s backward and the next forward of layer ``j``, so the window bound keeps
its form with that work added. With no schedule given and no compression, every bucket is sharded and buckets
covering layers ``0..j`` cost at least ``T_RS(B_j) + T_AG(B_j)`` (``+ T_AG(B_j)`` with clip; affine with
``α >= 0``, hence subadditive) ``+ t_update B_j / total / N`` (the steps are linear in bytes) plus the preparation;
with compression a bucket may be compressed (unsharded), so the dense bound above applies (a sharded bucket's
channel time is at least ``g`` of its bytes) and the compute counts per layer the lesser of its land copy and its
update share.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_pipedap.plan.compression import CompressionCost
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.evaluator import Evaluator, check_channels, op_code
from lightning_pipedap.plan.profile import ModelProfile
from lightning_pipedap.plan.sharding import PREPARE_BYTES_PER_LAYER, Sharding, ShardingArg, resolve_sharding
from lightning_pipedap.schedule import Schedule

__all__ = ["LowerBounds", "lower_bounds"]


@dataclass(frozen=True)
class LowerBounds:
    """Lower bounds on the steady-state iteration time, in seconds.

    Attributes:
        compute_s: Σ t_f + Σ t_b + t_update (sharded: the compute stream's least busy time, module docstring).
        comm_s: communication time per iteration (least possible, or the schedule's, busiest channel).
        sum_bound_s: ``max(compute_s, comm_s)``.
        window_s: the window bound (see the module docstring).
        window_layer: the layer ``j`` that attains ``window_s``.
    """

    compute_s: float
    comm_s: float
    sum_bound_s: float
    window_s: float
    window_layer: int

    @property
    def best_s(self) -> float:
        """The tighter of the two bounds."""
        return max(self.sum_bound_s, self.window_s)


def lower_bounds(profile: ModelProfile, cost_model: CostModel, schedule: Schedule | None = None, *,
                 channels: int = 1, compression: CompressionCost | None = None,
                 world_size: int | None = None, sharded: ShardingArg = False) -> LowerBounds:
    """Sum bound and window bound on the steady-state iteration time (s).

    Args:
        profile, cost_model: the instance.
        schedule: when given, the bounds use this schedule's buckets, ops and compressed flags (a
            bound for *this* schedule); when ``None``, the least communication any schedule could
            have (a bound for *every* schedule, the reference for a planner's gap), including
            schedules that compress any buckets when ``compression`` is given; schedules with
            16-bit wire buckets are not covered by it (they move fewer bytes).
        channels: 1 or 2; with 2 the communication in a window is divided between the channels
            (busiest channel for a given schedule, half of the least total otherwise).
        compression: the compression cost (required when the schedule flags compressed buckets).
        world_size: ranks, for ``collective="AG"`` compression and the sharded step (default ``cost_model.meta``).
        sharded: bounds of the sharded step's model (``True`` or a
            :class:`~lightning_pipedap.plan.sharding.Sharding`; module docstring).

    Raises:
        ValueError: if ``channels`` is not 1 or 2, the schedule does not fit the profile, or it
            flags compressed buckets without a ``compression``, or ``sharded`` without a world size.
    """
    check_channels(channels)
    sharding = resolve_sharding(sharded)
    layers = profile.layers
    L = len(layers)
    compute = profile.t_compute
    # Σ_{k>=j} (t_f + t_b)(k)
    tail = [0.0] * (L + 1)
    for j in range(L - 1, -1, -1):
        tail[j] = tail[j + 1] + layers[j].t_f + layers[j].t_b
    window = [0.0] * L
    if sharding is not None and schedule is None:
        return _sharded_least(profile, cost_model, tail, channels, compression, world_size, sharding)
    if schedule is None and compression is None:
        cum = 0
        for j in range(L):
            cum += layers[j].nbytes
            window[j] = tail[j] + cost_model.min_reduce(cum) / channels
        comm = cost_model.min_reduce(profile.total_bytes) / channels
    elif schedule is None:
        least = _least_comm_prefixes(profile, cost_model, compression, world_size)
        for j in range(L):
            window[j] = tail[j] + least[j] / channels
        comm = least[-1] / channels
    else:
        schedule.validate(L)
        ev = Evaluator(profile, cost_model, schedule.buckets, channels, compressed=schedule.compressed,
                       compression=compression, world_size=world_size, wire16=schedule.wire16, sharded=sharding)
        per_bucket = [[0.0, 0.0] for _ in range(ev.B)]
        for op in schedule.ops:  # (sharded buckets: effective costs, an AR costs its RS and an AG nothing)
            c = op_code(op)
            per_bucket[op.bucket][ev.chan[c]] += ev.cost[c]
        ch_ag = ev.chan[1]  # the sharded step's channel: the all-gathers'
        clip = sharding is not None and sharding.clip_norm
        for b in range(ev.B):
            if ev.sharded[b]:
                per_bucket[b][ch_ag] += ev.step_s[b] + ev.gather_s[b] + (cost_model.all_gather(ev.nbytes[b])
                                                                          if clip else 0.0)
        first = {}  # first layer (lowest index) -> buckets whose lowest layer it is
        for b, bk in enumerate(ev.buckets):
            first.setdefault(min(bk), []).append(b)
        acc = [0.0, 0.0]
        prepared = False
        for j in range(L):
            for b in first.get(j, ()):
                acc[0] += per_bucket[b][0]
                acc[1] += per_bucket[b][1]
                if ev.sharded[b] and not prepared:  # the preparation precedes the first parameter AG
                    acc[ch_ag] += ev.prepare_s
                    prepared = True
            window[j] = tail[j] + max(acc)
        tot = [sum(p[0] for p in per_bucket), sum(p[1] for p in per_bucket)]
        tot[ch_ag] += ev.prepare_s
        comm = max(tot)
        if sharding is not None:
            compute = ev.compute_s
    jstar = max(range(L), key=lambda j: window[j])
    return LowerBounds(compute_s=compute, comm_s=comm, sum_bound_s=max(compute, comm),
                       window_s=window[jstar], window_layer=jstar)


def _least_comm_prefixes(profile: ModelProfile, cost_model: CostModel, compression: CompressionCost,
                         world_size: int | None) -> list[float]:
    """Least channel seconds of any buckets covering layers ``0..j``, dense or compressed, per ``j``.

    The bound of the module docstring: ``min(g(B_j), f(0..j), min_i [α_i + β_i B_j + A +
    Σ_{k<=j} min(0, w_k - β_i n_k)])``, O(L).
    """
    if not isinstance(compression, CompressionCost):
        raise TypeError(f"compression must be a CompressionCost, got {type(compression).__name__}")
    compression.check_layers(profile.num_layers)
    if world_size is None:
        world_size = cost_model.meta.get("world_size")
    A, c_dense, c_pay = compression.channel_terms(cost_model, world_size)
    rs, ag, ar = cost_model.rs, cost_model.ag, cost_model.ar
    pieces = [(ar.alpha_s, ar.beta_s_per_byte), (rs.alpha_s + ag.alpha_s, rs.beta_s_per_byte + ag.beta_s_per_byte)]
    out: list[float] = []
    cum_bytes = 0
    cum_w = 0.0
    relax = [0.0, 0.0]
    for k, layer in enumerate(profile.layers):
        n = layer.nbytes
        w = c_dense * n + c_pay * compression.payload_variable(n, (k,))
        cum_bytes += n
        cum_w += w
        best = min(cost_model.min_reduce(cum_bytes), A + cum_w)
        for i, (a, bta) in enumerate(pieces):
            relax[i] += min(0.0, w - bta * n)
            best = min(best, a + bta * cum_bytes + A + relax[i])
        out.append(max(0.0, best))
    return out


def _sharded_least(profile: ModelProfile, cost_model: CostModel, tail: list[float], channels: int,
                   compression: CompressionCost | None, world_size: int | None, sharding: Sharding) -> LowerBounds:
    """:func:`lower_bounds` for every schedule of the sharded model (module docstring); ``tail[j]`` =
    Σ_{k>=j} (t_f + t_b)(k)."""
    if world_size is None:
        world_size = cost_model.meta.get("world_size")
    if not (isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1):
        raise ValueError(f"the sharded bounds need world_size (an int >= 1), got {world_size!r}")
    layers = profile.layers
    L = len(layers)
    total = profile.total_bytes
    tu = profile.t_update
    base = profile.t_forward + profile.t_backward
    window = [0.0] * L
    if compression is None:
        clip = 2 if sharding.clip_norm else 1
        prepare = cost_model.all_reduce(PREPARE_BYTES_PER_LAYER * L)
        step_per_byte = tu / total / world_size if total > 0 else 0.0

        def least(n: int) -> float:
            return (cost_model.reduce_scatter(n) + clip * cost_model.all_gather(n) + step_per_byte * n
                    + prepare) / channels

        cum = 0
        for j in range(L):
            cum += layers[j].nbytes
            window[j] = tail[j] + least(cum)
        comm = least(total)
        compute = base + sharding.land_s_per_byte * total
    else:
        prefixes = _least_comm_prefixes(profile, cost_model, compression, world_size)
        for j in range(L):
            window[j] = tail[j] + prefixes[j] / channels
        comm = prefixes[-1] / channels
        compute = base + (sum(min(sharding.land_s_per_byte * k.nbytes, tu * k.nbytes / total) for k in layers)
                          if total > 0 else 0.0)
    jstar = max(range(L), key=lambda j: window[j])
    return LowerBounds(compute_s=compute, comm_s=comm, sum_bound_s=max(compute, comm),
                       window_s=window[jstar], window_layer=jstar)
