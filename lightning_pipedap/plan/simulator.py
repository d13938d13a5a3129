"""Timeline simulator of one data-parallel training iteration in steady state, and lower bounds.

Model (DeAR ICDCS 2023 §III, PipeDAP TETC 2025 §IV, with consistent costs):

* **One compute stream** runs, per iteration, the forward of layers ``0 .. L-1`` and then the
  backward of layers ``L-1 .. 0`` (``t_f``, ``t_b`` from the profile), back to back.
* **One communication channel** (``channels=1``) runs the schedule's op list in list order, one op
  at a time, every iteration. With ``channels=2`` reduce-scatters and all-reduces use channel 0 and
  all-gathers channel 1, each channel keeping list order; the two channels are assumed not to slow
  each other down (an optimistic what-if, e.g. two NCCL communicators on separate links).
* Op durations come from the :class:`~lightning_pipedap.plan.cost_model.CostModel` at the bucket's
  byte size; they are never negative and no start-up is shared between ops (sharing is only the
  explicit RS+AG -> AR fusion of the cost model).
* Dependencies: ``RS(b)``/``AR(b)`` start after the backward of *every* layer of bucket ``b`` (the
  bucket's lowest layer index finishes last); ``AG(b)`` after ``RS(b)``; in the next iteration the
  first forward that uses bucket ``b`` starts after ``b``'s ``AG``/``AR`` and then, on the compute
  stream, bucket ``b``'s share of the optimizer update (``t_update * bytes(b) / total bytes``).

Steady state, computed directly (no fixed-point iteration is needed): every bucket must be fully
reduced before the forward of its layers in the next iteration, and that iteration's backward starts
only after its whole forward, so no operation of iteration ``k`` can still run when the backward of
iteration ``k+1`` starts, and the communication channel(s) are idle at that moment. Hence the
timeline from the start of one backward to the start of the next is identical in every iteration
(from the second on); simulating one backward (time 0 to ``Σ t_b``), the op list, and the next
forward yields the exact period, the steady-state iteration time. Reported times use the origin
"start of this iteration's forward", i.e. the moment the compute stream finished the previous
backward; the forward may first wait there for the previous iteration's communication.

Exposed communication = iteration time - (Σ t_f + Σ t_b + t_update): the compute stream's idle time.

**Compression** (optional: per-bucket flags + a
:class:`~lightning_pipedap.plan.compression.CompressionCost`). A compressed bucket has no separate
RS and AG: at the position of its ``RS`` (or ``AR``) op it is reduced in one channel op, and its
update is ready when that op ends (an ``AG`` of a compressed bucket, if listed, costs nothing and
changes nothing). With ``where="helper"`` the compression runs on a helper lane beside compute:
compressed buckets enter it in gradient-ready order, each starting when its backward is done and
the helper is free; the channel op waits for it and takes ``collective + post`` seconds. With
``where="inline"`` the compression is part of the channel op (``pre + collective + post``), which
waits only for the gradients. The steady-state argument above still holds: the helper lane is idle
when a backward starts, because every compression of an iteration precedes its bucket's channel op.

Lower bounds (valid for any schedule with the given profile and cost model), :func:`lower_bounds`:

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
from typing import TYPE_CHECKING, Iterable, Sequence

from lightning_pipedap.plan.compression import CompressionCost
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.profile import ModelProfile
from lightning_pipedap.schedule import Op, OpKind, Schedule

if TYPE_CHECKING:
    from lightning_pipedap.measure.timeline import OpRecord

__all__ = ["Evaluator", "Interval", "LowerBounds", "OpTiming", "SimResult", "lower_bounds", "simulate",
           "op_code", "code_op", "to_op_records"]

# The fast form of an :class:`Op` (the evaluator's and the planners' op lists): the integer
# ``3 * bucket + k``, where ``k`` is the position of the op's kind in :class:`OpKind`.
_KIND_OF_CODE: tuple[OpKind, ...] = tuple(OpKind)
_CODE_OF_KIND = {k: i for i, k in enumerate(_KIND_OF_CODE)}
_K_RS, _K_AG, _K_AR = (_CODE_OF_KIND[k] for k in (OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.ALL_REDUCE))
# the planners' code arithmetic needs AG(b) == RS(b) + 1 and AR(b) == RS(b) + 2
assert (_K_RS, _K_AG, _K_AR) == (0, 1, 2), "OpKind must list RS, AG, AR in this order"
_K_SKIP = len(_KIND_OF_CODE)  # effective kind of the AG of a compressed bucket: no operation


def op_code(op: Op) -> int:
    """Integer code ``3 * bucket + k`` (k: position of ``op.kind`` in :class:`OpKind`: 0 RS, 1 AG,
    2 AR) used by the fast evaluator and the planners."""
    return 3 * op.bucket + _CODE_OF_KIND[op.kind]


def code_op(code: int) -> Op:
    """Inverse of :func:`op_code`."""
    b, k = divmod(code, 3)
    return Op(_KIND_OF_CODE[k], b)


def _check_channels(channels: int) -> int:
    if channels not in (1, 2):
        raise ValueError(f"channels must be 1 or 2, got {channels!r}")
    return channels


@dataclass(frozen=True)
class OpTiming:
    """Start and end (seconds, iteration-origin frame) of one op on its channel."""

    op: Op
    channel: int
    start: float
    end: float


@dataclass(frozen=True)
class Interval:
    """A compute-stream interval: ``kind`` is ``forward``, ``backward``, ``update`` or ``wait``; or,
    on the compression helper lane, ``compress``.

    ``wait`` intervals are exposed communication: the compute stream idles until bucket
    ``bucket``'s reduction finishes. ``layers`` are the profile layers covered (forward/backward).
    """

    kind: str
    start: float
    end: float
    bucket: int | None = None
    layers: tuple[int, ...] = ()


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


@dataclass(frozen=True)
class SimResult:
    """Steady-state simulation of one schedule.

    Attributes:
        schedule: the simulated schedule.
        channels: number of communication channels simulated (1 or 2).
        iteration_s: steady-state iteration time (the period), seconds.
        compute_s: Σ t_f + Σ t_b + t_update, seconds.
        exposed_comm_s: ``iteration_s - compute_s`` (compute-stream idle time), seconds.
        comm_busy_s: Σ of all op durations (all channels), seconds.
        ops: one :class:`OpTiming` per op, list order, in the iteration-origin frame. Ops of this
            iteration may end after ``iteration_s`` (they overlap the next forward); the same ops of
            the previous iteration are these shifted by ``-iteration_s``.
        compute: compute-stream intervals of this iteration, ``[0, iteration_s]``.
        bounds: lower bounds *for this schedule's fusion and modes*
            (``lower_bounds(profile, cost_model, schedule)``).
        helper: ``compress`` intervals of the compression helper lane (``where="helper"``), one
            per compressed bucket, iteration-origin frame; empty without compression.
    """

    schedule: Schedule
    channels: int
    iteration_s: float
    compute_s: float
    exposed_comm_s: float
    comm_busy_s: float
    ops: tuple[OpTiming, ...]
    compute: tuple[Interval, ...]
    bounds: LowerBounds
    helper: tuple[Interval, ...] = ()

    def op_window(self, iterations: int = 1) -> list[OpTiming]:
        """Op timings that overlap ``[0, iterations * iteration_s]``, previous iteration included."""
        P = self.iteration_s
        out = []
        for it in range(-1, iterations):
            for t in self.ops:
                s, e = t.start + it * P, t.end + it * P
                if e > 0 and s < iterations * P:
                    out.append(OpTiming(t.op, t.channel, s, e))
        return out

    def compute_window(self, iterations: int = 1) -> list[Interval]:
        """Compute intervals of ``iterations`` consecutive iterations starting at 0."""
        P = self.iteration_s
        return [Interval(c.kind, c.start + it * P, c.end + it * P, c.bucket, c.layers)
                for it in range(iterations) for c in self.compute]


class Evaluator:
    """A profile + cost model + fixed tensor fusion, compiled for fast evaluation of op lists.

    Planners call :meth:`period_codes` thousands of times; :func:`simulate` uses :meth:`run`, the
    same computation with every start/end recorded. Both implement the model of the module
    docstring. Cost: O(number of ops + number of forward steps) per evaluation.

    Args:
        profile: layers in forward order.
        cost_model: op costs.
        buckets: ``buckets[b]`` = profile layer indices of bucket ``b``; must partition
            ``range(profile.num_layers)``.
        channels: 1 or 2.
        compressed: optional per-bucket flags (see the module docstring); None: nothing compressed.
        compression: the compression cost; required when a flag is set.
        world_size: number of ranks, needed by ``collective="AG"`` compression; default
            ``cost_model.meta["world_size"]``.

    Attributes:
        ready: ``ready[b]``, seconds after the backward start at which bucket ``b``'s first channel
            op can start: its gradients are complete (``grad_ready[b]``), and, for a bucket
            compressed on the helper lane, its compression has finished.
        grad_ready: ``grad_ready[b]``, seconds after the backward start at which bucket ``b``'s
            gradients are complete.
        nbytes: bytes per bucket.
        payload: payload bytes per bucket (compressed buckets), else ``None``.
        compressed: the flags, one bool per bucket.
        helper: ``(bucket, start, end)`` of each helper-lane compression, backward-start frame,
            in helper order.
        t_backward: Σ t_b (the next forward can start then).

    Raises:
        ValueError: if ``buckets`` do not partition the layers, ``channels`` is not 1 or 2, the
            flags do not match the buckets, a bucket is flagged without a ``compression``, or the
            compression's per-layer payloads do not match the profile.
    """

    def __init__(self, profile: ModelProfile, cost_model: CostModel, buckets: Sequence[Sequence[int]],
                 channels: int = 1, *, compressed: Sequence[bool] | None = None,
                 compression: CompressionCost | None = None, world_size: int | None = None) -> None:
        self.channels = _check_channels(channels)
        L = profile.num_layers
        buckets = tuple(tuple(int(i) for i in bk) for bk in buckets)
        seen: list[int] = [-1] * L
        for b, bk in enumerate(buckets):
            if not bk:
                raise ValueError(f"bucket {b} is empty; every bucket needs at least one layer")
            for i in bk:
                if not 0 <= i < L:
                    raise ValueError(f"bucket {b} names layer {i}; valid layers are 0..{L - 1}")
                if seen[i] != -1:
                    raise ValueError(f"layer {i} is in buckets {seen[i]} and {b}; buckets must partition the layers")
                seen[i] = b
        missing = [i for i in range(L) if seen[i] == -1]
        if missing:
            raise ValueError(f"layers {missing[:10]} are in no bucket; buckets must partition the {L} layers")
        self.profile, self.cost_model, self.buckets = profile, cost_model, buckets
        self.B = len(buckets)
        flags = _check_flags(compressed, self.B, compression, L)
        self.compressed, self.compression = flags, compression
        if world_size is None:
            world_size = cost_model.meta.get("world_size")
        self.world_size = world_size
        layers = profile.layers
        suffix_tb = [0.0] * (L + 1)
        for i in range(L - 1, -1, -1):
            suffix_tb[i] = suffix_tb[i + 1] + layers[i].t_b
        self.suffix_tb = suffix_tb
        self.t_backward = suffix_tb[0]
        self.grad_ready = [suffix_tb[min(bk)] for bk in buckets]
        self.nbytes = [sum(layers[i].nbytes for i in bk) for bk in buckets]
        total = sum(self.nbytes)
        tu = profile.t_update
        self.update = [tu * n / total if total > 0 else tu / self.B for n in self.nbytes]
        cost: list[float] = []
        chan: list[int] = []
        kind: list[int] = []
        self.payload: list[float | None] = [None] * self.B
        for b in range(self.B):
            n = self.nbytes[b]
            if flags[b]:
                assert compression is not None
                self.payload[b] = compression.payload_bytes(n, buckets[b])
                c = compression.channel_s(cost_model, n, buckets[b], world_size)
                cost += [c, 0.0, c]
                kind += [_K_AR, _K_SKIP, _K_AR]
            else:
                cost += [cost_model.reduce_scatter(n), cost_model.all_gather(n), cost_model.all_reduce(n)]
                kind += [_K_RS, _K_AG, _K_AR]
            chan += [0, 1 if channels == 2 else 0, 0]
        self.cost, self.chan, self.kind = cost, chan, kind
        # helper lane: compressed buckets in gradient-ready order (ties: higher bucket first, as backward)
        self.ready = list(self.grad_ready)
        self.helper: list[tuple[int, float, float]] = []
        if compression is not None and compression.where == "helper":
            h = 0.0
            for b in sorted((b for b in range(self.B) if flags[b]), key=lambda b: (self.grad_ready[b], -b)):
                s = h if h > self.grad_ready[b] else self.grad_ready[b]
                h = s + compression.helper_s(self.nbytes[b])
                self.helper.append((b, s, h))
                self.ready[b] = h
        # forward steps: (bucket waited for, update share, forward seconds until the next new bucket, layers)
        steps: list[list] = []
        waited: set[int] = set()
        for i in range(L):
            b = seen[i]
            if b not in waited:
                waited.add(b)
                steps.append([b, self.update[b], 0.0, []])
            steps[-1][2] += layers[i].t_f
            steps[-1][3].append(i)
        self.steps = [(s[0], s[1], s[2], tuple(s[3])) for s in steps]
        self._fast_steps = [(s[0], s[1] + s[2]) for s in steps]

    # ------------------------------------------------------------ evaluation
    def period_codes(self, codes: Sequence[int]) -> float:
        """Steady-state iteration time (s) of the op list given as :func:`op_code` integers.

        The list is not validated (use :meth:`Schedule.validate`); an op list that leaves a bucket
        unreduced gives that bucket done-time 0 here.
        """
        cost, ready, kind = self.cost, self.ready, self.kind
        done = [0.0] * self.B
        if self.channels == 1:
            t = 0.0
            for c in codes:
                k = kind[c]
                if k == 1:
                    t += cost[c]
                    done[c // 3] = t
                elif k != 3:
                    b = c // 3
                    r = ready[b]
                    t = (t if t > r else r) + cost[c]
                    if k == 2:
                        done[b] = t
        else:
            rs_end = [0.0] * self.B
            free = [0.0, 0.0]
            chan = self.chan
            for c in codes:
                k = kind[c]
                if k == 3:
                    continue
                b = c // 3
                ch = chan[c]
                dep = rs_end[b] if k == 1 else ready[b]
                f = free[ch]
                e = (f if f > dep else dep) + cost[c]
                free[ch] = e
                if k == 0:
                    rs_end[b] = e
                else:
                    done[b] = e
        cur = self.t_backward
        for b, d in self._fast_steps:
            x = done[b]
            if x > cur:
                cur = x
            cur += d
        return cur

    def period(self, ops: Iterable[Op]) -> float:
        """Steady-state iteration time (s) of an op list (not validated)."""
        return self.period_codes([op_code(o) for o in ops])

    def run(self, ops: Sequence[Op]) -> tuple[float, list[OpTiming], list[Interval]]:
        """Like :meth:`period` but returns ``(period, op timings, compute intervals)``.

        Times are in the iteration-origin frame (start of this iteration's forward = 0). The AG of
        a compressed bucket gets a zero-length timing at its channel's free time. The helper lane's
        intervals are :meth:`helper_intervals` (same frame, given the period).
        """
        cost, ready, chan, kind = self.cost, self.ready, self.chan, self.kind
        done = [0.0] * self.B
        rs_end = [0.0] * self.B
        free = [0.0, 0.0]
        raw: list[tuple[Op, int, float, float]] = []
        for op in ops:
            c = op_code(op)
            b, k = op.bucket, kind[c]
            ch = chan[c]
            if k == _K_SKIP:
                raw.append((op, ch, free[ch], free[ch]))
                continue
            dep = rs_end[b] if k == _K_AG else ready[b]
            s = max(free[ch], dep)
            e = s + cost[c]
            free[ch] = e
            if k == _K_RS:
                rs_end[b] = e
            else:
                done[b] = e
            raw.append((op, ch, s, e))
        Tb = self.t_backward
        cur = Tb
        fwd: list[Interval] = []
        for b, u, d, lay in self.steps:
            if done[b] > cur:
                fwd.append(Interval("wait", cur - Tb, done[b] - Tb, b))
                cur = done[b]
            if u > 0:
                fwd.append(Interval("update", cur - Tb, cur + u - Tb, b))
                cur += u
            fwd.append(Interval("forward", cur - Tb, cur + d - Tb, b, lay))
            cur += d
        P = cur
        shift = P - Tb  # anchor frame (backward start = 0) -> iteration-origin frame
        bwd: list[Interval] = []
        layers = self.profile.layers
        t = 0.0
        bucket_of = {i: b for b, bk in enumerate(self.buckets) for i in bk}
        for i in range(len(layers) - 1, -1, -1):
            bwd.append(Interval("backward", t + shift, t + layers[i].t_b + shift, bucket_of[i], (i,)))
            t += layers[i].t_b
        timings = [OpTiming(op, ch, s + shift, e + shift) for op, ch, s, e in raw]
        return P, timings, fwd + bwd

    def helper_intervals(self, period: float) -> list[Interval]:
        """Helper-lane ``compress`` intervals in the iteration-origin frame of an iteration of ``period`` s."""
        shift = period - self.t_backward
        return [Interval("compress", s + shift, e + shift, b) for b, s, e in self.helper]


def _check_flags(compressed: Sequence[bool] | None, num_buckets: int, compression: CompressionCost | None,
                 num_layers: int) -> tuple[bool, ...]:
    """Validate per-bucket compression flags; return them as a tuple (all False for None)."""
    if compression is not None:
        if not isinstance(compression, CompressionCost):
            raise TypeError(f"compression must be a CompressionCost, got {type(compression).__name__}")
        compression.check_layers(num_layers)
    if compressed is None:
        return (False,) * num_buckets
    flags = tuple(compressed)
    if len(flags) != num_buckets:
        raise ValueError(f"compressed has {len(flags)} flags for {num_buckets} buckets; give one bool per bucket")
    if any(not isinstance(f, bool) for f in flags):
        raise ValueError(f"compressed flags must be bools, got {[f for f in flags if not isinstance(f, bool)][0]!r}")
    if any(flags) and compression is None:
        raise ValueError(f"buckets {[b for b, f in enumerate(flags) if f][:10]} are flagged compressed but no "
                         "compression cost was given; pass compression=CompressionCost(...)")
    return flags


def simulate(profile: ModelProfile, cost_model: CostModel, schedule: Schedule, *, channels: int = 1,
             compression: CompressionCost | None = None, world_size: int | None = None) -> SimResult:
    """Simulate ``schedule`` in steady state (see the module docstring for the exact model).

    Args:
        profile: layers in forward order; the schedule's buckets name these layer indices.
        cost_model: op costs.
        schedule: fusion + op list (+ compressed flags); validated against ``profile.num_layers``.
        channels: 1 (default) or 2 communication channels.
        compression: the cost of compressing, required when the schedule flags a bucket compressed.
        world_size: ranks, for ``collective="AG"`` compression (default ``cost_model.meta``).

    Returns:
        :class:`SimResult` with the iteration time, exposed communication, every op's start/end,
        the helper lane's compressions and the schedule's lower bounds.

    Raises:
        ValueError: if the schedule is not executable or does not partition the profile's layers,
            or it flags compressed buckets without a ``compression``.
    """
    schedule.validate(profile.num_layers)
    ev = Evaluator(profile, cost_model, schedule.buckets, channels, compressed=schedule.compressed,
                   compression=compression, world_size=world_size)
    P, timings, compute = ev.run(schedule.ops)
    comp = profile.t_compute
    return SimResult(
        schedule=schedule, channels=channels, iteration_s=P, compute_s=comp,
        exposed_comm_s=max(0.0, P - comp), comm_busy_s=sum(t.end - t.start for t in timings),
        ops=tuple(timings), compute=tuple(compute),
        bounds=lower_bounds(profile, cost_model, schedule, channels=channels, compression=compression,
                            world_size=world_size),
        helper=tuple(ev.helper_intervals(P)),
    )


def to_op_records(result: SimResult, iterations: int = 1) -> list[OpRecord]:
    """A simulated timeline as :class:`~lightning_pipedap.measure.timeline.OpRecord` s, so that the
    measured-timeline tools (exposed communication, Chrome trace, Gantt chart) apply unchanged.

    Covers ``iterations`` consecutive steady-state iterations from time 0 (the start of the first
    one's forward, see the module docstring), times in seconds:

    * every op of :attr:`SimResult.ops` of each of those iterations (shifted by ``k * iteration_s``;
      the last ones may end after ``iterations * iteration_s``), plus the ops of the previous
      iteration that end after 0 (the first forward waits for them); kind ``RS``/``AG``/``AR``,
      lane ``comm``, name ``str(op)`` (e.g. ``"RS3"``); with 2 channels both channels share the
      ``comm`` lane (concurrent records);
    * every compute interval, lane ``compute``: ``wait`` (exposed communication, the compute stream
      idle), ``update`` (a bucket's share), ``forward`` (the layers up to the next bucket to wait
      for), named ``W<b>``, ``U<b>``, ``F<b>``; ``backward``: one record ``B<b>`` per run of
      consecutive layers of bucket ``b`` (their backward intervals are back to back);
    * every helper-lane compression (:attr:`SimResult.helper`) of those iterations and the previous
      one's that end after 0, kind ``compress``, lane ``compress``, named ``C<b>``.

    Hence ``measure.timeline.exposed_communication_ms(records, window=(0, k * P))`` equals
    ``k * exposed_comm_s`` in ms (the channel is busy whenever the compute stream waits), and
    the busy compute per iteration equals ``compute_s``. With helper-lane compression the compute
    stream can also wait while only the helper works; pass ``comm_kinds=COMM_KINDS +
    COMPRESS_KINDS`` to count that time as exposed too.

    Args:
        result: a :func:`simulate` result.
        iterations: number of iterations, >= 1.

    Returns:
        ``list[OpRecord]``, compute records first, each group in time order.

    Raises:
        ValueError: if ``iterations < 1``.
    """
    from lightning_pipedap.measure.timeline import OpRecord  # lazy: plan/ does not need measure/ to plan

    if not (isinstance(iterations, int) and iterations >= 1):
        raise ValueError(f"iterations must be an int >= 1, got {iterations!r}")
    P = result.iteration_s
    prefix = {"forward": "F", "backward": "B", "update": "U", "wait": "W"}
    compute: list[OpRecord] = []
    for c in result.compute_window(iterations):
        last = compute[-1] if compute else None
        if (c.kind == "backward" and last is not None and last.kind == "backward" and last.bucket == c.bucket
                and abs(last.end_s - c.start) <= 1e-12 * max(1.0, abs(c.start))):
            last.end_s = c.end
            continue
        name = prefix[c.kind] + ("" if c.bucket is None else str(c.bucket))
        compute.append(OpRecord(name, c.kind, c.bucket, c.start, c.end, "compute"))
    comm: list[OpRecord] = []
    for k in range(-1, iterations):
        for t in result.ops:
            s, e = t.start + k * P, t.end + k * P
            if k >= 0 or e > 0.0:
                comm.append(OpRecord(str(t.op), t.op.kind.value, t.op.bucket, s, e, "comm"))
    comm.sort(key=lambda r: (r.start_s, r.end_s))
    helper: list[OpRecord] = []
    for k in range(-1, iterations):
        for c in result.helper:
            s, e = c.start + k * P, c.end + k * P
            if k >= 0 or e > 0.0:
                helper.append(OpRecord(f"C{c.bucket}", "compress", c.bucket, s, e, "compress"))
    helper.sort(key=lambda r: (r.start_s, r.end_s))
    return compute + comm + helper


def lower_bounds(profile: ModelProfile, cost_model: CostModel, schedule: Schedule | None = None, *,
                 channels: int = 1, compression: CompressionCost | None = None,
                 world_size: int | None = None) -> LowerBounds:
    """Sum bound and window bound on the steady-state iteration time (s).

    Args:
        profile, cost_model: the instance.
        schedule: when given, the bounds use this schedule's buckets, ops and compressed flags (a
            bound for *this* schedule); when ``None``, the least communication any schedule could
            have (a bound for *every* schedule, the reference for a planner's gap), including
            schedules that compress any buckets when ``compression`` is given.
        channels: 1 or 2; with 2 the communication in a window is divided between the channels
            (busiest channel for a given schedule, half of the least total otherwise).
        compression: the compression cost (required when the schedule flags compressed buckets).
        world_size: ranks, for ``collective="AG"`` compression (default ``cost_model.meta``).

    Raises:
        ValueError: if ``channels`` is not 1 or 2, the schedule does not fit the profile, or it
            flags compressed buckets without a ``compression``.
    """
    _check_channels(channels)
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
                       compression=compression, world_size=world_size)
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
