"""Flat gradient buckets (tensor fusion) for the engine.

A :class:`FlatBucket` owns one contiguous 1-D buffer per bucket of the schedule::

    [ grad of p0 | grad of p1 | ... | used-flag per param (k elements) | padding to N·S ]

Gradients are copied in as they become ready (divided by the world size, as DDP does), the
whole buffer is reduced (RS then AG, or one AR) and the reduced gradients are read back as views.
The *used flags* travel with the data: a rank writes 1 for each parameter that received a
gradient in this backward, so after reduction ``flag > 0`` tells every rank whether any rank
produced a gradient. Parameters unused on every rank keep their own ``.grad`` in the update, as
DDP leaves it: None (the optimizer skips them) or, after ``zero_grad(set_to_none=False)``, a zero
tensor the optimizer steps with; no ``find_unused_parameters`` flag and no extra collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class FlatBucket:
    """One bucket's flat buffer and the placement of its parameters.

    Attributes:
        index: bucket number (forward order).
        param_indices: indices of the parameters (into the engine's parameter list).
        params: the parameters themselves, same order.
        offsets: element offset of each parameter's gradient in ``buffer``.
        numel: number of gradient elements (sum of parameter sizes).
        buffer: 1-D tensor, ``world_size · shard_size`` elements, dtype of the parameters.
        shard_size: elements per rank after reduce-scatter (``S``).
        world_size: ranks sharing the bucket (``N``).
        views: per parameter, the view of ``buffer`` holding its gradient, shaped like the parameter
            (built once: :meth:`grad_view`).
        flag_view: the used-flag elements, one per parameter (``k`` elements; :attr:`flags`).
        as_view: ``gradient_as_bucket_view`` is on for this bucket: each parameter's ``.grad`` is its
            view (set by the engine), so backward accumulates into the buffer and nothing is copied back.
    """

    index: int
    param_indices: tuple[int, ...]
    params: list[torch.Tensor]
    offsets: list[int]
    numel: int
    buffer: torch.Tensor
    shard_size: int
    world_size: int
    views: list[torch.Tensor] = field(default_factory=list, repr=False)
    flag_view: torch.Tensor = field(default=None, repr=False)  # type: ignore[assignment]
    as_view: bool = False

    def __post_init__(self) -> None:
        self.views = [self.buffer[o : o + p.numel()].view_as(p) for o, p in zip(self.offsets, self.params)]
        self.flag_view = self.buffer[self.numel : self.numel + len(self.params)]

    @classmethod
    def allocate(cls, index: int, param_indices: tuple[int, ...], params: list[torch.Tensor], world_size: int) -> "FlatBucket":
        """Allocate the buffer for ``params`` on their device.

        Raises:
            ValueError: if the parameters do not share one dtype and device.
        """
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"bucket {index} mixes dtypes/devices {sorted(map(str, kinds))}; split it")
        dtype, device = kinds.pop()
        offsets, off = [], 0
        for p in params:
            offsets.append(off)
            off += p.numel()
        total = off + len(params)  # data + one used-flag per parameter
        shard = -(-total // world_size)
        buffer = torch.zeros(shard * world_size, dtype=dtype, device=device)
        return cls(index, tuple(param_indices), list(params), offsets, off, buffer, shard, world_size)

    @property
    def nbytes(self) -> int:
        """Bytes moved per rank by an all-reduce of this bucket (padded buffer)."""
        return self.buffer.numel() * self.buffer.element_size()

    def grad_view(self, slot: int) -> torch.Tensor:
        """View of the buffer holding parameter ``slot``'s gradient, shaped like the parameter."""
        return self.views[slot]

    def is_view(self, slot: int, grad: torch.Tensor | None) -> bool:
        """Whether ``grad`` is parameter ``slot``'s view of the buffer (same storage, offset and shape)."""
        v = self.views[slot]
        return (grad is not None and grad.data_ptr() == v.data_ptr() and grad.shape == v.shape
                and grad.stride() == v.stride() and grad.dtype == v.dtype and grad.device == v.device)

    @property
    def flags(self) -> torch.Tensor:
        """The used-flag elements, one per parameter (``k`` elements)."""
        return self.flag_view

    def own_data_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of gradient elements (flags and padding excluded) in ``rank``'s shard."""
        start = rank * self.shard_size
        return min(start, self.numel), min(start + self.shard_size, self.numel)
