"""The app's default job (`pipedap-train` with no arguments: digits CNN, 2 processes, schedule optimal, 16 epochs)
ends with a finished plan selection and most of its steps in steady state (issue 28: it ended "unfinished", 46 of
368 steps in steady state). Run with its real config, its own empty α-β cache and no plan cache, in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.multiprocess


def test_the_default_job_finishes_its_selection_within_the_startup_budget(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, HYDRA_FULL_ERROR="0",
               PIPEDAP_CACHE_DIR=str(tmp_path / "cache"), PIPEDAP_PLAN_CACHE="off")
    for k in ("LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "NODE_RANK", "RANK"):
        env.pop(k, None)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "lightning_pipedap.app.train", f"hydra.run.dir={out}",
                           "trainer.enable_progress_bar=false"], cwd=str(tmp_path), env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads((out / "results.json").read_text())
    ran = res["pipedap"]
    assert ran["schedule"] == "optimal" and ran["plan_selection_status"] == "finished", ran["plan_selection"]
    steps = res["iteration_from_step"] + res["iteration_steps"]
    startup = ran["startup"]["total_steps"]
    # startup_budget 0.1; a trial window is never shorter than one settling and 2 measured steps, so the last window
    # may overrun the budget by up to that (CI, stop 33: 37 steps of 353 under load)
    assert startup <= 0.1 * steps + 3, (startup, steps)
    assert res["iteration_steps"] >= 0.7 * steps  # the goal: >= 70% of the steps in steady state
    assert ran["installed"]["name"] in {c["name"] for c in ran["candidates"] if c["chosen"]}
    summary = proc.stdout
    assert "candidates      " in summary and "(chosen)" in summary
    assert "communication   " in summary and "plan selection  unfinished" not in summary
    assert "pipedap: asked: optimal -> running: " in (out / "train.log").read_text()
