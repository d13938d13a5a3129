"""The driver of the benchmark matrix: one testbed launch per cell (:func:`run_cell`) and the command-line
entry point (:func:`main`), which also re-enters as the worker of one rank (``--worker``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Optional, Sequence

from lightning_pipedap.bench.matrix.args import PROG, parse_args
from lightning_pipedap.bench.matrix.models import DEFAULT_OPTIMIZER, OPTIMIZERS
from lightning_pipedap.bench.matrix.report import (format_text_report, machine_description, quick_line, render_markdown,
                                                   replace_marked_section, write_chart)
from lightning_pipedap.bench.matrix.results import CellResult, combine
from lightning_pipedap.bench.matrix.spec import (CLIP_SUFFIX, COMPRESS_SEP, COMPRESSOR_KWARGS, DEFAULT_PIPEDAP,
                                                 INLINE_SUFFIX, LINKS, MODELS, NICE_SUFFIX, PIPEDAP_PREFIX, PLAN_TRIALS,
                                                 PRESETS, QUICK_PLAN_TRIALS, QUICK_TRIAL_ROUNDS, QUICK_TRIAL_STEPS,
                                                 SHARD_SUFFIX,
                                                 TRIAL_ROUNDS, TRIAL_STEPS, WIRE_SUFFIXES, compressor_names,
                                                 valid_strategies)

#: the module every rank runs (``python -m <this> --worker <spec JSON>``)
WORKER_MODULE = "lightning_pipedap.bench.matrix"
RESULT_PREFIX = "RESULT "


def worker_spec(model: str, link: str, args: argparse.Namespace) -> dict:
    """The JSON-able settings one cell's workers run with (:func:`~lightning_pipedap.bench.matrix.worker.worker`).

    ``args`` may carry ``model_options`` (a dict, the replay model's), ``trial_steps``, ``plan_trials`` and
    ``trial_rounds`` (the measured plan selection; defaults: the strategy's, or the quick ones with ``quick``).
    """
    quick = bool(args.quick)
    return dict(model=model, size=args.size, model_options=getattr(args, "model_options", None),
                batch=args.batch or PRESETS[model][args.size]["batch"], steps=args.steps,
                warmup=args.warmup, strategies=list(args.strategies), ddp_bucket_mb=list(args.ddp_bucket_mb),
                sweep_steps=args.sweep_steps, repeats=args.repeats, quick=quick,
                trial_steps=getattr(args, "trial_steps", None) or (QUICK_TRIAL_STEPS if quick else TRIAL_STEPS),
                plan_trials=getattr(args, "plan_trials", None) or (QUICK_PLAN_TRIALS if quick else PLAN_TRIALS),
                trial_rounds=getattr(args, "trial_rounds", None) or (QUICK_TRIAL_ROUNDS if quick else TRIAL_ROUNDS),
                threads=args.threads, watts=args.watts, timeline=bool(args.timeline), link=link,
                weight_reader=bool(args.weight_reader), optimizer=getattr(args, "optimizer", DEFAULT_OPTIMIZER),
                timeline_dir=os.path.abspath(args.timeline_dir) if args.timeline_dir else None)


def run_cell(model: str, link: str, ranks: int, args: argparse.Namespace) -> CellResult:
    """Launch one cell on a fresh testbed and return its combined result. ``link`` is a ``tc`` rate string
    (``"1gbit"``, ``"237mbit"``) or ``"none"`` (uncapped).

    Raises:
        TestbedUnavailable: namespaces cannot be created here (not root, no iproute2).
        RuntimeError / TimeoutError: from :meth:`Testbed.run_ranks` (a rank failed / ran past the timeout),
            or fewer ranks than launched reported a result.
    """
    from lightning_pipedap.testbed import Testbed

    spec = worker_spec(model, link, args)
    rate = None if link == "none" else link
    with tempfile.TemporaryDirectory(prefix="pipedap-matrix-") as cache, Testbed(hosts=ranks, rate=rate) as tb:
        # a per-cell α-β cache: the planned schedules of this cell share one measurement of this link
        env = {"OMP_NUM_THREADS": str(args.threads), "PIPEDAP_CACHE_DIR": cache}
        outs = tb.run_ranks([sys.executable, "-m", WORKER_MODULE, "--worker", json.dumps(spec)],
                            timeout_s=args.cell_timeout_s, env=env)
    raw = [json.loads(line[len(RESULT_PREFIX):]) for o in outs for line in o.splitlines()
           if line.startswith(RESULT_PREFIX)]
    if len(raw) != ranks:
        raise RuntimeError(f"{len(raw)} of {ranks} ranks reported a result; rank 0 output tail:\n{outs[0][-3000:]}")
    return combine(model, link, raw, spec["batch"])


def _render_outputs(cells: list[CellResult], meta: dict, args: argparse.Namespace) -> None:
    """Write whichever of ``--json``, ``--markdown`` and ``--chart`` were asked for."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "cells": [asdict(c) for c in cells]}, f, indent=1)
    if args.markdown:
        old = ""
        if os.path.exists(args.markdown):
            with open(args.markdown) as f:
                old = f.read()
        with open(args.markdown, "w") as f:
            f.write(replace_marked_section(old, render_markdown(cells, meta)))
    if args.chart and cells:
        write_chart(cells, args.chart)


def print_list(compressors: Sequence[str]) -> None:
    """``--list``: the valid models, links, strategies and compressors."""
    print("models:", ", ".join(MODELS))
    print("links:", ", ".join(LINKS))
    print("strategies:", ", ".join(valid_strategies(compressors)))
    print(f"  (also any {PIPEDAP_PREFIX}<schedule>{COMPRESS_SEP}<compressor>[{INLINE_SUFFIX}]; "
          f"'all' = the above without {INLINE_SUFFIX}, {'/'.join(WIRE_SUFFIXES)}, {CLIP_SUFFIX} and {SHARD_SUFFIX}; "
          "any pipedap form may end in "
          f"{NICE_SUFFIX}<N>, N in 1..19: train_thread_nice=N; an uncompressed one in {' or '.join(WIRE_SUFFIXES)}: "
          f"wire_dtype, or in @part<MiB>: partition_mb; an uncompressed fp32 one with a planned schedule in "
          f"@margin<percent>: torch_ddp_margin; ddp and any uncompressed pipedap form in {CLIP_SUFFIX}<max_norm>: "
          f"Trainer(gradient_clip_val=max_norm, gradient_clip_algorithm='norm'); any uncompressed pipedap form "
          f"without @part in {SHARD_SUFFIX}: shard_optimizer=True)")
    print("optimizers (--optimizer):", ", ".join(OPTIMIZERS), f"(default {DEFAULT_OPTIMIZER})")
    print("compressors:", ", ".join(compressor_names()),
          f"(kwargs: {'; '.join(f'{k} {v}' for k, v in COMPRESSOR_KWARGS.items())})")


def _from_json(args: argparse.Namespace) -> None:
    """``--from-json``: print the text report of every cell in the file and render the outputs again."""
    with open(args.from_json) as f:
        data = json.load(f)
    cells = [CellResult.from_dict(c) for c in data["cells"]]
    for c in cells:
        print(format_text_report(c))
    _render_outputs(cells, data["meta"], args)


def _run_matrix(args: argparse.Namespace, argv: Optional[Sequence[str]]) -> int:
    """Every cell of ``args`` in turn; outputs are rewritten after each cell. Returns the exit status."""
    from lightning_pipedap.testbed import TestbedUnavailable, testbed_available

    ok, why = testbed_available()
    if not ok:
        print(f"testbed unavailable: {why}", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    cmd = PROG + " " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = dict(machine=machine_description(), command=cmd.strip(), date=time.strftime("%Y-%m-%d %H:%M"),
                optimizer=args.optimizer, steps=args.steps, warmup=args.warmup, threads=args.threads, watts=args.watts,
                weight_reader=bool(args.weight_reader))
    cells: list[CellResult] = []
    for model in args.models:
        for ranks in args.ranks:
            for link in args.links:
                t0 = time.monotonic()
                try:
                    cell = run_cell(model, link, ranks, args)
                except TestbedUnavailable as exc:
                    print(f"testbed unavailable: {exc}", file=sys.stderr)
                    return 2
                cells.append(cell)
                print(format_text_report(cell) + f"\n  ({time.monotonic() - t0:.0f} s)", flush=True)
                meta["wall_s"] = time.monotonic() - t_start
                _render_outputs(cells, meta, args)  # partial results survive a later failure
    if args.quick:
        c = cells[0]
        print(quick_line(c, DEFAULT_PIPEDAP))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status (0 ok, 2 testbed unavailable)."""
    args = parse_args(argv)
    if args.worker is not None:
        from lightning_pipedap.bench.matrix.worker import worker

        print(RESULT_PREFIX + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    if args.list:
        print_list(args.compressors)
        return 0
    if args.from_json:
        _from_json(args)
        return 0
    return _run_matrix(args, argv)
