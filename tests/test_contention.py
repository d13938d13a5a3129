"""Contention between compute and communication: the model, its timeline simulation, the fit from a
micro-benchmark, and the live micro-benchmark on two gloo ranks."""

from __future__ import annotations

import math
import random

import pytest

from lightning_pipedap.plan import Contention, ContendedResult, contended_pair, fit_contention, simulate_contended
from lightning_pipedap.plan.compression import CompressionCost
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.planners import get_planner
from lightning_pipedap.plan.profile import LayerProfile, ModelProfile, load_profile
from lightning_pipedap.plan.simulator import simulate, to_op_records
from lightning_pipedap.schedule import Op, OpKind, Schedule
from lightning_pipedap.plan.profile import PACKAGED_PROFILES_DIR

RS, AG, AR = OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.ALL_REDUCE
SHARED = PACKAGED_PROFILES_DIR  # the reference profiles shipped with the package


def ops(text: str) -> tuple[Op, ...]:
    kinds = {"RS": RS, "AG": AG, "AR": AR}
    return tuple(Op(kinds[t[:2]], int(t[2:])) for t in text.split())


def timeline(r) -> list[tuple[str, float, float]]:
    return [(iv.kind, round(iv.start, 12), round(iv.end, 12)) for iv in r.compute]


# ------------------------------------------------------------------------------ the model object
@pytest.mark.parametrize("kw, match", [
    ({"comm_slowdown": -0.1}, r"comm_slowdown must be a finite number >= 0, got -0.1"),
    ({"compute_slowdown": math.nan}, r"compute_slowdown must be a finite number >= 0, got nan"),
    ({"op_overhead_s": math.inf}, r"op_overhead_s must be a finite number >= 0, got inf"),
    ({"comm_slowdown": True}, r"comm_slowdown must be a finite number >= 0, got True"),
    ({"meta": [1]}, r"meta must be a dict, got list"),
])
def test_contention_validation_names_the_bad_value(kw, match):
    with pytest.raises(ValueError, match=match):
        Contention(**kw)


def test_contention_dict_round_trip_and_none():
    c = Contention(0.3, 0.25, 1e-3, {"alone_comm_s": 0.5})
    d = c.to_dict()
    assert d["format"] == "lightning_pipedap.contention" and d["op_overhead_s"] == 1e-3
    back = Contention.from_dict(d)
    assert back == c and back.meta == {"alone_comm_s": 0.5}
    assert Contention.none() == Contention(0.0, 0.0, 0.0) and Contention.none().is_none and not c.is_none
    with pytest.raises(ValueError, match="not a contention model"):
        Contention.from_dict({"format": "x"})
    with pytest.raises(ValueError, match=r"lacks \['compute_slowdown'\]"):
        Contention.from_dict({"format": "lightning_pipedap.contention", "version": 1, "comm_slowdown": 0.1})


# ------------------------------------------------------------------------------ hand-computed timelines
def one_layer() -> tuple[ModelProfile, CostModel, Schedule]:
    # t_b = 1, t_f = 1, one AR of cost 1 (alpha = 1, beta = 0)
    return (ModelProfile("one", (LayerProfile("l0", 100, 1.0, 1.0),)), CostModel.from_allreduce(1.0, 0.0),
            Schedule(((0,),), ops("AR0")))


@pytest.mark.parametrize("delta", [0.0, 0.5])
def test_one_layer_comm_after_backward_is_not_slowed(delta):
    prof, cm, s = one_layer()
    # AR starts at 1 (after backward), compute idle then (waits for it): rate 1, no δ -> [1, 2]; forward -> 3
    r = simulate_contended(prof, cm, s, Contention(1.0, 0.0, delta))
    assert isinstance(r, ContendedResult)
    assert r.iteration_s == 3.0 and r.exposed_comm_s == 1.0 and r.compute_busy_s == 2.0
    assert [(str(o.op), o.start, o.end) for o in r.ops] == [("AR0", 3.0, 4.0)]  # iteration frame: +2
    assert timeline(r) == [("wait", 0.0, 1.0), ("forward", 1.0, 2.0), ("backward", 2.0, 3.0)]


def two_layers() -> tuple[ModelProfile, CostModel, Schedule]:
    # backward l1 [0, 1] then l0 (t_b = 2); AR(100 bytes) = 0.5 + 0.01 * 100 = 1.5 s; t_f = 1 each
    prof = ModelProfile("a", (LayerProfile("l0", 100, 1.0, 2.0), LayerProfile("l1", 100, 1.0, 1.0)))
    return prof, CostModel.from_allreduce(0.5, 0.01), Schedule(((0,), (1,)), ops("AR1 AR0"))


@pytest.mark.parametrize("contention, P, busy, ar1_end, bwd_end", [
    # σ_m=1, σ_c=0.5, δ=0.5: AR1 starts at 1 while l0 runs: work 1.5+0.5 = 2 at rate 1/2; l0 work 2 at
    # rate 1/1.5 -> ends at 4; AR1 has done 1.5 by then, the last 0.5 alone -> 4.5; AR0 [4.5, 6]
    # (compute waits: no δ); forward 6 -> 8.
    (Contention(1.0, 0.5, 0.5), 8.0, 6.0, 4.5, 4.0),
    # δ=0: AR1 (1.5 at rate 1/2) and l0 (2 at rate 2/3) both end at 4; AR0 [4, 5.5]; forward -> 7.5
    (Contention(1.0, 0.5, 0.0), 7.5, 6.0, 4.0, 4.0),
    # σ_c=1: AR1 ends at 4; l0 has done 1.5 at rate 1/2, the last 0.5 alone -> 4.5; AR0 [4.5, 6] -> 8
    (Contention(1.0, 1.0, 0.0), 8.0, 6.5, 4.0, 4.5),
    # none: simulate()'s 6.5 (AR1 [1, 2.5], l0 [1, 3], AR0 [3, 4.5], forward -> 6.5)
    (Contention.none(), 6.5, 5.0, 2.5, 3.0),
])
def test_two_layers_by_hand(contention, P, busy, ar1_end, bwd_end):
    prof, cm, s = two_layers()
    r = simulate_contended(prof, cm, s, contention)
    assert r.iteration_s == pytest.approx(P, abs=1e-12)
    assert r.compute_busy_s == pytest.approx(busy, abs=1e-12)
    assert r.exposed_comm_s == pytest.approx(P - busy, abs=1e-12)
    assert r.compute_stretch_s == pytest.approx(busy - 5.0, abs=1e-12)
    shift = P - bwd_end  # anchor frame (backward start 0) -> iteration frame (forward start 0)
    assert r.ops[0].start == pytest.approx(1.0 + shift) and r.ops[0].end == pytest.approx(ar1_end + shift)
    assert r.ops[1].end == pytest.approx(P - busy + bwd_end + shift)  # AR0 ends when the wait ends (+ P)
    waits = [iv for iv in r.compute if iv.kind == "wait"]
    assert [(w.bucket, w.start) for w in waits] == [(0, 0.0)]
    assert waits[0].end == pytest.approx(P - busy)
    bwd = [iv for iv in r.compute if iv.kind == "backward"]
    assert [b.layers for b in bwd] == [(1,), (0,)]
    assert bwd[0].start == pytest.approx(shift) and bwd[1].end == pytest.approx(P)
    assert r.comm_busy_s == pytest.approx(sum(o.end - o.start for o in r.ops))


def test_two_channels_slow_compute_per_running_op():
    # 3 layers of 2 bytes; RS = AG = 1 s (alpha 0, beta 1 s/byte); t_b = 1, 0.5, 3 (l2, l1, l0); t_f = 1.
    # σ_m = 0, σ_c = 1; channel 0: RS2 RS1 RS0, channel 1: AG2 AG1 AG0.
    #   [0,1] l2 alone; [1,2] RS2, l1 at rate 1/2 (0.5 done: ends at 2);
    #   [2,3] RS1 and AG2 together: l0 at rate 1/(1+2) (1/3 done); [3,4] AG1: rate 1/2 (1/2 done);
    #   l0's remaining 3 - 1/3 - 1/2 = 13/6 alone -> ends 37/6; RS0 [37/6, 43/6], AG0 [43/6, 49/6];
    #   forward 3 s -> P = 67/6.
    prof = ModelProfile("c", (LayerProfile("l0", 2, 1.0, 3.0), LayerProfile("l1", 2, 1.0, 0.5),
                              LayerProfile("l2", 2, 1.0, 1.0)))
    cm = CostModel.from_allreduce(0.0, 1.0)
    s = Schedule(((0,), (1,), (2,)), ops("RS2 RS1 AG2 AG1 RS0 AG0"))
    r = simulate_contended(prof, cm, s, Contention(0.0, 1.0), channels=2)
    assert r.iteration_s == pytest.approx(67 / 6, abs=1e-12)
    assert r.exposed_comm_s == pytest.approx(2.0, abs=1e-12)
    shift = 67 / 6 - 37 / 6
    got = {str(o.op): (o.channel, o.start - shift, o.end - shift) for o in r.ops}
    want = {"RS2": (0, 1, 2), "RS1": (0, 2, 3), "AG2": (1, 2, 3), "AG1": (1, 3, 4),
            "RS0": (0, 37 / 6, 43 / 6), "AG0": (1, 43 / 6, 49 / 6)}
    for k, (ch, a, b) in want.items():
        assert got[k][0] == ch and got[k][1] == pytest.approx(a, abs=1e-12) and got[k][2] == pytest.approx(b, abs=1e-12)
    # one channel: ops serialised, compute never slowed by more than one op at a time
    assert simulate_contended(prof, cm, s, Contention(0.0, 1.0)).iteration_s > simulate(prof, cm, s).iteration_s


def test_helper_lane_is_not_slowed():
    # l0: 100 B, t_f 1, t_b 0.5; l1: 100 B, t_f 1, t_b 1. Compression on the helper: 0.1 + 0.001 n = 0.2 s,
    # payload 50 B -> AR(50) = 1.0 s. σ_m = 1, σ_c = 0.
    #   l1 [0,1]; C1 [1,1.2] (not slowed); AR1 from 1.2 at rate 1/2 while l0 runs [1,1.5] (0.15 done),
    #   then alone (compute waits for b0): ends 1.5 + 0.85 = 2.35; C0 [1.5,1.7]; AR0 [2.35,3.35]; P = 5.35
    prof = ModelProfile("c", (LayerProfile("l0", 100, 1.0, 0.5), LayerProfile("l1", 100, 1.0, 1.0)))
    cm = CostModel.from_allreduce(0.5, 0.01)
    comp = CompressionCost(0.1, 0.001, payload_ratio=0.5)
    s = Schedule(((0,), (1,)), ops("AR1 AR0"), compressed=(True, True))
    r = simulate_contended(prof, cm, s, Contention(1.0, 0.0), compression=comp)
    assert r.iteration_s == pytest.approx(5.35, abs=1e-12)
    shift = 5.35 - 1.5
    assert [(h.bucket, h.start - shift, h.end - shift) for h in r.helper] == [
        (1, pytest.approx(1.0), pytest.approx(1.2)), (0, pytest.approx(1.5), pytest.approx(1.7))]
    assert [(str(o.op), o.start - shift, o.end - shift) for o in r.ops] == [
        ("AR1", pytest.approx(1.2), pytest.approx(2.35)), ("AR0", pytest.approx(2.35), pytest.approx(3.35))]
    assert simulate(prof, cm, s, compression=comp).iteration_s == pytest.approx(5.2)


# ------------------------------------------------------------------------------ parity with simulate()
def random_instance(rng: random.Random):
    L = rng.randint(1, 7)
    layers = tuple(LayerProfile(f"l{i}", rng.choice([0, 1, 10, 100, 1000, 5000]),
                                rng.choice([0.0, rng.uniform(0, 2)]), rng.choice([0.0, rng.uniform(0, 2)]))
                   for i in range(L))
    prof = ModelProfile("r", layers, t_update=rng.choice([0.0, rng.uniform(0, 0.5)]))
    cm = CostModel.from_allreduce(rng.uniform(0, 1), rng.uniform(0, 2e-3), startup_sharing=rng.uniform(0, 1),
                                  meta={"world_size": 4})
    collective = rng.choice(["AR", "AG"])
    comp = CompressionCost(rng.uniform(0, 0.5), rng.uniform(0, 1e-3), payload_ratio=rng.uniform(0, 1),
                           collective=collective, rounds=rng.choice([1, 2]) if collective == "AR" else 1,
                           where=rng.choice(["helper", "inline"]), post_share=rng.uniform(0, 1))
    perm = list(range(L))
    rng.shuffle(perm)  # buckets need not be contiguous
    cuts = sorted(rng.sample(range(1, L), rng.randint(0, L - 1))) if L > 1 else []
    buckets = tuple(tuple(perm[a:b]) for a, b in zip([0] + cuts, cuts + [L]))
    B = len(buckets)
    flags = tuple(rng.random() < 0.4 for _ in range(B)) if rng.random() < 0.5 else None
    pending: list[Op] = []
    seq: list[Op] = []
    for b in rng.sample(range(B), B):
        if rng.random() < 0.5:
            seq.append(Op(AR, b))
        else:
            seq.append(Op(RS, b))
            pending.append(Op(AG, b))
        while pending and rng.random() < 0.5:
            seq.append(pending.pop(rng.randrange(len(pending))))
    rng.shuffle(pending)
    seq += pending
    return prof, cm, Schedule(buckets, tuple(seq), compressed=flags), (comp if flags else None)


def assert_same_as_simulate(prof, cm, sched, comp, channels):
    ref = simulate(prof, cm, sched, compression=comp, channels=channels)
    r = simulate_contended(prof, cm, sched, Contention.none(), compression=comp, channels=channels)
    assert abs(r.iteration_s - ref.iteration_s) <= 1e-12 * max(1.0, ref.iteration_s), (r.iteration_s, ref.iteration_s)
    assert r.exposed_comm_s == pytest.approx(ref.exposed_comm_s, rel=1e-9, abs=1e-9)
    assert r.compute_busy_s == pytest.approx(ref.compute_s, rel=1e-9, abs=1e-9)
    assert [(o.op, o.channel) for o in r.ops] == [(o.op, o.channel) for o in ref.ops]
    for a, b in zip(r.ops, ref.ops):
        assert (a.start, a.end) == pytest.approx((b.start, b.end), rel=1e-9, abs=1e-9)
    assert [(c.kind, c.bucket, c.layers) for c in r.compute] == [(c.kind, c.bucket, c.layers) for c in ref.compute]
    for a, b in zip(r.compute, ref.compute):
        assert (a.start, a.end) == pytest.approx((b.start, b.end), rel=1e-9, abs=1e-9)
    assert [(h.bucket, round(h.start, 9), round(h.end, 9)) for h in r.helper] == \
        [(h.bucket, round(h.start, 9), round(h.end, 9)) for h in ref.helper]
    assert r.bounds == ref.bounds
    return ref


def test_no_contention_equals_simulate_on_random_instances():
    rng = random.Random(7)
    for _ in range(400):
        prof, cm, sched, comp = random_instance(rng)
        assert_same_as_simulate(prof, cm, sched, comp, rng.choice([1, 2]))


@pytest.mark.parametrize("model", ["resnet50", "vgg16", "densenet201", "bert_base", "gpt2"])
def test_no_contention_equals_simulate_on_shared_profiles(model):
    prof = load_profile(model)
    fp16 = CompressionCost(1e-4, 0.25e-9, payload_ratio=0.5, method="fp16")
    for ws, beta in ((2, 1.0), (8, 30.0)):
        cm = CostModel.from_reference(SHARED / "alpha_beta.json", ws).scaled(beta_factor=beta)
        for name in ("wfbp", "dear", "pipedap"):
            for channels in (1, 2):
                assert_same_as_simulate(prof, cm, get_planner(name)(prof, cm, ws, channels=channels), None, channels)
            s = get_planner(name)(prof, cm, ws, compression=fp16)
            assert s.num_compressed > 0
            assert_same_as_simulate(prof, cm, s, fp16, 1)
    s = get_planner("optimal")(prof, cm, 8)
    ref = assert_same_as_simulate(prof, cm, s, None, 1)
    assert ref.iteration_s == pytest.approx(s.predicted_iteration_s, rel=1e-12)


def test_contention_never_speeds_up_and_keeps_the_timeline_consistent():
    rng = random.Random(8)
    for _ in range(300):
        prof, cm, sched, comp = random_instance(rng)
        channels = rng.choice([1, 2])
        c = Contention(rng.choice([0.0, rng.uniform(0, 2)]), rng.choice([0.0, rng.uniform(0, 2)]),
                       rng.choice([0.0, rng.uniform(0, 0.3)]))
        ref = simulate(prof, cm, sched, compression=comp, channels=channels)
        r = simulate_contended(prof, cm, sched, c, compression=comp, channels=channels)
        assert r.iteration_s >= ref.iteration_s * (1 - 1e-12) - 1e-12
        assert r.compute_busy_s >= r.compute_s * (1 - 1e-12) - 1e-12
        assert r.iteration_s == pytest.approx(r.compute_busy_s + r.exposed_comm_s, rel=1e-9, abs=1e-12)
        # compute intervals tile [0, P]; every op ends by the time its bucket's forward starts (+ P)
        assert r.compute[0].start == 0.0 and r.compute[-1].end == pytest.approx(r.iteration_s, abs=1e-12)
        for a, b in zip(r.compute, r.compute[1:]):
            assert b.start == pytest.approx(a.end, abs=1e-12)
        first_fwd = {}
        for iv in r.compute:
            if iv.kind == "forward":
                first_fwd.setdefault(iv.bucket, iv.start)
        for o in r.ops:
            if o.op.kind is AG and sched.is_compressed(o.op.bucket):
                continue  # a no-op, placed at its channel's free time as in simulate()
            assert o.end <= first_fwd[o.op.bucket] + r.iteration_s + 1e-9
            assert o.end - o.start >= -1e-12
        # the simulated records keep the measured-timeline identities
        recs = to_op_records(r, 2)
        busy = sum(x.end_s - x.start_s for x in recs if x.lane == "compute" and x.kind != "wait")
        assert busy == pytest.approx(2 * r.compute_busy_s, rel=1e-9, abs=1e-9)


def test_simulate_contended_rejects_bad_input():
    prof, cm, s = one_layer()
    with pytest.raises(TypeError, match="contention must be a Contention, got dict"):
        simulate_contended(prof, cm, s, {"comm_slowdown": 1})
    with pytest.raises(ValueError, match="channels must be 1 or 2, got 3"):
        simulate_contended(prof, cm, s, Contention.none(), channels=3)
    with pytest.raises(ValueError, match="no compression cost was given"):
        simulate_contended(prof, cm, Schedule(((0,),), ops("AR0"), compressed=(True,)), Contention.none())


# ------------------------------------------------------------------------------ the fit
def pair_by_simulation(C: float, M: float, c: Contention) -> tuple[float, float]:
    """The micro-benchmark run through simulate_contended: layer 1 (no backward time, M s of AR) and
    layer 0 (C s of backward, a free AR) start together at the backward start."""
    prof = ModelProfile("mb", (LayerProfile("load", 0, 0.0, C), LayerProfile("msg", 1000, 0.0, 0.0)))
    cm = CostModel.from_allreduce(0.0, M / 1000)
    r = simulate_contended(prof, cm, Schedule(((0,), (1,)), ops("AR1 AR0")), c)
    start = [iv for iv in r.compute if iv.kind == "backward"][0].start
    load_end = [iv for iv in r.compute if iv.kind == "backward" and iv.layers == (0,)][0].end
    return load_end - start, r.ops[0].end - start


def test_contended_pair_by_hand():
    # C = 2, M = 1, σ_m = 1, σ_c = 0.5: comm ends first at 2; compute did 2/1.5 by then, rest alone
    assert contended_pair(2.0, 1.0, Contention(1.0, 0.5)) == pytest.approx((2.0 + 2.0 - 2.0 / 1.5, 2.0))
    # C = 1, M = 2, σ_c = 1, σ_m = 0.5, δ = 0.25: compute ends first at 2; comm did 2/1.5 of 2.25
    assert contended_pair(1.0, 2.0, Contention(0.5, 1.0, 0.25)) == pytest.approx((2.0, 2.0 + 2.25 - 2.0 / 1.5))


def test_fit_recovers_the_simulators_contention():
    rng = random.Random(9)
    cases = {"comm_first": 0, "compute_first": 0}
    for _ in range(200):
        C, M = rng.uniform(0.05, 2.0), rng.uniform(0.05, 2.0)
        truth = Contention(rng.uniform(0, 2), rng.uniform(0, 2), rng.choice([0.0, rng.uniform(0, 0.2)]))
        Tc, Tm = pair_by_simulation(C, M, truth)
        assert (Tc, Tm) == pytest.approx(contended_pair(C, M, truth), rel=1e-12, abs=1e-12)
        fit = fit_contention(C, M, Tc, Tm, op_overhead_s=truth.op_overhead_s)
        assert fit.comm_slowdown == pytest.approx(truth.comm_slowdown, abs=1e-9)
        assert fit.compute_slowdown == pytest.approx(truth.compute_slowdown, abs=1e-9)
        assert fit.op_overhead_s == truth.op_overhead_s and fit.meta["clamped"] == []
        assert fit.meta["loaded_comm_s"] == Tm and fit.meta["alone_compute_s"] == C
        cases[fit.meta["case"]] += 1
    assert min(cases.values()) > 30, cases  # both branches of the inversion are exercised


def test_fit_by_hand_and_clamping():
    # comm first: T_m = 1.3 = 1.0 (1 + σ_m) -> σ_m = 0.3; T_c = 2.2 = 1.3 + 2 - 1.3/(1+σ_c) -> σ_c = 0.2/1.1
    f = fit_contention(2.0, 1.0, 2.2, 1.3)
    assert f.meta["case"] == "comm_first"
    assert f.comm_slowdown == pytest.approx(0.3) and f.compute_slowdown == pytest.approx(0.2 / 1.1)
    # noise: both faster loaded than alone -> 0
    f = fit_contention(2.0, 1.0, 1.9, 0.9)
    assert (f.comm_slowdown, f.compute_slowdown) == (0.0, 0.0)
    assert f.meta["clamped"] == ["comm_slowdown", "compute_slowdown"]
    # compute stalled completely while comm ran (T_c >= C + T_m): unbounded -> max_slowdown
    f = fit_contention(1.0, 1.0, 2.5, 1.5, max_slowdown=50.0)
    assert f.compute_slowdown == 50.0 and f.comm_slowdown == pytest.approx(0.5)
    with pytest.raises(ValueError, match="loaded_comm_s must be a finite number of seconds > 0, got 0"):
        fit_contention(1.0, 1.0, 1.0, 0)
    with pytest.raises(ValueError, match="alone_compute_s must be a finite number of seconds > 0, got nan"):
        fit_contention(math.nan, 1.0, 1.0, 1.0)


# ------------------------------------------------------------------------------ the live micro-benchmark
def _measure(rank: int, world: int, with_step: bool = True):
    import torch

    from lightning_pipedap.engine import collectives as C
    from lightning_pipedap.probe.slowdown import measure_contention

    comm = C.new_comm_group(timeout_s=30)
    try:
        c = measure_contention(comm, torch.device("cpu"), nbytes=1 << 20, repeats=2, timeout_s=30,
                               with_step=with_step)
    finally:
        C.destroy_comm_group(comm)
    return c.to_dict()


@pytest.mark.multiprocess
@pytest.mark.parametrize("with_step", [True, False])
def test_measure_contention_on_two_gloo_ranks(with_step):
    from tests._dist_util import run_ranks

    res = run_ranks(_measure, 2, with_step, timeout_s=60)
    assert res[0] == res[1]  # every rank fits the same gathered times
    d = res[0]
    c = Contention.from_dict(d)
    for v in (c.comm_slowdown, c.compute_slowdown, c.op_overhead_s):
        assert math.isfinite(v) and v >= 0
    m = c.meta
    for key in ("alone_compute_s", "alone_comm_s", "loaded_compute_s", "loaded_comm_s"):
        assert math.isfinite(m[key]) and m[key] > 0
    assert len(m["per_rank"]) == 2 and m["nbytes"] == 1 << 20 and m["repeats"] == 2
    for raw in m["per_rank"]:
        for key in ("compute_alone_s", "comm_alone_s", "compute_loaded_s", "comm_loaded_s"):
            assert len(raw[key]) == 2 and all(x > 0 for x in raw[key])
    assert m["matmuls"] >= 1 and m["case"] in ("comm_first", "compute_first")
    if with_step:  # phase (d): the optimizer step's fit
        assert m["step"]["steps"] >= 1 and c.step_slowdown >= 0 and c.compute_slowdown_step >= 0
        assert all(len(raw["step_alone_s"]) == 2 for raw in m["per_rank"])
    else:  # not a sharded run: phase (d) is skipped, its slowdowns are 0
        assert m["step"] is None and c.step_slowdown == 0.0 and c.compute_slowdown_step == 0.0
        assert all("step_alone_s" not in raw for raw in m["per_rank"])


def test_the_contention_log_line_shows_measured_times_and_names_capped_values():
    from lightning_pipedap.strategy.planning import describe_contention

    line = describe_contention(fit_contention(0.1, 0.05, 0.12, 0.07))
    assert line == ("pipedap: contention while communication and compute overlap: communication +40%, compute +40% "
                    "(alone: communication 50.0 ms, compute 100.0 ms; together: 70.0 ms and 120.0 ms)")
    # noise (loaded faster than alone) -> 0, said as such; no progress -> the cap, said as such, never as "100.00"
    assert "communication not measurably slowed" in describe_contention(fit_contention(0.1, 0.05, 0.09, 0.049))
    # the sharded step's pair (phase d): a capped value is named as the cap, not shown as "+10000%"
    import dataclasses

    step = fit_contention(0.1, 0.05, 2.5, 1.5, max_slowdown=100.0)
    c = dataclasses.replace(fit_contention(0.1, 0.05, 0.12, 0.07), step_slowdown=step.comm_slowdown,
                            compute_slowdown_step=step.compute_slowdown, meta={"step": step.meta})
    line = describe_contention(c)
    assert "compute beside it stalled while the other ran (the model uses its cap, 100)" in line, line
    assert "+10000%" not in line
    capped = describe_contention(fit_contention(0.1, 0.05, 0.2, 0.25))
    assert "communication stalled while the other ran (the model uses its cap, 100)" in capped
    assert "compute +100%" in capped
