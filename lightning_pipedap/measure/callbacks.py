"""Lightning callbacks: :class:`EnergyMonitor`, :class:`SpeedupMonitor`, :class:`CommTimeline`.

All three work with any strategy (single device, ``ddp``, ``pipedap``), take only scalar constructor
arguments (so Hydra can instantiate them), log through ``trainer.loggers`` from global rank 0, and keep
their results in attributes for plain-Python use. Cross-rank values are summed with
``trainer.strategy.reduce(tensor, reduce_op="sum")`` at step counts that are identical on every rank,
so the collectives line up.

Run summary: at the end of ``fit`` the monitors merge their headline numbers into a JSON file in the
log directory (``measure_summary.json`` by default; see :data:`SUMMARY_KEYS`). Another run (e.g. the
DDP job of a Hydra sweep) passes that file as ``reference_file`` to get speedup and energy saving.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any, Callable, Optional

import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_pipedap.measure.energy import (
    DEFAULT_RAPL_ROOT,
    ESTIMATED,
    MEASURED,
    EnergyReader,
    open_energy_reader,
)
from lightning_pipedap.measure.timeline import (
    COMPRESS_KINDS,
    OpRecord,
    as_op_records,
    communication_ms,
    compute_ms,
    exposed_communication_ms,
    gantt_png,
    gantt_rgb,
    write_chrome_trace,
)

SUMMARY_FILE = "measure_summary.json"
#: keys written to the summary file (units in the names): iteration_s, throughput_samples_per_s,
#: samples_per_step (SpeedupMonitor); energy_kind, energy_source, energy_J_per_step,
#: energy_J_per_sample, energy_mean_W, energy_total_J (EnergyMonitor).
SUMMARY_KEYS = ("iteration_s", "throughput_samples_per_s", "samples_per_step", "energy_kind", "energy_source",
                "energy_J_per_step", "energy_J_per_sample", "energy_mean_W", "energy_total_J")


# -------------------------------------------------------------------------------------------- helpers
def read_summary(path: str) -> dict[str, Any]:
    """Load a summary JSON written by the monitors.

    Raises:
        FileNotFoundError: ``path`` does not exist (message names it).
        ValueError: the file is not a JSON object.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"reference_file={path!r} does not exist (expected a {SUMMARY_FILE} of a finished run)")
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"reference_file={path!r} holds {type(data).__name__}, expected a JSON object")
    return data


def update_summary(path: str, values: dict[str, Any]) -> None:
    """Merge ``values`` into the JSON object at ``path`` (created if missing), atomically."""
    data: dict[str, Any] = {}
    if os.path.isfile(path):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = {}
    data.update(values)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def batch_size_of(batch: Any) -> Optional[int]:
    """Samples in ``batch``: ``size(0)`` of the first tensor found (dicts, lists, tuples searched
    depth-first); ``None`` when there is no tensor with a batch dimension."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for b in batch:
            n = batch_size_of(b)
            if n is not None:
                return n
    return None


def _reduce_sum(trainer: Any, values: list[float]) -> list[float]:
    """Sum ``values`` over all ranks with the strategy's reduce (a collective when world_size > 1)."""
    dev = trainer.strategy.root_device
    dtype = torch.float32 if dev.type == "mps" else torch.float64
    t = torch.tensor(values, dtype=dtype, device=dev)
    out = trainer.strategy.reduce(t, reduce_op="sum")
    return [float(v) for v in out.detach().cpu().tolist()]


def _log(trainer: Any, metrics: dict[str, float], step: Optional[int] = None) -> None:
    if not trainer.is_global_zero or not metrics:
        return
    step = trainer.global_step if step is None else step
    for lg in trainer.loggers:
        lg.log_metrics(metrics, step=step)


def _log_dir(trainer: Any) -> str:
    """Log directory; ``trainer.log_dir`` broadcasts, so call it on every rank (we do it in ``setup``)."""
    return trainer.log_dir or trainer.default_root_dir


def _check_positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return value


def _check_positive_float(name: str, value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} must be a number > 0 or None")
    return float(value)


# ---------------------------------------------------------------------------------------- energy
class EnergyMonitor(Callback):
    """Energy per step and per sample, summed over all ranks, measured where a counter exists.

    Every rank opens a reader for its own device (:func:`~lightning_pipedap.measure.energy.open_energy_reader`:
    NVML for a CUDA rank, else RAPL -- counted by local rank 0 only, since it covers the socket --, else
    an *estimate* of ``estimate_watts`` x busy seconds). Over windows of ``window_steps`` training steps
    the window's joules, samples and wall time are summed over ranks and global rank 0 logs, with
    ``<p>`` = ``energy/measured_`` if every rank measured, else ``energy/estimated_``:

    * ``<p>J_per_step``: J of all ranks per training step of the job (J); a step is one training
      batch (one micro-batch under gradient accumulation), as in all three callbacks;
    * ``<p>J_per_sample``: J per training sample of the global batch (J);
    * ``<p>mean_W``: window J / window wall time (W, all ranks together);
    * ``<p>total_J``: J since ``on_train_start``, including validation and checkpointing (J);
    * ``<p>saving_pct``: ``100 * (1 - J_per_sample / reference J_per_sample)`` when a reference is given.

    Measured and estimated numbers never share a tag. The source is recorded as the hyperparameters
    ``energy_source``/``energy_kind`` (and as TensorBoard text), in :attr:`energy_source`,
    :attr:`energy_kind` and the callback state. Validation interrupts a window (it is dropped, not
    logged); its energy still counts in ``total_J``. On CUDA the device is synchronised at window edges.

    Args:
        window_steps: steps per window (>= 1). NVML updates every 20-100 ms: choose windows >= ~0.5 s.
        source: ``"auto"`` (NVML -> RAPL -> estimate) or one of ``"nvml"``, ``"rapl"``, ``"estimate"``.
        estimate_watts: W per busy CPU core (``estimate_basis="cpu"``) or per device (``"wall"``) for
            the estimate. An assumption, recorded in ``energy_source``.
        estimate_basis: ``"cpu"`` (CPU seconds of the process and its children) or ``"wall"``.
        reference_J_per_sample: reference energy per sample (J) for ``saving_pct``; assumed to be of
            the same kind (measured/estimated) as this run.
        reference_file: a summary JSON of a reference run (keys ``energy_J_per_sample``,
            ``energy_kind``); used only when its ``energy_kind`` equals this run's.
        summary_file: file name (in the log directory) or path of this run's summary; ``None``: none.
        batch_size: samples per batch per rank; ``None``: from the batch's first tensor.
        rapl_root: powercap directory (tests).

    Raises:
        ValueError: bad argument (message names it and the valid choices).
        FileNotFoundError: ``reference_file`` does not exist (at ``setup``).
        EnergyUnavailable: an explicitly requested ``source`` is not available (at ``setup``).
    """

    #: reads neither weights nor gradients: no observer for PipeDAPStrategy (lightning_pipedap.strategy.observers)
    pipedap_reads_model = False

    def __init__(
        self,
        window_steps: int = 10,
        source: str = "auto",
        estimate_watts: float = 10.0,
        estimate_basis: str = "cpu",
        reference_J_per_sample: Optional[float] = None,
        reference_file: Optional[str] = None,
        summary_file: Optional[str] = SUMMARY_FILE,
        batch_size: Optional[int] = None,
        rapl_root: str = DEFAULT_RAPL_ROOT,
    ) -> None:
        self.window_steps = _check_positive_int("window_steps", window_steps)
        if reference_J_per_sample is not None and reference_file is not None:
            raise ValueError("give reference_J_per_sample or reference_file, not both")
        self.source = source
        self.estimate_watts = estimate_watts
        self.estimate_basis = estimate_basis
        self.reference_J_per_sample = _check_positive_float("reference_J_per_sample", reference_J_per_sample)
        self.reference_file = reference_file
        self.summary_file = summary_file
        self.batch_size = None if batch_size is None else _check_positive_int("batch_size", batch_size)
        self.rapl_root = rapl_root
        # results
        self.energy_source: Optional[str] = None  # this rank's source
        self.energy_kind: Optional[str] = None  # job-wide: "measured" or "estimated"
        self.total_J = 0.0  # job-wide, as last reduced
        self.history: list[dict[str, float]] = []  # logged metrics per window
        self._reader: Optional[EnergyReader] = None
        self._offset_J = 0.0  # total of a resumed run
        self._ref_file_data: Optional[dict[str, Any]] = None
        self._reset_window()
        self._sums = {"J": 0.0, "steps": 0.0, "samples": 0.0, "wall": 0.0}
        self._warned: set[str] = set()
        self._log_dir = ""

    def _reset_window(self) -> None:
        self._win_open = False
        self._win_t0 = self._win_J0 = 0.0
        self._win_steps = 0
        self._win_samples = 0
        self._win_samples_known = True

    # ----------------------------------------------------------------- life cycle
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self._log_dir = _log_dir(trainer)
        if self.reference_file is not None:
            self._ref_file_data = read_summary(self.reference_file)
        self._reader, notes = open_energy_reader(
            self.source, cuda_index=self._cuda_index(trainer), read_rapl=trainer.local_rank == 0,
            estimate_watts=self.estimate_watts, estimate_basis=self.estimate_basis, rapl_root=self.rapl_root,
        )
        self.energy_source = self._reader.source
        if self._reader.kind == ESTIMATED:
            rank_zero_warn(
                f"EnergyMonitor: no energy counter ({'; '.join(notes)}); logging ESTIMATED energy "
                f"({self.energy_source}) under energy/estimated_* -- an assumption, not a measurement"
            )
        else:
            rank_zero_info(f"EnergyMonitor: measuring energy with {self.energy_source}")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._sync(trainer)
        self._J_train0 = self._read()
        self._t_train0 = time.perf_counter()
        if trainer.is_global_zero:
            params = {"energy_source": self.energy_source, "energy_reader_kind": self._reader.kind}
            if self._reader.kind == ESTIMATED:
                params["energy_estimate_watts"] = float(self.estimate_watts)
                params["energy_estimate_basis"] = self.estimate_basis
            for lg in trainer.loggers:
                lg.log_hyperparams(params)
                if isinstance(lg, TensorBoardLogger):
                    lg.experiment.add_text("energy/source", f"{self.energy_source} ({self._reader.kind}, rank 0)", 0)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self._win_open:
            self._sync(trainer)
            self._win_open = True
            self._win_t0 = time.perf_counter()
            self._win_J0 = self._read()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._win_open:
            return
        self._win_steps += 1
        n = self.batch_size if self.batch_size is not None else batch_size_of(batch)
        if n is None:
            self._win_samples_known = False
        else:
            self._win_samples += n
        if self._win_steps >= self.window_steps:
            self._close_window(trainer)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._reset_window()  # a partial window is dropped: validation is not training work

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._reset_window()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._reader is None:
            return
        self._sync(trainer)
        total_local = self._read() - self._J_train0
        est, total = _reduce_sum(trainer, [1.0 if self._reader.kind == ESTIMATED else 0.0, total_local])
        self._set_kind(trainer, est)
        self.total_J = self._offset_J + total
        prefix = f"energy/{self.energy_kind}_"
        _log(trainer, {prefix + "total_J": self.total_J})
        if trainer.is_global_zero and self.summary_file:
            s = self._sums
            summary: dict[str, Any] = {"energy_kind": self.energy_kind, "energy_source": self.energy_source,
                                       "energy_total_J": self.total_J}
            if s["steps"] > 0:
                summary["energy_J_per_step"] = s["J"] / s["steps"]
                summary["energy_mean_W"] = s["J"] / s["wall"] if s["wall"] > 0 else None
            if s["samples"] > 0:
                summary["energy_J_per_sample"] = s["J"] / s["samples"]
            update_summary(self._summary_path(), summary)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def state_dict(self) -> dict[str, Any]:
        return {"energy_source": self.energy_source, "energy_kind": self.energy_kind, "total_J": self.total_J}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._offset_J = float(state_dict.get("total_J", 0.0))

    # ----------------------------------------------------------------- internals
    @staticmethod
    def _cuda_index(trainer: Any) -> Optional[int]:
        """This rank's CUDA device index, or ``None`` when it does not train on CUDA."""
        dev = trainer.strategy.root_device
        return (dev.index or 0) if dev.type == "cuda" else None

    def _summary_path(self) -> str:
        return self.summary_file if os.path.isabs(self.summary_file) else os.path.join(self._log_dir, self.summary_file)

    def _read(self) -> float:
        return self._reader.read_J() if self._reader is not None else 0.0

    @staticmethod
    def _sync(trainer: Any) -> None:
        dev = trainer.strategy.root_device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def _set_kind(self, trainer: Any, estimated_ranks: float) -> None:
        kind = ESTIMATED if estimated_ranks > 0.5 else MEASURED
        if kind == ESTIMATED and estimated_ranks < trainer.world_size - 0.5 and "mixed" not in self._warned:
            self._warned.add("mixed")
            rank_zero_warn(f"EnergyMonitor: {estimated_ranks:.0f} of {trainer.world_size} ranks have no energy "
                           "counter; the sum is labelled estimated")
        self.energy_kind = kind

    def _reference(self) -> Optional[float]:
        if self.reference_J_per_sample is not None:
            return self.reference_J_per_sample
        ref = self._ref_file_data
        if ref is None:
            return None
        if ref.get("energy_kind") != self.energy_kind or not ref.get("energy_J_per_sample"):
            if "ref" not in self._warned:
                self._warned.add("ref")
                rank_zero_warn(f"EnergyMonitor: reference {self.reference_file!r} has energy_kind="
                               f"{ref.get('energy_kind')!r}, energy_J_per_sample={ref.get('energy_J_per_sample')!r}; "
                               f"this run is {self.energy_kind!r}: no energy saving logged")
            return None
        return float(ref["energy_J_per_sample"])

    def _close_window(self, trainer: Any) -> None:
        self._sync(trainer)
        t1, J1 = time.perf_counter(), self._read()
        wall = t1 - self._win_t0
        known = 1.0 if self._win_samples_known else 0.0
        est, J, samples, walls, known_ranks, total = _reduce_sum(trainer, [
            1.0 if self._reader.kind == ESTIMATED else 0.0, J1 - self._win_J0, float(self._win_samples),
            wall, known, J1 - self._J_train0,
        ])
        steps = self._win_steps
        self._reset_window()
        # the next window starts where this one ended
        self._win_open, self._win_t0, self._win_J0 = True, t1, J1
        self._set_kind(trainer, est)
        self.total_J = self._offset_J + total
        wall_mean = walls / trainer.world_size
        p = f"energy/{self.energy_kind}_"
        m = {p + "J_per_step": J / steps, p + "total_J": self.total_J}
        if wall_mean > 0:
            m[p + "mean_W"] = J / wall_mean
        if wall_mean < 0.5 and self._reader.source.startswith("nvml") and "short" not in self._warned:
            self._warned.add("short")
            rank_zero_warn(f"EnergyMonitor: window of {steps} steps lasted {wall_mean * 1e3:.0f} ms; NVML updates "
                           "every 20-100 ms, so raise window_steps for accurate joules")
        self._sums["J"] += J
        self._sums["steps"] += steps
        self._sums["wall"] += wall_mean
        if known_ranks > trainer.world_size - 0.5 and samples > 0:
            m[p + "J_per_sample"] = J / samples
            self._sums["samples"] += samples
            ref = self._reference()
            if ref is not None:
                m[p + "saving_pct"] = 100.0 * (1.0 - (J / samples) / ref)
        elif "samples" not in self._warned:
            self._warned.add("samples")
            rank_zero_warn("EnergyMonitor: batch size unknown (no tensor in the batch); pass batch_size= "
                           "to log J per sample")
        self.history.append(m)
        _log(trainer, m)


# --------------------------------------------------------------------------------------- speedup
class SpeedupMonitor(Callback):
    """Iteration time, throughput and speedup, as medians over windows after a warm-up.

    The iteration time of step ``i`` is ``start(i+1) - start(i)`` from ``on_train_batch_start``
    (``time.perf_counter``): start-to-start, because a strategy may defer the end of step ``i``
    (all-gather, update) into the forward of step ``i+1``. Intervals spanning validation or an epoch
    boundary are discarded, and the first ``warmup_steps`` intervals too. Every ``window_steps``
    intervals, global rank 0 logs

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
        self.warmup_steps = _check_positive_int("warmup_steps", warmup_steps, minimum=0)
        self.window_steps = _check_positive_int("window_steps", window_steps)
        if reference_iteration_s is not None and reference_file is not None:
            raise ValueError("give reference_iteration_s or reference_file, not both")
        self.reference_iteration_s = _check_positive_float("reference_iteration_s", reference_iteration_s)
        self.reference_file = reference_file
        self.summary_file = summary_file
        self.batch_size = None if batch_size is None else _check_positive_int("batch_size", batch_size)
        self._clock = clock or time.perf_counter
        self.history: list[dict[str, float]] = []
        self.intervals_s: list[float] = []  # all post-warm-up intervals of this rank
        self._window: list[float] = []
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
        self._log_dir = _log_dir(trainer)
        if self.reference_file is not None:
            ref = read_summary(self.reference_file)
            self._ref_iter_s = ref.get("iteration_s")
            self._ref_thr = ref.get("throughput_samples_per_s")
            if not self._ref_iter_s and not self._ref_thr:
                raise ValueError(f"reference_file={self.reference_file!r} has neither iteration_s nor "
                                 "throughput_samples_per_s")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        now = self._clock()
        if self._last is not None:
            self._seen += 1
            if self._seen > self.warmup_steps:
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

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._last = None

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._last = None

    def _log_window(self, trainer: Any) -> None:
        med = statistics.median(self._window)
        known = 1.0 if self._samples_known else 0.0
        samples = sum(self._window_samples) / len(self._window_samples) if self._window_samples else 0.0
        med_sum, samples_sum, known_sum = _reduce_sum(trainer, [med, samples, known])
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
        _log(trainer, m)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        med = statistics.median(self.intervals_s) if self.intervals_s else 0.0
        med_sum, have = _reduce_sum(trainer, [med, 1.0 if self.intervals_s else 0.0])
        if not trainer.is_global_zero or not self.summary_file:
            return
        if have < trainer.world_size - 0.5:
            rank_zero_warn(f"SpeedupMonitor: fewer than warmup_steps+1={self.warmup_steps + 1} timed steps; "
                           "no iteration time in the summary")
            return
        it_s = med_sum / trainer.world_size
        summary: dict[str, Any] = {"iteration_s": it_s}
        if self._samples_per_step:
            summary["samples_per_step"] = self._samples_per_step
            summary["throughput_samples_per_s"] = self._samples_per_step / it_s
        path = self.summary_file if os.path.isabs(self.summary_file) else os.path.join(self._log_dir, self.summary_file)
        update_summary(path, summary)


# -------------------------------------------------------------------------------------- timeline
class CommTimeline(Callback):
    """Start/end of every compute, communication and compression operation of sampled steps.

    A sampled step is the interval from its ``on_train_batch_start`` to the next one (start-to-start:
    one period of a pipelined schedule, which contains the all-gathers deferred from the previous
    step). Steps ``warmup_steps, warmup_steps + every_n_steps, ...`` (counted in training batches) are
    sampled. For a sampled step the callback

    * records compute itself from callback hooks: ``forward`` = batch start -> ``on_before_zero_grad``
      or ``on_before_backward``; ``backward`` = ``on_before_backward`` -> ``on_after_backward``;
      ``update`` = ``on_before_optimizer_step`` -> ``on_train_batch_end`` (host times; on CUDA these
      are issue times);
    * if the strategy has ``timeline_enabled``, sets it ``True`` for the step, and if it has
      ``take_timeline()``, collects its records (:class:`OpRecord`, or op timings with ``op``,
      ``start_s``, ``end_s``) at the end -- a strategy's own compute records replace the callback's
      of the same kind; without ``take_timeline`` (e.g. plain ``ddp``) only compute lanes are recorded
      and a rank-zero warning says so once;
    * a strategy may also report ``wait`` records (its training thread blocked on communication, e.g.
      an all-gather awaited in a forward pre-hook); they are subtracted from compute, so a stalled
      forward does not count as hiding communication;
    * logs (global rank 0, averaged over ranks) ``timeline/step_ms``, ``timeline/compute_ms`` (busy
      compute), and,
      with communication records, ``timeline/comm_ms``, ``timeline/exposed_comm_ms``,
      ``timeline/overlap_ratio`` (``1 - sum exposed / sum comm``), with compression records
      ``timeline/compress_ms``, ``timeline/exposed_compress_ms``; all clipped to the step's interval;
    * writes ``<log_dir>/<trace_dir>/step<global_step>_rank<r>.trace.json`` (Chrome trace, every rank)
      and, on rank 0, a Gantt PNG next to it and as the TensorBoard image ``timeline/gantt``.

    Args:
        every_n_steps: sampling period in training batches (>= 1).
        warmup_steps: first sampled batch (>= 0); skip the first steps (bucket rebuild, planning).
        trace_dir: folder under the log directory for trace and PNG files.
        log_gantt: render the Gantt chart (PNG file and TensorBoard image).
        clock: seconds clock (tests); must be the clock of the strategy's records
            (default ``time.perf_counter``).

    Attributes:
        last_records: the records of the last sampled step on this rank.
        last_window: its ``(start_s, end_s)``.
        trace_files: trace files written by this rank.
        history: logged metrics per sampled step.
    """

    #: reads neither weights nor gradients: no observer for PipeDAPStrategy (lightning_pipedap.strategy.observers)
    pipedap_reads_model = False

    def __init__(
        self,
        every_n_steps: int = 50,
        warmup_steps: int = 3,
        trace_dir: str = "timeline",
        log_gantt: bool = True,
        clock: Optional[Callable[[], float]] = None,
    ) -> None:
        self.every_n_steps = _check_positive_int("every_n_steps", every_n_steps)
        self.warmup_steps = _check_positive_int("warmup_steps", warmup_steps, minimum=0)
        self.trace_dir = trace_dir
        self.log_gantt = bool(log_gantt)
        self._clock = clock or time.perf_counter
        self.last_records: list[OpRecord] = []
        self.last_window: Optional[tuple[float, float]] = None
        self.trace_files: list[str] = []
        self.history: list[dict[str, float]] = []
        self._batches = 0
        self._open: Optional[dict[str, Any]] = None
        self._warned = False
        self._log_dir = ""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._log_dir = _log_dir(trainer)

    def _sampled(self, n: int) -> bool:
        return n >= self.warmup_steps and (n - self.warmup_steps) % self.every_n_steps == 0

    # ----------------------------------------------------------------- hooks
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        now = self._clock()
        if self._open is not None:
            self._close(trainer, now)
        n = self._batches
        self._batches += 1
        if not self._sampled(n):
            return
        strategy = trainer.strategy
        has_take = callable(getattr(strategy, "take_timeline", None))
        if hasattr(strategy, "timeline_enabled"):
            strategy.timeline_enabled = True
        if has_take:
            strategy.take_timeline()  # drop stale records; lets the strategy apply the flag
        elif not self._warned:
            self._warned = True
            rank_zero_warn(f"CommTimeline: strategy {type(strategy).__name__} has no take_timeline(); recording "
                           "compute lanes only (no exposed communication / overlap ratio)")
        self._open = {"t0": self._clock(), "step": trainer.global_step, "has_take": has_take,
                      "records": [], "fwd_end": None, "bwd0": None, "upd0": None}

    def _forward_done(self) -> None:
        o = self._open
        if o is not None and o["fwd_end"] is None:
            o["fwd_end"] = self._clock()
            o["records"].append(OpRecord("forward", "forward", None, o["t0"], o["fwd_end"], "compute"))

    def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._forward_done()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._forward_done()
        if self._open is not None:
            self._open["bwd0"] = self._clock()

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        o = self._open
        if o is not None and o["bwd0"] is not None:
            o["records"].append(OpRecord("backward", "backward", None, o["bwd0"], self._clock(), "compute"))
            o["bwd0"] = None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._open is not None:
            self._open["upd0"] = self._clock()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        o = self._open
        if o is not None and o["upd0"] is not None:
            o["records"].append(OpRecord("update", "update", None, o["upd0"], self._clock(), "compute"))
            o["upd0"] = None

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self._open is not None:
            self._close(trainer, self._clock())

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._open is not None:
            self._close(trainer, self._clock())

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._open is not None:
            self._close(trainer, self._clock())

    # ----------------------------------------------------------------- closing a sample
    def _close(self, trainer: Any, t1: float) -> None:
        o, self._open = self._open, None
        strategy = trainer.strategy
        if hasattr(strategy, "timeline_enabled"):
            strategy.timeline_enabled = False
        theirs = as_op_records(strategy.take_timeline()) if o["has_take"] else []
        their_kinds = {r.kind for r in theirs}
        records = [r for r in o["records"] if r.kind not in their_kinds] + theirs
        window = (o["t0"], t1)
        self.last_records, self.last_window = records, window
        comm = communication_ms(records, window=window)
        exposed = exposed_communication_ms(records, window=window)
        compute = compute_ms(records, window=window)
        compress = communication_ms(records, kinds=COMPRESS_KINDS, window=window)
        exposed_c = exposed_communication_ms(records, comm_kinds=COMPRESS_KINDS, window=window)
        step_ms = 1000.0 * (t1 - o["t0"])
        has_comm = 1.0 if o["has_take"] else 0.0
        sums = _reduce_sum(trainer, [step_ms, compute, comm, exposed, compress, exposed_c, has_comm])
        w = trainer.world_size
        step_s, compute_s, comm_s, exposed_s, compress_s, exposed_cs, has_comm_s = sums
        m = {"timeline/step_ms": step_s / w, "timeline/compute_ms": compute_s / w}
        if has_comm_s > w - 0.5:
            m["timeline/comm_ms"] = comm_s / w
            m["timeline/exposed_comm_ms"] = exposed_s / w
            if comm_s > 0:
                m["timeline/overlap_ratio"] = 1.0 - exposed_s / comm_s
        if compress_s > 0:
            m["timeline/compress_ms"] = compress_s / w
            m["timeline/exposed_compress_ms"] = exposed_cs / w
        self.history.append(m)
        _log(trainer, m, step=o["step"])
        rank = trainer.global_rank
        base = os.path.join(self._log_dir, self.trace_dir, f"step{o['step']:07d}_rank{rank}")
        self.trace_files.append(write_chrome_trace(records, base + ".trace.json", rank=rank, origin_s=o["t0"]))
        if self.log_gantt and trainer.is_global_zero:
            title = f"step {o['step']}, rank {rank}: step {step_ms:.1f} ms"
            if has_comm:
                title += f", exposed comm {exposed:.1f} ms of {comm:.1f} ms"
            gantt_png(records, base + ".png", title=title, origin_s=o["t0"])
            for lg in trainer.loggers:
                if isinstance(lg, TensorBoardLogger):
                    img = gantt_rgb(records, title=title, origin_s=o["t0"])
                    lg.experiment.add_image("timeline/gantt", img, o["step"], dataformats="HWC")


class CompressionMonitor(Callback):
    """Per-bucket compression telemetry of :class:`~lightning_pipedap.PipeDAPStrategy` with ``compression=``.

    Every ``every_n_steps`` optimizer steps it reads ``trainer.strategy.compression_stats()`` (the
    last round of each bucket) on rank 0 and logs, per bucket ``b``:
    ``compress/b{b}/ratio`` (dense bytes ÷ payload bytes), ``compress/b{b}/compress_ms`` (helper time),
    ``compress/b{b}/hidden_ms`` (compression time not waited for by the communication worker, i.e.
    hidden behind backward by the pipeline), plus totals ``compress/ratio``, ``compress/compress_ms``,
    ``compress/hidden_pct``. Logs nothing (with one info line) when the strategy does not compress.

    Args:
        every_n_steps: logging period in optimizer steps (>= 1).
    """

    #: reads neither weights nor gradients: no observer for PipeDAPStrategy (lightning_pipedap.strategy.observers)
    pipedap_reads_model = False

    def __init__(self, every_n_steps: int = 20) -> None:
        self.every_n_steps = _check_positive_int("every_n_steps", every_n_steps)
        self._said = False

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not trainer.is_global_zero or trainer.global_step % self.every_n_steps:
            return
        getter = getattr(trainer.strategy, "compression_stats", None)
        stats = getter() if getter is not None else {}
        if not stats:
            if not self._said:
                rank_zero_info("CompressionMonitor: the strategy reports no compression statistics; nothing to log")
                self._said = True
            return
        m: dict[str, float] = {}
        dense = payload = comp = hidden = 0.0
        for b, s in sorted(stats.items()):
            h = max(0.0, s.compress_s - s.wait_s)
            m[f"compress/b{b}/ratio"] = s.ratio
            m[f"compress/b{b}/compress_ms"] = 1e3 * s.compress_s
            m[f"compress/b{b}/hidden_ms"] = 1e3 * h
            dense, payload, comp, hidden = dense + s.dense_bytes, payload + s.payload_bytes, comp + s.compress_s, hidden + h
        m["compress/ratio"] = dense / payload if payload else 1.0
        m["compress/compress_ms"] = 1e3 * comp
        m["compress/hidden_pct"] = 100.0 * hidden / comp if comp else 0.0
        _log(trainer, m)
