"""Mid-epoch resume with compression equals the uninterrupted run (2 gloo ranks, Lightning).

The run stops at step 8 of 18 with a checkpoint and resumes from it; the checkpoint carries the
final schedule (so the resumed run installs it directly: no trace or profiling steps, which would
run uncompressed) and every rank's compression state (error-feedback residuals, PowerSGD factors,
step counters) per parameter name. All cases run in one launch of 2 processes; this file is also
the script each rank runs::

    LOCAL_RANK=r WORLD_SIZE=2 ... python -m tests.test_compress_state_resume OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-6

# name -> PipeDAPStrategy keyword arguments. Schedule "pipedap": a planned schedule (trace, 3 profiling
# steps, then the plan) that compresses every bucket ("optimal" compresses only where it pays, which
# can be nowhere for this tiny model). Resume without compression is tested in test_parity.py.
VARIANTS = {
    "fp16": {"schedule": "pipedap", "compression": "fp16", "compression_mode": "inline"},
    "powersgd": {"schedule": "pipedap", "compression": "powersgd", "compression_mode": "process",
                 "compression_kwargs": {"rank": 2, "min_compression_rate": 1.0}},
}


def _resume(variant: str) -> dict:
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_pipedap import PipeDAPStrategy
    from tests.parity_cases import _shared_dir, max_diff, train

    def strategy() -> PipeDAPStrategy:
        return PipeDAPStrategy(bucket_cap_mb=0.002, **VARIANTS[variant])

    kw = {"opt": "adamw", "sched": "step"}
    full = train("mlp", kw, {}, strategy())
    out = {}
    with tempfile.TemporaryDirectory() as d:
        d = _shared_dir(d)
        cb = ModelCheckpoint(dirpath=d, every_n_train_steps=8, save_top_k=-1, filename="mid-{step}")
        train("mlp", kw, {}, strategy(), callbacks=[cb], max_steps=8, root_dir=d)
        path = os.path.join(d, "mid-step=8.ckpt")
        ckpt = torch.load(path, weights_only=True)  # plain data only: Lightning's default loader reads it
        plan = ckpt.get("pipedap_plan")
        out["plan_buckets"] = None if plan is None else len(plan["final_schedule"]["buckets"])
        entry = ckpt.get("pipedap_compression")
        if entry is not None:
            out["entry"] = {k: entry[k] for k in ("version", "compressor", "world_size")}
            out["ranks"] = len(entry["per_rank"])
            per_rank = entry["per_rank"]
            out["params"] = sorted(per_rank[0]["params"])
            out["steps"] = sorted({p["step"] for p in per_rank[0]["params"].values()})
            res = [torch.cat([p["residual"].reshape(-1) for _, p in sorted(r["params"].items())
                              if p["residual"] is not None] or [torch.zeros(1)]) for r in per_rank]
            out["residual_abs_max"] = float(max(r.abs().max() for r in res))
            out["residuals_differ_by_rank"] = not torch.equal(res[0], res[1])
            out["q_factors"] = sum("q" in p["tensors"] for p in per_rank[0]["params"].values())
        resumed_strategy = strategy()
        resumed = train("mlp", kw, {}, resumed_strategy, ckpt_path=path, root_dir=d)
    # bucket updates applied in deferred mode (after the final schedule is installed) by the resumed run
    out["resumed_deferred_updates"] = sum(resumed_strategy.update_counts.values())
    out["diff"] = max_diff(resumed, full)
    out["full"] = {k: v.tolist() for k, v in full.items()}
    return out


def main(out_path: str) -> None:
    import torch

    torch.set_num_threads(1)
    results = {}
    for name in VARIANTS:
        try:
            results[name] = _resume(name)
        except Exception as exc:  # one failing case must not hide the others
            import traceback

            results[name] = {"error": f"{exc!r}\n{traceback.format_exc()}"}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


@pytest.fixture(scope="module")
def resume_results(tmp_path_factory):
    from tests._dist_util import run_lightning_ranks

    out = tmp_path_factory.mktemp("resume") / "results.json"
    run_lightning_ranks(["-m", "tests.test_compress_state_resume", str(out)], world=2, timeout_s=600, cwd=str(ROOT))
    return json.loads(out.read_text())


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_resume_mid_epoch_with_compression_equals_uninterrupted(resume_results, variant):
    res = resume_results[variant]
    assert "error" not in res, res.get("error")
    assert res["diff"] <= TOL, f"{variant}: max |param(resumed) - param(uninterrupted)| = {res['diff']:.3e}"
    # no re-trace, no re-profiling: all 10 remaining steps (18 - 8) ran with the final schedule
    assert res["plan_buckets"] and res["resumed_deferred_updates"] == 10 * res["plan_buckets"]
    assert res["entry"] == {"version": 1, "compressor": variant, "world_size": 2} and res["ranks"] == 2
    assert res["params"] == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight", "net.4.bias", "net.4.weight"]
    # compressed from step 4 (after 1 trace + 3 profiling steps) to step 7: 4 compress calls per bucket
    assert res["steps"] == [4]
    if variant == "powersgd":
        assert res["residual_abs_max"] > 1e-4 and res["residuals_differ_by_rank"]  # per-rank error memory
        assert res["q_factors"] == 3  # one warm-start Q per weight matrix; biases are sent dense


@pytest.mark.multiprocess
def test_powersgd_changes_the_trajectory(resume_results):
    """PowerSGD really compressed (else its resume parity above would prove little): its trajectory
    leaves the fp16 one (itself within 1e-3 of the uncompressed run, see test_parity.py)."""
    import torch

    full = {v: {k: torch.tensor(x) for k, x in resume_results[v]["full"].items()} for v in VARIANTS}
    diff = max(float((full["powersgd"][k] - full["fp16"][k]).abs().max()) for k in full["fp16"])
    assert diff > 1e-3, diff


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(sys.argv[1])
