"""What exact clip-by-norm costs per step, measured with clipped and unclipped steps alternating in one fit.

On a shared machine the medians of separate runs move by 2x between rounds (BENCHMARKS.md, issue 26), far more
than the cost sought. Here every variant trains the matrix's bench model on the testbed (``--rate`` cap, one
network namespace per rank) with ``Trainer.gradient_clip_val`` switched every step after ``--warmup`` steps:
max norm ``--clip`` (algorithm norm) on even steps, off on odd ones. Adjacent iterations of the two kinds are
a second apart, so the machine's load hits both alike, and the per-pair difference is the cost.

Where the cost lands: under DDP in the clipped step's own iteration (the norm after backward); under pipedap
(deferred updates) in the *next* iteration, whose first bucket update waits for every all-gather of the clipped
step (``strategy/deferred.py: _clip_coefficient``). Iteration ``i`` is start-to-start of training batches ``i``
and ``i + 1`` (``on_train_batch_start``); per variant and round the script reports the median iteration after
a clipped step and after an unclipped one, and the median over adjacent pairs of their difference; for pipedap
also, from its timeline, the median *lead* of both kinds (iteration start -> first bucket update, which the
forward waits for)::

    python benchmarks/clip_alternate.py                                  # ddp and pipedap-dear, 2 ranks, 1 Gbit/s
    python benchmarks/clip_alternate.py --variants ddp,dear --pairs 30 --rounds 2 --json out.json

Variants: ``ddp`` (Lightning's ``"ddp"``) and pipedap schedules (``dear``, ``pipedap``, ...: ``PipeDAPStrategy(
schedule=..., plan_trials=1)``, the schedule installed without measured selection, whose trials would mix both
kinds of step). Needs root (the testbed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Optional

RESULT = "RESULT "


def _worker(cfg: dict) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipedap import PipeDAPStrategy
    from lightning_pipedap.bench.matrix.models import build_net, make_module
    from lightning_pipedap.bench.matrix.spec import PRESETS
    from lightning_pipedap.bench.matrix.worker import quiet_worker
    from lightning_pipedap.engine import collectives as C

    class Alternate(pl.Callback):
        """Start times of every batch; clip on even steps from ``first`` on, off otherwise."""

        pipedap_reads_model = False

        def __init__(self, first: int, clip: float) -> None:
            self.first, self.clip, self.starts, self.records = first, clip, [], []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.starts.append(time.perf_counter())
            i = len(self.starts) - 1
            trainer.gradient_clip_val = self.clip if i >= self.first and (i - self.first) % 2 == 0 else None

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.starts.append(time.perf_counter())
            take = getattr(trainer.strategy, "take_timeline", None)
            if take is not None:
                self.records = take()

    world = int(os.environ["WORLD_SIZE"])
    size = cfg.get("size", "bench")
    batch = PRESETS[cfg["model"]][size]["batch"]
    steps = cfg["warmup"] + 2 * cfg["pairs"]
    _, _, make_batch = build_net(cfg["model"], size)
    out: dict[str, Any] = {"runs": []}
    with quiet_worker():
        torch.set_num_threads(1)
        ds = TensorDataset(*make_batch(batch * (steps + 1) * world, torch.Generator().manual_seed(1234)))
        for r in range(cfg["rounds"]):
            for v in cfg["variants"]:
                pl.seed_everything(0, verbose=False)
                if v == "ddp":
                    strategy: Any = "ddp"
                else:
                    strategy = PipeDAPStrategy(schedule=v, plan_trials=1, replan_every=10**6, startup_budget=None)
                    strategy.timeline_enabled = True
                cb = Alternate(cfg["warmup"], cfg["clip"])
                trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, num_nodes=world,
                                     max_steps=steps, logger=False, enable_checkpointing=False,
                                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                     limit_val_batches=0, callbacks=[cb], gradient_clip_algorithm="norm")
                trainer.fit(make_module(cfg["model"], size), DataLoader(ds, batch_size=batch, shuffle=False))
                out["runs"].append(_summarise(v, r, cb.starts, cb.records, cfg["warmup"]))
        C.shutdown()
    return out


def _summarise(variant: str, rnd: int, starts: list[float], records: list, first: int) -> dict:
    """Per iteration from ``first`` on: duration, whether the previous step was clipped, lead (pipedap)."""
    its = []
    for i in range(first, len(starts) - 1):
        a, b = starts[i], starts[i + 1]
        upd = [rec.start_s for rec in records if rec.kind == "update" and a <= rec.start_s < b]
        its.append({"i": i, "ms": (b - a) * 1e3, "prev_clipped": (i - 1 - first) % 2 == 0,
                    "lead_ms": (min(upd) - a) * 1e3 if upd else None})
    return {"variant": variant, "round": rnd, "iterations": its}


def analyse(run: dict) -> dict:
    """Medians of one run. With strict alternation an iteration either runs a clipped step (its previous step was
    not clipped: ``own_ms``) or follows one (``after_ms``); ``pair_diff_ms`` is the median over each clipped step's
    iteration and the next one of ``after - own``: pipedap's cost (the next iteration waits), minus DDP's (the
    norm runs in the clipped step's own iteration). ``lead_*``: iteration start -> first bucket update."""
    its = run["iterations"]
    own = [x["ms"] for x in its if not x["prev_clipped"]]
    after = [x["ms"] for x in its if x["prev_clipped"]]
    diffs = [its[k + 1]["ms"] - its[k]["ms"] for k in range(len(its) - 1) if not its[k]["prev_clipped"]]
    lead_after = [x["lead_ms"] for x in its if x["prev_clipped"] and x["lead_ms"] is not None]
    lead_own = [x["lead_ms"] for x in its if not x["prev_clipped"] and x["lead_ms"] is not None]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"variant": run["variant"], "round": run["round"], "own_ms": med(own), "after_ms": med(after),
            "pair_diff_ms": med(diffs), "pairs": len(diffs), "lead_after_ms": med(lead_after),
            "lead_own_ms": med(lead_own)}


def _fmt(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.0f}"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="ddp,dear", help="ddp and/or pipedap schedule names (comma list)")
    ap.add_argument("--model", default="mlp", help="matrix model")
    ap.add_argument("--size", default="bench", help="matrix size preset (tiny: a smoke run)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rate", default="1gbit", help="tc rate of every host link, or 'none'")
    ap.add_argument("--pairs", type=int, default=30, help="clipped + unclipped step pairs per run")
    ap.add_argument("--warmup", type=int, default=8, help="unclipped steps first (pipedap traces and profiles)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the variants, in the same processes")
    ap.add_argument("--clip", type=float, default=1.0, help="max norm of the clipped steps")
    ap.add_argument("--json", default=None, help="write the raw iterations and the summary here")
    ap.add_argument("--timeout-s", type=float, default=3600.0)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        res = _worker(json.loads(args.worker))
        if int(os.environ.get("RANK", "0")) == 0:
            print(RESULT + json.dumps(res), flush=True)
        return 0
    from lightning_pipedap.testbed import Testbed, testbed_available

    ok, why = testbed_available()
    if not ok:
        print(f"testbed unavailable: {why}", file=sys.stderr)
        return 2
    cfg = dict(variants=[v.strip() for v in args.variants.split(",") if v.strip()], model=args.model, size=args.size,
               pairs=args.pairs,
               warmup=args.warmup, rounds=args.rounds, clip=args.clip)
    t0 = time.monotonic()
    with Testbed(hosts=args.ranks, rate=None if args.rate == "none" else args.rate) as tb:
        outs = tb.run_ranks([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)],
                            timeout_s=args.timeout_s, env={"OMP_NUM_THREADS": "1"})
    res = next(json.loads(line[len(RESULT):]) for line in outs[0].splitlines() if line.startswith(RESULT))
    summary = [analyse(r) for r in res["runs"]]
    print(f"{args.model}, {args.rate}, {args.ranks} ranks, {args.pairs} pairs per run, clip max norm {args.clip:g} "
          f"({time.monotonic() - t0:.0f} s)")
    print("| variant | round | clipped step's iteration ms | next iteration ms | next - clipped, per pair ms | "
          "lead: clipped step's / next ms |")
    print("|---|---:|---:|---:|---:|---|")
    for s in summary:
        print(f"| {s['variant']} | {s['round'] + 1} | {_fmt(s['own_ms'])} | {_fmt(s['after_ms'])} | "
              f"{_fmt(s['pair_diff_ms'])} ({s['pairs']} pairs) | "
              f"{_fmt(s['lead_own_ms'])} / {_fmt(s['lead_after_ms'])} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg,
                       "command": " ".join(["python benchmarks/clip_alternate.py", *(argv or sys.argv[1:])]),
                       "date": time.strftime("%Y-%m-%d %H:%M"), "summary": summary, "runs": res["runs"]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
