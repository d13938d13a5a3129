"""Lightning callback :class:`CompressionMonitor`: per-bucket compression ratio, time and hidden share."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info

from lightning_pipedap.measure._common import check_int_at_least, log_metrics


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
        self.every_n_steps = check_int_at_least("every_n_steps", every_n_steps)
        self._said = False

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not trainer.is_global_zero or trainer.global_step % self.every_n_steps:
            return
        getter = getattr(trainer.strategy, "compression_stats", None)
        stats = getter() if getter is not None else {}
        if not stats:
            # quiet when nothing was asked to compress (the app adds this callback to every run)
            if not self._said and getattr(trainer.strategy, "compression", None):
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
            dense, payload = dense + s.dense_bytes, payload + s.payload_bytes
            comp, hidden = comp + s.compress_s, hidden + h
        m["compress/ratio"] = dense / payload if payload else 1.0
        m["compress/compress_ms"] = 1e3 * comp
        m["compress/hidden_pct"] = 100.0 * hidden / comp if comp else 0.0
        log_metrics(trainer, m)
