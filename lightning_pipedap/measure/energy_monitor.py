"""Lightning callback :class:`EnergyMonitor`: energy per step and per sample, summed over all ranks."""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_pipedap.measure._common import (
    batch_size_of, check_int_at_least, check_positive_float, log_dir, log_metrics, reduce_sum,
)
from lightning_pipedap.measure.energy import (
    DEFAULT_RAPL_ROOT,
    ESTIMATED,
    MEASURED,
    EnergyReader,
    open_energy_reader,
)
from lightning_pipedap.measure.summary import SUMMARY_FILE, read_summary, summary_path, update_summary


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
        self.window_steps = check_int_at_least("window_steps", window_steps)
        if reference_J_per_sample is not None and reference_file is not None:
            raise ValueError("give reference_J_per_sample or reference_file, not both")
        self.source = source
        self.estimate_watts = estimate_watts
        self.estimate_basis = estimate_basis
        self.reference_J_per_sample = check_positive_float("reference_J_per_sample", reference_J_per_sample)
        self.reference_file = reference_file
        self.summary_file = summary_file
        self.batch_size = None if batch_size is None else check_int_at_least("batch_size", batch_size)
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
        self._log_dir = log_dir(trainer)
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
        est, total = reduce_sum(trainer, [1.0 if self._reader.kind == ESTIMATED else 0.0, total_local])
        self._set_kind(trainer, est)
        self.total_J = self._offset_J + total
        prefix = f"energy/{self.energy_kind}_"
        log_metrics(trainer, {prefix + "total_J": self.total_J})
        if trainer.is_global_zero and self.summary_file:
            s = self._sums
            summary: dict[str, Any] = {"energy_kind": self.energy_kind, "energy_source": self.energy_source,
                                       "energy_total_J": self.total_J}
            if s["steps"] > 0:
                summary["energy_J_per_step"] = s["J"] / s["steps"]
                summary["energy_mean_W"] = s["J"] / s["wall"] if s["wall"] > 0 else None
            if s["samples"] > 0:
                summary["energy_J_per_sample"] = s["J"] / s["samples"]
            update_summary(summary_path(self.summary_file, self._log_dir), summary)

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
        est, J, samples, walls, known_ranks, total = reduce_sum(trainer, [
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
        log_metrics(trainer, m)

