"""The strategy's options as one typed, validated object, declared once.

:class:`PipeDAPConfig` holds every option of :class:`~lightning_pipedap.PipeDAPStrategy` (except Lightning's own
``accelerator``, ``timeout``, ... which go to ``DDPStrategy``) in five frozen groups: :class:`ScheduleOptions`,
:class:`PlanningOptions`, :class:`TrialOptions`, :class:`CompressionOptions` and :class:`SafetyOptions`. Each option
is one field of one group, with its type, default and a docstring under it (units, valid choices); each group checks
its own ranges and choices in ``__post_init__``. Everything else derives from these fields: the flat read access
(``config.bucket_cap_mb``), the strategies' keyword arguments, the Hydra schema (``app/schema.py``), the YAML
defaults' test and docs/OPTIONS.md (``python -m lightning_pipedap.docs_options``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from lightning_pipedap.plan import PLANNERS, CostModel
from lightning_pipedap.schedule import BUILTIN_SCHEDULES

#: runtime schedule name -> planner name; a planner whose name is a fixed schedule gets "_tuned"
PLANNED = {(n if n not in BUILTIN_SCHEDULES else f"{n}_tuned"): n for n in PLANNERS}

#: options that may differ between ranks: rank 0's cost model plans for every rank; the others are local
PER_RANK_OPTIONS = ("cost_model", "cost_model_cache", "train_thread_nice", "compression_threads", "plan_cache")

DeferUpdate = Union[bool, Literal["auto"]]
CompressionMode = Literal["process", "inline"]
NonFinite = Literal["warn", "raise", "skip", "ignore"]
WireDtype = Literal["fp32", "fp16", "bf16"]
#: valid values of ``wire_dtype``
WIRE_DTYPE_CHOICES: tuple[str, ...] = ("fp32", "fp16", "bf16")
#: valid values of ``nonfinite``
NONFINITE_CHOICES: tuple[str, ...] = ("warn", "raise", "skip", "ignore")


#: smallest ``partition_mb`` (MiB): 1 KiB pieces (a 4 MiB layer in 4096); smaller pieces only multiply the
#: planner's layers (1e-9 MiB split a 1024x1024 layer into a million one-element pieces: minutes of planning)
MIN_PARTITION_MB = 1.0 / 1024


def valid_schedule_names() -> tuple[str, ...]:
    """Names accepted by ``PipeDAPStrategy(schedule=...)``: built-ins plus registered planners."""
    return tuple(BUILTIN_SCHEDULES) + tuple(PLANNED.keys())


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if value == math.inf:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _optimizer_classes(value: Any) -> tuple[type, ...]:
    """``deferrable_optimizers`` as a tuple of ``torch.optim.Optimizer`` subclasses (dotted names imported).

    Raises:
        ValueError: a value that is not a list of optimizer classes or dotted names of such classes, naming it.
    """
    import importlib  # noqa: PLC0415

    import torch  # noqa: PLC0415

    if isinstance(value, (str, type)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"deferrable_optimizers must be a list of torch.optim.Optimizer subclasses (or their dotted "
                         f"names), got {value!r}")
    out = []
    for item in value:
        cls = item
        if isinstance(item, str):
            module, _, name = item.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module), name) if module else None
            except (ImportError, AttributeError) as exc:
                raise ValueError(f"deferrable_optimizers: cannot import {item!r} ({exc})") from exc
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ValueError(f"deferrable_optimizers: {item!r} is not a torch.optim.Optimizer subclass (give the "
                             "class, or its dotted name such as 'torch.optim.SGD')")
        out.append(cls)
    return tuple(out)


def _integer(name: str, value: Any, low: int, high: Optional[int] = None, note: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        rng = (f">= {low}" if high is None else f"in {low}..{high}") + note
        raise ValueError(f"{name} must be an integer {rng}, got {value!r}")


def _boolean(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


#: ``torch_ddp_margin``'s default: DDP's reducer is kept unless a candidate measured more than 10% faster
DEFAULT_TORCH_DDP_MARGIN = 0.10
#: ``plan_trials`` of ``schedule="optimal"`` when not given: the planner's schedule, DeAR, WFBP and the next planner
DEFAULT_PLAN_TRIALS = 4


@dataclass(frozen=True)
class ScheduleOptions:
    """What runs and how the gradients travel: the schedule, its fusion, the wire format, when updates apply."""

    schedule: str = "optimal"
    """op-list planner. Fixed schedules with ``bucket_cap_mb`` fusion, no profiling: ``"dear"`` (RS in backward, AG
    before the next forward) and ``"allreduce"`` (WFBP: one all-reduce per bucket in backward). Planned schedules,
    from a profile measured during ``profile_steps`` warm-up steps and the α-β model of the live group:
    ``"optimal"``, ``"pipedap"``, ``"wfbp"``, ``"dear_tuned"`` (DeAR order, planned fusion) and ``"no_overlap"``
    (:func:`valid_schedule_names` lists all)."""

    bucket_cap_mb: float = 25.0
    """tensor-fusion cap of the fixed schedules, in MiB (> 0)."""

    defer_update: DeferUpdate = "auto"
    """``"auto"`` (default): apply each bucket's update in the next forward, where its first consumer (traced op by
    op) runs, unless user code could see the difference: with a gradient hook (``on_after_backward``,
    ``on_before_optimizer_step``, ``configure_gradient_clipping``, ``optimizer_step``, ``on_before_zero_grad``)
    overridden by the LightningModule or a callback, steps run in sync mode; before a between-step hook
    (``on_train_batch_start``/``_end``, ``on_train_epoch_start``/``_end``) that can read weights, pending updates
    are applied and ``.grad`` holds the averaged gradients (see :mod:`lightning_pipedap.observers`; the log names
    the hook). ``True``: defer regardless of hooks (the user vouches that they neither read weights nor ``.grad``).
    ``False``: sync mode always (updates at the end of backward, as DDP; RS/AG still overlap backward)."""

    warmup_steps: int = 1
    """optimizer steps run in sync mode first (>= 1); the forward order is traced during the first one and the
    buckets are rebuilt from it."""

    ring_chunk_mb: float = 2.0
    """piece size of the pipelined gloo ring reduce-scatter/all-gather, in MiB."""

    deferrable_optimizers: tuple[type, ...] = ()
    """extra optimizer classes whose ``step`` is per-parameter (safe to split by bucket), each a subclass of
    ``torch.optim.Optimizer`` or its dotted name (``"mypackage.optim.Lion"``, imported at construction); torch's
    SGD, Adam, AdamW, ... are known already."""

    wire_dtype: WireDtype = "fp32"
    """element format of fp32 gradients on the wire of the engine's dense reduce-scatter and all-gather:
    ``"fp32"`` (default, as is); ``"fp16"`` or ``"bf16"``: each ring piece is cast in the send path (no helper
    process, no extra copy of the bucket) and summed in fp32, halving the bytes; the reduced shard is rounded to the
    wire format by its owner, so every rank applies byte-identical gradients and a norm computed from the shards is
    that of the applied gradients. ``optimal`` sends a bucket 16-bit only where the α-β model predicts a shorter
    iteration (β·bytes/2; fp32 where communication is hidden anyway); the fixed planners send every bucket 16-bit.
    fp16 overflows beyond 65504 to inf (``nonfinite`` sees it); bf16 keeps fp32's range with 8 bits of mantissa.
    Not with ``compression`` (the ``"fp16"`` compressor is the helper-process form of the same idea)."""

    gradient_as_bucket_view: bool = False
    """``False`` (default): each parameter's gradient is copied (divided by the world size) into its bucket when it
    is ready, and the averaged gradient is copied back into ``.grad``. ``True`` (as DDP's option of that name):
    ``.grad`` of every parameter is a view into its bucket's flat buffer, so backward accumulates straight into the
    bucket and no second copy of the gradients exists (about one gradient's worth of memory less).
    ``zero_grad(set_to_none=True)`` detaches the views; the next backward re-points ``.grad`` at its (zeroed) view.
    A bucket that cannot be a view keeps the copy path, logged once with the reason
    (:func:`~lightning_pipedap.engine.engine.view_refusal`: a compressed or 16-bit wire bucket, a non-contiguous
    parameter). Values in ``.grad`` are the same either way."""

    shard_optimizer: Union[bool, str] = False
    """``False`` (default): every rank all-gathers the averaged gradients and runs the whole optimizer step, as
    DDP. ``True`` (ZeRO stage 2, as Megatron-Core's distributed optimizer and FSDP2 without resharding): each rank
    steps only the shard of each bucket its reduce-scatter left it, holding optimizer state for that shard only
    (Adam: 1/N of its two moment tensors), and the updated *parameters* are all-gathered before their first use in
    the next forward; same bytes on the wire. Deferred steps only (``defer_update`` not False). Element-wise
    optimizers (SGD, Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad, Adadelta, Rprop, ASGD) are sharded by
    element range; whole-tensor ones (Muon, Adafactor) by parameter ownership (each parameter stepped whole by one
    rank; shards padded to parameter boundaries); manual optimization and several optimizers (Muon + AdamW) step
    sharded in sync mode; a compressed bucket is stepped unsharded. ``optimizer.state`` raises while sharded:
    checkpoints and ``trainer.strategy.optimizer_state`` gather the full state. With ``gradient_as_bucket_view`` a
    sharded bucket keeps the copy path (after its step it holds parameters), logged once. ``"auto"``: measured plan
    selection runs the planner's schedule both sharded and unsharded among its trial candidates and keeps the
    faster (step time only: choose True for the memory); unsharded where sharding is refused (the reason logged),
    with a fixed schedule or under ``Trainer(deterministic=True)``. Trainer only (Fabric runs sync mode)."""

    sharded_checkpoint: bool = False
    """``False`` (default): a checkpoint holds the whole optimizer state, gathered on rank 0 (one file, loadable by
    ``ddp``, one process or any world size). ``True`` (with ``shard_optimizer`` True or ``"auto"``; as Lightning's
    FSDP ``state_dict_type="sharded"``): ``trainer.save_checkpoint`` and ``ModelCheckpoint`` write a directory
    through ``torch.distributed.checkpoint``, in which each rank writes its own slices of the optimizer state and
    rank 0 the model and ``meta.pt`` (loops, callbacks, hyper-parameters): nothing is gathered whole.
    ``optimizer_state(opt)`` then returns this rank's part. Any world size resumes from it (each rank reads the
    pieces its own slices overlap: re-sharded); ``ddp`` resumes after
    :func:`~lightning_pipedap.strategy.sharded_checkpoint.consolidate_sharded_checkpoint` (or ``python -m
    lightning_pipedap.consolidate DIR``) wrote one file (docs/SHARDING.md)."""

    train_thread_nice: int = 0
    """CPU training on Linux: nice-value increment (0..19) for the training thread once the communication threads
    exist, so the communication worker, gloo's I/O threads and the kernel's TCP work get the cores first when
    compute keeps every core busy (0 = off). Without ``CAP_SYS_NICE`` the thread keeps the lower priority after
    training."""

    def __post_init__(self) -> None:
        """Raises:
            ValueError: an unknown schedule, a non-positive size, a value outside its choices (named)."""
        names = valid_schedule_names()
        if self.schedule not in names:
            raise ValueError(f"unknown schedule {self.schedule!r}; valid: {', '.join(names)}")
        for name in ("bucket_cap_mb", "ring_chunk_mb"):
            _positive(name, getattr(self, name))
        _integer("warmup_steps", self.warmup_steps, 1)
        _integer("train_thread_nice", self.train_thread_nice, 0, 19, " (0 = off)")
        _boolean("gradient_as_bucket_view", self.gradient_as_bucket_view)
        if not (isinstance(self.shard_optimizer, bool) or self.shard_optimizer == "auto"):
            raise ValueError(f"shard_optimizer must be True, False or 'auto', got {self.shard_optimizer!r}")
        if self.shard_optimizer and self.defer_update is False:
            raise ValueError(f"shard_optimizer={self.shard_optimizer!r} needs deferred steps (each rank steps its "
                             "shard between the reduce-scatter and the all-gather); got defer_update=False: use "
                             "defer_update='auto' or True")
        _boolean("sharded_checkpoint", self.sharded_checkpoint)
        if self.sharded_checkpoint and not self.shard_optimizer:
            raise ValueError("sharded_checkpoint=True writes each rank's shard of the optimizer state, which needs "
                             f"shard_optimizer=True or 'auto'; got shard_optimizer={self.shard_optimizer!r}: pass "
                             "shard_optimizer=True, or sharded_checkpoint=False (one file, the state gathered)")
        if not isinstance(self.wire_dtype, str) or self.wire_dtype not in WIRE_DTYPE_CHOICES:
            raise ValueError(f"wire_dtype must be one of {', '.join(map(repr, WIRE_DTYPE_CHOICES))}, "
                             f"got {self.wire_dtype!r}")
        if self.defer_update not in ("auto", True, False) or type(self.defer_update) is int:
            raise ValueError(f"defer_update must be 'auto', True or False, got {self.defer_update!r}")
        object.__setattr__(self, "deferrable_optimizers", _optimizer_classes(self.deferrable_optimizers))
        object.__setattr__(self, "bucket_cap_mb", float(self.bucket_cap_mb))
        object.__setattr__(self, "ring_chunk_mb", float(self.ring_chunk_mb))

    @property
    def planned(self) -> bool:
        """Whether the schedule is planned from a profile (not one of the fixed built-ins)."""
        return self.schedule not in BUILTIN_SCHEDULES


@dataclass(frozen=True)
class PlanningOptions:
    """How a planned schedule is made and kept: the profile, the α-β cost model, partitioning, the plan cache and
    re-planning on drift. Unused by the fixed schedules (``"dear"``, ``"allreduce"``)."""

    profile_steps: int = 3
    """sync-mode steps whose per-layer forward/backward times are measured (median) before a planned schedule is
    computed (>= 1)."""

    cost_model: Optional[Union[str, CostModel]] = None
    """α-β model for planning: a JSON file written by ``CostModel.save``, a
    :class:`~lightning_pipedap.plan.CostModel`, or ``None`` to measure RS/AG/AR on the live process group (a few
    seconds; cached per backend, world size and hosts)."""

    cost_model_cache: bool = True
    """read/write the measured model from ``$PIPEDAP_CACHE_DIR`` (default ``~/.cache/lightning_pipedap``)."""

    calibrate_cost_model: bool = True
    """before the first plan, compare the engine's measured communication busy time during the profiling steps
    (communication running beside compute, as in training) with the α-β prediction for the same operations, and
    when it is > 5% slower scale α and β by that ratio (the micro-benchmark runs on idle cores; gloo's threads and
    the ring's additions slow down when they share the cores with compute). Not applied to a ``cost_model`` passed
    in by the user."""

    model_contention: bool = True
    """before the first plan, measure how much communication and compute slow each other down when they overlap
    (:func:`~lightning_pipedap.probe.slowdown.measure_contention`, ~1 s: a matmul load and an 8 MiB all-reduce,
    alone and together) and predict iteration times with the contention-aware simulator
    (:func:`~lightning_pipedap.plan.contention.simulate_contended`); the planners still search with the plain α-β
    simulator. :attr:`contention` holds the fit."""

    partition_mb: Optional[float] = None
    """tensor partitioning for planned schedules (ByteScheduler, SOSP 2019; PipeDAP TETC 2025 §IV-C): None
    (default) = off; a number > 0 = also plan on the profile whose layers larger than ``partition_mb`` MiB are split
    into pieces of at most that size (:func:`~lightning_pipedap.plan.partition.partition_profile`; a piece is an
    element range of a parameter, :attr:`~lightning_pipedap.schedule.Schedule.pieces`), and keep that plan when its
    predicted iteration time is lower than the unpartitioned plan's by more than 1% (both predictions are logged;
    with ``plan_trials > 1`` both are trial candidates). A layer's gradient is ready whole and its forward needs it
    whole, so pieces help only by ordering part of a large layer's communication apart from the rest (often ~0, see
    docs/PLANNERS.md). Not used with ``compression`` (a compressor works on whole parameters) nor by the fixed
    schedules (``"allreduce"``, ``"dear"``)."""

    plan_cache: Union[bool, str] = True
    """remember the plan a measured selection chose, across runs (:mod:`~lightning_pipedap.strategy.plan_cache`):
    ``True`` (default) in the default directory (``$PIPEDAP_PLAN_CACHE`` if set, where ``off``/``0``/``false``
    turns the default off; else ``$PIPEDAP_CACHE_DIR/plans``, default ``~/.cache/lightning_pipedap/plans``),
    ``False`` off, or a directory path. A run whose key (model in traced order, world size and layout, backend,
    device, link, optimizer classes, the options that change the plan, versions) matches an entry installs its
    candidate right after the trace step, with no profiling and no trials, and verifies it over a trial window:
    slower than recorded by more than ``replan_margin`` in each of ``trial_rounds`` (at least 2) windows, it
    selects again (and remembers the new choice). Rank 0 reads and writes; an unwritable directory is one
    warning."""

    replan_margin: float = 0.15
    """re-profile and re-plan when the measured step time (lower quartile of the last ``replan_every`` steps) is
    slower than the chosen candidate measured in its trial (or, without trials, than the prediction) by more than
    this fraction; a faster run never re-plans, nor does one under ``torch_ddp``; at most ``max_replans`` times.
    When the engine's measured communication busy time exceeds the α-β prediction for the schedule by > 5%, α and
    β are scaled by that ratio first."""

    replan_every: int = 50
    """deferred steps between drift checks (>= 2)."""

    max_replans: int = 1
    """re-plans per fit (>= 0)."""

    def __post_init__(self) -> None:
        """Raises:
            ValueError: a value out of range or of the wrong type, a ``cost_model`` file that does not exist, a
                ``plan_cache`` that is not a switch or a directory (named)."""
        _positive("replan_margin", self.replan_margin)
        for name, low in (("profile_steps", 1), ("replan_every", 2), ("max_replans", 0)):
            _integer(name, getattr(self, name), low)
        for name in ("calibrate_cost_model", "model_contention", "cost_model_cache"):
            _boolean(name, getattr(self, name))
        if self.partition_mb is not None:
            if isinstance(self.partition_mb, bool) or not isinstance(self.partition_mb, numbers.Real) \
                    or not MIN_PARTITION_MB <= float(self.partition_mb) < float("inf"):
                raise ValueError(f"partition_mb must be None (off) or a finite number of MiB >= 1/1024 = "
                                 f"{MIN_PARTITION_MB!r} (1 KiB; split layers larger than that before planning, e.g. "
                                 f"4), got {self.partition_mb!r}")
            object.__setattr__(self, "partition_mb", float(self.partition_mb))
        if self.cost_model is not None and not isinstance(self.cost_model, (str, CostModel)):
            raise ValueError(f"cost_model must be a path to a cost-model JSON file, a CostModel or None, "
                             f"got {self.cost_model!r}")
        if isinstance(self.cost_model, str) and not os.path.isfile(self.cost_model):
            raise ValueError(f"cost_model={self.cost_model!r}: no such file (a JSON file written by CostModel.save; "
                             "or None to measure the α-β model on the live group)")
        self._check_plan_cache()
        object.__setattr__(self, "replan_margin", float(self.replan_margin))

    def _check_plan_cache(self) -> None:
        """``plan_cache``: True, False or a directory path (a path-like becomes a ``str``).

        Raises:
            ValueError: another type, an empty path, or a path that names an existing file.
        """
        value = self.plan_cache
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
            object.__setattr__(self, "plan_cache", value)
        if not isinstance(value, (bool, str)) or value == "":
            raise ValueError(f"plan_cache must be True (remember selected plans in the default directory: "
                             "$PIPEDAP_CACHE_DIR/plans, default ~/.cache/lightning_pipedap/plans), False (off) or a "
                             f"directory path, got {value!r}")
        if isinstance(value, str) and value.strip().lower() in ("off", "on", "true", "false", "yes", "no", "none",
                                                                "null", "0", "1"):
            raise ValueError(f"plan_cache={value!r} reads like a switch, not a directory: pass False to turn the plan "
                             "cache off, True for the default directory, or a directory path")
        if isinstance(value, str) and os.path.exists(os.path.expanduser(value)) \
                and not os.path.isdir(os.path.expanduser(value)):
            raise ValueError(f"plan_cache={value!r} is a file; give a directory for the plan cache (created if "
                             "missing), True for the default one, or False (off)")


@dataclass(frozen=True)
class TrialOptions:
    """Measured plan selection of the planned schedules: how many candidates, how long each is measured, the
    start-up budget, and the ``torch_ddp`` candidate (PyTorch DDP's own reducer)."""

    plan_trials: Optional[int] = None
    """measured plan selection, for planned schedules without compression. ``None`` (default): 4 for
    ``schedule="optimal"`` (the default: the fastest by measurement), 1 for a named planner (``"pipedap"``,
    ``"wfbp"``, ``"dear_tuned"``, ``"no_overlap"``: the schedule you name is the schedule that runs); read
    ``PipeDAPConfig.plan_trials`` for the resolved number. An integer > 1: after planning, run up to this many
    candidate schedules (the planner's, DeAR and WFBP with ``bucket_cap_mb`` fusion, then the other planners; see
    :func:`~lightning_pipedap.plan.candidates.trial_candidates`), plus ``torch_ddp`` when enabled, for
    ``trial_steps`` measured steps each (plus one settling step), in ``trial_rounds`` interleaved rounds, and keep
    the one with the lowest measured step time on rank 0 (each window's lower quartile, median over the rounds;
    :func:`~lightning_pipedap.strategy.controller.choose_candidate`): ``torch_ddp`` is kept unless another candidate
    is faster by more than 10%, and candidates within noise of the fastest are decided by trial order, so that
    reruns pick the same. 1 = install the planner's schedule directly. The α-β model does not see the CPU that
    communication takes from compute, so the model's favourite can be slower than a coarser plan (see
    docs/PLANNERS.md). Results: :attr:`trial_results`."""

    trial_steps: int = 3
    """measured steps per candidate and round (>= 1), at least."""

    trial_rounds: int = 2
    """interleaved rounds over the candidates (>= 1): with 2, every candidate is measured twice, a burst of load on
    a shared machine hits one round of one candidate, and the spread of its two rounds is the noise the choice
    allows for."""

    trial_window_s: float = 0.25
    """shortest measured window per candidate and round (s, >= 0): short steps are measured over
    ``ceil(trial_window_s / step)`` steps (at most 50), the step time being the plan's no-overlap time, so that
    their median is stable on a noisy machine. 0 = exactly ``trial_steps``."""

    startup_budget: Optional[float] = 0.1
    """fraction in (0, 1] of the fit's optimizer steps (Lightning's ``Trainer.estimated_stepping_batches``) that one
    selection may take: trace, profiling and measured plan selection, and again each drift re-plan. Trial windows
    are shortened to fit it (at least 2 measured steps each); when it runs out, the fastest candidate measured so
    far is installed, and the log and the summary say so. 0.1 (default): trials cut to 10% of a short fit (the
    trace and profile steps are not cut: a fit of a few dozen steps spends more).
    None: no budget (also when the fit's length is unknown, e.g. ``max_epochs=-1`` or Fabric)."""

    torch_ddp_candidate: bool = True
    """measure PyTorch's own ``DistributedDataParallel`` reducer (WFBP all-reduce inside backward, ``bucket_cap_mb``
    buckets) among the trial candidates and, when it is the fastest, train the rest of the fit under it
    (:mod:`~lightning_pipedap.strategy.handover`): on a small or compute-bound model, where communication is
    negligible, pipedap's per-step bookkeeping then costs nothing. Not offered with compression,
    ``nonfinite="raise"``/``"skip"`` or ``check_params_every_n_steps`` (they need pipedap's own reduction); under
    it, non-finite gradients behave exactly as under DDP and ``nonfinite="warn"`` checks the parameters after every
    step (a non-finite update leaves them non-finite) instead of each step's reduced gradients."""

    torch_ddp_margin: float = DEFAULT_TORCH_DDP_MARGIN
    """fraction in [0, 1): the ``torch_ddp`` candidate is kept unless another candidate measured faster than it by
    more than this (0.10: more than 10%), in the first pass and in the confirmation rounds. The default protects
    against trial windows that mislead on a shared, noisy machine; on a quiet dedicated cluster a smaller margin
    (0.03-0.05) lets a schedule that is a few percent faster displace DDP's reducer."""

    find_unused_parameters: Optional[bool] = None
    """DDP's option of that name, for the ``torch_ddp`` candidate (pipedap's own engine needs none: it reduces
    used-flags with the buckets). ``None`` (default): the candidate runs with it, so a parameter that gets no
    gradient on some ranks in some step (a head run only ``if positives.any()``) never stops training after DDP's
    reducer was installed; it costs DDP one more small all-reduce per step, which the trials measure. ``True``: the
    same, as ``DDPStrategy(find_unused_parameters=True)``. ``False``: you vouch that every trainable parameter gets
    a gradient on every rank in every step (as DDP's default requires): one collective less per step; the option is
    still set when a profiled or trial step left a parameter without a gradient, and a parameter that stops getting
    one on some ranks later stops the fit with an error naming it (as DDP would)."""

    def __post_init__(self) -> None:
        """Raises:
            ValueError: a count, window, fraction or switch out of range or of the wrong type (named)."""
        if isinstance(self.trial_window_s, bool) or not isinstance(self.trial_window_s, (int, float)) \
                or not 0 <= self.trial_window_s < float("inf"):
            raise ValueError(f"trial_window_s must be a finite number of seconds >= 0, got {self.trial_window_s!r}")
        object.__setattr__(self, "trial_window_s", float(self.trial_window_s))
        if isinstance(self.torch_ddp_margin, bool) or not isinstance(self.torch_ddp_margin, numbers.Real) \
                or not 0 <= self.torch_ddp_margin < 1:
            raise ValueError(f"torch_ddp_margin must be a fraction in [0, 1) (0.10 = another candidate must be more "
                             f"than 10% faster than DDP's reducer), got {self.torch_ddp_margin!r}")
        object.__setattr__(self, "torch_ddp_margin", float(self.torch_ddp_margin))
        if self.plan_trials is not None:
            _integer("plan_trials", self.plan_trials, 1, note=" or None (4 for 'optimal', 1 for a named planner)")
        for name in ("trial_steps", "trial_rounds"):
            _integer(name, getattr(self, name), 1)
        _boolean("torch_ddp_candidate", self.torch_ddp_candidate)
        if self.startup_budget is not None:
            if isinstance(self.startup_budget, bool) or not isinstance(self.startup_budget, numbers.Real) \
                    or not 0 < self.startup_budget <= 1:
                raise ValueError(f"startup_budget must be None (no budget) or a fraction in (0, 1] of the fit's "
                                 f"optimizer steps (0.1 = at most 10% for trace, profiling and trials), got "
                                 f"{self.startup_budget!r}")
            object.__setattr__(self, "startup_budget", float(self.startup_budget))
        if self.find_unused_parameters is not None and not isinstance(self.find_unused_parameters, bool):
            raise ValueError(f"find_unused_parameters must be None (default: set for DDP's reducer), True or False, "
                             f"got {self.find_unused_parameters!r}")


@dataclass(frozen=True)
class CompressionOptions:
    """Gradient compression (docs/COMPRESSION.md): the method, its arguments and where it runs."""

    compression: Optional[str] = None
    """gradient compressor (``"fp16"``, ``"powersgd"``, ``"topk"``, ...; see
    :func:`lightning_pipedap.compress.valid_compressor_names`) with error feedback where the method needs it, once
    the final schedule runs; None = dense."""

    compression_kwargs: dict[str, Any] = field(default_factory=dict)
    """the compressor's keyword arguments (``{"rank": 4}`` for PowerSGD)."""

    compression_mode: CompressionMode = "process"
    """``"process"``: a per-rank helper process compresses each bucket as soon as its gradients are complete
    (PipeCompress, ICC 2022); ``"inline"``: in the communication worker, at the bucket's slot in the op list."""

    compression_threads: int = 1
    """torch threads of the helper process (>= 1)."""

    def __post_init__(self) -> None:
        """Raises:
            ValueError: an unknown method, keyword arguments the method does not take, a mode or arguments without
                a method (named, with the valid choices)."""
        _integer("compression_threads", self.compression_threads, 1)
        if self.compression is None and (self.compression_kwargs or self.compression_mode != "process"):
            raise ValueError(f"compression_kwargs={self.compression_kwargs!r} / compression_mode="
                             f"{self.compression_mode!r} need a compression method; set compression= to one of the "
                             "valid names")
        object.__setattr__(self, "compression_kwargs", dict(self.compression_kwargs or {}))
        if self.compression is not None:
            from lightning_pipedap.compress import get_compressor, valid_compressor_names  # noqa: PLC0415

            if self.compression not in valid_compressor_names():
                raise ValueError(f"unknown compression {self.compression!r}; valid: "
                                 f"{', '.join(valid_compressor_names())}")
            get_compressor(self.compression, **self.compression_kwargs)  # validates the keyword arguments
            if self.compression_mode not in ("process", "inline"):
                raise ValueError(f"compression_mode must be 'process' or 'inline', got {self.compression_mode!r}")


@dataclass(frozen=True)
class SafetyOptions:
    """Timeouts and numerical checks: what a hang, a NaN or diverged parameters do."""

    wait_timeout_s: float = 300.0
    """timeout in seconds of every wait on communication (and of every collective on the dedicated process group);
    errors name the operation."""

    nonfinite: NonFinite = "warn"
    """what a step whose *averaged* gradients hold NaN or inf does. The decision is taken from the reduced buckets,
    which are identical on every rank (a NaN on one rank is in the reduced sum of all), so every rank decides alike
    with no extra collective. ``"warn"`` (default): log once on rank 0 (step and first parameter named) and apply
    the update as DDP does. ``"raise"``: every rank raises
    :class:`~lightning_pipedap.strategy.nonfinite.NonFiniteGradientError` naming the step, the bucket and the first
    parameter, before any of that step's update is applied. ``"skip"``: the whole optimizer step is skipped on every
    rank (parameters and optimizer state unchanged, as AMP's ``GradScaler`` skips a step), logged on rank 0.
    ``"ignore"``: no check (no cost). The check reads the reduced gradients once per step. In deferred mode
    ``"raise"`` and ``"skip"`` wait for every bucket's all-gather before the first bucket of the step is applied
    (the all-gathers still overlap the gap between steps, no longer the next forward). With an fp16 ``GradScaler``
    the scaler's own skip applies (scaled gradients overflow by design) and the check is off."""

    check_params_every_n_steps: Optional[int] = None
    """debug option: every N optimizer steps (at the start of the next step, pending updates applied first) every
    rank hashes each trainable parameter's bytes and the hashes are compared across ranks (one
    ``all_gather_object``); on a difference every rank raises
    :class:`~lightning_pipedap.strategy.nonfinite.ParameterDivergenceError` naming the first diverging parameter and
    the ranks. Costs one read of the parameters (a device-to-host copy on CUDA) every N steps. None (default) = off;
    else an integer >= 1."""

    def __post_init__(self) -> None:
        """Raises:
            ValueError: a timeout that is not a positive finite number, an unknown ``nonfinite``, a bad interval."""
        _positive("wait_timeout_s", self.wait_timeout_s)
        if self.wait_timeout_s == float("inf"):
            raise ValueError("wait_timeout_s must be finite (seconds), got inf")
        if not isinstance(self.nonfinite, str) or self.nonfinite not in NONFINITE_CHOICES:
            raise ValueError(f"nonfinite must be one of {', '.join(map(repr, NONFINITE_CHOICES))}, "
                             f"got {self.nonfinite!r}")
        if self.check_params_every_n_steps is not None:
            _integer("check_params_every_n_steps", self.check_params_every_n_steps, 1, note=" or None (off)")
        object.__setattr__(self, "wait_timeout_s", float(self.wait_timeout_s))


@dataclass(frozen=True, init=False)
class PipeDAPConfig:
    """Every option of :class:`~lightning_pipedap.PipeDAPStrategy`, in five groups (validated once, there).

    Each option is declared once, as a field of its group with a docstring under it; docs/OPTIONS.md, the Hydra
    schema (``app/schema.py``) and the strategies' keyword arguments derive from these declarations.

    Build it from groups, from options by name, or both (the named options are applied over the groups)::

        PipeDAPConfig(schedule="dear", bucket_cap_mb=4.0)
        PipeDAPConfig(trials=TrialOptions(plan_trials=2), torch_ddp_margin=0.05)

    Every option is also readable by its own name (``config.bucket_cap_mb`` is ``config.scheduling.bucket_cap_mb``;
    read-only: the config is frozen), and :attr:`plan_trials` reads the resolved number of trials.

    Attributes:
        scheduling: :class:`ScheduleOptions`: what runs and how gradients travel.
        planning: :class:`PlanningOptions`: profile, cost model, plan cache, re-planning.
        trials: :class:`TrialOptions`: measured plan selection and the ``torch_ddp`` candidate.
        gradient_compression: :class:`CompressionOptions`: the compressor.
        safety: :class:`SafetyOptions`: timeouts and numerical checks.

    Raises:
        ValueError: any value out of range or not among the choices; the message names the option and the valid
            values. Also ``wire_dtype`` 16-bit together with ``compression`` (they exclude each other).
        TypeError: an unknown option name (the valid ones are named), or a group of the wrong class.
    """

    scheduling: ScheduleOptions = field(default_factory=ScheduleOptions)
    planning: PlanningOptions = field(default_factory=PlanningOptions)
    trials: TrialOptions = field(default_factory=TrialOptions)
    gradient_compression: CompressionOptions = field(default_factory=CompressionOptions)
    safety: SafetyOptions = field(default_factory=SafetyOptions)

    def __init__(self, scheduling: Optional[ScheduleOptions] = None, planning: Optional[PlanningOptions] = None,
                 trials: Optional[TrialOptions] = None, gradient_compression: Optional[CompressionOptions] = None,
                 safety: Optional[SafetyOptions] = None, **options: Any) -> None:
        unknown = sorted(set(options) - set(OPTION_GROUP))
        if unknown:
            raise TypeError(f"PipeDAPConfig got unknown options {unknown}; valid: {', '.join(OPTION_GROUP)}")
        given = {"scheduling": scheduling, "planning": planning, "trials": trials,
                 "gradient_compression": gradient_compression, "safety": safety}
        for name, cls in self.groups().items():
            group, mine = given[name], {k: v for k, v in options.items() if OPTION_GROUP[k] == name}
            if group is not None and not isinstance(group, cls):
                raise TypeError(f"PipeDAPConfig: {name} must be a {cls.__name__} or None, got {group!r}")
            if group is None or mine:
                group = dataclasses.replace(group, **mine) if group is not None else cls(**mine)
            object.__setattr__(self, name, group)
        if self.wire_dtype != "fp32" and self.compression is not None:
            raise ValueError(f"wire_dtype={self.wire_dtype!r} and compression={self.compression!r} exclude each other: "
                             "choose the 16-bit wire format (cast in the ring, per bucket) or a compressor")

    @classmethod
    def groups(cls) -> dict[str, type]:
        """``{attribute: group class}`` in declaration order (``{"scheduling": ScheduleOptions, ...}``)."""
        return {f.name: f.default_factory for f in dataclasses.fields(cls)}  # type: ignore[misc]

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """Every option, group by group, each group in declaration order."""
        return tuple(OPTION_GROUP)

    @classmethod
    def option_fields(cls) -> list[tuple[str, dataclasses.Field]]:
        """``(group attribute, field)`` of every option, in :meth:`option_names` order (the one declaration)."""
        return [(g, f) for g, group in cls.groups().items() for f in dataclasses.fields(group)]

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """``{option: default}`` (a fresh value where the default is a factory)."""
        return {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
                for _, f in cls.option_fields()}

    def options(self) -> dict[str, Any]:
        """``{option: value}`` of every option as given (``plan_trials`` unresolved), flat; ``PipeDAPConfig(**x)``
        rebuilds an equal config."""
        return {f.name: getattr(getattr(self, g), f.name) for g, f in self.option_fields()}

    def replace(self, **options: Any) -> PipeDAPConfig:
        """A copy with the named options changed (validated again).

        Raises:
            TypeError, ValueError: as the constructor.
        """
        return PipeDAPConfig(**{g: getattr(self, g) for g in self.groups()}, **options)

    @property
    def plan_trials(self) -> Optional[int]:
        """The number of measured candidates: ``trials.plan_trials``, or when that is None, 4
        (:data:`DEFAULT_PLAN_TRIALS`) for ``schedule="optimal"``, 1 for a named planner, None for a fixed schedule."""
        given = self.trials.plan_trials
        if given is None and self.planned:  # ("optimal" selects by measurement; a named planner runs)
            return DEFAULT_PLAN_TRIALS if self.schedule == "optimal" else 1
        return given

    @property
    def planned(self) -> bool:
        """Whether the schedule is planned from a profile (not one of the fixed built-ins)."""
        return self.scheduling.planned

    def signature(self) -> list[tuple[str, str]]:
        """``(option, repr(value))`` of every option that must be the same on every rank (compared at set-up):
        all but :data:`PER_RANK_OPTIONS`. Dicts are sorted by key, classes named by module and qualified name."""
        out = []
        for name in self.option_names():
            if name in PER_RANK_OPTIONS:
                continue
            value = getattr(self, name)
            if isinstance(value, dict):
                value = dict(sorted(value.items()))
            elif name == "deferrable_optimizers":
                value = tuple(f"{c.__module__}.{c.__qualname__}" for c in value)
            out.append((name, repr(value)))
        return out

    def ignored_options(self) -> list[str]:
        """Sentences (``pipedap: ...``) naming the options set here that this configuration does not use, for
        the log at the start of a fit: trial settings changed from their defaults under a fixed schedule
        (measured plan selection runs for planned schedules only), and ``torch_ddp_candidate=True`` where
        the ``torch_ddp`` candidate is not trialled (a 16-bit ``wire_dtype``: DDP's reducer sends fp32;
        ``nonfinite="raise"``/``"skip"`` or ``check_params_every_n_steps``: they need pipedap's reduction), and
        ``partition_mb`` under a fixed schedule or with compression (neither is partitioned)."""
        defaults = self.defaults()
        out = []
        if not self.planned:
            changed = [f"{n}={getattr(self, n)!r}" for n in ("plan_trials", "trial_steps", "trial_rounds",
                                                               "trial_window_s") if getattr(self, n) != defaults[n]]
            if changed:
                out.append(f"pipedap: {', '.join(changed)} not used: schedule {self.schedule!r} is fixed, and measured "
                           f"plan selection runs only for the planned schedules ({', '.join(sorted(PLANNED))})")
        elif self.torch_ddp_candidate and self.plan_trials > 1 and self.compression is None:
            why = []
            if self.wire_dtype != "fp32":
                why.append(f"wire_dtype={self.wire_dtype!r} (DDP's reducer sends fp32: set wire_dtype='fp32' to "
                           "measure it)")
            if self.nonfinite in ("raise", "skip"):
                why.append(f"nonfinite={self.nonfinite!r} (it needs pipedap's own reduction)")
            if self.check_params_every_n_steps:
                why.append("check_params_every_n_steps (it needs pipedap's own reduction)")
            if why:
                out.append("pipedap: torch_ddp_candidate=True not used: the torch_ddp candidate (DDP's reducer) is "
                           f"not trialled with {' and '.join(why)}")
        untrialled = [why for bad, why in (
            (not self.planned, f"schedule {self.schedule!r} is fixed"),
            (not self.torch_ddp_candidate, "torch_ddp_candidate=False"),
            (self.planned and (self.plan_trials or 1) < 2, f"plan_trials={self.plan_trials}"),
            (self.compression is not None, f"compression={self.compression!r}"),
            (self.wire_dtype != "fp32", f"wire_dtype={self.wire_dtype!r}"),
            (self.nonfinite in ("raise", "skip"), f"nonfinite={self.nonfinite!r}"),
            (bool(self.check_params_every_n_steps), "check_params_every_n_steps is set")) if bad]
        if self.torch_ddp_margin != defaults["torch_ddp_margin"] and untrialled:
            out.append(f"pipedap: torch_ddp_margin={self.torch_ddp_margin!r} not used: the torch_ddp candidate is not "
                       f"trialled here ({', '.join(untrialled)})")
        if self.partition_mb is not None and (not self.planned or self.compression is not None):
            why = (f"schedule {self.schedule!r} is fixed (only planned schedules are partitioned)" if not self.planned
                   else f"compression={self.compression!r} is set (a compressor works on whole parameters)")
            out.append(f"pipedap: partition_mb={self.partition_mb:g} not used: {why}")
        return out

    def what_runs(self) -> str:
        """What ``schedule`` means with these options, in words, for the first line of a fit's log: the schedule
        named is the schedule that runs, except ``"optimal"`` (the default), which measures candidates."""
        if not self.planned:
            fixed = {"dear": "reduce-scatter in backward, all-gather before the next forward",
                     "allreduce": "WFBP, one all-reduce per bucket in backward"}.get(self.schedule, "fixed")
            return (f"asked for schedule {self.schedule!r}: the fixed schedule "
                    f"({fixed}, {self.bucket_cap_mb:g} MiB buckets), "
                    "no profiling or trials")
        if (self.plan_trials or 1) > 1 and self.compression is None:
            return (f"asked for schedule {self.schedule!r}: the fastest, measured in trials, "
                    f"of up to {self.plan_trials} planned "
                    "candidates" + (" and DDP's own reducer" if self.torch_ddp_candidate else "")
                    + " (the plan below says which runs)")
        return (f"asked for schedule {self.schedule!r}: the {PLANNED[self.schedule]} planner's plan "
                "from a profile of the first "
                f"steps{', compressed' if self.compression else ''}, no trials")


#: option name -> the :class:`PipeDAPConfig` attribute of its group (``"bucket_cap_mb" -> "scheduling"``)
OPTION_GROUP: dict[str, str] = {f.name: g for g, f in PipeDAPConfig.option_fields()}


def _flat_reader(group: str, name: str) -> property:
    def read(self: PipeDAPConfig) -> Any:
        return getattr(getattr(self, group), name)

    read.__doc__ = f"``{group}.{name}`` (read-only)."
    return property(read)


for _name, _group in OPTION_GROUP.items():  # the flat read access; plan_trials has its own (resolved) property
    if _name not in vars(PipeDAPConfig):
        assert not hasattr(PipeDAPConfig, _name), f"option {_name!r} would shadow PipeDAPConfig.{_name}"
        setattr(PipeDAPConfig, _name, _flat_reader(_group, _name))
del _name, _group


def build_config(config: Optional[PipeDAPConfig], explicit: dict[str, Any], options: dict[str, Any],
                 owner: str = "PipeDAPStrategy") -> PipeDAPConfig:
    """The config a strategy runs with: ``config`` (None: every default) with ``options`` applied over it, and the
    strategy's ``explicit`` keyword parameters (``{option: value}``) that differ from their defaults (a parameter
    left at its default cannot be told from one not given, so it keeps ``config``'s value).

    Raises:
        TypeError: ``config`` is not a :class:`PipeDAPConfig` (naming ``owner`` and the value), or an unknown
            option.
        ValueError: an option out of range (as :class:`PipeDAPConfig`).
    """
    if config is None:
        return PipeDAPConfig(**explicit, **options)
    if not isinstance(config, PipeDAPConfig):
        raise TypeError(f"{owner}: config must be a PipeDAPConfig or None, got {config!r} ({type(config).__name__}); "
                        "pass the options by keyword (schedule='dear', ...)")
    defaults = PipeDAPConfig.defaults()
    changed = {k: v for k, v in explicit.items() if type(v) is not type(defaults[k]) or v != defaults[k]}
    return config.replace(**changed, **options) if changed or options else config
