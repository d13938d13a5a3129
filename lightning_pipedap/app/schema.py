"""Structured-config schemas (dataclasses in Hydra's ConfigStore) and validation before launch.

The YAML files of the ``strategy`` and ``scheduler`` groups extend these schemas through their
defaults list (``- /schema/strategy/pipedap@_here_``), so Hydra rejects unknown keys and values of
the wrong type while composing. Range and choice checks live in ``__post_init__`` and run in
:func:`validate`, which converts the composed nodes to the dataclasses (``OmegaConf.to_object``)
before anything is instantiated or any process is started.
"""

from __future__ import annotations

import os

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

#: Schedules that have a config file in ``conf/scheduler``. Which of them the installed strategy can
#: run is :func:`lightning_pipedap.valid_schedule_names` (planners register themselves).
SCHEDULER_NAMES = ("allreduce", "dear", "no_overlap", "wfbp", "dear_tuned", "pipedap", "optimal")
#: Lightning launcher start methods.
START_METHODS = ("popen", "spawn", "fork", "forkserver")


class ConfigError(ValueError):
    """An invalid config value, found before anything is instantiated or launched."""


def _choice(what: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{what}={value!r} is not valid; valid choices: {', '.join(choices)}")


@dataclass
class SchedulerConf:
    """``scheduler`` group: which communication schedule the pipedap strategy runs.

    ``allreduce``: WFBP, one all-reduce per bucket in backward. ``dear``: reduce-scatter in backward,
    all-gather before the next forward (DeAR, ICDCS 2023). ``pipedap`` and ``optimal``: planned
    orders (PipeDAP, TETC 2025), available once their planners are installed.
    """

    name: str = "dear"

    def __post_init__(self) -> None:
        _choice("scheduler", self.name, SCHEDULER_NAMES)


@dataclass
class DDPStrategyConf:
    """``strategy=ddp``: Lightning's ``DDPStrategy`` (all-reduce inside backward), the baseline."""

    _target_: str = "lightning.pytorch.strategies.DDPStrategy"
    start_method: str = "popen"
    process_group_backend: Optional[str] = None
    find_unused_parameters: bool = False

    def __post_init__(self) -> None:
        _choice("strategy.start_method", self.start_method, START_METHODS)


@dataclass
class PipeDAPStrategyConf:
    """``strategy=pipedap``: :class:`lightning_pipedap.PipeDAPStrategy` (see its docstring for units)."""

    _target_: str = "lightning_pipedap.PipeDAPStrategy"
    schedule: str = "optimal"
    bucket_cap_mb: float = 25.0
    defer_update: Any = "auto"  # "auto" | true | false (see PipeDAPStrategy)
    warmup_steps: int = 1
    wait_timeout_s: float = 300.0
    ring_chunk_mb: float = 2.0
    profile_steps: int = 3
    cost_model: Optional[str] = None
    cost_model_cache: bool = True
    plan_cache: Any = True  # true (default directory) | false (off) | a directory path (see PipeDAPStrategy)
    replan_margin: float = 0.15
    replan_every: int = 50
    max_replans: int = 1
    calibrate_cost_model: bool = True
    model_contention: bool = True
    plan_trials: Optional[int] = None  # null: 4 for optimal (measured selection), 1 for a named planner
    trial_steps: int = 3
    trial_rounds: int = 2
    trial_window_s: float = 0.25
    startup_budget: Any = 0.1  # fraction of the fit's steps for trace, profiling and trials; null: none (checked by PipeDAPConfig)
    torch_ddp_candidate: bool = True
    find_unused_parameters: Any = None  # null: set for DDP's reducer (torch_ddp); false: you vouch (checked by PipeDAPConfig)
    torch_ddp_margin: float = 0.10
    train_thread_nice: int = 0
    compression: Optional[str] = None
    compression_kwargs: dict[str, Any] = field(default_factory=dict)
    compression_mode: str = "process"
    compression_threads: int = 1
    wire_dtype: str = "fp32"  # "fp32" | "fp16" | "bf16" (see PipeDAPStrategy)
    gradient_as_bucket_view: bool = False  # .grad as views into the buckets (see PipeDAPStrategy)
    nonfinite: str = "warn"  # "warn" | "raise" | "skip" | "ignore" (see PipeDAPStrategy)
    check_params_every_n_steps: Optional[int] = None
    partition_mb: Optional[float] = None  # null = off; MiB: also plan with larger layers split (see PipeDAPStrategy)
    start_method: str = "popen"
    process_group_backend: Optional[str] = None

    def __post_init__(self) -> None:
        """Every option is checked by :class:`~lightning_pipedap.strategy.config.PipeDAPConfig` (written once)."""
        from lightning_pipedap.strategy.config import PipeDAPConfig  # noqa: PLC0415 (planners register on import)

        options = {name: getattr(self, name) for name in PipeDAPConfig.option_names() if hasattr(self, name)}
        try:
            PipeDAPConfig(**options)
        except ValueError as exc:
            raise ConfigError(f"strategy: {exc}") from None
        _choice("strategy.start_method", self.start_method, START_METHODS)


@dataclass
class NamedStrategyConf:
    """``strategy=auto``: a strategy given by its Lightning registry name (single process, debugging)."""

    name: str = "auto"

    def __post_init__(self) -> None:
        from lightning.pytorch.strategies import StrategyRegistry  # noqa: PLC0415

        _choice("strategy.name", self.name, ("auto", *StrategyRegistry.available_strategies()))


_SCHEMAS = {
    ("schema/strategy", "ddp"): DDPStrategyConf,
    ("schema/strategy", "pipedap"): PipeDAPStrategyConf,
    ("schema/strategy", "named"): NamedStrategyConf,
    ("schema/scheduler", "scheduler"): SchedulerConf,
}


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent; called when the app module is imported)."""
    cs = ConfigStore.instance()
    for (group, name), node in _SCHEMAS.items():
        cs.store(group=group, name=name, node=node)
    if not OmegaConf.has_resolver("pipedap.launch_dir"):
        # the launch directory; ${hydra:runtime.cwd} is not set yet when a multirun resolves
        # hydra.sweep.dir, and $PWD is not updated by subprocess.run(cwd=...)
        OmegaConf.register_new_resolver("pipedap.launch_dir", os.getcwd)


def validate(cfg: DictConfig) -> None:
    """Check the composed config before anything is instantiated or launched.

    Converts ``cfg.scheduler`` and ``cfg.strategy`` to their schema dataclasses, which runs the range
    and choice checks, and checks that every other group node is present.

    Raises:
        ConfigError: (a ``ValueError``) a bad value; the message names the key, the value and the
            valid choices.
    """
    for key in ("model", "data", "strategy", "trainer"):
        if key not in cfg or cfg[key] is None:
            raise ConfigError(f"config group {key!r} is missing; choose one with {key}=<option>")
    for key in ("scheduler", "strategy"):
        node = cfg.get(key)
        if node is None:
            continue
        if OmegaConf.get_type(node) is dict:
            raise ConfigError(f"config {key!r} is not typed by a schema: its YAML must list "
                             f"'/schema/{key}/<name>@_here_' in its defaults")
        try:
            OmegaConf.to_object(node)
        except ConfigError:
            raise
        except Exception as e:  # OmegaConf may wrap errors raised in __post_init__
            cause = e.__cause__ if isinstance(e.__cause__, ConfigError) else None
            raise ConfigError(str(cause or e)) from e
    _check_schedule_matches_scheduler(cfg)
    _check_compression_applies(cfg)
    _check_ckpt_path(cfg)


def _check_schedule_matches_scheduler(cfg: DictConfig) -> None:
    """The ``scheduler`` group is the one place that chooses ``strategy=pipedap``'s schedule
    (``strategy.schedule: ${scheduler.name}``). An explicit ``strategy.schedule=<x>`` that differs from it
    would run ``x`` while the config, the summary and the sweep's duplicate detection say the group's name.

    Raises:
        ConfigError: naming both values and how to choose the schedule.
    """
    node, sched = cfg.strategy, cfg.get("scheduler")
    if sched is None or "schedule" not in node or not str(node.get("_target_", "")).endswith("PipeDAPStrategy"):
        return
    if str(node.schedule) != str(sched.name):
        raise ConfigError(f"strategy.schedule={node.schedule!r} conflicts with scheduler={sched.name!r}: the "
                          f"schedule comes from the scheduler group; choose it with scheduler=<name> (valid choices: "
                          f"{', '.join(SCHEDULER_NAMES)}) and leave strategy.schedule unset")


def _check_compression_applies(cfg: DictConfig) -> None:
    """``compression=`` only configures ``strategy=pipedap``: with another strategy it would be ignored.

    Raises:
        ConfigError: a compression method chosen together with a strategy that does not compress.
    """
    node = cfg.get("compression")
    method = node.get("name") if node is not None else None
    target = str(cfg.strategy.get("_target_", ""))
    if method not in (None, "none") and not target.endswith("PipeDAPStrategy"):
        raise ConfigError(f"compression={method} applies to strategy=pipedap only; strategy {target or '?'} would "
                          "train uncompressed. Use strategy=pipedap, or compression=none (the default)")


def _check_ckpt_path(cfg: DictConfig) -> None:
    """``ckpt_path`` is null, one of Lightning's names, or an existing file.

    Raises:
        ConfigError: naming the missing file.
    """
    import os  # noqa: PLC0415

    path = cfg.get("ckpt_path")
    if path is None or str(path) in ("last", "best", "hpc", "registry"):
        return
    if not os.path.isfile(str(path)):
        raise ConfigError(f"ckpt_path={path!r}: no such checkpoint file (give a .ckpt path, 'last' or 'best', "
                          "or null to start afresh)")
