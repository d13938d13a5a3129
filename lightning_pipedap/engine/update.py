"""Applying reduced gradients: per-bucket optimizer updates (deferred mode) and write-back (sync mode).

Deferred mode (DeAR ICDCS 2023 §III-B; PipeDAP TETC 2025 §IV): the optimizer step of iteration t
is split per bucket and each part runs when that bucket's all-gather lands, in the forward pre-hook
of iteration t+1. For a *per-parameter* optimizer (SGD, Adam, AdamW, ...) the step restricted to a
bucket's parameters is exactly the full step's effect on them, so the result equals DDP's.
The bucket's step uses the hyper-parameters snapshotted when iteration t's ``optimizer_step``
ran, so LR schedulers that step in between do not leak into update t.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
from torch.optim import Optimizer

from lightning_pipedap.engine.buckets import FlatBucket

#: torch optimizers whose step is a per-parameter function of (param, grad, per-param state, group
#: hyper-parameters), so running it bucket by bucket equals one full step.
PER_PARAMETER_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Rprop", "ASGD")
    if hasattr(torch.optim, name)
)


def snapshot_hparams(optimizer: Optimizer) -> list[dict[str, Any]]:
    """Copy every param group's hyper-parameters (all keys but ``params``); tensors are cloned."""
    return [
        {k: (v.clone() if torch.is_tensor(v) else v) for k, v in g.items() if k != "params"}
        for g in optimizer.param_groups
    ]


@dataclass
class ClipRequest:
    """Gradient clipping asked for by Lightning in ``_after_closure`` for one step.

    Attributes:
        value: clip threshold (> 0).
        algorithm: ``"norm"`` (global 2-norm, as ``torch.nn.utils.clip_grad_norm_``) or ``"value"``.
    """

    value: float
    algorithm: str


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """``min(1, max_norm / (total_norm + 1e-6))``, the factor ``clip_grad_norm_`` applies (torch semantics:
    a NaN norm gives a NaN factor, so every clipped gradient becomes NaN, as ``torch.clamp`` keeps NaN)."""
    coef = max_norm / (total_norm + 1e-6)
    return coef if coef != coef else min(1.0, coef)


def shard_sum_of_squares(buckets: Iterable[FlatBucket], rank: int) -> float:
    """Σ g² over the gradient elements of ``rank``'s shard of every reduced bucket (float64 on host).

    After reduce-scatter each rank holds its own shard reduced, so the global 2-norm is
    ``sqrt(all_reduce_sum(this))`` with one scalar all-reduce.
    """
    total = None
    for b in buckets:
        lo, hi = b.own_data_range(rank)
        if hi > lo:
            s = b.buffer[lo:hi].double().pow(2).sum()
            total = s if total is None else total + s
    return 0.0 if total is None else float(total)


class BucketOptimizer:
    """Runs ``optimizer``'s step restricted to one bucket's parameters.

    Args:
        optimizer: a per-parameter torch optimizer (see :data:`PER_PARAMETER_OPTIMIZERS`).
        buckets: the engine's buckets.

    The restricted step runs the optimizer class's ``step`` on a shallow view of ``optimizer``
    whose ``param_groups`` hold only the bucket's parameters (state, defaults and hooks shared).
    Parameters of a bucket that belong to no param group are not updated (as with DDP).
    """

    def __init__(self, optimizer: Optimizer, buckets: Sequence[FlatBucket]) -> None:
        self.optimizer = optimizer
        group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        # per bucket: list of (group index, [(slot, param)])
        self._members: list[list[tuple[int, list[tuple[int, torch.Tensor]]]]] = []
        for b in buckets:
            per_group: dict[int, list[tuple[int, torch.Tensor]]] = {}
            for slot, p in enumerate(b.params):
                gi = group_of.get(id(p))
                if gi is not None:
                    per_group.setdefault(gi, []).append((slot, p))
            self._members.append(sorted(per_group.items()))

    def step(self, bucket: FlatBucket, hparams: list[dict[str, Any]], clip: ClipRequest | None, coef: float | None,
             used: list[bool] | None = None) -> None:
        """Apply the update of ``bucket`` from its reduced gradients (call under ``torch.no_grad``).

        Args:
            bucket: a bucket whose AG/AR has finished.
            used: per parameter, whether any rank produced a gradient (default: read the reduced flags).
                A parameter no rank produced a gradient for is stepped with its own ``.grad`` when that is
                not None (``zero_grad(set_to_none=False)`` left a zero tensor: DDP steps it too, so momentum
                and weight decay move it) and skipped when it is None.
            hparams: :func:`snapshot_hparams` taken at the step's ``optimizer_step``.
            clip: the step's clip request, or ``None``.
            coef: the global clip-by-norm coefficient (required when ``clip.algorithm == "norm"``).
        """
        members = self._members[bucket.index]
        if not members:
            return
        if used is None:
            used = (bucket.flags > 0).tolist()
        groups, saved = [], []
        for gi, slots in members:
            plist = []
            for slot, p in slots:
                saved.append((p, p.grad))
                if used[slot]:
                    g = bucket.grad_view(slot)
                elif p.grad is not None:
                    # unused on every rank but ``.grad`` kept (``zero_grad(set_to_none=False)``): DDP leaves
                    # ``.grad`` untouched and the optimizer steps the parameter with it (momentum, weight decay)
                    g = p.grad
                else:
                    continue  # no gradient anywhere: not stepped, as with DDP
                if clip is not None and clip.algorithm == "value":
                    g.clamp_(-clip.value, clip.value)
                elif clip is not None and coef is not None:
                    g.mul_(coef)
                p.grad = g
                plist.append(p)
            if plist:
                groups.append(dict(hparams[gi], params=plist))
        try:
            if groups:
                view = object.__new__(type(self.optimizer))
                view.__dict__.update(self.optimizer.__dict__)
                view.param_groups = groups
                type(self.optimizer).step(view)
        finally:
            for p, g in saved:
                p.grad = g


def write_back_grads(bucket: FlatBucket, used: list[bool] | None = None) -> None:
    """Sync mode: set each parameter's ``.grad`` to its reduced (averaged) gradient.

    Parameters that no rank produced a gradient for keep their ``.grad`` untouched (DDP semantics).
    ``used`` (per parameter, any rank had a gradient) defaults to the reduced flags. On a bucket with
    ``as_view`` a ``.grad`` that is the bucket's view (or None) is pointed at the view: no copy.
    """
    if used is None:
        used = (bucket.flags > 0).tolist()
    for slot, p in enumerate(bucket.params):
        if not used[slot]:
            continue
        g = bucket.grad_view(slot)
        if bucket.as_view and (p.grad is None or bucket.is_view(slot, p.grad)):
            p.grad = g  # gradient_as_bucket_view: .grad is the reduced view itself, nothing to copy
        elif p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
