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
        path = Path(cache_dir) / f"alpha_beta-{AB._cache_key(comm)}.json"
        if rank == 0:  # what an earlier good fit left, and one written before fitted_at was recorded
            model = CostModel.from_allreduce(1e-4, 2e-9, meta={"source": "measured", "fitted_at": "2026-11-30 08:00:00 UTC"})
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
