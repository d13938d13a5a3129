"""Measure the cost of the configured gradient compressor in the trainer, for compression-aware planning.

Produces the :class:`~lightning_pipedap.plan.compression.CompressionCost` the planners read:

* **Time.** A :class:`~lightning_pipedap.compress.runtime.CompressionRuntime` (the code the helper
  process runs) compresses random fp32 buckets of 2-3 sizes, from about 1/16 of the model up to the
  whole model (the largest bucket a plan can have), and runs what follows the collective on one
  rank: later rounds and decompression for summable payloads (the sum over one rank is the payload
  itself), packing, unpacking and aggregating ``world_size`` payloads for the others. Each size is
  timed in up to ``repeats`` interleaved rounds within ``budget_s`` seconds and the fastest cycle is
  kept (load on a shared CPU only adds time); ``alpha_c``/``beta_c`` are the non-negative least-squares line
  through (dense bytes, total seconds) and ``post_share`` the measured share after the collective
  (:func:`~lightning_pipedap.plan.compression.fit_compression_cost`). PowerSGD buckets are built from the model's own
  parameter shapes (its cost depends on the matrices, not only on the byte count); the other methods see one 1-D tensor.
* **Payload** from the compressor's :meth:`~lightning_pipedap.compress.base.Compressor.payload_spec`
  (communicated tensors; packed size for all-gathered methods), fitted as ``ratio * bytes + const``
  from two sizes; for PowerSGD exactly per layer, from the factor sizes of its layout
  (``Σ (rows + cols)·r`` plus the uncompressed elements, fp32), with 2 rounds.

Threads: with ``where="helper"`` the measurement runs with the helper's thread count.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

import torch

from lightning_pipedap.compress.compressors import PowerSGDCompressor, get_compressor
from lightning_pipedap.compress.runtime import CompressionRuntime
from lightning_pipedap.plan.compression import WHERE, CompressionCost, fit_compression_cost

__all__ = ["measure_compression_cost", "payload_model"]

Shape = tuple[int, ...]
_ELEMENT = 4  # compression works on fp32 gradients: bytes per element


def payload_model(compressor_name: str, compressor_kwargs: dict[str, Any] | None,
                  layer_shapes: Sequence[Sequence[Sequence[int]]]) -> dict[str, Any]:
    """Payload part of a :class:`CompressionCost` for a compressor and a model's layers.

    Args:
        compressor_name, compressor_kwargs: the configured compressor.
        layer_shapes: per profile layer, the shapes of its parameters.

    Returns:
        Keyword arguments for :func:`~lightning_pipedap.plan.compression.fit_compression_cost`:
        ``collective``, ``rounds``, ``payload_ratio``, ``payload_const_bytes`` and, for PowerSGD,
        ``layer_payload_bytes``.

    Raises:
        ValueError: for an unknown compressor or bad keyword arguments.
    """
    comp = get_compressor(compressor_name, **(compressor_kwargs or {}))
    collective = "AR" if comp.summable else "AG"
    if isinstance(comp, PowerSGDCompressor):
        per_layer, any_matrix = [], False
        for shapes in layer_shapes:
            shapes = [tuple(int(d) for d in s) for s in shapes]
            numel = sum(math.prod(s) for s in shapes)
            lay = comp.layout(shapes) if shapes else None
            if lay is not None and lay.matrices:
                any_matrix = True
                per_layer.append(float((lay.p_numel + lay.q_numel + lay.dense_numel) * _ELEMENT))
            else:
                per_layer.append(float(numel * _ELEMENT))
        return {"collective": "AR", "rounds": 2 if any_matrix else 1, "layer_payload_bytes": per_layer,
                "payload_ratio": 0.0, "payload_const_bytes": 0.0}

    def nbytes(n: int) -> int:
        if comp.summable:
            return sum(s.nbytes for s in comp.payload_spec(n).values() if not s.local)
        return comp.packed_nbytes(n)

    n1, n2 = 1 << 16, 1 << 20
    b1, b2 = nbytes(n1), nbytes(n2)
    ratio = max(0.0, (b2 - b1) / ((n2 - n1) * _ELEMENT))
    const = max(0.0, b1 - ratio * n1 * _ELEMENT)
    return {"collective": collective, "rounds": 1, "layer_payload_bytes": None, "payload_ratio": ratio,
            "payload_const_bytes": const}


def _bucket_layouts(layer_shapes: Sequence[Sequence[Sequence[int]]], targets: Sequence[int],
                    by_shape: bool) -> list[list[tuple[str, Shape]]]:
    """One layout per target element count: the model's parameter shapes in backward order, repeated
    as needed, until the target is reached (``by_shape``), else one 1-D tensor of the target size."""
    if not by_shape:
        return [[(f"b{k}", (int(t),))] for k, t in enumerate(targets)]
    shapes = [tuple(int(d) for d in s) for layer in reversed(layer_shapes) for s in layer if math.prod(s) > 0]
    if not shapes:
        shapes = [(1024,)]
    out = []
    for t in targets:
        lay, total, i = [], 0, 0
        while total < t:
            s = shapes[i % len(shapes)]
            lay.append((f"b{len(out)}.p{i}", s))
            total += math.prod(s)
            i += 1
        out.append(lay)
    return out


def _time_bucket(rt: CompressionRuntime, bucket: int, grad: torch.Tensor, world_size: int) -> tuple[float, float]:
    """One full compression cycle of ``bucket``: ``(seconds before the collective, seconds after)``."""
    comp = rt.compressor
    t0 = time.perf_counter()
    payload = rt.compress(bucket, grad)
    t1 = time.perf_counter()
    if comp.summable:
        while not payload.final:  # the sum over one rank is the payload itself
            payload = rt.next_round(bucket, payload)
        rt.decompress(bucket, payload)
    else:
        packed = comp.pack(payload)
        n = rt.bucket_numels[bucket]
        rt.aggregate(bucket, [comp.unpack(packed, n) for _ in range(world_size)], average=False)
    return t1 - t0, time.perf_counter() - t1


def measure_compression_cost(compressor_name: str, compressor_kwargs: dict[str, Any] | None,
                             layer_shapes: Sequence[Sequence[Sequence[int]]], *, world_size: int,
                             where: str = "helper", threads: int | None = None, budget_s: float = 1.0,
                             repeats: int = 3, seed: int = 0, extra_allreduces: int = 1) -> CompressionCost:
    """Time the compressor on this process and return its :class:`CompressionCost` (module docstring).

    Args:
        compressor_name, compressor_kwargs: the configured compressor.
        layer_shapes: per profile layer (forward order), the shapes of its trainable parameters.
        world_size: ranks (all-gathered payloads are aggregated ``world_size`` times).
        where: ``"helper"`` (the helper process compresses) or ``"inline"``.
        threads: intra-op threads during the measurement (the helper's count); None keeps the current.
        budget_s: wall-clock budget of the timings, seconds (> 0); the two smallest sizes are always
            timed once.
        repeats: timings per size, >= 1; the fastest full cycle is kept (load on a shared machine only
            adds time, so the minimum is the stable estimate).
        seed: seed of the random gradients.
        extra_allreduces: tiny all-reduces per compressed bucket besides the payload (the engine's
            transport all-reduces the used-flags: 1).

    Returns:
        The fitted cost; ``meta`` holds the sizes (elements), the samples and the fit's R².

    Raises:
        ValueError: for a bad argument (unknown compressor, ``where``, empty ``layer_shapes``, ...).
    """
    if where not in WHERE:
        raise ValueError(f"where must be one of {WHERE}, got {where!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not (isinstance(budget_s, (int, float)) and budget_s > 0):
        raise ValueError(f"budget_s must be > 0 seconds, got {budget_s!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    total = sum(math.prod(s) for layer in layer_shapes for s in layer)
    if total < 1:
        raise ValueError("layer_shapes hold no elements; nothing to compress")
    payload = payload_model(compressor_name, compressor_kwargs, layer_shapes)
    comp = get_compressor(compressor_name, **(compressor_kwargs or {}))
    by_shape = isinstance(comp, PowerSGDCompressor)
    targets = sorted({max(4096, total // 16), max(16384, total // 4), max(65536, total)})
    layouts = _bucket_layouts(layer_shapes, targets, by_shape)
    numels = [sum(math.prod(s) for _, s in lay) for lay in layouts]
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    samples: list[tuple[float, float, float]] = []
    t_start = time.perf_counter()
    try:
        gen = torch.Generator().manual_seed(seed)
        rt = CompressionRuntime(numels, compressor_name, compressor_kwargs, layouts)
        warm = getattr(comp, "start_step", 0) + 1  # PowerSGD sends its first steps uncompressed
        grads: list[torch.Tensor] = []
        for b, n in enumerate(numels):  # warm-up; sizes past the two smallest only while the budget lasts
            if b >= 2 and time.perf_counter() - t_start > budget_s:
                break
            grads.append(torch.randn(n, generator=gen).mul_(1e-2))
            for _ in range(warm):
                _time_bucket(rt, b, grads[b], world_size)
        # Rounds over all sizes (interleaved, so a burst of load hits one round, not one size); the
        # fastest cycle per size is kept.
        best: list[tuple[float, float] | None] = [None] * len(grads)
        for _ in range(repeats):
            for b, grad in enumerate(grads):
                a, c = _time_bucket(rt, b, grad, world_size)
                if best[b] is None or a + c < best[b][0] + best[b][1]:
                    best[b] = (a, c)
            if time.perf_counter() - t_start > budget_s:
                break
        for b, ac in enumerate(best):
            assert ac is not None  # one full round always runs
            samples.append((float(numels[b] * _ELEMENT), ac[0], ac[1]))
    finally:
        torch.set_num_threads(old_threads)
    meta = {"numels": numels[: len(samples)], "samples": samples, "threads": threads,
            "measure_s": time.perf_counter() - t_start}
    return fit_compression_cost(samples, where=where, method=compressor_name, meta=meta,
                                extra_allreduces=extra_allreduces, **payload)
