"""The backward hooks of :class:`~lightning_pipedap.strategy.lightning.PipeDAPStrategy` (:class:`BackwardHooks`, a
mixin of it): accumulation micro-batches without communication, the gradient reduction finished before
``on_after_backward``, and a forward that read a parameter before its pending update landed reported by name.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Generator, Optional

from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pipedap.engine import collectives as C


class BackwardHooks:
    """Lightning's backward overrides, delegating to the run-time (``self._rt``; None: DDP's or Lightning's own
    behaviour). Mixed into :class:`~lightning_pipedap.strategy.lightning.PipeDAPStrategy` ahead of
    ``DDPStrategy``, whose methods ``super()`` reaches."""

    _rt: Any
    lightning_module: Any
    precision_plugin: Any

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-batches (all but the last) keep gradients local: no communication."""
        rt = self._rt
        if rt is None:
            yield
            return
        if rt.handed_over:
            with super().block_backward_sync():  # DDP's no_sync()
                yield
            return
        with rt.local_gradients():
            yield

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if self._rt is not None and self._rt.handed_over:
            super().pre_backward(closure_loss)
        elif self._rt is not None:
            self._rt.before_backward()

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward, with the gradient reduction finished *before* ``on_after_backward``.

        In sync mode ``.grad`` holds the averaged gradients when ``on_after_backward`` runs, as with DDP
        (whose reducer finishes inside backward). A forward that read a parameter before its pending update
        landed is reported by name instead of autograd's in-place error.
        """
        lm = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, lm)
        try:
            self.precision_plugin.backward(closure_loss, lm, optimizer, *args, **kwargs)
        except RuntimeError as exc:
            rt = self._rt
            if rt is not None and rt.deferred is not None and rt.deferred.late_applied \
                    and "modified by an inplace operation" in str(exc):
                raise RuntimeError(rt.deferred.stale_message()) from exc
            why = rt.stalled_elsewhere() if rt is not None else None
            if why:  # (DDP's bucket all-reduces failed because another rank's reduction stalled)
                raise RuntimeError(why) from exc
            named = None if rt is None else C.named_peer_failure(
                exc, "DDP's gradient all-reduce (backward)" if rt.handed_over else "the backward", lm.global_step)
            if named is not None:  # (gloo's bare "Connection reset by peer": name this rank, the step, the peer)
                raise named from exc
            raise
        if self._rt is not None and not self._rt.handed_over:
            self._rt.finish_backward()
            self._rt.nonfinite.raise_if_bad()  # (nonfinite="raise": every rank, the same step)
        elif self._rt is not None:
            self._rt.after_ddp_backward()  # (a stalled DDP reduction is finished before on_after_backward)
        closure_loss = self.precision_plugin.post_backward(closure_loss, lm)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """Nothing: the reduction is finished in :meth:`backward`, before ``on_after_backward``."""
