"""The communication worker: one thread per engine that walks the schedule's op list every round.

For each op, in the schedule's order (the same on every rank), the worker waits until the bucket is
READY (reduce-scatter, all-reduce) and moves it through its states by the bucket's own verbs
(:class:`~.bucket_sync.BucketSync`): ``start_grad_sync`` / ``finish_grad_sync`` around a reduce-scatter
or all-reduce, ``start_param_sync`` / ``finish_param_sync`` around an all-gather. The collective itself
is the bucket's transport's (:mod:`.transport`). An exception fails every bucket (every waiter wakes up)
and is re-raised in the training process at its next wait, as :class:`EngineError`.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch

from lightning_pipedap.engine.bucket_sync import BucketSync
from lightning_pipedap.engine.streams import streams_for
from lightning_pipedap.engine.transport import Transport
from lightning_pipedap.measure.timeline import OpTiming
from lightning_pipedap.schedule import Op, OpKind, Schedule

__all__ = ["EngineError", "OpWorker"]


class EngineError(RuntimeError):
    """Raised in the training process when the communication worker failed or a wait timed out."""


class OpWorker:
    """Runs ``schedule.ops`` over ``syncs`` once per :meth:`start`, on a daemon thread.

    Args:
        schedule: the op list (validated by the engine).
        syncs: one :class:`BucketSync` per bucket of the schedule.
        transports: per bucket, how its ops are performed.
        wait_timeout_s: how long (s) the worker waits for a bucket's gradients before failing.
        device: the device of the buffers (None: CPU). The ops run on a stream of their own
            (:mod:`.streams`: the accelerator's, or a :class:`~.streams.HostStream` stand-in on CPU) and the
            hand-offs carry its events.

    Attributes:
        timeline_enabled: record an :class:`OpTiming` per op (read at each op's start).
        last_round_busy_s: seconds spent inside ops during the last finished round (communication busy time).
        error: the exception that stopped the worker, or None.
    """

    def __init__(self, schedule: Schedule, syncs: Sequence[BucketSync], transports: Sequence[Transport],
                 wait_timeout_s: float, device: Optional[torch.device] = None) -> None:
        self.schedule, self.syncs, self.transports = schedule, list(syncs), list(transports)
        self.wait_timeout_s = wait_timeout_s
        self.timeline_enabled = False
        self.last_round_busy_s: Optional[float] = None
        self.error: Optional[BaseException] = None
        self.closed = False
        self._timings: list[OpTiming] = []
        #: the engine's sharded step (``shard_optimizer``; :class:`~.shard_step.ShardedStep`), or None
        self.shard: Any = None
        #: how a sharded bucket's parameters are all-gathered (their own dtype, never the 16-bit wire)
        self.param_transport: Optional[Transport] = None
        self._idle = threading.Event()
        self._idle.set()
        self._jobs: "queue.Queue[object]" = queue.Queue()
        self._ahead: Optional[int] = None  # the sharded bucket stepped during the previous all-gather
        self.streams = streams_for(device if device is not None else "cpu")
        #: the communication stream the ops run on
        self.stream = self.streams.new_stream("comm")
        self._thread = threading.Thread(target=self._run, name="pipedap-comm", daemon=True)
        self._thread.start()

    def start(self, label: Any) -> None:
        """Run the op list once (``label``: the iteration the op timings are filed under)."""
        self._idle.clear()
        self._jobs.put(label)

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until the current round is finished (False on timeout)."""
        return self._idle.wait(timeout_s)

    @property
    def idle(self) -> bool:
        """Whether no round is running."""
        return self._idle.is_set()

    def take_timings(self) -> list[OpTiming]:
        """Return and clear the op timings recorded while :attr:`timeline_enabled` was true."""
        out, self._timings = self._timings, []
        return out

    def close(self, abort: bool = False) -> None:
        """Stop the thread: after the running round (at most ``wait_timeout_s``), or, with ``abort``, within 1 s."""
        self.closed = True
        self._jobs.put(None)
        self._thread.join(timeout=1.0 if abort else self.wait_timeout_s)

    def _run(self) -> None:
        self.streams.bind_thread()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._run_round(job)
            except BaseException as exc:  # surfaced to the trainer at its next wait
                self.error = exc
                for s in self.syncs:
                    s.fail()
                self._idle.set()
                return
            self._idle.set()

    def _run_round(self, label: Any) -> None:
        stream = self.stream
        busy = 0.0
        self._ahead = None
        ops = self.schedule.ops
        with self.streams.use(stream):
            for k, op in enumerate(ops):
                sync = self.syncs[op.bucket]
                transport, params, during = self.transports[op.bucket], False, None
                if op.kind is OpKind.ALL_GATHER:
                    if sync.gathered:  # (a compressed bucket: its reduction did everything; it may have landed since)
                        continue
                    shard = self.shard
                    if shard is not None and shard.round is not None and op.bucket in shard.slices:
                        if not self._shard_step(op):
                            return
                        transport, params = self.param_transport, True
                        during = self._step_ahead(ops[k + 1:])
                    sync.start_param_sync()
                else:
                    if not sync.wait_ready(self.wait_timeout_s, stream):
                        raise EngineError(f"timed out after {self.wait_timeout_s} s waiting for the gradients of "
                                          f"bucket {op.bucket} ({op})")
                    if self.closed:
                        return
                    sync.start_grad_sync()
                record = self.timeline_enabled  # read at op start: an op is recorded in full or not at all
                t0 = time.perf_counter()
                done = transport.run(op.kind, sync.flat, *(() if during is None else (during,)))
                t1 = time.perf_counter()
                busy += t1 - t0
                if done is None:
                    raise EngineError(f"bucket {op.bucket}: the transport did nothing for {op}")
                if record:
                    self._timings.append(OpTiming(op if done is op.kind else Op(done, op.bucket), t0, t1, label))
                if done is OpKind.ALL_GATHER:
                    sync.finish_param_sync(stream, params)
                else:
                    sync.finish_grad_sync(done, stream)
        self.last_round_busy_s = busy

    def _shard_step(self, op: Op) -> bool:
        """Before a sharded bucket's all-gather: wait until the round's optimizer step was recorded, prepare the
        round once (one all-reduce: used flags, clip factor, non-finite verdict), then step this rank's slices
        (REDUCED -> STEPPED). Returns False when the engine closed meanwhile.

        Raises:
            EngineError: the optimizer step was not recorded within the timeout.
        """
        shard, sync = self.shard, self.syncs[op.bucket]
        if self._ahead == op.bucket:  # (stepped during the previous all-gather: _step_ahead)
            self._ahead = None
            return True
        if not shard.round.prepared.is_set():
            if not shard.wait_go(self.wait_timeout_s, lambda: self.closed):
                if self.closed:
                    return False
                raise EngineError(f"timed out after {self.wait_timeout_s} s waiting for the optimizer step to be "
                                  f"recorded before the sharded step of bucket {op.bucket} ({op}; shard_optimizer)")
            shard.prepare()
        if shard.step_bucket(op.bucket):
            sync.step()
        return True

    def _step_ahead(self, rest: Sequence[Op]) -> Optional[Callable[[], None]]:
        """The sharded step of the next sharded bucket all-gathered after this one (the first such all-gather in
        ``rest``, the ops after the current one), to run while the current all-gather's transfer is in flight (its
        ``during``): on the host the step of bucket b+1 then overlaps AG(b) instead of following it, so the
        all-gathers of the next forward follow each other with only the first step in front of them. None when no
        sharded all-gather follows, or on an accelerator (its kernels are queued on the stream anyway)."""
        shard = self.shard
        if self.streams.accelerated:
            return None
        nxt = next((op.bucket for op in rest if op.kind is OpKind.ALL_GATHER and op.bucket in shard.slices), None)
        if nxt is None:
            return None

        def step() -> None:
            self._ahead = nxt
            if shard.step_bucket(nxt):
                self.syncs[nxt].step()

        return step
