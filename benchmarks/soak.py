"""Soak benchmark: does a long 2-rank pipedap run leak memory or shared memory?

Not a test (no assertions). Starts 2 CPU ranks (torchrun-style variables, gloo), each training an
MLP with ``schedule="dear"`` and the chosen compression for ``--steps`` optimizer steps. Every
``--every`` steps each rank samples

* its resident set size (``/proc/<pid>/statm``), and that of its compression helper process;
* ``/dev/shm``: bytes allocated to its entries (``st_blocks``; shared by both ranks) and their number.

It prints, per rank, the first and last sample and the least-squares slope in MB per 1000 steps
over the samples after the first 20% of the steps (warm-up, allocator growth and the compression
start are excluded)::

    python benchmarks/soak.py                      # 1500 steps, top-k (ratio 0.01) in the helper process
    python benchmarks/soak.py --quick              # 400 steps, < 60 s
    python benchmarks/soak.py --compression powersgd --kwargs '{"rank": 4}' --steps 5000
    python benchmarks/soak.py --compression none   # dense gradients
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MB = 2**20
DEFAULT_KWARGS = {"topk": {"ratio": 0.01}, "powersgd": {"rank": 4}, "randomk": {"ratio": 0.01}}


def rss_mb(pid: int | None) -> float | None:
    """Resident set size of ``pid`` in MB (None: no such process)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE / MB
    except (OSError, IndexError, ValueError):
        return None


def shm_usage() -> tuple[float, int]:
    """(MB allocated to the entries of ``/dev/shm``, number of entries); (0, 0) without ``/dev/shm``."""
    total, count = 0, 0
    try:
        with os.scandir("/dev/shm") as it:
            for e in it:
                try:
                    total += e.stat(follow_symlinks=False).st_blocks * 512
                    count += 1
                except OSError:  # removed meanwhile
                    pass
    except OSError:
        return 0.0, 0
    return total / MB, count


def slope_per_1000(steps: list[int], values: list[float]) -> float:
    """Least-squares slope of ``values`` over ``steps``, times 1000 (0 with fewer than 2 points)."""
    n = len(steps)
    if n < 2:
        return 0.0
    mx, my = sum(steps) / n, sum(values) / n
    var = sum((x - mx) ** 2 for x in steps)
    return 0.0 if var == 0 else 1000 * sum((x - mx) * (y - my) for x, y in zip(steps, values)) / var


# ---------------------------------------------------------------------------------------- one rank
def run_rank(args: argparse.Namespace, out: Path) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipedap import PipeDAPStrategy

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(128, args.hidden), torch.nn.ReLU(),
                                           torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                           torch.nn.Linear(args.hidden, 10))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Sampler(pl.Callback):
        def __init__(self) -> None:
            self.rows: list[dict] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if step % args.every == 0 or step == args.steps:
                rt = getattr(trainer.strategy, "_rt", None)
                pipe = getattr(rt, "pipe", None)
                shm, entries = shm_usage()
                self.rows.append({"step": step, "rss": rss_mb(os.getpid()), "shm": shm, "entries": entries,
                                  "helper": rss_mb(getattr(pipe, "helper_pid", None))})

    g = torch.Generator().manual_seed(rank)
    data = TensorDataset(torch.randn(64 * 32, 128, generator=g), torch.randint(0, 10, (64 * 32,), generator=g))
    compression = None if args.compression == "none" else args.compression
    kwargs = json.loads(args.kwargs) if args.kwargs else DEFAULT_KWARGS.get(args.compression, {})
    strategy = PipeDAPStrategy(schedule="dear", compression=compression,
                               compression_kwargs=kwargs if compression else {},
                               wait_timeout_s=60, nonfinite=args.nonfinite)
    sampler = Sampler()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, max_epochs=-1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[sampler], use_distributed_sampler=False)
    t0 = time.perf_counter()
    trainer.fit(Net(), DataLoader(data, batch_size=32, shuffle=True))
    out.write_text(json.dumps({"rank": rank, "rows": sampler.rows, "seconds": time.perf_counter() - t0,
                               "steps": trainer.global_step}))


# ---------------------------------------------------------------------------------------- launcher
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Start both ranks (this script with ``--rank-out``), wait up to ``--limit-s``, print the table.

    The ranks import ``lightning_pipedap`` from the checkout this script is in (prepended to ``PYTHONPATH``)."""
    port = free_port()
    root = str(Path(__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory() as tmp:
        procs, outs = [], [Path(tmp) / f"rank{r}.json" for r in range(2)]
        logs = [Path(tmp) / f"rank{r}.log" for r in range(2)]
        shm_before = shm_usage()
        t0 = time.perf_counter()
        for r in range(2):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(r),
                       LOCAL_RANK=str(r), NODE_RANK="0", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                       PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
            cmd = [sys.executable, __file__, *argv, "--rank-out", str(outs[r])]
            with open(logs[r], "w") as log:
                procs.append(subprocess.Popen(cmd, env=env, stdout=None if args.verbose else log,
                                              stderr=None if args.verbose else subprocess.STDOUT))
        deadline = time.monotonic() + args.limit_s
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for r, p in enumerate(procs):
            p.wait()
            if p.returncode != 0:
                err = logs[r].read_text(errors="replace")[-4000:]
                print(f"rank {r} exited with {p.returncode}:\n{err}", file=sys.stderr)
                return 1
        results = [json.loads(o.read_text()) for o in outs]
        took = time.perf_counter() - t0
        shm_after = shm_usage()
    report(args, results, took, shm_before, shm_after)
    return 0


def report(args: argparse.Namespace, results: list[dict], took: float, shm_before: tuple[float, int],
           shm_after: tuple[float, int]) -> None:
    print(f"soak: {results[0]['steps']} steps, 2 CPU ranks, schedule dear, compression {args.compression}, "
          f"nonfinite={args.nonfinite!r}, "
          f"MLP 128-{args.hidden}-{args.hidden}-10; {took:.0f} s in all ({results[0]['seconds']:.0f} s of fit)")
    print(f"slopes over steps >= {int(0.2 * args.steps)} (MB per 1000 steps)\n")
    head = ("rank", "RSS first MB", "RSS last MB", "RSS slope", "helper RSS last", "helper slope",
            "shm last MB", "shm slope", "shm entries")
    print(" | ".join(head))
    print(" | ".join("-" * len(h) for h in head))
    for res in results:
        rows = res["rows"]
        late = [r for r in rows if r["step"] >= 0.2 * args.steps]
        steps = [r["step"] for r in late]
        helper = [r["helper"] for r in late if r["helper"] is not None]
        helper_steps = [r["step"] for r in late if r["helper"] is not None]
        cells = (str(res["rank"]), f"{rows[0]['rss']:.1f}", f"{rows[-1]['rss']:.1f}",
                 f"{slope_per_1000(steps, [r['rss'] for r in late]):+.2f}",
                 f"{helper[-1]:.1f}" if helper else "-",
                 f"{slope_per_1000(helper_steps, helper):+.2f}" if helper else "-",
                 f"{rows[-1]['shm']:.2f}", f"{slope_per_1000(steps, [r['shm'] for r in late]):+.3f}",
                 str(rows[-1]["entries"]))
        print(" | ".join(c.rjust(len(h)) for c, h in zip(cells, head)))
    print(f"\n/dev/shm before the run: {shm_before[0]:.2f} MB in {shm_before[1]} entries; after it: "
          f"{shm_after[0]:.2f} MB in {shm_after[1]} entries")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps (default 1500)")
    p.add_argument("--compression", default="topk", help="compressor name, or 'none' (default topk)")
    p.add_argument("--kwargs", default="",
                   help='compressor keyword arguments as JSON (default: {"ratio": 0.01} for topk)')
    p.add_argument("--nonfinite", default="warn", help="the strategy's nonfinite option (default warn)")
    p.add_argument("--every", type=int, default=25, help="steps between samples (default 25)")
    p.add_argument("--hidden", type=int, default=512, help="hidden width of the MLP (default 512)")
    p.add_argument("--quick", action="store_true", help="400 steps, sampled every 10: under a minute")
    p.add_argument("--limit-s", type=float, default=3600.0, help="kill the ranks after this many seconds")
    p.add_argument("--verbose", action="store_true", help="show the ranks' output")
    p.add_argument("--rank-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.every = 400, 10
    if args.steps < 10 or args.every < 1:
        p.error(f"--steps must be >= 10 and --every >= 1, got {args.steps} and {args.every}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.rank_out is not None:
        run_rank(args, Path(args.rank_out))
        return 0
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
