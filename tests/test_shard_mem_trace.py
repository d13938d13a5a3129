"""benchmarks/shard_mem_trace.py: the recorder's points (RSS now, the highest sample since the last point) and the
report around the highest sample, in-process (no ranks, no training)."""

from __future__ import annotations

from pathlib import Path


SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "shard_mem_trace.py"


def _load():
    from tests._dist_util import load_script

    return load_script(SCRIPT, "shard_mem_trace")


_SCENARIO = """
import json, torch
from tests.test_shard_mem_trace import _load
mod = _load()
rec = mod.Recorder(census=True, period_s=0.0005)
try:
    rec.point("before")
    big = torch.ones(64 * 2**20 // 4)  # (64 MiB, touched: resident)
    rec.point("allocated")
    del big
    rec.point("freed")
finally:
    rec.stop()
print(json.dumps(rec.points))
"""


def test_points_see_a_transient_allocation_and_the_report_names_where():
    # (in a fresh process: in the suite's long-lived one a 64 MiB block may come back from memory already resident)
    import json
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _SCENARIO], capture_output=True, text=True, timeout=120,
                         cwd=str(SCRIPT.parents[1]))
    assert res.returncode == 0, res.stderr
    points = json.loads(res.stdout.strip().splitlines()[-1])
    mod = _load()
    before, allocated, freed = points
    assert allocated["rss"] - before["rss"] > 48 and allocated["peak_since"] >= allocated["rss"]
    assert allocated["tensors"] - before["tensors"] > 48  # (the census sees the live tensor)
    assert freed["tensors"] < allocated["tensors"] - 48
    text = mod.report({"rank": 0, "variant": "x", "points": points}, around=1)
    assert "highest sample" in text and "allocated" in text.split("highest sample")[1]
