"""Lightning callback :class:`SpeedupMonitor`: iteration time, throughput and speedup over a reference."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_warn

from lightning_pipedap.measure._common import (
    batch_size_of, check_int_at_least, check_positive_float, log_dir, log_metrics, reduce_sum,
)
from lightning_pipedap.measure.summary import SUMMARY_FILE, read_summary, summary_path, update_summary


#: steps after a strategy's start-up (``strategy.startup["total_steps"]``) that are not timed: the step that
#: installs the chosen candidate and the next one settle (``benchmarks/step_overhead.py``'s ``_steady``)
SETTLE_STEPS = 2


def steady_from_step(strategy: Any) -> Optional[int]:
    """The first steady-state step index (0-based, in the fit) of ``strategy``: 0 when it has no start-up
    (no ``startup`` attribute: Lightning's DDP, a registry name), ``startup["total_steps"] + SETTLE_STEPS``
    once its start-up is over, None while it is not (or the fit ended before it was)."""
    if isinstance(strategy, str) or not hasattr(strategy, "startup") or getattr(strategy, "single_process", False):
        return 0  # (pipedap with one process has no start-up: nothing to synchronise)
    startup = getattr(strategy, "startup", None)
    return int(startup["total_steps"]) + SETTLE_STEPS if startup else None


def model_comparison(strategy: Any, iteration_s: float) -> dict[str, float]:
    """The steady-state iteration time ``iteration_s`` against what ``strategy`` predicted (the summary's
    ``no_overlap_time_s``, ``speedup_vs_no_overlap``, ``predicted_iteration_s``, ``prediction_error_pct``, as the
    ``speed/`` tags of the same names); only the entries whose prediction the strategy exposes."""
    out: dict[str, float] = {}
    if isinstance(strategy, str) or not iteration_s:
        return out
    no_overlap = getattr(strategy, "no_overlap_time_s", None)
    if no_overlap is not None:
        out["no_overlap_time_s"] = float(no_overlap)
        out["speedup_vs_no_overlap"] = float(no_overlap) / iteration_s
    predicted = getattr(strategy, "predicted_iteration_s", None)
    if predicted:
        out["predicted_iteration_s"] = float(predicted)
        out["prediction_error_pct"] = 100.0 * (iteration_s / float(predicted) - 1.0)
    return out


class SpeedupMonitor(Callback):
    """Iteration time, throughput and speedup, as medians over steady-state windows after a warm-up.

    The iteration time of step ``i`` is ``start(i+1) - start(i)`` from ``on_train_batch_start``
    (``time.perf_counter``): start-to-start, because a strategy may defer the end of step ``i``
    (all-gather, update) into the forward of step ``i+1``. Intervals spanning validation or an epoch
    boundary are discarded, and the first ``warmup_steps`` intervals too.

    *Steady state.* A strategy with a start-up (pipedap: trace, profiling and measured plan selection,
    exposed as ``strategy.startup``, ``{"total_steps", "total_s", ...}`` once the chosen schedule runs) is
    timed only from optimizer step ``startup["total_steps"] + SETTLE_STEPS`` of the fit (0-based; the steps
    that install the chosen candidate settle first, as ``benchmarks/step_overhead.py`` does); a strategy without
    ``startup`` (Lightning's ``ddp``, single device) is in steady state from its first step. The start-up
    intervals after the warm-up are kept apart (:attr:`startup_intervals_s`) and logged as
    ``speed/startup_step_time_ms``; they are never in the iteration time, throughput or speedups. A fit
    that ends before steady state has no iteration time: the summary says so (``iteration_s`` None,
    ``steady_state`` False) instead of reporting start-up steps. A strategy that also exposes ``phase``
    (pipedap) is timed only from ``SETTLE_STEPS + 2`` step starts after it last entered ``run``, so the
    profiling and trial steps of a drift re-plan (and the settling after it) are left out too
    (:attr:`replan_intervals_s`, counted as ``replan_steps`` in the summary).

    Every ``window_steps`` steady-state intervals, global rank 0 logs

    * ``speed/iteration_time_ms``: median interval (ms), averaged over ranks;
    * ``speed/throughput_samples_per_s``: global samples per step / median interval;
    * ``speed/speedup_vs_reference``: ``throughput / ref_throughput`` when the reference file has a
      throughput (robust to a different global batch), else ``ref_iteration_s / iteration_s``
      (assumes the same global batch);
    * ``speed/speedup_vs_no_overlap`` and ``speed/no_overlap_time_ms``: when the strategy exposes
      ``no_overlap_time_s`` (compute-only + communication-only time per step, seconds, from its
      profiler): ``no_overlap_time_s / iteration_s``. Not logged when it is ``None`` or missing.
    * ``speed/predicted_iteration_ms`` and ``speed/prediction_error_pct`` (``100·(measured/predicted − 1)``):
      when the strategy exposes the planner's ``predicted_iteration_s``.

    and every ``window_steps`` start-up intervals ``speed/startup_step_time_ms`` (median start-up interval,
    ms, averaged over ranks: trace, profiling and trial steps of pipedap, several schedules mixed).

    At the end of the fit, global rank 0 merges into the summary file: ``iteration_s`` (median steady-state
    interval, s, averaged over ranks; None before steady state), ``iteration_steps`` (steady-state intervals
    in that median, rank 0), ``steady_from_step`` (the first timed step, 0-based: at least
    ``total_steps + SETTLE_STEPS`` after a start-up and ``warmup_steps`` in any case; None when the fit ended
    before steady state), ``startup_steps`` (start-up steps of the strategy, ``startup["total_steps"]``, None
    without one), ``startup_s`` (their seconds),
    ``steady_state`` (whether any steady-state interval was timed), ``warmup_steps`` (this monitor's),
    ``replan_steps`` (intervals left out for a drift re-plan after the start-up),
    ``iteration_note`` (why there is no ``iteration_s``, else None), with known batch sizes
    ``samples_per_step`` and ``throughput_samples_per_s``, and, when the strategy exposes them, the steady-state
    ``speedup_vs_no_overlap`` (with ``no_overlap_time_s``) and ``prediction_error_pct`` (with
    ``predicted_iteration_s``) of the tags above, over the whole median (:func:`model_comparison`).

    Args:
        warmup_steps: intervals discarded at the start (>= 0).
        window_steps: intervals per logged median (>= 1).
        reference_iteration_s: reference iteration time (s), e.g. of a DDP run with the same global batch.
        reference_file: a summary JSON of a reference run (``iteration_s`` and/or
            ``throughput_samples_per_s``).
        summary_file: file name (in the log directory) or path of this run's summary; ``None``: none.
        batch_size: samples per batch per rank; ``None``: from the batch's first tensor.
        clock: seconds clock (tests); default ``time.perf_counter``.

    Raises:
        ValueError: bad argument.
        FileNotFoundError: ``reference_file`` does not exist (at ``setup``).
    """

    #: reads neither weights nor gradients: no observer for PipeDAPStrategy (lightning_pipedap.strategy.observers)
    pipedap_reads_model = False

    def __init__(
        self,
        warmup_steps: int = 5,
        window_steps: int = 20,
        reference_iteration_s: Optional[float] = None,
        reference_file: Optional[str] = None,
        summary_file: Optional[str] = SUMMARY_FILE,
        batch_size: Optional[int] = None,
        clock: Optional[Callable[[], float]] = None,
    ) -> None:
        self.warmup_steps = check_int_at_least("warmup_steps", warmup_steps, minimum=0)
        self.window_steps = check_int_at_least("window_steps", window_steps)
        if reference_iteration_s is not None and reference_file is not None:
            raise ValueError("give reference_iteration_s or reference_file, not both")
        self.reference_iteration_s = check_positive_float("reference_iteration_s", reference_iteration_s)
        self.reference_file = reference_file
        self.summary_file = summary_file
        self.batch_size = None if batch_size is None else check_int_at_least("batch_size", batch_size)
        self._clock = clock or time.perf_counter
        self.history: list[dict[str, float]] = []
        self.intervals_s: list[float] = []  # post-warm-up steady-state intervals of this rank (s)
        self.startup_intervals_s: list[float] = []  # post-warm-up intervals of the strategy's start-up (s)
        self.replan_intervals_s: list[float] = []  # intervals of a drift re-plan after the start-up (s)
        self._run_streak = 0  # consecutive step starts that saw the strategy's phase "run"
        self.steady_from: Optional[int] = None  # first timed steady-state step of the last fit (None: not reached)
        self._step = 0  # steps started in this fit
        self._window: list[float] = []
        self._startup_window: list[float] = []
        self._window_samples: list[int] = []
        self._last: Optional[float] = None
        self._last_samples: Optional[int] = None
        self._seen = 0
        self._samples_known = True
        self._ref_iter_s: Optional[float] = self.reference_iteration_s
        self._ref_thr: Optional[float] = None
        self._log_dir = ""
        self._samples_per_step: Optional[float] = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self._log_dir = log_dir(trainer)
        if self.reference_file is not None:
            ref = read_summary(self.reference_file)
            self._ref_iter_s = ref.get("iteration_s")
            self._ref_thr = ref.get("throughput_samples_per_s")
            if not self._ref_iter_s and not self._ref_thr:
                raise ValueError(f"reference_file={self.reference_file!r} has neither iteration_s nor "
                                 "throughput_samples_per_s")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._step, self._last, self._seen, self.steady_from, self._run_streak = 0, None, 0, None, 0
        self.intervals_s, self.startup_intervals_s, self.replan_intervals_s = [], [], []
        self._window, self._window_samples, self._startup_window = [], [], []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        now = self._clock()
        self._step += 1
        replanning = self._replanning(trainer.strategy)  # (every step start counts towards the run streak)
        if self._last is not None:
            self._seen += 1
            # (the interval that ends now is the previous batch's, index self._step - 2, identical on every rank;
            # the strategy counts optimizer steps: accumulate_grad_batches batches each)
            steady = steady_from_step(trainer.strategy)
            accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
            if self._seen > self.warmup_steps and (steady is None or (self._step - 2) // accumulate < steady):
                self.startup_intervals_s.append(now - self._last)
                self._startup_window.append(now - self._last)
                if len(self._startup_window) >= self.window_steps:
                    self._log_startup_window(trainer)
            elif self._seen > self.warmup_steps and replanning:
                self.replan_intervals_s.append(now - self._last)
            elif self._seen > self.warmup_steps:
                if self.steady_from is None:
                    self.steady_from = self._step - 2  # the first timed steady-state step
                self._window.append(now - self._last)
                self.intervals_s.append(now - self._last)
                if self._last_samples is None:
                    self._samples_known = False
                else:
                    self._window_samples.append(self._last_samples)
                if len(self._window) >= self.window_steps:
                    self._log_window(trainer)
        self._last = now
        self._last_samples = self.batch_size if self.batch_size is not None else batch_size_of(batch)

    def _replanning(self, strategy: Any) -> bool:
        """Whether the interval ending now belongs to a strategy phase other than a settled run: the strategy
        exposes ``phase`` (pipedap's :class:`~lightning_pipedap.strategy.controller.Phase`) and fewer than
        ``SETTLE_STEPS + 2`` consecutive step starts (this one included) saw it in ``run``, the same distance
        from entering ``run`` as ``startup["total_steps"] + SETTLE_STEPS`` after the start-up. Excludes the
        profiling and trial steps of a drift re-plan; False for a strategy without ``phase``."""
        phase = None if isinstance(strategy, str) else getattr(strategy, "phase", None)
        if phase is None:
            return False
        self._run_streak = self._run_streak + 1 if getattr(phase, "value", phase) == "run" else 0
        return self._run_streak < SETTLE_STEPS + 2

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._last = None

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._last = None

    def _log_startup_window(self, trainer: Any) -> None:
        (med_sum,) = reduce_sum(trainer, [statistics.median(self._startup_window)])
        self._startup_window = []
        m = {"speed/startup_step_time_ms": 1000.0 * med_sum / trainer.world_size}
        self.history.append(m)
        log_metrics(trainer, m)

    def _log_window(self, trainer: Any) -> None:
        med = statistics.median(self._window)
        known = 1.0 if self._samples_known else 0.0
        samples = sum(self._window_samples) / len(self._window_samples) if self._window_samples else 0.0
        med_sum, samples_sum, known_sum = reduce_sum(trainer, [med, samples, known])
        self._window, self._window_samples, self._samples_known = [], [], True
        it_s = med_sum / trainer.world_size
        m = {"speed/iteration_time_ms": 1000.0 * it_s}
        thr = None
        if known_sum > trainer.world_size - 0.5:
            self._samples_per_step = samples_sum
            thr = samples_sum / it_s
            m["speed/throughput_samples_per_s"] = thr
        if self._ref_thr and thr is not None:
            m["speed/speedup_vs_reference"] = thr / self._ref_thr
        elif self._ref_iter_s:
            m["speed/speedup_vs_reference"] = self._ref_iter_s / it_s
        no_overlap = getattr(trainer.strategy, "no_overlap_time_s", None)
        if no_overlap is not None:
            m["speed/no_overlap_time_ms"] = 1000.0 * float(no_overlap)
            m["speed/speedup_vs_no_overlap"] = float(no_overlap) / it_s
        predicted = getattr(trainer.strategy, "predicted_iteration_s", None)
        if predicted:
            m["speed/predicted_iteration_ms"] = 1000.0 * float(predicted)
            m["speed/prediction_error_pct"] = 100.0 * (it_s / float(predicted) - 1.0)
        self.history.append(m)
        log_metrics(trainer, m)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        med = statistics.median(self.intervals_s) if self.intervals_s else 0.0
        med_sum, have = reduce_sum(trainer, [med, 1.0 if self.intervals_s else 0.0])
        if not trainer.is_global_zero or not self.summary_file:
            return
        startup = getattr(trainer.strategy, "startup", None) if not isinstance(trainer.strategy, str) else None
        summary: dict[str, Any] = {
            "iteration_steps": len(self.intervals_s), "steady_from_step": self.steady_from,
            "warmup_steps": self.warmup_steps, "replan_steps": len(self.replan_intervals_s),
            "startup_steps": int(startup["total_steps"]) if startup else None,
            "startup_s": float(startup["total_s"]) if startup else None,
            "steady_state": have > trainer.world_size - 0.5,
        }
        if have < trainer.world_size - 0.5:
            if self.startup_intervals_s or steady_from_step(trainer.strategy) is None:
                why = ("the fit ended before steady state (during the strategy's start-up: trace, profiling, trials)"
                       if steady_from_step(trainer.strategy) is None else
                       f"the fit ended before steady state (first steady step {steady_from_step(trainer.strategy)}: "
                       f"start-up {summary['startup_steps']} steps + {SETTLE_STEPS} settling)")
            else:
                why = f"fewer than warmup_steps+1={self.warmup_steps + 1} timed steps"
            rank_zero_warn(f"SpeedupMonitor: {why}; no iteration time in the summary")
            summary.update(iteration_s=None, throughput_samples_per_s=None, iteration_note=why)
            update_summary(summary_path(self.summary_file, self._log_dir), summary)
            return
        it_s = med_sum / trainer.world_size
        summary["iteration_s"] = it_s
        summary["iteration_note"] = None
        summary.update(model_comparison(trainer.strategy, it_s))
        if self._samples_per_step:
            summary["samples_per_step"] = self._samples_per_step
            summary["throughput_samples_per_s"] = self._samples_per_step / it_s
        update_summary(summary_path(self.summary_file, self._log_dir), summary)
