"""Compressed reduction of one bucket: the engine's transport when ``compression=`` is set.

Pipeline (PipeCompress, Wu et al., ICC 2022): when a bucket's gradients are complete, the trainer
hands the (world-size-divided) flat gradient to the per-rank compression helper
(:class:`~lightning_pipedap.compress.pipeline.CompressionPipeline`) and continues backward; the
communication worker later collects the payload, communicates it and writes the decompressed
average back into the bucket. Summable payloads (fp16, bf16, random-k, PowerSGD factors) are
all-reduced in place, round by round; the others are packed to equal size, all-gathered and
aggregated locally. The used-flags of the bucket (see :mod:`.buckets`) are all-reduced alongside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_pipedap.engine import collectives as C
from lightning_pipedap.engine.buckets import FlatBucket
from lightning_pipedap.schedule import OpKind


@dataclass
class CompressionStats:
    """Per-bucket telemetry of the last round (seconds and bytes).

    Attributes:
        compress_s: helper time compressing (incl. extra rounds and decompression).
        wait_s: time the communication worker blocked waiting for the helper; the hidden part of
            compression is ``compress_s - wait_s``.
        payload_bytes: bytes this rank sent for the bucket (before the collective's own factor).
        dense_bytes: bytes of the uncompressed gradient.
    """

    compress_s: float = 0.0
    wait_s: float = 0.0
    payload_bytes: int = 0
    dense_bytes: int = 0

    @property
    def ratio(self) -> float:
        """Compression ratio dense / payload bytes (1.0 when nothing was sent)."""
        return self.dense_bytes / self.payload_bytes if self.payload_bytes else 1.0


class CompressedTransport:
    """Submits ready buckets to a compression pipeline and reduces their payloads.

    Args:
        pipeline: a started :class:`CompressionPipeline` whose bucket sizes are the buckets' ``numel``.
        comm: the engine's dedicated group.
        owns_pipeline: close the pipeline with the transport (False: the caller keeps it for the next engine).
    """

    def __init__(self, pipeline, comm: C.CommGroup, owns_pipeline: bool = True) -> None:
        self.pipeline = pipeline
        self.comm = comm
        self.owns_pipeline = owns_pipeline
        self._tickets: dict[int, object] = {}
        self.stats: dict[int, CompressionStats] = {}
        # a helper process compresses as soon as the gradients are complete; inline, the worker does it
        self._submit_at_ready = getattr(pipeline, "mode", "process") != "inline"

    def ready(self, bucket: FlatBucket) -> None:
        """Gradients complete: hand them to the helper now (process mode), so compression overlaps backward."""
        if self._submit_at_ready:
            self.submit(bucket)

    def run(self, kind: OpKind, bucket: FlatBucket) -> Optional[OpKind]:
        """The whole compressed reduction at the bucket's RS/AR op (returns ALL_REDUCE); AG: nothing (None)."""
        if kind is OpKind.ALL_GATHER:
            return None
        if bucket.index not in self._tickets:
            self.submit(bucket)
        self.reduce(bucket)
        return OpKind.ALL_REDUCE

    def submit(self, bucket: FlatBucket) -> None:
        """Hand bucket ``bucket``'s gradient (``[numel]``, already divided by N) to the helper."""
        self._tickets[bucket.index] = self.pipeline.submit(bucket.index, bucket.buffer[: bucket.numel])

    def reduce(self, bucket: FlatBucket) -> None:
        """Collect the payload, communicate it and write the averaged gradient into ``bucket``."""
        pipe, comp = self.pipeline, self.pipeline.compressor
        ticket = self._tickets.pop(bucket.index)
        sent = 0
        payload = pipe.result(ticket)
        if comp.summable:
            while True:
                C.all_reduce_(payload.data, self.comm)
                sent += payload.data.numel() * payload.data.element_size()
                if payload.final:
                    break
                payload = pipe.next_round(ticket, payload)
            grad = pipe.decompress(ticket, payload)
        else:
            packed = comp.pack(payload)
            sent = packed.numel() * packed.element_size()
            rows = C.all_gather_rows(packed, self.comm)
            parts = [comp.unpack(rows[r], bucket.numel) for r in range(self.comm.world_size)]
            grad = comp.aggregate(parts, average=False)
        bucket.buffer[: bucket.numel].copy_(grad)
        timings = pipe.timings(ticket)
        pipe.release(ticket)
        C.all_reduce_(bucket.flags, self.comm)
        self.stats[bucket.index] = CompressionStats(
            compress_s=sum(v for k, v in timings.items() if k != "wait"),
            wait_s=timings.get("wait", 0.0),
            payload_bytes=sent,
            dense_bytes=bucket.numel * bucket.buffer.element_size(),
        )

    def close(self) -> None:
        """Close the pipeline if this transport owns it (a pipeline shared across engines stays open)."""
        if self.owns_pipeline:
            self.pipeline.close()
