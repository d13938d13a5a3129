"""Compressor interface over one bucket's flat gradient, its payload and its per-bucket state.

The split follows GRACE (Xu et al., "GRACE: A Compressed Communication Framework for Distributed
Machine Learning", ICDCS 2021): a *compressor* turns one bucket's flat 1-D fp32 gradient (shape
``[n]``) into a :class:`Payload`; an *error-feedback memory* (:mod:`.memory`) keeps what the
compression dropped; the *communicator* (the engine, not this package) moves payloads.

How the engine moves a payload depends on :attr:`Compressor.summable`:

* **summable** (``none``, ``fp16``, ``bf16``, ``randomk``, ``powersgd``): the payload has exactly
  one communicated tensor, ``payload.data``, and the element-wise *sum* of all ranks' ``data``
  decompresses to the sum of the ranks' (decompressed) gradients. It goes through reduce-scatter +
  all-gather (or one all-reduce) like an uncompressed bucket. Multi-round methods (PowerSGD: P then
  Q) return ``payload.final == False``; the engine sums ``data``, then calls
  :meth:`Compressor.next_round` for the next payload, until ``final``.
* **not summable** (``topk``, ``dgc``, ``qsgd``, ``efsignsgd``): every rank's payload is packed into a
  fixed-size byte buffer (:meth:`Compressor.pack`, padded to the largest possible payload, so an
  all-gather of equal sizes works), all-gathered, unpacked (:meth:`Compressor.unpack`) and reduced
  locally with :meth:`Compressor.aggregate`.

The engine divides gradients by the world size before communication (as DDP does), so the *sum*
over ranks is the mean gradient; :meth:`Compressor.aggregate` therefore takes ``average=False`` in
that case.
"""

from __future__ import annotations

import math
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import ClassVar, Sequence

import torch

_HEADER_DTYPE = torch.int64
_ALIGN = 8  # bytes; every packed region starts on an 8-byte boundary so dtype views are valid


@dataclass(frozen=True)
class TensorSpec:
    """Largest shape of one named payload tensor, used to preallocate shared-memory slots.

    Attributes:
        numel: maximum number of elements (the tensor is stored flat, 1-D).
        dtype: element type.
        local: True for tensors that stay on the rank and are *not* communicated (PowerSGD's
            orthogonalised ``phat``); they are not packed and not summed.
    """

    numel: int
    dtype: torch.dtype
    local: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of the largest tensor (``numel · element size``)."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Payload:
    """The compressed form of one bucket (one round of it), as moved between ranks.

    Attributes:
        method: compressor name (``"fp16"``, ``"topk"``, ...).
        numel: ``n``, number of gradient elements of the bucket.
        tensors: communicated tensors by name, each 1-D (e.g. ``{"data": [n] fp16}`` or
            ``{"indices": [k] int32, "values": [k] fp32}``).
        meta: small integers every rank can use to decode (``seed``, ``count``, ``step``); packed
            with the tensors for all-gather. Summable methods keep ``meta`` identical on all ranks.
        stage: round number within the step (0 first; PowerSGD: 0 dense, 1 P, 2 Q).
        final: False when :meth:`Compressor.next_round` must be called after summing ``data``.
        local: tensors kept on this rank only (not communicated), by name.
    """

    method: str
    numel: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, int] = field(default_factory=dict)
    stage: int = 0
    final: bool = True
    local: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def data(self) -> torch.Tensor:
        """The single communicated tensor of a summable payload.

        Raises:
            ValueError: if the payload does not have exactly one tensor named ``"data"``.
        """
        if set(self.tensors) != {"data"}:
            raise ValueError(f"payload of {self.method!r} has tensors {sorted(self.tensors)}, not one 'data' tensor")
        return self.tensors["data"]

    def with_data(self, data: torch.Tensor) -> "Payload":
        """Same payload with ``data`` replaced (e.g. by the all-reduced sum over ranks).

        Raises:
            ValueError: if the shape or dtype of ``data`` differs from the current one.
        """
        old = self.data
        if data.shape != old.shape or data.dtype != old.dtype:
            raise ValueError(
                f"{self.method} stage {self.stage}: new data {tuple(data.shape)} {data.dtype} does not match "
                f"{tuple(old.shape)} {old.dtype}"
            )
        return replace(self, tensors={"data": data})

    @property
    def nbytes(self) -> int:
        """Bytes of the communicated tensors (local tensors and ``meta`` excluded)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass
class BucketState:
    """Per-bucket compression state (error-feedback residual, per-parameter method tensors, step counter).

    Attributes:
        bucket: bucket index (used to derive per-bucket random seeds).
        numel: ``n``, gradient elements of the bucket.
        shapes: shape of each parameter packed into the bucket, in buffer order (their element
            counts sum to ``n``); default: one 1-D tensor ``(n,)``. Parameter ``i`` occupies
            ``[offsets[i], offsets[i] + numel_i)`` of the flat gradient.
        names: name of each parameter (e.g. ``"net.0.weight"``), same order; default
            ``"<bucket b>#i"``. Seeds of per-parameter random choices (PowerSGD's initial Q) are
            derived from names, so they do not depend on how parameters are fused into buckets.
        step: number of :meth:`Compressor.compress` calls so far for this bucket (identical on all
            ranks as long as every rank compresses every bucket every step).
        residual: error-feedback residual ``[n]`` fp32, or None before the first update.
        param_tensors: one dict per parameter of method tensors that persist across steps and are
            saved in checkpoints (PowerSGD: the warm-start ``q`` ``[cols, r]`` of each compressed matrix).
        scratch: transient tensors between the rounds of one step (PowerSGD: the corrected gradient);
            not saved.

    Raises:
        ValueError: if ``shapes`` does not add up to ``numel`` elements.
    """

    bucket: int
    numel: int
    shapes: tuple[tuple[int, ...], ...] | None = None
    names: tuple[str, ...] | None = None
    step: int = 0
    residual: torch.Tensor | None = None
    param_tensors: list[dict[str, torch.Tensor]] = field(default_factory=list)
    scratch: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.shapes = ((self.numel,),) if self.shapes is None else tuple(tuple(int(d) for d in s) for s in self.shapes)
        total = sum(math.prod(s) for s in self.shapes)
        if total != self.numel:
            raise ValueError(f"bucket {self.bucket}: parameter shapes {list(self.shapes)} hold {total} elements, "
                             f"the bucket has {self.numel}")
        if self.names is None:
            self.names = tuple(f"<bucket {self.bucket}>#{i}" for i in range(len(self.shapes)))
        if len(self.names) != len(self.shapes):
            raise ValueError(f"bucket {self.bucket}: {len(self.names)} parameter names for {len(self.shapes)} shapes")
        if not self.param_tensors:
            self.param_tensors = [{} for _ in self.shapes]

    @property
    def offsets(self) -> list[int]:
        """Element offset of each parameter in the flat gradient ``[n]``."""
        out, off = [], 0
        for s in self.shapes:
            out.append(off)
            off += math.prod(s)
        return out


class Compressor(ABC):
    """Compresses one bucket's flat fp32 gradient ``[n]``; subclasses implement one method.

    Subclasses set :attr:`name`, :attr:`summable` and implement :meth:`compress`,
    :meth:`decompress` and :meth:`payload_spec`. Compressors are stateless: everything that
    persists across steps lives in the :class:`BucketState` passed in.
    """

    name: ClassVar[str]
    summable: ClassVar[bool]
    #: meta keys every payload of this method carries (packed in this order)
    meta_keys: ClassVar[tuple[str, ...]] = ()

    error_feedback: bool = False

    def init_state(self, bucket: int, numel: int, shapes: Sequence[Sequence[int]] | None = None,
                   names: Sequence[str] | None = None) -> BucketState:
        """Fresh state for bucket ``bucket`` of ``numel`` elements holding parameters of ``shapes``.

        Args:
            bucket: bucket index, >= 0.
            numel: gradient elements of the bucket, >= 1.
            shapes: parameter shapes in buffer order (summing to ``numel`` elements); None: one
                1-D tensor. Only PowerSGD uses them (one matrix per parameter).
            names: parameter names, same order (see :class:`BucketState`).

        Raises:
            ValueError: if ``numel < 1``, ``bucket < 0``, ``shapes`` do not add up to ``numel`` or
                ``names`` and ``shapes`` differ in length.
        """
        if numel < 1 or bucket < 0:
            raise ValueError(f"bucket index must be >= 0 and numel >= 1, got bucket={bucket}, numel={numel}")
        return BucketState(bucket=bucket, numel=numel, shapes=None if shapes is None else tuple(map(tuple, shapes)),
                           names=None if names is None else tuple(names))

    @abstractmethod
    def payload_spec(self, numel: int, shapes: Sequence[Sequence[int]] | None = None) -> dict[str, TensorSpec]:
        """Largest payload tensors over all rounds, by name (communicated and local), for a bucket of
        ``numel`` elements holding parameters of ``shapes`` (None: one 1-D tensor)."""

    @abstractmethod
    def compress(self, grad: torch.Tensor, state: BucketState) -> Payload:
        """Compress ``grad`` (``[n]`` fp32, n = ``state.numel``) and advance ``state`` (step, residual).

        The input is not modified. The returned payload may alias ``grad`` (``none``).
        """

    def next_round(self, reduced: Payload, state: BucketState) -> Payload:
        """Next round's payload from this round's payload summed over ranks (multi-round methods).

        Raises:
            ValueError: for single-round methods, or when ``reduced.final`` is already True.
        """
        raise ValueError(f"{self.name} has a single communication round; next_round() is not defined")

    @abstractmethod
    def decompress(self, payload: Payload, state: BucketState | None = None) -> torch.Tensor:
        """Dense gradient ``[n]`` fp32 from a final payload (one rank's, or the sum of summable ones).

        ``state`` is only used by methods that learn from the result or need the bucket's parameter
        shapes (PowerSGD: warm start, one matrix per parameter).
        """

    def aggregate(self, payloads: Sequence[Payload], average: bool = True) -> torch.Tensor:
        """Mean (``average=True``) or sum of the decompressed payloads of all ranks, ``[n]`` fp32.

        Used for non-summable methods after an all-gather of payloads.

        Raises:
            ValueError: if ``payloads`` is empty or the payloads disagree on ``numel``.
        """
        self._check_payloads(payloads)
        out = self.decompress(payloads[0]).clone()
        for p in payloads[1:]:
            out.add_(self.decompress(p))
        if average:
            out.div_(len(payloads))
        return out

    # ------------------------------------------------------------------ packing for all-gather
    @staticmethod
    def _check_payloads(payloads: Sequence[Payload]) -> None:
        """Raise ``ValueError`` if ``payloads`` is empty or mixes buckets (different ``numel``)."""
        if not payloads:
            raise ValueError("aggregate() needs at least one payload")
        sizes = {p.numel for p in payloads}
        if len(sizes) != 1:
            raise ValueError(f"payloads of different buckets (numel {sorted(sizes)}) cannot be aggregated")

    def packed_nbytes(self, numel: int) -> int:
        """Size in bytes of :meth:`pack`'s output for a bucket of ``numel`` (the same on every rank)."""
        spec = {k: s for k, s in self.payload_spec(numel).items() if not s.local}
        header = (len(spec) + len(self.meta_keys)) * 8
        return header + sum(_round_up(s.nbytes, _ALIGN) for s in spec.values())

    def pack(self, payload: Payload) -> torch.Tensor:
        """Serialise a final payload to a 1-D uint8 tensor of :meth:`packed_nbytes` bytes.

        Layout: int64 header (element count of each communicated tensor in spec order, then the
        ``meta`` values in :attr:`meta_keys` order), then each tensor's bytes, padded to its maximum
        size rounded up to 8 bytes. Equal sizes on every rank make a plain all-gather possible.

        Raises:
            ValueError: for non-final payloads, or tensors not in the spec or larger than the spec.
        """
        if not payload.final:
            raise ValueError(f"{self.name}: only final payloads are packed (got stage {payload.stage})")
        spec = {k: s for k, s in self.payload_spec(payload.numel).items() if not s.local}
        unknown = set(payload.tensors) - set(spec)
        if unknown:
            raise ValueError(f"{self.name}: payload tensors {sorted(unknown)} not in spec {sorted(spec)}")
        device = next(iter(payload.tensors.values())).device if payload.tensors else torch.device("cpu")
        buf = torch.zeros(self.packed_nbytes(payload.numel), dtype=torch.uint8, device=device)
        header = [payload.tensors[k].numel() if k in payload.tensors else 0 for k in spec]
        header += [int(payload.meta[k]) for k in self.meta_keys]
        nh = len(header) * 8
        buf[:nh].view(_HEADER_DTYPE).copy_(torch.tensor(header, dtype=_HEADER_DTYPE))
        off = nh
        for k, s in spec.items():
            if k in payload.tensors:
                t = payload.tensors[k]
                if t.numel() > s.numel or t.dtype != s.dtype:
                    raise ValueError(f"{self.name}: tensor {k!r} {t.numel()} x {t.dtype} exceeds spec {s}")
                b = t.contiguous().reshape(-1).view(torch.uint8)
                buf[off : off + b.numel()].copy_(b)
            off += _round_up(s.nbytes, _ALIGN)
        return buf

    def unpack(self, buf: torch.Tensor, numel: int) -> Payload:
        """Inverse of :meth:`pack`: a payload whose tensors are views into ``buf``.

        Raises:
            ValueError: if ``buf`` is not a 1-D uint8 tensor of :meth:`packed_nbytes` bytes.
        """
        expected = self.packed_nbytes(numel)
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != expected:
            raise ValueError(f"{self.name}: packed buffer must be 1-D uint8 of {expected} bytes, got "
                             f"{tuple(buf.shape)} {buf.dtype}")
        spec = {k: s for k, s in self.payload_spec(numel).items() if not s.local}
        nh = (len(spec) + len(self.meta_keys)) * 8
        header = buf[:nh].view(_HEADER_DTYPE).tolist()
        counts, metas = header[: len(spec)], header[len(spec) :]
        tensors, off = {}, nh
        for (k, s), c in zip(spec.items(), counts):
            if c:
                esize = torch.empty((), dtype=s.dtype).element_size()
                tensors[k] = buf[off : off + c * esize].view(s.dtype)
            off += _round_up(s.nbytes, _ALIGN)
        return Payload(self.name, numel, tensors, dict(zip(self.meta_keys, metas)))

    # ------------------------------------------------------------------ helpers
    def _check_grad(self, grad: torch.Tensor, state: BucketState) -> None:
        if grad.dim() != 1 or grad.numel() != state.numel:
            raise ValueError(f"{self.name}: bucket {state.bucket} expects a flat [{state.numel}] gradient, got "
                             f"{tuple(grad.shape)}")
        if grad.dtype != torch.float32:
            raise ValueError(f"{self.name}: bucket {state.bucket} expects float32, got {grad.dtype}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, summable={self.summable}, error_feedback={self.error_feedback})"


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def count_for_ratio(numel: int, ratio: float) -> int:
    """Number of kept elements ``k = max(1, ceil(ratio · n))`` for sparsifiers (ratio in (0, 1])."""
    return max(1, min(numel, math.ceil(ratio * numel)))


def name_seed(name: str) -> int:
    """A stable 32-bit integer for a parameter name (CRC-32 of its UTF-8 bytes; the same in every process)."""
    return zlib.crc32(name.encode("utf-8"))


def mix_seed(*parts: int) -> int:
    """Deterministic 63-bit seed from integers (SplitMix64 finaliser applied per part).

    Python's ``hash`` of strings differs between processes, so seeds shared by all ranks (random-k
    indices, PowerSGD's initial Q) are derived with this instead.
    """
    mask = (1 << 64) - 1
    z = 0x9E3779B97F4A7C15
    for p in parts:
        z = (z + (int(p) & mask) + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z = z ^ (z >> 31)
    return z & ((1 << 63) - 1)
