"""What-if CLI ``python -m lightning_pipedap.plan.cli``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_pipedap.measure import timeline
from lightning_pipedap.plan import cli, sweep
from lightning_pipedap.plan.bounds import lower_bounds
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.planners import get_planner
from lightning_pipedap.plan.profile import load_profile
from lightning_pipedap.plan.simulator import simulate
from lightning_pipedap.schedule import Op, OpKind, Schedule
from lightning_pipedap.plan.profile import PACKAGED_PROFILES_DIR

DATA = Path(__file__).resolve().parent / "data"
SHARED = PACKAGED_PROFILES_DIR  # the reference profiles shipped with the package
REPO = Path(__file__).resolve().parents[1]


def test_table_png_and_trace_on_tiny_profile(tmp_path, capsys):
    png, trace = tmp_path / "g.png", tmp_path / "t.json"
    rc = cli.main(["--profile", str(DATA / "tiny_profile.json"), "--world-size", "4", "--alpha", "2e-4",
                   "--beta", "2e-9", "--png", str(png), "--trace", str(trace)])
    assert rc == 0
    out = capsys.readouterr().out
    prof = load_profile(DATA / "tiny_profile.json")
    cm = CostModel.from_allreduce(2e-4, 2e-9)
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in cli.ORDER}
    assert list(rows) == list(cli.ORDER)
    # the α-β constants in the same units as the training log (AR: alpha 2e-4 s, beta 2e-9 s/B)
    assert f"cost model: AR {cm.ar.describe(with_r2=False)}, RS " in out
    assert "AR α=200 µs β=2.000 ns/B (0.5 GB/s)" in out and "ps/B" not in out
    for name, cols in rows.items():
        expected = get_planner(name)(prof, cm, 4).predicted_iteration_s
        assert float(cols[3]) == pytest.approx(expected * 1e3, abs=1e-3)
    assert float(rows["no_overlap"][6]) == pytest.approx(1.0)
    assert f"window {lower_bounds(prof, cm).window_s * 1e3:.3f} ms" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert list(procs.values()) == list(cli.ORDER)  # one process per planner, named after it
    assert any(e.get("cat") == "wait" for e in events)
    # the trace is measure.timeline's: lanes as threads, every op of the optimal schedule on the comm lane
    pid = next(p for p, n in procs.items() if n == "optimal")
    threads = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"
               and e["pid"] == pid}
    assert threads == {"compute": 0, "comm": 1, "compress": 2}
    comm = [e for e in events if e["ph"] == "X" and e["pid"] == pid and e["tid"] == 1]
    assert {e["args"]["op"] for e in comm} == {str(op) for op in get_planner("optimal")(prof, cm, 4).ops}
    # each named with its iteration (-1: the previous iteration's ops that reach into the first one)
    assert all(e["name"] == f"it {e['args']['iteration']}: {e['args']['op']}" for e in comm)
    assert not hasattr(cli, "draw_gantt") and cli.chrome_trace is timeline.chrome_trace  # one drawing and writer


def test_bandwidth_gives_ring_beta():
    args = cli.parse_args(["--profile", "x", "--world-size", "4", "--alpha", "1e-4", "--bandwidth", "10"])
    cm = cli.build_cost_model(args)
    assert cm.ar.beta_s_per_byte == pytest.approx(2 * 3 / 4 / 10e9)


@pytest.mark.parametrize("argv, match", [
    (["--planner", "fastest"], "unknown planner 'fastest'"),
    (["--alpha", "1e-4"], "exactly one of --beta"),
    (["--beta", "1e-9"], "need --alpha"),
    (["--out", "x.md"], "--out goes with --sweep"),
    (["--sweep"], "--sweep runs the fixed Validation 1 grid; drop --profile"),
])
def test_bad_arguments_exit_2(argv, match, capsys):
    rc = cli.main(["--profile", str(DATA / "tiny_profile.json"), "--world-size", "2", *argv])
    assert rc == 2
    assert match in capsys.readouterr().err


def test_module_runs_on_shared_profile():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PIPEDAP_PROFILES_DIR=str(SHARED))
    res = subprocess.run([sys.executable, "-m", "lightning_pipedap.plan.cli", "--profile", "vgg16",
                          "--world-size", "8", "--planner", "wfbp"],
                         capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    prof = load_profile(SHARED / "vgg16.json")
    cm = CostModel.from_reference(SHARED / "alpha_beta.json", 8)
    expected = get_planner("wfbp")(prof, cm, 8).predicted_iteration_s
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("wfbp"))
    assert float(line.split()[3]) == pytest.approx(expected * 1e3, abs=1e-3)
    assert "profile vgg16: 16 layers" in res.stdout


def test_profile_and_world_size_required_without_sweep_and_sweep_takes_no_what_if(capsys):
    assert cli.main(["--world-size", "2"]) == 2
    assert "give --profile and --world-size (or --sweep)" in capsys.readouterr().err
    assert cli.main(["--sweep", "--beta-scale", "10"]) == 2  # the grid is fixed: no silently ignored option
    assert "drop --beta-scale" in capsys.readouterr().err


def test_sweep_prints_and_writes_the_table(tmp_path, monkeypatch, capsys):
    # the full grid takes ~30 s; the CLI path is the same on a one-model, one-worker-count grid
    full = cli.run_sweep
    monkeypatch.setattr(cli, "run_sweep", lambda **kw: full(SHARED, models=("vgg16",), world_sizes=(8,), **kw))
    out = tmp_path / "PLANNERS.md"
    out.write_text(f"# doc\n{sweep.SWEEP_BEGIN}\nstale\n{sweep.SWEEP_END}\ntail\n")
    assert cli.main(["--sweep", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| vgg16 |")]
    assert [r.split("|")[3].strip() for r in rows] == ["1", "10", "30"]
    prof = load_profile(SHARED / "vgg16.json")
    for r, k in zip(rows, (1.0, 10.0, 30.0)):
        cm = CostModel.from_reference(SHARED / "alpha_beta.json", 8, startup_sharing=0.0).scaled(beta_factor=k)
        cells = [c.strip() for c in r.strip("|").split("|")]
        for name, cell in zip(cli.ORDER, cells[3:8]):
            assert float(cell) == pytest.approx(get_planner(name)(prof, cm, 8).predicted_iteration_s * 1e3, abs=1e-3)
        lb = lower_bounds(prof, cm)
        assert float(cells[8]) == pytest.approx(lb.sum_bound_s * 1e3, abs=1e-3)
        assert float(cells[9]) == pytest.approx(lb.window_s * 1e3, abs=1e-3)
    assert "optimal <= every other planner on 3/3 rows" in printed
    text = out.read_text()
    assert text.startswith("# doc\n" + sweep.SWEEP_BEGIN) and text.endswith(sweep.SWEEP_END + "\ntail\n")
    assert "stale" not in text and printed.strip() in text


TINY = ["--profile", str(DATA / "tiny_profile.json"), "--world-size", "4", "--alpha", "2e-4", "--beta", "2e-9"]


def _row(out: str, name: str) -> list[str]:
    (row,) = [line.split() for line in out.splitlines() if line.split() and line.split()[0] == name]
    return row


@pytest.mark.parametrize("planner", ["optimal", "dear"])
def test_saved_schedule_simulates_to_the_same_iteration_time(planner, tmp_path, capsys):
    path = tmp_path / "s.json"
    assert cli.main([*TINY, "--planner", planner, "--save-schedule", str(path)]) == 0
    planned_out = capsys.readouterr().out
    assert f"wrote {path} (schedule of {planner})" in planned_out
    assert cli.main([*TINY, "--schedule", str(path)]) == 0
    loaded_out = capsys.readouterr().out
    assert _row(loaded_out, planner) == _row(planned_out, planner)  # buckets, ops, iteration, exposed, gap
    prof, cm = load_profile(DATA / "tiny_profile.json"), CostModel.from_allreduce(2e-4, 2e-9)
    planned = get_planner(planner)(prof, cm, 4)
    saved = Schedule.from_dict(json.loads(path.read_text()))
    assert saved == planned
    a, b = simulate(prof, cm, planned), simulate(prof, cm, saved)
    assert (b.iteration_s, b.exposed_comm_s) == (a.iteration_s, a.exposed_comm_s)
    assert float(_row(loaded_out, planner)[3]) == pytest.approx(a.iteration_s * 1e3, abs=1e-3)


@pytest.mark.parametrize("argv, match", [
    (["--save-schedule", "{dir}/s.json"], "--save-schedule writes one schedule: give --planner NAME"),
    (["--schedule", "{dir}/s.json", "--planner", "dear"], "--schedule simulates the saved schedule; drop --planner"),
    (["--schedule", "{dir}/missing.json"], "missing.json: no such file"),
    (["--schedule", "{dir}/bad.json"], "bad.json is not JSON (Expecting property name"),
    (["--schedule", "{dir}/cost.json"], "cost.json: not a schedule: format is 'lightning_pipedap.cost_model'"),
    (["--schedule", "{dir}/wide.json"], "wide.json: buckets must partition the 5 trainable parameters; missing [],"
                                        " out of range [5]"),
    (["--schedule", "{dir}/s.json", "--compression", "fp16"], "has no compression flags; drop --compression"),
])
def test_bad_schedule_arguments_exit_2(argv, match, tmp_path, capsys):
    (tmp_path / "s.json").write_text(json.dumps(Schedule(((0, 1, 2, 3, 4),), (Op(OpKind.ALL_REDUCE, 0),)).to_dict()))
    (tmp_path / "wide.json").write_text(json.dumps(Schedule(((0, 1, 2), (3, 4, 5)), (
        Op(OpKind.ALL_REDUCE, 1), Op(OpKind.ALL_REDUCE, 0))).to_dict()))
    (tmp_path / "bad.json").write_text("{not json")
    CostModel.from_allreduce(2e-4, 2e-9).save(tmp_path / "cost.json")
    rc = cli.main([*TINY, *[a.replace("{dir}", str(tmp_path)) for a in argv]])
    assert rc == 2
    assert match in capsys.readouterr().err


def test_simulate_module_runs_the_cli_from_any_directory(tmp_path):
    """``python -m lightning_pipedap.simulate`` (the documented command name) is the same CLI."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "lightning_pipedap.simulate", "--profile", "resnet50",
                          "--world-size", "8"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    direct = subprocess.run([sys.executable, "-m", "lightning_pipedap.plan.cli", "--profile", "resnet50",
                             "--world-size", "8"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.stdout == direct.stdout and "optimal" in out.stdout
