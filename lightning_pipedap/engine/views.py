"""``gradient_as_bucket_view``: each parameter's ``.grad`` is its view of the bucket's buffer.

Backward then accumulates into the bucket itself and the engine only divides in place: no copy in, no
copy back (as DDP's ``gradient_as_bucket_view``). :func:`view_refusal` says which buckets cannot do that
(they keep the copy path, same values); :class:`BucketViews` points ``.grad`` at the views before each
backward and takes a view back from a parameter that no rank produced a gradient for (DDP leaves it None).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from lightning_pipedap.engine.buckets import FlatBucket

__all__ = ["BucketViews", "view_refusal"]


def view_refusal(bucket: FlatBucket, compressed: bool = False, wire16: bool = False,
                 buckets_of: Optional[dict[int, Sequence[int]]] = None,
                 names: Optional[Sequence[str]] = None, sharded: bool = False) -> Optional[str]:
    """Why ``bucket`` cannot hold its parameters' ``.grad`` as views of its buffer, or None when it can.

    ``gradient_as_bucket_view`` makes each parameter's ``.grad`` a view into the bucket, so the bucket's
    contents must be the gradient itself at every point user code can see it. That fails when

    - the bucket is ``compressed``: the compressor reads the bucket and writes its own reconstruction;
    - it is stepped sharded (``sharded``, ``shard_optimizer``): after its step it holds parameters;
    - it travels in the 16-bit wire format (``wire16``): the owner rounds its reduced shard in place;
    - it holds a piece of a split parameter (tensor partitioning): that parameter's ``.grad`` spans
      several buckets, so it cannot be one view of one buffer;
    - a parameter is not a contiguous dense tensor: a contiguous view would break the gradient
      layout contract (``.grad`` strides equal to the parameter's).

    Such a bucket keeps the copy path (same values in ``.grad``, one more copy).

    Args:
        bucket: the bucket (its parameters are read, not changed).
        compressed: whether the schedule compresses this bucket.
        sharded: whether the bucket is stepped sharded (``shard_optimizer``).
        wire16: whether the schedule sends this bucket in the 16-bit wire format.
        buckets_of: split parameter index -> the buckets holding its pieces (for the message; optional).
        names: the parameters' names by engine index (for the message; optional: ``"parameter <index>"``).

    Returns:
        None, or a short reason naming the cause (for the log).
    """
    def called(i: int) -> str:
        return f"{names[i]} (parameter {i})" if names is not None and i < len(names) else f"parameter {i}"

    if compressed:
        return "it is compressed (the compressor rewrites the bucket)"
    if sharded:
        return "it is stepped sharded (shard_optimizer: after the step the bucket holds the gathered parameters)"
    if wire16:
        return "it travels in the 16-bit wire format (its reduced shard is rounded in the buffer)"
    for slot, p in enumerate(bucket.params):
        if bucket.is_piece(slot):
            i = bucket.param_indices[slot]
            start, stop = bucket.ranges[slot]
            where = (f"split over buckets {', '.join(map(str, buckets_of[i]))}" if buckets_of and i in buckets_of
                     else "split over several buckets")
            return (f"it holds part of {called(i)} (elements [{start}, {stop}) of {p.numel()}, {where}), whose "
                    ".grad cannot be a view of one bucket")
    for slot, p in enumerate(bucket.params):
        if p.layout != torch.strided or not p.is_contiguous():
            return (f"{called(bucket.param_indices[slot])} (shape {tuple(p.shape)}) is not a contiguous dense "
                    "tensor (its .grad layout differs from the flat buffer's)")
    return None


class BucketViews:
    """The view buckets of one engine and the parameters whose None ``.grad`` was pointed at a view.

    Args:
        buckets: the engine's buckets; those :func:`view_refusal` accepts get ``as_view = True``.
        reason_for: ``bucket -> why it keeps the copy path, or None`` (:func:`view_refusal` with the
            engine's schedule).

    Attributes:
        refusals: bucket index -> why it keeps the copy path.
    """

    def __init__(self, buckets: Sequence[FlatBucket], reason_for) -> None:
        self.refusals: dict[int, str] = {}
        for b in buckets:
            reason = reason_for(b)
            if reason is None:
                b.as_view = True
            else:
                self.refusals[b.index] = reason
        self.buckets = [b for b in buckets if b.as_view]  # (attach runs before every backward)
        self._attached: set[int] = set()  # param indices whose None .grad attach pointed at the view

    def attach(self) -> int:
        """Point every ``.grad`` that is None at its zeroed view, and move any other ``.grad`` that is not
        this engine's view into it (one copy, values unchanged). Call with no round running.

        Returns:
            the number of gradients copied.
        """
        copies = 0
        for bucket in self.buckets:
            for slot, p in enumerate(bucket.params):
                if p.grad is None:
                    view = bucket.grad_view(slot)
                    view.zero_()
                    p.grad = view
                    self._attached.add(bucket.param_indices[slot])
                elif not bucket.is_view(slot, p.grad):
                    # a view of an earlier engine's bucket (a new schedule was installed) or a tensor user code
                    # put there: same values, now in this bucket (and the earlier bucket can be freed)
                    view = bucket.grad_view(slot)
                    view.copy_(p.grad)
                    p.grad = view
                    copies += 1
        return copies

    def detach_unused(self, bucket: FlatBucket, used: Sequence[bool]) -> None:
        """A parameter of ``bucket`` that :meth:`attach` pointed at its view and that no rank produced a
        gradient for (``used[slot]`` False) gets ``.grad = None`` back, as under DDP."""
        if not self._attached:
            return
        for slot, i in enumerate(bucket.param_indices):
            if i in self._attached:
                self._attached.discard(i)
                if not used[slot] and bucket.is_view(slot, bucket.params[slot].grad):
                    bucket.params[slot].grad = None
