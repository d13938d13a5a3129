"""PowerSGD (:class:`PowerSGDCompressor`): per-parameter rank-r factors, and how it splits a bucket into
matrices and uncompressed spans (:class:`BucketLayout`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from lightning_pipedap.compress._common import check_bool, check_int, seeded_generator
from lightning_pipedap.compress.base import BucketState, Compressor, Payload, TensorSpec, mix_seed, name_seed
from lightning_pipedap.compress.memory import compensate


@dataclass(frozen=True)
class LowRankMatrix:
    """One compressed parameter of a bucket: parameter ``slot`` at element ``offset``, viewed as
    ``rows × cols`` (``rows = shape[0]``, ``cols = numel / rows``), approximated with rank ``r``."""

    slot: int
    offset: int
    rows: int
    cols: int
    r: int


@dataclass(frozen=True)
class BucketLayout:
    """How PowerSGD splits one bucket: compressed matrices, and dense ``(offset, numel)`` spans sent as fp32."""

    matrices: tuple[LowRankMatrix, ...]
    dense: tuple[tuple[int, int], ...]

    @property
    def p_numel(self) -> int:
        """Elements of all P factors (``Σ rows·r``)."""
        return sum(m.rows * m.r for m in self.matrices)

    @property
    def q_numel(self) -> int:
        """Elements of all Q factors (``Σ cols·r``)."""
        return sum(m.cols * m.r for m in self.matrices)

    @property
    def dense_numel(self) -> int:
        """Elements sent uncompressed (1-D tensors and matrices too small to pay off)."""
        return sum(k for _, k in self.dense)


class PowerSGDCompressor(Compressor):
    """PowerSGD: rank-r approximation of each parameter's gradient matrix by one power-iteration step.

    Source: Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
    Distributed Optimization", NeurIPS 2019, Algorithm 1 (with error feedback, Algorithm 2, and
    warm start, Sec. 3): per matrix ``M``, ``P = M Q`` → all-reduce P → ``P̂ = orthogonalise(P)`` →
    ``Q = Mᵀ P̂`` → all-reduce Q → ``M ≈ P̂ Qᵀ``.

    **Matrix view** (as PyTorch's ``powerSGD_hook``): every parameter of the bucket with at least
    2 dimensions is its own matrix ``shape[0] × (numel / shape[0])`` (a conv weight
    ``[out, in, kh, kw]`` becomes ``out × in·kh·kw``), compressed with rank
    ``r = min(rank, rows, cols)`` when that pays off: ``(rows + cols) · r · min_compression_rate <
    rows · cols``. 1-D tensors (biases, norms) and matrices too small to pay off are sent
    uncompressed, as fp32, summed in the same round as the P factors. The bucket's parameter shapes
    come from :class:`~.base.BucketState` ``.shapes`` (a bucket without shapes is one 1-D tensor and
    is never compressed). The whole bucket is sent uncompressed for the first ``start_step`` steps
    (``start_step >= 2``, as PyTorch requires when error feedback or warm start is on, because
    buckets can be rebuilt after the first step) and when no parameter is compressed.

    **Rounds.** ``compress`` returns round 1 (``stage=1``, ``data`` = all P factors
    ``[Σ rows·r]`` followed by the uncompressed values, not final); the engine sums ``data`` over
    ranks and calls :meth:`next_round`, which orthogonalises each P, updates the error-feedback
    residual ``M - P̂ Q_ownᵀ`` (zero on the uncompressed spans, sent exactly) and returns round 2
    (``stage=2``, ``data`` = all Q factors ``[Σ cols·r]``, final, with ``local["phat"]`` and
    ``local["dense"]``, the summed uncompressed values); the engine sums ``data`` again and calls
    :meth:`decompress` *with the state*, which stores each summed Q for the warm start.
    Uncompressed steps give one final round (``stage=0``, ``data`` = the gradient).

    **Orthogonalisation.** Modified Gram-Schmidt with each column divided by ``max(norm, eps)``:
    a zero column stays zero (no NaN), unlike an unguarded division (pytorch/pytorch#49374).

    Args:
        rank: ``r >= 1`` (clipped to ``min(rows, cols)`` per matrix).
        start_step: first compressed step, ``>= 2``.
        warm_start: reuse the previous step's summed Q (else a fresh random Q every step).
        error_feedback: keep the residual ``[n]``.
        seed: base seed for the initial Q (mixed with the parameter's name and the step), identical
            on all ranks.
        min_compression_rate: compress a matrix only when it saves at least this factor, ``>= 1``
            (PyTorch's ``PowerSGDState`` default, 2).
        eps: column-norm floor of the orthogonalisation, ``> 0``.
    """

    name = "powersgd"
    summable = True
    meta_keys = ("step",)

    def __init__(self, rank: int = 4, start_step: int = 2, warm_start: bool = True, error_feedback: bool = True,
                 seed: int = 0, min_compression_rate: float = 2.0, eps: float = 1e-8) -> None:
        self.rank = check_int("rank", rank, 1)
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 2:
            raise ValueError(f"start_step must be an integer >= 2 (the first steps are sent uncompressed so that "
                             f"error feedback and warm start see stable buckets), got {start_step!r}")
        self.start_step = start_step
        self.warm_start = check_bool("warm_start", warm_start)
        self.error_feedback = check_bool("error_feedback", error_feedback)
        self.seed = check_int("seed", seed, 0)
        if isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, (int, float)) \
                or min_compression_rate < 1:
            raise ValueError(f"min_compression_rate must be a number >= 1, got {min_compression_rate!r}")
        self.min_compression_rate = float(min_compression_rate)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"eps must be a number > 0, got {eps!r}")
        self.eps = float(eps)
        self._layouts: dict[tuple[tuple[int, ...], ...], BucketLayout] = {}

    @staticmethod
    def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
        """``(rows, cols) = (shape[0], numel / shape[0])`` of a parameter, or None for 0-D/1-D tensors."""
        if len(shape) < 2:
            return None
        rows = int(shape[0])
        return rows, (math.prod(shape) // rows if rows else 0)

    def compresses(self, shape: Sequence[int]) -> bool:
        """Whether a parameter of ``shape`` is compressed: ``(rows + cols) · r · rate < rows · cols``."""
        rc = self.matrix_shape(shape)
        if rc is None:
            return False
        rows, cols = rc
        return (rows + cols) * min(self.rank, rows, cols) * self.min_compression_rate < rows * cols

    def layout(self, shapes: Sequence[Sequence[int]]) -> BucketLayout:
        """Compressed matrices and uncompressed spans of a bucket holding parameters of ``shapes`` (cached)."""
        key = tuple(tuple(int(d) for d in s) for s in shapes)
        cached = self._layouts.get(key)
        if cached is not None:
            return cached
        mats, dense, off = [], [], 0
        for slot, shape in enumerate(key):
            k = math.prod(shape)
            if self.compresses(shape):
                rows, cols = self.matrix_shape(shape)
                mats.append(LowRankMatrix(slot, off, rows, cols, min(self.rank, rows, cols)))
            elif k:
                if dense and dense[-1][0] + dense[-1][1] == off:  # merge neighbouring spans
                    dense[-1] = (dense[-1][0], dense[-1][1] + k)
                else:
                    dense.append((off, k))
            off += k
        out = self._layouts[key] = BucketLayout(tuple(mats), tuple(dense))
        return out

    def payload_spec(self, numel: int, shapes: Sequence[Sequence[int]] | None = None) -> dict[str, TensorSpec]:
        """``data`` ``[n]`` (the largest round: the uncompressed steps); local ``phat`` ``[Σ rows·r]`` and
        ``dense`` ``[uncompressed elements]`` when some parameter is compressed."""
        spec = {"data": TensorSpec(numel, torch.float32)}
        lay = self.layout(((numel,),) if shapes is None else shapes)
        if lay.matrices:
            spec["phat"] = TensorSpec(lay.p_numel, torch.float32, local=True)
            if lay.dense_numel:
                spec["dense"] = TensorSpec(lay.dense_numel, torch.float32, local=True)
        return spec

    def compress(self, grad: torch.Tensor, state: BucketState) -> Payload:
        self._check_grad(grad, state)
        step = state.step
        state.step += 1
        n = state.numel
        lay = self.layout(state.shapes)
        if step < self.start_step or not lay.matrices:
            return Payload(self.name, n, {"data": grad}, {"step": step}, stage=0, final=True)
        corrected = compensate(grad, state, self.error_feedback)
        parts = []
        for m in lay.matrices:
            q = state.param_tensors[m.slot].get("q") if self.warm_start else None
            if q is None or tuple(q.shape) != (m.cols, m.r):
                g = seeded_generator(mix_seed(self.seed, name_seed(state.names[m.slot]), step), torch.device("cpu"))
                q = torch.randn(m.cols, m.r, generator=g).to(grad.device)
            parts.append((corrected[m.offset : m.offset + m.rows * m.cols].view(m.rows, m.cols) @ q).reshape(-1))
        parts += [corrected[off : off + k] for off, k in lay.dense]
        state.scratch["m"] = corrected
        return Payload(self.name, n, {"data": torch.cat(parts)}, {"step": step}, stage=1, final=False)

    def next_round(self, reduced: Payload, state: BucketState) -> Payload:
        if reduced.stage != 1:
            raise ValueError(f"powersgd: next_round() follows round 1 (P), got a stage-{reduced.stage} payload")
        corrected = state.scratch.pop("m", None)
        if corrected is None:
            raise ValueError(f"powersgd: bucket {state.bucket} has no round-1 matrix; call compress() first")
        lay = self.layout(state.shapes)
        data = reduced.data
        phats, qs, pos = [], [], 0
        for m in lay.matrices:
            phat = orthogonalize_(data[pos : pos + m.rows * m.r].reshape(m.rows, m.r).clone(), self.eps)
            pos += m.rows * m.r
            mat = corrected[m.offset : m.offset + m.rows * m.cols].view(m.rows, m.cols)
            q = mat.t() @ phat
            if self.error_feedback:  # corrected is the residual buffer: residual = M - P̂ Q_ownᵀ
                mat.sub_(phat @ q.t())
            phats.append(phat.reshape(-1))
            qs.append(q.reshape(-1))
        local = {"phat": torch.cat(phats)}
        if lay.dense:
            local["dense"] = data[pos : pos + lay.dense_numel].clone()
            if self.error_feedback:  # sent exactly: nothing left over
                for off, k in lay.dense:
                    corrected[off : off + k].zero_()
        return Payload(self.name, state.numel, {"data": torch.cat(qs)}, dict(reduced.meta), stage=2, final=True,
                       local=local)

    def decompress(self, payload: Payload, state: BucketState | None = None) -> torch.Tensor:
        """Dense ``[n]`` from a final payload; stage 2 needs the bucket's ``state`` (its parameter shapes).

        Raises:
            ValueError: for a non-final stage, or a stage-2 payload without ``state``.
        """
        if payload.stage == 0:
            return payload.data
        if payload.stage != 2:
            raise ValueError(f"powersgd: only final payloads (stage 0 or 2) decompress, got stage {payload.stage}")
        if state is None:
            raise ValueError("powersgd: decompressing factors needs the bucket's state (its parameter shapes)")
        lay = self.layout(state.shapes)
        q_all, phat_all = payload.data, payload.local["phat"]
        out = torch.empty(payload.numel, dtype=torch.float32, device=q_all.device)
        qpos = ppos = 0
        for m in lay.matrices:
            q = q_all[qpos : qpos + m.cols * m.r].view(m.cols, m.r)
            phat = phat_all[ppos : ppos + m.rows * m.r].view(m.rows, m.r)
            qpos, ppos = qpos + m.cols * m.r, ppos + m.rows * m.r
            torch.mm(phat, q.t(), out=out[m.offset : m.offset + m.rows * m.cols].view(m.rows, m.cols))
            if self.warm_start:
                state.param_tensors[m.slot]["q"] = q.clone()
        pos = 0
        for off, k in lay.dense:
            out[off : off + k].copy_(payload.local["dense"][pos : pos + k])
            pos += k
        return out

    def aggregate(self, payloads: Sequence[Payload], average: bool = True) -> torch.Tensor:
        raise ValueError("powersgd payloads are summed (all-reduce of P, then of Q), not aggregated; "
                         "use next_round() and decompress()")


def orthogonalize_(m: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Orthonormalise the columns of ``m`` (``[rows, r]``) in place by modified Gram-Schmidt.

    Each column is divided by ``max(||column||, eps)``, so zero (or dependent) columns come out as
    zero vectors instead of NaN. Returns ``m``.
    """
    for i in range(m.shape[1]):
        col = m[:, i]
        if i:
            prev = m[:, :i]
            col.sub_(prev @ (prev.t() @ col))
        col.div_(col.norm().clamp_min(eps))
    return m

