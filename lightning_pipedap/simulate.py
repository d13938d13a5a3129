"""What-if CLI: predicted iteration time of every planner for a profile, worker count and network.

Usage::

    python -m lightning_pipedap.simulate --profile resnet50 --world-size 8
    python -m lightning_pipedap.simulate --profile my_profile.json --world-size 4 \\
        --alpha 1e-4 --beta 2e-10 --planner optimal --png gantt.png --trace trace.json

The profile is a file (our format or a PipeDAP reference profile) or the name of a shared profile
(``shared/profiles/<name>.json``). The cost model is, in this order of precedence: ``--cost-model``
(a JSON written by :meth:`CostModel.save`), ``--alpha``/``--beta`` (all-reduce constants, s and
s/byte), ``--alpha``/``--bandwidth`` (GB/s of a ring all-reduce: ``beta = 2 (N-1) / N / bandwidth``),
or the shared reference constants ``alpha_beta.json`` for the worker count.
RS and AG are derived from all-reduce constants with ``--startup-sharing`` (see
:meth:`CostModel.from_allreduce`). ``--beta-scale`` multiplies beta (a slower network).

The table lists, per planner: buckets, ops, predicted iteration time, exposed communication, gap
to the best lower bound, and speedup over ``no_overlap``; then the lower bounds. ``--png`` draws a
Gantt chart of two steady-state iterations per planner (compute lane with waits = exposed
communication in red, one lane per channel); ``--trace`` writes a Chrome trace (chrome://tracing,
Perfetto). :func:`draw_gantt` and :func:`chrome_trace` take plain intervals, so measured timelines
can be drawn the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from lightning_pipedap.plan.cost_model import CostModel, load_cost_model
from lightning_pipedap.plan.planners import PLANNERS, get_planner
from lightning_pipedap.plan.profile import load_profile, shared_profiles_dir
from lightning_pipedap.plan.simulator import Interval, OpTiming, SimResult, lower_bounds, simulate

ORDER = ("no_overlap", "wfbp", "dear", "pipedap", "optimal")
_COLORS = {"forward": "#4C72B0", "backward": "#55A868", "update": "#8C8C8C", "wait": "#D62728",
           "RS": "#DD8452", "AG": "#8172B3", "AR": "#937860"}


def build_cost_model(args: argparse.Namespace) -> CostModel:
    """Cost model from the CLI arguments (see the module docstring for the precedence).

    Raises:
        ValueError: if the arguments are inconsistent or no source of constants is available.
    """
    n = args.world_size
    if args.cost_model:
        cm = load_cost_model(args.cost_model)
    elif args.alpha is not None or args.beta is not None or args.bandwidth is not None:
        if args.alpha is None:
            raise ValueError("--beta/--bandwidth need --alpha (start-up seconds of one all-reduce)")
        if (args.beta is None) == (args.bandwidth is None):
            raise ValueError("give exactly one of --beta (s/byte) and --bandwidth (GB/s) with --alpha")
        if args.beta is not None:
            beta = args.beta
        else:
            if args.bandwidth <= 0:
                raise ValueError(f"--bandwidth must be > 0 GB/s, got {args.bandwidth}")
            beta = 2.0 * (n - 1) / n / (args.bandwidth * 1e9) if n > 1 else 0.0
        cm = CostModel.from_allreduce(args.alpha, beta, startup_sharing=args.startup_sharing,
                                      meta={"world_size": n})
    else:
        d = shared_profiles_dir()
        if d is None or not (d / "alpha_beta.json").is_file():
            raise ValueError("no cost model: give --cost-model, --alpha with --beta/--bandwidth, or put "
                             "shared/profiles/alpha_beta.json beside the checkout")
        cm = CostModel.from_reference(d / "alpha_beta.json", n, bytes_per_element=args.bytes_per_element,
                                      startup_sharing=args.startup_sharing)
    if args.beta_scale != 1.0:
        cm = cm.scaled(beta_factor=args.beta_scale)
    return cm


def format_table(results: dict[str, SimResult], bounds_best: float, bounds_text: str) -> str:
    """Plain-text table of the results (times in ms)."""
    base = results.get("no_overlap")
    head = f"{'planner':<11} {'buckets':>7} {'ops':>5} {'iter ms':>10} {'exposed ms':>10} {'gap %':>7} {'speedup':>8}"
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        gap = 100.0 * (r.iteration_s / bounds_best - 1.0) if bounds_best > 0 else 0.0
        sp = f"{base.iteration_s / r.iteration_s:8.3f}" if base is not None else f"{'-':>8}"
        lines.append(f"{name:<11} {len(r.schedule.buckets):>7} {len(r.schedule.ops):>5} {r.iteration_s * 1e3:>10.3f} "
                     f"{r.exposed_comm_s * 1e3:>10.3f} {gap:>7.2f} {sp}")
    lines.append(bounds_text)
    return "\n".join(lines)


def draw_gantt(rows: Sequence[tuple[str, Sequence[Interval], Sequence[OpTiming], float]], path: str | Path,
               iterations: int = 2) -> Path:
    """Draw one Gantt panel per row and save a PNG (matplotlib, Agg backend).

    Args:
        rows: ``(title, compute intervals, op timings, iteration seconds)``; times in seconds,
            already laid out over ``iterations`` iterations from 0 (see
            :meth:`SimResult.compute_window` / :meth:`SimResult.op_window`; measured timelines can
            be passed in the same form).
        path: output PNG path.
        iterations: how many iterations the x axis spans.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(rows), 1, figsize=(14, 1.6 + 1.3 * len(rows)), squeeze=False)
    for ax, (title, compute, ops, period) in zip(axes[:, 0], rows):
        span = iterations * period
        nch = 1 + max((o.channel for o in ops), default=0)
        lanes = ["compute"] + [f"comm {c}" for c in range(nch)]
        for c in compute:
            ax.broken_barh([(c.start * 1e3, (c.end - c.start) * 1e3)], (nch + 0.1, 0.8),
                           facecolors=_COLORS.get(c.kind, "k"), edgecolor="white", linewidth=0.2)
        for o in ops:
            s, e = max(0.0, o.start), min(span, o.end)
            if e > s:
                ax.broken_barh([(s * 1e3, (e - s) * 1e3)], (nch - 1 - o.channel + 0.1, 0.8),
                               facecolors=_COLORS[o.op.kind.value], edgecolor="white", linewidth=0.3)
                if (e - s) / span > 0.025:
                    ax.text((s + e) / 2 * 1e3, nch - 1 - o.channel + 0.5, str(o.op), ha="center", va="center",
                            fontsize=6, color="white")
        for k in range(1, iterations):
            ax.axvline(k * period * 1e3, color="k", linestyle=":", linewidth=0.8)
        ax.set_xlim(0, span * 1e3)
        ax.set_ylim(0, nch + 1)
        ax.set_yticks([i + 0.5 for i in range(nch + 1)])
        ax.set_yticklabels(list(reversed(lanes)))
        ax.set_title(f"{title}: {period * 1e3:.2f} ms / iteration", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time (ms)")
    fig.legend(handles=[Patch(color=v, label=k if k != "wait" else "wait (exposed comm.)") for k, v in _COLORS.items()],
               loc="upper right", ncol=7, fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    p = Path(path)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p


def chrome_trace(rows: Sequence[tuple[str, Sequence[Interval], Sequence[OpTiming], float]]) -> dict:
    """Chrome trace JSON (``traceEvents``, complete events, microseconds); one process per row."""
    events = []
    for pid, (title, compute, ops, _) in enumerate(rows):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": title}})
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "compute"}})
        for c in compute:
            name = c.kind if c.bucket is None else f"{c.kind} b{c.bucket}"
            events.append({"name": name, "cat": c.kind, "ph": "X", "pid": pid, "tid": 0,
                           "ts": c.start * 1e6, "dur": (c.end - c.start) * 1e6})
        for o in ops:
            events.append({"name": str(o.op), "cat": o.op.kind.value, "ph": "X", "pid": pid, "tid": 1 + o.channel,
                           "ts": o.start * 1e6, "dur": (o.end - o.start) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line arguments (see ``--help``)."""
    ap = argparse.ArgumentParser(prog="python -m lightning_pipedap.simulate", description=__doc__.split("\n")[0])
    ap.add_argument("--profile", required=True, help="profile JSON file or shared profile name (e.g. resnet50)")
    ap.add_argument("--world-size", type=int, required=True, help="number of data-parallel workers")
    ap.add_argument("--planner", default="all", help=f"'all' or one of {sorted(PLANNERS)}")
    ap.add_argument("--cost-model", help="cost model JSON (CostModel.save)")
    ap.add_argument("--alpha", type=float, help="all-reduce start-up time, s")
    ap.add_argument("--beta", type=float, help="all-reduce transfer time, s per byte")
    ap.add_argument("--bandwidth", type=float, help="instead of --beta: bus bandwidth, GB/s (ring all-reduce)")
    ap.add_argument("--beta-scale", type=float, default=1.0, help="multiply beta (what-if: slower network)")
    ap.add_argument("--startup-sharing", type=float, default=0.0,
                    help="fraction of alpha an AR saves over RS+AG, in [0, 1] (0 = reference split)")
    ap.add_argument("--channels", type=int, default=1, choices=(1, 2), help="communication channels")
    ap.add_argument("--bytes-per-element", type=int, default=4, help="bytes per gradient element (fp32: 4)")
    ap.add_argument("--repaired", action="store_true", help="use layers_repaired of a reference profile")
    ap.add_argument("--png", help="write a Gantt chart PNG here")
    ap.add_argument("--trace", help="write a Chrome trace JSON here")
    ap.add_argument("--describe", action="store_true", help="also print each schedule's op list")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status (0 ok, 2 bad arguments)."""
    args = parse_args(argv)
    try:
        if args.world_size < 1:
            raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
        names = list(ORDER) if args.planner == "all" else [args.planner]
        for n in names:
            get_planner(n)
        profile = load_profile(args.profile, repaired=args.repaired, bytes_per_element=args.bytes_per_element)
        cm = build_cost_model(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = {}
    for n in names:
        sched = get_planner(n)(profile, cm, args.world_size, channels=args.channels)
        results[n] = simulate(profile, cm, sched, channels=args.channels)
    lb = lower_bounds(profile, cm, channels=args.channels)
    print(f"profile {profile.name}: {profile.num_layers} layers, {profile.total_bytes / 2**20:.1f} MiB, "
          f"forward {profile.t_forward * 1e3:.3f} ms, backward {profile.t_backward * 1e3:.3f} ms, "
          f"update {profile.t_update * 1e3:.3f} ms; world size {args.world_size}, {args.channels} channel(s)")
    print(f"cost model: AR alpha {cm.ar.alpha_s * 1e6:.2f} us, beta {cm.ar.beta_s_per_byte * 1e12:.4f} ps/B; "
          f"RS alpha {cm.rs.alpha_s * 1e6:.2f} us; AG alpha {cm.ag.alpha_s * 1e6:.2f} us")
    bounds = (f"lower bounds: compute {lb.compute_s * 1e3:.3f} ms, sum max(compute, comm) {lb.sum_bound_s * 1e3:.3f} ms, "
              f"window {lb.window_s * 1e3:.3f} ms (layer {lb.window_layer}); gap % is against "
              f"{lb.best_s * 1e3:.3f} ms")
    print(format_table(results, lb.best_s, bounds))
    if args.describe:
        for r in results.values():
            print(r.schedule.describe())
    rows = [(n, r.compute_window(2), r.op_window(2), r.iteration_s) for n, r in results.items()]
    if args.png:
        print(f"wrote {draw_gantt(rows, args.png)}")
    if args.trace:
        Path(args.trace).write_text(json.dumps(chrome_trace(rows)))
        print(f"wrote {args.trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
