"""The plan cache of one fit: a remembered plan installed after the trace step, a finished selection remembered.

The store and the key are :mod:`lightning_pipedap.plan.plan_cache` (pure); this module builds the key
from the live run (traced order, process layout, the α-β cache entry of the group, optimizers, options),
reads on rank 0 and broadcasts the answer, so every rank installs the same candidate or none
(:meth:`PlanCache.lookup`, a collective), and writes on rank 0 after each finished selection
(:meth:`PlanCache.store`). The controller verifies a remembered plan over a trial window and selects again
when it measures slower than recorded by more than ``replan_margin`` in each of ``trial_rounds`` (at least 2)
windows.

Where: ``plan_cache=<dir>``; ``plan_cache=True`` (default): ``$PIPEDAP_PLAN_CACHE`` when set (``off``, ``0``,
``false`` or ``no`` turn the default off: the test suite does), else ``$PIPEDAP_CACHE_DIR/plans``, else
``~/.cache/lightning_pipedap/plans``. Plans are remembered only after a measured selection (a planned
schedule, ``plan_trials > 1``, no compression).
"""

from __future__ import annotations

import hashlib
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import torch

import lightning_pipedap.engine.collectives as C
from lightning_pipedap.plan import CostModel
from lightning_pipedap.plan.plan_cache import ENTRY_VERSION, PlanStore, digest, plan_key
from lightning_pipedap import compat
from lightning_pipedap.probe.alpha_beta import cache_key, device_kind
from lightning_pipedap.schedule import Schedule
from lightning_pipedap.strategy.config import PipeDAPConfig
from lightning_pipedap.strategy.lightning_reads import accumulate_grad_batches

#: environment variable that says what ``plan_cache=True`` means (a directory, or off)
ENV = "PIPEDAP_PLAN_CACHE"
#: values of :data:`ENV` that turn the default plan cache off
OFF_VALUES = ("0", "off", "false", "no")
#: options that change how candidates are measured or when a run re-plans, not which plan wins: not in the key
#: (``cost_model`` is in the key's link part; the other per-rank options are rank 0's own)
UNKEYED_OPTIONS = ("wait_timeout_s", "warmup_steps", "profile_steps", "replan_margin", "replan_every", "max_replans",
                   "trial_steps", "trial_rounds", "trial_window_s", "startup_budget", "plan_cache",
                   "sharded_checkpoint")  # (the checkpoint format: not what is planned)


class CachedRun(Protocol):
    """What the plan cache reads of one fit's run-time (:class:`~lightning_pipedap.strategy.runtime.Runtime`)."""

    module: torch.nn.Module
    tset: Any
    params: list[torch.Tensor]
    order: list[int]
    owners: list[Any]
    layout: tuple[int, int]
    world_size: int
    comm: Any
    device: torch.device
    optimizers: Callable[[], list]
    controller: Any
    handover: Any
    planning: Any
    final_schedule: Any

    def say(self, key: str, message: str) -> None: ...


def _package_version() -> str:
    """``lightning_pipedap.__version__``. The package is imported already (this is one of its modules); it is read
    from ``sys.modules`` because an import statement would close an import circle through the package's lazy
    loading of the strategies."""
    return sys.modules[__name__.partition(".")[0]].__version__


def default_directory() -> Path:
    """``$PIPEDAP_CACHE_DIR/plans``, default ``~/.cache/lightning_pipedap/plans`` (read now)."""
    return Path(os.environ.get("PIPEDAP_CACHE_DIR", Path.home() / ".cache" / "lightning_pipedap")) / "plans"


def plan_cache_directory(option: Any) -> tuple[Optional[Path], str]:
    """Where the plan cache of option ``plan_cache`` is: ``(directory, "")``, or ``(None, why it is off)``."""
    if option is False:
        return None, "plan_cache=False"
    if isinstance(option, str):
        return Path(option).expanduser(), ""
    env = os.environ.get(ENV)
    if env is not None and env.strip().lower() in OFF_VALUES:
        return None, f"{ENV}={env}"
    if env:
        return Path(env).expanduser(), ""
    return default_directory(), ""


def keyed_options(config: PipeDAPConfig, accumulate: int, frontend: str) -> dict[str, Any]:
    """The options in the key: every option that must agree across ranks (``config.signature()``) except
    :data:`UNKEYED_OPTIONS`, plus Lightning's ``accumulate_grad_batches`` (no ``torch_ddp`` candidate above 1) and
    the frontend (``"Trainer"``: deferred updates and the ``torch_ddp`` candidate; ``"Fabric"``: sync mode)."""
    out: dict[str, Any] = {k: v for k, v in config.signature() if k not in UNKEYED_OPTIONS}
    out["accumulate_grad_batches"] = int(accumulate)
    out["frontend"] = frontend
    return out


def link_fingerprint(comm: Any, device: torch.device, cost_model: Any) -> dict[str, Any]:
    """The key's link part (a collective: every rank's host name): the α-β cache entry of this group, and the
    constants of a ``cost_model`` the user gave (a file's content or the model's, as a digest)."""
    out: dict[str, Any] = {"alpha_beta_key": cache_key(comm, device)}
    if isinstance(cost_model, str):
        try:
            out["cost_model"] = hashlib.sha1(Path(cost_model).read_bytes()).hexdigest()[:16]
        except OSError:
            out["cost_model"] = f"unreadable {cost_model}"
    elif isinstance(cost_model, CostModel):
        data = cost_model.to_dict()
        data.pop("meta", None)
        out["cost_model"] = digest(data)
    return out


def _utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _qualname(obj: Any) -> str:
    inner = compat.unwrap_optimizer(obj)  # (a wrapper of Lightning's or Fabric's: the optimizer inside)
    return f"{type(inner).__module__}.{type(inner).__qualname__}"


def job_label(module: torch.nn.Module, model_digest: Optional[str] = None) -> str:
    """This job in words, for the α-β cache's record of who fitted a model: ``"train.py: DigitsCNN"``."""
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    return f"{script}: {type(module).__name__}" + (f" (model {model_digest})" if model_digest else "")


class PlanCache:
    """The plan cache of one fit (module docstring).

    Args:
        config: the strategy's options (``plan_cache`` says where).
        rank: this process's rank (rank 0 reads and writes).
        info, warn: rank-0 loggers.

    Attributes:
        directory: the cache directory, None when off.
        key: the key of the last lookup (None before, or when off).
        entry: what a hit installed, for the results: ``{"path", "selected_at", "chosen", "describe",
            "measured_s", "candidates"}``; None otherwise.
        path: the entry file of the last hit or write.
    """

    def __init__(self, config: PipeDAPConfig, rank: int, info: Callable[[str], None],
                 warn: Callable[[str], None]) -> None:
        self.config, self.rank, self.info, self.warn = config, rank, info, warn
        self.directory, self.why_off = plan_cache_directory(config.plan_cache)
        if self.directory is not None and not (config.planned and config.plan_trials > 1 and not config.compression):
            why = ("a fixed schedule" if not config.planned else f"plan_trials={config.plan_trials}"
                   if config.plan_trials < 2 else f"compression={config.compression!r}")
            self.directory, self.why_off = None, f"no measured selection with {why}"
        self.key: Optional[dict[str, Any]] = None
        self.entry: Optional[dict[str, Any]] = None
        self.path: Optional[Path] = None
        self._warned = False
        self._origin: Optional[str] = None  # (a hit's α-β origin as recorded, and as this fit says it)
        self._origin_here: Optional[str] = None

    @property
    def on(self) -> bool:
        """Whether plans are looked up and remembered."""
        return self.directory is not None

    # ------------------------------------------------------------------ key
    def build_key(self, rt: "CachedRun") -> dict[str, Any]:
        """The key of this run after its trace (:func:`~lightning_pipedap.plan.plan_cache.plan_key`; a
        collective: the link part gathers every rank's host name)."""
        names = {id(m): n for n, m in rt.module.named_modules()}
        pnames = rt.tset.names()
        traced = [[pnames.get(id(rt.params[i]), f"<parameter {i}>"), list(rt.params[i].shape),
                   str(rt.params[i].dtype), True, names.get(id(rt.owners[k]), "") if k < len(rt.owners) else None]
                  for k, i in enumerate(rt.order)]
        trainable = {id(p) for p in rt.params}
        frozen = [[n, list(p.shape), str(p.dtype), False, None] for n, p in rt.module.named_parameters()
                  if id(p) not in trainable]
        nodes, per_node = rt.layout
        return plan_key(
            model_class=type(rt.module).__name__, params=traced + frozen, world_size=rt.world_size, nodes=nodes,
            processes_per_node=per_node, backend=str(getattr(rt.comm, "backend", "?")),
            device=device_kind(rt.device), link=link_fingerprint(rt.comm, rt.device, self.config.cost_model),
            optimizers=[_qualname(o) for o in rt.optimizers()],
            options=keyed_options(self.config, accumulate_grad_batches(rt.module) or 1,
                                  "Fabric" if rt.controller.run_noun == "run" else "Trainer"),
            versions={"lightning_pipedap": _package_version(), "torch": torch.__version__,
                      "entry": str(ENTRY_VERSION)})

    # ------------------------------------------------------------------ lookup (after the trace)
    def lookup(self, rt: "CachedRun") -> tuple[str, Optional[tuple[Any, float, float]]]:
        """Rank 0 looks this run's key up; every rank gets its answer (collective when on).

        Returns:
            ``(status, plan)``: ``("off", None)``, ``("miss", None)``, or ``("hit", (candidate, no_overlap_s,
            measured_s))``: the remembered candidate (an engine :class:`~lightning_pipedap.schedule.Schedule` or
            the ``torch_ddp`` candidate), its no-overlap time and its recorded trial time (s). On a hit the
            entry's α-β model, as fitted (before calibration), becomes the run's (``rt.planning``).
        """
        self.entry = None
        if not self.on:
            rt.say("plan-cache-off", f"pipedap: plan cache off ({self.why_off})")
            return "off", None
        self.key = self.build_key(rt)
        answer = None
        if self.rank == 0:
            try:
                answer = self._read(rt.handover is not None)
            except Exception as exc:  # noqa: BLE001 (rank 0 must answer, or the others wait in the broadcast)
                answer = ("miss", None, None, f"pipedap: plan cache miss: reading {self.directory} failed ({exc!r})")
        status, entry, path, line = C.broadcast_object(answer, src=0)
        self.info(line)
        if status != "hit":
            return "miss", None
        self.path = Path(path)
        choice = entry["choice"]
        candidate = _candidate(choice)
        fitted = entry.get("raw_cost_model") or entry.get("cost_model")
        if fitted is not None:  # (as fitted: a re-plan of this fit calibrates it on its own profiling steps)
            self._origin = entry.get("cost_model_origin")
            self._origin_here = f"α-β model of the plan cache entry {path} ({self._origin or 'origin not recorded'})"
            rt.planning.adopt_cost_model(CostModel.from_dict(fitted), self._origin_here)
        self.entry = {"path": path, "selected_at": entry.get("selected_at"), "chosen": candidate.name,
                      "describe": candidate.describe(), "measured_s": entry["measured_s"],
                      "candidates": entry.get("candidates", [])}
        return "hit", (candidate, float(entry["no_overlap_time_s"]), float(entry["measured_s"]))

    def _read(self, torch_ddp_ok: bool) -> tuple[str, Optional[dict], Optional[str], str]:
        """Rank 0: ``(status, entry, path, log line)``; a usable entry only (its candidate builds)."""
        assert self.key is not None and self.directory is not None
        try:
            found = PlanStore(self.directory).lookup(self.key)
        except OSError as exc:
            return "miss", None, None, f"pipedap: plan cache miss: {self.directory} unreadable ({exc})"
        if found.entry is None:
            return "miss", None, None, f"pipedap: plan cache miss in {self.directory}: {found.reason}"
        entry = found.entry
        try:
            candidate = _candidate(entry["choice"])
            if candidate.name == "torch_ddp" and not torch_ddp_ok:
                raise ValueError("its torch_ddp candidate (DDP's reducer) is not available here")
            float(entry["measured_s"]), float(entry["no_overlap_time_s"])
            for k in ("cost_model", "raw_cost_model"):
                if entry.get(k) is not None:
                    CostModel.from_dict(entry[k])
        except (KeyError, TypeError, ValueError) as exc:
            return "miss", None, None, f"pipedap: plan cache miss: the entry {found.path} is unusable ({exc})"
        line = (f"pipedap: plan cache hit {found.path} (selected {entry.get('selected_at') or '?'}, "
                f"{candidate.describe()[:200]}, {float(entry['measured_s']) * 1e3:.1f} ms in its trial) — verifying")
        return "hit", entry, str(found.path), line

    # ------------------------------------------------------------------ store (after a finished selection)
    def store(self, rt: "CachedRun", results: list[dict[str, Any]], no_overlap_s: Optional[float],
              measured_s: Optional[float]) -> None:
        """Rank 0 remembers the selection that just finished (the chosen candidate installed now, every
        candidate's measured times, the α-β model) under the key of the last lookup. An unwritable directory is
        one warning; the fit goes on."""
        if not self.on or self.key is None or self.rank != 0 or rt.final_schedule is None \
                or no_overlap_s is None or measured_s is None:
            return
        final = rt.final_schedule
        planning = rt.planning
        entry = {
            "selected_at": _utc_now(), "job": job_label(rt.module),
            "choice": {"kind": "torch_ddp" if final.name == "torch_ddp" else "schedule", **final.to_dict()},
            "describe": final.describe(), "no_overlap_time_s": float(no_overlap_s), "measured_s": float(measured_s),
            "candidates": [{k: r.get(k) for k in ("name", "describe", "predicted_s", "measured_s", "deciding_s",
                                                  "decided_in", "windows_s", "chosen")} for r in results],
            "cost_model": None if planning.cost_model is None else planning.cost_model.to_dict(),
            "raw_cost_model": None if planning.raw_cost_model is None else planning.raw_cost_model.to_dict(),
            "cost_model_origin": (self._origin if planning.cost_model_origin == self._origin_here
                                  and self._origin_here is not None else planning.cost_model_origin),
        }
        try:
            self.path = PlanStore(self.directory).save(self.key, entry)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                self.warn(f"pipedap: plan cache: cannot write to {self.directory} ({exc.strerror or exc}); this "
                          "selection is not remembered and training goes on. Set plan_cache=<writable directory>, "
                          f"{ENV}=<directory>, or plan_cache=False")
            return
        self.info(f"pipedap: plan cache: remembered {final.name} in {self.path}")


def _candidate(choice: dict[str, Any]) -> Any:
    """The candidate of an entry's ``choice``: an engine schedule, or the ``torch_ddp`` candidate.

    Raises:
        ValueError, KeyError, TypeError: not a valid choice.
    """
    data = dict(choice)
    kind = data.pop("kind", "schedule")
    if kind == "torch_ddp":
        from lightning_pipedap.strategy.handover import TorchDDPCandidate  # noqa: PLC0415

        pred = data.get("predicted_iteration_s")
        return TorchDDPCandidate(float(data["bucket_cap_mb"]), bool(data["find_unused_parameters"]),
                                 None if pred is None else float(pred),
                                 gradient_as_bucket_view=bool(data.get("gradient_as_bucket_view", False)))
    if kind != "schedule":
        raise ValueError(f"unknown choice kind {kind!r}")
    return Schedule.from_dict(data)
