"""Measurement: energy readers, per-step operation timelines, and the Lightning callbacks that log them.

* :mod:`~lightning_pipedap.measure.energy` -- NVML / RAPL / estimated energy readers;
* :mod:`~lightning_pipedap.measure.timeline` -- :class:`OpRecord`, exposed communication, overlap
  ratio, Chrome trace and Gantt export (pure functions);
* :mod:`~lightning_pipedap.measure.callbacks` -- :class:`EnergyMonitor`, :class:`SpeedupMonitor`,
  :class:`CommTimeline`, :class:`CompressionMonitor` (they import Lightning, so they load on first
  access: the engine and the compression helper use the timeline without importing Lightning).
"""

from typing import Any

from lightning_pipedap.measure.energy import EnergyUnavailable, open_energy_reader
from lightning_pipedap.measure.timeline import OpRecord, exposed_communication_ms, overlap_ratio

__all__ = [
    "CommTimeline",
    "CompressionMonitor",
    "EnergyMonitor",
    "EnergyUnavailable",
    "OpRecord",
    "SpeedupMonitor",
    "exposed_communication_ms",
    "open_energy_reader",
    "overlap_ratio",
]


_CALLBACKS = ("CommTimeline", "CompressionMonitor", "EnergyMonitor", "SpeedupMonitor")


def __getattr__(name: str) -> Any:
    if name in _CALLBACKS:
        from lightning_pipedap.measure import callbacks  # noqa: PLC0415

        return getattr(callbacks, name)
    raise AttributeError(f"module 'lightning_pipedap.measure' has no attribute {name!r}")
