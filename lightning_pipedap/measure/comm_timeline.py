"""Lightning callback :class:`CommTimeline`: the compute, communication and compression operations of
sampled steps, as metrics, Chrome traces and Gantt charts."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

from lightning.pytorch import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn

from lightning_pipedap.measure._common import check_int_at_least, log_dir, log_metrics, reduce_sum
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
      and, on rank 0, a Gantt PNG next to it and as the TensorBoard image ``timeline/gantt``; every operation
      is labelled with the iteration it belongs to (``"it 12: AR0"``: a deferred all-gather or update of the
      previous iteration runs in this step's forward), the callback's own compute records with the step's
      (when the strategy has ``take_timeline``: without it every record is the step's own).

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
        self.every_n_steps = check_int_at_least("every_n_steps", every_n_steps)
        self.warmup_steps = check_int_at_least("warmup_steps", warmup_steps, minimum=0)
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
            self._log_dir = log_dir(trainer)

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
                      # (the compute records name the step when the strategy's records can be of another one)
                      "it": trainer.global_step if has_take else None,
                      "records": [], "fwd_end": None, "bwd0": None, "upd0": None}

    def _forward_done(self) -> None:
        o = self._open
        if o is not None and o["fwd_end"] is None:
            o["fwd_end"] = self._clock()
            o["records"].append(OpRecord("forward", "forward", None, o["t0"], o["fwd_end"], "compute", o["it"]))

    def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._forward_done()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._forward_done()
        if self._open is not None:
            self._open["bwd0"] = self._clock()

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        o = self._open
        if o is not None and o["bwd0"] is not None:
            o["records"].append(OpRecord("backward", "backward", None, o["bwd0"], self._clock(), "compute", o["it"]))
            o["bwd0"] = None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._open is not None:
            self._open["upd0"] = self._clock()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        o = self._open
        if o is not None and o["upd0"] is not None:
            o["records"].append(OpRecord("update", "update", None, o["upd0"], self._clock(), "compute", o["it"]))
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
        sums = reduce_sum(trainer, [step_ms, compute, comm, exposed, compress, exposed_c, has_comm])
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
        log_metrics(trainer, m, step=o["step"])
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

