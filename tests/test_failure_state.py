"""Units of :mod:`lightning_pipedap.strategy.failure_state`: which step a rank can still hold after a failure, decided
from the buckets' states alone (the forward and set-back paths run end to end in tests/test_faults_checkpoint.py)."""

from __future__ import annotations

from types import SimpleNamespace

from lightning_pipedap.engine.bucket_sync import BucketState as S
from lightning_pipedap.strategy.deferred import Pending
from lightning_pipedap.strategy.failure_state import settle


def _sync(state: S, failed_from: S | None = None) -> SimpleNamespace:
    return SimpleNamespace(state=state, failed_from=failed_from, params_gathered=False)


def _rt(states: list[SimpleNamespace], sharded: bool = False, pending: bool = True) -> SimpleNamespace:
    engine = SimpleNamespace(syncs=states, buckets=[None] * len(states))
    deferred = SimpleNamespace(engine=engine, pending=Pending([{}], None, step=7) if pending else None, updater=None,
                               nonfinite=None)
    return SimpleNamespace(deferred=deferred, slot=SimpleNamespace(state_sharded=sharded))


def test_nothing_pending_is_consistent_as_it_stands():
    s = settle(_rt([_sync(S.WRITTEN)], pending=False), SimpleNamespace(global_step=8), None)
    assert (s.global_step, s.how, s.why) == (8, "complete", None)


def test_partly_applied_step_whose_rest_was_not_gathered_is_refused_naming_the_buckets():
    rt = _rt([_sync(S.LANDED), _sync(S.GATHERING)])
    s = settle(rt, SimpleNamespace(global_step=8), None)
    assert s.global_step is None
    assert s.why == ("the update of step 7 was applied to bucket(s) 0 on this rank when the failure came, while the "
                     "communication of bucket(s) 1 had not finished: this rank holds neither step 7's state nor the "
                     "one after it")
    assert rt.deferred.pending is not None  # (nothing changed)


def test_a_failed_worker_keeps_what_each_bucket_had_reached():
    """The worker's failure turns every bucket FAILED; the state it failed from still tells a landed bucket."""
    s = settle(_rt([_sync(S.FAILED, S.LANDED), _sync(S.FAILED, S.REDUCING)]), SimpleNamespace(global_step=8), None)
    assert s.why is not None and "applied to bucket(s) 0" in s.why and "bucket(s) 1 had not finished" in s.why


def test_without_a_mark_of_the_step_the_counters_are_not_guessed():
    s = settle(_rt([_sync(S.GATHERING)]), SimpleNamespace(global_step=8), None)
    assert s.why == "the update of step 7 was still being communicated and the step's counters could not be set back"


def test_sharded_optimizer_state_is_refused():
    s = settle(_rt([_sync(S.GATHERED)], sharded=True), SimpleNamespace(global_step=8), None)
    assert s.why is not None and "shard_optimizer" in s.why
