"""16-bit wire format in the plan: a wire16 bucket costs its RS/AG at half its bytes, and ``optimal``
sends 16-bit only the buckets where that shortens the predicted iteration."""

from __future__ import annotations

import pytest

from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.planners import get_planner
from lightning_pipedap.plan.profile import LayerProfile, ModelProfile
from lightning_pipedap.plan.simulator import simulate
from lightning_pipedap.schedule import Op, OpKind, Schedule

RS, AG, AR = OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.ALL_REDUCE
# 1 GB/s, no start-up: T_AR(n) = n ns, T_RS(n) = T_AG(n) = n/2 ns
CM = CostModel.from_allreduce(0.0, 1e-9)
# layer 0: 4 MB, t_f = t_b = 10 ms (its reduction starts when the backward ends: exposed);
# layer 1: 1 MB, t_f = t_b = 1 ms (reduced during layer 0's 10 ms backward: hidden)
PROF = ModelProfile("wire", (LayerProfile("l0", 4_000_000, 0.010, 0.010), LayerProfile("l1", 1_000_000, 0.001, 0.001)))


def test_simulator_costs_a_wire16_bucket_at_half_its_bytes():
    # backward 11 ms; bucket 0's AR starts at 11 ms: 4 ms in fp32, RS + AG of 2 MB = 2 ms as 16-bit;
    # then forward 11 ms: 26 ms vs 24 ms
    ops = (Op(AR, 1), Op(AR, 0))
    fp32 = Schedule(((0,), (1,)), ops)
    half = Schedule(((0,), (1,)), ops, wire16=(True, False))
    assert simulate(PROF, CM, fp32).iteration_s == pytest.approx(0.026, abs=1e-12)
    assert simulate(PROF, CM, half).iteration_s == pytest.approx(0.024, abs=1e-12)
    rs = Schedule(((0,), (1,)), (Op(AR, 1), Op(RS, 0), Op(AG, 0)), wire16=(True, True))
    res = simulate(PROF, CM, rs)
    assert [round((t.end - t.start) * 1e3, 9) for t in res.ops] == [0.5, 1.0, 1.0]


def test_measured_16bit_constants_replace_the_half_bytes_rule():
    """With the fitted 16-bit constants (cast included) a wire16 bucket costs those, over its fp32 bytes: the
    16-bit RS and AG at 0.3 ns/byte each take 1.2 ms for bucket 0's 4 MB instead of 1 ms each."""
    import dataclasses

    from lightning_pipedap.plan.cost_model import AlphaBeta

    cm = dataclasses.replace(CM, rs16=AlphaBeta(0.0, 0.3e-9), ag16=AlphaBeta(0.0, 0.3e-9))
    assert cm.reduce_scatter16(4_000_000) == pytest.approx(1.2e-3)
    assert CM.reduce_scatter16(4_000_000) == pytest.approx(1e-3)
    half = Schedule(((0,), (1,)), (Op(AR, 1), Op(AR, 0)), wire16=(True, False))
    # backward 11 ms, bucket 0's AR (16-bit RS + AG) 2.4 ms, forward 11 ms
    assert simulate(PROF, cm, half).iteration_s == pytest.approx(0.0244, abs=1e-12)
    # a 16-bit format slower than fp32 (cast costs more than the halved transfer saves): optimal keeps fp32
    slow = dataclasses.replace(CM, rs16=AlphaBeta(0.0, 0.6e-9), ag16=AlphaBeta(0.0, 0.6e-9))
    s = get_planner("optimal")(PROF, slow, 2, wire16=True)
    assert s.wire16 is None or not any(s.wire16)


def test_optimal_sends_16bit_only_the_exposed_bucket():
    dense = get_planner("optimal")(PROF, CM, 2)
    assert dense.predicted_iteration_s == pytest.approx(0.026, abs=1e-12)
    assert dense.wire16 is None
    plan = get_planner("optimal")(PROF, CM, 2, wire16=True)
    # bucket 0 (layer 0, exposed) goes 16-bit: 24 ms; bucket 1 (hidden under layer 0's backward)
    # stays fp32: sending it 16-bit would not shorten the iteration
    assert plan.buckets == ((0,), (1,))
    assert plan.wire16 == (True, False)
    assert plan.predicted_iteration_s == pytest.approx(0.024, abs=1e-12)
    assert simulate(PROF, CM, plan).iteration_s == pytest.approx(plan.predicted_iteration_s, abs=1e-15)
    assert "H" in plan.describe()


def test_optimal_keeps_fp32_when_halving_the_bytes_buys_nothing():
    latency_only = CostModel.from_allreduce(1e-3, 0.0)  # every op costs its 1 ms start-up, whatever its size
    plan = get_planner("optimal")(PROF, latency_only, 2, wire16=True)
    assert plan.wire16 is None
    # bucket 1's AR hides under layer 0's backward, bucket 0's (fused with it or not) costs 1 ms exposed
    assert plan.predicted_iteration_s == pytest.approx(PROF.t_compute + 1e-3, rel=1e-9)


def test_schedule_rejects_bad_wire16_flags():
    with pytest.raises(ValueError, match="wire16 has 1 flags for 2 buckets"):
        Schedule(((0,), (1,)), (Op(AR, 1), Op(AR, 0)), wire16=(True,)).validate()
    with pytest.raises(ValueError, match="both compressed and wire16"):
        Schedule(((0,), (1,)), (Op(AR, 1), Op(AR, 0)), compressed=(True, False), wire16=(True, False)).validate()


def test_contended_simulator_and_bounds_see_the_wire16_bytes():
    from lightning_pipedap.plan.bounds import lower_bounds
    from lightning_pipedap.plan.contention import Contention, simulate_contended

    half = Schedule(((0,), (1,)), (Op(AR, 1), Op(AR, 0)), wire16=(True, False))
    assert simulate_contended(PROF, CM, half, Contention.none()).iteration_s == pytest.approx(0.024, abs=1e-12)
    # the schedule's own bound: bucket 0 (layers 0..) communicates 2 ms, bucket 1 1 ms
    assert lower_bounds(PROF, CM, half).comm_s == pytest.approx(0.003, abs=1e-12)
