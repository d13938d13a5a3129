"""The communication engine: the trainer's side of gradient synchronisation, and its worker thread.

Data flow inside one iteration (a bucket's states: :mod:`.bucket_sync`)::

    backward (autograd thread)                   worker thread (:class:`~.worker.OpWorker`, own process group)
    ───────────────────────────                  ───────────────────────────────────────────────────────────────
    begin_iteration(): every bucket COLLECTING
    grad_ready(param) ─ copy into bucket ──┐
      bucket complete → mark_ready: READY ─┼──▶ for op in schedule.ops (same order on every rank):
    finish_backward(): unused params → 0 ──┘      RS(b)/AR(b): wait READY; REDUCING → REDUCED (RS) / GATHERED (AR)
                                                  AG(b): GATHERING → GATHERED
    next forward (main thread)
    wait_done(b) ◀──────────────────────────────── GATHERED
    apply bucket b's update: LANDED (strategy.deferred), or write .grad: WRITTEN

Every wait has a timeout and names the operation; an exception in the worker is re-raised in the
main thread at the next wait. With ``bucket_view`` (``gradient_as_bucket_view``) ``.grad`` is the
bucket's view itself: backward accumulates into it and ``grad_ready`` divides in place, no copy. On CUDA
the worker issues collectives on its own stream and the hand-offs carry CUDA events, so the main thread
never synchronises the host on the hot path.

Tensor partitioning (``Schedule.pieces``; ByteScheduler, Peng et al., SOSP 2019): a bucket's slots are
units, element ranges of parameters; ``grad_ready`` of a split parameter copies each piece into its own
bucket, and a bucket is ready when every slot is filled. Without ``pieces`` (or when no parameter is
split) nothing of this costs anything per step.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from lightning_pipedap.engine import collectives as C
from lightning_pipedap.engine.bucket_sync import BucketState, BucketSync
from lightning_pipedap.engine.buckets import FlatBucket, allocate_buckets, param_places
from lightning_pipedap.plan.sharding import assign_owners
from lightning_pipedap.engine.carry import GradientCarry
from lightning_pipedap.engine.shard_step import ShardedStep
from lightning_pipedap.engine.transport import DenseTransport, bucket_transports
from lightning_pipedap.engine.update import write_back_grads
from lightning_pipedap.engine.views import BucketViews, view_refusal
from lightning_pipedap.engine.waits import EngineWaits
from lightning_pipedap.engine.worker import EngineError, OpWorker
from lightning_pipedap.engine.streams import streams_for
from lightning_pipedap.measure.timeline import OpTiming
from lightning_pipedap.schedule import Schedule, sharded_ops

__all__ = ["BucketState", "CommEngine", "EngineError", "OpTiming", "view_refusal"]


class CommEngine(EngineWaits):
    """Executes a :class:`~lightning_pipedap.schedule.Schedule` on the dedicated process group.

    Args:
        comm: the dedicated group (see :func:`collectives.new_comm_group`).
        params: trainable parameters with dense gradients, indexed as ``schedule.buckets`` (or ``schedule.pieces``)
            name them (may be empty: a model whose every gradient is sparse gets an engine without buckets).
        schedule: fusion and op list; validated against ``len(params)`` and their sizes. With
            ``schedule.pieces`` (tensor partitioning, ByteScheduler SOSP 2019) a bucket's slots are
            element ranges of parameters: a split parameter's gradient is copied piece by piece into
            each of its buckets by :meth:`grad_ready`, and a bucket is ready when all its slots are.
        wait_timeout_s: timeout, in seconds, of every wait (worker waiting for gradients, trainer
            waiting for an op).
        transport_factory: optional ``f(buckets) -> CompressedTransport``; with it the buckets
            flagged in ``schedule.compressed`` are compressed and their RS/AR op performs the whole
            compressed reduction (:mod:`.compressed`); not called when no bucket is flagged.
        wire_dtype: ``"fp32"`` (default), ``"fp16"`` or ``"bf16"``: the wire format of the buckets
            flagged in ``schedule.wire16`` (their RS/AG cast each piece in the send path and sum in
            fp32; :class:`~lightning_pipedap.engine.transport.DenseTransport`); the other buckets
            travel in their own dtype.
        bucket_view: ``gradient_as_bucket_view`` (:mod:`.views`): every ``.grad`` is its view of the bucket
            where :func:`view_refusal` allows it; :attr:`view_refusals` says why not elsewhere.
        param_names: the parameters' names in ``params`` order, for messages (optional).
        shard: the sharded optimizer step (``shard_optimizer``, :mod:`.shard_step`); with ``shard_ops`` (deferred
            sharded rounds) the op list becomes :func:`~lightning_pipedap.schedule.sharded_ops` of ``schedule``,
            without it (warm-up engines: sync-mode steps only) it runs as planned.
        shard_owned: with ``shard``, parameter ownership (a whole-tensor optimizer such as Muon or Adafactor):
            each uncompressed bucket's parameters are assigned whole to the ranks
            (:func:`~lightning_pipedap.plan.sharding.assign_owners`, balancing ``owner_costs``, else elements) and
            laid out in their owners' shards, padded to the largest (:meth:`FlatBucket.allocate`).
        owner_costs: per parameter (``params`` order), the cost ownership balances (seconds of its optimizer step,
            :func:`~lightning_pipedap.probe.optimizer_time.optimizer_step_times`); identical on every rank.

    Raises:
        ValueError: if the schedule does not partition ``params`` or is not executable, or flags
            ``wire16`` buckets while ``wire_dtype`` is ``"fp32"`` (the message names the choices).
    """

    def __init__(self, comm: C.CommGroup, params: Sequence[torch.Tensor], schedule: Schedule, wait_timeout_s: float,
                 transport_factory=None, wire_dtype: str = "fp32", bucket_view: bool = False,
                 param_names: Optional[Sequence[str]] = None, shard: bool = False, shard_ops: bool = True,
                 shard_owned: bool = False, owner_costs: Optional[Sequence[float]] = None) -> None:
        schedule.validate(len(params), [p.numel() for p in params])
        if shard and shard_ops:  # (every gradient op before the first all-gather of parameters: see sharded_ops)
            schedule = sharded_ops(schedule, compressed=transport_factory is not None)
        if schedule.num_wire16 and wire_dtype not in C.WIRE_DTYPES:
            raise ValueError(f"schedule {schedule.name!r} sends {schedule.num_wire16} bucket(s) in the 16-bit wire "
                             f"format but wire_dtype={wire_dtype!r}; valid: {', '.join(map(repr, C.WIRE_DTYPES))}")
        self.comm = comm
        self.schedule = schedule
        #: the parameters' names (engine order) for messages; empty when not given
        self.param_names = list(param_names) if param_names is not None else []
        self.wait_timeout_s = float(wait_timeout_s)
        self._params = list(params)
        owners = None
        if shard and shard_owned:  # (a whole-tensor optimizer: each parameter stepped whole by one rank)
            compressed = transport_factory is not None
            cost = list(owner_costs) if owner_costs is not None else [p.numel() for p in params]
            owners = assign_owners([None if compressed and schedule.is_compressed(b) else
                                    [cost[i] for i in idxs] for b, idxs in enumerate(schedule.buckets)],
                                   comm.world_size)
        self.buckets = allocate_buckets(schedule, params, comm.world_size, owners)
        #: param index -> its ``(bucket, slot, start, stop)`` places, in element order (whole: one place);
        #: split param index -> the buckets holding its pieces (element order; empty without splits)
        self.places, self.split = param_places(self.buckets)
        #: the compressed transport (None when no bucket is compressed); per bucket, how its ops run
        self.transport, self._transports = bucket_transports(schedule, self.buckets, comm, transport_factory,
                                                             C.WIRE_DTYPES.get(wire_dtype))
        self._views = BucketViews(self.buckets if bucket_view else [], lambda b: view_refusal(
            b, compressed=self.transport is not None and schedule.is_compressed(b.index),
            wire16=schedule.is_wire16(b.index), buckets_of=self.split, names=param_names, sharded=shard))
        #: bucket index -> why it keeps the copy path under ``bucket_view`` (:func:`view_refusal`)
        self.view_refusals = self._views.refusals
        #: gradients copied into a bucket by :meth:`grad_ready` or :meth:`attach_views` (on the view path only
        #: a ``.grad`` that is not the view yet is copied, once)
        self.copies = 0
        self._local: set[int] = set()  # param indices with a gradient from a backward without communication
        self._slot_of = {i: pl[0][:2] for i, pl in self.places.items()}  # (bucket, slot) of the (first) place
        self._got = [False] * len(params)
        device = self.buckets[0].buffer.device if self.buckets else torch.device("cpu")  # (none: sparse grads only)
        #: values added once to a parameter's next gradient (:class:`GradientCarry`: error-feedback residuals)
        self.carry = GradientCarry({i: p.numel() for i, p in enumerate(self._params) if i in self._slot_of}, device)
        # events hand gradients to the comm stream and results back, without host syncs (CPU: checked no-ops)
        streams = streams_for(device)
        #: per bucket, its life-cycle object (state, hand-off events: :class:`BucketSync`)
        self.syncs = [BucketSync(b, streams) for b in self.buckets]
        self.collecting = False
        self.iteration = 0
        #: ``() -> str``: what the run-time is doing (phase, step), for error messages
        self.context: Optional[Callable[[], str]] = None
        #: ``(wait_s) -> str``: which peers do not answer (``Heartbeat.describe``), for error messages
        self.peers: Optional[Callable[[float], str]] = None
        #: the communication worker (its op timings: ``timeline_enabled``, ``take_timings()``, ``last_round_busy_s``)
        self.worker = OpWorker(schedule, self.syncs, self._transports, self.wait_timeout_s, device)
        #: the sharded optimizer step (``shard``; :class:`~.shard_step.ShardedStep`), or None
        self.shard = ShardedStep.for_engine(self, DenseTransport(comm)) if shard else None
    # ------------------------------------------------------------------ trainer side
    @property
    def num_buckets(self) -> int:
        """Number of buckets of the schedule."""
        return len(self.buckets)

    @property
    def params(self) -> list[torch.Tensor]:
        """The engine's parameters (engine order: the indices ``schedule.buckets`` or ``schedule.pieces`` use)."""
        return self._params

    def buckets_of(self, param_index: int) -> tuple[int, ...]:
        """The buckets holding parameter ``param_index`` (one for a whole parameter; a split one's in element order)."""
        return self.split.get(param_index) or (self._slot_of[param_index][0],)

    def begin_iteration(self, label: Optional[int] = None) -> None:
        """Start collecting gradients for one reduction round and wake the worker.

        ``label``: the training iteration these gradients belong to (the strategy's optimizer step), kept in the
        round's op timings (:attr:`OpTiming.iteration`) so a timeline can tell rounds apart; default: the round
        count (:attr:`iteration`).

        Raises:
            EngineError: if the previous round has not finished within the timeout, or the worker failed.
        """
        self._check()
        if not self.worker.wait_idle(self.wait_timeout_s):
            raise EngineError(f"pipedap: previous round of {self.schedule.name} ops did not finish within "
                              f"{self.wait_timeout_s} s{self._where()}")
        self._check()
        for sync in self.syncs:
            sync.start_collect()  # gradient slots are overwritten by grad_ready or zeroed by finish_backward
        self._got = [False] * len(self._got)
        self.iteration += 1
        self.collecting = True
        if self.shard is not None:
            self.shard.begin_round()
        self.worker.start(self.iteration if label is None else label)

    def grad_ready(self, param_index: int, grad: torch.Tensor) -> None:
        """Copy one parameter's finished local gradient into its bucket (called from the autograd thread).

        A split parameter (``schedule.pieces``) is copied piece by piece: elements ``[start, stop)`` of
        ``grad`` flattened (row-major, ``grad.reshape(-1)``) go to each of its buckets; every bucket whose
        slots are all filled is marked ready.

        Args:
            param_index: index of the parameter in the engine's parameter list.
            grad: its gradient, same shape as the parameter.

        Raises:
            EngineError: if the parameter already delivered a gradient in this round (for example
                reentrant activation checkpointing, which runs a nested backward; use
                ``use_reentrant=False``).
        """
        if self._got[param_index]:
            raise EngineError(
                f"pipedap: parameter {param_index} produced its gradient twice in one backward; nested "
                "backward passes (reentrant activation checkpointing) are not supported: use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )
        self._got[param_index] = True
        if self.split and param_index in self.split:
            self._split_grad_ready(param_index, grad)
            return
        b, slot = self._slot_of[param_index]
        bucket = self.buckets[b]
        view = bucket.grad_view(slot)
        if bucket.as_view and bucket.is_view(slot, grad):
            view.div_(self.comm.world_size)  # backward accumulated into the bucket itself
        else:
            torch.mul(grad, 1.0 / self.comm.world_size, out=view)  # (DDP's copy: times 1/N, not divided by N)
            self.copies += 1
            if bucket.as_view:  # autograd made a new tensor (.grad was None), or user code replaced .grad
                bucket.params[slot].grad = view
        if self.carry:
            extra = self.carry.pop(param_index)
            if extra is not None:  # once: see GradientCarry
                view.add_(extra.view(view.shape).to(view.dtype))
        if self.syncs[b].fill(slot):
            self._mark_ready(b)

    def _split_grad_ready(self, param_index: int, grad: torch.Tensor) -> None:
        """:meth:`grad_ready` of a split parameter: each piece (``stop - start`` elements of ``grad`` flattened,
        divided by the world size, plus its part of a carried value) into its bucket; no bucket of a split
        parameter is a view bucket (:func:`view_refusal`), so this always copies."""
        flat = grad.detach().reshape(-1)
        extra = self.carry.pop(param_index)
        for b, slot, start, stop in self.places[param_index]:
            bucket = self.buckets[b]
            view = bucket.grad_view(slot)
            torch.mul(flat[start:stop], 1.0 / self.comm.world_size, out=view)  # (as DDP's copy, see grad_ready)
            if extra is not None:  # once: see GradientCarry
                view.add_(extra[start:stop].to(view.dtype))
            self.copies += 1
            if self.syncs[b].fill(slot):
                self._mark_ready(b)

    def attach_views(self) -> None:
        """``bucket_view``: before a backward, point every None ``.grad`` at its zeroed view and move any other
        into its view (:meth:`BucketViews.attach`), after waiting for a round still running (no op of the
        worker may write the buffer while it is zeroed).

        Raises:
            EngineError: if the previous round does not finish within the timeout, or the worker failed.
        """
        if not self._views.buckets:
            return
        if not self.worker.idle:
            self.wait_idle()
        self._check()
        self.copies += self._views.attach()

    def local_gradient(self, param_index: int) -> None:
        """Parameter ``param_index`` got a gradient in a backward that does not communicate (an accumulation
        micro-batch, ``no_sync``): it counts as used in the next round even without a gradient in that round's
        backward, and :meth:`finish_backward` reduces its accumulated ``.grad`` (as DDP's reducer, which marks a
        parameter used in any micro-batch of the window and reduces its accumulated gradient)."""
        self._local.add(param_index)

    def local_gradients(self) -> list[int]:
        """The parameters (engine indices) recorded by :meth:`local_gradient` since the last communicating
        backward: those an accumulation window has used so far, for an engine that replaces this one mid-window."""
        return sorted(self._local)

    def finish_backward(self) -> None:
        """Mark every incomplete bucket ready. A parameter that got no gradient in this backward but one in a
        micro-batch before it (:meth:`local_gradient`) contributes its accumulated ``.grad``; the others
        contribute zeros, flag 0."""
        if not self.collecting:
            return
        local, self._local = self._local, set()
        for i in sorted(local):
            if not self._got[i]:
                grad = self._params[i].grad
                if grad is not None:
                    self.grad_ready(i, grad)
        for b in range(self.num_buckets):
            if not self.syncs[b].is_ready:
                bucket = self.buckets[b]
                for slot, i in enumerate(bucket.param_indices):
                    if not self._got[i]:
                        bucket.grad_view(slot).zero_()
                self._mark_ready(b)
        self.collecting = False

    def used_flags(self, b: int) -> list[bool]:
        """Per slot of bucket ``b``: whether its parameter got a gradient on *any* rank in this round (every
        piece of a split parameter alike).

        The host reads the reduced flags (a device sync on CUDA) only when some parameter of the bucket got
        no local gradient. Call once the bucket is reduced. ``bucket_view``: an attached view no rank
        produced a gradient for is taken back here (``.grad = None``, as under DDP), before any update reads it.
        """
        bucket = self.buckets[b]
        local = [self._got[i] for i in bucket.param_indices]
        if all(local):
            used = local
        else:
            reduced = (bucket.flags > 0).tolist()
            used = [mine or any_rank for mine, any_rank in zip(local, reduced)]
        self._views.detach_unused(bucket, used)
        return used

    def write_back(self, b: int) -> FlatBucket:
        """Sync mode: wait for bucket ``b`` and write its averaged gradients to ``.grad`` (GATHERED -> WRITTEN;
        :func:`~lightning_pipedap.engine.update.write_back_grads`). Returns the bucket.

        Raises:
            EngineError: on timeout (naming the op) or if the worker failed.
        """
        bucket = self.wait_done(b)
        write_back_grads(bucket, self.used_flags(b))
        self.syncs[b].write()
        return bucket

    def close(self, abort: bool = False) -> None:
        """Stop the worker. With ``abort`` (after an exception) do not wait for a running op."""
        if self.worker.closed:
            return
        self.worker.close(abort)
        if self.transport is not None:
            self.transport.close()

    # ------------------------------------------------------------------ internals
    def _mark_ready(self, b: int) -> None:
        if self.shard is not None:
            self.shard.mark_ready(b)
        self._transports[b].ready(self.buckets[b])
        self.syncs[b].mark_ready()
