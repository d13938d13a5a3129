"""Applying reduced gradients: per-bucket optimizer updates (deferred mode) and write-back (sync mode).

Deferred mode (DeAR ICDCS 2023 §III-B; PipeDAP TETC 2025 §IV): the optimizer step of iteration t
is split per bucket and each part runs when that bucket's all-gather lands, in the forward pre-hook
of iteration t+1. For a *per-parameter* optimizer (SGD, Adam, AdamW, ...) the step restricted to a
bucket's parameters is exactly the full step's effect on them, so the result equals DDP's. A parameter
split over several buckets (tensor partitioning, ByteScheduler SOSP 2019) is stepped once, from all its
reduced pieces, when the last of its buckets is applied.
The bucket's step uses the hyper-parameters snapshotted when iteration t's ``optimizer_step``
ran, so LR schedulers that step in between do not leak into update t.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch.optim import Optimizer

from lightning_pipedap.engine.buckets import FlatBucket

#: torch optimizers whose step is a per-parameter function of (param, grad, per-param state, group
#: hyper-parameters), so running it bucket by bucket equals one full step.
PER_PARAMETER_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Rprop", "ASGD",
                 "Muon", "Adafactor")
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


def clip_norm_coefficient(grads: Sequence[torch.Tensor], max_norm: float) -> Optional[torch.Tensor]:
    """The factor ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` multiplies the gradients by, computed as it
    computes it: per-tensor norms in the given order (``torch.nn.utils.get_total_norm``: ``_foreach_norm`` per
    device and dtype, then the 2-norm of the stacked norms), ``max_norm / (total + 1e-6)`` in the norm's dtype,
    clamped to at most 1 (torch 2.13, ``torch/nn/utils/clip_grad.py``). With the same tensors in the same order
    the factor is bit-identical to DDP's; a NaN norm gives a NaN factor, as in torch.

    Args:
        grads: the averaged gradients, each shaped like its parameter, in the order of the optimizer's param
            groups (Lightning's ``Precision.main_params``), those that are None under DDP left out.
        max_norm: the clip threshold (> 0).

    Returns:
        A 0-dim tensor (multiply each gradient by it), or None when ``grads`` is empty (torch clips nothing).
    """
    if not grads:
        return None
    total = torch.nn.utils.get_total_norm(list(grads), 2.0, error_if_nonfinite=False)
    return torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)


def averaged_grads(engine: Any, optimizer: Optimizer, grads: Optional[dict] = None) -> list[torch.Tensor]:
    """The gradients ``clip_grad_norm_`` would see under DDP once every bucket of ``engine`` (a
    :class:`~lightning_pipedap.engine.engine.CommEngine`) is gathered, in ``optimizer``'s parameter order: a
    parameter some rank produced a gradient for gives its averaged gradient (its bucket view; a split parameter's
    pieces concatenated, shaped like it), one no rank did gives its ``.grad`` as DDP leaves it (skipped when None;
    ``grads``: ``id(param) -> .grad`` to read instead, the sharded step's snapshot)."""
    index = {id(p): i for i, p in enumerate(engine.params)}
    used = {b: engine.used_flags(b) for b in range(engine.num_buckets)}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            i = index.get(id(p))
            places = engine.places.get(i, []) if i is not None else []
            if places and used[places[0][0]][places[0][1]]:
                views = [engine.buckets[b].grad_view(s) for b, s, _, _ in places]
                out.append(views[0] if len(views) == 1 and views[0].shape == p.shape
                           else torch.cat([v.reshape(-1) for v in views]).view_as(p))
            elif (g := p.grad if grads is None else grads.get(id(p))) is not None:
                out.append(g)
    return out


class BucketOptimizer:
    """Runs ``optimizer``'s step restricted to one bucket's parameters.

    Args:
        optimizer: a per-parameter torch optimizer (see :data:`PER_PARAMETER_OPTIMIZERS`).
        buckets: the engine's buckets.
        landed: ``landed(b)``: whether bucket ``b``'s update was applied in this optimizer step (the engine's
            bucket states: :class:`~lightning_pipedap.engine.bucket_sync.BucketSync`); asked only for the other
            buckets of a split parameter (below).

    The restricted step runs the optimizer class's ``step`` on a shallow view of ``optimizer``
    whose ``param_groups`` hold only the bucket's parameters (state, defaults and hooks shared).
    Parameters of a bucket that belong to no param group are not updated (as with DDP).

    A *split* parameter (its pieces in several buckets: tensor partitioning, ByteScheduler SOSP 2019) is
    stepped once per optimizer step, by the call that applies the *last* of its buckets to be applied
    (whatever order the caller applies them in: forward triggers, the guard, leftovers): every other
    bucket holding one of its pieces has then landed (``landed``), so its reduced pieces are complete.
    Each piece is clipped in place in its bucket when that bucket is applied; the optimizer then gets the
    pieces concatenated (``torch.cat`` of the 1-D piece views in element order, ``.view_as(p)``, a copy)
    as ``p.grad`` for the step.
    """

    def __init__(self, optimizer: Optimizer, buckets: Sequence[FlatBucket], landed: Callable[[int], bool]) -> None:
        self.optimizer = optimizer
        self.landed = landed
        group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        # per bucket: list of (group index, [(slot, param)]) of its whole parameters
        self._members: list[list[tuple[int, list[tuple[int, torch.Tensor]]]]] = []
        # per bucket: [(slot, param index, group index)] of its pieces of split parameters (in a param group)
        self._pieces: list[list[tuple[int, int, int]]] = []
        # split param index -> (param, [(bucket, slot)] in element order, the buckets holding it)
        self._split: dict[int, tuple[torch.Tensor, list[tuple[FlatBucket, int]], frozenset[int]]] = {}
        places: dict[int, list[tuple[int, FlatBucket, int]]] = {}
        for b in buckets:
            per_group: dict[int, list[tuple[int, torch.Tensor]]] = {}
            pieces: list[tuple[int, int, int]] = []
            for slot, p in enumerate(b.params):
                gi = group_of.get(id(p))
                if gi is None:
                    continue
                if b.is_piece(slot):
                    i = b.param_indices[slot]
                    pieces.append((slot, i, gi))
                    places.setdefault(i, []).append((b.ranges[slot][0], b, slot))
                else:
                    per_group.setdefault(gi, []).append((slot, p))
            self._members.append(sorted(per_group.items()))
            self._pieces.append(pieces)
        for i, pl in places.items():
            pl.sort(key=lambda place: place[0])
            self._split[i] = (pl[0][1].params[pl[0][2]], [(bk, slot) for _, bk, slot in pl],
                              frozenset(bk.index for _, bk, _ in pl))

    def step(self, bucket: FlatBucket, hparams: list[dict[str, Any]], clip: ClipRequest | None,
             coef: torch.Tensor | None, used: list[bool] | None = None) -> None:
        """Apply the update of ``bucket`` from its reduced gradients (call under ``torch.no_grad``).

        Args:
            bucket: a bucket whose AG/AR has finished.
            used: per slot, whether any rank produced a gradient for its parameter (default: read the reduced
                flags). A parameter no rank produced a gradient for is stepped with its own ``.grad`` when
                that is not None (``zero_grad(set_to_none=False)`` left a zero tensor: DDP steps it too, so
                momentum and weight decay move it) and skipped when it is None.
            hparams: :func:`snapshot_hparams` taken at the step's ``optimizer_step``.
            clip: the step's clip request, or ``None``.
            coef: the clip-by-norm factor (:func:`clip_norm_coefficient`; None: nothing to clip).

        A piece of a split parameter is clipped here; the parameter is stepped only when this is the last
        of its buckets applied in this optimizer step (see the class docstring).
        """
        members, pieces = self._members[bucket.index], self._pieces[bucket.index]
        if not members and not pieces:
            return
        if used is None:
            used = (bucket.flags > 0).tolist()
        per_group: dict[int, list[torch.Tensor]] = {}
        saved = []

        def clipped(g: torch.Tensor) -> torch.Tensor:
            if clip is not None and clip.algorithm == "value":
                g.clamp_(-clip.value, clip.value)
            elif clip is not None and coef is not None:
                g.mul_(coef)
            return g

        for gi, slots in members:
            for slot, p in slots:
                if used[slot]:
                    g = bucket.grad_view(slot)
                elif p.grad is not None:
                    # unused on every rank but ``.grad`` kept (``zero_grad(set_to_none=False)``): DDP leaves
                    # ``.grad`` untouched and the optimizer steps the parameter with it (momentum, weight decay)
                    g = p.grad
                else:
                    continue  # no gradient anywhere: not stepped, as with DDP
                saved.append((p, p.grad))
                p.grad = clipped(g)
                per_group.setdefault(gi, []).append(p)
        last: dict[int, tuple[int, int]] = {}  # split param index -> (slot, group) of its last piece here
        for slot, i, gi in pieces:
            if used[slot]:
                clipped(bucket.grad_view(slot))  # in place: ``.grad`` written back later shows clipped values
            last[i] = (slot, gi)
        for i, (slot, gi) in last.items():
            p, places, buckets = self._split[i]
            if not all(self.landed(b) for b in buckets if b != bucket.index):
                continue  # other buckets of the parameter are applied later; the last one steps it
            if used[slot]:
                g = torch.cat([bk.grad_view(s) for bk, s in places]).view_as(p)
            elif p.grad is not None:
                g = clipped(p.grad)  # unused on every rank, ``.grad`` kept: as for a whole parameter
            else:
                continue
            saved.append((p, p.grad))
            p.grad = g
            per_group.setdefault(gi, []).append(p)
        try:
            if per_group:
                step_on(self.optimizer, [dict(hparams[gi], params=plist) for gi, plist in sorted(per_group.items())])
        finally:
            for p, g in saved:
                p.grad = g


def step_on(optimizer: Optimizer, param_groups: list[dict[str, Any]], state: Optional[dict] = None) -> None:
    """Run ``optimizer``'s class ``step`` on a shallow view of it whose ``param_groups`` are ``param_groups`` (and whose
    ``state`` is ``state`` when given; the optimizer's own otherwise): a step of some parameters only, with the
    optimizer's defaults, hooks and (shared) state."""
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    view.param_groups = param_groups
    if state is not None:
        view.state = state
    type(optimizer).step(view)


def _write_flat(grad: torch.Tensor, start: int, stop: int, piece: torch.Tensor) -> None:
    """``grad`` flattened (row-major), elements ``[start, stop)`` := ``piece`` (1-D), in place."""
    if grad.is_contiguous():
        grad.view(-1)[start:stop].copy_(piece)
    else:  # (a channels-last or otherwise strided .grad: go through a row-major copy)
        flat = grad.reshape(-1).clone()
        flat[start:stop].copy_(piece)
        grad.copy_(flat.view(grad.shape))


def write_back_grads(bucket: FlatBucket, used: list[bool] | None = None) -> None:
    """Sync mode: set each parameter's ``.grad`` to its reduced (averaged) gradient.

    Parameters that no rank produced a gradient for keep their ``.grad`` untouched (DDP semantics).
    ``used`` (per slot, any rank had a gradient for its parameter) defaults to the reduced flags. On a
    bucket with ``as_view`` a ``.grad`` that is the bucket's view (or None) is pointed at the view: no copy.
    A piece of a split parameter is written to elements ``[start, stop)`` of ``p.grad`` flattened
    (``p.grad`` is first allocated as zeros when None): its ``.grad`` is complete once every bucket holding
    one of its pieces was written back.
    """
    if used is None:
        used = (bucket.flags > 0).tolist()
    for slot, p in enumerate(bucket.params):
        if not used[slot]:
            continue
        g = bucket.grad_view(slot)
        if bucket.pieces[slot]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            start, stop = bucket.ranges[slot]
            _write_flat(p.grad, start, stop, g)
        elif bucket.as_view and (p.grad is None or bucket.is_view(slot, p.grad)):
            p.grad = g  # gradient_as_bucket_view: .grad is the reduced view itself, nothing to copy
        elif p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
