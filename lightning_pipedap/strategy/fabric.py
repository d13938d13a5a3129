"""``PipeDAPFabricStrategy``: the Lightning Fabric glue around the same run-time as the Trainer strategy.

``Fabric(strategy="pipedap")`` trains with the engine, planner, schedules and controller of
:class:`~lightning_pipedap.strategy.lightning.PipeDAPStrategy` (one
:class:`~lightning_pipedap.strategy.runtime.Runtime` per set-up model); only the hooks differ, because
Fabric has no training loop of its own. Life of one step in Fabric user code::

    out = model(x)                 first grad-enabled forward after a step: trainable set checked (rebuild if
                                   (un)frozen), buffers broadcast by DDP's rule, traced / profiled by phase
    fabric.backward(loss)          engine.begin_iteration(); post-accumulate-grad hooks hand each parameter's
                                   gradient to the engine, the worker runs the schedule's RS/AG (or AR) as
                                   buckets complete; at the end of autograd's pass every bucket is waited for
                                   and ``.grad`` holds the averaged gradients (DDP's point)
    fabric.clip_gradients(...)     Fabric's own clipping, on the averaged ``.grad``
    optimizer.step()               the real optimizer step; then the controller advances
                                   (trace -> profile -> trial -> run, the same transitions as under the Trainer)

Only the *sync* mode exists here: in Fabric the user's code can read parameters, ``.grad`` and the
optimizer state anywhere between steps, so an update may not be deferred into the next forward.
"""

from __future__ import annotations

import atexit
import sys
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Generator, Literal, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies.ddp import DDPStrategy
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

import lightning_pipedap.engine.collectives as C
from lightning_pipedap import compat
from lightning_pipedap.strategy.config import (DeferUpdate, PipeDAPConfig, PlanningOptions, SafetyOptions,
                                               ScheduleOptions, TrialOptions, WireDtype, build_config)
from lightning_pipedap.strategy.failure import exit_on_lost_peer
from lightning_pipedap.strategy.refusals import group_timeout, refuse_kwargs, refuse_self_communicating, register_names
from lightning_pipedap.strategy.results import RunResults
from lightning_pipedap.strategy.resume import ResumeState

#: ``defer_update`` values the Fabric strategy accepts ("auto" resolves to sync mode in Fabric)
FABRIC_DEFER_UPDATE = ("auto", False)


class PipeDAPFabricStrategy(RunResults, DDPStrategy):
    """Lightning Fabric strategy: DDP semantics, with gradients reduced by PipeDAP's scheduled RS/AG engine.

    ``Fabric(strategy="pipedap", accelerator=..., devices=N)`` (after ``import lightning_pipedap``), or an
    instance ``Fabric(strategy=PipeDAPFabricStrategy(schedule="dear"))``. The same engine, planners,
    schedules and phase controller as the Trainer's :class:`~lightning_pipedap.PipeDAPStrategy`.

    Supported (every parameter, ``.grad`` and optimizer state user code can see equals Fabric's
    ``"ddp"``; tested to 1e-6 in ``tests/test_fabric.py``):

    - **sync mode only**: each bucket is reduce-scattered and all-gathered (or all-reduced, by the
      schedule) while backward runs, and ``fabric.backward`` returns with the averaged gradients in
      ``.grad``; ``optimizer.step()`` is the optimizer's own. ``defer_update`` must be ``False`` or
      ``"auto"`` (which means sync mode here).
    - every schedule: the fixed ``"dear"`` / ``"allreduce"`` and the planned ones (trace, profile,
      trials, re-plan, as under the Trainer; steps are counted by ``optimizer.step()`` calls).
    - ``fabric.setup(model, optimizer, ...)`` or ``setup_module`` + ``setup_optimizers``; one model per
      strategy; any optimizer that does not communicate by itself (several are fine).
    - ``fabric.no_backward_sync(model, enabled=...)``: micro-batches keep gradients local, the last one
      reduces the accumulated gradients (as DDP's ``no_sync``).
    - ``fabric.clip_gradients`` (norm and value): Fabric's own, on the averaged gradients.
    - ``fabric.save`` / ``fabric.load``: plain state dicts without a ``module.`` prefix, interchangeable with
      ``"ddp"`` and single-device checkpoints.
    - BatchNorm buffers: broadcast from rank 0 before a forward with DDP's rule.

    Not supported (refused): ``defer_update=True``, ``compression``, a second model on the same
    strategy, self-communicating optimizers (ZeRO, post-local SGD), and the options of the Trainer
    strategy that only deferred updates use (``deferrable_optimizers``). ``torch.compile`` of the set-up
    model and precisions other than ``"32-true"`` are not tested.

    Args:
        config: the options, grouped (:class:`~lightning_pipedap.strategy.config.PipeDAPConfig`); None = the
            defaults. The keyword options are applied over it (a keyword left at its default keeps ``config``'s
            value). It may not set the Trainer-only options below.
        schedule, bucket_cap_mb, wire_dtype, gradient_as_bucket_view, plan_trials, plan_cache, wait_timeout_s: as for
            :class:`~lightning_pipedap.PipeDAPStrategy` (documented in
            :class:`~lightning_pipedap.strategy.config.PipeDAPConfig` and docs/OPTIONS.md).
        defer_update: ``"auto"`` or ``False`` (both: sync mode).
        **options: the other options of ``PipeDAPConfig`` by name (``warmup_steps``, ``ring_chunk_mb``,
            ``profile_steps``, ``cost_model``, ``cost_model_cache``, ``replan_margin``, ``calibrate_cost_model``,
            ``train_thread_nice``, ``replan_every``, ``max_replans``, ``trial_steps``, ``trial_rounds``,
            ``trial_window_s``, ``model_contention``, ``partition_mb``), except the Trainer-only ones (refused,
            each with its reason): ``deferrable_optimizers``, ``compression_kwargs``, ``compression_mode``,
            ``compression_threads``, ``startup_budget``, ``torch_ddp_candidate``, ``torch_ddp_margin``,
            ``find_unused_parameters``, ``nonfinite``, ``check_params_every_n_steps``; ``compression`` must be
            ``None`` (compression is not available under Fabric).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision,
            process_group_backend, timeout, start_method: as for Fabric's ``DDPStrategy``; ``timeout`` of
            the default group: a ``datetime.timedelta`` or a number of seconds (converted), default
            ``wait_timeout_s``; another type is a ``TypeError`` at construction.

    Raises:
        ValueError: an option out of range (see ``PipeDAPConfig``), ``defer_update`` not in
            ``("auto", False)``, ``compression`` not None, a ``config`` that sets a Trainer-only option; at set-up:
            a second model, a model without trainable parameters, models that differ between ranks, SyncBatchNorm
            on CPU, a self-communicating optimizer, a sparse embedding with a 16-bit ``wire_dtype``. Sparse
            embeddings (``nn.Embedding(sparse=True)``) are supported: their gradients are all-reduced as DDP does
            (:mod:`~lightning_pipedap.engine.sparse`).
        TypeError: an unknown keyword argument (DDP-only ones and the Trainer-only options included), naming the
            valid ones; a ``config`` that is not a ``PipeDAPConfig``; ``no_backward_sync`` on a module this strategy
            did not set up.
    """

    RUN_NOUN = "run"

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
        plan_trials: Optional[int] = TrialOptions.plan_trials,
        plan_cache: Union[bool, str] = PlanningOptions.plan_cache,
        wait_timeout_s: float = SafetyOptions.wait_timeout_s,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[timedelta, float]] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **options: Any,
    ) -> None:
        unknown = sorted(k for k in options if k not in PipeDAPConfig.option_names() or k in _TRAINER_ONLY)
        if unknown:
            refuse_kwargs(type(self).__name__, PipeDAPFabricStrategy.__init__, unknown, _TRAINER_ONLY,
                          more_valid=[n for n in PipeDAPConfig.option_names() if n not in _TRAINER_ONLY])
        _refuse_for_fabric(defer_update, options.get("compression"))
        common = dict(schedule=schedule, bucket_cap_mb=bucket_cap_mb, defer_update=defer_update, wire_dtype=wire_dtype,
                      gradient_as_bucket_view=gradient_as_bucket_view, plan_trials=plan_trials, plan_cache=plan_cache,
                      wait_timeout_s=wait_timeout_s)
        self._init_run_state(build_config(config, common, options, type(self).__name__))
        if config is not None:
            _refuse_trainer_only_in(self.config)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision,
                         process_group_backend=process_group_backend,
                         timeout=group_timeout(type(self).__name__, timeout, self.config.wait_timeout_s),
                         start_method=start_method)
        compat.set_backward_sync_control(self, _PipeDAPBackwardSyncControl(self))
        self._optimizers: list[Optimizer] = []
        self._step_open = False  # a grad-enabled forward ran since the last optimizer step
        self._at_exit_registered = False

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: compat.StrategyRegistry) -> None:
        """Register ``"pipedap"`` (popen launcher) and ``"pipedap_spawn"`` (spawn launcher); idempotent."""
        register_names(strategy_registry, cls, "PipeDAP for Fabric: scheduled reduce-scatter/all-gather gradient "
                                               "sync in backward")

    # ------------------------------------------------------------------ set-up
    @override
    def setup_module(self, module: Module) -> Module:
        """Broadcast rank 0's parameters and buffers, build the run-time (buckets, engine), install the hooks.

        With one process (``devices=1``, one node) there is nothing to synchronise: no run-time is built, and the
        wrapper runs forward, backward and the optimizer step as they are (what DDP computes with one process).

        Returns:
            A thin wrapper whose ``forward`` runs ``module``'s through the run-time (what Fabric's
            ``_FabricModule`` calls, as it calls DDP's wrapper); ``.module`` is ``module``.

        Raises:
            ValueError: a second model, no trainable parameter, models that differ between ranks, a
                SyncBatchNorm on CPU, or a sparse embedding with a 16-bit ``wire_dtype`` (named).
        """
        if self._rt is not None:
            raise ValueError(f"PipeDAPFabricStrategy sets up one model; {type(self._rt.module).__name__} is set up "
                             f"already and {type(module).__name__} was passed. Put both in one nn.Module, or use "
                             "strategy='ddp'")
        if self.single_process:  # nothing to synchronise: no run-time; forward, backward and step run as they are
            self.note_single_process()
            return _PipeDAPModule(module, self)
        rt = self._start_runtime(module, lambda: self._optimizers, ResumeState(), self._on_lost_peer)
        rt.install_warmup()
        rt.remember_trainable_set()
        self._step_open = False
        if not self._at_exit_registered:
            atexit.register(self._close_at_exit)
            self._at_exit_registered = True
        return _PipeDAPModule(module, self)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Keep the optimizer (its param groups are part of the trainable set checked every step).

        Raises:
            ValueError: an optimizer that communicates by itself (ZeroRedundancyOptimizer, ...).
        """

        refuse_self_communicating([optimizer])
        self._optimizers.append(optimizer)
        if self._rt is not None:
            self._rt.remember_trainable_set()
        return optimizer

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Union[Any, Tensor]]:
        return super().get_module_state_dict(module.module if isinstance(module, _PipeDAPModule) else module)

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Union[Any, Tensor]],
                               strict: bool = True) -> None:
        super().load_module_state_dict(module.module if isinstance(module, _PipeDAPModule) else module,
                                       state_dict=state_dict, strict=strict)

    # ------------------------------------------------------------------ hooks
    def _on_grad_ready(self, p: Tensor) -> None:
        if self._rt is not None:
            self._rt.grad_ready(p)

    def _on_module_forward(self, module: Module, args: Any) -> None:
        if self._rt is not None:
            self._rt.module_forward(module)

    def _on_lost_peer(self, message: str) -> None:
        """Heartbeat watchdog: end the process only inside a step (a wait on a lost peer); between steps the
        user's code may run alone for long (rank-0 evaluation), and the next collective names the peer."""
        if self._step_open:
            exit_on_lost_peer(message)

    def run_forward(self, call: Callable[[], Any]) -> Any:
        """Run the set-up model's forward (``call``) as a training step when autograd records it, else with
        DDP's buffer rule only (evaluation under ``torch.no_grad``)."""
        rt = self._rt
        if rt is None:
            return call()
        if not torch.is_grad_enabled():
            return rt.plain_forward(call)
        if not self._step_open:  # the first forward of a step (all ranks: same point)
            self._step_open = True
            rt.retrain_if_changed()
            rt.no_update_time()
        return rt.training_step(call)

    @contextmanager
    def blocked_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-batches: gradients stay local (no communication) inside this context."""
        rt = self._rt
        if rt is None:
            yield
            return
        with rt.local_gradients():
            yield

    @override
    def backward(self, tensor: Tensor, module: Optional[Module], *args: Any, **kwargs: Any) -> None:
        """Fabric's backward, with the gradient reduction finished before it returns (``.grad`` averaged)."""
        rt = self._rt
        if rt is not None:
            rt.before_backward()
        self.precision.pre_backward(tensor, module)
        self.precision.backward(tensor, module, *args, **kwargs)
        if rt is not None:
            rt.finish_backward()  # (normally done already when autograd's pass ended)
        self.precision.post_backward(tensor, module)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The optimizer's own step on the averaged gradients; then the phase controller advances."""
        out = super().optimizer_step(optimizer, **kwargs)
        rt = self._rt
        if rt is not None:
            deferrable = rt.controller.phase.deferrable  # (TRIAL / RUN: a final schedule is installed)
            rt.after_sync_step()
            if deferrable:
                rt.controller.at_step_start()  # trials switch candidates, drift checks, on every rank
            self._step_open = False
        return out

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        """Close the engine, remove every hook and the dedicated group (Fabric never calls this itself:
        it runs at interpreter exit, or call ``fabric.strategy.teardown()`` to release the model early)."""
        self._close(abort=False)
        super().teardown()

    def _close(self, abort: bool) -> None:
        rt, comm = self._rt, self._comm
        self._rt, self._comm, self._last = None, None, rt or self._last
        if rt is not None:
            rt.close(abort=abort)
        self._optimizers, self._step_open = [], False
        if comm is not None and not abort:
            C.destroy_comm_group(comm)

    def _close_at_exit(self) -> None:
        if self._rt is None:
            return
        failed = getattr(sys, "last_value", None) is not None or self._rt.engine is None or self._rt.engine.collecting
        self._close(abort=failed)


class _PipeDAPModule(Module):
    """What ``setup_module`` returns: ``forward`` goes through the strategy's run-time, ``.module`` is the
    user's model (Fabric's ``_FabricModule`` keeps that one as its original module)."""

    def __init__(self, module: Module, strategy: PipeDAPFabricStrategy) -> None:
        super().__init__()
        self.module = module
        self._strategy = strategy

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._strategy.run_forward(lambda: self.module(*args, **kwargs))


class _PipeDAPBackwardSyncControl(compat.BackwardSyncControl):
    """``fabric.no_backward_sync``: no communication in the micro-batches it wraps."""

    def __init__(self, strategy: PipeDAPFabricStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """Raises:
            TypeError: ``module`` is not the model this strategy set up."""
        if not enabled:
            return nullcontext()
        if not isinstance(module, _PipeDAPModule):
            raise TypeError(f"fabric.no_backward_sync with strategy 'pipedap' needs the model returned by "
                            f"fabric.setup(...); got {type(module).__name__}")
        return self._strategy.blocked_sync()


_TRAINER_ONLY = {k: "an option of the Trainer strategy PipeDAPStrategy that Fabric's sync mode does not use"
                 for k in ("deferrable_optimizers", "compression_kwargs", "compression_mode", "compression_threads")}
_TRAINER_ONLY["precision_plugin"] = _TRAINER_ONLY["compression_mode"] + " (Fabric's name is 'precision')"
_TRAINER_ONLY.update({k: "an option of the Trainer strategy PipeDAPStrategy: its measured plan selection also tries "
                         "DDP's own reducer (the torch_ddp candidate), which Fabric's does not"
                      for k in ("torch_ddp_candidate", "torch_ddp_margin", "find_unused_parameters")})
_TRAINER_ONLY["shard_optimizer"] = ("an option of the Trainer strategy PipeDAPStrategy: the sharded optimizer step "
                                    "runs in deferred steps, which Fabric's sync mode does not have")
_TRAINER_ONLY["sharded_checkpoint"] = ("an option of the Trainer strategy PipeDAPStrategy: it needs shard_optimizer, "
                                       "which Fabric's sync mode does not run")
_TRAINER_ONLY["startup_budget"] = ("an option of the Trainer strategy PipeDAPStrategy: a fraction of the fit's steps, "
                                   "which the Trainer knows and Fabric does not")
_TRAINER_ONLY.update({k: "an option of the Trainer strategy PipeDAPStrategy, whose own reduction paths it needs; "
                         "Fabric's sync mode checks nothing beyond Fabric's 'ddp'"
                      for k in ("nonfinite", "check_params_every_n_steps")})



def _refuse_for_fabric(defer_update: Any, compression: Any) -> None:
    """Raises:
        ValueError: ``defer_update`` not in :data:`FABRIC_DEFER_UPDATE` or a ``compression`` method (both named)."""
    if defer_update not in FABRIC_DEFER_UPDATE or type(defer_update) is int:
        raise ValueError(f"PipeDAPFabricStrategy: defer_update={defer_update!r} is not supported under Fabric "
                         f"(user code can read parameters anywhere between steps); valid: "
                         f"{', '.join(map(repr, FABRIC_DEFER_UPDATE))} (both: sync mode)")
    if compression is not None:
        raise ValueError(f"PipeDAPFabricStrategy: compression={compression!r} is not supported under Fabric; "
                         "valid: None (use the Trainer strategy PipeDAPStrategy for compression)")


def _refuse_trainer_only_in(config: PipeDAPConfig) -> None:
    """A ``config=`` given to the Fabric strategy: the same refusals as its keywords.

    Raises:
        ValueError: ``defer_update=True``, a compression method, or a Trainer-only option changed from its default
            (named, with the reason).
    """
    _refuse_for_fabric(config.defer_update, config.compression)
    defaults = PipeDAPConfig.defaults()
    for name in sorted(set(_TRAINER_ONLY) & set(PipeDAPConfig.option_names())):
        if getattr(config, name) != defaults[name]:
            raise ValueError(f"PipeDAPFabricStrategy: config sets {name}={getattr(config, name)!r}: "
                             f"{_TRAINER_ONLY[name]}; leave it at its default {defaults[name]!r}")


PipeDAPFabricStrategy.register_strategies(STRATEGY_REGISTRY)
