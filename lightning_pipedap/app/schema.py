"""Structured-config schemas (dataclasses in Hydra's ConfigStore) and validation before launch.

The YAML files of the ``strategy`` and ``scheduler`` groups extend these schemas through their
defaults list (``- /schema/strategy/pipedap@_here_``), so Hydra rejects unknown keys and values of
the wrong type while composing. Range and choice checks live in ``__post_init__`` and run in
:func:`validate`, which converts the composed nodes to the dataclasses (``OmegaConf.to_object``)
before anything is instantiated or any process is started.
"""

from __future__ import annotations

import dataclasses
import os
import typing

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


#: YAML-side types OmegaConf checks; the members of an option's type that a YAML value cannot be (classes)
_YAML_SCALARS = (int, float, bool, str)
#: options typed ``Any`` in the schema whatever their type, so that a bad value gets ``PipeDAPConfig``'s message
#: naming the choices (OmegaConf's ``Optional[bool]`` would read ``3`` as True; its float fails ``abc`` in its own
#: words)
CHECKED_BY_CONFIG_ONLY = ("startup_budget", "find_unused_parameters")


def yaml_type(annotation: Any) -> Any:
    """The type an option of :class:`~lightning_pipedap.strategy.config.PipeDAPConfig` gets in the Hydra schema:
    a scalar (or ``Optional`` scalar) stays; a ``Literal`` of strings is ``str``; a ``dict`` is ``dict[str, Any]``;
    a ``Union`` keeps its members a YAML value can be (``Union[str, CostModel]`` -> ``str``) and is ``Any`` when
    several remain (``Union[bool, str]``: the range check is :class:`PipeDAPConfig`'s). None: not expressible in
    YAML (``tuple[type, ...]``), left out of the schema."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in _YAML_SCALARS:
        return annotation
    if origin is typing.Literal:
        return str if all(isinstance(a, str) for a in args) else Any
    if origin is dict:
        return dict[str, Any]
    if origin is typing.Union:
        optional = type(None) in args
        kinds = {yaml_type(a) for a in args if a is not type(None)} - {None}
        if not kinds:
            return None
        kind = kinds.pop() if len(kinds) == 1 else Any
        return Optional[kind] if optional and kind is not Any else kind
    return None


def _pipedap_fields() -> list[tuple[str, Any, Any]]:
    """``(name, type, field)`` of ``strategy=pipedap``'s schema: ``_target_``, every option of ``PipeDAPConfig`` a YAML
    value can hold (its default, :func:`yaml_type` of its type), then Lightning's ``start_method`` and
    ``process_group_backend``."""
    from lightning_pipedap.strategy.config import PipeDAPConfig  # noqa: PLC0415 (planners register on import)

    out: list[tuple[str, Any, Any]] = [("_target_", str, field(default="lightning_pipedap.PipeDAPStrategy"))]
    for group, f in PipeDAPConfig.option_fields():
        kind = yaml_type(typing.get_type_hints(PipeDAPConfig.groups()[group])[f.name])
        if kind is not None and f.name in CHECKED_BY_CONFIG_ONLY:
            kind = Any
        if kind is None:
            continue
        default = (field(default_factory=f.default_factory) if f.default is dataclasses.MISSING
                   else field(default=f.default))
        out.append((f.name, kind, default))
    out += [("start_method", str, field(default="popen")),
            ("process_group_backend", Optional[str], field(default=None))]
    return out


def _check_pipedap_options(self: Any) -> None:
    """Every option is checked by :class:`~lightning_pipedap.strategy.config.PipeDAPConfig` (written once).

    Raises:
        ConfigError: the option's message, prefixed ``strategy:``; an unknown ``start_method``.
    """
    from lightning_pipedap.strategy.config import PipeDAPConfig  # noqa: PLC0415

    options = {name: getattr(self, name) for name in PipeDAPConfig.option_names() if hasattr(self, name)}
    try:
        PipeDAPConfig(**options)
    except ValueError as exc:
        raise ConfigError(f"strategy: {exc}") from None
    _choice("strategy.start_method", self.start_method, START_METHODS)


#: ``strategy=pipedap``: :class:`lightning_pipedap.PipeDAPStrategy`, every key derived from ``PipeDAPConfig``'s fields
#: (see docs/OPTIONS.md for units and choices); ``conf/strategy/pipedap.yaml`` sets the defaults' interpolations
PipeDAPStrategyConf = dataclasses.make_dataclass(
    "PipeDAPStrategyConf", _pipedap_fields(), namespace={"__post_init__": _check_pipedap_options, "__doc__": (
        "``strategy=pipedap``: :class:`lightning_pipedap.PipeDAPStrategy`; one key per option of "
        ":class:`~lightning_pipedap.strategy.config.PipeDAPConfig` (generated from its fields; docs/OPTIONS.md).")})
PipeDAPStrategyConf.__module__ = __name__


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
