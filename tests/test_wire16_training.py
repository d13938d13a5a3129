"""``wire_dtype=`` in training (``tests/wire16_cases.py``, one launch of 2 ranks).

Reference: fp32 DDP and DDP with PyTorch's ``fp16_compress_hook``. Neither is bit-comparable (the hook
rounds both addends and sums in fp16; the ring sums in fp32 and rounds the partial sum on the wire and
the result once, see ``tests/test_engine_wire16.py`` for the exact arithmetic), so after 3 epochs the
parameters must stay within the fp16 compressor's tolerance of them (1e-3, as
``test_compressed_training_through_the_engine``; 5e-3 for bf16's 8-bit mantissa), both ranks must
hold byte-identical parameters, and ``wire_dtype="fp32"`` must equal DDP to 1e-6.
"""

import json
from pathlib import Path

import pytest

from tests._dist_util import run_lightning_ranks

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("wire16") / "results.json"
    run_lightning_ranks(["-m", "tests.wire16_cases", str(out)], world=2, timeout_s=1200, cwd=str(ROOT))
    return json.loads(out.read_text())


@pytest.mark.multiprocess
def test_16bit_wire_trains_close_to_ddp_and_ranks_stay_identical(results):
    res = results["parity"]
    assert "error" not in res, res.get("error")
    assert 0.0 < res["hook_vs_ddp"] < 1e-3  # the hook reference really rounds
    for name, tol in (("dear_fp16", 1e-3), ("optimal_fp16", 1e-3), ("dear_bf16", 5e-3), ("dear_fp32", 1e-6)):
        r = res[name]
        assert r["vs_ddp"] <= tol, (name, r)
        assert r["ranks_identical"], name
    assert res["dear_fp16"]["vs_hook"] < 1e-3
    assert res["dear_fp16"]["vs_ddp"] > 0  # the wire really rounds
    assert "(4 wire16)" in res["dear_fp16"]["installed"] and "(4 wire16)" in res["dear_bf16"]["installed"]
    assert "wire16" not in res["dear_fp32"]["installed"]


@pytest.mark.multiprocess
def test_clip_by_norm_of_the_rounded_gradients_keeps_ranks_identical(results):
    res = results["clip"]
    assert "error" not in res, res.get("error")
    assert res["vs_ddp"] < 1e-3
    assert res["ranks_identical"]


@pytest.mark.multiprocess
def test_fp16_wire_overflow_is_seen_by_nonfinite(results):
    res = results["overflow"]
    assert "error" not in res, res.get("error")
    assert res["ddp_nonfinite"] == 0  # finite in fp32: only the fp16 wire overflows
    warn = res["fp16_warn"]
    assert warn["error"] is None and warn["nonfinite"] > 0  # the inf update applied
    assert len(warn["warnings"]) == 1 and "step 4: the averaged gradients are not finite" in warn["warnings"][0]
    skip = res["fp16_skip"]
    assert skip["error"] is None and skip["nonfinite"] == 0 and skip["max_diff"] < 1e-3  # vs DDP without step 4
    assert "the optimizer step is skipped on every rank" in skip["warnings"][0]
    assert res["fp16_raise"]["error"].startswith("NonFiniteGradientError: pipedap: step 4:")
    # the messages blame the fp16 wire, not a gradient DDP would see too
    for msg in (res["fp16_raise"]["error"], warn["warnings"][0], skip["warnings"][0]):
        assert "is sent in fp16 on the wire (wire_dtype='fp16')" in msg and "wire_dtype='bf16'" in msg, msg
    assert "as DDP" not in res["fp16_raise"]["error"] and "as DDP applies it" not in warn["warnings"][0]
    bf16 = res["bf16_raise"]  # bf16 keeps fp32's range: nothing to raise
    assert bf16["error"] is None and bf16["nonfinite"] == 0
