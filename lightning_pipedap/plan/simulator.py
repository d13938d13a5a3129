"""Timeline simulator of one data-parallel training iteration in steady state.

Model (DeAR ICDCS 2023 §III, PipeDAP TETC 2025 §IV, with consistent costs):

* **One compute stream** runs, per iteration, the forward of layers ``0 .. L-1`` and then the
  backward of layers ``L-1 .. 0`` (``t_f``, ``t_b`` from the profile), back to back.
* **One communication channel** (``channels=1``) runs the schedule's op list in list order, one op
  at a time, every iteration. With ``channels=2`` reduce-scatters and all-reduces use channel 0 and
  all-gathers channel 1, each channel keeping list order; the two channels are assumed not to slow
  each other down (an optimistic what-if, e.g. two NCCL communicators on separate links).
* Op durations come from the :class:`~lightning_pipedap.plan.cost_model.CostModel` at the bucket's
  byte size (a bucket flagged ``wire16`` in the schedule: the model's 16-bit RS and AG,
  :meth:`~lightning_pipedap.plan.cost_model.CostModel.reduce_scatter16`, its AR = that RS + that AG); they are
  never negative and no start-up is shared between ops (sharing is only the explicit RS+AG -> AR fusion of the
  cost model).
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

Exposed communication = iteration time - (Σ t_f + Σ t_b + t_update): the compute stream's idle time (with a
sharded step, see below, only the compute stream's share of the update counts).

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

**Sharded optimizer step** (optional: ``sharded=True`` or a :class:`~lightning_pipedap.plan.sharding.Sharding`,
``shard_optimizer`` of the strategy, issue 30). The simulated op list is the one the engine runs,
:func:`~lightning_pipedap.schedule.sharded_ops` of the schedule: every gradient op in list order (an uncompressed
bucket's ``AR`` runs as its ``RS``), then ``AG(b)`` of every uncompressed ("sharded") bucket in forward order. After
the last gradient op, and no earlier than the end of the backward (the step waits for its hyper-parameters, recorded
once the backward is done), the channel of the all-gathers runs, with ``clip_norm``, one fp32 all-gather of every
sharded bucket's gradients, then one preparation all-reduce of
:data:`~lightning_pipedap.plan.sharding.PREPARE_BYTES_PER_LAYER` bytes per layer (used flags), and then per sharded
bucket in forward order its *step*,
``t_update * bytes(b) / total / N`` seconds (this rank's ``1/N`` shard, N = ``world_size``), followed by ``AG(b)``
(the updated parameters, fp32 bytes: a wire16 bucket's parameters travel in their own dtype). The next forward
waits for ``AG(b)`` and pays, on the compute stream, only a *land* copy of ``land_s_per_byte * bytes(b)`` (default
0; the strategy passes the rate its profiling steps measured). Under parameter ownership
(:attr:`~lightning_pipedap.plan.sharding.Sharding.owned`: a whole-tensor optimizer) a sharded bucket's RS and AG move
its padded bytes and its step is the slowest owner's share instead of ``1/N``
(:func:`~lightning_pipedap.plan.sharding.owned_buckets`, the engine's layout). A compressed bucket stays unsharded: its
update share stays on the compute stream as above. The contention-aware form of this model is
:func:`~lightning_pipedap.plan.contention.simulate_contended` with ``sharded=``.
With two channels the gradient ops use channel 0 and the preparation, the steps and
the all-gathers channel 1; since the latter wait for every gradient op, the period equals the one-channel one. The
steady-state argument holds unchanged: the preparation, the steps and the all-gathers of iteration ``k`` precede the
forward of their bucket in iteration ``k+1``, so the channel is idle when the backward of ``k+1`` starts, and the
step's wait for "the end of the backward" refers to iteration ``k``'s backward (time ``Σ t_b`` of the period).
Exposed communication is then the compute stream's idle time: ``iteration_s - compute_s`` with ``compute_s`` =
Σ t_f + Σ t_b + the unsharded buckets' update shares + the land copies (the steps are on the channel).

The model is compiled per fusion by :class:`~lightning_pipedap.plan.evaluator.Evaluator`; lower bounds
on its iteration time are :func:`~lightning_pipedap.plan.bounds.lower_bounds`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_pipedap.plan.bounds import LowerBounds, lower_bounds
from lightning_pipedap.plan.compression import CompressionCost
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.evaluator import Evaluator, Interval, OpTiming
from lightning_pipedap.plan.profile import ModelProfile
from lightning_pipedap.plan.sharding import Sharding, ShardingArg, resolve_sharding
from lightning_pipedap.schedule import Schedule, sharded_ops

if TYPE_CHECKING:
    from lightning_pipedap.measure.timeline import OpRecord

__all__ = ["SimResult", "simulate", "to_op_records"]

#: record kind and name prefix of the sharded step's channel intervals (:attr:`SimResult.shard`)
_SHARD_RECORD = {"prepare": ("AR", "P"), "gather_grads": ("AG", "GG"), "step": ("step", "S")}


@dataclass(frozen=True)
class SimResult:
    """Steady-state simulation of one schedule.

    Attributes:
        schedule: the simulated schedule; with a sharded step the op list the engine runs,
            :func:`~lightning_pipedap.schedule.sharded_ops` of the schedule given.
        channels: number of communication channels simulated (1 or 2).
        iteration_s: steady-state iteration time (the period), seconds.
        compute_s: Σ t_f + Σ t_b + t_update, seconds (sharded: the compute stream's busy time, the steps of the
            sharded buckets excluded, their land copies included).
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
        sharding: the sharded step's options, or ``None`` (unsharded).
        shard: the sharded step's channel intervals (``prepare``, ``gather_grads``, ``step``; see
            :class:`~lightning_pipedap.plan.evaluator.Interval`), iteration-origin frame; empty when unsharded.
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
    sharding: Sharding | None = None
    shard: tuple[Interval, ...] = ()

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


def simulate(profile: ModelProfile, cost_model: CostModel, schedule: Schedule, *, channels: int = 1,
             compression: CompressionCost | None = None, world_size: int | None = None,
             sharded: ShardingArg = False) -> SimResult:
    """Simulate ``schedule`` in steady state (see the module docstring for the exact model).

    Args:
        profile: layers in forward order; the schedule's buckets name these layer indices.
        cost_model: op costs.
        schedule: fusion + op list (+ compressed flags); validated against ``profile.num_layers``.
        channels: 1 (default) or 2 communication channels.
        compression: the cost of compressing, required when the schedule flags a bucket compressed.
        world_size: ranks, for ``collective="AG"`` compression and the sharded step (default ``cost_model.meta``).
        sharded: the sharded optimizer step (``True`` or a :class:`~lightning_pipedap.plan.sharding.Sharding`;
            module docstring); ``False``: unsharded.

    Returns:
        :class:`SimResult` with the iteration time, exposed communication, every op's start/end,
        the helper lane's compressions, the sharded step's intervals and the schedule's lower bounds.

    Raises:
        ValueError: if the schedule is not executable or does not partition the profile's layers,
            or it flags compressed buckets without a ``compression``, or ``sharded`` without a world size.
        TypeError: ``sharded`` is neither a bool nor a ``Sharding``.
    """
    schedule.validate(profile.num_layers)
    sharding = resolve_sharding(sharded)
    if sharding is not None:
        schedule = sharded_ops(schedule)
    ev = Evaluator(profile, cost_model, schedule.buckets, channels, compressed=schedule.compressed,
                   compression=compression, world_size=world_size, wire16=schedule.wire16, sharded=sharding)
    shard: list[Interval] = []
    P, timings, compute = ev.run(schedule.ops, shard)
    comp = profile.t_compute if sharding is None else ev.compute_s
    return SimResult(
        schedule=schedule, channels=channels, iteration_s=P, compute_s=comp,
        exposed_comm_s=max(0.0, P - comp), comm_busy_s=sum(t.end - t.start for t in timings),
        ops=tuple(timings), compute=tuple(compute),
        bounds=lower_bounds(profile, cost_model, schedule, channels=channels, compression=compression,
                            world_size=world_size, sharded=sharding),
        helper=tuple(ev.helper_intervals(P)), sharding=sharding, shard=tuple(shard),
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
      one's that end after 0, kind ``compress``, lane ``compress``, named ``C<b>``;
    * with a sharded step, its channel intervals (:attr:`SimResult.shard`) like the ops, lane ``comm``: the
      preparation all-reduce (kind ``AR``, named ``P``), clip by norm's gradient all-gathers (kind ``AG``, named
      ``GG<b>``) and each shard's step (kind ``step``, named ``S<b>``); a land copy is a compute record of kind
      ``update`` named ``L<b>``;
    * each record's ``iteration``: ``k`` for the k-th iteration (0-based), ``-1`` for the previous
      iteration's ops, so the Gantt chart can say which iteration an op overlapping the next one is of.

    Hence ``measure.timeline.exposed_communication_ms(records, window=(0, k * P))`` equals
    ``k * exposed_comm_s`` in ms (the channel is busy whenever the compute stream waits), and
    the busy compute per iteration equals ``compute_s``. With helper-lane compression the compute
    stream can also wait while only the helper works; pass ``comm_kinds=COMM_KINDS +
    COMPRESS_KINDS`` to count that time as exposed too; with a sharded step the compute stream also waits while
    the channel steps a shard: pass ``comm_kinds=COMM_KINDS + (STEP_KIND,)``.

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
    prefix = {"forward": "F", "backward": "B", "update": "U", "wait": "W", "land": "L"}
    compute: list[OpRecord] = []
    window = result.compute_window(iterations)  # (each iteration's compute intervals, in order)
    per_iteration = len(result.compute)
    for i, c in enumerate(window):
        it = i // per_iteration if per_iteration else 0
        last = compute[-1] if compute else None
        if (c.kind == "backward" and last is not None and last.kind == "backward" and last.bucket == c.bucket
                and last.iteration == it and abs(last.end_s - c.start) <= 1e-12 * max(1.0, abs(c.start))):
            last.end_s = c.end
            continue
        name = prefix[c.kind] + ("" if c.bucket is None else str(c.bucket))
        kind = "update" if c.kind == "land" else c.kind
        compute.append(OpRecord(name, kind, c.bucket, c.start, c.end, "compute", it))
    comm: list[OpRecord] = []
    for k in range(-1, iterations):
        for t in result.ops:
            s, e = t.start + k * P, t.end + k * P
            if k >= 0 or e > 0.0:
                comm.append(OpRecord(str(t.op), t.op.kind.value, t.op.bucket, s, e, "comm", k))
        for c in result.shard:
            s, e = c.start + k * P, c.end + k * P
            if k >= 0 or e > 0.0:
                kind, name = _SHARD_RECORD[c.kind]
                comm.append(OpRecord(name + ("" if c.bucket is None else str(c.bucket)), kind, c.bucket, s, e, "comm",
                                     k))
    comm.sort(key=lambda r: (r.start_s, r.end_s))
    helper: list[OpRecord] = []
    for k in range(-1, iterations):
        for c in result.helper:
            s, e = c.start + k * P, c.end + k * P
            if k >= 0 or e > 0.0:
                helper.append(OpRecord(f"C{c.bucket}", "compress", c.bucket, s, e, "compress", k))
    helper.sort(key=lambda r: (r.start_s, r.end_s))
    return compute + comm + helper
