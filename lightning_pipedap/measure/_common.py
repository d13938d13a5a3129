"""What the measurement callbacks share: batch sizes, cross-rank sums, rank-0 logging, argument checks.

Every callback works with any strategy (single device, ``ddp``, ``pipedap``), takes only scalar
constructor arguments (so Hydra can instantiate it), logs through ``trainer.loggers`` from global
rank 0 and keeps its results in attributes for plain-Python use. Cross-rank values are summed with
``trainer.strategy.reduce(tensor, reduce_op="sum")`` (:func:`reduce_sum`) at step counts that are
identical on every rank, so the collectives line up.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


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


def reduce_sum(trainer: Any, values: list[float]) -> list[float]:
    """Sum ``values`` over all ranks with the strategy's reduce (a collective when world_size > 1)."""
    dev = trainer.strategy.root_device
    dtype = torch.float32 if dev.type == "mps" else torch.float64
    t = torch.tensor(values, dtype=dtype, device=dev)
    out = trainer.strategy.reduce(t, reduce_op="sum")
    return [float(v) for v in out.detach().cpu().tolist()]


def log_metrics(trainer: Any, metrics: dict[str, float], step: Optional[int] = None) -> None:
    """Log ``metrics`` to every logger of the trainer, on global rank 0 only (default step: ``global_step``)."""
    if not trainer.is_global_zero or not metrics:
        return
    step = trainer.global_step if step is None else step
    for lg in trainer.loggers:
        lg.log_metrics(metrics, step=step)


def log_dir(trainer: Any) -> str:
    """Log directory; ``trainer.log_dir`` broadcasts, so every rank calls it (the callbacks do in ``setup``)."""
    return trainer.log_dir or trainer.default_root_dir


def check_int_at_least(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` when it is an int (not a bool) ``>= minimum``.

    Raises:
        ValueError: naming ``name``, the value and the minimum.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return value


def check_positive_float(name: str, value: Any) -> Optional[float]:
    """``value`` as a float when it is a number > 0, ``None`` for ``None``.

    Raises:
        ValueError: naming ``name`` and the value.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} must be a number > 0 or None")
    return float(value)
