"""``PipeDAPStrategy``: the Lightning glue around the communication engine.

What this file does, and nothing more: install hooks, hand finished gradients to the engine,
apply bucket updates when their all-gathers land, and flush pending updates at validation,
checkpoint and the end of training. Planning lives in :mod:`lightning_pipedap.schedule` /
:mod:`lightning_pipedap.plan`, communication in :mod:`lightning_pipedap.engine`.

Life of one training step ``t`` in deferred mode (the default after ``warmup_steps``)::

    optimizer_step(t) ─ closure ─ training_step: forward pre-hooks apply update t-1 bucket by bucket
                                  (each waits for its all-gather first)
                                ─ pre_backward: apply leftovers of t-1, engine.begin_iteration()
                                ─ backward: post-accumulate-grad hooks fill buckets; the worker
                                  reduce-scatters them as they complete
                                ─ post_backward: engine.finish_backward()
                      ─ record update t as pending (hyper-parameters and clip request snapshotted)

Warm-up steps, manual optimization, several optimizers, closure-based optimizers and fp16 with a
grad scaler use *sync mode*: the same engine, but ``post_backward`` waits for every bucket and
writes the averaged gradients into ``.grad``, and the real optimizer step runs as with DDP.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Generator, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

import lightning_pipedap.engine.collectives as C
from lightning_pipedap.engine.threads import lower_current_thread_priority
from lightning_pipedap.engine.engine import CommEngine
from lightning_pipedap.engine.update import (
    PER_PARAMETER_OPTIMIZERS,
    BucketOptimizer,
    ClipRequest,
    clip_coefficient,
    shard_sum_of_squares,
    snapshot_hparams,
    write_back_grads,
)
from lightning_pipedap.measure.timeline import OpRecord, as_op_records
from lightning_pipedap.plan import PLANNERS, CostModel, get_planner, load_cost_model
from lightning_pipedap.plan.candidates import trial_candidates
from lightning_pipedap.profile.alpha_beta import measure_cost_model
from lightning_pipedap.observers import Observers, ObservationFlush, find_observers
from lightning_pipedap.profile.consumers import (ConsumerTrace, ModuleStack, consumer_order, eager_modules,
                                                 transform_active)
from lightning_pipedap.profile.recorder import StepRecorder, group_layers, merge_steps
from lightning_pipedap.schedule import BUILTIN_SCHEDULES, Op, OpKind, Schedule, builtin_schedule, expand_layers

log = logging.getLogger(__name__)

_REJECTED_DDP_KWARGS = {
    "ddp_comm_state": "pipedap does its own gradient communication; compression comes with `compression=`",
    "ddp_comm_hook": "pipedap does its own gradient communication; compression comes with `compression=`",
    "ddp_comm_wrapper": "pipedap does its own gradient communication",
    "model_averaging_period": "post-local SGD is a DDP feature; use strategy='ddp'",
    "find_unused_parameters": "not needed: pipedap detects parameters without gradients by itself",
    "static_graph": "not needed: pipedap traces the forward order itself",
    "gradient_as_bucket_view": "pipedap always uses its own flat buckets",
}


#: checkpoint key of the installed final schedule (see ``PipeDAPStrategy.save_checkpoint``)
PLAN_KEY = "pipedap_plan"
PLAN_VERSION = 1

#: where a bucket update was applied (``PipeDAPStrategy.update_counts``)
_UPDATE_PLACES = ("forward", "leftover", "flush", "observe", "guard")

_SELF_COMMUNICATING_OPTIMIZERS = ("ZeroRedundancyOptimizer", "PostLocalSGDOptimizer", "DistributedOptimizer")


# runtime schedule name -> planner name; a planner whose name is a fixed schedule gets "_tuned"
_PLANNED = {(n if n not in BUILTIN_SCHEDULES else f"{n}_tuned"): n for n in PLANNERS}


def valid_schedule_names() -> tuple[str, ...]:
    """Names accepted by ``PipeDAPStrategy(schedule=...)``: built-ins plus registered planners."""
    return tuple(BUILTIN_SCHEDULES) + tuple(_PLANNED.keys())


@dataclass
class _Trial:
    """Measured plan selection in progress: candidate schedules (engine-level) and their timings."""

    schedules: list[Schedule]
    no_overlap_s: list[float]
    starts: list[float] = field(default_factory=list)  # perf_counter at each step start of the current candidate
    measured_s: list[float] = field(default_factory=list)
    gaps_s: list[list[float]] = field(default_factory=list)  # per candidate: every step interval, settling one first


@dataclass
class _Pending:
    """An update that has been computed by communication but not yet applied."""

    hparams: list[dict[str, Any]]
    clip: Optional[ClipRequest]
    remaining: set[int]
    coef: Optional[float] = None


def _outside_compiled(name: str, modules: dict[str, torch.nn.Module]) -> str:
    """The owner to trigger instead of module ``name``: the parent of the outermost ``torch.compile``d
    module around it (hooks of modules inside a compiled region do not run eagerly), else ``name``."""
    parts = name.split(".") if name else []
    for k in range(1, len(parts) + 1):
        if isinstance(modules.get(".".join(parts[:k])), torch._dynamo.eval_frame.OptimizedModule):
            return ".".join(parts[:k - 1])
    return name


class _DeferredStep:
    """Stands in for the optimizer inside Lightning's precision plugin during a deferred step.

    ``step(closure)`` runs the closure (forward, backward, ``on_before_optimizer_step``, clipping)
    and returns its result; the real update is applied later, bucket by bucket. Attribute reads
    (``param_groups``, ``state``, ``defaults``) go to the wrapped optimizer.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self.clip: Optional[ClipRequest] = None

    def step(self, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(f"pipedap: extra optimizer.step arguments {sorted(kwargs)} are not supported in deferred mode")
        return closure()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


class PipeDAPStrategy(DDPStrategy):
    """Data-parallel training with scheduled, decoupled reduce-scatter / all-gather gradient sync.

    Each gradient bucket is reduce-scattered during backward and all-gathered later (for example
    right after backward, in forward order, with ``"dear"``), and its optimizer update is
    applied in the forward pre-hook of the module that first uses it in the next iteration, so
    communication overlaps both backward and forward (DeAR, Zhang et al., ICDCS 2023; PipeDAP,
    TETC 2025). Updates equal DDP's (tested to 1e-6 in fp32).

    Args:
        schedule: op-list planner. Fixed schedules with ``bucket_cap_mb`` fusion, no profiling:
            ``"dear"`` (RS in backward, AG before the next forward) and ``"allreduce"`` (WFBP: one
            all-reduce per bucket in backward). Planned schedules, from a profile measured during
            ``profile_steps`` warm-up steps and the α-β model of the live group: ``"optimal"``,
            ``"pipedap"``, ``"wfbp"``, ``"dear_tuned"`` (DeAR order, planned fusion) and
            ``"no_overlap"`` (:func:`valid_schedule_names` lists all).
        bucket_cap_mb: tensor-fusion cap of the fixed schedules, in MiB (> 0).
        defer_update: ``"auto"`` (default): apply each bucket's update in the next forward, where its
            first consumer (traced op by op) runs, unless user code could see the difference: with
            a gradient hook (``on_after_backward``, ``on_before_optimizer_step``,
            ``configure_gradient_clipping``, ``optimizer_step``, ``on_before_zero_grad``) overridden
            by the LightningModule or a callback, steps run in sync mode; before a between-step hook
            (``on_train_batch_start``/``_end``, ``on_train_epoch_start``/``_end``) that can read
            weights, pending updates are applied and ``.grad`` holds the averaged gradients (see
            :mod:`lightning_pipedap.observers`; the log names the hook). ``True``: defer regardless
            of hooks (the user vouches that they neither read weights nor ``.grad``). ``False``:
            sync mode always (updates at the end of backward, as DDP; RS/AG still overlap backward).
        warmup_steps: optimizer steps run in sync mode first (>= 1); the forward order is traced
            during the first one and the buckets are rebuilt from it.
        wait_timeout_s: timeout in seconds of every wait on communication (and of every
            collective on the dedicated process group); errors name the operation.
        ring_chunk_mb: piece size of the pipelined gloo ring reduce-scatter/all-gather, in MiB.
        deferrable_optimizers: extra optimizer classes whose ``step`` is per-parameter (safe to
            split by bucket); torch's SGD, Adam, AdamW, ... are known already.
        profile_steps: sync-mode steps whose per-layer forward/backward times are measured (median)
            before a planned schedule is computed (>= 1).
        cost_model: α-β model for planning: a JSON file written by ``CostModel.save``, a
            :class:`~lightning_pipedap.plan.CostModel`, or ``None`` to measure RS/AG/AR on the live
            process group (a few seconds; cached per backend, world size and hosts).
        cost_model_cache: read/write the measured model from ``~/.cache/lightning_pipedap``.
        replan_margin: re-profile and re-plan when the measured median iteration time differs from
            the prediction by more than this fraction (checked every ``replan_every`` steps, at most
            ``max_replans`` times). When the engine's measured communication busy time exceeds the
            α-β prediction for the schedule by > 5%, α and β are scaled by that ratio first.
        calibrate_cost_model: before the first plan, compare the engine's measured communication busy
            time during the profiling steps (communication running beside compute, as in training)
            with the α-β prediction for the same operations, and when it is > 5% slower scale α and β
            by that ratio (the micro-benchmark runs on idle cores; gloo's threads and the ring's
            additions slow down when they share the cores with compute). Not applied to a
            ``cost_model`` passed in by the user.
        train_thread_nice: CPU training on Linux: nice-value increment (0..19) for the training thread
            once the communication threads exist, so the communication worker, gloo's I/O threads and
            the kernel's TCP work get the cores first when compute keeps every core busy (0 = off).
            Without ``CAP_SYS_NICE`` the thread keeps the lower priority after training.
        plan_trials: measured plan selection, for planned schedules without compression: after
            planning, run up to this many candidate schedules (the planner's, DeAR and WFBP with
            ``bucket_cap_mb`` fusion, then the other planners; see
            :func:`~lightning_pipedap.plan.candidates.trial_candidates`) for ``trial_steps`` measured
            steps each (plus one settling step) and keep the one with the lowest median measured
            iteration time on rank 0. 1 = install the planner's schedule directly. The α-β model does
            not see the CPU that communication takes from compute, so the model's favourite can be
            slower than a coarser plan (see docs/PLANNERS.md). Results: :attr:`trial_results`.
        trial_steps: measured steps per candidate (>= 1).
        model_contention: before the first plan, measure how much communication and compute slow
            each other down when they overlap (:func:`~lightning_pipedap.profile.contention.
            measure_contention`, ~1 s: a matmul load and an 8 MiB all-reduce, alone and together)
            and predict iteration times with the contention-aware simulator
            (:func:`~lightning_pipedap.plan.contention.simulate_contended`); the planners still
            search with the plain α-β simulator. :attr:`contention` holds the fit.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend, timeout, start_method: as for Lightning's ``DDPStrategy``
            (``start_method="spawn"`` is what the ``"pipedap_spawn"`` name selects).

    Raises:
        ValueError: unknown ``schedule``, non-positive ``bucket_cap_mb``/``ring_chunk_mb``/
            ``wait_timeout_s``, ``warmup_steps < 1``, ``defer_update`` not ``"auto"``/True/False; at
            set-up: world size 1, a model without trainable parameters, parameters that differ
            between ranks, sparse embeddings, ``sync_batchnorm=True`` / SyncBatchNorm on CPU.
        RuntimeError: during training, when a forward read a parameter while its update was
            pending (a data-dependent path the trace and the guard steps did not see); the message
            names the parameter.
        TypeError: DDP-only keyword arguments (``ddp_comm_hook``, ``find_unused_parameters``, ...).
    """

    strategy_name = "pipedap"

    def __init__(
        self,
        schedule: str = "optimal",
        bucket_cap_mb: float = 25.0,
        defer_update: Union[bool, Literal["auto"]] = "auto",
        warmup_steps: int = 1,
        wait_timeout_s: float = 300.0,
        ring_chunk_mb: float = 2.0,
        deferrable_optimizers: tuple[type, ...] = (),
        profile_steps: int = 3,
        cost_model: Optional[Union[str, CostModel]] = None,
        cost_model_cache: bool = True,
        replan_margin: float = 0.15,
        calibrate_cost_model: bool = True,
        train_thread_nice: int = 0,
        replan_every: int = 50,
        max_replans: int = 1,
        compression: Optional[str] = None,
        compression_kwargs: Optional[dict[str, Any]] = None,
        compression_mode: str = "process",
        compression_threads: int = 1,
        plan_trials: int = 4,
        trial_steps: int = 3,
        model_contention: bool = True,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        bad = sorted(kwargs)
        if bad:
            import difflib  # noqa: PLC0415
            import inspect  # noqa: PLC0415

            valid = [n for n in inspect.signature(PipeDAPStrategy.__init__).parameters if n not in ("self", "kwargs")]

            def why(k: str) -> str:
                if _REJECTED_DDP_KWARGS.get(k):
                    return _REJECTED_DDP_KWARGS[k]
                close = difflib.get_close_matches(k, valid, n=1)
                return f"unknown argument{'; did you mean ' + repr(close[0]) + '?' if close else ''}"

            reasons = "; ".join(f"{k}: {why(k)}" for k in bad)
            raise TypeError(f"PipeDAPStrategy got unsupported keyword arguments {bad} ({reasons}); "
                            f"valid arguments: {', '.join(valid)}")
        names = valid_schedule_names()
        if schedule not in names:
            raise ValueError(f"unknown schedule {schedule!r}; valid: {', '.join(names)}")
        for name, value in (("bucket_cap_mb", bucket_cap_mb), ("wait_timeout_s", wait_timeout_s), ("ring_chunk_mb", ring_chunk_mb)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        for name, value, low in (("warmup_steps", warmup_steps, 1), ("profile_steps", profile_steps, 1),
                                 ("replan_every", replan_every, 2), ("max_replans", max_replans, 0),
                                 ("plan_trials", plan_trials, 1), ("trial_steps", trial_steps, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if defer_update not in ("auto", True, False) or isinstance(defer_update, int) and not isinstance(defer_update, bool):
            raise ValueError(f"defer_update must be 'auto', True or False, got {defer_update!r}")
        for name, value in (("calibrate_cost_model", calibrate_cost_model), ("model_contention", model_contention),
                            ("cost_model_cache", cost_model_cache)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if compression is None and (compression_kwargs or compression_mode != "process"):
            raise ValueError(f"compression_kwargs={compression_kwargs!r} / compression_mode={compression_mode!r} "
                             "need a compression method; set compression= to one of the valid names")
        if not isinstance(replan_margin, (int, float)) or replan_margin <= 0:
            raise ValueError(f"replan_margin must be a positive fraction (0.5 = 50%), got {replan_margin!r}")
        if compression is not None:
            from lightning_pipedap.compress import get_compressor, valid_compressor_names  # noqa: PLC0415

            if compression not in valid_compressor_names():
                raise ValueError(f"unknown compression {compression!r}; valid: {', '.join(valid_compressor_names())}")
            get_compressor(compression, **(compression_kwargs or {}))  # validates the keyword arguments
            if compression_mode not in ("process", "inline"):
                raise ValueError(f"compression_mode must be 'process' or 'inline', got {compression_mode!r}")
            if not isinstance(compression_threads, int) or compression_threads < 1:
                raise ValueError(f"compression_threads must be an integer >= 1, got {compression_threads!r}")
        if cost_model is not None and not isinstance(cost_model, (str, CostModel)):
            raise ValueError(f"cost_model must be a path to a cost-model JSON file, a CostModel or None, got {cost_model!r}")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.schedule_name = schedule
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.defer_update: Union[bool, str] = defer_update
        self.warmup_steps = warmup_steps
        self.wait_timeout_s = float(wait_timeout_s)
        self.ring_chunk_mb = float(ring_chunk_mb)
        self.deferrable_optimizers = tuple(deferrable_optimizers)
        self.profile_steps = profile_steps
        self.cost_model = cost_model
        self.cost_model_cache = bool(cost_model_cache)
        self.replan_margin = float(replan_margin)
        self.calibrate_cost_model = bool(calibrate_cost_model)
        if not isinstance(train_thread_nice, int) or isinstance(train_thread_nice, bool) or not 0 <= train_thread_nice <= 19:
            raise ValueError(f"train_thread_nice must be an integer in 0..19 (0 = off), got {train_thread_nice!r}")
        self.train_thread_nice = train_thread_nice
        self._restore_priority: Optional[Callable[[], bool]] = None
        #: measured / predicted communication busy time of the profiling steps (1.0 = not calibrated)
        self.calibration_ratio = 1.0
        self.replan_every = replan_every
        self.max_replans = max_replans
        self.compression = compression
        self.compression_kwargs = dict(compression_kwargs or {})
        self.compression_mode = compression_mode
        self.compression_threads = compression_threads
        self.plan_trials = plan_trials
        self.model_contention = bool(model_contention)
        #: the measured :class:`~lightning_pipedap.plan.contention.Contention` (None before, or when off)
        self.contention: Optional[Any] = None
        self.trial_steps = trial_steps
        #: measured plan selection of the last plan: one dict per candidate (name, describe, steps_s,
        #: predicted_s, measured_s, chosen); empty when no trial ran
        self.trial_results: list[dict[str, Any]] = []
        #: ``Schedule.describe()`` of the last schedule training ran with (None before the first)
        self.installed_schedule: Optional[str] = None
        #: the planner's predicted iteration time (s), the measured median (s, at the last drift check),
        #: the no-overlap time compute + communication (s) and the merged profile (dict), once planned
        self.predicted_iteration_s: Optional[float] = None
        self.measured_iteration_s: Optional[float] = None
        self.no_overlap_time_s: Optional[float] = None
        self.profile: Optional[dict] = None
        #: how many bucket updates of the last ``fit`` were applied where: "forward" (overlapped with
        #: the next forward, the goal), "leftover" (start of backward: its module was not called in
        #: forward), "flush" (validation, checkpoint, end of training)
        self.update_counts = dict.fromkeys(_UPDATE_PLACES, 0)
        #: re-plans triggered by drift in the last ``fit``
        self.replans_done = 0
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._engine: Optional[CommEngine] = None
        self._comm: Optional[C.CommGroup] = None
        self._params: list[Tensor] = []
        self._index_of: dict[int, int] = {}  # id(param) -> index in the engine's (forward-ordered) list
        self._hook_handles: list[Any] = []
        self._triggers: dict[int, list[int]] = {}  # id(module) -> buckets applied at its forward
        self._root_buckets: list[int] = []
        self._pending: Optional[_Pending] = None
        self._updater: Optional[BucketOptimizer] = None
        self._sync_grads = True
        self._deferring = False  # inside a deferred optimizer_step
        self._in_train_forward = False
        self._trace: Optional[list[torch.nn.Module]] = None
        self._trace_seen: set[int] = set()
        self._sync_steps = 0
        self._phase = "trace"  # trace -> (profile) -> run
        self._trial: Optional[_Trial] = None  # measured plan selection in progress (phase "run")
        self._raw_cost_model: Optional[CostModel] = None  # the α-β fit before calibration (rank 0)
        #: rank 0: every prediction of each planned candidate, by schedule name (see ``_predict``), s
        self.predictions: dict[str, dict[str, float]] = {}
        self._order: list[int] = []
        self._owners: list[Optional[torch.nn.Module]] = []
        self._layers: list[list[int]] = []
        self._layer_of_param: list[int] = []
        self._layer_of_module: dict[int, list[int]] = {}
        self._recorder: Optional[StepRecorder] = None
        self._profiled: list[tuple[list[float], list[float]]] = []
        self._t_updates: list[float] = []
        self._t_backward_done: Optional[float] = None
        self._t_step_end: Optional[float] = None
        self._cost_model: Optional[CostModel] = None
        self._iter_starts: collections.deque[float] = collections.deque(maxlen=self.replan_every + 1)
        self._busy: collections.deque[float] = collections.deque(maxlen=self.replan_every)
        self._planned_busy_s: Optional[float] = None
        self._run_steps = 0
        self._aborted = False
        self._buffers_sync_next = True
        self._orig_clip: Optional[Callable] = None
        self._timeline_enabled = False
        self._records: list[OpRecord] = []
        self._compression_state: Optional[dict[str, Any]] = None  # per-parameter state for the next compressing engine
        self._compression_cost: Optional[Any] = None  # measured CompressionCost (rank 0), once per fit
        self._resume: Optional[dict[str, Any]] = None  # a checkpoint's plan (PLAN_KEY), used by configure_ddp
        # consumers of parameters (trace step) and the guard of the first deferred steps of a schedule
        self._consumers: Optional[ConsumerTrace] = None
        self._stack: Optional[ModuleStack] = None
        self._verify_left = 0
        self._guard_misses: dict[int, str] = {}  # engine parameter index -> where it was read early
        self._bucket_of: list[int] = []  # engine parameter index -> bucket
        self._applying = False
        # stale-read detection: engine parameter indices applied after the forward of this step
        self._late: set[int] = set()
        self._stale: list[int] = []
        # hooks that can observe a deferred update (see lightning_pipedap.observers)
        self._observers = Observers()
        self._observed_for: Optional[tuple[int, ...]] = None  # ids of the callbacks the observers were found for
        self._flush_callback: Optional[ObservationFlush] = None
        self._wrapped_train: list[torch.nn.Module] = []
        self._trainable_key: Optional[int] = None
        self._hooked: set[int] = set()  # ids of parameters with our post-accumulate-grad hook
        self._said: set[str] = set()  # log messages given once per fit

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())  # Lightning's Strategy drops its optimizer wrappers
        for k in ("_engine", "_comm", "_hook_handles", "_updater", "_pending", "_trace", "_orig_clip", "_consumers",
                  "_stack", "_flush_callback", "_wrapped_train"):
            state[k] = [] if k in ("_hook_handles", "_wrapped_train") else None
        return state

    # ------------------------------------------------------------------ registration
    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"pipedap"`` (popen launcher) and ``"pipedap_spawn"`` (spawn launcher); idempotent."""
        for name, start_method in (("pipedap", "popen"), ("pipedap_spawn", "spawn")):
            if name in strategy_registry:
                continue
            strategy_registry.register(
                name,
                cls,
                description=(
                    "PipeDAP: scheduled decoupled reduce-scatter/all-gather gradient sync "
                    f"(DeAR/PipeDAP), start_method '{start_method}'"
                ),
                start_method=start_method,
            )

    # ------------------------------------------------------------------ set-up
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        if self.cluster_environment is not None and self.world_size < 2:
            raise ValueError(
                f"strategy 'pipedap' needs at least 2 processes, got world size {self.world_size} "
                "(devices x num_nodes); use strategy='auto' for a single device"
            )

    def setup(self, trainer: Any) -> None:
        if self._layer_sync is not None and self.root_device.type == "cpu":
            raise ValueError("pipedap: Trainer(sync_batchnorm=True) needs CUDA devices (torch's SyncBatchNorm has no "
                             "CPU implementation); remove sync_batchnorm=True on CPU, or train on GPUs")
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        lm = self.lightning_module
        self._trainable_key = self._trainable_signature()  # (the optimizers exist now)
        self._flush_callback = ObservationFlush(self)
        trainer.callbacks.insert(0, self._flush_callback)
        self._find_observers(trainer)
        for opt in self.optimizers:
            name = type(opt).__name__
            if name in _SELF_COMMUNICATING_OPTIMIZERS:
                raise ValueError(
                    f"pipedap: optimizer {name} communicates by itself and cannot run under pipedap; use a local "
                    "optimizer (torch.optim.SGD, Adam, AdamW, ...) or strategy='ddp'"
                )
        if not lm.automatic_optimization or len(self.optimizers) != 1:
            rank_zero_info("pipedap: manual optimization or several optimizers -> sync mode (reduce in backward)")
        # intercept gradient clipping: in deferred mode it is applied to the reduced gradients
        plugin = self.precision_plugin
        self._orig_clip = plugin.clip_gradients
        strategy = self

        def clip_gradients(optimizer: Any, clip_val: Union[int, float] = 0.0, gradient_clip_algorithm: Any = None) -> None:
            if isinstance(optimizer, _DeferredStep):
                if clip_val and clip_val > 0:
                    algo = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm) or "norm")
                    optimizer.clip = ClipRequest(float(clip_val), algo)
                return None
            return strategy._orig_clip(optimizer, clip_val, gradient_clip_algorithm)

        plugin.clip_gradients = clip_gradients

    def configure_ddp(self) -> None:
        """Replace DDP wrapping: broadcast rank 0's states, build buckets and the engine, install hooks.

        Raises:
            ValueError: no trainable parameter, parameters that differ between ranks, a sparse
                embedding (its name is given) or a SyncBatchNorm module on CPU.
        """
        model = self.model
        assert isinstance(model, torch.nn.Module)
        self._refuse_unsupported_modules(model)
        with torch.no_grad():
            C.broadcast_coalesced_([t for t in list(model.parameters()) + list(model.buffers())], src=0)
        self._params = self._trainable_params()
        self.update_counts = dict.fromkeys(_UPDATE_PLACES, 0)
        self.replans_done = 0
        self._comm = C.new_comm_group(self.wait_timeout_s, int(self.ring_chunk_mb * 2**20))
        self._hook_new_params()
        # prepend: our pre-hook runs before hooks registered earlier (legacy weight_norm recomputes
        # `weight` from `weight_g`/`weight_v` in a pre-hook, which must see the updated values);
        # compiler.disable: under torch.compile the hook (and the optimizer step in it) runs eagerly
        on_forward = torch.compiler.disable(self._on_module_forward)
        for m in eager_modules(model):
            self._hook_handles.append(m.register_forward_pre_hook(on_forward, prepend=True))
            if type(m).train is not torch.nn.Module.train and "train" not in m.__dict__:
                self._wrap_train(m)  # a module that reads its weights in train()/eval() (LoRA merge)
        # warm-up: registration order, one all-reduce per bucket (WFBP), sync mode
        order = list(range(len(self._params)))
        self._install(order, self._builtin(order, "allreduce"), owners=None)
        if self.train_thread_nice and self.root_device.type == "cpu" and self._restore_priority is None:
            self._restore_priority = lower_current_thread_priority(self.train_thread_nice)
        self._resume_plan()  # a checkpoint's final schedule, when it fits this run: no re-trace, no re-profile

    def _refuse_unsupported_modules(self, model: torch.nn.Module) -> None:
        """Sparse embeddings and CPU SyncBatchNorm are refused before any collective, naming the module."""
        for name, m in model.named_modules():
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
                raise ValueError(
                    f"pipedap: parameter {name + '.weight' if name else 'weight'!r} has sparse gradients "
                    f"({type(m).__name__}(sparse=True)); pipedap reduces dense buckets only. Use sparse=False "
                    "or strategy='ddp'")
            if isinstance(m, torch.nn.SyncBatchNorm) and self.root_device.type == "cpu":
                raise ValueError(f"pipedap: module {name!r} is a SyncBatchNorm, which needs CUDA; on CPU use BatchNorm")

    def _trainable_params(self) -> list[Tensor]:
        """The model's trainable parameters, checked to be the same (name, shape, dtype) on every rank."""
        model = self.model
        wants = self._requires_grad
        named = [(n, p) for n, p in model.named_parameters() if wants(p)]
        if not named:
            raise ValueError(f"pipedap: {type(model).__name__} has no trainable parameters (all requires_grad=False)")
        signature = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
        ref = C.broadcast_object(signature, src=0)
        if ref != signature:
            diff = next((f"{a} here vs {b} on rank 0" for a, b in zip(signature, ref) if a != b),
                        f"{len(signature)} here vs {len(ref)} on rank 0")
            raise ValueError(
                f"pipedap: rank {self.global_rank}'s trainable parameters differ from rank 0's (first difference: "
                f"{diff}); every rank must build the same model and freeze the same parameters"
            )
        return [p for _, p in named]

    def _hook_new_params(self) -> None:
        """Post-accumulate-grad hooks on every trainable parameter not hooked yet (again after unfreezing)."""
        for p in self._params:
            if id(p) not in self._hooked:
                self._hooked.add(id(p))
                toggled_off = not p.requires_grad  # (switched off by toggle_optimizer right now)
                if toggled_off:
                    p.requires_grad_(True)
                try:
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
                finally:
                    if toggled_off:
                        p.requires_grad_(False)

    def _requires_grad(self, p: Tensor) -> bool:
        """``p.requires_grad`` as the user set it: ``LightningModule.toggle_optimizer`` switches the other
        optimizers' parameters off for one optimizer's step, which is not a change of the trainable set."""
        toggled = getattr(self.lightning_module, "_param_requires_grad_state", None) or {}
        return bool(toggled.get(p, p.requires_grad))

    def _wrap_train(self, module: torch.nn.Module) -> None:
        """Apply pending updates before ``module.train(mode)`` runs (it may read weights: LoRA-style merges)."""
        original = module.train
        strategy = self

        def train(mode: bool = True) -> torch.nn.Module:
            if strategy._pending is not None:
                strategy._say(f"train:{type(module).__name__}", f"pipedap: {type(module).__name__}.train() can read "
                              "its weights; pending updates are applied before it")
                strategy.flush()
            return original(mode)

        module.train = train  # instance attribute: found before the class's method
        self._wrapped_train.append(module)

    def _trainable_signature(self) -> int:
        """Hash of which parameters are trainable and of every optimizer's param groups (checked every step)."""
        lm = self.lightning_module
        wants = self._requires_grad
        trainable = tuple(id(p) for p in lm.parameters() if wants(p))
        groups = tuple(tuple(id(p) for p in g["params"]) for opt in self.optimizers for g in opt.param_groups)
        return hash((trainable, groups))

    def _retrain_if_changed(self) -> None:
        """At a step's start: if parameters were (un)frozen or a param group added, rebuild buckets and plan.

        Every rank checks the same thing at the same step; the new trainable set is compared across
        ranks (:meth:`_trainable_params`). Pending updates are applied first; training then traces,
        profiles and plans again as at the start (sync steps), and every param group is stepped.
        """
        key = self._trainable_signature()
        if key == self._trainable_key:
            return
        self._trainable_key = key
        self.flush()
        before = len(self._params)
        self._params = self._trainable_params()
        self._hook_new_params()
        self._trial, self._recorder, self._pending = None, None, None
        self._phase, self._sync_steps, self._trace = "trace", 0, None
        order = list(range(len(self._params)))
        self._install(order, self._builtin(order, "allreduce"), owners=None)
        rank_zero_info(f"pipedap: the trainable parameters or the optimizer's param groups changed ({before} -> "
                       f"{len(self._params)} trainable tensors): buckets rebuilt, tracing and planning again")

    def _say(self, key: str, message: str) -> None:
        """Log ``message`` on rank 0 once per fit."""
        if key not in self._said:
            self._said.add(key)
            rank_zero_info(message)

    # ------------------------------------------------------------------ observers (lightning_pipedap.observers)
    def _find_observers(self, trainer: Any) -> None:
        """Find the hooks that can observe a deferred update (again whenever the callback list changes)."""
        ids = tuple(id(cb) for cb in trainer.callbacks)
        if ids == self._observed_for:
            return
        self._observed_for = ids
        self._observers = find_observers(self.lightning_module, trainer.callbacks)
        if self.defer_update != "auto":
            return
        if self._observers.grads:
            self._say("grads:" + ",".join(self._observers.grads),
                      f"pipedap: {', '.join(self._observers.grads)} can read or write .grad: steps run in sync mode "
                      "(averaged gradients in .grad at the end of backward, the optimizer steps as with DDP; the "
                      "reduce-scatter/all-gather still overlap backward). Pass defer_update=True if they do not.")
        for hook, names in self._observers.between.items():
            self._say(f"between:{hook}:{','.join(names)}",
                      f"pipedap: {', '.join(names)} can read parameters or .grad: pending updates are applied "
                      f"before {hook} (their all-gathers no longer overlap the next forward). Pass "
                      "defer_update=True if they do not.")

    def observe(self, hook: str, trainer: Any) -> None:
        """Called by :class:`~lightning_pipedap.observers.ObservationFlush` before the other ``hook`` calls.

        Applies pending updates (and writes the averaged, clipped gradients to ``.grad``) when a
        hook of the user's can observe them, or always at ``on_train_end``.
        """
        if hook == "on_train_batch_start":
            self._find_observers(trainer)
        if self._pending is None or self.defer_update is True and hook != "on_train_end":
            return
        if hook == "on_train_end" or hook in self._observers.between:
            if self._aborted or self._engine is None or trainer.interrupted:
                return
            self._apply_all("observe")

    def _builtin(self, order: list[int], name: str, compress_all: bool = False) -> Schedule:
        params = [self._params[i] for i in order]
        sizes = [p.numel() * p.element_size() for p in params]
        keys = [(p.dtype, p.device) for p in params]
        return builtin_schedule(name, sizes, int(self.bucket_cap_mb * 2**20), keys, compress_all=compress_all)

    def _install(self, order: list[int], schedule: Schedule, owners: Optional[list[Optional[torch.nn.Module]]],
                 final: bool = False) -> None:
        """Replace the engine: parameters in forward ``order``, ``schedule`` over their indices.

        ``final``: the schedule training runs with (compression, if configured, starts here; warm-up
        and profiling steps communicate uncompressed).
        """
        if self._engine is not None:
            self._engine.wait_idle()
            self._keep_compression_state()
            self._engine.close()
        params = [self._params[i] for i in order]
        self._index_of = {id(p): k for k, p in enumerate(params)}
        factory = self._compression_factory() if final and self.compression else None
        self._engine = CommEngine(self._comm, params, schedule, self.wait_timeout_s, transport_factory=factory)
        self._engine.timeline_enabled = self._timeline_enabled
        self._restore_compression_state()
        self._updater = None
        self._triggers, self._root_buckets = {}, []
        self._bucket_of = [0] * len(params)
        for b, idxs in enumerate(schedule.buckets):
            for i in idxs:
                self._bucket_of[i] = b
        if owners is not None:
            lm = self.lightning_module
            for b, idxs in enumerate(schedule.buckets):
                # the bucket lands before its earliest consumer; a parameter read outside every module
                # forward (training_step, a torch.func transform) or never seen in the trace: before training_step
                if any(owners[i] is None or owners[i] is lm for i in idxs):
                    self._root_buckets.append(b)
                else:
                    self._triggers.setdefault(id(owners[idxs[0]]), []).append(b)
        self._verify_left = 2 if final else 0
        if final:
            self.installed_schedule = schedule.describe()
        what = "schedule" if final else "warm-up schedule (sync mode, until the plan is ready)"
        rank_zero_info(f"pipedap: {what} {schedule.describe()[:300]}")

    def _compression_factory(self) -> Callable[[list], Any]:
        from lightning_pipedap.compress import CompressionPipeline  # noqa: PLC0415
        from lightning_pipedap.compress.compressors import compressor_kwargs  # noqa: PLC0415
        from lightning_pipedap.engine.compressed import CompressedTransport  # noqa: PLC0415

        if self.root_device.type != "cpu":
            raise ValueError("pipedap: compression= runs on CPU/gloo in this version; on CUDA use compression=None")
        kwargs = dict(self.compression_kwargs)
        if "rank" in compressor_kwargs(self.compression) and self.compression != "powersgd":
            kwargs["rank"] = self.global_rank  # per-rank random streams (QSGD, DGC sampling)

        def factory(buckets: list) -> Any:
            pipe = CompressionPipeline([b.numel for b in buckets], self.compression, kwargs,
                                       layouts=self._compression_layouts(buckets),
                                       threads=self.compression_threads, timeout_s=self.wait_timeout_s,
                                       mode=self.compression_mode)
            return CompressedTransport(pipe, self._comm)

        return factory

    def _order_from_trace(self) -> None:
        """Rank 0 turns the traced consumptions into a parameter order and owners; every rank adopts them.

        The order is the order of first consumption by an op (:mod:`~lightning_pipedap.profile.consumers`);
        the owner of a parameter is the innermost module whose forward was running then, by name, so that
        every rank triggers the same buckets even when control flow differs between ranks (experts that
        get no tokens on one rank). Parameters read outside every module forward, inside a ``torch.func``
        transform, or not read in rank 0's trace step are owned by the LightningModule: their buckets are
        applied before ``training_step``.
        """
        lm = self.lightning_module
        plan: Optional[tuple[list[int], list[Optional[str]]]] = None
        first = self._consumers.first if self._consumers is not None else {}
        self._consumers = None
        if self.global_rank == 0:
            names = {id(m): n for n, m in lm.named_modules()}
            order = consumer_order(len(self._params), first)
            owners: list[Optional[str]] = []
            for i in order:
                c = first.get(i)
                module = None if c is None or c.in_transform else c.module
                owners.append(names.get(id(module), "") if module is not None else "")
            plan = (order, owners)
        order, owner_names = C.broadcast_object(plan, src=0)
        modules = dict(lm.named_modules())
        owner_names = [_outside_compiled(n, modules) for n in owner_names]
        self._order = order
        self._owners = [modules.get(n, lm) for n in owner_names]
        self._trace = None

    def _after_sync_step(self, t_step_end: float) -> None:
        """Advance warm-up: trace -> (profile) -> run, identically on every rank."""
        self._sync_steps += 1
        if self._phase == "trace" and self._sync_steps >= self.warmup_steps:
            self._order_from_trace()
            if self.schedule_name in BUILTIN_SCHEDULES:
                # the fixed schedules compress every bucket when compression is configured
                self._install(self._order, self._builtin(self._order, self.schedule_name, bool(self.compression)),
                              self._owners, final=True)
                self._phase = "run"
            else:
                self._start_profiling()
        elif self._phase == "profile" and self._recorder is not None:
            rec, self._recorder = self._recorder, None
            if self._engine.last_round_busy_s is not None:
                self._profile_busy.append(self._engine.last_round_busy_s)
            if rec.complete:
                self._profiled.append(rec.times())
                if self._t_backward_done is not None:
                    self._t_updates.append(max(0.0, t_step_end - self._t_backward_done))
            if len(self._profiled) >= self.profile_steps:
                self._finish_profiling()

    def _start_profiling(self) -> None:
        """Profiling buckets (fixed fusion, all-reduce, sync mode) and the α-β model of the live group."""
        self._install(self._order, self._builtin(self._order, "allreduce"), self._owners)
        self._layers = group_layers([id(o) if o is not None else None for o in self._owners])
        self._layer_of_param = [k for k, layer in enumerate(self._layers) for _ in layer]
        self._layer_of_module = {}
        for k, layer in enumerate(self._layers):
            owner = self._owners[layer[0]]
            if owner is not None:
                self._layer_of_module.setdefault(id(owner), []).append(k)
        if self._cost_model is None:
            if isinstance(self.cost_model, str):
                self._cost_model = load_cost_model(self.cost_model)
            elif self.cost_model is not None:
                self._cost_model = self.cost_model
            else:
                largest = max(p.numel() * p.element_size() for p in self._params)
                self._cost_model = measure_cost_model(
                    self._comm, self.root_device, max_bytes=min(64 << 20, max(largest, 16 << 20)),
                    use_cache=self.cost_model_cache,
                )
        if self.model_contention and self.contention is None and not self.compression:
            from lightning_pipedap.profile.contention import measure_contention  # noqa: PLC0415

            self.contention = measure_contention(self._comm, self.root_device, nbytes=8 << 20, repeats=5,
                                                 timeout_s=self.wait_timeout_s)
            rank_zero_info(f"pipedap: contention: communication {self.contention.comm_slowdown:.2f} and compute "
                           f"{self.contention.compute_slowdown:.2f} extra slowdown while they overlap")
        cm = self._cost_model
        poor = [k for k, ab in (("RS", cm.rs), ("AG", cm.ag), ("AR", cm.ar)) if ab.r2 is not None and ab.r2 < 0.5]
        if poor:
            rank_zero_warn(
                f"pipedap: the α-β fit of {poor} is poor (R² < 0.5; typical on an uncontended loopback where "
                "start-up noise dominates); plans may be off. Pass cost_model=<file> or cost_model_cache=False to re-measure."
            )
        rank_zero_info(
            "pipedap: α-β model "
            + ", ".join(f"{k} α={ab.alpha_s * 1e6:.0f} µs β={ab.beta_s_per_byte * 1e9 / 8:.3f} ns/bit R²={ab.r2 if ab.r2 is None else round(ab.r2, 4)}"
                        for k, ab in (("RS", cm.rs), ("AG", cm.ag), ("AR", cm.ar)))
        )
        self._profiled, self._t_updates, self._profile_busy = [], [], []
        self._measured_cost_model = self.cost_model is None
        self._phase = "profile"

    def _finish_profiling(self) -> None:
        """Rank 0 plans from the median profile (and picks trial candidates); every rank installs the result."""
        plan = None
        if self.global_rank == 0:
            self.predictions = {}
            self._calibrate()
            lm = self.lightning_module
            names = {id(m): n or "<root>" for n, m in lm.named_modules()}
            params = [self._params[i] for i in self._order]
            layer_names = [names.get(id(self._owners[l[0]]), "<unused>") for l in self._layers]
            layer_bytes = [sum(params[i].numel() * params[i].element_size() for i in l) for l in self._layers]
            profile = merge_steps(type(lm).__name__, layer_names, layer_bytes, self._profiled, self._t_updates)
            planner = get_planner(_PLANNED[self.schedule_name])
            schedule = planner(profile, self._cost_model, self.world_size)
            candidates = [schedule]
            if self.compression:
                schedule = self._plan_compression(planner, profile, schedule,
                                                  [[tuple(params[i].shape) for i in l] for l in self._layers])
                candidates = [schedule]
            elif self.plan_trials > 1:
                candidates = trial_candidates(profile, self._cost_model, self.world_size, schedule,
                                              cap_bytes=int(self.bucket_cap_mb * 2**20), k=self.plan_trials)
            candidates = [self._predict(profile, c) for c in candidates]
            no_overlap = [profile.t_compute + profile.t_update + sum(
                self._cost_model.all_reduce(sum(layer_bytes[k] for k in b)) for b in c.buckets) for c in candidates]
            plan = (candidates, no_overlap, profile.to_dict(), self._cost_model)
        candidates, no_overlap, self.profile, self._cost_model = C.broadcast_object(plan, src=0)
        keys = [(self._params[i].dtype, self._params[i].device) for i in self._order]
        engine_schedules = [expand_layers(c, self._layers, keys) for c in candidates]
        self.trial_results = []
        if len(engine_schedules) > 1:
            rank_zero_info(f"pipedap: measuring {len(engine_schedules)} candidate schedules for {self.trial_steps} "
                           f"steps each: {', '.join(c.name for c in candidates)}")
            self._trial = _Trial(engine_schedules, no_overlap)
            self._enter_run(engine_schedules[0], no_overlap[0])
            self._trial.starts = [time.perf_counter()]
        else:
            self._enter_run(engine_schedules[0], no_overlap[0])

    def _predict(self, profile: Any, schedule: Schedule) -> Schedule:
        """Rank 0: ``schedule`` with the prediction training is checked against, and every prediction in
        :attr:`predictions` (s): α-β as fitted (``ab_s``), α-β calibrated (``calibrated_s``), and each of
        those through the contention-aware simulator (``contended_s``, ``contended_calibrated_s``).

        The prediction kept is the contention-aware one on the *uncalibrated* α-β when the contention was
        measured (the profiling-step calibration already contains some of the same slowdown), else the
        planner's own (calibrated when calibration applied).
        """
        from lightning_pipedap.plan.contention import simulate_contended  # noqa: PLC0415
        from lightning_pipedap.plan.simulator import simulate  # noqa: PLC0415

        if self.compression:
            return schedule  # compressed plans: the planner's compression-aware prediction
        raw = self._raw_cost_model or self._cost_model
        pred = {"ab_s": simulate(profile, raw, schedule).iteration_s,
                "calibrated_s": simulate(profile, self._cost_model, schedule).iteration_s}
        keep = schedule.predicted_iteration_s
        if self.contention is not None:
            pred["contended_s"] = simulate_contended(profile, raw, schedule, self.contention).iteration_s
            pred["contended_calibrated_s"] = simulate_contended(profile, self._cost_model, schedule,
                                                                self.contention).iteration_s
            keep = pred["contended_s"]
        self.predictions[schedule.name] = pred
        return dataclasses.replace(schedule, predicted_iteration_s=keep)

    def _enter_run(self, schedule: Schedule, no_overlap_s: float) -> None:
        """Install a planned engine schedule (all ranks) and restart the drift bookkeeping."""
        self._install(self._order, schedule, self._owners, final=True)
        self.predicted_iteration_s = schedule.predicted_iteration_s
        self.no_overlap_time_s = no_overlap_s
        self._iter_starts.clear()
        self._busy.clear()
        self._run_steps = 0
        self._planned_busy_s = self._predicted_busy_s(self._cost_model)
        self._phase = "run"

    def _trial_step(self) -> None:
        """At a deferred step's start during measured plan selection: time it; switch candidates when due.

        Every rank calls this at the same step (the step count is the same everywhere); the choice is
        rank 0's (its iteration time is the group's, ranks being coupled by the collectives).
        """
        tr = self._trial
        assert tr is not None
        tr.starts.append(time.perf_counter())
        if len(tr.starts) < self.trial_steps + 2:  # the first interval after a switch settles, not counted
            return
        gaps = [b - a for a, b in zip(tr.starts[:-1], tr.starts[1:])]
        tr.gaps_s.append(gaps)
        tr.measured_s.append(statistics.median(gaps[1:]))
        self._apply_all("flush")  # the previous step's updates, before the engine changes
        if len(tr.measured_s) < len(tr.schedules):  # the next candidate is number len(measured_s)
            nxt = len(tr.measured_s)
            self._enter_run(tr.schedules[nxt], tr.no_overlap_s[nxt])
            tr.starts = [time.perf_counter()]
            return
        measured = C.broadcast_object(tr.measured_s if self.global_rank == 0 else None, src=0)
        best = min(range(len(measured)), key=measured.__getitem__)
        self._trial = None
        self.trial_results = [
            {"name": s.name, "describe": s.describe(), "predicted_s": s.predicted_iteration_s, "measured_s": m,
             "chosen": i == best, "steps_s": tr.gaps_s[i], **self.predictions.get(s.name, {})}
            for i, (s, m) in enumerate(zip(tr.schedules, measured))
        ]
        rank_zero_info("pipedap: measured candidates: " + "; ".join(
            f"{r['name']} {r['measured_s'] * 1e3:.1f} ms (predicted "
            + (f"{r['predicted_s'] * 1e3:.1f}" if r["predicted_s"] is not None else "-") + " ms)"
            + (" <- chosen" if r["chosen"] else "") for r in self.trial_results))
        if best != len(tr.schedules) - 1:  # the last candidate is the one installed now
            self._enter_run(tr.schedules[best], tr.no_overlap_s[best])
        else:
            self._iter_starts.clear()
            self._busy.clear()
            self._run_steps = 0

    def _predicted_busy_s(self, cm: CostModel) -> float:
        """α-β prediction of the installed engine's communication busy time per round (s), dense costs."""
        return sum(cm.cost(op.kind, self._engine.buckets[op.bucket].nbytes) for op in self._engine.schedule.ops)

    def _plan_compression(self, planner: Callable[..., Schedule], profile: Any, dense: Schedule,
                          layer_shapes: list[list[tuple[int, ...]]]) -> Schedule:
        """Rank 0: plan again with the measured compression cost; log what is compressed and what it buys.

        The compressor is timed once per run (:func:`~lightning_pipedap.profile.compression_cost.
        measure_compression_cost`, about a second at most) with the helper's thread count. ``optimal``
        compresses only the buckets where it pays; the other planners compress every bucket.
        """
        from lightning_pipedap.profile.compression_cost import measure_compression_cost  # noqa: PLC0415

        cost = self._compression_cost
        if cost is None:
            process = self.compression_mode == "process"
            cost = measure_compression_cost(self.compression, self.compression_kwargs, layer_shapes,
                                            world_size=self.world_size, where="helper" if process else "inline",
                                            threads=self.compression_threads if process else None)
            self._compression_cost = cost
            rank_zero_info(
                f"pipedap: compression cost of {cost.method}: {cost.alpha_c_s * 1e6:.0f} µs + "
                f"{cost.beta_c_s_per_byte * 1e9:.3f} ns/byte ({cost.post_share:.0%} after the collective, "
                f"R²={cost.meta.get('r2')}), payload via {cost.collective} x{cost.rounds}"
            )
        schedule = planner(profile, self._cost_model, self.world_size, compression=cost)
        p_c, p_d = schedule.predicted_iteration_s, dense.predicted_iteration_s
        rank_zero_info(
            f"pipedap: {schedule.num_compressed} of {len(schedule.buckets)} buckets compressed ({self.compression}); "
            f"predicted iteration {p_c * 1e3:.1f} ms vs {p_d * 1e3:.1f} ms without compression"
        )
        return schedule

    def _calibrate(self) -> None:
        """Scale the measured α-β model by the profiling steps' measured / predicted busy time (rank 0).

        Only for a model measured by the strategy (not one the user passed), only once per model, and
        only when communication was > 5% slower during training than the idle micro-benchmark predicts.
        """
        if not (self.calibrate_cost_model and self._measured_cost_model and self._profile_busy
                and self.calibration_ratio == 1.0 and self._cost_model is not None):
            return
        cm = self._cost_model
        predicted = self._predicted_busy_s(cm)
        if predicted <= 0:
            return
        ratio = statistics.median(self._profile_busy) / predicted
        if ratio > 1.05:
            self.calibration_ratio = ratio
            self._raw_cost_model = cm
            self._cost_model = cm.scaled(alpha_factor=ratio, beta_factor=ratio)
            rank_zero_info(f"pipedap: communication during the profiling steps took {ratio:.2f}x the α-β "
                           "prediction (compute shares the cores); planning with α and β scaled by it")

    def _check_drift(self) -> None:
        """Every ``replan_every`` deferred steps: re-profile if the iteration time left the prediction."""
        if self._trial is not None:
            self._trial_step()
            return
        self._iter_starts.append(time.perf_counter())  # bounded deque: the last replan_every + 1 starts
        if self._engine.last_round_busy_s is not None:
            self._busy.append(self._engine.last_round_busy_s)
        self._run_steps += 1
        n = self._run_steps
        check = (self.predicted_iteration_s is not None and n > self.replan_every and not (n - 1) % self.replan_every
                 and self.replans_done < self.max_replans)
        if not check and (n < 6 or (n - 1) % 5):
            return
        starts = list(self._iter_starts)
        measured = statistics.median(b - a for a, b in zip(starts[:-1], starts[1:]))
        self.measured_iteration_s = measured  # median of the last window, refreshed every 5 steps
        if not check:
            return
        busy_ratio = (statistics.median(self._busy) / self._planned_busy_s) if self._busy and self._planned_busy_s else 1.0
        drift, busy_ratio = C.broadcast_object((abs(measured / self.predicted_iteration_s - 1.0), busy_ratio), src=0)
        if drift > self.replan_margin and self._cost_model is not None and busy_ratio > 1.05 and not self.compression:
            # communication is slower during training than in the idle micro-benchmark (compute, gloo
            # threads and the ring's additions share the cores): calibrate the α-β model before re-planning
            rank_zero_info(f"pipedap: communication busy {busy_ratio:.2f}x the α-β prediction; scaling α and β")
            self._cost_model = self._cost_model.scaled(alpha_factor=busy_ratio, beta_factor=busy_ratio)
        if drift > self.replan_margin:
            rank_zero_info(
                f"pipedap: measured iteration {measured * 1e3:.1f} ms vs predicted "
                f"{self.predicted_iteration_s * 1e3:.1f} ms (drift {drift:.0%} > {self.replan_margin:.0%}): re-planning"
            )
            self.replans_done += 1
            self._apply_all("flush")
            self._start_profiling()

    # ------------------------------------------------------------------ hooks
    def _on_grad_ready(self, p: Tensor) -> None:
        engine = self._engine
        if engine is not None and engine.collecting and p.grad is not None:
            i = self._index_of.get(id(p))
            if i is None:  # not trainable when the buckets were built (see _retrain_if_changed)
                return
            if p.grad.layout != torch.strided:
                raise ValueError(f"pipedap: parameter {self._param_name(p)!r} got a {p.grad.layout} gradient; "
                                 "pipedap reduces dense gradients only (use strategy='ddp' for sparse gradients)")
            if i in self._late:
                self._stale.append(i)
            engine.grad_ready(i, p.grad)
            if self._recorder is not None:
                self._sync_device()
                self._recorder.param_ready(i)

    def _param_name(self, p: Tensor) -> str:
        return next((n for n, q in self.lightning_module.named_parameters() if q is p), "<unnamed parameter>")

    def _on_module_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not self._in_train_forward:
            # a forward outside training_step (an RL agent acting in the data loader, a metric
            # computed in a hook) must see the updated weights, as under DDP
            if self._pending is not None and not self._applying:
                self._say("outside", f"pipedap: {type(module).__name__} ran a forward outside training_step while "
                          "updates were pending; they are applied first")
                self.flush()
            return
        if self._trace is not None and id(module) not in self._trace_seen:
            self._trace_seen.add(id(module))
            self._trace.append(module)
        if self._recorder is not None:
            for k in self._layer_of_module.get(id(module), ()):
                self._sync_device()
                self._recorder.layer_used(k)
        if self._pending is not None and not self._applying:
            buckets = self._triggers.get(id(module))
            if buckets and not transform_active():  # (no in-place update inside vmap/grad: see _order_from_trace)
                self._apply(buckets)

    def _on_guarded_read(self, i: int) -> None:
        """Guard (verification steps): engine parameter ``i`` is about to be read by an op."""
        pending = self._pending
        if pending is None or self._applying:
            return
        b = self._bucket_of[i]
        if b not in pending.remaining:
            return
        p = self._engine.buckets[b].params[self._engine.buckets[b].param_indices.index(i)]
        top = self._stack.top() if self._stack is not None else None
        where = type(top).__name__ if top is not None else "training_step"
        if transform_active():
            raise RuntimeError(f"pipedap: parameter {self._param_name(p)!r} is read inside a torch.func transform "
                               "while its update is pending, and an update cannot be applied inside a transform; "
                               "pass defer_update=False")
        self._guard_misses.setdefault(b, f"{self._param_name(p)} (read in {where})")
        self._apply([b], "guard")

    def _end_guard(self) -> None:
        """After a guarded forward: buckets read before their trigger are applied before training_step from now on."""
        misses, self._guard_misses = self._guard_misses, {}
        for b, what in sorted(misses.items()):
            for buckets in self._triggers.values():
                if b in buckets:
                    buckets.remove(b)
            if b not in self._root_buckets:
                self._root_buckets.append(b)
            self._say(f"guard:{what}", f"pipedap: {what} was read before its update's trigger module ran; the "
                      f"update was applied just before the read, and bucket {b} is applied before training_step from "
                      "now on")

    @contextmanager
    def _consumer_mode(self, on_consume: Optional[Callable[[int], None]]) -> Generator[Optional[ConsumerTrace], None, None]:
        """Module stack + :class:`ConsumerTrace` over the engine's parameters for one forward."""
        stack = ModuleStack(self.lightning_module)
        params = [None] * len(self._index_of)
        for p in self._params:
            k = self._index_of.get(id(p))
            if k is not None:
                params[k] = p
        mode = ConsumerTrace(params, stack, on_consume)
        self._stack = stack
        stack.install()
        stack.pause_in_compiled(mode)
        try:
            with mode:
                yield mode
        finally:
            stack.remove()
            self._stack = None

    # ------------------------------------------------------------------ training step
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._engine is None:
            return super().training_step(*args, **kwargs)
        if self._buffers_sync_next:
            self._sync_buffers()
        if self._pending is not None:
            self._clip_coefficient(self._pending)
            if self._root_buckets:
                self._apply(list(self._root_buckets))
        mode: Optional[Callable[[int], None]] = None
        tracing = self._phase == "trace" and self._sync_steps == 0 and self._trace is None
        if tracing:
            self._trace, self._trace_seen = [], set()
        elif self._verify_left > 0 and self._pending is not None:
            self._verify_left -= 1
            mode = self._on_guarded_read
        if tracing or mode is not None:
            with self._consumer_mode(mode) as trace:
                if tracing:
                    self._consumers = trace
                try:
                    return self._training_step(*args, **kwargs)
                finally:
                    if mode is not None:
                        self._end_guard()
        return self._training_step(*args, **kwargs)

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._phase == "profile" and self._sync_grads:
            self._sync_device()
            self._recorder = StepRecorder(self._layer_of_param, len(self._layers))
            self._recorder.forward_start()
            if self._t_step_end is not None:
                self._recorder.pre_gap = self._recorder.t_fwd0 - self._t_step_end
            for k in self._layer_of_module.get(id(self.lightning_module), ()):
                self._recorder.layer_used(k)
        self._in_train_forward = True
        try:
            out = super().training_step(*args, **kwargs)
        finally:
            self._in_train_forward = False
        if self._recorder is not None:
            self._sync_device()
            self._recorder.forward_end()
        # DDP's rule: buffers are broadcast before a forward that follows a grad-syncing forward
        self._buffers_sync_next = torch.is_grad_enabled() and self._sync_grads
        return out

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._buffers_sync_next = False  # as DDP: a no-grad forward turns the next buffer sync off
        return super().validation_step(*args, **kwargs)

    def _sync_buffers(self) -> None:
        bufs = list(self.lightning_module.buffers())
        if bufs:
            with torch.no_grad():
                C.broadcast_coalesced_(bufs, src=0)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-batches (all but the last) keep gradients local: no communication."""
        prev, self._sync_grads = self._sync_grads, False
        try:
            yield
        finally:
            self._sync_grads = prev

    def pre_backward(self, closure_loss: Tensor) -> None:
        if self._engine is None:
            return
        self._late, self._stale = set(), []
        if self._pending is not None:
            # leftovers of the previous update (buckets whose modules were not called); a gradient that
            # arrives for one of them in this backward means the forward read it before its update
            engine = self._engine
            self._late = {i for b in self._pending.remaining for i in engine.buckets[b].param_indices}
            self._apply_all("leftover")
        if self._sync_grads:
            self._engine.begin_iteration()
            if self._recorder is not None:
                self._sync_device()
                self._recorder.backward_start()

    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward, with the gradient reduction finished *before* ``on_after_backward``.

        In sync mode ``.grad`` holds the averaged gradients when ``on_after_backward`` runs, as with
        DDP (whose reducer finishes inside backward). A forward that read a parameter before its
        pending update landed is reported by name instead of autograd's in-place error.
        """
        lm = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, lm)
        try:
            self.precision_plugin.backward(closure_loss, lm, optimizer, *args, **kwargs)
        except RuntimeError as exc:
            if self._late and "modified by an inplace operation" in str(exc):
                raise RuntimeError(self._stale_message(sorted(self._late))) from exc
            raise
        self._finish_backward()
        closure_loss = self.precision_plugin.post_backward(closure_loss, lm)
        self.post_backward(closure_loss)
        return closure_loss

    def _stale_message(self, indices: list[int]) -> str:
        engine = self._engine
        params = {i: p for b in engine.buckets for i, p in zip(b.param_indices, b.params)}
        names = sorted({self._param_name(params[i]) for i in indices if i in params})
        return (f"pipedap: the forward read {', '.join(names[:5])}{' ...' if len(names) > 5 else ''} while its "
                "update was still pending (it is read outside the module that first used it in the traced step, "
                "e.g. on a data-dependent path); results would differ from DDP's. Pass defer_update=False.")

    def post_backward(self, closure_loss: Tensor) -> None:
        """Nothing: the reduction is finished in :meth:`backward`, before ``on_after_backward``."""

    def _finish_backward(self) -> None:
        engine = self._engine
        if self._stale:
            stale, self._stale = self._stale, []
            raise RuntimeError(self._stale_message(stale))
        if engine is None or not engine.collecting:
            return
        if self._recorder is not None:
            self._sync_device()
            self._recorder.backward_end()
        engine.finish_backward()
        if not self._deferring:
            t0 = time.perf_counter()
            engine.wait_idle()
            if self._timeline_enabled:
                self._records.append(OpRecord("wait_all", "wait", None, t0, time.perf_counter(), "compute"))
            with torch.no_grad():
                for b in range(engine.num_buckets):
                    write_back_grads(engine.wait_done(b), engine.used_flags(b))
            self._sync_device()
            self._t_backward_done = time.perf_counter()

    def _sync_device(self) -> None:
        """On CUDA, synchronise before a profiling timestamp (only called while profiling)."""
        if self.root_device.type == "cuda":
            torch.cuda.synchronize(self.root_device)

    def _can_defer(self, optimizer: Optimizer) -> bool:
        lm = self.lightning_module
        return (
            (self.defer_update is True or self.defer_update == "auto" and not self._observers.grads)
            and self._phase == "run"
            and lm.automatic_optimization
            and len(self.optimizers) == 1
            and isinstance(optimizer, PER_PARAMETER_OPTIMIZERS + self.deferrable_optimizers)
            and getattr(self.precision_plugin, "scaler", None) is None
        )

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[Any, torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        if self._engine is not None:
            self._retrain_if_changed()
        if self._engine is None or not self._can_defer(optimizer):
            self._t_backward_done = None
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
            if self._engine is not None:
                self._sync_device()
                self._t_step_end = time.perf_counter()
                self._after_sync_step(self._t_step_end)
            return out
        self._check_drift()
        if self._updater is None:
            self._updater = BucketOptimizer(optimizer, self._engine.buckets)
        step = _DeferredStep(optimizer)
        rounds_before = self._engine.iteration
        self._deferring = True
        try:
            out = self.precision_plugin.optimizer_step(step, model=model or self.lightning_module, closure=closure, **kwargs)
        finally:
            self._deferring = False
        if self._engine.collecting:  # backward did not run (e.g. training_step returned None)
            self._engine.finish_backward()
        if self._engine.iteration != rounds_before:  # this step's gradients are being reduced
            self._pending = _Pending(snapshot_hparams(optimizer), step.clip, set(range(self._engine.num_buckets)))
        return out

    # ------------------------------------------------------------------ applying updates
    def _apply(self, buckets: list[int], where: str = "forward") -> None:
        pending = self._pending
        if pending is None:
            return
        engine = self._engine
        self._applying = True
        try:
            self._apply_buckets(pending, engine, buckets, where)
        finally:
            self._applying = False
        if not pending.remaining:
            self._pending = None

    def _apply_buckets(self, pending: _Pending, engine: CommEngine, buckets: list[int], where: str) -> None:
        """Wait for each bucket's all-gather and run its optimizer update (``where``: see ``update_counts``).

        ``where == "observe"``: also write the averaged (clipped) gradients to ``.grad``, as DDP shows them
        after the optimizer step.
        """
        with torch.inference_mode(False), torch.no_grad(), torch._C.DisableTorchFunction():
            for b in buckets:
                if b not in pending.remaining:
                    continue
                t0 = time.perf_counter()
                self._clip_coefficient(pending)
                bucket = engine.wait_done(b)
                t1 = time.perf_counter()
                used = engine.used_flags(b)
                self._updater.step(bucket, pending.hparams, pending.clip, pending.coef, used)
                if where == "observe":
                    write_back_grads(bucket, used)
                if self._timeline_enabled:
                    self._records.append(OpRecord(f"wait{b}", "wait", b, t0, t1, "compute"))
                    self._records.append(OpRecord(f"update{b}", "update", b, t1, time.perf_counter(), "compute"))
                pending.remaining.discard(b)
                self.update_counts[where] += 1

    def _clip_coefficient(self, pending: _Pending) -> None:
        """Clip-by-norm: the global norm from every rank's reduced shards (one scalar all-reduce on the
        default group). Computed at the start of ``training_step`` (or at a flush), a point every rank
        reaches in the same order relative to other collectives, never inside a data-dependent trigger."""
        if pending.clip is not None and pending.clip.algorithm == "norm" and pending.coef is None:
            self._engine.wait_all_reduced()
            sq = shard_sum_of_squares(self._engine.buckets, self._comm.rank)
            total = C.all_reduce_scalar(sq, self.root_device) ** 0.5
            pending.coef = clip_coefficient(total, pending.clip.value)

    def _apply_all(self, where: str) -> None:
        if self._pending is not None:
            self._apply(sorted(self._pending.remaining), where)

    def flush(self) -> None:
        """Apply every pending update now (all ranks must call it). No-op after an exception."""
        if self._aborted or self._engine is None:
            return
        trainer = getattr(self.lightning_module, "_trainer", None) if self.lightning_module is not None else None
        if trainer is not None and trainer.interrupted:
            return
        self._apply_all("flush")

    # ------------------------------------------------------------------ flush points
    def on_validation_start(self) -> None:
        self.flush()
        super().on_validation_start()

    def on_train_end(self) -> None:
        self.flush()
        super().on_train_end()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.flush()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        self.flush()
        return super().optimizer_state(optimizer)

    # ------------------------------------------------------------------ checkpoints: plan and compression state
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Add the final schedule and every rank's compression state, then let rank 0 write.

        Lightning calls this on every rank (``Trainer.save_checkpoint``), so the compression state
        of all ranks is gathered here to rank 0 with one ``all_gather_object``: a user who calls
        ``strategy.save_checkpoint`` on rank 0 only, while compressing, blocks until the process
        group's timeout. Keys: :data:`PLAN_KEY` (schedule, parameter order, owners; identical on all
        ranks) and ``compress.state.CHECKPOINT_KEY`` (``{"version", "compressor", "kwargs",
        "world_size", "per_rank"}``; per rank, per parameter name: error-feedback residual slice,
        PowerSGD ``q``, step counter). The compression state costs one fp32 copy of the model per
        rank for methods with error feedback.
        """
        self._add_resume_state(checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load as Lightning does, and keep this rank's compression state and the plan for set-up.

        Lightning loads the checkpoint before ``setup`` (``configure_ddp``), so the plan is installed
        there directly and the compression state is applied when compression starts. A checkpoint
        of another compressor or world size gives a warning naming both values, and compression
        starts with fresh state.
        """
        from lightning_pipedap.compress.state import CHECKPOINT_KEY, state_for_rank  # noqa: PLC0415

        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resume = checkpoint.get(PLAN_KEY)
        entry = checkpoint.get(CHECKPOINT_KEY)
        state, reason = state_for_rank(entry, self.compression, self.world_size, self.global_rank)
        if reason:
            rank_zero_warn(f"pipedap: {reason}; compression starts with fresh error-feedback state")
        elif state is not None and entry.get("kwargs") != self.compression_kwargs:
            rank_zero_info(f"pipedap: the checkpoint's compression_kwargs {entry.get('kwargs')} differ from this "
                           f"run's {self.compression_kwargs}; restoring the state anyway (factors of another shape "
                           "start afresh)")
        self._compression_state = state
        return checkpoint

    def _add_resume_state(self, checkpoint: dict[str, Any]) -> None:
        """Put :data:`PLAN_KEY` and the gathered compression state into ``checkpoint`` (all ranks call it)."""
        if self._engine is None or self._aborted:
            return
        self.flush()
        if self._engine.collecting:  # inside a step (a user call from training_step): the state is in flux
            return
        self._engine.wait_idle()
        if self.compression:
            from lightning_pipedap.compress.state import CHECKPOINT_KEY, checkpoint_entry  # noqa: PLC0415

            mine = self._compression_state_now(take=False)
            per_rank = C.all_gather_object(mine)
            if any(s is not None for s in per_rank):
                checkpoint[CHECKPOINT_KEY] = checkpoint_entry(per_rank, self.compression, self.compression_kwargs,
                                                              self.world_size)
        if self._phase == "run" and self._trial is None:  # mid-trial: no final plan yet, a resume plans again
            checkpoint[PLAN_KEY] = self._plan_state()

    def _param_names(self) -> dict[int, str]:
        """``id(parameter) -> name`` in the LightningModule (``"net.0.weight"``)."""
        return {id(p): n for n, p in self.lightning_module.named_parameters()}

    def _compression_layouts(self, buckets: list) -> list[list[tuple[str, tuple[int, ...]]]]:
        """Per bucket, ``(parameter name, shape)`` in buffer order: what the compression state is keyed by."""
        names = self._param_names()
        return [[(names.get(id(p), f"<parameter {i}>"), tuple(p.shape)) for i, p in zip(b.param_indices, b.params)]
                for b in buckets]

    def _engine_param_names(self) -> dict[int, tuple[str, tuple[int, ...]]]:
        """Engine parameter index -> ``(name, shape)`` of the installed engine."""
        names = self._param_names()
        return {i: (names.get(id(p), f"<parameter {i}>"), tuple(p.shape))
                for b in self._engine.buckets for i, p in zip(b.param_indices, b.params)}

    def _compression_state_now(self, take: bool) -> Optional[dict[str, Any]]:
        """This rank's compression state by parameter name: the helper's (or the kept one while no
        compressing engine runs) plus the residuals the engine still has to add to a dense gradient
        (:meth:`CommEngine.carry_to_next_gradient`). ``take``: remove those from the engine."""
        from lightning_pipedap.compress.state import add_residuals  # noqa: PLC0415

        transport = self._engine.transport
        state = transport.pipeline.state_dict() if transport is not None else self._compression_state
        carried = self._engine.take_carried(clear=take)
        if carried:
            info = self._engine_param_names()
            state = add_residuals(state, {info[i][0]: v for i, v in carried.items()},
                                  {n: s for n, s in info.values()}, self.compression, self.compression_kwargs)
        return state

    def _keep_compression_state(self) -> None:
        """Before the engine is replaced (re-plan): keep the compression state by parameter name,
        including residuals not yet added to a dense gradient."""
        if self._engine is not None and not self._aborted and self.compression:
            self._compression_state = self._compression_state_now(take=True)

    def _restore_compression_state(self) -> None:
        """After an engine is installed: hand it the kept or checkpointed compression state.

        Error-feedback residuals of parameters in buckets the new engine sends dense (warm-up and
        profiling steps, or a plan that stopped compressing them) are added once to their next
        gradient (:meth:`CommEngine.carry_to_next_gradient`; same units, local gradient / world
        size, as the compressors' residuals) and cleared from the state, so what earlier
        compressions left out reaches the other ranks exactly once. The rest goes into the helper
        (compressed buckets), or waits for the next compressing engine (step counters, PowerSGD
        factors).
        """
        from lightning_pipedap.compress.state import split_residuals  # noqa: PLC0415

        engine = self._engine
        if engine is None or self._compression_state is None or self._resume is not None:
            return  # (a checkpoint's plan is about to be installed: the state goes to that engine)
        transport = engine.transport
        info = self._engine_param_names()
        dense = {i for b in engine.buckets if transport is None or not engine.schedule.is_compressed(b.index)
                 for i in b.param_indices}
        index_of = {info[i][0]: i for i in dense}
        self._compression_state, moved = split_residuals(self._compression_state, index_of)
        if moved:
            engine.carry_to_next_gradient({index_of[n]: r for n, r in moved.items()})
            rank_zero_info(f"pipedap: error-feedback residuals of {len(moved)} parameters now sent dense are added "
                           "once to their next gradient")
        if transport is None:
            return
        state, self._compression_state = self._compression_state, None
        fresh = transport.pipeline.load_state_dict(state)
        if fresh:
            rank_zero_info(f"pipedap: no saved compression state for {len(fresh)} parameters "
                           f"({', '.join(fresh[:5])}{', ...' if len(fresh) > 5 else ''}); they start from zero")

    def _signature(self) -> list[list[Any]]:
        """``[name, shape]`` of every trainable parameter, in ``self._params`` order."""
        names = self._param_names()
        return [[names.get(id(p), f"<parameter {i}>"), list(p.shape)] for i, p in enumerate(self._params)]

    def _plan_state(self) -> dict[str, Any]:
        """The installed final schedule as plain data (``torch.load(weights_only=True)`` reads it back)."""
        modules = {id(m): n for n, m in self.lightning_module.named_modules()}
        sched = self._engine.schedule
        return {
            "version": PLAN_VERSION, "world_size": self.world_size, "schedule": self.schedule_name,
            "bucket_cap_mb": self.bucket_cap_mb, "params": self._signature(), "order": list(self._order),
            "owners": [None if o is None else modules.get(id(o)) for o in self._owners],
            "buckets": [list(b) for b in sched.buckets], "ops": [[op.kind.value, op.bucket] for op in sched.ops],
            "compressed": None if sched.compressed is None else list(sched.compressed),
            "name": sched.name, "predicted_iteration_s": sched.predicted_iteration_s,
            "no_overlap_time_s": self.no_overlap_time_s,
            "cost_model": None if self._cost_model is None else self._cost_model.to_dict(),
        }

    def _resume_plan(self) -> None:
        """Install a checkpoint's final schedule directly when it fits this run (same world size,
        parameters, schedule and fusion cap): no trace or profiling steps, so a resumed run with
        compression compresses from its first step, as the uninterrupted run did."""
        plan, self._resume = self._resume, None
        if plan is None:
            return
        mine = {"version": PLAN_VERSION, "world_size": self.world_size, "schedule": self.schedule_name,
                "bucket_cap_mb": self.bucket_cap_mb, "params": self._signature()}
        differ = [k for k, v in mine.items() if plan.get(k) != v]
        if differ:
            rank_zero_info(f"pipedap: the checkpoint's schedule does not fit this run ({', '.join(differ)} differ); "
                           "tracing and planning again")
            return
        modules = dict(self.lightning_module.named_modules())
        self._order = list(plan["order"])
        self._owners = [None if n is None else modules.get(n) for n in plan["owners"]]
        schedule = Schedule(tuple(tuple(b) for b in plan["buckets"]), tuple(Op(OpKind(k), b) for k, b in plan["ops"]),
                            plan["name"], plan["predicted_iteration_s"],
                            None if plan.get("compressed") is None else tuple(bool(c) for c in plan["compressed"]))
        if plan["cost_model"] is not None:
            self._cost_model = CostModel.from_dict(plan["cost_model"])
        self._install(self._order, schedule, self._owners, final=True)
        self.predicted_iteration_s = schedule.predicted_iteration_s
        self.no_overlap_time_s = plan["no_overlap_time_s"]
        if self._cost_model is not None:
            self._planned_busy_s = self._predicted_busy_s(self._cost_model)
        self._phase = "run"
        rank_zero_info("pipedap: resumed with the checkpoint's schedule (no trace or profiling steps)")

    # ------------------------------------------------------------------ timeline
    def compression_stats(self) -> dict[int, Any]:
        """Per-bucket :class:`~lightning_pipedap.engine.compressed.CompressionStats` of the last round ({} when not compressing)."""
        transport = self._engine.transport if self._engine is not None else None
        return dict(transport.stats) if transport is not None else {}

    @property
    def timeline_enabled(self) -> bool:
        """Record op timings (engine ops, waits on them, bucket updates) for :meth:`take_timeline`."""
        return self._timeline_enabled

    @timeline_enabled.setter
    def timeline_enabled(self, value: bool) -> None:
        self._timeline_enabled = bool(value)
        if self._engine is not None:
            self._engine.timeline_enabled = self._timeline_enabled

    def take_timeline(self) -> list[OpRecord]:
        """Return and clear the records taken while :attr:`timeline_enabled` was set.

        RS/AG/AR records (lane ``comm``) come from the communication worker; ``wait`` records are
        the time the training thread blocked on communication; ``update`` records are per-bucket
        optimizer steps. Times are ``time.perf_counter()`` seconds (host issue times on CUDA).
        """
        out, self._records = self._records, []
        if self._engine is not None:
            out = as_op_records(self._engine.take_timings()) + out
        return sorted(out, key=lambda r: r.start_s)

    # ------------------------------------------------------------------ teardown
    def on_exception(self, exception: BaseException) -> None:
        self._aborted = True
        if self._engine is not None:
            self._engine.close(abort=True)
        super().on_exception(exception)

    def teardown(self) -> None:
        if self._engine is not None and not self._aborted:
            try:
                self.flush()
            finally:
                self._engine.close()
        for h in self._hook_handles:
            h.remove()
        for m in self._wrapped_train:
            m.__dict__.pop("train", None)
        trainer = getattr(self.lightning_module, "_trainer", None) if self.lightning_module is not None else None
        if trainer is not None and self._flush_callback in trainer.callbacks:
            trainer.callbacks.remove(self._flush_callback)
        if self._orig_clip is not None:
            self.precision_plugin.clip_gradients = self._orig_clip
        comm, aborted = self._comm, self._aborted
        if self._restore_priority is not None:
            self._restore_priority()
            self._restore_priority = None
        self._reset_runtime()
        if comm is not None and not aborted:
            C.destroy_comm_group(comm)
        super().teardown()
