"""One compressor plus the per-bucket states of one rank: what runs in the helper process or inline.

:class:`CompressionRuntime` is the unit the pipeline's helper process owns (and the inline mode
runs in the trainer). It keeps one :class:`~.base.BucketState` per bucket (error-feedback residual,
PowerSGD warm-start Q, step counter) and exposes the three calls of a step::

    payload = rt.compress(b, grad)            # round 0/1
    while not payload.final:                  # PowerSGD: once
        payload = rt.next_round(b, summed)    # summed = payload with data summed over ranks
    grad_out = rt.decompress(b, summed)       # final payload summed over ranks (summable methods)

Checkpoints: :meth:`state_dict` / :meth:`load_state_dict` save and restore the bucket states
(residuals, method tensors, step counters) per parameter name (:mod:`.state`), so the state
survives a change of buckets; :func:`relayout_runtime` builds the runtime of new buckets with the
state of the old one carried that way.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from lightning_pipedap.compress.base import BucketState, Compressor, Payload
from lightning_pipedap.compress.compressors import get_compressor
from lightning_pipedap.compress.state import Layout, check_layouts, export_state, import_state


class CompressionRuntime:
    """A compressor and the states of the buckets of one rank.

    Args:
        bucket_numels: elements of each bucket, index = bucket number.
        compressor_name: a name from :func:`~.compressors.valid_compressor_names`.
        compressor_kwargs: keyword arguments of that compressor (validated).
        layouts: per bucket, ``(parameter name, shape)`` of each parameter in buffer order (shapes
            summing to the bucket's elements); names key the checkpointed state, shapes give
            PowerSGD its matrices. None: each bucket is one 1-D tensor named ``"<bucket b>"``.

    Raises:
        ValueError: for an unknown compressor, bad keyword arguments, a bucket size < 1 or
            layouts that do not match the bucket sizes.
    """

    def __init__(self, bucket_numels: Sequence[int], compressor_name: str,
                 compressor_kwargs: dict[str, Any] | None = None, layouts: Layout | None = None) -> None:
        self.compressor_name = compressor_name
        self.compressor_kwargs = dict(compressor_kwargs or {})
        self.compressor: Compressor = get_compressor(compressor_name, **self.compressor_kwargs)
        self.bucket_numels = tuple(int(n) for n in bucket_numels)
        if not self.bucket_numels:
            raise ValueError("bucket_numels is empty; the runtime needs at least one bucket")
        self.layouts = check_layouts(self.bucket_numels, layouts)
        self.states = [self.compressor.init_state(b, n, [shape for _, shape in entries], [name for name, _ in entries])
                       for b, (n, entries) in enumerate(zip(self.bucket_numels, self.layouts))]

    def _state(self, bucket: int) -> BucketState:
        if not (0 <= bucket < len(self.states)):
            n = len(self.states)
            raise ValueError(f"bucket {bucket} out of range; there are {n} buckets (0..{n - 1})")
        return self.states[bucket]

    def compress(self, bucket: int, grad: torch.Tensor) -> Payload:
        """First payload of this step for ``bucket`` from its flat fp32 gradient ``[n]``."""
        return self.compressor.compress(grad, self._state(bucket))

    def next_round(self, bucket: int, reduced: Payload) -> Payload:
        """Next round's payload from the previous one summed over ranks (PowerSGD: P → Q)."""
        if reduced.final:
            raise ValueError(f"bucket {bucket}: payload stage {reduced.stage} is final; decompress it instead")
        return self.compressor.next_round(reduced, self._state(bucket))

    def decompress(self, bucket: int, payload: Payload) -> torch.Tensor:
        """Dense ``[n]`` fp32 gradient from a final payload; updates method state (PowerSGD warm start)."""
        if not payload.final:
            raise ValueError(f"bucket {bucket}: payload stage {payload.stage} is not final; call next_round() first")
        return self.compressor.decompress(payload, self._state(bucket))

    def aggregate(self, bucket: int, payloads: Sequence[Payload], average: bool = True) -> torch.Tensor:
        """Mean (or sum) of all ranks' decompressed payloads, ``[n]`` (non-summable methods)."""
        self._state(bucket)
        return self.compressor.aggregate(payloads, average=average)

    def state_dict(self) -> dict[str, Any]:
        """Residuals, method tensors and step counters per parameter name (:func:`~.state.export_state`)."""
        return export_state(self.states, self.layouts, self.compressor_name, self.compressor_kwargs)

    def load_state_dict(self, sd: dict[str, Any]) -> list[str]:
        """Restore :meth:`state_dict` output, also from a run with other buckets (by parameter name).

        Returns:
            names of parameters without saved state (they start with a zero residual).

        Raises:
            ValueError: if the state belongs to another compressor or a parameter's shape differs.
        """
        return import_state(sd, self.states, self.layouts, self.compressor_name)


def relayout_runtime(old: CompressionRuntime | None, bucket_numels: Sequence[int], compressor_name: str,
                     compressor_kwargs: dict[str, Any] | None, layouts: Layout | None,
                     keep_state: bool = True) -> tuple[CompressionRuntime, list[str]]:
    """A runtime for new buckets that continues ``old``'s compression state by parameter name.

    The state of every parameter present in both layouts (residual slice, method tensors such as
    PowerSGD's ``q``, step counter) moves to its new bucket and offset, through
    :meth:`CompressionRuntime.state_dict` / :meth:`~CompressionRuntime.load_state_dict`; parameters
    only in the old layout are dropped with their state. ``old`` is not modified.

    Args:
        old: the runtime of the previous layout, or None (no state to carry).
        bucket_numels, compressor_name, compressor_kwargs, layouts: as for :class:`CompressionRuntime`.
        keep_state: False starts every parameter afresh.

    Returns:
        ``(runtime, fresh)``: the new runtime and the sorted names of its parameters without carried
        state (all of them when ``old`` is None or ``keep_state`` is False).

    Raises:
        ValueError: as for :class:`CompressionRuntime`, or a parameter whose shape differs between
            the layouts.
    """
    rt = CompressionRuntime(bucket_numels, compressor_name, compressor_kwargs, layouts)
    if old is None or not keep_state:
        return rt, sorted(name for entries in rt.layouts for name, _ in entries)
    return rt, rt.load_state_dict(old.state_dict())
