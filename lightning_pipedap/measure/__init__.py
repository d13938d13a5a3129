"""Measurement: energy readers, per-step operation timelines, and the Lightning callbacks that log them.

* :mod:`~lightning_pipedap.measure.energy` -- NVML / RAPL / estimated energy readers;
* :mod:`~lightning_pipedap.measure.timeline` -- :class:`OpRecord`, exposed communication, overlap
  ratio, Chrome trace and Gantt export (pure functions);
* :mod:`~lightning_pipedap.measure.callbacks` -- :class:`EnergyMonitor`, :class:`SpeedupMonitor`,
  :class:`CommTimeline`.
"""

from lightning_pipedap.measure.callbacks import CommTimeline, CompressionMonitor, EnergyMonitor, SpeedupMonitor
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
