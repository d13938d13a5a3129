"""The α-β fit on a live 2-rank gloo group says whether its model was fitted now or read from the cache."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

import lightning_pipedap.engine.collectives as C
import lightning_pipedap.probe.alpha_beta as AB
from lightning_pipedap.plan.cost_model import CostModel
from tests._dist_util import run_ranks


def _fit_then_cached(rank: int, world: int, cache_dir: str) -> dict:
    AB.CACHE_DIR = Path(cache_dir)
    comm = C.new_comm_group(timeout_s=60)
    try:
        fresh = AB.measure_cost_model(comm, torch.device("cpu"), max_bytes=64 << 10, min_bytes=4 << 10,
                                      repeats=1, use_cache=False)
        path = Path(cache_dir) / f"alpha_beta-{AB.cache_key(comm)}.json"
        if rank == 0:  # what an earlier good fit left, and one written before fitted_at was recorded
            model = CostModel.from_allreduce(1e-4, 2e-9,
                                             meta={"source": "measured", "fitted_at": "2026-11-30 08:00:00 UTC"})
            path.write_text(json.dumps(model.to_dict()))
        C.barrier()
        cached = AB.measure_cost_model(comm, torch.device("cpu"), max_bytes=64 << 10, min_bytes=4 << 10)
        C.barrier()
        if rank == 0:
            old = CostModel.from_allreduce(1e-4, 2e-9, meta={"source": "measured"})
            path.write_text(json.dumps(old.to_dict()))
            os.utime(path, (0, 86400))  # 1970-01-02
        C.barrier()
        undated = AB.measure_cost_model(comm, torch.device("cpu"), max_bytes=64 << 10, min_bytes=4 << 10)
        return {"fresh": fresh.meta, "cached": cached.meta, "cached_ar": (cached.ar.alpha_s, cached.ar.beta_s_per_byte),
                "undated": undated.meta, "path": str(path)}
    finally:
        C.destroy_comm_group(comm)


def test_a_cached_model_says_so_and_a_fresh_fit_says_when(tmp_path):
    out = run_ranks(_fit_then_cached, 2, str(tmp_path))
    path = out[0]["path"]
    for rank in (0, 1):
        fresh, cached, undated = out[rank]["fresh"], out[rank]["cached"], out[rank]["undated"]
        assert fresh["source"] == "measured" and fresh["fit_s"] > 0
        assert fresh["fitted_at"] == out[0]["fresh"]["fitted_at"]  # rank 0's time on every rank
        assert fresh["fitted_at"][:4] == time.strftime("%Y", time.gmtime())
        assert AB.describe_origin(fresh) == f"α-β model fitted on the live group in {fresh['fit_s']:.1f} s"
        assert out[rank]["cached_ar"] == (1e-4, 2e-9)
        assert AB.describe_origin(cached) == f"cached α-β model from {path} (fitted 2026-11-30 08:00:00 UTC)"
        assert AB.describe_origin(undated) == f"cached α-β model from {path} (fitted 1970-01-02 00:00:00 UTC)"


def _fit_wire16(rank: int, world: int, cache_dir: str) -> dict:
    import dataclasses

    from lightning_pipedap.plan.cost_model import AlphaBeta

    AB.CACHE_DIR = Path(cache_dir)
    comm = C.new_comm_group(timeout_s=60)
    try:
        kw = dict(max_bytes=1 << 20, min_bytes=16 << 10, repeats=1)
        fresh = AB.measure_cost_model(comm, torch.device("cpu"), wire_dtype="fp16", use_cache=False, **kw)
        path16 = Path(cache_dir) / f"alpha_beta-{AB.cache_key(comm)}-fp16.json"
        fp32_only = CostModel.from_allreduce(1e-4, 2e-9, meta={"source": "measured", "fitted_at": "x"})
        if rank == 0:  # a file without the 16-bit constants is not taken for them
            path16.write_text(json.dumps(fp32_only.to_dict()))
        C.barrier()
        refit = AB.measure_cost_model(comm, torch.device("cpu"), wire_dtype="fp16", **kw)
        C.barrier()
        if rank == 0:
            with16 = dataclasses.replace(fp32_only, rs16=AlphaBeta(1e-4, 1.5e-9), ag16=AlphaBeta(1e-4, 1.25e-9))
            path16.write_text(json.dumps(with16.to_dict()))
        C.barrier()
        cached = AB.measure_cost_model(comm, torch.device("cpu"), wire_dtype="fp16", **kw)
        return {"fresh": fresh.to_dict(), "refit": refit.to_dict(), "cached": cached.to_dict()}
    finally:
        C.destroy_comm_group(comm)


def test_a_16bit_wire_dtype_fits_its_own_rs_and_ag_and_caches_them_apart(tmp_path):
    """``wire_dtype="fp16"``: the reduce-scatter and all-gather are also timed in the 16-bit wire format and
    fitted over the fp32 bytes (``rs16``/``ag16``, non-negative, on the sizes of the fp32 fit), identical on
    every rank; the cache has a file of its own for them, and a cached model without them is measured again."""
    out = run_ranks(_fit_wire16, 2, str(tmp_path))
    for rank in (0, 1):
        fresh, refit, cached = (CostModel.from_dict(out[rank][k]) for k in ("fresh", "refit", "cached"))
        assert fresh.rs16 is not None and fresh.ag16 is not None
        assert fresh.meta["source"] == "measured" and fresh.meta["wire_dtype"] == "fp16"
        assert fresh.rs16.n_samples == fresh.rs.n_samples >= 3
        assert min(fresh.rs16.alpha_s, fresh.rs16.beta_s_per_byte, fresh.ag16.beta_s_per_byte) >= 0
        assert refit.meta["source"] == "measured" and refit.rs16 is not None
        assert cached.meta["source"] == "cached" and cached.rs16.beta_s_per_byte == 1.5e-9
        assert cached.ag16.beta_s_per_byte == 1.25e-9
        assert out[rank]["fresh"] == out[0]["fresh"]  # rank 0's fit on every rank
