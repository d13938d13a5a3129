"""Pipelined compression (PipeCompress): a per-rank helper process fed through shared-memory slots.

Source: PipeCompress (ICC 2022): decouple gradient compression from backpropagation into a second
process, pipelined, with a purpose-built inter-process hand-off. Here:

* **Helper process.** Started with an explicit ``spawn`` context (safe with CUDA and with
  ``torch.distributed``; start it before ``init_process_group``), ``daemon=True``. It owns a
  :class:`~.runtime.CompressionRuntime`, so error-feedback residuals and PowerSGD factors live in
  the helper; :meth:`CompressionPipeline.state_dict` / :meth:`~CompressionPipeline.load_state_dict`
  export and import them per parameter name (:mod:`.state`) over the control channel, with a
  timeout, for checkpoints and for carrying the state across a re-plan. It limits its
  intra-op threads with ``torch.set_num_threads(threads)`` and ignores SIGINT (the trainer stops it).
* **Slots.** Per bucket, ``slots_per_bucket`` (>= 2) preallocated CPU slots in shared memory
  (``share_memory_()``; with torch's default ``file_descriptor`` sharing strategy the segments are
  unlinked at once, so nothing is left in ``/dev/shm`` even after a SIGKILL, at the price of one
  file descriptor per tensor: about ``buckets · slots · 4``). A slot holds the input gradient
  ``[n]`` fp32 (reused as the decompression output) and one flat tensor per payload name of
  :meth:`~.base.Compressor.payload_spec` (largest size). Submitting copies the gradient into a
  free slot (one memcpy: 1.17 ms for 25 MiB here, against 23.5 ms to push a fresh tensor through
  ``torch.multiprocessing.Queue``) and sends only ``(op, ticket, bucket, slot)`` plus, for later
  rounds, a few integers describing the payload, over a one-way ``Pipe`` (the transport of
  ``SimpleQueue``, used directly because its ``poll(timeout)`` makes timed waits possible). Results
  come back the same way; payload tensors returned by :meth:`CompressionPipeline.result` are views
  into the slot, valid until :meth:`CompressionPipeline.release` of that ticket.
* **Liveness.** The helper runs a watchdog thread that waits on its parent's sentinel
  (``multiprocessing.parent_process().sentinel``) and polls ``os.getppid()`` every 0.5 s, and calls
  ``os._exit(3)`` when the parent dies, even in the middle of a compression (a ``daemon`` flag
  alone does not survive a SIGKILL of the parent; the sentinel alone misses it while a process
  forked from the trainer, such as a DataLoader worker, still holds the sentinel pipe). The trainer waits on the
  result pipe *and* the helper's sentinel with a timeout; a dead helper raises
  :class:`HelperDiedError` naming the bucket, operation and exit code; a timeout raises
  :class:`HelperTimeoutError`. Failing on every rank is the engine's job (it must abort its
  collectives when this raises).
* **Inline mode** (``mode="inline"``): the same API, compression runs in the caller (for
  comparison, and where a second process does not pay).
* **Who sends.** The helper only compresses (and decompresses); the trainer's communication
  worker sends. Only the engine owns a process group (a gloo/NCCL group cannot be shared with a
  second process, so a sending helper would need its own rank set and connections), and handing
  the payload back costs nothing: :meth:`CompressionPipeline.result` returns views into shared
  memory that the engine can reduce in place. Measured here (benchmarks/compress_bench.py, loaded
  2-core machine, 1 thread): a 95 MiB bucket round trip through a slot + index took 9.2 ms against
  148 ms through ``torch.multiprocessing.Queue`` with a fresh tensor (25 MiB: 2.5 vs 68 ms).
* **Start-up.** The helper is a fresh interpreter that imports torch and this package (about 4-8 s
  here, most of it ``lightning`` pulled in by ``lightning_pipedap/__init__``): start it once, in
  the strategy's set-up, and reuse it for the whole run.

Life cycle of one bucket in one step (summable methods; non-summable ones all-gather
``compressor.pack(payload)`` instead and aggregate)::

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

import io
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.multiprocessing  # noqa: F401  (registers tensor reductions for the spawn pickler)

from lightning_pipedap.compress.base import Payload
from lightning_pipedap.compress.compressors import get_compressor
from lightning_pipedap.compress.runtime import CompressionRuntime
from lightning_pipedap.compress.state import Layout, check_layouts

#: exit code of the helper when its parent died
EXIT_PARENT_DIED = 3
MODES = ("process", "inline")


class HelperDiedError(RuntimeError):
    """The compression helper process is not running (crashed, killed, or exited)."""


class HelperTimeoutError(RuntimeError):
    """The compression helper did not answer within the timeout."""


@dataclass(frozen=True)
class Ticket:
    """Handle of one submitted bucket: ``id`` (unique per pipeline), ``bucket``, ``slot``."""

    id: int
    bucket: int
    slot: int


@dataclass
class _Flight:
    """Book-keeping of one ticket (trainer side)."""

    ticket: Ticket
    op: str | None = None  # operation in flight, None when its result was collected
    result: Any = None  # ("ok", value, seconds) or ("error", text, seconds) received but not collected
    timings: dict[str, float] = field(default_factory=dict)


class CompressionPipeline:
    """Compression of bucket gradients in a helper process (or inline), with shared-memory slots.

    Args:
        bucket_numels: elements ``n`` of each bucket (index = bucket number).
        compressor_name: a name from :func:`~.compressors.valid_compressor_names`.
        compressor_kwargs: that compressor's keyword arguments (validated here, in the trainer).
        layouts: per bucket, ``(parameter name, shape)`` of its parameters in buffer order (see
            :class:`~.runtime.CompressionRuntime`); PowerSGD needs the shapes (one matrix per
            parameter), checkpoints the names. None: each bucket is one 1-D tensor.
        slots_per_bucket: preallocated slots per bucket, >= 2 (a bucket can be in flight twice, e.g.
            step t being decompressed while step t+1 is compressed).
        threads: ``torch.set_num_threads`` of the helper, >= 1 (budget cores with the trainer).
        timeout_s: seconds to wait for any helper answer before :class:`HelperTimeoutError`.
        mode: ``"process"`` (helper process) or ``"inline"`` (in the caller, same API).
        start_timeout_s: seconds to wait for the helper to start (it imports torch and this package).

    Raises:
        ValueError: for bad arguments (unknown compressor or keyword, slots < 2, threads < 1, layouts
            that do not match the bucket sizes, ...).
        HelperDiedError, HelperTimeoutError: if the helper does not start.
    """

    def __init__(self, bucket_numels: Sequence[int], compressor_name: str,
                 compressor_kwargs: dict[str, Any] | None = None, slots_per_bucket: int = 2, threads: int = 1,
                 timeout_s: float = 60.0, mode: str = "process", start_timeout_s: float = 120.0,
                 layouts: Layout | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if isinstance(slots_per_bucket, bool) or not isinstance(slots_per_bucket, int) or slots_per_bucket < 2:
            raise ValueError(f"slots_per_bucket must be an integer >= 2, got {slots_per_bucket!r}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        for nm, v in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{nm} must be a number of seconds > 0, got {v!r}")
        numels = tuple(bucket_numels)
        if not numels or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in numels):
            raise ValueError(f"bucket_numels must be a non-empty sequence of integers >= 1, got {list(numels)}")
        self.mode = mode
        self.bucket_numels = numels
        self.compressor_name = compressor_name
        self.compressor_kwargs = dict(compressor_kwargs or {})
        self.compressor = get_compressor(compressor_name, **self.compressor_kwargs)  # validates in the trainer
        self.layouts = check_layouts(numels, layouts)
        self.slots_per_bucket = slots_per_bucket
        self.threads = threads
        self.timeout_s = float(timeout_s)
        self._next_id = 0
        self._flights: dict[int, _Flight] = {}
        self._slot_owner: list[list[int | None]] = [[None] * slots_per_bucket for _ in numels]
        self._closed = False
        self._dead: str | None = None
        #: exit code of the helper once closed (0: clean stop; negative: killed by that signal)
        self.exitcode: int | None = None
        self._runtime: CompressionRuntime | None = None
        self._proc = None
        self._lock = threading.RLock()  # book-keeping and sends
        self._recv_lock = threading.Lock()  # one reader of the result pipe at a time
        self._slots: list[list[dict[str, Any]]] | None = None
        if mode == "inline":
            self._runtime = CompressionRuntime(numels, compressor_name, self.compressor_kwargs, self.layouts)
            self._finalizer = None
            return
        self._slots = [
            [
                {"grad": torch.empty(n, dtype=torch.float32).share_memory_(),
                 "out": {k: torch.empty(s.numel, dtype=s.dtype).share_memory_()
                         for k, s in self.compressor.payload_spec(n, [shape for _, shape in lay]).items()}}
                for _ in range(slots_per_bucket)
            ]
            for n, lay in zip(numels, self.layouts)
        ]
        ctx = mp.get_context("spawn")
        req_r, self._req = ctx.Pipe(duplex=False)
        self._res, res_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_helper_main, name="pipedap-compress-helper", daemon=True,
            args=(req_r, res_w, numels, compressor_name, self.compressor_kwargs, self.layouts, self._slots, threads,
                  os.getpid()),
        )
        self._proc.start()
        self._pid = self._proc.pid
        req_r.close()
        res_w.close()
        self._finalizer = weakref.finalize(self, _shutdown, self._proc, self._req, self._res)
        try:
            msg = self._recv(float(start_timeout_s), "start-up")
            if msg is None:
                self._raise_timeout("start-up", float(start_timeout_s))
        except BaseException:
            self.close()
            raise
        if msg[0] != "ready":
            self.close()
            raise HelperDiedError(f"compression helper failed to start:\n{msg[2] if len(msg) > 2 else msg}")

    # ------------------------------------------------------------------ public API
    @property
    def helper_pid(self) -> int | None:
        """PID of the helper process (None in inline mode)."""
        return None if self._proc is None else self._pid

    @property
    def shared_nbytes(self) -> int:
        """Bytes of shared memory held by the slots (0 in inline mode)."""
        if not self._slots:
            return 0
        total = 0
        for per_bucket in self._slots:
            for slot in per_bucket:
                total += slot["grad"].numel() * 4
                total += sum(t.numel() * t.element_size() for t in slot["out"].values())
        return total

    def submit(self, bucket: int, grad: torch.Tensor) -> Ticket:
        """Start compressing ``grad`` (flat ``[n]`` fp32 of ``bucket``); returns at once in process mode.

        The gradient is copied into a free slot (process mode); in inline mode it is compressed now
        and the payload may alias ``grad`` (``none``, PowerSGD's uncompressed steps).

        Raises:
            ValueError: bad bucket index or gradient shape/dtype.
            RuntimeError: no free slot for ``bucket`` (release earlier tickets), or pipeline closed.
            HelperDiedError: the helper is not running.
        """
        n = self._numel(bucket)
        if grad.dim() != 1 or grad.numel() != n or grad.dtype != torch.float32:
            raise ValueError(f"bucket {bucket} expects a flat [{n}] float32 gradient, got "
                             f"{tuple(grad.shape)} {grad.dtype}")
        with self._lock:
            self._check_open()
            owners = self._slot_owner[bucket]
            free = [s for s, o in enumerate(owners) if o is None]
            if not free:
                raise RuntimeError(f"bucket {bucket}: all {len(owners)} slots hold unreleased tickets {owners}; "
                                   f"call release(ticket) once a ticket's payload is consumed")
            ticket = Ticket(self._next_id, bucket, free[0])
            self._next_id += 1
            owners[ticket.slot] = ticket.id
            flight = _Flight(ticket, op="compress")
            self._flights[ticket.id] = flight
            if self._runtime is not None:
                self._run_inline(flight, lambda: self._runtime.compress(bucket, grad))
                return ticket
            slot = self._slots[bucket][ticket.slot]["grad"]
        try:
            slot.copy_(grad)  # outside the lock: other threads may collect results meanwhile
        except BaseException:
            with self._lock:
                owners[ticket.slot] = None
                del self._flights[ticket.id]
            raise
        with self._lock:
            self._check_open()
            self._send(flight, ("compress", ticket.id, bucket, ticket.slot))
        return ticket

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
            HelperDiedError: the helper died (message names bucket, operation, exit code).
            HelperTimeoutError: no answer within ``timeout_s`` (default: the pipeline's).
        """
        with self._lock:
            flight = self._flight(ticket)
            if flight.op is None:
                raise RuntimeError(f"ticket {ticket.id} (bucket {ticket.bucket}) has no operation in flight")
            op = flight.op
        (kind, value, seconds), waited = self._wait(flight, timeout_s, f"{op} of bucket {ticket.bucket} "
                                                                         f"(ticket {ticket.id})")
        with self._lock:
            flight.op = None
            flight.timings[op] = flight.timings.get(op, 0.0) + seconds
            flight.timings["wait"] = flight.timings.get("wait", 0.0) + waited
            if kind == "error":
                raise RuntimeError(f"compression helper failed in {op} of bucket {ticket.bucket} "
                                   f"({self.compressor_name}):\n{value}")
            if self._runtime is not None:
                return value
            if op == "decompress":
                return self._slots[ticket.bucket][ticket.slot]["grad"]
            return self._payload_from_desc(ticket, value)

    def submit_round(self, ticket: Ticket, reduced: Payload) -> None:
        """Send the non-final payload summed over ranks back for the next round (PowerSGD: P → Q).

        ``reduced.data`` may be the slot view returned by :meth:`result` (summed in place) or any
        tensor of the same shape; it is copied into the slot if needed.

        Raises:
            ValueError: if ``reduced`` is final or of another stage than the ticket's last payload.
        """
        with self._lock:
            flight = self._idle_flight(ticket)
            if reduced.final:
                raise ValueError(f"bucket {ticket.bucket}: payload stage {reduced.stage} is final; "
                                 f"use submit_decompress")
            self._submit_payload(flight, "round", reduced, self._runtime.next_round if self._runtime else None)

    def submit_decompress(self, ticket: Ticket, reduced: Payload) -> None:
        """Decompress a final payload (summed over ranks for summable methods) in the helper.

        The result (:meth:`result`) is the dense ``[n]`` gradient. Runs PowerSGD's warm-start update.

        Raises:
            ValueError: if ``reduced`` is not final.
        """
        with self._lock:
            flight = self._idle_flight(ticket)
            if not reduced.final:
                raise ValueError(f"bucket {ticket.bucket}: payload stage {reduced.stage} is not final; "
                                 f"use submit_round")
            self._submit_payload(flight, "decompress", reduced,
                                 self._runtime.decompress if self._runtime else None)

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
            flight = self._flight(ticket)
            if flight.op is not None:
                raise RuntimeError(f"ticket {ticket.id} (bucket {ticket.bucket}) still has {flight.op!r} in "
                                   f"flight; collect it with result() before release()")
            self._slot_owner[ticket.bucket][ticket.slot] = None
            del self._flights[ticket.id]

    def timings(self, ticket: Ticket) -> dict[str, float]:
        """Seconds per operation of ``ticket`` so far: ``compress``, ``round``, ``decompress`` (time spent
        compressing, in the helper or inline) and ``wait`` (time the caller blocked in :meth:`result`).
        ``compress - wait`` is the compression time hidden by the pipeline."""
        with self._lock:
            return dict(self._flight(ticket).timings)

    def state_dict(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Compression state per parameter name (residual slices, PowerSGD ``q``, step counters), CPU tensors.

        Call between steps (no ticket in flight). In process mode the helper serialises it and the
        answer comes back over the result pipe (wait bounded by ``timeout_s``, default: the
        pipeline's). Format: :func:`~.state.export_state`.

        Raises:
            RuntimeError: if tickets are in flight.
            HelperDiedError, HelperTimeoutError: as for :meth:`result`.
        """
        with self._lock:
            self._check_quiet("state_dict")
            if self._runtime is not None:
                return self._runtime.state_dict()
        blob = self._control(("state_dict",), "state_dict", timeout_s)
        return torch.load(io.BytesIO(blob), weights_only=True)

    def load_state_dict(self, state: dict[str, Any], timeout_s: float | None = None) -> list[str]:
        """Restore :meth:`state_dict` output (e.g. on resume, or after a re-plan with other buckets:
        the state is matched by parameter name and offset), before the next submit.

        Returns:
            names of parameters without saved state (they start with a zero residual).

        Raises:
            ValueError: if the state belongs to another compressor (checked here, in the trainer).
            RuntimeError: if tickets are in flight; in process mode also for any error of the
                helper's import (a parameter whose shape changed, ...), with its traceback.
            HelperDiedError, HelperTimeoutError: as for :meth:`result`.
        """
        with self._lock:
            self._check_quiet("load_state_dict")
            if self._runtime is not None:
                return self._runtime.load_state_dict(state)
        if state.get("compressor") != self.compressor_name:  # same check as the helper, with a local error
            raise ValueError(f"checkpoint holds compression state of {state.get('compressor')!r}, "
                             f"this run uses {self.compressor_name!r}")
        buf = io.BytesIO()
        torch.save(state, buf)
        return self._control(("load_state_dict", buf.getvalue()), "load_state_dict", timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the helper (``stop`` message, then terminate/kill after ``timeout_s``) and free the slots.

        Idempotent; also called on garbage collection and by the context manager.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._finalizer is not None:
            self._finalizer.detach()
            self.exitcode = _shutdown(self._proc, self._req, self._res, timeout_s)
        self._slots = None
        self._flights.clear()
        self._runtime = None

    def __enter__(self) -> "CompressionPipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _numel(self, bucket: int) -> int:
        if isinstance(bucket, bool) or not isinstance(bucket, int) or not (0 <= bucket < len(self.bucket_numels)):
            raise ValueError(f"bucket {bucket!r} out of range; valid buckets 0..{len(self.bucket_numels) - 1}")
        return self.bucket_numels[bucket]

    def _flight(self, ticket: Ticket) -> _Flight:
        self._check_open()
        flight = self._flights.get(ticket.id)
        if flight is None or flight.ticket != ticket:
            raise RuntimeError(f"unknown or released ticket {ticket}")
        return flight

    def _idle_flight(self, ticket: Ticket) -> _Flight:
        flight = self._flight(ticket)
        if flight.op is not None:
            raise RuntimeError(f"ticket {ticket.id} (bucket {ticket.bucket}) still has {flight.op!r} in flight")
        return flight

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("compression pipeline is closed")
        if self._dead is not None:
            raise HelperDiedError(self._dead)

    def _check_quiet(self, what: str) -> None:
        self._check_open()
        busy = [f.ticket for f in self._flights.values() if f.op is not None and f.ticket.id >= 0]
        if busy:
            raise RuntimeError(f"{what}() needs no ticket in flight; collect results of {busy} first")

    def _run_inline(self, flight: _Flight, fn) -> None:
        t0 = time.perf_counter()
        try:
            flight.result = ("ok", fn(), time.perf_counter() - t0)
        except Exception:  # reported by result(), like a helper error
            flight.result = ("error", traceback.format_exc(), time.perf_counter() - t0)

    def _submit_payload(self, flight: _Flight, op: str, reduced: Payload, inline_fn) -> None:
        """Caller holds the lock."""
        t = flight.ticket
        if reduced.numel != self.bucket_numels[t.bucket] or reduced.method != self.compressor_name:
            raise ValueError(f"bucket {t.bucket}: payload of {reduced.method!r} with {reduced.numel} elements does "
                             f"not belong here ({self.compressor_name!r}, {self.bucket_numels[t.bucket]})")
        flight.op = op
        if inline_fn is not None:
            self._run_inline(flight, lambda: inline_fn(t.bucket, reduced))
            return
        try:
            desc = _write_payload(self._slots[t.bucket][t.slot]["out"], reduced)
        except BaseException:
            flight.op = None
            raise
        self._send(flight, (op, t.id, t.bucket, t.slot, desc))

    def _payload_from_desc(self, ticket: Ticket, desc: tuple) -> Payload:
        return _read_payload(self._slots[ticket.bucket][ticket.slot]["out"], desc, self.compressor_name,
                             self.bucket_numels[ticket.bucket])

    def _send(self, flight: _Flight, msg: tuple) -> None:
        """Send a request (caller holds the lock); a broken pipe means the helper died."""
        try:
            self._req.send(msg)
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            flight.op = None
            self._mark_dead(f"{msg[0]} of bucket {flight.ticket.bucket} (ticket {flight.ticket.id})", e)

    def _wait(self, flight: _Flight, timeout_s: float | None, what: str) -> tuple[tuple, float]:
        """Block until ``flight.result`` is set; returns ``(result, seconds waited)``.

        One thread at a time reads the result pipe (``_recv_lock``) and files every message under
        its ticket, so threads waiting for different tickets can share the pipe.
        """
        total = self.timeout_s if timeout_s is None else float(timeout_s)
        t0 = time.perf_counter()
        deadline = t0 + total
        while True:
            with self._lock:
                self._check_open()
                if flight.result is not None:
                    res, flight.result = flight.result, None
                    return res, time.perf_counter() - t0
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or not self._recv_lock.acquire(timeout=remaining):
                self._raise_timeout(what, total)
            try:
                with self._lock:
                    if flight.result is not None:
                        continue
                msg = self._recv(remaining, what)
                if msg is None:
                    continue  # deadline reached: raised at the top of the loop
                with self._lock:
                    if msg[0] != "ready":
                        other = self._flights.get(msg[1])
                        if other is not None:
                            other.result = (msg[0], msg[2], msg[3])
            finally:
                self._recv_lock.release()

    def _control(self, msg: tuple, what: str, timeout_s: float | None) -> Any:
        """Send a control request (state_dict, load_state_dict) and wait for its answer."""
        with self._lock:
            cid = -1 - self._next_id  # negative ids: control messages
            self._next_id += 1
            flight = _Flight(Ticket(cid, -1, -1), op=what)
            self._flights[cid] = flight
            self._send(flight, (msg[0], cid) + msg[1:])
        try:
            (kind, value, _), _ = self._wait(flight, timeout_s, what)
        finally:
            with self._lock:
                self._flights.pop(cid, None)
        if kind == "error":
            raise RuntimeError(f"compression helper failed in {what}:\n{value}")
        return value

    def _recv(self, timeout: float, what: str) -> tuple | None:
        """Next message from the helper within ``timeout`` s, or None; watches the helper's sentinel.

        Raises:
            HelperDiedError: if the helper exited (and left no message).
        """
        ready = mpc.wait([self._res, self._proc.sentinel], timeout=max(timeout, 0.0))
        if self._res in ready:
            try:
                return self._res.recv()
            except (EOFError, OSError) as e:
                self._mark_dead(what, e)
        if ready:  # sentinel only: the process ended without a pending message
            self._mark_dead(what, None)
        return None

    def _raise_timeout(self, what: str, timeout_s: float) -> None:
        if not self._proc.is_alive():
            self._mark_dead(what, None)
        raise HelperTimeoutError(f"compression helper (pid {self._pid}, alive) did not finish {what} within "
                                 f"{timeout_s:g} s")

    def _mark_dead(self, what: str, cause: BaseException | None) -> None:
        self._proc.join(timeout=2.0)
        code = self._proc.exitcode
        reason = ("killed by signal %d" % -code) if code is not None and code < 0 else f"exit code {code}"
        if code == EXIT_PARENT_DIED:
            reason += " (parent-death watchdog)"
        self._dead = (f"compression helper (pid {self._pid}) died during {what}: {reason}"
                      + (f" ({type(cause).__name__})" if cause is not None else ""))
        raise HelperDiedError(self._dead) from cause


def _write_payload(out: dict[str, torch.Tensor], payload: Payload) -> tuple:
    """Copy payload tensors into slot tensors ``out`` (skipped when already there); returns the descriptor
    ``(stage, final, meta, {name: numel}, {local name: numel})``."""
    names, local = {}, {}
    for dst_names, tensors in ((names, payload.tensors), (local, payload.local)):
        for k, t in tensors.items():
            if k not in out:
                raise ValueError(f"{payload.method}: payload tensor {k!r} has no slot (slots: {sorted(out)})")
            dst = out[k]
            if t.dtype != dst.dtype or t.numel() > dst.numel():
                raise ValueError(f"{payload.method}: payload tensor {k!r} {t.numel()} x {t.dtype} does not fit "
                                 f"its slot {dst.numel()} x {dst.dtype}")
            if t.data_ptr() != dst.data_ptr() or t.device != dst.device:
                dst[: t.numel()].copy_(t.reshape(-1))
            dst_names[k] = t.numel()
    return payload.stage, payload.final, dict(payload.meta), names, local


def _read_payload(out: dict[str, torch.Tensor], desc: tuple, method: str, numel: int) -> Payload:
    """Inverse of :func:`_write_payload`: the :class:`Payload` of ``method`` for a bucket of ``numel``
    elements that descriptor ``desc`` describes, its tensors views into the slot tensors ``out``."""
    stage, final, meta, names, local_names = desc
    return Payload(method, numel, {k: out[k][:c] for k, c in names.items()}, dict(meta), stage, final,
                   {k: out[k][:c] for k, c in local_names.items()})


def _shutdown(proc, req, res, timeout_s: float = 10.0) -> int | None:
    """Stop the helper: polite ``stop``, then terminate, then kill; close the pipes and the process
    handle (its sentinel fd). Returns the helper's exit code (negative: killed by that signal)."""
    try:
        if proc.is_alive():
            try:
                req.send(("stop",))
            except (BrokenPipeError, ConnectionResetError, OSError):
                pass
            proc.join(timeout_s)
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        else:
            proc.join(0.1)
        return proc.exitcode
    finally:
        for conn in (req, res):
            try:
                conn.close()
            except OSError:
                pass
        try:
            proc.close()
        except ValueError:  # still running after kill (should not happen): leave the handle open
            pass


# ---------------------------------------------------------------------------------- helper side


def _watch_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Helper thread: exit the process as soon as the parent process dies.

    Waits on the parent's sentinel (fires when the parent's end of the spawn pipe closes) and, every
    ``poll_s`` seconds, checks ``os.getppid()``: the sentinel alone misses the parent's death when a
    process forked from the parent (e.g. a DataLoader worker) still holds that pipe open.
    """
    parent = mp.parent_process()
    sentinel = None if parent is None else parent.sentinel
    while os.getppid() == parent_pid:
        if sentinel is not None:
            if mpc.wait([sentinel], timeout=poll_s):
                break
        else:
            time.sleep(poll_s)
    os._exit(EXIT_PARENT_DIED)


def _helper_main(req, res, bucket_numels, compressor_name, compressor_kwargs, layouts, slots, threads,
                 parent_pid) -> None:
    """Entry point of the helper process: serve ``compress``/``round``/``decompress`` requests."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()
    torch.set_num_threads(threads)
    try:
        rt = CompressionRuntime(bucket_numels, compressor_name, compressor_kwargs, layouts)
    except Exception:
        res.send(("error", None, traceback.format_exc()))
        return
    res.send(("ready", os.getpid()))
    while True:
        try:
            msg = req.recv()
        except (EOFError, OSError):
            return  # trainer closed its end
        op = msg[0]
        if op == "stop":
            return
        tid = msg[1]
        t0 = time.perf_counter()
        try:
            if op == "compress":
                b, s = msg[2], msg[3]
                slot = slots[b][s]
                value = _write_payload(slot["out"], rt.compress(b, slot["grad"]))
            elif op in ("round", "decompress"):
                b, s = msg[2], msg[3]
                slot = slots[b][s]
                out = slot["out"]
                payload = _read_payload(out, msg[4], compressor_name, bucket_numels[b])
                if op == "round":
                    value = _write_payload(out, rt.next_round(b, payload))
                else:
                    dense = rt.decompress(b, payload)
                    if dense.data_ptr() != slot["grad"].data_ptr():
                        slot["grad"].copy_(dense)
                    value = None
            elif op == "state_dict":
                buf = io.BytesIO()
                torch.save(rt.state_dict(), buf)
                value = buf.getvalue()
            elif op == "load_state_dict":
                value = rt.load_state_dict(torch.load(io.BytesIO(msg[2]), weights_only=True))
            else:
                raise ValueError(f"unknown helper operation {op!r}")
            res.send(("ok", tid, value, time.perf_counter() - t0))
        except Exception:
            res.send(("error", tid, traceback.format_exc(), time.perf_counter() - t0))
