"""Compression-aware planning: the CompressionCost model, the simulator with compressed buckets, the
lower bounds with compression, schedules with flags, and the planners' per-bucket choice."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from lightning_pipedap.plan.bounds import lower_bounds
from lightning_pipedap.plan.compression import CompressionCost, fit_compression_cost
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.evaluator import Evaluator
from lightning_pipedap.plan.planners import get_planner
from lightning_pipedap.plan.profile import LayerProfile, ModelProfile
from lightning_pipedap.plan.simulator import simulate, to_op_records
from lightning_pipedap.schedule import Op, OpKind, Schedule, builtin_schedule, expand_layers

RS, AG, AR = OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.ALL_REDUCE


def ops(text: str) -> tuple[Op, ...]:
    kinds = {"RS": RS, "AG": AG, "AR": AR}
    return tuple(Op(kinds[t[:2]], int(t[2:])) for t in text.split())


# ------------------------------------------------------------------------------ CompressionCost
def test_cost_terms_by_hand():
    cm = CostModel.from_allreduce(0.5, 0.01)  # AR(n) = 0.5 + 0.01 n; AG(n) = 0.25 + 0.005 n
    c = CompressionCost(alpha_c_s=0.1, beta_c_s_per_byte=0.001, payload_ratio=0.5, payload_const_bytes=4,
                        rounds=2, post_share=0.25)
    # T_c(100) = 0.2; pre 0.15, post 0.05; payload 54; AR x2: 2*0.5 + 0.01*54 = 1.54
    assert c.compress_s(100) == pytest.approx(0.2)
    assert (c.pre_s(100), c.post_s(100), c.helper_s(100)) == pytest.approx((0.15, 0.05, 0.15))
    assert c.payload_bytes(100) == pytest.approx(54)
    assert c.collective_s(cm, 54) == pytest.approx(1.54)
    assert c.channel_s(cm, 100) == pytest.approx(1.54 + 0.05)
    inline = CompressionCost(0.1, 0.001, payload_ratio=0.5, payload_const_bytes=4, rounds=2, post_share=0.25,
                             where="inline", extra_allreduces=1)
    assert inline.helper_s(100) == 0.0
    assert inline.channel_s(cm, 100) == pytest.approx(0.2 + 1.54 + 0.5)
    # all-gather of N = 4 payloads of 54 bytes: AG(216) = 0.25 + 0.005 * 216
    ag = CompressionCost(0.0, 0.0, payload_ratio=0.5, payload_const_bytes=4, collective="AG")
    assert ag.channel_s(cm, 100, world_size=4) == pytest.approx(0.25 + 0.005 * 216)
    A, cd, cp = ag.channel_terms(cm, 4)
    assert (A, cd, cp) == pytest.approx((0.25 + 0.02 * 4, 0.0, 0.02))
    with pytest.raises(ValueError, match="world size"):
        ag.channel_s(cm, 100)
    per_layer = CompressionCost(0.0, 0.0, layer_payload_bytes=(10, 20, 30), payload_const_bytes=1)
    assert per_layer.payload_bytes(999, (0, 2)) == pytest.approx(41)
    with pytest.raises(ValueError, match="pass the bucket's layers"):
        per_layer.payload_bytes(10)
    with pytest.raises(ValueError, match="2 layers"):
        per_layer.check_layers(2)


@pytest.mark.parametrize("kw, match", [
    ({"collective": "RS"}, "collective must be one of"),
    ({"where": "gpu"}, "where must be one of"),
    ({"rounds": 0}, "rounds must be an int >= 1"),
    ({"rounds": 2, "collective": "AG"}, "needs collective='AR'"),
    ({"post_share": 1.5}, r"post_share must be in \[0, 1\]"),
    ({"alpha_c_s": -1.0}, "alpha_c_s must be a finite number >= 0"),
    ({"payload_ratio": math.nan}, "payload_ratio must be a finite number >= 0"),
    ({"layer_payload_bytes": (1.0, -2.0)}, r"layer_payload_bytes\[1\]"),
    ({"extra_allreduces": -1}, "extra_allreduces must be an int >= 0"),
])
def test_cost_validation_names_the_bad_value(kw, match):
    args = {"alpha_c_s": 0.0, "beta_c_s_per_byte": 0.0, **kw}
    with pytest.raises(ValueError, match=match):
        CompressionCost(**args)


def test_cost_dict_round_trip_and_fit():
    c = CompressionCost(1e-4, 2e-9, payload_ratio=0.25, payload_const_bytes=8, layer_payload_bytes=(1.0, 2.0),
                        collective="AR", rounds=2, where="inline", post_share=0.4, extra_allreduces=1,
                        method="powersgd", meta={"r2": 0.9})
    back = CompressionCost.from_dict(c.to_dict())
    assert back == c and back.meta == {"r2": 0.9}
    with pytest.raises(ValueError, match="not a compression cost"):
        CompressionCost.from_dict({"format": "x"})
    # exact line: total = 0.002 + 1e-6 * n, a quarter of it after the collective
    samples = [(n, 0.75 * (0.002 + 1e-6 * n), 0.25 * (0.002 + 1e-6 * n)) for n in (1000, 4000, 16000)]
    fit = fit_compression_cost(samples, payload_ratio=0.5, method="fp16")
    assert (fit.alpha_c_s, fit.beta_c_s_per_byte, fit.post_share) == pytest.approx((0.002, 1e-6, 0.25))
    assert fit.meta["r2"] == pytest.approx(1.0) and fit.payload_ratio == 0.5
    with pytest.raises(ValueError, match="distinct"):
        fit_compression_cost([(10, 1.0, 0.0), (10, 2.0, 0.0)])


# ------------------------------------------------------------------------------ schedule flags
def test_schedule_flags_validate_describe_expand():
    s = Schedule(((0,), (1, 2)), ops("AR1 RS0 AG0"), "x", compressed=(True, False))
    assert s.describe() == "x: 2 buckets (1 compressed): AR1 CRS0 CAG0"
    assert s.num_compressed == 1 and s.is_compressed(0) and not s.is_compressed(1)
    assert Schedule(((0,),), ops("AR0")).describe() == "custom: 1 buckets: AR0"
    with pytest.raises(ValueError, match="2 flags for 1 buckets"):
        Schedule(((0,),), ops("AR0"), compressed=(True, False)).validate()
    with pytest.raises(ValueError, match="must be bools"):
        Schedule(((0,),), ops("AR0"), compressed=(1,)).validate()
    # layer 0 = params (0, 1) of two dtypes: the compressed bucket splits into two compressed buckets
    layers = [[0, 1], [2]]
    e = expand_layers(Schedule(((0,), (1,)), ops("AR1 AR0"), "p", 1.0, (True, False)), layers,
                      keys=["a", "b", "a"])
    assert e.buckets == ((0,), (1,), (2,)) and e.compressed == (True, True, False)
    assert expand_layers(Schedule(((0, 1),), ops("AR0")), layers).compressed is None
    fixed = builtin_schedule("dear", [4, 4, 4], 8, compress_all=True)
    assert fixed.compressed == (True, True)
    assert builtin_schedule("dear", [4, 4, 4], 8).compressed is None


# ------------------------------------------------------------------------------ simulator
def case_c() -> tuple[ModelProfile, CostModel, CompressionCost]:
    # two layers of 100 bytes; backward of l1 [0,1], of l0 [1,1.5]; AR(100) = 1.5 s.
    # compression: T_c(100) = 0.2 s, payload 50 bytes, AR(50) = 1.0 s
    prof = ModelProfile("c", (LayerProfile("l0", 100, 1.0, 0.5), LayerProfile("l1", 100, 1.0, 1.0)))
    return prof, CostModel.from_allreduce(0.5, 0.01), CompressionCost(0.1, 0.001, payload_ratio=0.5)


@pytest.mark.parametrize("flags, where, order, expected", [
    ((False, False), "helper", "AR1 AR0", 6.0),         # AR1 [1,2.5], AR0 [2.5,4]; 4 + 2 forward
    ((True, True), "helper", "AR1 AR0", 5.2),           # helper C1 [1,1.2], C0 [1.5,1.7]; AR1 [1.2,2.2], AR0 [2.2,3.2]
    ((True, True), "helper", "RS1 RS0 AG0 AG1", 5.2),   # the RS slot reduces a compressed bucket; AGs do nothing
    ((True, True), "inline", "AR1 AR0", 5.4),           # on the channel: AR1 [1,2.2], AR0 [2.2,3.4]
    ((False, True), "helper", "AR1 AR0", 5.7),          # AR1 [1.2,2.2], dense AR0 [2.2,3.7]
    ((True, False), "helper", "AR1 AR0", 5.5),          # dense AR1 [1,2.5], helper C0 [1.5,1.7], AR0 [2.5,3.5]
])
def test_compressed_buckets_by_hand(flags, where, order, expected):
    prof, cm, comp = case_c()
    comp = CompressionCost(comp.alpha_c_s, comp.beta_c_s_per_byte, payload_ratio=0.5, where=where)
    r = simulate(prof, cm, Schedule(((0,), (1,)), ops(order), compressed=flags), compression=comp)
    assert r.iteration_s == pytest.approx(expected)
    assert r.iteration_s >= r.bounds.best_s - 1e-12
    assert r.exposed_comm_s == pytest.approx(expected - 3.5)


def test_helper_lane_timeline_and_records():
    prof, cm, comp = case_c()
    r = simulate(prof, cm, Schedule(((0,), (1,)), ops("AR1 AR0"), compressed=(True, True)), compression=comp)
    # iteration-origin frame: shift = P - Σt_b = 5.2 - 1.5 = 3.7
    assert [(c.kind, c.bucket, c.start, c.end) for c in r.helper] == [
        ("compress", 1, pytest.approx(4.7), pytest.approx(4.9)),
        ("compress", 0, pytest.approx(5.2), pytest.approx(5.4))]
    assert [(str(t.op), t.start, t.end) for t in r.ops] == [("AR1", pytest.approx(4.9), pytest.approx(5.9)),
                                                          ("AR0", pytest.approx(5.9), pytest.approx(6.9))]
    recs = [x for x in to_op_records(r, 1) if x.lane == "compress"]
    # the previous iteration's C0 ([-0.0, 0.2] after shifting by -P) overlaps this one
    assert [(x.name, round(x.start_s, 9)) for x in recs] == [("C0", 0.0), ("C1", 4.7), ("C0", 5.2)]
    # the comm-only bound of this schedule uses the compressed channel time (1.0 s per bucket)
    assert r.bounds.comm_s == pytest.approx(2.0)
    assert r.bounds.window_s == pytest.approx(4.5)  # j=0: (1+0.5)+(1+1) + 1.0


def test_evaluator_rejects_bad_flags():
    prof, cm, comp = case_c()
    with pytest.raises(ValueError, match="3 flags for 2 buckets"):
        Evaluator(prof, cm, ((0,), (1,)), compressed=(True, True, False), compression=comp)
    with pytest.raises(ValueError, match="no compression cost was given"):
        Evaluator(prof, cm, ((0,), (1,)), compressed=(True, False))
    with pytest.raises(ValueError, match="no compression cost was given"):
        simulate(prof, cm, Schedule(((0,), (1,)), ops("AR1 AR0"), compressed=(True, False)))


def test_least_comm_bound_with_compression_by_hand():
    prof, cm, comp = case_c()
    # per layer w = 0.01 * 50 = 0.5, A = 0.5: prefix 0 -> min(g(100) 1.5, f 1.0) = 1.0; prefix 1 -> min(2.5, 1.5)
    lb = lower_bounds(prof, cm, compression=comp)
    assert lb.comm_s == pytest.approx(1.5)
    assert lb.window_s == pytest.approx(4.5)   # j=0: 3.5 + 1.0
    assert lower_bounds(prof, cm).window_s == pytest.approx(5.0)  # dense: 3.5 + 1.5


def random_instance(rng: random.Random, L: int) -> tuple[ModelProfile, CostModel, CompressionCost]:
    layers = tuple(LayerProfile(f"l{i}", rng.choice([0, 1, 10, 100, 1000, 5000]), rng.uniform(0, 2),
                                rng.uniform(0, 2)) for i in range(L))
    prof = ModelProfile("r", layers, t_update=rng.uniform(0, 0.5))
    cm = CostModel.from_allreduce(rng.uniform(0, 1), rng.uniform(0, 2e-3), startup_sharing=rng.uniform(0, 1),
                                  meta={"world_size": 4})
    collective = rng.choice(["AR", "AG"])
    comp = CompressionCost(rng.uniform(0, 0.5), rng.uniform(0, 1e-3), payload_ratio=rng.uniform(0, 1),
                           payload_const_bytes=rng.choice([0, 16]), collective=collective,
                           rounds=rng.choice([1, 2]) if collective == "AR" else 1,
                           where=rng.choice(["helper", "inline"]), post_share=rng.uniform(0, 1),
                           extra_allreduces=rng.choice([0, 1]))
    return prof, cm, comp


def test_lower_bounds_hold_for_random_compressed_schedules():
    rng = random.Random(3)
    for _ in range(300):
        L = rng.randint(1, 6)
        prof, cm, comp = random_instance(rng, L)
        perm = list(range(L))
        rng.shuffle(perm)  # buckets need not be contiguous
        cuts = sorted(rng.sample(range(1, L), rng.randint(0, L - 1))) if L > 1 else []
        buckets = [tuple(perm[a:b]) for a, b in zip([0] + cuts, cuts + [L])]
        B = len(buckets)
        flags = tuple(rng.random() < 0.5 for _ in range(B))
        seq = []
        for b in rng.sample(range(B), B):
            seq += [Op(AR, b)] if flags[b] or rng.random() < 0.5 else [Op(RS, b), Op(AG, b)]
        sched = Schedule(tuple(buckets), tuple(seq), compressed=flags)
        r = simulate(prof, cm, sched, compression=comp, channels=rng.choice([1, 2]))
        every = lower_bounds(prof, cm, compression=comp, channels=r.channels)
        assert r.iteration_s >= r.bounds.best_s * (1 - 1e-9) - 1e-12
        assert r.iteration_s >= every.best_s * (1 - 1e-9) - 1e-12
        assert r.bounds.comm_s >= every.comm_s * (1 - 1e-9) - 1e-12


# ------------------------------------------------------------------------------ planners
def slow_link() -> tuple[ModelProfile, CostModel]:
    # 4 layers of 4 MB, 10 ms backward each; 1 Gbit/s-like link: AR = 1 ms + 8 ns/byte (32 ms per layer)
    prof = ModelProfile("s", tuple(LayerProfile(f"l{i}", 4_000_000, 0.005, 0.010) for i in range(4)))
    return prof, CostModel.from_allreduce(1e-3, 8e-9, meta={"world_size": 2})


def test_optimal_compresses_on_a_slow_link_with_cheap_compression():
    prof, cm = slow_link()
    fp16 = CompressionCost(1e-4, 0.25e-9, payload_ratio=0.5, method="fp16")  # 1 ms per 4 MB; halves the bytes
    dense = get_planner("optimal")(prof, cm, 2)
    s = get_planner("optimal")(prof, cm, 2, compression=fp16)
    assert s.num_compressed >= 1 and s.compressed is not None and len(s.compressed) == len(s.buckets)
    assert s.predicted_iteration_s < 0.8 * dense.predicted_iteration_s
    assert simulate(prof, cm, s, compression=fp16).iteration_s == pytest.approx(s.predicted_iteration_s)
    # compressed buckets have exactly one op, an AR
    for b in range(len(s.buckets)):
        kinds = [o.kind for o in s.ops if o.bucket == b]
        if s.is_compressed(b):
            assert kinds == [AR]
    lb = lower_bounds(prof, cm, compression=fp16)
    assert s.predicted_iteration_s >= lb.best_s - 1e-12


def test_optimal_does_not_compress_when_it_costs_more_than_it_saves():
    prof, cm = slow_link()
    # inline, 40 ns per byte on the channel, to save 4 ns per byte of all-reduce
    slow = CompressionCost(1e-3, 40e-9, payload_ratio=0.5, where="inline")
    dense = get_planner("optimal")(prof, cm, 2)
    s = get_planner("optimal")(prof, cm, 2, compression=slow)
    assert s.num_compressed == 0 and s.compressed == (False,) * len(s.buckets)
    assert s.predicted_iteration_s == pytest.approx(dense.predicted_iteration_s, rel=1e-12)
    # the fixed-idea planners compress every bucket and pay for it
    for name in ("wfbp", "dear", "pipedap", "no_overlap"):
        t = get_planner(name)(prof, cm, 2, compression=slow)
        assert t.compressed == (True,) * len(t.buckets)
        assert all(o.kind is AR for o in t.ops) and len(t.ops) == len(t.buckets)
        assert t.predicted_iteration_s > s.predicted_iteration_s


def _all_op_lists(flags: tuple[bool, ...]):
    """Every valid op list: per bucket AR (compressed: only AR) or RS ... AG, in every order."""
    B = len(flags)
    for modes in itertools.product(*[(AR,) if f else (AR, RS) for f in flags]):
        items = []
        for b, m in enumerate(modes):
            items += [Op(AR, b)] if m is AR else [Op(RS, b), Op(AG, b)]
        for perm in set(itertools.permutations(items)):
            if all(perm.index(Op(RS, b)) < perm.index(Op(AG, b)) for b in range(B) if modes[b] is RS):
                yield perm


def test_optimal_matches_brute_force_over_flags_and_orders():
    rng = random.Random(11)
    for _ in range(12):
        prof, cm, comp = random_instance(rng, 3)
        buckets = ((0,), (1,), (2,))
        best = math.inf
        for flags in itertools.product((False, True), repeat=3):
            ev = Evaluator(prof, cm, buckets, compressed=flags, compression=comp)
            best = min(best, min(ev.period(seq) for seq in _all_op_lists(flags)))
        s = get_planner("optimal")(prof, cm, 4, fusion="none", compression=comp)
        assert s.predicted_iteration_s <= best * (1 + 1e-9) + 1e-12
        assert s.predicted_iteration_s >= best * (1 - 1e-9) - 1e-12


@pytest.mark.parametrize("exact", [True, False])
def test_optimal_is_never_worse_than_any_alternative(exact):
    rng = random.Random(5)
    kw_exact = {} if exact else {"exact_max_layers": 0, "exact_compress_max_layers": 0}  # heuristics alone
    for _ in range(10):
        prof, cm, comp = random_instance(rng, rng.randint(2, 7))
        s = get_planner("optimal")(prof, cm, 4, compression=comp, **kw_exact)
        plans = [get_planner(n)(prof, cm, 4, **kw) for n in ("no_overlap", "wfbp", "dear", "pipedap")
                 for kw in ({}, {"compression": comp})]
        plans.append(get_planner("optimal")(prof, cm, 4, **kw_exact))  # the same search without compression
        alternatives = [(p.describe(), p.predicted_iteration_s) for p in plans]
        L = prof.num_layers
        for flag in (False, True):  # one bucket per layer, none or every bucket compressed, best op list
            ev = Evaluator(prof, cm, tuple((i,) for i in range(L)), compressed=(flag,) * L, compression=comp)
            alternatives.append(("all" if flag else "none", structured_period(ev)))
        for name, p in alternatives:
            assert s.predicted_iteration_s <= p * (1 + 1e-9) + 1e-12, (name, p, s.describe())
        assert simulate(prof, cm, s, compression=comp).iteration_s == pytest.approx(s.predicted_iteration_s)


def structured_period(ev: Evaluator) -> float:
    from lightning_pipedap.plan.planners.optimal import structured_best

    return structured_best(ev)[0]


def test_exposed_time_of_records_counts_the_helper_lane():
    from lightning_pipedap.measure.timeline import COMM_KINDS, COMPRESS_KINDS, exposed_communication_ms

    prof, cm, _ = case_c()
    slow = CompressionCost(1.0, 0.001, payload_ratio=0.5)  # T_c(100) = 1.1 s: the forward waits on the helper
    r = simulate(prof, cm, Schedule(((0,), (1,)), ops("AR1 AR0"), compressed=(True, True)), compression=slow)
    # helper C1 [1,2.1], C0 [2.1,3.2]; AR1 [2.1,3.1], AR0 [3.2,4.2]; forward 4.2 + 2 -> 6.2 s, 2.7 s exposed
    assert r.iteration_s == pytest.approx(6.2)
    recs = to_op_records(r, 3)
    window = (0.0, 3 * r.iteration_s)
    both = exposed_communication_ms(recs, comm_kinds=COMM_KINDS + COMPRESS_KINDS, window=window)
    assert both == pytest.approx(3 * 2.7e3)
    assert exposed_communication_ms(recs, window=window) < both  # the channel alone idles while C0 runs
