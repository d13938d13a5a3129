"""Timeline simulator: hand-computed timelines, steady state, lower bounds."""

from __future__ import annotations

import random

import pytest

from lightning_pipedap.plan.bounds import lower_bounds
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.evaluator import Evaluator
from lightning_pipedap.plan.profile import LayerProfile, ModelProfile
from lightning_pipedap.plan.simulator import simulate
from lightning_pipedap.schedule import Op, OpKind, Schedule

RS, AG, AR = OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.ALL_REDUCE


def ops(text: str) -> tuple[Op, ...]:
    """'RS1 AG1 AR0' -> ops."""
    kinds = {"RS": RS, "AG": AG, "AR": AR}
    return tuple(Op(kinds[t[:2]], int(t[2:])) for t in text.split())


def case_a() -> tuple[ModelProfile, CostModel]:
    # 2 layers of 100 bytes; AR(100) = 0.5 + 0.01 * 100 = 1.5 s, RS = AG = 0.75 s
    prof = ModelProfile("a", (LayerProfile("l0", 100, 1.0, 2.0), LayerProfile("l1", 100, 1.0, 1.0)))
    return prof, CostModel.from_allreduce(0.5, 0.01)


def case_b() -> tuple[ModelProfile, CostModel]:
    # 3 layers; buckets (0,) and (1, 2) hold 200 bytes each: AR = 1 + 0.005 * 200 = 2 s, RS = AG = 1 s;
    # update 0.4 s split by bytes: 0.2 s per bucket
    prof = ModelProfile("b", (LayerProfile("l0", 200, 0.5, 1.0), LayerProfile("l1", 0, 1.0, 1.0),
                              LayerProfile("l2", 200, 1.0, 2.0)), t_update=0.4)
    return prof, CostModel.from_allreduce(1.0, 0.005)


def test_wfbp_two_buckets_by_hand():
    prof, cm = case_a()
    r = simulate(prof, cm, Schedule(((0,), (1,)), ops("AR1 AR0")))
    # backward l1 [0,1], l0 [1,3]; AR1 [1,2.5], AR0 [3,4.5]; forward waits until 4.5: 4.5+1+1 = 6.5
    assert r.iteration_s == pytest.approx(6.5)
    assert r.compute_s == pytest.approx(5.0)
    assert r.exposed_comm_s == pytest.approx(1.5)
    # iteration-origin frame: shift by P - Σt_b = 3.5
    assert [(str(t.op), t.start, t.end) for t in r.ops] == [("AR1", pytest.approx(4.5), pytest.approx(6.0)),
                                                          ("AR0", pytest.approx(6.5), pytest.approx(8.0))]
    kinds = [(c.kind, round(c.start, 9), round(c.end, 9)) for c in r.compute]
    assert kinds == [("wait", 0.0, 1.5), ("forward", 1.5, 2.5), ("forward", 2.5, 3.5),
                     ("backward", 3.5, 4.5), ("backward", 4.5, 6.5)]
    assert r.comm_busy_s == pytest.approx(3.0)


def test_dear_with_update_by_hand():
    prof, cm = case_b()
    r = simulate(prof, cm, Schedule(((0,), (1, 2)), ops("RS1 RS0 AG0 AG1")))
    # ready(b1) = t_b(l2)+t_b(l1) = 3, ready(b0) = 4 = Σt_b.  RS1 [3,4] RS0 [4,5] AG0 [5,6] AG1 [6,7]
    # forward: wait b0 -> 6, update 0.2, l0 0.5 -> 6.7; wait b1 -> 7, update 0.2, l1+l2 2.0 -> 9.2
    assert r.iteration_s == pytest.approx(9.2)
    assert r.compute_s == pytest.approx(6.9)
    assert r.exposed_comm_s == pytest.approx(2.3)
    assert [(str(t.op), t.start) for t in r.ops] == [("RS1", pytest.approx(8.2)), ("RS0", pytest.approx(9.2)),
                                                   ("AG0", pytest.approx(10.2)), ("AG1", pytest.approx(11.2))]
    waits = [(c.bucket, round(c.start, 9), round(c.end, 9)) for c in r.compute if c.kind == "wait"]
    assert waits == [(0, 0.0, 2.0), (1, 2.7, 3.0)]
    assert sum(c.end - c.start for c in r.compute if c.kind == "wait") == pytest.approx(r.exposed_comm_s)
    fwd = [c.layers for c in r.compute if c.kind == "forward"]
    assert fwd == [(0,), (1, 2)]


@pytest.mark.parametrize("order, channels, expected", [
    ("RS1 RS0 AG0 AG1", 1, 9.2),
    ("RS1 AG1 RS0 AG0", 1, 9.9),   # AG1 early delays RS0: b0 done at 7 -> 7.7 -> 9.9
    ("AR1 AR0", 1, 9.9),
    ("RS1 RS0 AG1 AG0", 1, 9.9),   # AG0 last: b0 done at 7
    ("RS1 RS0 AG1 AG0", 2, 8.9),   # AG1 on channel 1 at [4,5], AG0 [5,6]: 6+0.2+0.5, then 6.7+0.2+2
    ("RS1 RS0 AG0 AG1", 2, 9.2),   # AG0 [5,6], AG1 [6,7] (list order on channel 1)
])
def test_op_order_and_channels_by_hand(order, channels, expected):
    prof, cm = case_b()
    r = simulate(prof, cm, Schedule(((0,), (1, 2)), ops(order)), channels=channels)
    assert r.iteration_s == pytest.approx(expected)


def test_non_contiguous_bucket_waits_at_first_use():
    prof, cm = case_b()
    # bucket 0 = layers 0 and 2 (400 B: AR 3 s, update 0.4 s), bucket 1 = layer 1 (0 B: AR 1 s, update 0)
    r = simulate(prof, cm, Schedule(((0, 2), (1,)), ops("AR1 AR0")))
    # ready(b0) = 4, ready(b1) = 3; AR1 [3,4], AR0 [4,7]; fwd: 7 + 0.4 + 0.5 -> 7.9, l1 -> 8.9, l2 -> 9.9
    assert r.iteration_s == pytest.approx(9.9)


def test_lower_bounds_by_hand():
    prof, cm = case_b()
    lb = lower_bounds(prof, cm)
    # min_reduce(bytes): cumulative 200, 200, 400 -> 2, 2, 3; tails Σ_{k>=j}(t_f+t_b) = 6.5, 5, 3
    assert lb.compute_s == pytest.approx(6.9)
    assert lb.comm_s == pytest.approx(3.0)
    assert lb.sum_bound_s == pytest.approx(6.9)
    assert lb.window_s == pytest.approx(8.5) and lb.window_layer == 0
    assert lb.best_s == pytest.approx(8.5)
    # for the DeAR schedule: per-bucket comm 2 and 2; window j=1: 5 + 4 = 9
    lbs = lower_bounds(prof, cm, Schedule(((0,), (1, 2)), ops("RS1 RS0 AG0 AG1")))
    assert lbs.window_s == pytest.approx(9.0) and lbs.window_layer == 1
    assert lbs.comm_s == pytest.approx(4.0)
    assert lower_bounds(prof, cm, channels=2).comm_s == pytest.approx(1.5)


def test_invalid_schedules_are_rejected():
    prof, cm = case_b()
    with pytest.raises(ValueError, match="AG0 is not valid after nothing"):
        simulate(prof, cm, Schedule(((0,), (1, 2)), ops("AG0 RS0 AR1")))
    with pytest.raises(ValueError, match="partition"):
        simulate(prof, cm, Schedule(((0,), (1,)), ops("AR0 AR1")))
    with pytest.raises(ValueError, match="channels must be 1 or 2"):
        simulate(prof, cm, Schedule(((0, 1, 2),), ops("AR0")), channels=3)


def _naive_iterations(prof, cm, sched, channels, iters):
    """Independent event simulation of ``iters`` consecutive iterations from a cold start.

    Channel state carries over between iterations (nothing is reset); returns the start time of
    each iteration's backward pass.
    """
    L = prof.num_layers
    bucket_of = {i: b for b, bk in enumerate(sched.buckets) for i in bk}
    nbytes = [sum(prof.layers[i].nbytes for i in bk) for bk in sched.buckets]
    total = sum(nbytes)
    upd = [prof.t_update * n / total for n in nbytes]
    done = [0.0] * len(sched.buckets)
    free = [0.0, 0.0]
    t = 0.0
    bwd_starts = []
    for _ in range(iters):
        applied = set()
        for i in range(L):  # forward
            b = bucket_of[i]
            if b not in applied:
                applied.add(b)
                t = max(t, done[b]) + upd[b]
            t += prof.layers[i].t_f
        bwd_starts.append(t)
        end_of = {}
        for i in reversed(range(L)):  # backward
            t += prof.layers[i].t_b
            end_of[i] = t
        ready = [max(end_of[i] for i in bk) for bk in sched.buckets]
        rs_end = {}
        for op in sched.ops:
            ch = 1 if (channels == 2 and op.kind is AG) else 0
            n = nbytes[op.bucket]
            dep = rs_end[op.bucket] if op.kind is AG else ready[op.bucket]
            s = max(free[ch], dep)
            free[ch] = s + cm.cost(op.kind, n)
            if op.kind is RS:
                rs_end[op.bucket] = free[ch]
            else:
                done[op.bucket] = free[ch]
    return bwd_starts


def _random_schedule(rng, L):
    cuts = sorted(rng.sample(range(1, L), rng.randint(0, L - 1))) if L > 1 else []
    bounds = [0] + cuts + [L]
    buckets = tuple(tuple(range(a, b)) for a, b in zip(bounds, bounds[1:]))
    pending, out = list(range(len(buckets))), []
    rs_done = []
    while pending or rs_done:
        choices = [("x", b) for b in pending] + [("ag", b) for b in rs_done]
        what, b = rng.choice(choices)
        if what == "ag":
            rs_done.remove(b)
            out.append(Op(AG, b))
        elif rng.random() < 0.5:
            pending.remove(b)
            out.append(Op(AR, b))
        else:
            pending.remove(b)
            rs_done.append(b)
            out.append(Op(RS, b))
    return Schedule(buckets, tuple(out))


def test_steady_state_matches_multi_iteration_event_simulation():
    rng = random.Random(3)
    for _ in range(60):
        L = rng.randint(1, 7)
        prof = ModelProfile("r", tuple(LayerProfile(f"l{i}", rng.randint(1, 5000), rng.uniform(0, 1), rng.uniform(0, 1))
                                       for i in range(L)), t_update=rng.choice([0.0, 0.3]))
        cm = CostModel.from_allreduce(rng.uniform(0, 0.5), rng.uniform(0, 1e-3), startup_sharing=rng.random())
        sched = _random_schedule(rng, L)
        channels = rng.choice([1, 2])
        starts = _naive_iterations(prof, cm, sched, channels, 5)
        r = simulate(prof, cm, sched, channels=channels)
        # every period after the first iteration equals the directly computed steady state
        for k in (2, 3, 4):
            assert starts[k] - starts[k - 1] == pytest.approx(r.iteration_s, rel=1e-12, abs=1e-12)
        assert r.iteration_s >= lower_bounds(prof, cm, channels=channels).best_s * (1 - 1e-12)
        assert r.iteration_s >= r.bounds.best_s * (1 - 1e-12)
        assert Evaluator(prof, cm, sched.buckets, channels).period(sched.ops) == pytest.approx(r.iteration_s, rel=1e-12)


def test_windows_repeat_with_the_period():
    prof, cm = case_b()
    r = simulate(prof, cm, Schedule(((0,), (1, 2)), ops("RS1 RS0 AG0 AG1")))
    w = r.op_window(2)
    # window [0, 18.4]: previous iteration's RS0 [0, 1], AG0, AG1; this one's 4 ops; the next one's RS1
    # starts at 8.2 + 9.2 = 17.4
    assert [str(t.op) for t in w] == ["RS0", "AG0", "AG1", "RS1", "RS0", "AG0", "AG1", "RS1"]
    assert (w[0].start, w[0].end) == (pytest.approx(0.0), pytest.approx(1.0))
    assert w[-1].start == pytest.approx(17.4)
    assert len(r.compute_window(2)) == 2 * len(r.compute)
