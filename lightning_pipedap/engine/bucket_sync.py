"""One bucket's life in one object: :class:`BucketSync` and its :class:`BucketState`.

A bucket (tensor fusion: a flat buffer of several parameters' gradients, :class:`~.buckets.FlatBucket`)
goes through the same states every round, each transition made by one verb on one thread::

      trainer (autograd / main thread)           worker thread (the op list)
      ────────────────────────────────           ───────────────────────────────────────────
    IDLE ─start_collect─▶ COLLECTING ─mark_ready─▶ READY ─start_grad_sync─▶ REDUCING
                                                                   │ finish_grad_sync(RS) │ finish_grad_sync(AR)
                                                                   ▼                      │
                                                  REDUCED ─start_param_sync─▶ GATHERING   │
                                                     │  (STEPPED: sharded step) │         │
                                                     └──────────▶ STEPPED ──────┘         │
                                                     finish_param_sync ▼                  ▼
    LANDED ◀─land── GATHERED ◀───────────────────────────────────────────────────────────────┘
    DROPPED ◀─drop─┘    └─write─▶ WRITTEN ◀─write── LANDED, DROPPED
    LANDED, DROPPED ─retire─▶ IDLE;  GATHERED, LANDED, DROPPED, WRITTEN, IDLE ─start_collect─▶ COLLECTING

- REDUCED: after a reduce-scatter this rank's shard holds the averaged gradients (only the shard).
- STEPPED: the sharded optimizer step (``shard_optimizer``, :mod:`.shard_step`) updated this rank's slices of
  the bucket's parameters; the all-gather that follows gathers parameters (:attr:`BucketSync.params_gathered`).
- GATHERED: every rank holds the whole averaged bucket (after the all-gather, or an all-reduce).
- LANDED: its share of the deferred optimizer step was applied (DeAR ICDCS 2023 §III-B); ``.grad`` does
  not show the averaged gradients yet (written when read). DROPPED: a skipped non-finite step: clipped
  for ``.grad`` but not stepped. WRITTEN: ``.grad`` shows the averaged gradients (sync mode, or read).
- FAILED: the worker failed; every wait wakes up and the engine raises. A FAILED bucket is still in flight:
  its update is owed, and applying it raises.

An illegal transition raises :class:`BucketStateError` naming the bucket and both states. The state is
written by the thread making the transition and handed over with an event set *after* it, so a thread
that waited for the event reads the state the other thread left (Megatron-Core's bucket group has the
same start/finish verbs for its gradient and parameter syncs; FSDP2 names its states the same way).
"""

from __future__ import annotations

import enum
import threading
from typing import Optional


from lightning_pipedap.engine.buckets import FlatBucket
from lightning_pipedap.engine.streams import DeviceStreams, Stream, streams_for
from lightning_pipedap.schedule import OpKind

__all__ = ["BucketState", "BucketStateError", "BucketSync", "TRANSITIONS"]


class BucketState(enum.Enum):
    """Where a bucket is in its round (module docstring)."""

    IDLE = "idle"
    COLLECTING = "collecting"
    READY = "ready"
    REDUCING = "reducing"
    REDUCED = "reduced"
    STEPPED = "stepped"
    GATHERING = "gathering"
    GATHERED = "gathered"
    LANDED = "landed"
    DROPPED = "dropped"
    WRITTEN = "written"
    FAILED = "failed"


S = BucketState
#: state -> the states one verb may move it to (FAILED is reachable from every state: :meth:`BucketSync.fail`)
TRANSITIONS: dict[BucketState, frozenset[BucketState]] = {
    S.IDLE: frozenset({S.COLLECTING}),
    S.COLLECTING: frozenset({S.READY}),
    S.READY: frozenset({S.REDUCING}),
    S.REDUCING: frozenset({S.REDUCED, S.GATHERED}),
    S.REDUCED: frozenset({S.STEPPED, S.GATHERING}),
    S.STEPPED: frozenset({S.GATHERING}),
    S.GATHERING: frozenset({S.GATHERED}),
    S.GATHERED: frozenset({S.LANDED, S.DROPPED, S.WRITTEN, S.COLLECTING}),
    S.LANDED: frozenset({S.WRITTEN, S.IDLE, S.COLLECTING}),
    S.DROPPED: frozenset({S.WRITTEN, S.IDLE, S.COLLECTING}),
    S.WRITTEN: frozenset({S.COLLECTING}),
    S.FAILED: frozenset(),
}
#: states in which the bucket's round is communicated but its update is not applied yet (deferred mode); FAILED
#: counts: an update the worker could not finish is still owed, and applying it raises the worker's error
#: (never "nothing left to apply", which would let a checkpoint after the failure miss the update)
IN_FLIGHT = frozenset({S.COLLECTING, S.READY, S.REDUCING, S.REDUCED, S.STEPPED, S.GATHERING, S.GATHERED, S.FAILED})
#: states whose averaged gradients a ``.grad`` read must still get written (:meth:`BucketSync.write`)
UNWRITTEN = frozenset({S.LANDED, S.DROPPED})


class BucketStateError(RuntimeError):
    """An illegal bucket transition (a bug in the run-time, never a user error)."""


class BucketSync:
    """One bucket: its buffer (:attr:`flat`), its hand-off events and its :class:`BucketState`.

    Args:
        flat: the bucket's buffer and slots (``[N·S]`` elements; :class:`~.buckets.FlatBucket`).
        streams: the streams of the buffer's device (default: :func:`~.streams.streams_for` its device). Each
            hand-off records an event (gradients ready on the compute stream, reduced/gathered on the comm
            stream) that the other side's stream waits for, so neither side synchronises the host; on CPU
            the events are :class:`~.streams.HostEvent` stand-ins that check the order.

    Attributes:
        index: the bucket's number (forward order).
        state: the current :class:`BucketState`.
        missing: slots still without a gradient in this round (:meth:`fill`).
    """

    def __init__(self, flat: FlatBucket, streams: Optional[DeviceStreams] = None) -> None:
        self.flat = flat
        self.index = flat.index
        self.state = S.IDLE
        self.missing = 0
        #: the buffer holds gathered *parameters* (a sharded step's all-gather), not averaged gradients
        self.params_gathered = False
        #: the state FAILED was entered from (what had completed before the worker failed; None: not failed)
        self.failed_from: Optional[BucketState] = None
        self._ready, self._reduced, self._gathered = threading.Event(), threading.Event(), threading.Event()
        self.streams = streams if streams is not None else streams_for(flat.buffer.device)
        ev = self.streams.new_event
        self._ready_ev, self._reduced_ev, self._gathered_ev = ev("ready"), ev("reduced"), ev("gathered")

    def __repr__(self) -> str:
        return f"BucketSync({self.index}, {self.state.name})"

    def _to(self, new: BucketState) -> None:
        if new not in TRANSITIONS[self.state]:
            allowed = ", ".join(s.name for s in sorted(TRANSITIONS[self.state], key=lambda s: s.name)) or "none"
            raise BucketStateError(f"pipedap: bucket {self.index}: {self.state.name} -> {new.name} is not a legal "
                                   f"transition (from {self.state.name}: {allowed})")
        self.state = new

    # ------------------------------------------------------------------ trainer: collecting gradients
    def start_collect(self) -> None:
        """A new round: every slot waits for a gradient (used flags zeroed); what was not written is forgotten."""
        self._to(S.COLLECTING)
        self.flat.flags.zero_()
        self.missing = len(self.flat.params)
        self.params_gathered = False
        self._ready.clear()
        self._reduced.clear()
        self._gathered.clear()

    def fill(self, slot: int) -> bool:
        """Slot ``slot`` holds its gradient (flag 1). Returns whether the bucket is now complete."""
        self.flat.flags[slot] = 1
        self.missing -= 1
        return self.missing == 0

    def mark_ready(self) -> None:
        """COLLECTING -> READY: hand the bucket to the worker (after the gradient copies on the compute stream)."""
        self._to(S.READY)
        self._ready_ev.record(self.streams.current())
        self._ready.set()

    @property
    def is_ready(self) -> bool:
        """Whether the bucket was handed to the worker in this round."""
        return self._ready.is_set()

    # ------------------------------------------------------------------ worker: the collectives
    def wait_ready(self, timeout_s: float, stream: Optional[Stream] = None) -> bool:
        """Worker: block until :meth:`mark_ready` (False on timeout); ``stream`` (the comm stream) then waits for
        the gradient copies (raises :class:`~.streams.StreamOrderError` on CPU if that event was never recorded)."""
        if not self._ready.wait(timeout_s):
            return False
        if stream is not None:
            stream.wait_event(self._ready_ev)
        return True

    def start_grad_sync(self) -> None:
        """READY -> REDUCING: the reduce-scatter or all-reduce starts."""
        self._to(S.REDUCING)

    def finish_grad_sync(self, done: OpKind, stream: Optional[Stream] = None) -> None:
        """REDUCING -> REDUCED (``done`` is a reduce-scatter: this rank's shard is averaged) or -> GATHERED
        (an all-reduce, or a compressed reduction, averaged the whole bucket)."""
        if done is OpKind.ALL_GATHER:
            raise BucketStateError(f"pipedap: bucket {self.index}: finish_grad_sync after an all-gather")
        self._to(S.REDUCED if done is OpKind.REDUCE_SCATTER else S.GATHERED)
        self._reduced_ev.record(stream if stream is not None else self.streams.current())
        self._reduced.set()
        if done is not OpKind.REDUCE_SCATTER:
            self._gathered_done(stream)

    def step(self) -> None:
        """REDUCED -> STEPPED: this rank's slices of the bucket's parameters were stepped (sharded step)."""
        self._to(S.STEPPED)

    def start_param_sync(self) -> None:
        """REDUCED (or STEPPED) -> GATHERING: the all-gather starts."""
        self._to(S.GATHERING)

    def finish_param_sync(self, stream: Optional[Stream] = None, params: bool = False) -> None:
        """GATHERING -> GATHERED: every rank holds the whole averaged bucket, or (``params``: a sharded step) the
        bucket's updated parameters."""
        self._to(S.GATHERED)
        self.params_gathered = params
        self._gathered_done(stream)

    def _gathered_done(self, stream: Optional[Stream]) -> None:
        self._gathered_ev.record(stream if stream is not None else self.streams.current())
        self._gathered.set()

    def fail(self) -> None:
        """Any state -> FAILED (the worker failed): every waiter wakes up (and the engine raises)."""
        if self.state is not S.FAILED:
            self.failed_from = self.state
        self.state = S.FAILED
        for e in (self._ready, self._reduced, self._gathered):
            e.set()

    # ------------------------------------------------------------------ trainer: using the result
    def wait_gathered(self, timeout_s: float) -> bool:
        """Block until the bucket is GATHERED (False on timeout; FAILED also wakes it). On CUDA the current
        stream waits for the collective instead of the host."""
        if not self._gathered.wait(timeout_s):
            return False
        if self.state is not S.FAILED:
            self.streams.current().wait_event(self._gathered_ev)
        return True

    @property
    def gathered(self) -> bool:
        """Whether this round's bucket is complete on every rank (GATHERED or later; not before a round)."""
        return self._gathered.is_set()

    def land(self) -> None:
        """GATHERED -> LANDED: the bucket's share of the deferred optimizer step was applied."""
        self._to(S.LANDED)

    def drop(self) -> None:
        """GATHERED -> DROPPED: the step was skipped (non-finite); gradients kept for ``.grad``, nothing stepped."""
        self._to(S.DROPPED)

    def write(self) -> None:
        """GATHERED, LANDED or DROPPED -> WRITTEN: ``.grad`` shows the bucket's averaged gradients."""
        self._to(S.WRITTEN)

    def retire(self) -> None:
        """LANDED or DROPPED -> IDLE: ``.grad`` must no longer get the averaged gradients (Lightning cleared it,
        or a new backward overwrites the buffer). Other states are left as they are."""
        if self.state in UNWRITTEN:
            self._to(S.IDLE)

    @property
    def in_flight(self) -> bool:
        """Whether the round's update is still to be applied (collected or communicated, not landed)."""
        return self.state in IN_FLIGHT

    @property
    def landed(self) -> bool:
        """Whether the round's update was applied (LANDED, or LANDED then WRITTEN; in a deferred round)."""
        return self.state is S.LANDED or self.state is S.WRITTEN

    @property
    def unwritten(self) -> bool:
        """Whether the bucket was applied (or dropped) but ``.grad`` does not show its averaged gradients yet."""
        return self.state in UNWRITTEN
