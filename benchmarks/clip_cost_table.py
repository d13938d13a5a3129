"""The table of BENCHMARKS.md's "Exact clip-by-norm: what it costs (issue 26)" from a matrix launch, no run.

Reads a results JSON of ``python -m lightning_pipedap.bench.matrix --repeats N ... --json F`` with ``<s>`` and
``<s>@clip<v>`` variants, and optionally its ``--timeline-dir``; prints a Markdown table, per variant:

* the median iteration time of every round (the matrix keeps the fastest and lists all in its note) and their
  median;
* per round, clipped / unclipped of the same strategy, and each variant / ``ddp`` and / ``ddp@clip<v>`` (the
  variants of a round ran one after another in the same processes, so a ratio within a round is less exposed to
  a shared machine's load than one across rounds); the median over rounds;
* from rank 0's timeline dump (the last 3 iterations of the last round), medians over those iterations:
  *lead*, from the iteration's start (``on_train_batch_start``) to the first bucket update (no layer runs its
  forward with the new weights before it), and *comm in fwd*, the communication busy time between the
  iteration's start and its first reduce-scatter / all-reduce after that update (the previous step's
  all-gathers, and a late reduce-scatter);
* the matrix's own timeline columns, *wait* (time the training thread blocked in the timeline's ``wait``
  records) and *comm busy* per iteration, and the schedule the best round ran (with its trials)::

    python benchmarks/clip_cost_table.py docs/data/clip26_mlp_1gbit_2r.json --timelines docs/data/clip26_timelines_2r
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
from typing import Optional


def _overlap(r: dict, lo: float, hi: float) -> float:
    return max(0.0, min(r["end_ms"], hi) - max(r["start_ms"], lo))


def timeline_summary(path: str) -> dict[str, float]:
    """Medians over the dumped iterations of one ``--timeline-dir`` file: ``lead_ms``, ``comm_in_fwd_ms``,
    ``wait_ms`` and ``iter_ms`` (NaN where an iteration has no bucket update: DDP's reducer ran)."""
    with open(path) as f:
        d = json.load(f)
    starts, recs = d["iteration_starts_ms"], d["records"]
    rows = []
    for a, b in zip(starts[:-1], starts[1:]):
        inside = [r for r in recs if a <= r["start_ms"] < b]
        upd = [r["start_ms"] for r in inside if r["kind"] == "update"]
        lead = min(upd) if upd else None
        rs = [r["start_ms"] for r in inside if r["kind"] in ("RS", "AR") and lead is not None and r["start_ms"] > lead]
        first = min(rs) if rs else b
        comm = sum(_overlap(r, a, first) for r in recs if r["lane"] == "comm") if lead is not None else float("nan")
        wait = sum(r["end_ms"] - r["start_ms"] for r in inside if r["kind"] == "wait")
        rows.append((b - a, (lead - a) if lead is not None else float("nan"), comm, wait))
    if not rows:
        return {}
    med = [statistics.median(c) for c in zip(*rows)]
    return dict(iter_ms=med[0], lead_ms=med[1], comm_in_fwd_ms=med[2], wait_ms=med[3])


def _rounds(v: dict) -> list[float]:
    m = re.search(r"best of ([0-9/]+) ms", v.get("note") or "")
    return [float(x) for x in m.group(1).split("/")] if m else [v["iter_s"] * 1e3]


def _ratios(a: list[float], b: Optional[list[float]]) -> Optional[list[float]]:
    return None if b is None else [x / y for x, y in zip(a, b)]


def _cell(xs: Optional[list[float]], each: bool = False) -> str:
    if not xs:
        return "–"
    med = f"**{statistics.median(xs):.2f}**"
    return f"{med} ({' / '.join(f'{x:.2f}' for x in xs)})" if each else med


def table(results: str, timelines: Optional[str] = None) -> str:
    """The Markdown table (and a header line naming the cell's references) of the first cell of ``results``."""
    with open(results) as f:
        cell = json.load(f)["cells"][0]
    variants = {v["name"]: v for v in cell["variants"]}
    rounds = {n: _rounds(v) for n, v in variants.items()}
    ddp_clip = next((n for n in variants if n.startswith("ddp@clip")), None)
    tl = {}
    if timelines:
        for path in glob.glob(os.path.join(timelines, "*.json")):
            name = re.sub(r"^.*-\d+r-", "", os.path.basename(path)[:-5])
            tl[name] = timeline_summary(path)
    lines = [f"{cell['model']}, {cell['link']}, {cell['ranks']} ranks: compute-only {cell['compute_s'] * 1e3:.0f} ms, "
             f"gloo all-reduce {cell['allreduce_s'] * 1e3:.0f} ms, ring RS+AG {cell['rs_ag_s'] * 1e3:.0f} ms, "
             f"{min(len(r) for r in rounds.values())} rounds",
             "",
             "| variant | rounds ms | median ms | clip / no-clip | / ddp | / ddp@clip1 | lead ms | comm in fwd ms | "
             "wait ms | comm busy ms | ran (best round) |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, v in variants.items():
        base = name.split("@clip")[0] if "@clip" in name else None
        t = tl.get(name, {})
        ran = v.get("installed") or ("DDP" if name.startswith("ddp") else "")
        trials = [x for x in v.get("trials") or [] if x.get("measured_s") is not None]
        if trials:
            ran += " (trials: " + ", ".join(f"{x['name']} {x.get('deciding_s', x['measured_s']) * 1e3:.0f}"
                                           + (" chosen" if x["chosen"] else "") for x in trials) + ")"
        num = lambda key: "–" if key not in t or t[key] != t[key] else f"{t[key]:.0f}"  # noqa: E731 (NaN: –)
        wait = "–" if v.get("wait_s") is None else f"{v['wait_s'] * 1e3:.0f}"
        busy = "–" if v.get("comm_busy_s") is None else f"{v['comm_busy_s'] * 1e3:.0f}"
        lines.append(f"| {name} | {' / '.join(f'{x:.0f}' for x in rounds[name])} | "
                     f"{statistics.median(rounds[name]):.0f} | "
                     f"{_cell(_ratios(rounds[name], rounds.get(base)), each=True) if base else '–'} | "
                     f"{_cell(_ratios(rounds[name], rounds.get('ddp')))} | "
                     f"{_cell(_ratios(rounds[name], rounds.get(ddp_clip)))} | {num('lead_ms')} | "
                     f"{num('comm_in_fwd_ms')} | "
                     f"{wait} | {busy} | {ran} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", help="results JSON of a matrix launch (--json)")
    ap.add_argument("--timelines", default=None, help="its --timeline-dir")
    args = ap.parse_args()
    print(table(args.results, args.timelines))


if __name__ == "__main__":
    main()
