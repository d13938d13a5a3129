"""Energy readers: NVML GPU counter, CPU RAPL counters, and a clearly labelled estimate.

Every reader answers one question for *this process's device*: how many joules were used since the
reader was opened (:meth:`EnergyReader.read_J`, a cumulative value; callers take differences over
windows). Readers differ in whether the number is *measured* by a hardware counter or *estimated*
from a model, and :attr:`EnergyReader.kind` says which, so that the two are never mixed in one metric.

Sources, in the order :func:`open_energy_reader` tries them:

1. ``nvml`` -- ``nvmlDeviceGetTotalEnergyConsumption`` (NVIDIA Volta or newer) returns the GPU's energy
   in **mJ** since the driver was loaded. The counter updates every 20-100 ms, so windows should span
   several steps and at least a few hundred ms (NVML reference; PETSc ``PetscLogGpuEnergyMeter``).
   Package ``nvidia-ml-py`` (import name ``pynvml``).
2. ``rapl`` -- Linux powercap: ``/sys/class/powercap/intel-rapl:N/energy_uj`` (**µJ**) per CPU package
   (also used for AMD packages), optionally plus the ``dram`` sub-zones. The counter wraps at
   ``max_energy_range_uj``; :class:`RaplReader` unwraps, which is correct as long as it is read at least
   once per wrap period (minutes at typical package power). The files are usually root-only.
   RAPL covers the whole socket, so on a node with several ranks only local rank 0 should read it.
3. ``estimate`` -- *not a measurement*: configured watts x measured busy time, where busy time is
   the CPU seconds of this process and its live child processes (``basis="cpu"``) or wall-clock
   seconds (``basis="wall"``).
"""

from __future__ import annotations

import glob
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

MEASURED = "measured"
ESTIMATED = "estimated"
SOURCES = ("auto", "nvml", "rapl", "estimate")
ESTIMATE_BASES = ("cpu", "wall")
DEFAULT_RAPL_ROOT = "/sys/class/powercap"


class EnergyUnavailable(RuntimeError):
    """Raised when a requested energy source cannot be opened on this machine (the message says why)."""


class EnergyReader(ABC):
    """A cumulative energy counter for one device.

    Attributes:
        source: short name recorded with the run, e.g. ``"nvml:gpu0"``, ``"rapl:package-0+dram"``,
            ``"estimate:10W x cpu_s"``.
        kind: ``"measured"`` (hardware counter) or ``"estimated"`` (model).
    """

    source: str = ""
    kind: str = MEASURED

    @abstractmethod
    def read_J(self) -> float:
        """Joules used since the reader was created (monotone non-decreasing)."""

    def close(self) -> None:
        """Release the counter (default: nothing to release)."""


# --------------------------------------------------------------------------------------------- NVML
class NvmlReader(EnergyReader):
    """GPU energy from NVML's total-energy counter (mJ, Volta or newer).

    Args:
        device_index: CUDA device index *as torch sees it* (after ``CUDA_VISIBLE_DEVICES``).
        nvml: the ``pynvml`` module (injected for tests); default imports ``pynvml`` from nvidia-ml-py.
        uuid: the device UUID (``"GPU-..."``) when known. Otherwise the index is mapped through
            ``CUDA_VISIBLE_DEVICES`` (NVML numbers devices physically and ignores that variable).

    Raises:
        EnergyUnavailable: ``pynvml`` is missing, ``nvmlInit`` fails (no driver), the device cannot be
            found, or it has no energy counter (pre-Volta).
    """

    kind = MEASURED

    def __init__(self, device_index: int, nvml=None, uuid: Optional[str] = None) -> None:
        if nvml is None:
            try:
                import pynvml as nvml  # nvidia-ml-py
            except ImportError as e:  # pragma: no cover - it is a dependency
                raise EnergyUnavailable(f"nvml: package nvidia-ml-py not importable ({e})") from e
        self._nvml = nvml
        try:
            nvml.nvmlInit()
        except Exception as e:
            raise EnergyUnavailable(f"nvml: nvmlInit failed ({type(e).__name__}: {e})") from e
        try:
            ident = uuid or _visible_cuda_device(device_index)
            if isinstance(ident, str):
                self._handle = nvml.nvmlDeviceGetHandleByUUID(ident)
            else:
                self._handle = nvml.nvmlDeviceGetHandleByIndex(ident)
            self._start_mJ = int(nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except Exception as e:
            _safe(nvml.nvmlShutdown)
            raise EnergyUnavailable(
                f"nvml: no energy counter for CUDA device {device_index} ({type(e).__name__}: {e})"
            ) from e
        self.source = f"nvml:gpu{device_index}"
        self._closed = False

    def read_J(self) -> float:
        mJ = int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        return (mJ - self._start_mJ) / 1000.0

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _safe(self._nvml.nvmlShutdown)


def _visible_cuda_device(index: int) -> int | str:
    """NVML identity of torch CUDA device ``index``: the physical index, or the UUID string when
    ``CUDA_VISIBLE_DEVICES`` names devices by UUID (``GPU-...``/``MIG-...``)."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis:
        parts = [p.strip() for p in vis.split(",") if p.strip()]
        if index < len(parts):
            return int(parts[index]) if parts[index].isdigit() else parts[index]
    return index


def _safe(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:
        pass


# --------------------------------------------------------------------------------------------- RAPL
@dataclass
class _RaplZone:
    name: str
    energy_path: str
    max_uj: int
    last_uj: int
    total_uj: int = 0


class RaplReader(EnergyReader):
    """CPU energy from Linux powercap RAPL counters (µJ), with wrap-around.

    Reads every top-level package zone ``<root>/intel-rapl:N`` whose ``name`` starts with ``package``,
    plus its ``dram`` sub-zones when ``include_dram`` (DRAM is not part of the package domain on
    servers). ``psys`` and ``core``/``uncore`` zones are skipped because they overlap the package.

    Wrap-around: the counter runs from 0 to ``max_energy_range_uj`` and then restarts at 0, so a reading
    lower than the previous one means one wrap: ``delta = cur + max_energy_range_uj - prev``. More
    than one wrap between reads cannot be detected; read at least every few minutes.

    Args:
        root: powercap directory (a fake tree in tests).
        include_dram: also count ``dram`` sub-zones.

    Raises:
        EnergyUnavailable: no package zone found, or a counter file is not readable (often root-only).
    """

    kind = MEASURED

    def __init__(self, root: str = DEFAULT_RAPL_ROOT, include_dram: bool = True) -> None:
        zones: list[_RaplZone] = []
        tops = sorted(p for p in glob.glob(os.path.join(root, "intel-rapl:*")) if p.count(":") == 1)
        for top in tops:
            name = _read_text(os.path.join(top, "name"))
            if name is None or not name.startswith("package"):
                continue
            zones.append(self._open_zone(top, name))
            if include_dram:
                for sub in sorted(glob.glob(top + ":*")):
                    if _read_text(os.path.join(sub, "name")) == "dram":
                        zones.append(self._open_zone(sub, f"{name}/dram"))
        if not zones:
            raise EnergyUnavailable(f"rapl: no readable package zone under {root}/intel-rapl:*")
        self._zones = zones
        self.source = "rapl:" + "+".join(z.name for z in zones)

    @staticmethod
    def _open_zone(path: str, name: str) -> _RaplZone:
        energy_path = os.path.join(path, "energy_uj")
        try:
            cur = _read_int(energy_path)
            max_uj = _read_int(os.path.join(path, "max_energy_range_uj"))
        except (OSError, ValueError) as e:
            raise EnergyUnavailable(f"rapl: cannot read {energy_path} ({type(e).__name__}: {e})") from e
        if max_uj <= 0:
            raise EnergyUnavailable(f"rapl: {path}/max_energy_range_uj is {max_uj}, expected > 0")
        return _RaplZone(name, energy_path, max_uj, cur)

    def read_J(self) -> float:
        total = 0
        for z in self._zones:
            cur = _read_int(z.energy_path)
            z.total_uj += rapl_delta_uj(z.last_uj, cur, z.max_uj)
            z.last_uj = cur
            total += z.total_uj
        return total / 1e6


def rapl_delta_uj(prev_uj: int, cur_uj: int, max_energy_range_uj: int) -> int:
    """Energy (µJ) between two readings of one RAPL counter, assuming at most one wrap.

    Args:
        prev_uj, cur_uj: consecutive ``energy_uj`` readings.
        max_energy_range_uj: the zone's ``max_energy_range_uj`` (the value at which the counter wraps).

    Raises:
        ValueError: a reading is outside ``[0, max_energy_range_uj]``.
    """
    for label, v in (("prev_uj", prev_uj), ("cur_uj", cur_uj)):
        if not 0 <= v <= max_energy_range_uj:
            raise ValueError(f"rapl: {label}={v} outside [0, max_energy_range_uj={max_energy_range_uj}]")
    if cur_uj >= prev_uj:
        return cur_uj - prev_uj
    return cur_uj + max_energy_range_uj - prev_uj


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read().strip())


# ----------------------------------------------------------------------------------------- estimate
class EstimateReader(EnergyReader):
    """Estimated energy: ``watts x busy seconds``. Not a measurement; its kind is ``"estimated"``.

    Args:
        watts: assumed power in W of one busy CPU core (``basis="cpu"``) or of the whole device
            (``basis="wall"``). Must be > 0.
        basis: ``"cpu"`` -- busy seconds are the CPU time of this process (all threads) plus its live
            child processes (Linux ``/proc``; e.g. the compression helper), so extra CPU work costs
            energy; ``"wall"`` -- busy seconds are wall-clock seconds.
        clock: wall clock in seconds (injected for tests; default ``time.perf_counter``).
        cpu_clock: CPU-seconds function (injected for tests; default: this process's
            ``time.process_time()`` plus its child processes' user+system time from ``/proc``).

    Raises:
        ValueError: ``watts <= 0`` or an unknown ``basis``.
    """

    kind = ESTIMATED

    def __init__(
        self,
        watts: float,
        basis: str = "cpu",
        clock: Optional[Callable[[], float]] = None,
        cpu_clock: Optional[Callable[[], float]] = None,
    ) -> None:
        if not watts > 0:
            raise ValueError(f"estimate: watts={watts!r} must be > 0")
        if basis not in ESTIMATE_BASES:
            raise ValueError(f"estimate: basis={basis!r}; valid choices: {ESTIMATE_BASES}")
        self.watts = float(watts)
        self.basis = basis
        if basis == "cpu":
            self._clock = cpu_clock or _ProcessTreeCpu()
        else:
            self._clock = clock or time.perf_counter
        self._start = self._clock()
        self.source = f"estimate:{self.watts:g}W x {basis}_s"

    def read_J(self) -> float:
        return self.watts * max(0.0, self._clock() - self._start)


class _ProcessTreeCpu:
    """CPU seconds of this process plus its child processes; a child that exits keeps its last value."""

    def __init__(self) -> None:
        self._seen: dict[int, float] = {}

    def __call__(self) -> float:
        for pid, cpu in _children_cpu_s(os.getpid()).items():
            self._seen[pid] = max(cpu, self._seen.get(pid, 0.0))
        return time.process_time() + sum(self._seen.values())


def _children_cpu_s(pid: int) -> dict[int, float]:
    out: dict[int, float] = {}
    try:
        tick = float(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-Linux
        return out
    stack = [pid]
    while stack:
        p = stack.pop()
        for kid in _child_pids(p):
            if kid in out:
                continue
            stat = _read_text(f"/proc/{kid}/stat")
            if stat is None:
                continue
            fields = stat.rsplit(")", 1)[-1].split()
            try:  # utime, stime are fields 14, 15 (1-based); after "pid (comm)" they are index 11, 12
                out[kid] = (int(fields[11]) + int(fields[12])) / tick
            except (IndexError, ValueError):
                continue
            stack.append(kid)
    return out


def _child_pids(pid: int) -> Iterable[int]:
    kids: list[int] = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        txt = _read_text(task)
        if txt:
            kids.extend(int(x) for x in txt.split())
    return kids


class _PeerCountedReader(EnergyReader):
    """Measured source whose energy another process of the node counts (RAPL on local rank > 0): 0 J."""

    kind = MEASURED

    def __init__(self, source: str) -> None:
        self.source = f"{source} (counted by local rank 0)"

    def read_J(self) -> float:
        return 0.0


# ------------------------------------------------------------------------------------------ factory
def open_energy_reader(
    source: str = "auto",
    cuda_index: Optional[int] = None,
    read_rapl: bool = True,
    estimate_watts: float = 10.0,
    estimate_basis: str = "cpu",
    rapl_root: str = DEFAULT_RAPL_ROOT,
    nvml=None,
    cuda_uuid: Optional[str] = None,
) -> tuple[EnergyReader, list[str]]:
    """Open the first available energy source for this process's device.

    Args:
        source: ``"auto"`` (NVML -> RAPL -> estimate), or exactly one of ``"nvml"``, ``"rapl"``,
            ``"estimate"`` (no fallback: an unavailable source raises).
        cuda_index: this rank's CUDA device index, or ``None`` when it trains on CPU (NVML skipped).
        read_rapl: whether this process counts RAPL energy. RAPL covers the whole socket, so only one
            process per node (local rank 0) should; the others get a measured reader that always
            reads 0 J (their energy is in local rank 0's counter), so that summing over ranks is right.
        estimate_watts, estimate_basis: see :class:`EstimateReader`.
        rapl_root: powercap directory.
        nvml: injected ``pynvml`` module (tests).
        cuda_uuid: device UUID for NVML lookup (preferred over the index when given).

    Returns:
        ``(reader, notes)``: the reader and the reasons earlier sources in the order were skipped.

    Raises:
        ValueError: unknown ``source``.
        EnergyUnavailable: an explicitly requested source cannot be opened.
    """
    if source not in SOURCES:
        raise ValueError(f"energy source {source!r}; valid choices: {SOURCES}")
    notes: list[str] = []
    if source in ("auto", "nvml"):
        try:
            if cuda_index is None:
                raise EnergyUnavailable("nvml: this rank does not train on a CUDA device")
            return NvmlReader(cuda_index, nvml=nvml, uuid=cuda_uuid), notes
        except EnergyUnavailable as e:
            if source == "nvml":
                raise
            notes.append(str(e))
    if source in ("auto", "rapl"):
        try:
            reader = RaplReader(rapl_root)
            if not read_rapl:  # counters are readable here, but another rank of this node counts them
                return _PeerCountedReader(reader.source), notes
            return reader, notes
        except EnergyUnavailable as e:
            if source == "rapl":
                raise
            notes.append(str(e))
    return EstimateReader(estimate_watts, estimate_basis), notes
