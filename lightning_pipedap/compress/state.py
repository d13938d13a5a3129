"""Layout-independent compression state: per parameter name, for checkpoints and re-planning.

Error-feedback residuals and PowerSGD factors live per *bucket* while training
(:class:`~.base.BucketState`), but buckets are a property of one plan: a resumed run, or a re-plan
after drift, may fuse the same parameters differently. So the state is exported per *parameter*,
keyed by its name in the LightningModule (``"net.0.weight"``), and imported into whatever buckets
exist by name and element offset, never by bucket index.

One rank's state (:func:`export_state`)::

    {"version": 1, "compressor": "powersgd", "kwargs": {...},
     "params": {"net.0.weight": {"shape": [32, 16], "step": 12,
                                 "residual": Tensor [512] fp32 or None,
                                 "tensors": {"q": Tensor [16, 4]}},      # PowerSGD warm start
                ...}}

A checkpoint holds every rank's state under one key (:data:`CHECKPOINT_KEY`, built by
:func:`checkpoint_entry`); on resume each rank takes its own part (:func:`state_for_rank`). Only
plain containers, ints, strings and CPU tensors are used, so ``torch.load(weights_only=True)``
reads it. Residuals differ per rank (each rank's own compression error); PowerSGD's ``q`` and
the step counters are identical on all ranks.

A parameter that is now sent dense (warm-up/profiling steps, or a plan that stopped compressing its
bucket) must not keep its residual waiting for a compression that may never come: the strategy takes
it out with :func:`split_residuals` and the engine adds it once to the parameter's next gradient
(``CommEngine.carry``); one not yet used when the engine is replaced or a
checkpoint is written goes back in with :func:`add_residuals`.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import torch

from lightning_pipedap.compress.base import BucketState

#: format version of :func:`export_state` and :func:`checkpoint_entry`
STATE_VERSION = 1
#: key of the compression state in a Lightning checkpoint dict
CHECKPOINT_KEY = "pipedap_compression"

#: per bucket, ``(parameter name, parameter shape)`` in buffer order
Layout = Sequence[Sequence[tuple[str, Sequence[int]]]]


def check_layouts(bucket_numels: Sequence[int],
                  layouts: Layout | None) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]:
    """Validate ``layouts`` against the bucket sizes; None gives one 1-D tensor per bucket named ``"<bucket b>"``.

    Returns:
        per bucket a tuple of ``(name, shape)`` with int shapes.

    Raises:
        ValueError: if the number of buckets differs, a bucket's shapes do not add up to its
            ``numel``, a bucket is empty, or a parameter name appears twice.
    """
    if layouts is None:
        return tuple(((f"<bucket {b}>", (int(n),)),) for b, n in enumerate(bucket_numels))
    if len(layouts) != len(bucket_numels):
        raise ValueError(f"layouts describe {len(layouts)} buckets, but there are {len(bucket_numels)} buckets")
    out, seen = [], set()
    for b, (n, entries) in enumerate(zip(bucket_numels, layouts)):
        entries = tuple((str(name), tuple(int(d) for d in shape)) for name, shape in entries)
        if not entries:
            raise ValueError(f"bucket {b}: layout is empty; every bucket holds at least one parameter")
        total = sum(math.prod(shape) for _, shape in entries)
        if total != n:
            raise ValueError(f"bucket {b}: layout {[f'{k}{list(s)}' for k, s in entries]} holds {total} elements, "
                             f"the bucket has {n}")
        dup = seen.intersection(name for name, _ in entries)
        if dup:
            raise ValueError(f"parameter names {sorted(dup)} appear twice in the layouts (bucket {b})")
        seen.update(name for name, _ in entries)
        out.append(entries)
    return tuple(out)


def export_state(states: Sequence[BucketState], layouts: Layout, compressor: str,
                 kwargs: dict[str, Any]) -> dict[str, Any]:
    """One rank's state per parameter name (see the module docstring), CPU tensors, copies.

    Args:
        states: the bucket states, index = bucket.
        layouts: per bucket ``(name, shape)`` in buffer order (:func:`check_layouts`).
        compressor: the compressor name; kwargs: its keyword arguments.
    """
    params: dict[str, Any] = {}
    for st, entries in zip(states, layouts):
        for (name, shape), off, tensors in zip(entries, st.offsets, st.param_tensors):
            k = math.prod(shape)
            res = None if st.residual is None else st.residual[off : off + k].detach().to("cpu", copy=True)
            params[name] = {"shape": list(shape), "step": int(st.step), "residual": res,
                            "tensors": {key: t.detach().to("cpu", copy=True) for key, t in tensors.items()}}
    return {"version": STATE_VERSION, "compressor": compressor, "kwargs": dict(kwargs), "params": params}


def import_state(saved: dict[str, Any], states: Sequence[BucketState], layouts: Layout, compressor: str) -> list[str]:
    """Load :func:`export_state` output into ``states`` by parameter name and offset.

    Each bucket's step counter becomes the largest saved step of its parameters (they agree when
    every bucket was compressed every step); parameters without saved state start with a zero
    residual and no method tensors. Method tensors are copied as saved; a compressor that finds one
    of the wrong shape (PowerSGD ``q`` after a change of ``rank``) starts that one afresh.

    Returns:
        names of this run's parameters that found no saved state (sorted).

    Raises:
        ValueError: unknown format version, state of another compressor, or a parameter whose saved
            shape differs from this run's (naming both shapes).
    """
    if saved.get("version") != STATE_VERSION:
        raise ValueError(f"compression state version {saved.get('version')!r} is not supported; "
                         f"valid: {STATE_VERSION}")
    if saved.get("compressor") != compressor:
        raise ValueError(f"checkpoint holds compression state of {saved.get('compressor')!r}, "
                         f"this run uses {compressor!r}")
    params = saved["params"]
    for entries in layouts:
        for name, shape in entries:
            if name in params and tuple(params[name]["shape"]) != tuple(shape):
                raise ValueError(f"parameter {name!r}: saved compression state has shape "
                                 f"{tuple(params[name]['shape'])}, this run's parameter has shape {tuple(shape)}")
    fresh = []
    for st, entries in zip(states, layouts):
        known = [params[name] for name, _ in entries if name in params]
        fresh += [name for name, _ in entries if name not in params]
        st.step = max((int(p["step"]) for p in known), default=0)
        st.scratch = {}
        if any(p["residual"] is not None for p in known):
            device = st.residual.device if st.residual is not None else torch.device("cpu")
            st.residual = torch.zeros(st.numel, dtype=torch.float32, device=device)
        else:
            st.residual = None
        st.param_tensors = [{} for _ in entries]
        for slot, ((name, shape), off) in enumerate(zip(entries, st.offsets)):
            p = params.get(name)
            if p is None:
                continue
            if p["residual"] is not None:
                st.residual[off : off + math.prod(shape)].copy_(p["residual"].reshape(-1))
            st.param_tensors[slot] = {k: t.clone() for k, t in p["tensors"].items()}
    return sorted(fresh)


def split_residuals(saved: dict[str, Any] | None,
                    names: Iterable[str]) -> tuple[dict[str, Any] | None, dict[str, torch.Tensor]]:
    """Take the error-feedback residuals of parameters ``names`` out of a state (:func:`export_state` format).

    For parameters that are now sent dense: their residual (what earlier compressions of this rank
    left out, in the units of the bucket gradient, i.e. local gradient / world size) must be added
    once to their next gradient instead of waiting in the compression state for a compression that
    may never come. Residuals that are exactly zero are dropped (nothing to deliver).

    Args:
        saved: the state, or None (nothing to take).
        names: parameter names to take the residual of; names without saved state are skipped.

    Returns:
        ``(state, residuals)``: a copy of ``saved`` whose entries for those names have
        ``"residual": None`` (step counters and method tensors kept; ``saved`` itself is not
        modified), and ``{name: flat fp32 residual}`` of the non-zero ones.
    """
    if saved is None:
        return None, {}
    params = dict(saved["params"])
    taken: dict[str, torch.Tensor] = {}
    for name in names:
        entry = params.get(name)
        if entry is None or entry.get("residual") is None:
            continue
        res = entry["residual"]
        params[name] = {**entry, "residual": None}
        if bool(res.ne(0).any()):
            taken[name] = res.reshape(-1)
    return {**saved, "params": params}, taken


def add_residuals(saved: dict[str, Any] | None, residuals: Mapping[str, torch.Tensor],
                  shapes: Mapping[str, Sequence[int]], compressor: str,
                  kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """Put residuals back into a state (:func:`export_state` format), adding to any saved residual.

    The inverse direction of :func:`split_residuals`, for residuals that were meant to be added to
    a dense gradient but were not yet when the engine was replaced or a checkpoint was taken: the
    next compressing engine then compensates them (or the next dense one adds them).

    Args:
        saved: the state, or None (a new one for ``compressor`` and ``kwargs`` is made when there
            is something to add).
        residuals: parameter name -> residual (``numel`` elements, flattened, fp32 CPU copies kept).
        shapes: parameter name -> shape, for names not yet in ``saved``.
        compressor, kwargs: the compressor of a new state.

    Returns:
        a new state (``saved`` is not modified), or ``saved`` itself when ``residuals`` is empty.

    Raises:
        ValueError: a residual whose element count differs from the parameter's (naming both), or a
            name without a shape.
    """
    if not residuals:
        return saved
    base = saved if saved is not None else {"version": STATE_VERSION, "compressor": compressor,
                                            "kwargs": dict(kwargs), "params": {}}
    params = dict(base["params"])
    for name, res in residuals.items():
        entry = params.get(name)
        if entry is None:
            if name not in shapes:
                raise ValueError(f"no shape for parameter {name!r}; cannot add its residual to the compression state")
            entry = {"shape": [int(d) for d in shapes[name]], "step": 0, "residual": None, "tensors": {}}
        n = math.prod(entry["shape"])
        if res.numel() != n:
            raise ValueError(f"parameter {name!r}: residual has {res.numel()} elements, the parameter "
                             f"{tuple(entry['shape'])} has {n}")
        flat = res.detach().reshape(-1).to("cpu", torch.float32, copy=True)
        old = entry["residual"]
        params[name] = {**entry, "residual": flat if old is None else old.reshape(-1).to(torch.float32) + flat}
    return {**base, "params": params}


def checkpoint_entry(per_rank: Sequence[dict[str, Any] | None], compressor: str, kwargs: dict[str, Any],
                     world_size: int) -> dict[str, Any]:
    """The checkpoint value under :data:`CHECKPOINT_KEY`: every rank's :func:`export_state`, rank order.

    Raises:
        ValueError: if ``per_rank`` does not have ``world_size`` entries.
    """
    if len(per_rank) != world_size:
        raise ValueError(f"got compression state of {len(per_rank)} ranks for world size {world_size}")
    return {"version": STATE_VERSION, "compressor": compressor, "kwargs": dict(kwargs), "world_size": int(world_size),
            "per_rank": list(per_rank)}


def state_for_rank(entry: dict[str, Any] | None, compressor: str | None, world_size: int,
                   rank: int) -> tuple[dict[str, Any] | None, str | None]:
    """Rank ``rank``'s part of a checkpoint entry, or why it cannot be used.

    Args:
        entry: the checkpoint's :data:`CHECKPOINT_KEY` value (None when absent).
        compressor: this run's compressor name (None: no compression).
        world_size, rank: this run's.

    Returns:
        ``(state, None)`` to restore, or ``(None, reason)`` to start fresh; ``reason`` names both
        values when the checkpoint's compressor, world size or format differs (None when there is
        simply nothing to restore).
    """
    if entry is None:
        return None, None
    if entry.get("version") != STATE_VERSION:
        return None, (f"compression state format version {entry.get('version')!r} in the checkpoint is not "
                      f"supported (valid: {STATE_VERSION})")
    saved_comp = entry.get("compressor")
    if saved_comp != compressor:
        return None, (f"the checkpoint holds compression state of compressor {saved_comp!r}, this run uses "
                      f"compression={compressor!r}")
    saved_world = entry.get("world_size")
    if saved_world != world_size:
        return None, (f"the checkpoint holds compression state of world size {saved_world}, this run has world "
                      f"size {world_size} (residuals are per rank)")
    state = entry["per_rank"][rank]
    return state, None
