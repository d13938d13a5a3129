"""Where the pipeline's compression runs: in the caller (:class:`InlineBackend`) or in the helper
process (:class:`HelperBackend`).

:class:`~.pipeline.CompressionPipeline` keeps the tickets and validates every call; a backend runs
the operations of a ticket and the layout-wide ones, with the same methods in both modes:

* ``compress(flight, grad)``, ``resume(flight, op, reduced)``: start an operation (``op`` is
  ``"round"`` or ``"decompress"``); ``collect(flight, timeout_s, what)`` waits for its answer
  ``(kind, value, seconds)`` and returns it with the seconds waited; ``output(ticket, op, value)``
  turns a successful answer into what :meth:`~.pipeline.CompressionPipeline.result` returns.
* ``state_dict``, ``load_state_dict``, ``relayout``: between steps, called with no ticket in flight.
* ``wait_ready``, ``start_expired``, ``check``, ``close``: the helper's life cycle (trivial inline).

Backends are thread-safe for different tickets; the pipeline serialises the layout-wide calls.
"""

from __future__ import annotations

import io
import os
import threading
import time
import traceback
from typing import Any, Callable

import torch

from lightning_pipedap.compress.base import Compressor, Payload
from lightning_pipedap.compress.channel import HelperChannel
from lightning_pipedap.compress.runtime import CompressionRuntime, relayout_runtime
from lightning_pipedap.compress.slots import allocate_slots, read_payload, slots_nbytes, write_payload
from lightning_pipedap.compress.tickets import Flight, Ticket

#: ``(numels, layouts)`` of a validated layout, or None before the first one
FirstLayout = tuple[tuple[int, ...], tuple] | None


def _what(op: str, ticket: Ticket) -> str:
    return f"{op} of bucket {ticket.bucket} (ticket {ticket.id})"


class InlineBackend:
    """Compression in the caller: one :class:`~.runtime.CompressionRuntime`, payloads as the compressor
    returns them (they may alias the submitted gradient), no shared memory.

    Args:
        compressor_name, compressor_kwargs: the compressor.
        first: the first layout, or None.
    """

    helper_pid = None
    shared_nbytes = 0
    startup_s = 0.0

    def __init__(self, compressor_name: str, compressor_kwargs: dict[str, Any], first: FirstLayout) -> None:
        self.name, self.kwargs = compressor_name, compressor_kwargs
        self.rt = None if first is None else CompressionRuntime(first[0], compressor_name, compressor_kwargs, first[1])
        self._lock = threading.Lock()  # one runtime call at a time

    def _run(self, flight: Flight, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        with self._lock:
            try:
                flight.result = ("ok", fn(), time.perf_counter() - t0)
            except Exception:  # reported by collect(), like a helper error
                flight.result = ("error", traceback.format_exc(), time.perf_counter() - t0)

    def compress(self, flight: Flight, grad: torch.Tensor) -> None:
        self._run(flight, lambda: self.rt.compress(flight.ticket.bucket, grad))

    def resume(self, flight: Flight, op: str, reduced: Payload) -> None:
        fn = self.rt.next_round if op == "round" else self.rt.decompress
        self._run(flight, lambda: fn(flight.ticket.bucket, reduced))

    def collect(self, flight: Flight, timeout_s: float, what: str) -> tuple[tuple[str, Any, float], float]:
        result, flight.result = flight.result, None
        return result, 0.0

    def output(self, ticket: Ticket, op: str, value: Any) -> Any:
        return value

    def state_dict(self, timeout_s: float) -> dict[str, Any]:
        return self.rt.state_dict()

    def load_state_dict(self, state: dict[str, Any], timeout_s: float) -> list[str]:
        return self.rt.load_state_dict(state)

    def relayout(self, numels: tuple[int, ...], layouts: tuple, keep_state: bool, timeout_s: float) -> list[str]:
        self.rt, fresh = relayout_runtime(self.rt, numels, self.name, self.kwargs, layouts, keep_state)
        return fresh

    def wait_ready(self, timeout_s: float | None) -> float:
        return 0.0

    def start_expired(self) -> bool:
        return False

    def check(self) -> None:
        pass

    def close(self, timeout_s: float) -> None:
        self.rt = None


class HelperBackend:
    """Compression in the helper process: shared-memory slots (:mod:`.slots`) and a
    :class:`~.channel.HelperChannel` that carries ``(op, ticket, bucket, slot[, descriptor])`` requests.

    Args:
        compressor: the compressor instance (sizes the slots); compressor_name, compressor_kwargs: its
            name and arguments, for the helper.
        slots_per_bucket, threads: as for the pipeline.
        send_timeout_s: bound on writing a large request.
        start_timeout_s: seconds from now within which the helper must be ready.
        first: the first layout (its slots are passed to the helper at start), or None.
    """

    def __init__(self, compressor: Compressor, compressor_name: str, compressor_kwargs: dict[str, Any],
                 slots_per_bucket: int, threads: int, send_timeout_s: float, start_timeout_s: float,
                 first: FirstLayout) -> None:
        self.compressor, self.name, self.slots_per_bucket = compressor, compressor_name, slots_per_bucket
        self.send_timeout_s = send_timeout_s
        self.numels: tuple[int, ...] = ()
        self.slots: list = []
        layout = None
        if first is not None:
            self.numels, self.slots = first[0], allocate_slots(compressor, first[0], first[1], slots_per_bucket)
            layout = (first[0], first[1], self.slots)
        self.channel = HelperChannel((compressor_name, compressor_kwargs, threads, os.getpid(), layout),
                                     start_timeout_s)
        self.helper_pid: int = self.channel.pid

    @property
    def shared_nbytes(self) -> int:
        return slots_nbytes(self.slots)

    def compress(self, flight: Flight, grad: torch.Tensor) -> None:
        t = flight.ticket
        self.slots[t.bucket][t.slot].grad.copy_(grad)
        self.channel.send(("compress", t.id, t.bucket, t.slot), _what("compress", t), self.send_timeout_s)

    def resume(self, flight: Flight, op: str, reduced: Payload) -> None:
        t = flight.ticket
        desc = write_payload(self.slots[t.bucket][t.slot].out, reduced)
        self.channel.send((op, t.id, t.bucket, t.slot, desc), _what(op, t), self.send_timeout_s)

    def collect(self, flight: Flight, timeout_s: float, what: str) -> tuple[tuple[str, Any, float], float]:
        return self.channel.wait(flight.ticket.id, timeout_s, what)

    def output(self, ticket: Ticket, op: str, value: Any) -> Any:
        slot = self.slots[ticket.bucket][ticket.slot]
        if op == "decompress":
            return slot.grad
        return read_payload(slot.out, value, self.name, self.numels[ticket.bucket])

    def state_dict(self, timeout_s: float) -> dict[str, Any]:
        blob = self.channel.call("state_dict", (), "state_dict", timeout_s)
        return torch.load(io.BytesIO(blob), weights_only=True)

    def load_state_dict(self, state: dict[str, Any], timeout_s: float) -> list[str]:
        buf = io.BytesIO()
        torch.save(state, buf)
        return self.channel.call("load_state_dict", (buf.getvalue(),), "load_state_dict", timeout_s)

    def relayout(self, numels: tuple[int, ...], layouts: tuple, keep_state: bool, timeout_s: float) -> list[str]:
        """Fresh slots for ``numels`` go to the helper; the old ones are dropped once it answered."""
        slots = allocate_slots(self.compressor, numels, layouts, self.slots_per_bucket)
        fresh = self.channel.call("relayout", (numels, layouts, slots, bool(keep_state)),
                                  f"relayout to {len(numels)} buckets", timeout_s)
        self.numels, self.slots = numels, slots
        return fresh

    def wait_ready(self, timeout_s: float | None) -> float:
        self.channel.wait_ready(timeout_s)
        return self.channel.startup_s

    @property
    def startup_s(self) -> float | None:
        return self.channel.startup_s

    def start_expired(self) -> bool:
        return self.channel.start_expired()

    def check(self) -> None:
        self.channel.check()

    def close(self, timeout_s: float) -> int | None:
        exitcode = self.channel.close(timeout_s)
        self.slots = []
        return exitcode
