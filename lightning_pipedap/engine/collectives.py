"""The only module of lightning_pipedap that talks to ``torch.distributed``.

Everything the engine and the strategy send over the network goes through the functions here, so
backends differ only in this file:

* **gloo** (CPU): reduce-scatter and all-gather are a chunked point-to-point ring (N-1 steps,
  each step's segment split into pipelined pieces), because gloo's own ``reduce_scatter_tensor``
  reached only ~43% of line rate on a 1 Gbit/s link (308 ms vs 140 ms for 32 MiB, docs/HOW_IT_WORKS.md)
  while chunked ``isend``/``irecv`` reached 87%. All-reduce uses gloo's native ring.
* **nccl** (CUDA): the native collectives, issued on the caller's current stream.

The ring follows the classic bandwidth-optimal schedule (Patarasuk & Yuan, "Bandwidth optimal
all-reduce algorithms for clusters of workstations", JPDC 2009): each rank sends and receives
``(N-1)/N`` of the buffer, so the α-β cost of either primitive is ``(N-1)·α + (N-1)/N · bytes · β``.
"""

from __future__ import annotations

import datetime
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_pipedap import compat

__all__ = [
    "CommGroup",
    "is_initialized",
    "new_comm_group",
    "destroy_comm_group",
    "ring_reduce_scatter_",
    "ring_all_gather_",
    "broadcast_coalesced_",
    "broadcast_object",
    "native_reduce_scatter_",
    "native_all_gather_",
    "reduce_scatter_wire_",
    "all_gather_wire_",
    "WIRE_DTYPES",
    "SparseReduction",
    "start_sparse_all_reduce",
    "Heartbeat",
    "PeerLostError",
    "named_peer_failure",
    "naming_peer_failures",
    "ddp_reduction_finished",
    "ddp_buffers_sync_next",
    "finish_stalled_reduction",
    "ranks_not_stalled",
    "ranks_marked_stalled",
]


@dataclass
class CommGroup:
    """A dedicated process group and the facts the engine needs about it.

    Attributes:
        group: the ``torch.distributed`` process group (all ranks, same order as WORLD).
        rank: this process's rank in ``group``.
        world_size: number of ranks.
        backend: ``"gloo"`` or ``"nccl"`` (lower case).
        chunk_bytes: piece size of the gloo ring pipeline, in bytes.
    """

    group: object
    rank: int
    world_size: int
    backend: str
    chunk_bytes: int = 2 << 20
    # scratch tensors of the ring, by (role, dtype, device): reused across calls (see :meth:`scratch`)
    _scratch: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def uses_ring(self) -> bool:
        """True when RS/AG run as the point-to-point ring (gloo), False for native collectives."""
        return self.backend == "gloo"

    def scratch(self, role: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D scratch tensor of ``numel`` elements for the ring, kept and reused across calls.

        Fresh receive buffers cost page faults on first touch (about a fifth of the ring's CPU time
        per byte on a 1 Gbit/s link, BENCHMARKS.md); one buffer per ``role`` grows to the largest
        size asked for and is reused. Only the thread that runs this group's collectives may use it
        (the engine's communication worker), and no two live uses may share a ``role``.
        """
        key = (role, dtype, device)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._scratch[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def release_scratch(self) -> None:
        """Drop the ring's scratch tensors (they grow to the largest bucket ever reduced: a start-up engine's). Call
        only while no collective of this group runs (between engines); the next use allocates what it needs."""
        self._scratch.clear()


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def new_comm_group(timeout_s: float, chunk_bytes: int = 2 << 20) -> CommGroup:
    """Create the dedicated process group used only by the communication worker.

    Must be called by every rank, in the same order relative to other group creations.

    Args:
        timeout_s: timeout of every collective on the group, in seconds.
        chunk_bytes: piece size of the gloo ring pipeline, in bytes (> 0).

    Raises:
        RuntimeError: if the default process group is not initialised.
        ValueError: if ``chunk_bytes`` is not positive.
    """
    if not is_initialized():
        raise RuntimeError("pipedap: torch.distributed is not initialised; the strategy sets it up before the engine")
    if chunk_bytes <= 0:
        raise ValueError(f"ring chunk size must be positive, got {chunk_bytes} bytes")
    backend = str(dist.get_backend()).lower()
    group = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return CommGroup(group, dist.get_rank(group), dist.get_world_size(group), backend, chunk_bytes)


def destroy_comm_group(comm: CommGroup) -> None:
    """Destroy the dedicated group (collective-free in torch >= 2.2; safe to call once)."""
    if is_initialized() and comm.group is not None:
        dist.destroy_process_group(comm.group)
        comm.group = None


def _pieces(numel: int, piece: int) -> list[slice]:
    return [slice(i, min(i + piece, numel)) for i in range(0, numel, piece)] or [slice(0, 0)]


#: 16-bit wire formats of the ring, by name (``wire_dtype``: :class:`~lightning_pipedap.strategy.config.PipeDAPConfig`)
WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _wire(buf: torch.Tensor, wire: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The wire dtype to use for ``buf``: ``wire`` when it is narrower than ``buf``'s dtype, else None (as is)."""
    if wire is None or not buf.is_floating_point() or torch.finfo(wire).bits >= torch.finfo(buf.dtype).bits:
        return None
    return wire


def _host_staged(buf: torch.Tensor, comm: CommGroup, role: str) -> Optional[torch.Tensor]:
    """A host copy of a device ``buf`` for the gloo ring (gloo's point-to-point ops take CPU tensors only: a CUDA
    tensor's pointer handed to its TCP transport fails with ``writev ... Bad address``); None for a CPU ``buf``."""
    if buf.device.type == "cpu":
        return None
    host = comm.scratch(role, buf.numel(), buf.dtype, torch.device("cpu"))
    host.copy_(buf)
    return host


def ring_reduce_scatter_(buf: torch.Tensor, comm: CommGroup, wire: Optional[torch.dtype] = None) -> torch.Tensor:
    """In-place ring reduce-scatter (sum) of a flat buffer.

    Args:
        buf: 1-D tensor of ``N·S`` elements (N = world size); segment ``r`` is ``buf[r·S:(r+1)·S]``.
        comm: the group.
        wire: optional 16-bit dtype (``torch.float16`` / ``torch.bfloat16``) of the bytes on the wire;
            ignored unless narrower than ``buf``'s dtype. Each piece is cast into a wire-dtype send
            buffer just before it is sent, received pieces are added into ``buf`` in ``buf``'s dtype
            (fp32 accumulation), and at the end this rank's reduced segment is rounded to the wire
            dtype in place, so it equals what :func:`ring_all_gather_` with the same ``wire`` delivers
            to every rank (a gradient norm computed from the shards is that of the applied gradients).

    Returns:
        ``buf[rank·S:(rank+1)·S]``, which holds the element-wise sum over ranks of this segment.
        Other segments hold partial sums afterwards.

    Step ``s`` (0..N-2) sends segment ``(r-s-1) mod N`` to rank ``r+1`` and adds segment
    ``(r-s-2) mod N`` received from rank ``r-1``; a piece is forwarded as soon as it has been added,
    so transfers of consecutive steps overlap. Receive (and wire send) buffers are the group's
    scratch tensors (:meth:`CommGroup.scratch`), reused across calls.

    Rounding with ``wire`` (unit round-off ``u``: 2^-11 fp16, 2^-8 bf16): every partial sum is
    rounded once when it is sent and the result once at the end, so each element of the result is
    within ``(N-1)·u·Σ_k |x_k| + u·|Σ_k x_k|`` (to first order) of the exact sum (N-1 hops plus the
    final rounding); with N = 2: ``u·(|x_other| + |sum|)``. fp16 values beyond 65504 become ±inf.
    """
    n, r = comm.world_size, comm.rank
    seg = buf.view(n, -1)
    host = _host_staged(buf, comm, "rs_host") if n > 1 else None
    if host is not None:  # a device tensor on gloo: the ring runs on a host copy, the own segment is copied back
        seg[r].copy_(ring_reduce_scatter_(host, comm, wire))
        return seg[r]
    wire = _wire(buf, wire)
    if n == 1:
        if wire is not None:
            seg[0].copy_(seg[0].to(wire))
        return seg[0]
    right, left = (r + 1) % n, (r - 1) % n
    S = seg.shape[1]
    pieces = _pieces(S, max(1, comm.chunk_bytes // buf.element_size()))
    rdtype = wire or buf.dtype
    slots = min(2, n - 1)  # (step s receives into slot s % 2: with 2 ranks there is one step, one slot)
    tmp = comm.scratch("rs_recv", slots * S, rdtype, buf.device).view(slots, S)
    out = comm.scratch("rs_send", n * S, wire, buf.device).view(n, S) if wire is not None else seg
    group, isend, irecv = comm.group, dist.isend, dist.irecv
    sends: list = []
    prev = None  # (recv works, recv views, views of the segment they are added into) of the previous step
    for s in range(n - 1):
        send_idx, recv_idx = (r - s - 1) % n, (r - s - 2) % n
        rbuf, dst, src = tmp[s % slots], seg[send_idx], out[send_idx]
        rviews = [rbuf[p] for p in pieces]
        rworks = [irecv(v, src=left, group=group) for v in rviews]
        for i, p in enumerate(pieces):
            if prev is not None:
                prev[0][i].wait()
                prev[2][i].add_(prev[1][i])
            if wire is not None:
                src[p].copy_(dst[p])  # cast on the fly: this piece's partial sum, rounded once
            sends.append(isend(src[p], dst=right, group=group))
        prev = (rworks, rviews, [seg[recv_idx][p] for p in pieces])
    for w, v, d in zip(*prev):
        w.wait()
        d.add_(v)
    for w in sends:
        w.wait()
    if wire is not None:  # round the own segment through its (never sent) slot of the wire buffer: no allocation
        out[r].copy_(seg[r])
        seg[r].copy_(out[r])
    return seg[r]


def ring_all_gather_(buf: torch.Tensor, comm: CommGroup, wire: Optional[torch.dtype] = None,
                     during: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """In-place ring all-gather of a flat buffer whose own segment ``r`` is filled.

    Args:
        buf: 1-D tensor of ``N·S`` elements; on entry segment ``rank`` holds this rank's data.
        comm: the group.
        wire: optional 16-bit dtype of the bytes on the wire (ignored unless narrower than ``buf``'s):
            the own segment is cast once into a wire-dtype staging buffer and rounded in place to
            what is sent, received pieces land in the staging buffer (forwarded from there as is) and
            are widened into ``buf``; every rank ends with byte-identical ``buf``.
        during: optional work of the caller's that overlaps the transfer: called once, after the first ring
            step's sends and receives are posted (with 2 ranks: all of them) and before any wait; it must not touch
            ``buf``. The all-gather returns after it (an exception it raises is re-raised once the posted
            transfers finished).

    Returns:
        ``buf``, with every segment ``k`` equal to rank ``k``'s segment.
    """
    n, r = comm.world_size, comm.rank
    seg = buf.view(n, -1)
    host = _host_staged(buf, comm, "ag_host") if n > 1 else None
    if host is not None:  # a device tensor on gloo: gathered on a host copy, copied back whole
        return buf.copy_(ring_all_gather_(host, comm, wire, during))
    wire = _wire(buf, wire)
    if n == 1:
        if wire is not None:
            seg[0].copy_(seg[0].to(wire))
        if during is not None:
            during()
        return buf
    right, left = (r + 1) % n, (r - 1) % n
    S = seg.shape[1]
    pieces = _pieces(S, max(1, comm.chunk_bytes // buf.element_size()))
    stage = seg
    if wire is not None:
        stage = comm.scratch("ag_stage", n * S, wire, buf.device).view(n, S)
        stage[r].copy_(seg[r])
        seg[r].copy_(stage[r])  # the owner keeps what the others receive
    group, isend, irecv = comm.group, dist.isend, dist.irecv
    sends: list = []
    failed: Optional[BaseException] = None
    prev = None  # (recv works, staging views, views of buf they widen into) of the previous step
    for s in range(n - 1):
        send_idx, recv_idx = (r - s) % n, (r - s - 1) % n
        rviews = [stage[recv_idx][p] for p in pieces]
        rworks = [irecv(v, src=left, group=group) for v in rviews]
        src = stage[send_idx]
        for i, p in enumerate(pieces):
            if prev is not None:
                prev[0][i].wait()
                if wire is not None:
                    prev[2][i].copy_(prev[1][i])
            sends.append(isend(src[p], dst=right, group=group))
        prev = (rworks, rviews, [seg[recv_idx][p] for p in pieces])
        if s == 0 and during is not None:
            failed = _run_during(during)
    for w, v, d in zip(*prev):
        w.wait()
        if wire is not None:
            d.copy_(v)
    for w in sends:
        w.wait()
    if failed is not None:
        raise failed
    return buf


def _run_during(during: Callable[[], None]) -> Optional[BaseException]:
    """``during()``; the exception it raised (re-raised by the caller once its posted transfers finished), or None."""
    try:
        during()
    except BaseException as exc:  # noqa: BLE001 - re-raised after the waits
        return exc
    return None


def native_reduce_scatter_(buf: torch.Tensor, comm: CommGroup) -> torch.Tensor:
    """In-place reduce-scatter (sum) with the backend's own collective; same contract as the ring."""
    seg = buf.view(comm.world_size, -1)
    out = seg[comm.rank]
    dist.reduce_scatter_tensor(out, buf, group=comm.group)
    return out


def native_all_gather_(buf: torch.Tensor, comm: CommGroup) -> torch.Tensor:
    """In-place all-gather with the backend's own collective; same contract as the ring."""
    seg = buf.view(comm.world_size, -1)
    if comm.backend == "gloo":  # gloo's all_gather_into_tensor cannot alias its input
        src = seg[comm.rank].clone()
    else:
        src = seg[comm.rank]
    dist.all_gather_into_tensor(buf, src, group=comm.group)
    return buf


def reduce_scatter_(buf: torch.Tensor, comm: CommGroup) -> torch.Tensor:
    """Reduce-scatter (sum) of ``buf`` (``N·S`` elements); returns this rank's reduced segment."""
    return ring_reduce_scatter_(buf, comm) if comm.uses_ring else native_reduce_scatter_(buf, comm)


def all_gather_(buf: torch.Tensor, comm: CommGroup, during: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """All-gather of every rank's segment of ``buf`` into the whole of ``buf``; ``during``: work overlapping the
    transfer (:func:`ring_all_gather_`; on a native backend run after the collective is issued)."""
    if comm.uses_ring:
        return ring_all_gather_(buf, comm, during=during)
    native_all_gather_(buf, comm)
    if during is not None:
        during()
    return buf


def reduce_scatter_wire_(buf: torch.Tensor, comm: CommGroup, wire: torch.dtype) -> torch.Tensor:
    """:func:`reduce_scatter_` with a 16-bit wire format (see :func:`ring_reduce_scatter_`).

    On the native backends (NCCL) the whole buffer is cast to ``wire`` and reduce-scattered in it (the
    backend's own accumulation, not fp32), and the reduced segment is widened back into ``buf``.
    """
    if comm.uses_ring:
        return ring_reduce_scatter_(buf, comm, wire)
    if _wire(buf, wire) is None:
        return native_reduce_scatter_(buf, comm)
    low = buf.to(wire)
    out = native_reduce_scatter_(low, comm)
    seg = buf.view(comm.world_size, -1)[comm.rank]
    seg.copy_(out)
    return seg


def all_gather_wire_(buf: torch.Tensor, comm: CommGroup, wire: torch.dtype) -> torch.Tensor:
    """:func:`all_gather_` with a 16-bit wire format (see :func:`ring_all_gather_`)."""
    if comm.uses_ring:
        return ring_all_gather_(buf, comm, wire)
    if _wire(buf, wire) is None:
        return native_all_gather_(buf, comm)
    low = buf.to(wire)
    native_all_gather_(low, comm)
    return buf.copy_(low)


def all_reduce_(buf: torch.Tensor, comm: CommGroup) -> torch.Tensor:
    """In-place all-reduce (sum) of ``buf`` with the backend's native algorithm."""
    dist.all_reduce(buf, group=comm.group)
    return buf


class SparseReduction(NamedTuple):
    """A sparse all-reduce in flight (:func:`start_sparse_all_reduce`).

    Attributes:
        grad: the gradient it reduces in place: once ``work.wait()`` returned, the sum over ranks of every
            rank's ``grad / world_size`` (coalesced, same shape as the parameter).
        work: the backend's work handle.
    """

    grad: torch.Tensor
    work: Any


def start_sparse_all_reduce(grad: torch.Tensor, comm: CommGroup) -> SparseReduction:
    """DDP's reduction of one parameter with a sparse gradient, started asynchronously on ``comm``'s group.

    As DDP's reducer (``reducer.cpp``: ``mark_variable_ready_sparse`` then the bucket's all-reduce, one bucket
    per sparse parameter): ``grad`` is divided in place by the world size, then the backend's all-reduce (sum)
    runs on the sparse tensor itself. On gloo that gathers every rank's coalesced indices and values, adds
    them in rank order and coalesces (``ProcessGroupGloo``'s sparse all-reduce), the same on every rank; the
    same call on the same inputs gives DDP's bits (tested against DDP at 2 and 3 ranks).

    Args:
        grad: a ``torch.sparse_coo`` gradient (an empty one for a parameter without a gradient on this rank:
            :func:`~lightning_pipedap.engine.sparse.empty_sparse_like`), or a dense one; every rank passes the same
            shape and sparse/dense dims.
        comm: the group (every rank calls this for the same parameters in the same order).

    Returns:
        The :class:`SparseReduction`; ``work.wait()`` before reading ``grad``.
    """
    grad.div_(comm.world_size)
    return SparseReduction(grad, dist.all_reduce(grad, group=comm.group, async_op=True))


def broadcast_coalesced_(tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Broadcast ``tensors`` from global rank ``src`` on the default group, fused into one message per dtype.

    Used for module buffers (BatchNorm running statistics), as DDP does before a forward.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        dist.broadcast(flat, src=src)
        offset = 0
        for t in ts:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def broadcast_object(obj: object, src: int = 0, what: str = "an object") -> object:
    """Broadcast a picklable object from global rank ``src`` on the default group; returns it on every rank.

    Raises:
        PeerLostError: the broadcast failed because a peer stopped answering (names this rank, ``what`` was
            broadcast and the peer: :func:`named_peer_failure`).
    """
    box = [obj]
    with naming_peer_failures(f"the broadcast of {what} from rank {src}"):
        dist.broadcast_object_list(box, src=src)
    return box[0]


def init_from_env(backend: str = "gloo", timeout_s: float = 300.0) -> tuple[int, int]:
    """Initialise the default group from ``MASTER_ADDR/PORT``, ``RANK``, ``WORLD_SIZE``; return (rank, world).

    For benchmark scripts run outside Lightning. Raises ``KeyError`` naming a missing variable.
    """
    import os

    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        if var not in os.environ:
            raise KeyError(f"environment variable {var} is not set (needed to join the process group)")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def barrier() -> None:
    """Barrier on the default group."""
    dist.barrier()


def shutdown() -> None:
    """Destroy the default group if it exists."""
    if is_initialized():
        dist.destroy_process_group()


def all_gather_object(obj: object) -> list:
    """Gather one picklable object from every rank on the default group; returns the list by rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def ddp_reduction_finished(ddp: torch.nn.Module) -> bool:
    """Whether DDP's reducer finished averaging the last backward (always True inside ``no_sync``).

    DDP without ``find_unused_parameters`` launches its bucket all-reduces in bucket order, each once every
    parameter of the bucket has its gradient, and writes the averaged gradients back to ``.grad`` only once
    every bucket has been reduced. A parameter that gets no gradient in a backward (a branch that skips it)
    stalls its bucket and every later one: ``.grad`` keeps the local gradients, and the next forward raises
    "Expected to have finished reduction". This asks the reducer (one C++ call, no communication).

    Raises:
        compat.CompatError: this torch's reducer cannot be asked (:func:`~lightning_pipedap.compat.reducer_finalized`).
    """
    return compat.reducer_finalized(ddp.reducer)


def ranks_not_stalled(key: str, rank: int, world_size: int, timeout_s: float) -> list[int]:
    """Mark ``rank`` as stalled under ``key`` in the default group's rendezvous store and wait up to ``timeout_s``
    for every rank's mark; returns the ranks that did not mark it (empty: every rank stalled alike).

    A rank whose DDP reduction finished cannot mark anything: it is blocked inside DDP's backward, waiting for
    the bucket all-reduces that the stalled ranks never launched. The store (not a collective) lets the stalled
    ranks find that out without pairing a collective with DDP's pending ones.
    """
    store = compat.default_store()
    store.set(f"{key}/{rank}", "1")
    deadline = time.monotonic() + timeout_s
    while True:
        marked = _marked(store, key, world_size)
        missing = [r for r in range(world_size) if r not in marked]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.02)


def ranks_marked_stalled(key: str, world_size: int) -> list[int]:
    """The ranks that marked ``key`` in :func:`ranks_not_stalled` so far (no wait, no collective); empty when the
    store cannot be reached (the rank that hosts it has exited)."""
    try:
        return _marked(compat.default_store(), key, world_size)
    except compat.CompatError:
        raise
    except (RuntimeError, ValueError, OSError):  # (DistStoreError / DistNetworkError derive from RuntimeError)
        return []


def _marked(store: Any, key: str, world_size: int) -> list[int]:
    """The ranks whose ``key/<rank>`` is set in ``store``."""
    return [r for r in range(world_size) if store.check([f"{key}/{r}"])]


def finish_stalled_reduction(params: Sequence[torch.nn.Parameter], comm: CommGroup) -> list[int]:
    """Average ``.grad`` over the ranks after a stalled DDP reduction, as DDP with ``find_unused_parameters=True``
    does: a parameter without a gradient on this rank contributes zeros, one without a gradient on every rank
    keeps its ``.grad`` (None) untouched; each gradient is divided by the world size, then summed.

    Only for DDP without ``gradient_as_bucket_view`` (``.grad`` then holds this rank's local gradients: DDP
    writes back only when it finishes). Collectives: one flag all-reduce and one all-reduce of the gradients,
    on ``comm``'s group and not on the default group, where DDP's launched bucket all-reduces may still be
    running: if another rank did not stall (a parameter unused on some ranks only), this times out after
    ``comm``'s timeout with gloo's error instead of pairing with one of DDP's all-reduces.

    Args:
        params: the wrapped module's parameters that require gradients, identical order on every rank.
        comm: pipedap's own process group (:func:`new_comm_group`).

    Returns:
        Indices (into ``params``) of the parameters no rank produced a gradient for.
    """
    has = torch.tensor([float(p.grad is not None) for p in params])
    dist.all_reduce(has, group=comm.group)
    flags = has.tolist()
    unused = [k for k, h in enumerate(flags) if h == 0]
    reduce = [p for p, h in zip(params, flags) if h > 0]
    if reduce:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in reduce]
        flat = torch.cat([g.reshape(-1) for g in grads]).mul_(1.0 / comm.world_size)  # (DDP's copy into its buckets)
        dist.all_reduce(flat, group=comm.group)
        off = 0
        for p, g in zip(reduce, grads):
            n = g.numel()
            g.copy_(flat[off:off + n].view_as(g))
            p.grad = g
            off += n
    return unused


def torch_ddp(module: torch.nn.Module, device: torch.device, bucket_cap_mb: float,
              find_unused_parameters: bool, gradient_as_bucket_view: bool = False,
              sync_buffers_next: bool = True) -> torch.nn.Module:
    """Wrap ``module`` in PyTorch's ``DistributedDataParallel`` on the default process group.

    The C++ reducer all-reduces gradient buckets of ``bucket_cap_mb`` MiB inside backward (WFBP) and
    averages them into ``.grad``. Every rank must wrap at the same step (the reducer's collectives pair by
    order), but construction communicates nothing (``init_sync=False``): the strategy broadcast rank 0's state
    once at set-up, as DDP does, and a wrap in the middle of a fit must keep every rank's parameters and
    buffers as they are (rank-local state, e.g. an EMA codebook updated in place, would be overwritten).
    The wrapper's buffer rule continues the strategy's: ``sync_buffers_next`` says whether the previous forward
    synced gradients, so the first forward under the wrapper broadcasts rank 0's buffers exactly when DDP,
    wrapped once at set-up, would (:func:`ddp_buffers_sync_next`). Dropping the returned wrapper (and
    collecting it) removes its autograd hooks, so the module computes local gradients again.

    Args:
        module: the model (already on ``device``), identical on every rank.
        device: the model's device (``device_ids`` is set for CUDA).
        bucket_cap_mb: DDP's bucket size, MiB (> 0).
        find_unused_parameters: traverse the graph each step for parameters without a gradient.
        gradient_as_bucket_view: ``.grad`` as views into DDP's buckets (no second gradient copy).
        sync_buffers_next: whether the first forward under the wrapper broadcasts rank 0's buffers (DDP's rule:
            the previous forward ran with gradients enabled and synced them).

    Returns:
        The ``DistributedDataParallel`` wrapper.
    """
    ids = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else None
    ddp = torch.nn.parallel.DistributedDataParallel(module, device_ids=ids, bucket_cap_mb=bucket_cap_mb,
                                                    find_unused_parameters=find_unused_parameters,
                                                    gradient_as_bucket_view=gradient_as_bucket_view, init_sync=False)
    ddp.require_forward_param_sync = sync_buffers_next  # (DDP's flag for "broadcast buffers before the next forward")
    return ddp


def ddp_buffers_sync_next(ddp: torch.nn.Module) -> bool:
    """Whether DDP's next forward broadcasts rank 0's buffers (``require_forward_param_sync``: set by its forward
    when gradients are enabled and synced; checked on torch 2.13)."""
    return bool(getattr(ddp, "require_forward_param_sync", True))


def all_gather_rows(buf: torch.Tensor, comm: CommGroup) -> torch.Tensor:
    """All-gather a 1-D tensor of the same size on every rank; returns ``[N, len(buf)]`` (rank order).

    Used for non-summable compressed payloads (packed to equal byte size on every rank).
    """
    out = torch.empty(comm.world_size * buf.numel(), dtype=buf.dtype, device=buf.device)
    dist.all_gather_into_tensor(out, buf.contiguous(), group=comm.group)
    return out.view(comm.world_size, -1)


# ---------------------------------------------------------------------- errors that name the lost peer
class PeerLostError(RuntimeError):
    """A collective failed because a peer stopped answering; the message names this rank, the operation and what
    the heartbeat knows of each peer (the backend's own error, e.g. gloo's ``Connection reset by peer``, is the
    ``__cause__``)."""


#: the heartbeat of this process's current (or last) fit, for :func:`named_peer_failure`
_heartbeat: Optional["Heartbeat"] = None

#: words of the backends' errors when a peer's connection is gone or a collective timed out
_PEER_FAILURE_WORDS = ("Connection reset", "Connection closed", "Connection refused", "Broken pipe", "Timed out",
                       "timed out", "Timeout", "closed by peer", "NCCL", "gloo")


def named_peer_failure(exc: BaseException, operation: str, step: Optional[int] = None,
                       wait_s: float = 2.0) -> Optional[PeerLostError]:
    """A :class:`PeerLostError` for ``exc`` when it is a backend's error about a lost peer (``torch.distributed``'s
    ``DistError`` or a ``RuntimeError`` whose text is gloo's/NCCL's), else None (also for errors already named:
    text starting with ``pipedap:``).

    The message is ``pipedap: rank R: OPERATION [at step S] failed (PEERS): FIRST LINE OF exc``, where PEERS is the
    heartbeat's :meth:`Heartbeat.describe` after waiting up to ``wait_s`` seconds for a sign of life from each
    peer (``rank 1: no heartbeat for the last 2.0 s (stopped or dead?)``, ``rank 1: stopped on SIGTERM``).
    """
    text = str(exc)
    dist_error = getattr(dist, "DistError", None)
    if not isinstance(exc, RuntimeError) or isinstance(exc, PeerLostError) or text.startswith("pipedap:"):
        return None
    if not (dist_error is not None and isinstance(exc, dist_error) or any(w in text for w in _PEER_FAILURE_WORDS)):
        return None
    hb = _heartbeat
    try:
        peers = hb.describe(wait_s=wait_s) if hb is not None else "no heartbeat: the peers' state is unknown"
    except Exception as e:  # noqa: BLE001  (describing must not hide the error)
        peers = f"the peers' state could not be read: {e!r}"
    rank = dist.get_rank() if is_initialized() else "?"
    where = f" at step {step}" if step is not None else ""
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return PeerLostError(f"pipedap: rank {rank}: {operation}{where} failed ({peers}): {first}")


@contextmanager
def naming_peer_failures(operation: str, step: Optional[int] = None) -> Iterator[None]:
    """Re-raise a backend's lost-peer error inside the block as :class:`PeerLostError` naming ``operation``
    (:func:`named_peer_failure`); other exceptions pass unchanged."""
    try:
        yield
    except RuntimeError as exc:
        named = named_peer_failure(exc, operation, step)
        if named is None:
            raise
        raise named from exc


# ---------------------------------------------------------------------- liveness of the peers
_GONE = {"left": "left the fit (it finished, or ran out of batches: uneven inputs?)",
         "failed": "failed with an exception (see its log)",
         "interrupted": "was interrupted (SIGINT / KeyboardInterrupt)",
         "stopped": "stopped on SIGTERM"}
#: peer states after which the watchdog need not wait for the timeout: the peer will not answer again
_FAILED = ("failed", "interrupted", "stopped")


class Heartbeat:
    """Liveness of every rank through the default group's rendezvous store, and a watchdog.

    A daemon thread on each rank writes an increasing counter to the store key
    ``pipedap/heartbeat/<rank>`` every ``interval_s`` and reads the other ranks' keys. A peer whose
    counter has not changed for ``timeout_s`` (stopped with SIGSTOP, hung with the GIL held, or dead),
    that marked itself as left (:meth:`stop`: it finished or abandoned the fit), or a store that does
    not answer for ``timeout_s`` (rank 0, which hosts it, is gone) is *not answering*.

    After ``timeout_s + grace_s`` of a peer not answering (``failed_grace_s`` after a peer said it failed,
    was interrupted or stopped on SIGTERM: it will not answer again), ``on_stale(message)`` is called once from
    the watchdog thread with a message naming the rank(s), what was seen and ``context()`` (the
    strategy's phase and step). By then every collective of this rank should have failed by its own
    timeout; the call is the backstop for a wait nothing else bounds (a collective whose error a
    library swallows and follows with another). The strategy's ``on_stale`` logs the message and ends
    the process with exit code 1, as PyTorch's NCCL watchdog does.

    Args:
        timeout_s: seconds without a sign of life before a peer is not answering (> 0, finite).
        interval_s: seconds between beats (> 0).
        grace_s: extra seconds before ``on_stale``.
        on_stale: called once with the message (None: only :meth:`not_answering` reports).
        context: ``() -> str`` describing what this rank is doing, for the message.
        on_note: ``(rank, word)`` called once per word a peer publishes with its beats (:attr:`note`) and once
            for the state it left in (``"stopped"``, ``"failed"``, ...: :meth:`stop`).
        failed_grace_s: seconds after a peer's failure before ``on_stale``.

    Raises:
        RuntimeError: if the default group is not initialised or has no store.
    """

    PREFIX = "pipedap/heartbeat/"

    def __init__(self, timeout_s: float, interval_s: float = 1.0, grace_s: float = 10.0,
                 on_stale=None, context=None, on_note=None, failed_grace_s: float = 3.0) -> None:
        if not is_initialized():
            raise RuntimeError("pipedap: heartbeat needs the default process group")
        self.store = compat.default_store()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout_s, self.interval_s, self.grace_s = float(timeout_s), float(interval_s), float(grace_s)
        self.on_stale, self.context = on_stale, context or (lambda: "")
        #: a word published with every beat (``"sigterm"``: this rank received SIGTERM); peers see it
        self.note: Optional[str] = None
        self.on_note, self.failed_grace_s = on_note, float(failed_grace_s)
        self._noted: set[tuple[int, str]] = set()
        self._lock = threading.Lock()
        now = _now()
        self._seen: dict[int, tuple[str, float]] = {r: ("", now) for r in range(self.world_size) if r != self.rank}
        self._store_ok_at = now
        self._count = 0
        self._stop = threading.Event()
        self._wake = threading.Event()  # (set by publish: beat now, not at the next interval)
        self._fired = False
        self._beat()
        self._thread = threading.Thread(target=self._loop, name="pipedap-heartbeat", daemon=True)
        self._thread.start()
        global _heartbeat
        _heartbeat = self  # (the errors of this fit's collectives name the peers it knows: named_peer_failure)

    def not_answering(self) -> dict[int, str]:
        """Peers not answering now, ``{rank: what was seen}`` (rank 0 stands for an unreachable store)."""
        with self._lock:
            now = _now()
            out = {r: (f"{_GONE[v]} {now - t:.1f} s ago" if v in _GONE else f"no heartbeat for {now - t:.1f} s")
                   for r, (v, t) in self._seen.items() if v in _GONE or now - t > self.timeout_s}
            if now - self._store_ok_at > self.timeout_s:
                out[0] = f"the rendezvous store on rank 0 has not answered for {now - self._store_ok_at:.1f} s"
            return out

    def describe(self, wait_s: float = 0.0) -> str:
        """``"rank 1: no heartbeat for 3.2 s"``-style text of the peers not answering, or "every peer is alive".

        With ``wait_s`` > 0 (error paths: a peer that just died has a recent heartbeat), reads every
        peer's counter now and again until each has changed, for up to ``wait_s`` seconds; a peer whose
        counter did not change is named too.
        """
        bad = self.not_answering()
        if wait_s > 0:
            start = _now()
            first = self._read()
            silent = {r for r in first if r not in bad}
            while silent and _now() - start < wait_s:
                time.sleep(min(self.interval_s / 4, 0.25))
                now = self._read()
                silent = {r for r in silent if now.get(r) == first.get(r) and now.get(r) not in _GONE}
                bad.update({r: f"{_GONE[v]}" for r, v in now.items() if v in _GONE and r not in bad})
            for r in silent:
                bad[r] = f"no heartbeat for the last {_now() - start:.1f} s (stopped or dead?)"
        if not bad:
            return "every peer is alive"
        return "; ".join(f"rank {r}: {what}" for r, what in sorted(bad.items()))

    def publish(self, note: str) -> None:
        """Set :attr:`note` and send it now (the next beat, without waiting for the interval); safe to call from
        a signal handler (it only sets two attributes)."""
        self.note = note
        self._wake.set()

    def peer_words(self, cached: bool = False) -> dict[int, str]:
        """``{rank: word}`` read from the store now (``cached``: as the watchdog last saw them): each peer's
        published note (``"sigterm"``) or the state it left in (``"left"``, ``"failed"``, ``"interrupted"``,
        ``"stopped"``); peers with neither, or an unreachable store, are left out. Works after :meth:`stop` too."""
        if cached:
            with self._lock:
                values = {r: v for r, (v, _) in self._seen.items()}
        else:
            values = self._read()
        return {r: _word(v) or v for r, v in values.items() if v is not None and (_word(v) or v in _GONE)}

    def wait_peers_noted(self, timeout_s: float) -> bool:
        """Wait until every peer has published a note or left a final state in the store (:meth:`stop`), or has not
        beaten for ``1.5 * interval_s`` (dead: it will not), at most ``timeout_s`` seconds; returns whether every
        peer did one of these."""
        start = _now()
        first = self._read()
        while True:
            now = self._read()
            stale = _now() - start > 1.5 * self.interval_s
            if all(v is not None and (v in _GONE or _word(v)) or stale and v == first.get(r) for r, v in now.items()):
                return True
            if _now() - start >= timeout_s:
                return False
            time.sleep(0.1)

    def _read(self) -> dict[int, Optional[str]]:
        """Every peer's current counter (None: not written yet or the store does not answer).

        Two store requests however many ranks (``check`` and ``multi_get`` of every key), then one per
        peer only while some peer has not written its key yet."""
        peers = list(self._seen)
        keys = [f"{self.PREFIX}{r}" for r in peers]
        try:
            if self.store.check(keys):
                return {r: v.decode() for r, v in zip(peers, self.store.multi_get(keys))}
        except Exception:  # noqa: BLE001
            return dict.fromkeys(peers)
        out: dict[int, Optional[str]] = {}
        for r, k in zip(peers, keys):
            try:
                out[r] = self.store.get(k).decode() if self.store.check([k]) else None
            except Exception:  # noqa: BLE001
                out[r] = None
        return out

    def stop(self, state: Optional[str] = "left") -> None:
        """Stop beating and tell the peers why: ``"left"`` (this rank's fit ended), ``"failed"`` (it saw an
        exception), ``"interrupted"``, ``"stopped"`` (SIGTERM) or None (say nothing: they will see no
        heartbeat). Only the first call publishes."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=2 * self.interval_s + 1)
        if state is not None:
            try:
                self.store.set(f"{self.PREFIX}{self.rank}", state)
            except Exception:  # noqa: BLE001  (the store may be gone at the end of a failed run)
                pass

    # -------------------------------------------------------------- internals
    def _beat(self) -> None:
        self._count += 1
        self.store.set(f"{self.PREFIX}{self.rank}", f"{self._count} {self.note}" if self.note else str(self._count))

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self._beat()
                values = {r: v for r, v in self._read().items() if v is not None}
                now = _now()
                with self._lock:
                    self._store_ok_at = now
                    for r, v in values.items():
                        if v != self._seen[r][0]:
                            self._seen[r] = (v, now)
                for r, v in values.items():
                    word = _word(v) or (v if v in _GONE else "")  # (a note, or the state a peer left in)
                    if word and (r, word) not in self._noted and self.on_note is not None:
                        self._noted.add((r, word))
                        self.on_note(r, word)
            except Exception:  # noqa: BLE001  (an unreachable store counts as not answering)
                pass
            bad = self.not_answering()
            if bad and self.on_stale is not None and not self._fired:
                with self._lock:
                    since = [t for r, (_, t) in self._seen.items() if r in bad] + [self._store_ok_at] * (0 in bad)
                    failed = any(self._seen[r][0] in _FAILED for r in bad if r in self._seen)
                if _now() - min(since) > (self.failed_grace_s if failed else self.timeout_s + self.grace_s):
                    self._fired = True
                    what = "; ".join(f"rank {r}: {w}" for r, w in sorted(bad.items()))
                    why = "gone" if failed else f"not answering for more than {self.timeout_s:g} s"
                    self.on_stale(f"pipedap: rank {self.rank}: peer(s) {why} ({what}) while "
                                  f"{self.context() or 'training'}; exiting")


def _word(value: str) -> str:
    """The note of a heartbeat value (``"12 sigterm"`` -> ``"sigterm"``; ``"12"`` -> ``""``)."""
    return value.partition(" ")[2]


def _now() -> float:
    return time.monotonic()
