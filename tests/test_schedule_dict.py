"""``Schedule.to_dict`` / ``Schedule.from_dict``, and the checkpoint's plan entry built on them."""

from __future__ import annotations

import io
import json

import pytest
import torch

from lightning_pipedap.plan import CostModel
from lightning_pipedap.schedule import SCHEDULE_FORMAT, Op, OpKind, Schedule, allreduce_ops, builtin_schedule, dear_ops
from lightning_pipedap.strategy.resume import PLAN_VERSION, plan_mismatch, plan_schedule, plan_state

RS, AG, AR = OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.ALL_REDUCE
PLANNED = Schedule(((0, 1), (2,), (3, 4)), (Op(RS, 2), Op(AR, 1), Op(RS, 0), Op(AG, 0), Op(AG, 2)), "optimal",
                   0.012345678901234567, (False, True, False))


@pytest.mark.parametrize("schedule", [
    builtin_schedule("dear", [4, 4, 4, 4], 8),  # no flags, no prediction
    builtin_schedule("allreduce", [4, 4, 4], 4, compress_all=True),  # flags, no prediction
    PLANNED,  # flags and a prediction with all 17 digits
    Schedule(((0,), (1,)), (Op(AR, 1), Op(AR, 0)), predicted_iteration_s=0.5),  # a prediction, no flags
    Schedule(((0,), (1,)), (Op(AR, 1), Op(AR, 0)), wire16=(True, False)),  # 16-bit wire flags
])
def test_round_trip_through_json(schedule):
    d = schedule.to_dict()
    assert d["format"] == SCHEDULE_FORMAT and d["version"] == 1
    back = Schedule.from_dict(json.loads(json.dumps(d)))
    assert back == schedule
    assert back.predicted_iteration_s == schedule.predicted_iteration_s
    assert back.compressed == schedule.compressed
    assert back.wire16 == schedule.wire16


def test_to_dict_is_plain_data():
    assert PLANNED.to_dict() == {
        "format": SCHEDULE_FORMAT, "version": 1, "name": "optimal", "buckets": [[0, 1], [2], [3, 4]],
        "ops": [["RS", 2], ["AR", 1], ["RS", 0], ["AG", 0], ["AG", 2]], "compressed": [False, True, False],
        "predicted_iteration_s": 0.012345678901234567, "wire16": None, "pieces": None}


def test_optional_keys_take_their_defaults():
    s = Schedule.from_dict({"format": SCHEDULE_FORMAT, "version": 1, "buckets": [[0]], "ops": [["AR", 0]]})
    assert (s.name, s.predicted_iteration_s, s.compressed) == ("custom", None, None)


def _with(**changes):
    d = PLANNED.to_dict()
    for k, v in changes.items():
        if v is KeyError:
            del d[k]
        else:
            d[k] = v
    return d


@pytest.mark.parametrize("data, match", [
    ([["RS", 0]], "a schedule is a dict with keys"),
    (_with(format="lightning_pipedap.cost_model"), "format is 'lightning_pipedap.cost_model', expected"),
    (_with(version=2), "unsupported schedule version 2; valid: 1"),
    (_with(fusion="auto"), r"unknown schedule keys \['fusion'\]"),
    (_with(ops=KeyError), r"schedule lacks \['ops'\]"),
    (_with(buckets={"0": [0]}), "buckets must be a list of buckets"),
    (_with(buckets=[[0, 1], [2], [3, "4"]]), r"buckets\[2\] must be a list of parameter indices .* got \[3, '4'\]"),
    (_with(buckets=[[0, 1], [-2], [3, 4]]), r"buckets\[1\] must be a list of parameter indices"),
    (_with(ops=[["RS", 2], ["XX", 1]]), r"ops\[1\] must be a \[kind, bucket\] pair .* got \['XX', 1\]"),
    (_with(ops=[["AR", 0, 1]]), r"ops\[0\] must be a \[kind, bucket\] pair"),
    (_with(ops=[["AR", True]]), r"ops\[0\] must be a \[kind, bucket\] pair"),
    (_with(ops="RS2"), "ops must be a list of"),
    (_with(name=7), "name must be a string, got 7"),
    (_with(predicted_iteration_s="fast"), "predicted_iteration_s must be a finite number >= 0 .* got 'fast'"),
    (_with(predicted_iteration_s=-1.0), "predicted_iteration_s must be a finite number >= 0"),
    (_with(predicted_iteration_s=float("nan")), "predicted_iteration_s must be a finite number >= 0"),
    (_with(compressed=[False, 1, False]), r"compressed\[1\] must be true or false, got 1"),
    (_with(compressed=True), "compressed must be a list of bools"),
    (_with(compressed=[True]), "compressed has 1 flags for 3 buckets"),  # Schedule.validate
    (_with(ops=[["AG", 0]]), "op AG0 is not valid after nothing on bucket 0"),  # Schedule.validate
    (_with(ops=[["AR", 0], ["AR", 1]]), r"buckets \[2\] are never fully reduced"),  # Schedule.validate
])
def test_from_dict_names_the_bad_key_or_value(data, match):
    with pytest.raises(ValueError, match=match):
        Schedule.from_dict(data)


def _plan(schedule: Schedule, cost_model: CostModel | None = None) -> dict:
    return plan_state(world_size=2, schedule_name="optimal", bucket_cap_mb=1.0, signature=[["w", [4, 2]]],
                      order=[1, 0], owner_names=["layer", None], schedule=schedule, no_overlap_time_s=0.25,
                      cost_model=cost_model)


def test_plan_entry_holds_the_schedule_dict_and_survives_a_weights_only_load():
    cm = CostModel.from_allreduce(1e-4, 1e-9)
    plan = _plan(PLANNED, cm)
    assert plan["version"] == PLAN_VERSION == 2 and plan["final_schedule"] == PLANNED.to_dict()
    buf = io.BytesIO()
    torch.save({"plan": plan}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)["plan"]  # plain data only
    assert plan_schedule(back) == PLANNED
    assert CostModel.from_dict(back["cost_model"]) == cm
    assert plan_mismatch(back, world_size=2, schedule_name="optimal", bucket_cap_mb=1.0,
                         signature=[["w", [4, 2]]]) == []
    old = dict(back, version=1)  # an entry of another version is not installed
    assert plan_mismatch(old, world_size=2, schedule_name="optimal", bucket_cap_mb=1.0,
                         signature=[["w", [4, 2]]]) == ["version"]


def test_plan_schedule_without_a_schedule_names_the_missing_key():
    with pytest.raises(ValueError, match="no 'final_schedule'"):
        plan_schedule({"version": PLAN_VERSION, "world_size": 1})
    plan = _plan(PLANNED)
    plan["final_schedule"]["ops"] = plan["final_schedule"]["ops"][:-1]  # AG2 missing
    with pytest.raises(ValueError, match=r"buckets \[2\] are never fully reduced"):
        plan_schedule(plan)


# ---------------------------------------------------------------- tensor partitioning (pieces)
_PIECES = ((0, 0, 10), (1, 0, 5), (1, 5, 9), (2, 0, 3))


def test_pieces_round_trip_and_accessors():
    s = Schedule(buckets=((0, 1), (2, 3)), ops=dear_ops(2), pieces=_PIECES).validate(3, [10, 9, 3])
    assert Schedule.from_dict(s.to_dict()) == s
    assert s.to_dict()["pieces"] == [[0, 0, 10], [1, 0, 5], [1, 5, 9], [2, 0, 3]]
    assert s.split_params() == {1: (1, 2)}
    assert s.num_units == 4 and [s.unit_param(u) for u in range(4)] == [0, 1, 1, 2]
    assert "(2 pieces of 1 split parameters)" in s.describe()


@pytest.mark.parametrize("pieces, numels, message", [
    (((0, 0, 10), (1, 0, 5), (1, 6, 9), (2, 0, 3)), None, "starts at element 6; the previous piece ends at 5"),
    (((0, 0, 10), (1, 5, 9), (1, 0, 5), (2, 0, 3)), None, "must be listed in element order"),
    (_PIECES, [10, 10, 3], "end at element 9; it has 10 elements"),
    (((0, 0, 10), (1, 0, 5), (1, 5, 9), (3, 0, 3)), None, "missing [2], out of range [3]"),
    (((0, 0, 10), (1, 0, 5), (1, 5, 5), (2, 0, 3)), None, "0 <= start < stop"),
])
def test_bad_pieces_are_named(pieces, numels, message):
    with pytest.raises(ValueError) as e:
        Schedule(buckets=((0, 1), (2, 3)), ops=dear_ops(2), pieces=pieces).validate(3, numels)
    assert message in str(e.value)


def test_a_compressed_bucket_cannot_hold_a_piece():
    with pytest.raises(ValueError, match=r"compressed buckets \[0\] hold pieces of a split parameter"):
        Schedule(buckets=((0, 1), (2, 3)), ops=allreduce_ops(2), pieces=_PIECES, compressed=(True, False)).validate(3)
    # a compressed bucket of whole parameters is fine next to split ones
    Schedule(buckets=((0,), (1, 2, 3)), ops=allreduce_ops(2), pieces=_PIECES, compressed=(True, False)).validate(3)


def test_pieces_from_dict_rejects_malformed_triples():
    d = Schedule(buckets=((0, 1), (2, 3)), ops=dear_ops(2), pieces=_PIECES).to_dict()
    d["pieces"][1] = [1, 0]
    with pytest.raises(ValueError, match=r"pieces\[1\] must be a \[param, start, stop\] triple"):
        Schedule.from_dict(d)
