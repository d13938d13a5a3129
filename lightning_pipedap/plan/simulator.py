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

Lower bounds (valid for any schedule with the given profile and cost model), :func:`lower_bounds`:

* sum bound: ``max(Σ compute, Σ comm)``;
* window bound: ``max_j [ Σ_{k>=j} (t_f + t_b)(k) + comm(0..j) ]``: the communication of every
  bucket holding one of the layers ``0..j`` must run between the end of layer ``j``'s backward and
  the start of its next forward.

With no schedule given, ``comm`` is the least possible: ``g(bytes)`` with
``g = CostModel.min_reduce``, which is concave and >= 0, hence subadditive, so no fusion or mode
choice can communicate those bytes in less time (divided by the number of channels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.profile import ModelProfile
from lightning_pipedap.schedule import Op, OpKind, Schedule

if TYPE_CHECKING:
    from lightning_pipedap.measure.timeline import OpRecord

__all__ = ["Evaluator", "Interval", "LowerBounds", "OpTiming", "SimResult", "lower_bounds", "simulate",
           "op_code", "code_op", "to_op_records"]

_K_RS, _K_AG, _K_AR = 0, 1, 2
_KIND_OF_CODE = (OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.ALL_REDUCE)
_CODE_OF_KIND = {k: i for i, k in enumerate(_KIND_OF_CODE)}


def op_code(op: Op) -> int:
    """Integer code ``3 * bucket + k`` (k: 0 RS, 1 AG, 2 AR) used by the fast evaluator."""
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
    """A compute-stream interval: ``kind`` is ``forward``, ``backward``, ``update`` or ``wait``.

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

    Attributes:
        ready: ``ready[b]``, seconds after the backward start at which bucket ``b``'s gradients are
            complete.
        nbytes: bytes per bucket.
        t_backward: Σ t_b (the next forward can start then).

    Raises:
        ValueError: if ``buckets`` do not partition the layers or ``channels`` is not 1 or 2.
    """

    def __init__(self, profile: ModelProfile, cost_model: CostModel, buckets: Sequence[Sequence[int]],
                 channels: int = 1) -> None:
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
        layers = profile.layers
        suffix_tb = [0.0] * (L + 1)
        for i in range(L - 1, -1, -1):
            suffix_tb[i] = suffix_tb[i + 1] + layers[i].t_b
        self.suffix_tb = suffix_tb
        self.t_backward = suffix_tb[0]
        self.ready = [suffix_tb[min(bk)] for bk in buckets]
        self.nbytes = [sum(layers[i].nbytes for i in bk) for bk in buckets]
        total = sum(self.nbytes)
        tu = profile.t_update
        self.update = [tu * n / total if total > 0 else tu / self.B for n in self.nbytes]
        cost: list[float] = []
        chan: list[int] = []
        for b in range(self.B):
            n = self.nbytes[b]
            cost += [cost_model.reduce_scatter(n), cost_model.all_gather(n), cost_model.all_reduce(n)]
            chan += [0, 1 if channels == 2 else 0, 0]
        self.cost, self.chan = cost, chan
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

    # ----------------------------------------------------------------- costs
    def op_cost(self, op: Op) -> float:
        """Seconds of ``op`` on its bucket."""
        return self.cost[op_code(op)]

    # ------------------------------------------------------------ evaluation
    def period_codes(self, codes: Sequence[int]) -> float:
        """Steady-state iteration time (s) of the op list given as :func:`op_code` integers.

        The list is not validated (use :meth:`Schedule.validate`); an op list that leaves a bucket
        unreduced gives that bucket done-time 0 here.
        """
        cost, ready = self.cost, self.ready
        done = [0.0] * self.B
        if self.channels == 1:
            t = 0.0
            for c in codes:
                b = c // 3
                k = c - 3 * b
                if k == 1:
                    t += cost[c]
                    done[b] = t
                else:
                    r = ready[b]
                    t = (t if t > r else r) + cost[c]
                    if k == 2:
                        done[b] = t
        else:
            rs_end = [0.0] * self.B
            free = [0.0, 0.0]
            chan = self.chan
            for c in codes:
                b = c // 3
                k = c - 3 * b
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

        Times are in the iteration-origin frame (start of this iteration's forward = 0).
        """
        cost, ready, chan = self.cost, self.ready, self.chan
        done = [0.0] * self.B
        rs_end = [0.0] * self.B
        free = [0.0, 0.0]
        raw: list[tuple[Op, int, float, float]] = []
        for op in ops:
            c = op_code(op)
            b, k = op.bucket, c % 3
            ch = chan[c]
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


def simulate(profile: ModelProfile, cost_model: CostModel, schedule: Schedule, *, channels: int = 1) -> SimResult:
    """Simulate ``schedule`` in steady state (see the module docstring for the exact model).

    Args:
        profile: layers in forward order; the schedule's buckets name these layer indices.
        cost_model: op costs.
        schedule: fusion + op list; validated against ``profile.num_layers``.
        channels: 1 (default) or 2 communication channels.

    Returns:
        :class:`SimResult` with the iteration time, exposed communication, every op's start/end
        and the schedule's lower bounds.

    Raises:
        ValueError: if the schedule is not executable or does not partition the profile's layers.
    """
    schedule.validate(profile.num_layers)
    ev = Evaluator(profile, cost_model, schedule.buckets, channels)
    P, timings, compute = ev.run(schedule.ops)
    comp = profile.t_compute
    return SimResult(
        schedule=schedule, channels=channels, iteration_s=P, compute_s=comp,
        exposed_comm_s=max(0.0, P - comp), comm_busy_s=sum(t.end - t.start for t in timings),
        ops=tuple(timings), compute=tuple(compute),
        bounds=lower_bounds(profile, cost_model, schedule, channels=channels),
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
      consecutive layers of bucket ``b`` (their backward intervals are back to back).

    Hence ``measure.timeline.exposed_communication_ms(records, window=(0, k * P))`` equals
    ``k * exposed_comm_s`` in ms (the channel is busy whenever the compute stream waits), and
    the busy compute per iteration equals ``compute_s``.

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
    return compute + comm


def lower_bounds(profile: ModelProfile, cost_model: CostModel, schedule: Schedule | None = None, *,
                 channels: int = 1) -> LowerBounds:
    """Sum bound and window bound on the steady-state iteration time (s).

    Args:
        profile, cost_model: the instance.
        schedule: when given, the bounds use this schedule's buckets and ops (a bound for *this*
            schedule); when ``None``, the least communication any schedule could have (a bound
            for *every* schedule, the reference for a planner's gap).
        channels: 1 or 2; with 2 the communication in a window is divided between the channels
            (busiest channel for a given schedule, half of the least total otherwise).

    Raises:
        ValueError: if ``channels`` is not 1 or 2 or the schedule does not fit the profile.
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
    if schedule is None:
        cum = 0
        for j in range(L):
            cum += layers[j].nbytes
            window[j] = tail[j] + cost_model.min_reduce(cum) / channels
        comm = cost_model.min_reduce(profile.total_bytes) / channels
    else:
        schedule.validate(L)
        ev = Evaluator(profile, cost_model, schedule.buckets, channels)
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
