"""How the engine moves one bucket: the transport interface and the dense transport.

The worker thread walks the schedule's op list and hands each op to the transport of its bucket:

- :class:`DenseTransport`: the op as it is: reduce-scatter, all-gather or all-reduce of the flat
  bucket buffer (``engine.collectives``); with a 16-bit wire dtype (buckets flagged ``wire16`` in
  the schedule) the RS and AG cast in the send path and an AR runs as that RS then that AG.
- :class:`~lightning_pipedap.engine.compressed.CompressedTransport`: the bucket's whole compressed
  reduction at its reduce-scatter or all-reduce op; its all-gather op then has nothing to do.

:meth:`Transport.run` returns the kind of op it performed, which decides what the engine signals:
after a reduce-scatter the bucket's shards are reduced; after an all-gather or an all-reduce the
whole bucket is; ``None``: nothing was done (the all-gather of a compressed bucket).
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from lightning_pipedap.engine import collectives as C
from lightning_pipedap.engine.buckets import FlatBucket
from lightning_pipedap.schedule import OpKind


class Transport(Protocol):
    """One way of reducing a bucket (see the module docstring)."""

    def ready(self, bucket: FlatBucket) -> None:
        """The bucket's gradients are complete (called on the autograd thread, must not block)."""

    def run(self, kind: OpKind, bucket: FlatBucket) -> Optional[OpKind]:
        """Perform op ``kind`` on ``bucket`` (worker thread); return the kind performed, or None."""

    def close(self) -> None:
        """Release what the transport holds (called once, when the engine closes)."""


class DenseTransport:
    """The bucket buffer reduced as is over the engine's group.

    Args:
        comm: the engine's dedicated :class:`~lightning_pipedap.engine.collectives.CommGroup`.
        wire: None (the buffer's own dtype on the wire) or a 16-bit dtype (``torch.float16``,
            ``torch.bfloat16``): see :func:`~lightning_pipedap.engine.collectives.ring_reduce_scatter_`.
    """

    def __init__(self, comm: C.CommGroup, wire: Optional[torch.dtype] = None) -> None:
        self.comm = comm
        self.wire = wire

    def ready(self, bucket: FlatBucket) -> None:
        """Nothing to do: the worker reads the buffer when it reaches the op."""

    def run(self, kind: OpKind, bucket: FlatBucket, during: Optional[Callable[[], None]] = None) -> OpKind:
        """Reduce-scatter, all-gather or all-reduce ``bucket.buffer`` in place (``[N·S]`` elements). ``during``: with an
        all-gather in the buffer's own dtype, work overlapping the transfer (:func:`~.collectives.all_gather_`)."""
        if during is not None and (kind is not OpKind.ALL_GATHER or self.wire is not None):
            raise ValueError(f"pipedap: work overlapping a transfer needs an all-gather in the buffer's own dtype; got "
                             f"{kind.name} with wire dtype {self.wire}")
        buf, comm, wire = bucket.buffer, self.comm, self.wire
        if wire is not None:
            if kind is not OpKind.ALL_GATHER:
                C.reduce_scatter_wire_(buf, comm, wire)
            if kind is not OpKind.REDUCE_SCATTER:
                C.all_gather_wire_(buf, comm, wire)
        elif kind is OpKind.REDUCE_SCATTER:
            C.reduce_scatter_(buf, comm)
        elif kind is OpKind.ALL_GATHER:
            C.all_gather_(buf, comm, during)
        else:
            C.all_reduce_(buf, comm)
        return kind

    def close(self) -> None:
        """Nothing held."""


def bucket_transports(schedule, buckets: list[FlatBucket], comm: C.CommGroup, compressed_factory=None,
                      wire: Optional[torch.dtype] = None) -> tuple[Optional[Transport], list[Transport]]:
    """Each bucket's transport for ``schedule`` (a :class:`~lightning_pipedap.schedule.Schedule`).

    Args:
        buckets: the engine's buckets.
        comm: the engine's group.
        compressed_factory: ``f(buckets) -> CompressedTransport``, called once when ``schedule`` compresses a
            bucket; its pipeline is built over *all* buckets (simple numbering, telemetry by bucket index; the
            slots of uncompressed buckets stay unused) and only the flagged buckets use it.
        wire: the 16-bit wire dtype of the buckets flagged ``wire16`` (None when none is).

    Returns:
        ``(compressed transport or None, one transport per bucket)``.
    """
    wants = compressed_factory is not None and schedule.num_compressed > 0
    compressed = compressed_factory(buckets) if wants else None
    dense = DenseTransport(comm)
    half = DenseTransport(comm, wire) if schedule.num_wire16 else dense
    return compressed, [compressed if compressed is not None and schedule.is_compressed(b)
                        else half if schedule.is_wire16(b) else dense for b in range(len(buckets))]
