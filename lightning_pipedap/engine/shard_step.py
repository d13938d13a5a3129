"""The sharded optimizer step (``shard_optimizer``): each rank steps the shard its reduce-scatter left it.

ZeRO-style data parallelism (Rajbhandari et al., SC 2020, stages 1-2; Megatron-Core's distributed optimizer;
FSDP2 with ``reshard_after_forward=False``) with pipedap's planned fusion and order. A sharded bucket's round::

    backward: RS(b) ─▶ REDUCED (this rank's shard of the averaged gradients, elements [r·S, (r+1)·S))
    after the optimizer step is recorded (hyper-parameters, clip request: ``go``), at the first AG of the round:
        prepare: one all-reduce of [used flags | per-slot NaN/inf counts] -> used flags and the non-finite
                 verdict, identical on every rank; with clip by norm the gradients are all-gathered first
                 (the factor bit for bit as DDP's)
    at AG(b):  step this rank's slices of the bucket's parameters (optimizer state only for them) ─▶ STEPPED
               write the updated parameter slices into the shard, all-gather (own dtype) ─▶ GATHERED
    next forward, before the bucket's first consumer: copy the gathered parameters into the model ─▶ LANDED

Only *element-wise* optimizers are sharded (:data:`ELEMENTWISE_OPTIMIZERS`: the update of an element depends on
that element's gradient and state and on per-parameter scalars such as the step count), so stepping a slice of a
parameter equals that slice of the full step. *Whole-tensor* optimizers (:data:`WHOLE_TENSOR_OPTIMIZERS`: Muon,
Adafactor) are sharded by parameter ownership instead: each parameter lies whole in one rank's shard (the bucket's
layout padded so shards end at parameter boundaries, :attr:`FlatBucket.owners`) and that rank steps it whole
(DeepSpeed and Megatron-Core shard such optimizers the same way, by parameter). Optimizer state lives in
:attr:`ShardedOptimizer.state`, keyed by each slice's tensor; :meth:`ShardedOptimizer.consolidate` gathers it back
into the optimizer's own ``state`` (full tensors shaped like the parameters) for checkpoints, a step in sync mode
or another engine, and :meth:`ShardedOptimizer.absorb` moves it back into the slices at the next sharded round.

The rank's averaged (clipped) gradient shard is kept so a later read of ``.grad`` can be served by an all-gather
of the gradients (:meth:`~lightning_pipedap.engine.waits.EngineWaits.gather_grads`): in the same elements of the
parameter's own ``.grad`` (after the reduce-scatter its local gradient is needed by nothing, and no read of ``.grad``
reaches it before that all-gather rewrites it), so keeping costs no memory while that ``.grad`` lives; the kept
views are dropped before the next backward (:meth:`ShardedStep.drop_kept`), so an old ``.grad`` Lightning set to
None is not pinned beside the new one. A slice whose ``.grad`` cannot hold it (None, not contiguous) gets a tensor
of its own.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch.optim import Optimizer

from lightning_pipedap import compat
from lightning_pipedap.engine import collectives as C
from lightning_pipedap.engine.buckets import FlatBucket
from lightning_pipedap.engine.update import averaged_grads, clip_norm_coefficient, step_on

__all__ = ["ELEMENTWISE_OPTIMIZERS", "WHOLE_TENSOR_OPTIMIZERS", "ShardRound", "ShardSlice", "ShardedOptimizer",
           "ShardedState", "ShardedStateError", "ShardedStep", "land_params", "nonfinite_counts", "nonfinite_shards",
           "shard_slices"]

#: torch optimizers whose update of one element depends only on that element's gradient and state and on
#: per-parameter scalars (step count, hyper-parameters): a slice of a parameter can be stepped on its own
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Rprop", "ASGD")
    if hasattr(torch.optim, name)
)

#: torch optimizers whose step needs the whole parameter (Muon's Newton-Schulz orthogonalisation of the 2-D update,
#: Adafactor's factored row/column statistics): sharded by parameter ownership, each parameter stepped whole by one
#: rank (:func:`~lightning_pipedap.plan.sharding.assign_owners`; :attr:`FlatBucket.owners`)
WHOLE_TENSOR_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in ("Muon", "Adafactor") if hasattr(torch.optim, name)
)


@dataclass
class ShardSlice:
    """The part of one bucket slot that lies in this rank's shard.

    Attributes:
        bucket: bucket index.
        slot: slot of the bucket.
        param_index: the parameter's engine index.
        param: the parameter.
        lo, hi: element range ``[lo, hi)`` of the bucket buffer (inside this rank's shard).
        p_lo, p_hi: the same elements as a range of the parameter flattened (row-major).
        tensor: what the optimizer steps: a 1-D view of the parameter's storage (contiguous parameter) or a copy
            refreshed from the parameter before each step (:attr:`master`); shaped like the parameter when
            :attr:`whole`.
        master: whether :attr:`tensor` is a copy (a non-contiguous parameter).
        whole: the slice is the whole parameter, owned by this rank (parameter ownership: whole-tensor optimizers).
    """

    bucket: int
    slot: int
    param_index: int
    param: torch.Tensor
    lo: int
    hi: int
    p_lo: int
    p_hi: int
    tensor: torch.Tensor
    master: bool
    whole: bool = False


def shard_slices(bucket: FlatBucket, rank: int) -> list[ShardSlice]:
    """The slots' element ranges inside ``rank``'s shard of ``bucket`` (``[rank·S, (rank+1)·S)``), slot order; with
    parameter ownership (``bucket.owners``) the whole parameters this rank owns, shaped like them."""
    start, end = bucket.own_data_range(rank)
    if bucket.owners:
        out = []
        for slot, p in enumerate(bucket.params):
            if bucket.owners[slot] != rank:
                continue
            off, n = bucket.offsets[slot], p.numel()
            master = not p.is_contiguous()
            t = p.detach().clone(memory_format=torch.contiguous_format) if master else p.detach()
            out.append(ShardSlice(bucket.index, slot, bucket.param_indices[slot], p, off, off + n, 0, n, t, master,
                                  whole=True))
        return out
    out = []
    for slot, p in enumerate(bucket.params):
        off, (a, b) = bucket.offsets[slot], bucket.ranges[slot]
        lo, hi = max(start, off), min(end, off + b - a)
        if lo >= hi:
            continue
        p_lo, p_hi = a + lo - off, a + hi - off
        master = not p.is_contiguous()
        t = p.detach().reshape(-1)[p_lo:p_hi].clone() if master else p.detach().view(-1)[p_lo:p_hi]
        out.append(ShardSlice(bucket.index, slot, bucket.param_indices[slot], p, lo, hi, p_lo, p_hi, t, master))
    return out


def _is_elem(v: Any, s: ShardSlice) -> bool:
    """Whether optimizer-state entry ``v`` of slice ``s`` is element-wise (one value per element of the slice: 1-D,
    or shaped like the parameter for a whole one), so it is gathered in the bucket's layout."""
    return (torch.is_tensor(v) and v.numel() == s.hi - s.lo
            and (v.dim() == 1 or (s.whole and v.shape == s.param.shape)))


def _layouts(buckets: Sequence[FlatBucket]) -> list[tuple]:
    """Each bucket's layout (its parameters, their element ranges and offsets, the shard size, the owners): equal
    layouts give every rank the same slices."""
    return [(tuple(id(p) for p in b.params), tuple(b.ranges), tuple(b.offsets), b.shard_size, b.owners)
            for b in buckets]


def land_params(bucket: FlatBucket, in_place: Optional[tuple[int, int]] = None) -> None:
    """Copy the gathered parameters of ``bucket`` (its buffer holds parameters, not gradients) into the model
    (call under ``torch.no_grad``): a whole parameter from its view, a piece into its element range.

    ``in_place``: a buffer range ``[lo, hi)`` whose elements the model holds already (this rank's shard, stepped in
    place in contiguous parameters: :attr:`ShardedStep.in_place`); a contiguous parameter's elements there are not
    copied (1/N of the bucket's land copy)."""
    klo, khi = in_place or (0, 0)
    for slot, p in enumerate(bucket.params):
        v = bucket.grad_view(slot)
        start, stop = bucket.ranges[slot]
        off = bucket.offsets[slot]
        a, b = max(klo - off, 0), min(khi - off, stop - start)  # (the slot's elements held already: [a, b))
        if p.is_contiguous() and a < b:
            flat, src = p.view(-1)[start:stop], v.reshape(-1)
            if a > 0:
                flat[:a].copy_(src[:a])
            if b < stop - start:
                flat[b:].copy_(src[b:])
        elif bucket.pieces[slot]:
            if p.is_contiguous():
                p.view(-1)[start:stop].copy_(v)
            else:
                flat = p.reshape(-1).clone()
                flat[start:stop].copy_(v)
                p.copy_(flat.view(p.shape))
        else:
            p.copy_(v)


def grad_snapshot(params: Sequence[torch.Tensor]) -> dict[int, Optional[torch.Tensor]]:
    """``id(p) -> p.grad`` for ``params`` now (training thread, when the step is recorded: :attr:`ShardRound.grads`),
    read with torch-function handling off, so no mode of the strategy's takes it for a read by user code."""
    with compat.disable_torch_function():
        return {id(p): p.grad for p in params}


def keep_view(s: ShardSlice, dtype: torch.dtype, g: Optional[torch.Tensor],
              spare: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
    """Where slice ``s``'s averaged gradient is kept: its elements of the parameter's ``.grad`` ``g`` (the snapshot
    of :attr:`ShardRound.grads`) when that is a contiguous tensor of dtype ``dtype`` shaped like the parameter (no
    memory), else a tensor of its own in ``spare`` (``(bucket, slot) ->``, allocated once)."""
    if g is not None and g.is_contiguous() and g.dtype == dtype and g.shape == s.param.shape:
        return g.detach().view(-1)[s.p_lo:s.p_hi]
    key = (s.bucket, s.slot)
    if key not in spare:
        spare[key] = torch.empty(s.hi - s.lo, dtype=dtype, device=s.tensor.device)
    return spare[key]


def nonfinite_shards(buckets: Sequence[FlatBucket], sharded: Sequence[int], rank: int) -> set[int]:
    """The buckets among ``sharded`` whose shard on ``rank`` (``own_data_range``) may hold NaN/inf: one sum per shard
    and one host sync (a sum is finite only if every element is: NaN and inf propagate, as in
    :func:`~lightning_pipedap.strategy.numerics.first_nonfinite`); a shard whose sum overflowed with finite elements is
    returned too, and its element-wise counts are then zero. A sum reads the shard once and allocates nothing:
    ``isfinite().all()`` per shard cost 14 ms per step on the bench MLP's 8.4 M elements of a rank, the sums 1 ms."""
    sums, which = [], []
    for b in sharded:
        lo, hi = buckets[b].own_data_range(rank)
        if hi > lo:
            sums.append(buckets[b].buffer[lo:hi].sum().to(torch.float64))  # (buckets differ in dtype)
            which.append(b)
    if not sums:
        return set()
    finite = torch.stack(sums).isfinite()
    if bool(finite.all()):
        return set()
    return {b for b, ok in zip(which, finite.tolist()) if not ok}


def nonfinite_counts(buckets: Sequence[FlatBucket], sharded: Sequence[int], slices: dict[int, list[ShardSlice]],
                     rank: int) -> list[torch.Tensor]:
    """Per bucket of ``sharded``, ``[nan, inf]`` counts of each slot in ``rank``'s shard (float64, ``2·slots``
    elements: slot ``k`` at ``2k``, ``2k+1``; ``slices``: this rank's :class:`ShardSlice` per bucket), counted
    element by element only in the buckets :func:`nonfinite_shards` names; zeros elsewhere."""
    suspect = nonfinite_shards(buckets, sharded, rank)
    counts = []
    for b in sharded:
        bucket = buckets[b]
        c = torch.zeros(2 * len(bucket.params), dtype=torch.float64, device=bucket.buffer.device)
        for s in slices[b] if b in suspect else ():
            g = bucket.buffer[s.lo:s.hi]
            c[2 * s.slot] += int(g.isnan().sum())
            c[2 * s.slot + 1] += int(g.isinf().sum())
        counts.append(c)
    return counts


class ShardedStateError(RuntimeError):
    """User code read the optimizer state of a parameter whose state is sharded over the ranks."""


class ShardedState(collections.defaultdict):
    """``optimizer.state`` while the sharded parameters' state lives in the ranks' shards: the unsharded
    parameters' entries as usual (iteration sees only them, so Lightning's device moves work), and a
    :class:`ShardedStateError` naming the parameter and the way out for any access to a sharded one.

    Args:
        unsharded: the entries kept (parameters of unsharded buckets).
        sharded: ``id(parameter) -> name`` of the parameters whose state is sharded.
        world_size: ranks sharing it (for the message).
    """

    def __init__(self, unsharded: dict, sharded: dict[int, str], world_size: int) -> None:
        super().__init__(dict, unsharded)
        self._sharded, self._world = sharded, world_size

    def _check(self, p: Any) -> None:
        name = self._sharded.get(id(p))
        if name is not None:
            raise ShardedStateError(
                f"pipedap: the optimizer state of {name} is sharded over the {self._world} ranks "
                "(shard_optimizer=True): each rank holds its part during the fit, so optimizer.state has no entry "
                "for it. Read trainer.strategy.optimizer_state(optimizer) (every rank must call it: the whole state "
                "dict gathered on rank 0; with sharded_checkpoint=True each rank's own part), or pass "
                "shard_optimizer=False")

    def __getitem__(self, p: Any) -> Any:
        self._check(p)
        return super().__getitem__(p)

    def get(self, p: Any, default: Any = None) -> Any:
        self._check(p)
        return super().get(p, default)

    def __contains__(self, p: Any) -> bool:
        self._check(p)
        return super().__contains__(p)

    def setdefault(self, p: Any, default: Any = None) -> Any:
        self._check(p)
        return super().setdefault(p, default)

    def __setitem__(self, p: Any, value: Any) -> None:
        self._check(p)
        super().__setitem__(p, value)


def _refuse_state_dict() -> None:
    raise ShardedStateError("pipedap: optimizer.state_dict() during a sharded fit (shard_optimizer=True) would miss "
                            "the sharded state; call trainer.strategy.optimizer_state(optimizer) instead (every rank: "
                            "it gathers the state on rank 0; with sharded_checkpoint=True each rank's part), or pass "
                            "shard_optimizer=False")


class ShardRound:
    """One sharded round: what the worker waits for and what its preparation decided.

    Attributes:
        go: set when the optimizer step was recorded (:meth:`ShardedStep.go`).
        prepared: set when the preparation all-reduce has run (used flags, clip factor, verdict known).
        hparams: the step's hyper-parameters per param group (``snapshot_hparams``).
        clip: the step's :class:`~lightning_pipedap.engine.update.ClipRequest`, or None.
        nonfinite: the non-finite check's mode when it is active (``"warn"``, ``"raise"``, ``"skip"``), or None.
        coef: the clip-by-norm factor (0-dim tensor) or None.
        finding: ``(bucket, slot, nan, inf, numel)`` of the first slot with non-finite averaged gradients, or None.
        stepped: whether the shards were stepped (False: a non-finite step under ``raise``/``skip``).
        grads: ``id(param) -> its .grad`` when the step was recorded (main thread): what DDP's step sees, and all
            the worker reads of ``.grad`` (user code may replace or clear ``.grad`` while the worker runs, e.g.
            Lightning's ``on_validation_model_zero_grad``; a worker read of it then raced, and crashed, torch).
    """

    def __init__(self) -> None:
        self.go, self.prepared = threading.Event(), threading.Event()
        self.hparams: Optional[list[dict[str, Any]]] = None
        self.clip: Any = None
        self.nonfinite: Optional[str] = None
        self.coef: Optional[torch.Tensor] = None
        self.finding: Optional[tuple[int, int, int, int, int]] = None
        self.stepped = True
        self.error: Optional[BaseException] = None
        self.grads: dict[int, Optional[torch.Tensor]] = {}


class ShardedOptimizer:
    """An element-wise optimizer's step on this rank's slices, with optimizer state only for them.

    Args:
        optimizer: the user's optimizer (one of :data:`ELEMENTWISE_OPTIMIZERS` or a declared element-wise class).
        slices: per sharded bucket index, this rank's :class:`ShardSlice` list.
        params: the engine's parameters (engine order).
        names: their names (messages); world_size: ranks sharing the state (messages).

    While the state is here, ``optimizer.state`` is a :class:`ShardedState` (a read of a sharded parameter's entry
    raises, naming it) and ``optimizer.state_dict()`` raises; :meth:`consolidate` puts both back.

    Attributes:
        state: slice tensor -> its optimizer state (tensors of the slice's length where the full state is shaped
            like the parameter; scalars such as Adam's ``step`` as they are).
        absorbed: whether the state is here (True) or in ``optimizer.state`` (False).
    """

    def __init__(self, optimizer: Optimizer, slices: dict[int, list[ShardSlice]], params: Sequence[torch.Tensor],
                 names: Sequence[str] = (), world_size: int = 1):
        self.optimizer = optimizer
        self.params = list(params)
        self.names, self.world_size = list(names), world_size
        #: ids of the optimizer's own parameters (its slices: those of ``slices`` holding one of them)
        self.mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self.slices = slices = {b: [s for s in sl if id(s.param) in self.mine] for b, sl in slices.items()}
        group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        #: per bucket: [(group index, [slices])] of the slices whose parameter is in a param group
        self.by_group: dict[int, list[tuple[int, list[ShardSlice]]]] = {}
        for b, sl in slices.items():
            groups: dict[int, list[ShardSlice]] = {}
            for s in sl:
                gi = group_of.get(id(s.param))
                if gi is not None:
                    groups.setdefault(gi, []).append(s)
            self.by_group[b] = sorted(groups.items())
        #: engine indices of the parameters whose every element lives in a sharded bucket
        self.sharded_params = sorted({s.param_index for sl in slices.values() for s in sl})
        self.state: dict[torch.Tensor, dict[str, Any]] = collections.defaultdict(dict)
        self.absorbed = False
        #: engine indices of the sharded parameters of this optimizer (every rank's; set by ShardedStep.attach)
        self.owned: list[int] = list(self.sharded_params)
        #: the sharded buckets holding some of them (the same list on every rank)
        self.buckets: list[int] = sorted(slices)

    def name(self, i: int) -> str:
        """Engine parameter ``i``'s name (messages)."""
        return self.names[i] if i < len(self.names) else f"parameter {i}"

    def step_unsharded(self) -> float:
        """Step the optimizer's parameters that no sharded bucket holds (compressed buckets) with its own step, on a
        view of it; returns the seconds it took (0 when there are none). Call after :meth:`absorb`."""
        owned = {id(self.params[i]) for i in self.owned}
        rest = [dict(g, params=[p for p in g["params"] if id(p) not in owned]) for g in self.optimizer.param_groups]
        if not any(g["params"] for g in rest):
            return 0.0
        t0 = time.perf_counter()
        step_on(self.optimizer, [g for g in rest if g["params"]])
        return time.perf_counter() - t0

    def state_nbytes(self) -> int:
        """Bytes of the sharded optimizer state this rank holds."""
        return sum(v.numel() * v.element_size() for st in self.state.values() for v in st.values()
                   if torch.is_tensor(v))

    # ------------------------------------------------------------------ moving the state
    def absorb(self, owned: Sequence[int]) -> None:
        """Move the optimizer's own state of the sharded parameters (``owned``: their engine indices, every rank's)
        into the slices: element-wise entries (shaped like the parameter) are sliced, others copied; then the
        full entries are dropped from ``optimizer.state`` (this rank keeps 1/N). Local, no collective."""
        if self.absorbed:
            return
        full = self.optimizer.state
        for sl in self.slices.values():
            for s in sl:
                st = full.get(s.param)
                if not st:
                    continue
                mine = self.state[s.tensor]
                for k, v in st.items():
                    if torch.is_tensor(v) and v.shape == s.param.shape:
                        mine[k] = v.detach().clone() if s.whole else v.detach().reshape(-1)[s.p_lo:s.p_hi].clone()
                    else:
                        mine[k] = v.clone() if torch.is_tensor(v) else v
        for i in owned:
            full.pop(self.params[i], None)
        names = {id(self.params[i]): self.names[i] if i < len(self.names) else f"parameter {i}" for i in owned}
        self.optimizer.state = ShardedState(dict(full), names, self.world_size)
        self.optimizer.state_dict = _refuse_state_dict  # (until consolidate: it would miss the sharded state)
        self.absorbed = True

    def release(self) -> None:
        """After a failure (no collective possible): the optimizer's own state object back, without the sharded
        entries (they are lost with the fit), so teardown can move or drop it."""
        if self.absorbed:
            self.optimizer.state = collections.defaultdict(dict, dict(self.optimizer.state))
            self.optimizer.__dict__.pop("state_dict", None)
            self.state.clear()
            self.absorbed = False

    def _merged_info(self, comm: C.CommGroup) -> dict[int, dict[str, Any]]:
        """Every rank's entries, ``param index -> {entry: ("elem", dtype) | ("value", value, device)}`` (scalars from
        the rank holding the parameter's first element): one ``all_gather_object``."""
        info: dict[int, dict[str, Any]] = {}
        for sl in self.slices.values():
            for s in sl:
                st = self.state.get(s.tensor)
                if not st:
                    continue
                mine = info.setdefault(s.param_index, {})
                for k, v in st.items():
                    if _is_elem(v, s):
                        mine[k] = ("elem", str(v.dtype).replace("torch.", ""))
                    elif s.p_lo == 0:
                        mine[k] = ("value", v.cpu(), str(v.device)) if torch.is_tensor(v) else ("value", v, None)
        merged: dict[int, dict[str, Any]] = {}
        for part in C.all_gather_object(info):
            for i, entries in part.items():
                merged.setdefault(i, {}).update(entries)
        return merged

    def _gathered(self, comm: C.CommGroup, buckets: Sequence[FlatBucket], merged: dict[int, dict[str, Any]],
                  drop: bool = False) -> Iterator[tuple[FlatBucket, str, torch.Tensor]]:
        """Per sharded bucket and element-wise entry (sorted: the same sequence on every rank): a buffer of the
        bucket's layout holding that entry of every rank's slices, all-gathered. One buffer per dtype, as large as
        the largest bucket, serves every bucket (valid until the next item); ``drop``: this rank's slices' entry is
        dropped from :attr:`state` once gathered (:meth:`transfer`: the old and the new state never both whole)."""
        scratch: dict[str, torch.Tensor] = {}
        largest = max((b.shard_size * b.world_size for b in buckets if b.index in self.slices), default=0)
        for bucket in buckets:
            if bucket.index not in self.slices:
                continue
            keys = sorted({(k, kind[1]) for i in dict.fromkeys(bucket.param_indices) for k, kind in
                           merged.get(i, {}).items() if kind[0] == "elem"})
            # (the layout's size, not the buffer's: a closed engine's bucket has released its buffer)
            n = bucket.shard_size * bucket.world_size
            for k, dtype_name in keys:
                if dtype_name not in scratch:
                    scratch[dtype_name] = torch.empty(largest, dtype=getattr(torch, dtype_name),
                                                      device=bucket.buffer.device)
                buf = scratch[dtype_name][:n]
                buf.zero_()
                for s in self.slices[bucket.index]:
                    st = self.state.get(s.tensor, {})
                    v = st.pop(k, None) if drop else st.get(k)
                    if v is not None:
                        buf[s.lo:s.hi].copy_(v.reshape(-1))
                C.all_gather_(buf, comm)
                yield bucket, k, buf

    def gather_state(self, comm: C.CommGroup, buckets: Sequence[FlatBucket], device: Optional[torch.device] = None,
                     keep: bool = True, drop: bool = False) -> dict[torch.Tensor, dict[str, Any]]:
        """The sharded parameters' whole optimizer state, ``parameter -> {entry: value}`` (element-wise entries as
        full tensors shaped like the parameter, on ``device``, default the parameter's): one ``all_gather_object``
        of the entries' kinds and scalars, then one all-gather of the bucket's layout per (bucket, entry, dtype),
        one bucket at a time. A collective: every rank calls it at the same point. ``keep=False``: this rank takes
        part but assembles nothing (returns ``{}``; rank-0-only checkpoints). The shards are left as they are, or with
        ``drop`` each one's entries dropped once gathered (:meth:`consolidate`: not both whole and sliced)."""
        merged = self._merged_info(comm)
        full: dict[int, dict[str, torch.Tensor]] = {}
        for bucket, k, buf in self._gathered(comm, buckets, merged, drop=drop):
            if keep:
                self._assemble(bucket, k, buf, merged, full, device)
        if not keep:
            return {}
        out: dict[torch.Tensor, dict[str, Any]] = {}
        for i, entries in merged.items():
            p = self.params[i]
            out[p] = {k: (full[i][k].view(p.shape) if kind[0] == "elem"
                          else kind[1].to(kind[2]) if torch.is_tensor(kind[1]) else kind[1])
                      for k, kind in entries.items()}
        return out

    def transfer(self, new: "ShardedOptimizer", comm: C.CommGroup, buckets: Sequence[FlatBucket]) -> None:
        """Move the state into ``new`` (the same optimizer over another engine's slices, the same sharded
        parameters) without gathering it whole anywhere: per bucket and entry of this layout one all-gather (one
        bucket's size at a time), from which each rank copies the elements its new slices hold. A collective.
        Afterwards the state is in ``new`` and ``optimizer.state`` stays the :class:`ShardedState`."""
        merged = self._merged_info(comm)
        new_of: dict[int, list[ShardSlice]] = {}
        for sl in new.slices.values():
            for ns in sl:
                new_of.setdefault(id(ns.param), []).append(ns)
        for bucket, k, buf in self._gathered(comm, buckets, merged, drop=True):
            for slot, i in enumerate(bucket.param_indices):
                if merged.get(i, {}).get(k, ("",))[0] != "elem":
                    continue
                a, b = bucket.ranges[slot]
                off = bucket.offsets[slot]
                for ns in new_of.get(id(self.params[i]), ()):
                    lo, hi = max(a, ns.p_lo), min(b, ns.p_hi)
                    if lo >= hi:
                        continue
                    t = new.state[ns.tensor].get(k)
                    if t is None:
                        t = torch.zeros(ns.hi - ns.lo, dtype=buf.dtype, device=ns.tensor.device)
                        new.state[ns.tensor][k] = t.view(ns.tensor.shape) if ns.whole else t
                    t.view(-1)[lo - ns.p_lo:hi - ns.p_lo].copy_(buf[off + lo - a:off + hi - a])
        for i, entries in merged.items():
            for ns in new_of.get(id(self.params[i]), ()):
                for k, kind in entries.items():
                    if kind[0] == "value":  # (a tensor of its own per slice: Adam increments ``step`` in place)
                        new.state[ns.tensor][k] = kind[1].to(kind[2]).clone() if torch.is_tensor(kind[1]) else kind[1]
        new.absorbed = True
        self.state.clear()
        self.absorbed = False

    def move(self, new: "ShardedOptimizer") -> None:
        """Move the state into ``new`` when its slices are these (another engine with the same bucket layout, on
        every rank: :meth:`ShardedStep.adopt` decides): the tensors change hands, nothing is copied or sent."""
        for b, sl in self.slices.items():
            for s, ns in zip(sl, new.slices.get(b, ())):
                st = self.state.pop(s.tensor, None)
                if st:
                    new.state[ns.tensor] = st
        new.absorbed = True
        self.state.clear()
        self.absorbed = False

    def _assemble(self, bucket: FlatBucket, k: str, buf: torch.Tensor, merged: dict, full: dict,
                  device: Optional[torch.device]) -> None:
        """Copy entry ``k`` of every parameter of ``bucket`` from the gathered ``buf`` into its full tensor."""
        for slot, i in enumerate(bucket.param_indices):
            if merged.get(i, {}).get(k, ("",))[0] != "elem":
                continue
            p = self.params[i]
            t = full.setdefault(i, {}).get(k)
            if t is None:
                t = full[i][k] = torch.zeros(p.numel(), dtype=buf.dtype, device=device or p.device)
            a, b = bucket.ranges[slot]
            off = bucket.offsets[slot]
            t[a:b].copy_(buf[off:off + b - a])

    def consolidate(self, comm: C.CommGroup, buckets: Sequence[FlatBucket],
                    device: Optional[torch.device] = None) -> None:
        """Gather the sliced state back into ``optimizer.state`` (:meth:`gather_state`, on every rank; ``device``:
        where the full tensors go, default the parameters' device) and drop the slices. No-op when the state is
        not here."""
        if not self.absorbed:
            return
        out = collections.defaultdict(dict, dict(self.optimizer.state))  # (the unsharded entries, then the rest)
        out.update(self.gather_state(comm, buckets, device, drop=True))
        self.optimizer.state = out
        self.optimizer.__dict__.pop("state_dict", None)
        self.state.clear()
        self.absorbed = False

    def state_dict(self, comm: C.CommGroup, buckets: Sequence[FlatBucket]) -> dict[str, Any]:
        """``optimizer.state_dict()`` as the whole optimizer would give it, assembled on rank 0 in CPU memory (other
        ranks take part in the collective and get ``{}``, as Lightning's FSDP strategy does); the shards stay in
        place, so training goes on without re-slicing. A collective."""
        keep = comm.rank == 0
        full = self.gather_state(comm, buckets, torch.device("cpu"), keep=keep)
        if not keep:
            return {}
        index: dict[int, int] = {}
        groups = []
        for g in self.optimizer.param_groups:  # (torch's packing: parameters numbered in group order)
            packed = {k: v for k, v in g.items() if k != "params"}
            for p in g["params"]:
                index.setdefault(id(p), len(index))
            packed["params"] = [index[id(p)] for p in g["params"]]
            groups.append(packed)
        state = {index[id(p)]: st for p, st in dict.items(self.optimizer.state) if id(p) in index}
        state.update({index[id(p)]: st for p, st in full.items() if id(p) in index})
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    # ------------------------------------------------------------------ the step
    def step(self, b: int, buffer: Optional[torch.Tensor], used: Sequence[bool], hparams: list[dict[str, Any]],
             grads: Optional[dict[int, Optional[torch.Tensor]]] = None) -> None:
        """Step this rank's slices of bucket ``b``: a slice of a parameter some rank produced a gradient for is
        stepped with the averaged (clipped) gradient in ``buffer[lo:hi]`` (``buffer`` None, a sync-mode step: with
        its elements of ``.grad``, which then holds it); one no rank did is stepped with its own ``.grad`` where that
        is not None (as DDP), and skipped otherwise. Runs the optimizer class's ``step`` on a shallow view of
        ``optimizer`` whose ``param_groups`` hold the slices (hyper-parameters ``hparams``) and whose ``state`` is
        :attr:`state`. ``grads``: ``id(param) -> .grad`` to read instead of ``.grad`` (the worker's snapshot)."""
        per_group: list[dict[str, Any]] = []
        stepped: list[ShardSlice] = []
        for gi, sl in self.by_group.get(b, []):
            plist = []
            for s in sl:
                if used[s.slot] and buffer is not None:
                    g = buffer[s.lo:s.hi]
                elif (g := s.param.grad if grads is None else grads.get(id(s.param))) is not None:
                    g = g.detach().reshape(-1)[s.p_lo:s.p_hi]
                else:
                    continue
                s.tensor.grad = g.view(s.tensor.shape)
                plist.append(s.tensor)
                stepped.append(s)
            if plist:
                per_group.append(dict(hparams[gi], params=plist))
        if not per_group:
            return
        try:
            with torch.no_grad():
                step_on(self.optimizer, per_group, self.state)
        finally:
            for s in stepped:
                s.tensor.grad = None


class ShardedStep:
    """The engine's side of ``shard_optimizer``: the slices, the kept gradient shards, the round's preparation and
    the step of each bucket before its all-gather (module docstring).

    Args:
        buckets: the engine's buckets.
        sharded: indices of the buckets stepped sharded (the uncompressed ones).
        comm: the engine's group.
        params: the engine's parameters (engine order).
        averaged_grads: ``(optimizer, grads) -> the averaged gradients clip_grad_norm_ sees under DDP`` once every
            bucket holds its whole averaged gradients (:func:`~lightning_pipedap.engine.update.averaged_grads`).
        names: the parameters' names (engine order), for messages.

    Attributes:
        round: the current :class:`ShardRound`, or None when this round gathers gradients (sync mode).
        opts: ``id(optimizer) -> ShardedOptimizer`` in the order they first stepped (several with manual
            optimization, e.g. Muon for the matrices and AdamW for the rest; a deferred round steps one).
    """

    def __init__(self, buckets: Sequence[FlatBucket], sharded: Sequence[int], comm: C.CommGroup,
                 params: Sequence[torch.Tensor],
                 averaged_grads: Callable[[Optimizer, dict], list[torch.Tensor]] = lambda opt, grads: [],
                 names: Sequence[str] = ()) -> None:
        self.buckets, self.comm, self.params = list(buckets), comm, list(params)
        self.names = list(names)
        self.averaged_grads = averaged_grads
        self.sharded = sorted(sharded)
        self.slices = {b: shard_slices(self.buckets[b], comm.rank) for b in self.sharded}
        #: (bucket, slot) -> where that slice's averaged gradient is kept this round (see the module docstring)
        self.keep: dict[tuple[int, int], torch.Tensor] = {}
        self._spare: dict[tuple[int, int], torch.Tensor] = {}
        self.local_flags = {b: torch.zeros_like(self.buckets[b].flags) for b in self.sharded}
        self.reduced_flags = {b: torch.zeros_like(self.buckets[b].flags) for b in self.sharded}
        self.used: dict[int, list[bool]] = {}
        self.round: Optional[ShardRound] = None
        self.opts: dict[int, ShardedOptimizer] = {}
        self.armed = False
        #: the last sync-mode step's optimizer update as a whole-model step would take it (s): the unsharded part
        #: plus N times this rank's slices (the parameter all-gathers and the land copies left out), or None; what
        #: a profile's ``t_update`` means (the planners' sharded model divides it by N again)
        self.sync_update_s: Optional[float] = None
        #: the last sync-mode step's land copies: ``(seconds, bytes)`` of copying the gathered parameters into the
        #: model (:func:`land_params`, every bucket of the step), or None; the planner's land cost per byte
        #: (:attr:`~lightning_pipedap.plan.sharding.Sharding.land_s_per_byte`)
        self.sync_land: Optional[tuple[float, int]] = None
        #: engine indices of the parameters held by sharded buckets
        self.params_sharded = sorted({i for b in self.sharded for i in self.buckets[b].param_indices})
        #: per sharded bucket, the buffer range its land copy skips (:func:`land_params`): this rank's shard
        self.in_place = {b: self.buckets[b].own_data_range(comm.rank) for b in self.sharded}

    @classmethod
    def for_engine(cls, engine: Any, param_transport: Any) -> "ShardedStep":
        """The sharded step of ``engine`` (a :class:`~.engine.CommEngine` built with ``shard``): its uncompressed
        buckets are sharded; in a deferred round its worker steps them before their all-gather, which
        ``param_transport`` performs (the parameters' own dtype); a sync-mode step runs :meth:`sync_step`."""
        compressed = engine.transport is not None
        sharded = [b for b in range(len(engine.buckets)) if not (compressed and engine.schedule.is_compressed(b))]
        ref = weakref.ref(engine)  # (no cycle engine -> step -> engine: a closed engine's buffers go at once)
        step = cls(engine.buckets, sharded, engine.comm, engine.params,
                   lambda opt, grads: averaged_grads(ref(), opt, grads), engine.param_names)
        engine.worker.shard, engine.worker.param_transport = step, param_transport
        return step

    # ------------------------------------------------------------------ trainer side
    @property
    def optimizer(self) -> Optional[ShardedOptimizer]:
        """The first optimizer stepped sharded (the one a deferred round steps), or None before any."""
        return next(iter(self.opts.values()), None)

    def sharded_of(self, optimizer: Optimizer) -> Optional[ShardedOptimizer]:
        """``optimizer``'s :class:`ShardedOptimizer` when it has stepped sharded on this engine, else None."""
        return self.opts.get(id(optimizer))

    def attach(self, optimizer: Optimizer) -> ShardedOptimizer:
        """``optimizer``'s :class:`ShardedOptimizer` (built at its first sharded step): this rank's slices of the
        optimizer's own parameters (several optimizers share the engine's buckets, each parameter in one of them).

        Raises:
            ValueError: if a parameter belongs to this optimizer and to one attached before (named).
        """
        opt = self.opts.get(id(optimizer))
        if opt is None:
            opt = ShardedOptimizer(optimizer, self.slices, self.params, self.names, self.comm.world_size)
            opt.owned = [i for i in self.params_sharded if id(self.params[i]) in opt.mine]
            opt.buckets = [b for b in self.sharded if any(id(p) in opt.mine for p in self.buckets[b].params)]
            for other in self.opts.values():
                both = [i for i in other.owned if i in set(opt.owned)]
                if both:
                    raise ValueError(f"pipedap: shard_optimizer: parameter {opt.name(both[0])} is in two optimizers "
                                     f"({type(other.optimizer).__name__} and {type(optimizer).__name__}); give each "
                                     "parameter to one optimizer")
            self.opts[id(optimizer)] = opt
        return opt

    def adopt(self, old: "ShardedStep") -> None:
        """The optimizer state of the engine this one replaces (``old``, the same group): moved shard to shard when
        both shard the same parameters (as it is, locally, with the same bucket layout: :meth:`ShardedOptimizer.move`;
        else :meth:`ShardedOptimizer.transfer`), else gathered whole into
        ``optimizer.state`` (it is sliced again at this engine's first sharded step). A collective."""
        if not any(prev.absorbed for prev in old.opts.values()):
            return
        if {id(old.params[i]) for i in old.params_sharded} != {id(self.params[i]) for i in self.params_sharded}:
            old.consolidate()
            return
        same = old.sharded == self.sharded and _layouts(old.buckets) == _layouts(self.buckets)
        for prev in [p for p in old.opts.values() if p.absorbed]:
            new = self.attach(prev.optimizer)
            _ = prev.move(new) if same else prev.transfer(new, self.comm, old.buckets)

    def release_buffers(self) -> None:
        """Kept after its engine closed, for :meth:`adopt`: the buffers and kept shards go (the move reads neither),
        so they are not alive next to the next engine's (a gradient's worth of memory at each start-up change)."""
        for bucket in self.buckets:
            bucket.release()
        self.keep.clear(), self._spare.clear()

    def sync_step(self, optimizer: Optimizer) -> None:
        """A sync-mode optimizer step (main thread, after backward wrote the averaged gradients to ``.grad`` and the
        round's ops ended): the optimizer's own step on the parameters of no sharded bucket, this rank's slices
        stepped from their ``.grad`` elements (clipped as Lightning clipped them), then per bucket the parameter
        slices all-gathered (a collective) and copied into the model. The state stays sliced; one all-gather of
        parameters per bucket more than an unsharded sync step."""
        opt = self.attach(optimizer)
        opt.absorb(opt.owned)
        hparams = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        whole_s, sliced_s = opt.step_unsharded(), 0.0
        land_s, land_bytes = 0.0, 0
        with torch.no_grad():
            for b in opt.buckets:  # (the buckets holding this optimizer's parameters: the same on every rank)
                bucket = self.buckets[b]
                t0 = time.perf_counter()
                self._step_slices(b, None, [True] * len(bucket.params), hparams, opt)
                sliced_s += time.perf_counter() - t0
                C.all_gather_(bucket.buffer, self.comm)
                t0 = time.perf_counter()
                land_params(bucket, self.in_place.get(b))  # (bytes: the whole bucket's, as the deferred land)
                land_s += time.perf_counter() - t0
                land_bytes += sum(p.numel() * p.element_size() for p in bucket.params)
        self.sync_update_s = whole_s + self.comm.world_size * sliced_s
        self.sync_land = (land_s, land_bytes)

    def begin_round(self) -> None:
        """A reduction round starts: sharded (:attr:`armed`, a deferred step) or gathering gradients."""
        self.round = ShardRound() if self.armed and self.sharded else None  # (every bucket compressed: nothing)

    def mark_ready(self, b: int) -> None:
        """Bucket ``b``'s gradients are complete: keep its local used flags (the reduce-scatter overwrites them)."""
        if b in self.local_flags:
            self.local_flags[b].copy_(self.buckets[b].flags)

    def go(self, optimizer: Optimizer, hparams: list[dict[str, Any]], clip: Any, nonfinite: Optional[str]) -> None:
        """The round's optimizer step was recorded: move the optimizer state into the slices and let the worker
        step (main thread)."""
        r = self.round
        if r is None:
            return
        opt = self.attach(optimizer)
        opt.absorb(opt.owned)
        r.hparams, r.clip, r.nonfinite = hparams, clip, nonfinite
        r.grads = grad_snapshot([self.params[i] for i in self.params_sharded])
        r.go.set()

    def consolidate(self, device: Optional[torch.device] = None) -> None:
        """The optimizer state back into ``optimizer.state`` (a collective; worker idle; ``device``: where)."""
        for opt in self.opts.values():
            opt.consolidate(self.comm, self.buckets, device)

    def release(self) -> None:
        """After a failure: :meth:`ShardedOptimizer.release` (local; the sharded state is dropped)."""
        for opt in self.opts.values():
            opt.release()

    # ------------------------------------------------------------------ worker side
    def wait_go(self, timeout_s: float, closed: Callable[[], bool]) -> bool:
        """Worker: wait until the step was recorded (False on timeout or when the engine closes)."""
        r = self.round
        deadline = time.monotonic() + timeout_s
        while not r.go.wait(0.1):
            if closed() or time.monotonic() > deadline:
                return False
        return True

    def prepare(self) -> None:
        """Worker, once per sharded round after every reduce-scatter: one all-reduce (float64) of every sharded
        bucket's local used flags and each slot's NaN/inf counts in this rank's shard (non-finite check); then the
        verdict and the clipped shards kept for ``.grad``.

        Clip by norm needs ``clip_grad_norm_``'s factor bit for bit (per-tensor norms of the whole averaged
        gradients: a factor one ulp off is amplified by Adam on parameters whose true gradient is zero, issue 26),
        so every sharded bucket's gradients are all-gathered first and the factor is computed as in an unsharded
        step (:func:`~lightning_pipedap.engine.update.clip_norm_coefficient`): one more all-gather per bucket.
        """
        r = self.round
        clip = r.clip
        by_norm = clip is not None and clip.algorithm == "norm"
        check = r.nonfinite is not None
        parts: list[torch.Tensor] = [self.local_flags[b].to(torch.float64) for b in self.sharded]
        if by_norm:  # (the whole averaged gradients on every rank: the clip factor exactly as DDP's, see below)
            for b in self.sharded:
                C.all_gather_(self.buckets[b].buffer, self.comm)
        if check:
            parts.extend(nonfinite_counts(self.buckets, self.sharded, self.slices, self.comm.rank))
        vec = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)  # (on the buckets' device)
        if vec.numel():
            C.all_reduce_(vec, self.comm)
        pos = 0
        for b in self.sharded:
            k = len(self.buckets[b].params)
            self.reduced_flags[b].copy_(vec[pos:pos + k])
            self.used[b] = (vec[pos:pos + k] > 0.5).tolist()
            pos += k
        if check:
            for b in self.sharded:
                k = len(self.buckets[b].params)
                c = vec[pos:pos + 2 * k]
                pos += 2 * k
                if r.finding is None and bool((c > 0).any()):
                    slot = int((c.view(k, 2).sum(1) > 0).nonzero()[0, 0])
                    bucket = self.buckets[b]
                    a, z = bucket.ranges[slot]
                    r.finding = (b, slot, int(c[2 * slot]), int(c[2 * slot + 1]), z - a)
        if by_norm:
            r.coef = clip_norm_coefficient(self.averaged_grads(self.optimizer.optimizer, r.grads), clip.value)
        r.stepped = not (r.finding is not None and r.nonfinite in ("raise", "skip"))
        self._clip_and_keep(clip, r.coef, r.grads)
        r.grads = {id(s.param): r.grads.get(id(s.param)) for b in self.sharded for s in self.slices[b]
                   if not self.used[b][s.slot]}  # (what the steps still read: no old .grad pinned past them)
        r.prepared.set()

    def _clip_and_keep(self, clip: Any, coef: Optional[torch.Tensor], grads: dict[int, Any]) -> None:
        """Clip this rank's shards (and, for a parameter no rank produced a gradient for, its own ``.grad`` in
        place, as ``clip_grad_norm_`` does) and keep each used slice's averaged gradient for later ``.grad`` reads
        (:func:`keep_view`)."""
        self.keep.clear()
        for b in self.sharded:
            bucket = self.buckets[b]
            lo, hi = bucket.own_data_range(self.comm.rank)
            shard = bucket.buffer[lo:hi]
            if clip is not None and clip.algorithm == "value":
                shard.clamp_(-clip.value, clip.value)
            elif clip is not None and coef is not None:
                shard.mul_(coef)
            for s in self.slices[b]:
                if self.used[b][s.slot]:
                    g = grads.get(id(s.param))
                    self.keep[(b, s.slot)] = keep_view(s, bucket.buffer.dtype, g, self._spare)
                    self.keep[(b, s.slot)].copy_(bucket.buffer[s.lo:s.hi])
        if clip is None:
            return
        done: set[int] = set()
        for b in self.sharded:
            for slot, i in enumerate(self.buckets[b].param_indices):
                g = grads.get(id(self.params[i]))
                if self.used[b][slot] or i in done or g is None:
                    continue
                done.add(i)
                with torch.no_grad():
                    if clip.algorithm == "value":
                        g.clamp_(-clip.value, clip.value)
                    elif coef is not None:
                        g.mul_(coef)

    def drop_kept(self, buckets: Sequence[int]) -> None:
        """Forget the kept gradient shards of ``buckets`` (their ``.grad`` will not be written any more: a new
        backward starts, or ``.grad`` was cleared). A kept view of a ``.grad`` that Lightning set to None would keep
        that whole old gradient alive next to the one the next backward allocates (one gradient's worth of memory)."""
        for b in buckets:
            for s in self.slices.get(b, ()):
                self.keep.pop((b, s.slot), None)

    def step_bucket(self, b: int) -> bool:
        """Worker, before AG(b): step this rank's slices (unless the round's verdict forbids it) and write the
        parameter slices and the reduced used flags into the buffer, so the all-gather gathers parameters.
        Returns whether the shard was stepped."""
        r = self.round
        bucket = self.buckets[b]
        self._step_slices(b, bucket.buffer, self.used[b], r.hparams if r.stepped else None, self.optimizer)
        bucket.flags.copy_(self.reduced_flags[b])
        return r.stepped

    def _step_slices(self, b: int, grads: Optional[torch.Tensor], used: Sequence[bool],
                     hparams: Optional[list[dict[str, Any]]], opt: Optional[ShardedOptimizer]) -> None:
        """Step ``opt``'s slices of bucket ``b`` on this rank (:meth:`ShardedOptimizer.step`; ``grads``: the buffer
        holding the averaged gradients, or None: their ``.grad`` elements; ``hparams`` None: not stepped) and write
        every parameter slice of this rank into the bucket's buffer for the all-gather (the others unchanged)."""
        for s in self.slices[b]:
            if s.master:  # (a non-contiguous parameter: its slice is a copy, refreshed here)
                s.tensor.view(-1).copy_(s.param.detach().reshape(-1)[s.p_lo:s.p_hi])
        if hparams is not None and opt is not None:
            opt.step(b, grads, used, hparams, None if grads is None else self.round.grads)  # (a buffer: a worker round)
        buffer = self.buckets[b].buffer
        for s in self.slices[b]:
            buffer[s.lo:s.hi].copy_(s.tensor.reshape(-1))
