"""The strategy's options as one typed, validated object.

:class:`PipeDAPConfig` holds every option of :class:`~lightning_pipedap.PipeDAPStrategy` (except
Lightning's own ``accelerator``, ``timeout``, ... which go to ``DDPStrategy``). Each range and choice
is checked once, in ``__post_init__``; the Hydra schema (``app/schema.py``) validates through it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from lightning_pipedap.plan import PLANNERS, CostModel
from lightning_pipedap.schedule import BUILTIN_SCHEDULES

#: runtime schedule name -> planner name; a planner whose name is a fixed schedule gets "_tuned"
PLANNED = {(n if n not in BUILTIN_SCHEDULES else f"{n}_tuned"): n for n in PLANNERS}

DeferUpdate = Union[bool, Literal["auto"]]
CompressionMode = Literal["process", "inline"]


def valid_schedule_names() -> tuple[str, ...]:
    """Names accepted by ``PipeDAPStrategy(schedule=...)``: built-ins plus registered planners."""
    return tuple(BUILTIN_SCHEDULES) + tuple(PLANNED.keys())


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _integer(name: str, value: Any, low: int, high: Optional[int] = None, note: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        rng = (f">= {low}" if high is None else f"in {low}..{high}") + note
        raise ValueError(f"{name} must be an integer {rng}, got {value!r}")


def _boolean(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


@dataclass(frozen=True)
class PipeDAPConfig:
    """Options of :class:`~lightning_pipedap.PipeDAPStrategy`; see its docstring for the full meaning.

    Attributes:
        schedule: op-list planner, one of :func:`valid_schedule_names`.
        bucket_cap_mb: tensor-fusion cap of the fixed schedules (MiB, > 0).
        defer_update: ``"auto"``, True or False (deferred updates and the hooks that observe them).
        warmup_steps: sync steps first (>= 1); the forward is traced in the first.
        wait_timeout_s: timeout of every wait on communication (s, > 0).
        ring_chunk_mb: piece size of the gloo ring RS/AG (MiB, > 0).
        deferrable_optimizers: extra per-parameter optimizer classes (safe to step bucket by bucket).
        profile_steps: planned schedules: profiled sync steps (>= 1).
        cost_model: α-β model (JSON path or ``CostModel``), None = measure on the live group.
        cost_model_cache: cache the measured model in ``~/.cache/lightning_pipedap``.
        replan_margin: relative drift of the measured iteration time that re-plans (> 0).
        calibrate_cost_model: scale α-β by the profiling steps' measured/predicted busy time.
        train_thread_nice: CPU: nice increment of the training thread (0..19, 0 = off).
        replan_every: deferred steps between drift checks (>= 2).
        max_replans: re-plans per fit (>= 0).
        compression: compressor name (see ``lightning_pipedap.compress``) or None.
        compression_kwargs: the compressor's keyword arguments.
        compression_mode: ``"process"`` (helper process, pipelined) or ``"inline"``.
        compression_threads: torch threads of the helper (>= 1).
        plan_trials: candidates measured by plan selection (>= 1; 1 = install the plan).
        trial_steps: measured steps per candidate (>= 1).
        model_contention: measure the communication/compute contention before planning.

    Raises:
        ValueError: any value out of range or not among the choices; the message names the option
            and the valid values.
    """

    schedule: str = "optimal"
    bucket_cap_mb: float = 25.0
    defer_update: DeferUpdate = "auto"
    warmup_steps: int = 1
    wait_timeout_s: float = 300.0
    ring_chunk_mb: float = 2.0
    deferrable_optimizers: tuple[type, ...] = ()
    profile_steps: int = 3
    cost_model: Optional[Union[str, CostModel]] = None
    cost_model_cache: bool = True
    replan_margin: float = 0.15
    calibrate_cost_model: bool = True
    train_thread_nice: int = 0
    replan_every: int = 50
    max_replans: int = 1
    compression: Optional[str] = None
    compression_kwargs: dict[str, Any] = field(default_factory=dict)
    compression_mode: CompressionMode = "process"
    compression_threads: int = 1
    plan_trials: int = 4
    trial_steps: int = 3
    model_contention: bool = True

    def __post_init__(self) -> None:
        names = valid_schedule_names()
        if self.schedule not in names:
            raise ValueError(f"unknown schedule {self.schedule!r}; valid: {', '.join(names)}")
        for name in ("bucket_cap_mb", "wait_timeout_s", "ring_chunk_mb", "replan_margin"):
            _positive(name, getattr(self, name))
        if self.wait_timeout_s == float("inf"):
            raise ValueError("wait_timeout_s must be finite (seconds), got inf")
        for name, low in (("warmup_steps", 1), ("profile_steps", 1), ("replan_every", 2), ("max_replans", 0),
                          ("plan_trials", 1), ("trial_steps", 1), ("compression_threads", 1)):
            _integer(name, getattr(self, name), low)
        _integer("train_thread_nice", self.train_thread_nice, 0, 19, " (0 = off)")
        for name in ("calibrate_cost_model", "model_contention", "cost_model_cache"):
            _boolean(name, getattr(self, name))
        if self.defer_update not in ("auto", True, False) or type(self.defer_update) is int:
            raise ValueError(f"defer_update must be 'auto', True or False, got {self.defer_update!r}")
        if self.compression is None and (self.compression_kwargs or self.compression_mode != "process"):
            raise ValueError(f"compression_kwargs={self.compression_kwargs!r} / compression_mode="
                             f"{self.compression_mode!r} need a compression method; set compression= to one of the "
                             "valid names")
        if self.compression is not None:
            from lightning_pipedap.compress import get_compressor, valid_compressor_names  # noqa: PLC0415

            if self.compression not in valid_compressor_names():
                raise ValueError(f"unknown compression {self.compression!r}; valid: {', '.join(valid_compressor_names())}")
            get_compressor(self.compression, **self.compression_kwargs)  # validates the keyword arguments
            if self.compression_mode not in ("process", "inline"):
                raise ValueError(f"compression_mode must be 'process' or 'inline', got {self.compression_mode!r}")
        if self.cost_model is not None and not isinstance(self.cost_model, (str, CostModel)):
            raise ValueError(f"cost_model must be a path to a cost-model JSON file, a CostModel or None, "
                             f"got {self.cost_model!r}")
        object.__setattr__(self, "deferrable_optimizers", tuple(self.deferrable_optimizers))
        object.__setattr__(self, "compression_kwargs", dict(self.compression_kwargs or {}))
        object.__setattr__(self, "bucket_cap_mb", float(self.bucket_cap_mb))
        object.__setattr__(self, "wait_timeout_s", float(self.wait_timeout_s))
        object.__setattr__(self, "ring_chunk_mb", float(self.ring_chunk_mb))
        object.__setattr__(self, "replan_margin", float(self.replan_margin))

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """Every option, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @property
    def planned(self) -> bool:
        """Whether the schedule is planned from a profile (not one of the fixed built-ins)."""
        return self.schedule not in BUILTIN_SCHEDULES
