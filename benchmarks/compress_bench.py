"""Micro-benchmark: per-method compression time and ratio, and the trainer → helper hand-off cost.

Not a test (no assertions on time). Prints, for one bucket of ``--numel`` fp32 elements (default
25 M = 100 MB) with ``torch.set_num_threads(--threads)``:

* per compressor: median compress time (ms; PowerSGD: both rounds' local work, P = MQ then
  orthogonalise and Q = MᵀP̂, measured after its uncompressed start steps), median decompress time
  (ms), communicated bytes and ratio ``4n / bytes``;
* hand-off of one bucket to a helper process and back (round trip, ms): a preallocated
  ``share_memory_()`` slot + slot index over a pipe, against putting a fresh tensor on a
  ``torch.multiprocessing.Queue`` (which moves it to shared memory on every put).

Usage::

    python benchmarks/compress_bench.py [--numel 25000000] [--threads 1] [--repeats 3]
        [--methods fp16,topk,...] [--skip-handoff]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import statistics
import time

import torch
import torch.multiprocessing as tmp

from lightning_pipedap.compress import CompressionRuntime, valid_compressor_names

DEFAULT_KWARGS = {
    "powersgd": {"rank": 4},
    "randomk": {"ratio": 0.01},
    "topk": {"ratio": 0.01},
    "dgc": {"ratio": 0.01, "sample_ratio": 0.01},
    "qsgd": {"levels": 127},
}


def bench_method(name: str, grad: torch.Tensor, repeats: int) -> tuple[float, float, int]:
    """Median compress ms, median decompress ms, communicated bytes per step for ``name``."""
    n = grad.numel()
    rows = math.isqrt(n)
    while n % rows:  # PowerSGD compresses per parameter: view the bucket as one near-square matrix
        rows -= 1
    rt = CompressionRuntime([n], name, DEFAULT_KWARGS.get(name, {}), layouts=[[("grad", (rows, n // rows))]])
    if name == "powersgd":  # skip the uncompressed start steps
        for _ in range(rt.compressor.start_step):
            rt.decompress(0, rt.compress(0, grad))
    comp, decomp, nbytes = [], [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        p = rt.compress(0, grad)
        nbytes = p.nbytes
        while not p.final:
            p = rt.next_round(0, p)
            nbytes += p.nbytes
        t1 = time.perf_counter()
        rt.decompress(0, p) if rt.compressor.summable else rt.compressor.aggregate([p])
        t2 = time.perf_counter()
        comp.append(t1 - t0)
        decomp.append(t2 - t1)
    return statistics.median(comp) * 1e3, statistics.median(decomp) * 1e3, nbytes


def _slot_echo(conn_in, conn_out, slot: torch.Tensor, threads: int) -> None:
    torch.set_num_threads(threads)
    while True:
        msg = conn_in.recv()
        if msg is None:
            return
        _ = float(slot[msg[1]])  # touch the data
        conn_out.send(msg[0])


def _queue_echo(q_in, q_out, threads: int) -> None:
    torch.set_num_threads(threads)
    while True:
        item = q_in.get()
        if item is None:
            return
        i, t = item
        _ = float(t[0])
        del t
        q_out.put(i)


def bench_handoff(numel: int, repeats: int, threads: int) -> tuple[float, float]:
    """Median round-trip ms: (shared slot copy + index over a pipe, fresh tensor over tmp.Queue)."""
    ctx = mp.get_context("spawn")
    grad = torch.randn(numel)
    slot = torch.empty(numel).share_memory_()
    a_r, a_w = ctx.Pipe(duplex=False)
    b_r, b_w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_slot_echo, args=(a_r, b_w, slot, threads), daemon=True)
    p.start()
    slot_ms = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        slot.copy_(grad)
        a_w.send((i, i % numel))
        if not b_r.poll(120):
            raise RuntimeError("slot echo helper did not answer within 120 s")
        b_r.recv()
        slot_ms.append((time.perf_counter() - t0) * 1e3)
    a_w.send(None)
    p.join(30)

    tctx = tmp.get_context("spawn")
    q_in, q_out = tctx.Queue(), tctx.Queue()
    p = tctx.Process(target=_queue_echo, args=(q_in, q_out, threads), daemon=True)
    p.start()
    queue_ms = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        q_in.put((i, grad.clone()))  # a fresh gradient every step, as backward produces it
        q_out.get(timeout=120)
        queue_ms.append((time.perf_counter() - t0) * 1e3)
    q_in.put(None)
    p.join(30)
    # first round trip includes the helper's start-up; drop it
    return statistics.median(slot_ms[1:]), statistics.median(queue_ms[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default=",".join(valid_compressor_names()))
    ap.add_argument("--skip-handoff", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    grad = torch.randn(args.numel)
    dense = 4 * args.numel
    print(f"bucket: {args.numel} fp32 elements ({dense / 2**20:.1f} MiB), torch threads {args.threads}, "
          f"median of {args.repeats}")
    print(f"{'method':<10} {'kwargs':<34} {'compress ms':>12} {'decompress ms':>14} {'bytes':>12} {'ratio':>8}")
    for name in args.methods.split(","):
        c_ms, d_ms, nbytes = bench_method(name, grad, args.repeats)
        kw = ",".join(f"{k}={v}" for k, v in DEFAULT_KWARGS.get(name, {}).items())
        print(f"{name:<10} {kw:<34} {c_ms:12.1f} {d_ms:14.1f} {nbytes:12d} {dense / nbytes:8.1f}")
    if not args.skip_handoff:
        slot_ms, queue_ms = bench_handoff(args.numel, args.repeats, args.threads)
        print(f"hand-off round trip, {dense / 2**20:.1f} MiB: shared slot + index {slot_ms:.2f} ms, "
              f"torch.multiprocessing.Queue with a fresh tensor {queue_ms:.2f} ms")


if __name__ == "__main__":
    main()
