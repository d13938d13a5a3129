"""Micro-benchmark: achieved bandwidth of the engine's RS/AG/AR against gloo's own collectives.

Run through the testbed (ranks in network namespaces on a capped link)::

    sudo python -m lightning_pipedap.bench.bandwidth --rate 1gbit --hosts 2 --mb 32

or as one rank of an existing job (``--worker``, with MASTER_ADDR/PORT, RANK, WORLD_SIZE set).
For each primitive it prints the median time (ms) over ``--repeat`` runs and the *bus bandwidth*
(bytes each rank must send: ``(N-1)/N · size`` for RS/AG, ``2(N-1)/N · size`` for AR, divided by
time), which is directly comparable with the link rate (Gbit/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _worker(mb: float, repeat: int, chunk_mb: float) -> dict:
    import torch

    from lightning_pipedap.engine import collectives as C

    torch.set_num_threads(1)
    rank, world = C.init_from_env("gloo")
    comm = C.new_comm_group(timeout_s=300, chunk_bytes=int(chunk_mb * 2**20))
    numel = int(mb * 2**20 / 4) // world * world
    buf = torch.ones(numel)
    prims = {
        "ring_reduce_scatter": (C.ring_reduce_scatter_, 1),
        "gloo_reduce_scatter_tensor": (C.native_reduce_scatter_, 1),
        "ring_all_gather": (C.ring_all_gather_, 1),
        "gloo_all_gather_into_tensor": (C.native_all_gather_, 1),
        "gloo_all_reduce": (C.all_reduce_, 2),
    }
    out = {}
    for name, (fn, factor) in prims.items():
        times = []
        for _ in range(repeat + 1):  # first run is a warm-up
            C.barrier()
            t0 = time.perf_counter()
            fn(buf, comm)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times[1:])
        bus_bytes = factor * (world - 1) / world * numel * 4
        out[name] = {"ms": round(t * 1e3, 2), "bus_gbit_s": round(bus_bytes * 8 / t / 1e9, 3)}
    C.destroy_comm_group(comm)
    C.shutdown()
    return {"rank": rank, "world": world, "mb": numel * 4 / 2**20, "results": out}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2, help="ranks, one per network namespace (>= 2)")
    ap.add_argument("--rate", default="1gbit", help="tc rate of each host link, e.g. 1gbit, 10gbit, or 'none'")
    ap.add_argument("--mb", type=float, default=32.0, help="buffer size in MiB (fp32)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per primitive (median reported)")
    ap.add_argument("--chunk-mb", type=float, default=2.0, help="ring pipeline piece size in MiB")
    ap.add_argument("--worker", action="store_true", help="run as one rank of an existing job")
    args = ap.parse_args(argv)
    if args.worker:
        res = _worker(args.mb, args.repeat, args.chunk_mb)
        print("RESULT " + json.dumps(res))
        return
    from lightning_pipedap.testbed import Testbed, TestbedUnavailable

    rate = None if args.rate.lower() in ("none", "0", "") else args.rate
    try:
        with Testbed(hosts=args.hosts, rate=rate) as tb:
            outs = tb.run_ranks([sys.executable, "-m", "lightning_pipedap.bench.bandwidth", "--worker",
                                 "--mb", str(args.mb), "--repeat", str(args.repeat), "--chunk-mb", str(args.chunk_mb)],
                                timeout_s=900, env={"OMP_NUM_THREADS": "1"})
    except TestbedUnavailable as exc:
        print(f"testbed unavailable: {exc}", file=sys.stderr)
        sys.exit(2)
    res = [json.loads(line[7:]) for o in outs for line in o.splitlines() if line.startswith("RESULT ")]
    r0 = res[0]
    print(f"{args.hosts} ranks, link {rate or 'uncapped'}, {r0['mb']:.1f} MiB fp32, median of {args.repeat}")
    print(f"{'primitive':32s} {'ms':>9s} {'bus Gbit/s':>11s}")
    for name, v in r0["results"].items():
        print(f"{name:32s} {v['ms']:9.1f} {v['bus_gbit_s']:11.3f}")
    rr, nr = r0["results"]["ring_reduce_scatter"]["ms"], r0["results"]["gloo_reduce_scatter_tensor"]["ms"]
    ra, na = r0["results"]["ring_all_gather"]["ms"], r0["results"]["gloo_all_gather_into_tensor"]["ms"]
    print(f"speedup ring/gloo: reduce-scatter {nr / rr:.2f}x, all-gather {na / ra:.2f}x")


if __name__ == "__main__":
    main()
