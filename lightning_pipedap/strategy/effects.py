"""What the controller's transitions do to one fit (:class:`RunEffects`, the
:class:`~lightning_pipedap.strategy.controller.Effects` of a :class:`~lightning_pipedap.strategy.runtime.Runtime`).

Each method is one effect named by the controller: adopt the traced order and owners, install the fixed,
profiling or planned schedule (or hand the model to DDP's reducer), plan the trial candidates, the
measurements the trials and the drift check read, and the plan cache's lookup and store. The state they
change lives in the run-time's pieces (:class:`~lightning_pipedap.strategy.engine_slot.EngineSlot`,
:class:`~lightning_pipedap.strategy.planning.Planning`, ...), reached through the narrow :class:`Fit` view:
this module does not import the run-time.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from torch import Tensor

import lightning_pipedap.engine.collectives as C
from lightning_pipedap.probe.consumers import ConsumerTrace
from lightning_pipedap.schedule import Schedule
from lightning_pipedap.strategy.config import DEFAULT_TORCH_DDP_MARGIN
from lightning_pipedap.strategy.context import FitContext
from lightning_pipedap.strategy.engine_slot import EngineSlot
from lightning_pipedap.strategy.handover import TorchDDPCandidate
from lightning_pipedap.strategy.lightning_reads import accumulate_grad_batches
from lightning_pipedap.strategy.plan_cache import PlanCache
from lightning_pipedap.strategy.planning import Planning, predicted_busy_s
from lightning_pipedap.strategy.step import ProfileProbe
from lightning_pipedap.strategy.tracing import owner_modules, plan_owners
from lightning_pipedap.strategy.trainables import Trainables


class Fit(Protocol):
    """What the effects need of one fit's run-time (its pieces, read-only, and a few verbs)."""

    @property
    def ctx(self) -> FitContext: ...

    @property
    def slot(self) -> EngineSlot: ...

    @property
    def planning(self) -> Planning: ...

    @property
    def probe(self) -> ProfileProbe: ...

    @property
    def plan_cache(self) -> PlanCache: ...

    @property
    def trainables(self) -> Trainables: ...

    @property
    def timing_free(self) -> Optional[str]: ...

    def take_trace(self) -> Optional[ConsumerTrace]:
        """The trace of the trace step (None: none was taken); the run-time forgets it."""

    def install(self, order: list[int], schedule: Schedule, owners: Any, final: bool = False) -> None:
        """Replace the engine (see :meth:`EngineSlot.install`)."""

    def builtin(self, order: list[int], name: str, compress_all: bool = False, wire16_all: bool = False) -> Schedule:
        """The fixed schedule ``name`` over the parameters in ``order``."""

    def flush(self) -> None:
        """Apply every pending update."""

    def publish_predictions(self, predictions: dict[str, dict[str, float]]) -> None:
        """Rank 0's predictions of the planned candidates, for the controller's results."""


class RunEffects:
    """The controller's effects on ``fit`` (every method runs on every rank at the same step; those that
    communicate say so).

    Args:
        fit: the fit's run-time, seen through :class:`Fit`.
    """

    def __init__(self, fit: Fit) -> None:
        self.fit = fit
        self._said_accumulate = False  # (the torch_ddp candidate left out under accumulation: said once a fit)

    def info(self, message: str) -> None:
        """Log on rank 0."""
        self.fit.ctx.info(message)

    def flush(self) -> None:
        """Apply every pending update."""
        self.fit.flush()

    def _params(self) -> list[Tensor]:
        return self.fit.trainables.params

    def adopt_trace(self) -> None:
        """Rank 0's trace (order of first consumption, owners by module name) on every rank."""
        fit, ctx = self.fit, self.fit.ctx
        trace = fit.take_trace()
        first = trace.first if trace is not None else {}
        plan = None
        if ctx.rank == 0:
            plan = plan_owners(first, len(self._params()), {id(m): n for n, m in ctx.module.named_modules()})
        order, owner_names = C.broadcast_object(plan, src=0, what="the traced layout (bucket order and owners)")
        fit.slot.adopt_layout(order, owner_modules(owner_names, ctx.module))

    def install_fixed(self, name: Optional[str] = None) -> None:
        """The configured fixed schedule, or ``name`` (a fallback's). A planned schedule gets here under
        ``Trainer(deterministic=True)`` where candidates round differently (the fixed ``"dear"``: timing-free), or
        when every trainable parameter has a sparse gradient (``"allreduce"`` of no bucket: nothing to plan)."""
        fit, slot = self.fit, self.fit.slot
        cfg = fit.ctx.config
        if name is None:
            name = cfg.schedule if not cfg.planned else "dear" if fit.timing_free else "allreduce"
        fit.install(slot.order, fit.builtin(slot.order, name, bool(cfg.compression), cfg.wire_dtype != "fp32"),
                    slot.owners, final=True)

    def start_profiling(self) -> dict[str, float]:
        """Profiling buckets (fixed fusion, all-reduce, sync mode), layers and the α-β model of the live group;
        returns the seconds of the α-β model and the contention benchmark (start-up accounting)."""
        fit, slot = self.fit, self.fit.slot
        fit.install(slot.order, fit.builtin(slot.order, "allreduce"), slot.owners)
        params = self._params()
        return fit.planning.start([params[i] for i in slot.order], slot.owners)

    def take_profile_step(self, t_step_end: float) -> Optional[int]:
        rec, t_backward_done = self.fit.probe.take()
        if rec is None:
            return None
        engine = self.fit.slot.engine
        busy_s = engine.worker.last_round_busy_s
        # (a sharded sync step: its update as a whole-model step, without the parameter all-gathers)
        update_s = engine.shard.sync_update_s if engine.shard is not None else None
        land = engine.shard.sync_land if engine.shard is not None else None  # (the land copies, timed)
        if engine.shard is not None:
            engine.shard.sync_update_s = engine.shard.sync_land = None
        return self.fit.planning.keep_step(rec, busy_s, t_backward_done, t_step_end, update_s, land)

    def plan(self) -> tuple[list[Schedule], list[float]]:
        fit, slot, planning = self.fit, self.fit.slot, self.fit.planning
        ctx, cfg = fit.ctx, fit.ctx.config
        params = self._params()
        names = {id(m): n or "<root>" for n, m in ctx.module.named_modules()}
        layer_names = [names.get(id(slot.owners[layer[0]]), "<unused>") for layer in planning.layers]
        schedules, no_overlap = planning.plan(type(ctx.module).__name__, layer_names,
                                              [params[i] for i in slot.order], slot.engine, slot.shard_mode,
                                              slot.owner_costs if slot.shard_owned else None, slot.shard_owned)
        fit.publish_predictions(planning.predictions)
        checks = cfg.nonfinite in ("raise", "skip") or cfg.check_params_every_n_steps  # (need pipedap's own paths)
        # a candidate switch happens in the optimizer step, after the earlier micro-batches of an accumulation
        # window ran under the previous reducer: DDP's reducer would not know which parameters they used
        accumulate = accumulate_grad_batches(ctx.module)
        if slot.handover is not None and cfg.torch_ddp_candidate and accumulate > 1 and not self._said_accumulate:
            self._said_accumulate = True
            ctx.info(f"pipedap: the torch_ddp candidate is not trialled with accumulate_grad_batches={accumulate}: "
                     "candidates switch inside an accumulation window, and DDP's reducer would not see which "
                     "parameters the earlier micro-batches used"
                     + (f" (so torch_ddp_margin={cfg.torch_ddp_margin!r} is not used either)"
                        if cfg.torch_ddp_margin != DEFAULT_TORCH_DDP_MARGIN else ""))
        # DDP's reducer raises ("Expected sparse gradient to be defined.") in a step that leaves a sparse-gradient
        # parameter without a gradient on some rank, which pipedap's own reduction handles
        has_sparse = fit.trainables.has_sparse
        sparse_unused = has_sparse and fit.trainables.sparse.saw_unused
        if sparse_unused and slot.handover is not None and cfg.torch_ddp_candidate:
            ctx.say("ddp-sparse", "pipedap: the torch_ddp candidate is not trialled: a parameter with sparse gradients "
                    "had no gradient on some rank in a profiled step, and DDP's reducer raises for such a step")
        if slot.handover is not None and cfg.torch_ddp_candidate and len(schedules) > 1 and not cfg.compression \
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
            unused = cfg.find_unused_parameters is not False or slot.saw_unused \
                or any(o is None for o in slot.owners) or cfg.gradient_as_bucket_view or has_sparse
            schedules = [*schedules, TorchDDPCandidate(
                cfg.bucket_cap_mb, unused, None if same is None else schedules[same].predicted_iteration_s,
                gradient_as_bucket_view=cfg.gradient_as_bucket_view)]
            no_overlap = [*no_overlap, no_overlap[same] if same is not None else max(no_overlap)]
        return schedules, no_overlap

    def install_run(self, schedule: Any) -> Optional[float]:
        fit, slot = self.fit, self.fit.slot
        if isinstance(schedule, TorchDDPCandidate):
            slot.hand_over(schedule)  # (a collective on the default group, at the same step on every rank)
            return None
        fit.install(slot.order, schedule, slot.owners, final=True)
        cm = fit.planning.cost_model
        return None if cm is None else predicted_busy_s(cm, slot.engine)

    def agree(self, value: Any) -> Any:
        return C.broadcast_object(value if self.fit.ctx.rank == 0 else None, src=0, what="rank 0's decision")

    def last_busy_s(self) -> Optional[float]:
        engine = self.fit.slot.engine
        return engine.worker.last_round_busy_s if engine is not None else None

    def comm_floor_s(self) -> Optional[float]:
        """The α-β all-reduce time of every gradient byte, measured alone (s; rank 0's model)."""
        planning = self.fit.planning
        cm = planning.raw_cost_model or planning.cost_model
        if cm is None or self.fit.ctx.config.compression:
            return None
        return cm.all_reduce(sum(p.numel() * p.element_size() for p in self._params()))

    def rescale_cost_model(self, ratio: float) -> bool:
        return self.fit.planning.rescale(ratio)

    def cached_plan(self) -> tuple[str, Optional[tuple[Any, float, float]]]:
        """This run's entry in the plan cache (rank 0 reads, every rank gets its answer; a collective when the
        cache is on): :meth:`~lightning_pipedap.strategy.plan_cache.PlanCache.lookup`."""
        return self.fit.plan_cache.lookup(self.fit)

    def store_plan(self, results: list[dict[str, Any]], no_overlap_s: float, measured_s: float) -> None:
        """Remember the finished selection (rank 0 writes; no collective)."""
        self.fit.plan_cache.store(self.fit, results, no_overlap_s, measured_s)
