"""Measurement: energy readers, per-step operation timelines, and the Lightning callbacks that log them.

* :mod:`~lightning_pipedap.measure.energy` -- NVML / RAPL / estimated energy readers;
* :mod:`~lightning_pipedap.measure.timeline` -- :class:`OpRecord`, exposed communication, overlap
  ratio, Chrome trace and Gantt export (pure functions);
* :mod:`~lightning_pipedap.measure.summary` -- the run summary JSON the monitors write and read as reference;
* callbacks, one per module: :class:`EnergyMonitor` (:mod:`~lightning_pipedap.measure.energy_monitor`),
  :class:`SpeedupMonitor` (:mod:`~lightning_pipedap.measure.speedup`), :class:`CommTimeline`
  (:mod:`~lightning_pipedap.measure.comm_timeline`), :class:`CompressionMonitor`
  (:mod:`~lightning_pipedap.measure.compression_monitor`). They import Lightning, so they load on
  first access: the engine and the compression helper use the timeline without importing Lightning.
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


_CALLBACKS = {"CommTimeline": "comm_timeline", "CompressionMonitor": "compression_monitor",
              "EnergyMonitor": "energy_monitor", "SpeedupMonitor": "speedup"}


def __getattr__(name: str) -> Any:
    if name in _CALLBACKS:
        import importlib  # noqa: PLC0415

        return getattr(importlib.import_module(f"lightning_pipedap.measure.{_CALLBACKS[name]}"), name)
    raise AttributeError(f"module 'lightning_pipedap.measure' has no attribute {name!r}")
