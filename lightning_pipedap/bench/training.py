"""Training-step benchmark: Lightning ``"ddp"`` vs ``pipedap`` schedules on a capped testbed link.

::

    python -m lightning_pipedap.bench.training --rate 1gbit --hosts 2 --steps 20

Every variant runs in the same launch (same processes, same link), one after another, on an MLP
whose compute and communication are of the same order on this CPU. Per variant it prints the
median iteration time (start-to-start of training batches, after warm-up), and the speedup over
``ddp``. Compute-only time (no communication) is measured in the same run with world-local
training of the same model (``--no-comm`` reference), and the lower bound is
``max(compute, all-reduce time)``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _make_model(width: int, depth: int, lr: float = 0.01):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import lightning.pytorch as pl

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers = []
            for _ in range(depth):
                layers += [nn.Linear(width, width), nn.ReLU()]
            self.net = nn.Sequential(*layers, nn.Linear(width, 10))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)

    return MLP()


class _StepTimer:
    """Lightning callback recording the start time of every training batch (perf_counter, s)."""

    def __new__(cls):
        import lightning.pytorch as pl

        class StepTimer(pl.Callback):
            def __init__(self) -> None:
                self.starts: list[float] = []

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                self.starts.append(time.perf_counter())

            def on_train_end(self, trainer, pl_module):
                self.starts.append(time.perf_counter())

        return StepTimer()


def _worker(args: argparse.Namespace) -> dict:
    import os

    import torch
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_pipedap  # noqa: F401

    torch.set_num_threads(args.threads)
    hosts = int(os.environ["WORLD_SIZE"])
    n = args.batch * (args.steps + args.warmup)
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n * hosts, args.width, generator=g), torch.randint(0, 10, (n * hosts,), generator=g))
    out = {}
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        pl.seed_everything(0, verbose=False)
        model = _make_model(args.width, args.depth)
        if v == "ddp":
            strategy = "ddp"
        else:
            strategy = lightning_pipedap.PipeDAPStrategy(schedule=v, bucket_cap_mb=args.bucket_mb, replan_every=10**6)
        timer = _StepTimer()
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, num_nodes=hosts, max_steps=args.steps + args.warmup,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[timer])
        trainer.fit(model, DataLoader(ds, batch_size=args.batch, shuffle=False))
        d = [b - a for a, b in zip(timer.starts[:-1], timer.starts[1:])][args.warmup:]
        out[v] = {"median_s": statistics.median(d), "steps": len(d),
                  "predicted_s": getattr(strategy, "predicted_iteration_s", None)}
    # compute-only reference: same model, forward+backward+step with no communication at all
    model = _make_model(args.width, args.depth)
    opt = model.configure_optimizers()
    x, y = ds.tensors[0][: args.batch], ds.tensors[1][: args.batch]
    ts = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = model.training_step((x, y), 0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ts.append(time.perf_counter() - t0)
    out["compute_only"] = {"median_s": statistics.median(ts[args.warmup:]), "steps": args.steps}
    from lightning_pipedap.engine import collectives as C

    nparams = sum(p.numel() for p in model.parameters())
    buf = torch.zeros(nparams)
    ts = []
    for _ in range(4):
        C.barrier()
        t0 = time.perf_counter()
        import torch.distributed as dist  # noqa: F401 (the group is Lightning's default group)

        C.all_reduce_(buf, C.CommGroup(None, 0, hosts, "gloo"))
        ts.append(time.perf_counter() - t0)
    out["allreduce_only"] = {"median_s": statistics.median(ts[1:]), "steps": 3}
    out["params_M"] = nparams / 1e6
    C.shutdown()  # destroy the default group before exit (gloo threads alive at exit can abort the process)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--rate", default="1gbit", help="tc rate per host link, or 'none'")
    ap.add_argument("--variants", default="ddp,allreduce,dear", help="comma list: ddp and pipedap schedule names")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=4.0, help="fusion cap of the fixed schedules (MiB)")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(_worker(args)))
        return
    from lightning_pipedap.testbed import Testbed, TestbedUnavailable

    rate = None if args.rate.lower() in ("none", "0", "") else args.rate
    fwd = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--worker",)]
    try:
        with Testbed(hosts=args.hosts, rate=rate) as tb:
            outs = tb.run_ranks([sys.executable, "-m", "lightning_pipedap.bench.training", "--worker", *fwd],
                                timeout_s=1800, env={"OMP_NUM_THREADS": str(args.threads)})
    except TestbedUnavailable as exc:
        print(f"testbed unavailable: {exc}", file=sys.stderr)
        sys.exit(2)
    res = [json.loads(line[7:]) for o in outs for line in o.splitlines() if line.startswith("RESULT ")][0]
    comp, comm = res["compute_only"]["median_s"], res["allreduce_only"]["median_s"]
    bound = max(comp, comm)
    print(f"{args.hosts} ranks, link {rate or 'uncapped'}, MLP {res['params_M']:.1f} M params, batch {args.batch}")
    print(f"compute-only {comp * 1e3:.0f} ms, all-reduce-only {comm * 1e3:.0f} ms, lower bound {bound * 1e3:.0f} ms")
    ddp = res.get("ddp", {}).get("median_s")
    print(f"{'variant':12s} {'iter ms':>9s} {'vs ddp':>8s} {'/bound':>8s} {'predicted':>10s} {'error':>7s}")
    for v in args.variants.split(","):
        t, pred = res[v]["median_s"], res[v].get("predicted_s")
        pr = f"{pred * 1e3:10.0f} {(t / pred - 1) * 100:6.1f}%" if pred else f"{'-':>10s} {'-':>7s}"
        print(f"{v:12s} {t * 1e3:9.0f} {(ddp / t if ddp else float('nan')):8.2f} {t / bound:8.2f} {pr}")


if __name__ == "__main__":
    main()
