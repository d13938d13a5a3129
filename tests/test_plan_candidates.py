"""Candidate schedules for measured plan selection (plan/candidates.py): pure, hand-checkable."""

from __future__ import annotations

import pytest

from lightning_pipedap.plan.candidates import trial_candidates
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.planners import get_planner
from lightning_pipedap.plan.profile import LayerProfile, ModelProfile
from lightning_pipedap.plan.simulator import simulate

MiB = 2**20


def _profile() -> ModelProfile:
    # four 4 MiB layers, compute 10 ms forward / 20 ms backward each
    return ModelProfile("toy", tuple(LayerProfile(f"l{i}", 4 * MiB, 0.010, 0.020) for i in range(4)), 0.0)


def _cm() -> CostModel:
    return CostModel.from_allreduce(alpha_s=1e-3, beta_s_per_byte=2e-9, startup_sharing=1.0, meta={"world_size": 2})


def test_planned_first_then_fixed_fusion_dear_and_wfbp():
    prof, cm = _profile(), _cm()
    planned = get_planner("optimal")(prof, cm, 2)
    cands = trial_candidates(prof, cm, 2, planned, cap_bytes=8 * MiB, k=3)
    assert cands[0] is planned
    names = [c.name for c in cands]
    # the planned schedule may coincide with a fixed-fusion one; then the next distinct one follows
    assert len(cands) == 3 and len({(c.buckets, c.ops) for c in cands}) == 3
    fixed = [c for c in cands[1:] if "@" in c.name]
    assert fixed and all(c.name.endswith("@8MiB") for c in fixed)
    for c in fixed:  # 8 MiB greedy cap over four 4 MiB layers: two buckets of two layers
        assert c.buckets == ((0, 1), (2, 3))
    for c in cands:  # every candidate carries the simulator's prediction
        assert c.predicted_iteration_s == pytest.approx(simulate(prof, cm, c).iteration_s, rel=1e-12)
    assert "optimal" == names[0]


def test_k_one_is_the_planned_schedule_only_and_duplicates_are_dropped():
    prof, cm = _profile(), _cm()
    planned = get_planner("dear")(prof, cm, 2, fusion=8 * MiB)
    assert trial_candidates(prof, cm, 2, planned, cap_bytes=8 * MiB, k=1) == [planned]
    cands = trial_candidates(prof, cm, 2, planned, cap_bytes=8 * MiB, k=2)
    # dear@8MiB equals the planned schedule: skipped, wfbp@8MiB is the second candidate
    assert [c.name for c in cands] == ["dear", "wfbp@8MiB"]
    assert [str(o) for o in cands[1].ops] == ["AR1", "AR0"]


@pytest.mark.parametrize("kw, match", [({"k": 0}, "k must be"), ({"k": True}, "k must be"),
                                       ({"cap_bytes": 0}, "cap_bytes must be")])
def test_bad_arguments_are_named(kw, match):
    prof, cm = _profile(), _cm()
    args = dict(cap_bytes=MiB, k=2) | kw
    with pytest.raises(ValueError, match=match):
        trial_candidates(prof, cm, 2, get_planner("wfbp")(prof, cm, 2), **args)
