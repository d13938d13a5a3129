"""The sharded step's model against what the engine does (issue 30, "the simulator against measurement"): the
contention of the shard steps (CPU work on the communication worker), the measured land copy, and the padding of
parameter ownership on the wire. Pure: plain data, no processes (one test lays real buckets out with torch)."""

from __future__ import annotations

import random

import pytest

from lightning_pipedap.plan.contention import Contention, simulate_contended
from lightning_pipedap.plan.cost_model import AlphaBeta, CostModel
from lightning_pipedap.plan.evaluator import Evaluator
from lightning_pipedap.plan.planners import get_planner
from lightning_pipedap.plan.profile import LayerProfile, ModelProfile
from lightning_pipedap.plan.sharding import FLAG_BYTES, Sharding, assign_owners, owned_buckets
from lightning_pipedap.plan.simulator import simulate
from lightning_pipedap.schedule import Op, OpKind, Schedule

RS, AG = OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER


def case_s() -> tuple[ModelProfile, CostModel]:
    # as tests/test_plan_sharded.py: 3 layers of 100 B, t_f = t_b = 1 s, t_update 0.6 s (a shard's step 0.1 s at
    # N = 2); RS(100 B) 0.5 s, AG(100 B) 0.4 s, any AR 0.1 s (the preparation all-reduce)
    prof = ModelProfile("s", tuple(LayerProfile(f"l{i}", 100, 1.0, 1.0) for i in range(3)), t_update=0.6)
    cm = CostModel(rs=AlphaBeta(0.0, 0.005), ag=AlphaBeta(0.0, 0.004), ar=AlphaBeta(0.1, 0.0), meta={"world_size": 2})
    return prof, cm


DEAR3 = Schedule(((0,), (1,), (2,)), tuple(Op(RS, b) for b in (2, 1, 0)) + tuple(Op(AG, b) for b in (0, 1, 2)))


# ----------------------------------------------------------------------------- the steps' contention
def test_contended_shard_steps_by_hand():
    prof, cm = case_s()
    # σ_m = σ_c = 0: only the steps slow and are slowed (σ_s = σ_cs = 1: each at half rate while the other runs)
    c = Contention(0.0, 0.0, 0.0, step_slowdown=1.0, compute_slowdown_step=1.0)
    r = simulate_contended(prof, cm, DEAR3, c, sharded=True)
    # backward-start frame: RS2 [1,1.5] RS1 [2,2.5] RS0 [3,3.5], prepare [3.5,3.6], step0 [3.6,3.7] (compute waits:
    # not slowed), AG0 [3.7,4.1]; forward f0 from 4.1 with step1: both at half rate -> step1 [4.1,4.3] (f0 did 0.1);
    # AG1 [4.3,4.7] (f0 0.4 more); step2 [4.7,4.9] (f0 0.1 more); AG2 [4.9,5.3] (f0 0.4 more: ends at 5.3);
    # f1 [5.3,6.3], f2 [6.3,7.3]: period 7.3 against 7.1 uncontended
    assert r.iteration_s == pytest.approx(7.3)
    assert r.compute_s == pytest.approx(6.0)  # the uncontended busy time of the sharded model (no update on it)
    assert r.compute_busy_s == pytest.approx(6.2)
    assert r.exposed_comm_s == pytest.approx(1.1)
    steps = {iv.bucket: round(iv.end - iv.start, 9) for iv in r.shard if iv.kind == "step"}
    assert steps == {0: 0.1, 1: 0.2, 2: 0.2}
    assert [str(t.op) for t in r.ops] == ["RS2", "RS1", "RS0", "AG0", "AG1", "AG2"]
    assert simulate(prof, cm, DEAR3, sharded=True).iteration_s == pytest.approx(7.1)


def test_step_slowdowns_touch_only_the_sharded_model():
    prof, cm = case_s()
    steps_only = Contention(0.0, 0.0, 0.0, step_slowdown=0.5, compute_slowdown_step=2.0)
    assert not steps_only.is_none
    # unsharded: no step on the worker, so the step's slowdowns change nothing
    assert simulate_contended(prof, cm, DEAR3, steps_only).iteration_s == pytest.approx(
        simulate(prof, cm, DEAR3).iteration_s, rel=1e-12)
    # sharded: they lengthen the step
    assert simulate_contended(prof, cm, DEAR3, steps_only, sharded=True).iteration_s > simulate(
        prof, cm, DEAR3, sharded=True).iteration_s + 0.05


def test_contended_sharded_without_contention_equals_simulate_on_random_instances():
    rng = random.Random(3)
    for _ in range(150):
        L = rng.randint(1, 7)
        prof = ModelProfile("r", tuple(LayerProfile(f"l{i}", rng.randint(1, 10**6), rng.random(), rng.random())
                                       for i in range(L)), t_update=rng.random())
        cm = CostModel(rs=AlphaBeta(rng.random() * 0.01, rng.random() * 1e-6),
                       ag=AlphaBeta(rng.random() * 0.01, rng.random() * 1e-6),
                       ar=AlphaBeta(rng.random() * 0.01, rng.random() * 2e-6), meta={"world_size": 2})
        channels = rng.choice([1, 2])
        sh = Sharding(clip_norm=rng.random() < 0.5, land_s_per_byte=rng.random() * 1e-7)
        s = get_planner(rng.choice(["dear", "pipedap", "wfbp"]))(prof, cm, 2, channels=channels, sharded=sh)
        a = simulate(prof, cm, s, sharded=sh, channels=channels)
        b = simulate_contended(prof, cm, s, Contention.none(), sharded=sh, channels=channels)
        assert b.iteration_s == pytest.approx(a.iteration_s, rel=1e-12, abs=1e-12)
        assert b.compute_s == pytest.approx(a.compute_s, rel=1e-12)
        assert sorted((str(t.op), round(t.start, 9), round(t.end, 9)) for t in b.ops) == sorted(
            (str(t.op), round(t.start, 9), round(t.end, 9)) for t in a.ops)
        assert sorted((i.kind, i.bucket, round(i.start, 9)) for i in b.shard) == sorted(
            (i.kind, i.bucket, round(i.start, 9)) for i in a.shard)
        loaded = Contention(0.3, 0.2, 0.001, step_slowdown=0.5, compute_slowdown_step=0.7)
        assert simulate_contended(prof, cm, s, loaded, sharded=sh, channels=channels).iteration_s >= a.iteration_s


def test_contention_file_keeps_the_step_slowdowns_and_reads_older_files():
    c = Contention(0.1, 0.2, 0.0, {"x": 1}, step_slowdown=0.3, compute_slowdown_step=0.4)
    back = Contention.from_dict(c.to_dict())
    assert (back.step_slowdown, back.compute_slowdown_step) == (0.3, 0.4)
    old = c.to_dict()
    del old["step_slowdown"], old["compute_slowdown_step"]
    assert Contention.from_dict(old).step_slowdown == 0.0
    with pytest.raises(ValueError, match="step_slowdown"):
        Contention(step_slowdown=-1.0)


# ----------------------------------------------------------------------------- the land copy
def test_measured_land_copy_by_hand_with_contention():
    prof, cm = case_s()
    sh = Sharding(land_s_per_byte=0.001)  # 0.1 s per 100-byte bucket
    # uncontended: b0 gathered at 4.1, land [4.1,4.2], f0 [4.2,5.2]; land1 [5.2,5.3] f1 [5.3,6.3]; land2, f2: 7.4
    assert simulate(prof, cm, DEAR3, sharded=sh).iteration_s == pytest.approx(7.4)
    # σ_c = 1 (compute at half rate while an op runs; the steps are not ops, σ_cs = 0). Backward: l2 [0,1]; l1 with
    # RS2 [1,1.5]: ends 2.25; l0 with RS1 [2.25,2.75]: ends 3.5; RS0 [3.5,4], prepare [4,4.1], step0 [4.1,4.2],
    # AG0 [4.2,4.6]. land0 [4.6,4.7] beside step1; f0 from 4.7: AG1 [4.7,5.1] (f0 0.2), step2 [5.1,5.2] (0.1),
    # AG2 [5.2,5.6] (0.2), alone to 6.1; land1 [6.1,6.2], f1 [6.2,7.2], land2 [7.2,7.3], f2 [7.3,8.3]
    r = simulate_contended(prof, cm, DEAR3, Contention(0.0, 1.0, 0.0), sharded=sh)
    assert r.iteration_s == pytest.approx(8.3)
    lands = [(iv.bucket, round(iv.end - iv.start, 9)) for iv in r.compute if iv.kind == "land"]
    assert lands == [(0, 0.1), (1, 0.1), (2, 0.1)]
    assert r.compute_s == pytest.approx(6.3)  # 3 + 3 + three land copies


class _Rec:
    """A complete profiled step (what :meth:`Planning.keep_step` reads of a StepRecorder)."""

    complete, passes = True, 1

    def times(self) -> tuple[list[float], list[float]]:
        return [0.1, 0.1], [0.2, 0.2]


def test_planning_measures_the_land_rate_from_the_profiled_sync_steps():
    import torch

    from lightning_pipedap.strategy.planning import Planning

    planning = Planning.__new__(Planning)  # (only the profiling lists and the layers are used here)
    planning._profiled, planning._t_updates, planning._profile_busy, planning._passes = [], [], [], []
    planning._lands, planning.layers = [], [[0], [1, 2]]
    for land in ((0.002, 1000), (0.010, 1000), (0.004, 1000), (0.5, 0)):
        planning.keep_step(_Rec(), None, 0.0, 0.1, 0.05, land)
    assert planning._t_updates == [0.05] * 4
    params = [torch.zeros(10), torch.zeros(5), torch.zeros(20, dtype=torch.float64)]
    sh = planning.sharding_model(params)
    assert sh.land_s_per_byte == pytest.approx(4e-6)  # the median rate (a step that landed nothing left out)
    assert sh.owned is None
    own = planning.sharding_model(params, {id(params[0]): 0.5, id(params[2]): 0.25}, owned=True)
    assert own.owned == (((40, 0.5),), ((20, 0.0), (160, 0.25)))
    by_elements = planning.sharding_model(params, None, owned=True)
    assert by_elements.owned == (((40, 10.0),), ((20, 5.0), (160, 20.0)))
    planning._lands = []
    assert planning.sharding_model(params).land_s_per_byte == 0.0


# ----------------------------------------------------------------------------- ownership padding
def test_ownership_padding_on_the_wire_by_hand():
    # 2 layers: l0 holds parameters of 300 and 100 B, l1 one of 100 B; one bucket, N = 2, owners balanced by bytes:
    # 300 -> rank 0, 100 -> rank 1, 100 -> rank 1; regions 300 and 200 + 3 flags: padded to 2 x 300 = 600 B on the
    # wire (500 B of data), and the step is rank 0's 300/500 of the bucket's update
    prof = ModelProfile("o", (LayerProfile("l0", 400, 1.0, 1.0), LayerProfile("l1", 100, 1.0, 1.0)), t_update=1.0)
    cm = CostModel(rs=AlphaBeta(0.0, 0.001), ag=AlphaBeta(0.0, 0.0005), ar=AlphaBeta(0.1, 0.0),
                   meta={"world_size": 2})
    sched = Schedule(((0, 1),), (Op(RS, 0), Op(AG, 0)))
    owned = (((300, 300.0), (100, 100.0)), ((100, 100.0),))
    (ob,) = owned_buckets(owned, sched.buckets, [True], 2)
    assert (ob.wire_bytes, ob.data_bytes, ob.step_share) == (600, 500, pytest.approx(0.6))
    assert ob.padding == pytest.approx(100 / 600)
    # backward [0,2]; RS(600 B) [2,2.6]; prepare [2.6,2.7]; step 0.6 [2.7,3.3]; AG(600 B) [3.3,3.6]; forward 2 s
    r = simulate(prof, cm, sched, sharded=Sharding(owned=owned))
    assert r.iteration_s == pytest.approx(5.6)
    # element-wise shards: RS [2,2.5], prepare [2.5,2.6], step 0.5 [2.6,3.1], AG [3.1,3.35] -> 5.35
    assert simulate(prof, cm, sched, sharded=True).iteration_s == pytest.approx(5.35)
    ev = Evaluator(prof, cm, sched.buckets, sharded=Sharding(owned=owned), world_size=2)
    assert ev.wire_bytes == [600] and ev.nbytes == [500]
    assert ev.cost[0] == pytest.approx(0.6) and ev.gather_s == [pytest.approx(0.3)]


def test_ownership_by_measured_cost_sets_the_slowest_owners_step():
    # costs are step seconds, not bytes: the 100-B parameter costs most (Muon's m·n·min(m, n))
    owned = (((300, 1.0), (100, 3.0)), ((100, 1.0),))
    (ob,) = owned_buckets(owned, ((0, 1),), [True], 2)
    # LPT by cost: 3.0 -> rank 0 (100 B), 1.0 -> rank 1 (300 B), 1.0 -> rank 1 (100 B): regions 100 and 400 + flags
    assert ob.wire_bytes == 2 * (400 + 3 * FLAG_BYTES)
    assert ob.step_share == pytest.approx(3.0 / 5.0)


def test_owned_buckets_match_the_engines_layout():
    import torch

    from lightning_pipedap.engine.buckets import FlatBucket

    rng = random.Random(7)
    for _ in range(40):
        n = rng.randint(2, 4)
        layers = [[rng.randint(1, 400) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(1, 6))]
        cut = sorted(rng.sample(range(1, len(layers)), rng.randint(0, len(layers) - 1))) if len(layers) > 1 else []
        bounds = [0, *cut, len(layers)]
        buckets = [tuple(range(a, b)) for a, b in zip(bounds, bounds[1:])]
        costs = [[rng.random() for _ in layer] for layer in layers]
        owned = tuple(tuple((4 * e, c) for e, c in zip(layer, cl)) for layer, cl in zip(layers, costs))
        model = owned_buckets(owned, buckets, [True] * len(buckets), n)
        # the engine: owners over every bucket in forward order, then the padded buffer (engine/engine.py)
        rows = [[c for i in bk for c in costs[i]] for bk in buckets]
        owners = assign_owners(rows, n)
        for b, bk in enumerate(buckets):
            params = [torch.zeros(e) for i in bk for e in layers[i]]
            fb = FlatBucket.allocate(b, tuple(range(len(params))), params, n, owners=owners[b])
            assert model[b].wire_bytes == fb.nbytes, (layers, buckets, b)
            assert model[b].data_bytes == 4 * sum(p.numel() for p in params)


def test_candidates_predict_sharded_plans_with_the_contention_model():
    # the strategy's prediction of a sharded plan goes through the contention-aware simulator with the measured
    # sharded model (land copy, step slowdowns), as an unsharded plan's does
    from lightning_pipedap import PipeDAPStrategy
    from lightning_pipedap.strategy.candidates import CandidatePlanner

    prof, cm = case_s()
    params = [None] * 3
    cfg = PipeDAPStrategy(schedule="pipedap", plan_trials=1, shard_optimizer=True).config
    c = Contention(0.2, 0.3, 0.0, step_slowdown=1.0, compute_slowdown_step=1.0)
    sh = Sharding(land_s_per_byte=0.001)
    planner = CandidatePlanner(cfg, cm, None, 2, c, lambda _m: None, None, True, sh)
    (cand,), _, _ = planner.build(prof, params, [[0], [1], [2]], 1)
    want = simulate_contended(prof, cm, cand, c, sharded=sh).iteration_s
    assert cand.predicted_iteration_s == pytest.approx(want, rel=1e-12)
    assert want > simulate(prof, cm, cand, sharded=sh).iteration_s + 0.1
    assert planner.predictions[cand.name]["contended_s"] == pytest.approx(want, rel=1e-12)


def test_the_sharded_models_log_line_names_the_land_rate_and_the_padding():
    from lightning_pipedap.strategy.candidates import describe_sharding

    prof = ModelProfile("o", (LayerProfile("l0", 400, 1.0, 1.0), LayerProfile("l1", 100, 1.0, 1.0)), t_update=1.0)
    line = describe_sharding(Sharding(land_s_per_byte=2e-9), prof, 2)
    assert "land copy 2.000 ns/B" in line and "0.0 ms per step" in line and "padding" not in line
    owned = (((300, 300.0), (100, 100.0)), ((100, 100.0),))
    line = describe_sharding(Sharding(owned=owned), prof, 2)
    assert "16.7% padding" in line and "steps 60%" in line
