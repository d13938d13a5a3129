"""What-if CLI ``python -m lightning_pipedap.simulate``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_pipedap import simulate as cli
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.planners import get_planner
from lightning_pipedap.plan.profile import load_profile
from lightning_pipedap.plan.simulator import lower_bounds

DATA = Path(__file__).resolve().parent / "data"
SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "profiles"
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
    for name, cols in rows.items():
        expected = get_planner(name)(prof, cm, 4).predicted_iteration_s
        assert float(cols[3]) == pytest.approx(expected * 1e3, abs=1e-3)
    assert float(rows["no_overlap"][6]) == pytest.approx(1.0)
    assert f"window {lower_bounds(prof, cm).window_s * 1e3:.3f} ms" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(1 for e in events if e["ph"] == "M" and e["name"] == "process_name") == len(cli.ORDER)
    assert any(e.get("cat") == "wait" for e in events)


def test_bandwidth_gives_ring_beta():
    args = cli.parse_args(["--profile", "x", "--world-size", "4", "--alpha", "1e-4", "--bandwidth", "10"])
    cm = cli.build_cost_model(args)
    assert cm.ar.beta_s_per_byte == pytest.approx(2 * 3 / 4 / 10e9)


@pytest.mark.parametrize("argv, match", [
    (["--planner", "fastest"], "unknown planner 'fastest'"),
    (["--alpha", "1e-4"], "exactly one of --beta"),
    (["--beta", "1e-9"], "need --alpha"),
])
def test_bad_arguments_exit_2(argv, match, capsys):
    rc = cli.main(["--profile", str(DATA / "tiny_profile.json"), "--world-size", "2", *argv])
    assert rc == 2
    assert match in capsys.readouterr().err


@pytest.mark.skipif(not (SHARED / "alpha_beta.json").is_file(), reason=f"shared profiles not found at {SHARED}")
def test_module_runs_on_shared_profile():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PIPEDAP_PROFILES_DIR=str(SHARED))
    res = subprocess.run([sys.executable, "-m", "lightning_pipedap.simulate", "--profile", "vgg16",
                          "--world-size", "8", "--planner", "wfbp"],
                         capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    prof = load_profile(SHARED / "vgg16.json")
    cm = CostModel.from_reference(SHARED / "alpha_beta.json", 8)
    expected = get_planner("wfbp")(prof, cm, 8).predicted_iteration_s
    line = next(l for l in res.stdout.splitlines() if l.startswith("wfbp"))
    assert float(line.split()[3]) == pytest.approx(expected * 1e3, abs=1e-3)
    assert "profile vgg16: 16 layers" in res.stdout
