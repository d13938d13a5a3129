"""Three-rank check of a few real-world cases (``tests/test_three_ranks.py`` starts 3 ranks; each ``Trainer`` joins
them). At 3 ranks a gradient's average depends on the order of the sums, so DDP itself gives different bits for
different bucket layouts: its *spread* is the largest difference between ``DDPStrategy`` runs with
``bucket_cap_mb`` 25, 0.002 and 0.0002 (every pair). Per case:

- ``ddp`` (bucket_cap_mb=25, the reference), ``ddp_small_buckets`` (0.002), ``ddp_tiny_buckets`` (0.0002), once
  each: ``spread`` (largest of the three pairwise differences);
- ``default_deterministic``: ``PipeDAPStrategy()`` with ``Trainer(deterministic=True)`` (the plan runs as the fixed
  ``dear`` schedule, ``strategy/runtime.py: timing_free_reason``), twice: ``repro``, the distance to the nearest DDP
  run (``vs_nearest_ddp``) and to the farthest (``vs_farthest_ddp``);
- ``default``: ``PipeDAPStrategy()`` without it, twice: the same numbers (two runs identical or not is reported:
  the plan comes from measured times, so the bucket layout, and with it the order of the sums, can differ);
- ``shard_deterministic``: ``PipeDAPStrategy(shard_optimizer=True)`` with ``deterministic=True`` (issue 30: each
  rank steps its shard; optimizer state compared after it is gathered back), twice, judged as
  ``default_deterministic``.

Run as a script on every rank::

    python -m tests.three_rank_cases OUT.json [case ...]      # no case names: THREE_RANK_CASES

Every rank's state is compared with the same rank of the other run (state DDP keeps per rank, a case's
``rank_local``, included); ``replicas`` compares ranks 1.. with rank 0 without the rank-local state.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist

from tests import realworld_cases as rc
from tests.realworld_models import CASES

THREE_RANK_CASES = ["mha", "nanogpt_tied", "clip_grad_norm_override", "resnet_batchnorm", "bert_finetune_clip_adamw",
                    "vqvae_ema_codebook", "nanogpt_muon"]
DDP_RUNS = ("ddp", "ddp_small_buckets", "ddp_tiny_buckets")
RUNS = {**dict.fromkeys(DDP_RUNS, 1), "default_deterministic": 2, "default": 2, "shard_deterministic": 2}


def _max_diff(a: list[dict], b: list[dict]) -> tuple[float, str]:
    """Largest difference between the same ranks of two fits, and the tensor where it is."""
    return max((rc._diff(x, y) for x, y in zip(a, b)), key=lambda t: t[0])


def run_case(name: str, xchg: rc.Exchange) -> dict[str, Any]:
    c = CASES[name]
    t0 = time.monotonic()
    res: dict[str, Any] = {"source": c.doc}
    if c.skip is not None:
        reason = next((r for r in xchg.swap(f"{name}.skip", c.skip()) if r), None)
        if reason:
            return {"skipped": reason}
    states: dict[str, list[list[dict]]] = {}
    for variant, runs in RUNS.items():
        for i in range(runs):
            outs = xchg.swap(f"{name}.{variant}.{i}", rc.fit(c, variant))
            if any(o is None for o in outs):
                raise TimeoutError(f"{name}/{variant}: a rank did not report (hung)")
            errs = [o for o in outs if o["status"] == "error"]
            if errs:
                rc.init_pg(xchg.root)
                res.setdefault("errors", {})[f"{variant}.{i}"] = errs[0]["error"]
                continue
            states.setdefault(variant, []).append([o["state"] for o in outs])
            res.setdefault("selection", {}).setdefault(variant, []).append(outs[0]["selection"])
            res.setdefault("wall_s", {}).setdefault(variant, []).append(outs[0]["wall_s"])
    if any(v not in states for v in DDP_RUNS):
        res["wall_s_total"] = round(time.monotonic() - t0, 1)
        return res
    ddp = [states[v][0] for v in DDP_RUNS]
    res["ddp_pairs"] = {f"{DDP_RUNS[i]}~{DDP_RUNS[j]}": _max_diff(ddp[i], ddp[j])[0]
                        for i in range(len(ddp)) for j in range(i + 1, len(ddp))}
    res["spread"] = max(res["ddp_pairs"].values())
    res["ddp_replicas"] = max(rc._replicas(d, lambda s: rc._model_part(s, c.rank_local)) for d in ddp)
    pl.seed_everything(0, verbose=False)
    init = {k: v.detach().clone() for k, v in c.build().model.state_dict().items()}
    res["ref_moved"] = rc._diff({k: v for k, v in ddp[0][0].items() if k in init}, init)[0]
    for variant in ("default_deterministic", "default", "shard_deterministic"):
        runs = states.get(variant)
        if not runs:
            continue
        out: dict[str, Any] = {}
        per_run = [[_max_diff(r, d) for d in ddp] for r in runs]  # each run against each DDP run
        out["vs_nearest_ddp"] = max(min(x[0] for x in row) for row in per_run)
        out["vs_farthest_ddp"], out["worst"] = max((x for row in per_run for x in row), key=lambda t: t[0])
        out["vs_each_ddp"] = [[x[0] for x in row] for row in per_run]
        out["replicas"] = max(rc._replicas(r, lambda s: rc._model_part(s, c.rank_local)) for r in runs)
        if len(runs) > 1:
            out["repro"] = _max_diff(runs[0], runs[1])[0]
        res[variant] = out
    res["wall_s_total"] = round(time.monotonic() - t0, 1)
    return res


def main(out_path: str, names: list[str]) -> None:
    import torch

    torch.set_num_threads(1)
    names = names or [n for n in os.environ.get("THREE_RANK_CASES", ",".join(THREE_RANK_CASES)).split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}")
    xchg = rc.Exchange(out_path + ".xchg")
    rc.init_pg(xchg.root)
    rc.freeze_heap()
    results: dict[str, Any] = {"_meta": {"cases": names, "world": rc.WORLD, "runs": RUNS}}
    t0 = time.monotonic()
    for name in names:
        try:
            results[name] = run_case(name, xchg)
        except TimeoutError as exc:
            results[name] = {"error": repr(exc)}
            results["_meta"]["aborted"] = repr(exc)
            if rc.RANK == 0:
                _write(out_path, results, t0)
            sys.stdout.flush()
            os._exit(3)
        except Exception as exc:
            results[name] = {"error": f"{exc!r}\n{traceback.format_exc()}"}
        if rc.RANK == 0:
            _write(out_path, results, t0)
            r = results[name]
            print(f"[three-ranks] {name}: "
                  + json.dumps({k: v for k, v in r.items() if k not in ("source", "selection")}, default=str)[:1500],
                  flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def _write(path: str, results: dict, t0: float) -> None:
    results["_meta"]["wall_s"] = round(time.monotonic() - t0, 1)
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1, default=lambda x: "inf" if x == math.inf else str(x))
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
