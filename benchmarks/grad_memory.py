"""Peak memory of rank 0 with and without ``gradient_as_bucket_view`` (DDP's and pipedap's), bench MLP.

Each variant trains the bench MLP (:data:`~lightning_pipedap.bench.matrix.spec.PRESETS` ``mlp/bench``:
16 hidden layers of 1024, 16.8 M parameters, 67 MB of fp32 gradients; SGD with momentum) as its own
2-process CPU job (gloo, Lightning's default launcher, so every job starts with a fresh process) and reports
rank 0's peak resident set size (``VmHWM`` of ``/proc/self/status``, MB = 10**6 bytes, read after the fit) and
its median step time and process CPU time per step (every thread; ms) after ``--warmup`` steps (pipedap: after
its start-up, ``strategy.startup``)::

    python benchmarks/grad_memory.py                       # every variant, one round
    python benchmarks/grad_memory.py --variants dear,dear-view --rounds 3

Variants: ``ddp`` / ``ddp-view`` (Lightning's ``DDPStrategy``, ``gradient_as_bucket_view`` False / True),
``dear`` / ``dear-view`` and ``optimal`` / ``optimal-view`` (``PipeDAPStrategy``, the planned schedule
installed directly: ``plan_trials=1``). The copy path holds every gradient twice (``.grad`` and the
bucket); the view path once, so the expected saving is about one gradient's size (67 MB here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("ddp", "ddp-view", "dear", "dear-view", "optimal", "optimal-view")


def peak_rss_mb() -> float:
    """This process's peak resident set size (``VmHWM``), in MB (10**6 bytes).

    Raises:
        RuntimeError: where ``/proc/self/status`` has no ``VmHWM`` line (not Linux).
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _job(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipedap import PipeDAPStrategy
    from lightning_pipedap.bench.matrix.models import BenchModule, build_net
    from lightning_pipedap.bench.matrix.spec import PRESETS

    torch.manual_seed(0)
    torch.set_num_threads(1)
    net, units, make_batch = build_net("mlp", "bench")
    batch = PRESETS["mlp"]["bench"]["batch"]
    x, y = make_batch(batch * 4, torch.Generator().manual_seed(0))
    view = args.variant.endswith("-view")
    base = args.variant.removesuffix("-view")
    if base == "ddp":
        strategy: object = DDPStrategy(gradient_as_bucket_view=view)
    else:
        strategy = PipeDAPStrategy(schedule=base, plan_trials=1, profile_steps=2, model_contention=False,
                                   gradient_as_bucket_view=view)

    class Clock(pl.Callback):
        pipedap_reads_model = False  # reads no parameter: pipedap need not apply pending updates before it

        def __init__(self) -> None:
            self.starts: list[float] = []
            self.cpu: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.starts.append(time.perf_counter())
            self.cpu.append(time.process_time())

    clock = Clock()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                         callbacks=[clock], enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, use_distributed_sampler=False)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)
    trainer.fit(BenchModule(net, units), loader)
    if trainer.global_rank != 0:
        return
    startup = getattr(strategy, "startup", None)
    first = max(args.warmup, int(startup["total_steps"]) + 1 if startup else 0)
    gaps = [b - a for a, b in zip(clock.starts[:-1], clock.starts[1:])][first:]
    cpu = clock.cpu[first:]
    if len(gaps) < 3:
        raise SystemExit(f"{args.variant}: only {len(gaps)} steps after step {first}; raise --steps")
    with open(args.out, "w") as f:
        json.dump({"peak_rss_mb": peak_rss_mb(), "median_ms": 1e3 * statistics.median(gaps),
                   "cpu_ms": 1e3 * (cpu[-1] - cpu[0]) / (len(cpu) - 1), "steps": len(gaps),
                   "installed": (getattr(strategy, "installed_schedule", None) or "ddp").split(":")[0]}, f)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=4, help="step intervals discarded at least")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job:
        _job(args)
        return
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variants {bad}; valid: {', '.join(VARIANTS)}")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for v in variants:  # interleaved: a burst of load on the machine hits one variant of one round
                out = os.path.join(tmp, f"{v}.{r}.json")
                cmd = [sys.executable, os.path.abspath(__file__), "--job", "--variant", v, "--out", out,
                       "--steps", str(args.steps), "--warmup", str(args.warmup)]
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
                if done.returncode != 0:
                    raise SystemExit(f"variant {v}, round {r} failed:\n{done.stderr[-3000:]}")
                with open(out) as f:
                    runs[v].append(json.load(f))
    med = {v: {k: statistics.median(j[k] for j in runs[v]) for k in ("peak_rss_mb", "median_ms", "cpu_ms")}
           for v in variants}
    print(f"bench MLP, 2 CPU processes (gloo), rank 0, median of {args.rounds} round(s); ratio: view / copy")
    print(f"{'variant':<14}{'peak RSS MB':>12}{'ratio':>8}{'ms/step':>10}{'CPU ms/step':>13}  ran")
    for v in variants:
        m = med[v]
        base = v.removesuffix("-view")
        ratio = f"{m['peak_rss_mb'] / med[base]['peak_rss_mb']:.3f}" if v != base and base in med else ""
        ran = ",".join(sorted({j["installed"].split(" (")[0] for j in runs[v]}))
        print(f"{v:<14}{m['peak_rss_mb']:>12.0f}{ratio:>8}{m['median_ms']:>10.0f}{m['cpu_ms']:>13.0f}  {ran}")
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
