"""Where a rank's resident set rises during a fit: RSS sampled every millisecond or so, and named points of the
start-up (engine installs and closes, the sharded step's state moves, the α-β and contention benchmarks, Lightning's
step hooks) with the peak between each point and the next and, optionally, the bytes of the live CPU tensors there
(issue 30: the sharded rank's peak in its first steps).

How to run (loopback, 2 ranks, the bench MLP with Adam, ``shard_bench.py``'s variants)::

    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/shard_mem_trace.py --variant pipedap-sharded --census

Prints, per rank, one line per point: time (s), RSS now, the highest RSS sampled since the previous point and the
live tensors' MiB (``--census``); then the points around the highest sample. ``MALLOC_MMAP_THRESHOLD_`` (or
``PipeDAPStrategy(malloc_mmap_threshold=...)``) makes RSS follow the live allocations: without it glibc keeps freed
heap memory resident and the trace shows where the heap grew, not what is alive.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shard_bench as SB  # noqa: E402

MIB = 1024 * 1024
RESULT = "TRACE "


class Recorder:
    """RSS sampled by a thread (every ``period_s``) and named points (RSS, the peak sampled since the last point, and
    with ``census`` the live CPU tensors' MiB)."""

    def __init__(self, census: bool, period_s: float = 0.001) -> None:
        self.census, self.period_s = census, period_s
        self.t0 = time.perf_counter()
        self.points: list[dict[str, Any]] = []
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True, name="rss-sampler").start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            rss = SB._rss_bytes()
            with self._lock:
                self._peak = max(self._peak, rss)
            time.sleep(self.period_s)

    def point(self, name: str) -> None:
        """Record point ``name``: RSS now and the peak since the last point (both MiB)."""
        rss = SB._rss_bytes()
        with self._lock:
            peak, self._peak = max(self._peak, rss), rss
        p = {"t": round(time.perf_counter() - self.t0, 3), "name": name, "rss": round(rss / MIB, 1),
             "peak_since": round(peak / MIB, 1)}
        if self.census:
            c = SB.tensor_census()
            p["tensors"], p["largest"] = round(c["total"], 1), c["largest"][:4]
        self.points.append(p)

    def stop(self) -> None:
        self._stop.set()


def _wrap(obj: Any, attr: str, rec: Recorder, label: str) -> None:
    """Record ``label:in`` before and ``label:out`` after every call of ``obj.attr``."""
    orig = getattr(obj, attr)

    @functools.wraps(orig)
    def wrapped(*a: Any, **k: Any) -> Any:
        rec.point(label + ":in")
        try:
            return orig(*a, **k)
        finally:
            rec.point(label + ":out")

    setattr(obj, attr, wrapped)


def instrument(rec: Recorder) -> None:
    """Wrap the start-up's functions that allocate (engine installs, closes, state moves, benchmarks)."""
    from lightning_pipedap.engine import engine as E
    from lightning_pipedap.engine import shard_step as S
    from lightning_pipedap.strategy import engine_slot as ES
    from lightning_pipedap.strategy import planning as P

    for obj, attr, label in ((ES.EngineSlot, "install", "install"), (ES.EngineSlot, "close_engine", "close"),
                             (E.CommEngine, "__init__", "CommEngine"), (S.ShardedStep, "adopt", "adopt"),
                             (S.ShardedStep, "sync_step", "sync_step"), (S.ShardedStep, "__init__", "ShardedStep"),
                             (S.ShardedOptimizer, "absorb", "absorb"), (S.ShardedOptimizer, "consolidate", "consol"),
                             (S.ShardedStep, "step_bucket", "step_bucket"),
                             (P.Planning, "start", "planning.start"), (P.Planning, "plan", "planning.plan")):
        _wrap(obj, attr, rec, label)


def hooks_callback(rec: Recorder) -> Any:
    """A Lightning callback recording a point at every step hook."""
    import lightning.pytorch as pl

    class Points(pl.Callback):
        pipedap_reads_model = False

        def on_train_batch_start(self, trainer: Any, *a: Any) -> None:
            rec.point(f"step {trainer.global_step} start")

        def on_before_backward(self, trainer: Any, *a: Any) -> None:
            rec.point("before_backward")

        def on_after_backward(self, trainer: Any, *a: Any) -> None:
            rec.point("after_backward")

        def on_before_optimizer_step(self, trainer: Any, *a: Any) -> None:
            rec.point("before_optimizer_step")

        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            rec.point("batch_end")

    return Points()


def worker(cfg: dict) -> dict:
    """One rank: :func:`shard_bench.worker` with the points recorded."""
    rec = Recorder(cfg.get("census", False))
    instrument(rec)
    classes = SB._classes
    cb = hooks_callback(rec)

    @functools.wraps(classes)
    def with_points() -> dict:
        out = classes()
        clock = out["Clock"]

        class ClockAndPoints(clock):
            def on_train_batch_start(self, trainer: Any, *a: Any) -> None:
                super().on_train_batch_start(trainer, *a)
                cb.on_train_batch_start(trainer, *a)

            def on_before_backward(self, trainer: Any, *a: Any) -> None:
                cb.on_before_backward(trainer, *a)

            def on_after_backward(self, trainer: Any, *a: Any) -> None:
                cb.on_after_backward(trainer, *a)

            def on_before_optimizer_step(self, trainer: Any, *a: Any) -> None:
                cb.on_before_optimizer_step(trainer, *a)

            def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
                cb.on_train_batch_end(trainer, *a)

        out["Clock"] = ClockAndPoints
        return out

    SB._classes = with_points
    rec.point("start")
    res = SB.worker(cfg)
    rec.point("end")
    rec.stop()
    res["points"] = rec.points
    return res


def report(res: dict, around: int) -> str:
    """The points of one rank as text, and the ``around`` points either side of the highest peak."""
    pts = res.get("points", [])
    lines = [f"rank {res.get('rank')} {res.get('variant')}: peak {res.get('peak_rss_mib', 0):.0f} MiB, last step "
             f"{res.get('last_rss_mib', 0):.0f} MiB, error {res.get('error')}"]
    def fmt(p: dict) -> str:
        census = f"  tensors {p['tensors']:7.1f} {p['largest']}" if "tensors" in p else ""
        return f"  {p['t']:8.3f} s  rss {p['rss']:7.1f}  peak since last {p['peak_since']:7.1f}{census}  {p['name']}"

    lines += [fmt(p) for p in pts]
    if pts:
        top = max(range(len(pts)), key=lambda i: pts[i]["peak_since"])
        lines.append(f" highest sample {pts[top]['peak_since']:.1f} MiB, between:")
        lines += [fmt(p) for p in pts[max(0, top - around):top + around + 1]]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", default="pipedap-sharded", choices=SB.VARIANTS)
    p.add_argument("--size", default="bench", choices=tuple(SB.SIZES))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--census", action="store_true", help="live tensor bytes at every point (slow: gc walk)")
    p.add_argument("--around", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        print(RESULT + json.dumps(worker(json.loads(args.worker))), flush=True)
        os._exit(0)
    cfg = dict(variant=args.variant, size=args.size, steps=args.steps, warmup=args.warmup, census=args.census)
    env = {"OMP_NUM_THREADS": "1", "PIPEDAP_PLAN_CACHE": "off",
           "PIPEDAP_CACHE_DIR": os.environ.get("PIPEDAP_CACHE_DIR", "/tmp/shard-mem-trace-cache")}
    outs = SB.run_local([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)], args.ranks, 900,
                        env)
    res = [json.loads(ln[len(RESULT):]) for o in outs for ln in o.splitlines() if ln.startswith(RESULT)]
    for r in sorted(res, key=lambda d: d["rank"]):
        print(report(r, args.around))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
