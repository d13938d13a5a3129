"""Every wait of the trainer on the communication engine: each has a timeout and, when it fails, names the
operation, the rank, what the run-time was doing and which peers do not answer (:class:`EngineWaits`, a mixin
of :class:`~lightning_pipedap.engine.engine.CommEngine`)."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import lightning_pipedap.engine.collectives as C
from lightning_pipedap.engine.buckets import FlatBucket
from lightning_pipedap.engine.shard_step import ShardRound
from lightning_pipedap.engine.worker import EngineError


class EngineWaits:
    """The engine's waits (mixed into :class:`~lightning_pipedap.engine.engine.CommEngine`, which provides the
    attributes below)."""

    syncs: list
    buckets: list[FlatBucket]
    wait_timeout_s: float
    worker: Any
    schedule: Any
    comm: Any
    shard: Any
    context: Optional[Callable[[], str]]
    peers: Optional[Callable[[float], str]]

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

    def wait_prepared(self) -> "ShardRound":
        """Sharded round (main thread): block until the worker prepared the current round (one all-reduce of used
        flags and NaN counts, :meth:`ShardedStep.prepare`); return it.

        Raises:
            EngineError: the worker failed, no sharded round is running, or the timeout passed (naming the
                operation, the rank and what it was doing).
        """
        r = self.shard.round
        if r is None:
            raise EngineError(f"pipedap: no sharded round to wait for{self._where()}")
        deadline = time.monotonic() + self.wait_timeout_s
        while not r.prepared.wait(0.1):
            self._check()
            if time.monotonic() > deadline:
                raise EngineError(f"pipedap: timed out after {self.wait_timeout_s} s waiting for the sharded step's "
                                  f"preparation (one all-reduce of used flags, norms and NaN counts){self._where()}")
        return r

    def forget_kept(self) -> None:
        """A new backward starts, or ``.grad`` was cleared: the sharded step forgets the kept gradient shards of the
        buckets whose ``.grad`` is not to be written any more (:meth:`ShardedStep.drop_kept`)."""
        if self.shard is not None:
            self.shard.drop_kept([s.index for s in self.syncs if not (s.unwritten or s.in_flight)])

    def gather_grads(self, b: int) -> float:
        """Sharded bucket ``b`` landed and ``.grad`` is read: all-gather its gradients (after the round's ops;
        this rank's kept shard, then an all-gather). Returns the seconds it took. Raises: EngineError (as
        :meth:`wait_idle`)."""
        self.wait_idle()
        t0, shard, bucket = time.perf_counter(), self.shard, self.buckets[b]
        lo, hi = bucket.own_data_range(self.comm.rank)
        bucket.buffer[lo:hi].zero_()  # (a slice no rank produced a gradient for: not shown, any value will do)
        for s in shard.slices[b]:  # (this rank's kept averaged gradients: ShardedStep.keep)
            kept = shard.keep.get((b, s.slot))
            if kept is not None:
                bucket.buffer[s.lo:s.hi].copy_(kept)
        bucket.flags.copy_(shard.reduced_flags[b])
        C.all_gather_(bucket.buffer, self.comm)
        bucket.flags.copy_(shard.reduced_flags[b])
        self.syncs[b].params_gathered = False
        return time.perf_counter() - t0

    def wait_idle(self) -> None:
        """Block until the worker finished the current round."""
        if not self.worker.wait_idle(self.wait_timeout_s):
            self._check()
            raise EngineError(f"pipedap: timed out after {self.wait_timeout_s} s waiting for the end of the op list "
                              f"({self.schedule.describe()[:200]}){self._where()}")
        self._check()

    def _check(self) -> None:
        error = self.worker.error
        if error is not None:
            raise EngineError(f"pipedap: the communication worker failed: {error!r}{self._where()}") from error
        if self.worker.closed:
            raise EngineError("pipedap: the communication engine is closed")

    def _where(self) -> str:
        """`` (rank r, <context>; <peers>)`` for error messages: what this rank was doing and who did not answer."""
        parts = [f"rank {self.comm.rank}"]
        if self.context is not None:
            parts.append(self.context())
        if self.peers is not None:
            parts.append(self.peers(3.0))
        return f" ({'; '.join(p for p in parts if p)})"
