"""Argument checks and seeded random generators shared by the compressors."""

from __future__ import annotations

from typing import Any

import torch


def check_ratio(name: str, value: Any) -> float:
    """``value`` as a float in (0, 1]; ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 < float(value) <= 1.0):
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


def check_int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    """``value`` when it is an int (not a bool) in ``[lo, hi]`` (``hi=None``: no upper limit); ``ValueError``
    otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be an integer {rng}, got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` when it is a bool; ``ValueError`` naming ``name`` otherwise."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed``."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
