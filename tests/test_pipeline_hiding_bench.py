"""benchmarks/pipeline_hiding.py: the bucket layout, the bound arithmetic and one tiny end-to-end run.

No timing assertions: the end-to-end run checks the JSON structure and invariants that hold on any
machine (shares in [0, 1], fp16's ratio of exactly 2, inline == pipelined decompressed gradients,
inline compression fully exposed, pipelined exposure bounded by the compression time plus hand-off
latency). It starts one helper process (a few seconds).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline_hiding.py"


@pytest.fixture(scope="module")
def bench():
    from tests._dist_util import load_script

    yield load_script(SCRIPT, "pipeline_hiding_bench")
    sys.modules.pop("pipeline_hiding_bench", None)


def test_mlp_buckets_match_25mib_fusion(bench):
    # one Linear(1024, 1024) = 1,048,576 + 1,024 elements = 4,198,400 bytes; 6 fit under 25 MiB = 26,214,400 B
    b = bench.mlp_buckets(cap_mb=25)
    layer = 1024 * 1024 + 1024
    assert b.numels == (6 * layer, 6 * layer, 4 * layer + 10 * 1024 + 10)
    assert sum(b.numels) == 16_803_850
    assert b.layouts[0][0] == ("0.weight", (1024, 1024)) and b.layouts[0][1] == ("0.bias", (1024,))
    assert b.layouts[2][-1] == ("32.bias", (10,))
    # a 5 MiB cap holds one layer (weight + bias); the 10-class head joins the last layer
    assert bench.mlp_buckets(cap_mb=5).numels == (layer,) * 15 + (layer + 10 * 1024 + 10,)


def test_equal_buckets_near_square(bench):
    b = bench.equal_buckets(4096, 3)
    assert b.numels == (4096,) * 3 and b.layouts[1] == (("b1.grad", (64, 64)),)
    assert bench.equal_buckets(6, 1).layouts[0][0][1] == (2, 3)
    with pytest.raises(ValueError, match="--numel-per-bucket"):
        bench.equal_buckets(0, 2)


def test_min_exposed_and_hidden_share(bench):
    # bucket 1 submitted at 0.1 s with 0.15 s of work ends at 0.25; bucket 0 (0.2 s) starts at 0.25, ends at 0.30
    assert bench.min_exposed_s([0.2, 0.1], [0.05, 0.15], 0.30) == pytest.approx(0.0, abs=1e-12)
    assert bench.min_exposed_s([0.2, 0.1], [0.05, 0.15], 0.28) == pytest.approx(0.02)
    # helper idle until the last submit: only the last bucket is exposed
    assert bench.min_exposed_s([0.5, 0.1], [0.04, 0.01], 0.5) == pytest.approx(0.04)
    assert bench.hidden_share([0.02], [0.2]) == pytest.approx(0.9)
    assert bench.hidden_share([0.3], [0.2]) == 0.0  # waited longer than the helper worked: clamped
    assert bench.hidden_share([0.0], [0.0]) is None


def test_bad_arguments_name_valid_choices(bench):
    with pytest.raises(ValueError, match="valid names: .*fp16"):
        bench.main(["--methods", "fp16,zip"])
    with pytest.raises(ValueError, match="--backward-ms"):
        bench.main(["--backward-ms", "0"])


def test_tiny_run_json_invariants(bench, tmp_path):
    out = tmp_path / "hiding.json"
    backward_ms = 100.0  # long enough that an exposure counting the backward would break the bound below
    res = bench.main(["--numel-per-bucket", "4096", "--buckets", "3", "--repeats", "2", "--warmup", "1",
                      "--methods", "fp16", "--backward-ms", str(backward_ms), "--json", str(out)], log=lambda *_: None)
    data = json.loads(out.read_text())
    assert data["summary"] == res["summary"] and data["summary"].startswith("summary: ")
    assert set(data) == {"cpu", "config", "calibration", "methods", "table", "summary"}
    assert data["cpu"]["usable_cores"] == len(data["cpu"]["affinity"]) == len(os.sched_getaffinity(0))
    assert data["cpu"]["helper_has_own_core"] == (len(os.sched_getaffinity(0)) >= 2)
    assert data["config"]["buckets"] == [4096, 4096, 4096]

    cal = data["calibration"]
    assert len(cal["segment_units"]) == 3 and min(cal["segment_units"]) >= 1
    # equal buckets get equal shares; rounding moves each by at most half a unit
    assert len(set(cal["segment_units"])) == 1
    if backward_ms / 3 > cal["unit_ms"]:
        assert abs(sum(cal["segment_units"]) * cal["unit_ms"] - backward_ms) <= 1.5 * cal["unit_ms"] + 1e-9

    (m,) = data["methods"]
    assert m["method"] == "fp16" and m["kwargs"] == {}
    assert m["ratio"] == 2.0  # [n] fp32 -> [n] fp16
    assert m["parity_max_abs_diff"] == 0.0  # inline and helper decompress the same gradient identically
    assert m["skipped_rounds"] == 1
    assert "compress_ms" not in m["dense"]
    for mode in ("dense", "inline", "process"):
        s = m[mode]
        assert s["iterations"] == 2 and len(s["iter_ms_all"]) == 2
        for it, comp in zip(s["iter_ms_all"], s["compute_ms_all"]):
            assert it >= comp - 1e-3  # the compute segments lie inside the iteration
    for mode in ("inline", "process"):
        s = m[mode]
        assert 0.0 <= s["hidden_share"] <= 1.0
        assert all(c > 0 for c in s["compress_ms_all"])
        expect = max(0.0, 1.0 - sum(s["exposed_ms_all"]) / sum(s["compress_ms_all"]))
        assert s["hidden_share"] == pytest.approx(min(1.0, expect), abs=1e-9)
    # inline: compression runs inside the trainer's calls, so all of it is exposed
    assert all(e >= c for e, c in zip(m["inline"]["exposed_ms_all"], m["inline"]["compress_ms_all"]))
    assert m["inline"]["hidden_share"] == 0.0
    # pipelined: the trainer never waits longer than the helper's work plus hand-off latency (50 ms slack for a
    # loaded machine; far below the 100 ms backward, so counting backward time as exposed would fail here)
    for e, c in zip(m["process"]["exposed_ms_all"], m["process"]["compress_ms_all"]):
        assert e <= c + 50.0
    assert 0.0 <= m["hidden_bound"] <= 1.0 and 0.0 <= m["hidden_share_end_to_end"] <= 1.0
    assert m["speedup_pipelined_vs_inline"] == pytest.approx(m["inline"]["iter_ms"] / m["process"]["iter_ms"])
    assert math.isfinite(m["helper_start_s"]) and m["helper_start_s"] > 0
    assert "| fp16 |" in data["table"]
