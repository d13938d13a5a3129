"""Entry point: ``pipedap-train`` or ``python -m lightning_pipedap.app.train`` (Hydra app).

With no arguments it trains the digits CNN on scikit-learn's digits with ``strategy=pipedap``
(schedule ``optimal``) on 2 CPU processes and prints a short summary. Everything is created from the
config in ``lightning_pipedap/conf/`` (package data) with ``hydra.utils.instantiate``; see ``conf/train.yaml``.

Examples::

    pipedap-train                                   # the default experiment
    pipedap-train strategy=ddp                      # the DDP baseline
    pipedap-train -m strategy=ddp,pipedap scheduler=allreduce,dear trainer.max_epochs=2

Each job writes ``results.json`` (metrics, median iteration time, energy, paths) in its output
directory; a multirun also gets ``sweep_summary.{csv,md,png}`` in the sweep directory. A run into a
directory that already holds one leaves it as it is and writes into a fresh ``version_<N>`` folder of it
(said in the log and the summary; :func:`run_dir`).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.loggers import TensorBoardLogger
from omegaconf import DictConfig, OmegaConf

import lightning_pipedap  # noqa: F401  (registers "pipedap" and "pipedap_spawn" with Lightning)
from lightning_pipedap.app.launch import (
    distributed_env, externally_launched, in_multirun, named_strategy_for, start_method_for,
)
from lightning_pipedap.app.sweep import VERSION_PREFIX, latest_results_file
from lightning_pipedap.app.schema import ConfigError, register_configs, validate
import lightning_pipedap.strategy.messages as M
from lightning_pipedap import compat
from lightning_pipedap.strategy.controller import describe_startup, steps_text

#: ``lightning_pipedap/conf/`` (package data), as an absolute path computed from this file: Hydra would
#: read a relative path as a package path when the app runs as the ``pipedap-train`` console script.
#: The same from a checkout, an editable install, ``pip install .`` or a wheel.
CONFIG_PATH = str(Path(__file__).resolve().parents[1] / "conf")
RESULTS_FILE = "results.json"
MEASURE_FILE = "measure_summary.json"

register_configs()


class CloseProcessGroup(pl.Callback):
    """Spawned ranks: leave together and destroy the default process group at the end of ``fit``.

    Without it a rank that exits while its peer's gloo threads still talk to it can abort in the C++
    destructors (``terminate called without an active exception``), and a job that trained fine fails.
    """

    pipedap_reads_model = False

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning_pipedap.engine import collectives as C  # noqa: PLC0415

        if stage == "fit" and C.is_initialized():
            C.barrier()
            C.shutdown()


#: a rank's own log file in the job directory: the name Lightning gives Hydra's job log of a popen rank
#: (``hydra.job.name=train_ddp_process_<local rank>``), used for spawned ranks too so one run and a sweep agree
RANK_LOG_FILE = "train_ddp_process_{rank}.log"


class LogToJobDir(pl.Callback):
    """Spawned ranks (multirun): write the ``lightning_pipedap`` log to the job's log file too.

    Hydra configures logging in its own process only; a rank started with ``spawn`` is a fresh
    interpreter. Rank 0 appends to the job's ``<task>.log``, rank r to :data:`RANK_LOG_FILE`
    (``train_ddp_process_<r>.log``, as in a single run), which gets rank r's own messages (its set-up line,
    warnings and errors, ``[rank r]``-prefixed: :mod:`lightning_pipedap.strategy.messages`).
    """

    pipedap_reads_model = False

    def __init__(self, log_dir: str, task: str) -> None:
        self.log_dir, self.task = log_dir, task
        self._handler: Optional[logging.Handler] = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._handler is not None:
            return
        rank = trainer.global_rank
        name = f"{self.task}.log" if rank == 0 else RANK_LOG_FILE.format(rank=rank)
        os.makedirs(self.log_dir, exist_ok=True)
        self._handler = logging.FileHandler(os.path.join(self.log_dir, name), mode="a")
        self._handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        log = logging.getLogger("lightning_pipedap")
        log.addHandler(self._handler)
        log.setLevel(logging.INFO)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._handler is not None:
            logging.getLogger("lightning_pipedap").removeHandler(self._handler)
            self._handler.close()
            self._handler = None


def _instantiate_group(node: Optional[DictConfig]) -> list[Any]:
    """Instantiate every entry with a ``_target_`` of a keyed group (callbacks, logger)."""
    if not node:
        return []
    return [hydra.utils.instantiate(v) for v in node.values() if isinstance(v, DictConfig) and "_target_" in v]


def build_strategy(cfg: DictConfig, multirun: bool) -> Any:
    """The Trainer's ``strategy`` argument: an instance from ``cfg.strategy._target_`` (with the
    start method adapted under multirun, see :mod:`lightning_pipedap.app.launch`), or a registry name."""
    node = cfg.strategy
    if "_target_" not in node:
        return named_strategy_for(node.name, multirun)
    kwargs = {}
    if "start_method" in node:
        kwargs["start_method"] = start_method_for(node.start_method, multirun)
    return hydra.utils.instantiate(node, **kwargs)


def strategy_label(cfg: DictConfig) -> tuple[str, Optional[str]]:
    """``(name, schedule)`` for summaries: ``("ddp", None)``, ``("pipedap", "dear")``, ``("auto", None)``."""
    node = cfg.strategy
    if "_target_" not in node:
        return str(node.name), None
    target = str(node._target_)
    if target.endswith("PipeDAPStrategy"):
        return "pipedap", str(node.schedule)
    if target.endswith("DDPStrategy"):
        return "ddp", None
    return target.rsplit(".", 1)[-1], None


def effective_key(cfg: DictConfig, output_dir: str) -> str:
    """A hash of what the job runs: the resolved config without ``paths``, with the job's own directory
    masked, and without the ``scheduler`` group when the strategy is not pipedap (it does not apply)."""
    c = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(c, dict)
    for k in ("paths", "hydra", "print_summary"):
        c.pop(k, None)
    if strategy_label(cfg)[0] != "pipedap":
        c.pop("scheduler", None)
    text = json.dumps(c, sort_keys=True, default=str).replace(output_dir, "<job dir>")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def earlier_same_job(key: str, output_dir: str, job_num: int) -> Optional[dict[str, Any]]:
    """The ``results.json`` of an earlier job of the same sweep (a sibling directory of the job directory
    ``output_dir``, lower job number; its latest run: :func:`~lightning_pipedap.app.sweep.latest_results_file`)
    whose :func:`effective_key` is ``key``; None when there is none."""
    found = []
    for job_dir in glob.glob(os.path.join(os.path.dirname(output_dir), "*", "")):
        path = latest_results_file(job_dir)
        if path is None:
            continue
        res = _read_json(path)
        if (res.get("effective_key") == key and res.get("duplicate_of") is None
                and res.get("job_num", job_num) < job_num):
            found.append(res)
    return min(found, key=lambda r: r["job_num"]) if found else None


#: what in a job directory shows that a run already wrote there (files, or folders that are not empty)
EARLIER_RUN_MARKERS = (RESULTS_FILE, MEASURE_FILE, "tensorboard", "csv", "checkpoints", "timeline")
#: the directory the launching process chose for this run, for the ranks Lightning's popen launcher starts (they run
#: this app again with the same hydra.run.dir, after rank 0 may have written into the fresh folder)
RUN_DIR_ENV = "PIPEDAP_RUN_DIR"


def earlier_run(job_dir: str) -> list[str]:
    """What of :data:`EARLIER_RUN_MARKERS` ``job_dir`` holds (an earlier run wrote there); [] for a fresh directory
    (Hydra's own ``.hydra/`` and ``<job>.log`` do not count)."""
    found = []
    for name in EARLIER_RUN_MARKERS:
        path = os.path.join(job_dir, name)
        if os.path.isfile(path) or (os.path.isdir(path) and os.listdir(path)):
            found.append(name)
    return found


def run_dir(job_dir: str) -> tuple[str, Optional[str]]:
    """Where this run writes (results.json, measure_summary.json, TensorBoard, checkpoints, timelines), and why when
    that is not the job directory.

    A job directory that already holds a run (:func:`earlier_run`: ``pipedap-train hydra.run.dir=X`` twice, or a
    sweep run again into the same ``hydra.sweep.dir``) is left as it is, and this run writes into a fresh
    ``<job dir>/version_<N>`` (the first unused ``N``), as Lightning's loggers number their versions; the reason is
    returned for the log and the summary. The ranks started by Lightning's popen launcher take the launching
    process's choice (:data:`RUN_DIR_ENV`)."""
    inherited = os.environ.get(RUN_DIR_ENV)
    if inherited and externally_launched() and os.path.dirname(inherited) == job_dir:
        return inherited, None
    found = earlier_run(job_dir)
    if not found:
        return job_dir, None
    n = 1
    while os.path.exists(os.path.join(job_dir, f"{VERSION_PREFIX}{n}")):
        n += 1
    version = os.path.join(job_dir, f"{VERSION_PREFIX}{n}")
    return version, (f"{job_dir} already holds a run ({', '.join(found)}): its results are kept, and this run writes "
                     f"its results, TensorBoard logs and checkpoints into {version}; Hydra's own log files there "
                     f"(train.log, train_ddp_process_<r>.log, .hydra/) get this run's lines appended (Hydra opens them "
                     "before the app runs): for separate logs use another directory (hydra.run.dir=<dir>, or "
                     "hydra.sweep.dir=<dir> for a sweep)")


def _scalar_metrics(trainer: pl.Trainer) -> dict[str, float]:
    out = {}
    for k, v in trainer.callback_metrics.items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            out[k] = float(v)
        elif isinstance(v, (int, float)):
            out[k] = float(v)
    return out


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def collect_results(cfg: DictConfig, trainer: pl.Trainer, output_dir: str, fit_s: float) -> dict[str, Any]:
    """The job's results (written to ``results.json``): metrics from ``trainer.callback_metrics``,
    iteration time and energy from the measure callbacks' ``measure_summary.json`` (when present).

    ``iteration_ms`` is :class:`~lightning_pipedap.measure.SpeedupMonitor`'s median over steady-state steps
    (ms): ``iteration_steps`` steps from step ``iteration_from_step`` of the fit (pipedap: after its
    ``startup_steps`` start-up steps, ``startup_s`` seconds, and 2 settling steps; ``warmup_steps`` in any case;
    ``replan_steps`` steps of a drift re-plan left out); None with ``iteration_note``
    saying why when the fit ended before steady state. ``startup_cost_s`` (:func:`startup_cost_s`) is what the
    start-up cost over running its steps at the steady-state iteration time (s). ``plan_cache``: ``"hit"``,
    ``"miss"``, ``"off"`` or ``"stale (re-selected)"`` for pipedap (whether the plan came from the plan cache;
    ``pipedap.plan_cache_entry`` says which), else None. ``speedup_vs_no_overlap`` and
    ``prediction_error_pct`` (with ``no_overlap_time_s`` and ``predicted_iteration_s``) compare the steady-state
    median with the strategy's predictions; the summary flags them when surprising (:func:`surprises`)."""
    metrics = _scalar_metrics(trainer)
    measure = _read_json(os.path.join(output_dir, MEASURE_FILE))
    name, schedule = strategy_label(cfg)
    hc = HydraConfig.get() if HydraConfig.initialized() else None
    tb_dirs = [lg.log_dir for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
    it_s = measure.get("iteration_s")
    res: dict[str, Any] = {
        "job_num": _job_num(),
        "effective_key": effective_key(cfg, output_dir),
        "duplicate_of": None,
        "overrides": list(hc.overrides.task) if hc is not None else [],
        "strategy": name,
        "schedule": schedule,
        "compression": (cfg.strategy.get("compression") if name == "pipedap" else None),
        "model": str(cfg.model.get("net", {}).get("_target_", cfg.model._target_)).rsplit(".", 1)[-1],
        "processes": int(trainer.world_size),
        "nodes": int(getattr(trainer, "num_nodes", 1) or 1),
        "accelerator": str(cfg.trainer.get("accelerator", "")),
        "fit_s": fit_s,
        "val_acc": metrics.get("val/acc"),
        "val_loss": metrics.get("val/loss"),
        "iteration_ms": None if it_s is None else 1000.0 * float(it_s),
        # which steps the median covers (SpeedupMonitor: steady state only, after the strategy's start-up)
        "iteration_steps": measure.get("iteration_steps"),
        "iteration_from_step": measure.get("steady_from_step"),
        "iteration_note": measure.get("iteration_note"),
        "warmup_steps": measure.get("warmup_steps"),
        "startup_steps": measure.get("startup_steps"),
        "startup_s": measure.get("startup_s"),
        "replan_steps": measure.get("replan_steps"),
        "startup_cost_s": startup_cost_s(measure.get("startup_s"), measure.get("startup_steps"), it_s),
        "plan_cache": (trainer.strategy.what_ran().get("plan_cache") if hasattr(trainer.strategy, "what_ran")
                       else None),
        # False: the fit ended with NaN/inf in its parameters (pipedap; the process exits with 3)
        "final_parameters_finite": (trainer.strategy.what_ran().get("final_parameters_finite")
                                    if hasattr(trainer.strategy, "what_ran") else None),
        "throughput_samples_per_s": measure.get("throughput_samples_per_s"),
        "energy_J_per_step": measure.get("energy_J_per_step"),
        "energy_J_per_sample": measure.get("energy_J_per_sample"),
        "energy_total_J": measure.get("energy_total_J"),
        "energy_kind": measure.get("energy_kind"),
        "speedup_vs_reference": None,
        # the steady-state median against the strategy's predictions (SpeedupMonitor; pipedap only)
        **{k: measure.get(k) for k in COMPARISON_KEYS},
        "host_cpus": os.cpu_count(),
        "metrics": metrics,
        "output_dir": output_dir,
        "tensorboard_dir": tb_dirs[0] if tb_dirs else None,
        # pipedap: the installed schedule, the measured candidates, compression actually applied
        "pipedap": trainer.strategy.what_ran() if hasattr(trainer.strategy, "what_ran") else None,
    }
    ref_file = OmegaConf.select(cfg, "callbacks.speedup.reference_file")
    if ref_file and res["iteration_ms"]:
        ref_s = _read_json(str(ref_file)).get("iteration_s")
        if ref_s:
            res["speedup_vs_reference"] = 1000.0 * float(ref_s) / res["iteration_ms"]
    return res


#: what SpeedupMonitor writes when the strategy predicts its step
#: (:func:`~lightning_pipedap.measure.speedup.model_comparison`)
COMPARISON_KEYS = ("no_overlap_time_s", "speedup_vs_no_overlap", "predicted_iteration_s", "prediction_error_pct")
#: the summary flags a steady-state iteration time off the planner's prediction by more than this (%)
PREDICTION_ERROR_FLAG_PCT = 25.0


def _contention_text(res: dict[str, Any]) -> str:
    """Why compute may have run slower than profiled, with what the run knows: the processes per CPU core, the
    measured slowdown of compute while communication runs."""
    parts = []
    cpus = res.get("host_cpus")
    if str(res.get("accelerator")) == "cpu" and cpus:
        parts.append(f"{res['processes']} training processes and their communication threads share {cpus} CPU "
                     f"core{'s' if cpus != 1 else ''} with whatever else runs on the machine")
    sigma = ((res.get("pipedap") or {}).get("contention") or {}).get("compute_slowdown")
    if sigma:
        parts.append(f"the contention benchmark measured compute {sigma:.0%} slower while communication runs")
    return "; ".join(parts)


def surprises(res: dict[str, Any]) -> list[str]:
    """The numbers of ``res`` a reader would not expect, each with the reason the run can give: a speed-up over
    the no-overlap reference below 1.0, and a steady-state iteration time more than
    :data:`PREDICTION_ERROR_FLAG_PCT` % off the planner's prediction. Empty when nothing is surprising."""
    out: list[str] = []
    ran = res.get("pipedap") or {}
    it_ms = res.get("iteration_ms")
    compute_s = ran.get("profiled_compute_s")
    no_overlap_s = res.get("no_overlap_time_s") or ran.get("no_overlap_time_s")
    comm_s = None if compute_s is None or no_overlap_s is None else max(0.0, no_overlap_s - compute_s)
    contention = _contention_text(res)
    speedup = res.get("speedup_vs_no_overlap")
    if speedup is not None and speedup < 1.0 and it_ms and no_overlap_s:
        text = (f"speedup vs no overlap {speedup:.2f} (< 1.0): the step ({it_ms:.1f} ms) is slower than the "
                f"no-overlap reference ({1e3 * no_overlap_s:.1f} ms), which is not a measured run but a prediction")
        if comm_s is not None:
            share = comm_s / no_overlap_s if no_overlap_s else 0.0
            text += (f": compute + update of the profiling steps ({1e3 * compute_s:.1f} ms) plus the α-β model's "
                     f"all-reduce of every bucket ({1e3 * comm_s:.1f} ms, {share:.0%} of it)")
            if share < 0.10:
                where = " (on one machine, over loopback)" if res.get("nodes", 1) == 1 else ""
                text += (f". With communication a few % of the step{where} overlap can save at most that, and any "
                         "slowdown of compute outweighs it")
        text += (". A step slower than compute and communication in series means compute ran slower than in the "
                 "profiling steps")
        text += f" ({contention})" if contention else ""
        out.append(text)
    err = res.get("prediction_error_pct")
    predicted_s = res.get("predicted_iteration_s") or ran.get("predicted_iteration_s")
    if err is not None and abs(err) > PREDICTION_ERROR_FLAG_PCT and predicted_s and it_ms:
        text = (f"prediction error {err:+.0f}% (more than {PREDICTION_ERROR_FLAG_PCT:.0f}%): measured {it_ms:.1f} ms "
                f"per step, the plan predicted {1e3 * predicted_s:.1f} ms from the profiling steps and the α-β model")
        origin = ran.get("cost_model_origin")
        gap_s = 1e-3 * it_ms - predicted_s
        if err > 0 and comm_s is not None and gap_s > comm_s:
            text += (f". The gap ({1e3 * gap_s:.1f} ms) is more than all the communication the model predicts "
                     f"({1e3 * comm_s:.1f} ms), so exposed communication cannot explain it: compute ran slower than "
                     "in the profiling steps")
            text += f" ({contention})" if contention else ""
        elif err > 0:
            text += (". Communication was slower, or less hidden, than the α-β model predicts"
                     + (f" ({origin}; fitted on an idle link)" if origin else "")
                     + (f", or compute ran slower than profiled ({contention})" if contention else ""))
        else:
            text += (". The step ran faster than predicted: the profiling steps (sync mode) were slower than steady "
                     "state, or the α-β model overestimates communication" + (f" ({origin})" if origin else ""))
        out.append(text)
    return out


#: the training-run length the summary sets the start-up cost against (s): issue-tracker goal "under 10% of
#: a 5-minute run"
REFERENCE_RUN_S = 300.0


def startup_cost_s(startup_s: Any, startup_steps: Any, iteration_s: Any) -> Optional[float]:
    """Seconds the strategy's start-up (trace, profiling, α-β fit, contention benchmark, trials) cost over
    running the same number of steps at the steady-state iteration time: ``startup_s - startup_steps ·
    iteration_s`` (s; may be slightly negative on a noisy machine). None when a value is missing."""
    if startup_s is None or startup_steps is None or iteration_s is None:
        return None
    return float(startup_s) - int(startup_steps) * float(iteration_s)


def _fmt(v: Any, spec: str, unit: str = "") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:{spec}}{unit}"


def iteration_text(res: dict[str, Any]) -> str:
    """The summary's iteration time: the median (ms), which steps it covers, throughput; or why there is none
    (the fit ended before steady state)."""
    if res.get("iteration_ms") is None:
        if res.get("iteration_note"):
            return f"n/a: {res['iteration_note']}; no steady-state time (train longer)"
        return "n/a"
    it = f"{res['iteration_ms']:.2f} ms median"
    n, first = res.get("iteration_steps"), res.get("iteration_from_step")
    if n is not None and res.get("startup_steps") is not None and first:
        cost = res.get("startup_cost_s")
        it += (f" of {n} steady-state steps (from step {first}, after {res['startup_steps']} start-up steps in "
               f"{_fmt(res.get('startup_s'), '.1f', ' s')}"
               + ("" if cost is None else f", {cost:+.1f} s over steady state"
                  + (f" = {cost / res['fit_s']:.1%} of this fit" if res.get("fit_s") else "")
                  + f", {cost / REFERENCE_RUN_S:.1%} of a {REFERENCE_RUN_S / 60:.0f}-minute run")
               + (f"; {res['replan_steps']} steps of a drift re-plan left out" if res.get("replan_steps") else "")
               + ")")
    elif n is not None:
        it += f" of {n} steps (after {res.get('warmup_steps', '?')} warm-up steps)"
    if res.get("throughput_samples_per_s"):
        it += f", {res['throughput_samples_per_s']:.0f} samples/s"
    return it


def _ms(seconds: Optional[float]) -> str:
    return _fmt(seconds and 1e3 * seconds, ".1f", " ms")


def _deciding_s(c: dict[str, Any]) -> Optional[float]:
    """A candidate's time the choice was made on (s): ``deciding_s``, else ``measured_s`` (older results)."""
    return c.get("deciding_s", c.get("measured_s"))


def candidates_text(cands: list[dict[str, Any]]) -> str:
    """The measured candidates with the numbers the choice was made on (``deciding_s``; results without it:
    ``measured_s``), the chosen one marked; after a confirmation also which rounds decided and each
    candidate's median over all its windows (``measured_s``), which can order them differently."""
    text = ", ".join(f"{c['name']} {_ms(_deciding_s(c))}" + (" (chosen)" if c["chosen"] else "") for c in cands)
    confirmed = [c["name"] for c in cands if c.get("decided_in") == "confirmation"]
    if confirmed:
        text += (f"; decided on the confirmation rounds of {' and '.join(confirmed)} (the others on the first pass); "
                 "median of all windows: " + ", ".join(f"{c['name']} {_ms(c.get('measured_s'))}" for c in cands))
    return text


#: below this share of a step, the summary says there is little communication to hide here
LITTLE_COMMUNICATION = 0.2
#: a command that shows where the gain appears, without a cluster or root
WHAT_IF_COMMAND = "pipedap-simulate --profile resnet50 --world-size 8 --alpha 0.0005 --bandwidth 0.125"  # (1 Gbit/s)


def communication_text(comm: dict[str, float], processes: int) -> str:
    """The summary's line on what communication weighs here (measured while profiling), and, when it is little,
    where the gain appears instead."""
    line = (f"communication   {comm['busy_s'] * 1e3:.1f} ms busy per step beside {comm['compute_s'] * 1e3:.1f} ms of "
            f"forward + backward ({comm['share']:.0%} of the two), measured while profiling")
    if comm["share"] < LITTLE_COMMUNICATION:
        line += (f": with {processes} processes on one machine there is little communication to hide, so pipedap "
                 "cannot be much faster than DDP here (its trials keep DDP's own reducer when nothing is faster); "
                 f"the gain appears where communication is a large share of a step (slower links, more workers): "
                 f"`{WHAT_IF_COMMAND}` predicts it from a published profile, BENCHMARKS.md has the measured testbed")
    return line


def plan_cache_text(ran: dict[str, Any]) -> str:
    """The plan cache's part in a fit (``what_ran()``'s ``plan_cache`` and ``plan_cache_entry``): ``"hit: <file>
    (selected <date>, <candidate>, 2.4 ms in its trial)"``, ``"miss"``, ``"off"``, ``"stale (re-selected)"``."""
    status, entry = ran.get("plan_cache"), ran.get("plan_cache_entry")
    if status == "hit" and entry:
        return (f"hit: {entry.get('path')} (selected {entry.get('selected_at') or '?'}, {entry.get('chosen')}, "
                f"{_ms(entry.get('measured_s'))} in its trial)")
    return str(status)


def format_summary(res: dict[str, Any]) -> str:
    """A short human-readable end-of-run summary of ``res`` (see :func:`collect_results`)."""
    sched = f" (schedule {res['schedule']}" if res.get("schedule") else ""
    ran = res.get("pipedap") or {}
    unfinished = ran.get("plan_selection_status") == "unfinished"
    if sched and ran.get("single_process"):
        sched += ": not used, one process has nothing to synchronise"
    elif sched and unfinished:  # no candidate was chosen: say what ran instead of "installed"
        sched += f" -> plan selection {ran['plan_selection']}, {ran.get('ran_at_end') or 'nothing'} ran at the end"
    elif sched and ran.get("installed"):
        sched += f" -> installed {ran['installed']['name']}"
        sched += f", {ran['buckets']} buckets" if ran.get("buckets") is not None else " (DDP's reducer)"
    if sched and ran.get("wire_dtype") not in (None, "fp32"):
        sched += f", wire {ran['wire_dtype']}"
        if ran.get("buckets") is not None and ran.get("installed"):
            sched += f" on {ran.get('wire16_buckets', '?')} of {ran['buckets']} buckets"
    if sched:
        if res.get("compression"):
            sched += f", compression {res['compression']} on {ran.get('compressed_buckets', '?')} of " \
                     f"{ran.get('buckets', '?')} buckets"
        sched += ")"
    if res.get("speedup_vs_reference") is not None:
        speed = f"{res['speedup_vs_reference']:.3f}x vs the reference run"
        if (ran.get("installed") or {}).get("name") == "torch_ddp" and not unfinished:
            speed += " (installed torch_ddp: DDP's reducer, not a pipedap schedule)"
    else:
        speed = "n/a in a single run: sweep `-m strategy=ddp,pipedap` for speedup vs DDP"
    energy = "n/a (callbacks.energy not enabled)"
    if res.get("energy_J_per_step") is not None:
        per_sample = _fmt(res.get("energy_J_per_sample"), ".3g")
        energy = f"{res['energy_J_per_step']:.3g} J/step, {per_sample} J/sample ({res.get('energy_kind')})"
    it = iteration_text(res)
    lines = [
        f"strategy        {res['strategy']}{sched}, {res['processes']} process(es), {res['accelerator']}",
        f"val/acc         {_fmt(res.get('val_acc'), '.4f')}   val/loss {_fmt(res.get('val_loss'), '.4f')}",
        f"iteration time  {it}",
        *([f"compression     {ran['compression_note']}"] if ran.get("compression_note") else []),
        *([f"plan selection  {ran['plan_selection']}: the fit ended before a candidate was chosen ("
           f"{ran.get('ran_at_end')} ran last)"
           + (", so the iteration time is that of the schedule before the re-plan (the re-plan's profiling and "
              "trial steps are left out)" if res.get("iteration_ms") is not None else "")
           + "; train longer, or lower plan_trials / trial_rounds"] if unfinished else []),
        *([("candidates      " if not unfinished else "earlier choice  ") + candidates_text(ran["candidates"])]
          if ran.get("candidates") else []),
        *([f"why             {'; '.join(ran['selection_notes'])}"]
          if ran.get("candidates") and ran.get("selection_notes") else []),
        *(["measured so far " + ", ".join(f"{c['name']} {_fmt(c['measured_s'] and 1e3 * c['measured_s'], '.1f', ' ms')}"
                                           for c in ran["unfinished_candidates"] if c.get("measured_s") is not None)]
          if unfinished and any(c.get("measured_s") is not None for c in ran.get("unfinished_candidates") or [])
          else []),
        *([f"start-up        {ran['startup']['total_steps']} steps, {ran['startup']['total_s']:.1f} s to steady state "
           f"({describe_startup(ran['startup'], 1)})"] if ran.get("startup") else []),
        *([f"cost model      {ran['cost_model_origin']}"] if ran.get("cost_model_origin") else []),
        *([communication_text(ran["communication"], res["processes"])] if ran.get("communication") else []),
        *([f"plan cache      {plan_cache_text(ran)}"] if ran.get("plan_cache") else []),
        f"speedup         {speed}",
        *([f"parameters      NOT FINITE at the end of the fit: {ran['final_parameters_note']} (exit code 3)"]
          if ran.get("final_parameters_finite") is False else []),
        *[f"check           {text}" for text in surprises(res)],
        f"energy          {energy}",
        f"fit time        {res['fit_s']:.1f} s",
        f"TensorBoard     tensorboard --logdir {res.get('tensorboard_dir') or res['output_dir']}",
        f"results         {os.path.join(res['output_dir'], RESULTS_FILE)}",
        *([f"output dir      {res['earlier_run']}"] if res.get("earlier_run") else []),
    ]
    bar = "-" * 72
    return "\n".join([bar, f"pipedap-train summary ({res['model']})", bar, *lines, bar])


def lookup_metric(res: dict[str, Any], name: Optional[str]) -> Optional[float]:
    """Value of ``name`` in the results (top level first, then the logged metrics), or ``None``."""
    if not name:
        return None
    v = res.get(name, res["metrics"].get(name))
    return None if v is None else float(v)


def _job_num() -> int:
    hc = HydraConfig.get() if HydraConfig.initialized() else None
    return int(hc.job.num) if hc is not None and hc.job.get("num") is not None else 0


def train(cfg: DictConfig) -> dict[str, Any]:
    """Validate ``cfg``, build everything with ``hydra.utils.instantiate``, fit, and (on global rank 0)
    write ``results.json`` and print the summary. Returns the results dict (``{}`` on other ranks).

    Raises:
        ValueError: an invalid config value (before any process is started).
    """
    validate(cfg)
    M.route_console_handlers()  # Hydra's console handler: pipedap's lines never land inside a progress bar's line
    multirun = in_multirun()
    job_dir = os.path.abspath(str(cfg.paths.output_dir))
    output_dir, again = run_dir(job_dir)  # (a directory that holds a run already: a fresh version_N in it)
    if again:
        logging.getLogger("lightning_pipedap").warning(f"pipedap-train: {again}")
        cfg.paths.output_dir = output_dir  # (everything the app writes follows ${paths.output_dir})
    if multirun:  # a sweep runs each distinct job once (`strategy=ddp scheduler=dear` is `strategy=ddp`)
        same = earlier_same_job(effective_key(cfg, output_dir), job_dir, _job_num())
        if same is not None:
            hc = HydraConfig.get()
            res = dict(same, job_num=_job_num(), duplicate_of=same["job_num"], output_dir=output_dir,
                       overrides=list(hc.overrides.task), earlier_run=again)
            os.makedirs(output_dir, exist_ok=True)
            with open(os.path.join(output_dir, RESULTS_FILE), "w") as f:
                json.dump(res, f, indent=2)
            logging.getLogger("lightning_pipedap").info(
                f"job #{res['job_num']} ({' '.join(res['overrides'])}) runs what job #{same['job_num']} ran "
                "(the options that differ do not apply to this strategy): not run again; results.json refers "
                "to it")
            return res
    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)

    datamodule = hydra.utils.instantiate(cfg.data)
    model = hydra.utils.instantiate(cfg.model)
    callbacks = _instantiate_group(cfg.get("callbacks"))
    loggers = _instantiate_group(cfg.get("logger"))
    strategy = build_strategy(cfg, multirun)
    if compat.start_method(strategy) == "spawn":
        callbacks.append(CloseProcessGroup())
        if HydraConfig.initialized():
            hc = HydraConfig.get()
            callbacks.append(LogToJobDir(str(hc.runtime.output_dir), str(hc.job.name)))
    trainer: pl.Trainer = hydra.utils.instantiate(cfg.trainer, strategy=strategy, callbacks=callbacks,
                                                  logger=loggers or False)

    config = OmegaConf.to_container(cfg, resolve=True)
    for lg in trainer.loggers:  # the job's full config as hyper-parameters (hparams.yaml, TensorBoard's HPARAMS tab)
        lg.log_hyperparams({k: v for k, v in config.items() if k not in ("paths", "hydra")})
    with distributed_env():
        launching = not externally_launched()
        if launching:
            os.environ[RUN_DIR_ENV] = output_dir  # (the ranks the popen launcher starts write where this one does)
        try:
            t0 = time.perf_counter()
            trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
            fit_s = time.perf_counter() - t0
        finally:
            if launching:
                os.environ.pop(RUN_DIR_ENV, None)

    if trainer.global_rank != 0:
        return {}
    res = collect_results(cfg, trainer, output_dir, fit_s)
    res["earlier_run"] = again
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, RESULTS_FILE), "w") as f:
        json.dump(res, f, indent=2)
    if res.get("pipedap"):
        for lg in trainer.loggers:  # TensorBoard's TEXT tab: what ran, next to the curves
            if isinstance(lg, TensorBoardLogger):
                lg.experiment.add_text("pipedap/what_ran", what_ran_markdown(res["pipedap"]), trainer.global_step)
                lg.experiment.flush()
    if cfg.get("print_summary", True):
        print(format_summary(res), flush=True)
    return res


def what_ran_markdown(ran: dict[str, Any]) -> str:
    """Markdown of the strategy's ``what_ran()``: the installed schedule, the measured candidates (ms: the median
    the choice was made on, which rounds decided, the median of all windows) and the time to steady state."""
    inst = ran.get("installed") or {}
    lines = [f"**configured** `{ran.get('schedule')}`, **installed** `{inst.get('name', 'none')}`"
             + (f", {ran['buckets']} buckets ({ran.get('compressed_buckets', 0)} compressed)"
                if ran.get("buckets") is not None else "")]
    if ran.get("compression_note"):
        lines.append(f"compression: {ran['compression_note']}")
    if ran.get("plan_selection"):
        lines.append(f"plan selection: {ran['plan_selection']}"
                     + (f"; `{ran.get('ran_at_end')}` ran at the end (no candidate chosen; the table is the last "
                        "finished selection)" if ran.get("plan_selection_status") == "unfinished" else ""))
    if ran.get("candidates"):
        lines += ["", "| candidate | predicted (ms) | deciding (ms) | decided in | all windows (ms) | chosen |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {c['name']} | {_fmt(c.get('predicted_s') and 1e3 * c['predicted_s'], '.2f')} | "
                  f"{_fmt(_deciding_s(c) and 1e3 * _deciding_s(c), '.2f')} | "
                  f"{c.get('decided_in') or ''} | {_fmt(c.get('measured_s') and 1e3 * c['measured_s'], '.2f')} | "
                  f"{'yes' if c.get('chosen') else ''} |" for c in ran["candidates"]]
        if ran.get("selection_notes"):
            lines += ["", "why: " + "; ".join(ran["selection_notes"])]
    st = ran.get("startup") or {}
    if st:
        lines += ["", f"steady state after {steps_text(st['total_steps'])}, {st['total_s']:.2f} s: "
                  f"{describe_startup(st)}"]
    if ran.get("cost_model_origin"):
        lines += ["", f"cost model: {ran['cost_model_origin']}"]
    if ran.get("plan_cache"):
        lines += ["", f"plan cache: {plan_cache_text(ran)}"]
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="train")
def main(cfg: DictConfig) -> Optional[float]:
    """Hydra entry point; returns ``cfg.optimized_metric`` of the run (for sweepers such as Optuna).

    An invalid config value ends the process with status 2 and a one-line message (no traceback).
    """
    try:
        res = train(cfg)
    except ConfigError as e:
        overrides = " ".join(HydraConfig.get().overrides.task) if HydraConfig.initialized() else ""
        print(f"Invalid config ({overrides or 'no overrides'}): {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return lookup_metric(res, cfg.get("optimized_metric")) if res else None


if __name__ == "__main__":
    main()
