"""Parity with Lightning's ``"ddp"``: after 3 epochs on 2 gloo ranks every parameter and every optimizer state
tensor agrees to 1e-6 (also with ``shard_optimizer=True``: ``SHARD_SCHEDULES``).

All cases run in one launch of 2 processes (``tests/parity_cases.py``); each case trains the same
seeded model with ``ddp`` and with ``pipedap`` under both schedules and reports max |Δparam|.
"""

import json
from pathlib import Path

import pytest

from tests._dist_util import run_lightning_ranks
from tests.parity_cases import CASES, NO_SHARD, SHARD_SCHEDULES, SPECIAL, VARIANTS

TOL = 1e-6
# manual optimization and closure-based optimizers run the synchronous path by design
SYNC_PATH_CASES = {"manual_optimization", "lbfgs_closure", "manual_two_optimizers", "muon_adamw",
                   "unused_zero_grad_keep"}  # (an optimizer_zero_grad override: "auto" runs in sync mode)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def parity_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity") / "results.json"
    run_lightning_ranks(["-m", "tests.parity_cases", str(out), *CASES, *SPECIAL], world=2, timeout_s=1200,
                        cwd=str(ROOT))
    return json.loads(out.read_text())


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_with_ddp(parity_results, case):
    res = parity_results[case]
    assert "error" not in res, res.get("error")
    assert res["ddp_moved"] > 1e-3, "the reference run must actually train"
    for schedule in ("allreduce", "dear", "optimal"):
        assert res[schedule] <= TOL, f"{case}/{schedule}: max |param - ddp| = {res[schedule]:.3e}"
        for suffix, options in VARIANTS.get(case, {}).items():
            key = f"{schedule}_{suffix}"
            assert res[key] <= TOL, f"{case}/{key} ({options}): max |param - ddp| = {res[key]:.3e}"
            # a variant that defers must really defer; one in sync mode must not
            defers = options["defer_update"] is True if "defer_update" in options else case not in SYNC_PATH_CASES
            assert (res[f"{key}_updates_in_forward"] > 0) == defers, (key, res)
        if schedule in SHARD_SCHEDULES and case not in NO_SHARD:  # (deferred sharded steps; manual: sync mode)
            key = f"{schedule}_shard"
            assert res[key] <= TOL, f"{case}/{key}: max |param or optimizer state - ddp| = {res[key]:.3e}"
            defers = case not in SYNC_PATH_CASES - {"unused_zero_grad_keep"}  # (that one: defer_update=True)
            assert (res[f"{key}_updates_in_forward"] > 0) == defers, (key, res)
            # the state really sharded: this rank holds well under the whole (1/2 plus scalars and padding)
            assert res[f"{key}_state_fraction"] is not None and res[f"{key}_state_fraction"] < 0.8, (key, res)
    if case not in SYNC_PATH_CASES:
        # updates must really be deferred into the next forward (not silently flushed)
        assert res["dear_updates_in_forward"] > 0
    else:
        assert res["dear_updates_in_forward"] == 0


@pytest.mark.multiprocess
def test_validation_and_checkpoint_every_step_keep_trajectory(parity_results):
    res = parity_results["val_and_ckpt_every_step"]
    assert "error" not in res, res.get("error")
    assert res["dear"] <= TOL


@pytest.mark.multiprocess
def test_resume_mid_epoch_equals_uninterrupted(parity_results):
    res = parity_results["resume_mid_epoch"]
    assert "error" not in res, res.get("error")
    assert res["ddp"] <= TOL  # the harness itself resumes exactly
    assert res["dear"] <= TOL
    for key in ("shard", "shard_to_ddp", "ddp_to_shard"):  # (shard_optimizer: the checkpoint holds the full state)
        assert res[key] <= TOL, f"{key}: max |Δ| = {res[key]:.3e}"


@pytest.mark.multiprocess
def test_replan_on_drift_keeps_parity(parity_results):
    res = parity_results["replan_on_drift"]
    assert "error" not in res, res.get("error")
    assert res["replans"] == 1
    assert res["predicted_ms"] > 0
    assert res["optimal"] <= TOL


@pytest.mark.multiprocess
def test_compressed_training_through_the_engine(parity_results):
    res = parity_results["compression"]
    assert "error" not in res, res.get("error")
    assert res["none"] <= TOL  # the helper-process round trip itself changes nothing
    assert res["fp16"] < 1e-3  # fp16 rounding of averaged gradients only
    for lossy in ("powersgd", "topk", "efsignsgd"):
        # approximate methods follow DDP's trajectory loosely (DDP itself moved the weights by 0.26)
        assert 0.0 < res[lossy] < 0.2, (lossy, res[lossy])
    assert res["powersgd_shard_vs_unsharded"] == 0.0  # (shard_optimizer with every bucket compressed: unsharded)


@pytest.mark.multiprocess
def test_measured_plan_selection_keeps_parity(parity_results):
    res = parity_results["plan_trials"]
    assert "error" not in res, res.get("error")
    # engine switches mid-epoch, into DDP's reducer and out of it again, change nothing
    assert res["optimal"] <= TOL
    trials = res["trials"]
    assert 3 <= len(trials) <= 4 and len({t["describe"] for t in trials}) == len(trials)
    assert trials[0]["name"] == "optimal" and trials[-1]["name"] == "torch_ddp"
    # two interleaved rounds (a candidate > 25% slower than the fastest after round 1 is dropped by racing: one
    # window; never DDP's reducer); a first-pass winner over torch_ddp is confirmed in two more rounds of the two
    confirmed = [t for t in trials if len(t["windows_s"]) == 4]
    assert all(len(t["windows_s"]) in (1, 2, 4) and t["measured_s"] > 0 for t in trials)
    # (torch_ddp: every round; one window only when racing dropped every other candidate after round 1, which
    # ends the race: a loaded machine measured torch_ddp > 25% faster than all of them in CI, stop 33)
    alone = all(len(t["windows_s"]) == 1 for t in trials[:-1])
    assert len(trials[-1]["windows_s"]) in ((1, 2, 4) if alone else (2, 4)), trials
    assert confirmed == [] or (len(confirmed) == 2 and confirmed[-1]["name"] == "torch_ddp")
    chosen = [t for t in trials if t["chosen"]]
    assert len(chosen) == 1
    if confirmed:  # decided between the two on the confirmation windows alone
        assert chosen[0] in confirmed
        assert chosen[0]["deciding_s"] <= 1.10 * min(t["deciding_s"] for t in confirmed)
    else:  # the fastest, or a preferred one within the noise band (at most 10 %) of it
        assert all(t["deciding_s"] == t["measured_s"] for t in trials)
        assert chosen[0]["measured_s"] <= 1.10 * min(t["measured_s"] for t in trials)
    assert res["installed"] == chosen[0]["describe"]  # every rank ends on the chosen candidate


@pytest.mark.multiprocess
def test_shard_optimizer_auto_measures_sharded_and_unsharded_and_keeps_parity(parity_results):
    res = parity_results["plan_trials_auto"]
    assert "error" not in res, res.get("error")
    assert res["optimal"] <= TOL  # (parameters and optimizer state, every switch between shards and whole state)
    names = [t["name"] for t in res["trials"]]
    assert "optimal" in names and "optimal+shard" in names and names[-1] == "torch_ddp", names
    assert all(t["measured_s"] > 0 for t in res["trials"])
    chosen = [t for t in res["trials"] if t["chosen"]]
    assert len(chosen) == 1 and res["installed"] == chosen[0]["describe"]


@pytest.mark.multiprocess
def test_resume_at_an_epoch_boundary_matches_ddp(parity_results):
    """Resuming at the end of an epoch (step 6) or later (step 12): pipedap's resumed run deviates from the
    uninterrupted one exactly as much as DDP's does (Lightning's epoch-boundary resume with a per-step LR
    scheduler is not bit-exact for either), i.e. the strategy adds nothing of its own."""
    res = parity_results["resume_epoch_boundary"]
    assert "error" not in res, res.get("error")
    for at in (6, 12):
        assert res[f"dear_{at}"] == pytest.approx(res[f"ddp_{at}"], abs=1e-7)


@pytest.mark.multiprocess
def test_torch_ddp_candidate_trains_exactly_as_ddp(parity_results):
    """When measured selection chooses DDP's reducer (forced here), the rest of the fit runs under it: the
    models equal DDP's, with accumulation, clipping, BatchNorm buffers, frozen and sometimes-unused
    parameters and validation. DDP's reducer runs with ``find_unused_parameters`` by default; with
    ``find_unused_parameters=False`` (``_vouch``: the user vouches, DDP's default) it runs without (its per-step
    used-map all-reduce costs 1.4x a tiny MLP's step) unless a profiled step left a parameter without a gradient; a
    parameter used only before step 12 (``unused_late``) then stalls DDP's reduction at step 12: pipedap
    finishes that step's averaging as DDP with the option does and re-wraps with it, and says so in the log
    (without that, DDP stepped on un-averaged gradients and stopped the fit with "Expected to have finished
    reduction"). With ``gradient_as_bucket_view`` the option is set from the start (a stalled reduction would
    leave ``.grad``, DDP's own buffers, half-averaged). Under accumulation the candidate is left out (a switch falls
    inside the window, and DDP's reducer would not see a parameter used only in the earlier micro-batches:
    ``unused_accumulate2`` was 0.0117 off DDP with it) and pipedap's own schedule keeps parity."""
    res = parity_results["torch_ddp_forced"]
    assert "error" not in res, res.get("error")
    for name, r in res.items():
        assert r["diff"] <= TOL, (name, r)
        if name in ("accumulate2", "unused_accumulate2"):  # (not trialled under accumulation: switches fall
            assert not r["installed"].startswith("torch_ddp"), (name, r)  # inside the window)
        elif name not in ("manual_optimization", "manual_two_optimizers"):  # (their plans stay in the warm-up here)
            assert r["installed"].startswith("torch_ddp"), (name, r)
    for name, r in res.items():  # (default find_unused_parameters=None: DDP's reducer always runs with it)
        if (r["installed"] or "").startswith("torch_ddp") and not name.endswith("_vouch"):
            assert "find_unused_parameters" in r["installed"] and not r["stalled"], (name, r)
    # find_unused_parameters=False (the user vouches, DDP's default): the option only where a step showed it is needed
    for name in ("clip_norm_vouch", "batchnorm_vouch"):  # (every parameter used)
        assert "find_unused_parameters" not in res[name]["installed"] and not res[name]["stalled"], (name, res[name])
    r = res["unused_late_vouch"]  # (used in every profiled step, then no longer: a stall, finished by pipedap)
    assert "find_unused_parameters" in r["installed"] and len(r["stalled"]) == 1, r
    assert "pipedap averaged this step's gradients" in r["stalled"][0], r
    r = res["unused_rank1_vouch"]  # (unused on rank 1 from step 6: seen in the profiled and trial steps, option set)
    assert "find_unused_parameters" in r["installed"] and not r["stalled"], r
    for name in ("clip_norm_view", "unused_late_view"):  # (bucket views: the option from the start, no stall)
        assert "find_unused_parameters" in res[name]["installed"] and not res[name]["stalled"], (name, res[name])
    for name, r in res.items():  # (the strategy's gradient_as_bucket_view reaches DDP's reducer)
        assert ("gradient_as_bucket_view" in (r["installed"] or "")) == name.endswith("_view"), (name, r)
    assert {"clip_norm_view", "unused_some_steps_view", "unused_late_view"} <= set(res)
    assert {"unused_accumulate2", "unused_late"} <= set(res)
