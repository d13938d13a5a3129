"""Flat gradient buckets (tensor fusion) for the engine.

A :class:`FlatBucket` owns one contiguous 1-D buffer per bucket of the schedule::

    [ grad of unit 0 | grad of unit 1 | ... | used-flag per unit (k elements) | padding to N·S ]

A *unit* (a *slot* of the bucket) is a whole parameter, or, with tensor partitioning
(``Schedule.pieces``; ByteScheduler, Peng et al., SOSP 2019), the element range ``[start, stop)``
of one parameter flattened (a *piece*): a large parameter may be split over several buckets so its
communication is pipelined with its neighbours'. Gradients are copied in as they become ready
(divided by the world size, as DDP does), the whole buffer is reduced (RS then AG, or one AR) and the
reduced gradients are read back as views (a whole parameter's view is shaped like it, a piece's is
1-D, ``stop - start`` elements).

The *used flags* travel with the data: a rank writes 1 for each unit whose parameter received a
gradient in this backward (every piece of a split parameter alike), so after reduction ``flag > 0``
tells every rank whether any rank produced a gradient. Parameters unused on every rank keep their own
``.grad`` in the update, as DDP leaves it: None (the optimizer skips them) or, after
``zero_grad(set_to_none=False)``, a zero tensor the optimizer steps with; no ``find_unused_parameters``
flag and no extra collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch


@dataclass
class FlatBucket:
    """One bucket's flat buffer and the placement of its units (slots).

    Attributes:
        index: bucket number (forward order).
        param_indices: per slot, the index of the slot's parameter (into the engine's parameter list);
            a split parameter appears in every bucket holding one of its pieces.
        params: per slot, the parameter itself.
        offsets: element offset of each slot's gradient in ``buffer``.
        numel: elements before the used flags: the slots' sizes summed (with parameter ownership, ``owners``,
            the gaps between the ranks' regions included).
        buffer: 1-D tensor, ``world_size · shard_size`` elements, dtype of the parameters.
        shard_size: elements per rank after reduce-scatter (``S``).
        world_size: ranks sharing the bucket (``N``).
        ranges: per slot, ``(start, stop)``: the elements of the parameter flattened that the slot holds
            (``(0, numel)`` for a whole parameter; default: every slot whole).
        units: per slot, the schedule's unit index (default: ``param_indices``, units are parameters).
        views: per slot, the view of ``buffer`` holding its gradient: shaped like the parameter for a whole
            one, 1-D (``stop - start`` elements) for a piece (built once: :meth:`grad_view`).
        flag_view: the used-flag elements, one per slot (``k`` elements; :attr:`flags`).
        pieces: per slot, whether it holds a piece of a split parameter (not the whole parameter).
        as_view: ``gradient_as_bucket_view`` is on for this bucket: each parameter's ``.grad`` is its view
            (set by the engine), so backward accumulates into the buffer and nothing is copied back.
        owners: with parameter ownership (``shard_optimizer`` with a whole-tensor optimizer), per slot the rank
            whose shard ``[r·S, (r+1)·S)`` holds the whole parameter (padding fills each rank's region up to
            ``S``); empty otherwise.
    """

    index: int
    param_indices: tuple[int, ...]
    params: list[torch.Tensor]
    offsets: list[int]
    numel: int
    buffer: torch.Tensor
    shard_size: int
    world_size: int
    ranges: list[tuple[int, int]] = field(default_factory=list)
    units: tuple[int, ...] = ()
    views: list[torch.Tensor] = field(default_factory=list, repr=False)
    flag_view: torch.Tensor = field(default=None, repr=False)  # type: ignore[assignment]
    pieces: list[bool] = field(default_factory=list, repr=False)
    as_view: bool = False
    owners: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.ranges:
            self.ranges = [(0, p.numel()) for p in self.params]
        if not self.units:
            self.units = tuple(self.param_indices)
        self.pieces = [stop - start != p.numel() for (start, stop), p in zip(self.ranges, self.params)]
        self.views = [self.buffer[o : o + stop - start] if piece else self.buffer[o : o + p.numel()].view_as(p)
                      for o, (start, stop), p, piece in zip(self.offsets, self.ranges, self.params, self.pieces)]
        self.flag_view = self.buffer[self.numel : self.numel + len(self.params)]

    @classmethod
    def allocate(cls, index: int, param_indices: tuple[int, ...], params: list[torch.Tensor], world_size: int,
                 ranges: Optional[Sequence[tuple[int, int]]] = None,
                 units: Optional[Sequence[int]] = None,
                 owners: Optional[Sequence[int]] = None) -> "FlatBucket":
        """Allocate the buffer for the slots on their parameters' device.

        Args:
            index: bucket number.
            param_indices: per slot, the parameter's index.
            params: per slot, the parameter.
            world_size: ranks sharing the bucket.
            ranges: per slot, ``(start, stop)`` elements of the parameter flattened (None: every slot whole).
            units: per slot, the schedule's unit index (None: the parameter indices).
            owners: per slot, the rank that owns the whole parameter (parameter ownership: each rank's slots lie
                in its own shard, ``S`` = the largest rank's elements, the used flags after the last rank's; the
                padding travels with the reduce-scatter and all-gather). None: slots packed in order.

        Raises:
            ValueError: if the parameters do not share one dtype and device, a range is empty or
                outside its parameter, or ``owners`` has a rank outside ``0..world_size-1`` or a piece.
        """
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"bucket {index} mixes dtypes/devices {sorted(map(str, kinds))}; split it")
        dtype, device = kinds.pop()
        spans = [(0, p.numel()) for p in params] if ranges is None else [(int(a), int(b)) for a, b in ranges]
        if len(spans) != len(params):
            raise ValueError(f"bucket {index}: {len(spans)} ranges for {len(params)} slots")
        for slot, ((start, stop), p) in enumerate(zip(spans, params)):
            if not (0 <= start <= stop <= p.numel() and (start < stop or p.numel() == 0)):
                raise ValueError(f"bucket {index} slot {slot}: elements [{start}, {stop}) are not a non-empty range "
                                 f"of parameter {param_indices[slot]} ({p.numel()} elements)")
        if owners is not None:
            offsets, off, shard = _owned_layout(index, spans, params, world_size, owners)
        else:
            offsets, off = [], 0
            for start, stop in spans:
                offsets.append(off)
                off += stop - start
            total = off + len(params)  # data + one used-flag per slot
            shard = -(-total // world_size)
        buffer = torch.zeros(shard * world_size, dtype=dtype, device=device)
        return cls(index, tuple(param_indices), list(params), offsets, off, buffer, shard, world_size,
                   spans, tuple(param_indices if units is None else units),
                   owners=tuple(owners) if owners is not None else ())

    @property
    def nbytes(self) -> int:
        """Bytes moved per rank by an all-reduce of this bucket (padded buffer)."""
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def has_pieces(self) -> bool:
        """Whether some slot holds a piece of a split parameter."""
        return any(self.pieces)

    def grad_view(self, slot: int) -> torch.Tensor:
        """View of the buffer holding slot ``slot``'s gradient: shaped like the parameter for a whole parameter,
        1-D (``stop - start`` elements of the parameter flattened) for a piece."""
        return self.views[slot]

    def is_piece(self, slot: int) -> bool:
        """Whether slot ``slot`` holds a piece of a split parameter (not the whole parameter)."""
        return self.pieces[slot]

    def is_view(self, slot: int, grad: torch.Tensor | None) -> bool:
        """Whether ``grad`` is slot ``slot``'s view of the buffer (same storage, offset and shape)."""
        v = self.views[slot]
        return (grad is not None and grad.data_ptr() == v.data_ptr() and grad.shape == v.shape
                and grad.stride() == v.stride() and grad.dtype == v.dtype and grad.device == v.device)

    @property
    def flags(self) -> torch.Tensor:
        """The used-flag elements, one per slot (``k`` elements)."""
        return self.flag_view

    def some_rank_unused(self, world_size: int) -> bool:
        """After the reduction (the flags summed over ``world_size`` ranks): whether some rank left a slot's
        parameter without a gradient (identical on every rank)."""
        return bool((self.flag_view < world_size - 0.5).any())

    def release(self) -> None:
        """Drop the buffer (and its views), keeping the layout: a closed engine's bucket that only describes where
        elements lie (the sharded state's move to the next engine) holds no memory beside the next engine's."""
        empty = self.buffer.new_empty(0)
        self.buffer, self.views, self.flag_view = empty, [], empty

    def own_data_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of gradient elements (flags and padding excluded) in ``rank``'s shard."""
        start = rank * self.shard_size
        return min(start, self.numel), min(start + self.shard_size, self.numel)


def _owned_layout(index: int, spans: Sequence[tuple[int, int]], params: Sequence[torch.Tensor], world_size: int,
                  owners: Sequence[int]) -> tuple[list[int], int, int]:
    """Offsets, flag offset and shard size of a bucket whose slots lie whole in their owners' shards."""
    if len(owners) != len(params) or any(not (0 <= int(r) < world_size) for r in owners):
        raise ValueError(f"bucket {index}: owners {list(owners)} must give each of the {len(params)} slots a rank in "
                         f"0..{world_size - 1}")
    for slot, ((start, stop), p) in enumerate(zip(spans, params)):
        if stop - start != p.numel():
            raise ValueError(f"bucket {index} slot {slot}: parameter ownership needs whole parameters, got elements "
                             f"[{start}, {stop}) of {p.numel()}")
    load = [0] * world_size
    for (start, stop), r in zip(spans, owners):
        load[int(r)] += stop - start
    shard = max(max(load[:-1], default=0), load[-1] + len(params))  # (the flags follow the last rank's slots)
    pos = [r * shard for r in range(world_size)]
    offsets = []
    for (start, stop), r in zip(spans, owners):
        offsets.append(pos[int(r)])
        pos[int(r)] += stop - start
    return offsets, (world_size - 1) * shard + load[-1], shard


def allocate_buckets(schedule, params: Sequence[torch.Tensor], world_size: int,
                     owners: Optional[Sequence[Optional[Sequence[int]]]] = None) -> list[FlatBucket]:
    """One :class:`FlatBucket` per bucket of ``schedule`` (a :class:`~lightning_pipedap.schedule.Schedule`), on the
    parameters' device: its units are whole parameters, or with ``schedule.pieces`` element ranges of them.
    ``owners``: per bucket, per slot the owning rank (parameter ownership, :func:`~lightning_pipedap.plan.sharding.
    assign_owners`), or None for a bucket packed in order."""
    if schedule.pieces is None:
        return [FlatBucket.allocate(b, idxs, [params[i] for i in idxs], world_size,
                                    owners=owners[b] if owners else None)
                for b, idxs in enumerate(schedule.buckets)]
    if owners is not None:
        raise ValueError("parameter ownership (shard_optimizer with a whole-tensor optimizer) needs whole parameters; "
                         "the schedule splits parameters into pieces (partition_mb): remove partition_mb")
    pieces = schedule.pieces
    return [FlatBucket.allocate(b, tuple(pieces[u][0] for u in units), [params[pieces[u][0]] for u in units],
                                world_size, [pieces[u][1:] for u in units], units)
            for b, units in enumerate(schedule.buckets)]


def param_places(buckets: Sequence[FlatBucket]) -> tuple[dict[int, list[tuple[int, int, int, int]]],
                                                         dict[int, tuple[int, ...]]]:
    """Where each parameter lives in ``buckets``.

    Returns:
        ``(places, split)``: parameter index -> its ``(bucket, slot, start, stop)`` places in element order
        (a whole parameter: one place); split parameter index -> the buckets holding its pieces (element
        order; empty when no parameter is split).
    """
    places: dict[int, list[tuple[int, int, int, int]]] = {}
    for b in buckets:
        for s, i in enumerate(b.param_indices):
            places.setdefault(i, []).append((b.index, s) + tuple(b.ranges[s]))
    for pl in places.values():
        pl.sort(key=lambda place: place[2])
    split = {i: tuple(dict.fromkeys(b for b, _, _, _ in pl)) for i, pl in places.items()
             if any(buckets[b].is_piece(s) for b, s, _, _ in pl)}
    return places, split
