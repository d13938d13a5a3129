"""What-if CLI with ``--compression``: planners with a compression cost beside the dense ones."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_pipedap.compress.compressors import valid_compressor_names
from lightning_pipedap.plan import cli
from lightning_pipedap.plan.bounds import lower_bounds
from lightning_pipedap.plan.compression import CompressionCost, load_compression_cost
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.planners import get_planner
from lightning_pipedap.plan.profile import load_profile
from lightning_pipedap.plan.simulator import simulate
from lightning_pipedap.schedule import Schedule
from lightning_pipedap.plan.profile import PACKAGED_PROFILES_DIR

DATA = Path(__file__).resolve().parent / "data"
SHARED = PACKAGED_PROFILES_DIR  # the reference profiles shipped with the package
#: a hand-made fp16 cost (not measured): half the bytes on the wire, cheap to compute
COST = CompressionCost(alpha_c_s=2e-4, beta_c_s_per_byte=5e-11, payload_ratio=0.5, post_share=0.3,
                       extra_allreduces=1, method="fp16")


def _rows(out: str) -> dict[str, list[str]]:
    names = set(cli.ORDER) | {f"{n}+fp16" for n in cli.ORDER}
    return {line.split()[0]: line.split() for line in out.splitlines() if line.split() and line.split()[0] in names}


def test_compressed_rows_equal_the_planners_with_the_cost_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIPEDAP_PROFILES_DIR", str(SHARED))
    cost_file = COST.save(tmp_path / "fp16.json")
    trace = tmp_path / "t.json"
    rc = cli.main(["--profile", "vgg16", "--world-size", "8", "--beta-scale", "30", "--compression", "fp16",
                   "--compression-cost", str(cost_file), "--trace", str(trace)])
    assert rc == 0
    out = capsys.readouterr().out
    assert f"loaded from {cost_file}" in out
    rows = _rows(out)
    assert list(rows) == [r for n in cli.ORDER for r in (n, f"{n}+fp16")]  # each planner next to its dense row
    prof = load_profile(SHARED / "vgg16.json")
    cm = CostModel.from_reference(SHARED / "alpha_beta.json", 8).scaled(beta_factor=30.0)
    for name in cli.ORDER:
        dense = get_planner(name)(prof, cm, 8)
        comp = get_planner(name)(prof, cm, 8, compression=COST)
        assert float(rows[name][3]) == pytest.approx(dense.predicted_iteration_s * 1e3, abs=1e-3)
        assert float(rows[f"{name}+fp16"][3]) == pytest.approx(comp.predicted_iteration_s * 1e3, abs=1e-3)
        assert rows[name][7] == "-"
        assert rows[f"{name}+fp16"][7] == f"{comp.num_compressed}/{len(comp.buckets)}"
        if name != "optimal":  # the other planners compress every bucket
            assert comp.num_compressed == len(comp.buckets)
    # optimal never loses against not compressing; at beta x30 compressing pays here
    assert float(rows["optimal+fp16"][3]) < float(rows["optimal"][3])
    lb_c = lower_bounds(prof, cm, compression=COST, world_size=8)
    assert f"gap % of the +fp16 rows is against {lb_c.best_s * 1e3:.3f} ms" in out
    gap = 100.0 * (float(rows["optimal+fp16"][3]) / (lb_c.best_s * 1e3) - 1.0)
    assert float(rows["optimal+fp16"][5]) == pytest.approx(gap, abs=0.02)
    # the helper lane (compression beside compute) is in the trace of a compressed row
    events = json.loads(trace.read_text())["traceEvents"]
    procs = {e["args"]["name"]: e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    helper = [e for e in events if e["ph"] == "X" and e["pid"] == procs["optimal+fp16"] and e["cat"] == "compress"]
    assert len(helper) >= get_planner("optimal")(prof, cm, 8, compression=COST).num_compressed
    assert not [e for e in events if e["ph"] == "X" and e["pid"] == procs["optimal"] and e["cat"] == "compress"]


def test_where_overrides_the_cost_file_and_measured_cost_is_saved(tmp_path, capsys):
    prof = load_profile(DATA / "tiny_profile.json")
    cm = CostModel.from_allreduce(2e-4, 2e-9)
    cost_file = COST.save(tmp_path / "fp16.json")
    assert cli.main(["--profile", str(DATA / "tiny_profile.json"), "--world-size", "4", "--alpha", "2e-4",
                     "--beta", "2e-9", "--planner", "wfbp", "--compression", "fp16", "--compression-cost",
                     str(cost_file), "--compression-where", "inline"]) == 0
    rows = _rows(capsys.readouterr().out)
    inline = replace(COST, where="inline")
    expected = get_planner("wfbp")(prof, cm, 4, compression=inline).predicted_iteration_s
    assert float(rows["wfbp+fp16"][3]) == pytest.approx(expected * 1e3, abs=1e-3)
    # no cost file: measured on this CPU (fp16 payload is exactly half the dense bytes), saved, used
    saved = tmp_path / "measured.json"
    assert cli.main(["--profile", str(DATA / "tiny_profile.json"), "--world-size", "4", "--alpha", "2e-4",
                     "--beta", "2e-9", "--planner", "wfbp", "--compression", "fp16", "--compression-budget", "0.3",
                     "--save-compression-cost", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "measured on this CPU" in out and "synthetic fp32 tensors" in out
    measured = load_compression_cost(saved)
    assert (measured.method, measured.payload_ratio, measured.collective, measured.where) == ("fp16", 0.5, "AR",
                                                                                                "helper")
    expected = get_planner("wfbp")(prof, cm, 4, compression=measured).predicted_iteration_s
    assert float(_rows(out)["wfbp+fp16"][3]) == pytest.approx(expected * 1e3, abs=1e-3)


def test_bad_method_exits_2_listing_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--profile", str(DATA / "tiny_profile.json"), "--world-size", "2", "--compression", "zip"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'zip'" in err
    for name in valid_compressor_names():
        assert name in err


@pytest.mark.parametrize("argv, match", [
    (["--compression-cost", "x.json"], "--compression-cost need --compression METHOD (one of none, fp16"),
    (["--compression", "fp16", "--compression-kwargs", "rank=4"], "compressor 'fp16' does not take ['rank']"),
    (["--compression", "topk", "--compression-kwargs", "ratio"], "item 'ratio' is not key=value"),
    (["--compression", "bf16", "--compression-cost", "{cost}"],
     "holds the cost of 'fp16', but --compression is 'bf16'"),
    (["--compression", "fp16", "--compression-cost", "{cost}", "--compression-kwargs", "a=1"],
     "--compression-kwargs has no effect with --compression-cost"),
    (["--compression", "fp16", "--bytes-per-element", "2"], "fp32 gradients (4 bytes per element); got"),
    (["--compression", "fp16", "--compression-budget", "0"], "--compression-budget must be > 0 seconds, got 0.0"),
])
def test_bad_compression_arguments_exit_2(argv, match, tmp_path, capsys):
    cost_file = str(COST.save(tmp_path / "fp16.json"))
    argv = [a.replace("{cost}", cost_file) for a in argv]
    rc = cli.main(["--profile", str(DATA / "tiny_profile.json"), "--world-size", "2", "--alpha", "1e-4",
                   "--beta", "1e-9", *argv])
    assert rc == 2
    assert match in capsys.readouterr().err


def test_kwargs_parsing_and_synthetic_shapes():
    assert cli.parse_compression_kwargs("rank=4, start_step=0,error_feedback=false,ratio=0.01,x=abc") == {
        "rank": 4, "start_step": 0, "error_feedback": False, "ratio": 0.01, "x": "abc"}
    assert cli.parse_compression_kwargs(None) == {}
    prof = load_profile(DATA / "tiny_profile.json")  # 65536, 262144, 512, 131072 elements, 20480 bytes
    assert cli.synthetic_layer_shapes(prof, "powersgd") == [[(256, 256)], [(512, 512)], [(22, 23), (6,)],
                                                             [(362, 362), (28,)], [(71, 72), (8,)]]
    assert cli.synthetic_layer_shapes(prof, "topk") == [[(65536,)], [(262144,)], [(512,)], [(131072,)], [(5120,)]]


def test_compression_cost_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, expected a compression cost object"):
        load_compression_cost(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        load_compression_cost(bad)
    assert load_compression_cost(COST.save(tmp_path / "ok.json")) == COST


def test_saved_compressed_schedule_simulates_to_the_same_iteration_time(tmp_path, capsys):
    tiny = ["--profile", str(DATA / "tiny_profile.json"), "--world-size", "4", "--alpha", "2e-4", "--beta", "2e-9"]
    cost_file, path = str(COST.save(tmp_path / "fp16.json")), tmp_path / "s.json"
    with_cost = ["--compression", "fp16", "--compression-cost", cost_file]
    assert cli.main([*tiny, "--planner", "wfbp", *with_cost, "--save-schedule", str(path)]) == 0
    planned = _rows(capsys.readouterr().out)["wfbp+fp16"]
    saved = Schedule.from_dict(json.loads(path.read_text()))
    assert saved.num_compressed == len(saved.buckets) > 0  # wfbp with a compression cost compresses every bucket
    assert cli.main([*tiny, "--schedule", str(path), *with_cost]) == 0
    loaded = _rows(capsys.readouterr().out)["wfbp"]
    assert loaded[1:] == planned[1:]  # buckets, ops, iteration, exposed, gap (vs the bound with compression), k/B
    prof, cm = load_profile(DATA / "tiny_profile.json"), CostModel.from_allreduce(2e-4, 2e-9)
    a = simulate(prof, cm, get_planner("wfbp")(prof, cm, 4, compression=COST), compression=COST, world_size=4)
    b = simulate(prof, cm, saved, compression=COST, world_size=4)
    assert (b.iteration_s, b.exposed_comm_s, b.helper) == (a.iteration_s, a.exposed_comm_s, a.helper)
    # without the cost the compressed buckets cannot be simulated
    assert cli.main([*tiny, "--schedule", str(path)]) == 2
    assert f"compresses {saved.num_compressed} of {len(saved.buckets)} buckets; give --compression METHOD" in \
        capsys.readouterr().err
