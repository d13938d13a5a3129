"""After a failure: the trainer left at the last optimizer step whose update completed, assembled on this rank from
what it holds (no collective), so that a checkpoint written on the exception (``ModelCheckpoint(save_on_exception=
True)``, or ``trainer.save_checkpoint`` in a callback's ``on_exception``) resumes exactly.

With deferred updates (:mod:`.deferred`) the update of Lightning's last counted step may still be pending when a
failure comes: some of its buckets may have landed (their share of the optimizer step ran), others may still be
communicated. Lightning's counters (``global_step``, the loops' progress), the learning-rate schedulers and the
optimizer's hyper-parameters already count that step. :func:`settle` makes parameters, optimizer state and counters
those of one step, or says why it cannot:

- **forward**: every bucket not yet applied was gathered completely on this rank before the failure (the
  communication of the step finished: every rank's gradients are in it): their updates are applied here, as they
  would have been in the next forward. The state is that of ``global_step`` as Lightning counts it, as DDP holds it
  after a failure in the next step's forward.
- **back**: no bucket of the pending step had landed on this rank: the parameters and the optimizer state are those
  before the step; Lightning's loop progress, the schedulers' state and the optimizer's hyper-parameters are set back
  to the :class:`StepMark` taken when the step was recorded (inside its optimizer step, after backward), and the
  pending update is dropped. The state is that of ``global_step - 1``, as DDP holds it after a failure in that
  step's backward; a resume repeats its batch. Callbacks' own states are not set back.
- otherwise (some buckets landed, others' communication did not finish; or a sharded optimizer state,
  ``shard_optimizer``, whose other shards live on the other ranks): no consistent step exists on this rank, and a
  checkpoint after the failure is not written (:func:`refusal` says why).

A non-finite pending step (``nonfinite="raise"``/``"skip"`` not decided yet) is not applied forward: it would have
been refused or skipped; it is set back when possible.
"""

from __future__ import annotations

import copy
import pickle
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from lightning_pipedap import compat
from lightning_pipedap.compat import disable_torch_function
from lightning_pipedap.engine.bucket_sync import BucketState
from lightning_pipedap.engine.update import BucketOptimizer, averaged_grads, clip_norm_coefficient

log = logging.getLogger(__name__)

_APPLIED = (BucketState.LANDED, BucketState.WRITTEN, BucketState.DROPPED)


@dataclass
class StepMark:
    """What Lightning's trainer held inside the optimizer step whose update is ``pending`` (after its backward,
    before Lightning counted it and before the schedulers stepped): enough to set the counters back to it.

    Attributes:
        pending: the :class:`~.deferred.Pending` update recorded in that step (matched by identity).
        step: ``global_step`` then (the number of completed optimizer steps before this one).
        progress: ``"epoch_loop.batch_progress"``-style path -> that progress tracker, pickled together (bytes).
        batches_that_stepped: the training epoch loop's ``_batches_that_stepped`` then.
        schedulers: each learning-rate scheduler's ``state_dict()`` then (``trainer.lr_scheduler_configs`` order).
    """

    pending: Any
    step: int
    progress: bytes = b""
    batches_that_stepped: int = 0
    schedulers: list[dict] = field(default_factory=list)


@dataclass
class Settled:
    """The outcome of :func:`settle`.

    Attributes:
        global_step: the step whose state the trainer holds now (None: no consistent step: ``why`` says why).
        how: ``"complete"`` (nothing was pending), ``"forward"`` or ``"back"`` (module docstring).
        detail: what was done, in words (for the log).
        why: why no consistent step could be assembled (None when one was).
    """

    global_step: Optional[int]
    how: str = "complete"
    detail: str = ""
    why: Optional[str] = None


#: the fit loop last walked and its progress trackers (:func:`~lightning_pipedap.compat.loop_progress`: the loop
#: tree is built once per Trainer, so one walk per fit)
_TRACKERS: list = [None, {}]


def _trackers(fit_loop: Any) -> dict[str, Any]:
    if _TRACKERS[0] is not fit_loop:
        _TRACKERS[:] = [fit_loop, compat.loop_progress(fit_loop)]
    return _TRACKERS[1]


def mark_step(trainer: Any, pending: Any) -> Optional[StepMark]:
    """A :class:`StepMark` of ``trainer`` for ``pending`` (None without a trainer or a pending update). Costs a pickled
    copy of the loops' progress trackers and a copy of the schedulers' state dicts: about 50-80 µs per step on this
    project's 2-core CPU machine (``tests/test_failure_state.py`` measures nothing; BENCHMARKS.md does not either)."""
    if trainer is None or pending is None:
        return None
    return StepMark(
        pending=pending, step=int(trainer.global_step),
        progress=pickle.dumps(_trackers(trainer.fit_loop)),
        batches_that_stepped=compat.batches_that_stepped(trainer),
        schedulers=[copy.deepcopy(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs])


def _effective(sync: Any) -> BucketState:
    """The bucket's state, or for a FAILED one (the worker failed after the fault) the state it failed from."""
    if sync.state is BucketState.FAILED and getattr(sync, "failed_from", None) is not None:
        return sync.failed_from
    return sync.state


def settle(rt: Any, trainer: Any, mark: Optional[StepMark]) -> Settled:
    """Leave the trainer at one consistent step after a failure (module docstring); no collective, no wait.

    Args:
        rt: the fit's :class:`~lightning_pipedap.strategy.runtime.Runtime` (or None).
        trainer: Lightning's trainer (or None).
        mark: the :class:`StepMark` of the last deferred step (or None).
    """
    now = None if trainer is None else int(trainer.global_step)
    deferred = None if rt is None else rt.deferred
    pending = None if deferred is None else deferred.pending
    if rt is not None and rt.slot.state_sharded:
        return Settled(None, why="the optimizer state is sharded over the ranks (shard_optimizer) and gathering it "
                       "needs every rank")
    if pending is None:
        return Settled(now, detail="no update was pending")
    if pending.sharded:
        return Settled(None, why="the pending step's buckets were stepped sharded (shard_optimizer) and its other "
                       "shards live on the other ranks")
    engine = deferred.engine
    syncs = engine.syncs
    states = [_effective(s) for s in syncs]
    applied = [b for b, st in enumerate(states) if st in _APPLIED]
    owed = [b for b, st in enumerate(states) if st not in _APPLIED and st is not BucketState.IDLE]
    unfinished = [b for b in owed if states[b] is not BucketState.GATHERED or syncs[b].params_gathered]
    step = pending.step if pending.step >= 0 else (now - 1 if now is not None else -1)
    nonfinite = _undecided_finding(deferred, pending) if not unfinished else None
    if not unfinished and nonfinite is None and deferred.updater is not None:
        _apply_forward(deferred, pending, applied, owed)
        deferred.pending = None
        return Settled(now, "forward", f"the update of step {step} (global_step {step} -> {step + 1}) had been "
                       f"communicated completely; its {len(owed)} bucket(s) not yet applied were applied on this rank "
                       "(no communication)")
    if not applied and mark is not None and mark.pending is pending and trainer is not None:
        _set_back(trainer, mark, deferred.updater.optimizer if deferred.updater is not None else None, pending)
        deferred.pending = None
        cause = (f"its averaged gradients are not finite ({nonfinite})" if nonfinite is not None else
                 f"the communication of bucket(s) {_short(unfinished)} had not finished")
        return Settled(mark.step, "back", f"the update of step {step} (global_step {step} -> {step + 1}) did not "
                       f"complete ({cause}) and none of it was applied on this rank: global_step, the loops' progress, "
                       "the learning-rate schedulers and the optimizer's hyper-parameters were set back to global_step "
                       f"{mark.step} (a resume repeats that batch)")
    if applied:
        why = (f"the update of step {step} was applied to bucket(s) {_short(applied)} on this rank when the failure "
               f"came, while the communication of bucket(s) {_short(unfinished)} had not finished: this rank holds "
               f"neither step {step}'s state nor the one after it")
    else:
        why = f"the update of step {step} was still being communicated and the step's counters could not be set back"
    return Settled(None, why=why)


def _short(buckets: list[int]) -> str:
    return ", ".join(map(str, buckets[:8])) + (" ..." if len(buckets) > 8 else "")


def _undecided_finding(deferred: Any, pending: Any) -> Optional[str]:
    """A non-finite pending step that ``nonfinite="raise"``/``"skip"`` has not judged yet, in words (None: finite,
    judged already, or not checked)."""
    check = deferred.nonfinite
    if pending.decided or check is None or not check.decides_first:
        return None
    from lightning_pipedap.strategy.numerics import first_nonfinite  # noqa: PLC0415

    found = first_nonfinite(deferred.engine.buckets, deferred.name_of, pending.step)
    return None if found is None else f"first: {found.name!r} in bucket {found.bucket}"


def _apply_forward(deferred: Any, pending: Any, applied: list[int], owed: list[int]) -> None:
    """Apply the pending step to the buckets ``owed`` (every one gathered), as :meth:`DeferredUpdates.apply` would,
    without the engine's waits (its worker is stopped) and without changing the buckets' states."""
    engine = deferred.engine
    optimizer = deferred.updater.optimizer
    done = set(applied)
    updater = BucketOptimizer(optimizer, engine.buckets, lambda b: b in done)  # (split parameters: see its docstring)
    with torch.inference_mode(False), torch.no_grad(), disable_torch_function():
        coef = pending.coef
        clip = pending.clip
        if clip is not None and clip.algorithm == "norm" and not pending.clip_ready:
            coef = clip_norm_coefficient(averaged_grads(engine, optimizer), clip.value)
        for b in owed:
            done.add(b)
            updater.step(engine.buckets[b], pending.hparams, clip, coef, engine.used_flags(b))


def _set_back(trainer: Any, mark: StepMark, optimizer: Any, pending: Any) -> None:
    """Lightning's counters, the schedulers and the optimizer's hyper-parameters back to ``mark``."""
    trackers = _trackers(trainer.fit_loop)
    for path, saved in pickle.loads(mark.progress).items():
        if path in trackers:
            trackers[path].load_state_dict(saved.state_dict())
    compat.batches_that_stepped(trainer, mark.batches_that_stepped)
    for config, state in zip(trainer.lr_scheduler_configs, mark.schedulers):
        config.scheduler.load_state_dict(copy.deepcopy(state))
    if optimizer is not None:
        for group, hp in zip(optimizer.param_groups, pending.hparams):
            group.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in hp.items()})


class SettleAfterFailure:
    """Mixin of :class:`~lightning_pipedap.strategy.lightning.PipeDAPStrategy`: a :class:`StepMark` per deferred
    step (:meth:`mark_deferred_step`), :func:`settle` once a failure is noted (:meth:`settle_after_failure`, from
    ``abort``), and what a checkpoint after the failure holds (:meth:`failure_checkpoint`)."""

    _rt: Any
    lightning_module: Any
    _step_mark: Optional[StepMark] = None
    _settled: Optional[Settled] = None

    def mark_deferred_step(self) -> None:
        """Right after a deferred optimizer step recorded its pending update (inside Lightning's optimizer step)."""
        from lightning_pipedap.strategy.lightning_reads import trainer_of  # noqa: PLC0415

        rt = self._rt
        pending = None if rt is None or rt.deferred is None else rt.deferred.pending
        self._step_mark = mark_step(trainer_of(self.lightning_module), pending)

    def settle_after_failure(self) -> None:
        """Leave the trainer at the last completed step (:func:`settle`); logged. Never raises: an error here is
        logged and a checkpoint after the failure is then refused."""
        from lightning_pipedap.strategy.lightning_reads import trainer_of  # noqa: PLC0415

        try:
            self._settled = settle(self._rt, trainer_of(self.lightning_module), self._step_mark)
        except Exception as exc:  # noqa: BLE001 (the fit's own failure is what must surface)
            log.exception("pipedap: could not assemble the last completed step after the failure")
            self._settled = Settled(None, why=f"assembling the last completed step failed ({exc!r})")
        self._step_mark = None
        s = self._settled
        if s.how in ("forward", "back"):
            log.info("pipedap: rank %s: after the failure the trainer holds global_step %s: %s",
                     getattr(self, "global_rank", "?"), s.global_step, s.detail)

    def failure_checkpoint(self, filepath: Any) -> Optional[str]:
        """After a failure: why a checkpoint to ``filepath`` cannot be written (None: it can; the step it holds is
        logged on this rank)."""
        s = self._settled
        if s is None or s.why is not None:
            return s.why if s is not None else "the failure was not settled"
        import lightning_pipedap.strategy.messages as M  # noqa: PLC0415

        how = {"forward": "its update had been gathered completely and was applied on this rank",
               "back": f"the update of the step after it did not complete: counters set back from {s.global_step + 1}"
               if s.global_step is not None else ""}.get(s.how, "no update was pending")
        M.warn(f"pipedap: writing {filepath} after the failure: the state of global_step {s.global_step}, the last "
               f"step whose update completed ({how})")
        return None
