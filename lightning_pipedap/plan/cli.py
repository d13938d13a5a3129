"""What-if CLI: predicted iteration time of every planner for a profile, worker count and network.

Usage::

    python -m lightning_pipedap.plan.cli --profile resnet50 --world-size 8
    python -m lightning_pipedap.plan.cli --profile my_profile.json --world-size 4 \\
        --alpha 1e-4 --beta 2e-10 --planner optimal --png gantt.png --trace trace.json
    python -m lightning_pipedap.plan.cli --profile vgg16 --world-size 8 --compression powersgd \\
        --compression-kwargs rank=4 --png vgg16_powersgd.png
    python -m lightning_pipedap.plan.cli --sweep --out docs/PLANNERS.md

The profile is a file (our format or a PipeDAP reference profile) or the name of a reference profile
shipped with the package (``lightning_pipedap/plan/profiles/<name>.json``). The cost model is, in this order
of precedence: ``--cost-model`` (a JSON written by :meth:`CostModel.save`), ``--alpha``/``--beta`` (all-reduce
constants, s and s/byte), ``--alpha``/``--bandwidth`` (GB/s of a ring all-reduce: ``beta = 2 (N-1) / N / bandwidth``),
or the shared reference constants ``alpha_beta.json`` for the worker count.
RS and AG are derived from all-reduce constants with ``--startup-sharing`` (see
:meth:`CostModel.from_allreduce`). ``--beta-scale`` multiplies beta (a slower network).

The table lists, per planner: buckets, ops, predicted iteration time, exposed communication, gap
to the best lower bound, and speedup over ``no_overlap``; then the lower bounds. ``--png`` draws a
Gantt chart of two steady-state iterations per planner and ``--trace`` writes a Chrome trace
(chrome://tracing, Perfetto), one process per planner. Both go through
:func:`lightning_pipedap.plan.simulator.to_op_records` and the measured-timeline drawer and writer of
:mod:`lightning_pipedap.measure.timeline`, so simulated and measured timelines look the same
(compute lane, communication lane, exposed communication shaded red).

``--compression METHOD`` (a compressor name of :mod:`lightning_pipedap.compress`) adds, beside each
planner's dense row, a row ``<planner>+<METHOD>`` planned with the compression cost: ``optimal``
chooses which buckets to compress (never worse than dense), the other planners compress every
bucket; the ``compressed`` column counts the compressed buckets and their gap % is against the
lower bound with compression. Without a live process group the cost comes from one of two honest
sources (:func:`build_compression_cost`): ``--compression-cost FILE`` (a JSON written by
:meth:`~lightning_pipedap.plan.compression.CompressionCost.save`, e.g. ``--save-compression-cost``
of an earlier run), or else it is *measured on this machine's CPU* with
:func:`~lightning_pipedap.probe.compression_cost.measure_compression_cost` on synthetic fp32
tensors of the profile's layer sizes (elements = layer bytes / 4; for ``powersgd`` each layer is one
near-square matrix plus a 1-D remainder, since a profile has no parameter shapes), about
``--compression-budget`` seconds. ``--compression-where helper`` (default) puts the compression on a
helper lane beside compute (drawn in the Gantt chart and the trace), ``inline`` on the channel.

``--save-schedule FILE`` writes the schedule of the one planner named by ``--planner`` (with
``--compression``: the one planned with compression) as JSON (:meth:`Schedule.to_dict
<lightning_pipedap.schedule.Schedule.to_dict>`); ``--schedule FILE`` reads such a file back and
simulates it, instead of planning, against ``--profile`` and the cost model (a schedule with
compressed buckets needs ``--compression``, and ``--compression-cost`` for the cost it was planned with).

``--sharded`` adds, beside each row, a row ``<row>+sharded`` planned and simulated for the sharded optimizer step
(``shard_optimizer``: each rank steps its 1/N shard of a bucket between its reduce-scatter and the all-gather of the
parameters, :mod:`lightning_pipedap.plan.sharding`); ``--clip-norm`` models clip by norm (the gradients of every
sharded bucket all-gathered before the first step) and ``--land-ns-per-byte`` the land copy on the compute stream
(default 0). It prints the lower bounds of the sharded model and, per row, the predicted iteration sharded vs
unsharded for the same profile. With ``--save-schedule`` the sharded row's schedule is written (the engine's op list);
with ``--schedule`` the saved schedule is simulated both ways.

``--sweep`` runs the Validation 1 grid of ``docs/PLANNERS.md`` (:mod:`lightning_pipedap.plan.sweep`):
every shared profile x {2, 4, 8} workers x beta x {1, 10, 30} with the reference convention; it
prints a Markdown table and, with ``--out``, writes it into a file between the sweep markers.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from lightning_pipedap.compress.compressors import get_compressor, valid_compressor_names
from lightning_pipedap.measure.timeline import chrome_trace, gantt_panels_png
from lightning_pipedap.plan.bounds import lower_bounds
from lightning_pipedap.plan._jsonfile import save_json
from lightning_pipedap.plan.compression import WHERE, CompressionCost, load_compression_cost
from lightning_pipedap.plan.cost_model import CostModel, load_cost_model
from lightning_pipedap.plan.planners import PLANNERS, get_planner
from lightning_pipedap.plan.profile import ModelProfile, load_profile, shared_profiles_dir
from lightning_pipedap.plan.sharding import Sharding
from lightning_pipedap.plan.simulator import SimResult, simulate, to_op_records
from lightning_pipedap.plan.sweep import ORDER, run_sweep, sweep_markdown, write_between_markers
from lightning_pipedap.schedule import Schedule


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
            raise ValueError("no cost model: give --cost-model, --alpha with --beta/--bandwidth, or point "
                             "PIPEDAP_PROFILES_DIR at a folder with alpha_beta.json")
        cm = CostModel.from_reference(d / "alpha_beta.json", n, bytes_per_element=args.bytes_per_element,
                                      startup_sharing=args.startup_sharing)
    if args.beta_scale != 1.0:
        cm = cm.scaled(beta_factor=args.beta_scale)
    return cm


def format_table(results: dict[str, SimResult], bounds_best: float, bounds_text: str, *,
                 row_bounds: Mapping[str, float] | None = None) -> str:
    """Plain-text table of the results (times in ms).

    Columns: planner (row name), buckets, ops, iteration ms, exposed communication ms, gap % to the
    best lower bound (``row_bounds[name]`` when given for that row, else ``bounds_best``, seconds),
    speedup over the ``no_overlap`` row, and, when any schedule carries compression flags, the
    compressed buckets ``k/B`` (``-`` for dense rows).
    """
    base = results.get("no_overlap")
    width = max([11, *(len(n) for n in results)])
    show_c = any(r.schedule.compressed is not None for r in results.values())
    head = (f"{'planner':<{width}} {'buckets':>7} {'ops':>5} {'iter ms':>10} {'exposed ms':>10} {'gap %':>7} "
            f"{'speedup':>8}" + (f" {'compressed':>10}" if show_c else ""))
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        best = (row_bounds or {}).get(name, bounds_best)
        gap = round(100.0 * (r.iteration_s / best - 1.0), 2) + 0.0 if best > 0 else 0.0  # + 0.0: no "-0.00"
        sp = f"{base.iteration_s / r.iteration_s:8.3f}" if base is not None else f"{'-':>8}"
        line = (f"{name:<{width}} {len(r.schedule.buckets):>7} {len(r.schedule.ops):>5} {r.iteration_s * 1e3:>10.3f} "
                f"{r.exposed_comm_s * 1e3:>10.3f} {gap:>7.2f} {sp}")
        if show_c:
            sch = r.schedule
            line += f" {(f'{sch.num_compressed}/{len(sch.buckets)}' if sch.compressed is not None else '-'):>10}"
        lines.append(line)
    lines.append(bounds_text)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ compression
def parse_compression_kwargs(text: str | None) -> dict[str, Any]:
    """``"rank=4,start_step=0"`` -> ``{"rank": 4, "start_step": 0}``.

    Values are Python literals (``4``, ``0.01``, ``True``; ``true``/``false`` also accepted); anything
    else is kept as a string. The compressor validates names and values.

    Raises:
        ValueError: for an item without ``=`` or with an empty key, naming the item.
    """
    out: dict[str, Any] = {}
    if not text:
        return out
    for item in text.split(","):
        if not item.strip():
            continue
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key:
            raise ValueError(f"--compression-kwargs item {item!r} is not key=value (e.g. rank=4,start_step=0)")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
            continue
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def synthetic_layer_shapes(profile: ModelProfile, method: str) -> list[list[tuple[int, ...]]]:
    """Per profile layer, parameter shapes for timing ``method`` without the model (fp32 elements).

    A layer of ``nbytes`` bytes has ``nbytes // 4`` elements (compression works on fp32 gradients).
    For ``powersgd`` (whose cost depends on matrix shapes, which a profile does not record) the
    layer becomes one near-square matrix ``[r, n // r]`` with ``r = isqrt(n)`` plus a 1-D remainder of
    ``n - r * (n // r)`` elements; for the other methods one 1-D tensor ``[n]``. Layers with no
    elements get no shapes.
    """
    shapes: list[list[tuple[int, ...]]] = []
    for layer in profile.layers:
        n = layer.nbytes // 4
        if n < 1:
            shapes.append([])
        elif method == "powersgd":
            r = math.isqrt(n)
            c = n // r
            shapes.append([(r, c)] + ([(n - r * c,)] if n - r * c else []))
        else:
            shapes.append([(n,)])
    return shapes


def build_compression_cost(args: argparse.Namespace, profile: ModelProfile) -> CompressionCost | None:
    """The compression cost from the CLI arguments, or None without ``--compression``.

    ``--compression-cost FILE`` is loaded (its method must be ``--compression``; ``--compression-where``
    overrides its ``where``); otherwise the cost is measured on this machine's CPU on
    :func:`synthetic_layer_shapes` of ``profile`` (module docstring) and, with
    ``--save-compression-cost``, written to that file.

    Raises:
        ValueError: compression options without ``--compression``, bad ``--compression-kwargs`` (the
            compressor names the valid keywords), a cost file of another method, kwargs given
            together with a cost file (they would be ignored), ``--bytes-per-element`` other than 4,
            or per-layer payloads that do not fit the profile.
        FileNotFoundError: the cost file does not exist.
    """
    method = args.compression
    if method is None:
        given = [f for f in ("compression_cost", "compression_kwargs", "compression_where", "save_compression_cost")
                 if getattr(args, f) is not None]
        if given:
            raise ValueError(f"{', '.join('--' + g.replace('_', '-') for g in given)} need --compression METHOD "
                             f"(one of {', '.join(valid_compressor_names())})")
        return None
    if args.bytes_per_element != 4:
        raise ValueError(f"--compression works on fp32 gradients (4 bytes per element); got --bytes-per-element "
                         f"{args.bytes_per_element}")
    kwargs = parse_compression_kwargs(args.compression_kwargs)
    if args.compression_cost is not None and kwargs:
        raise ValueError("--compression-kwargs has no effect with --compression-cost (the file's payload and "
                         "times belong to the kwargs it was measured with); drop one of them")
    get_compressor(method, **kwargs)  # validates names and values before any work
    if args.compression_cost is not None:
        cost = load_compression_cost(args.compression_cost)
        if cost.method != method:
            raise ValueError(f"{args.compression_cost} holds the cost of {cost.method!r}, but --compression is "
                             f"{method!r}")
        if args.compression_where is not None and args.compression_where != cost.where:
            cost = replace(cost, where=args.compression_where)
        source = f"loaded from {args.compression_cost}"
    else:
        from lightning_pipedap.probe.compression_cost import measure_compression_cost  # noqa: PLC0415  (torch work)

        if args.compression_budget <= 0:
            raise ValueError(f"--compression-budget must be > 0 seconds, got {args.compression_budget}")
        cost = measure_compression_cost(method, kwargs, synthetic_layer_shapes(profile, method),
                                        world_size=args.world_size, where=args.compression_where or "helper",
                                        budget_s=args.compression_budget)
        source = (f"measured on this CPU in {cost.meta.get('measure_s', 0.0):.2f} s on synthetic fp32 tensors of the "
                  f"profile's layer sizes (R\u00b2 {cost.meta.get('r2', float('nan')):.3f}); GPU or helper-process "
                  "timings differ")
        if args.save_compression_cost:
            cost.save(args.save_compression_cost)
            source += f"; saved to {args.save_compression_cost}"
    cost.check_layers(profile.num_layers)
    print(f"compression {method} ({cost.where}): {cost.alpha_c_s * 1e6:.1f} us + {cost.beta_c_s_per_byte * 1e9:.4f} "
          f"ns/B, {cost.post_share:.0%} after the collective, payload via {cost.collective} x{cost.rounds}; "
          f"{source}")
    return cost


# ------------------------------------------------------------------------------------ schedules
#: row name -> (schedule, the compression cost it is simulated with or None, the sharded step's model or None)
Rows = dict[str, tuple[Schedule, CompressionCost | None, Sharding | None]]


def build_sharding(args: argparse.Namespace) -> Sharding | None:
    """The sharded step's model from ``--sharded``, ``--clip-norm`` and ``--land-ns-per-byte``, or None.

    Raises:
        ValueError: ``--clip-norm`` or ``--land-ns-per-byte`` without ``--sharded``, or a negative land cost.
    """
    if not args.sharded:
        given = [f for f, v in (("--clip-norm", args.clip_norm), ("--land-ns-per-byte", args.land_ns_per_byte))
                 if v not in (False, None)]
        if given:
            raise ValueError(f"{', '.join(given)} model the sharded optimizer step: add --sharded")
        return None
    land = 0.0 if args.land_ns_per_byte is None else args.land_ns_per_byte
    if not land >= 0:
        raise ValueError(f"--land-ns-per-byte must be >= 0, got {args.land_ns_per_byte}")
    return Sharding(clip_norm=args.clip_norm, land_s_per_byte=land * 1e-9)


def planned_rows(args: argparse.Namespace, profile: ModelProfile, cm: CostModel,
                 cost: CompressionCost | None, sharding: Sharding | None = None) -> Rows:
    """Every planner of ``--planner`` planned dense (row ``<planner>``) and, with a compression cost,
    planned with it (row ``<planner>+<METHOD>``, next to the dense one); with ``sharding`` each of those
    also planned for the sharded step (row ``<row>+sharded``, next to it)."""
    rows: Rows = {}
    for n in list(ORDER) if args.planner == "all" else [args.planner]:
        for name, c in [(n, None)] + ([(f"{n}+{args.compression}", cost)] if cost is not None else []):
            rows[name] = (get_planner(n)(profile, cm, args.world_size, channels=args.channels, compression=c), c, None)
            if sharding is not None:
                rows[f"{name}+sharded"] = (get_planner(n)(profile, cm, args.world_size, channels=args.channels,
                                                          compression=c, sharded=sharding), c, sharding)
    return rows


def sharded_comparison(results: Mapping[str, SimResult]) -> list[str]:
    """One line per row that has a ``+sharded`` twin: ``sharded vs unsharded <row>: X ms vs Y ms (+d %)``, the
    predicted iteration times of the same profile with and without the sharded optimizer step."""
    out = []
    for name, r in results.items():
        twin = results.get(f"{name}+sharded")
        if twin is None or name.endswith("+sharded"):
            continue
        d = 100.0 * (twin.iteration_s / r.iteration_s - 1.0) if r.iteration_s > 0 else 0.0
        out.append(f"sharded vs unsharded {name}: {twin.iteration_s * 1e3:.3f} ms vs {r.iteration_s * 1e3:.3f} ms "
                   f"({d:+.2f} %; exposed {twin.exposed_comm_s * 1e3:.3f} vs {r.exposed_comm_s * 1e3:.3f} ms)")
    return out


def read_schedule(path: str, profile: ModelProfile, cost: CompressionCost | None) -> Schedule:
    """The schedule saved at ``path`` (``--save-schedule``), checked against ``profile``'s layers.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not JSON or not a schedule (:meth:`Schedule.from_dict` names the bad key
            or value), its buckets do not partition the profile's layers, it compresses buckets but
            ``cost`` is None, or ``cost`` is given for a schedule without compression flags.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--schedule {path}: no such file")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--schedule {path} is not JSON ({e})") from None
    try:
        sched = Schedule.from_dict(data).validate(profile.num_layers)
    except ValueError as e:
        raise ValueError(f"--schedule {path}: {e}") from None
    if sched.num_compressed and cost is None:
        raise ValueError(f"--schedule {path} compresses {sched.num_compressed} of {len(sched.buckets)} buckets; "
                         "give --compression METHOD (and --compression-cost FILE, the cost it was planned with)")
    if cost is not None and sched.compressed is None:
        raise ValueError(f"--schedule {path} has no compression flags; drop --compression")
    return sched


def _sweep_main(args: argparse.Namespace) -> int:
    defaults = vars(parse_args([]))
    for flag, value in vars(args).items():
        if flag not in ("sweep", "out") and value != defaults[flag]:
            print(f"error: --sweep runs the fixed Validation 1 grid; drop --{flag.replace('_', '-')}", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    try:
        rows = run_sweep(progress=lambda r: print(
            f"  {r.model} {r.world_size}w beta x{r.beta_scale:g}: optimal {r.iteration_s['optimal'] * 1e3:.3f} ms",
            file=sys.stderr, flush=True))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = sweep_markdown(rows)
    print(table, end="")
    print(f"sweep: {len(rows)} rows in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if args.out:
        try:
            print(f"wrote {write_between_markers(args.out, table)}", file=sys.stderr)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line arguments (see ``--help``)."""
    ap = argparse.ArgumentParser(prog="python -m lightning_pipedap.plan.cli", description=__doc__.split("\n")[0])
    ap.add_argument("--profile", help="profile JSON file or shared profile name (e.g. resnet50); required "
                                      "unless --sweep")
    ap.add_argument("--world-size", type=int, help="number of data-parallel workers; required unless --sweep")
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
    ap.add_argument("--png", help="write a Gantt chart PNG here (two iterations per planner)")
    ap.add_argument("--trace", help="write a Chrome trace JSON here (one process per planner)")
    ap.add_argument("--describe", action="store_true", help="also print each schedule's op list")
    ap.add_argument("--compression", choices=valid_compressor_names(), metavar="METHOD",
                    help="also plan with gradient compression: one of " + ", ".join(valid_compressor_names())
                         + "; its cost comes from --compression-cost or is measured on this CPU on synthetic "
                           "fp32 tensors of the profile's layer sizes")
    ap.add_argument("--compression-kwargs", metavar="K=V,...", help="compressor keyword arguments, e.g. rank=4")
    ap.add_argument("--compression-where", choices=WHERE,
                    help="helper: compression on a helper lane beside compute (default); inline: on the channel")
    ap.add_argument("--compression-cost", metavar="FILE", help="CompressionCost JSON (CompressionCost.save) "
                                                               "instead of measuring")
    ap.add_argument("--compression-budget", type=float, default=1.0,
                    help="seconds the CPU measurement of the compressor may take (default 1)")
    ap.add_argument("--save-compression-cost", metavar="FILE", help="write the measured compression cost here")
    ap.add_argument("--save-schedule", metavar="FILE",
                    help="write the schedule of --planner NAME (with --compression: planned with it) as JSON")
    ap.add_argument("--schedule", metavar="FILE", help="simulate this saved schedule (--save-schedule) instead of "
                                                       "planning")
    ap.add_argument("--sharded", action="store_true",
                    help="also plan and simulate each row for the sharded optimizer step (shard_optimizer): rows "
                         "<row>+sharded and the predicted iteration sharded vs unsharded")
    ap.add_argument("--clip-norm", action="store_true",
                    help="with --sharded: the step clips by norm (gradients all-gathered before the first step)")
    ap.add_argument("--land-ns-per-byte", type=float, metavar="NS",
                    help="with --sharded: compute-stream cost of landing gathered parameters, ns/byte (default 0)")
    ap.add_argument("--sweep", action="store_true",
                    help="Validation 1: every shared profile x {2,4,8} workers x beta x{1,10,30}, Markdown table")
    ap.add_argument("--out", help="with --sweep: write the table into this file between the sweep markers")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status (0 ok, 2 bad arguments)."""
    args = parse_args(argv)
    if args.sweep:
        return _sweep_main(args)
    try:
        if args.out is not None:
            raise ValueError("--out goes with --sweep")
        if args.profile is None or args.world_size is None:
            raise ValueError("give --profile and --world-size (or --sweep)")
        if args.world_size < 1:
            raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
        if args.planner != "all":
            get_planner(args.planner)
        if args.schedule is not None and (args.planner != "all" or args.save_schedule is not None):
            raise ValueError("--schedule simulates the saved schedule; drop --planner and --save-schedule")
        if args.save_schedule is not None and args.planner == "all":
            raise ValueError("--save-schedule writes one schedule: give --planner NAME")
        sharding = build_sharding(args)
        profile = load_profile(args.profile, repaired=args.repaired, bytes_per_element=args.bytes_per_element)
        cm = build_cost_model(args)
        if sharding is not None and cm.meta.get("world_size") not in (None, args.world_size):
            raise ValueError(f"the cost model was built for world size {cm.meta['world_size']}, but --world-size is "
                             f"{args.world_size}")
        cost = build_compression_cost(args, profile)
        if args.schedule is not None:
            saved = read_schedule(args.schedule, profile, cost)
            rows: Rows = {saved.name: (saved, cost, None)}
            if sharding is not None:
                rows[f"{saved.name}+sharded"] = (saved, cost, sharding)
        else:
            rows = planned_rows(args, profile, cm, cost, sharding)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    N = args.world_size
    results = {row: simulate(profile, cm, sched, channels=args.channels, compression=c, world_size=N, sharded=sh)
               for row, (sched, c, sh) in rows.items()}
    lb_c = (lower_bounds(profile, cm, channels=args.channels, compression=cost, world_size=N)
            if cost is not None else None)
    row_bounds = {row: lb_c.best_s for row, (_, c, _) in rows.items() if c is not None}
    lb = lower_bounds(profile, cm, channels=args.channels)
    lb_s = {}  # sharded rows: the sharded model's bounds (with the compression cost, if any)
    if sharding is not None:
        for c in {id(c): c for _, c, _ in rows.values()}.values():
            lb_s[id(c)] = lower_bounds(profile, cm, channels=args.channels, compression=c, world_size=N,
                                       sharded=sharding)
        row_bounds.update({row: lb_s[id(c)].best_s for row, (_, c, sh) in rows.items() if sh is not None})
    print(f"profile {profile.name}: {profile.num_layers} layers, {profile.total_bytes / 2**20:.1f} MiB, "
          f"forward {profile.t_forward * 1e3:.3f} ms, backward {profile.t_backward * 1e3:.3f} ms, "
          f"update {profile.t_update * 1e3:.3f} ms; world size {args.world_size}, {args.channels} channel(s)")
    print("cost model: " + ", ".join(f"{k} {ab.describe(with_r2=False)}"
                                     for k, ab in (("AR", cm.ar), ("RS", cm.rs), ("AG", cm.ag))))
    bounds = (f"lower bounds: compute {lb.compute_s * 1e3:.3f} ms, "
              f"sum max(compute, comm) {lb.sum_bound_s * 1e3:.3f} ms, window {lb.window_s * 1e3:.3f} ms "
              f"(layer {lb.window_layer}); gap % is against {lb.best_s * 1e3:.3f} ms")
    if lb_c is not None:
        bounds += (f"\nlower bounds with {args.compression} (any bucket dense or compressed): sum max(compute, comm) "
                   f"{lb_c.sum_bound_s * 1e3:.3f} ms, window {lb_c.window_s * 1e3:.3f} ms (layer {lb_c.window_layer}); "
                   f"gap % of the +{args.compression} rows is against {lb_c.best_s * 1e3:.3f} ms")
    if sharding is not None:
        what = ", clip by norm" if sharding.clip_norm else ""
        for c, lbs in ((c, lb_s[id(c)]) for c in {id(c): c for _, c, _ in rows.values()}.values()):
            with_c = f" with {args.compression}" if c is not None else ""
            bounds += (f"\nlower bounds sharded{with_c} (N = {N}{what}): compute {lbs.compute_s * 1e3:.3f} ms, "
                       f"sum max(compute, comm) {lbs.sum_bound_s * 1e3:.3f} ms, window {lbs.window_s * 1e3:.3f} ms "
                       f"(layer {lbs.window_layer}); gap % of the +sharded{with_c} rows is against "
                       f"{lbs.best_s * 1e3:.3f} ms")
    print(format_table(results, lb.best_s, bounds, row_bounds=row_bounds))
    for line in sharded_comparison(results):
        print(line)
    if args.describe:
        for r in results.values():
            print(r.schedule.describe())
    # two iterations of the slowest schedule; the faster ones get as many iterations as fill that span
    span = 2 * max(r.iteration_s for r in results.values())
    panels = [(f"{n}: {r.iteration_s * 1e3:.2f} ms / iteration, exposed comm. {r.exposed_comm_s * 1e3:.2f} ms",
               to_op_records(r, iterations=max(2, math.ceil(span / r.iteration_s - 1e-9)) if r.iteration_s > 0 else 2))
              for n, r in results.items()]
    if args.png:
        print(f"wrote {gantt_panels_png(panels, args.png, origin_s=0.0, window=(0.0, span), width_in=14.0)}")
    if args.save_schedule:
        row = (args.planner if cost is None else f"{args.planner}+{args.compression}") + \
            ("+sharded" if sharding is not None else "")
        print(f"wrote {save_json(rows[row][0], args.save_schedule)} (schedule of {row})")
    if args.trace:
        events = [e for pid, (n, (_, recs)) in enumerate(zip(results, panels))
                  for e in chrome_trace(recs, rank=pid, origin_s=0.0, process_name=n)["traceEvents"]]
        Path(args.trace).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        print(f"wrote {args.trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
