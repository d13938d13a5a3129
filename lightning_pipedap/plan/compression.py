"""Gradient compression as a planned operation: what compressing a bucket costs and what it sends.

Plain data, no ``torch``: the planners and the timeline simulator read a :class:`CompressionCost`
like the :class:`~lightning_pipedap.plan.cost_model.CostModel`, and decide per bucket whether
compressing pays: compression and decompression are operations with measured costs, placed on the
timeline like the collectives.

Model of one compressed bucket of ``n`` dense bytes (the pipelined helper is PipeCompress, Wu et al.,
ICC 2022; the collectives follow the alpha-beta model of the cost model):

* **Compression time** ``T_c(n) = alpha_c_s + beta_c_s_per_byte * n`` seconds, covering compression,
  decompression and, for multi-round methods (PowerSGD), the work between rounds. A share
  ``post_share`` of it runs *after* the payload collective on the communication channel's critical
  path (decompression: the communication worker waits for it); the rest, ``pre = (1 - post_share) T_c``,
  runs before the collective:

  - ``where="helper"``: on a separate lane (the helper process) beside compute. Buckets enter it
    in gradient-ready order; a bucket starts when its gradients are complete and the helper is free.
  - ``where="inline"``: on the communication channel, directly before the collective.

* **Payload** ``p`` bytes per rank: ``payload_ratio * n + payload_const_bytes``, or, when
  ``layer_payload_bytes`` is given (one entry per profile layer, e.g. PowerSGD factors, which depend
  on the parameter shapes rather than on ``n``), the sum over the bucket's layers plus
  ``payload_const_bytes``.
* **Collective** on the communication channel, in the slot of the bucket's reduce-scatter or
  all-reduce (a compressed bucket has no separate all-gather):

  - ``"AR"`` (summable payloads: fp16, bf16, random-k, PowerSGD factors): ``rounds`` all-reduces
    that together carry ``p`` bytes: ``rounds * alpha_AR + beta_AR * p``;
  - ``"AG"`` (non-summable payloads: top-k, DGC, QSGD, sign): an all-gather of every rank's payload.
    The cost model's ``T_AG(m)`` rebuilds an ``m``-byte buffer from ``N`` shards of ``m / N`` bytes,
    so ``N`` payloads of ``p`` bytes cost ``T_AG(N * p)``;
  - plus ``extra_allreduces`` tiny all-reduces (start-up ``alpha_AR`` each; the engine all-reduces a
    compressed bucket's used-flags separately: 1).

So a compressed bucket occupies the channel for
``channel_s = [inline: pre] + collective + post``, which is affine in ``n`` and in the payload's
variable part (:meth:`CompressionCost.channel_terms`); the simulator's lower bounds rely on that.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from lightning_pipedap.plan._jsonfile import check_header, save_json
from lightning_pipedap.plan.cost_model import CostModel, fit_alpha_beta

__all__ = ["COLLECTIVES", "WHERE", "CompressionCost", "fit_compression_cost", "load_compression_cost"]

COMPRESSION_COST_FORMAT = "lightning_pipedap.compression_cost"
COMPRESSION_COST_VERSION = 1
COLLECTIVES = ("AR", "AG")
WHERE = ("helper", "inline")


def _nonneg(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class CompressionCost:
    """Measured cost of compressing a bucket and of communicating its payload (see the module docstring).

    Attributes:
        alpha_c_s: compression start-up per bucket, seconds (>= 0).
        beta_c_s_per_byte: compression time per dense byte, seconds/byte (>= 0).
        payload_ratio: payload bytes per dense byte (>= 0; fp16: 0.5).
        payload_const_bytes: payload bytes per bucket independent of its size (headers), >= 0.
        layer_payload_bytes: optional explicit payload bytes of each profile layer (>= 0 each); when
            given it replaces ``payload_ratio`` and must have one entry per layer of the profile
            the cost is used with.
        collective: ``"AR"`` (all-reduce of the payload) or ``"AG"`` (all-gather of all payloads).
        rounds: communication rounds per step (``"AR"`` only; PowerSGD: 2), >= 1.
        where: ``"helper"`` (separate lane beside compute) or ``"inline"`` (on the channel).
        post_share: share of ``T_c`` that runs after the collective, on the channel, in [0, 1].
        extra_allreduces: tiny all-reduces per compressed bucket besides the payload, >= 0.
        method: compressor name, for logs.
        meta: free-form provenance (fit quality, sizes measured, ...); not compared.

    Raises:
        ValueError: naming the bad field, its value and the valid choices.
    """

    alpha_c_s: float
    beta_c_s_per_byte: float
    payload_ratio: float = 1.0
    payload_const_bytes: float = 0.0
    layer_payload_bytes: tuple[float, ...] | None = None
    collective: str = "AR"
    rounds: int = 1
    where: str = "helper"
    post_share: float = 0.0
    extra_allreduces: int = 0
    method: str = "custom"
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("alpha_c_s", "beta_c_s_per_byte", "payload_ratio", "payload_const_bytes"):
            _nonneg(name, getattr(self, name))
        if self.layer_payload_bytes is not None:
            lpb = tuple(self.layer_payload_bytes)
            for k, v in enumerate(lpb):
                _nonneg(f"layer_payload_bytes[{k}]", v)
            object.__setattr__(self, "layer_payload_bytes", lpb)
        if self.collective not in COLLECTIVES:
            raise ValueError(f"collective must be one of {COLLECTIVES}, got {self.collective!r}")
        if self.where not in WHERE:
            raise ValueError(f"where must be one of {WHERE}, got {self.where!r}")
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"rounds must be an int >= 1, got {self.rounds!r}")
        if isinstance(self.extra_allreduces, bool) or not isinstance(self.extra_allreduces, int) \
                or self.extra_allreduces < 0:
            raise ValueError(f"extra_allreduces must be an int >= 0, got {self.extra_allreduces!r}")
        if self.collective == "AG" and self.rounds != 1:
            raise ValueError(f"rounds={self.rounds} needs collective='AR'; an all-gather of payloads has 1 round")
        ps = _nonneg("post_share", self.post_share)
        if ps > 1:
            raise ValueError(f"post_share must be in [0, 1], got {self.post_share!r}")

    # ------------------------------------------------------------------ times
    def compress_s(self, dense_bytes: float) -> float:
        """``T_c(n)``: seconds of compression + decompression of a bucket of ``dense_bytes``."""
        return self.alpha_c_s + self.beta_c_s_per_byte * _nonneg("dense_bytes", dense_bytes)

    def pre_s(self, dense_bytes: float) -> float:
        """Seconds of compression before the collective: ``(1 - post_share) * T_c(n)``."""
        return (1.0 - self.post_share) * self.compress_s(dense_bytes)

    def post_s(self, dense_bytes: float) -> float:
        """Seconds after the collective, on the channel: ``post_share * T_c(n)``."""
        return self.post_share * self.compress_s(dense_bytes)

    def helper_s(self, dense_bytes: float) -> float:
        """Seconds the bucket occupies the helper lane (``pre`` with ``where="helper"``, else 0)."""
        return self.pre_s(dense_bytes) if self.where == "helper" else 0.0

    def check_layers(self, num_layers: int) -> None:
        """Check ``layer_payload_bytes`` against a profile of ``num_layers`` layers.

        Raises:
            ValueError: if the lengths differ.
        """
        if self.layer_payload_bytes is not None and len(self.layer_payload_bytes) != num_layers:
            raise ValueError(f"layer_payload_bytes has {len(self.layer_payload_bytes)} entries but the profile has "
                             f"{num_layers} layers; give one payload size per layer")

    def payload_variable(self, dense_bytes: float, layers: Iterable[int] | None = None) -> float:
        """The size-dependent part of the payload, bytes: ``payload_ratio * n`` or the layers' sum.

        Raises:
            ValueError: if ``layer_payload_bytes`` is set and ``layers`` is None or out of range.
        """
        if self.layer_payload_bytes is None:
            return self.payload_ratio * _nonneg("dense_bytes", dense_bytes)
        if layers is None:
            raise ValueError("this CompressionCost gives payloads per layer (layer_payload_bytes); pass the "
                             "bucket's layers")
        lpb = self.layer_payload_bytes
        try:
            return float(sum(lpb[k] for k in layers))
        except IndexError:
            raise ValueError(f"bucket layers {sorted(layers)[:10]} out of range; valid layers are "
                             f"0..{len(lpb) - 1}") from None

    def payload_bytes(self, dense_bytes: float, layers: Iterable[int] | None = None) -> float:
        """Payload bytes one rank sends for a bucket of ``dense_bytes`` (holding profile ``layers``)."""
        return self.payload_variable(dense_bytes, layers) + self.payload_const_bytes

    def channel_terms(self, cost_model: CostModel, world_size: int | None) -> tuple[float, float, float]:
        """``(A, c_dense, c_payload)`` with ``channel_s = A + c_dense * n + c_payload * v``.

        ``n`` = dense bytes, ``v`` = :meth:`payload_variable`. ``A`` collects every per-bucket
        constant (start-ups, constant payload, compression alpha on the channel); all three are >= 0.

        Raises:
            ValueError: if ``collective="AG"`` and ``world_size`` is not an int >= 1.
        """
        on_channel = self.post_share + (1.0 - self.post_share if self.where == "inline" else 0.0)
        if self.collective == "AR":
            ab = cost_model.ar
            a_coll, per_payload = self.rounds * ab.alpha_s, ab.beta_s_per_byte
        else:
            if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
                raise ValueError(f"collective='AG' (all-gather of every rank's payload) needs the world size, an "
                                 f"int >= 1; got {world_size!r}")
            ab = cost_model.ag
            a_coll, per_payload = ab.alpha_s, ab.beta_s_per_byte * world_size
        A = (a_coll + self.extra_allreduces * cost_model.ar.alpha_s + per_payload * self.payload_const_bytes
             + on_channel * self.alpha_c_s)
        return A, on_channel * self.beta_c_s_per_byte, per_payload

    def collective_s(self, cost_model: CostModel, payload_bytes: float, world_size: int | None = None) -> float:
        """Seconds of the payload collective(s) alone, extra all-reduces included (module docstring)."""
        p = _nonneg("payload_bytes", payload_bytes)
        extra = self.extra_allreduces * cost_model.ar.alpha_s
        if self.collective == "AR":
            return cost_model.all_reduce(p) + (self.rounds - 1) * cost_model.ar.alpha_s + extra
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"collective='AG' needs the world size, an int >= 1; got {world_size!r}")
        return cost_model.all_gather(world_size * p) + extra

    def channel_s(self, cost_model: CostModel, dense_bytes: float, layers: Iterable[int] | None = None,
                  world_size: int | None = None) -> float:
        """Seconds a compressed bucket occupies the communication channel (>= 0).

        ``[inline: pre] + collective + post``; equals ``A + c_dense * n + c_payload * v`` of
        :meth:`channel_terms`.
        """
        A, cd, cp = self.channel_terms(cost_model, world_size)
        return A + cd * dense_bytes + cp * self.payload_variable(dense_bytes, layers)

    # ------------------------------------------------------------------ json i/o
    def to_dict(self) -> dict:
        """JSON-ready dict (format ``lightning_pipedap.compression_cost`` version 1)."""
        return {
            "format": COMPRESSION_COST_FORMAT, "version": COMPRESSION_COST_VERSION,
            "units": {"alpha_c": "s", "beta_c": "s/byte", "payload": "bytes"},
            "alpha_c_s": self.alpha_c_s, "beta_c_s_per_byte": self.beta_c_s_per_byte,
            "payload_ratio": self.payload_ratio, "payload_const_bytes": self.payload_const_bytes,
            "layer_payload_bytes": None if self.layer_payload_bytes is None else list(self.layer_payload_bytes),
            "collective": self.collective, "rounds": self.rounds, "where": self.where,
            "post_share": self.post_share, "extra_allreduces": self.extra_allreduces, "method": self.method,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CompressionCost":
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: for another format tag or version, a missing field, or an invalid value.
        """
        check_header(data, COMPRESSION_COST_FORMAT, COMPRESSION_COST_VERSION, "compression cost",
                     ("alpha_c_s", "beta_c_s_per_byte"))
        lpb = data.get("layer_payload_bytes")
        return cls(
            alpha_c_s=data["alpha_c_s"], beta_c_s_per_byte=data["beta_c_s_per_byte"],
            payload_ratio=data.get("payload_ratio", 1.0), payload_const_bytes=data.get("payload_const_bytes", 0.0),
            layer_payload_bytes=None if lpb is None else tuple(lpb), collective=data.get("collective", "AR"),
            rounds=data.get("rounds", 1), where=data.get("where", "helper"), post_share=data.get("post_share", 0.0),
            extra_allreduces=data.get("extra_allreduces", 0), method=data.get("method", "custom"),
            meta=dict(data.get("meta", {})),
        )

    def save(self, path: str | Path) -> Path:
        """Write the cost as JSON (:meth:`to_dict`) to ``path``; return the path."""
        return save_json(self, path)


def load_compression_cost(path: str | Path) -> CompressionCost:
    """Read a compression cost written by :meth:`CompressionCost.save`.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: if it is not JSON or not a compression cost file (naming the format found).
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not JSON ({e}); expected a file written by CompressionCost.save") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p} holds a JSON {type(data).__name__}, expected a compression cost object")
    return CompressionCost.from_dict(data)


def fit_compression_cost(samples: Sequence[tuple[float, float, float]], *, payload_ratio: float = 1.0,
                         payload_const_bytes: float = 0.0, layer_payload_bytes: Sequence[float] | None = None,
                         collective: str = "AR", rounds: int = 1, where: str = "helper", extra_allreduces: int = 0,
                         method: str = "custom", meta: Mapping[str, Any] | None = None) -> CompressionCost:
    """Fit ``T_c(n) = alpha_c + beta_c * n`` and ``post_share`` from timed compressions.

    Args:
        samples: ``(dense bytes, pre seconds, post seconds)`` per timed bucket: ``pre`` = compression
            before the collective, ``post`` = work after it (decompression, later rounds).
        payload_ratio, payload_const_bytes, layer_payload_bytes, collective, rounds, where,
            extra_allreduces, method: as in :class:`CompressionCost`.
        meta: provenance; the fit's ``r2`` and sample count are added.

    Returns:
        The cost; ``alpha_c``, ``beta_c`` are the non-negative least-squares line through
        ``(n, pre + post)`` (:func:`~lightning_pipedap.plan.cost_model.fit_alpha_beta`) and
        ``post_share = Σ post / Σ (pre + post)``.

    Raises:
        ValueError: fewer than two distinct sizes, a negative or non-finite sample, or a bad field.
    """
    pts = [(float(n), float(a), float(b)) for n, a, b in samples]
    for n, a, b in pts:
        if not all(math.isfinite(x) and x >= 0 for x in (n, a, b)):
            raise ValueError(f"compression sample (bytes={n}, pre={a} s, post={b} s) must be finite and >= 0")
    ab = fit_alpha_beta([(n, a + b) for n, a, b in pts])
    total = sum(a + b for _, a, b in pts)
    post_share = sum(b for _, _, b in pts) / total if total > 0 else 0.0
    m = dict(meta or {})
    m.update(r2=ab.r2, n_samples=ab.n_samples)
    return CompressionCost(
        alpha_c_s=ab.alpha_s, beta_c_s_per_byte=ab.beta_s_per_byte, payload_ratio=payload_ratio,
        payload_const_bytes=payload_const_bytes,
        layer_payload_bytes=None if layer_payload_bytes is None else tuple(float(x) for x in layer_payload_bytes),
        collective=collective, rounds=rounds, where=where, post_share=min(1.0, post_share),
        extra_allreduces=extra_allreduces, method=method, meta=m,
    )
