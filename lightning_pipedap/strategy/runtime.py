"""The strategy's run-time for one fit: parameters, the engine, hooks' reactions and one step's flow.

:class:`Runtime` is created when the strategy sets the model up and lives until teardown. It owns

- the trainable parameters (checked identical on every rank) and their hooks' reactions
  (:meth:`grad_ready`, :meth:`module_forward`);
- the installed :class:`~lightning_pipedap.engine.engine.CommEngine` and its
  :class:`~lightning_pipedap.strategy.deferred.DeferredUpdates`;
- the :class:`~lightning_pipedap.strategy.controller.Controller` (phases), whose transitions act on
  this run-time through :class:`~lightning_pipedap.strategy.effects.RunEffects` (adopt the trace,
  install schedules, profile and plan with :class:`~lightning_pipedap.strategy.planning.Planning`);
- the compression state across engines and the checkpoint's plan (``resume``);
- the plan cache of the fit (``plan_cache``: :class:`~lightning_pipedap.strategy.plan_cache.PlanCache`).

It imports no Lightning: the strategy passes in the module, the optimizers and loggers.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Optional

import torch
from torch import Tensor

import lightning_pipedap.engine.collectives as C
from lightning_pipedap import compat
from lightning_pipedap.engine.engine import CommEngine
from lightning_pipedap.engine.sparse import SparseGradReducer, sparse_gradient_params
from lightning_pipedap.engine.update import write_back_grads
from lightning_pipedap.measure.timeline import OpRecord
from lightning_pipedap.probe.consumers import ConsumerTrace, ModuleStack
from lightning_pipedap.schedule import Schedule, builtin_schedule
from lightning_pipedap.strategy import resume as R
from lightning_pipedap.strategy.config import PipeDAPConfig
from lightning_pipedap.strategy.controller import Controller, Phase
from lightning_pipedap.strategy.deferred import DeferredUpdates
from lightning_pipedap.strategy.effects import RunEffects
from lightning_pipedap.strategy.handover import TorchDDPHandover
from lightning_pipedap.strategy.hooks import ModelHooks
from lightning_pipedap.strategy.numerics import NonFiniteCheck, check_replicas_agree
from lightning_pipedap.strategy.params import ParamInfo, TrainableSet
from lightning_pipedap.strategy.plan_cache import PlanCache, job_label
from lightning_pipedap.strategy.planning import Measured, Planning
from lightning_pipedap.strategy.tracing import consumer_mode

#: run-times built in this process so far (every rank builds them in the same order: a per-fit key)
_FITS = itertools.count()
#: what a user can do about a parameter unused on some ranks only under DDP's reducer
_STALL_REMEDY = ("Leave find_unused_parameters at its default (None: DDP's reducer then runs with it), or pass "
                 "torch_ddp_candidate=False (pipedap's own engine handles parameters unused on some ranks)")


def timing_free_reason(config: PipeDAPConfig, world_size: int) -> Optional[str]:
    """Why a planned schedule must give way to a fixed one, or None: deterministic algorithms are on
    (``torch.are_deterministic_algorithms_enabled()``: ``Trainer(deterministic=True)``) and the candidates of measured
    selection can round differently, so the plan (chosen from measured times) would decide the bits. At 2 ranks in
    fp32 every candidate sums each element as ``a/2 + b/2`` (exact in any order) and none rounds differently: no
    reason. At >= 3 ranks the ring sums a bucket's elements in an order set by the bucket layout; a 16-bit wire
    rounds the elements a rank does not own, and compression works per bucket."""
    if not config.planned or not torch.are_deterministic_algorithms_enabled():
        return None
    if world_size >= 3:
        return (f"at {world_size} processes the order of the sums depends on the bucket layout, which differs "
                "between candidates")
    if config.wire_dtype != "fp32":
        return f"wire_dtype={config.wire_dtype!r} rounds the elements a rank does not own, set by the bucket layout"
    if config.compression:
        return f"compression={config.compression!r} works per bucket"
    return None


def refuse_unsupported_modules(model: torch.nn.Module, device: torch.device) -> None:
    """CPU SyncBatchNorm is refused before any collective, naming the module.

    Raises:
        ValueError: naming the module.
    """
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.SyncBatchNorm) and device.type == "cpu":
            raise ValueError(f"pipedap: module {name!r} is a SyncBatchNorm, which needs CUDA; on CPU use BatchNorm")


def refuse_sparse_with(config: PipeDAPConfig, name: str, kind: str) -> None:
    """Options that change what the dense buckets carry do not combine with sparse gradients, which are
    all-reduced exactly as DDP does.

    Raises:
        ValueError: ``compression`` set or ``wire_dtype`` not ``"fp32"``, naming the parameter ``name`` (of a
            ``kind`` module) and the valid choices.
    """
    if config.compression is not None:
        bad, valid = f"compression={config.compression!r}", "compression=None"
    elif config.wire_dtype != "fp32":
        bad, valid = f"wire_dtype={config.wire_dtype!r}", "wire_dtype='fp32'"
    else:
        return
    raise ValueError(f"pipedap: parameter {name!r} has sparse gradients ({kind}), which pipedap all-reduces exactly "
                     f"as DDP does; {bad} is not supported together with sparse gradients. Valid: {valid}, or "
                     "sparse=False for that embedding")


def start_compression_helper(config: PipeDAPConfig, device: torch.device, rank: int) -> Any:
    """The fit's compression helper, started at set-up (its start-up overlaps the warm-up steps) and given
    each final schedule's bucket layout by ``relayout``: one helper process per rank for the whole fit.

    Raises:
        ValueError: compression on a non-CPU device.
    """
    from lightning_pipedap.compress import CompressionPipeline  # noqa: PLC0415
    from lightning_pipedap.compress.compressors import compressor_kwargs  # noqa: PLC0415

    if device.type != "cpu":
        raise ValueError("pipedap: compression= runs on CPU/gloo in this version; on CUDA use compression=None")
    kwargs = dict(config.compression_kwargs)
    if "rank" in compressor_kwargs(config.compression) and config.compression != "powersgd":
        kwargs["rank"] = rank  # per-rank random streams (QSGD, DGC sampling)
    return CompressionPipeline.start(config.compression, kwargs, threads=config.compression_threads,
                                     timeout_s=config.wait_timeout_s, mode=config.compression_mode,
                                     start_timeout_s=config.wait_timeout_s)


class Runtime:
    """One fit's run-time state (module docstring).

    Args:
        config: the strategy's options.
        module: the LightningModule (an ``nn.Module``).
        optimizers: ``optimizers()`` -> the strategy's optimizers (they exist only after set-up).
        comm: the dedicated process group of the engine.
        world_size, rank, device: of this process.
        measured: measurements kept across fits (contention, calibration).
        resume: a loaded checkpoint's plan and compression state (used by :meth:`start`).
        info, warn: rank-0 loggers.
        counts: ``update_counts`` of the strategy (incremented per applied bucket).
        records: the strategy's timeline records; ``timeline()`` says whether to record.

    Raises:
        ValueError: no trainable parameter, or trainable parameters that differ between ranks.
    """

    def __init__(self, config: PipeDAPConfig, module: torch.nn.Module, optimizers: Callable[[], list],
                 comm: Any, world_size: int, rank: int, device: torch.device, measured: Measured,
                 resume: R.ResumeState, info: Callable[[str], None], warn: Callable[[str], None],
                 counts: dict[str, int], records: list[OpRecord], timeline: Callable[[], bool],
                 run_noun: str = "fit") -> None:
        self.config, self.module, self.optimizers, self.comm = config, module, optimizers, comm
        self.world_size, self.rank, self.device = world_size, rank, device
        self.info, self.warn, self.counts, self.records, self.timeline = info, warn, counts, records, timeline
        self.resume = resume
        self.params: list[Tensor] = []
        self.engine: Optional[CommEngine] = None
        self.deferred: Optional[DeferredUpdates] = None
        self.order: list[int] = []
        self.owners: list[Optional[torch.nn.Module]] = []
        self.installed_schedule: Optional[str] = None
        self.final_schedule: Optional[Schedule] = None
        #: name of the schedule communicating now (final, profiling or warm-up): what ran at the end of a fit
        self.running_schedule: Optional[str] = None
        self._logged_schedule: Optional[str] = None  # the last "pipedap: schedule ..." line, not repeated
        #: Trainer(deterministic=True) where candidates round differently (see :func:`timing_free_reason`): the fixed
        #: ``dear`` schedule with ``bucket_cap_mb`` fusion runs instead of a plan that depends on measured times
        self.timing_free = timing_free_reason(config, world_size)
        if self.timing_free:
            info(f"pipedap: torch.use_deterministic_algorithms is on (Trainer(deterministic=True)) and {self.timing_free}, "
                 f"so which schedule runs must not depend on timing: schedule {config.schedule!r} runs as the fixed "
                 f"'dear' schedule with bucket_cap_mb={config.bucket_cap_mb:g} fusion (no profiling, trials or "
                 "re-plans); two identical runs then give identical bits")
        self.controller = Controller(RunEffects(self), planned=config.planned and not self.timing_free,
                                     warmup_steps=config.warmup_steps,
                                     profile_steps=config.profile_steps, trial_steps=config.trial_steps,
                                     trial_rounds=config.trial_rounds, trial_window_s=config.trial_window_s,
                                     replan_every=config.replan_every, replan_margin=config.replan_margin,
                                     max_replans=config.max_replans, run_noun=run_noun,
                                     prefer_margin=config.torch_ddp_margin, startup_budget=config.startup_budget,
                                     asked=config.schedule)
        self.planning = Planning(config, comm, device, world_size, rank, measured, info, warn)
        info(f"pipedap: {config.what_runs()}")
        self.planning.job = job_label(module)
        #: the fit's plan cache (a remembered plan after the trace; a finished selection remembered)
        self.plan_cache = PlanCache(config, rank, info, warn)
        #: ``(nodes, processes per node)`` (set by the strategy; the plan cache's key)
        self.layout: tuple[int, int] = (1, world_size)
        for note in config.ignored_options():  # (once per fit: options that do not apply are not silent)
            info(note)
        self.carry = (R.CompressionCarry(config.compression, config.compression_kwargs, self.engine_param_info, info)
                      if config.compression else None)
        if self.carry is not None:
            self.carry.state = resume.compression
        # per-step flags and measurements
        self.sync_grads = True  # False inside accumulation micro-batches (block_backward_sync)
        self.in_train_forward = False
        self.buffers_sync_next = True
        self.recorder: Optional[Any] = None
        self.t_backward_done: Optional[float] = None
        self.t_step_end: Optional[float] = None
        self.trace: Optional[ConsumerTrace] = None
        self._tracing = False
        self._index_of: dict[int, int] = {}
        self._engine_params: list[Tensor] = []
        self._stack = ModuleStack(module)  # the model's structure is fixed for the fit
        self._said: set[str] = set()
        self._end_queued = False
        self.tset = TrainableSet(module, rank)
        self.name_of = self.tset.name_of
        #: the trainable parameters with sparse gradients, reduced outside the buckets (None: there are none)
        self.sparse: Optional[SparseGradReducer] = None
        self.params = self.dense_params(self.tset.collect())
        self.trainable_key = 0
        self.heartbeat: Optional[C.Heartbeat] = None
        #: a trace or profiling step left a trainable parameter without a gradient on some rank (the reduced
        #: used-flags count the ranks: identical on every rank); the ``torch_ddp`` candidate then gets
        #: ``find_unused_parameters``
        self.saw_unused = False
        self.stalls = 0  # stalled DDP reductions so far (store keys of the stall agreement)
        self.fit_id = next(_FITS)  # (the same on every rank: every rank builds its run-times in the same order)
        self.hooks = ModelHooks(module)
        #: DDP's reducer for the rest of the fit, when the ``torch_ddp`` candidate runs
        #: (``set_model`` is given by the strategy: :meth:`enable_handover`)
        self.handover: Optional[TorchDDPHandover] = None
        #: ``() -> int``: the current optimizer step (Lightning's ``global_step``; set by the strategy)
        self.step_of: Callable[[], int] = lambda: -1
        #: the ``nonfinite`` check of this fit (the strategy turns it off under an fp16 grad scaler)
        self.nonfinite = NonFiniteCheck(config.nonfinite, self.name_of, warn, config.wire_dtype,
                                        lambda b: self.engine is not None and self.engine.schedule.is_wire16(b))
        self.nonfinite.step_of = lambda: self.step_of()
        self._params_checked_at = 0
        #: the compression helper for the whole fit (started now, given a layout per final schedule)
        self.pipe = None
        if config.compression:
            t0 = time.perf_counter()
            self.pipe = start_compression_helper(config, device, rank)
            self.controller.account({"helper_start": time.perf_counter() - t0})

    def start_heartbeat(self, on_stale: Callable[[str], None]) -> None:
        """Liveness of the peers (:class:`~lightning_pipedap.engine.collectives.Heartbeat`) with the
        communication timeout: errors name the rank that does not answer, ``on_stale`` ends the wait that
        nothing else bounds."""
        self.heartbeat = C.Heartbeat(self.config.wait_timeout_s, on_stale=on_stale, context=self.describe_step)

    def describe_step(self) -> str:
        """``"phase run, engine round 12"``: where this rank is, for error messages."""
        return (f"phase {self.controller.phase.value}, engine round "
                f"{self.engine.iteration if self.engine is not None else 0}")

    # ------------------------------------------------------------------ parameters
    def dense_params(self, trainable: list[Tensor]) -> list[Tensor]:
        """The parameters of ``trainable`` with dense gradients (the engine's); those with sparse gradients go to
        :attr:`sparse` (its group is created here at the first one: every rank reaches this point alike).

        Raises:
            ValueError: a sparse-gradient parameter with ``compression`` or a 16-bit ``wire_dtype``
                (:func:`refuse_sparse_with`).
        """
        kinds = sparse_gradient_params(self.module)
        sparse = [p for p in trainable if id(p) in kinds]
        for p in sparse[:1]:
            refuse_sparse_with(self.config, self.name_of(p), kinds[id(p)])
        dense = [p for p in trainable if id(p) not in kinds]
        # (nothing to plan without a dense bucket; nothing timing-dependent under deterministic=True where candidates
        # round differently)
        self.controller.planned = self.config.planned and not self.timing_free and bool(dense)
        if not sparse and self.sparse is None:
            return dense
        if self.sparse is None:
            group = C.new_comm_group(self.config.wait_timeout_s)
            self.sparse = SparseGradReducer(group, sparse, self.name_of)
        self.sparse.params = sparse
        if sparse:
            names = ", ".join(self.name_of(p) for p in sparse[:4]) + (", ..." if len(sparse) > 4 else "")
            only = ("; no parameter has a dense gradient, so there is no bucket to plan"
                    f"{f' (schedule {self.config.schedule!r} is not used)' if self.config.planned else ''}"
                    if not dense else "")
            self.say("sparse", f"pipedap: {len(sparse)} parameter(s) with sparse gradients ({names}): each is "
                     "all-reduced as DDP does (divided by the world size, one sparse all-reduce per parameter at the "
                     "end of backward, on a process group of its own), and every step runs in sync mode (as "
                     f"defer_update=False){only}")
        return dense

    @property
    def has_sparse(self) -> bool:
        """Whether some trainable parameter has a sparse gradient. The strategies then run every step in sync mode:
        the deferred per-bucket updates step only the buckets' parameters."""
        return self.sparse is not None and bool(self.sparse.params)

    def install_hooks(self, on_grad: Callable[[Tensor], None], on_forward: Callable[..., Any]) -> None:
        """Gradient hooks on the trainable parameters and forward pre-hooks on the eager modules
        (:class:`~lightning_pipedap.strategy.hooks.ModelHooks`)."""
        self.hooks.install(self.params, on_grad, on_forward)

    def enable_handover(self, set_model: Callable[[torch.nn.Module], None]) -> None:
        """Allow the ``torch_ddp`` candidate: ``set_model(m)`` makes ``m`` what the strategy runs."""
        self.handover = TorchDDPHandover(self.module, self.device, set_model, self.hooks.remove, self.hooks.reinstall,
                                         (lambda: self.buffers_sync_next, self._set_buffers_sync_next))

    def _set_buffers_sync_next(self, value: bool) -> None:
        self.buffers_sync_next = value

    @property
    def handed_over(self) -> bool:
        """Whether DDP's reducer synchronises the gradients now (the ``torch_ddp`` candidate)."""
        return self.handover is not None and self.handover.active

    def after_ddp_backward(self) -> None:
        """After a backward under DDP's reducer: when its reduction stalled (a parameter got no gradient and the
        ``torch_ddp`` candidate runs without ``find_unused_parameters``), finish it as DDP with that option would
        and continue with it (:meth:`TorchDDPHandover.finish_stalled`), before the optimizer step reads ``.grad``.

        Raises:
            RuntimeError: naming the parameters, the step and the ranks, when the stall is not on every rank (a
                parameter unused on some ranks only: the others are blocked in DDP's backward, and no rank steps),
                within ``min(60 s, wait_timeout_s)``.
        """
        h = self.handover
        if h is None or not h.stalled():
            return
        step = self._step_text()
        missing = C.ranks_not_stalled(self._stall_key(), self.rank, self.comm.world_size,
                                      min(60.0, self.config.wait_timeout_s))
        self.stalls += 1
        if missing:
            local = [self.name_of(p) for p in self.params if p.requires_grad and p.grad is None][:5]
            raise RuntimeError(
                f"pipedap: rank {self.rank}: {', '.join(local) or 'a parameter'} got no gradient in {step} under DDP's "
                f"reducer (the torch_ddp candidate, which runs without find_unused_parameters: you passed "
                f"find_unused_parameters=False, and every parameter had a gradient in the profiled steps), but rank(s) {missing} had one: DDP cannot average such a step. "
                + _STALL_REMEDY)
        unused = h.finish_stalled(self.comm)
        assert h.candidate is not None
        self.installed_schedule = h.candidate.describe()
        names = ", ".join(self.name_of(p) for p in unused[:5]) + (", ..." if len(unused) > 5 else "")
        self.say("ddp-stalled", f"pipedap: {'parameter(s) ' + names if unused else 'a parameter'} got no gradient in "
                 f"{step} under DDP's reducer, which ran without find_unused_parameters (every "
                 "parameter had one in the profiled steps); pipedap averaged this step's gradients as DDP with "
                 "find_unused_parameters=True does, and DDP's reducer continues with that option")

    def stalled_elsewhere(self) -> Optional[str]:
        """Why DDP's backward failed on this rank when another rank's reduction stalled in this step (a parameter
        unused on that rank only, see :meth:`after_ddp_backward`), as an error message; None when no other rank
        marked a stall (then the failure has another cause). Reads the rendezvous store only."""
        if not self.handed_over:
            return None
        marked = [r for r in C.ranks_marked_stalled(self._stall_key(), self.comm.world_size) if r != self.rank]
        if not marked:
            return None
        return (f"pipedap: rank {self.rank}: DDP's reducer failed in {self._step_text()}: rank(s) {marked} got no "
                "gradient for a parameter that this rank used (the torch_ddp candidate runs without "
                "find_unused_parameters: you passed find_unused_parameters=False, and every parameter had a gradient in "
                "the profiled and trial steps), so the "
                f"bucket all-reduces this rank launched were never matched; the error of rank(s) {marked} names the "
                "parameters. " + _STALL_REMEDY)

    def _stall_key(self) -> str:
        """Rendezvous-store key of this fit's next stall agreement (:func:`C.ranks_not_stalled`)."""
        return f"pipedap/ddp_stall/{self.fit_id}/{self.stalls}"

    def _step_text(self) -> str:
        """``"global step 12"`` for messages (``"a step"`` outside a Trainer)."""
        trainer = compat.attached_trainer(self.module)
        return f"global step {trainer.global_step}" if trainer is not None else "a step"

    def trainable_signature(self) -> int:
        return self.tset.key(self.optimizers())

    def retrain_if_changed(self) -> None:
        """At a step's start: if parameters were (un)frozen or a param group added, rebuild buckets and plan.

        Every rank checks the same thing at the same step; the new trainable set is compared across
        ranks. Pending updates are applied first; training then traces, profiles and plans again as at
        the start (sync steps), and every param group is stepped.
        """
        key = self.trainable_signature()
        if key == self.trainable_key:
            return
        self.trainable_key = key
        self.flush()
        before = len(self.params)
        self.params = self.dense_params(self.tset.collect())
        self.hooks.add_params(self.params)
        self.recorder, self._tracing = None, False
        self.controller.restart()
        self.install_warmup()
        self.info(f"pipedap: the trainable parameters or the optimizer's param groups changed ({before} -> "
                  f"{len(self.params)} trainable tensors): buckets rebuilt, tracing and planning again")

    def wrap_train(self, module: torch.nn.Module, flush: Callable[[], None]) -> None:
        """Apply pending updates before ``module.train(mode)`` runs (it may read weights: LoRA-style merges)."""

        def before(m: torch.nn.Module) -> None:
            if self.deferred is not None and self.deferred.pending is not None:
                self.say(f"train:{type(m).__name__}", f"pipedap: {type(m).__name__}.train() can read its weights; "
                         "pending updates are applied before it")
                flush()

        self.hooks.wrap_train(module, before)

    def engine_param_info(self, engine: Optional[CommEngine] = None) -> ParamInfo:
        """Engine parameter index -> ``(name, shape)``."""
        return self.tset.engine_info(engine or self.engine)

    # ------------------------------------------------------------------ engines
    def builtin(self, order: list[int], name: str, compress_all: bool = False, wire16_all: bool = False) -> Schedule:
        params = [self.params[i] for i in order]
        return builtin_schedule(name, [p.numel() * p.element_size() for p in params],
                                int(self.config.bucket_cap_mb * 2**20), [(p.dtype, p.device) for p in params],
                                compress_all=compress_all, wire16_all=wire16_all)

    def install(self, order: list[int], schedule: Schedule, owners: Optional[list[Optional[torch.nn.Module]]],
                final: bool = False) -> None:
        """Replace the engine: parameters in ``order``, ``schedule`` over their indices, triggers from ``owners``.

        ``final``: the schedule training runs with (compression, if configured, starts here; warm-up and
        profiling steps communicate uncompressed).
        """
        # parameters that earlier micro-batches of this accumulation window used: the new engine reduces them
        # too (a candidate switch comes in the optimizer step, after those micro-batches)
        used_so_far = [self._engine_params[k] for k in self.engine.local_gradients()] if self.engine is not None else []
        self.close_engine()
        params = [self.params[i] for i in order]
        self._index_of = {id(p): k for k, p in enumerate(params)}
        self._engine_params = params  # (engine order: what the consumer trace watches)
        factory = self._compression_factory() if final and self.config.compression else None
        self.engine = CommEngine(self.comm, params, schedule, self.config.wait_timeout_s, transport_factory=factory,
                                 wire_dtype=self.config.wire_dtype, bucket_view=self.config.gradient_as_bucket_view,
                                 param_names=[self.name_of(p) for p in params])
        for b, reason in sorted(self.engine.view_refusals.items()):
            names = ", ".join(self.name_of(p) for p in self.engine.buckets[b].params[:3])
            self.say(f"view:{reason}", f"pipedap: gradient_as_bucket_view: bucket {b} ({names}, ...) keeps the copy "
                     f"path: {reason}")
        for p in used_so_far:
            k = self._index_of.get(id(p))
            if k is not None:
                self.engine.local_gradient(k)
        self.engine.timeline_enabled = self.timeline()
        self.engine.context = self.describe_step
        self.engine.peers = self.heartbeat.describe if self.heartbeat is not None else None
        if self.carry is not None and self.resume.plan is None:  # (a checkpoint's plan is installed next)
            self.carry.restore(self.engine)
        self.deferred = DeferredUpdates(self.engine, self.name_of, self.say, self.records,
                                        self.timeline, self.counts, self.nonfinite)
        # (the used-flags are watched only while the torch_ddp candidate may still be installed without
        # find_unused_parameters: before the final schedule runs, and until a partial use is seen)
        self.deferred.track_use = (self.handover is not None and self.config.torch_ddp_candidate and not self.saw_unused
                                   and (not final or self.controller.phase is not Phase.RUN))
        self.deferred.set_owners(owners, self.module)
        if owners is not None:  # (a first consumer without parameters of its own reads another module's)
            self.hooks.add_modules([o for o in dict.fromkeys(owners) if o is not None])
        if final:
            self.installed_schedule, self.final_schedule = schedule.describe(), schedule
        self.running_schedule = schedule.name
        what = "schedule" if final else "warm-up schedule (sync mode, until the plan is ready)"
        line = f"pipedap: {what} {schedule.describe()[:300]}"
        if line != self._logged_schedule:  # (the profiling steps re-install the set-up's warm-up schedule)
            self.info(line)
        self._logged_schedule = line

    def note_partial_use(self) -> None:
        """Carry the current deferred updates' sighting of a parameter some rank left without a gradient into
        :attr:`saw_unused` (before they are replaced)."""
        if self.deferred is not None and self.deferred.saw_partial_use:
            self.saw_unused = True

    def close_engine(self) -> None:
        """Finish and close the current engine, or leave DDP's reducer."""
        self.note_partial_use()
        if self.handover is not None:
            self.handover.leave()
        if self.engine is not None:
            self.engine.wait_idle()
            if self.deferred is not None:
                self.deferred.write_unwritten()  # .grad shows the averaged gradients, as under DDP
            if self.carry is not None:
                self.carry.keep(self.engine)
            self.engine.close()
            self.engine, self.deferred = None, None

    def install_warmup(self) -> None:
        """Registration order, one all-reduce per bucket (WFBP), sync mode."""
        order = list(range(len(self.params)))
        self.install(order, self.builtin(order, "allreduce"), owners=None)

    def _compression_factory(self) -> Callable[[list], Any]:
        from lightning_pipedap.engine.compressed import CompressedTransport  # noqa: PLC0415

        def factory(buckets: list) -> Any:
            # (the state moves by name through ``carry``: keep() before, restore() after)
            self.pipe.relayout([b.numel for b in buckets], self.tset.layouts(buckets), keep_state=False)
            return CompressedTransport(self.pipe, self.comm, owns_pipeline=False)

        return factory

    def flush(self) -> None:
        if self.deferred is not None:
            self.deferred.apply_all("flush")

    def say(self, key: str, message: str) -> None:
        """Log ``message`` on rank 0 once per fit."""
        if key not in self._said:
            self._said.add(key)
            self.info(message)

    # ------------------------------------------------------------------ hooks' reactions
    def grad_ready(self, p: Tensor) -> None:
        engine = self.engine
        if engine is None or p.grad is None:
            return
        i = self._index_of.get(id(p))
        if i is None:  # not trainable when the buckets were built (see retrain_if_changed)
            return
        if not engine.collecting:  # an accumulation micro-batch: used in this window, reduced in the next round
            engine.local_gradient(i)
            return
        if p.grad.layout != torch.strided:
            raise ValueError(f"pipedap: parameter {self.name_of(p)!r} got a {p.grad.layout} gradient, but it is not "
                             "the weight of an nn.Embedding / nn.EmbeddingBag with sparse=True, the parameters "
                             "pipedap reduces as sparse (found at set-up); build it as such a module, or use "
                             "strategy='ddp'")
        self.deferred.gradient_arrived(i)
        if not self._end_queued:
            # as DDP's reducer: the reduction finishes when autograd's backward pass ends, so user code right
            # after ``loss.backward()`` (a LightningModule.backward override) sees averaged gradients in sync mode
            self._end_queued = True
            compat.queue_autograd_callback(self._end_of_backward_pass)
        engine.grad_ready(i, p.grad)
        if self.recorder is not None:
            self.sync_device()
            self.recorder.param_ready(i)

    def module_forward(self, module: torch.nn.Module) -> None:
        deferred = self.deferred
        if deferred is None:
            return
        if not self.in_train_forward:
            # a forward outside training_step (an RL agent acting in the data loader, a metric computed
            # in a hook) must see the updated weights, as under DDP
            if deferred.pending is not None and not deferred.applying:
                self.say("outside", f"pipedap: {type(module).__name__} ran a forward outside training_step while "
                         "updates were pending; they are applied first")
                deferred.apply_all("flush")
            return
        if self.recorder is not None:
            for k in self.planning.layer_of_module.get(id(module), ()):
                self.sync_device()
                self.recorder.layer_used(k)
        deferred.at_module(module)

    def _end_of_backward_pass(self) -> None:
        self._end_queued = False
        self.finish_backward()

    def sync_device(self) -> None:
        """On CUDA, synchronise before a profiling timestamp (only called while profiling)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ one step
    def training_step(self, call: Callable[[], Any]) -> Any:
        """Run Lightning's ``training_step`` (``call``): trace it, guard it or just time it."""
        self.nonfinite.verdict = None
        self.check_params()
        self._sync_buffers_if_due()
        deferred = self.deferred
        deferred.before_training_step()
        ctl = self.controller
        if ctl.phase is Phase.TRACE and ctl.sync_steps == 0 and not self._tracing:
            self._tracing = True
            with consumer_mode(self._stack, self._engine_params, [], None, track=True) as trace:
                self.trace = trace
                return self._timed_step(call)
        if not deferred.guard_needed:
            out = self._timed_step(call)
        else:
            with consumer_mode(self._stack, self._engine_params, self.optimizers(), deferred.guarded_read,
                               track=False):
                try:
                    out = self._timed_step(call)
                finally:
                    self._adopt_misses()
        if deferred.pending is not None and self.config.gradient_as_bucket_view:
            # .grad is the bucket: what the forward left lands before Lightning's zero_grad, which may zero .grad
            # in place (set_to_none=False) and so the reduced gradients of a bucket still pending
            deferred.land_leftovers()
        return out

    def check_params(self) -> None:
        """``check_params_every_n_steps=N``: at the first ``training_step`` of every N-th optimizer step (the same
        point on every rank), apply pending updates and :func:`.numerics.check_replicas_agree` (which raises
        ``ParameterDivergenceError`` on every rank when a parameter differs)."""
        every, step = self.config.check_params_every_n_steps, self.step_of()
        if not every or step <= 0 or step % every or step == self._params_checked_at:
            return
        self._params_checked_at = step
        self.flush()
        check_replicas_agree(self.module, step, every)

    def plain_forward(self, call: Callable[[], Any]) -> Any:
        """Run a forward that is not a training step (``call``; Fabric: one without autograd), with DDP's
        buffer rule only: rank 0's buffers are broadcast first if the previous forward synced gradients."""
        self._sync_buffers_if_due()
        out = call()
        self.buffers_sync_next = torch.is_grad_enabled() and self.sync_grads
        return out

    def _sync_buffers_if_due(self) -> None:
        if self.buffers_sync_next:
            bufs = list(self.module.buffers())
            if bufs:
                with torch.no_grad():
                    C.broadcast_coalesced_(bufs, src=0)

    def _adopt_misses(self) -> None:
        """Parameters the guard caught read before their trigger are owned by the root from now on (every
        later schedule of this fit applies them before ``training_step``)."""
        deferred = self.deferred
        deferred.end_guard()
        if deferred.missed and self.owners:
            for i in deferred.missed:
                self.owners[i] = self.module
            deferred.missed.clear()

    def _timed_step(self, call: Callable[[], Any]) -> Any:
        if self.controller.phase is Phase.PROFILE and self.sync_grads:
            self.sync_device()
            self.recorder = self.planning.recorder()
            self.recorder.forward_start()
            if self.t_step_end is not None:
                self.recorder.pre_gap = self.recorder.t_fwd0 - self.t_step_end
            for k in self.planning.layer_of_module.get(id(self.module), ()):
                self.recorder.layer_used(k)
        self.in_train_forward = True
        try:
            out = call()
        finally:
            self.in_train_forward = False
        if self.recorder is not None:
            self.sync_device()
            self.recorder.forward_end()
        # DDP's rule: buffers are broadcast before a forward that follows a grad-syncing forward
        self.buffers_sync_next = torch.is_grad_enabled() and self.sync_grads
        return out

    def before_backward(self) -> None:
        self.deferred.before_backward()
        self.engine.attach_views()  # (gradient_as_bucket_view: None .grad -> zeroed views; every pending bucket landed)
        if self.sync_grads:
            step = self.step_of()
            self.engine.begin_iteration(step if step >= 0 else None)  # (timeline records name the step)
            if self.recorder is not None:
                self.sync_device()
                self.recorder.backward_start()

    def finish_backward(self) -> None:
        """End of backward: in sync mode wait for every bucket and write the averaged gradients to ``.grad``; the
        sparse gradients (:attr:`sparse`) are all-reduced meanwhile on their own group and set in ``.grad`` too."""
        self.deferred.check_stale()
        engine = self.engine
        if not engine.collecting:
            return
        if self.recorder is not None:
            self.sync_device()
            self.recorder.backward_end()
        engine.finish_backward()
        if self.deferred.deferring:  # (never with sparse gradients: those steps run in sync mode, see has_sparse)
            return
        sparse = self.sparse if self.has_sparse else None
        t0 = time.perf_counter()
        if sparse is not None:  # (its own group: they run while the engine finishes the dense buckets)
            with torch.no_grad():
                sparse.start()
        engine.wait_idle()
        if self.timeline():
            step = self.step_of()
            self.records.append(OpRecord("wait_all", "wait", None, t0, time.perf_counter(), "compute",
                                         step if step >= 0 else None))
        with torch.no_grad():
            watching = self.controller.phase is not Phase.RUN  # (trace, profile and trial steps)
            for b in range(engine.num_buckets):
                used = engine.used_flags(b)
                bucket = engine.wait_done(b)
                if watching and not self.saw_unused:
                    self.saw_unused = bucket.some_rank_unused(self.comm.world_size)
                write_back_grads(bucket, used)
            if sparse is not None:
                sparse.finish()
        # (the reduced buckets are identical on every rank: every rank finds the same)
        self.nonfinite.verdict = self.nonfinite.scan(engine.buckets) if self.nonfinite.active else None
        if sparse is not None and self.nonfinite.verdict is None and self.nonfinite.active:
            self.nonfinite.verdict = self.nonfinite.scan_sparse(sparse)
        self.sync_device()
        self.t_backward_done = time.perf_counter()

    def after_sync_step(self) -> None:
        self.sync_device()
        self.controller.after_sync_step(time.perf_counter())
        # the next profiled step's pre_gap (host work between steps) starts after the controller's work: a
        # transition's α-β and contention benchmarks, planning and engine installs are not per-step work
        self.t_step_end = time.perf_counter()
        self._tracing = self._tracing and self.controller.phase is Phase.TRACE

    # ------------------------------------------------------------------ manual optimization: one step per training_step
    def manual_step_start(self) -> None:
        """Manual optimization: a ``training_step`` starts. Its forward segments, backward passes and optimizer
        steps (several with a GAN) are one step of the run-time: traced, profiled and timed as a whole, and
        schedules change only between two of them (here, on every rank alike)."""
        self.retrain_if_changed()
        if self.controller.phase.deferrable:
            self.controller.at_step_start()  # a final schedule runs: time the step, switch candidates when due

    def manual_step_end(self) -> None:
        """Manual optimization: the ``training_step`` returned; the step ends (the controller advances). The
        optimizer steps ran inside it, in its profiled forward time: no separate update time is measured."""
        self.t_backward_done = None
        self.after_sync_step()

    def close(self, abort: bool = False) -> None:
        """Close the engine (or leave DDP's reducer), remove the hooks and the ``train()`` wrappers; say so when
        the fit ended before measured plan selection chose a candidate."""
        note = None if abort else self.controller.unfinished_trial()
        if note:
            self.info(note)
        if self.handover is not None:
            self.handover.leave(rehook=False)  # (local: unwrapping communicates nothing)
        self.hooks.close()
        if self.engine is not None:
            self.engine.close(abort=abort)
        if self.sparse is not None and not abort:
            C.destroy_comm_group(self.sparse.comm)
        if self.heartbeat is not None:
            self.heartbeat.stop("failed" if abort else "left")
        if self.pipe is not None:
            self.pipe.close()
