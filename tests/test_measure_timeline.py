"""Timeline math and exports on hand-made records (times in seconds, expected values in ms)."""

from __future__ import annotations

import json
import types

import pytest

from lightning_pipedap.measure.timeline import (
    COMPRESS_KINDS,
    OpRecord,
    as_op_records,
    chrome_trace,
    communication_ms,
    compute_ms,
    exposed_communication_ms,
    gantt_png,
    gantt_rgb,
    intersection_length,
    lane_of_kind,
    overlap_ratio,
    records_from_chrome_trace,
    subtract,
    union,
    write_chrome_trace,
)
from lightning_pipedap.schedule import Op, OpKind

BASE = 100.0  # perf_counter-like origin


def ms(a, b):
    return BASE + a / 1000.0, BASE + b / 1000.0


def hand_made_step():
    """forward 0-10, backward 10-30, update 30-32 ms; RS0 15-25, RS1 28-40, AG0 40-45, AG1 41-44 (concurrent
    with AG0), compress 12-14 ms."""
    spec = [("forward", "forward", None, 0, 10, "compute"), ("backward", "backward", None, 10, 30, "compute"),
            ("update", "update", None, 30, 32, "compute"), ("RS0", "RS", 0, 15, 25, "comm"),
            ("RS1", "RS", 1, 28, 40, "comm"), ("AG0", "AG", 0, 40, 45, "comm"), ("AG1", "AG", 1, 41, 44, "comm"),
            ("compress1", "compress", 1, 12, 14, "compress")]
    return [OpRecord(n, k, b, *ms(s, e), lane) for n, k, b, s, e, lane in spec]


def test_exposed_communication_and_overlap_are_exact():
    recs = hand_made_step()
    # comm union: [15,25] + [28,45] = 27 ms; overlapped by compute [0,32]: 10 + 4 = 14 ms
    assert communication_ms(recs) == pytest.approx(27.0)
    assert exposed_communication_ms(recs) == pytest.approx(13.0)
    assert overlap_ratio(recs) == pytest.approx(14.0 / 27.0)
    # clipped to a window ending at 42 ms: comm 10 + 14 = 24, overlapped 14
    w = ms(0, 42)
    assert communication_ms(recs, window=w) == pytest.approx(24.0)
    assert exposed_communication_ms(recs, window=w) == pytest.approx(10.0)
    # compression lane: fully inside backward -> nothing exposed
    assert exposed_communication_ms(recs, comm_kinds=COMPRESS_KINDS) == pytest.approx(0.0)
    assert communication_ms(recs, kinds=COMPRESS_KINDS) == pytest.approx(2.0)


def test_waits_inside_compute_do_not_hide_communication():
    # the forward blocks 2-6 ms on AG0 (2-6 ms) and the backward 12-13 ms on nothing of ours
    recs = hand_made_step() + [OpRecord("wait", "wait", None, *ms(2, 6), "compute"),
                               OpRecord("AG0", "AG", 0, *ms(2, 6), "comm"),
                               OpRecord("wait", "wait", None, *ms(18, 20), "compute")]
    assert compute_ms(recs) == pytest.approx(32.0 - 4.0 - 2.0)
    # comm union 4 + 27 = 31 ms; hidden: [15,18] + [20,25] + [28,32] = 12 ms
    assert communication_ms(recs) == pytest.approx(31.0)
    assert exposed_communication_ms(recs) == pytest.approx(19.0)
    assert overlap_ratio(recs) == pytest.approx(12.0 / 31.0)


def test_no_communication_gives_no_ratio_and_zero_exposed():
    recs = [r for r in hand_made_step() if r.lane == "compute"]
    assert overlap_ratio(recs) is None
    assert exposed_communication_ms(recs) == 0.0
    only_comm = [r for r in hand_made_step() if r.lane == "comm"]
    assert overlap_ratio(only_comm) == 0.0
    assert exposed_communication_ms(only_comm) == pytest.approx(27.0)


def test_interval_helpers():
    assert union([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]
    assert intersection_length([(0, 10)], [(2, 3), (5, 7), (9, 12)]) == 4
    assert intersection_length([(0, 1), (4, 6)], [(0, 6)]) == 3
    assert intersection_length([], [(0, 1)]) == 0
    assert subtract([(0, 10)], [(2, 3), (5, 7), (9, 12)]) == [(0, 2), (3, 5), (7, 9)]
    assert subtract([(0, 2), (4, 6)], [(1, 5)]) == [(0, 1), (5, 6)]
    assert subtract([(0, 2)], [(0, 2)]) == []


def test_op_record_validation():
    with pytest.raises(ValueError, match=r"kind='reduce'.*valid choices"):
        OpRecord("x", "reduce", 0, 0.0, 1.0, "comm")
    with pytest.raises(ValueError, match=r"lane='net'.*valid choices"):
        OpRecord("x", "RS", 0, 0.0, 1.0, "net")
    with pytest.raises(ValueError, match="end_s=0.5 < start_s=1.0"):
        OpRecord("x", "RS", 0, 1.0, 0.5, "comm")
    with pytest.raises(ValueError, match="bucket='3'"):
        OpRecord("x", "RS", "3", 0.0, 1.0, "comm")
    assert lane_of_kind("AG") == "comm" and lane_of_kind("decompress") == "compress"
    assert lane_of_kind("update") == "compute"


def test_engine_op_timings_become_records():
    items = [types.SimpleNamespace(op=Op(OpKind.REDUCE_SCATTER, 2), start_s=1.0, end_s=1.5),
             types.SimpleNamespace(op=Op(OpKind.ALL_REDUCE, 0), start_s=2.0, end_s=2.25)]
    recs = as_op_records(items + [hand_made_step()[0]])
    assert [(r.name, r.kind, r.bucket, r.lane, r.duration_s) for r in recs[:2]] == [
        ("RS2", "RS", 2, "comm", 0.5), ("AR0", "AR", 0, "comm", 0.25)]
    assert recs[2].kind == "forward"
    with pytest.raises(TypeError, match="neither an OpRecord"):
        as_op_records([3])


def test_chrome_trace_file_parses_and_contains_every_operation(tmp_path):
    recs = hand_made_step()
    path = write_chrome_trace(recs, str(tmp_path / "t" / "step.trace.json"), rank=3, origin_s=BASE)
    with open(path) as f:
        trace = json.load(f)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in complete) == sorted(r.name for r in recs)
    rs0 = next(e for e in complete if e["name"] == "RS0")
    assert (rs0["pid"], rs0["tid"], rs0["cat"]) == (3, 1, "RS")
    assert rs0["ts"] == pytest.approx(15_000.0) and rs0["dur"] == pytest.approx(10_000.0)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {"rank 3", "compute", "comm", "compress"}
    back = records_from_chrome_trace(trace)
    assert [(r.name, r.kind, r.bucket, r.lane) for r in back] == [
        (r.name, r.kind, r.bucket, r.lane) for r in sorted(recs, key=lambda r: r.start_s)]
    assert exposed_communication_ms(back) == pytest.approx(13.0)
    # default origin is the earliest start
    assert min(e["ts"] for e in chrome_trace(recs)["traceEvents"] if e["ph"] == "X") == 0.0


def test_gantt_png_and_rgb(tmp_path):
    recs = hand_made_step()
    path = gantt_png(recs, str(tmp_path / "g.png"), title="hand-made")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    img = gantt_rgb(recs)
    assert img.shape == (260, 1000, 3) and str(img.dtype) == "uint8"
    assert gantt_rgb([]).shape == (260, 1000, 3)  # an empty step still renders


def _two_iterations():
    """Step 12 (forward 0-10, backward 10-30 ms, RS0 of it 12 at 20-35) with the previous iteration's AR0 (0-6 ms)
    and update0 (6-8 ms) drawn across its forward: the case the Gantt chart drew without saying whose they were."""
    spec = [("forward", "forward", None, 0, 10, "compute", 12), ("backward", "backward", None, 10, 30, "compute", 12),
            ("AR0", "AR", 0, 0, 6, "comm", 11), ("update0", "update", 0, 6, 8, "compute", 11),
            ("RS0", "RS", 0, 20, 35, "comm", 12)]
    return [OpRecord(n, k, b, *ms(s, e), lane, it) for n, k, b, s, e, lane, it in spec]


def test_gantt_and_trace_label_each_operation_with_its_iteration(tmp_path):
    from lightning_pipedap.measure.timeline import display_name, gantt_figure

    recs = _two_iterations()
    fig = gantt_figure(recs, title="step 12", origin_s=BASE)
    ax = fig.axes[0]
    texts = {t.get_text() for t in ax.texts}
    assert {"it 11: AR0", "it 11: update0", "it 12: RS0", "it 12: forward", "it 12: backward"} <= texts, texts
    # odd iterations are dotted, even ones plain: told apart where a bar has no room for its label
    assert [c.get_hatch() for c in ax.collections].count("..") == 2  # it 11's AR0 and update0
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[-2:] == ["it 11", "it 12"], legend
    # the Chrome trace names them too, and reads back
    trace = chrome_trace(recs, origin_s=BASE)
    names = sorted(e["name"] for e in trace["traceEvents"] if e["ph"] == "X")
    assert names == sorted(display_name(r) for r in recs) and "it 11: AR0" in names
    back = records_from_chrome_trace(trace)
    assert sorted((r.name, r.iteration) for r in back) == sorted((r.name, r.iteration) for r in recs)
    # records without an iteration keep their plain names
    assert display_name(hand_made_step()[3]) == "RS0"
    with pytest.raises(ValueError, match="iteration='3'"):
        OpRecord("x", "RS", 0, 0.0, 1.0, "comm", "3")


def test_engine_timings_and_simulated_records_carry_their_iteration():
    items = [types.SimpleNamespace(op=Op(OpKind.ALL_REDUCE, 0), start_s=2.0, end_s=2.25, iteration=7)]
    assert as_op_records(items)[0].iteration == 7
    from lightning_pipedap.plan import CostModel, simulate, to_op_records
    from lightning_pipedap.plan.profile import LayerProfile, ModelProfile
    from lightning_pipedap.schedule import Schedule

    prof = ModelProfile("m", (LayerProfile("l0", 100, 1.0, 2.0), LayerProfile("l1", 100, 1.0, 1.0)), t_update=0.2)
    res = simulate(prof, CostModel.from_allreduce(0.5, 0.01),
                   Schedule(((0,), (1,)), (Op(OpKind.REDUCE_SCATTER, 1), Op(OpKind.REDUCE_SCATTER, 0),
                                           Op(OpKind.ALL_GATHER, 0), Op(OpKind.ALL_GATHER, 1))))
    recs = to_op_records(res, iterations=2)
    assert {r.iteration for r in recs if r.lane == "compute"} == {0, 1}
    assert {r.iteration for r in recs if r.lane == "comm"} <= {-1, 0, 1} and any(
        r.iteration == -1 for r in recs if r.lane == "comm")


def test_the_engine_labels_a_rounds_ops_with_the_step():
    """The engine's op timings carry the label begin_iteration was given (the strategy passes the optimizer step)."""
    import torch
    import torch.distributed as dist

    from lightning_pipedap.engine import collectives as C
    from lightning_pipedap.engine.engine import CommEngine
    from lightning_pipedap.schedule import builtin_schedule

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        comm = C.new_comm_group(timeout_s=30)
        engine = CommEngine(comm, [torch.zeros(10)], builtin_schedule("allreduce", [40], 1 << 20), wait_timeout_s=30)
        engine.worker.timeline_enabled = True
        for label in (41, None):
            engine.begin_iteration(label)
            engine.grad_ready(0, torch.ones(10))
            engine.finish_backward()
            engine.wait_idle()
        assert [t.iteration for t in engine.worker.take_timings()] == [41, 2]  # (None: the round count)
        engine.close()
        C.destroy_comm_group(comm)
    finally:
        dist.destroy_process_group()
