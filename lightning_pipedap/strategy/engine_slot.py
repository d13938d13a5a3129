"""The engine one fit runs now, or DDP's reducer instead (:class:`EngineSlot`), and which schedule that is
(:class:`ScheduleRecord`).

Installing replaces the :class:`~lightning_pipedap.engine.engine.CommEngine` and its
:class:`~lightning_pipedap.strategy.deferred.DeferredUpdates`: the parameters a current accumulation window
used locally move to the new engine, the compression state moves through
:class:`~lightning_pipedap.strategy.resume.CompressionCarry`, and ``.grad`` shows the averaged gradients of
the old engine when it closes, as under DDP. Handing over to DDP's reducer (the ``torch_ddp`` candidate)
closes the engine and wraps the model (:class:`~lightning_pipedap.strategy.handover.TorchDDPHandover`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_pipedap.engine.engine import CommEngine
from lightning_pipedap.schedule import Schedule
from lightning_pipedap.strategy.context import FitContext
from lightning_pipedap.strategy.controller import Phase
from lightning_pipedap.strategy.deferred import DeferredUpdates
from lightning_pipedap.strategy.handover import TorchDDPCandidate, TorchDDPHandover
from lightning_pipedap.strategy.hooks import ModelHooks
from lightning_pipedap.strategy.numerics import NonFiniteCheck
from lightning_pipedap.strategy.params import ParamInfo, TrainableSet
from lightning_pipedap.strategy.resume import CompressionCarry, ResumeState
from lightning_pipedap.strategy.sharding import ownership_summary
from lightning_pipedap.strategy.step import Timeline


class ScheduleRecord:
    """Which schedule runs: the final one installed (:attr:`final`, its ``describe()`` :attr:`installed`), the
    one communicating now (:attr:`running`: final, profiling or warm-up), and the last schedule line logged.

    Args:
        info: rank-0 logger.
    """

    def __init__(self, info: Callable[[str], None]) -> None:
        self._info = info
        self.installed: Optional[str] = None
        self.final: Optional[Any] = None
        self.running: Optional[str] = None
        self._logged: Optional[str] = None  # the last "pipedap: schedule ..." line, not repeated

    def engine_runs(self, schedule: Schedule, final: bool, sharded: bool = False) -> None:
        """An engine with ``schedule`` was installed (``final``: the schedule training runs with; ``sharded``: its
        optimizer step is sharded, ``shard_optimizer``); its line is logged unless it repeats the last one (the
        profiling steps re-install the set-up's warm-up schedule)."""
        if final:
            self.installed, self.final = schedule.describe(), schedule
        self.running = schedule.name
        what = "schedule" if final else "warm-up schedule (sync mode, until the plan is ready)"
        line = f"pipedap: {what} {schedule.describe()[:300]}"
        if sharded:
            line += " (shard_optimizer: each rank steps its reduce-scatter shard, parameters all-gathered)"
        if line != self._logged:
            self._info(line)
        self._logged = line

    def ddp_runs(self, candidate: TorchDDPCandidate) -> None:
        """DDP's reducer runs ``candidate`` (always logged)."""
        self.installed, self.final = candidate.describe(), candidate
        self.running = candidate.name
        self._logged = f"pipedap: schedule {candidate.describe()}"
        self._info(self._logged)

    def ddp_continues_as(self, candidate: TorchDDPCandidate) -> None:
        """DDP's reducer continues with other options (a stalled reduction finished, see ``DDPStall``)."""
        self.installed = candidate.describe()


class EngineSlot:
    """The current engine and deferred updates of one fit, the parameter order and owners they are built on,
    and DDP's reducer when the ``torch_ddp`` candidate runs.

    Args:
        ctx: the fit's :class:`~lightning_pipedap.strategy.context.FitContext`.
        tset: the fit's trainable set (parameter names; compression layouts).
        hooks: the fit's model hooks (owners get forward pre-hooks).
        nonfinite: the fit's ``nonfinite`` check (given to the deferred updates).
        timeline: the strategy's timeline records.
        counts: ``update_counts`` of the strategy.
        resume: a loaded checkpoint's plan and compression state.
        phase: ``() -> Phase`` of the controller.
        describe_step: ``() -> str``, where this rank is (engine error messages).
        peers: ``() -> describe``: the heartbeat's description of the peers (engine error messages), or None.
        pipe: the fit's compression helper, or None.

    Attributes:
        engine, deferred: the installed engine and its deferred updates (None under DDP's reducer).
        order: engine position -> index into the trainable parameters (the traced order).
        owners: the owner (trigger module) of each engine position, or None.
        handover: DDP's reducer for the rest of the fit when the ``torch_ddp`` candidate runs (None: not allowed).
        saw_unused: a trace, profiling or trial step left a trainable parameter without a gradient on some rank
            (identical on every rank); the ``torch_ddp`` candidate then gets ``find_unused_parameters``.
        schedules: the :class:`ScheduleRecord`.
        carry: the compression state across engines (None without compression).
    """

    def __init__(self, ctx: FitContext, tset: TrainableSet, hooks: ModelHooks, nonfinite: NonFiniteCheck,
                 timeline: Timeline, counts: dict[str, int], resume: ResumeState, phase: Callable[[], Phase],
                 describe_step: Callable[[], str], peers: Callable[[], Optional[Callable[[], str]]],
                 pipe: Optional[Any]) -> None:
        cfg = ctx.config
        self.ctx, self.tset, self.hooks, self.nonfinite = ctx, tset, hooks, nonfinite
        self.timeline, self.counts, self.resume, self._phase = timeline, counts, resume, phase
        self.describe_step, self._peers, self.pipe = describe_step, peers, pipe
        self.engine: Optional[CommEngine] = None
        self.deferred: Optional[DeferredUpdates] = None
        self.order: list[int] = []
        self.owners: list[Optional[torch.nn.Module]] = []
        self.handover: Optional[TorchDDPHandover] = None
        self.saw_unused = False
        #: ``shard_optimizer`` as it applies to this fit: True, False or "auto" (per candidate schedule:
        #: ``Schedule.sharded``); "auto" becomes False where sharding is refused (set-up)
        self.shard_mode = cfg.shard_optimizer
        #: ``shard_optimizer`` with a whole-tensor optimizer (Muon, Adafactor): parameter ownership
        #: (:func:`~lightning_pipedap.strategy.sharding.use_ownership`, at set-up)
        self.shard_owned = False
        #: with it, ``id(parameter) -> seconds of its optimizer step`` (measured on rank 0, the same on every rank),
        #: or None: owners balanced by elements
        self.owner_costs: Optional[dict[int, float]] = None
        #: the arguments of the last :meth:`install` (built again with parameter ownership)
        self.installed: Optional[tuple] = None
        self.schedules = ScheduleRecord(ctx.info)
        self._index_of: dict[int, int] = {}
        self._engine_params: list[Tensor] = []
        self.carry = (CompressionCarry(cfg.compression, cfg.compression_kwargs, self.engine_param_info, ctx.info,
                                       state=resume.compression) if cfg.compression else None)

    # ------------------------------------------------------------------ reads
    def index_of(self, p: Tensor) -> Optional[int]:
        """Engine position of trainable parameter ``p`` (None: not trainable when the engine was built)."""
        return self._index_of.get(id(p))

    @property
    def engine_params(self) -> list[Tensor]:
        """The parameters in engine order (what the consumer trace watches)."""
        return self._engine_params

    def engine_param_info(self, engine: Optional[CommEngine] = None) -> ParamInfo:
        """Engine parameter index -> ``(name, shape)``."""
        return self.tset.engine_info(engine or self.engine)

    @property
    def updates_pending(self) -> bool:
        """Whether a deferred update has not been applied yet."""
        return self.deferred is not None and self.deferred.pending is not None

    # ------------------------------------------------------------------ changes
    def adopt_layout(self, order: list[int], owners: list[Optional[torch.nn.Module]]) -> None:
        """The traced (or a checkpoint's) parameter order and owners, for the next installs."""
        self.order, self.owners = order, owners

    def owned_by_root(self, positions: Any) -> None:
        """Engine ``positions`` are owned by the root module from now on (their updates apply before
        ``training_step``)."""
        for i in positions:
            self.owners[i] = self.ctx.module

    def allow_handover(self, set_model: Callable[[torch.nn.Module], None],
                       buffer_sync: tuple[Callable[[], bool], Callable[[bool], None]]) -> None:
        """Allow the ``torch_ddp`` candidate: ``set_model(m)`` makes ``m`` what the strategy runs."""
        self.handover = TorchDDPHandover(self.ctx.module, self.ctx.device, set_model, self.hooks.remove,
                                         self.hooks.reinstall, buffer_sync)

    def install(self, params: list[Tensor], schedule: Schedule, owners: Optional[list[Optional[torch.nn.Module]]],
                final: bool = False) -> None:
        """Replace the engine: ``params`` in engine order, ``schedule`` over their indices, triggers from ``owners``.

        ``final``: the schedule training runs with (compression, if configured, starts here; warm-up and
        profiling steps communicate uncompressed).
        """
        cfg, ctx = self.ctx.config, self.ctx
        self.installed = (params, schedule, owners, final)
        # parameters that earlier micro-batches of this accumulation window used: the new engine reduces them
        # too (a candidate switch comes in the optimizer step, after those micro-batches)
        used_so_far = [self._engine_params[k] for k in self.engine.local_gradients()] if self.engine is not None else []
        # (a schedule's own choice counts under "auto" only: a cached or checkpointed plan of an "auto" fit installed
        # under True or False follows the option)
        sharded = bool(schedule.sharded) if self.shard_mode == "auto" else self.shard_mode is True
        old_shard = self.close_engine(keep_shards=sharded)
        ctx.comm.release_scratch()  # (sized for the closed engine's largest bucket; the new engine sizes its own)
        self._index_of = {id(p): k for k, p in enumerate(params)}
        self._engine_params = params
        factory = self._compression_factory() if final and cfg.compression else None
        self.engine = engine = CommEngine(ctx.comm, params, schedule, cfg.wait_timeout_s, transport_factory=factory,
                                          wire_dtype=cfg.wire_dtype, bucket_view=cfg.gradient_as_bucket_view,
                                          param_names=[self.tset.name_of(p) for p in params],
                                          shard=sharded, shard_ops=final, shard_owned=self.shard_owned,
                                          owner_costs=None if self.owner_costs is None else
                                          [self.owner_costs.get(id(p), 0.0) for p in params])
        if old_shard is not None:
            engine.shard.adopt(old_shard)  # (the sliced optimizer state moves shard to shard: never whole)
        for b, reason in sorted(engine.view_refusals.items()):
            names = ", ".join(self.tset.name_of(p) for p in engine.buckets[b].params[:3])
            ctx.say(f"view:{reason}", f"pipedap: gradient_as_bucket_view: bucket {b} ({names}, ...) keeps the copy "
                    f"path: {reason}")
        for p in used_so_far:
            k = self._index_of.get(id(p))
            if k is not None:
                engine.local_gradient(k)
        engine.worker.timeline_enabled = self.timeline.enabled()
        engine.context = self.describe_step
        engine.peers = self._peers()
        if self.carry is not None and self.resume.plan is None:  # (a checkpoint's plan is installed next)
            self.carry.restore(engine)
        self.deferred = DeferredUpdates(engine, self.tset.name_of, ctx.say, self.timeline.records,
                                        self.timeline.enabled, self.counts, self.nonfinite)
        # (the used-flags are watched only while the torch_ddp candidate may still be installed without
        # find_unused_parameters: before the final schedule runs, and until a partial use is seen)
        self.deferred.track_use = (self.handover is not None and cfg.torch_ddp_candidate and not self.saw_unused
                                   and (not final or self._phase() is not Phase.RUN))
        self.deferred.set_owners(owners, ctx.module)
        if owners is not None:  # (a first consumer without parameters of its own reads another module's)
            self.hooks.add_modules([o for o in dict.fromkeys(owners) if o is not None])
        shard = engine.shard
        self.schedules.engine_runs(schedule, final, sharded=shard is not None and bool(shard.sharded) and final)
        if shard is not None and final and self.shard_owned:
            ctx.say("shard-owners", "pipedap: shard_optimizer: " + ownership_summary(engine, self.owner_costs))
        if shard is not None and final and len(shard.sharded) < engine.num_buckets:
            ctx.say("shard-compressed", f"pipedap: shard_optimizer: {engine.num_buckets - len(shard.sharded)} "
                    f"compressed bucket(s) of {engine.num_buckets} are stepped unsharded (the compressed reduction "
                    "leaves the whole bucket on every rank; their optimizer state is whole)")

    def hand_over(self, candidate: TorchDDPCandidate) -> None:
        """Close the engine and let DDP's reducer run ``candidate`` (a collective on the default group, at the
        same step on every rank)."""
        self.close_engine()  # (notes a parameter some rank left without a gradient in the steps so far)
        if self.saw_unused and not candidate.find_unused_parameters:  # (seen after planning: in the trials)
            candidate = dataclasses.replace(candidate, find_unused_parameters=True)
        assert self.handover is not None
        self.handover.enter(candidate)
        self.schedules.ddp_runs(candidate)
        if candidate.find_unused_parameters and self.ctx.config.find_unused_parameters is None:
            self.ctx.say("ddp-find-unused", "pipedap: DDP's reducer runs with find_unused_parameters (the default, "
                         "find_unused_parameters=None), so that a parameter that gets no gradient on some ranks in a "
                         "later step cannot stop the fit; DDP may warn that it found no unused parameter. Pass "
                         "find_unused_parameters=False if every parameter gets a gradient on every rank in every step "
                         "(one collective less per step)")

    def note_unused(self, bucket: Any) -> None:
        """A reduced ``bucket`` of a watched step: note whether some rank left one of its parameters unused."""
        if not self.saw_unused:
            self.saw_unused = bucket.some_rank_unused(self.ctx.comm.world_size)

    def note_partial_use(self) -> None:
        """Carry the current deferred updates' sighting of a parameter some rank left without a gradient into
        :attr:`saw_unused` (before they are replaced)."""
        if self.deferred is not None and self.deferred.saw_partial_use:
            self.saw_unused = True

    def close_engine(self, keep_shards: bool = False) -> Optional[Any]:
        """Finish and close the current engine, or leave DDP's reducer. A sharded optimizer state is gathered back
        into ``optimizer.state`` (for DDP's reducer), or with ``keep_shards`` left in the closed engine's
        :class:`~lightning_pipedap.engine.shard_step.ShardedStep`, returned for the next engine to adopt."""
        self.note_partial_use()
        if self.handover is not None:
            self.handover.leave()
        kept = None
        if self.engine is not None:
            self.engine.wait_idle()
            if self.deferred is not None:
                self.deferred.write_unwritten()  # .grad shows the averaged gradients, as under DDP
            if self.engine.shard is not None:
                if keep_shards:
                    kept = self.engine.shard
                else:
                    self.engine.shard.consolidate()  # (the optimizer's own state again, for DDP's reducer)
            if self.carry is not None:
                self.carry.keep(self.engine)
            self.engine.close()
            self.engine, self.deferred = None, None
        if kept is not None:  # (the move to the next engine reads no buffer: free them before it allocates its own)
            kept.release_buffers()
        return kept

    def flush(self) -> None:
        """Apply every pending update."""
        if self.deferred is not None:
            self.deferred.apply_all("flush")

    @property
    def engine_sharded(self) -> bool:
        """Whether the installed engine steps the optimizer sharded."""
        return self.engine is not None and self.engine.shard is not None

    @property
    def state_sharded(self) -> bool:
        """Whether the optimizer state is held in shards by the engine (``shard_optimizer``) right now."""
        shard = self.engine.shard if self.engine is not None else None
        return shard is not None and any(opt.absorbed for opt in shard.opts.values())

    def holds_sharded(self, optimizer: Any) -> bool:
        """Whether ``optimizer``'s state is held in shards by the engine right now (the same on every rank)."""
        shard = self.engine.shard if self.engine is not None else None
        opt = shard.sharded_of(optimizer) if shard is not None else None
        return opt is not None and opt.absorbed

    def consolidate(self, device: Optional[torch.device] = None) -> None:
        """The sharded optimizer state back into ``optimizer.state`` (a collective: every rank at the same point;
        after the round's ops; ``device``: where the full tensors go, default the parameters'). No-op when the
        state is not sharded."""
        if self.state_sharded:
            self.engine.wait_idle()
            self.engine.shard.consolidate(device)

    def sharded_state_dict(self, optimizer: Any) -> dict[str, Any]:
        """``optimizer``'s whole state dict on rank 0, in CPU memory, the shards left in place (a collective;
        :meth:`~lightning_pipedap.engine.shard_step.ShardedOptimizer.state_dict`); ``{}`` on the other ranks.
        Call only when :meth:`holds_sharded` is true."""
        self.engine.wait_idle()
        return self.engine.shard.sharded_of(optimizer).state_dict(self.engine.comm, self.engine.buckets)

    def state_nbytes(self, optimizer: Any) -> int:
        """Bytes of ``optimizer``'s state this rank holds: its own ``state`` plus the engine's shards."""
        own = sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
                  if torch.is_tensor(v))
        shard = self.engine.shard if self.engine is not None else None
        opt = shard.sharded_of(optimizer) if shard is not None else None
        if opt is not None:
            own += opt.state_nbytes()
        return own

    def close(self, abort: bool) -> None:
        """At the end of the fit: leave DDP's reducer (local), remove the hooks and the ``train()`` wrappers, close
        the engine (``abort``: without waiting for its work)."""
        if self.handover is not None:
            self.handover.leave(rehook=False)  # (local: unwrapping communicates nothing)
        self.hooks.close()
        if self.engine is not None:
            if not abort:  # (after the fit, optimizer.state is the full state, in CPU memory as Lightning's
                self.consolidate(torch.device("cpu"))  # teardown leaves it: no device peak at the end)
            elif self.engine.shard is not None:
                self.engine.shard.release()  # (no collective after a failure: the sharded state is lost)
            self.engine.close(abort=abort)

    def _compression_factory(self) -> Callable[[list], Any]:
        from lightning_pipedap.engine.compressed import CompressedTransport  # noqa: PLC0415

        def factory(buckets: list) -> Any:
            # (the state moves by name through ``carry``: keep() before, restore() after)
            self.pipe.relayout([b.numel for b in buckets], self.tset.layouts(buckets), keep_state=False)
            return CompressedTransport(self.pipe, self.ctx.comm, owns_pipeline=False)

        return factory

