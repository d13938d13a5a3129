"""The sharded optimizer step in the planning model (issue 30 item 4): hand-computed timelines, bounds valid on
random profiles, planners planning for the sharded op list, the what-if CLI's ``--sharded``."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_pipedap.measure.timeline import COMM_KINDS, STEP_KIND, exposed_communication_ms
from lightning_pipedap.plan import cli
from lightning_pipedap.plan.bounds import lower_bounds
from lightning_pipedap.plan.compression import CompressionCost
from lightning_pipedap.plan.cost_model import AlphaBeta, CostModel
from lightning_pipedap.plan.evaluator import Evaluator, op_code
from lightning_pipedap.plan.planners import PLANNERS, get_planner
from lightning_pipedap.plan.profile import LayerProfile, ModelProfile
from lightning_pipedap.plan.sharding import Sharding, resolve_sharding
from lightning_pipedap.plan.simulator import simulate, to_op_records
from lightning_pipedap.schedule import Op, OpKind, Schedule, sharded_ops

RS, AG, AR = OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.ALL_REDUCE
NAMES = ("no_overlap", "wfbp", "dear", "pipedap", "optimal")


def ops(text: str) -> tuple[Op, ...]:
    """'RS1 AG1 AR0' -> ops."""
    kinds = {"RS": RS, "AG": AG, "AR": AR}
    return tuple(Op(kinds[t[:2]], int(t[2:])) for t in text.split())


def case_s() -> tuple[ModelProfile, CostModel]:
    # 3 layers of 100 bytes, t_f = t_b = 1 s; t_update 0.6 s: 0.2 s per bucket, a shard's step 0.1 s at N = 2.
    # RS(100 B) = 0.5 s, AG(100 B) = 0.4 s, any AR 0.1 s (the preparation all-reduce too)
    prof = ModelProfile("s", tuple(LayerProfile(f"l{i}", 100, 1.0, 1.0) for i in range(3)), t_update=0.6)
    cm = CostModel(rs=AlphaBeta(0.0, 0.005), ag=AlphaBeta(0.0, 0.004), ar=AlphaBeta(0.1, 0.0), meta={"world_size": 2})
    return prof, cm


BUCKETS3 = ((0,), (1,), (2,))


def _timeline(r) -> list[tuple[str, float, float]]:
    out = [(str(t.op), t.start, t.end) for t in r.ops] + [
        (c.kind + ("" if c.bucket is None else str(c.bucket)), c.start, c.end) for c in r.shard]
    return sorted(((n, round(s, 9), round(e, 9)) for n, s, e in out), key=lambda x: (x[1], x[2]))


def test_unsharded_reference_by_hand():
    prof, cm = case_s()
    r = simulate(prof, cm, Schedule(BUCKETS3, ops("RS2 RS1 RS0 AG0 AG1 AG2")))
    # backward l2 [0,1] l1 [1,2] l0 [2,3]; RS2 [1,1.5] RS1 [2,2.5] RS0 [3,3.5] AG0 [3.5,3.9] AG1 [,4.3] AG2 [,4.7]
    # forward from 3: wait b0 -> 3.9, +0.2 update +1 -> 5.1; +0.2 +1 -> 6.3; +0.2 +1 -> 7.5
    assert r.iteration_s == pytest.approx(7.5)
    assert r.compute_s == pytest.approx(6.6)


@pytest.mark.parametrize("order, channels", [("RS2 RS1 RS0 AG0 AG1 AG2", 1), ("AR2 AR1 AR0", 1),
                                             ("RS2 AG2 RS1 AG1 RS0 AG0", 1), ("RS2 RS1 RS0 AG0 AG1 AG2", 2)])
def test_sharded_timeline_by_hand(order, channels):
    prof, cm = case_s()
    r = simulate(prof, cm, Schedule(BUCKETS3, ops(order)), sharded=True, channels=channels)
    # the engine's list whatever the planned one: gradient ops in place (AR -> RS), then AG per bucket, forward order
    assert r.schedule.ops == ops("RS2 RS1 RS0 AG0 AG1 AG2")
    # backward-start frame: RS2 [1,1.5] RS1 [2,2.5] RS0 [3,3.5]; prepare [3.5,3.6]; step0 [3.6,3.7] AG0 [3.7,4.1];
    # step1 [4.1,4.2] AG1 [4.2,4.6]; step2 [4.6,4.7] AG2 [4.7,5.1]. Forward from 3: wait b0 -> 4.1, land 0, f0 -> 5.1;
    # b1 (4.6) and b2 (5.1) are there in time: 6.1, 7.1. Period 7.1; shift to the iteration frame: P - Σt_b = 4.1
    assert r.iteration_s == pytest.approx(7.1)
    assert r.compute_s == pytest.approx(6.0)  # the update left the compute stream
    assert r.exposed_comm_s == pytest.approx(1.1)
    s = 4.1
    assert _timeline(r) == [(n, round(a + s, 9), round(b + s, 9)) for n, a, b in [
        ("RS2", 1, 1.5), ("RS1", 2, 2.5), ("RS0", 3, 3.5), ("prepare", 3.5, 3.6), ("step0", 3.6, 3.7),
        ("AG0", 3.7, 4.1), ("step1", 4.1, 4.2), ("AG1", 4.2, 4.6), ("step2", 4.6, 4.7), ("AG2", 4.7, 5.1)]]
    ch = {str(t.op): t.channel for t in r.ops}
    assert ch == ({"RS2": 0, "RS1": 0, "RS0": 0, "AG0": 0, "AG1": 0, "AG2": 0} if channels == 1 else
                  {"RS2": 0, "RS1": 0, "RS0": 0, "AG0": 1, "AG1": 1, "AG2": 1})
    waits = [(c.bucket, round(c.start, 9), round(c.end, 9)) for c in r.compute if c.kind == "wait"]
    assert waits == [(0, 0.0, 1.1)]
    assert not [c for c in r.compute if c.kind in ("update", "land")]


def test_sharded_with_clip_by_norm_by_hand():
    prof, cm = case_s()
    r = simulate(prof, cm, Schedule(BUCKETS3, ops("RS2 RS1 RS0 AG0 AG1 AG2")), sharded=Sharding(clip_norm=True))
    # after RS0 (3.5): gradient gathers GG0 [3.5,3.9] GG1 [,4.3] GG2 [,4.7], prepare [4.7,4.8]; step0 [4.8,4.9]
    # AG0 [4.9,5.3]; step1 [5.3,5.4] AG1 [5.4,5.8]; step2 [5.8,5.9] AG2 [5.9,6.3]. Forward: 5.3 + 1 -> 6.3;
    # b1 5.8 ok -> 7.3; b2 6.3 ok -> 8.3
    assert r.iteration_s == pytest.approx(8.3)
    s = 8.3 - 3.0
    assert _timeline(r) == [(n, round(a + s, 9), round(b + s, 9)) for n, a, b in [
        ("RS2", 1, 1.5), ("RS1", 2, 2.5), ("RS0", 3, 3.5), ("gather_grads0", 3.5, 3.9), ("gather_grads1", 3.9, 4.3),
        ("gather_grads2", 4.3, 4.7), ("prepare", 4.7, 4.8), ("step0", 4.8, 4.9), ("AG0", 4.9, 5.3),
        ("step1", 5.3, 5.4), ("AG1", 5.4, 5.8), ("step2", 5.8, 5.9), ("AG2", 5.9, 6.3)]]


def test_sharded_land_copy_and_records_by_hand():
    prof, cm = case_s()
    r = simulate(prof, cm, Schedule(BUCKETS3, ops("AR2 AR1 AR0")), sharded=Sharding(land_s_per_byte=0.001))
    # as the plain sharded case, each forward step paying a 0.1 s land copy first: 4.1 + 0.1 + 1 = 5.2; 6.3; 7.4
    assert r.iteration_s == pytest.approx(7.4)
    assert r.compute_s == pytest.approx(6.3)
    lands = [(c.bucket, round(c.start, 9), round(c.end, 9)) for c in r.compute if c.kind == "land"]
    assert lands == [(0, 1.1, 1.2), (1, 2.2, 2.3), (2, 3.3, 3.4)]
    recs = to_op_records(r, iterations=3)
    names = {x.name for x in recs}
    assert {"L0", "S0", "S2", "P", "AG2"} <= names
    assert {x.kind for x in recs if x.name.startswith("S")} == {STEP_KIND}
    # the channel (ops, the preparation, the steps) is busy whenever the compute stream waits
    exposed = exposed_communication_ms(recs, comm_kinds=COMM_KINDS + (STEP_KIND,), window=(0, 3 * r.iteration_s))
    assert exposed == pytest.approx(3e3 * r.exposed_comm_s)


def test_two_bucket_dear_versus_sharded_by_hand():
    # 2 buckets of 200 B (l1 holds none), AR = 1 + 0.005 n: RS = AG = 1 s; the preparation AR(24 B) = 1.12 s
    prof = ModelProfile("b", (LayerProfile("l0", 200, 0.5, 1.0), LayerProfile("l1", 0, 1.0, 1.0),
                              LayerProfile("l2", 200, 1.0, 2.0)), t_update=0.4)
    cm = CostModel.from_allreduce(1.0, 0.005, meta={"world_size": 2})
    sched = Schedule(((0,), (1, 2)), ops("RS1 RS0 AG0 AG1"))
    assert simulate(prof, cm, sched).iteration_s == pytest.approx(9.2)  # (test_plan_simulator's hand value)
    r = simulate(prof, cm, sched, sharded=True)
    # RS1 [3,4] RS0 [4,5] prepare [5,6.12] step0 [,6.22] AG0 [,7.22] step1 [,7.32] AG1 [,8.32];
    # forward from 4: wait -> 7.22 + 0.5 = 7.72, wait -> 8.32 + 2 = 10.32
    assert r.iteration_s == pytest.approx(10.32)
    assert r.bounds.best_s == pytest.approx(10.32)  # the window bound at layer 1 is tight here
    assert lower_bounds(prof, cm, sharded=True).best_s <= r.iteration_s


def test_compressed_bucket_stays_unsharded():
    prof, cm = case_s()
    comp = CompressionCost(alpha_c_s=0.0, beta_c_s_per_byte=0.0, payload_ratio=0.5, where="inline")
    sched = Schedule(BUCKETS3, ops("RS2 AG2 AR1 AR0"), compressed=(True, False, False))
    assert sharded_ops(sched).ops == ops("RS2 RS1 AR0 AG1 AG2")
    ev = Evaluator(prof, cm, BUCKETS3, compressed=sched.compressed, compression=comp, sharded=True)
    assert ev.sharded == (False, True, True)
    assert ev.step_s[0] == 0.0 and ev.update[0] == pytest.approx(0.2) and ev.step_s[1] == pytest.approx(0.1)
    r = simulate(prof, cm, sched, compression=comp, sharded=True)
    assert r.schedule.ops == ops("RS2 RS1 AR0 AG1 AG2")
    assert [c.bucket for c in r.compute if c.kind == "update"] == [0]
    assert r.compute_s == pytest.approx(6.2)
    # RS2 [1,1.5] RS1 [2,2.5] AR0 (compressed: the payload's AR, 0.1 s) [3,3.1]; prepare [3.1,3.2]; step1 [3.2,3.3]
    # AG1 [3.3,3.7]; step2 [3.7,3.8] AG2 [3.8,4.2]. Forward from 3: b0 done at 3.1, its update 0.2 (unsharded) and
    # f0 -> 4.3; b1 (3.7) and b2 (4.2) in time: 5.3, 6.3
    P = r.iteration_s
    assert P == pytest.approx(6.3)
    assert lower_bounds(prof, cm, compression=comp, sharded=True).best_s <= P * (1 + 1e-12)


def test_sharding_options_are_validated():
    assert resolve_sharding(False) is None and resolve_sharding(None) is None
    assert resolve_sharding(True) == Sharding()
    with pytest.raises(TypeError, match="sharded must be a bool or a Sharding"):
        resolve_sharding("yes")
    with pytest.raises(ValueError, match="land_s_per_byte must be a finite number >= 0"):
        Sharding(land_s_per_byte=-1.0)
    with pytest.raises(TypeError, match="clip_norm must be a bool"):
        Sharding(clip_norm=1)
    prof, _ = case_s()
    with pytest.raises(ValueError, match="the sharded model needs world_size"):
        simulate(prof, CostModel.from_allreduce(0.1, 0.0), Schedule(BUCKETS3, ops("AR2 AR1 AR0")), sharded=True)


# ---------------------------------------------------------------------------------------- random instances
def _random_instance(rng: random.Random, L: int, N: int) -> tuple[ModelProfile, CostModel]:
    prof = ModelProfile("r", tuple(LayerProfile(f"l{i}", rng.randint(0, 4000), rng.uniform(0, 1), rng.uniform(0, 1))
                                   for i in range(L)), t_update=rng.choice([0.0, rng.uniform(0, 2.0)]))
    cm = CostModel.from_allreduce(rng.uniform(0, 0.5), rng.uniform(0, 1e-3),
                                  startup_sharing=rng.choice([0.0, 1.0, rng.random()]), meta={"world_size": N})
    return prof, cm


def _random_schedule(rng: random.Random, L: int, compressed: bool) -> Schedule:
    cuts = sorted(rng.sample(range(1, L), rng.randint(0, L - 1))) if L > 1 else []
    bounds = [0] + cuts + [L]
    buckets = tuple(tuple(range(a, b)) for a, b in zip(bounds, bounds[1:]))
    B = len(buckets)
    flags = tuple(rng.random() < 0.4 for _ in range(B)) if compressed else None
    state = [0] * B
    seq: list[Op] = []
    while any(s != 2 for s in state):
        b = rng.choice([b for b in range(B) if state[b] != 2])
        if state[b] == 1:
            seq.append(Op(AG, b))
            state[b] = 2
        elif rng.random() < 0.5 or (flags is not None and flags[b]):  # (a compressed bucket: one AR, as planned)
            seq.append(Op(AR, b))
            state[b] = 2
        else:
            seq.append(Op(RS, b))
            state[b] = 1
    half = tuple(not (flags is not None and flags[b]) and rng.random() < 0.3 for b in range(B))
    return Schedule(buckets, tuple(seq), compressed=flags, wire16=half if any(half) else None)


def _random_compression(rng: random.Random) -> CompressionCost:
    return CompressionCost(alpha_c_s=rng.uniform(0, 0.05), beta_c_s_per_byte=rng.uniform(0, 1e-4),
                           payload_ratio=rng.uniform(0.01, 1.0), where=rng.choice(["helper", "inline"]),
                           post_share=rng.random())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), L=st.integers(1, 7), N=st.integers(1, 8), channels=st.sampled_from([1, 2]),
       clip=st.booleans(), land=st.sampled_from([0.0, 1e-4]), compressed=st.booleans())
def test_sharded_bounds_hold_on_random_profiles(seed, L, N, channels, clip, land, compressed):
    rng = random.Random(seed)
    prof, cm = _random_instance(rng, L, N)
    sched = _random_schedule(rng, L, compressed)
    comp = _random_compression(rng) if compressed else None
    sh = Sharding(clip_norm=clip, land_s_per_byte=land)
    r = simulate(prof, cm, sched, channels=channels, compression=comp, sharded=sh)
    P = r.iteration_s
    slack = 1 + 1e-9
    assert r.bounds.best_s <= P * slack  # this schedule's bounds
    if sched.wire16 is None:  # (the bound of every schedule does not cover 16-bit wire buckets: fewer bytes)
        assert lower_bounds(prof, cm, channels=channels, compression=comp, sharded=sh).best_s <= P * slack
    assert r.compute_s <= P * slack and r.exposed_comm_s >= 0
    # the fast evaluation equals the recorded one, for the planned and for the executed op list
    ev = Evaluator(prof, cm, sched.buckets, channels, compressed=sched.compressed, compression=comp, sharded=sh,
                   wire16=sched.wire16)
    assert ev.period_codes([op_code(o) for o in sched.ops]) == pytest.approx(P, rel=1e-12)
    assert ev.period_codes([op_code(o) for o in r.schedule.ops]) == pytest.approx(P, rel=1e-12)
    assert r.schedule.ops == sharded_ops(sched).ops


def _contiguous_fusions(L: int):
    for mask in range(1 << (L - 1)):
        cuts = [0] + [i for i in range(1, L) if mask >> (i - 1) & 1] + [L]
        yield tuple(tuple(range(a, b)) for a, b in zip(cuts, cuts[1:]))


def _all_grad_orders(B: int):
    """Every order of one gradient op (RS) per bucket: the sharded op lists (the AGs' places do not matter)."""
    import itertools

    for perm in itertools.permutations(range(B)):
        yield tuple(Op(RS, b) for b in perm) + tuple(Op(AG, b) for b in range(B))


@pytest.mark.parametrize("seed", range(12))
def test_optimal_sharded_matches_exhaustive_search(seed):
    rng = random.Random(700 + seed)
    L = [1, 2, 3, 3, 4, 4][seed % 6]
    N = rng.choice([2, 3, 4])
    prof, cm = _random_instance(rng, L, N)
    channels = 1 if seed % 3 else 2
    sh = Sharding(clip_norm=bool(seed % 2))
    best = min(simulate(prof, cm, Schedule(bk, o), channels=channels, sharded=sh).iteration_s
               for bk in _contiguous_fusions(L) for o in _all_grad_orders(len(bk)))
    s = get_planner("optimal")(prof, cm, N, channels=channels, sharded=sh)
    assert s.predicted_iteration_s == pytest.approx(best, rel=1e-12)
    for name in NAMES:
        p = get_planner(name)(prof, cm, N, channels=channels, sharded=sh)
        assert p.predicted_iteration_s >= best * (1 - 1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_every_planner_returns_the_engines_sharded_op_list(seed):
    rng = random.Random(900 + seed)
    L = rng.randint(3, 12)
    N = rng.choice([2, 4])
    prof, cm = _random_instance(rng, L, N)
    comp = _random_compression(rng) if seed % 2 else None
    for name in sorted(PLANNERS):
        s = get_planner(name)(prof, cm, N, compression=comp, sharded=True)
        assert sharded_ops(s) == s, name  # already the order the engine runs
        r = simulate(prof, cm, s, compression=comp, sharded=True)
        assert s.predicted_iteration_s == pytest.approx(r.iteration_s, rel=1e-12), name
        assert r.iteration_s >= lower_bounds(prof, cm, compression=comp, sharded=True).best_s * (1 - 1e-9)
    # planning for the sharded model is never worse there than sharding the unsharded plan
    plain = get_planner("optimal")(prof, cm, N, compression=comp)
    planned = get_planner("optimal")(prof, cm, N, compression=comp, sharded=True)
    assert planned.predicted_iteration_s <= simulate(prof, cm, plain, compression=comp,
                                                     sharded=True).iteration_s * (1 + 1e-12)


def test_planners_refuse_a_bad_sharded_argument():
    prof, cm = case_s()
    for name in NAMES:
        with pytest.raises(TypeError, match="sharded must be a bool or a Sharding"):
            get_planner(name)(prof, cm, 2, sharded="auto")


# ---------------------------------------------------------------------------------------------------- CLI
def test_cli_sharded_rows_and_comparison(capsys):
    rc = cli.main(["--profile", "resnet50", "--world-size", "4", "--alpha", "1e-4", "--beta", "1e-9",
                   "--planner", "optimal", "--sharded", "--clip-norm", "--describe"])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    assert any(line.startswith("optimal ") for line in lines)
    row = [line for line in lines if line.startswith("optimal+sharded ")]
    assert len(row) == 1
    cmp_lines = [line for line in lines if line.startswith("sharded vs unsharded")]
    assert cmp_lines and "optimal" in cmp_lines[0]
    assert "lower bounds sharded" in out
    # the sharded row's schedule is the engine's op list: every AG after every gradient op
    desc = [line for line in lines if line.startswith("optimal: ")]
    assert len(desc) == 2
    sharded_desc = desc[1].split(": ", 2)[2].split()
    first_ag = min(i for i, t in enumerate(sharded_desc) if t.startswith("AG"))
    assert all(t.startswith("AG") for t in sharded_desc[first_ag:])


def test_cli_sharded_options_need_sharded(capsys):
    rc = cli.main(["--profile", "resnet50", "--world-size", "4", "--alpha", "1e-4", "--beta", "1e-9",
                   "--clip-norm"])
    assert rc == 2
    assert "--clip-norm" in capsys.readouterr().err


def test_cli_saves_the_sharded_schedule_and_simulates_it_both_ways(tmp_path, capsys):
    base = ["--profile", "resnet50", "--world-size", "4", "--alpha", "1e-4", "--beta", "1e-9"]
    path = tmp_path / "s.json"
    assert cli.main(base + ["--planner", "dear", "--sharded", "--save-schedule", str(path)]) == 0
    assert "(schedule of dear+sharded)" in capsys.readouterr().out
    saved = cli.read_schedule(str(path), cli.load_profile("resnet50"), None)
    assert sharded_ops(saved) == saved
    assert cli.main(base + ["--schedule", str(path), "--sharded", "--land-ns-per-byte", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "dear+sharded " in out and "sharded vs unsharded dear:" in out
