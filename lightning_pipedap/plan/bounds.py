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
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_pipedap.plan.compression import CompressionCost
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.evaluator import Evaluator, check_channels, op_code
from lightning_pipedap.plan.profile import ModelProfile
from lightning_pipedap.schedule import Schedule

__all__ = ["LowerBounds", "lower_bounds"]


@dataclass(frozen=True)
class LowerBounds:
    """Lower bounds on the steady-state iteration time, in seconds.

    Attributes:
        compute_s: Σ t_f + Σ t_b + t_update.
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
                 world_size: int | None = None) -> LowerBounds:
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
        world_size: ranks, for ``collective="AG"`` compression (default ``cost_model.meta``).

    Raises:
        ValueError: if ``channels`` is not 1 or 2, the schedule does not fit the profile, or it
            flags compressed buckets without a ``compression``.
    """
    check_channels(channels)
    layers = profile.layers
    L = len(layers)
    compute = profile.t_compute
    # Σ_{k>=j} (t_f + t_b)(k)
    tail = [0.0] * (L + 1)
    for j in range(L - 1, -1, -1):
        tail[j] = tail[j + 1] + layers[j].t_f + layers[j].t_b
    window = [0.0] * L
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
                       compression=compression, world_size=world_size, wire16=schedule.wire16)
        per_bucket = [[0.0, 0.0] for _ in range(ev.B)]
        for op in schedule.ops:
            c = op_code(op)
            per_bucket[op.bucket][ev.chan[c]] += ev.cost[c]
        first = {}  # first layer (lowest index) -> buckets whose lowest layer it is
        for b, bk in enumerate(ev.buckets):
            first.setdefault(min(bk), []).append(b)
        acc = [0.0, 0.0]
        for j in range(L):
            for b in first.get(j, ()):
                acc[0] += per_bucket[b][0]
                acc[1] += per_bucket[b][1]
            window[j] = tail[j] + max(acc)
        tot = [sum(p[0] for p in per_bucket), sum(p[1] for p in per_bucket)]
        comm = max(tot)
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
