"""One backward pass of a fit under pipedap's engine (:class:`BackwardSync`): each gradient handed to the
engine as it is ready, and at the end of autograd's pass (as DDP's reducer) in sync mode every bucket waited
for, the averaged gradients written to ``.grad``, the sparse gradients all-reduced and the result checked for
non-finite values."""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import Tensor

from lightning_pipedap.strategy.context import FitContext
from lightning_pipedap.strategy.controller import Phase
from lightning_pipedap.strategy.engine_slot import EngineSlot
from lightning_pipedap.strategy.numerics import NonFiniteCheck
from lightning_pipedap.strategy.step import ProfileProbe, StepFlags, Timeline
from lightning_pipedap.strategy.trainables import Trainables


class BackwardSync:
    """The gradient hooks' reaction and the end of a backward pass.

    Args:
        ctx: the fit's context.
        slot: the fit's engine slot.
        flags: the step's flags (gradients local or synced; the end-of-backward callback).
        probe: the profiling steps' timestamps.
        trainables: the fit's parameters (the sparse ones are reduced here).
        nonfinite: the fit's ``nonfinite`` check (its verdict is taken at the end of a synced backward).
        timeline: the strategy's timeline records (the wait for every bucket).
        phase: ``() -> Phase`` of the controller.
    """

    def __init__(self, ctx: FitContext, slot: EngineSlot, flags: StepFlags, probe: ProfileProbe,
                 trainables: Trainables, nonfinite: NonFiniteCheck, timeline: Timeline,
                 phase: Callable[[], Phase]) -> None:
        self.ctx, self.slot, self.flags, self.probe = ctx, slot, flags, probe
        self.trainables, self.nonfinite, self.timeline, self._phase = trainables, nonfinite, timeline, phase

    def grad_ready(self, p: Tensor) -> None:
        """``p``'s gradient is accumulated (its post-accumulate-grad hook): hand it to the engine.

        Raises:
            ValueError: a sparse gradient of a parameter that is not a sparse embedding's weight.
        """
        engine = self.slot.engine
        if engine is None or p.grad is None:
            return
        i = self.slot.index_of(p)
        if i is None:  # not trainable when the buckets were built (see retrain_if_changed)
            return
        if not engine.collecting:  # an accumulation micro-batch: used in this window, reduced in the next round
            engine.local_gradient(i)
            return
        if p.grad.layout != torch.strided:
            raise ValueError(f"pipedap: parameter {self.trainables.name_of(p)!r} got a {p.grad.layout} gradient, but "
                             "it is not the weight of an nn.Embedding / nn.EmbeddingBag with sparse=True, the "
                             "parameters pipedap reduces as sparse (found at set-up); build it as such a module, or "
                             "use strategy='ddp'")
        self.slot.deferred.gradient_arrived(i)
        # as DDP's reducer: the reduction finishes when autograd's backward pass ends, so user code right
        # after ``loss.backward()`` (a LightningModule.backward override) sees averaged gradients in sync mode
        self.flags.queue_end_of_backward(self._end_of_backward_pass)
        engine.grad_ready(i, p.grad)
        self.probe.param_ready(i)

    def _end_of_backward_pass(self) -> None:
        self.flags.backward_ended()
        self.finish()

    def start(self) -> None:
        """Before a backward: leftovers of the pending update land; a synced backward opens an engine round."""
        slot = self.slot
        slot.deferred.before_backward()
        slot.engine.attach_views()  # (gradient_as_bucket_view: None .grad -> zeroed views; every pending bucket landed)
        if self.flags.syncing:
            slot.engine.begin_iteration(self.ctx.step_or_none())  # (timeline records name the step)
            self.probe.backward_start()

    def finish(self) -> None:
        """End of backward: in sync mode wait for every bucket and write the averaged gradients to ``.grad``; the
        sparse gradients are all-reduced meanwhile on their own group and set in ``.grad`` too."""
        slot, nonfinite = self.slot, self.nonfinite
        slot.deferred.check_stale()
        engine = slot.engine
        if not engine.collecting:
            return
        self.probe.backward_end()
        engine.finish_backward()
        if slot.deferred.deferring:  # (never with sparse gradients: those steps run in sync mode, see has_sparse)
            return
        sparse = self.trainables.sparse if self.trainables.has_sparse else None
        t0 = time.perf_counter()
        if sparse is not None:  # (its own group: they run while the engine finishes the dense buckets)
            with torch.no_grad():
                sparse.start()
        engine.wait_idle()
        self.timeline.record_wait(t0, self.ctx.step_or_none)
        with torch.no_grad():
            watching = self._phase() is not Phase.RUN  # (trace, profile and trial steps)
            for b in range(engine.num_buckets):
                bucket = engine.write_back(b)  # (GATHERED -> WRITTEN: .grad shows the averaged gradients)
                if watching:
                    slot.note_unused(bucket)
            if sparse is not None:
                sparse.finish()
        # (the reduced buckets are identical on every rank: every rank finds the same)
        nonfinite.verdict = nonfinite.scan(engine.buckets) if nonfinite.active else None
        if sparse is not None and nonfinite.verdict is None and nonfinite.active:
            nonfinite.verdict = nonfinite.scan_sparse(sparse)
        self.probe.backward_done()
