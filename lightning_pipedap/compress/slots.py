"""Shared-memory slots of the compression pipeline: allocation and the payload hand-off.

Per bucket, the pipeline preallocates ``slots_per_bucket`` CPU slots in shared memory
(``share_memory_()``). A slot (:class:`Slot`) holds the input gradient ``[n]`` fp32 (reused as the
decompression output) and one flat tensor per payload name of
:meth:`~.base.Compressor.payload_spec`, of the largest size that name can have. With torch's
default ``file_descriptor`` sharing strategy the segments are unlinked at once, so nothing is left
in ``/dev/shm`` even after a SIGKILL, at the price of one file descriptor per tensor (about
``buckets · slots · 4``).

A payload crosses between the trainer and the helper as a *descriptor*
(:func:`write_payload`): the payload's stage, ``final`` flag and ``meta`` plus the element count of
each tensor; the tensors themselves stay in the slot, and :func:`read_payload` rebuilds the
:class:`~.base.Payload` as views into it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from lightning_pipedap.compress.base import Compressor, Payload

#: ``(stage, final, meta, {name: numel}, {local name: numel})``, see :func:`write_payload`
PayloadDesc = tuple[int, bool, dict[str, int], dict[str, int], dict[str, int]]


class Slot(NamedTuple):
    """One shared-memory slot of a bucket.

    Attributes:
        grad: ``[n]`` fp32, the submitted gradient; after decompression the dense result.
        out: payload name -> flat tensor with room for that payload tensor's largest size.
    """

    grad: torch.Tensor
    out: dict[str, torch.Tensor]


def allocate_slots(compressor: Compressor, bucket_numels: Sequence[int],
                   layouts: Sequence[Sequence[tuple[str, Sequence[int]]]], slots_per_bucket: int) -> list[list[Slot]]:
    """``slots_per_bucket`` fresh shared-memory slots per bucket (index = bucket, then slot).

    Args:
        compressor: gives each bucket's payload tensors (:meth:`~.base.Compressor.payload_spec`).
        bucket_numels: elements ``n`` of each bucket.
        layouts: per bucket ``(name, shape)`` of its parameters (validated,
            :func:`~.state.check_layouts`); PowerSGD sizes its factors from the shapes.
        slots_per_bucket: slots of each bucket.
    """
    return [
        [Slot(torch.empty(n, dtype=torch.float32).share_memory_(),
              {k: torch.empty(s.numel, dtype=s.dtype).share_memory_()
               for k, s in compressor.payload_spec(n, [shape for _, shape in lay]).items()})
         for _ in range(slots_per_bucket)]
        for n, lay in zip(bucket_numels, layouts)
    ]


def slots_nbytes(slots: Sequence[Sequence[Slot]]) -> int:
    """Bytes of shared memory held by ``slots`` (gradients and payload tensors)."""
    return sum(slot.grad.numel() * slot.grad.element_size()
               + sum(t.numel() * t.element_size() for t in slot.out.values())
               for per_bucket in slots for slot in per_bucket)


def write_payload(out: dict[str, torch.Tensor], payload: Payload) -> PayloadDesc:
    """Copy ``payload``'s tensors into the slot tensors ``out`` (skipped for a tensor already there).

    Returns:
        the descriptor ``(stage, final, meta, {name: numel}, {local name: numel})``.

    Raises:
        ValueError: a payload tensor without a slot tensor, of another dtype, or larger than its slot.
    """
    names: dict[str, int] = {}
    local: dict[str, int] = {}
    for dst_names, tensors in ((names, payload.tensors), (local, payload.local)):
        for k, t in tensors.items():
            if k not in out:
                raise ValueError(f"{payload.method}: payload tensor {k!r} has no slot (slots: {sorted(out)})")
            dst = out[k]
            if t.dtype != dst.dtype or t.numel() > dst.numel():
                raise ValueError(f"{payload.method}: payload tensor {k!r} {t.numel()} x {t.dtype} does not fit "
                                 f"its slot {dst.numel()} x {dst.dtype}")
            if t.data_ptr() != dst.data_ptr() or t.device != dst.device:
                dst[: t.numel()].copy_(t.reshape(-1))
            dst_names[k] = t.numel()
    return payload.stage, payload.final, dict(payload.meta), names, local


def read_payload(out: dict[str, torch.Tensor], desc: Any, method: str, numel: int) -> Payload:
    """Inverse of :func:`write_payload`: the :class:`~.base.Payload` of ``method`` for a bucket of
    ``numel`` elements that ``desc`` describes, its tensors views into the slot tensors ``out``."""
    stage, final, meta, names, local_names = desc
    return Payload(method, numel, {k: out[k][:c] for k, c in names.items()}, dict(meta), stage, final,
                   {k: out[k][:c] for k, c in local_names.items()})
