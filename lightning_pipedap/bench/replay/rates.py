"""Link rates for the replay cells: the communication/compute ratio of a profile on a link, and the link
rate that gives a wanted ratio (pure functions, no torch).

Communication is the ring all-reduce of every gradient byte: each rank sends and receives
``2 (n - 1) / n · B`` bytes over its own link (the testbed caps every host link in both directions), so
``T_ar = α + 2 (n - 1) / n · B · 8 / rate`` with ``rate`` in bit/s. Compute is ``Σ (t_f + t_b) + t_update``
(:attr:`~lightning_pipedap.plan.profile.ModelProfile.t_compute`). The ratio ``T_ar / compute`` is what
decides how much communication an overlapping schedule can hide; scaling every size by ``s_b`` and every
time by ``s_t`` keeps it when the rate is scaled by ``s_b / s_t`` (:func:`scaled_rate_bps`).
"""

from __future__ import annotations

import math
from pathlib import Path

from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.profile import ModelProfile, shared_profiles_dir

#: 1 Gbit/s in bit/s
GBIT = 1e9


def _positive(name: str, v: float) -> float:
    if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    return float(v)


def _world(world: int) -> int:
    if int(world) != world or world < 2:
        raise ValueError(f"world must be an integer >= 2, got {world!r}")
    return int(world)


def ring_allreduce_s(nbytes: float, world: int, rate_bps: float, alpha_s: float = 0.0) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` bytes on ``world`` ranks whose links carry ``rate_bps``
    bit/s each way: ``alpha_s + 2 (world - 1) / world · nbytes · 8 / rate_bps``.

    Raises:
        ValueError: ``nbytes < 0``, ``world < 2``, a non-positive rate or a negative ``alpha_s``.
    """
    if nbytes < 0 or alpha_s < 0:
        raise ValueError(f"nbytes and alpha_s must be >= 0, got {nbytes!r}, {alpha_s!r}")
    n = _world(world)
    return alpha_s + 2.0 * (n - 1) / n * nbytes * 8.0 / _positive("rate_bps", rate_bps)


def comm_compute_ratio(profile: ModelProfile, world: int, rate_bps: float) -> float:
    """``ring_allreduce_s(all gradient bytes) / compute`` of ``profile`` on ``rate_bps`` links (no α)."""
    return ring_allreduce_s(profile.total_bytes, world, rate_bps) / _positive("compute", profile.t_compute)


def rate_for_ratio_bps(profile: ModelProfile, world: int, ratio: float) -> float:
    """The link rate (bit/s) at which ``comm_compute_ratio(profile, world, rate) == ratio``.

    Raises:
        ValueError: a non-positive ratio or compute time, or a profile without bytes.
    """
    t_one = ring_allreduce_s(_positive("total bytes", profile.total_bytes), world, 1.0)  # s at 1 bit/s
    return t_one / (_positive("ratio", ratio) * _positive("compute", profile.t_compute))


def reference_ratio(profile: ModelProfile, world: int, alpha_beta: str | Path | None = None,
                    beta_scale: float = 1.0) -> float:
    """The paper's ratio: the PipeDAP reference's all-reduce time of all gradients (``α + β · M``, its
    ``alpha_beta.json`` constants for ``world`` workers, β times ``beta_scale``) over the compute time.

    Raises:
        FileNotFoundError: no ``alpha_beta.json`` given or shipped.
        ValueError: no constants for ``world`` workers (from :meth:`CostModel.from_reference`).
    """
    if alpha_beta is None:
        d = shared_profiles_dir()
        if d is None or not (d / "alpha_beta.json").is_file():
            raise FileNotFoundError("no alpha_beta.json shipped with the package and none given")
        alpha_beta = d / "alpha_beta.json"
    cm = CostModel.from_reference(alpha_beta, _world(world)).scaled(beta_factor=_positive("beta_scale", beta_scale))
    return cm.all_reduce(profile.total_bytes) / _positive("compute", profile.t_compute)


def scaled_rate_bps(rate_bps: float, size_scale: float, time_scale: float) -> float:
    """The rate that keeps a ratio when sizes are multiplied by ``size_scale`` and times by ``time_scale``:
    ``rate_bps · size_scale / time_scale``."""
    return _positive("rate_bps", rate_bps) * _positive("size_scale", size_scale) / _positive("time_scale", time_scale)


def tbf_rate(rate_bps: float) -> str:
    """``tc tbf`` rate string of ``rate_bps`` in whole Mbit/s (at least 1): ``237.4e6`` -> ``"237mbit"``."""
    return f"{max(1, round(_positive('rate_bps', rate_bps) / 1e6))}mbit"


def tbf_rate_bps(rate: str) -> float:
    """Bit/s of a ``tc`` rate string (``"237mbit"``, ``"1gbit"``, ``"500kbit"``, ``"1000000bit"``).

    Raises:
        ValueError: an unknown unit (naming the valid ones).
    """
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for u, f in units.items():
        if rate.endswith(u):
            return _positive("rate", float(rate[: -len(u)])) * f
    raise ValueError(f"rate {rate!r} has no unit; valid: {', '.join(units)}")
