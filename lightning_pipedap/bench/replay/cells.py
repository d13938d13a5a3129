"""Which replay cells to run (pure): per profile and rank count the sleep model's scales and the link rate
that give the wanted communication/compute ratio (:func:`plan_cell`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from lightning_pipedap.bench.replay.model import ReplayOptions, replay_profile
from lightning_pipedap.bench.replay.rates import (GBIT, comm_compute_ratio, rate_for_ratio_bps, reference_ratio,
                                                  tbf_rate, tbf_rate_bps)
from lightning_pipedap.plan.profile import load_profile

#: the five published profiles (shipped in ``lightning_pipedap/plan/profiles``)
PROFILES = ("vgg16", "resnet50", "densenet201", "bert_base", "gpt2")
#: gradient bytes of a replayed model: the profile's sizes and times are both scaled by
#: ``TARGET_MB / size`` (at most 1) so that one iteration stays around half a second at 1 Gbit/s, 2 ranks
TARGET_MB = 60.0
#: the fastest link a cell may ask for; a faster one is slowed to this and the times stretched instead
MAX_RATE_BPS = GBIT


@dataclass(frozen=True)
class ReplayCell:
    """One replay cell's set-up.

    Attributes:
        profile: shared profile name.
        ranks: world size.
        ratio_spec: what the ratio was asked as (``"1gbit"``, ``"paper"``, ``"paper*30"`` or a number).
        ratio: the comm/compute ratio of the replayed (scaled) model on ``rate`` (ring all-reduce, no α).
        options: the sleep model's :class:`ReplayOptions`.
        rate: the testbed's ``tc`` rate string.
    """

    profile: str
    ranks: int
    ratio_spec: str
    ratio: float
    options: ReplayOptions
    rate: str

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return dict(asdict(self), options=asdict(self.options))

    @staticmethod
    def from_dict(d: dict) -> "ReplayCell":
        """Inverse of :meth:`to_dict`."""
        return ReplayCell(**dict(d, options=ReplayOptions.from_dict(d["options"])))


def target_ratio(profile: str, ranks: int, ratio_spec: str) -> float:
    """The comm/compute ratio a cell replays.

    ``ratio_spec``: ``"1gbit"`` (the real model, real sizes and times, on 1 Gbit/s links: what a 1 Gbit/s
    cluster sees), ``"paper"`` (the PipeDAP reference's α-β constants for ``ranks`` workers,
    :func:`~lightning_pipedap.bench.replay.rates.reference_ratio`), ``"paper*K"`` (its β times K, the
    slower networks of the planners' sweep) or a number.

    Raises:
        ValueError: an unparseable ``ratio_spec`` (naming the valid forms).
    """
    base = load_profile(profile, repaired=True)
    if ratio_spec == "1gbit":
        return comm_compute_ratio(base, ranks, GBIT)
    if ratio_spec == "paper" or ratio_spec.startswith("paper*"):
        k = float(ratio_spec.split("*", 1)[1]) if "*" in ratio_spec else 1.0
        return reference_ratio(base, ranks, beta_scale=k)
    try:
        r = float(ratio_spec)
    except ValueError:
        r = -1.0
    if not (r > 0 and math.isfinite(r)):
        raise ValueError(f"ratio {ratio_spec!r} not understood; valid: 1gbit, paper, paper*<K>, or a number > 0")
    return r


def plan_cell(profile: str, ranks: int, ratio_spec: str = "1gbit", target_mb: float = TARGET_MB,
              max_rate_bps: float = MAX_RATE_BPS) -> ReplayCell:
    """The cell that replays ``profile`` on ``ranks`` ranks at the ratio of ``ratio_spec``
    (:func:`target_ratio`): sizes and times scaled by ``s = min(1, target_mb MB / model bytes)``; the link
    rate that then gives the ratio, or ``max_rate_bps`` with the times stretched by the excess when that
    rate would be faster (the ratio is kept either way). The rate is rounded to whole Mbit/s for ``tc``.
    """
    base = load_profile(profile, repaired=True)
    s = min(1.0, target_mb * 1e6 / base.total_bytes)
    ratio = target_ratio(profile, ranks, ratio_spec)
    probe = replay_profile(ReplayOptions(profile, s, s))
    rate = rate_for_ratio_bps(probe, ranks, ratio)
    t = s * max(1.0, rate / max_rate_bps)
    opts = ReplayOptions(profile, s, t)
    rate_s = tbf_rate(rate_for_ratio_bps(replay_profile(opts), ranks, ratio))
    return ReplayCell(profile, ranks, ratio_spec, comm_compute_ratio(replay_profile(opts), ranks, tbf_rate_bps(rate_s)),
                      opts, rate_s)
