"""Tickets of the compression pipeline: which slot each submitted bucket holds, and what is in flight.

A :class:`Ticket` is handed out by :meth:`~.pipeline.CompressionPipeline.submit` for one bucket's
gradient and holds one of that bucket's slots until it is released; at most one operation
(``compress``, ``round``, ``decompress``) of a ticket is in flight at a time. :class:`TicketBook`
keeps that book for one pipeline and layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Ticket:
    """Handle of one submitted bucket: ``id`` (unique per pipeline, >= 0), ``bucket``, ``slot``."""

    id: int
    bucket: int
    slot: int


@dataclass
class Flight:
    """Book-keeping of one ticket.

    Attributes:
        ticket: the ticket.
        op: operation in flight, None once its result was collected.
        result: inline mode: ``(kind, value, seconds)`` of the operation, not yet collected.
        timings: seconds per operation so far, and ``wait`` (see
            :meth:`~.pipeline.CompressionPipeline.timings`).
    """

    ticket: Ticket
    op: str | None = None
    result: Any = None
    timings: dict[str, float] = field(default_factory=dict)


class TicketBook:
    """The tickets of one pipeline: slot owners per bucket and the flights by ticket id.

    Not locked: the pipeline calls it under its own lock.

    Args:
        slots_per_bucket: slots of each bucket.
    """

    def __init__(self, slots_per_bucket: int) -> None:
        self.slots_per_bucket = slots_per_bucket
        self.next_id = 0
        self._flights: dict[int, Flight] = {}
        self._owners: list[list[int | None]] = []

    def reset(self, n_buckets: int) -> None:
        """Start a layout of ``n_buckets`` buckets with every slot free (earlier tickets are forgotten)."""
        self._flights.clear()
        self._owners = [[None] * self.slots_per_bucket for _ in range(n_buckets)]

    def issue(self, bucket: int, op: str) -> Flight:
        """A new ticket on a free slot of ``bucket`` (a valid index), with ``op`` in flight.

        Raises:
            RuntimeError: every slot of ``bucket`` holds an unreleased ticket.
        """
        owners = self._owners[bucket]
        free = [s for s, o in enumerate(owners) if o is None]
        if not free:
            raise RuntimeError(f"bucket {bucket}: all {len(owners)} slots hold unreleased tickets {owners}; "
                               f"call release(ticket) once a ticket's payload is consumed")
        flight = Flight(Ticket(self.next_id, bucket, free[0]), op=op)
        self.next_id += 1
        owners[flight.ticket.slot] = flight.ticket.id
        self._flights[flight.ticket.id] = flight
        return flight

    def get(self, ticket: Ticket) -> Flight:
        """The flight of a live ticket.

        Raises:
            RuntimeError: unknown or released ticket.
        """
        flight = self._flights.get(ticket.id)
        if flight is None or flight.ticket != ticket:
            raise RuntimeError(f"unknown or released ticket {ticket}")
        return flight

    def idle(self, ticket: Ticket) -> Flight:
        """The flight of a live ticket with nothing in flight.

        Raises:
            RuntimeError: unknown or released ticket, or an operation still in flight.
        """
        flight = self.get(ticket)
        if flight.op is not None:
            raise RuntimeError(f"ticket {ticket.id} (bucket {ticket.bucket}) still has {flight.op!r} in flight")
        return flight

    def pending(self, ticket: Ticket) -> Flight:
        """The flight of a live ticket with an operation in flight.

        Raises:
            RuntimeError: unknown or released ticket, or nothing in flight.
        """
        flight = self.get(ticket)
        if flight.op is None:
            raise RuntimeError(f"ticket {ticket.id} (bucket {ticket.bucket}) has no operation in flight")
        return flight

    def release(self, ticket: Ticket, force: bool = False) -> None:
        """Free the ticket's slot (``force``: also with an operation in flight, to undo a failed submit).

        Raises:
            RuntimeError: unknown or released ticket; without ``force``, an operation in flight.
        """
        flight = self.get(ticket)
        if flight.op is not None and not force:
            raise RuntimeError(f"ticket {ticket.id} (bucket {ticket.bucket}) still has {flight.op!r} in "
                               f"flight; collect it with result() before release()")
        self._owners[ticket.bucket][ticket.slot] = None
        del self._flights[ticket.id]

    def check_quiet(self, what: str, released: bool = False) -> None:
        """Raise unless no ticket has an operation in flight (``released``: unless no ticket exists).

        Raises:
            RuntimeError: naming ``what`` and each such ticket's bucket, id and state.
        """
        held = [f for f in self._flights.values() if released or f.op is not None]
        if held:
            need = "every ticket released" if released else "no ticket in flight"
            raise RuntimeError(f"{what}() needs {need}; held: " + ", ".join(
                f"bucket {f.ticket.bucket} (ticket {f.ticket.id}, "
                + (f"{f.op!r} in flight)" if f.op is not None else "not released)") for f in held))
