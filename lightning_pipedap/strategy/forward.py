"""The forward side of one fit's step (:class:`StepForward`): the training step traced (TRACE), guarded (a
deferred update whose first consumer the trace did not see) or timed (PROFILE), DDP's buffer rule, the
replica check, and the forward pre-hooks' reaction (a bucket's update applied at its first consumer)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

import lightning_pipedap.engine.collectives as C
from lightning_pipedap.probe.consumers import ConsumerTrace, ModuleStack
from lightning_pipedap.strategy.context import FitContext
from lightning_pipedap.strategy.controller import Controller, Phase
from lightning_pipedap.strategy.engine_slot import EngineSlot
from lightning_pipedap.strategy.numerics import NonFiniteCheck, check_replicas_agree
from lightning_pipedap.strategy.planning import Planning
from lightning_pipedap.strategy.step import ProfileProbe, StepFlags
from lightning_pipedap.strategy.tracing import consumer_mode


class StepForward:
    """Forwards of one fit under pipedap's engine.

    Args:
        ctx: the fit's context.
        slot: the fit's engine slot (its deferred updates apply at the forward pre-hooks).
        flags: the step's flags.
        probe: the profiling steps' timestamps.
        planning: the fit's planning (layers of each module, the profiling step's recorder).
        controller: the fit's controller (phase, sync steps so far).
        nonfinite: the fit's ``nonfinite`` check (its verdict is reset at each training step).
    """

    def __init__(self, ctx: FitContext, slot: EngineSlot, flags: StepFlags, probe: ProfileProbe,
                 planning: Planning, controller: Controller, nonfinite: NonFiniteCheck) -> None:
        self.ctx, self.slot, self.flags, self.probe = ctx, slot, flags, probe
        self.planning, self.controller, self.nonfinite = planning, controller, nonfinite
        self._stack = ModuleStack(ctx.module)  # the model's structure is fixed for the fit
        self._trace: Optional[ConsumerTrace] = None
        self._params_checked_at = 0

    def take_trace(self) -> Optional[ConsumerTrace]:
        """The consumer trace of the trace step (None: none taken); forgotten here."""
        trace, self._trace = self._trace, None
        return trace

    def at_module(self, module: torch.nn.Module) -> None:
        """``module``'s forward pre-hook: apply the updates it is the first consumer of (in a training step),
        or every pending update before a forward outside ``training_step``."""
        deferred = self.slot.deferred
        if deferred is None:
            return
        if not self.flags.in_training_forward:
            # a forward outside training_step (an RL agent acting in the data loader, a metric computed
            # in a hook) must see the updated weights, as under DDP
            if deferred.pending is not None and not deferred.applying:
                self.ctx.say("outside", f"pipedap: {type(module).__name__} ran a forward outside training_step "
                             "while updates were pending; they are applied first")
                deferred.apply_all("flush")
            return
        if self.probe.recording:
            self.probe.layers_used(self.planning.layer_of_module.get(id(module), ()))
        deferred.at_module(module)

    def training_step(self, call: Callable[[], Any]) -> Any:
        """Run Lightning's ``training_step`` (``call``): trace it, guard it or just time it."""
        self.nonfinite.verdict = None
        self.check_params()
        self._sync_buffers_if_due()
        deferred = self.slot.deferred
        deferred.before_training_step()
        ctl = self.controller
        if ctl.phase is Phase.TRACE and ctl.sync_steps == 0 and not self.flags.trace_taken:
            self.flags.take_trace()
            with consumer_mode(self._stack, self.slot.engine_params, [], None, track=True) as trace:
                self._trace = trace
                return self._timed_step(call)
        if not deferred.guard_needed:
            out = self._timed_step(call)
        else:
            with consumer_mode(self._stack, self.slot.engine_params, self.ctx.optimizers(), deferred.guarded_read,
                               track=False):
                try:
                    out = self._timed_step(call)
                finally:
                    self._adopt_misses()
        if deferred.pending is not None and self.ctx.config.gradient_as_bucket_view:
            # .grad is the bucket: what the forward left lands before Lightning's zero_grad, which may zero .grad
            # in place (set_to_none=False) and so the reduced gradients of a bucket still pending
            deferred.land_leftovers()
        return out

    def check_params(self) -> None:
        """``check_params_every_n_steps=N``: at the first ``training_step`` of every N-th optimizer step (the same
        point on every rank), apply pending updates and :func:`.numerics.check_replicas_agree` (which raises
        ``ParameterDivergenceError`` on every rank when a parameter differs)."""
        every, step = self.ctx.config.check_params_every_n_steps, self.ctx.step_of()
        if not every or step <= 0 or step % every or step == self._params_checked_at:
            return
        self._params_checked_at = step
        self.slot.flush()
        check_replicas_agree(self.ctx.module, step, every)

    def plain_forward(self, call: Callable[[], Any]) -> Any:
        """Run a forward that is not a training step (``call``; Fabric: one without autograd), with DDP's
        buffer rule only: rank 0's buffers are broadcast first if the previous forward synced gradients."""
        self._sync_buffers_if_due()
        out = call()
        self.flags.forward_ran()
        return out

    def _sync_buffers_if_due(self) -> None:
        if self.flags.buffers_due:
            bufs = list(self.ctx.module.buffers())
            if bufs:
                with torch.no_grad():
                    C.broadcast_coalesced_(bufs, src=0)

    def _adopt_misses(self) -> None:
        """Parameters the guard caught read before their trigger are owned by the root from now on (every
        later schedule of this fit applies them before ``training_step``)."""
        deferred = self.slot.deferred
        deferred.end_guard()
        if deferred.missed and self.slot.owners:
            self.slot.owned_by_root(deferred.missed)
            deferred.missed.clear()

    def _timed_step(self, call: Callable[[], Any]) -> Any:
        if self.controller.phase is Phase.PROFILE and self.flags.syncing:
            self.probe.start_step(self.planning.recorder, self.planning.layer_of_module.get(id(self.ctx.module), ()))
        with self.flags.training_forward():
            out = call()
        self.probe.forward_end()
        # DDP's rule: buffers are broadcast before a forward that follows a grad-syncing forward
        self.flags.forward_ran()
        return out
