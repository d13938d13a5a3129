"""The run summary: a JSON object in the log directory into which the monitors merge their headline numbers.

At the end of ``fit`` :class:`~lightning_pipedap.measure.speedup.SpeedupMonitor` and
:class:`~lightning_pipedap.measure.energy_monitor.EnergyMonitor` write their numbers into one file
(``measure_summary.json`` by default; see :data:`SUMMARY_KEYS`). Another run (e.g. the DDP job of a
Hydra sweep) passes that file as ``reference_file`` to get speedup and energy saving.
"""

from __future__ import annotations

import json
import os
from typing import Any

SUMMARY_FILE = "measure_summary.json"
#: keys written to the summary file (units in the names): iteration_s, throughput_samples_per_s,
#: samples_per_step (SpeedupMonitor); energy_kind, energy_source, energy_J_per_step,
#: energy_J_per_sample, energy_mean_W, energy_total_J (EnergyMonitor).
SUMMARY_KEYS = ("iteration_s", "throughput_samples_per_s", "samples_per_step", "energy_kind", "energy_source",
                "energy_J_per_step", "energy_J_per_sample", "energy_mean_W", "energy_total_J")


def read_summary(path: str) -> dict[str, Any]:
    """Load a summary JSON written by the monitors.

    Raises:
        FileNotFoundError: ``path`` does not exist (message names it).
        ValueError: the file is not a JSON object.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"reference_file={path!r} does not exist (expected a {SUMMARY_FILE} of a finished run)")
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"reference_file={path!r} holds {type(data).__name__}, expected a JSON object")
    return data


def update_summary(path: str, values: dict[str, Any]) -> None:
    """Merge ``values`` into the JSON object at ``path`` (created if missing), atomically."""
    data: dict[str, Any] = {}
    if os.path.isfile(path):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = {}
    data.update(values)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def summary_path(summary_file: str, log_dir: str) -> str:
    """``summary_file`` itself when it is an absolute path, else that file name in ``log_dir``."""
    return summary_file if os.path.isabs(summary_file) else os.path.join(log_dir, summary_file)
