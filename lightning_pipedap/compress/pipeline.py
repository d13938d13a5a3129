"""Pipelined compression (PipeCompress): a per-rank helper process fed through shared-memory slots.

Source: PipeCompress (ICC 2022): decouple gradient compression from backpropagation into a second
process, pipelined, with a purpose-built inter-process hand-off. Here:

* **Helper process** (:mod:`.helper`; started, watched and stopped by :mod:`.channel`). It owns a
  :class:`~.runtime.CompressionRuntime`, so error-feedback residuals and PowerSGD factors live in
  the helper; :meth:`CompressionPipeline.state_dict` / :meth:`~CompressionPipeline.load_state_dict`
  export and import them per parameter name (:mod:`.state`) over the control channel, with a
  timeout, for checkpoints. A training script without an ``if __name__ == "__main__":`` guard is
  not run again in the helper (:func:`~.channel.start_without_main`).
* **Start once, lay out on every plan.** The helper is a fresh interpreter that imports torch and
  this package (about 4-8 s here, most of it ``lightning`` pulled in by ``lightning_pipedap/__init__``).
  :meth:`CompressionPipeline.start` starts it without buckets and returns at once;
  :meth:`~CompressionPipeline.wait_ready` (or any first use) waits for it, bounded by
  ``start_timeout_s``; :meth:`~CompressionPipeline.relayout` gives it buckets, and new ones after a
  re-plan, in the same process, carrying the compression state by parameter name.
* **Slots** (:mod:`.slots`). Submitting copies the gradient into a free preallocated slot in shared
  memory (one memcpy: 1.17 ms for 25 MiB here, against 23.5 ms to push a fresh tensor through
  ``torch.multiprocessing.Queue``) and sends only ``(op, ticket, bucket, slot)`` plus, for later
  rounds, a few integers describing the payload. Results come back the same way; payload tensors
  returned by :meth:`CompressionPipeline.result` are views into the slot, valid until
  :meth:`CompressionPipeline.release` of that ticket.
* **Liveness.** Every wait is bounded: a dead helper raises :class:`HelperDiedError` naming the
  operation, bucket, pid and exit code; no answer in time raises :class:`HelperTimeoutError`
  (:mod:`.channel`). The helper exits when the trainer dies, also when it is SIGKILLed. Failing on
  every rank is the engine's job (it must abort its collectives when this raises).
* **Inline mode** (``mode="inline"``): the same API, compression runs in the caller (for
  comparison, and where a second process does not pay).
* **Who sends.** The helper only compresses (and decompresses); the trainer's communication
  worker sends. Only the engine owns a process group (a gloo/NCCL group cannot be shared with a
  second process, so a sending helper would need its own rank set and connections), and handing
  the payload back costs nothing: :meth:`CompressionPipeline.result` returns views into shared
  memory that the engine can reduce in place. Measured here (benchmarks/compress_bench.py, loaded
  2-core machine, 1 thread): a 95 MiB bucket round trip through a slot + index took 9.2 ms against
  148 ms through ``torch.multiprocessing.Queue`` with a fresh tensor (25 MiB: 2.5 vs 68 ms).

Life cycle of one bucket in one step (summable methods; non-summable ones all-gather
``compressor.pack(payload)`` instead and aggregate)::

    pipe = CompressionPipeline.start("powersgd", {"rank": 4})   # at set-up; returns at once
    pipe.relayout(numels, layouts)            # when the buckets are known (waits for the start)
    t = pipe.submit(b, grad)                  # returns at once (process mode)
    p = pipe.result(t)                        # Payload, views into the slot
    while not p.final:                        # PowerSGD: once (P then Q)
        all_reduce(p.data)                    # in place in the slot is fine
        p = pipe.next_round(t, p)
    all_reduce(p.data)
    g = pipe.decompress(t, p)                 # [n] fp32 view into the slot
    ...use g...
    pipe.release(t)
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import torch

from lightning_pipedap.compress.backends import HelperBackend, InlineBackend
from lightning_pipedap.compress.base import Payload
from lightning_pipedap.compress.channel import HelperDiedError, HelperTimeoutError
from lightning_pipedap.compress.compressors import get_compressor
from lightning_pipedap.compress.helper import EXIT_PARENT_DIED
from lightning_pipedap.compress.state import Layout, check_layouts
from lightning_pipedap.compress.tickets import Ticket, TicketBook

__all__ = ["CompressionPipeline", "Ticket", "HelperDiedError", "HelperTimeoutError", "EXIT_PARENT_DIED", "MODES"]

MODES = ("process", "inline")


def _check_options(mode: str, slots_per_bucket: int, threads: int, timeout_s: float, start_timeout_s: float) -> None:
    """Raise ValueError for an unknown mode, slots < 2, threads < 1 or a timeout not in (0, inf)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if isinstance(slots_per_bucket, bool) or not isinstance(slots_per_bucket, int) or slots_per_bucket < 2:
        raise ValueError(f"slots_per_bucket must be an integer >= 2, got {slots_per_bucket!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
    for name, v in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise ValueError(f"{name} must be a number of seconds > 0 and finite, got {v!r}")


def _check_layout(bucket_numels: Sequence[int], layouts: Layout | None) -> tuple[tuple[int, ...], tuple]:
    """``(numels, layouts)`` validated (:func:`~.state.check_layouts`); ValueError for bad values."""
    numels = tuple(bucket_numels)
    if not numels or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in numels):
        raise ValueError(f"bucket_numels must be a non-empty sequence of integers >= 1, got {list(numels)}")
    return numels, check_layouts(numels, layouts)


class CompressionPipeline:
    """Compression of bucket gradients in a helper process (or inline), with shared-memory slots.

    Args:
        bucket_numels: elements ``n`` of each bucket (index = bucket number); None: no buckets until
            :meth:`relayout`.
        compressor_name: a name from :func:`~.compressors.valid_compressor_names`.
        compressor_kwargs: that compressor's keyword arguments (validated here, in the trainer).
        slots_per_bucket: preallocated slots per bucket, >= 2 (a bucket can be in flight twice, e.g.
            step t being decompressed while step t+1 is compressed).
        threads: ``torch.set_num_threads`` of the helper, >= 1 (budget cores with the trainer).
        timeout_s: seconds to wait for any helper answer (results, state, relayout) before
            :class:`HelperTimeoutError`, unless a call gives its own; also bounds writing a large request.
        mode: ``"process"`` (helper process) or ``"inline"`` (in the caller, same API).
        start_timeout_s: seconds from the start within which the helper must be ready (it imports
            torch and this package).
        layouts: per bucket, ``(parameter name, shape)`` of its parameters in buffer order (see
            :class:`~.runtime.CompressionRuntime`); PowerSGD needs the shapes (one matrix per
            parameter), checkpoints the names. None: each bucket is one 1-D tensor.
        wait: block until the helper is ready; False returns at once (:meth:`wait_ready` or the
            first use waits).

    Raises:
        ValueError: for bad arguments (unknown compressor or keyword, slots < 2, threads < 1, a timeout
            not in (0, inf), layouts that do not match the bucket sizes or without bucket sizes, ...).
        HelperDiedError, HelperTimeoutError: with ``wait``, if the helper does not start (it is stopped).
    """

    def __init__(self, bucket_numels: Sequence[int] | None, compressor_name: str,
                 compressor_kwargs: dict[str, Any] | None = None, slots_per_bucket: int = 2, threads: int = 1,
                 timeout_s: float = 60.0, mode: str = "process", start_timeout_s: float = 120.0,
                 layouts: Layout | None = None, wait: bool = True) -> None:
        _check_options(mode, slots_per_bucket, threads, timeout_s, start_timeout_s)
        if bucket_numels is None and layouts is not None:
            raise ValueError("layouts given without bucket_numels; pass both, or neither and call relayout()")
        first = None if bucket_numels is None else _check_layout(bucket_numels, layouts)
        self.mode = mode
        self.compressor_name = compressor_name
        self.compressor_kwargs = dict(compressor_kwargs or {})
        self.compressor = get_compressor(compressor_name, **self.compressor_kwargs)  # validates in the trainer
        self.slots_per_bucket = slots_per_bucket
        self.threads = threads
        self.timeout_s = float(timeout_s)
        #: elements of each bucket of the current layout (empty before the first layout)
        self.bucket_numels: tuple[int, ...] = ()
        #: per bucket ``(name, shape)`` of its parameters (:func:`~.state.check_layouts`)
        self.layouts: tuple = ()
        #: exit code of the helper once closed (0: clean stop; negative: killed by that signal)
        self.exitcode: int | None = None
        self._tickets = TicketBook(slots_per_bucket)
        self._closed = False
        self._lock = threading.RLock()  # tickets and layout
        if mode == "inline":
            self._backend = InlineBackend(compressor_name, self.compressor_kwargs, first)
        else:
            self._backend = HelperBackend(self.compressor, compressor_name, self.compressor_kwargs, slots_per_bucket,
                                          threads, self.timeout_s, start_timeout_s, first)
        if first is not None:
            self._adopt(*first)
        if wait:
            self.wait_ready()

    @classmethod
    def start(cls, compressor_name: str, compressor_kwargs: dict[str, Any] | None = None, *,
              slots_per_bucket: int = 2, threads: int = 1, timeout_s: float = 60.0, mode: str = "process",
              start_timeout_s: float = 120.0) -> "CompressionPipeline":
        """Start the helper without buckets and return at once (the helper starts meanwhile).

        Give it buckets with :meth:`relayout` before the first :meth:`submit`; that call (or
        :meth:`wait_ready`) waits for the helper, until ``start_timeout_s`` after this call.
        Arguments as for the constructor.
        """
        return cls(None, compressor_name, compressor_kwargs, slots_per_bucket, threads, timeout_s, mode,
                   start_timeout_s, wait=False)

    # ------------------------------------------------------------------ public API
    @property
    def helper_pid(self) -> int | None:
        """PID of the helper process (None in inline mode)."""
        return self._backend.helper_pid

    @property
    def shared_nbytes(self) -> int:
        """Bytes of shared memory held by the slots of the current layout (0 in inline mode)."""
        return self._backend.shared_nbytes

    @property
    def ready(self) -> bool:
        """True once the helper is ready (never blocks; True inline). Raises as :meth:`wait_ready` does."""
        return self._wait_ready(0.0, poll=True)

    def wait_ready(self, timeout_s: float | None = None) -> float:
        """Block until the helper is ready (at once when it is, and inline).

        Args:
            timeout_s: seconds from now; None: until ``start_timeout_s`` after the start.

        Returns:
            seconds the helper took from its start to ready (wall clock; 0.0 inline).

        Raises:
            RuntimeError: pipeline closed.
            HelperDiedError: the helper died or failed to start (with its traceback); the pipeline is closed.
            HelperTimeoutError: not ready in time (naming ``start-up`` and the pid); once ``start_timeout_s``
                has passed since the start the pipeline is closed, before that it can be waited for again.
        """
        self._wait_ready(timeout_s, poll=False)
        return self._backend.startup_s

    def relayout(self, bucket_numels: Sequence[int], layouts: Layout | None = None, keep_state: bool = True,
                 timeout_s: float | None = None) -> list[str]:
        """Replace the buckets, in the same helper process: fresh slots, a rebuilt runtime, state carried.

        Allocates shared-memory slots for the new buckets, sends them to the running helper and waits
        for it to rebuild its :class:`~.runtime.CompressionRuntime` (:func:`~.runtime.relayout_runtime`);
        the old slots are then freed. With ``keep_state`` the compression state (error-feedback
        residuals, PowerSGD ``q``, step counters) of every parameter in both layouts moves to its new
        bucket and offset by name, as :meth:`state_dict` before and :meth:`load_state_dict` after
        would, without leaving the helper; parameters only in the old layout lose theirs. Waits for
        the helper's start first (:meth:`wait_ready`).

        Args:
            bucket_numels, layouts: the new buckets, as for the constructor (``bucket_numels`` required).
            keep_state: False starts every parameter afresh.
            timeout_s: seconds to wait for the helper (default: the pipeline's ``timeout_s``).

        Returns:
            sorted names of the new layout's parameters without carried state (as :meth:`load_state_dict`
            returns; every name when ``keep_state`` is False or there was no layout).

        Raises:
            ValueError: bad ``bucket_numels`` or ``layouts`` (nothing changes).
            RuntimeError: a ticket not yet released (naming its bucket, id and state), pipeline closed,
                or the helper failed to build the layout (with its traceback; the old layout stays).
            HelperDiedError: the helper died.
            HelperTimeoutError: no answer in time; the pipeline is then closed (the helper's layout is
                unknown).
        """
        self._ensure_ready()
        numels, lays = _check_layout(bucket_numels, layouts)
        with self._lock:
            self._check_open()
            self._tickets.check_quiet("relayout", released=True)
            try:
                fresh = self._backend.relayout(numels, lays, bool(keep_state), self._timeout(timeout_s))
            except HelperTimeoutError as e:
                self.close(timeout_s=1.0)  # an unresponsive helper: no long polite wait
                raise HelperTimeoutError(f"{e}; the pipeline is closed (the helper's layout is unknown)") from e
            self._adopt(numels, lays)
            return fresh

    def submit(self, bucket: int, grad: torch.Tensor) -> Ticket:
        """Start compressing ``grad`` (flat ``[n]`` fp32 of ``bucket``); returns at once in process mode.

        The gradient is copied into a free slot (process mode); in inline mode it is compressed now
        and the payload may alias ``grad`` (``none``, PowerSGD's uncompressed steps). The first
        submit waits for the helper's start (:meth:`wait_ready`).

        Raises:
            ValueError: bad bucket index (also: no layout yet) or gradient shape/dtype.
            RuntimeError: no free slot for ``bucket`` (release earlier tickets), or pipeline closed.
            HelperDiedError: the helper is not running.
        """
        self._ensure_ready()
        with self._lock:
            self._check_open()
            n = self._numel(bucket)
            if grad.dim() != 1 or grad.numel() != n or grad.dtype != torch.float32:
                raise ValueError(f"bucket {bucket} expects a flat [{n}] float32 gradient, got "
                                 f"{tuple(grad.shape)} {grad.dtype}")
            flight = self._tickets.issue(bucket, "compress")
        try:
            self._backend.compress(flight, grad)  # outside the lock: other threads may collect results meanwhile
        except BaseException:
            with self._lock:
                self._tickets.release(flight.ticket, force=True)
            raise
        return flight.ticket

    def result(self, ticket: Ticket, timeout_s: float | None = None) -> Any:
        """Wait for the last operation of ``ticket`` and return its output.

        Thread-safe: tickets may be submitted in one thread (backward hooks) and collected in
        another (the communication worker).

        Returns:
            after ``submit`` / ``submit_round``: a :class:`~.base.Payload` (process mode: views
            into the ticket's slot); after ``submit_decompress``: the dense ``[n]`` fp32 gradient
            (process mode: a view into the slot). Valid until ``release(ticket)``.

        Raises:
            RuntimeError: nothing in flight for this ticket; the compressor raised in the helper
                (message carries the helper's traceback).
            HelperDiedError: the helper died (message names bucket, operation, pid, exit code).
            HelperTimeoutError: no answer within ``timeout_s`` (default: the pipeline's); a later
                call can still collect the answer.
        """
        with self._lock:
            self._check_open()
            flight = self._tickets.pending(ticket)
            op = flight.op
        (kind, value, seconds), waited = self._backend.collect(
            flight, self._timeout(timeout_s), f"{op} of bucket {ticket.bucket} (ticket {ticket.id})")
        with self._lock:
            self._check_open()
            flight.op = None
            flight.timings[op] = flight.timings.get(op, 0.0) + seconds
            flight.timings["wait"] = flight.timings.get("wait", 0.0) + waited
            if kind == "error":
                raise RuntimeError(f"compression helper failed in {op} of bucket {ticket.bucket} "
                                   f"({self.compressor_name}):\n{value}")
            return self._backend.output(ticket, op, value)

    def submit_round(self, ticket: Ticket, reduced: Payload) -> None:
        """Send the non-final payload summed over ranks back for the next round (PowerSGD: P → Q).

        ``reduced.data`` may be the slot view returned by :meth:`result` (summed in place) or any
        tensor of the same shape; it is copied into the slot if needed.

        Raises:
            ValueError: if ``reduced`` is final or not a payload of this bucket and compressor.
        """
        self._submit_payload(ticket, "round", reduced)

    def submit_decompress(self, ticket: Ticket, reduced: Payload) -> None:
        """Decompress a final payload (summed over ranks for summable methods) in the helper.

        The result (:meth:`result`) is the dense ``[n]`` gradient. Runs PowerSGD's warm-start update.

        Raises:
            ValueError: if ``reduced`` is not final or not a payload of this bucket and compressor.
        """
        self._submit_payload(ticket, "decompress", reduced)

    def next_round(self, ticket: Ticket, reduced: Payload, timeout_s: float | None = None) -> Payload:
        """:meth:`submit_round` then :meth:`result`."""
        self.submit_round(ticket, reduced)
        return self.result(ticket, timeout_s)

    def decompress(self, ticket: Ticket, reduced: Payload, timeout_s: float | None = None) -> torch.Tensor:
        """:meth:`submit_decompress` then :meth:`result`."""
        self.submit_decompress(ticket, reduced)
        return self.result(ticket, timeout_s)

    def release(self, ticket: Ticket) -> None:
        """Free the ticket's slot; its payload/gradient views must not be used afterwards.

        Raises:
            RuntimeError: if an operation of the ticket is still in flight.
        """
        with self._lock:
            self._check_open()
            self._tickets.release(ticket)

    def timings(self, ticket: Ticket) -> dict[str, float]:
        """Seconds per operation of ``ticket`` so far: ``compress``, ``round``, ``decompress`` (time spent
        compressing, in the helper or inline) and ``wait`` (time the caller blocked in :meth:`result`).
        ``compress - wait`` is the compression time hidden by the pipeline."""
        with self._lock:
            self._check_open()
            return dict(self._tickets.get(ticket).timings)

    def state_dict(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Compression state per parameter name (residual slices, PowerSGD ``q``, step counters), CPU tensors.

        Call between steps (no ticket in flight). In process mode the helper serialises it and the
        answer comes back over the result pipe (wait bounded by ``timeout_s``, default: the
        pipeline's). Format: :func:`~.state.export_state`.

        Raises:
            RuntimeError: if tickets are in flight, or there is no layout yet.
            HelperDiedError, HelperTimeoutError: as for :meth:`result`.
        """
        self._ensure_ready()
        with self._lock:
            self._check_quiet("state_dict")
            return self._backend.state_dict(self._timeout(timeout_s))

    def load_state_dict(self, state: dict[str, Any], timeout_s: float | None = None) -> list[str]:
        """Restore :meth:`state_dict` output (e.g. on resume, or after a re-plan with other buckets:
        the state is matched by parameter name and offset), before the next submit.

        Returns:
            names of parameters without saved state (they start with a zero residual).

        Raises:
            ValueError: if the state belongs to another compressor (checked here, in the trainer).
            RuntimeError: if tickets are in flight or there is no layout yet; in process mode also for
                any error of the helper's import (a parameter whose shape changed, ...), with its
                traceback.
            HelperDiedError, HelperTimeoutError: as for :meth:`result`.
        """
        self._ensure_ready()
        with self._lock:
            self._check_quiet("load_state_dict")
            if state.get("compressor") != self.compressor_name:  # the helper's check, as a local error
                raise ValueError(f"checkpoint holds compression state of {state.get('compressor')!r}, "
                                 f"this run uses {self.compressor_name!r}")
            return self._backend.load_state_dict(state, self._timeout(timeout_s))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the helper (``stop`` request, then SIGKILL after ``timeout_s``) and free the slots.

        Idempotent; also called on garbage collection and by the context manager.
        """
        timeout_s = self._timeout(timeout_s)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.exitcode = self._backend.close(timeout_s)
        self._tickets.reset(0)

    def __enter__(self) -> "CompressionPipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _adopt(self, numels: tuple[int, ...], layouts: tuple) -> None:
        self.bucket_numels, self.layouts = numels, layouts
        self._tickets.reset(len(numels))

    def _timeout(self, timeout_s: float | None) -> float:
        """A call's timeout (None: the pipeline's); ValueError unless finite and >= 0."""
        if timeout_s is None:
            return self.timeout_s
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 <= timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a finite number of seconds >= 0, got {timeout_s!r}")
        return float(timeout_s)

    def _ensure_ready(self) -> None:
        if self._backend.startup_s is None:
            self._wait_ready(None, poll=False)

    def _wait_ready(self, timeout_s: float | None, poll: bool) -> bool:
        """Wait for the helper; ``poll``: False instead of a timeout error while the start may still come."""
        timeout_s = None if timeout_s is None else self._timeout(timeout_s)
        self._check_open()
        if self._backend.startup_s is not None:
            return True
        try:
            self._backend.wait_ready(timeout_s)
            return True
        except HelperDiedError:
            self.close(timeout_s=1.0)
            raise
        except HelperTimeoutError:
            if self._backend.start_expired():
                self.close(timeout_s=1.0)  # a helper that did not start in time: no long polite wait
            elif poll:
                return False
            raise

    def _numel(self, bucket: int) -> int:
        if not self.bucket_numels:
            raise ValueError(f"bucket {bucket!r} out of range; the pipeline has no buckets yet (call relayout())")
        if isinstance(bucket, bool) or not isinstance(bucket, int) or not (0 <= bucket < len(self.bucket_numels)):
            raise ValueError(f"bucket {bucket!r} out of range; valid buckets 0..{len(self.bucket_numels) - 1}")
        return self.bucket_numels[bucket]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("compression pipeline is closed")
        self._backend.check()

    def _check_quiet(self, what: str) -> None:
        self._check_open()
        self._tickets.check_quiet(what)
        if not self.bucket_numels:
            raise RuntimeError(f"{what}() needs a bucket layout; call relayout() first")

    def _submit_payload(self, ticket: Ticket, op: str, reduced: Payload) -> None:
        with self._lock:
            self._check_open()
            flight = self._tickets.idle(ticket)
            b = ticket.bucket
            if reduced.final != (op == "decompress"):
                raise ValueError(f"bucket {b}: payload stage {reduced.stage} is "
                                 + ("final; use submit_decompress" if reduced.final else "not final; use submit_round"))
            if reduced.numel != self.bucket_numels[b] or reduced.method != self.compressor_name:
                raise ValueError(f"bucket {b}: payload of {reduced.method!r} with {reduced.numel} elements does "
                                 f"not belong here ({self.compressor_name!r}, {self.bucket_numels[b]})")
            flight.op = op
        try:
            self._backend.resume(flight, op, reduced)
        except BaseException:
            with self._lock:
                flight.op = None
            raise
