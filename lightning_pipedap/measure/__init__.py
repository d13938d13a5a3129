"""Measurement: energy readers, per-step operation timelines, and the Lightning callbacks that log them.

* :mod:`~lightning_pipedap.measure.energy` -- NVML / RAPL / estimated energy readers;
* :mod:`~lightning_pipedap.measure.timeline` -- :class:`OpRecord`, exposed communication, overlap
  ratio, Chrome trace and Gantt export (pure functions);
* :mod:`~lightning_pipedap.measure.summary` -- the run summary JSON the monitors write and read as reference;
* callbacks, one per module: :class:`EnergyMonitor` (:mod:`~lightning_pipedap.measure.energy_monitor`),
  :class:`SpeedupMonitor` (:mod:`~lightning_pipedap.measure.speedup`), :class:`CommTimeline`
  (:mod:`~lightning_pipedap.measure.comm_timeline`), :class:`CompressionMonitor`
  (:mod:`~lightning_pipedap.measure.compression_monitor`).
"""

from lightning_pipedap.measure.comm_timeline import CommTimeline
from lightning_pipedap.measure.compression_monitor import CompressionMonitor
from lightning_pipedap.measure.energy import EnergyUnavailable, open_energy_reader
from lightning_pipedap.measure.energy_monitor import EnergyMonitor
from lightning_pipedap.measure.speedup import SpeedupMonitor
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
