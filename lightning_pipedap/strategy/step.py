"""One training step's state on this rank: where the step is (:class:`StepFlags`), what the profiling steps
time (:class:`ProfileProbe`) and the timeline records (:class:`Timeline`)."""

from __future__ import annotations

import enum
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Generator, Optional

import torch

from lightning_pipedap import compat
from lightning_pipedap.measure.timeline import OpRecord


class GradSync(enum.Enum):
    """Whether this backward communicates."""

    SYNC = "sync"  #: gradients are reduced (the last micro-batch of a step, or no accumulation)
    LOCAL = "local"  #: an accumulation micro-batch (``block_backward_sync``): gradients stay on this rank


class Forward(enum.Enum):
    """Which forward runs now, for the forward pre-hooks."""

    OTHER = "other"  #: outside ``training_step`` (validation, a metric, an RL agent in the data loader)
    TRAINING_STEP = "training_step"  #: the training step's forward


class TraceStep(enum.Enum):
    """The consumer trace of the TRACE phase: taken once per trace."""

    NOT_TAKEN = "not taken"
    TAKEN = "taken"


class StepFlags:
    """Where this rank's current step is, with DDP's buffer rule and the end-of-backward callback.

    Attributes (read-only): :attr:`grad_sync`, :attr:`forward`, :attr:`trace_step`, :attr:`buffers_due`.
    """

    def __init__(self) -> None:
        self._grad_sync = GradSync.SYNC
        self._forward = Forward.OTHER
        self._trace = TraceStep.NOT_TAKEN
        self._buffers_due = True  # DDP: rank 0's buffers are broadcast before the next forward
        self._end_queued = False

    @property
    def syncing(self) -> bool:
        """Whether this backward reduces gradients (not an accumulation micro-batch)."""
        return self._grad_sync is GradSync.SYNC

    @property
    def in_training_forward(self) -> bool:
        return self._forward is Forward.TRAINING_STEP

    @property
    def trace_taken(self) -> bool:
        return self._trace is TraceStep.TAKEN

    @property
    def buffers_due(self) -> bool:
        """Whether rank 0's buffers are broadcast before the next forward (DDP's rule)."""
        return self._buffers_due

    @contextmanager
    def local_gradients(self) -> Generator[None, None, None]:
        """Accumulation micro-batches inside: gradients stay local; the previous mode comes back after."""
        prev, self._grad_sync = self._grad_sync, GradSync.LOCAL
        try:
            yield
        finally:
            self._grad_sync = prev

    @contextmanager
    def training_forward(self) -> Generator[None, None, None]:
        """The training step's forward runs inside."""
        self._forward = Forward.TRAINING_STEP
        try:
            yield
        finally:
            self._forward = Forward.OTHER

    def take_trace(self) -> None:
        self._trace = TraceStep.TAKEN

    def trace_over(self, still_tracing: bool) -> None:
        """After a step (or a restart: ``still_tracing=False``): a new trace may be taken unless still tracing."""
        if not (self.trace_taken and still_tracing):
            self._trace = TraceStep.NOT_TAKEN

    def forward_ran(self) -> None:
        """DDP's rule: buffers are broadcast before a forward that follows a grad-syncing forward."""
        self._buffers_due = torch.is_grad_enabled() and self.syncing

    def set_buffers_due(self, due: bool) -> None:
        """Set DDP's buffer rule's flag (a no-grad forward turns it off; DDP's wrapper hands it back)."""
        self._buffers_due = due

    def queue_end_of_backward(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when autograd's current backward pass ends (queued once per pass)."""
        if not self._end_queued:
            self._end_queued = True
            compat.queue_autograd_callback(callback)

    def backward_ended(self) -> None:
        self._end_queued = False


class ProfileProbe:
    """The profiling steps' timestamps of one fit: a :class:`~lightning_pipedap.probe.recorder.StepRecorder` per
    profiled step, the end of the last synced backward and the end of the last step.

    Args:
        device: the training device (CUDA is synchronised before each timestamp).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._recorder: Optional[Any] = None
        self._t_backward_done: Optional[float] = None
        self._t_step_end: Optional[float] = None

    @property
    def recording(self) -> bool:
        """Whether this step is profiled."""
        return self._recorder is not None

    def sync_device(self) -> None:
        """On CUDA, synchronise before a profiling timestamp."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start_step(self, make_recorder: Callable[[], Any], root_layers: Any) -> None:
        """A profiled step's forward starts (``root_layers``: the layers the root module owns)."""
        self.sync_device()
        self._recorder = recorder = make_recorder()
        recorder.forward_start()
        if self._t_step_end is not None:
            recorder.pre_gap = recorder.t_fwd0 - self._t_step_end
        for k in root_layers:
            recorder.layer_used(k)

    def _synced(self) -> Optional[Any]:
        """The profiled step's recorder after a device sync (timestamps follow), None when not profiling."""
        if self._recorder is not None:
            self.sync_device()
        return self._recorder

    def forward_end(self) -> None:
        if (rec := self._synced()) is not None:
            rec.forward_end()

    def backward_start(self) -> None:
        if (rec := self._synced()) is not None:
            rec.backward_start()

    def backward_end(self) -> None:
        if (rec := self._synced()) is not None:
            rec.backward_end()

    def param_ready(self, i: int) -> None:
        """Engine parameter ``i``'s gradient is ready (profiled steps)."""
        if (rec := self._synced()) is not None:
            rec.param_ready(i)

    def layers_used(self, layers: Any) -> None:
        """A module owning ``layers`` starts its forward (profiled steps)."""
        if self._recorder is not None:
            for k in layers:
                self.sync_device()
                self._recorder.layer_used(k)

    def backward_done(self) -> None:
        """A synced backward finished (the update time is measured from here)."""
        self.sync_device()
        self._t_backward_done = time.perf_counter()

    def no_update_time(self) -> None:
        """This step's update is not timed (the optimizer step runs inside the measured step)."""
        self._t_backward_done = None

    def step_ended(self) -> None:
        self._t_step_end = time.perf_counter()

    def take(self) -> tuple[Optional[Any], Optional[float]]:
        """The profiled step's recorder (None when it was not profiled) and its backward's end; stops recording."""
        rec, self._recorder = self._recorder, None
        return rec, self._t_backward_done

    def drop(self) -> None:
        self._recorder = None


@dataclass(frozen=True)
class Timeline:
    """The strategy's timeline records (``records``) and whether to take them (``enabled()``)."""

    records: list[OpRecord]
    enabled: Callable[[], bool]

    def record_wait(self, t0: float, step: Callable[[], Optional[int]]) -> None:
        """The training thread's wait for every bucket, from ``t0`` to now (s), in optimizer step ``step()``, when
        recording."""
        if self.enabled():
            at = step()
            self.records.append(OpRecord("wait_all", "wait", None, t0, time.perf_counter(), "compute", at))
