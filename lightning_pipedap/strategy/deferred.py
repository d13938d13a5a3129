"""Deferred updates: which bucket lands where, applying it, and proving no read came too early.

After a deferred step the engine holds every bucket's reduced gradients (or will, when its
all-gather lands). :class:`DeferredUpdates` keeps that step's :class:`Pending` update and applies
it bucket by bucket:

- at the forward pre-hook of the bucket's first consumer (``triggers``; owners come from the
  op-level trace, :mod:`~lightning_pipedap.probe.consumers`), or before ``training_step``
  (``root`` buckets: parameters read outside every module forward, in a ``torch.func``
  transform, or not seen in the trace);
- by the *guard* (a :class:`ConsumerTrace` active in ``training_step`` while updates are pending):
  just before any op that reads a parameter, its ``.grad`` or its optimizer state whose update is
  still pending (a ``.grad`` read also gets the averaged gradient written back); the parameter is
  then owned by the root, so its bucket lands before ``training_step`` from the next step on;
- whatever is left at the start of backward (modules not called this step); a gradient that then
  arrives for one of those parameters proves that the forward read it stale, and is an error;
- at flush points (validation, checkpoints, observer hooks, the end).

With ``nonfinite="raise"`` or ``"skip"`` (:mod:`~lightning_pipedap.strategy.numerics`) the first of
these places waits for every bucket of the step and scans the averaged gradients before any bucket
is applied: a non-finite step raises on every rank, or is dropped as a whole (parameters and
optimizer state unchanged).

The update of a bucket is the optimizer's step restricted to it
(:class:`~lightning_pipedap.engine.update.BucketOptimizer`, DeAR ICDCS 2023 §III-B), with the
hyper-parameters and clip request snapshotted when the step was recorded.

A parameter split over several buckets (``Schedule.pieces``, tensor partitioning: ByteScheduler SOSP 2019)
is stepped once, when the last of its buckets lands; every one of its buckets is triggered no later than its
first consumer, the guard applies all of them (and writes all its pieces to ``.grad`` for a grad read), and
the rules above are about parameters, whatever buckets hold their pieces.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_pipedap.compat import disable_torch_function, mark_optimizer_stepped
from lightning_pipedap.engine.engine import CommEngine
from lightning_pipedap.engine.shard_step import land_params
from lightning_pipedap.engine.update import (BucketOptimizer, ClipRequest, averaged_grads, clip_norm_coefficient,
                                             snapshot_hparams, write_back_grads)
from lightning_pipedap.measure.timeline import OpRecord
from lightning_pipedap.probe.consumers import transform_active
from lightning_pipedap.strategy.numerics import Finding, NonFiniteCheck, first_nonfinite

#: where a bucket update was applied (``PipeDAPStrategy.update_counts``): in the next forward, at the
#: start of backward (module not called), at a flush point, before an observing hook, by the guard
UPDATE_PLACES = ("forward", "leftover", "flush", "observe", "guard")


@dataclass
class Pending:
    """An update computed by communication but not yet applied.

    Attributes:
        hparams: every param group's hyper-parameters at the step (``snapshot_hparams``).
        clip: the step's clip request, or None.
        coef: the clip-by-norm factor, once computed (:meth:`clip_coefficient`; a 0-dim tensor,
            None when there is nothing to clip).
        clip_ready: whether ``coef`` was computed.
        step: the optimizer step it belongs to (Lightning's ``global_step`` then), for messages.
        decided: whether the non-finite check that must come before the first bucket has run.
        sharded: the step's buckets are stepped sharded by the worker (``shard_optimizer``; the clip factor
            and the non-finite verdict come from the worker's preparation).
    """

    hparams: list[dict[str, Any]]
    clip: Optional[ClipRequest]
    coef: Optional[Tensor] = None
    step: int = -1
    decided: bool = False
    clip_ready: bool = False
    sharded: bool = False

    def clip_coefficient(self, engine: CommEngine, updater: Optional[BucketOptimizer]) -> None:
        """Clip-by-norm exactly as ``clip_grad_norm_`` computes it under DDP (:func:`clip_norm_coefficient`): wait
        for every bucket's all-gather, then take the per-tensor norms of the averaged gradients, shaped like their
        parameters, in the optimizer's parameter order. Local (every rank holds the same averaged gradients): no
        collective. The cost: the first bucket of a clipped step lands only after the last all-gather (the
        all-gathers overlap the gap between steps, no longer the next forward)."""
        if self.clip is None or self.clip.algorithm != "norm" or self.clip_ready:
            return
        if self.sharded:  # (the worker computed it from the shards' sums of squares: ShardedStep.prepare)
            self.coef = engine.wait_prepared().coef
            self.clip_ready = True
            return
        assert updater is not None
        with disable_torch_function(), torch.no_grad():
            for b in range(engine.num_buckets):
                engine.wait_done(b)
            self.coef = clip_norm_coefficient(averaged_grads(engine, updater.optimizer), self.clip.value)
        self.clip_ready = True


class DeferredStep:
    """Stands in for the optimizer inside Lightning's precision plugin during a deferred step.

    ``step(closure)`` runs the closure (forward, backward, ``on_before_optimizer_step``, clipping)
    and returns its result; the real update is applied later, bucket by bucket. Attribute reads
    (``param_groups``, ``state``, ``defaults``) go to the wrapped optimizer.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self.clip: Optional[ClipRequest] = None

    def step(self, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(f"pipedap: extra optimizer.step arguments {sorted(kwargs)} are not supported in deferred "
                            "mode")
        return closure()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


class LandingPoints:
    """Where each bucket of a deferred step lands: at the forward pre-hook of its first consumer (``triggers``),
    or before ``training_step`` (``root``).

    Attributes:
        triggers: ``id(module)`` -> the buckets applied at its forward pre-hook.
        root: the buckets applied before ``training_step``.
    """

    def __init__(self) -> None:
        self.triggers: dict[int, list[int]] = {}
        self.root: list[int] = []

    def set_owners(self, engine: CommEngine, owners: Optional[list[Optional[torch.nn.Module]]],
                   root_module: torch.nn.Module) -> None:
        """Triggers from per-parameter owners (engine order, which is first-consumption order): a bucket lands
        before the earliest consumer of any of its units' parameters (the owner of its first parameter; with
        ``schedule.pieces``, of its lowest parameter index); one with a parameter owned by ``root_module`` or by
        nobody lands before ``training_step``. Every bucket holding a piece of a split parameter so lands
        before that parameter's first consumer, and the parameter is stepped when the last of them lands."""
        self.triggers, self.root = {}, []
        if owners is not None:
            pieces = engine.schedule.pieces is not None
            for b in engine.buckets:
                idxs = b.param_indices  # (per unit: its parameter)
                if any(owners[i] is None or owners[i] is root_module for i in idxs):
                    self.root.append(b.index)
                else:
                    self.triggers.setdefault(id(owners[min(idxs) if pieces else idxs[0]]), []).append(b.index)

    def move_to_root(self, b: int) -> None:
        """Bucket ``b`` was read before its trigger: it lands before ``training_step`` from now on."""
        for buckets in self.triggers.values():
            if b in buckets:
                buckets.remove(b)
        if b not in self.root:
            self.root.append(b)


class DeferredUpdates:
    """Pending update of one engine and the rules of where its buckets land (module docstring).

    Args:
        engine: the installed engine (its buckets, waits, used flags).
        name_of: ``parameter -> name`` for messages.
        say: log once per key on rank 0 (``say(key, message)``).
        records: the strategy's timeline list (wait/update records are appended when ``timeline()``).
        timeline: whether op timings are recorded now.
        counts: ``UPDATE_PLACES`` counters, incremented per applied bucket.
        nonfinite: the fit's non-finite check (None: no check).
    """

    def __init__(self, engine: CommEngine, name_of: Callable[[Tensor], str],
                 say: Callable[[str, str], None], records: list[OpRecord], timeline: Callable[[], bool],
                 counts: dict[str, int], nonfinite: Optional[NonFiniteCheck] = None) -> None:
        self.nonfinite, self.verdict, self.engine = nonfinite, StepVerdict(engine, nonfinite, name_of), engine
        self.name_of, self.say, self.records, self.timeline, self.counts = name_of, say, records, timeline, counts
        self.pending: Optional[Pending] = None
        self.updater: Optional[BucketOptimizer] = None
        self.points = LandingPoints()
        #: engine parameter index -> the buckets holding it (one; several for a parameter split over buckets)
        self.buckets_of: list[tuple[int, ...]] = [engine.buckets_of(i) for i in range(len(engine.params))]
        self.applying = False
        #: watch the reduced used-flags for a parameter some rank left without a gradient (set by the run-time until a
        #: final schedule runs; the ``torch_ddp`` candidate then needs ``find_unused_parameters``)
        self.track_use = True
        #: such a parameter was seen (identical on every rank: the flags are reduced)
        self.saw_partial_use = False
        self.deferring = False  # inside a deferred optimizer step (its backward does not wait for the reduction)
        self._misses: dict[int, str] = {}  # bucket -> what was read early (this step)
        self.missed: list[int] = []  # engine parameter indices read before their trigger (all steps)
        self._applied_in_forward = False
        self._forward_params: set[int] = set()
        self._late: set[int] = set()
        self._stale: list[int] = []
        self._landed = False  # leftovers of this step applied already (land_leftovers after training_step)

    def set_owners(self, owners: Optional[list[Optional[torch.nn.Module]]], root_module: torch.nn.Module) -> None:
        """Where each bucket lands, from per-parameter owners (:meth:`LandingPoints.set_owners`)."""
        self.points.set_owners(self.engine, owners, root_module)

    # ------------------------------------------------------------------ recording a step
    def record(self, optimizer: Optimizer, clip: Optional[ClipRequest], step: int = -1) -> None:
        """This step's gradients are being reduced: their update is pending (hyper-parameters snapshotted)."""
        if self.updater is None:
            syncs = self.engine.syncs
            self.updater = BucketOptimizer(optimizer, self.engine.buckets, lambda b: syncs[b].landed)
        self.pending = Pending(snapshot_hparams(optimizer), clip, step=step)
        shard = self.engine.shard
        if shard is not None and shard.round is not None:
            check = self.nonfinite
            shard.go(optimizer, self.pending.hparams, clip, check.mode if check is not None and check.active else None)
            self.pending.sharded = True
            mark_optimizer_stepped(optimizer)  # (the shards are stepped without optimizer.step: LR schedulers)

    def remaining(self) -> list[int]:
        """The buckets of the pending step not applied yet (their state is before LANDED: :class:`BucketSync`)."""
        return [s.index for s in self.engine.syncs if s.in_flight] if self.pending is not None else []

    # ------------------------------------------------------------------ where buckets land
    def run_step(self, optimizer: Optimizer, call: Callable[[DeferredStep], Any], step_of: Callable[[], int]) -> Any:
        """One deferred optimizer step: ``call(stand_in)`` runs the closure (forward, backward, clipping) with a
        :class:`DeferredStep` in place of ``optimizer``; if the step's gradients are being reduced, its update
        is recorded as pending (at optimizer step ``step_of()``), to land bucket by bucket later."""
        stand_in = DeferredStep(optimizer)
        engine = self.engine
        rounds_before = engine.iteration
        self.deferring = True
        if engine.shard is not None:
            engine.shard.armed = True  # (this step's round is stepped sharded by the worker)
        try:
            out = call(stand_in)
        finally:
            self.deferring = False
            if engine.shard is not None:
                engine.shard.armed = False
        if engine.collecting:  # backward did not run (e.g. training_step returned None)
            engine.finish_backward()
        if engine.iteration != rounds_before:  # this step's gradients are being reduced
            self.record(optimizer, stand_in.clip, step_of())
        return out

    def before_training_step(self) -> None:
        """The clip coefficient (same point on every rank) and the root buckets."""
        self._applied_in_forward, self._forward_params = False, set()
        self._landed = False
        if self.pending is not None:
            self.pending.clip_coefficient(self.engine, self.updater)
            self._decide(self.pending)  # (nonfinite raise/skip: before any bucket of the step lands)
            if self.points.root and self.pending is not None:
                self.apply(list(self.points.root))

    def at_module(self, module: torch.nn.Module) -> None:
        """A module's forward pre-hook inside ``training_step``."""
        if self.pending is not None and not self.applying:
            buckets = self.points.triggers.get(id(module))
            if buckets and not transform_active():  # (no in-place update inside vmap/grad: owned by the root)
                self.apply(buckets)

    @property
    def guard_needed(self) -> bool:
        """Whether the next ``training_step`` must run guarded: an update is pending, or an applied bucket's
        averaged gradients are not in ``.grad`` yet (a read of ``.grad`` must see them, as under DDP)."""
        return self.pending is not None or any(s.unwritten for s in self.engine.syncs)

    def guarded_read(self, i: int, grad_read: bool = False) -> None:
        """Guard: engine parameter ``i`` (or its ``.grad``, or its optimizer state) is about to be read by an
        op; apply its pending buckets first (every bucket holding a piece of a split parameter), and write
        the averaged gradients to ``.grad`` for a grad read."""
        if self.applying:
            return
        buckets = self.buckets_of[i]
        syncs = self.engine.syncs
        if grad_read:
            for b in buckets:
                if syncs[b].unwritten:
                    self._write_grads(b)
        if self.pending is None:
            return
        todo = [b for b in buckets if syncs[b].in_flight]
        if not todo:
            return
        p = self.engine.params[i]
        if transform_active():
            raise RuntimeError(f"pipedap: parameter {self.name_of(p)!r} is read inside a torch.func transform "
                               "while its update is pending, and an update cannot be applied inside a transform; "
                               "pass defer_update=False")
        for b in todo:
            self._misses.setdefault(b, f"{self.name_of(p)}{'.grad' if grad_read else ''}")
        self.missed.append(i)
        self.apply(todo, "guard", write_grads=grad_read)

    def end_guard(self) -> None:
        """After a guarded forward: buckets read before their trigger land before ``training_step`` from now on."""
        misses, self._misses = self._misses, {}
        for b, what in sorted(misses.items()):
            self.points.move_to_root(b)
            self.say(f"guard:{what}", f"pipedap: {what} was read before its update's trigger module ran (user code "
                     "in training_step, or a data-dependent path); the update was applied just before the read, and "
                     "it lands before training_step from now on")

    def land_leftovers(self) -> None:
        """Apply leftovers (modules not called); remember their parameters to catch stale reads. Runs at the
        start of backward, or earlier, right after ``training_step`` (``gradient_as_bucket_view``: before
        ``zero_grad`` can zero ``.grad``, which is then the bucket itself)."""
        self._late, self._stale = set(), []
        if self.pending is not None:
            self._late = {i for b in self.remaining() for i in self.engine.buckets[b].param_indices}
            self.apply_all("leftover")
        self._landed = True

    def before_backward(self) -> None:
        """Leftovers land (unless :meth:`land_leftovers` ran after this step's ``training_step``); ``.grad`` must
        not get the reduced gradients any more."""
        if not self._landed:
            self.land_leftovers()
        self._landed = False
        self.forget_unwritten()

    def gradient_arrived(self, i: int) -> None:
        if i in self._late:
            self._stale.append(i)

    @property
    def late_applied(self) -> bool:
        """Whether buckets were applied only at the start of this backward, or at a trigger in this forward."""
        return bool(self._late) or self._applied_in_forward

    def check_stale(self) -> None:
        """Raises:
            RuntimeError: a parameter updated only after the forward received a gradient (it was read stale)."""
        if self._stale:
            stale, self._stale = self._stale, []
            raise RuntimeError(self.stale_message(stale))

    def stale_message(self, indices: Optional[list[int]] = None) -> str:
        indices = sorted(self._late | self._forward_params) if indices is None else indices
        params = self.engine.params
        names = sorted({self.name_of(params[i]) for i in indices if 0 <= i < len(params)})
        return (f"pipedap: the forward read {', '.join(names[:5])}{' ...' if len(names) > 5 else ''} while its "
                "update was still pending (it is read outside the module that first used it in the traced step, "
                "e.g. on a data-dependent path); results would differ from DDP's. Pass defer_update=False.")

    # ------------------------------------------------------------------ applying
    def apply(self, buckets: list[int], where: str = "forward", write_grads: bool = False) -> None:
        """Wait for each bucket's all-gather and run its optimizer update (``where``: see :data:`UPDATE_PLACES`).

        ``where == "observe"`` or ``write_grads``: also write the averaged (clipped) gradients to ``.grad``,
        as DDP shows them after the optimizer step; otherwise the guard writes them when ``.grad`` is read
        in the next ``training_step`` (unless Lightning cleared ``.grad`` first: :meth:`forget_unwritten`).
        """
        pending = self.pending
        if pending is None:
            return
        self._decide(pending)
        if self.pending is None:  # the step was skipped
            return
        self.applying = True
        try:
            with torch.inference_mode(False), torch.no_grad(), disable_torch_function():
                for b in buckets:
                    if self.engine.syncs[b].in_flight:
                        self._apply_one(pending, b, where, write_grads or where == "observe")
        finally:
            self.applying = False
        if not any(s.in_flight for s in self.engine.syncs):  # (stops at the first bucket still owed)
            self.pending = None

    def apply_all(self, where: str) -> None:
        """Apply every bucket of the pending step not applied yet (``where``: see :data:`UPDATE_PLACES`)."""
        if self.pending is not None:
            self.apply(self.remaining(), where)

    def _apply_one(self, pending: Pending, b: int, where: str, write_grads: bool) -> None:
        engine = self.engine
        t0 = time.perf_counter()
        pending.clip_coefficient(self.engine, self.updater)
        bucket = engine.wait_done(b)
        t1 = time.perf_counter()
        sync = engine.syncs[b]
        if self.nonfinite is not None and self.nonfinite.mode == "warn" and not sync.params_gathered:
            self.nonfinite.scan([bucket], pending.step)  # (logs the first finding of the fit; DDP's update)
        used = engine.used_flags(b)
        if self.track_use and not self.saw_partial_use:
            self.saw_partial_use = bucket.some_rank_unused(engine.comm.world_size)
        if sync.params_gathered:  # (stepped sharded: the bucket holds the updated parameters)
            land_params(bucket, engine.shard.in_place.get(b) if engine.shard is not None else None)
        else:
            self.updater.step(bucket, pending.hparams, pending.clip, pending.coef, used)
        sync.land()
        if write_grads:
            self._write_grads(b)
        if self.timeline():
            it = pending.step if pending.step >= 0 else None
            self.records.append(OpRecord(f"wait{b}", "wait", b, t0, t1, "compute", it))
            self.records.append(OpRecord(f"update{b}", "update", b, t1, time.perf_counter(), "compute", it))
        self.counts[where] += 1
        if where == "forward":
            self._applied_in_forward = True
            self._forward_params.update(self.engine.buckets[b].param_indices)

    def _decide(self, pending: Pending) -> None:
        """``nonfinite``: before the first bucket of ``pending`` is applied, the step's verdict
        (:meth:`StepVerdict.decide`); a non-finite step under ``"skip"`` is dropped as a whole.

        Raises:
            NonFiniteGradientError: ``"raise"``, naming the step, the bucket and the first parameter.
        """
        if pending.decided:
            return
        pending.decided = True
        found = self.verdict.decide(pending)
        if found is not None:
            self._skip(pending)
            self.nonfinite.skip(found)

    def _skip(self, pending: Pending) -> None:
        """Drop the pending step: no bucket is stepped. ``.grad`` still shows the averaged (clipped)
        gradients when read, as DDP shows them after a skipped ``optimizer.step``."""
        pending.clip_coefficient(self.engine, self.updater)
        with torch.inference_mode(False), torch.no_grad(), disable_torch_function():
            for b in self.remaining():
                bucket = self.engine.buckets[b]
                if self.engine.syncs[b].params_gathered:  # (the worker clipped the kept shards; nothing stepped)
                    self.engine.syncs[b].drop()
                    continue
                for slot, used in enumerate(self.engine.used_flags(b)):
                    if used and pending.clip is not None:
                        g = bucket.grad_view(slot)
                        if pending.clip.algorithm == "value":
                            g.clamp_(-pending.clip.value, pending.clip.value)
                        elif pending.coef is not None:
                            g.mul_(pending.coef)
                self.engine.syncs[b].drop()
        self.pending = None

    def _write_grads(self, b: int) -> None:
        engine = self.engine
        if engine.syncs[b].params_gathered:  # (a sharded step: its averaged gradients exist as shards only)
            seconds = engine.gather_grads(b)
            self.say("shard-grad-gather", "pipedap: shard_optimizer: showing the averaged gradients in .grad (a read "
                     "by user code or a hook, or the end of the fit) all-gathers them from the shards (bucket "
                     f"{b}: {engine.buckets[b].nbytes} bytes, {seconds * 1e3:.1f} ms; said once)")
        with torch.no_grad(), disable_torch_function():
            write_back_grads(engine.buckets[b], engine.used_flags(b))
        engine.syncs[b].write()

    def write_unwritten(self) -> None:
        """Write every applied bucket's averaged gradients to ``.grad`` now (before the engine is replaced)."""
        for s in self.engine.syncs:
            if s.unwritten:
                self._write_grads(s.index)

    def forget_unwritten(self) -> None:
        """``.grad`` must not get the reduced gradients any more: a new backward starts, or Lightning set ``.grad``
        to None (``on_validation_model_zero_grad``); the sharded step's kept shards of them go too."""
        for s in self.engine.syncs:
            s.retire()
        self.engine.forget_kept()


class StepVerdict:
    """Whether a deferred step's averaged gradients are finite, decided before its first bucket lands
    (``nonfinite="raise"``/``"skip"``), and its first finding logged (``"warn"``).

    Args:
        engine: the installed engine.
        check: the fit's non-finite check (None: no check).
        name_of: ``parameter -> name`` for messages.
    """

    def __init__(self, engine: CommEngine, check: Optional[NonFiniteCheck], name_of: Callable[[Tensor], str]) -> None:
        self.engine, self.check, self.name_of = engine, check, name_of

    def decide(self, pending: Pending) -> Optional[Finding]:
        """The finding that makes ``pending`` skipped (``"skip"``), or None: apply it. An unsharded step waits for
        every bucket's all-gather and scans the averaged gradients (identical on every rank: every rank decides
        alike, with no collective); a sharded one takes the worker's verdict (:func:`sharded_finding`).

        Raises:
            NonFiniteGradientError: ``"raise"`` and a non-finite step.
        """
        check, engine = self.check, self.engine
        found = None
        if pending.sharded and check is not None and check.active:
            found = sharded_finding(engine, self.name_of, pending.step)
            if found is not None and not check.decides_first:
                check.report(found)  # (warn: logged once per fit; the update is applied as DDP's)
        if check is None or not check.decides_first or (pending.sharded and found is None):
            return None
        for b in range(engine.num_buckets):
            engine.wait_done(b)
        if not pending.sharded:
            found = check.scan(engine.buckets, pending.step)
        if found is not None and check.mode == "raise":
            raise check.error(found)
        return found


def sharded_finding(engine: CommEngine, name_of: Callable[[Tensor], str], step: int) -> Optional[Finding]:
    """The non-finite verdict of a sharded step (the worker's preparation: identical on every rank) as a
    :class:`Finding`; the step's unsharded (compressed) buckets are scanned as in an unsharded step."""
    hit = engine.wait_prepared().finding
    if hit is not None:
        b, slot, nan, inf, numel = hit
        return Finding(step, b, name_of(engine.buckets[b].params[slot]), nan, inf, numel)
    rest = [b for b in range(engine.num_buckets) if b not in engine.shard.slices]
    for b in rest:
        engine.wait_done(b)
    return first_nonfinite([engine.buckets[b] for b in rest], name_of, step) if rest else None


def intercept_clipping(plugin: Any) -> Callable[..., Any]:
    """Make a precision plugin's ``clip_gradients`` record Lightning's clipping request on a
    :class:`DeferredStep` (applied later to the reduced gradients) and clip as before otherwise.

    Returns:
        The original ``plugin.clip_gradients``, to put back at teardown.
    """
    original = plugin.clip_gradients

    def clip_gradients(optimizer: Any, clip_val: Union[int, float] = 0.0, gradient_clip_algorithm: Any = None) -> None:
        if isinstance(optimizer, DeferredStep):
            if clip_val and clip_val > 0:
                algo = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm) or "norm")
                optimizer.clip = ClipRequest(float(clip_val), algo)
            return None
        return original(optimizer, clip_val, gradient_clip_algorithm)

    plugin.clip_gradients = clip_gradients
    return original
