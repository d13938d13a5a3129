"""Hydra callbacks for multiruns: validate every job before the first starts; summarise at the end.

:class:`ValidateSweep` (``on_multirun_start``) expands the sweep (command-line overrides and
``hydra.sweeper.params``, as Hydra's basic sweeper does), composes each job's config and runs
:func:`lightning_pipedap.app.schema.validate` on it, so ``scheduler=dear,foo`` or
``strategy.bucket_cap_mb=25,-1`` stops the sweep before any job or process starts.

:class:`SweepSummary` (``on_multirun_end``) reads each job's ``results.json`` and writes, in the
sweep directory, ``sweep_summary.csv``, ``sweep_summary.md`` and ``sweep_summary.png`` (bar charts of
median iteration time, speedup and energy per step; a job not run again is hatched and labelled
``same run as #k``, and the energy panel says ``estimated`` or ``measured``), and a TensorBoard run
``<sweep_dir>/tensorboard`` with the same numbers as scalars (step = job number), the table as text
and the chart as an image.

Speedup of a job = median iteration time of the DDP job(s) with the same other overrides (all
overrides except ``strategy``/``scheduler`` ones) divided by the job's median iteration time;
DDP jobs therefore show about 1.0, and jobs without a matching DDP job show nothing.

Iteration times are :class:`~lightning_pipedap.measure.SpeedupMonitor`'s steady-state medians
(``results.json``'s ``iteration_ms``: after a pipedap job's start-up of trace, profiling and trials), so a
speedup compares the schedules that ran, not their start-up.

Column ``installed`` names the schedule a pipedap job ran at the end (``results.json``'s
``pipedap.installed.name``). When measured plan selection installed ``torch_ddp`` (PyTorch's DDP reducer),
the Markdown table marks its speedup ``(torch_ddp: DDP's reducer)``: it is DDP against DDP. The CSV keeps
``speedup_vs_ddp`` numeric; its ``installed`` column says the same.

Column ``plan_selection`` says whether a pipedap job's measured plan selection finished
(``results.json``'s ``pipedap.plan_selection``). A job whose fit ended with selection unfinished
ran candidates under measurement, not a chosen plan: the Markdown table marks its speedup
``(selection unfinished)`` and says so under the table.
"""

from __future__ import annotations

import csv
import glob
import itertools
import json
import os
import statistics
import sys
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

#: Columns of the CSV and Markdown tables, in order.
COLUMNS = ("job", "strategy", "schedule", "installed", "plan_selection", "overrides", "processes", "val_acc",
           "iteration_ms", "speedup_vs_ddp", "energy_J_per_step", "energy_kind", "fit_s")
#: the measured-selection candidate that hands the model to PyTorch's DDP reducer (no pipedap engine)
DDP_REDUCER = "torch_ddp"
_STRATEGY_KEYS = ("strategy", "scheduler")


def expand_sweep(overrides: list[str], sweeper_params: Optional[dict[str, Any]] = None) -> list[list[str]]:
    """The per-job override lists of a basic-sweeper multirun (cartesian product, in Hydra's order:
    ``hydra.sweeper.params`` first, then the command line; a later override of the same key wins).

    Raises:
        ValueError: an override that Hydra cannot parse (message from Hydra's parser).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser  # noqa: PLC0415

    lines = [f"{k}={v}" for k, v in (sweeper_params or {}).items()] + list(overrides)
    parsed = OverridesParser.create().parse_overrides(lines)
    by_key: dict[str, list[str]] = {}
    for ov in parsed:
        key = ov.get_key_element()
        if ov.is_sweep_override():
            if ov.is_discrete_sweep():
                by_key[key] = [f"{key}={v}" for v in ov.sweep_string_iterator()]
            else:  # interval sweeps need a sweeper plugin (e.g. Optuna); nothing to enumerate
                by_key[key] = []
        else:
            by_key[key] = [f"{key}={ov.get_value_element_as_str()}"]
    choices = [v for v in by_key.values() if v]
    return [list(job) for job in itertools.product(*choices)]


class ValidateSweep(Callback):
    """Compose and validate every job of a basic-sweeper multirun before the first job starts.

    Exceptions in Hydra callbacks only become warnings, so a failure ends the process with
    ``SystemExit`` (exit status 1) and a message naming the job's overrides and the bad value.
    Sweeps run by another sweeper (e.g. Optuna) choose their jobs on the fly and are not checked here;
    each of their jobs is still validated before it starts.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra import compose  # noqa: PLC0415

        from lightning_pipedap.app.schema import validate  # noqa: PLC0415

        sweeper = config.hydra.get("sweeper", {})
        if not str(sweeper.get("_target_", "")).endswith("BasicSweeper"):
            return
        params = {str(k): str(v) for k, v in (sweeper.get("params") or {}).items()}
        jobs = expand_sweep(list(config.hydra.overrides.task), params)
        for num, job in enumerate(jobs):
            try:
                cfg = compose(config_name=config.hydra.job.config_name, overrides=job)
                validate(cfg)
            except Exception as e:  # noqa: BLE001 (reported with the job's overrides, then exit)
                msg = str(e).split("\nConfig search path")[0].strip()
                print(f"Error in sweep job #{num} ({' '.join(job)}): {msg}", file=sys.stderr, flush=True)
                raise SystemExit(1) from e


#: the folders a run writes into when its directory already holds an earlier run (``version_1``, ``version_2``, ...)
VERSION_PREFIX = "version_"


def version_of(path: str) -> int:
    """The ``N`` of a ``version_N`` folder name (0 for anything else: the job directory itself)."""
    name = os.path.basename(os.path.normpath(path))
    suffix = name[len(VERSION_PREFIX):] if name.startswith(VERSION_PREFIX) else ""
    return int(suffix) if suffix.isdigit() else 0


def latest_results_file(job_dir: str) -> Optional[str]:
    """The ``results.json`` of the latest run in ``job_dir``: its highest ``version_N/results.json`` (a run into a
    directory that already held one writes into a fresh ``version_N``, see ``app.train.run_dir``), else
    ``job_dir/results.json``; None when there is none."""
    found = [p for p in [os.path.join(job_dir, "results.json"),
                         *glob.glob(os.path.join(job_dir, VERSION_PREFIX + "*", "results.json"))] if os.path.isfile(p)]
    return max(found, key=lambda p: version_of(os.path.dirname(p))) if found else None


def read_results(sweep_dir: str) -> list[dict[str, Any]]:
    """The latest ``results.json`` of every job directory of a sweep (:func:`latest_results_file`: a sweep run again
    into the same directory is read, not the earlier one), sorted by job number."""
    rows = []
    for job_dir in sorted(glob.glob(os.path.join(sweep_dir, "*", ""))):
        path = latest_results_file(job_dir)
        if path is not None:
            with open(path) as f:
                rows.append(json.load(f))
    return sorted(rows, key=lambda r: r.get("job_num", 0))


def _is_strategy_override(ov: str) -> bool:
    key = ov.split("=", 1)[0].lstrip("+~")
    return key.split(".", 1)[0].split("@", 1)[0] in _STRATEGY_KEYS


def add_speedup(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add ``speedup_vs_ddp`` to each row (see the module docstring); ``None`` without a reference."""
    def context(r: dict[str, Any]) -> tuple[str, ...]:
        return tuple(sorted(o for o in r.get("overrides", []) if not _is_strategy_override(o)))

    refs: dict[tuple[str, ...], list[float]] = {}
    for r in rows:
        if r.get("strategy") == "ddp" and r.get("iteration_ms"):
            refs.setdefault(context(r), []).append(float(r["iteration_ms"]))
    for r in rows:
        ref = refs.get(context(r))
        it = r.get("iteration_ms")
        r["speedup_vs_ddp"] = statistics.median(ref) / float(it) if ref and it else None
    return rows


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows restricted to :data:`COLUMNS` (overrides joined by spaces)."""
    out = []
    for r in rows:
        out.append({
            "job": r.get("job_num"), "strategy": r.get("strategy"), "schedule": r.get("schedule") or "",
            "installed": ((r.get("pipedap") or {}).get("installed") or {}).get("name") or "",
            "plan_selection": (r.get("pipedap") or {}).get("plan_selection") or "",
            "overrides": " ".join(r.get("overrides", [])), "processes": r.get("processes"),
            "val_acc": r.get("val_acc"), "iteration_ms": r.get("iteration_ms"),
            "speedup_vs_ddp": r.get("speedup_vs_ddp"), "energy_J_per_step": r.get("energy_J_per_step"),
            "energy_kind": r.get("energy_kind") or "", "fit_s": r.get("fit_s"),
            "duplicate_of": r.get("duplicate_of"),  # (not a column: marks the job in the Markdown table)
            # (not a column: the job's directory held an earlier run, this one is in a version_N folder of it)
            "version_dir": r.get("output_dir") if r.get("earlier_run") else None,
        })
    return out


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _unfinished(row: dict[str, Any]) -> bool:
    """Whether a :func:`table_rows` row's fit ended with measured plan selection unfinished."""
    return str(row.get("plan_selection") or "").startswith("unfinished")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """A GitHub-flavoured Markdown table of :func:`table_rows` output; the speedup of a job whose plan
    selection was unfinished at the end of its fit is marked, with a note under the table."""
    def cell(r: dict[str, Any], c: str) -> str:
        v = _cell(r[c])
        if c == "speedup_vs_ddp" and v and _unfinished(r):
            v += " (selection unfinished)"
        elif c == "speedup_vs_ddp" and v and r.get("installed") == DDP_REDUCER:
            v += f" ({DDP_REDUCER}: DDP's reducer)"
        elif c == "job" and r.get("duplicate_of") is not None:
            v += f" (= #{r['duplicate_of']}, not run again)"
        return v.replace("|", "\\|")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r, c) for c in COLUMNS) + " |" for r in rows]
    flagged = [str(r["job"]) for r in rows if _unfinished(r)]
    if flagged:
        lines += ["", f"Job(s) {', '.join('#' + j for j in flagged)}: the fit ended during measured plan selection "
                      "and no plan was chosen for the schedule running at the end: without an earlier selection there "
                      "is no steady-state iteration time; after one (a drift re-plan) the iteration time is that of "
                      "the schedule before the re-plan, whose measurement steps are left out. Their speedup is not "
                      "that of a plan chosen for the end of the fit (train longer, or lower plan_trials / "
                      "trial_rounds)."]
    reducer = [str(r["job"]) for r in rows if r.get("installed") == DDP_REDUCER and r.get("speedup_vs_ddp") is not None]
    if reducer:
        lines += ["", f"Job(s) {', '.join('#' + j for j in reducer)}: measured plan selection installed "
                      f"`{DDP_REDUCER}`, PyTorch's own DDP reducer (no pipedap schedule), so the speedup compares DDP "
                      "with DDP."]
    again = [r for r in rows if r.get("version_dir")]
    if again:
        lines += ["", f"Job(s) {', '.join('#' + str(r['job']) for r in again)}: the job directory already held an "
                      "earlier run, kept as it was; this sweep's run is in "
                      + ", ".join(f"`{r['version_dir']}`" for r in again) + "."]
    return "\n".join(lines) + "\n"


def _bar_label(r: dict[str, Any]) -> str:
    """A bar's y label: ``#1 pipedap/optimal -> torch_ddp``; a job that was not run again says which job it repeats."""
    label = (f"#{r['job']} {r['strategy']}{'/' + r['schedule'] if r['schedule'] else ''}"
             + (f" -> {r['installed']}" if r.get("installed") and r["installed"] != r["schedule"] else ""))
    if r.get("duplicate_of") is not None:
        label += f" (same run as #{r['duplicate_of']})"
    return label


def _energy_title(rows: list[dict[str, Any]]) -> str:
    """The energy panel's title: says "estimated" (or "measured") as the summary's ``energy_kind`` does; with both
    kinds in one sweep each bar is labelled instead."""
    kinds = {r.get("energy_kind") or "" for r in rows if r.get("energy_J_per_step") is not None}
    if len(kinds) == 1 and "" not in kinds:
        return f"energy per step (J, {kinds.pop()})"
    return "energy per step (J)"


def bar_chart_figure(rows: list[dict[str, Any]]):
    """The sweep's bar chart as a matplotlib ``Figure`` (Agg canvas, no pyplot state): one panel per quantity
    (iteration time, speedup, energy when present).

    A pipedap job's label names the installed schedule when it differs from the configured one
    (``#1 pipedap/optimal -> torch_ddp``). A job the sweep did not run again (``duplicate_of``: e.g. ``strategy=ddp``
    under two ``scheduler`` values) is drawn hatched and pale and labelled ``(same run as #k)``: its numbers are job
    #k's. The energy panel says whether the energy was ``estimated`` or ``measured`` (each bar is labelled when a
    sweep has both)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    panels = [("iteration_ms", "median iteration time (ms)"), ("speedup_vs_ddp", "speedup vs DDP"),
              ("energy_J_per_step", _energy_title(rows))]
    panels = [p for p in panels if any(r[p[0]] is not None for r in rows)] or panels[:1]
    labels = [_bar_label(r) for r in rows]
    fig = Figure(figsize=(4.5 * len(panels), 0.5 * len(rows) + 2), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)
    mixed_energy = _energy_title(rows) == "energy per step (J)"  # (no single kind to name in the title)
    for ax, (key, title) in zip(axes[0], panels):
        vals = [r[key] if r[key] is not None else 0.0 for r in rows]
        bars = ax.barh(range(len(rows)), vals, color=["#888888" if r["strategy"] == "ddp" else "#1f77b4" for r in rows])
        for bar, r in zip(bars, rows):
            if r.get("duplicate_of") is not None:
                bar.set_hatch("///")
                bar.set_alpha(0.45)
                bar.set_edgecolor("black")
            if key == "energy_J_per_step" and mixed_energy and r[key] is not None and r.get("energy_kind"):
                ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {r['energy_kind']}", va="center",
                        fontsize=7)
        ax.set_yticks(range(len(rows)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        if key == "speedup_vs_ddp":
            ax.axvline(1.0, color="k", lw=0.8, ls="--")
    fig.tight_layout()
    return fig


def bar_chart(rows: list[dict[str, Any]], path: str) -> None:
    """Write :func:`bar_chart_figure` of ``rows`` to the PNG file ``path``."""
    fig = bar_chart_figure(rows)
    fig.savefig(path, dpi=100)


def write_summary(sweep_dir: str, tensorboard: bool = True) -> Optional[dict[str, str]]:
    """Write the sweep summary files into ``sweep_dir``; return their paths, or ``None`` when no job
    wrote ``results.json``."""
    rows = read_results(sweep_dir)
    if not rows:
        return None
    rows = table_rows(add_speedup(rows))
    paths = {k: os.path.join(sweep_dir, f"sweep_summary.{k}") for k in ("csv", "md", "png")}
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    md = markdown_table(rows)
    with open(paths["md"], "w") as f:
        f.write(md)
    bar_chart(rows, paths["png"])
    if tensorboard:
        paths["tensorboard"] = _write_tensorboard(rows, md, paths["png"], os.path.join(sweep_dir, "tensorboard"))
    return paths


def _write_tensorboard(rows: list[dict[str, Any]], md: str, png: str, logdir: str) -> str:
    import matplotlib.image as mpimg  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415

    with SummaryWriter(logdir) as w:
        for r in rows:
            for key in ("iteration_ms", "speedup_vs_ddp", "energy_J_per_step", "val_acc"):
                if r[key] is not None:
                    w.add_scalar(f"sweep/{key}", float(r[key]), global_step=int(r["job"]))
        w.add_text("sweep/table", md)
        img = mpimg.imread(png)[..., :3]
        w.add_image("sweep/bar_chart", np.ascontiguousarray(img), dataformats="HWC")
    return logdir


class SweepSummary(Callback):
    """Write the sweep summary (see :func:`write_summary`) at the end of a multirun.

    Args:
        tensorboard: also write the TensorBoard run ``<sweep_dir>/tensorboard``.
    """

    def __init__(self, tensorboard: bool = True) -> None:
        self.tensorboard = tensorboard
        self._sweep_dir: Optional[str] = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._sweep_dir = os.path.abspath(str(config.hydra.sweep.dir))  # resolve ${now:...} once

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = self._sweep_dir or os.path.abspath(str(config.hydra.sweep.dir))
        paths = write_summary(sweep_dir, self.tensorboard)
        if paths is None:
            print(f"sweep summary: no results.json under {sweep_dir}", flush=True)
            return
        print(f"sweep summary: {paths['md']}\n{open(paths['md']).read()}", flush=True)
