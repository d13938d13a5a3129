"""Alpha-beta cost model of the three collective primitives: reduce-scatter, all-gather, all-reduce.

Each primitive ``p`` costs ``T_p(n) = alpha_p + beta_p * n`` seconds for a bucket of ``n`` bytes
(Hockney's alpha-beta model; alpha = start-up latency in s, beta = transfer time in s/byte). The
three primitives have independent constants, so a measured fit expresses by itself whether fusing a
reduce-scatter (RS) and an all-gather (AG) into one all-reduce (AR) saves anything: the saving is
``T_RS(n) + T_AG(n) - T_AR(n)`` (see :meth:`CostModel.fused_saving`).

Costs are never negative: both constants are constrained to be >= 0 (the fit is a non-negative
least-squares fit, see :func:`fit_alpha_beta`), so ``T_p(n) >= 0`` for every ``n >= 0``.

Start-up sharing, made explicit: the PipeDAP reference implementation only has all-reduce constants
``(alpha, beta)`` and derives RS = AG = ``T_AR / 2``; then ``T_RS + T_AG == T_AR`` exactly and merging
an RS with an AG into one AR saves nothing. :meth:`CostModel.from_allreduce` takes a
``startup_sharing`` fraction ``s`` in [0, 1]: RS and AG each get ``alpha * (1 + s) / 2`` and
``beta / 2``, so an AR saves ``s * alpha`` over the separate RS + AG. ``s = 0`` is the reference's
convention; ``s = 1`` means every call pays the whole start-up (e.g. a per-call launch/synchronisation
overhead) and an AR shares one start-up between its two halves. No other sharing exists in the
model: in particular an RS never gets cheaper because "its" AG moved elsewhere (the reference's
``T_ar - alpha`` accounting, which goes negative, is not reproduced).

The 16-bit wire format (gradients cast to fp16/bf16 in the ring's send path, summed in fp32) has its own
optional constants for RS and AG, fitted like the others over the *fp32* bytes of the bucket
(:attr:`CostModel.rs16`, :attr:`CostModel.ag16`): the cast and the fp32 accumulation cost CPU per byte, so
the 16-bit transfer is not exactly half the fp32 one. Without them a 16-bit bucket costs the fp32 constants
at :data:`WIRE16_RATIO` of its bytes (:meth:`CostModel.reduce_scatter16`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from lightning_pipedap.plan._jsonfile import check_header, save_json
from lightning_pipedap.schedule import OpKind

__all__ = ["AlphaBeta", "CostModel", "WIRE16_RATIO", "fit_alpha_beta", "fit_cost_model", "load_cost_model"]

#: bytes on the wire per gradient byte of a bucket in the 16-bit wire format: 2-byte elements for the
#: 4-byte fp32 gradients the profile's ``nbytes`` count; used when no 16-bit constants were measured
#: (then ``T16(n) = alpha + beta * n / 2``: the cast's CPU time is not in the model)
WIRE16_RATIO = 0.5

COST_MODEL_FORMAT = "lightning_pipedap.cost_model"
COST_MODEL_VERSION = 1


@dataclass(frozen=True)
class AlphaBeta:
    """Alpha-beta constants of one primitive: ``T(n) = alpha_s + beta_s_per_byte * n`` seconds.

    Attributes:
        alpha_s: start-up time in seconds (>= 0).
        beta_s_per_byte: transfer time in seconds per byte (>= 0).
        r2: coefficient of determination of the fit that produced the constants, ``None`` when
            they were given rather than fitted.
        n_samples: number of (bytes, seconds) samples of that fit (0 when given).

    Raises:
        ValueError: if a constant is negative or not finite.
    """

    alpha_s: float
    beta_s_per_byte: float
    r2: float | None = None
    n_samples: int = 0

    def __post_init__(self) -> None:
        for name in ("alpha_s", "beta_s_per_byte"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 (costs are never negative), got {v!r}")

    def time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` bytes (>= 0).

        Raises:
            ValueError: if ``nbytes`` is negative.
        """
        if nbytes < 0:
            raise ValueError(f"message size must be >= 0 bytes, got {nbytes}")
        return self.alpha_s + self.beta_s_per_byte * nbytes

    def describe(self, with_r2: bool = True) -> str:
        """The constants in the one unit convention of every output (log, summary, what-if CLI):
        ``α=789 µs β=8.313 ns/B (0.120 GB/s)``, α in µs, β in ns per byte with its bandwidth ``1/β`` in
        GB/s (10^9 bytes/s) beside it, then ``R²=0.9993`` when the constants were fitted and ``with_r2``."""
        bw = f"{1e-9 / self.beta_s_per_byte:.3g} GB/s" if self.beta_s_per_byte > 0 else "unbounded"
        r2 = f" R²={self.r2:.4f}" if with_r2 and self.r2 is not None else ""
        return f"α={self.alpha_s * 1e6:.0f} µs β={self.beta_s_per_byte * 1e9:.3f} ns/B ({bw}){r2}"

    def scaled(self, alpha_factor: float = 1.0, beta_factor: float = 1.0) -> "AlphaBeta":
        """Copy with ``alpha`` and ``beta`` multiplied (what-if studies: slower network = larger beta)."""
        return AlphaBeta(self.alpha_s * alpha_factor, self.beta_s_per_byte * beta_factor, self.r2, self.n_samples)


def _r2(xs: Sequence[float], ys: Sequence[float], alpha: float, beta: float) -> float:
    mean = sum(ys) / len(ys)
    ss_tot = sum((y - mean) ** 2 for y in ys)
    ss_res = sum((y - alpha - beta * x) ** 2 for x, y in zip(xs, ys))
    if ss_tot == 0.0:
        return 1.0 if ss_res == 0.0 else 0.0
    return 1.0 - ss_res / ss_tot


def fit_alpha_beta(samples: Iterable[tuple[float, float]]) -> AlphaBeta:
    """Least-squares fit of ``seconds = alpha + beta * bytes`` with ``alpha, beta >= 0``.

    The unconstrained ordinary least-squares line is used when both constants come out >= 0.
    Otherwise the constrained optimum lies on a face of the feasible quadrant, and the better of
    the two one-parameter fits is taken: ``alpha = 0`` (``beta = Σxy / Σx²``) or ``beta = 0``
    (``alpha = mean(y)``). This is the exact non-negative least-squares solution for two unknowns.

    Args:
        samples: ``(bytes, seconds)`` pairs, e.g. from a micro-benchmark over a range of sizes.

    Returns:
        The fitted :class:`AlphaBeta`, with its ``r2`` (computed for the returned constants) and
        ``n_samples``.

    Raises:
        ValueError: with fewer than two samples, fewer than two distinct sizes, or a negative or
            non-finite size or time.
    """
    pts = [(float(x), float(y)) for x, y in samples]
    if len(pts) < 2:
        raise ValueError(f"need at least 2 (bytes, seconds) samples to fit alpha and beta, got {len(pts)}")
    for x, y in pts:
        if not (math.isfinite(x) and math.isfinite(y)) or x < 0 or y < 0:
            raise ValueError(f"sample (bytes={x}, seconds={y}) is invalid: both must be finite and >= 0")
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts]
    if len(set(xs)) < 2:
        raise ValueError(f"need at least 2 distinct message sizes to fit alpha and beta, got only {sorted(set(xs))}")
    n = len(pts)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    beta = sxy / sxx
    alpha = my - beta * mx
    if alpha < 0 or beta < 0:
        candidates = []
        sx2 = sum(x * x for x in xs)
        b0 = max(0.0, sum(x * y for x, y in zip(xs, ys)) / sx2) if sx2 > 0 else 0.0
        candidates.append((0.0, b0))
        candidates.append((max(0.0, my), 0.0))

        def sse(ab: tuple[float, float]) -> float:
            return sum((y - ab[0] - ab[1] * x) ** 2 for x, y in zip(xs, ys))

        alpha, beta = min(candidates, key=sse)
    return AlphaBeta(alpha, beta, r2=_r2(xs, ys, alpha, beta), n_samples=n)


_KINDS = (OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.ALL_REDUCE)


def _kind(k: OpKind | str) -> OpKind:
    if isinstance(k, OpKind):
        return k
    try:
        return OpKind(str(k).upper())
    except ValueError:
        raise ValueError(f"unknown primitive {k!r}; valid: 'RS', 'AG', 'AR'") from None


@dataclass(frozen=True)
class CostModel:
    """Alpha-beta costs of reduce-scatter, all-gather and all-reduce on one process group.

    Sizes are the bytes of the *whole bucket* (the full gradient buffer of ``n`` bytes that is
    reduce-scattered, all-gathered back or all-reduced), times are seconds.

    Attributes:
        rs: constants of reduce-scatter.
        ag: constants of all-gather.
        ar: constants of all-reduce.
        meta: free-form provenance (backend, world size, hosts, source file, ...).
        rs16, ag16: optional constants of reduce-scatter and all-gather in the 16-bit wire format, over the
            bucket's fp32 bytes (measured with the cast; None: the fp32 constants at :data:`WIRE16_RATIO`
            of the bytes). Both or neither.
    """

    rs: AlphaBeta
    ag: AlphaBeta
    ar: AlphaBeta
    meta: dict = field(default_factory=dict, compare=False)
    rs16: Optional[AlphaBeta] = None
    ag16: Optional[AlphaBeta] = None

    def __post_init__(self) -> None:
        if (self.rs16 is None) != (self.ag16 is None):
            raise ValueError("a cost model has 16-bit wire constants for both RS and AG or for neither, got "
                             f"rs16={self.rs16!r}, ag16={self.ag16!r}")

    # ------------------------------------------------------------------ costs
    def primitive(self, kind: OpKind | str) -> AlphaBeta:
        """The :class:`AlphaBeta` of ``kind`` (an :class:`OpKind` or ``"RS"``/``"AG"``/``"AR"``).

        Raises:
            ValueError: for an unknown kind.
        """
        k = _kind(kind)
        return {OpKind.REDUCE_SCATTER: self.rs, OpKind.ALL_GATHER: self.ag, OpKind.ALL_REDUCE: self.ar}[k]

    def cost(self, kind: OpKind | str, nbytes: float) -> float:
        """Seconds of one ``kind`` operation on a bucket of ``nbytes`` bytes (never negative)."""
        return self.primitive(kind).time(nbytes)

    def reduce_scatter(self, nbytes: float) -> float:
        """Seconds of a reduce-scatter of an ``nbytes``-byte bucket."""
        return self.rs.time(nbytes)

    def all_gather(self, nbytes: float) -> float:
        """Seconds of an all-gather that rebuilds an ``nbytes``-byte bucket."""
        return self.ag.time(nbytes)

    def all_reduce(self, nbytes: float) -> float:
        """Seconds of an all-reduce of an ``nbytes``-byte bucket."""
        return self.ar.time(nbytes)

    def reduce_scatter16(self, nbytes: float) -> float:
        """Seconds of a reduce-scatter of an ``nbytes``-byte (fp32) bucket in the 16-bit wire format: the
        measured :attr:`rs16`, else the fp32 reduce-scatter of ``WIRE16_RATIO * nbytes``."""
        return self.rs16.time(nbytes) if self.rs16 is not None else self.rs.time(WIRE16_RATIO * nbytes)

    def all_gather16(self, nbytes: float) -> float:
        """Seconds of an all-gather rebuilding an ``nbytes``-byte (fp32) bucket in the 16-bit wire format: the
        measured :attr:`ag16`, else the fp32 all-gather of ``WIRE16_RATIO * nbytes``."""
        return self.ag16.time(nbytes) if self.ag16 is not None else self.ag.time(WIRE16_RATIO * nbytes)

    def fused_saving(self, nbytes: float) -> float:
        """``T_RS + T_AG - T_AR`` in seconds: what one AR saves over RS + AG (may be < 0)."""
        return self.rs.time(nbytes) + self.ag.time(nbytes) - self.ar.time(nbytes)

    def min_reduce(self, nbytes: float) -> float:
        """Cheapest way to fully reduce ``nbytes``: ``min(T_AR, T_RS + T_AG)`` seconds.

        This function is concave and >= 0 at 0, hence subadditive; the lower bounds of
        :mod:`lightning_pipedap.plan.simulator` rely on that.
        """
        return min(self.ar.time(nbytes), self.rs.time(nbytes) + self.ag.time(nbytes))

    def scaled(self, alpha_factor: float = 1.0, beta_factor: float = 1.0) -> "CostModel":
        """Copy with every alpha and beta multiplied (e.g. ``beta_factor=10``: a 10x slower network)."""
        meta = dict(self.meta, alpha_factor=alpha_factor * self.meta.get("alpha_factor", 1.0),
                    beta_factor=beta_factor * self.meta.get("beta_factor", 1.0))
        def sc(ab: Optional[AlphaBeta]) -> Optional[AlphaBeta]:
            return None if ab is None else ab.scaled(alpha_factor, beta_factor)

        return CostModel(sc(self.rs), sc(self.ag), sc(self.ar), meta, sc(self.rs16), sc(self.ag16))

    # ----------------------------------------------------------- constructors
    @classmethod
    def from_allreduce(cls, alpha_s: float, beta_s_per_byte: float, *, startup_sharing: float = 0.0,
                       meta: Mapping[str, Any] | None = None) -> "CostModel":
        """Build RS/AG/AR costs from all-reduce constants only.

        ``T_AR(n) = alpha + beta * n``; ``T_RS(n) = T_AG(n) = alpha * (1 + s) / 2 + beta / 2 * n``
        with ``s = startup_sharing``. ``s = 0`` reproduces the PipeDAP reference's split
        (RS = AG = T_AR / 2, so fusing RS + AG into AR saves nothing); ``s = 1`` charges every
        decoupled operation the whole start-up, so an AR saves ``alpha`` over RS + AG.

        Raises:
            ValueError: if a constant is negative or ``startup_sharing`` is outside [0, 1].
        """
        if not (0.0 <= startup_sharing <= 1.0):
            raise ValueError("startup_sharing must be in [0, 1] (fraction of alpha saved by one AR), "
                             f"got {startup_sharing}")
        half = AlphaBeta(alpha_s * (1.0 + startup_sharing) / 2.0, beta_s_per_byte / 2.0)
        m = {"source": "from_allreduce", "startup_sharing": startup_sharing}
        m.update(meta or {})
        return cls(rs=half, ag=half, ar=AlphaBeta(alpha_s, beta_s_per_byte), meta=m)

    @classmethod
    def from_reference(cls, path: str | Path, world_size: int, *, bytes_per_element: int = 4,
                       startup_sharing: float = 0.0) -> "CostModel":
        """Load the PipeDAP reference constants (``alpha_beta.json`` of the packaged reference profiles).

        That file gives per worker count ``alpha_s`` (s) and ``beta_s_per_element`` (s/element);
        the byte-based beta is ``beta_s_per_element / bytes_per_element`` (fp32 gradients: 4).

        Raises:
            FileNotFoundError: if ``path`` does not exist.
            ValueError: if ``world_size`` is not in the file (the message lists the ones that are)
                or ``bytes_per_element`` is not positive.
        """
        if bytes_per_element <= 0:
            raise ValueError(f"bytes_per_element must be > 0, got {bytes_per_element}")
        data = json.loads(Path(path).read_text())
        key = str(int(world_size))
        if key not in data:
            valid = sorted(k for k in data if k.isdigit())
            raise ValueError(f"no alpha-beta constants for world size {world_size} in {path}; valid: {valid}")
        entry = data[key]
        return cls.from_allreduce(
            float(entry["alpha_s"]), float(entry["beta_s_per_element"]) / bytes_per_element,
            startup_sharing=startup_sharing,
            meta={"source": str(path), "world_size": int(world_size), "bytes_per_element": bytes_per_element},
        )

    # -------------------------------------------------------------- json i/o
    def to_dict(self) -> dict:
        """JSON-ready dict (format ``lightning_pipedap.cost_model`` version 1)."""
        return {
            "format": COST_MODEL_FORMAT,
            "version": COST_MODEL_VERSION,
            "units": {"alpha": "s", "beta": "s/byte", "size": "bytes of the whole bucket"},
            "primitives": {k.value: asdict(self.primitive(k)) for k in _KINDS},
            "meta": dict(self.meta),
        } | ({"wire16": {"RS": asdict(self.rs16), "AG": asdict(self.ag16)}} if self.rs16 is not None else {})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CostModel":
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: if the format tag, version or a primitive is missing or wrong.
        """
        check_header(data, COST_MODEL_FORMAT, COST_MODEL_VERSION, "cost model file")
        prims = data.get("primitives", {})
        missing = [k.value for k in _KINDS if k.value not in prims]
        if missing:
            raise ValueError(f"cost model lacks primitives {missing}; need 'RS', 'AG' and 'AR'")
        ab = {k: AlphaBeta(**prims[k.value]) for k in _KINDS}
        w16 = data.get("wire16") or {}
        if w16 and not {"RS", "AG"} <= set(w16):
            raise ValueError(f"cost model's wire16 section needs 'RS' and 'AG', got {sorted(w16)}")
        rs16, ag16 = (AlphaBeta(**w16["RS"]), AlphaBeta(**w16["AG"])) if w16 else (None, None)
        return cls(ab[OpKind.REDUCE_SCATTER], ab[OpKind.ALL_GATHER], ab[OpKind.ALL_REDUCE], dict(data.get("meta", {})),
                   rs16, ag16)

    def save(self, path: str | Path) -> Path:
        """Write the model as JSON to ``path``; return the path."""
        return save_json(self, path)


def load_cost_model(path: str | Path) -> CostModel:
    """Read a cost model written by :meth:`CostModel.save`.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: if it is not a cost model file.
    """
    return CostModel.from_dict(json.loads(Path(path).read_text()))


def fit_cost_model(samples: Mapping[OpKind | str, Iterable[tuple[float, float]]], *,
                   meta: Mapping[str, Any] | None = None,
                   wire16_samples: Mapping[str, Iterable[tuple[float, float]]] | None = None) -> CostModel:
    """Fit RS, AG and AR constants from micro-benchmark samples.

    Args:
        samples: for each primitive (``OpKind`` or ``"RS"``/``"AG"``/``"AR"``) a list of
            ``(bucket bytes, seconds)`` pairs. RS and AG are required. When AR has no samples it is
            taken as ``RS + AG`` (``alpha_AR = alpha_RS + alpha_AG``, same for beta: no start-up
            sharing assumed) and its ``r2`` is ``None``.
        meta: provenance stored with the model (backend, world size, hosts, ...).
        wire16_samples: optional ``{"RS": [...], "AG": [...]}`` of the 16-bit wire format, ``(fp32 bucket
            bytes, seconds)`` pairs: fitted into :attr:`CostModel.rs16` / :attr:`CostModel.ag16`.

    Returns:
        The fitted :class:`CostModel`; each primitive carries its ``r2`` (fit quality).

    Raises:
        ValueError: for an unknown primitive, missing RS/AG samples, or a degenerate sample set
            (see :func:`fit_alpha_beta`).
    """
    by_kind = {_kind(k): list(v) for k, v in samples.items()}
    for k in (OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER):
        if not by_kind.get(k):
            raise ValueError(f"no samples for {k.value}; fit_cost_model needs RS and AG samples (AR optional)")
    rs = fit_alpha_beta(by_kind[OpKind.REDUCE_SCATTER])
    ag = fit_alpha_beta(by_kind[OpKind.ALL_GATHER])
    if by_kind.get(OpKind.ALL_REDUCE):
        ar = fit_alpha_beta(by_kind[OpKind.ALL_REDUCE])
    else:
        ar = AlphaBeta(rs.alpha_s + ag.alpha_s, rs.beta_s_per_byte + ag.beta_s_per_byte)
    rs16 = ag16 = None
    if wire16_samples is not None:
        if not (wire16_samples.get("RS") and wire16_samples.get("AG")):
            raise ValueError(f"wire16_samples needs 'RS' and 'AG' samples, got {sorted(wire16_samples)}")
        rs16, ag16 = fit_alpha_beta(wire16_samples["RS"]), fit_alpha_beta(wire16_samples["AG"])
    return CostModel(rs, ag, ar, dict(meta or {}), rs16, ag16)
