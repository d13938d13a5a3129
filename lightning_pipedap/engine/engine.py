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
bucket's view itself: backward accumulates into it and ``grad_ready`` divides in place, no copy. On CUDA the worker issues collectives on its own stream and the
hand-offs carry CUDA events, so the main thread never synchronises the host on the hot path.

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
from lightning_pipedap.engine.buckets import FlatBucket
from lightning_pipedap.engine.transport import DenseTransport, Transport
from lightning_pipedap.engine.worker import EngineError, OpWorker
from lightning_pipedap.measure.timeline import OpTiming
from lightning_pipedap.schedule import Schedule

__all__ = ["BucketState", "CommEngine", "EngineError", "OpTiming", "view_refusal"]


def view_refusal(bucket: FlatBucket, compressed: bool = False, wire16: bool = False,
                 buckets_of: Optional[dict[int, Sequence[int]]] = None,
                 names: Optional[Sequence[str]] = None) -> Optional[str]:
    """Why ``bucket`` cannot hold its parameters' ``.grad`` as views of its buffer, or None when it can.

    ``gradient_as_bucket_view`` makes each parameter's ``.grad`` a view into the bucket, so the bucket's
    contents must be the gradient itself at every point user code can see it. That fails when

    - the bucket is ``compressed``: the compressor reads the bucket and writes its own reconstruction;
    - it travels in the 16-bit wire format (``wire16``): the owner rounds its reduced shard in place;
    - it holds a piece of a split parameter (tensor partitioning): that parameter's ``.grad`` spans
      several buckets, so it cannot be one view of one buffer;
    - a parameter is not a contiguous dense tensor: a contiguous view would break the gradient
      layout contract (``.grad`` strides equal to the parameter's).

    Such a bucket keeps the copy path (same values in ``.grad``, one more copy).

    Args:
        bucket: the bucket (its parameters are read, not changed).
        compressed: whether the schedule compresses this bucket.
        wire16: whether the schedule sends this bucket in the 16-bit wire format.
        buckets_of: split parameter index -> the buckets holding its pieces (for the message; optional).
        names: the parameters' names by engine index (for the message; optional: ``"parameter <index>"``).

    Returns:
        None, or a short reason naming the cause (for the log).
    """
    def called(i: int) -> str:
        return f"{names[i]} (parameter {i})" if names is not None and i < len(names) else f"parameter {i}"

    if compressed:
        return "it is compressed (the compressor rewrites the bucket)"
    if wire16:
        return "it travels in the 16-bit wire format (its reduced shard is rounded in the buffer)"
    for slot, p in enumerate(bucket.params):
        if bucket.is_piece(slot):
            i = bucket.param_indices[slot]
            start, stop = bucket.ranges[slot]
            where = (f"split over buckets {', '.join(map(str, buckets_of[i]))}" if buckets_of and i in buckets_of
                     else "split over several buckets")
            return (f"it holds part of {called(i)} (elements [{start}, {stop}) of {p.numel()}, {where}), whose "
                    ".grad cannot be a view of one bucket")
    for slot, p in enumerate(bucket.params):
        if p.layout != torch.strided or not p.is_contiguous():
            return (f"{called(bucket.param_indices[slot])} (shape {tuple(p.shape)}) is not a contiguous dense "
                    "tensor (its .grad layout differs from the flat buffer's)")
    return None


class CommEngine:
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
            compressed reduction (their AG, if any, is then a no-op marker); the other buckets run
            their RS/AG/AR as usual. Not called when no bucket is flagged. The compression happens
            where the planner's model puts it (:mod:`lightning_pipedap.plan.compression`): with a
            helper process (``pipeline.mode == "process"``) the bucket is submitted as soon as its
            gradients are complete; inline it is compressed by this worker at the op's slot, on the
            communication channel, so it never stalls the backward pass.
        wire_dtype: ``"fp32"`` (default), ``"fp16"`` or ``"bf16"``: the wire format of the buckets
            flagged in ``schedule.wire16`` (their RS/AG cast each piece in the send path and sum in
            fp32; :class:`~lightning_pipedap.engine.transport.DenseTransport`); the other buckets
            travel in their own dtype.
        bucket_view: ``gradient_as_bucket_view``: every parameter's ``.grad`` is its view of the
            bucket (set by :meth:`attach_views` before a backward, or by :meth:`grad_ready` when
            autograd made a new tensor), so backward accumulates into the bucket and
            :meth:`grad_ready` only divides in place. Buckets refused by :func:`view_refusal`
            keep the copy path; :attr:`view_refusals` says why.
        param_names: the parameters' names in ``params`` order, for messages (optional).

    Raises:
        ValueError: if the schedule does not partition ``params`` or is not executable, or flags
            ``wire16`` buckets while ``wire_dtype`` is ``"fp32"`` (the message names the choices).
    """

    def __init__(self, comm: C.CommGroup, params: Sequence[torch.Tensor], schedule: Schedule, wait_timeout_s: float,
                 transport_factory=None, wire_dtype: str = "fp32", bucket_view: bool = False,
                 param_names: Optional[Sequence[str]] = None) -> None:
        schedule.validate(len(params), [p.numel() for p in params])
        if schedule.num_wire16 and wire_dtype not in C.WIRE_DTYPES:
            raise ValueError(f"schedule {schedule.name!r} sends {schedule.num_wire16} bucket(s) in the 16-bit wire "
                             f"format but wire_dtype={wire_dtype!r}; valid: {', '.join(map(repr, C.WIRE_DTYPES))}")
        self.comm = comm
        self.schedule = schedule
        self.wait_timeout_s = float(wait_timeout_s)
        self._params = list(params)
        if schedule.pieces is None:
            self.buckets = [
                FlatBucket.allocate(b, idxs, [params[i] for i in idxs], comm.world_size)
                for b, idxs in enumerate(schedule.buckets)
            ]
        else:
            pieces = schedule.pieces
            self.buckets = [
                FlatBucket.allocate(b, tuple(pieces[u][0] for u in units), [params[pieces[u][0]] for u in units],
                                    comm.world_size, [pieces[u][1:] for u in units], units)
                for b, units in enumerate(schedule.buckets)
            ]
        #: param index -> its ``(bucket, slot, start, stop)`` places, in element order (whole: one place)
        self.places: dict[int, list[tuple[int, int, int, int]]] = {}
        for b in self.buckets:
            for s, i in enumerate(b.param_indices):
                self.places.setdefault(i, []).append((b.index, s) + tuple(b.ranges[s]))
        for pl in self.places.values():
            pl.sort(key=lambda place: place[2])
        #: split param index -> the buckets holding its pieces (element order; empty without splits)
        self.split: dict[int, tuple[int, ...]] = {
            i: tuple(dict.fromkeys(b for b, _, _, _ in pl)) for i, pl in self.places.items()
            if any(self.buckets[b].is_piece(s) for b, s, _, _ in pl)}
        # The compressed transport's pipeline is built over *all* buckets (simple bucket numbering, telemetry
        # by bucket index; slots of uncompressed buckets stay unused); only flagged buckets use it.
        wants = transport_factory is not None and schedule.num_compressed > 0
        #: the compressed transport (None when no bucket is compressed)
        self.transport = transport_factory(self.buckets) if wants else None
        dense = DenseTransport(comm)
        half = DenseTransport(comm, C.WIRE_DTYPES[wire_dtype]) if schedule.num_wire16 else dense
        self._transports: list[Transport] = [
            self.transport if self.transport is not None and schedule.is_compressed(b)
            else half if schedule.is_wire16(b) else dense
            for b in range(len(self.buckets))]
        #: bucket index -> why it keeps the copy path under ``bucket_view`` (:func:`view_refusal`)
        self.view_refusals: dict[int, str] = {}
        if bucket_view:
            for b in self.buckets:
                reason = view_refusal(b, compressed=self.transport is not None and schedule.is_compressed(b.index),
                                      wire16=schedule.is_wire16(b.index), buckets_of=self.split,
                                      names=param_names)
                if reason is None:
                    b.as_view = True
                else:
                    self.view_refusals[b.index] = reason
        self._view_buckets = [b for b in self.buckets if b.as_view]  # (attach_views runs before every backward)
        #: gradients copied into a bucket by :meth:`grad_ready` or :meth:`attach_views` (on the view path only
        #: a ``.grad`` that is not the view yet is copied, once)
        self.copies = 0
        self._attached: set[int] = set()  # param indices whose None .grad attach_views pointed at the view
        self._local: set[int] = set()  # param indices with a gradient from a backward without communication
        self._slot_of = {i: pl[0][:2] for i, pl in self.places.items()}  # (bucket, slot) of the (first) place
        self._got = [False] * len(params)
        self._carry: dict[int, torch.Tensor] = {}  # param index -> values added once to its next gradient
        # CUDA: events hand gradients to the comm stream and results back, without host syncs.
        cuda = bool(self.buckets) and self.buckets[0].buffer.is_cuda  # (no bucket: sparse gradients only)
        #: per bucket, its life-cycle object (state, hand-off events: :class:`BucketSync`)
        self.syncs = [BucketSync(b, cuda) for b in self.buckets]
        self.collecting = False
        self.iteration = 0
        #: ``() -> str``: what the run-time is doing (phase, step), for error messages
        self.context: Optional[Callable[[], str]] = None
        #: ``(wait_s) -> str``: which peers do not answer (``Heartbeat.describe``), for error messages
        self.peers: Optional[Callable[[float], str]] = None
        self._worker = OpWorker(schedule, self.syncs, self._transports, self.wait_timeout_s,
                                self.buckets[0].buffer.device if cuda else None)

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
        if not self._worker.wait_idle(self.wait_timeout_s):
            raise EngineError(f"pipedap: previous round of {self.schedule.name} ops did not finish within "
                              f"{self.wait_timeout_s} s{self._where()}")
        self._check()
        for sync in self.syncs:
            sync.start_collect()  # gradient slots are overwritten by grad_ready or zeroed by finish_backward
        self._got = [False] * len(self._got)
        self.iteration += 1
        self.collecting = True
        self._worker.start(self.iteration if label is None else label)

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
        if self._carry:
            extra = self._carry.pop(param_index, None)
            if extra is not None:  # once: see carry_to_next_gradient
                view.add_(extra.view(view.shape).to(view.dtype))
        if self.syncs[b].fill(slot):
            self._mark_ready(b)

    def _split_grad_ready(self, param_index: int, grad: torch.Tensor) -> None:
        """:meth:`grad_ready` of a split parameter: each piece (``stop - start`` elements of ``grad`` flattened,
        divided by the world size, plus its part of a carried value) into its bucket; no bucket of a split
        parameter is a view bucket (:func:`view_refusal`), so this always copies."""
        flat = grad.detach().reshape(-1)
        extra = self._carry.pop(param_index, None) if self._carry else None
        for b, slot, start, stop in self.places[param_index]:
            bucket = self.buckets[b]
            view = bucket.grad_view(slot)
            torch.mul(flat[start:stop], 1.0 / self.comm.world_size, out=view)  # (as DDP's copy, see grad_ready)
            if extra is not None:  # once: see carry_to_next_gradient
                view.add_(extra[start:stop].to(view.dtype))
            self.copies += 1
            if self.syncs[b].fill(slot):
                self._mark_ready(b)

    def carry_to_next_gradient(self, values: dict[int, torch.Tensor]) -> None:
        """Add ``values[i]`` once to parameter ``i``'s next gradient in its bucket, before communication.

        For error-feedback residuals of parameters that are now sent dense (a re-plan, or warm-up
        steps, stopped compressing them): the residual is what earlier compressions of this rank
        left out, so it must reach the other ranks exactly once (error feedback: Seide et al. 2014;
        Karimireddy et al. 2019). Units are those of the bucket: the local gradient divided by the
        world size (what :meth:`grad_ready` writes and the compressors compensate), so no scaling is
        applied here. A value is added in :meth:`grad_ready` of a round where the parameter has a
        local gradient, then dropped; one still waiting when the engine is replaced is returned by
        :meth:`take_carried`. Values for the same parameter accumulate. Call between rounds.

        Args:
            values: engine parameter index -> tensor of that parameter's ``numel`` elements (any
                shape, any float dtype; stored as a flat fp32 copy on the bucket's device).

        Raises:
            ValueError: for an index out of range or a tensor with the wrong number of elements.
        """
        for i, v in values.items():
            if not (isinstance(i, int) and i in self._slot_of):
                raise ValueError(f"carry_to_next_gradient: parameter index {i!r} out of range; valid: "
                                 f"0..{len(self._got) - 1}")
            b, slot = self._slot_of[i]
            n = self.buckets[b].params[slot].numel()
            if v.numel() != n:
                raise ValueError(f"carry_to_next_gradient: parameter {i} has {n} elements, the value has {v.numel()}")
            flat = v.detach().reshape(-1).to(device=self.buckets[b].buffer.device, dtype=torch.float32, copy=True)
            old = self._carry.get(i)
            self._carry[i] = flat if old is None else old.add_(flat)

    def take_carried(self, clear: bool = True) -> dict[int, torch.Tensor]:
        """Values of :meth:`carry_to_next_gradient` not added yet (flat fp32, by parameter index).

        With ``clear`` (default) they are removed from the engine (the caller takes them over, e.g.
        to hand them to the next engine); ``clear=False`` returns copies and keeps them (checkpoints).
        """
        if clear:
            out, self._carry = self._carry, {}
            return out
        return {i: v.clone() for i, v in self._carry.items()}

    def attach_views(self) -> None:
        """``bucket_view``: before a backward, point every ``.grad`` that is None at its zeroed view, and move
        any other ``.grad`` that is not this engine's view (an earlier engine's view after a new schedule was
        installed, or a tensor user code assigned) into its view (one copy, values unchanged).

        Autograd then accumulates into the bucket (no new tensor, no copy). A parameter attached here
        that then gets a gradient on no rank gets ``.grad = None`` back in :meth:`used_flags` (DDP
        leaves it None, and the optimizer must not step it). Waits for a round still running, so
        no operation of the worker writes the buffer while it is zeroed.

        Raises:
            EngineError: if the previous round does not finish within the timeout, or the worker failed.
        """
        views = self._view_buckets
        if not views:
            return
        if not self._worker.idle:
            self.wait_idle()
        self._check()
        for bucket in views:
            for slot, p in enumerate(bucket.params):
                if p.grad is None:
                    view = bucket.grad_view(slot)
                    view.zero_()
                    p.grad = view
                    self._attached.add(bucket.param_indices[slot])
                elif not bucket.is_view(slot, p.grad):
                    # a view of an earlier engine's bucket (a new schedule was installed) or a tensor user code
                    # put there: same values, now in this bucket (and the earlier bucket can be freed)
                    view = bucket.grad_view(slot)
                    view.copy_(p.grad)
                    p.grad = view
                    self.copies += 1

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

    def wait_done(self, b: int) -> FlatBucket:
        """Block until bucket ``b`` is fully reduced (its AG or AR finished); return the bucket.

        On CUDA this makes the current stream wait for the op instead of blocking the host.

        Raises:
            EngineError: on timeout (naming the op) or if the worker failed.
        """
        sync = self.syncs[b]
        if not sync.wait_gathered(self.wait_timeout_s):
            self._check()
            raise EngineError(f"pipedap: timed out after {self.wait_timeout_s} s waiting for all-gather/all-reduce "
                              f"of bucket {b}{self._where()}")
        self._check()
        return self.buckets[b]

    def used_flags(self, b: int) -> list[bool]:
        """Per slot of bucket ``b``: whether its parameter got a gradient on *any* rank in this round (every
        piece of a split parameter alike).

        A parameter that got a local gradient is used without looking at the reduced flag, so the
        host reads the reduced flags (a device sync on CUDA) only when some parameter of the bucket
        got no local gradient. Call once the bucket is reduced.

        ``bucket_view``: a parameter whose None ``.grad`` :meth:`attach_views` pointed at its view and
        that no rank produced a gradient for gets ``.grad = None`` back here (as under DDP), before any
        update reads it.
        """
        bucket = self.buckets[b]
        local = [self._got[i] for i in bucket.param_indices]
        if all(local):
            used = local
        else:
            reduced = (bucket.flags > 0).tolist()
            used = [l or r for l, r in zip(local, reduced)]
        if self._attached:
            for slot, i in enumerate(bucket.param_indices):
                if i in self._attached:
                    self._attached.discard(i)
                    if not used[slot] and bucket.is_view(slot, bucket.params[slot].grad):
                        bucket.params[slot].grad = None
        return used

    def wait_idle(self) -> None:
        """Block until the worker finished the current round."""
        if not self._worker.wait_idle(self.wait_timeout_s):
            self._check()
            raise EngineError(f"pipedap: timed out after {self.wait_timeout_s} s waiting for the end of the op list "
                              f"({self.schedule.describe()[:200]}){self._where()}")
        self._check()

    def take_timings(self) -> list[OpTiming]:
        """Return and clear the op timings recorded while :attr:`timeline_enabled` was true."""
        return self._worker.take_timings()

    @property
    def timeline_enabled(self) -> bool:
        """Whether the worker records an :class:`OpTiming` per op (read at each op's start)."""
        return self._worker.timeline_enabled

    @timeline_enabled.setter
    def timeline_enabled(self, on: bool) -> None:
        self._worker.timeline_enabled = bool(on)

    @property
    def last_round_busy_s(self) -> Optional[float]:
        """Seconds the worker spent inside ops during the last finished round (communication busy time)."""
        return self._worker.last_round_busy_s

    def close(self, abort: bool = False) -> None:
        """Stop the worker. With ``abort`` (after an exception) do not wait for a running op."""
        if self._worker.closed:
            return
        self._worker.close(abort)
        if self.transport is not None:
            self.transport.close()

    # ------------------------------------------------------------------ internals
    def _check(self) -> None:
        error = self._worker.error
        if error is not None:
            raise EngineError(f"pipedap: the communication worker failed: {error!r}{self._where()}") from error
        if self._worker.closed:
            raise EngineError("pipedap: the communication engine is closed")

    def _where(self) -> str:
        """`` (rank r, <context>; <peers>)`` for error messages: what this rank was doing and who did not answer."""
        parts = [f"rank {self.comm.rank}"]
        if self.context is not None:
            parts.append(self.context())
        if self.peers is not None:
            parts.append(self.peers(3.0))
        return f" ({'; '.join(p for p in parts if p)})"

    def _mark_ready(self, b: int) -> None:
        self._transports[b].ready(self.buckets[b])
        self.syncs[b].mark_ready()
