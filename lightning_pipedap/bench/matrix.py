"""Benchmark matrix: DDP (plain, tuned buckets, fp16 / PowerSGD comm hooks), FSDP2, pipedap's planners and
pipedap with gradient compression (pipelined or inline) on a bandwidth-capped testbed.

::

    python -m lightning_pipedap.bench.matrix --quick                      # headline cell, < 60 s
    python -m lightning_pipedap.bench.matrix --models mlp --links 1gbit,none --ranks 2 \\
        --json bench.json --markdown BENCHMARKS.md --chart docs/img/benchmarks.png

A *cell* is (model, link, ranks). Every cell is one launch on a fresh
:class:`~lightning_pipedap.testbed.Testbed` (one network namespace per rank, ``tc tbf`` cap on each host
link in both directions), and every strategy of the cell runs in that launch, one after another, in the
same processes over the same link, so the variants of one cell are directly comparable. All variants train
through Lightning (``Trainer.fit``) with the same lean LightningModule (loss only, SGD with momentum):

* ``ddp``: Lightning's ``"ddp"`` (``DistributedDataParallel``, default 25 MiB buckets, all-reduce in backward).
* ``ddp_tuned``: ``DDPStrategy(bucket_cap_mb=X)``; ``X`` is picked per cell by a short sweep over
  ``--ddp-bucket-mb`` (each candidate a few steps, the fastest median wins, then measured in full).
* ``fsdp2``: Lightning's ``ModelParallelStrategy`` (data-parallel mesh = all ranks, no tensor
  parallelism) with ``torch.distributed.fsdp.fully_shard(..., reshard_after_forward=False)`` applied in
  ``configure_model`` to every layer (Linear / residual block / transformer block) and then to the network.
* ``ddp+fp16hook``, ``ddp+powersgdhook``: DDP with PyTorch's communication hooks
  ``default_hooks.fp16_compress_hook`` (gradients cast to fp16 for the all-reduce: the uncompressed
  16-bit all-reduce baseline) and ``powerSGD_hook`` (``matrix_approximation_rank=4``,
  ``start_powerSGD_iter=2``, error feedback and warm start on, like ``pipedap-...+powersgd``).
  Lightning's ``DDPStrategy`` registers comm hooks only on CUDA, so a small subclass registers the hook
  on the ``DistributedDataParallel`` module right after ``configure_ddp``. ``bf16_compress_hook`` is not
  offered: DDP refuses to register it without NCCL (``TypeError: BF16 all reduce communication hook
  required CUDA 11+ and NCCL 2.10+``, checked on gloo with torch 2.13).
* ``pipedap-<schedule>``: :class:`~lightning_pipedap.strategy.PipeDAPStrategy` with each schedule in
  :func:`~lightning_pipedap.strategy.valid_schedule_names` (fixed ``dear``/``allreduce``, planned
  ``optimal``, ``pipedap``, ``wfbp``, ``dear_tuned``, ``no_overlap``).
* ``pipedap-<schedule>+<compressor>`` and ``pipedap-<schedule>+<compressor>:inline``: the same with
  ``compression=<compressor>`` (any name in :func:`~lightning_pipedap.compress.valid_compressor_names`;
  keyword arguments from :data:`COMPRESSOR_KWARGS`: PowerSGD rank 4, top-k 1%), compressed in the per-rank
  helper process (``compression_mode="process"``, pipelined with backward) or, with ``:inline``, in the
  trainer (``compression_mode="inline"``). ``--strategies all`` runs ``pipedap-optimal+<c>`` (pipelined)
  for every ``c`` in ``--compressors`` (default ``fp16,powersgd,topk``); inline variants run when named.

Per variant: median *iteration time* (start-to-start of training batches, ``on_train_batch_start``, after
``--warmup`` steps, over ``--steps`` steps), energy per iteration (an *estimate*: ``--watts`` x CPU-seconds
of each rank, summed over ranks; there is no energy counter on these CPUs), and for pipedap the planner's
prediction and the timeline (time the training thread waited on communication, communication busy time).
Per cell, measured in the same processes: *compute-only* time (the same Lightning loop on a single-device
strategy: no communication at all) and *communication-only* time (one gradient's worth of fp32 as one
buffer: gloo all-reduce, and the engine's ring reduce-scatter + all-gather). The *lower bound* of an
iteration is ``max(compute, communication)`` with communication the faster of the two (perfect overlap,
perfect fusion); each variant's ``ratio to bound`` is its iteration time over that bound and its
``speedup`` is ``ddp`` time over its time. A tighter *dependency bound*, ``max(compute + first-layer
communication, communication)``, is reported next to it (:func:`dependency_bound_s`). Compute-only runs
twice (before and after the strategies) and the bound uses the faster run.

``--quick`` runs only the headline cell (mlp, 1gbit, 2 ranks; ``ddp`` and ``pipedap-optimal``, 5 warm-up
and 5 measured steps, one compute-only run) and prints ``speedup_vs_ddp=<x> ratio_to_bound=<y>`` last.
It replaced the earlier ``bench.training`` script.

Per compressed pipedap variant, ``strategy.compression_stats()`` (per bucket, the last round) is sampled
before every backward and at the end of training, so each round is counted once for the step that made it,
and the rounds of the measured steps are summarised (:func:`summarize_compression`):
*compression time* per iteration (helper or inline time compressing, in extra rounds and decompressing,
summed over buckets), the share of it *hidden* by the pipeline, ``sum(compress - wait) / sum(compress)``
with ``wait`` the time the communication worker blocked on the helper (pipelined only: inline compression
runs in the trainer and hides nothing), and the *compression ratio* dense bytes / payload bytes. They
appear in a second table, ``compression``, next to the DDP hook baselines. Compression starts with the
final schedule (warm-up and profiling steps are dense), and PowerSGD sends its first 2 compressed-engine
steps dense, so its variants warm up 2 steps longer (:func:`extra_warmup_steps`).

Needs root for the network namespaces; without it the command says why and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

MODELS = ("mlp", "resnet", "gpt")
LINKS = ("1gbit", "10gbit", "none")
SIZES = ("bench", "tiny")
BASE_STRATEGIES = ("ddp", "ddp_tuned", "fsdp2")
#: DDP with a PyTorch communication hook -> the hook's description (registered on CPU by the matrix)
DDP_HOOKS = {
    "ddp+fp16hook": "fp16_compress_hook",
    "ddp+powersgdhook": "powerSGD_hook rank=4 start_iter=2, one DDP bucket (gloo)",
}
#: PowerSGD settings shared by ``ddp+powersgdhook`` and ``pipedap-...+powersgd``
POWERSGD_RANK = 4
POWERSGD_START = 2
#: measured plan selection of ``pipedap-optimal``: candidates and measured steps per candidate
#: (the strategy's defaults)
PLAN_TRIALS, TRIAL_STEPS = 4, 3
#: ``--quick``: measured steps per candidate (the 60 s budget of the headline cell)
QUICK_TRIAL_STEPS = 2
#: ``--quick``: candidates of the measured plan selection (the plan, DeAR and WFBP at 25 MiB)
QUICK_PLAN_TRIALS = 3
#: ``--quick``: warm-up steps of ``ddp`` (no warm-up phases; two steps settle its buckets, as in the cap sweep)
QUICK_DDP_WARMUP = 2
PIPEDAP_PREFIX = "pipedap-"
COMPRESS_SEP = "+"
INLINE_SUFFIX = ":inline"
#: ``pipedap-...@nice<N>``: ``PipeDAPStrategy(train_thread_nice=N)`` (communication threads first)
NICE_SUFFIX = "@nice"
#: compressors that ``--strategies all`` pairs with the default schedule (``--compressors`` default)
DEFAULT_COMPRESSORS = ("fp16", "powersgd", "topk")
#: keyword arguments of ``PipeDAPStrategy(compression_kwargs=...)`` per compressor (others: defaults)
COMPRESSOR_KWARGS: dict[str, dict[str, Any]] = {
    "powersgd": {"rank": POWERSGD_RANK, "start_step": POWERSGD_START},
    "topk": {"ratio": 0.01},
}
#: the variant every speedup is relative to
REFERENCE = "ddp"
#: default pipedap schedule (PipeDAPStrategy's default)
DEFAULT_PIPEDAP = "pipedap-optimal"
QUICK_STRATEGIES = ("ddp", DEFAULT_PIPEDAP)
MD_BEGIN = "<!-- matrix:begin (generated by python -m lightning_pipedap.bench.matrix; edit outside) -->"
MD_END = "<!-- matrix:end -->"


# ============================================================================ pure part: names, arguments
def pipedap_schedules() -> tuple[str, ...]:
    """Schedule names :class:`PipeDAPStrategy` accepts (its own list, so new planners appear here)."""
    from lightning_pipedap.strategy import valid_schedule_names

    return tuple(valid_schedule_names())


def compressor_names() -> tuple[str, ...]:
    """Compressor names ``PipeDAPStrategy(compression=...)`` accepts (the compress package's own list)."""
    from lightning_pipedap.compress import valid_compressor_names

    return tuple(valid_compressor_names())


@dataclass(frozen=True)
class StrategySpec:
    """A matrix strategy name taken apart.

    Attributes:
        name: the full name, e.g. ``"pipedap-optimal+powersgd:inline"``.
        family: ``"ddp"``, ``"ddp_tuned"``, ``"fsdp2"``, ``"ddp_hook"`` or ``"pipedap"``.
        schedule: pipedap schedule (``"optimal"``, ...); ``None`` for the others.
        compressor: pipedap compressor name, or ``None`` (uncompressed / not pipedap).
        mode: ``"process"`` (helper process, pipelined) or ``"inline"`` for compressed pipedap, else ``None``.
        nice: pipedap's ``train_thread_nice`` (``@nice<N>`` suffix), 0 = off.
    """

    name: str
    family: str
    schedule: Optional[str] = None
    compressor: Optional[str] = None
    mode: Optional[str] = None
    nice: int = 0

    @property
    def compression(self) -> str:
        """Human description of the compression (``""`` when none), e.g. ``"powersgd rank=4 start_step=2, helper process"``."""
        if self.family == "ddp_hook":
            return DDP_HOOKS[self.name]
        if self.compressor is None:
            return ""
        kw = " ".join(f"{k}={v}" for k, v in COMPRESSOR_KWARGS.get(self.compressor, {}).items())
        where = "helper process" if self.mode == "process" else "inline"
        return f"{self.compressor}{' ' + kw if kw else ''}, {where}"


def _strategy_forms() -> str:
    return (f"{', '.join(BASE_STRATEGIES + tuple(DDP_HOOKS))}, {PIPEDAP_PREFIX}<schedule> "
            f"(schedules: {', '.join(pipedap_schedules())}), {PIPEDAP_PREFIX}<schedule>{COMPRESS_SEP}<compressor>"
            f"[{INLINE_SUFFIX}] (compressors: {', '.join(compressor_names())}); any pipedap name may end in "
            f"{NICE_SUFFIX}<N> (train_thread_nice=N, 1..19)")


def parse_strategy(name: str) -> StrategySpec:
    """Take a strategy name apart: ``ddp``, ``ddp_tuned``, ``fsdp2``, ``ddp+fp16hook``, ``ddp+powersgdhook``,
    ``pipedap-<schedule>``, ``pipedap-<schedule>+<compressor>`` (helper process) or
    ``pipedap-<schedule>+<compressor>:inline``.

    Raises:
        ValueError: an unknown name, schedule, compressor or mode suffix; the message names the bad part
            and the valid choices.
    """
    if name in BASE_STRATEGIES:
        return StrategySpec(name, name)
    if name in DDP_HOOKS:
        return StrategySpec(name, "ddp_hook")
    if not name.startswith(PIPEDAP_PREFIX):
        raise ValueError(f"unknown strategy {name!r}; valid: {_strategy_forms()} (or 'all')")
    rest, at, nice_text = name[len(PIPEDAP_PREFIX):].partition("@")
    nice = 0
    if at:
        digits = nice_text[len(NICE_SUFFIX) - 1:] if nice_text.startswith(NICE_SUFFIX[1:]) else ""
        if not digits.isdigit() or not 1 <= int(digits) <= 19:
            raise ValueError(f"bad suffix {'@' + nice_text!r} in strategy {name!r}; valid: {NICE_SUFFIX}<N> with N in 1..19")
        nice = int(digits)
    spec = _parse_pipedap(name, rest)
    return StrategySpec(spec.name, spec.family, spec.schedule, spec.compressor, spec.mode, nice)


def _parse_pipedap(name: str, rest: str) -> StrategySpec:
    schedule, sep, comp = rest.partition(COMPRESS_SEP)
    if schedule not in pipedap_schedules():
        raise ValueError(f"unknown strategy {name!r}: unknown schedule {schedule!r}; valid: {_strategy_forms()} (or 'all')")
    if not sep:
        return StrategySpec(name, "pipedap", schedule)
    comp, colon, mode = comp.partition(":")
    if comp not in compressor_names():
        raise ValueError(f"unknown compressor {comp!r} in strategy {name!r}; valid: {', '.join(compressor_names())}")
    if colon and mode != INLINE_SUFFIX[1:]:
        raise ValueError(f"unknown compression mode {':' + mode!r} in strategy {name!r}; valid: {INLINE_SUFFIX!r} "
                         f"(no suffix = pipelined in the helper process)")
    return StrategySpec(name, "pipedap", schedule, comp, "inline" if colon else "process")


def plan_trials(name: str, candidates: int = PLAN_TRIALS) -> int:
    """``PipeDAPStrategy(plan_trials=...)`` of a pipedap variant: the default measured plan selection
    (:data:`PLAN_TRIALS` candidates) for ``pipedap-optimal`` without compression, the strategy's
    default; 1 (the named planner's schedule, nothing else) for the other planners, so that each
    planner's own schedule is what is measured, and with compression (the strategy runs no trials there).
    ``candidates`` replaces :data:`PLAN_TRIALS` (``--quick`` measures 3).

    Raises:
        ValueError: a bad name (see :func:`parse_strategy`).
    """
    sp = parse_strategy(name)
    return candidates if sp.family == "pipedap" and sp.schedule == DEFAULT_PIPEDAP[len(PIPEDAP_PREFIX):] \
        and sp.compressor is None else 1


def extra_warmup_steps(name: str, trial_steps: int = TRIAL_STEPS, candidates: int = PLAN_TRIALS) -> int:
    """Warm-up steps a variant runs on top of ``--warmup``: ``POWERSGD_START`` (2) for pipedap with PowerSGD,
    whose first ``start_step`` compressed-engine steps send dense gradients (as ``start_powerSGD_iter`` does
    in the DDP hook, which counts from step 0 and is past them before the measured steps begin), so that
    every measured step is compressed; with measured plan selection (:func:`plan_trials` > 1), the
    trial steps (``trial_steps + 1`` per candidate); 0 otherwise.

    Raises:
        ValueError: a bad name (see :func:`parse_strategy`).
    """
    extra = POWERSGD_START if parse_strategy(name).compressor == "powersgd" else 0
    trials = plan_trials(name, candidates)
    return extra + (trials * (trial_steps + 1) if trials > 1 else 0)


def all_strategies(compressors: Sequence[str] = DEFAULT_COMPRESSORS) -> tuple[str, ...]:
    """What ``--strategies all`` runs: ``ddp``, ``ddp_tuned``, ``fsdp2``, the DDP hook baselines, every
    ``pipedap-<schedule>``, and ``pipedap-optimal+<c>`` (pipelined) for each ``c`` in ``compressors``."""
    return (BASE_STRATEGIES + tuple(DDP_HOOKS) + tuple(PIPEDAP_PREFIX + s for s in pipedap_schedules())
            + tuple(f"{DEFAULT_PIPEDAP}{COMPRESS_SEP}{c}" for c in compressors))


def valid_strategies(compressors: Sequence[str] = DEFAULT_COMPRESSORS) -> tuple[str, ...]:
    """:func:`all_strategies` plus the inline forms ``pipedap-optimal+<c>:inline`` (for ``--list``; any
    other ``pipedap-<schedule>+<compressor>[:inline]`` is accepted too, see :func:`parse_strategy`)."""
    return all_strategies(compressors) + tuple(f"{DEFAULT_PIPEDAP}{COMPRESS_SEP}{c}{INLINE_SUFFIX}" for c in compressors)


def parse_strategies(text: str, compressors: Sequence[str] = DEFAULT_COMPRESSORS) -> list[str]:
    """Comma list of strategy names (``"all"``: :func:`all_strategies` for ``compressors``), each checked by
    :func:`parse_strategy`; duplicates dropped, order kept.

    Raises:
        ValueError: an empty list or a bad name (message from :func:`parse_strategy`).
    """
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if items == ["all"]:
        return list(all_strategies(compressors))
    if not items:
        raise ValueError(f"empty list of strategies; valid: {_strategy_forms()} (or 'all')")
    for t in items:
        parse_strategy(t)
    return list(dict.fromkeys(items))


def parse_compressors(text: str) -> list[str]:
    """``--compressors``: comma list of compressor names (``"all"``: every one) for ``--strategies all``.

    Raises:
        ValueError: an empty list or an unknown name; the message lists the valid compressors.
    """
    return parse_choice_list(text, compressor_names(), "compressors", "compressor")


def parse_choice_list(text: str, valid: Sequence[str], what: str, item: str) -> list[str]:
    """Split a comma list and check every item against ``valid`` (``"all"`` selects all of them).

    ``what`` names the list (``"models"``) and ``item`` one entry (``"model"``) in error messages.

    Raises:
        ValueError: an empty list or an unknown item; the message names the item and the valid choices.
    """
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if items == ["all"]:
        return list(valid)
    if not items:
        raise ValueError(f"empty list of {what}; valid: {', '.join(valid)} (or 'all')")
    for t in items:
        if t not in valid:
            raise ValueError(f"unknown {item} {t!r}; valid: {', '.join(valid)} (or 'all')")
    return list(dict.fromkeys(items))


def _parse_numbers(text: str, convert, ok, what: str, example: str) -> list:
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
    """The command-line parser (lists are comma-separated and validated by :func:`parse_args`)."""
    ap = argparse.ArgumentParser(prog="python -m lightning_pipedap.bench.matrix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="headline cell only (mlp, 1gbit, 2 ranks: ddp vs pipedap-optimal, few steps); "
                         "prints 'speedup_vs_ddp=<x> ratio_to_bound=<y>' last")
    ap.add_argument("--models", default="mlp", help=f"comma list of {', '.join(MODELS)} or 'all'")
    ap.add_argument("--links", default="1gbit,none", help=f"comma list of {', '.join(LINKS)} or 'all' ('none' = uncapped)")
    ap.add_argument("--ranks", default="2", help="comma list of rank counts (>= 2), e.g. 2,4")
    ap.add_argument("--strategies", default="all",
                    help="comma list (see --list) or 'all'; pipedap-<schedule>+<compressor>[:inline] adds compression")
    ap.add_argument("--compressors", default=",".join(DEFAULT_COMPRESSORS),
                    help="compressors that '--strategies all' pairs with pipedap-optimal (pipelined), or 'all'")
    ap.add_argument("--list", action="store_true", help="print the valid models, links and strategies and exit")
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


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate the command line; lists become Python lists.

    Raises:
        SystemExit: (status 2, through ``argparse``) on any invalid value; the message names the value
            and the valid choices.
    """
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.worker is not None:
        return args
    try:
        args.models = parse_choice_list(args.models, MODELS, "models", "model")
        args.links = parse_choice_list(args.links, LINKS, "links", "link")
        args.ranks = parse_ranks(args.ranks)
        args.compressors = parse_compressors(args.compressors)
        args.strategies = parse_strategies(args.strategies, args.compressors)
        args.ddp_bucket_mb = parse_bucket_list(args.ddp_bucket_mb)
        if args.size not in SIZES:
            raise ValueError(f"unknown size {args.size!r}; valid: {', '.join(SIZES)}")
        for name, low in (("steps", 2), ("warmup", 1), ("sweep_steps", 2), ("threads", 1), ("repeats", 1)):
            if getattr(args, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
        if any(s.startswith(PIPEDAP_PREFIX) for s in args.strategies) and args.warmup < 5:
            raise ValueError(f"--warmup must be >= 5 with pipedap strategies (1 trace + 3 profile steps + 1), got {args.warmup}")
        if args.batch is not None and args.batch < 1:
            raise ValueError(f"--batch must be >= 1, got {args.batch}")
        if not args.watts > 0:
            raise ValueError(f"--watts must be > 0, got {args.watts}")
        if args.quick:
            args.models, args.links, args.ranks = ["mlp"], ["1gbit"], [2]
            args.strategies = list(QUICK_STRATEGIES)
            args.steps, args.warmup, args.repeats = 5, 5, 1
    except ValueError as exc:
        ap.error(str(exc))
    return args


# ============================================================================ pure part: results
@dataclass
class VariantResult:
    """Measured result of one strategy in one cell.

    Attributes:
        name: strategy name (``"ddp"``, ``"pipedap-optimal"``, ...).
        iter_s: median iteration time, start-to-start, s (rank 0).
        steps: number of measured iterations.
        energy_J: estimated energy per iteration summed over ranks, J (``None`` if not measured).
        predicted_s: the planner's predicted iteration time, s (planned pipedap schedules only).
        wait_s: time per iteration the training thread waited on communication (pipedap timeline), s.
        comm_busy_s: time per iteration the communication worker was busy (RS/AG/AR), s.
        note: free text (e.g. the bucket cap chosen for ``ddp_tuned``).
        plan: pipedap's log of the installed schedule(s) and α-β fit (rank 0), for the record.
        compression: what the variant compresses with (:attr:`StrategySpec.compression`; ``""``: nothing).
        compress_s: compressed pipedap: compression time per iteration, s (rank 0, :func:`summarize_compression`).
        hidden_share: compressed pipedap, pipelined: share of ``compress_s`` hidden by the pipeline (0..1).
        compression_ratio: compressed pipedap: dense bytes / payload bytes over the measured rounds.
        compressed_rounds: bucket rounds the three compression numbers come from.
        trials: ``pipedap-optimal``: the measured plan selection, one dict per candidate schedule
            (name, describe, predicted_s, measured_s, chosen; :attr:`PipeDAPStrategy.trial_results`);
            the measured steps run the chosen one.
        predictions: planned pipedap, rank 0: every prediction per candidate schedule name, s
            (:attr:`PipeDAPStrategy.predictions`: α-β ``ab_s``, ``calibrated_s``, contention-aware
            ``contended_s``, ``contended_calibrated_s``).
        all_steps_ms: every start-to-start interval of the run, warm-up included, ms (rank 0), for
            looking at noise and at the warm-up phases (trace, profile, trials).
    """

    name: str
    iter_s: float
    steps: int
    energy_J: Optional[float] = None
    predicted_s: Optional[float] = None
    wait_s: Optional[float] = None
    comm_busy_s: Optional[float] = None
    note: str = ""
    plan: str = ""
    compression: str = ""
    compress_s: Optional[float] = None
    hidden_share: Optional[float] = None
    compression_ratio: Optional[float] = None
    compressed_rounds: Optional[int] = None
    trials: list = field(default_factory=list)
    predictions: dict = field(default_factory=dict)
    all_steps_ms: list = field(default_factory=list)


@dataclass
class CellResult:
    """All variants of one (model, link, ranks) cell plus the references measured in the same launch.

    Attributes:
        model, link, ranks: the cell (``link`` ``"none"`` = uncapped).
        params_M: trainable parameters, millions. batch: per-rank batch size (samples).
        compute_s: compute-only iteration time, s (slowest rank's median).
        allreduce_s: gloo all-reduce of all gradients as one fp32 buffer, s (median).
        rs_ag_s: ring reduce-scatter + all-gather of the same buffer, s (median).
        first_layer_comm_s: the faster of all-reduce and RS + AG of the first layer's parameters alone, s.
        allreduce_cpu_s: CPU time (user + system, all threads) one rank spends in that all-reduce, s
            (the busiest rank; see :func:`_comm_only`).
        variants: per strategy.
        skipped: strategy -> reason, for strategies that could not run in this cell.
    """

    model: str
    link: str
    ranks: int
    params_M: float
    batch: int
    compute_s: float
    allreduce_s: float
    rs_ag_s: float
    first_layer_comm_s: Optional[float] = None
    allreduce_cpu_s: Optional[float] = None
    variants: list[VariantResult] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def comm_s(self) -> float:
        """Communication-only time of the bound: the faster of all-reduce and RS + AG, s."""
        return min(self.allreduce_s, self.rs_ag_s)

    @property
    def bound_s(self) -> float:
        """Lower bound of an iteration, ``max(compute, communication)``, s."""
        return lower_bound_s(self.compute_s, self.comm_s)

    @property
    def cpu_bound_s(self) -> Optional[float]:
        """Lower bound when each rank has one core for compute *and* its communication's CPU work (the
        bench runs one torch thread per rank, as many ranks as cores): ``max(compute + CPU time of the
        all-reduce, communication)``, s; None when the CPU time was not measured. Kernel network work
        outside the process is not in it, so the true bound is higher still."""
        if self.allreduce_cpu_s is None:
            return None
        return max(self.compute_s + self.allreduce_cpu_s, self.comm_s)

    @property
    def dep_bound_s(self) -> Optional[float]:
        """Dependency-aware lower bound, :func:`dependency_bound_s` (s), when the first layer was measured."""
        if self.first_layer_comm_s is None:
            return None
        return dependency_bound_s(self.compute_s, self.comm_s, self.first_layer_comm_s)

    def variant(self, name: str) -> Optional[VariantResult]:
        """The result of strategy ``name`` or ``None``."""
        return next((v for v in self.variants if v.name == name), None)

    def speedup(self, name: str) -> Optional[float]:
        """``ddp`` iteration time / ``name``'s (``None`` when either is missing)."""
        ref, v = self.variant(REFERENCE), self.variant(name)
        return speedup(ref.iter_s, v.iter_s) if ref and v else None

    def ratio(self, name: str) -> Optional[float]:
        """``name``'s iteration time / the lower bound (``None`` when missing)."""
        v = self.variant(name)
        return ratio_to_bound(v.iter_s, self.bound_s) if v else None

    @staticmethod
    def from_dict(d: dict) -> "CellResult":
        """Inverse of ``dataclasses.asdict``."""
        d = dict(d)
        d["variants"] = [VariantResult(**v) for v in d.get("variants", [])]
        return CellResult(**d)


def _check_time(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite time in seconds, got {value!r}")
    return float(value)


def lower_bound_s(compute_s: float, comm_s: float) -> float:
    """Iteration-time lower bound of data-parallel training, ``max(compute, communication)`` (s).

    With perfect overlap an iteration can hide the shorter of compute and communication behind the
    longer one but no more (the bound the DeAR and PipeDAP papers compare against).

    Raises:
        ValueError: a time that is not a positive finite number.
    """
    return max(_check_time("compute_s", compute_s), _check_time("comm_s", comm_s))


def dependency_bound_s(compute_s: float, comm_s: float, first_layer_comm_s: float) -> float:
    """A tighter lower bound for synchronous data parallelism: ``max(compute + first-layer comm, comm)`` (s).

    The first layer's gradient is the last one backward produces and its updated weights are the first
    ones the next forward needs, so its communication cannot overlap any compute of the step (only the
    ``max(compute, comm)`` bound ignores this dependency). ``first_layer_comm_s`` is the communication time
    of the first layer's parameters alone; the update's own compute is left out.

    Raises:
        ValueError: a time that is not a positive finite number.
    """
    return max(_check_time("compute_s", compute_s) + _check_time("first_layer_comm_s", first_layer_comm_s),
               _check_time("comm_s", comm_s))


def ratio_to_bound(iter_s: float, bound_s: float) -> float:
    """Measured iteration time over the lower bound (>= 1 up to noise; 1.0 = perfect overlap).

    Raises:
        ValueError: a time that is not a positive finite number.
    """
    return _check_time("iter_s", iter_s) / _check_time("bound_s", bound_s)


def speedup(ref_s: float, iter_s: float) -> float:
    """Speedup of a variant over the reference: ``ref_s / iter_s`` (> 1 = faster than the reference).

    Raises:
        ValueError: a time that is not a positive finite number.
    """
    return _check_time("ref_s", ref_s) / _check_time("iter_s", iter_s)


def median_step_s(starts: Sequence[float], warmup: int) -> tuple[float, int]:
    """Median start-to-start iteration time after ``warmup`` iterations.

    Args:
        starts: ``time.perf_counter()`` stamps (s) of every training-batch start, plus the end of training.
        warmup: iterations to drop at the front.

    Returns:
        ``(median seconds, number of iterations used)``.

    Raises:
        ValueError: fewer than one iteration left after the warm-up.
    """
    gaps = [b - a for a, b in zip(starts[:-1], starts[1:])][warmup:]
    if not gaps:
        raise ValueError(f"no iteration left after {warmup} warm-up steps ({len(starts)} time stamps)")
    return statistics.median(gaps), len(gaps)


@dataclass
class CompressionSummary:
    """Compression telemetry of one variant over its measured steps (:func:`summarize_compression`).

    Attributes:
        compress_s: compression time per iteration, s: per bucket the mean over its rounds of the time spent
            compressing (first pass, extra rounds, decompression), summed over buckets.
        hidden_share: :func:`hidden_share` of all rounds (``None`` inline or when nothing was compressed).
        ratio: sum of dense bytes / sum of payload bytes over all rounds (``None`` when nothing was sent).
        rounds: number of (bucket, step) rounds summarised.
    """

    compress_s: float
    hidden_share: Optional[float]
    ratio: Optional[float]
    rounds: int


def _stat(st: Any, field_name: str) -> float:
    v = getattr(st, field_name)
    if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"compression stats: {field_name} must be a finite number >= 0, got {v!r}")
    return float(v)


def hidden_share(stats: Sequence[Any]) -> Optional[float]:
    """Share of compression time hidden by the pipeline: ``sum(compress_s - wait_s) / sum(compress_s)``.

    ``stats`` are per-round :class:`~lightning_pipedap.engine.compressed.CompressionStats` (any objects with
    ``compress_s`` and ``wait_s`` in s): ``compress_s`` is the helper's time on the round, ``wait_s`` the time
    the communication worker blocked for its results, so ``compress_s - wait_s`` ran while the trainer went
    on (PipeCompress, Wu et al., ICC 2022). Clamped at 0: a worker that waits longer than the helper worked
    (queued behind other buckets, hand-off latency) hid nothing.

    Returns:
        a share in ``[0, 1]``, or ``None`` when ``sum(compress_s)`` is 0 (nothing compressed).

    Raises:
        ValueError: a negative or non-finite time (naming the field).
    """
    comp = sum(_stat(st, "compress_s") for st in stats)
    if comp <= 0:
        return None
    return max(0.0, comp - sum(_stat(st, "wait_s") for st in stats)) / comp


def summarize_compression(rounds: Sequence[tuple[int, Any]], pipelined: bool = True) -> Optional[CompressionSummary]:
    """Summarise per-bucket compression rounds taken over the measured steps.

    Args:
        rounds: ``(bucket index, stats)`` per round; ``stats`` has ``compress_s``, ``wait_s`` (s),
            ``payload_bytes`` and ``dense_bytes`` (bytes), like
            :class:`~lightning_pipedap.engine.compressed.CompressionStats`.
        pipelined: compression ran in the helper process; ``False`` (inline) reports no hidden share.

    Returns:
        :class:`CompressionSummary`, or ``None`` without rounds. Compression time per iteration is the
        per-bucket mean summed over buckets, so a bucket caught in one step more or fewer than the others
        (a round that lands just before or after the window) does not skew it.

    Raises:
        ValueError: a negative or non-finite time or byte count (naming the field).
    """
    if not rounds:
        return None
    per_bucket: dict[int, list[float]] = {}
    for b, st in rounds:
        per_bucket.setdefault(int(b), []).append(_stat(st, "compress_s"))
    stats = [st for _, st in rounds]
    payload = sum(_stat(st, "payload_bytes") for st in stats)
    dense = sum(_stat(st, "dense_bytes") for st in stats)
    return CompressionSummary(compress_s=sum(statistics.fmean(v) for v in per_bucket.values()),
                              hidden_share=hidden_share(stats) if pipelined else None,
                              ratio=dense / payload if payload > 0 else None, rounds=len(rounds))


def _ms(x: Optional[float], digits: int = 0) -> str:
    return "–" if x is None else f"{x * 1e3:.{digits}f}"


def _x(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.2f}"


def cell_label(c: CellResult) -> str:
    """Short label of a cell, e.g. ``"mlp 1gbit 2r"``."""
    return f"{c.model} {'uncapped' if c.link == 'none' else c.link} {c.ranks}r"


def format_cells_table(cells: Sequence[CellResult]) -> str:
    """Markdown table of the per-cell references (compute, communication, bound)."""
    rows = ["| model | link | ranks | params (M) | batch/rank | compute-only ms | all-reduce ms | RS+AG ms "
            "| first-layer comm ms | bound ms max(compute, comm) | dependency bound ms | all-reduce CPU ms "
            "| CPU-aware bound ms |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        rows.append(f"| {c.model} | {'uncapped' if c.link == 'none' else c.link} | {c.ranks} | {c.params_M:.1f} | {c.batch} "
                    f"| {_ms(c.compute_s)} | {_ms(c.allreduce_s)} | {_ms(c.rs_ag_s)} | {_ms(c.first_layer_comm_s, 1)} "
                    f"| {_ms(c.bound_s)} | {_ms(c.dep_bound_s)} | {_ms(c.allreduce_cpu_s)} | {_ms(c.cpu_bound_s)} |")
    return "\n".join(rows)


def format_variants_table(cells: Sequence[CellResult]) -> str:
    """Markdown table: one row per (cell, strategy) with iteration time, speedup vs ddp, ratio to bound,
    estimated energy, the planner's prediction and the pipedap timeline columns."""
    rows = ["| cell | strategy | iter ms (median) | speedup vs ddp | / bound | / dep. bound | energy J/iter (estimate) "
            "| predicted ms | wait ms/iter | comm busy ms/iter | note |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in cells:
        dep = c.dep_bound_s
        for v in c.variants:
            e = "–" if v.energy_J is None else f"{v.energy_J:.1f}"
            rd = _x(ratio_to_bound(v.iter_s, dep)) if dep else "–"
            rows.append(f"| {cell_label(c)} | {v.name} | {_ms(v.iter_s)} | {_x(c.speedup(v.name))} | {_x(c.ratio(v.name))} "
                        f"| {rd} | {e} | {_ms(v.predicted_s)} | {_ms(v.wait_s)} | {_ms(v.comm_busy_s)} | {v.note} |")
        for name, why in c.skipped.items():
            rows.append(f"| {cell_label(c)} | {name} | not run | | | | | | | | {why} |")
    return "\n".join(rows)


def uncompressed_name(name: str) -> Optional[str]:
    """The uncompressed counterpart of a compressed variant: ``ddp`` for the DDP hooks,
    ``pipedap-<schedule>`` for ``pipedap-<schedule>+<compressor>[:inline]``; ``None`` for the others."""
    if name in DDP_HOOKS:
        return REFERENCE
    if name.startswith(PIPEDAP_PREFIX) and COMPRESS_SEP in name:
        return name.split(COMPRESS_SEP, 1)[0]
    return None


def _pct(x: Optional[float]) -> str:
    return "–" if x is None else f"{x * 100:.0f}%"


def _ratio(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.1f}"


HIDDEN_NOTE = ("*hidden* = share of the compression time (compressing, extra rounds, decompressing) during which "
               "the communication worker did not wait for the helper, sum(compress − wait) / sum(compress) over "
               "the measured steps; inline compression runs in the trainer, so nothing is hidden (–). Compression "
               "time is per iteration, summed over buckets; ratio = dense bytes / payload bytes. The DDP hooks "
               "report no telemetry (–).")


def format_compression_table(cells: Sequence[CellResult]) -> str:
    """Markdown table of the compressed variants (DDP hooks and ``pipedap-...+<compressor>``) with their
    uncompressed counterparts (``ddp``, ``pipedap-<schedule>``) as reference rows: iteration time, speedup
    vs ``ddp`` and vs the counterpart, compression ms per iteration, share hidden, compression ratio.
    ``""`` when no cell has a compressed variant."""
    rows = ["| cell | strategy | compression | iter ms (median) | speedup vs ddp | vs uncompressed "
            "| compression ms/iter | hidden | ratio |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        bases = {uncompressed_name(v.name) for v in c.variants} - {None}
        if not bases:
            continue
        for v in c.variants:
            base = uncompressed_name(v.name)
            if base is None and v.name not in bases:
                continue
            ref = c.variant(base) if base else None
            vs = _x(speedup(ref.iter_s, v.iter_s)) if ref else "–"
            rows.append(f"| {cell_label(c)} | {v.name} | {v.compression or 'none'} | {_ms(v.iter_s)} "
                        f"| {_x(c.speedup(v.name))} | {vs} | {_ms(v.compress_s, 1)} | {_pct(v.hidden_share)} "
                        f"| {_ratio(v.compression_ratio)} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def format_text_report(c: CellResult) -> str:
    """Plain-text summary of one cell for the terminal."""
    lines = [f"{cell_label(c)}: {c.params_M:.1f} M params, batch {c.batch}/rank; compute-only {_ms(c.compute_s)} ms, "
             f"all-reduce {_ms(c.allreduce_s)} ms, RS+AG {_ms(c.rs_ag_s)} ms, lower bound {_ms(c.bound_s)} ms, "
             f"dependency bound {_ms(c.dep_bound_s)} ms (first layer comm {_ms(c.first_layer_comm_s, 1)} ms), "
             f"all-reduce CPU {_ms(c.allreduce_cpu_s)} ms, CPU-aware bound {_ms(c.cpu_bound_s)} ms",
             f"  {'strategy':30s} {'iter ms':>8s} {'vs ddp':>7s} {'/bound':>7s} {'pred ms':>8s} {'wait ms':>8s} "
             f"{'busy ms':>8s} {'J/iter':>7s}"]
    for v in c.variants:
        e = "–" if v.energy_J is None else f"{v.energy_J:.1f}"
        comp = ""
        if v.compress_s is not None:
            comp = (f" [{v.compression}: compression {_ms(v.compress_s, 1)} ms/iter, hidden {_pct(v.hidden_share)}, "
                    f"ratio {_ratio(v.compression_ratio)}]")
        elif v.compression:
            comp = f" [{v.compression}]"
        lines.append(f"  {v.name:30s} {_ms(v.iter_s):>8s} {_x(c.speedup(v.name)):>7s} {_x(c.ratio(v.name)):>7s} "
                     f"{_ms(v.predicted_s):>8s} {_ms(v.wait_s):>8s} {_ms(v.comm_busy_s):>8s} {e:>7s} {v.note}{comp}")
        for t in v.trials:
            lines.append(f"      candidate {t['name']:24s} measured {_ms(t['measured_s']):>6s} ms, predicted "
                         f"{_ms(t['predicted_s']):>6s} ms{'  <- chosen' if t['chosen'] else ''}")
    for name, why in c.skipped.items():
        lines.append(f"  {name:30s} not run: {why}")
    return "\n".join(lines)


def replace_marked_section(text: str, body: str) -> str:
    """Put ``body`` between :data:`MD_BEGIN` and :data:`MD_END` in ``text`` (appended if the markers are
    missing), so hand-written prose around the generated tables survives a re-run.

    Raises:
        ValueError: the end marker comes before the begin marker.
    """
    block = f"{MD_BEGIN}\n{body.rstrip()}\n{MD_END}"
    i, j = text.find(MD_BEGIN), text.find(MD_END)
    if i < 0 or j < 0:
        return (text.rstrip() + "\n\n" if text.strip() else "") + block + "\n"
    if j < i:
        raise ValueError("BENCHMARKS markers out of order: the end marker precedes the begin marker")
    return text[:i] + block + text[j + len(MD_END):]


def machine_description() -> str:
    """CPU model (``/proc/cpuinfo``), core count (``nproc``), OS, Python, torch and Lightning versions."""
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        nproc = subprocess.run(["nproc"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        nproc = str(os.cpu_count())
    import lightning
    import torch

    return (f"{cpu}, {nproc} cores (nproc), {platform.system()} {platform.release()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}, lightning {lightning.__version__}")


def render_markdown(cells: Sequence[CellResult], meta: dict) -> str:
    """The generated part of BENCHMARKS.md: machine, command, settings, the cells and variants tables, and
    the compression table when a cell has compressed variants."""
    lines = [
        f"Machine: {meta.get('machine', '?')}.  ",
        f"Run: `{meta.get('command', '?')}` ({meta.get('date', '?')}, {meta.get('wall_s', 0):.0f} s).  ",
        f"Settings: {meta.get('steps')} measured steps after {meta.get('warmup')} warm-up steps per strategy, "
        f"{meta.get('threads')} torch thread(s) per rank, energy = estimate ({meta.get('watts')} W x CPU-seconds, "
        "summed over ranks; no hardware counter here).",
        "",
        "References measured in the same launch as the strategies:",
        "",
        format_cells_table(cells),
        "",
        format_variants_table(cells),
        "",
    ]
    comp_table = format_compression_table(cells)
    if comp_table:
        lines += [f"Compression (over the measured steps, rank 0): {HIDDEN_NOTE}", "", comp_table, ""]
    trials = format_trials_table(cells)
    if trials:
        lines += [f"Measured plan selection (`PipeDAPStrategy(plan_trials={PLAN_TRIALS})`, the default): each candidate ran "
                  f"{TRIAL_STEPS} measured steps (quick mode: {QUICK_PLAN_TRIALS} candidates, {QUICK_TRIAL_STEPS} steps) during warm-up; the measured steps above ran the chosen one.", "",
                  trials, ""]
    return "\n".join(lines)


def format_trials_table(cells: Sequence[CellResult]) -> str:
    """Markdown table of every variant's measured plan selection: candidate, prediction, measured time,
    prediction error, chosen; ``""`` when no variant ran trials."""
    rows = ["| cell | strategy | candidate | predicted ms | measured ms | error | chosen |",
            "|---|---|---|---:|---:|---:|---|"]
    for c in cells:
        for v in c.variants:
            for t in v.trials:
                p, m = t.get("predicted_s"), t["measured_s"]
                err = "–" if p is None else f"{(p / m - 1) * 100:+.1f}%"
                d = t["describe"] if len(t["describe"]) <= 120 else t["describe"][:117] + "..."
                rows.append(f"| {cell_label(c)} | {v.name} | `{d}` | {_ms(p)} | {_ms(m)} | {err} "
                            f"| {'yes' if t['chosen'] else ''} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def write_chart(cells: Sequence[CellResult], path: str) -> None:
    """Bar chart (PNG, matplotlib Agg) of speedup vs ``ddp`` per cell and strategy; a dashed tick per cell
    marks the speedup the lower bound would give (``ddp`` / bound)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(v.name for c in cells for v in c.variants))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 + 0.35 * len(names) * len(cells)), 4.2))
    width = 0.8 / max(1, len(names))
    cmap = plt.get_cmap("tab20")
    for k, name in enumerate(names):
        xs, ys = [], []
        for i, c in enumerate(cells):
            s = c.speedup(name)
            if s is not None:
                xs.append(i - 0.4 + width * (k + 0.5))
                ys.append(s)
        ax.bar(xs, ys, width, label=name, color=cmap(k % 20))
    for i, c in enumerate(cells):
        ref = c.variant(REFERENCE)
        if ref is not None:
            ax.hlines(ref.iter_s / c.bound_s, i - 0.45, i + 0.45, colors="k", linestyles="dashed", linewidth=1)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(cells)), [cell_label(c) for c in cells])
    ax.set_ylabel("speedup vs Lightning 'ddp' (x)")
    ax.set_title("Iteration-time speedup vs ddp (dashed: lower bound max(compute, comm))")
    ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ============================================================================ models (worker side)
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # mlp: 1024 input features, 16 hidden layers of 1024, 10 classes: 16.8 M parameters (67 MB of fp32
    # gradients: ~0.56 s all-reduce at 1 Gbit/s); fwd+bwd+step of batch 512 ~0.55 s at 1 thread on this
    # CPU (AMD EPYC) when the machine is quiet, so compute ~ communication at 1 Gbit/s. Many equal layers
    # rather than a few wide ones: with 5 layers of 2048 the last layer's backward (1/5 of compute) has to
    # finish before any of its 17 MB can move, which puts the window bound ~15% above max(compute, comm).
    "mlp": {"bench": dict(features=1024, width=1024, depth=16, batch=512),
            "tiny": dict(features=16, width=32, depth=2, batch=4)},
    # resnet: ResNet-18 layout at width 32 (2.8 M parameters), CIFAR-size 32x32 images
    "resnet": {"bench": dict(width=32, layers=(2, 2, 2, 2), image=32, batch=32),
               "tiny": dict(width=4, layers=(1, 1), image=8, batch=2)},
    # gpt: 6 layers x 384 wide (10.7 M parameters), context 128, byte vocabulary
    "gpt": {"bench": dict(n_layer=6, n_head=6, n_embd=384, block=128, batch=4),
            "tiny": dict(n_layer=1, n_head=2, n_embd=16, block=8, batch=2)},
}


def build_net(model: str, size: str):
    """``(net, shard_units, make_batch)`` for a model preset.

    ``shard_units`` are the modules FSDP2 shards one by one (then the whole net); ``make_batch(n, g)``
    returns ``n`` samples ``(inputs, targets)`` drawn from generator ``g``: mlp ``(n, features)`` floats and
    ``(n,)`` class ids; resnet ``(n, 3, H, W)`` images and ``(n,)`` class ids; gpt ``(n, T)`` token ids and
    ``(n, T)`` next-token targets.

    Raises:
        ValueError: unknown model or size (naming the valid choices).
    """
    import torch
    import torch.nn as nn

    if model not in PRESETS:
        raise ValueError(f"unknown model {model!r}; valid: {', '.join(MODELS)}")
    if size not in PRESETS[model]:
        raise ValueError(f"unknown size {size!r}; valid: {', '.join(SIZES)}")
    p = PRESETS[model][size]
    if model == "mlp":
        layers: list[nn.Module] = []
        for i in range(p["depth"]):
            layers += [nn.Linear(p["features"] if i == 0 else p["width"], p["width"]), nn.ReLU()]
        net = nn.Sequential(*layers, nn.Linear(p["width"], 10))
        units = [m for m in net if isinstance(m, nn.Linear)]

        def make_batch(n, g):
            return torch.randn(n, p["features"], generator=g), torch.randint(0, 10, (n,), generator=g)
    elif model == "resnet":
        from lightning_pipedap.models import ResNet

        net = ResNet("basic", p["layers"], 10, p["width"], 3)
        units = [net.stem] + [b for stage in net.stages for b in stage] + [net.fc]

        def make_batch(n, g):
            return torch.randn(n, 3, p["image"], p["image"], generator=g), torch.randint(0, 10, (n,), generator=g)
    else:
        from lightning_pipedap.models import GPT

        net = GPT(256, p["block"], p["n_layer"], p["n_head"], p["n_embd"], 0.0)
        units = [m for m in net.modules() if type(m).__name__ == "Block"]

        def make_batch(n, g):
            seq = torch.randint(0, 256, (n, p["block"] + 1), generator=g)
            return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    return net, units, make_batch


def make_module(model: str, size: str, lr: float = 0.01):
    """A lean LightningModule around :func:`build_net`'s network: cross-entropy loss, SGD (momentum 0.9),
    no logging; ``configure_model`` applies FSDP2 ``fully_shard(reshard_after_forward=False)`` when the
    trainer's strategy is Lightning's ``ModelParallelStrategy``."""
    import torch
    import torch.nn.functional as F
    import lightning.pytorch as pl

    net, units, _ = build_net(model, size)

    class BenchModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            self._units = units  # plain list: not registered twice

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.net(x)
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

        def configure_model(self) -> None:
            from lightning.pytorch.strategies import ModelParallelStrategy

            if not isinstance(self.trainer.strategy, ModelParallelStrategy):
                return
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for m in self._units:
                fully_shard(m, mesh=mesh, reshard_after_forward=False)
            fully_shard(self.net, mesh=mesh, reshard_after_forward=False)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)

    return BenchModule()


# ============================================================================ worker (one rank)
class _PlanLog:
    """Keeps pipedap's rank-0 info messages (α-β fit, installed schedule) instead of printing them."""

    def __init__(self) -> None:
        import logging

        self.messages: list[str] = []
        plan_log = self

        class _Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                msg = record.getMessage()
                if msg.startswith("pipedap:"):
                    plan_log.messages.append(msg)

        lg = logging.getLogger("lightning.pytorch.utilities.rank_zero")
        lg.setLevel(logging.INFO)
        lg.propagate = False
        lg.addHandler(_Handler())

    def take(self) -> list[str]:
        out, self.messages = self.messages, []
        return out


_PLAN_LOG: Optional[_PlanLog] = None


def _quiet() -> _PlanLog:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_pipedap", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return _PlanLog()


def _make_timer(watts: float):
    import lightning.pytorch as pl

    from lightning_pipedap.measure.energy import EstimateReader

    class StepTimer(pl.Callback):
        """Start time (perf_counter, s) and estimated energy (J) at every training-batch start and at the end;
        reads neither weights nor gradients (``pipedap_reads_model = False``: no observer for the strategy);
        with a compressing pipedap strategy also every per-bucket compression round, as
        ``(step, bucket, CompressionStats)``.

        Rounds are sampled before each backward and at the end: every round of step ``t`` has finished
        before the backward of step ``t + 1`` (its update is applied in that step's forward) and none of
        step ``t + 1`` has started, so each sample sees exactly the previous step's rounds.
        """

        def __init__(self) -> None:
            self.starts: list[float] = []
            self.joules: list[float] = []
            self.pipedap_reads_model = False
            self.reader = EstimateReader(watts, basis="cpu")
            self.records: list = []
            self.rounds: list[tuple[int, int, Any]] = []
            self._last: dict[int, Any] = {}

        def _stamp(self) -> None:
            self.starts.append(time.perf_counter())
            self.joules.append(self.reader.read_J())

        def _sample(self, trainer, step: int) -> None:
            stats = getattr(trainer.strategy, "compression_stats", None)
            if stats is None:
                return
            # the transport replaces a bucket's CompressionStats object every round: a new object is a new
            # round (the old one stays referenced in _last, so its id cannot be reused)
            for b, st in stats().items():
                if self._last.get(b) is not st:
                    self._last[b] = st
                    self.rounds.append((step, b, st))

        def on_before_backward(self, trainer, pl_module, loss):
            self._sample(trainer, len(self.starts) - 2)  # rounds finished now belong to the previous step

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._stamp()

        def on_train_end(self, trainer, pl_module):
            self._stamp()
            if getattr(trainer.strategy, "compression_stats", None) is not None:
                # finish the last step's deferred rounds (the strategy's own on_train_end, right after the
                # callbacks', would do the same) so that they are counted; the timing stamp is taken already
                trainer.strategy.flush()
                self._sample(trainer, len(self.starts) - 2)
            take = getattr(trainer.strategy, "take_timeline", None)
            if take is not None:  # before teardown, which drops the engine and its records
                self.records = take()

    return StepTimer()


def _fit(spec: dict, strategy: Any, ds, steps: int, devices_kw: dict) -> tuple[Any, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    pl.seed_everything(0, verbose=False)
    module = make_module(spec["model"], spec["size"])
    timer = _make_timer(spec["watts"])
    callbacks = [timer]
    if spec.get("weight_reader"):
        from lightning.pytorch.callbacks import EMAWeightAveraging

        callbacks.append(EMAWeightAveraging(decay=0.999))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks, **devices_kw)
    trainer.fit(module, DataLoader(ds, batch_size=spec["batch"], shuffle=False))
    return timer, module


def _timeline_summary(records: list, t0: float, t1: float, n: int) -> tuple[float, float]:
    """(wait s per iteration, comm busy s per iteration) of the records that start in ``[t0, t1)``."""
    wait = sum(r.end_s - r.start_s for r in records if r.kind == "wait" and t0 <= r.start_s < t1)
    busy = sum(r.end_s - r.start_s for r in records if r.lane == "comm" and t0 <= r.start_s < t1)
    return wait / n, busy / n


def _ddp_with_comm_hook(name: str) -> Any:
    """``DDPStrategy`` that registers the DDP communication hook of ``name`` (a :data:`DDP_HOOKS` key) on the
    ``DistributedDataParallel`` module right after ``configure_ddp``, on every device: Lightning's own
    ``ddp_comm_hook=`` argument is applied only on CUDA.

    Raises:
        ValueError: ``name`` is not a DDP hook variant (naming the valid ones).
    """
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name not in DDP_HOOKS:
        raise ValueError(f"unknown DDP hook variant {name!r}; valid: {', '.join(DDP_HOOKS)}")

    class CommHookDDPStrategy(DDPStrategy):
        def configure_ddp(self) -> None:
            super().configure_ddp()
            if name == "ddp+fp16hook":
                self.model.register_comm_hook(None, default_hooks.fp16_compress_hook)
            else:
                state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                                    start_powerSGD_iter=POWERSGD_START)
                self.model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    # powerSGD_hook chains its P and Q all-reduces in future callbacks; with several DDP buckets in flight
    # those callbacks issue collectives in a timing-dependent order, which gloo (unlike NCCL's ordered
    # stream) turns into a size mismatch between ranks ("op.preamble.length <= op.nbytes", seen on the
    # 16.8 M mlp; pytorch/pytorch#58467 for another gloo failure of this hook). One bucket = one chain.
    return CommHookDDPStrategy(bucket_cap_mb=POWERSGD_ONE_BUCKET_MB) if name == "ddp+powersgdhook" else CommHookDDPStrategy()


#: DDP bucket cap for ``ddp+powersgdhook`` on gloo: large enough for every bench model's gradients
POWERSGD_ONE_BUCKET_MB = 4096


def _run_variant(spec: dict, name: str, ds, world: int, bucket_mb: Optional[float] = None,
                 steps: Optional[int] = None) -> dict:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_pipedap import PipeDAPStrategy

    steps = steps or spec["steps"]
    trial_steps = spec.get("trial_steps", TRIAL_STEPS)
    candidates = spec.get("plan_trials", PLAN_TRIALS)
    warmup = spec["warmup"] + extra_warmup_steps(name, trial_steps, candidates)
    kw = dict(devices=1, num_nodes=world)
    sp = parse_strategy(name)
    if spec.get("quick") and sp.family == "ddp":
        warmup = QUICK_DDP_WARMUP
    if sp.family == "ddp":
        strategy: Any = "ddp"
    elif sp.family == "ddp_tuned":
        strategy = DDPStrategy(bucket_cap_mb=bucket_mb)
    elif sp.family == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    elif sp.family == "ddp_hook":
        strategy = _ddp_with_comm_hook(name)
    else:
        comp = {} if sp.compressor is None else dict(compression=sp.compressor, compression_mode=sp.mode,
                                                      compression_kwargs=COMPRESSOR_KWARGS.get(sp.compressor, {}))
        strategy = PipeDAPStrategy(schedule=sp.schedule, replan_every=10**6, train_thread_nice=sp.nice,
                                   plan_trials=plan_trials(name, candidates), trial_steps=trial_steps, **comp)
        strategy.timeline_enabled = bool(spec["timeline"])
    timer, _ = _fit(spec, strategy, ds, warmup + steps, kw)
    plan = _PLAN_LOG.take() if _PLAN_LOG is not None else []
    med, n = median_step_s(timer.starts, warmup)
    energy = (timer.joules[-1] - timer.joules[warmup]) / n
    out: dict[str, Any] = {"name": name, "iter_s": med, "steps": n, "energy_J": energy, "compression": sp.compression,
                           "all_steps_ms": [round((b - a) * 1e3, 1) for a, b in zip(timer.starts[:-1], timer.starts[1:])]}
    if isinstance(strategy, PipeDAPStrategy):
        out["predicted_s"] = strategy.predicted_iteration_s
        out["plan"] = " | ".join(plan)
        out["trials"] = strategy.trial_results
        out["predictions"] = strategy.predictions
        if spec["timeline"]:
            records = timer.records
            out["wait_s"], out["comm_busy_s"] = _timeline_summary(records, timer.starts[warmup], timer.starts[-1], n)
            if spec.get("timeline_dir") and int(os.environ.get("RANK", "0")) == 0:
                _dump_timeline(records, timer.starts, warmup, spec, name, plan)
        if sp.compressor is not None:
            # the rounds of the measured steps
            summary = summarize_compression([(b, st) for k, b, st in timer.rounds if k >= warmup],
                                            pipelined=sp.mode == "process")
            if summary is None:
                raise RuntimeError(f"{name}: no compression round finished in the {n} measured steps "
                                   f"(compression_stats() stayed empty); raise --steps")
            out.update(compress_s=summary.compress_s, hidden_share=summary.hidden_share,
                       compression_ratio=summary.ratio, compressed_rounds=summary.rounds)
    return out


def _dump_timeline(records: list, starts: list[float], warmup: int, spec: dict, name: str, plan: list[str]) -> None:
    """Rank 0: write the op records of the last three measured iterations (times relative to the first
    of them, ms) and the iteration starts to ``<timeline_dir>/<model>-<link>-<ranks>r-<name>.json``."""
    t0 = starts[max(warmup, len(starts) - 4)]
    keep = [r for r in records if r.start_s >= t0]
    doc = {"iteration_starts_ms": [(t - t0) * 1e3 for t in starts if t >= t0],
           "records": [{"name": r.name, "kind": r.kind, "bucket": r.bucket, "lane": r.lane,
                        "start_ms": round((r.start_s - t0) * 1e3, 2), "end_ms": round((r.end_s - t0) * 1e3, 2)}
                       for r in keep],
           "plan": plan}
    os.makedirs(spec["timeline_dir"], exist_ok=True)
    path = os.path.join(spec["timeline_dir"], f"{spec['model']}-{spec['link']}-{spec['world']}r-{name}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def _compute_only(spec: dict, ds) -> float:
    """Median iteration of the same Lightning loop on one device, no process group traffic (s)."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    import torch

    warmup = 2  # no strategy warm-up phases here: two steps settle the allocator and caches
    timer, _ = _fit(spec, SingleDeviceStrategy(torch.device("cpu")), ds, warmup + spec["steps"], {"devices": 1})
    return median_step_s(timer.starts, warmup)[0]


def _comm_only(numels: Sequence[int], repeat: int = 4) -> list[tuple[float, float, float]]:
    """Per size: median (all-reduce s, ring RS + AG s, CPU s of the all-reduce) of ``numel`` fp32 elements
    as one buffer, on a fresh group (first round a warm-up). The CPU time is this process's user + system
    time over all its threads (``time.process_time``) during the all-reduce: gloo's copies, the ring's
    additions and the socket calls; kernel network work done outside the process is not counted."""
    import torch

    from lightning_pipedap.engine import collectives as C

    comm = C.new_comm_group(timeout_s=600)
    out = []
    for numel in numels:
        buf = torch.ones(-(-numel // comm.world_size) * comm.world_size)
        ar, rsag, cpu = [], [], []
        for _ in range(repeat + 1):
            C.barrier()
            c0 = time.process_time()
            t0 = time.perf_counter()
            C.all_reduce_(buf, comm)
            t1 = time.perf_counter()
            cpu.append(time.process_time() - c0)
            C.barrier()
            t2 = time.perf_counter()
            C.reduce_scatter_(buf, comm)
            C.all_gather_(buf, comm)
            t3 = time.perf_counter()
            ar.append(t1 - t0)
            rsag.append(t3 - t2)
        out.append((statistics.median(ar[1:]), statistics.median(rsag[1:]), statistics.median(cpu[1:])))
    C.destroy_comm_group(comm)
    return out


def first_layer_numel(net) -> int:
    """Parameters of the first module (registration order, which is forward order for the bench models)
    that owns parameters: its gradient is finished last in backward and needed first in the next forward."""
    for m in net.modules():
        own = list(m.parameters(recurse=False))
        if own:
            return sum(p.numel() for p in own)
    raise ValueError(f"{type(net).__name__} has no parameters")


def _pick_ddp_bucket(spec: dict, ds, world: int) -> tuple[float, str]:
    """``ddp_tuned``'s bucket cap: the candidate with the fastest short run (rank 0 decides), and a note."""
    caps = spec["ddp_bucket_mb"]
    if len(caps) == 1:
        return caps[0], f"bucket_cap_mb={caps[0]:g}"
    from lightning_pipedap.engine import collectives as C

    short = dict(spec, timeline=False, warmup=2)  # DDP has no warm-up phases; two steps settle its buckets
    trial = {c: _run_variant(short, "ddp_tuned", ds, world, c, spec["sweep_steps"])["iter_s"] for c in caps}
    best = C.broadcast_object(min(trial, key=trial.get), src=0)  # every rank must use the same cap
    return best, f"bucket_cap_mb={best:g} (sweep " + ", ".join(f"{c:g}: {t * 1e3:.0f} ms" for c, t in trial.items()) + ")"


def worker(spec: dict) -> dict:
    """One rank of a cell: compute-only, every strategy (``repeats`` rounds, round-robin), communication-
    only, compute-only again; returns the raw results of this rank.

    ``spec`` keys: model, size, batch, steps, warmup, strategies, ddp_bucket_mb (list of MiB), sweep_steps,
    repeats, threads, watts, timeline, link, timeline_dir. With ``repeats > 1`` each strategy keeps its
    run with the lowest median (noise on a shared machine only adds time). Any error propagates: the
    peers then fail or time out, and the driver reports the rank's output.
    """
    import torch
    from torch.utils.data import TensorDataset

    global _PLAN_LOG
    _PLAN_LOG = _quiet()
    torch.set_num_threads(spec["threads"])
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    spec = dict(spec, world=world)
    _, _, make_batch = build_net(spec["model"], spec["size"])
    total = spec["warmup"] + max(extra_warmup_steps(n, spec.get("trial_steps", TRIAL_STEPS), spec.get("plan_trials", PLAN_TRIALS))
                                 for n in spec["strategies"]) + max(spec["steps"], spec["sweep_steps"])
    n = spec["batch"] * (total + 1) * world
    g = torch.Generator().manual_seed(1234)
    ds = TensorDataset(*make_batch(n, g))
    res: dict[str, Any] = {"rank": rank, "world": world, "variants": [], "skipped": {}}
    compute_runs = [_compute_only(spec, ds)]
    net = make_module(spec["model"], spec["size"]).net
    res["params"] = sum(p.numel() for p in net.parameters())
    res["first_layer_params"] = first_layer_numel(net)
    best: dict[str, dict] = {}
    bucket, note = None, ""
    for r in range(spec.get("repeats", 1)):
        for name in spec["strategies"]:
            if name == "ddp_tuned" and bucket is None:
                bucket, note = _pick_ddp_bucket(spec, ds, world)
            v = _run_variant(spec, name, ds, world, bucket if name == "ddp_tuned" else None)
            v["note"] = note if name == "ddp_tuned" else ""
            v["runs_ms"] = best.get(name, {}).get("runs_ms", []) + [round(v["iter_s"] * 1e3, 1)]
            if name not in best or v["iter_s"] < best[name]["iter_s"]:
                best[name] = v
            else:
                best[name]["runs_ms"] = v["runs_ms"]
    for name in spec["strategies"]:
        v = best[name]
        if len(v["runs_ms"]) > 1:
            v["note"] = (v["note"] + "; " if v["note"] else "") + "best of " + "/".join(f"{x:.0f}" for x in v["runs_ms"]) + " ms"
        del v["runs_ms"]
        res["variants"].append(v)
    (res["allreduce_s"], res["rs_ag_s"], res["allreduce_cpu_s"]), first = _comm_only(
        [res["params"], res["first_layer_params"]])
    res["first_layer_comm_s"] = min(first[:2])
    # compute-only again at the end (not in --quick): the bound takes the faster of the two runs (noise
    # on a shared machine only ever adds time); both are kept
    if not spec.get("quick"):
        compute_runs.append(_compute_only(spec, ds))
    res["compute_runs_s"] = compute_runs
    res["compute_s"] = min(compute_runs)
    from lightning_pipedap.engine import collectives as C

    C.shutdown()  # destroy the default group before exit (live gloo threads at exit can abort the process)
    return res


def _max_or_none(values: Sequence[Optional[float]]) -> Optional[float]:
    """The largest value, or None when any is None (a rank that did not measure it)."""
    return None if not values or any(v is None for v in values) else max(values)


def combine(model: str, link: str, raw: Sequence[dict], batch: int) -> CellResult:
    """Merge the ranks' raw results: rank 0's iteration times and references, the slowest rank's compute,
    energy summed over ranks.

    Raises:
        ValueError: no rank results, or ranks that disagree on the strategies run.
    """
    if not raw:
        raise ValueError("no rank reported a result")
    raw = sorted(raw, key=lambda r: r["rank"])
    r0 = raw[0]
    names = [v["name"] for v in r0["variants"]]
    for r in raw[1:]:
        if [v["name"] for v in r["variants"]] != names:
            raise ValueError(f"rank {r['rank']} ran {[v['name'] for v in r['variants']]}, rank 0 ran {names}")
    variants = []
    for k, v in enumerate(r0["variants"]):
        energies = [r["variants"][k].get("energy_J") for r in raw]
        e = sum(energies) if all(x is not None for x in energies) else None
        variants.append(VariantResult(**dict(v, energy_J=e)))
    return CellResult(model=model, link=link, ranks=len(raw), params_M=r0["params"] / 1e6, batch=batch,
                      compute_s=max(r["compute_s"] for r in raw), allreduce_s=r0["allreduce_s"], rs_ag_s=r0["rs_ag_s"],
                      first_layer_comm_s=r0.get("first_layer_comm_s"),
                      allreduce_cpu_s=_max_or_none([r.get("allreduce_cpu_s") for r in raw]),
                      variants=variants,
                      skipped=dict(r0.get("skipped", {})))


# ============================================================================ driver
def run_cell(model: str, link: str, ranks: int, args: argparse.Namespace) -> CellResult:
    """Launch one cell on a fresh testbed and return its combined result.

    Raises:
        TestbedUnavailable: namespaces cannot be created here (not root, no iproute2).
        RuntimeError / TimeoutError: from :meth:`Testbed.run_ranks` (a rank failed / ran past the timeout).
    """
    from lightning_pipedap.testbed import Testbed

    batch = args.batch or PRESETS[model][args.size]["batch"]
    spec = dict(model=model, size=args.size, batch=batch, steps=args.steps, warmup=args.warmup,
                strategies=list(args.strategies), ddp_bucket_mb=list(args.ddp_bucket_mb), sweep_steps=args.sweep_steps,
                repeats=args.repeats, quick=bool(args.quick),
                trial_steps=QUICK_TRIAL_STEPS if args.quick else TRIAL_STEPS,
                plan_trials=QUICK_PLAN_TRIALS if args.quick else PLAN_TRIALS,
                threads=args.threads, watts=args.watts, timeline=bool(args.timeline), link=link,
                weight_reader=bool(args.weight_reader), timeline_dir=os.path.abspath(args.timeline_dir) if args.timeline_dir else None)
    rate = None if link == "none" else link
    with tempfile.TemporaryDirectory(prefix="pipedap-matrix-") as cache, Testbed(hosts=ranks, rate=rate) as tb:
        # a per-cell α-β cache: the planned schedules of this cell share one measurement of this link
        env = {"OMP_NUM_THREADS": str(args.threads), "PIPEDAP_CACHE_DIR": cache}
        outs = tb.run_ranks([sys.executable, "-m", "lightning_pipedap.bench.matrix", "--worker", json.dumps(spec)],
                            timeout_s=args.cell_timeout_s, env=env)
    raw = [json.loads(line[len("RESULT "):]) for o in outs for line in o.splitlines() if line.startswith("RESULT ")]
    if len(raw) != ranks:
        raise RuntimeError(f"{len(raw)} of {ranks} ranks reported a result; rank 0 output tail:\n{outs[0][-3000:]}")
    return combine(model, link, raw, batch)


def _render_outputs(cells: list[CellResult], meta: dict, args: argparse.Namespace) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "cells": [asdict(c) for c in cells]}, f, indent=1)
    if args.markdown:
        old = open(args.markdown).read() if os.path.exists(args.markdown) else ""
        with open(args.markdown, "w") as f:
            f.write(replace_marked_section(old, render_markdown(cells, meta)))
    if args.chart and cells:
        write_chart(cells, args.chart)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status (0 ok, 2 testbed unavailable)."""
    args = parse_args(argv)
    if args.worker is not None:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    if args.list:
        print("models:", ", ".join(MODELS))
        print("links:", ", ".join(LINKS))
        print("strategies:", ", ".join(valid_strategies(args.compressors)))
        print(f"  (also any {PIPEDAP_PREFIX}<schedule>{COMPRESS_SEP}<compressor>[{INLINE_SUFFIX}]; "
              f"'all' = the above without {INLINE_SUFFIX}; any pipedap form may end in {NICE_SUFFIX}<N>, "
              f"N in 1..19: train_thread_nice=N)")
        print("compressors:", ", ".join(compressor_names()),
              f"(kwargs: {'; '.join(f'{k} {v}' for k, v in COMPRESSOR_KWARGS.items())})")
        return 0
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        cells = [CellResult.from_dict(c) for c in data["cells"]]
        for c in cells:
            print(format_text_report(c))
        _render_outputs(cells, data["meta"], args)
        return 0
    from lightning_pipedap.testbed import TestbedUnavailable, testbed_available

    ok, why = testbed_available()
    if not ok:
        print(f"testbed unavailable: {why}", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    cmd = "python -m lightning_pipedap.bench.matrix " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = dict(machine=machine_description(), command=cmd.strip(), date=time.strftime("%Y-%m-%d %H:%M"),
                steps=args.steps, warmup=args.warmup, threads=args.threads, watts=args.watts,
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
        print(f"speedup_vs_ddp={c.speedup(DEFAULT_PIPEDAP):.2f} ratio_to_bound={c.ratio(DEFAULT_PIPEDAP):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
