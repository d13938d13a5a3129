"""Streams and events of one device, the same verbs on CPU and on an accelerator: :class:`DeviceStreams`.

The engine hands buffers between the trainer's stream (gradients copied in, updates applied) and the
communication worker's stream (collectives) with events, so that neither side synchronises the host
(:mod:`.bucket_sync`, :mod:`.worker`). Every stream and event use goes through this module:

* on an accelerator (``device.type != "cpu"``: CUDA, and any device ``torch.accelerator`` drives) it uses
  torch's device-generic objects: ``torch.Stream``, ``torch.Event``, ``torch.accelerator.current_stream``
  and ``torch.accelerator.set_device_index``. These are the only calls that need a device
  (:class:`_AcceleratorStreams`, about ten lines); the check that runs them is ``scripts/gpu_check.py``.
* on CPU there is no stream to order: :class:`HostStream` and :class:`HostEvent` are no-ops that keep the
  *ordering logic* testable. A wait on an event that was never recorded raises :class:`StreamOrderError`
  (on a GPU such a wait silently does nothing: the consumer would read the buffer before the producer
  wrote it), and each stream logs what it recorded and waited for, so the CPU suite checks the hand-offs
  the GPU path relies on.

Ordering on the host (``threading.Event``) stays with the caller: an event here orders *device work*; the
host hand-off that says "the event is recorded" is the bucket's own (:class:`~.bucket_sync.BucketSync`).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any, Iterator, Optional, Union

import torch

__all__ = ["DeviceStreams", "HostEvent", "HostStream", "StreamOrderError", "streams_for"]

#: entries a :class:`HostStream` keeps in its log (a long run on CPU must not grow it without bound)
LOG_LENGTH = 4096


class StreamOrderError(RuntimeError):
    """A stream waited for an event that was never recorded (a hand-off out of order: a bug, not a user error)."""


class HostEvent:
    """A CPU stand-in for ``torch.Event``: records nothing on a device, counts its records.

    Attributes:
        name: what the event marks (for messages).
        records: how many times it was recorded.
    """

    def __init__(self, name: str = "event") -> None:
        self.name = name
        self.records = 0
        self._lock = threading.Lock()

    def record(self, stream: Optional["HostStream"] = None) -> None:
        """Mark the point in ``stream`` (default: the current one); on CPU every earlier work is done already."""
        with self._lock:
            self.records += 1
        if stream is not None:
            stream.log.append(("record", self.name))

    def query(self) -> bool:
        """Whether the recorded work finished: always True on CPU."""
        return True

    def synchronize(self) -> None:
        """Block until the recorded work finished: nothing to wait for on CPU."""

    def __repr__(self) -> str:
        return f"HostEvent({self.name!r}, records={self.records})"


class HostStream:
    """A CPU stand-in for ``torch.Stream``: work runs in program order, waits are checked.

    Attributes:
        name: the stream's name (``"compute"``, ``"comm"``).
        log: the last :data:`LOG_LENGTH` ``(verb, event name)`` in order, ``verb`` ``"record"`` or ``"wait"``
            (for tests: the order of the hand-offs).
    """

    def __init__(self, name: str = "stream") -> None:
        self.name = name
        self.log: collections.deque[tuple[str, str]] = collections.deque(maxlen=LOG_LENGTH)

    def wait_event(self, event: HostEvent) -> None:
        """Order later work after ``event``.

        Raises:
            StreamOrderError: ``event`` was never recorded.
        """
        if event.records == 0:
            raise StreamOrderError(f"pipedap: stream {self.name!r} waits for event {event.name!r}, which was never "
                                   "recorded (a hand-off out of order)")
        self.log.append(("wait", event.name))

    def synchronize(self) -> None:
        """Block until the stream's work finished: nothing to wait for on CPU."""

    def clear_log(self) -> None:
        """Forget the logged records and waits."""
        self.log.clear()

    def __repr__(self) -> str:
        return f"HostStream({self.name!r})"


Stream = Union[torch.Stream, HostStream]
Event = Union[torch.Event, HostEvent]


class DeviceStreams:
    """The streams and events of ``device``: CPU stand-ins (this class) or the accelerator's
    (:class:`_AcceleratorStreams`); get one with :func:`streams_for`.

    Attributes:
        device: the device.
        accelerated: whether streams and events are the device's own (not :class:`HostStream`).
    """

    accelerated = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._current = HostStream("compute")

    def new_stream(self, name: str = "comm") -> Stream:
        """A new stream (the worker's communication stream)."""
        return HostStream(name)

    def new_event(self, name: str = "event") -> Event:
        """A new event (one per hand-off of a bucket)."""
        return HostEvent(name)

    def current(self) -> Stream:
        """The calling thread's current stream (the trainer's compute stream)."""
        return self._current

    def use(self, stream: Optional[Stream]) -> contextlib.AbstractContextManager:
        """Context in which ``stream`` is the current stream (None: leave it as it is)."""
        return contextlib.nullcontext()

    def bind_thread(self) -> None:
        """Make ``device`` the calling thread's device (a new thread starts on device 0)."""


class _AcceleratorStreams(DeviceStreams):
    """Streams and events of an accelerator (CUDA): torch's device-generic objects. The only code here that
    needs a device; run by ``scripts/gpu_check.py``."""

    accelerated = True

    def new_stream(self, name: str = "comm") -> Stream:
        return torch.Stream(device=self.device)

    def new_event(self, name: str = "event") -> Event:
        return torch.Event(device=self.device)

    def current(self) -> Stream:
        return torch.accelerator.current_stream(self.device)

    def use(self, stream: Optional[Stream]) -> contextlib.AbstractContextManager:
        return _using(stream) if stream is not None else contextlib.nullcontext()

    def bind_thread(self) -> None:
        torch.accelerator.set_device_index(self.device)


@contextlib.contextmanager
def _using(stream: Any) -> Iterator[None]:
    """``with stream:`` (``torch.Stream`` sets itself current and restores the previous one on exit)."""
    with stream:
        yield


def streams_for(device: Union[torch.device, str]) -> DeviceStreams:
    """The :class:`DeviceStreams` of ``device``: CPU stand-ins for ``cpu``, the accelerator's otherwise.

    Raises:
        ValueError: ``device`` is an accelerator type torch has no streams for here (``torch.accelerator``
            names none, or another one).
    """
    device = torch.device(device)
    if device.type == "cpu":
        return DeviceStreams(device)
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None or acc.type != device.type:
        raise ValueError(f"pipedap: device {device} has no streams here (torch.accelerator: "
                         f"{acc.type if acc is not None else 'none'}); valid: 'cpu' or the accelerator's device")
    return _AcceleratorStreams(device)
