"""Contention between compute and communication: a processor-sharing timeline model and its fit.

:func:`~lightning_pipedap.plan.simulator.simulate` assumes the compute stream and the communication
channel never slow each other. On a host whose cores are shared (CPU training with gloo, where the
communication worker, gloo's threads and the training thread compete for the same cores) that is
optimistic: measured on a 2-core machine, communication ran ~30% slower while compute ran, and on a
fast link communication was CPU-bound and stole compute time. This module models both effects.

Model (processor sharing with piecewise-constant rates; Kleinrock, *Queueing Systems* Vol. 2,
§4.4, applied per resource). Each job has a *work* in seconds, the time it takes alone; it
progresses at a rate in (0, 1] that depends on what else runs at that moment:

* a communication op progresses at rate ``1 / (1 + σ_m)`` while the compute stream is busy
  (forward, backward or update; not while it waits), and at rate 1 otherwise;
* the compute stream progresses at rate ``1 / (1 + k·σ_c)`` while ``k >= 1`` communication ops run
  (``k <= channels``), and at rate 1 otherwise;
* an op that *starts* while the compute stream is busy gets ``δ`` extra seconds of work
  (``op_overhead_s``: per-call start-up that only shows under load, e.g. waking a descheduled
  thread); that extra work progresses at the op's rate like the rest;
* with the sharded optimizer step (``sharded=``), a shard's *step* is CPU work on the communication worker, not
  a transfer: it progresses at rate ``1 / (1 + σ_s)`` while the compute stream is busy and slows compute to rate
  ``1 / (1 + σ_cs)`` while it runs (``step_slowdown``, ``compute_slowdown_step``: measured like ``σ_m, σ_c`` with an
  optimizer step instead of the all-reduce, :func:`~lightning_pipedap.probe.slowdown.measure_contention`); the
  round's preparation all-reduce, clip by norm's gradient all-gathers and the parameter all-gathers are
  communication ops like the others; the land copies are compute;
* helper-lane compressions (``CompressionCost(where="helper")``, a separate process) are *not*
  slowed by contention and do not slow anything: their durations are those of the
  :class:`~lightning_pipedap.plan.evaluator.Evaluator`. Inline compression is part of its channel
  op and is slowed like the collective.

Everything else is the model of :mod:`lightning_pipedap.plan.simulator`: op costs, list order per
channel, dependencies (``RS(b)``/``AR(b)`` after bucket ``b``'s gradients are complete, and after
its helper-lane compression; ``AG(b)`` after ``RS(b)``), the forward steps (wait for a bucket, its
update share, then the forward up to the next new bucket). The steady-state argument of that
module still holds with contention: every op of an iteration ends before its bucket's next forward,
which precedes the next backward, so the channel(s) and the helper lane are idle at each backward
start and one simulated period from a backward start to the next is the exact iteration time.

:func:`simulate_contended` is a discrete-event simulation of that period: between two events
(a job ends, or an op becomes ready) every rate is constant, so the next event time is exact.
A job's remaining work is re-based only when its rate changes; with :meth:`Contention.none`
no rate ever changes and every start and end is computed with the same floating-point operations
as :meth:`Evaluator.run <lightning_pipedap.plan.evaluator.Evaluator.run>`, so the iteration time
equals :func:`simulate`'s exactly. Contention only lowers rates, so the contended iteration time
is never below the uncontended one, and :func:`~lightning_pipedap.plan.bounds.lower_bounds`
stay valid.

:func:`fit_contention` inverts the model on a micro-benchmark (see its docstring for the
equations); :func:`contended_pair` is the forward model of that micro-benchmark.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from lightning_pipedap.plan._jsonfile import check_header
from lightning_pipedap.plan.bounds import lower_bounds
from lightning_pipedap.plan.compression import CompressionCost
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.evaluator import K_AG, K_RS, K_SKIP, Evaluator, Interval, OpTiming, op_code
from lightning_pipedap.plan.profile import ModelProfile
from lightning_pipedap.plan.sharding import ShardingArg, resolve_sharding
from lightning_pipedap.plan.simulator import SimResult
from lightning_pipedap.schedule import Op, OpKind, Schedule, sharded_ops

__all__ = ["Contention", "ContendedResult", "contended_pair", "fit_contention", "simulate_contended"]

CONTENTION_FORMAT = "lightning_pipedap.contention"
CONTENTION_VERSION = 1


def _nonneg(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    return float(v)


def _positive(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class Contention:
    """How much compute and communication slow each other (see the module docstring).

    Attributes:
        comm_slowdown: ``σ_m >= 0``; while compute runs, a communication op progresses at rate
            ``1 / (1 + σ_m)`` (``σ_m = 0.3``: 30% longer).
        compute_slowdown: ``σ_c >= 0``; while ``k`` communication ops run, compute progresses at
            rate ``1 / (1 + k·σ_c)``.
        op_overhead_s: ``δ >= 0``, seconds of extra work of a communication op that starts while
            compute runs (may be 0).
        meta: provenance (raw micro-benchmark times, case of the fit, ...); not compared.
        step_slowdown: ``σ_s >= 0``; while compute runs, a sharded step (CPU work on the communication worker)
            progresses at rate ``1 / (1 + σ_s)`` (0: not measured, or not slowed).
        compute_slowdown_step: ``σ_cs >= 0``; while a sharded step runs, compute progresses at rate
            ``1 / (1 + σ_cs)`` (0: not measured, or not slowed). Both from the same micro-benchmark as ``σ_m, σ_c``
            with an optimizer step on the worker thread in place of the all-reduce (``meta["step"]``).

    Raises:
        ValueError: naming the field and the bad value, if a value is negative or not finite, or
            ``meta`` is not a dict.
    """

    comm_slowdown: float = 0.0
    compute_slowdown: float = 0.0
    op_overhead_s: float = 0.0
    meta: dict = field(default_factory=dict, compare=False)
    step_slowdown: float = 0.0
    compute_slowdown_step: float = 0.0

    def __post_init__(self) -> None:
        for name in ("comm_slowdown", "compute_slowdown", "op_overhead_s", "step_slowdown", "compute_slowdown_step"):
            object.__setattr__(self, name, _nonneg(name, getattr(self, name)))
        if not isinstance(self.meta, dict):
            raise ValueError(f"meta must be a dict, got {type(self.meta).__name__}")

    @classmethod
    def none(cls) -> "Contention":
        """No contention: ``σ_m = σ_c = δ = 0`` (:func:`simulate_contended` then equals :func:`simulate`)."""
        return cls(0.0, 0.0, 0.0)

    @property
    def is_none(self) -> bool:
        """True when all three parameters are 0."""
        return (self.comm_slowdown == 0.0 and self.compute_slowdown == 0.0 and self.op_overhead_s == 0.0
                and self.step_slowdown == 0.0 and self.compute_slowdown_step == 0.0)

    def to_dict(self) -> dict:
        """JSON-ready dict (format ``lightning_pipedap.contention`` version 1)."""
        return {"format": CONTENTION_FORMAT, "version": CONTENTION_VERSION,
                "units": {"comm_slowdown": "1", "compute_slowdown": "1", "op_overhead": "s", "step_slowdown": "1",
                          "compute_slowdown_step": "1"},
                "comm_slowdown": self.comm_slowdown, "compute_slowdown": self.compute_slowdown,
                "op_overhead_s": self.op_overhead_s, "step_slowdown": self.step_slowdown,
                "compute_slowdown_step": self.compute_slowdown_step, "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Contention":
        """Inverse of :meth:`to_dict` (a file without the step's slowdowns, older than them, reads them as 0).

        Raises:
            ValueError: for another format tag or version, a missing field, or an invalid value.
        """
        check_header(data, CONTENTION_FORMAT, CONTENTION_VERSION, "contention model",
                     ("comm_slowdown", "compute_slowdown"))
        return cls(data["comm_slowdown"], data["compute_slowdown"], data.get("op_overhead_s", 0.0),
                   dict(data.get("meta", {})), data.get("step_slowdown", 0.0), data.get("compute_slowdown_step", 0.0))


# ------------------------------------------------------------------------------ micro-benchmark model
def contended_pair(alone_compute_s: float, alone_comm_s: float, contention: Contention) -> tuple[float, float]:
    """Forward model of the micro-benchmark: a compute load and one comm op start together at 0.

    With ``C`` = ``alone_compute_s``, ``M' = alone_comm_s + δ`` (the op starts while compute runs),
    ``a = 1 + σ_c``, ``m = 1 + σ_m``, both progress at the contended rates until one ends; the
    survivor then runs alone at rate 1:

    * ``M'·m <= C·a`` (comm ends first): ``T_m = M'·m``, ``T_c = T_m + C - T_m / a``;
    * ``M'·m > C·a`` (compute ends first): ``T_c = C·a``, ``T_m = T_c + M' - T_c / m``.

    This is :func:`simulate_contended` on that two-job instance.

    Args:
        alone_compute_s, alone_comm_s: seconds of each alone (>= 0).
        contention: ``σ_m``, ``σ_c``, ``δ``.

    Returns:
        ``(loaded_compute_s, loaded_comm_s)``: seconds from the common start to each end.

    Raises:
        ValueError: if a time is negative or not finite.
    """
    C = _nonneg("alone_compute_s", alone_compute_s)
    M = _nonneg("alone_comm_s", alone_comm_s) + contention.op_overhead_s
    a, m = 1.0 + contention.compute_slowdown, 1.0 + contention.comm_slowdown
    if M * m <= C * a:
        Tm = M * m
        return Tm + (C - Tm / a), Tm
    Tc = C * a
    return Tc, Tc + (M - Tc / m)


def fit_contention(alone_compute_s: float, alone_comm_s: float, loaded_compute_s: float, loaded_comm_s: float,
                   *, op_overhead_s: float = 0.0, max_slowdown: float = 100.0,
                   meta: Mapping[str, Any] | None = None) -> Contention:
    """``σ_m`` and ``σ_c`` from a micro-benchmark, by inverting :func:`contended_pair`.

    The micro-benchmark: a compute load that takes ``C`` s alone and one communication op that
    takes ``M`` s alone start together; they end ``T_c`` and ``T_m`` s after the start. With
    ``M' = M + δ`` (``δ = op_overhead_s``, given, default 0: one message size cannot separate it
    from ``σ_m``) and the processor-sharing model of the module docstring:

    * **comm ends first** (``T_m < T_c``): the op ran contended throughout, ``T_m = M'(1 + σ_m)``,
      and compute did ``T_m / (1 + σ_c)`` of its work by ``T_m`` and the rest alone,
      ``T_c = T_m + C - T_m / (1 + σ_c)``. Hence::

          σ_m = T_m / M' - 1,        σ_c = (T_c - C) / (T_m + C - T_c)

    * **compute ends first** (``T_c <= T_m``): symmetrically ``T_c = C(1 + σ_c)`` and
      ``T_m = T_c + M' - T_c / (1 + σ_m)``::

          σ_c = T_c / C - 1,         σ_m = (T_m - M') / (T_c + M' - T_m)

    (At ``T_c = T_m`` both cases give the same values.) Each result is clamped to
    ``[0, max_slowdown]``: measurement noise can make a loaded time shorter than the alone one
    (then 0), and a denominator ``<= 0`` means the other job made no progress at all, i.e. an
    unbounded slowdown (then ``max_slowdown``). Clamped values are listed in ``meta["clamped"]``.

    Args:
        alone_compute_s: ``C``, seconds of the compute load alone (> 0).
        alone_comm_s: ``M``, seconds of the op alone (> 0).
        loaded_compute_s: ``T_c``, seconds from the common start to the end of compute (> 0).
        loaded_comm_s: ``T_m``, seconds from the common start to the end of the op (> 0).
        op_overhead_s: ``δ`` (>= 0), stored in the result.
        max_slowdown: upper clamp of ``σ_m`` and ``σ_c`` (> 0).
        meta: extra provenance merged into the result's ``meta``.

    Returns:
        A :class:`Contention`; ``meta`` holds the four input times, ``case``
        (``"comm_first"``/``"compute_first"``) and ``clamped``.

    Raises:
        ValueError: naming the argument, if a time is not a finite number > 0, ``op_overhead_s``
            is negative or ``max_slowdown`` is not > 0.
    """
    C = _positive("alone_compute_s", alone_compute_s)
    M = _positive("alone_comm_s", alone_comm_s)
    Tc = _positive("loaded_compute_s", loaded_compute_s)
    Tm = _positive("loaded_comm_s", loaded_comm_s)
    d = _nonneg("op_overhead_s", op_overhead_s)
    cap = _positive("max_slowdown", max_slowdown)
    Mp = M + d
    if Tm < Tc:
        case = "comm_first"
        sm_raw = Tm / Mp - 1.0
        den = Tm + C - Tc
        sc_raw = (Tc - C) / den if den > 0 else math.inf
    else:
        case = "compute_first"
        sc_raw = Tc / C - 1.0
        den = Tc + Mp - Tm
        sm_raw = (Tm - Mp) / den if den > 0 else math.inf
    clamped = []
    out = []
    for name, v in (("comm_slowdown", sm_raw), ("compute_slowdown", sc_raw)):
        c = min(max(v, 0.0), cap)
        if c != v:
            clamped.append(name)
        out.append(c)
    m = {"alone_compute_s": C, "alone_comm_s": M, "loaded_compute_s": Tc, "loaded_comm_s": Tm,
         "case": case, "clamped": clamped, "source": "fit_contention"}
    m.update(meta or {})
    return Contention(out[0], out[1], d, m)


# ------------------------------------------------------------------------------ the simulation
@dataclass(frozen=True)
class ContendedResult(SimResult):
    """A :class:`~lightning_pipedap.plan.simulator.SimResult` of :func:`simulate_contended`.

    Differences from :func:`simulate`'s result, all times in seconds, iteration-origin frame:

    * ``compute`` intervals have their *contended* (wall) durations; ``compute_s`` is still the
      uncontended ``Σ t_f + Σ t_b + t_update``;
    * ``exposed_comm_s`` is the compute stream's idle time, the sum of the ``wait`` intervals, and
      ``iteration_s = compute_busy_s + exposed_comm_s``;
    * ``ops`` hold wall start/end times (``comm_busy_s``: their sum);
    * ``bounds`` are the uncontended lower bounds of the schedule (still lower bounds).

    Attributes:
        contention: the model simulated.
        compute_busy_s: wall seconds the compute stream is busy per iteration (>= ``compute_s``).
    """

    contention: Contention = field(default_factory=Contention.none)
    compute_busy_s: float = 0.0

    @property
    def compute_stretch_s(self) -> float:
        """Seconds per iteration that communication adds to compute: ``compute_busy_s - compute_s``."""
        return self.compute_busy_s - self.compute_s


class _Job:
    """A job in progress: ``rem`` seconds of work left at time ``anchor``, progressing at ``rate``."""

    __slots__ = ("anchor", "rem", "rate", "start", "item")

    def __init__(self, t: float, work: float, item: object) -> None:
        self.anchor, self.rem, self.rate, self.start, self.item = t, work, 1.0, t, item

    def end(self) -> float:
        return self.anchor + self.rem / self.rate

    def set_rate(self, rate: float, t: float) -> None:
        if rate != self.rate:  # re-base only on a change: uncontended jobs keep start + work exactly
            self.rem = max(0.0, self.rem - (t - self.anchor) * self.rate)
            self.anchor, self.rate = t, rate


def simulate_contended(profile: ModelProfile, cost_model: CostModel, schedule: Schedule,
                       contention: Contention, *, compression: CompressionCost | None = None,
                       channels: int = 1, world_size: int | None = None,
                       sharded: ShardingArg = False) -> ContendedResult:
    """Steady-state iteration of ``schedule`` with compute/communication contention.

    Discrete-event processor-sharing simulation of one period from a backward start to the next
    (module docstring). Compute items, in order: the backward of layers ``L-1 .. 0``; then per
    forward step: wait for the bucket's last op, the bucket's update share, the forward. Comm ops
    run in list order per channel, each when its channel is free and its bucket is ready (RS/AR:
    gradients complete and helper-lane compression done; AG: after its RS). Op costs (dense,
    compressed, inline compression included) are those of :class:`Evaluator`.

    With ``sharded`` the op list is :func:`~lightning_pipedap.schedule.sharded_ops` of ``schedule`` and, as in
    :func:`~lightning_pipedap.plan.simulator.simulate`, the channel of the all-gathers runs after every gradient op
    and the backward: clip by norm's gradient all-gathers, the preparation all-reduce, then per sharded bucket its
    step and its parameter all-gather (the step slowed and slowing compute by ``σ_s``, ``σ_cs``; module
    docstring); the next forward pays each sharded bucket's land copy instead of its update. ``compute_s`` is then
    the compute stream's uncontended busy time of that model (:attr:`Evaluator.compute_s`).

    Args:
        profile: layers in forward order.
        cost_model: op costs.
        schedule: fusion + op list (+ compressed flags); validated against the profile.
        contention: ``σ_m``, ``σ_c``, ``δ``; :meth:`Contention.none` reproduces :func:`simulate`.
        compression: the compression cost, required when the schedule flags a bucket compressed.
        channels: 1 or 2 (as :func:`simulate`: RS/AR on channel 0, AG on channel 1).
        world_size: ranks, for ``collective="AG"`` compression and the sharded step (default ``cost_model.meta``).
        sharded: the sharded optimizer step (``True`` or a :class:`~lightning_pipedap.plan.sharding.Sharding`);
            ``False``: unsharded.

    Returns:
        :class:`ContendedResult` (iteration time, op timings, compute intervals, helper lane,
        exposed communication, the sharded step's intervals), in :func:`simulate`'s iteration-origin frame.

    Raises:
        TypeError: if ``contention`` is not a :class:`Contention`.
        ValueError: if the schedule is not executable or does not fit the profile, ``channels``
            is not 1 or 2, or compressed buckets have no ``compression``.
        RuntimeError: if the simulation cannot make progress (an op list the validator accepted
            but whose dependencies cannot be met; a bug).
    """
    if not isinstance(contention, Contention):
        raise TypeError(f"contention must be a Contention, got {type(contention).__name__}")
    schedule.validate(profile.num_layers)
    sharding = resolve_sharding(sharded)
    if sharding is not None:
        schedule = sharded_ops(schedule)
    ev = Evaluator(profile, cost_model, schedule.buckets, channels, compressed=schedule.compressed,
                   compression=compression, world_size=world_size, wire16=schedule.wire16, sharded=sharding)
    sim = _ContendedSim(ev, schedule, _compute_items(ev, profile), contention, compression)
    period = sim.run()
    return _contended_result(sim, period, profile, cost_model, schedule, contention, compression=compression,
                             channels=channels, world_size=world_size)


def _compute_items(ev: Evaluator, profile: ModelProfile) -> list[tuple]:
    """The compute stream of one period, in order: ``("backward", work, bucket, layers)`` for layers ``L-1 .. 0``,
    then per forward step ``("wait", b)``, ``("update", u, b, ())`` (when ``u > 0``; ``"land"`` for a sharded
    bucket), ``("forward", d, b, lay)`` (work in uncontended seconds)."""
    layers, L = profile.layers, profile.num_layers
    bucket_of = {i: b for b, bk in enumerate(ev.buckets) for i in bk}
    items: list[tuple] = [("backward", layers[i].t_b, bucket_of[i], (i,)) for i in range(L - 1, -1, -1)]
    for b, u, d, lay in ev.steps:
        items.append(("wait", b))
        if u > 0:
            items.append(("land" if ev.sharded[b] else "update", u, b, ()))
        items.append(("forward", d, b, lay))
    return items


class _Tail:
    """An item of the sharded step's tail on the all-gathers' channel: ``kind`` ``gather_grads``, ``prepare``,
    ``step`` or ``gather`` (the parameter all-gather, ``idx``: its position in the op list), ``work`` seconds."""

    __slots__ = ("kind", "bucket", "work", "idx")

    def __init__(self, kind: str, bucket: int | None, work: float, idx: int | None = None) -> None:
        self.kind, self.bucket, self.work, self.idx = kind, bucket, work, idx


def _shard_tail(ev: Evaluator, schedule: Schedule) -> tuple[list[_Tail], set[int]]:
    """The tail items in the engine's order (:meth:`Evaluator.run`) and the op-list positions of the sharded
    buckets' parameter all-gathers (run as tail items, not as list ops)."""
    ag_at = {op.bucket: idx for idx, op in enumerate(schedule.ops)
             if op.kind is OpKind.ALL_GATHER and ev.sharded[op.bucket]}
    if not ev.shard_tail:
        return [], set(ag_at.values())
    sh = ev.sharding
    items = [_Tail("gather_grads", b, ev.cost_model.all_gather(ev.wire_bytes[b]))
             for b, _ in ev.shard_tail if sh is not None and sh.clip_norm]
    items.append(_Tail("prepare", None, ev.prepare_s))
    for b, _ in ev.shard_tail:
        items += [_Tail("step", b, ev.step_s[b]), _Tail("gather", b, ev.gather_s[b], ag_at[b])]
    return items, set(ag_at.values())


class _ContendedSim:
    """The discrete-event processor-sharing simulation of :func:`simulate_contended`: one compute job and up to one
    op per channel progress at shared rates; times in the anchor frame (backward start = 0), seconds.

    Args:
        ev: the schedule's :class:`Evaluator` (op costs, channels, buckets, helper-lane order).
        schedule: its ops, in list order per channel.
        items: the compute stream (:func:`_compute_items`).
        contention: ``σ_m``, ``σ_c``, ``δ``.
        compression: helper-lane compression cost (None: no helper lane).
    """

    def __init__(self, ev: Evaluator, schedule: Schedule, items: list[tuple], contention: Contention,
                 compression: CompressionCost | None) -> None:
        self.ev, self.schedule, self.items = ev, schedule, items
        self.s_c, self.delta = contention.compute_slowdown, contention.op_overhead_s
        self.s_cs = contention.compute_slowdown_step
        self.rate_m_loaded = 1.0 / (1.0 + contention.comm_slowdown)
        self.rate_s_loaded = 1.0 / (1.0 + contention.step_slowdown)
        B = ev.B
        #: the bucket whose gradients are complete after the backward of a layer
        self.first_of = {min(bk): b for b, bk in enumerate(ev.buckets)}
        # helper lane: the Evaluator's order, durations not slowed
        self.helper_order = [b for b, _, _ in ev.helper]
        self.helper_cost = ({b: compression.helper_s(ev.nbytes[b]) for b in self.helper_order}
                            if compression is not None else {})
        self.helper_pos, self.helper_free = 0, 0.0
        self.helper_iv: list[tuple[int, float, float]] = []
        self.queues: list[list[tuple[int, object]]] = [[] for _ in range(2)]
        tail, tail_ags = _shard_tail(ev, schedule)
        for idx, op in enumerate(schedule.ops):
            if idx not in tail_ags:
                self.queues[ev.chan[op_code(op)]].append((idx, op))
        #: gradient ops not ended yet, and when the last one ended (the sharded tail waits for all of them)
        self.grad_left, self.grads_end = sum(len(q) for q in self.queues), 0.0
        self.backward_done: float | None = None
        self.queues[ev.chan[K_AG]].extend((-1 if t.idx is None else t.idx, t) for t in tail)
        self.shard_iv: list[tuple[str, int | None, float, float]] = []
        self.qpos = [0, 0]
        self.cjobs: list[_Job | None] = [None, None]
        self.grad_ready: list[float | None] = [None] * B
        self.ready: list[float | None] = [None] * B
        self.rs_end: list[float | None] = [None] * B
        self.done: list[float | None] = [None] * B
        self.timings: list[tuple[int, object, int, float, float] | None] = [None] * len(schedule.ops)
        self.intervals: list[Interval] = []  # anchor frame (backward start = 0)
        self.t = 0.0
        self.ci = 0
        self.cjob: _Job | None = None
        self.wait_since: float | None = None
        self.backward_end = 0.0

    # ---------------------------------------------------------------- compute stream
    def compute_step(self) -> bool:
        """Do one instantaneous compute transition at ``t``; False when nothing can happen."""
        if self.cjob is not None or self.ci >= len(self.items):
            return False
        it = self.items[self.ci]
        t = self.t
        if it[0] == "wait":
            b = it[1]
            done = self.done[b]
            if done is None:
                if self.wait_since is None:
                    self.wait_since = t
                return False
            start = t if self.wait_since is None else self.wait_since
            if done > start:
                self.intervals.append(Interval("wait", start, done, b))
            self.wait_since = None
            self.ci += 1
            return True
        self.cjob = _Job(t, it[1], it)
        if it[1] == 0:  # zero work: ends now
            self.finish_compute()
        return True

    def finish_compute(self) -> None:
        """The compute job ends at ``t``: record it; a backward may complete a bucket's gradients."""
        job = self.cjob
        assert job is not None
        kind, _, b, lay = job.item
        t = self.t
        self.intervals.append(Interval(kind, job.start, t, b, lay))
        self.cjob = None
        self.ci += 1
        if kind == "backward":
            self.backward_end = t
            if lay[0] == 0:  # (the last layer of the backward: layers run L-1 .. 0)
                self.backward_done = t
            fb = self.first_of.get(lay[0])
            if fb is not None:
                self.grad_ready[fb] = t
                if fb not in self.helper_cost:  # else ready when its helper-lane compression ends
                    self.ready[fb] = t
                self._run_helper()

    def _run_helper(self) -> None:
        """Compress, in the helper lane's order, every bucket whose gradients are complete (durations not
        slowed); such a bucket is ready when its compression ends."""
        order, grad_ready = self.helper_order, self.grad_ready
        while self.helper_pos < len(order) and grad_ready[order[self.helper_pos]] is not None:
            hb = order[self.helper_pos]
            gr = grad_ready[hb]
            s = self.helper_free if self.helper_free > gr else gr
            self.helper_free = s + self.helper_cost[hb]
            self.helper_iv.append((hb, s, self.helper_free))
            self.ready[hb] = self.helper_free
            self.helper_pos += 1

    # ---------------------------------------------------------------- channels
    def _dependency(self, op: Any) -> float | None:
        """When ``op``'s input is ready: its RS's end for an AG, else its bucket's readiness; a tail item: every
        gradient op and the backward done (None: not yet)."""
        if isinstance(op, _Tail):
            if self.grad_left or self.backward_done is None:
                return None
            return max(self.grads_end, self.backward_done)
        k = self.ev.kind[op_code(op)]
        return self.rs_end[op.bucket] if k == K_AG else self.ready[op.bucket]

    def channel_step(self, ch: int) -> bool:
        """Start (or skip) the head op of channel ``ch`` at ``t`` if it can; True if something happened."""
        if self.cjobs[ch] is not None or self.qpos[ch] >= len(self.queues[ch]):
            return False
        t = self.t
        idx, op = self.queues[ch][self.qpos[ch]]
        if isinstance(op, _Tail):
            dep = self._dependency(op)
            if dep is None or dep > t:
                return False
            work = op.work + (self.delta if self.cjob is not None and self.delta > 0 and op.kind != "step" else 0.0)
            self.cjobs[ch] = _Job(t, work, (idx, op, ch, op.kind))
            self.qpos[ch] += 1
            if work == 0:
                self.finish_op(ch)
            return True
        c = op_code(op)
        k, b = self.ev.kind[c], op.bucket
        if k == K_SKIP:
            self.timings[idx] = (idx, op, ch, t, t)
            self.qpos[ch] += 1
            self._grad_op_done(t)
            return True
        dep = self.rs_end[b] if k == K_AG else self.ready[b]
        if dep is None or dep > t:
            return False
        work = self.ev.cost[c]
        if self.cjob is not None and self.delta > 0:
            work += self.delta
        job = _Job(t, work, (idx, op, ch, k))
        self.cjobs[ch] = job
        self.qpos[ch] += 1
        if work == 0:
            self.finish_op(ch)
        return True

    def finish_op(self, ch: int) -> None:
        """The op of channel ``ch`` ends at ``t``: record it (an RS's end releases its AG; else the bucket is done)."""
        job = self.cjobs[ch]
        assert job is not None
        idx, op, _, k = job.item
        self.cjobs[ch] = None
        if isinstance(op, _Tail):
            if op.kind == "gather":
                self.timings[idx] = (idx, Op(OpKind.ALL_GATHER, op.bucket), ch, job.start, self.t)
                self.done[op.bucket] = self.t
            else:
                self.shard_iv.append((op.kind, op.bucket, job.start, self.t))
            return
        self.timings[idx] = (idx, op, ch, job.start, self.t)
        if k == K_RS:
            self.rs_end[op.bucket] = self.t
        else:
            self.done[op.bucket] = self.t
        self._grad_op_done(self.t)

    def _grad_op_done(self, t: float) -> None:
        """A gradient op (of the list, not of the sharded tail) ended at ``t``."""
        self.grad_left -= 1
        if t > self.grads_end:
            self.grads_end = t

    # ---------------------------------------------------------------- events
    def _settle(self) -> None:
        """Every instantaneous transition at ``t``: compute first (so an op starting now sees whether compute
        runs), then the channels."""
        progressed = True
        while progressed:
            progressed = self.compute_step()
            if not progressed:
                progressed = self.channel_step(0) or self.channel_step(1)

    def _set_rates(self) -> None:
        """Processor sharing for the next interval: compute slowed by ``σ_c`` per running op (``σ_cs`` per running
        shard step), ops by ``σ_m`` (steps by ``σ_s``) while compute runs."""
        running = [j for j in self.cjobs if j is not None]
        n_step = sum(1 for j in running if j.item[3] == "step")
        n_comm = len(running) - n_step
        t, cjob = self.t, self.cjob
        if cjob is not None:
            cjob.set_rate(1.0 if not running else 1.0 / (1.0 + self.s_c * n_comm + self.s_cs * n_step), t)
        for j in running:
            j.set_rate(1.0 if cjob is None else self.rate_s_loaded if j.item[3] == "step" else self.rate_m_loaded, t)

    def _events(self) -> list[float]:
        """Candidate times of the next event: a job's end, or a channel head's dependency becoming ready."""
        cand = []
        if self.cjob is not None:
            cand.append(self.cjob.end())
        for j in self.cjobs:
            if j is not None:
                cand.append(j.end())
        for ch in range(2):
            if self.cjobs[ch] is None and self.qpos[ch] < len(self.queues[ch]):
                _, op = self.queues[ch][self.qpos[ch]]
                dep = self._dependency(op)
                if dep is not None and dep > self.t:
                    cand.append(dep)
        return cand

    def run(self) -> float:
        """Simulate until the compute stream and both channels are done. Returns the period (s): when the compute
        stream finished its last item.

        Raises:
            RuntimeError: no event can happen (a bug).
        """
        period = None
        guard = 0
        max_events = 8 * (len(self.items) + len(self.schedule.ops)) + 64
        while True:
            self._settle()
            if self.ci >= len(self.items) and self.cjob is None:
                period = self.t if period is None else period
                if all(j is None for j in self.cjobs) and all(self.qpos[c] >= len(self.queues[c]) for c in range(2)):
                    return period
            self._set_rates()
            cand = self._events()
            guard += 1
            if not cand or guard > max_events:
                raise RuntimeError(f"contended simulation of {self.schedule.name!r} made no progress at t={self.t} "
                                   f"s (compute item {self.ci}/{len(self.items)}, channel heads {self.qpos}); this is "
                                   "a bug")
            self.t = t = min(cand)
            if self.cjob is not None and self.cjob.end() <= t:
                self.finish_compute()
            for ch in range(2):
                j = self.cjobs[ch]
                if j is not None and j.end() <= t:
                    self.finish_op(ch)


def _contended_result(sim: _ContendedSim, period: float, profile: ModelProfile, cost_model: CostModel,
                      schedule: Schedule, contention: Contention, *, compression: CompressionCost | None,
                      channels: int, world_size: int | None) -> ContendedResult:
    """The simulation's intervals and op timings moved from the anchor frame to :func:`simulate`'s iteration-origin
    frame (forward start = 0), with the exposed communication and the compute stream's busy time."""
    P = period
    backward_end = sim.backward_end
    shift = P - backward_end  # anchor frame -> iteration-origin frame (forward start = 0)
    fwd = [iv for iv in sim.intervals if iv.kind != "backward"]
    bwd = [iv for iv in sim.intervals if iv.kind == "backward"]
    compute = tuple(Interval(iv.kind, iv.start - backward_end, iv.end - backward_end, iv.bucket, iv.layers)
                    for iv in fwd) + tuple(Interval(iv.kind, iv.start + shift, iv.end + shift, iv.bucket, iv.layers)
                                           for iv in bwd)
    ops = tuple(OpTiming(op, ch, s + shift, e + shift) for _, op, ch, s, e in sim.timings)  # type: ignore[misc]
    helper = tuple(Interval("compress", s + shift, e + shift, b) for b, s, e in sim.helper_iv)
    shard = tuple(Interval(kind, s + shift, e + shift, b) for kind, b, s, e in sim.shard_iv)
    exposed = sum(iv.end - iv.start for iv in compute if iv.kind == "wait")
    busy = sum(iv.end - iv.start for iv in compute if iv.kind != "wait")
    sharding = sim.ev.sharding
    return ContendedResult(
        schedule=schedule, channels=channels, iteration_s=P,
        compute_s=profile.t_compute if sharding is None else sim.ev.compute_s,
        exposed_comm_s=exposed, comm_busy_s=sum(o.end - o.start for o in ops), ops=ops, compute=compute,
        bounds=lower_bounds(profile, cost_model, schedule, channels=channels, compression=compression,
                            world_size=world_size, sharded=sharding or False),
        helper=helper, contention=contention, compute_busy_s=busy, sharding=sharding, shard=shard,
    )
