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
        find_unused_parameters: DDP's option of that name (DDP then traverses the graph every step, as
            ``DDPStrategy(find_unused_parameters=True)``); the strategy always sets it, since which parameters
            get a gradient can change after the steps the trials see.
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
                 unhook: Callable[[], None], rehook: Callable[[], None]) -> None:
        self.module, self.device, self._set_model = module, device, set_model
        self._unhook, self._rehook = unhook, rehook
        self.wrapper: Optional[torch.nn.Module] = None

    @property
    def active(self) -> bool:
        """Whether DDP's reducer runs the gradient synchronisation now."""
        return self.wrapper is not None

    def enter(self, candidate: TorchDDPCandidate) -> None:
        """Wrap the model (a collective on the default group: every rank at the same step)."""
        if self.wrapper is not None:
            return
        self._unhook()
        self.wrapper = C.torch_ddp(self.module, self.device, candidate.bucket_cap_mb, candidate.find_unused_parameters,
                                   candidate.gradient_as_bucket_view)
        self._set_model(self.wrapper)

    def leave(self, rehook: bool = True) -> None:
        """Unwrap: DDP's autograd hooks go with the wrapper; pipedap's come back unless ``rehook`` is False
        (teardown removes them anyway)."""
        if self.wrapper is None:
            return
        self._set_model(self.module)
        self.wrapper = None
        gc.collect()  # the reducer removes its autograd hooks when the wrapper is freed
        if rehook:
            self._rehook()
