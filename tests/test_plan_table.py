"""Validation 1 table (``plan.sweep``) and the simulated-timeline -> OpRecord conversion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_pipedap.measure.timeline import (
    communication_ms, compute_ms, exposed_communication_ms, exposed_intervals, gantt_rgb, pack_rows,
)
from lightning_pipedap.plan import sweep
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.planners import get_planner
from lightning_pipedap.plan.profile import LayerProfile, ModelProfile, load_profile
from lightning_pipedap.plan.simulator import simulate, to_op_records
from lightning_pipedap.schedule import Op, OpKind, Schedule
from lightning_pipedap.plan.profile import PACKAGED_PROFILES_DIR

DATA = Path(__file__).resolve().parent / "data"
SHARED = PACKAGED_PROFILES_DIR  # the reference profiles shipped with the package
RS, AG, AR = OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.ALL_REDUCE


# ------------------------------------------------------------------------------------ the table
def _reference_numbers(model: str, world_size: int, beta_scale: float) -> tuple[float, float, float]:
    """(sum bound, window bound, no_overlap) in ms straight from the JSON files, without the library:
    T_AR(M elements) = alpha + beta_scale * beta * M, least comm = T_AR (RS + AG = T_AR)."""
    layers = json.loads((SHARED / f"{model}.json").read_text())["layers"]
    ab = json.loads((SHARED / "alpha_beta.json").read_text())[str(world_size)]

    def t_ar(m: float) -> float:
        return ab["alpha_s"] + beta_scale * ab["beta_s_per_element"] * m

    compute = sum(lay["t_f"] + lay["t_b"] for lay in layers)
    window, tail_before, cum = 0.0, 0.0, 0
    for lay in layers:  # j = 0, 1, ...: Σ_{k>=j} (t_f + t_b) = compute - Σ_{k<j}
        cum += lay["params"]
        window = max(window, compute - tail_before + t_ar(cum))
        tail_before += lay["t_f"] + lay["t_b"]
    return max(compute, t_ar(cum)) * 1e3, window * 1e3, (compute + t_ar(cum)) * 1e3


@pytest.mark.parametrize("model, beta_scale, optimal_ms, window_ms", [
    ("vgg16", 1.0, 548.2167, 548.2167),
    ("resnet50", 1.0, 336.8929, 336.8929),
    ("bert_base", 1.0, 389.9043, 389.9043),
    ("vgg16", 30.0, 1015.3249, 1014.0063),  # a row that separates the planners
])
def test_pinned_rows_at_8_workers(model, beta_scale, optimal_ms, window_ms):
    (row,) = sweep.run_sweep(SHARED, models=(model,), world_sizes=(8,), beta_scales=(beta_scale,))
    assert (row.model, row.world_size, row.beta_scale) == (model, 8, beta_scale)
    assert row.iteration_s["optimal"] * 1e3 == pytest.approx(optimal_ms, abs=0.01)
    assert row.window_s * 1e3 == pytest.approx(window_ms, abs=0.01)
    sum_bound, window, no_overlap = _reference_numbers(model, 8, beta_scale)
    assert row.window_s * 1e3 == pytest.approx(window, rel=1e-12)
    assert row.sum_bound_s * 1e3 == pytest.approx(sum_bound, rel=1e-12)
    assert row.iteration_s["no_overlap"] * 1e3 == pytest.approx(no_overlap, rel=1e-12)
    assert row.optimal_is_best
    assert row.gap_pct == pytest.approx(100.0 * (optimal_ms / window_ms - 1.0), abs=1e-3)


def _row(model: str, times_ms: dict[str, float], window_ms: float) -> sweep.SweepRow:
    return sweep.SweepRow(model, 4, 10.0, {k: v / 1e3 for k, v in times_ms.items()}, window_ms / 1e3 - 0.001,
                        window_ms / 1e3)


def test_markdown_and_summary_on_hand_made_rows():
    a = _row("m1", {"no_overlap": 120.0, "wfbp": 101.0, "dear": 102.0, "pipedap": 101.0, "optimal": 100.5}, 100.0)
    b = _row("m2", {"no_overlap": 120.0, "wfbp": 101.0, "dear": 99.0, "pipedap": 101.0, "optimal": 102.0}, 100.0)
    assert a.gap_pct == pytest.approx(0.5) and a.optimal_is_best
    assert b.gap_pct == pytest.approx(2.0) and not b.optimal_is_best  # dear beats optimal: must show
    text = sweep.sweep_markdown([a, b])
    lines = text.splitlines()
    assert lines[0] == ("| model | workers | β × | no_overlap | wfbp | dear | pipedap | optimal | sum bound | "
                        "window bound | gap % |")
    assert lines[2] == "| m1 | 4 | 10 | 120.000 | 101.000 | 102.000 | 101.000 | 100.500 | 99.000 | 100.000 | 0.50 |"
    assert lines[3].endswith("| 102.000 | 99.000 | 100.000 | 2.00 |")
    assert lines[-1] == ("optimal <= every other planner on 1/2 rows; optimal within 1% of the window bound on "
                         "1/2 rows (50%); largest gap 2.00%.")
    tiny = _row("m3", {"no_overlap": 1.0, "wfbp": 1.0, "dear": 1.0, "pipedap": 1.0, "optimal": 1.0 - 1e-15}, 1.0)
    assert "| 0.00 |" in sweep.sweep_markdown([tiny])  # float noise below the bound is not printed as -0.00


def test_write_between_markers(tmp_path):
    new = tmp_path / "d" / "T.md"
    sweep.write_between_markers(new, "| a |\n")
    assert new.read_text() == f"{sweep.SWEEP_BEGIN}\n| a |\n{sweep.SWEEP_END}\n"
    doc = tmp_path / "P.md"
    doc.write_text(f"# Title\nprose\n\n{sweep.SWEEP_BEGIN}\nold table\n{sweep.SWEEP_END}\n\nmore prose\n")
    sweep.write_between_markers(doc, "| new |\n\nsummary\n")
    once = doc.read_text()
    assert once == f"# Title\nprose\n\n{sweep.SWEEP_BEGIN}\n| new |\n\nsummary\n{sweep.SWEEP_END}\n\nmore prose\n"
    sweep.write_between_markers(doc, "| new |\n\nsummary\n")
    assert doc.read_text() == once  # idempotent
    plain = tmp_path / "plain.md"
    plain.write_text("hand-written, no markers\n")
    with pytest.raises(ValueError, match="has no .*sweep:begin"):
        sweep.write_between_markers(plain, "x")
    assert plain.read_text() == "hand-written, no markers\n"


# ------------------------------------------------------------------- SimResult -> OpRecord
def _case_a():
    # backward l1 [0,1], l0 [1,3]; AR(100 B) = 0.5 + 0.01*100 = 1.5 s: AR1 [1,2.5], AR0 [3,4.5];
    # the forward waits for AR0 until 4.5 -> period 4.5 + 1 + 1 = 6.5 s, compute 5 s, exposed 1.5 s
    prof = ModelProfile("a", (LayerProfile("l0", 100, 1.0, 2.0), LayerProfile("l1", 100, 1.0, 1.0)))
    cm = CostModel.from_allreduce(0.5, 0.01)
    return prof, cm, simulate(prof, cm, Schedule(((0,), (1,)), (Op(AR, 1), Op(AR, 0))))


def test_conversion_by_hand_and_exposed_equal():
    _, _, r = _case_a()
    assert r.iteration_s == pytest.approx(6.5) and r.exposed_comm_s == pytest.approx(1.5)
    recs = to_op_records(r)
    got = [(x.name, x.kind, x.bucket, x.lane, round(x.start_s, 9), round(x.end_s, 9)) for x in recs]
    assert got == [("W0", "wait", 0, "compute", 0.0, 1.5), ("F0", "forward", 0, "compute", 1.5, 2.5),
                   ("F1", "forward", 1, "compute", 2.5, 3.5), ("B1", "backward", 1, "compute", 3.5, 4.5),
                   ("B0", "backward", 0, "compute", 4.5, 6.5),
                   ("AR0", "AR", 0, "comm", 0.0, 1.5),  # previous iteration's AR0: the wait at 0
                   ("AR1", "AR", 1, "comm", 4.5, 6.0), ("AR0", "AR", 0, "comm", 6.5, 8.0)]
    P = r.iteration_s
    assert exposed_communication_ms(recs, window=(0.0, P)) == pytest.approx(1500.0)
    assert exposed_communication_ms(recs, window=(0.0, P)) == pytest.approx(r.exposed_comm_s * 1e3)
    assert exposed_intervals(recs, window=(0.0, P)) == [(0.0, pytest.approx(1.5))]
    assert compute_ms(recs, window=(0.0, P)) == pytest.approx(r.compute_s * 1e3)
    with pytest.raises(ValueError, match="iterations must be an int >= 1, got 0"):
        to_op_records(r, 0)


@pytest.mark.parametrize("channels", [1, 2])
def test_conversion_preserves_every_op_and_exposed_for_every_planner(channels):
    prof = load_profile(DATA / "tiny_profile.json")
    cm = CostModel.from_allreduce(2e-4, 2e-9, startup_sharing=0.5)
    for name in sweep.ORDER:
        r = simulate(prof, cm, get_planner(name)(prof, cm, 4, channels=channels), channels=channels)
        P, n = r.iteration_s, 3
        recs = to_op_records(r, iterations=n)
        comm = [(x.name, x.kind, x.bucket, x.start_s, x.end_s) for x in recs if x.lane == "comm"]
        for k in range(n):  # every op of every iteration, unchanged but for the shift
            for t in r.ops:
                assert (str(t.op), t.op.kind.value, t.op.bucket, t.start + k * P, t.end + k * P) in comm, (name, k, t)
        assert all(x[4] > 0 for x in comm)
        assert len(comm) == n * len(r.ops) + sum(1 for t in r.ops if t.end - P > 0)
        w = (0.0, n * P)
        assert exposed_communication_ms(recs, window=w) == pytest.approx(n * r.exposed_comm_s * 1e3, rel=1e-9, abs=1e-9)
        assert compute_ms(recs, window=w) == pytest.approx(n * r.compute_s * 1e3, rel=1e-9)
        waits = sum(x.duration_s for x in recs if x.kind == "wait")
        assert waits * 1e3 == pytest.approx(n * r.exposed_comm_s * 1e3, rel=1e-9, abs=1e-9)
        if channels == 1:  # one channel: the ops never overlap
            assert communication_ms(recs) == pytest.approx(sum(x[4] - x[3] for x in comm) * 1e3)


def test_two_channels_stack_concurrent_ops_in_the_comm_lane():
    # case b of test_plan_simulator with DeAR order on 2 channels: RS on channel 0, AG on channel 1
    prof = ModelProfile("b", (LayerProfile("l0", 200, 0.5, 1.0), LayerProfile("l1", 0, 1.0, 1.0),
                              LayerProfile("l2", 200, 1.0, 2.0)), t_update=0.4)
    cm = CostModel.from_allreduce(1.0, 0.005)  # RS = AG = 1 s per bucket
    r = simulate(prof, cm, Schedule(((0,), (1, 2)), (Op(RS, 1), Op(RS, 0), Op(AG, 1), Op(AG, 0))), channels=2)
    # ready b1 = 3, b0 = 4: RS1 [3,4], RS0 [4,5] on ch0; AG1 [4,5], AG0 [5,6] on ch1 -> AG1 runs beside RS0
    recs = [x for x in to_op_records(r) if x.lane == "comm" and x.start_s >= 0.5]
    rows = dict(zip([x.name for x in recs], pack_rows(recs)))
    assert rows == {"RS1": (0, 2), "RS0": (0, 2), "AG1": (1, 2), "AG0": (0, 2)}


def test_gantt_highlights_exposed_communication():
    _, _, r = _case_a()
    recs = to_op_records(r, iterations=2)
    red = (0xD6, 0x27, 0x28)  # the exposed-communication colour

    def red_pixels(img) -> int:
        return int(((img[..., 0] == red[0]) & (img[..., 1] == red[1]) & (img[..., 2] == red[2])).sum())

    on = gantt_rgb(recs, "case a", origin_s=0.0, window=(0.0, 2 * r.iteration_s))
    off = gantt_rgb(recs, "case a", origin_s=0.0, window=(0.0, 2 * r.iteration_s), highlight_exposed=False)
    assert on.shape == off.shape == (260, 1000, 3)
    assert red_pixels(off) == 0
    assert red_pixels(on) > 500  # the bars under the comm lane (1.5 of every 6.5 s) and the legend patch
