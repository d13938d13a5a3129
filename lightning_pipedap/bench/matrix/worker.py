"""What runs inside each rank of a cell (``python -m lightning_pipedap.bench.matrix --worker <spec JSON>``):
the compute-only reference, every strategy through ``Trainer.fit`` with a step timer, and the
communication-only reference; :func:`worker` returns the rank's raw results for
:func:`~lightning_pipedap.bench.matrix.results.combine`."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import time
import warnings
from typing import Any, Iterator, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipedap import PipeDAPStrategy
from lightning_pipedap.bench.matrix.models import DEFAULT_OPTIMIZER, build_net, first_layer_numel, make_module
from lightning_pipedap.bench.matrix.results import median_step_s, summarize_compression
from lightning_pipedap.bench.matrix.spec import (COMPRESSOR_KWARGS, DDP_HOOKS, PLAN_TRIALS, POWERSGD_ONE_BUCKET_MB,
                                                 POWERSGD_RANK, POWERSGD_START, QUICK_DDP_WARMUP, TRIAL_ROUNDS,
                                                 TRIAL_STEPS, extra_warmup_steps, parse_strategy, plan_trials)
from lightning_pipedap.engine import collectives as C
from lightning_pipedap.measure.energy import EstimateReader

#: loggers set to ERROR while a worker runs (Lightning's and pipedap's info messages, torch.distributed's notes)
QUIET_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_pipedap", "torch.distributed")
#: (message regex, category) of the warnings a worker does not show: deprecations inside torch that
#: Lightning's data fetching (``LeafSpec``) and the engine's gloo all-gather trigger on every fit, and
#: ``--weight-reader``'s note that EMAWeightAveraging does not shard (BenchModule shards only under FSDP2)
QUIET_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    (r"You're using the WeightAveraging callback with a model that overrides the configure_model", UserWarning),
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning),
)


@contextlib.contextmanager
def quiet_worker() -> Iterator[None]:
    """Inside: :data:`QUIET_LOGGERS` at ERROR and :data:`QUIET_WARNINGS` ignored; both restored on exit."""
    loggers = [logging.getLogger(n) for n in QUIET_LOGGERS]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        for message, category in QUIET_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


class StepTimer(pl.Callback):
    """Start time (perf_counter, s) and estimated energy (J) at every training-batch start and at the end;
    reads neither weights nor gradients (``pipedap_reads_model = False``: no observer for the strategy);
    with a compressing pipedap strategy also every per-bucket compression round, as
    ``(step, bucket, CompressionStats)``; with a timeline-recording strategy its op records.

    Rounds are sampled before each backward and at the end: every round of step ``t`` has finished
    before the backward of step ``t + 1`` (its update is applied in that step's forward) and none of
    step ``t + 1`` has started, so each sample sees exactly the previous step's rounds.

    Args:
        watts: assumed W per busy core of the energy estimate (``EstimateReader(watts, basis="cpu")``).
    """

    def __init__(self, watts: float) -> None:
        self.starts: list[float] = []
        self.joules: list[float] = []
        self.pipedap_reads_model = False
        self.reader = EstimateReader(watts, basis="cpu")
        self.records: list = []
        self.rounds: list[tuple[int, int, Any]] = []
        self._last: dict[int, Any] = {}
        #: class name of the trainer's (first) optimizer, read at the start of training ("" before)
        self.optimizer = ""

    def _stamp(self) -> None:
        self.starts.append(time.perf_counter())
        self.joules.append(self.reader.read_J())

    def _sample(self, trainer: Any, step: int) -> None:
        stats = getattr(trainer.strategy, "compression_stats", None)
        if stats is None:
            return
        # the transport replaces a bucket's CompressionStats object every round: a new object is a new
        # round (the old one stays referenced in _last, so its id cannot be reused)
        for b, st in stats().items():
            if self._last.get(b) is not st:
                self._last[b] = st
                self.rounds.append((step, b, st))

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._sample(trainer, len(self.starts) - 2)  # rounds finished now belong to the previous step

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.optimizer = type(trainer.optimizers[0]).__name__ if trainer.optimizers else ""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._stamp()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stamp()
        if getattr(trainer.strategy, "compression_stats", None) is not None:
            # finish the last step's deferred rounds (the strategy's own on_train_end, right after the
            # callbacks', would do the same) so that they are counted; the timing stamp is taken already
            trainer.strategy.flush()
            self._sample(trainer, len(self.starts) - 2)
        take = getattr(trainer.strategy, "take_timeline", None)
        if take is not None:  # before teardown, which drops the engine and its records
            self.records = take()


def _make_timer(watts: float) -> StepTimer:
    """A fresh :class:`StepTimer` for one fit."""
    return StepTimer(watts)


class CommHookDDPStrategy(DDPStrategy):
    """``DDPStrategy`` that registers the DDP communication hook of ``hook`` (a :data:`DDP_HOOKS` key) on the
    ``DistributedDataParallel`` module right after ``configure_ddp``, on every device (Lightning's own
    ``ddp_comm_hook=`` argument is applied only on CUDA). ``ddp+powersgdhook`` uses PowerSGD rank
    :data:`POWERSGD_RANK` from iteration :data:`POWERSGD_START`.

    Raises:
        ValueError: ``hook`` is not a DDP hook variant (naming the valid ones).
    """

    def __init__(self, hook: str, **kwargs: Any) -> None:
        if hook not in DDP_HOOKS:
            raise ValueError(f"unknown DDP hook variant {hook!r}; valid: {', '.join(DDP_HOOKS)}")
        super().__init__(**kwargs)
        self.comm_hook_variant = hook

    def configure_ddp(self) -> None:
        super().configure_ddp()
        if self.comm_hook_variant == "ddp+fp16hook":
            self.model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        else:
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                                start_powerSGD_iter=POWERSGD_START)
            self.model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def _ddp_with_comm_hook(name: str) -> CommHookDDPStrategy:
    """:class:`CommHookDDPStrategy` for ``name``; ``ddp+powersgdhook`` gets one DDP bucket
    (:data:`POWERSGD_ONE_BUCKET_MB`).

    powerSGD_hook chains its P and Q all-reduces in future callbacks; with several DDP buckets in flight
    those callbacks issue collectives in a timing-dependent order, which gloo (unlike NCCL's ordered
    stream) turns into a size mismatch between ranks (``op.preamble.length <= op.nbytes``); one bucket
    makes one chain.

    Raises:
        ValueError: ``name`` is not a DDP hook variant (naming the valid ones).
    """
    if name == "ddp+powersgdhook":
        return CommHookDDPStrategy(name, bucket_cap_mb=POWERSGD_ONE_BUCKET_MB)
    return CommHookDDPStrategy(name)


def plan_record(strategy: PipeDAPStrategy) -> list[str]:
    """What a pipedap strategy reports about its plan after a fit, one line per item, from its own
    attributes: the installed schedule, the predicted and no-overlap iteration times, the calibration of
    the α-β model, the measured contention, the measured candidates and why one was chosen, the re-plans
    and, when the fit ended during plan selection, that selection and the schedule that ran at the end
    (items it does not have are left out)."""
    lines = []
    if strategy.installed_schedule is not None:
        lines.append(f"schedule {strategy.installed_schedule}")
    if strategy.predicted_iteration_s is not None:
        lines.append(f"predicted iteration {strategy.predicted_iteration_s * 1e3:.1f} ms")
    if strategy.no_overlap_time_s is not None:
        lines.append(f"no-overlap iteration {strategy.no_overlap_time_s * 1e3:.1f} ms")
    prof = getattr(strategy, "profile", None)
    if isinstance(prof, dict) and prof.get("layers"):
        lines.append(f"profile: forward {sum(x['t_f'] for x in prof['layers']) * 1e3:.1f} ms, backward "
                     f"{sum(x['t_b'] for x in prof['layers']) * 1e3:.1f} ms, update "
                     f"{prof.get('t_update', 0.0) * 1e3:.1f} ms")
    if strategy.calibration_ratio != 1.0:
        lines.append(f"α-β model scaled by {strategy.calibration_ratio:.2f} (measured / predicted communication "
                     "of the profiling steps)")
    c = strategy.contention
    if c is not None:
        lines.append(f"contention: communication {c.comm_slowdown:.2f} and compute {c.compute_slowdown:.2f} "
                     "extra slowdown while they overlap"
                     + (f"; a sharded step {c.step_slowdown:.2f} and compute {c.compute_slowdown_step:.2f} while it "
                        "runs" if getattr(c, "step_slowdown", 0.0) or getattr(c, "compute_slowdown_step", 0.0)
                        else ""))
    if strategy.trial_results:
        lines.append("measured candidates (the medians the choice was made on): " + "; ".join(
            f"{t['name']} {t.get('deciding_s', t['measured_s']) * 1e3:.1f} ms"
            + (f" [confirmation; all windows {t['measured_s'] * 1e3:.1f} ms]" if t.get("decided_in") == "confirmation"
               else "") + (" (chosen)" if t["chosen"] else "")
            for t in strategy.trial_results))
    if strategy.replans_done:
        lines.append(f"re-plans: {strategy.replans_done}")
    ran = strategy.what_ran()
    if strategy.trial_results and ran.get("selection_notes"):
        lines.append("why: " + "; ".join(ran["selection_notes"]))
    if ran.get("plan_selection_status") == "unfinished":
        lines.append(f"plan selection {ran['plan_selection']}: {ran['ran_at_end']} ran at the end, not a chosen "
                     "candidate")
    return lines


def _fit(spec: dict, strategy: Any, ds: TensorDataset, steps: int, devices_kw: dict,
         trainer_kw: Optional[dict] = None) -> StepTimer:
    """``Trainer.fit`` of the spec's model for ``steps`` steps on ``strategy`` (``trainer_kw``: extra ``Trainer``
    arguments, e.g. a variant's clipping); returns its timer."""
    pl.seed_everything(0, verbose=False)
    module = make_module(spec["model"], spec["size"], options=spec.get("model_options"),
                         optimizer=spec.get("optimizer", DEFAULT_OPTIMIZER))
    timer = _make_timer(spec["watts"])
    callbacks: list[pl.Callback] = [timer]
    if spec.get("weight_reader"):
        from lightning.pytorch.callbacks import EMAWeightAveraging

        callbacks.append(EMAWeightAveraging(decay=0.999))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks, **devices_kw,
                         **(trainer_kw or {}))
    trainer.fit(module, DataLoader(ds, batch_size=spec["batch"], shuffle=False))
    return timer


def _timeline_summary(records: list, t0: float, t1: float, n: int) -> tuple[float, float]:
    """(wait s per iteration, comm busy s per iteration) of the records that start in ``[t0, t1)``."""
    wait = sum(r.end_s - r.start_s for r in records if r.kind == "wait" and t0 <= r.start_s < t1)
    busy = sum(r.end_s - r.start_s for r in records if r.lane == "comm" and t0 <= r.start_s < t1)
    return wait / n, busy / n


def _make_strategy(spec: dict, name: str, world: int, bucket_mb: Optional[float]) -> Any:
    """The Lightning strategy (or registry name) of matrix strategy ``name``."""
    sp = parse_strategy(name)
    if sp.family == "ddp":
        return "ddp"
    if sp.family == "ddp_tuned":
        return DDPStrategy(bucket_cap_mb=bucket_mb)
    if sp.family == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    if sp.family == "ddp_hook":
        return _ddp_with_comm_hook(name)
    trial_steps = spec.get("trial_steps", TRIAL_STEPS)
    comp = {} if sp.compressor is None else dict(compression=sp.compressor, compression_mode=sp.mode,
                                                  compression_kwargs=COMPRESSOR_KWARGS.get(sp.compressor, {}))
    if sp.partition_mb is not None:
        comp["partition_mb"] = sp.partition_mb
    if sp.torch_ddp_margin is not None:
        comp["torch_ddp_margin"] = sp.torch_ddp_margin
    if sp.shard:
        comp["shard_optimizer"] = True
    strategy = PipeDAPStrategy(schedule=sp.schedule, replan_every=10**6, train_thread_nice=sp.nice, wire_dtype=sp.wire,
                               plan_trials=plan_trials(name, spec.get("plan_trials", PLAN_TRIALS)),
                               trial_steps=trial_steps, trial_rounds=spec.get("trial_rounds", TRIAL_ROUNDS),
                               trial_window_s=0, plan_cache=False,  # (every repeat measures its own selection;
                               # window = trial_steps: the warm-up count is exact)
                               # no start-up budget: the selection runs in the warm-up that extra_warmup_steps adds for
                               # it, as in a long fit (the default budget, 10% of this short fit's steps, would leave
                               # no room for trials and install the planner's schedule unmeasured)
                               startup_budget=None, **comp)
    strategy.timeline_enabled = bool(spec["timeline"])
    return strategy


def _run_variant(spec: dict, name: str, ds: TensorDataset, world: int, bucket_mb: Optional[float] = None,
                 steps: Optional[int] = None) -> dict:
    """Train strategy ``name`` for its warm-up plus ``steps`` (default ``spec["steps"]``) steps; the raw
    result dict of this rank (keys of :class:`~lightning_pipedap.bench.matrix.results.VariantResult`)."""
    steps = steps or spec["steps"]
    warmup = spec["warmup"] + extra_warmup_steps(name, spec.get("trial_steps", TRIAL_STEPS),
                                                 spec.get("plan_trials", PLAN_TRIALS),
                                                 spec.get("trial_rounds", TRIAL_ROUNDS))
    sp = parse_strategy(name)
    if spec.get("quick") and sp.family == "ddp":
        warmup = QUICK_DDP_WARMUP
    strategy = _make_strategy(spec, name, world, bucket_mb)
    timer = _fit(spec, strategy, ds, warmup + steps, dict(devices=1, num_nodes=world), sp.trainer_kwargs)
    med, n = median_step_s(timer.starts, warmup)
    energy = (timer.joules[-1] - timer.joules[warmup]) / n
    out: dict[str, Any] = {"name": name, "iter_s": med, "steps": n, "energy_J": energy, "compression": sp.compression,
                           "optimizer": timer.optimizer,
                           "all_steps_ms": [round((b - a) * 1e3, 1)
                                            for a, b in zip(timer.starts[:-1], timer.starts[1:])]}
    if not isinstance(strategy, PipeDAPStrategy):
        return out
    plan = plan_record(strategy)
    out.update(predicted_s=strategy.predicted_iteration_s, plan=" | ".join(plan), trials=strategy.trial_results,
               predictions=strategy.predictions,
               installed=(strategy.what_ran().get("installed") or {}).get("name") or "")
    if spec["timeline"]:
        out["wait_s"], out["comm_busy_s"] = _timeline_summary(timer.records, timer.starts[warmup], timer.starts[-1], n)
        if spec.get("timeline_dir") and int(os.environ.get("RANK", "0")) == 0:
            _dump_timeline(timer.records, timer.starts, warmup, spec, name, plan)
    if sp.compressor is not None:
        # the rounds of the measured steps
        summary = summarize_compression([(b, st) for k, b, st in timer.rounds if k >= warmup],
                                        pipelined=sp.mode == "process")
        if summary is None:
            raise RuntimeError(f"{name}: no compression round finished in the {n} measured steps "
                               f"(compression_stats() stayed empty); raise --steps")
        out.update(compress_s=summary.compress_s, hidden_share=summary.hidden_share,
                   compression_ratio=summary.ratio, compressed_rounds=summary.rounds)
    return out


def _dump_timeline(records: list, starts: list[float], warmup: int, spec: dict, name: str, plan: list[str]) -> None:
    """Rank 0: write the op records of the last three measured iterations (times relative to the first
    of them, ms), the iteration starts and ``plan`` (:func:`plan_record`) to
    ``<timeline_dir>/<model>-<link>-<ranks>r-<name>.json``."""
    t0 = starts[max(warmup, len(starts) - 4)]
    keep = [r for r in records if r.start_s >= t0]
    doc = {"iteration_starts_ms": [(t - t0) * 1e3 for t in starts if t >= t0],
           "records": [{"name": r.name, "kind": r.kind, "bucket": r.bucket, "lane": r.lane,
                        "start_ms": round((r.start_s - t0) * 1e3, 2), "end_ms": round((r.end_s - t0) * 1e3, 2)}
                       for r in keep],
           "plan": plan}
    os.makedirs(spec["timeline_dir"], exist_ok=True)
    path = os.path.join(spec["timeline_dir"], f"{spec['model']}-{spec['link']}-{spec['world']}r-{name}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def _compute_only(spec: dict, ds: TensorDataset) -> float:
    """Median iteration of the same Lightning loop on one device, no process group traffic (s)."""
    warmup = 2  # no strategy warm-up phases here: two steps settle the allocator and caches
    timer = _fit(spec, SingleDeviceStrategy(torch.device("cpu")), ds, warmup + spec["steps"], {"devices": 1})
    return median_step_s(timer.starts, warmup)[0]


def comm_only(numels: Sequence[int], repeat: int = 4) -> list[tuple[float, float, float]]:
    """Per size: median (all-reduce s, ring RS + AG s, CPU s of the all-reduce) of ``numel`` fp32 elements
    as one buffer, on a fresh group (first round a warm-up). The CPU time is this process's user + system
    time over all its threads (``time.process_time``) during the all-reduce: gloo's copies, the ring's
    additions and the socket calls; kernel network work done outside the process is not counted."""
    comm = C.new_comm_group(timeout_s=600)
    out = []
    for numel in numels:
        buf = torch.ones(-(-numel // comm.world_size) * comm.world_size)
        ar, rsag, cpu = [], [], []
        for _ in range(repeat + 1):
            C.barrier()
            c0 = time.process_time()
            t0 = time.perf_counter()
            C.all_reduce_(buf, comm)
            t1 = time.perf_counter()
            cpu.append(time.process_time() - c0)
            C.barrier()
            t2 = time.perf_counter()
            C.reduce_scatter_(buf, comm)
            C.all_gather_(buf, comm)
            t3 = time.perf_counter()
            ar.append(t1 - t0)
            rsag.append(t3 - t2)
        out.append((statistics.median(ar[1:]), statistics.median(rsag[1:]), statistics.median(cpu[1:])))
    C.destroy_comm_group(comm)
    return out


def _pick_ddp_bucket(spec: dict, ds: TensorDataset, world: int) -> tuple[float, str]:
    """``ddp_tuned``'s bucket cap: the candidate with the fastest short run (rank 0 decides), and a note."""
    caps = spec["ddp_bucket_mb"]
    if len(caps) == 1:
        return caps[0], f"bucket_cap_mb={caps[0]:g}"
    short = dict(spec, timeline=False, warmup=2)  # DDP has no warm-up phases; two steps settle its buckets
    trial = {c: _run_variant(short, "ddp_tuned", ds, world, c, spec["sweep_steps"])["iter_s"] for c in caps}
    best = C.broadcast_object(min(trial, key=trial.get), src=0)  # every rank must use the same cap
    return best, (f"bucket_cap_mb={best:g} (sweep "
                  + ", ".join(f"{c:g}: {t * 1e3:.0f} ms" for c, t in trial.items()) + ")")


def _run_strategies(spec: dict, ds: TensorDataset, world: int) -> list[dict]:
    """Every strategy, ``repeats`` rounds round-robin; per strategy the run with the lowest median."""
    best: dict[str, dict] = {}
    bucket, note = None, ""
    for _ in range(spec.get("repeats", 1)):
        for name in spec["strategies"]:
            if name == "ddp_tuned" and bucket is None:
                bucket, note = _pick_ddp_bucket(spec, ds, world)
            v = _run_variant(spec, name, ds, world, bucket if name == "ddp_tuned" else None)
            v["note"] = note if name == "ddp_tuned" else ""
            v["runs_ms"] = best.get(name, {}).get("runs_ms", []) + [round(v["iter_s"] * 1e3, 1)]
            if name not in best or v["iter_s"] < best[name]["iter_s"]:
                best[name] = v
            else:
                best[name]["runs_ms"] = v["runs_ms"]
    variants = []
    for name in spec["strategies"]:
        v = best[name]
        if len(v["runs_ms"]) > 1:
            v["note"] = ((v["note"] + "; " if v["note"] else "")
                         + "best of " + "/".join(f"{x:.0f}" for x in v["runs_ms"]) + " ms")
        del v["runs_ms"]
        variants.append(v)
    return variants


def worker(spec: dict) -> dict:
    """One rank of a cell: compute-only, every strategy (``repeats`` rounds, round-robin), communication-
    only, compute-only again; returns the raw results of this rank.

    ``spec`` keys: model, size, model_options (:data:`~lightning_pipedap.bench.matrix.models.REPLAY_MODEL`
    only), batch, steps, warmup, strategies, ddp_bucket_mb (list of MiB), sweep_steps, repeats, threads, watts,
    timeline, link, timeline_dir (and quick, trial_steps, plan_trials, weight_reader, optimizer: an
    :data:`~lightning_pipedap.bench.matrix.models.OPTIMIZERS` name, default sgd). With ``repeats > 1`` each
    strategy keeps its run with the lowest median (noise on a shared machine only adds time). Runs inside
    :func:`quiet_worker`. Any error propagates: the peers then fail or time out, and the driver reports the rank's
    output.
    """
    with quiet_worker():
        torch.set_num_threads(spec["threads"])
        world = int(os.environ["WORLD_SIZE"])
        rank = int(os.environ["RANK"])
        spec = dict(spec, world=world)
        _, _, make_batch = build_net(spec["model"], spec["size"], spec.get("model_options"))
        trial_steps, candidates = spec.get("trial_steps", TRIAL_STEPS), spec.get("plan_trials", PLAN_TRIALS)
        rounds = spec.get("trial_rounds", TRIAL_ROUNDS)
        total = (spec["warmup"]
                 + max(extra_warmup_steps(n, trial_steps, candidates, rounds) for n in spec["strategies"])
                 + max(spec["steps"], spec["sweep_steps"]))
        g = torch.Generator().manual_seed(1234)
        ds = TensorDataset(*make_batch(spec["batch"] * (total + 1) * world, g))
        res: dict[str, Any] = {"rank": rank, "world": world, "variants": [], "skipped": {}}
        compute_runs = [_compute_only(spec, ds)]
        net = make_module(spec["model"], spec["size"], options=spec.get("model_options")).net
        res["params"] = sum(p.numel() for p in net.parameters())
        res["first_layer_params"] = first_layer_numel(net)
        res["variants"] = _run_strategies(spec, ds, world)
        (res["allreduce_s"], res["rs_ag_s"], res["allreduce_cpu_s"]), first = comm_only(
            [res["params"], res["first_layer_params"]])
        res["first_layer_comm_s"] = min(first[:2])
        # compute-only again at the end (not in --quick): the bound takes the faster of the two runs (noise
        # on a shared machine only ever adds time); both are kept
        if not spec.get("quick"):
            compute_runs.append(_compute_only(spec, ds))
        res["compute_runs_s"] = compute_runs
        res["compute_s"] = min(compute_runs)
        C.shutdown()  # destroy the default group before exit (live gloo threads at exit can abort the process)
    return res
