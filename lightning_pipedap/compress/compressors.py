"""Gradient compressors over one bucket's flat fp32 gradient ``[n]``, and the name registry.

Methods (``get_compressor(name, **kwargs)``):

=============  =========  ===========================================================  ===============
name           summable   payload (communicated)                                       error feedback
=============  =========  ===========================================================  ===============
``none``       yes        ``data`` [n] fp32 (the gradient itself)                      no
``fp16``       yes        ``data`` [n] fp16                                            no
``bf16``       yes        ``data`` [n] bf16                                            no
``randomk``    yes        ``data`` [k] fp32 values at indices drawn from a shared seed default on
``powersgd``   yes        P factors + dense rest, then Q factors (2 rounds)            default on
``topk``       no         ``indices`` [k] int32, ``values`` [k] fp32                   default on
``dgc``        no         ``indices`` [<=k] int32, ``values`` [<=k] fp32               default on
``qsgd``       no         ``levels`` [n] int8, ``norm`` [1] fp32                       default off
``efsignsgd``  no         ``bits`` [ceil(n/8)] uint8, ``scale`` [1] fp32               always
=============  =========  ===========================================================  ===============

``powersgd`` is :class:`~.powersgd.PowerSGDCompressor` (its own module, with its bucket layout);
this module holds the others and the registry of all of them.

Random choices that must agree on all ranks (random-k indices, PowerSGD's initial Q) are derived
from ``(seed, bucket, step)`` (PowerSGD: ``(seed, parameter name, step)``, independent of the
fusion into buckets) with :func:`~.base.mix_seed`, so every rank must pass the same ``seed``.
Random choices that should be independent per rank (QSGD stochastic rounding, DGC sampling) also
mix in the ``rank`` argument.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Sequence

import torch

from lightning_pipedap.compress._common import check_bool, check_int, check_ratio, seeded_generator
from lightning_pipedap.compress.base import BucketState, Compressor, Payload, TensorSpec, count_for_ratio, mix_seed
from lightning_pipedap.compress.memory import compensate, update_dense, update_sparse
from lightning_pipedap.compress.powersgd import PowerSGDCompressor

# ---------------------------------------------------------------------------------- dense casts


class NoCompression(Compressor):
    """Identity: the payload is the fp32 gradient itself (``data`` aliases the input)."""

    name = "none"
    summable = True

    def payload_spec(self, numel: int, shapes: Sequence[Sequence[int]] | None = None) -> dict[str, TensorSpec]:
        return {"data": TensorSpec(numel, torch.float32)}

    def compress(self, grad: torch.Tensor, state: BucketState) -> Payload:
        self._check_grad(grad, state)
        state.step += 1
        return Payload(self.name, state.numel, {"data": grad})

    def decompress(self, payload: Payload, state: BucketState | None = None) -> torch.Tensor:
        return payload.data


class _CastCompressor(Compressor):
    summable = True
    dtype: torch.dtype

    def payload_spec(self, numel: int, shapes: Sequence[Sequence[int]] | None = None) -> dict[str, TensorSpec]:
        return {"data": TensorSpec(numel, self.dtype)}

    def compress(self, grad: torch.Tensor, state: BucketState) -> Payload:
        self._check_grad(grad, state)
        state.step += 1
        return Payload(self.name, state.numel, {"data": grad.to(self.dtype)})

    def decompress(self, payload: Payload, state: BucketState | None = None) -> torch.Tensor:
        return payload.data.to(torch.float32)


class FP16Compressor(_CastCompressor):
    """Cast to IEEE half precision (2 bytes/element); sums are formed in fp16.

    Values above 65504 overflow to inf; the engine pre-divides by the world size, which keeps sums
    in range as in PyTorch DDP's ``fp16_compress_hook`` (pytorch/pytorch#45968). Cast compression
    is the 16-bit baseline every other method should be judged against (Agarwal et al., "On the
    Utility of Gradient Compression in Distributed Training Systems", MLSys 2022).
    """

    name = "fp16"
    dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Cast to bfloat16 (2 bytes/element, fp32's exponent range, 8-bit mantissa); sums in bf16.

    As DDP's ``bf16_compress_hook``; gloo accepts bf16 all-reduce in torch 2.13.
    """

    name = "bf16"
    dtype = torch.bfloat16


# ---------------------------------------------------------------------------------- sparsifiers


class _SparseMixin:
    """Decompress/aggregate for payloads ``indices`` (int32) + ``values`` (fp32)."""

    def payload_spec(self, numel: int, shapes: Sequence[Sequence[int]] | None = None) -> dict[str, TensorSpec]:
        """``k = ratio·n`` int32 indices and fp32 values."""
        k = count_for_ratio(numel, self.ratio)
        return {"indices": TensorSpec(k, torch.int32), "values": TensorSpec(k, torch.float32)}

    def decompress(self, payload: Payload, state: BucketState | None = None) -> torch.Tensor:
        values = payload.tensors.get("values")
        out = torch.zeros(payload.numel, dtype=torch.float32,
                          device=values.device if values is not None else "cpu")
        if values is not None:
            out.index_put_((payload.tensors["indices"].long(),), values)
        return out

    def aggregate(self, payloads: Sequence[Payload], average: bool = True) -> torch.Tensor:
        self._check_payloads(payloads)
        out = self.decompress(payloads[0]).clone()
        for p in payloads[1:]:
            if "values" in p.tensors:
                out.index_add_(0, p.tensors["indices"].long(), p.tensors["values"].to(out.device))
        if average:
            out.div_(len(payloads))
        return out


class TopKCompressor(_SparseMixin, Compressor):
    """Top-k sparsification: send the ``k = ceil(ratio · n)`` largest-magnitude entries exactly.

    Source: Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017;
    with error feedback as in Stich et al., "Sparsified SGD with Memory", NeurIPS 2018. Uses
    ``torch.topk`` (measured 407 ms for 25 M elements on 2 CPU threads: prefer ``dgc`` there).
    Ties are broken by ``torch.topk``'s order.

    Args:
        ratio: kept fraction in (0, 1].
        error_feedback: accumulate the unsent entries into the next step.
    """

    name = "topk"
    summable = False

    def __init__(self, ratio: float = 0.01, error_feedback: bool = True) -> None:
        self.ratio = check_ratio("ratio", ratio)
        self.error_feedback = check_bool("error_feedback", error_feedback)

    def compress(self, grad: torch.Tensor, state: BucketState) -> Payload:
        self._check_grad(grad, state)
        _check_index_range(state.numel)
        k = count_for_ratio(state.numel, self.ratio)
        corrected = compensate(grad, state, self.error_feedback)
        idx = torch.topk(corrected.abs(), k, sorted=False).indices
        values = corrected[idx]
        if self.error_feedback:
            update_sparse(state, corrected, idx)
        state.step += 1
        return Payload(self.name, state.numel, {"indices": idx.to(torch.int32), "values": values})


class DGCCompressor(_SparseMixin, Compressor):
    """Sampled-threshold sparsification as in Deep Gradient Compression.

    Source: Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
    Distributed Training", ICLR 2018, Sec. 3 and its threshold sampling: the threshold is the
    ``ceil(ratio · m)``-th largest magnitude among ``m = ceil(sample_ratio · n)`` entries sampled
    uniformly (with replacement; all entries when ``m >= n``); entries with ``|x| >= threshold``
    are selected, and if more than ``k = ceil(ratio · n)`` are selected, an exact top-k among the
    selected ones keeps ``k`` (the paper's hierarchical re-selection). The payload therefore holds
    ``count <= k`` entries (``meta["count"]``). Momentum correction, local gradient clipping and
    warm-up of the sparsity (also in the paper) belong to the optimiser and are not done here;
    gradient accumulation is the error-feedback residual.

    Args:
        ratio: target kept fraction in (0, 1].
        sample_ratio: sampled fraction in (0, 1] for the threshold estimate.
        seed: base seed for the sampling.
        rank: this rank's index, mixed into the sampling seed (independent samples per rank).
        error_feedback: accumulate the unsent entries into the next step.
    """

    name = "dgc"
    summable = False
    meta_keys = ("count",)

    def __init__(self, ratio: float = 0.01, sample_ratio: float = 0.01, seed: int = 0, rank: int = 0,
                 error_feedback: bool = True) -> None:
        self.ratio = check_ratio("ratio", ratio)
        self.sample_ratio = check_ratio("sample_ratio", sample_ratio)
        self.seed = check_int("seed", seed, 0)
        self.rank = check_int("rank", rank, 0)
        self.error_feedback = check_bool("error_feedback", error_feedback)

    def compress(self, grad: torch.Tensor, state: BucketState) -> Payload:
        self._check_grad(grad, state)
        _check_index_range(state.numel)
        n = state.numel
        k = count_for_ratio(n, self.ratio)
        corrected = compensate(grad, state, self.error_feedback)
        mag = corrected.abs()
        m = math.ceil(self.sample_ratio * n)
        if m >= n:
            sample = mag
        else:
            g = seeded_generator(mix_seed(self.seed, self.rank, state.bucket, state.step), mag.device)
            sample = mag[torch.randint(0, n, (m,), generator=g, device=mag.device)]
        kk = count_for_ratio(sample.numel(), self.ratio)
        threshold = torch.topk(sample, kk, sorted=False).values.min()
        sel = torch.nonzero(mag >= threshold).squeeze(1)
        if sel.numel() > k:
            sel = sel[torch.topk(mag[sel], k, sorted=False).indices]
        values = corrected[sel]
        if self.error_feedback:
            update_sparse(state, corrected, sel)
        state.step += 1
        return Payload(self.name, n, {"indices": sel.to(torch.int32), "values": values}, {"count": sel.numel()})


class RandomKCompressor(Compressor):
    """Random-k sparsification with indices shared by all ranks, so the values are summable.

    Source: Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018 (random-k with
    error feedback); the shared per-step seed follows GRACE's ``RandomKCompressor`` (ICDCS 2021).
    ``k = ceil(ratio · n)`` indices are drawn uniformly *with replacement* from a generator seeded by
    ``mix_seed(seed, bucket, step)`` (``meta["seed"]``); duplicates carry equal values, so slightly
    fewer than ``k`` distinct entries are sent (drawing without replacement, ``randperm``, cost
    850 ms for 25 M here, ``randint`` 2 ms). Values are not rescaled (biased; error feedback makes
    up for it).

    Args:
        ratio: kept fraction in (0, 1].
        seed: base seed, identical on all ranks.
        error_feedback: accumulate the unsent entries into the next step.
    """

    name = "randomk"
    summable = True
    meta_keys = ("seed",)

    def __init__(self, ratio: float = 0.01, seed: int = 0, error_feedback: bool = True) -> None:
        self.ratio = check_ratio("ratio", ratio)
        self.seed = check_int("seed", seed, 0)
        self.error_feedback = check_bool("error_feedback", error_feedback)

    def payload_spec(self, numel: int, shapes: Sequence[Sequence[int]] | None = None) -> dict[str, TensorSpec]:
        return {"data": TensorSpec(count_for_ratio(numel, self.ratio), torch.float32)}

    def indices(self, numel: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The int64 ``[k]`` indices for a bucket of ``numel`` elements and a payload seed."""
        k = count_for_ratio(numel, self.ratio)
        return torch.randint(0, numel, (k,), generator=seeded_generator(seed, torch.device(device)), device=device)

    def compress(self, grad: torch.Tensor, state: BucketState) -> Payload:
        self._check_grad(grad, state)
        seed = mix_seed(self.seed, state.bucket, state.step)
        idx = self.indices(state.numel, seed, grad.device)
        corrected = compensate(grad, state, self.error_feedback)
        values = corrected[idx]
        if self.error_feedback:
            update_sparse(state, corrected, idx)
        state.step += 1
        return Payload(self.name, state.numel, {"data": values}, {"seed": seed})

    def decompress(self, payload: Payload, state: BucketState | None = None) -> torch.Tensor:
        values = payload.data
        idx = self.indices(payload.numel, payload.meta["seed"], values.device)
        out = torch.zeros(payload.numel, dtype=torch.float32, device=values.device)
        out.index_put_((idx,), values.to(torch.float32))
        return out


# ---------------------------------------------------------------------------------- quantisers


class QSGDCompressor(Compressor):
    """QSGD stochastic quantisation with ``s`` levels and one L2 norm per bucket.

    Source: Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and
    Encoding", NeurIPS 2017, Eq. (3)/(4): ``Q(v)_i = ||v||_2 · sign(v_i) · xi_i(v, s) / s`` with
    ``xi_i = l + 1`` with probability ``s|v_i|/||v|| - l`` and ``l`` otherwise
    (``l = floor(s|v_i|/||v||)``), which is unbiased. Levels are stored as int8 (``1 <= s <= 127``),
    i.e. 1 byte/element plus the 4-byte norm (no Elias coding); the norm is per *bucket*.

    Args:
        levels: ``s``, number of quantisation levels, 1..127.
        seed: base seed for the stochastic rounding.
        rank: this rank's index, mixed into the seed (independent rounding per rank).
        error_feedback: off by default (QSGD is unbiased).
    """

    name = "qsgd"
    summable = False

    def __init__(self, levels: int = 127, seed: int = 0, rank: int = 0, error_feedback: bool = False) -> None:
        self.levels = check_int("levels", levels, 1, 127)
        self.seed = check_int("seed", seed, 0)
        self.rank = check_int("rank", rank, 0)
        self.error_feedback = check_bool("error_feedback", error_feedback)

    def payload_spec(self, numel: int, shapes: Sequence[Sequence[int]] | None = None) -> dict[str, TensorSpec]:
        return {"levels": TensorSpec(numel, torch.int8), "norm": TensorSpec(1, torch.float32)}

    def compress(self, grad: torch.Tensor, state: BucketState) -> Payload:
        self._check_grad(grad, state)
        corrected = compensate(grad, state, self.error_feedback)
        norm = corrected.norm().reshape(1)
        s = self.levels
        if float(norm) == 0.0:
            levels = torch.zeros(state.numel, dtype=torch.int8, device=grad.device)
        else:
            scaled = corrected.abs().mul_(s / norm)
            low = scaled.floor()
            g = seeded_generator(mix_seed(self.seed, self.rank, state.bucket, state.step), grad.device)
            up = torch.rand(state.numel, generator=g, device=grad.device) < scaled.sub_(low)
            levels = low.add_(up).clamp_(max=s).mul_(corrected.sign()).to(torch.int8)
        payload = Payload(self.name, state.numel, {"levels": levels, "norm": norm})
        if self.error_feedback:
            update_dense(state, corrected, self.decompress(payload))
        state.step += 1
        return payload

    def decompress(self, payload: Payload, state: BucketState | None = None) -> torch.Tensor:
        norm = payload.tensors["norm"].to(torch.float32)
        return payload.tensors["levels"].to(torch.float32).mul_(norm / self.levels)


class EFSignSGDCompressor(Compressor):
    """Scaled sign compression with error feedback (EF-SignSGD): 1 bit per element + one scale.

    Source: Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and other Gradient
    Compression Schemes", ICML 2019, Algorithm 1: ``p = g + e``, ``delta = (||p||_1 / n) · sign(p)``,
    ``e = p - delta``. Bit 1 encodes ``p_i >= 0`` (zero maps to ``+scale``, since one bit cannot
    encode 0); bits are packed little-endian, 8 per byte (``bits[j]`` bit ``b`` is element
    ``8j + b``). Error feedback is always on: it is part of the method.
    """

    name = "efsignsgd"
    summable = False
    error_feedback = True
    _WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)

    def payload_spec(self, numel: int, shapes: Sequence[Sequence[int]] | None = None) -> dict[str, TensorSpec]:
        return {"bits": TensorSpec(-(-numel // 8), torch.uint8), "scale": TensorSpec(1, torch.float32)}

    def compress(self, grad: torch.Tensor, state: BucketState) -> Payload:
        self._check_grad(grad, state)
        n = state.numel
        p = compensate(grad, state, True)
        scale = (p.abs().sum() / n).reshape(1)
        nbytes = -(-n // 8)
        bits = torch.zeros(nbytes * 8, dtype=torch.uint8, device=p.device)
        bits[:n] = p >= 0
        w = torch.tensor(self._WEIGHTS, dtype=torch.uint8, device=p.device)
        packed = bits.view(nbytes, 8).mul_(w).sum(1, dtype=torch.uint8)
        payload = Payload(self.name, n, {"bits": packed, "scale": scale})
        update_dense(state, p, self.decompress(payload))
        state.step += 1
        return payload

    def decompress(self, payload: Payload, state: BucketState | None = None) -> torch.Tensor:
        packed = payload.tensors["bits"]
        w = torch.tensor(self._WEIGHTS, dtype=torch.uint8, device=packed.device)
        positive = packed.unsqueeze(1).bitwise_and(w).ne(0).reshape(-1)[: payload.numel]
        scale = payload.tensors["scale"].to(torch.float32)
        return positive.to(torch.float32).mul_(2.0).sub_(1.0).mul_(scale)



def _check_index_range(numel: int) -> None:
    if numel >= 2**31:
        raise ValueError(f"bucket of {numel} elements is too large for int32 indices; use buckets < 2**31")


# ---------------------------------------------------------------------------------- registry

_REGISTRY: dict[str, type[Compressor]] = {
    c.name: c
    for c in (NoCompression, FP16Compressor, BF16Compressor, PowerSGDCompressor, RandomKCompressor,
              TopKCompressor, DGCCompressor, QSGDCompressor, EFSignSGDCompressor)
}


def valid_compressor_names() -> tuple[str, ...]:
    """Names accepted by :func:`get_compressor`."""
    return tuple(_REGISTRY)


def compressor_kwargs(name: str) -> dict[str, Any]:
    """Keyword arguments of compressor ``name`` with their defaults.

    Raises:
        ValueError: for an unknown name.
    """
    cls = _lookup(name)
    if cls.__init__ is object.__init__:
        return {}
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}


def get_compressor(name: str, **kwargs: Any) -> Compressor:
    """Build the compressor registered as ``name`` with validated keyword arguments.

    Raises:
        ValueError: for an unknown name (listing the valid ones), an unknown keyword (listing the
            valid ones for that method) or an invalid value (ratio outside (0, 1], rank < 1, ...).
    """
    cls = _lookup(name)
    valid = compressor_kwargs(name)
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(f"compressor {name!r} does not take {unknown}; valid keyword arguments: "
                         f"{sorted(valid) or 'none'}")
    return cls(**kwargs)


def _lookup(name: str) -> type[Compressor]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown compressor {name!r}; valid names: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]
