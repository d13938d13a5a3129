"""The strategy's run-time for one fit: a router from the strategy's and the hooks' calls to the pieces that
own each concern.

:class:`Runtime` is created when the strategy sets the model up and lives until teardown. It holds no state of
its own beyond its pieces, and nothing outside it writes into it (its attributes are read-only):

- :class:`~lightning_pipedap.strategy.context.FitContext`: the options, the model, the group, the loggers;
- :class:`~lightning_pipedap.strategy.trainables.Trainables`: the trainable parameters (checked identical on
  every rank), dense for the engine and sparse for their own reducer;
- :class:`~lightning_pipedap.strategy.engine_slot.EngineSlot`: the installed
  :class:`~lightning_pipedap.engine.engine.CommEngine` with its
  :class:`~lightning_pipedap.strategy.deferred.DeferredUpdates`, the traced order and owners, DDP's reducer
  when the ``torch_ddp`` candidate runs, the compression state across engines, which schedule runs;
- :class:`~lightning_pipedap.strategy.backward.BackwardSync`: the gradient hooks' reaction and the end of
  backward; :class:`~lightning_pipedap.strategy.step.StepFlags` and
  :class:`~lightning_pipedap.strategy.step.ProfileProbe`: where the step is, and the profiling timestamps;
- :class:`~lightning_pipedap.strategy.ddp_stall.DDPStall`: stalled reductions under DDP's reducer;
- the :class:`~lightning_pipedap.strategy.controller.Controller` (phases), whose transitions act on the pieces
  through :class:`~lightning_pipedap.strategy.effects.RunEffects`, with
  :class:`~lightning_pipedap.strategy.planning.Planning` and the fit's
  :class:`~lightning_pipedap.strategy.plan_cache.PlanCache`.

It imports no Lightning: the strategy passes in the module, the optimizers and the loggers, and what is read of a
Trainer goes through :mod:`~lightning_pipedap.strategy.lightning_reads`.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Any, Callable, Optional

import torch
from torch import Tensor

import lightning_pipedap.engine.collectives as C
from lightning_pipedap.measure.timeline import OpRecord
from lightning_pipedap.probe.consumers import ConsumerTrace
from lightning_pipedap.schedule import Schedule, builtin_schedule
from lightning_pipedap.strategy import resume as R
from lightning_pipedap.strategy.backward import BackwardSync
from lightning_pipedap.strategy.config import PipeDAPConfig
from lightning_pipedap.strategy.context import FitContext
from lightning_pipedap.strategy.controller import Controller, Phase
from lightning_pipedap.strategy.ddp_stall import DDPStall
from lightning_pipedap.strategy.effects import RunEffects
from lightning_pipedap.strategy.engine_slot import EngineSlot
from lightning_pipedap.strategy.forward import StepForward
from lightning_pipedap.strategy.hooks import ModelHooks
from lightning_pipedap.strategy.numerics import NonFiniteCheck
from lightning_pipedap.strategy.plan_cache import PlanCache, job_label
from lightning_pipedap.strategy.planning import Measured, Planning
from lightning_pipedap.strategy.step import ProfileProbe, StepFlags, Timeline
from lightning_pipedap.strategy.trainables import Trainables, refuse_sparse_with

__all__ = ["Runtime", "refuse_sparse_with", "refuse_unsupported_modules", "start_compression_helper",
           "timing_free_reason"]


def timing_free_reason(config: PipeDAPConfig, world_size: int) -> Optional[str]:
    """Why a planned schedule must give way to a fixed one, or None: deterministic algorithms are on
    (``torch.are_deterministic_algorithms_enabled()``: ``Trainer(deterministic=True)``) and the candidates of measured
    selection can round differently, so the plan (chosen from measured times) would decide the bits. At 2 ranks in
    fp32 every candidate sums each element as ``a/2 + b/2`` (exact in any order) and none rounds differently: no
    reason. At >= 3 ranks the ring sums a bucket's elements in an order set by the bucket layout; a 16-bit wire
    rounds the elements a rank does not own, and compression works per bucket."""
    if not config.planned or not torch.are_deterministic_algorithms_enabled():
        return None
    if world_size >= 3:
        return (f"at {world_size} processes the order of the sums depends on the bucket layout, which differs "
                "between candidates")
    if config.wire_dtype != "fp32":
        return f"wire_dtype={config.wire_dtype!r} rounds the elements a rank does not own, set by the bucket layout"
    if config.compression:
        return f"compression={config.compression!r} works per bucket"
    return None


def refuse_unsupported_modules(model: torch.nn.Module, device: torch.device) -> None:
    """CPU SyncBatchNorm is refused before any collective, naming the module.

    Raises:
        ValueError: naming the module.
    """
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.SyncBatchNorm) and device.type == "cpu":
            raise ValueError(f"pipedap: module {name!r} is a SyncBatchNorm, which needs CUDA; on CPU use BatchNorm")


def start_compression_helper(config: PipeDAPConfig, device: torch.device, rank: int) -> Any:
    """The fit's compression helper, started at set-up (its start-up overlaps the warm-up steps) and given
    each final schedule's bucket layout by ``relayout``: one helper process per rank for the whole fit.

    Raises:
        ValueError: compression on a non-CPU device.
    """
    from lightning_pipedap.compress import CompressionPipeline  # noqa: PLC0415
    from lightning_pipedap.compress.compressors import compressor_kwargs  # noqa: PLC0415

    if device.type != "cpu":
        raise ValueError(f"pipedap: compression= runs on CPU/gloo in this version (device {device}); on CUDA use "
                         "compression=None (the CUDA transport is designed, not yet verified on a GPU: docs/GPU.md)")
    kwargs = dict(config.compression_kwargs)
    if "rank" in compressor_kwargs(config.compression) and config.compression != "powersgd":
        kwargs["rank"] = rank  # per-rank random streams (QSGD, DGC sampling)
    return CompressionPipeline.start(config.compression, kwargs, threads=config.compression_threads,
                                     timeout_s=config.wait_timeout_s, mode=config.compression_mode,
                                     start_timeout_s=config.wait_timeout_s)


class _Route:
    """A read-only attribute of the run-time held by one of its pieces (``engine = _Route("slot")``: the
    slot's ``engine``; a dotted piece walks further). Assigning it raises: call the method named for the change."""

    def __init__(self, piece: str, name: Optional[str] = None) -> None:
        self.path, self.name = piece.split("."), name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, rt: Any, owner: type) -> Any:
        if rt is None:
            return self
        for part in self.path:
            rt = getattr(rt, part)
        return getattr(rt, self.name)

    def __set__(self, rt: Any, value: Any) -> None:
        raise AttributeError(f"Runtime.{self.name} is read-only (held by its {'.'.join(self.path)}); call the "
                             "run-time's method that makes the change")


class Runtime:
    """One fit's run-time (module docstring).

    Args:
        config: the strategy's options.
        module: the LightningModule (an ``nn.Module``).
        optimizers: ``optimizers()`` -> the strategy's optimizers (they exist only after set-up).
        comm: the dedicated process group of the engine.
        world_size, rank, device: of this process.
        measured: measurements kept across fits (contention, calibration).
        resume: a loaded checkpoint's plan and compression state (:func:`.resume.install_plan`).
        info, warn: rank-0 loggers.
        counts: ``update_counts`` of the strategy (incremented per applied bucket).
        records: the strategy's timeline records; ``timeline()`` says whether to record.
        run_noun: what messages call one training run (``"fit"``; Fabric: ``"run"``).
        layout: ``(nodes, processes per node)`` (the plan cache's key); default one node.
        step_of: ``() -> int``, the current optimizer step (Lightning's ``global_step``); default -1.

    Raises:
        ValueError: no trainable parameter, or trainable parameters that differ between ranks.
    """

    config = _Route("ctx")
    module = _Route("ctx")
    comm = _Route("ctx")
    world_size = _Route("ctx")
    rank = _Route("ctx")
    device = _Route("ctx")
    optimizers = _Route("ctx")
    info = _Route("ctx")
    say = _Route("ctx")
    params = _Route("trainables")
    tset = _Route("trainables")
    sparse = _Route("trainables")
    has_sparse = _Route("trainables")
    engine = _Route("slot")
    deferred = _Route("slot")
    order = _Route("slot")
    owners = _Route("slot")
    handover = _Route("slot")
    saw_unused = _Route("slot")
    carry = _Route("slot")
    installed_schedule = _Route("slot.schedules", "installed")
    final_schedule = _Route("slot.schedules", "final")
    running_schedule = _Route("slot.schedules", "running")

    def __init__(self, config: PipeDAPConfig, module: torch.nn.Module, optimizers: Callable[[], list],
                 comm: Any, world_size: int, rank: int, device: torch.device, measured: Measured,
                 resume: R.ResumeState, info: Callable[[str], None], warn: Callable[[str], None],
                 counts: dict[str, int], records: list[OpRecord], timeline: Callable[[], bool],
                 run_noun: str = "fit", layout: Optional[tuple[int, int]] = None,
                 step_of: Optional[Callable[[], int]] = None) -> None:
        self.ctx = ctx = FitContext(config, module, comm, world_size, rank, device, info, warn, optimizers,
                                    **({"step_of": step_of} if step_of is not None else {}))
        self.resume = resume
        #: Trainer(deterministic=True) where candidates round differently (see :func:`timing_free_reason`): the fixed
        #: ``dear`` schedule with ``bucket_cap_mb`` fusion runs instead of a plan that depends on measured times
        self.timing_free = timing_free_reason(config, world_size)
        if self.timing_free:
            info("pipedap: torch.use_deterministic_algorithms is on (Trainer(deterministic=True)) and "
                 f"{self.timing_free}, "
                 f"so which schedule runs must not depend on timing: schedule {config.schedule!r} runs as the fixed "
                 f"'dear' schedule with bucket_cap_mb={config.bucket_cap_mb:g} fusion (no profiling, trials or "
                 "re-plans); two identical runs then give identical bits")
        self.controller = Controller(RunEffects(self), planned=config.planned and not self.timing_free,
                                     warmup_steps=config.warmup_steps,
                                     profile_steps=config.profile_steps, trial_steps=config.trial_steps,
                                     trial_rounds=config.trial_rounds, trial_window_s=config.trial_window_s,
                                     replan_every=config.replan_every, replan_margin=config.replan_margin,
                                     max_replans=config.max_replans, run_noun=run_noun,
                                     prefer_margin=config.torch_ddp_margin, startup_budget=config.startup_budget,
                                     asked=config.schedule)
        self.planning = Planning(config, comm, device, world_size, rank, measured, info, warn, job=job_label(module))
        info(f"pipedap: {config.what_runs()}")
        #: the fit's plan cache (a remembered plan after the trace; a finished selection remembered)
        self.plan_cache = PlanCache(config, rank, info, warn)
        #: ``(nodes, processes per node)`` (the plan cache's key)
        self.layout: tuple[int, int] = layout or (1, world_size)
        for note in config.ignored_options():  # (once per fit: options that do not apply are not silent)
            info(note)
        self.flags, self.probe = StepFlags(), ProfileProbe(device)
        self.trainables = Trainables(ctx)
        self._note_dense(self.trainables.params)
        self.heartbeat: Optional[C.Heartbeat] = None
        self.hooks = ModelHooks(module)
        #: the ``nonfinite`` check of this fit (off under an fp16 grad scaler: :meth:`leave_nonfinite_to_scaler`)
        self.nonfinite = NonFiniteCheck(config.nonfinite, self.trainables.name_of, warn, config.wire_dtype,
                                        lambda b: self.engine is not None and self.engine.schedule.is_wire16(b))
        self.nonfinite.step_of = ctx.step_of
        #: the compression helper for the whole fit (started now, given a layout per final schedule)
        self.pipe = None
        if config.compression:
            t0 = time.perf_counter()
            self.pipe = start_compression_helper(config, device, rank)
            self.controller.account({"helper_start": time.perf_counter() - t0})
        timeline_sink = Timeline(records, timeline)
        self.slot = EngineSlot(ctx, self.trainables.tset, self.hooks, self.nonfinite, timeline_sink, counts, resume,
                               lambda: self.controller.phase, self.describe_step,
                               lambda: self.heartbeat.describe if self.heartbeat is not None else None, self.pipe)
        self.stall = DDPStall(ctx, self.slot, lambda: self.trainables.params, self.trainables.name_of)
        self.backward = BackwardSync(ctx, self.slot, self.flags, self.probe, self.trainables, self.nonfinite,
                                     timeline_sink, lambda: self.controller.phase)
        self.forward = StepForward(ctx, self.slot, self.flags, self.probe, self.planning, self.controller,
                                   self.nonfinite)

    def _note_dense(self, dense: list[Tensor]) -> None:
        # (nothing to plan without a dense bucket; nothing timing-dependent under deterministic=True where candidates
        # round differently)
        self.controller.planned = self.ctx.config.planned and not self.timing_free and bool(dense)

    def start_heartbeat(self, on_stale: Callable[[str], None]) -> None:
        """Liveness of the peers (:class:`~lightning_pipedap.engine.collectives.Heartbeat`) with the
        communication timeout: errors name the rank that does not answer, ``on_stale`` ends the wait that
        nothing else bounds."""
        self.heartbeat = C.Heartbeat(self.ctx.config.wait_timeout_s, on_stale=on_stale, context=self.describe_step)

    def describe_step(self) -> str:
        """``"phase run, engine round 12"``: where this rank is, for error messages."""
        return (f"phase {self.controller.phase.value}, engine round "
                f"{self.engine.iteration if self.engine is not None else 0}")

    # ------------------------------------------------------------------ what the strategy and the effects call
    def install_hooks(self, on_grad: Callable[[Tensor], None], on_forward: Callable[..., Any]) -> None:
        """Gradient hooks on the trainable parameters and forward pre-hooks on the eager modules."""
        self.hooks.install(self.params, on_grad, on_forward)

    def enable_handover(self, set_model: Callable[[torch.nn.Module], None]) -> None:
        """Allow the ``torch_ddp`` candidate: ``set_model(m)`` makes ``m`` what the strategy runs."""
        self.slot.allow_handover(set_model, (lambda: self.flags.buffers_due, self.flags.set_buffers_due))

    @property
    def handed_over(self) -> bool:
        """Whether DDP's reducer synchronises the gradients now (the ``torch_ddp`` candidate)."""
        return self.handover is not None and self.handover.active

    @property
    def updates_pending(self) -> bool:
        """Whether a deferred update has not been applied yet."""
        return self.slot.updates_pending

    def after_ddp_backward(self) -> None:
        """After a backward under DDP's reducer (:meth:`.ddp_stall.DDPStall.after_backward`; raises there)."""
        self.stall.after_backward()

    def stalled_elsewhere(self) -> Optional[str]:
        """Why DDP's backward failed here when another rank stalled, or None (:meth:`.ddp_stall.DDPStall.elsewhere`)."""
        return self.stall.elsewhere()

    def remember_trainable_set(self) -> None:
        """The current trainable set and param groups are the reference of :meth:`retrain_if_changed`."""
        self.trainables.remember()

    def retrain_if_changed(self) -> None:
        """At a step's start: if parameters were (un)frozen or a param group added, rebuild buckets and plan.

        Every rank checks the same thing at the same step; the new trainable set is compared across
        ranks. Pending updates are applied first; training then traces, profiles and plans again as at
        the start (sync steps), and every param group is stepped.
        """
        if not self.trainables.changed():
            return
        self.flush()
        before = len(self.params)
        self._note_dense(self.trainables.collect())
        self.hooks.add_params(self.params)
        self.probe.drop()
        self.flags.trace_over(still_tracing=False)
        self.controller.restart()
        self.install_warmup()
        self.info(f"pipedap: the trainable parameters or the optimizer's param groups changed ({before} -> "
                  f"{len(self.params)} trainable tensors): buckets rebuilt, tracing and planning again")

    def wrap_train(self, module: torch.nn.Module, flush: Callable[[], None]) -> None:
        """Apply pending updates before ``module.train(mode)`` runs (it may read weights: LoRA-style merges)."""

        def before(m: torch.nn.Module) -> None:
            if self.updates_pending:
                self.say(f"train:{type(m).__name__}", f"pipedap: {type(m).__name__}.train() can read its weights; "
                         "pending updates are applied before it")
                flush()

        self.hooks.wrap_train(module, before)

    def builtin(self, order: list[int], name: str, compress_all: bool = False, wire16_all: bool = False) -> Schedule:
        """The fixed schedule ``name`` over the trainable parameters in ``order``."""
        params = [self.params[i] for i in order]
        return builtin_schedule(name, [p.numel() * p.element_size() for p in params],
                                int(self.ctx.config.bucket_cap_mb * 2**20), [(p.dtype, p.device) for p in params],
                                compress_all=compress_all, wire16_all=wire16_all)

    def install(self, order: list[int], schedule: Schedule, owners: Optional[list[Optional[torch.nn.Module]]],
                final: bool = False) -> None:
        """Replace the engine: the trainable parameters in ``order``, ``schedule`` over their indices, triggers
        from ``owners`` (:meth:`.engine_slot.EngineSlot.install`)."""
        self.slot.install([self.params[i] for i in order], schedule, owners, final)

    def install_warmup(self) -> None:
        """Registration order, one all-reduce per bucket (WFBP), sync mode."""
        order = list(range(len(self.params)))
        self.install(order, self.builtin(order, "allreduce"), owners=None)

    def flush(self) -> None:
        """Apply every pending update."""
        self.slot.flush()

    def take_trace(self) -> Optional[ConsumerTrace]:
        """The consumer trace of the trace step (None: none taken); forgotten here."""
        return self.forward.take_trace()

    def publish_predictions(self, predictions: dict[str, dict[str, float]]) -> None:
        """Rank 0's predictions of the planned candidates, for the controller's results."""
        self.controller.predictions = predictions

    def local_gradients(self) -> AbstractContextManager:
        """Accumulation micro-batches inside: gradients stay local, no communication."""
        return self.flags.local_gradients()

    def no_buffer_sync_next(self) -> None:
        """As DDP: a no-grad forward (validation) turns the next buffer broadcast off."""
        self.flags.set_buffers_due(False)

    def no_update_time(self) -> None:
        """This step's update is not timed separately (it runs in sync mode, or inside the step)."""
        self.probe.no_update_time()

    def leave_nonfinite_to_scaler(self) -> None:
        """An fp16 grad scaler skips steps with non-finite gradients itself: the ``nonfinite`` check is off."""
        self.nonfinite.enabled = False

    def stop_after_failure(self, word: str) -> None:
        """After a failure on this rank: tell the peers (``word``: the heartbeat's note) and stop the communication
        worker without waiting."""
        if self.heartbeat is not None:
            self.heartbeat.stop(word)
        if self.engine is not None:
            self.engine.close(abort=True)

    # ------------------------------------------------------------------ hooks' reactions and one step
    def grad_ready(self, p: Tensor) -> None:
        self.backward.grad_ready(p)

    def module_forward(self, module: torch.nn.Module) -> None:
        self.forward.at_module(module)

    def training_step(self, call: Callable[[], Any]) -> Any:
        """Run Lightning's ``training_step`` (``call``): trace it, guard it or just time it."""
        return self.forward.training_step(call)

    def plain_forward(self, call: Callable[[], Any]) -> Any:
        """Run a forward that is not a training step (``call``) with DDP's buffer rule only."""
        return self.forward.plain_forward(call)

    def before_backward(self) -> None:
        self.backward.start()

    def finish_backward(self) -> None:
        """End of backward (:meth:`.backward.BackwardSync.finish`)."""
        self.backward.finish()

    def after_sync_step(self) -> None:
        self.probe.sync_device()
        self.controller.after_sync_step(time.perf_counter())
        # the next profiled step's pre_gap (host work between steps) starts after the controller's work: a
        # transition's α-β and contention benchmarks, planning and engine installs are not per-step work
        self.probe.step_ended()
        self.flags.trace_over(still_tracing=self.controller.phase is Phase.TRACE)

    # ------------------------------------------------------------------ manual optimization: one step per training_step
    def manual_step_start(self) -> None:
        """Manual optimization: a ``training_step`` starts. Its forward segments, backward passes and optimizer
        steps (several with a GAN) are one step of the run-time: traced, profiled and timed as a whole, and
        schedules change only between two of them (here, on every rank alike)."""
        self.retrain_if_changed()
        if self.controller.phase.deferrable:
            self.controller.at_step_start()  # a final schedule runs: time the step, switch candidates when due

    def manual_step_end(self) -> None:
        """Manual optimization: the ``training_step`` returned; the step ends (the controller advances). The
        optimizer steps ran inside it, in its profiled forward time: no separate update time is measured."""
        self.probe.no_update_time()
        self.after_sync_step()

    def close(self, abort: bool = False) -> None:
        """Close the engine (or leave DDP's reducer), remove the hooks and the ``train()`` wrappers; say so when
        the fit ended before measured plan selection chose a candidate."""
        note = None if abort else self.controller.unfinished_trial()
        if note:
            self.info(note)
        self.slot.close(abort)
        if self.sparse is not None and not abort:
            C.destroy_comm_group(self.sparse.comm)
        if self.heartbeat is not None:
            self.heartbeat.stop("failed" if abort else "left")
        if self.pipe is not None:
            self.pipe.close()
