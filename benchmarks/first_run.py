"""What a user pays on a first and a second run: fit time, start-up and steady-state share, DDP vs pipedap.

Runs the Hydra app's jobs (``pipedap-train``, 2 CPU processes) as separate processes, interleaved over ``--rounds``
rounds in one launch so that load on a shared machine hits every variant alike:

* ``ddp``: ``strategy=ddp``;
* ``pipedap-first``: ``strategy=pipedap`` with an empty plan cache (trace, profiling, measured selection);
* ``pipedap-second``: the same job again with the cache the first one wrote (the plan is installed after the
  trace step and only verified).

For each experiment and variant it prints the best (lowest fit time) of the rounds and the median: fit time (s),
the ratio to DDP's fit time in the same round, start-up steps and seconds (trace + profiling + trials), the share
of the fit's steps in steady state and the steady-state iteration time::

    python benchmarks/first_run.py                       # the default job (`pipedap-train`), 2 rounds
    python benchmarks/first_run.py --experiments default,gpt_stdlib --rounds 2 --markdown out.md

Each job writes its ``results.json`` under ``--out`` (a temporary folder by default); the plan cache of a round
lives in its own folder, so every round's first run starts from nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

VARIANTS = ("ddp", "pipedap-first", "pipedap-second")


def run_job(experiment: str, variant: str, out_dir: Path, cache_dir: Path, timeout_s: float) -> dict[str, Any]:
    """One ``pipedap-train`` job; returns its ``results.json`` plus ``wall_s`` (s), or ``{"error": ...}``."""
    overrides = ([] if experiment == "default" else [f"experiment={experiment}"]) + [f"hydra.run.dir={out_dir}"]
    if variant == "ddp":
        overrides.append("strategy=ddp")
    else:
        overrides.append(f"strategy.plan_cache={cache_dir}")
    env = dict(os.environ, PIPEDAP_CACHE_DIR=str(cache_dir), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "lightning_pipedap.app.train", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    results = out_dir / "results.json"
    if proc.returncode != 0 or not results.exists():
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-2000:]}"}
    res = json.loads(results.read_text())
    res["wall_s"] = wall
    return res


def summarise(res: dict[str, Any]) -> dict[str, Optional[float]]:
    """Fit time (s), start-up steps and seconds, steady-state share of the steps, iteration time (ms)."""
    ran = res.get("pipedap") or {}
    startup = ran.get("startup") or {}
    steps_total = (res.get("iteration_steps") or 0) + (res.get("iteration_from_step") or 0)
    start_steps = startup.get("total_steps", res.get("startup_steps"))
    steady = res.get("iteration_steps")
    return {"fit_s": res.get("fit_s"), "startup_steps": start_steps, "startup_s": startup.get("total_s"),
            "steady_share": (steady / steps_total) if steady and steps_total else None,
            "iteration_ms": res.get("iteration_ms"), "plan_cache": ran.get("plan_cache"),
            "installed": (ran.get("installed") or {}).get("name")}


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiments", default="default",
                    help="comma-separated conf/experiment names; 'default' = the app's default job (no experiment=)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="folder for the jobs' outputs (default: a temporary folder)")
    ap.add_argument("--timeout-s", type=float, default=1200.0, help="per job")
    ap.add_argument("--markdown", default=None, help="also write the table to this file")
    args = ap.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="first_run_"))
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for experiment in args.experiments.split(","):
        for r in range(args.rounds):
            cache = root / f"{experiment}-cache-{r}"
            for variant in VARIANTS:  # (the second run needs the first's cache: same round, in this order)
                res = run_job(experiment, variant, root / f"{experiment}-{variant}-{r}", cache, args.timeout_s)
                row = {"error": res["error"]} if "error" in res else summarise(res)
                rows.setdefault((experiment, variant), []).append(row)
                print(f"[{experiment} round {r + 1}] {variant}: {row}", flush=True)
    lines = ["| experiment | variant | fit s (best / median) | x DDP fit (same round, median) | start-up steps | "
             "start-up s | steady-state share | iteration ms | plan cache | installed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (experiment, variant), runs in rows.items():
        ok = [x for x in runs if "error" not in x and x.get("fit_s")]
        if not ok:
            lines.append(f"| {experiment} | {variant} | failed: {runs[0].get('error', '?')[:80]} | | | | | | | |")
            continue
        ddp = [x.get("fit_s") for x in rows.get((experiment, "ddp"), [])]
        ratios = [x["fit_s"] / d for x, d in zip(runs, ddp) if "error" not in x and d]
        best = min(ok, key=lambda x: x["fit_s"])

        def fmt(v: Any, spec: str) -> str:
            return "–" if v is None else format(v, spec)

        lines.append(f"| {experiment} | {variant} | {best['fit_s']:.1f} / "
                     f"{statistics.median(x['fit_s'] for x in ok):.1f} "
                     f"| {fmt(statistics.median(ratios) if ratios else None, '.2f')} "
                     f"| {fmt(best['startup_steps'], 'd') if isinstance(best['startup_steps'], int) else '–'} "
                     f"| {fmt(best['startup_s'], '.1f')} | {fmt(best['steady_share'], '.0%')} "
                     f"| {fmt(best['iteration_ms'], '.2f')} | {best.get('plan_cache') or '–'} "
                     f"| {best.get('installed') or '–'} |")
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")


if __name__ == "__main__":
    main()
