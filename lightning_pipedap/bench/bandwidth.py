"""Micro-benchmark: achieved bandwidth of the engine's RS/AG/AR against gloo's own collectives.

Run through the testbed (ranks in network namespaces on a capped link)::

    sudo python -m lightning_pipedap.bench.bandwidth --rate 1gbit --hosts 2 --mb 32

or as one rank of an existing job (``--worker``, with MASTER_ADDR/PORT, RANK, WORLD_SIZE set).
For each primitive it prints the median time (ms) over ``--repeat`` runs (rounds over all primitives,
interleaved, after one warm-up round), the *bus bandwidth* (bytes each rank must send:
``(N-1)/N · size`` for RS/AG, ``2(N-1)/N · size`` for AR, divided by time; directly comparable with
the link rate, Gbit/s; the 16-bit wire rows count the fp32 bytes they stand for) and the median CPU
time of rank 0 per MiB of fp32 buffer (``time.process_time``: user + system of every thread of the
process: additions, casts, copies and socket calls; kernel work outside the process is not counted).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _load_baseline(path: str):
    """The ring functions of another copy of ``engine/collectives.py`` (an older commit), for a before/after
    comparison in one launch; they are called with this copy's :class:`CommGroup` (same fields)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pipedap_baseline_collectives", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _worker(mb: float, repeat: int, chunk_mb: float, baseline: str | None = None) -> dict:
    import torch

    from lightning_pipedap.engine import collectives as C

    torch.set_num_threads(1)
    rank, world = C.init_from_env("gloo")
    comm = C.new_comm_group(timeout_s=300, chunk_bytes=int(chunk_mb * 2**20))
    numel = int(mb * 2**20 / 4) // world * world
    buf = torch.ones(numel)
    half, bf16 = torch.float16, torch.bfloat16
    prims = {
        "ring_reduce_scatter": (C.ring_reduce_scatter_, 1),
        "gloo_reduce_scatter_tensor": (C.native_reduce_scatter_, 1),
        "ring_all_gather": (C.ring_all_gather_, 1),
        "gloo_all_gather_into_tensor": (C.native_all_gather_, 1),
        "gloo_all_reduce": (C.all_reduce_, 2),
        "ring_reduce_scatter wire fp16": (lambda b, c: C.ring_reduce_scatter_(b, c, half), 1),
        "ring_all_gather wire fp16": (lambda b, c: C.ring_all_gather_(b, c, half), 1),
        "ring_reduce_scatter wire bf16": (lambda b, c: C.ring_reduce_scatter_(b, c, bf16), 1),
    }
    if baseline:
        old = _load_baseline(baseline)
        prims["baseline ring_reduce_scatter"] = (old.ring_reduce_scatter_, 1)
        prims["baseline ring_all_gather"] = (old.ring_all_gather_, 1)
    times: dict[str, list[float]] = {k: [] for k in prims}
    cpus: dict[str, list[float]] = {k: [] for k in prims}
    for it in range(repeat + 1):  # rounds over every primitive (interleaved); the first is a warm-up
        for name, (fn, _) in prims.items():
            buf.fill_(1.0)
            C.barrier()
            c0 = time.process_time()
            t0 = time.perf_counter()
            fn(buf, comm)
            t = time.perf_counter() - t0
            c = time.process_time() - c0
            if it:
                times[name].append(t)
                cpus[name].append(c)
    out = {}
    mib = numel * 4 / 2**20
    for name, (_, factor) in prims.items():
        t = statistics.median(times[name])
        bus_bytes = factor * (world - 1) / world * numel * 4
        out[name] = {"ms": round(t * 1e3, 2), "bus_gbit_s": round(bus_bytes * 8 / t / 1e9, 3),
                     "cpu_ms_per_mib": round(statistics.median(cpus[name]) * 1e3 / mib, 3)}
    C.destroy_comm_group(comm)
    C.shutdown()
    return {"rank": rank, "world": world, "mb": mib, "results": out}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2, help="ranks, one per network namespace (>= 2)")
    ap.add_argument("--rate", default="1gbit", help="tc rate of each host link, e.g. 1gbit, 10gbit, or 'none'")
    ap.add_argument("--mb", type=float, default=32.0, help="buffer size in MiB (fp32)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per primitive (median reported)")
    ap.add_argument("--chunk-mb", type=float, default=2.0, help="ring pipeline piece size in MiB")
    ap.add_argument("--worker", action="store_true", help="run as one rank of an existing job")
    ap.add_argument("--baseline", default=None,
                    help="path of another engine/collectives.py (e.g. an older commit's, from git archive): its "
                         "ring RS/AG are timed too, interleaved, as 'baseline ...' rows")
    args = ap.parse_args(argv)
    if args.worker:
        res = _worker(args.mb, args.repeat, args.chunk_mb, args.baseline)
        print("RESULT " + json.dumps(res))
        return
    from lightning_pipedap.testbed import Testbed, TestbedUnavailable

    rate = None if args.rate.lower() in ("none", "0", "") else args.rate
    try:
        with Testbed(hosts=args.hosts, rate=rate) as tb:
            outs = tb.run_ranks([sys.executable, "-m", "lightning_pipedap.bench.bandwidth", "--worker",
                                 "--mb", str(args.mb), "--repeat", str(args.repeat), "--chunk-mb", str(args.chunk_mb)]
                                + (["--baseline", args.baseline] if args.baseline else []),
                                timeout_s=900, env={"OMP_NUM_THREADS": "1"})
    except TestbedUnavailable as exc:
        print(f"testbed unavailable: {exc}", file=sys.stderr)
        sys.exit(2)
    res = [json.loads(line[7:]) for o in outs for line in o.splitlines() if line.startswith("RESULT ")]
    r0 = res[0]
    print(f"{args.hosts} ranks, link {rate or 'uncapped'}, {r0['mb']:.1f} MiB fp32, median of {args.repeat}")
    print(f"{'primitive':32s} {'ms':>9s} {'bus Gbit/s':>11s} {'CPU ms/MiB':>11s}")
    for name, v in r0["results"].items():
        print(f"{name:32s} {v['ms']:9.1f} {v['bus_gbit_s']:11.3f} {v['cpu_ms_per_mib']:11.3f}")
    rr, nr = r0["results"]["ring_reduce_scatter"]["ms"], r0["results"]["gloo_reduce_scatter_tensor"]["ms"]
    ra, na = r0["results"]["ring_all_gather"]["ms"], r0["results"]["gloo_all_gather_into_tensor"]["ms"]
    print(f"speedup ring/gloo: reduce-scatter {nr / rr:.2f}x, all-gather {na / ra:.2f}x")


if __name__ == "__main__":
    main()
