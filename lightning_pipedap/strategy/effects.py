"""What the controller's transitions do to one fit (:class:`RunEffects`, the
:class:`~lightning_pipedap.strategy.controller.Effects` of a :class:`~lightning_pipedap.strategy.runtime.Runtime`).

Each method is one effect named by the controller: adopt the traced order and owners, install the fixed,
profiling or planned schedule (or hand the model to DDP's reducer), plan the trial candidates, the
measurements the trials and the drift check read, and the plan cache's lookup and store. The state they
change lives on the runtime.
"""

from __future__ import annotations

import dataclasses

from typing import TYPE_CHECKING, Any, Optional

import lightning_pipedap.engine.collectives as C
from lightning_pipedap import compat
from lightning_pipedap.schedule import Schedule
from lightning_pipedap.strategy.config import DEFAULT_TORCH_DDP_MARGIN
from lightning_pipedap.strategy.handover import TorchDDPCandidate
from lightning_pipedap.strategy.planning import predicted_busy_s
from lightning_pipedap.strategy.tracing import owner_modules, plan_owners

if TYPE_CHECKING:
    from lightning_pipedap.strategy.runtime import Runtime


class RunEffects:
    """The controller's effects on ``rt`` (every method runs on every rank at the same step; those that
    communicate say so).

    Args:
        rt: the fit's run-time.
    """

    def __init__(self, rt: "Runtime") -> None:
        self.rt = rt
        self._said_accumulate = False  # (the torch_ddp candidate left out under accumulation: said once a fit)

    def info(self, message: str) -> None:
        """Log on rank 0."""
        self.rt.info(message)

    def flush(self) -> None:
        """Apply every pending update."""
        self.rt.flush()

    def adopt_trace(self) -> None:
        """Rank 0's trace (order of first consumption, owners by module name) on every rank."""
        rt = self.rt
        first = rt.trace.first if rt.trace is not None else {}
        rt.trace = None
        plan = None
        if rt.rank == 0:
            plan = plan_owners(first, len(rt.params), {id(m): n for n, m in rt.module.named_modules()})
        rt.order, owner_names = C.broadcast_object(plan, src=0)
        rt.owners = owner_modules(owner_names, rt.module)

    def install_fixed(self, name: Optional[str] = None) -> None:
        """The configured fixed schedule, or ``name`` (a fallback's). A planned schedule gets here under
        ``Trainer(deterministic=True)`` where candidates round differently (the fixed ``"dear"``: timing-free), or
        when every trainable parameter has a sparse gradient (``"allreduce"`` of no bucket: nothing to plan)."""
        rt = self.rt
        cfg = rt.config
        if name is None:
            name = cfg.schedule if not cfg.planned else "dear" if rt.timing_free else "allreduce"
        rt.install(rt.order, rt.builtin(rt.order, name, bool(cfg.compression), cfg.wire_dtype != "fp32"),
                   rt.owners, final=True)

    def start_profiling(self) -> dict[str, float]:
        """Profiling buckets (fixed fusion, all-reduce, sync mode), layers and the α-β model of the live group;
        returns the seconds of the α-β model and the contention benchmark (start-up accounting)."""
        rt = self.rt
        rt.install(rt.order, rt.builtin(rt.order, "allreduce"), rt.owners)
        return rt.planning.start([rt.params[i] for i in rt.order], rt.owners)

    def take_profile_step(self, t_step_end: float) -> Optional[int]:
        rt = self.rt
        rec, rt.recorder = rt.recorder, None
        if rec is None:
            return None
        return rt.planning.keep_step(rec, rt.engine.last_round_busy_s, rt.t_backward_done, t_step_end)

    def plan(self) -> tuple[list[Schedule], list[float]]:
        rt = self.rt
        names = {id(m): n or "<root>" for n, m in rt.module.named_modules()}
        layer_names = [names.get(id(rt.owners[layer[0]]), "<unused>") for layer in rt.planning.layers]
        schedules, no_overlap = rt.planning.plan(type(rt.module).__name__, layer_names,
                                                   [rt.params[i] for i in rt.order], rt.engine)
        rt.controller.predictions = rt.planning.predictions
        cfg = rt.config
        checks = cfg.nonfinite in ("raise", "skip") or cfg.check_params_every_n_steps  # (need pipedap's own paths)
        # a candidate switch happens in the optimizer step, after the earlier micro-batches of an accumulation
        # window ran under the previous reducer: DDP's reducer would not know which parameters they used
        accumulate = getattr(compat.attached_trainer(rt.module), "accumulate_grad_batches", 1)
        if rt.handover is not None and cfg.torch_ddp_candidate and accumulate > 1 and not self._said_accumulate:
            self._said_accumulate = True
            rt.info(f"pipedap: the torch_ddp candidate is not trialled with accumulate_grad_batches={accumulate}: "
                    "candidates switch inside an accumulation window, and DDP's reducer would not see which "
                    "parameters the earlier micro-batches used"
                    + (f" (so torch_ddp_margin={cfg.torch_ddp_margin!r} is not used either)"
                       if cfg.torch_ddp_margin != DEFAULT_TORCH_DDP_MARGIN else ""))
        # DDP's reducer raises ("Expected sparse gradient to be defined.") in a step that leaves a sparse-gradient
        # parameter without a gradient on some rank, which pipedap's own reduction handles
        sparse_unused = rt.has_sparse and rt.sparse.saw_unused
        if sparse_unused and rt.handover is not None and cfg.torch_ddp_candidate:
            rt.say("ddp-sparse", "pipedap: the torch_ddp candidate is not trialled: a parameter with sparse gradients "
                   "had no gradient on some rank in a profiled step, and DDP's reducer raises for such a step")
        if rt.handover is not None and cfg.torch_ddp_candidate and len(schedules) > 1 and not cfg.compression \
                and cfg.wire_dtype == "fp32" and not checks and accumulate <= 1 \
                and not sparse_unused:  # (DDP's reducer sends fp32)
            # DDP's reducer is WFBP with the same buckets: its α-β prediction is that schedule's
            same = next((k for k, c in enumerate(schedules) if c.name.startswith("wfbp@")), None)
            # find_unused_parameters (one more small collective per step): by default always, so that a parameter
            # that gets no gradient on some ranks in a later step cannot stop the fit under DDP's reducer; with
            # find_unused_parameters=False (the user vouches) only when a profiled step left a parameter without a
            # gradient on some rank (identical on every rank: read from the reduced used-flags), with
            # gradient_as_bucket_view (a stalled reduction leaves .grad half-averaged in DDP's buffers) and with
            # sparse gradients (DDP divides them in place before its reduction stalls)
            unused = cfg.find_unused_parameters is not False or rt.saw_unused \
                or any(o is None for o in rt.owners) or cfg.gradient_as_bucket_view or rt.has_sparse
            schedules = [*schedules, TorchDDPCandidate(
                cfg.bucket_cap_mb, unused, None if same is None else schedules[same].predicted_iteration_s,
                gradient_as_bucket_view=cfg.gradient_as_bucket_view)]
            no_overlap = [*no_overlap, no_overlap[same] if same is not None else max(no_overlap)]
        return schedules, no_overlap

    def install_run(self, schedule: Any) -> Optional[float]:
        rt = self.rt
        if isinstance(schedule, TorchDDPCandidate):
            rt.close_engine()  # (notes a parameter some rank left without a gradient in the steps so far)
            if rt.saw_unused and not schedule.find_unused_parameters:  # (seen after planning: in the trials)
                schedule = dataclasses.replace(schedule, find_unused_parameters=True)
            assert rt.handover is not None
            rt.handover.enter(schedule)  # (a collective on the default group, at the same step on every rank)
            rt.installed_schedule, rt.final_schedule = schedule.describe(), schedule
            rt.running_schedule = schedule.name
            rt._logged_schedule = f"pipedap: schedule {schedule.describe()}"
            rt.info(rt._logged_schedule)
            if schedule.find_unused_parameters and rt.config.find_unused_parameters is None:
                rt.say("ddp-find-unused", "pipedap: DDP's reducer runs with find_unused_parameters (the default, "
                       "find_unused_parameters=None), so that a parameter that gets no gradient on some ranks in a "
                       "later step cannot stop the fit; DDP may warn that it found no unused parameter. Pass "
                       "find_unused_parameters=False if every parameter gets a gradient on every rank in every step "
                       "(one collective less per step)")
            return None
        rt.install(rt.order, schedule, rt.owners, final=True)
        cm = rt.planning.cost_model
        return None if cm is None else predicted_busy_s(cm, rt.engine)

    def agree(self, value: Any) -> Any:
        return C.broadcast_object(value if self.rt.rank == 0 else None, src=0)

    def last_busy_s(self) -> Optional[float]:
        rt = self.rt
        return rt.engine.last_round_busy_s if rt.engine is not None else None

    def comm_floor_s(self) -> Optional[float]:
        """The α-β all-reduce time of every gradient byte, measured alone (s; rank 0's model)."""
        rt = self.rt
        cm = rt.planning.raw_cost_model or rt.planning.cost_model
        if cm is None or rt.config.compression:
            return None
        return cm.all_reduce(sum(p.numel() * p.element_size() for p in rt.params))

    def rescale_cost_model(self, ratio: float) -> bool:
        return self.rt.planning.rescale(ratio)

    def cached_plan(self) -> tuple[str, Optional[tuple[Any, float, float]]]:
        """This run's entry in the plan cache (rank 0 reads, every rank gets its answer; a collective when the
        cache is on): :meth:`~lightning_pipedap.strategy.plan_cache.PlanCache.lookup`."""
        return self.rt.plan_cache.lookup(self.rt)

    def store_plan(self, results: list[dict[str, Any]], no_overlap_s: float, measured_s: float) -> None:
        """Remember the finished selection (rank 0 writes; no collective)."""
        self.rt.plan_cache.store(self.rt, results, no_overlap_s, measured_s)
