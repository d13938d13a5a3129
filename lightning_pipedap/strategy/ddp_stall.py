"""A DDP reduction that stalled under the ``torch_ddp`` candidate (:class:`DDPStall`).

DDP's reducer without ``find_unused_parameters`` waits for a gradient of every parameter; a backward that
leaves one without a gradient stalls it. When every rank stalled alike, pipedap finishes the step as DDP with
``find_unused_parameters=True`` would and continues with that option; when only some ranks did, no rank can
step, and the error names the parameters, the step and the ranks (agreed through the rendezvous store).
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional

from torch import Tensor

import lightning_pipedap.engine.collectives as C
from lightning_pipedap.strategy.context import FitContext
from lightning_pipedap.strategy.engine_slot import EngineSlot
from lightning_pipedap.strategy.lightning_reads import step_text

#: run-times built in this process so far (every rank builds them in the same order: a per-fit key)
_FITS = itertools.count()
#: what a user can do about a parameter unused on some ranks only under DDP's reducer
_STALL_REMEDY = ("Leave find_unused_parameters at its default (None: DDP's reducer then runs with it), or pass "
                 "torch_ddp_candidate=False (pipedap's own engine handles parameters unused on some ranks)")


class DDPStall:
    """The stall agreements of one fit under DDP's reducer.

    Args:
        ctx: the fit's context.
        slot: the fit's engine slot (its ``handover``; the schedule record).
        params: ``() -> the dense trainable parameters`` (named in the error).
        name_of: ``parameter -> name``.
    """

    def __init__(self, ctx: FitContext, slot: EngineSlot, params: Callable[[], list[Tensor]],
                 name_of: Callable[[Tensor], str]) -> None:
        self.ctx, self.slot, self.params, self.name_of = ctx, slot, params, name_of
        self.fit_id = next(_FITS)  # (the same on every rank: every rank builds its run-times in the same order)
        self.stalls = 0  # stalled DDP reductions so far (store keys of the stall agreement)

    def after_backward(self) -> None:
        """After a backward under DDP's reducer: when its reduction stalled (a parameter got no gradient and the
        ``torch_ddp`` candidate runs without ``find_unused_parameters``), finish it as DDP with that option would
        and continue with it (:meth:`TorchDDPHandover.finish_stalled`), before the optimizer step reads ``.grad``.

        Raises:
            RuntimeError: naming the parameters, the step and the ranks, when the stall is not on every rank (a
                parameter unused on some ranks only: the others are blocked in DDP's backward, and no rank steps),
                within ``min(60 s, wait_timeout_s)``.
        """
        ctx, h = self.ctx, self.slot.handover
        if h is None or not h.stalled():
            return
        step = step_text(ctx.module)
        missing = C.ranks_not_stalled(self._key(), ctx.rank, ctx.comm.world_size,
                                      min(60.0, ctx.config.wait_timeout_s))
        self.stalls += 1
        if missing:
            local = [self.name_of(p) for p in self.params() if p.requires_grad and p.grad is None][:5]
            raise RuntimeError(
                f"pipedap: rank {ctx.rank}: {', '.join(local) or 'a parameter'} got no gradient in {step} under DDP's "
                f"reducer (the torch_ddp candidate, which runs without find_unused_parameters: you passed "
                f"find_unused_parameters=False, and every parameter had a gradient in the profiled steps), "
                f"but rank(s) {missing} had one: DDP cannot average such a step. "
                + _STALL_REMEDY)
        unused = h.finish_stalled(ctx.comm)
        assert h.candidate is not None
        self.slot.schedules.ddp_continues_as(h.candidate)
        names = ", ".join(self.name_of(p) for p in unused[:5]) + (", ..." if len(unused) > 5 else "")
        ctx.say("ddp-stalled", f"pipedap: {'parameter(s) ' + names if unused else 'a parameter'} got no gradient in "
                f"{step} under DDP's reducer, which ran without find_unused_parameters (every "
                "parameter had one in the profiled steps); pipedap averaged this step's gradients as DDP with "
                "find_unused_parameters=True does, and DDP's reducer continues with that option")

    def elsewhere(self) -> Optional[str]:
        """Why DDP's backward failed on this rank when another rank's reduction stalled in this step (a parameter
        unused on that rank only, see :meth:`after_backward`), as an error message; None when no other rank
        marked a stall (then the failure has another cause). Reads the rendezvous store only."""
        ctx, h = self.ctx, self.slot.handover
        if h is None or not h.active:
            return None
        marked = [r for r in C.ranks_marked_stalled(self._key(), ctx.comm.world_size) if r != ctx.rank]
        if not marked:
            return None
        return (f"pipedap: rank {ctx.rank}: DDP's reducer failed in {step_text(ctx.module)}: rank(s) {marked} got no "
                "gradient for a parameter that this rank used (the torch_ddp candidate runs without "
                "find_unused_parameters: you passed find_unused_parameters=False, and every parameter had a "
                "gradient in the profiled and trial steps), so the "
                f"bucket all-reduces this rank launched were never matched; the error of rank(s) {marked} names the "
                "parameters. " + _STALL_REMEDY)

    def _key(self) -> str:
        """Rendezvous-store key of this fit's next stall agreement (:func:`C.ranks_not_stalled`)."""
        return f"pipedap/ddp_stall/{self.fit_id}/{self.stalls}"
