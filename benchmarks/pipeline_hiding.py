"""Benchmark: how much compression time the helper-process pipeline hides behind backward, given a free core.

Not a test (no assertions on time). Issue 4 asks for "per compressor, iteration time inline vs pipelined
and the share of compression time hidden". The bench matrix measures it inside 2-rank training on a
2-core machine, where both cores already run a rank's compute and the helper has no core of its own.
This script measures what :class:`~lightning_pipedap.compress.pipeline.CompressionPipeline` itself
delivers when a core is free: **one** trainer process (1 torch thread) and its helper process (1 thread),
no process group, no communication.

Simulated backward (one iteration):

* The gradient buckets are the bench mlp's (``lightning_pipedap.bench.matrix`` preset ``mlp``/``bench``:
  16 ``Linear(1024, 1024)`` + ``Linear(1024, 10)``, 16.8 M fp32 parameters) fused greedily in forward order
  up to ``--bucket-cap-mb`` (default 25 MiB, pipedap's default cap; :func:`~lightning_pipedap.schedule.
  fuse_by_size`), or ``--buckets`` equal buckets of ``--numel-per-bucket`` elements. Backward produces
  them in reverse order (last bucket first).
* Per bucket a *compute segment* on the trainer thread: fp32 matmuls ``[64, 512] @ [512, 512]``, their
  count calibrated (before any helper starts) so that all segments take ``--backward-ms`` in total
  (default 390 ms, the bench mlp's measured backward on this machine), split over buckets in proportion
  to their elements. When a bucket's segment ends its "gradient" (a fixed ``randn`` ``[n]`` fp32 per
  bucket; error feedback still changes what is compressed every step) is ready.
* **pipelined** (``mode="process"``): ``submit(b, grad)`` and go on with the next segment. A stand-in for
  the engine's communication worker (a thread of the trainer process, as in
  :class:`~lightning_pipedap.engine.compressed.CompressedTransport`) takes each ticket, waits for its
  payload, runs the further rounds (PowerSGD: P then Q) and the decompression in the helper, and releases
  it. World size 1, no communication: the "reduced" payload passed to ``next_round`` / ``decompress`` is
  the local payload itself (the sum over one rank). Non-summable methods (``topk``, ...) are decompressed
  in the helper too; at world size 1 that is exactly ``aggregate([payload])`` (which the real engine runs
  on its communication worker after an all-gather). After the last segment the trainer waits until every
  bucket is done.
* **inline** (``mode="inline"``): the same calls, all on the trainer thread right after the bucket's
  segment (compress, rounds, decompress): compression sits on the critical path.
* **dense**: the compute segments only.

The three run interleaved (dense, inline, pipelined, dense, ...) so drifting machine load hits all alike.
Per compressor, after ``--warmup`` rounds (+ the compressor's uncompressed ``start_step`` rounds for
PowerSGD), over ``--repeats`` rounds:

* *iteration time*: start of the first segment to the last bucket done (median, ms);
* *compression time*: time the helper (or the inline call) spent compressing, in further rounds and
  decompressing, summed over buckets (``pipe.timings(ticket)`` without ``wait``; median, ms);
* *exposed*: trainer-thread time spent on compression: inside pipeline calls during backward (pipelined:
  the copy into the shared-memory slot; inline: the compression itself) plus the wait for the last
  results after the backward (median, ms);
* *hidden* = ``1 - sum(exposed) / sum(compression)`` over the measured rounds, clamped to [0, 1]
  (PipeCompress, Wu et al., ICC 2022: the share of compression that overlaps backward);
* *bound*: the most a single helper could hide given the measured compression time of each bucket and
  the times the buckets were submitted (a one-server queue: bucket k starts at ``max(submit_k,
  end of bucket k-1)``; what ends after the backward is exposed). The last bucket's compression can
  never be hidden, so large buckets cap the share;
* *end-to-end*: ``1 - (pipelined iteration - dense iteration) / compression``, clamped: the hidden share
  including the helper's contention on memory and caches (noisier);
* *speedup*: inline iteration time / pipelined iteration time;
* *ratio*: dense bytes / payload bytes (communicated tensors, all rounds);
* *parity*: max |inline - pipelined| of the decompressed gradients in the last warm-up round (PowerSGD:
  a compressed one; 0 expected: same code, same inputs, same states, 1 thread each).

The output starts with ``os.cpu_count()`` and ``os.sched_getaffinity(0)``: with fewer than 2 usable
cores the helper shares the trainer's core and the hidden share is meaningless (said in the output).

Usage::

    python benchmarks/pipeline_hiding.py [--methods fp16,powersgd,topk] [--backward-ms 390]
        [--bucket-cap-mb 25 | --numel-per-bucket N --buckets K] [--repeats 5] [--warmup 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from lightning_pipedap.compress import valid_compressor_names
from lightning_pipedap.compress.pipeline import CompressionPipeline, Ticket
from lightning_pipedap.schedule import fuse_by_size

#: keyword arguments per compressor (as in benchmarks/compress_bench.py); others take their defaults
DEFAULT_KWARGS: dict[str, dict[str, Any]] = {
    "powersgd": {"rank": 4},
    "randomk": {"ratio": 0.01},
    "topk": {"ratio": 0.01},
    "dgc": {"ratio": 0.01, "sample_ratio": 0.01},
    "qsgd": {"levels": 127},
}
DEFAULT_METHODS = "fp16,powersgd,topk"
#: unit of simulated backward compute: ``[UNIT_ROWS, UNIT_DIM] @ [UNIT_DIM, UNIT_DIM]`` fp32
UNIT_ROWS, UNIT_DIM = 64, 512
#: seconds to wait for any result before giving up (the helper's own waits use the pipeline's timeout)
WAIT_TIMEOUT_S = 120.0
TARGET_HIDDEN = 0.70


# ============================================================================ buckets
@dataclass(frozen=True)
class Buckets:
    """Gradient buckets of the simulated model.

    Attributes:
        numels: elements of each bucket (index = bucket, forward order).
        layouts: per bucket, ``(parameter name, shape)`` in buffer order (PowerSGD compresses each 2-D one).
        description: one line for the output.
    """

    numels: tuple[int, ...]
    layouts: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]
    description: str


def mlp_buckets(width: int = 1024, depth: int = 16, features: int = 1024, classes: int = 10,
                cap_mb: float = 25.0) -> Buckets:
    """The bench mlp's parameters (``depth`` x ``Linear(., width)`` then ``Linear(width, classes)``), fused in
    forward order up to ``cap_mb`` MiB per bucket (greedy, as pipedap's fixed schedules).

    Raises:
        ValueError: a size < 1 or a cap <= 0.
    """
    for nm, v in (("width", width), ("depth", depth), ("features", features), ("classes", classes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{nm} must be an integer >= 1, got {v!r}")
    if not cap_mb > 0:
        raise ValueError(f"bucket cap must be > 0 MiB, got {cap_mb!r}")
    params: list[tuple[str, tuple[int, ...]]] = []
    for i in range(depth):  # nn.Sequential(Linear, ReLU, Linear, ReLU, ..., Linear): Linears at even indices
        params += [(f"{2 * i}.weight", (width, features if i == 0 else width)), (f"{2 * i}.bias", (width,))]
    params += [(f"{2 * depth}.weight", (classes, width)), (f"{2 * depth}.bias", (classes,))]
    sizes = [4 * math.prod(s) for _, s in params]
    groups = fuse_by_size(sizes, int(cap_mb * 2**20))
    layouts = tuple(tuple(params[i] for i in g) for g in groups)
    numels = tuple(sum(math.prod(s) for _, s in lay) for lay in layouts)
    desc = (f"mlp {depth} x Linear(->{width}) + Linear({width}->{classes}), "
            f"{sum(numels) / 1e6:.1f} M fp32 params, fused up to {cap_mb:g} MiB")
    return Buckets(numels, layouts, desc)


def equal_buckets(numel: int, count: int) -> Buckets:
    """``count`` buckets of ``numel`` elements, each one near-square matrix (rows = largest divisor of
    ``numel`` <= sqrt(numel)), so PowerSGD has something to factorise.

    Raises:
        ValueError: ``numel`` or ``count`` < 1.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
        raise ValueError(f"--numel-per-bucket must be an integer >= 1, got {numel!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"--buckets must be an integer >= 1, got {count!r}")
    rows = math.isqrt(numel)
    while numel % rows:
        rows -= 1
    layouts = tuple(((f"b{b}.grad", (rows, numel // rows)),) for b in range(count))
    desc = f"{count} equal buckets of {numel} fp32 elements ({rows} x {numel // rows})"
    return Buckets((numel,) * count, layouts, desc)


# ============================================================================ simulated compute
class Compute:
    """Simulated backward compute: ``counts[b]`` matmuls ``[UNIT_ROWS, UNIT_DIM] @ [UNIT_DIM, UNIT_DIM]`` per
    bucket, on the calling thread (use ``torch.set_num_threads(1)``)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.a = torch.randn(UNIT_ROWS, UNIT_DIM, generator=g)
        self.w = torch.randn(UNIT_DIM, UNIT_DIM, generator=g) / UNIT_DIM**0.5
        self.c = torch.empty(UNIT_ROWS, UNIT_DIM)
        self.counts: list[int] = []
        self.unit_s = 0.0

    def run(self, units: int) -> None:
        """Run ``units`` matmuls."""
        for _ in range(units):
            torch.mm(self.a, self.w, out=self.c)

    def calibrate(self, backward_s: float, numels: Sequence[int], probes: int = 5) -> None:
        """Set ``unit_s`` (min over ``probes`` timed blocks of one matmul's seconds) and per bucket the matmul
        count that spreads ``backward_s`` over the buckets in proportion to their elements (>= 1 each)."""
        block = 50
        self.run(block)  # warm caches and the allocator
        times = []
        for _ in range(probes):
            t0 = time.perf_counter()
            self.run(block)
            times.append((time.perf_counter() - t0) / block)
        self.unit_s = min(times)
        total = sum(numels)
        self.counts = [max(1, round(backward_s * n / total / self.unit_s)) for n in numels]


# ============================================================================ one iteration
@dataclass
class BucketRecord:
    """One bucket's trip through the pipeline: ``compress_s`` (helper/inline seconds compressing, further
    rounds, decompressing), ``payload_bytes`` (communicated tensors, all rounds), ``out`` (the decompressed
    ``[n]`` gradient, cloned, only when asked)."""

    bucket: int
    compress_s: float
    payload_bytes: int
    out: torch.Tensor | None


@dataclass
class IterRecord:
    """One iteration, seconds. ``backward_s``: first segment start to last segment end (pipeline calls on the
    trainer thread included); ``compute_s``: the segments alone; ``trainer_s``: trainer time in pipeline
    calls during backward; ``wait_s``: after the backward until every bucket was done; ``submit_at``: per
    bucket (index = bucket), seconds from the iteration start to the return of its ``submit``."""

    iter_s: float
    backward_s: float
    compute_s: float
    trainer_s: float = 0.0
    wait_s: float = 0.0
    compress_s: float = 0.0
    payload_bytes: int = 0
    dense_bytes: int = 0
    per_bucket_compress_s: tuple[float, ...] = ()
    submit_at: tuple[float, ...] = ()
    outs: tuple[torch.Tensor, ...] = ()

    @property
    def exposed_s(self) -> float:
        """Trainer-thread seconds spent on compression: pipeline calls during backward + wait after it."""
        return self.trainer_s + self.wait_s


def reduce_local(pipe: CompressionPipeline, ticket: Ticket, keep: bool) -> BucketRecord:
    """World-size-1 stand-in of :meth:`CompressedTransport.reduce`: collect the payload, run the further
    rounds with the local payload as the "sum over ranks", decompress (in the helper in process mode),
    read the timings and release the ticket.

    Raises:
        RuntimeError, HelperDiedError, HelperTimeoutError: from the pipeline.
    """
    p = pipe.result(ticket)
    nbytes = p.nbytes
    while not p.final:
        p = pipe.next_round(ticket, p)
        nbytes += p.nbytes
    grad = pipe.decompress(ticket, p)
    out = grad.clone() if keep else None
    timings = pipe.timings(ticket)
    pipe.release(ticket)
    return BucketRecord(ticket.bucket, sum(v for k, v in timings.items() if k != "wait"), nbytes, out)


def _worker(pipe: CompressionPipeline, tickets: "queue.Queue[Ticket]", done: "queue.Queue[tuple]", count: int,
            keep: bool) -> None:
    """Stand-in communication worker: reduce ``count`` tickets in arrival order, report each on ``done``."""
    try:
        for _ in range(count):
            try:
                t = tickets.get(timeout=WAIT_TIMEOUT_S)
            except queue.Empty:
                raise TimeoutError(f"worker: no ticket submitted within {WAIT_TIMEOUT_S:g} s") from None
            done.put(("ok", reduce_local(pipe, t, keep)))
    except BaseException as e:  # reported to the trainer thread, which raises it
        done.put(("error", e))


def run_iteration(compute: Compute, grads: Sequence[torch.Tensor], pipe: CompressionPipeline | None,
                  keep: bool = False) -> IterRecord:
    """One simulated backward over ``grads`` (``[n_b]`` fp32 per bucket, produced last bucket first).

    ``pipe`` None: dense (segments only). ``pipe.mode == "inline"``: each bucket is compressed, further
    rounds run and decompressed on this thread after its segment. ``"process"``: each bucket is submitted
    after its segment and a worker thread collects it; after the last segment this thread waits for all.

    Raises:
        TimeoutError: a bucket not done within ``WAIT_TIMEOUT_S`` s after the backward.
        RuntimeError: the pipeline or the worker failed (chained cause).
    """
    order = range(len(grads) - 1, -1, -1)
    recs: dict[int, BucketRecord] = {}
    submit_at = [0.0] * len(grads)
    compute_s = trainer_s = 0.0
    worker = tickets = done = None
    if pipe is not None and pipe.mode == "process":
        tickets, done = queue.Queue(), queue.Queue()
        worker = threading.Thread(target=_worker, args=(pipe, tickets, done, len(grads), keep),
                                  name="stand-in-comm-worker", daemon=True)
        worker.start()
    t0 = time.perf_counter()
    for b in order:
        ts = time.perf_counter()
        compute.run(compute.counts[b])
        tc = time.perf_counter()
        compute_s += tc - ts
        if pipe is None:
            continue
        if worker is None:  # inline: the whole bucket on this thread
            recs[b] = reduce_local(pipe, pipe.submit(b, grads[b]), keep)
        else:
            tickets.put(pipe.submit(b, grads[b]))
        te = time.perf_counter()
        trainer_s += te - tc
        submit_at[b] = te - t0
    t_bwd = time.perf_counter()
    if worker is not None:
        for _ in grads:
            try:
                kind, value = done.get(timeout=WAIT_TIMEOUT_S)
            except queue.Empty:
                raise TimeoutError(f"{pipe.compressor_name}: buckets not done within {WAIT_TIMEOUT_S:g} s after "
                                   f"the backward ({len(recs)} of {len(grads)} done)") from None
            if kind == "error":
                raise RuntimeError(f"{pipe.compressor_name}: stand-in communication worker failed: {value}") from value
            recs[value.bucket] = value
    t_end = time.perf_counter()
    if worker is not None:
        worker.join(timeout=WAIT_TIMEOUT_S)
        if worker.is_alive():
            raise TimeoutError(f"stand-in communication worker did not exit within {WAIT_TIMEOUT_S:g} s")
    rec = IterRecord(iter_s=t_end - t0, backward_s=t_bwd - t0, compute_s=compute_s)
    if pipe is not None:
        rs = [recs[b] for b in range(len(grads))]
        rec.trainer_s, rec.wait_s = trainer_s, t_end - t_bwd
        rec.per_bucket_compress_s = tuple(r.compress_s for r in rs)
        rec.compress_s = sum(rec.per_bucket_compress_s)
        rec.payload_bytes = sum(r.payload_bytes for r in rs)
        rec.dense_bytes = sum(4 * g.numel() for g in grads)
        rec.submit_at = tuple(submit_at)
        if keep:
            rec.outs = tuple(r.out for r in rs)
    return rec


# ============================================================================ statistics
def clamp01(x: float) -> float:
    """``x`` clamped to ``[0, 1]``."""
    return min(1.0, max(0.0, x))


def hidden_share(exposed_s: Sequence[float], compress_s: Sequence[float]) -> float | None:
    """``1 - sum(exposed) / sum(compression)`` clamped to [0, 1]; None when nothing was compressed."""
    c = sum(compress_s)
    return None if c <= 0 else clamp01(1.0 - sum(exposed_s) / c)


def min_exposed_s(submit_at: Sequence[float], compress_s: Sequence[float], backward_s: float) -> float:
    """Lower bound of the exposed compression time with one helper: buckets are served one at a time in
    submission order, bucket k from ``max(submit_at[k], end of the previous one)`` for ``compress_s[k]``
    seconds; whatever ends after ``backward_s`` is exposed (no hand-off latency, no contention)."""
    end = 0.0
    for k in sorted(range(len(submit_at)), key=lambda i: submit_at[i]):
        end = max(end, submit_at[k]) + compress_s[k]
    return max(0.0, end - backward_s)


def _ms(xs: Sequence[float]) -> float:
    return statistics.median(xs) * 1e3


def summarize_mode(recs: Sequence[IterRecord]) -> dict[str, Any]:
    """Medians (ms), per-iteration lists (``*_all``, ms) and the hidden share of one mode over its measured
    iterations."""
    out: dict[str, Any] = {
        "iterations": len(recs),
        "iter_ms": _ms([r.iter_s for r in recs]),
        "iter_ms_all": [r.iter_s * 1e3 for r in recs],
        "backward_ms": _ms([r.backward_s for r in recs]),
        "compute_ms": _ms([r.compute_s for r in recs]),
        "compute_ms_all": [r.compute_s * 1e3 for r in recs],
    }
    if recs and recs[0].dense_bytes:
        out.update({
            "trainer_ms": _ms([r.trainer_s for r in recs]),
            "wait_ms": _ms([r.wait_s for r in recs]),
            "exposed_ms": _ms([r.exposed_s for r in recs]),
            "exposed_ms_all": [r.exposed_s * 1e3 for r in recs],
            "compress_ms": _ms([r.compress_s for r in recs]),
            "compress_ms_all": [r.compress_s * 1e3 for r in recs],
            "hidden_share": hidden_share([r.exposed_s for r in recs], [r.compress_s for r in recs]),
        })
    return out


# ============================================================================ per compressor
def bench_method(name: str, kwargs: dict[str, Any], buckets: Buckets, compute: Compute, grads: Sequence[torch.Tensor],
                 warmup: int, repeats: int, log=print) -> dict[str, Any]:
    """Dense, inline and pipelined iterations of one compressor, interleaved; returns its result dict."""
    pipes = {}
    try:
        pipes["inline"] = CompressionPipeline(buckets.numels, name, kwargs, mode="inline", layouts=buckets.layouts)
        t0 = time.perf_counter()
        pipes["process"] = CompressionPipeline(buckets.numels, name, kwargs, mode="process", threads=1,
                                               layouts=buckets.layouts)
        start_s = time.perf_counter() - t0
        skip = warmup + int(getattr(pipes["inline"].compressor, "start_step", 0))
        recs: dict[str, list[IterRecord]] = {"dense": [], "inline": [], "process": []}
        parity = None
        parity_round = max(0, skip - 1)  # the last skipped round (PowerSGD: a compressed step), else the first
        for i in range(skip + repeats):
            keep = i == parity_round
            dense = run_iteration(compute, grads, None)
            inline = run_iteration(compute, grads, pipes["inline"], keep)
            proc = run_iteration(compute, grads, pipes["process"], keep)
            if keep:
                parity = max(float((a - b).abs().max()) for a, b in zip(inline.outs, proc.outs))
                inline.outs = proc.outs = ()
            if i >= skip:
                for mode, r in (("dense", dense), ("inline", inline), ("process", proc)):
                    recs[mode].append(r)
    finally:
        for p in pipes.values():
            p.close()
    res: dict[str, Any] = {"method": name, "kwargs": kwargs, "helper_start_s": start_s, "skipped_rounds": skip}
    for mode, rs in recs.items():
        res[mode] = summarize_mode(rs)
    proc = recs["process"]
    res["ratio"] = sum(r.dense_bytes for r in proc) / max(1, sum(r.payload_bytes for r in proc))
    res["parity_max_abs_diff"] = parity
    res["hidden_share"] = res["process"]["hidden_share"]
    floor = [min_exposed_s(r.submit_at, r.per_bucket_compress_s, r.backward_s) for r in proc]
    res["hidden_bound"] = hidden_share(floor, [r.compress_s for r in proc])
    comp = res["process"]["compress_ms"]
    res["hidden_share_end_to_end"] = (None if comp <= 0 else
                                      clamp01(1.0 - (res["process"]["iter_ms"] - res["dense"]["iter_ms"]) / comp))
    res["speedup_pipelined_vs_inline"] = res["inline"]["iter_ms"] / res["process"]["iter_ms"]
    log(f"  {name}: helper start {start_s:.1f} s, {skip} rounds skipped, {repeats} measured")
    return res


# ============================================================================ output
def cpu_info() -> dict[str, Any]:
    """``os.cpu_count()``, the usable cores (``os.sched_getaffinity(0)`` where available) and whether the
    helper can have a core of its own (>= 2 usable)."""
    try:
        aff = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        aff = list(range(os.cpu_count() or 1))
    own = len(aff) >= 2
    note = ("the helper can run on a core of its own" if own else
            "only 1 usable core: the helper shares the trainer's core, so the hidden share is meaningless here")
    return {"cpu_count": os.cpu_count(), "affinity": aff, "usable_cores": len(aff), "helper_has_own_core": own,
            "note": note}


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:.0f}%"


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """Markdown table, one row per compressor."""
    rows = ["| method | dense ms | inline ms | pipelined ms | speedup pipelined vs inline | compression ms/iter "
            "| exposed ms (pipelined) | hidden | bound | hidden end-to-end | ratio | parity |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        kw = ",".join(f"{k}={v}" for k, v in r["kwargs"].items())
        p = r["process"]
        label = f"{r['method']} {kw}" if kw else r["method"]
        rows.append(f"| {label} | {r['dense']['iter_ms']:.0f} | {r['inline']['iter_ms']:.0f} "
                    f"| {p['iter_ms']:.0f} | {r['speedup_pipelined_vs_inline']:.2f} | {p['compress_ms']:.1f} "
                    f"| {p['exposed_ms']:.1f} | {_pct(r['hidden_share'])} | {_pct(r['hidden_bound'])} "
                    f"| {_pct(r['hidden_share_end_to_end'])} | {r['ratio']:.1f} | {r['parity_max_abs_diff']:.1e} |")
    return "\n".join(rows)


def summary_line(results: Sequence[dict[str, Any]], cpu: dict[str, Any]) -> str:
    """One line: per compressor pipelined vs inline, hidden share (and bound) against the 70% target."""
    parts = []
    for r in results:
        h, bnd = r["hidden_share"], r["hidden_bound"]
        if h is not None and h >= TARGET_HIDDEN:
            verdict = "target met"
        elif bnd is not None and bnd < TARGET_HIDDEN:
            verdict = "bound below target: the buckets cannot hide 70%"
        else:
            verdict = "below target"
        parts.append(f"{r['method']} hidden {_pct(h)} (bound {_pct(bnd)}, {verdict}), "
                     f"{r['speedup_pipelined_vs_inline']:.2f}x vs inline")
    core = "" if cpu["helper_has_own_core"] else " [1 usable core: hidden share meaningless]"
    return f"summary: {cpu['usable_cores']} usable cores{core}; " + "; ".join(parts)


# ============================================================================ main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and validate the command line.

    Raises:
        ValueError: an unknown compressor (listing the valid names) or an out-of-range number.
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default=DEFAULT_METHODS,
                    help=f"comma list of compressors (default {DEFAULT_METHODS}); valid: "
                         f"{', '.join(valid_compressor_names())}")
    ap.add_argument("--backward-ms", type=float, default=390.0, help="simulated backward compute, ms (default 390)")
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0, help="fusion cap of the mlp buckets, MiB")
    ap.add_argument("--numel-per-bucket", type=int, default=None,
                    help="equal buckets of this many elements instead of the mlp's")
    ap.add_argument("--buckets", type=int, default=4, help="number of equal buckets (with --numel-per-bucket)")
    ap.add_argument("--repeats", type=int, default=5, help="measured rounds per compressor (median)")
    ap.add_argument("--warmup", type=int, default=2, help="rounds dropped first (PowerSGD: + its start steps)")
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    args = ap.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    valid = valid_compressor_names()
    bad = [m for m in args.methods if m not in valid]
    if bad or not args.methods:
        raise ValueError(f"unknown compressor(s) {bad or args.methods!r}; valid names: {', '.join(valid)}")
    if not (math.isfinite(args.backward_ms) and args.backward_ms > 0):
        raise ValueError(f"--backward-ms must be a number of ms > 0, got {args.backward_ms!r}")
    if args.repeats < 1 or args.warmup < 0:
        raise ValueError(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    return args


def main(argv: Sequence[str] | None = None, log=print) -> dict[str, Any]:
    """Run the benchmark (see the module docstring); print the table and the summary; return (and with
    ``--json`` write) the results.

    Raises:
        ValueError: bad arguments (see :func:`parse_args`).
    """
    args = parse_args(argv)
    buckets = (equal_buckets(args.numel_per_bucket, args.buckets) if args.numel_per_bucket is not None
               else mlp_buckets(cap_mb=args.bucket_cap_mb))
    cpu = cpu_info()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        log(f"cores: os.cpu_count()={cpu['cpu_count']}, os.sched_getaffinity(0)={cpu['affinity']}: {cpu['note']}")
        log(f"buckets: {buckets.description}: {len(buckets.numels)} buckets of "
            f"{', '.join(f'{n / 1e6:.2f}' for n in buckets.numels)} M elements; trainer and helper 1 torch thread each")
        compute = Compute()
        compute.calibrate(args.backward_ms / 1e3, buckets.numels)
        g = torch.Generator().manual_seed(0)
        grads = [torch.randn(n, generator=g) for n in buckets.numels]
        log(f"backward: target {args.backward_ms:g} ms, matmul unit {compute.unit_s * 1e3:.3f} ms, segments "
            f"{compute.counts} units (last bucket first in backward)")
        results = [bench_method(m, DEFAULT_KWARGS.get(m, {}), buckets, compute, grads, args.warmup, args.repeats, log)
                   for m in args.methods]
    finally:
        torch.set_num_threads(threads)
    table = format_table(results)
    line = summary_line(results, cpu)
    log("")
    log(table)
    log("")
    log("hidden = 1 - exposed / compression (exposed: trainer time in pipeline calls during backward + wait after "
        "it); bound: the most one helper could hide with these buckets and submit times; end-to-end: "
        "1 - (pipelined - dense iteration) / compression; parity: max |inline - pipelined| of decompressed gradients")
    log(line)
    out = {
        "cpu": cpu,
        "config": {"methods": args.methods, "backward_ms": args.backward_ms, "repeats": args.repeats,
                   "warmup": args.warmup, "buckets": list(buckets.numels), "bucket_description": buckets.description,
                   "torch": torch.__version__, "python": sys.version.split()[0]},
        "calibration": {"unit_ms": compute.unit_s * 1e3, "unit": f"[{UNIT_ROWS},{UNIT_DIM}]@[{UNIT_DIM},{UNIT_DIM}]",
                        "segment_units": compute.counts},
        "methods": results,
        "table": table,
        "summary": line,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
