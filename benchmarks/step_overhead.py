"""Per-step overhead of pipedap against DDP on models whose communication costs next to nothing.

Runs each variant as its own 2-process CPU job (Lightning's default launcher), interleaved over
``--rounds`` rounds, and prints the median iteration time (start-to-start of ``on_train_batch_start``,
after ``--warmup`` steps and, for pipedap, after its start-up: trace, profiling and the measured plan selection's
trial windows, ``strategy.startup``) per variant and its ratio to DDP in the same round::

    python benchmarks/step_overhead.py --model tiny_mlp --rounds 2
    python benchmarks/step_overhead.py --model digits_cnn --variants ddp,pipedap
    python benchmarks/step_overhead.py --model tiny_mlp --variants pipedap --profile prof.txt

Rank 0's process CPU time per step (every thread) is printed too: it is what pipedap's glue costs,
and a load on the machine that only delays the processes changes it less than the wall-clock time.

``--profile FILE`` runs rank 0's steady-state steps (as measured) under cProfile and writes the functions of
lightning_pipedap with the most cumulative time, the most internal time overall, and who calls the
waits (the steady-state overhead breakdown).
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

VARIANTS = ("ddp", "pipedap", "pipedap-ddp", "pipedap-own", "pipedap-allreduce", "pipedap-dear")
#: ``pipedap-own``: the default without the ``torch_ddp`` candidate (pipedap's own engine paths only);
#: ``pipedap-ddp``: the default with the trial's choice forced to ``torch_ddp`` (what pipedap's glue costs
#: around DDP's own reducer)


#: fewest steady-state intervals a job measures
MIN_MEASURED = 20


def _steady(strategy: object) -> int | None:
    """The first step index of steady state: 0 for Lightning's ``"ddp"``; for pipedap the steps of its start-up
    (trace, profiling, trials: ``strategy.startup``) plus 2 (the step that installs the chosen candidate settles);
    None while pipedap's start-up is not over. The rule SpeedupMonitor (the app's iteration time) uses:
    :func:`lightning_pipedap.measure.speedup.steady_from_step`."""
    from lightning_pipedap.measure.speedup import steady_from_step

    return steady_from_step(strategy)


def _job(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_pipedap  # noqa: F401

    torch.manual_seed(0)
    torch.set_num_threads(1)
    if args.model == "tiny_mlp":
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                  torch.nn.Linear(64, 10))
        x, y = torch.randn(4096, 32), torch.randint(0, 10, (4096,))
    else:
        from lightning_pipedap.models.cnn import DigitsCNN

        net = DigitsCNN()
        x, y = torch.randn(4096, 1, 8, 8), torch.randint(0, 10, (4096,))

    class Clock(pl.Callback):
        pipedap_reads_model = False  # reads no parameter: pipedap need not apply pending updates before it

        def __init__(self) -> None:
            self.starts: list[float] = []
            self.cpu: list[float] = []  # process CPU time (all threads) at each step start
            self.prof = None  # cProfile of rank 0's steps after the warm-up (``--profile``)
            self.profiling = False

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.starts.append(time.perf_counter())
            self.cpu.append(time.process_time())
            if self.prof is not None and not self.profiling and len(self.starts) > args.warmup \
                    and _steady(trainer.strategy) is not None:
                self.profiling = True
                self.prof.enable()

    class Timed(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    if args.variant == "ddp":
        strategy: object = "ddp"
    else:
        from lightning_pipedap import PipeDAPStrategy

        schedule = {"pipedap": "optimal", "pipedap-ddp": "optimal", "pipedap-own": "optimal",
                    "pipedap-allreduce": "allreduce", "pipedap-dear": "dear"}[args.variant]
        if args.variant == "pipedap-ddp":
            import lightning_pipedap.strategy.controller as ctl

            real = ctl.choose_candidate

            def forced(names, windows, floor=None, **kw):
                _, medians, notes = real(names, windows, floor, **kw)
                return list(names).index("torch_ddp"), medians, notes

            ctl.choose_candidate = forced
        strategy = PipeDAPStrategy(schedule=schedule, torch_ddp_candidate=args.variant != "pipedap-own")
    model, clock = Timed(), Clock()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                         callbacks=[clock],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         use_distributed_sampler=False)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False)
    if args.profile and trainer.global_rank == 0:
        import cProfile

        clock.prof = cProfile.Profile()
    trainer.fit(model, loader)
    prof = clock.prof
    if trainer.global_rank != 0:
        return
    steady = _steady(strategy)
    if steady is None:  # (the fit ended before the trials chose: no steady state to measure)
        raise SystemExit(f"{args.variant}: the fit of {args.steps} steps ended before steady state; raise --steps")
    first = max(args.warmup, steady)
    if args.steps - first < MIN_MEASURED:
        raise SystemExit(f"{args.variant}: steady state from step {steady}, only {args.steps - first} steps to measure "
                         f"(< {MIN_MEASURED}); raise --steps")
    gaps = [b - a for a, b in zip(clock.starts[:-1], clock.starts[1:])][first:]
    cpu = clock.cpu[first:]
    with open(args.out, "w") as f:
        ran = getattr(strategy, "installed_schedule", None) or "ddp"
        json.dump({"median_s": statistics.median(gaps), "cpu_per_step_s": (cpu[-1] - cpu[0]) / (len(cpu) - 1),
                   "steps": len(gaps), "first": first, "installed": ran.split(":")[0]}, f)
    if prof is not None:
        import io
        import pstats

        prof.disable()
        prof.dump_stats(args.profile + ".pstats")  # (raw stats, for pstats or snakeviz)
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("cumulative").print_stats("lightning_pipedap", 40)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("tottime").print_stats("lightning_pipedap", 25)
        st.print_callers("distributed_c10d.py.*broadcast|threading.py.*\\(wait\\)|module.py.*__setattr__")
        with open(args.profile, "w") as f:
            f.write(f"{args.steps - first} profiled steps (from step {first})\n" + s.getvalue())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("tiny_mlp", "digits_cnn"), default="tiny_mlp")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=100,
                   help="intervals discarded at least; pipedap's are discarded until its start-up (trace, profiling, "
                        "trials) is over")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--profile", default=None)
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
    results: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    installed: dict[str, list[str]] = {v: [] for v in variants}
    measured: dict[str, list[str]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for v in variants:
                out = os.path.join(tmp, f"{v}.{r}.json")
                cmd = [sys.executable, os.path.abspath(__file__), "--job", "--variant", v, "--out", out,
                       "--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup)]
                if args.profile:
                    cmd += ["--profile", args.profile]
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if done.returncode != 0:
                    raise SystemExit(f"variant {v}, round {r} failed:\n{done.stderr[-3000:]}")
                with open(out) as f:
                    job = json.load(f)
                results[v].append(job["median_s"])
                cpu[v].append(job["cpu_per_step_s"])
                installed[v].append(job["installed"].split(" (")[0])
                measured[v].append(f"{job['first']}+{job['steps']}")
    print(f"model {args.model}, 2 CPU processes, median iteration (ms) per round, ratio to ddp of the same round")
    for v, times in results.items():
        ratios = [t / d for t, d in zip(times, results["ddp"])] if "ddp" in results else []
        print(f"  {v:18s} " + "  ".join(f"{t * 1e3:7.3f}" for t in times)
              + ("   ratio " + " ".join(f"{x:.3f}" for x in ratios) if ratios else "")
              + f"   ran: {' '.join(installed[v])}   measured (first step+intervals): {' '.join(measured[v])}")
    print("rank 0's process CPU time per step (ms, every thread: training, communication, gloo), ratio to ddp")
    for v, times in cpu.items():
        ratios = [t / d for t, d in zip(times, cpu["ddp"])] if "ddp" in cpu else []
        print(f"  {v:18s} " + "  ".join(f"{t * 1e3:7.3f}" for t in times)
              + ("   ratio " + " ".join(f"{x:.3f}" for x in ratios) if ratios else ""))


if __name__ == "__main__":
    main()
