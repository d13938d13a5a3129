"""Which physical limit stops each benchmark cell: a decomposition of pipedap's measured iteration time.

Reads the JSON files of ``python -m lightning_pipedap.bench.matrix --json`` (and of the profile replay,
``python -m lightning_pipedap.bench.replay --json``: the same cell records under ``result``) and prints, for
each cell and each pipedap variant, the measured iteration time ``T`` against the lower bound
``max(C, N)`` of the same launch, where

* ``C`` = compute alone (``compute_s``: forward + backward + step with no communication),
* ``N`` = the gradients' communication alone (the faster of ``allreduce_s`` and ``rs_ag_s``: line rate plus
  the per-operation start-ups, on an idle machine),

and splits the gap ``T - max(C, N)`` into what the strategy's own timeline records (``wait_s``: the trainer's
waits on communication per iteration, i.e. exposed communication; ``comm_busy_s``: the communication
worker's busy time per iteration):

* **exposed** ``W`` = ``wait_s``; the dependency chain alone forces about ``2F`` of it, ``F`` =
  ``first_layer_comm_s`` (the first layer's gradient is complete only at the end of backward and needed
  whole at the start of the next forward, so its reduce-scatter and all-gather, or all-reduce, cannot
  overlap compute, whatever the schedule or the tensor partitioning);
* **compute slowed** = ``T - W - C``: the trainer's own time (compute, Python, update) above compute alone,
  which on this machine is the CPU that the communication threads, the ring's additions and the kernel's TCP
  work take from compute on the same 2 cores;
* **communication slowed** = ``B / N`` with ``B`` = ``comm_busy_s``: the same bytes take this much longer
  while compute runs (CPU per byte under contention).

A 16-bit wire variant (``@fp16``, ``@bf16``) is held to half of ``N`` and ``F``: half the bytes at the fp32
references' rate, so its "same bytes alone" is the line rate of the 16-bit bytes.

The limit named for a cell: where communication alone is longer than compute and the wire is busy at least 90%
of the iteration, the *line rate* (busy time within 10% of the bytes alone) or *CPU per byte* (busy time more
than 10% above it); otherwise the largest of compute slowed (*CPU shared*), exposed communication beyond
``2F`` (the schedule), the *dependency chain* ``2F``, and, where communication is the longer, the link's idle
time ``T - B`` (gradients not ready yet). A variant whose measured plan selection kept DDP's reducer has no
pipedap timeline: its row gives ``T`` against the bound only. Usage::

    python benchmarks/limits.py docs/data/bench_2026-12-01b.json docs/data/wire16_mlp_1gbit_run2.json \\
        docs/data/issue13_mlp.json docs/data/replay-2r-firstwindow.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Iterator, Optional

from lightning_pipedap.bench.matrix.spec import WIRE_SUFFIXES


def cells(path: str) -> Iterator[dict[str, Any]]:
    """The cell records of one matrix or replay JSON file (replay cells keep theirs under ``result``, with the
    ratio they replay, e.g. ``"paper*30"``, in ``ratio_spec``)."""
    with open(path) as f:
        data = json.load(f)
    for c in data.get("cells", []):
        if "result" in c:
            yield dict(c["result"], ratio_spec=(c.get("setup") or {}).get("ratio_spec"))
        else:
            yield c


def _where(cell: dict[str, Any]) -> str:
    """``"vgg16 1000mbit 2r"``, with the replayed ratio when it is not the real model's 1 Gbit/s one."""
    ratio = cell.get("ratio_spec")
    return (f"{cell.get('model')} {cell.get('link')} {cell.get('ranks')}r"
            + (f" ({ratio})" if ratio and ratio != "1gbit" else ""))


def decompose(cell: dict[str, Any], v: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The decomposition of one pipedap variant ``v`` of ``cell`` (times in s; see the module docstring), or
    None when the variant lacks the timeline fields (``wait_s``, ``comm_busy_s``) or the cell its references."""
    T, W, B = v.get("iter_s"), v.get("wait_s"), v.get("comm_busy_s")
    C = cell.get("compute_s")
    comm = [x for x in (cell.get("allreduce_s"), cell.get("rs_ag_s")) if x]
    if None in (T, W, B, C) or not comm or not B:
        return None
    N, F = min(comm), cell.get("first_layer_comm_s") or 0.0
    if any("@" + part in WIRE_SUFFIXES for part in v.get("name", "").split("@")[1:]):
        N, F = N / 2, F / 2  # (16-bit wire: half the bytes; the references were measured in fp32)
    bound = max(C, N)
    slowed = T - W - C
    ms = lambda s: f"{1e3 * s:.0f} ms"  # noqa: E731
    if N > C and B >= 0.9 * T:  # the wire is busy almost the whole iteration
        limit = (f"line rate (link busy {ms(B)} of {ms(T)})" if B <= 1.1 * N else
                 f"CPU per byte: the link is busy {ms(B)} of {ms(T)}, {B / N:.2f}x the same bytes alone")
    else:
        parts = {f"CPU shared: compute {ms(slowed)} slower than alone": slowed,
                 f"exposed communication {ms(W - 2 * F)} beyond the first layer's": W - 2 * F,
                 f"dependency chain: the first layer's {ms(2 * F)} exposed at both ends": min(W, 2 * F)}
        if N > C:
            parts[f"link idle {ms(T - B)}: gradients not ready (dependency chain)"] = T - B
        limit = max(parts, key=lambda k: parts[k])
    base = {x["name"]: x["iter_s"] for x in cell.get("variants", []) if x.get("iter_s")}
    return {"T": T, "bound": bound, "C": C, "N": N, "W": W, "F": F, "B": B, "slowed": slowed,
            "comm_x": B / N, "limit": limit, "vs_ddp": base.get("ddp", float("nan")) / T,
            "vs_tuned": base.get("ddp_tuned", float("nan")) / T}


def _row(cell: dict[str, Any], name: str, d: dict[str, Any]) -> str:
    ms = lambda s: f"{1e3 * s:.0f}"  # noqa: E731
    where = _where(cell)
    return (f"| {where} | {name} | {ms(d['T'])} | {ms(d['C'])} / {ms(d['N'])} | {d['T'] / d['bound']:.2f} | "
            f"{ms(d['W'])} ({ms(2 * d['F'])}) | {ms(d['slowed'])} | {d['comm_x']:.2f} | {_x(d['vs_ddp'])} | "
            f"{_x(d['vs_tuned'])} | {d['limit']} |")


def _x(ratio: float) -> str:
    """A ratio to a baseline, ``–`` when the file has no run of that baseline."""
    return "–" if ratio != ratio else f"{ratio:.2f}"


def _ddp_row(cell: dict[str, Any], name: str, v: dict[str, Any]) -> str:
    """A variant whose measured plan selection kept DDP's reducer (``torch_ddp``): no pipedap timeline to split,
    so only ``T`` against the bound and the baselines."""
    T, C = v["iter_s"], cell.get("compute_s")
    comm = [x for x in (cell.get("allreduce_s"), cell.get("rs_ag_s")) if x]
    where = _where(cell)
    base = {x["name"]: x["iter_s"] for x in cell.get("variants", []) if x.get("iter_s")}
    ratio = lambda k: f"{base[k] / T:.2f}" if k in base else "–"  # noqa: E731
    if C is None or not comm:
        return f"| {where} | {name} | {1e3 * T:.0f} | – | – | – | – | – | {ratio('ddp')} | {ratio('ddp_tuned')} | " \
               "DDP's reducer kept by the measured selection (no timeline) |"
    N = min(comm)
    return (f"| {where} | {name} | {1e3 * T:.0f} | {1e3 * C:.0f} / {1e3 * N:.0f} | {T / max(C, N):.2f} | – | – | – | "
            f"{ratio('ddp')} | {ratio('ddp_tuned')} | DDP's reducer kept by the measured selection (no pipedap "
            f"timeline): {1e3 * (T - max(C, N)):.0f} ms over the bound |")


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", help="bench.matrix / bench.replay JSON files")
    p.add_argument("--all", action="store_true", help="every pipedap variant (default: the uncompressed ones)")
    args = p.parse_args(argv)
    print("| cell | variant | T ms | C / N ms | T / bound | exposed W ms (2F) | compute slowed ms | comm busy / alone "
          "| vs ddp | vs ddp_tuned | limit |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    rows = 0
    for path in args.files:
        for cell in cells(path):
            for v in cell.get("variants", []):
                name = v.get("name", "")
                if not name.startswith("pipedap-") or (not args.all and "+" in name):
                    continue
                d = decompose(cell, v)
                if d is not None:
                    print(_row(cell, name, d))
                    rows += 1
                elif v.get("iter_s") and "torch_ddp" in (v.get("plan") or ""):
                    print(_ddp_row(cell, name, v))
                    rows += 1
    if not rows:
        print("(no pipedap variant with the timeline fields wait_s and comm_busy_s, or with DDP's reducer installed, "
              "in "
              f"{', '.join(args.files)}: not a bench.matrix / bench.replay results file, or run with --no-timeline)")


if __name__ == "__main__":
    main()
