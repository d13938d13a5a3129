"""benchmarks/shard_mem_trace.py: the recorder's points (RSS now, the highest sample since the last point) and the
report around the highest sample, in-process (no ranks, no training)."""

from __future__ import annotations

from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "shard_mem_trace.py"


def _load():
    from tests._dist_util import load_script

    return load_script(SCRIPT, "shard_mem_trace")


def test_points_see_a_transient_allocation_and_the_report_names_where():
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
    before, allocated, freed = rec.points
    assert allocated["rss"] - before["rss"] > 48 and allocated["peak_since"] >= allocated["rss"]
    assert allocated["tensors"] - before["tensors"] > 48  # (the census sees the live tensor)
    assert freed["tensors"] < allocated["tensors"] - 48
    text = mod.report({"rank": 0, "variant": "x", "points": rec.points}, around=1)
    assert "highest sample" in text and "allocated" in text.split("highest sample")[1]
