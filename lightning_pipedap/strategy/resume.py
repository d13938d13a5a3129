"""What a checkpoint carries for an exact resume: the final schedule and the compression state.

- The *plan* (:data:`PLAN_KEY`): schedule, parameter order, owners by module name, the cost model;
  identical on all ranks, plain data (``torch.load(weights_only=True)`` reads it). A resumed run
  whose world size, parameters, schedule and fusion cap match installs it directly (no trace or
  profiling steps, so a compressing run compresses from its first resumed step).
- The *compression state* (``compress.state.CHECKPOINT_KEY``): every rank's error-feedback
  residuals, PowerSGD factors and step counters, per parameter name (independent of the bucket
  layout). :class:`CompressionCarry` keeps it across engines (re-plans, warm-up) and hands it to
  the next compressing engine.

:class:`ResumeState` is what :meth:`PipeDAPStrategy.load_checkpoint` reads, used once at set-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import lightning_pipedap.engine.collectives as C
from lightning_pipedap.plan import CostModel
from lightning_pipedap.schedule import Schedule
from lightning_pipedap.strategy.controller import Phase
from lightning_pipedap.strategy.params import ParamInfo
from lightning_pipedap.strategy.planning import predicted_busy_s
from lightning_pipedap.strategy.tracing import owner_modules

#: checkpoint key of the installed final schedule
PLAN_KEY = "pipedap_plan"
#: version of the :data:`PLAN_KEY` entry (see :func:`plan_state`); a run does not install an entry of another version
PLAN_VERSION = 2



@dataclass
class ResumeState:
    """A loaded checkpoint's plan and this rank's compression state, until set-up uses them.

    Attributes:
        plan: the :data:`PLAN_KEY` entry, or None.
        compression: this rank's compression state (``compress.state`` format), or None.
    """

    plan: Optional[dict[str, Any]] = None
    compression: Optional[dict[str, Any]] = None

    def take_plan(self) -> Optional[dict[str, Any]]:
        """The loaded plan, once (then None: a later engine gets the compression state directly)."""
        plan, self.plan = self.plan, None
        return plan

    def load_state_dict(self, checkpoint: dict[str, Any], method: Optional[str], kwargs: dict[str, Any],
                        world_size: int, rank: int) -> list[str]:
        """Read ``checkpoint``; returns the reasons (warnings) for not restoring the compression state.

        A checkpoint of another compressor or world size restores no compression state (the reason names
        both values); other ``compression_kwargs`` restore it anyway (factors of another shape start afresh).
        """
        from lightning_pipedap.compress.state import CHECKPOINT_KEY, state_for_rank  # noqa: PLC0415

        self.plan = checkpoint.get(PLAN_KEY)
        entry = checkpoint.get(CHECKPOINT_KEY)
        state, reason = state_for_rank(entry, method, world_size, rank)
        notes = [f"pipedap: {reason}; compression starts with fresh error-feedback state"] if reason else []
        if not reason and state is not None and entry.get("kwargs") != kwargs:
            notes.append(f"pipedap: the checkpoint's compression_kwargs {entry.get('kwargs')} differ from this run's "
                         f"{kwargs}; restoring the state anyway (factors of another shape start afresh)")
        self.compression = state
        return notes


def plan_state(*, world_size: int, schedule_name: str, bucket_cap_mb: float, signature: list[list[Any]],
               order: list[int], owner_names: list[Optional[str]], schedule: Schedule,
               no_overlap_time_s: Optional[float], cost_model: Optional[CostModel]) -> dict[str, Any]:
    """The installed final schedule as plain data (the :data:`PLAN_KEY` entry).

    ``schedule`` is the configured schedule name (``schedule_name``, compared by :func:`plan_mismatch`);
    ``final_schedule`` the installed :class:`Schedule` as :meth:`Schedule.to_dict`.
    """
    return {
        "version": PLAN_VERSION, "world_size": world_size, "schedule": schedule_name,
        "bucket_cap_mb": bucket_cap_mb, "params": signature, "order": list(order), "owners": list(owner_names),
        "final_schedule": schedule.to_dict(), "no_overlap_time_s": no_overlap_time_s,
        "cost_model": None if cost_model is None else cost_model.to_dict(),
    }


def plan_mismatch(plan: dict[str, Any], *, world_size: int, schedule_name: str, bucket_cap_mb: float,
                  signature: list[list[Any]]) -> list[str]:
    """The keys in which a checkpoint's plan does not fit this run (empty: it fits)."""
    mine = {"version": PLAN_VERSION, "world_size": world_size, "schedule": schedule_name,
            "bucket_cap_mb": bucket_cap_mb, "params": signature}
    return [k for k, v in mine.items() if plan.get(k) != v]


def plan_schedule(plan: dict[str, Any]) -> Schedule:
    """The :class:`Schedule` stored in a plan entry (:meth:`Schedule.from_dict` of its ``final_schedule``).

    Raises:
        ValueError: the entry holds no valid schedule (the message names the bad key or value).
    """
    if "final_schedule" not in plan:
        raise ValueError(f"the plan entry has no 'final_schedule' (keys: {sorted(plan)})")
    return Schedule.from_dict(plan["final_schedule"])


class CompressionCarry:
    """One rank's compression state across engines, by parameter name.

    Args:
        method, kwargs: the configured compressor.
        info: ``info()`` -> the installed engine's parameter names and shapes (:data:`ParamInfo`).
        log: rank-0 logger.
        state: a loaded checkpoint's state for this rank, or None.

    Attributes:
        state: the kept state while no compressing engine holds it (``compress.state`` format), or None.
    """

    def __init__(self, method: str, kwargs: dict[str, Any], info: Callable[[Any], ParamInfo],
                 log: Callable[[str], None], state: Optional[dict[str, Any]] = None) -> None:
        self.method, self.kwargs, self.info, self.log = method, kwargs, info, log
        self.state = state

    def now(self, engine: Any, take: bool) -> Optional[dict[str, Any]]:
        """This rank's state: the helper's (or the kept one while no compressing engine runs) plus the
        residuals ``engine`` still has to add to a dense gradient (``CommEngine.carry``).
        ``take``: remove those from the engine."""
        from lightning_pipedap.compress.state import add_residuals  # noqa: PLC0415

        transport = engine.transport
        state = transport.pipeline.state_dict() if transport is not None else self.state
        carried = engine.carry.take(clear=take)
        if carried:
            info = self.info(engine)
            state = add_residuals(state, {info[i][0]: v for i, v in carried.items()},
                                  {n: s for n, s in info.values()}, self.method, self.kwargs)
        return state

    def keep(self, engine: Any) -> None:
        """Before ``engine`` is replaced: keep its state, including residuals not yet added to a gradient."""
        self.state = self.now(engine, take=True)

    def restore(self, engine: Any) -> None:
        """After ``engine`` is installed: hand it the kept state.

        Error-feedback residuals of parameters in buckets the engine sends dense (warm-up and profiling
        steps, or a plan that stopped compressing them) are added once to their next gradient (same units,
        local gradient / world size, as the compressors' residuals) and cleared from the state, so what
        earlier compressions left out reaches the other ranks exactly once. The rest goes into the helper
        (compressed buckets), or waits for the next compressing engine (step counters, PowerSGD factors).
        """
        from lightning_pipedap.compress.state import split_residuals  # noqa: PLC0415

        if self.state is None:
            return
        transport = engine.transport
        info = self.info(engine)
        dense = {i for b in engine.buckets if transport is None or not engine.schedule.is_compressed(b.index)
                 for i in b.param_indices}
        index_of = {info[i][0]: i for i in dense}
        self.state, moved = split_residuals(self.state, index_of)
        if moved:
            engine.carry.add({index_of[n]: r for n, r in moved.items()})
            self.log(f"pipedap: error-feedback residuals of {len(moved)} parameters now sent dense are added once "
                     "to their next gradient")
        if transport is None:
            return
        state, self.state = self.state, None
        fresh = transport.pipeline.load_state_dict(state)
        if fresh:
            self.log(f"pipedap: no saved compression state for {len(fresh)} parameters "
                     f"({', '.join(fresh[:5])}{', ...' if len(fresh) > 5 else ''}); they start from zero")


def install_plan(rt: Any) -> None:
    """Install the loaded checkpoint's final schedule directly when it fits this run (same world size,
    parameters, schedule and fusion cap): no trace or profiling steps, so a resumed run with compression
    compresses from its first step, as the uninterrupted run did. Otherwise log which keys differ and
    leave the run to trace and plan again (the compression state then goes to the next engine).

    Args:
        rt: the fit's :class:`~lightning_pipedap.strategy.runtime.Runtime` (its ``resume.plan`` is consumed).
    """
    plan = rt.resume.take_plan()
    if plan is None:
        return
    cfg = rt.config
    differ = plan_mismatch(plan, world_size=rt.world_size, schedule_name=cfg.schedule,
                           bucket_cap_mb=cfg.bucket_cap_mb, signature=rt.tset.signature(rt.params))
    if differ:
        rt.info(f"pipedap: the checkpoint's schedule does not fit this run ({', '.join(differ)} differ); "
                "tracing and planning again")
        return
    rt.slot.adopt_layout(list(plan["order"]), owner_modules(plan["owners"], rt.module))
    schedule = plan_schedule(plan)
    if plan["cost_model"] is not None:
        rt.planning.adopt_cost_model(CostModel.from_dict(plan["cost_model"]))
    rt.install(rt.order, schedule, rt.owners, final=True)
    cm = rt.planning.cost_model
    rt.controller.resumed(schedule.predicted_iteration_s, plan["no_overlap_time_s"],
                          None if cm is None else predicted_busy_s(cm, rt.engine))
    rt.info("pipedap: resumed with the checkpoint's schedule (no trace or profiling steps)")


def add_to_checkpoint(rt: Any, checkpoint: dict[str, Any]) -> None:
    """Put the final plan and every rank's compression state into ``checkpoint``; every rank must call it.

    Keys: :data:`PLAN_KEY` (schedule, parameter order, owners; identical on all ranks; only once a final
    plan runs: a checkpoint taken mid-trial makes the resume plan again) and
    ``compress.state.CHECKPOINT_KEY`` (``{"version", "compressor", "kwargs", "world_size", "per_rank"}``;
    per rank, per parameter name: error-feedback residual slice, PowerSGD ``q``, step counter), gathered
    to every rank with one ``all_gather_object`` (a user who saves on rank 0 only, while compressing,
    blocks until the process group's timeout). The compression state costs one fp32 copy of the model
    per rank for methods with error feedback. Pending updates are applied first; called from inside a
    step (a user's ``save_checkpoint`` in ``training_step``) it adds nothing, as the state is in flux.

    Args:
        rt: the fit's :class:`~lightning_pipedap.strategy.runtime.Runtime`.
        checkpoint: Lightning's checkpoint dict (changed in place).
    """
    rt.flush()
    if rt.engine is None:  # DDP's reducer runs (the torch_ddp candidate): no engine state; a resume plans again
        return
    if rt.engine.collecting:
        return
    rt.engine.wait_idle()
    if rt.carry is not None:
        from lightning_pipedap.compress.state import CHECKPOINT_KEY, checkpoint_entry  # noqa: PLC0415

        per_rank = C.all_gather_object(rt.carry.now(rt.engine, take=False))
        if any(s is not None for s in per_rank):
            cfg = rt.config
            checkpoint[CHECKPOINT_KEY] = checkpoint_entry(per_rank, cfg.compression, cfg.compression_kwargs,
                                                          rt.world_size)
    add_plan(rt, checkpoint)


def add_plan(rt: Any, checkpoint: dict[str, Any]) -> None:
    """Put the final plan (:data:`PLAN_KEY`; identical on every rank, no collective) into ``checkpoint``, once a
    final plan runs on the engine (nothing under DDP's reducer or mid-trial: a resume plans again)."""
    if rt.engine is not None and rt.controller.phase is Phase.RUN:
        modules = {id(m): n for n, m in rt.module.named_modules()}
        checkpoint[PLAN_KEY] = plan_state(
            world_size=rt.world_size, schedule_name=rt.config.schedule, bucket_cap_mb=rt.config.bucket_cap_mb,
            signature=rt.tset.signature(rt.params), order=rt.order,
            owner_names=[None if o is None else modules.get(id(o)) for o in rt.owners],
            schedule=rt.engine.schedule, no_overlap_time_s=rt.controller.no_overlap_time_s,
            cost_model=rt.planning.cost_model)
