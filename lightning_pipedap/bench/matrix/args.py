"""Command line of the benchmark matrix: the ``argparse`` parser and the validation of its lists and numbers."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable, Optional, Sequence

from lightning_pipedap.bench.matrix.models import DEFAULT_OPTIMIZER, OPTIMIZERS, check_optimizer
from lightning_pipedap.bench.matrix.spec import (DEFAULT_COMPRESSORS, LINKS, MODELS, PIPEDAP_PREFIX, QUICK_STRATEGIES,
                                                 SIZES, compressor_names, parse_strategies)

PROG = "python -m lightning_pipedap.bench.matrix"


def parse_choice_list(text: str, valid: Sequence[str], what: str, item: str) -> list[str]:
    """Split a comma list and check every item against ``valid`` (``"all"`` selects all of them).

    ``what`` names the list (``"models"``) and ``item`` one entry (``"model"``) in error messages.

    Raises:
        ValueError: an empty list, an empty entry (``"vgg16,,"``) or an unknown item; the message names the
            item and the valid choices.
    """
    items = [t.strip() for t in str(text).split(",")]
    if items == ["all"]:
        return list(valid)
    if not any(items):
        raise ValueError(f"empty list of {what}; valid: {', '.join(valid)} (or 'all')")
    if not all(items):
        raise ValueError(f"empty {item} name in the list of {what} {text!r} (a stray comma?); valid: "
                         f"{', '.join(valid)} (or 'all')")
    for t in items:
        if t not in valid:
            raise ValueError(f"unknown {item} {t!r}; valid: {', '.join(valid)} (or 'all')")
    return list(dict.fromkeys(items))


def parse_compressors(text: str) -> list[str]:
    """``--compressors``: comma list of compressor names (``"all"``: every one) for ``--strategies all``.

    Raises:
        ValueError: an empty list or an unknown name; the message lists the valid compressors.
    """
    return parse_choice_list(text, compressor_names(), "compressors", "compressor")


def _parse_numbers(text: str, convert: Callable, ok: Callable, what: str, example: str) -> list:
    """Comma list -> unique numbers in order; ``ValueError`` naming the bad entry (``what``, ``example``)."""
    out = []
    for t in (t.strip() for t in str(text).split(",")):
        if not t:
            continue
        try:
            v = convert(t)
        except ValueError:
            v = None
        if v is None or not ok(v):
            raise ValueError(f"{what} (e.g. {example}), got {t!r}")
        out.append(v)
    if not out:
        raise ValueError(f"empty list: {what} (e.g. {example})")
    return list(dict.fromkeys(out))


def parse_ranks(text: str) -> list[int]:
    """``"2,4"`` -> ``[2, 4]``; every entry must be an integer >= 2 (one rank per testbed host).

    Raises:
        ValueError: naming the bad entry.
    """
    return _parse_numbers(text, int, lambda n: n >= 2, "ranks must be integers >= 2", "2,4")


def parse_bucket_list(text: str) -> list[float]:
    """``"1,4,10"`` -> ``[1.0, 4.0, 10.0]`` MiB, the DDP bucket caps swept for ``ddp_tuned``.

    Raises:
        ValueError: a non-number or non-positive entry, or an empty list.
    """
    return _parse_numbers(text, float, lambda v: v > 0 and not math.isinf(v),
                          "--ddp-bucket-mb takes positive numbers in MiB", "1,4,10")


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (lists are comma-separated and validated by :func:`parse_args`); its
    description is the package docstring of :mod:`lightning_pipedap.bench.matrix`."""
    package = sys.modules[__name__.rpartition(".")[0]]  # (imported already; an import would close a circle)
    ap = argparse.ArgumentParser(prog=PROG, description=package.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="headline cell only (mlp, 1gbit, 2 ranks: ddp vs pipedap-optimal, few steps); "
                         "prints 'speedup_vs_ddp=<x> ratio_to_bound=<y> installed=<schedule>' last, marked when the "
                         "schedule installed is torch_ddp (DDP's reducer)")
    ap.add_argument("--models", default="mlp", help=f"comma list of {', '.join(MODELS)} or 'all'")
    ap.add_argument("--links", default="1gbit,none",
                    help=f"comma list of {', '.join(LINKS)} or 'all' ('none' = uncapped)")
    ap.add_argument("--ranks", default="2", help="comma list of rank counts (>= 2), e.g. 2,4")
    ap.add_argument("--strategies", default="all",
                    help="comma list (see --list) or 'all'; pipedap-<schedule>+<compressor>[:inline] adds compression")
    ap.add_argument("--compressors", default=",".join(DEFAULT_COMPRESSORS),
                    help="compressors that '--strategies all' pairs with pipedap-optimal (pipelined), or 'all'")
    ap.add_argument("--list", action="store_true", help="print the valid models, links and strategies and exit")
    ap.add_argument("--optimizer", default=DEFAULT_OPTIMIZER,
                    help=f"the optimizer every strategy's LightningModule trains with: {', '.join(OPTIMIZERS)} "
                         "(sgd: SGD momentum 0.9, lr 0.01; adam: torch.optim.Adam, lr 1e-3)")
    ap.add_argument("--size", default="bench", help=f"model size preset: {', '.join(SIZES)} (tiny: smoke tests)")
    ap.add_argument("--steps", type=int, default=20, help="measured steps per variant (>= 2)")
    ap.add_argument("--warmup", type=int, default=6,
                    help="steps before measuring (>= 5: pipedap traces 1 and profiles 3 steps first)")
    ap.add_argument("--ddp-bucket-mb", default="1,4,10", help="DDP bucket caps (MiB) swept for ddp_tuned")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds over the strategies (round-robin); each keeps its fastest median")
    ap.add_argument("--sweep-steps", type=int, default=4, help="measured steps per ddp_tuned sweep candidate")
    ap.add_argument("--batch", type=int, default=None, help="override the preset per-rank batch size")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--watts", type=float, default=10.0, help="assumed W per busy core for the energy estimate")
    ap.add_argument("--timeline", action=argparse.BooleanOptionalAction, default=True,
                    help="record pipedap timelines (wait / communication busy time per iteration)")
    ap.add_argument("--timeline-dir", default=None,
                    help="write rank 0's op records of the last 3 measured pipedap iterations here (JSON per variant)")
    ap.add_argument("--cell-timeout-s", type=float, default=1500.0, help="timeout of one cell's launch (s)")
    ap.add_argument("--weight-reader", action="store_true",
                    help="every variant trains with Lightning's EMAWeightAveraging callback, which reads the weights "
                         "after every step (what the strategy's observer rule costs)")
    ap.add_argument("--json", default=None, help="write all results as JSON to this path")
    ap.add_argument("--markdown", default=None, help="write the tables into this Markdown file (between markers)")
    ap.add_argument("--chart", default=None, help="write the speedup chart (PNG) to this path")
    ap.add_argument("--from-json", default=None, help="skip running: re-render tables/chart from a results JSON")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap


def _validate(args: argparse.Namespace) -> None:
    """Turn the comma lists of ``args`` into lists and check every value (in place).

    Raises:
        ValueError: the first invalid value, naming it and the valid choices.
    """
    args.models = parse_choice_list(args.models, MODELS, "models", "model")
    args.links = parse_choice_list(args.links, LINKS, "links", "link")
    args.ranks = parse_ranks(args.ranks)
    args.compressors = parse_compressors(args.compressors)
    args.strategies = parse_strategies(args.strategies, args.compressors)
    args.ddp_bucket_mb = parse_bucket_list(args.ddp_bucket_mb)
    check_optimizer(args.optimizer)
    if args.size not in SIZES:
        raise ValueError(f"unknown size {args.size!r}; valid: {', '.join(SIZES)}")
    for name, low in (("steps", 2), ("warmup", 1), ("sweep_steps", 2), ("threads", 1), ("repeats", 1)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if any(s.startswith(PIPEDAP_PREFIX) for s in args.strategies) and args.warmup < 5:
        raise ValueError("--warmup must be >= 5 with pipedap strategies (1 trace + 3 profile steps + 1), "
                         f"got {args.warmup}")
    if args.batch is not None and args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    if not args.watts > 0:
        raise ValueError(f"--watts must be > 0, got {args.watts}")
    if args.from_json is not None and not os.path.isfile(args.from_json):
        raise ValueError(f"--from-json: no such file {args.from_json!r}")
    if args.quick:
        args.models, args.links, args.ranks = ["mlp"], ["1gbit"], [2]
        args.strategies = list(QUICK_STRATEGIES)
        args.steps, args.warmup, args.repeats = 5, 5, 1


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate the command line; lists become Python lists (``--worker`` skips the validation:
    the worker's settings travel in its JSON spec).

    Raises:
        SystemExit: (status 2, through ``argparse``) on any invalid value; the message names the value
            and the valid choices.
    """
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.worker is not None:
        return args
    try:
        _validate(args)
    except ValueError as exc:
        ap.error(str(exc))
    return args
