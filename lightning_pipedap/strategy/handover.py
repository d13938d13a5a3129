"""The ``torch_ddp`` candidate: hand the model to PyTorch's own ``DistributedDataParallel`` reducer.

When communication is negligible (a small or compute-bound model), every schedule of pipedap's engine
costs its Python bookkeeping per step (hooks, bucket copies, the worker hand-off) and buys nothing.
Measured plan selection therefore also measures DDP's C++ reducer (WFBP all-reduce inside backward,
``bucket_cap_mb`` buckets) and, when it is the fastest, training continues under it: the updates are
then DDP's by construction (plain ``optimizer.step()`` on gradients DDP averaged).

While handed over, pipedap's gradient and forward hooks are removed (no per-step cost) and the
strategy routes Lightning's hooks to DDP's paths; :meth:`TorchDDPHandover.leave` (a re-plan, a change
of the trainable set, teardown) unwraps the model and puts the hooks back.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

import lightning_pipedap.engine.collectives as C

NAME = "torch_ddp"


@dataclass(frozen=True)
class TorchDDPCandidate:
    """A trial candidate that is not an engine schedule: DDP's reducer (module docstring).

    Attributes:
        bucket_cap_mb: DDP's bucket size (MiB), the strategy's ``bucket_cap_mb``.
        find_unused_parameters: DDP's option of that name (DDP then all-reduces a used-parameter map every
            step, as ``DDPStrategy(find_unused_parameters=True)``: one more small collective per step, 1.4x the
            step time of a tiny MLP on gloo); set when a profiled step left a parameter without a gradient on
            some rank, and with ``gradient_as_bucket_view`` (``.grad`` are then DDP's buffers, which a stalled
            reduction leaves half-averaged). Without it a backward that leaves one out later is finished by
            :meth:`TorchDDPHandover.finish_stalled`, and DDP continues with it.
        predicted_iteration_s: the α-β prediction of the same WFBP schedule (s), None when unknown.
        gradient_as_bucket_view: DDP's option of that name, the strategy's ``gradient_as_bucket_view``
            (``.grad`` as views into DDP's buckets, so the reducer keeps no second copy either).
    """

    bucket_cap_mb: float
    find_unused_parameters: bool
    predicted_iteration_s: Optional[float] = None
    gradient_as_bucket_view: bool = False
    name: str = NAME
    num_compressed: int = 0
    #: no drift re-plan under it: it has no plan, and a machine that is slower now slows every candidate alike
    replannable: bool = False

    def describe(self) -> str:
        """``"torch_ddp (DistributedDataParallel reducer, 25 MiB buckets)"``."""
        unused = ", find_unused_parameters" if self.find_unused_parameters else ""
        unused += ", gradient_as_bucket_view" if self.gradient_as_bucket_view else ""
        return f"{self.name} (DistributedDataParallel reducer, {self.bucket_cap_mb:g} MiB buckets{unused})"

    def to_dict(self) -> dict[str, Any]:
        """Plain data for result files: name, bucket_cap_mb, find_unused_parameters, gradient_as_bucket_view,
        predicted_iteration_s."""
        return {"name": self.name, "bucket_cap_mb": self.bucket_cap_mb,
                "find_unused_parameters": self.find_unused_parameters,
                "gradient_as_bucket_view": self.gradient_as_bucket_view,
                "predicted_iteration_s": self.predicted_iteration_s}


class TorchDDPHandover:
    """Enter and leave DDP's reducer for one fit's model.

    Args:
        module: the model pipedap trains (the LightningModule).
        device: its device.
        set_model: ``set_model(m)`` makes ``m`` what the strategy runs (the wrapper, or ``module`` again).
        unhook, rehook: remove / reinstall pipedap's gradient and forward hooks.
    """

    def __init__(self, module: torch.nn.Module, device: torch.device, set_model: Callable[[torch.nn.Module], None],
                 unhook: Callable[[], None], rehook: Callable[[], None],
                 buffer_sync: Optional[tuple[Callable[[], bool], Callable[[bool], None]]] = None) -> None:
        self.module, self.device, self._set_model = module, device, set_model
        self._unhook, self._rehook = unhook, rehook
        #: (get, set) of the strategy's "broadcast rank 0's buffers before the next forward" flag (DDP's buffer rule),
        #: handed to the wrapper on entry and taken back on leaving, so a switch never adds or drops a broadcast
        self._buffer_sync = buffer_sync
        self.wrapper: Optional[torch.nn.Module] = None
        self.candidate: Optional[TorchDDPCandidate] = None

    @property
    def active(self) -> bool:
        """Whether DDP's reducer runs the gradient synchronisation now."""
        return self.wrapper is not None

    def enter(self, candidate: TorchDDPCandidate) -> None:
        """Wrap the model (every rank at the same step). Nothing is broadcast: parameters and buffers stay as they
        are on each rank, and the buffer rule continues where the strategy's left it."""
        if self.wrapper is not None:
            return
        self._unhook()
        self.candidate = candidate
        sync_next = self._buffer_sync[0]() if self._buffer_sync is not None else True
        self.wrapper = C.torch_ddp(self.module, self.device, candidate.bucket_cap_mb, candidate.find_unused_parameters,
                                   candidate.gradient_as_bucket_view, sync_buffers_next=sync_next)
        self._set_model(self.wrapper)

    def stalled(self) -> bool:
        """After a backward: DDP's reduction did not finish on this rank (a parameter got no gradient and DDP runs
        without ``find_unused_parameters``; :func:`~lightning_pipedap.engine.collectives.ddp_reduction_finished`)."""
        c, w = self.candidate, self.wrapper
        return (w is not None and c is not None and not c.find_unused_parameters
                and not C.ddp_reduction_finished(w))

    def finish_stalled(self, comm: C.CommGroup) -> list[torch.nn.Parameter]:
        """Average this backward's gradients as DDP with ``find_unused_parameters=True`` does
        (:func:`~lightning_pipedap.engine.collectives.finish_stalled_reduction`, on ``comm``; every rank stalled
        alike) and re-wrap the model with that option, so the next forward finds a reducer that is not waiting.

        Returns:
            The parameters no rank produced a gradient for.
        """
        assert self.candidate is not None and not self.candidate.gradient_as_bucket_view
        params = [p for p in self.module.parameters() if p.requires_grad]
        unused = C.finish_stalled_reduction(params, comm)
        candidate = dataclasses.replace(self.candidate, find_unused_parameters=True)
        self.leave(rehook=False)
        self.enter(candidate)
        return [params[k] for k in unused]

    def leave(self, rehook: bool = True) -> None:
        """Unwrap: DDP's autograd hooks go with the wrapper; pipedap's come back unless ``rehook`` is False
        (teardown removes them anyway)."""
        if self.wrapper is None:
            return
        if self._buffer_sync is not None:
            self._buffer_sync[1](C.ddp_buffers_sync_next(self.wrapper))
        self._set_model(self.module)
        self.wrapper = None
        gc.collect()  # the reducer removes its autograd hooks when the wrapper is freed
        if rehook:
            self._rehook()
