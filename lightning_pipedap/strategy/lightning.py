"""``PipeDAPStrategy``: the Lightning glue around the run-time.

Every method here is a Lightning hook or a public attribute; each delegates to the
:class:`~lightning_pipedap.strategy.runtime.Runtime` of the current fit (engine, deferred updates,
controller). The backward hooks (:class:`~lightning_pipedap.strategy.lightning_backward.BackwardHooks`), the flush
points and the checkpoint hooks (:mod:`~lightning_pipedap.strategy.lightning_state`) are mixins of the strategy.
Life of one training step ``t`` in deferred mode (phases TRIAL and RUN)::

    optimizer_step(t) ─ closure ─ training_step: root buckets of update t-1, then forward pre-hooks apply
                                  the others at their first consumer (each waits for its all-gather)
                                ─ backward: leftovers of t-1, engine.begin_iteration(); post-accumulate-grad
                                  hooks fill buckets, the worker reduce-scatters them as they complete;
                                  engine.finish_backward() before on_after_backward
                      ─ record update t as pending (hyper-parameters and clip request snapshotted)

Warm-up and profiling steps, manual optimization, several optimizers, closure-based optimizers,
fp16 with a grad scaler, user hooks that read ``.grad`` and models with sparse gradients
(``nn.Embedding(sparse=True)``, reduced as DDP does: :mod:`~lightning_pipedap.engine.sparse`) use *sync mode*:
the same engine, but
backward waits for every bucket and writes the averaged gradients into ``.grad``, and the real
optimizer step runs as with DDP. Under manual optimization the run-time's step is the whole
``training_step`` (its backward passes and ``optimizer.step()`` calls inside): the controller advances
when it returns, and candidates switch when the next one starts.
"""

from __future__ import annotations

import math

from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

import lightning_pipedap.engine.collectives as C
import lightning_pipedap.strategy.messages as M
from lightning_pipedap import compat
from lightning_pipedap.engine.threads import lower_current_thread_priority
from lightning_pipedap.engine.update import PER_PARAMETER_OPTIMIZERS
from lightning_pipedap.probe.consumers import eager_modules
from lightning_pipedap.strategy.config import (CompressionOptions, DeferUpdate, PipeDAPConfig, PlanningOptions,
                                               SafetyOptions, ScheduleOptions, TrialOptions, WireDtype, build_config)
from lightning_pipedap.strategy.deferred import intercept_clipping
from lightning_pipedap.strategy.numerics import skippable_step
from lightning_pipedap.strategy.observers import ObservationFlush
from lightning_pipedap.strategy.failure import CollectivesOffAfterFailure, exit_on_lost_peer, reap_children
from lightning_pipedap.strategy.failure_state import SettleAfterFailure
from lightning_pipedap.strategy.lightning_backward import BackwardHooks
from lightning_pipedap.strategy.lightning_reads import trainer_of
from lightning_pipedap.strategy.lightning_state import CheckpointHooks, FlushPoints
from lightning_pipedap.strategy.results import RunResults
from lightning_pipedap.strategy.refusals import (group_timeout, refuse_kwargs, refuse_self_communicating,
                                                 register_names)
from lightning_pipedap.strategy.resume import ResumeState, install_plan
from lightning_pipedap.strategy.sharding import resolve_shard_mode, sharded_sync
from lightning_pipedap.strategy.uneven import agreed_total_steps


class PipeDAPStrategy(BackwardHooks, FlushPoints, CheckpointHooks, RunResults, CollectivesOffAfterFailure,
                      SettleAfterFailure, DDPStrategy):
    """Data-parallel training with scheduled, decoupled reduce-scatter / all-gather gradient sync.

    Each gradient bucket is reduce-scattered during backward and all-gathered later (for example
    right after backward, in forward order, with ``"dear"``), and its optimizer update is
    applied in the forward pre-hook of the module that first uses it in the next iteration, so
    communication overlaps both backward and forward (DeAR, Zhang et al., ICDCS 2023; PipeDAP,
    TETC 2025). Updates equal DDP's (tested to 1e-6 in fp32).

    Args:
        config: every option, grouped (:class:`~lightning_pipedap.strategy.config.PipeDAPConfig`, each option
            documented there and in docs/OPTIONS.md); None = the defaults. The keyword options below and in
            ``**options`` are applied over it (a keyword left at its default keeps ``config``'s value).
        schedule, bucket_cap_mb, defer_update, wire_dtype, gradient_as_bucket_view, shard_optimizer, plan_trials,
            startup_budget, plan_cache, find_unused_parameters, compression, wait_timeout_s: the options most users
            touch (types and defaults are those of their ``PipeDAPConfig`` fields), e.g. ``schedule`` (``"optimal"``
            measures candidates and keeps the fastest; a named planner or ``"dear"``/``"allreduce"`` is what runs),
            ``bucket_cap_mb`` (fusion cap, MiB), ``defer_update`` (``"auto"``, True, False), ``wire_dtype``
            (``"fp32"``, ``"fp16"``, ``"bf16"``), ``shard_optimizer`` (each rank steps its reduce-scatter shard:
            ZeRO-2), ``compression`` (None or a compressor name), ``wait_timeout_s`` (seconds).
        **options: any other option of ``PipeDAPConfig`` by name (``torch_ddp_margin=0.05``, ``nonfinite="raise"``,
            ``compression_kwargs={"rank": 4}``, ...); every option is readable as an attribute of the strategy
            (``strategy.bucket_cap_mb``) and of :attr:`config`.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend, timeout, start_method: as for Lightning's ``DDPStrategy``; ``timeout``
            bounds the default group's collectives (Lightning's barriers and broadcasts): a
            ``datetime.timedelta`` or a number of seconds (converted), default ``wait_timeout_s``
            (``start_method="spawn"`` is what the ``"pipedap_spawn"`` name selects).

    Raises:
        ValueError: unknown ``schedule``, non-positive ``bucket_cap_mb``/``ring_chunk_mb``/
            ``wait_timeout_s``, ``warmup_steps < 1``, ``defer_update`` not ``"auto"``/True/False,
            ``nonfinite`` not one of its choices, ``check_params_every_n_steps`` not None or >= 1; at
            set-up: a model without trainable parameters, parameters or strategy options
            (schedule, compression method/kwargs/mode, ...) that differ between ranks (on every rank,
            naming the first difference), ``sync_batchnorm=True`` / SyncBatchNorm on CPU, sparse embeddings
            (``nn.Embedding(sparse=True)``: supported, reduced as DDP does) with ``compression`` or a 16-bit
            ``wire_dtype`` (the parameter is named); a ``timeout`` that is not positive.
        NonFiniteGradientError: ``nonfinite="raise"`` and a step's averaged gradients hold NaN/inf
            (every rank, naming the step, bucket and first parameter).
        ParameterDivergenceError: ``check_params_every_n_steps`` found a parameter that differs between
            ranks (every rank, naming it and the ranks).
        RuntimeError: during training, when a forward read a parameter while its update was
            pending (a data-dependent path the trace and the guard steps did not see); the message
            names the parameter.
        TypeError: an unknown keyword argument or a DDP-only one (``ddp_comm_hook``, ``static_graph``, ...),
            naming the valid ones; a ``config`` that is not a ``PipeDAPConfig``; a ``timeout`` that is neither a
            ``timedelta`` nor a number of seconds.
    """

    strategy_name = "pipedap"

    def __init__(
        self,
        config: Optional[PipeDAPConfig] = None,
        *,
        schedule: str = ScheduleOptions.schedule,
        bucket_cap_mb: float = ScheduleOptions.bucket_cap_mb,
        defer_update: DeferUpdate = ScheduleOptions.defer_update,
        wire_dtype: WireDtype = ScheduleOptions.wire_dtype,
        gradient_as_bucket_view: bool = ScheduleOptions.gradient_as_bucket_view,
        shard_optimizer: Union[bool, str] = ScheduleOptions.shard_optimizer,
        plan_trials: Optional[int] = TrialOptions.plan_trials,
        startup_budget: Optional[float] = TrialOptions.startup_budget,
        plan_cache: Union[bool, str] = PlanningOptions.plan_cache,
        find_unused_parameters: Optional[bool] = TrialOptions.find_unused_parameters,
        compression: Optional[str] = CompressionOptions.compression,
        wait_timeout_s: float = SafetyOptions.wait_timeout_s,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[timedelta, float]] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **options: Any,
    ) -> None:
        unknown = sorted(set(options) - set(PipeDAPConfig.option_names()))
        if unknown:
            refuse_kwargs(type(self).__name__, PipeDAPStrategy.__init__, unknown,
                          more_valid=PipeDAPConfig.option_names())
        common = dict(schedule=schedule, bucket_cap_mb=bucket_cap_mb, defer_update=defer_update, wire_dtype=wire_dtype,
                      gradient_as_bucket_view=gradient_as_bucket_view, shard_optimizer=shard_optimizer,
                      plan_trials=plan_trials,
                      startup_budget=startup_budget, plan_cache=plan_cache,
                      find_unused_parameters=find_unused_parameters, compression=compression,
                      wait_timeout_s=wait_timeout_s)
        self._init_run_state(build_config(config, common, options, type(self).__name__))
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=group_timeout(type(self).__name__, timeout, self.config.wait_timeout_s),
                         start_method=start_method)
        self._resume = ResumeState()
        self._aborted = False
        self._orig_clip: Optional[Callable] = None
        self._restore_priority: Optional[Callable[[], bool]] = None
        self._flush_callback: Optional[ObservationFlush] = None

    # ------------------------------------------------------------------ options and results
    @property
    def schedule_name(self) -> str:
        """The configured schedule (``config.schedule``)."""
        return self.config.schedule

    @override
    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())  # Lightning's Strategy drops its optimizer wrappers
        for k in ("_rt", "_last", "_comm", "_orig_clip", "_flush_callback"):
            state[k] = None
        return state

    # ------------------------------------------------------------------ registration
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: compat.StrategyRegistry) -> None:
        """Register ``"pipedap"`` (popen launcher) and ``"pipedap_spawn"`` (spawn launcher); idempotent."""
        register_names(strategy_registry, cls, "PipeDAP: scheduled decoupled reduce-scatter/all-gather gradient "
                                               "sync (DeAR/PipeDAP)")

    # ------------------------------------------------------------------ set-up

    @override
    def setup(self, trainer: Any) -> None:
        if compat.layer_sync(self) is not None and self.root_device.type == "cpu":
            raise ValueError("pipedap: Trainer(sync_batchnorm=True) needs CUDA devices (torch's SyncBatchNorm has no "
                             "CPU implementation); remove sync_batchnorm=True on CPU, or train on GPUs")
        super().setup(trainer)
        M.use_progress_bar(getattr(trainer, "progress_bar_callback", None))  # (messages print around the bar)
        if trainer.state.fn != TrainerFn.FITTING or self._rt is None:  # (one process: no run-time, see configure_ddp)
            return
        refuse_self_communicating(self.optimizers)
        lm = self.lightning_module
        if self.config.shard_optimizer:
            resolve_shard_mode(self)
        if not lm.automatic_optimization or len(self.optimizers) != 1:
            M.info("pipedap: manual optimization or several optimizers -> sync mode (reduce in backward); each "
                   "training_step is one step of the start-up (traced, profiled and measured whole)")
        self._rt.remember_trainable_set()  # (the optimizers exist now)
        if getattr(self.precision_plugin, "scaler", None) is not None:
            self._rt.leave_nonfinite_to_scaler()  # (scaled fp16 gradients overflow by design; the scaler skips)
            if self.config.nonfinite in ("raise", "skip"):
                M.info(f"pipedap: nonfinite={self.config.nonfinite!r} is not applied under the fp16 grad scaler, "
                       "which skips steps with non-finite gradients itself (as under DDP)")
        self._flush_callback = ObservationFlush(self)
        trainer.callbacks.insert(0, self._flush_callback)
        self._flush_callback.find(trainer)
        self._orig_clip = intercept_clipping(self.precision_plugin)

    @override
    def configure_ddp(self) -> None:
        """Replace DDP wrapping: broadcast rank 0's states, build the run-time (buckets, engine), install hooks.

        With one process (``devices=1``, one node) there is nothing to synchronise: no run-time, no engine, no plan
        or trials; the model is trained unwrapped, which is what DDP with one process computes (bit for bit), and
        one log line says so.

        Raises:
            ValueError: no trainable parameter, parameters that differ between ranks, a SyncBatchNorm module on
                CPU, a sparse embedding with compression or a 16-bit wire format (its name is given).
        """
        model = self.model
        assert isinstance(model, torch.nn.Module)
        if self.single_process:  # nothing to synchronise: the model runs unwrapped, as a single device
            self.note_single_process()
            return
        rt = self._start_runtime(model, lambda: self.optimizers, self._resume, exit_on_lost_peer,
                                 step_of=lambda: self.lightning_module.global_step)
        for m in eager_modules(model):
            if type(m).train is not torch.nn.Module.train and "train" not in m.__dict__:
                rt.wrap_train(m, self.flush)  # a module that reads its weights in train()/eval() (LoRA merge)
        rt.enable_handover(self._set_model)
        rt.install_warmup()
        if self.config.train_thread_nice and self.root_device.type == "cpu" and self._restore_priority is None:
            self._restore_priority = lower_current_thread_priority(self.config.train_thread_nice)
        install_plan(rt)  # a checkpoint's final schedule, when it fits this run: no re-trace, no re-profile

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """Lightning's batch transfer, after pending updates when a batch hook of the user's can read weights."""
        if self._flush_callback is not None and self.lightning_module is not None:
            trainer = trainer_of(self.lightning_module)
            if trainer is not None:
                self._flush_callback.before_batch_transfer(trainer)
        return super().batch_to_device(batch, device, dataloader_idx)

    def _set_model(self, model: torch.nn.Module) -> None:
        """The ``torch_ddp`` candidate: ``model`` (DDP's wrapper, or the module again) is what Lightning runs."""
        self.model = model

    @override
    def on_train_start(self) -> None:
        """The start-up budget's reference: the optimizer steps this fit will run (Lightning's estimate, less those a
        resumed checkpoint already ran; unknown, e.g. ``max_epochs=-1``: no budget)."""
        super().on_train_start()
        if self._rt is not None:
            trainer = self.lightning_module.trainer
            total = trainer.estimated_stepping_batches
            self._rt.controller.set_total_steps(agreed_total_steps(total - trainer.global_step if math.isfinite(total)
                                                                   else None, bool(self._rt.slot.shard_mode)))

    # ------------------------------------------------------------------ hooks on parameters and modules
    def _on_grad_ready(self, p: Tensor) -> None:
        if self._rt is not None:
            self._rt.grad_ready(p)

    def _on_module_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._rt is not None:
            self._rt.module_forward(module)

    # ------------------------------------------------------------------ training step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        rt = self._rt
        manual = rt is not None and _manual(self)
        if manual:
            rt.manual_step_start()  # (the step of the run-time is the training_step: it may step optimizers)
        if rt is None or rt.handed_over:
            out = super().training_step(*args, **kwargs)  # (handed over: through DDP's wrapper, as DDPStrategy)
        else:
            out = rt.training_step(lambda: super(PipeDAPStrategy, self).training_step(*args, **kwargs))
        if manual:
            rt.manual_step_end()
        return out

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._rt is not None:
            self._rt.no_buffer_sync_next()  # as DDP: a no-grad forward turns the next buffer sync off
        return super().validation_step(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: Optional[Union[Any, torch.nn.Module]] = None, **kwargs: Any) -> Any:
        rt = self._rt
        manual = rt is not None and _manual(self)  # (the training_step is the run-time's step: this is one of its)
        if rt is not None and not manual:
            rt.retrain_if_changed()
            if rt.controller.phase.deferrable:
                rt.controller.at_step_start()  # a final schedule runs: time the step, switch candidates
        if rt is None or not _can_defer(self, optimizer):
            if rt is not None:
                rt.no_update_time()
                if rt.slot.engine_sharded and rt.controller.phase.deferrable and not rt.handed_over:
                    why = ("manual optimization or several optimizers" if _manual(self) or len(self.optimizers) > 1
                           else "a hook reads the gradients: defer_update='auto' keeps such steps in sync mode; "
                           "defer_update=True defers them")
                    rt.ctx.say("shard-sync", f"pipedap: shard_optimizer: steps run in sync mode ({why}): still "
                               "sharded, with one more all-gather (of parameters) per bucket")
            skip = rt is not None and rt.nonfinite.decides_first
            shard = rt is not None and bool(rt.slot.shard_mode)
            with sharded_sync(rt.slot, optimizer) if shard else nullcontext(), \
                    skippable_step(optimizer, rt.nonfinite) if skip else nullcontext():
                out = super().optimizer_step(optimizer, closure, model, **kwargs)
            if rt is not None:
                if rt.handed_over:
                    rt.nonfinite.check_params_under_ddp(rt.params)
                if not manual:
                    rt.after_sync_step()
            return out
        lm = self.lightning_module
        out = rt.deferred.run_step(optimizer, lambda stand_in: self.precision_plugin.optimizer_step(
            stand_in, model=model or lm, closure=closure, **kwargs), lambda: lm.global_step)
        self.mark_deferred_step()  # (a failure before this update lands can set the counters back to here)
        return out

    # ------------------------------------------------------------------ teardown
    @override
    def on_exception(self, exception: BaseException) -> None:
        self.abort(exception)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        rt, comm, aborted = self._rt, self._comm, self._aborted
        if rt is not None:
            try:
                if not aborted:
                    self.flush()
                    self.check_final_parameters(self.lightning_module)  # (NaN/inf at the end: exit code 3)
            finally:
                rt.close(abort=aborted)
        trainer = trainer_of(self.lightning_module)
        if trainer is not None and self._flush_callback in trainer.callbacks:
            trainer.callbacks.remove(self._flush_callback)
        if self._orig_clip is not None:
            self.precision_plugin.clip_gradients = self._orig_clip
        if self._restore_priority is not None:
            self._restore_priority()
        M.use_progress_bar(None)
        self._last, self._rt, self._comm, self._aborted = rt or self._last, None, None, False
        self._orig_clip, self._restore_priority = None, None
        self._flush_callback = None
        if comm is not None and not aborted:
            C.destroy_comm_group(comm)
        if aborted and self.local_rank == 0:
            reap_children(self.launcher)
        super().teardown()


def _manual(strategy: PipeDAPStrategy) -> bool:
    """Whether the LightningModule uses manual optimization (its ``training_step`` steps the optimizers)."""
    lm = strategy.lightning_module
    return lm is not None and not lm.automatic_optimization


def _can_defer(strategy: PipeDAPStrategy, optimizer: Optimizer) -> bool:
    """Whether this optimizer step may defer its update (otherwise it runs in sync mode, as with DDP)."""
    cfg, rt, flush = strategy.config, strategy._rt, strategy._flush_callback
    grad_hooks = flush is None or bool(flush.observers.grads)  # (no callback: set-up did not run for fitting)
    return (
        (cfg.defer_update is True or cfg.defer_update == "auto" and not grad_hooks)
        and rt.controller.phase.deferrable
        and not rt.handed_over
        and strategy.lightning_module.automatic_optimization
        and len(strategy.optimizers) == 1
        and isinstance(optimizer, PER_PARAMETER_OPTIMIZERS + cfg.deferrable_optimizers)
        and getattr(strategy.precision_plugin, "scaler", None) is None
        and not rt.has_sparse  # (sparse gradients are reduced and stepped in the step itself, as with DDP)
    )


PipeDAPStrategy.register_strategies(StrategyRegistry)
