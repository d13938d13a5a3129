"""Energy readers: NVML (fake module), RAPL (fake sysfs tree, wrap-around), estimate, source order."""

from __future__ import annotations

import os
import types

import pytest

from lightning_pipedap.measure.energy import (
    ESTIMATED,
    MEASURED,
    EnergyUnavailable,
    EstimateReader,
    NvmlReader,
    RaplReader,
    open_energy_reader,
    rapl_delta_uj,
)


def fake_nvml(readings_mJ, fail_init=False):
    """A stand-in for ``pynvml``: the energy counter returns ``readings_mJ`` one after the other."""
    calls = {"handles": [], "shutdown": 0}
    it = iter(readings_mJ)

    def init():
        if fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    mod = types.SimpleNamespace(
        nvmlInit=init,
        nvmlShutdown=lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1),
        nvmlDeviceGetHandleByIndex=lambda i: calls["handles"].append(("index", i)) or f"h{i}",
        nvmlDeviceGetHandleByUUID=lambda u: calls["handles"].append(("uuid", u)) or f"h{u}",
        nvmlDeviceGetTotalEnergyConsumption=lambda h: next(it),
    )
    return mod, calls


def write_zone(path, name, energy_uj, max_uj):
    os.makedirs(path, exist_ok=True)
    for fname, value in (("name", name), ("energy_uj", energy_uj), ("max_energy_range_uj", max_uj)):
        with open(os.path.join(path, fname), "w") as f:
            f.write(f"{value}\n")


def set_energy(path, energy_uj):
    with open(os.path.join(path, "energy_uj"), "w") as f:
        f.write(f"{energy_uj}\n")


# ---------------------------------------------------------------------------------------- NVML
def test_nvml_reader_converts_mJ_to_J_from_first_reading(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml, calls = fake_nvml([1_000_000, 1_000_500, 1_003_250])
    r = NvmlReader(0, nvml=nvml)
    assert (r.kind, r.source) == (MEASURED, "nvml:gpu0")
    assert r.read_J() == pytest.approx(0.5)
    assert r.read_J() == pytest.approx(3.25)
    r.close()
    r.close()
    assert calls["shutdown"] == 1


def test_nvml_reader_maps_index_through_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    nvml, calls = fake_nvml([0, 0])
    NvmlReader(1, nvml=nvml)
    assert calls["handles"] == [("index", 5)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    nvml, calls = fake_nvml([0])
    NvmlReader(1, nvml=nvml)
    assert calls["handles"] == [("uuid", "GPU-bbbb")]


def test_nvml_without_driver_is_unavailable_and_auto_falls_back(tmp_path):
    nvml, _ = fake_nvml([], fail_init=True)
    with pytest.raises(EnergyUnavailable, match="nvmlInit failed"):
        NvmlReader(0, nvml=nvml)
    with pytest.raises(EnergyUnavailable, match="nvmlInit"):
        open_energy_reader("nvml", cuda_index=0, nvml=nvml)
    reader, notes = open_energy_reader("auto", cuda_index=0, nvml=nvml, rapl_root=str(tmp_path))
    assert reader.kind == ESTIMATED
    assert notes[0].startswith("nvml: nvmlInit failed") and notes[1].startswith("rapl: no readable package zone")


def test_source_order_prefers_nvml_then_rapl(tmp_path):
    write_zone(tmp_path / "intel-rapl:0", "package-0", 10, 1000)
    nvml, _ = fake_nvml([7, 7])
    assert open_energy_reader("auto", cuda_index=0, nvml=nvml, rapl_root=str(tmp_path))[0].source == "nvml:gpu0"
    # a CPU rank never uses NVML
    reader, notes = open_energy_reader("auto", cuda_index=None, nvml=nvml, rapl_root=str(tmp_path))
    assert reader.source == "rapl:package-0" and "does not train on a CUDA device" in notes[0]


def test_unknown_source_is_rejected():
    with pytest.raises(ValueError, match=r"'gpu'.*valid choices.*nvml"):
        open_energy_reader("gpu")


# ---------------------------------------------------------------------------------------- RAPL
def test_rapl_delta_handles_wrap_around():
    assert rapl_delta_uj(100, 250, 1000) == 150
    assert rapl_delta_uj(900, 100, 1000) == 200  # 900 -> 1000 (wrap) -> 100
    assert rapl_delta_uj(500, 500, 1000) == 0
    with pytest.raises(ValueError, match="cur_uj=1001"):
        rapl_delta_uj(0, 1001, 1000)


def test_rapl_reader_on_fake_sysfs_sums_packages_and_dram_and_unwraps(tmp_path):
    pkg0, pkg1 = tmp_path / "intel-rapl:0", tmp_path / "intel-rapl:1"
    write_zone(pkg0, "package-0", 8_000_000, 10_000_000)
    write_zone(tmp_path / "intel-rapl:0:0", "core", 5, 10_000_000)  # inside the package: skipped
    write_zone(tmp_path / "intel-rapl:0:1", "dram", 1_000_000, 65_000_000)
    write_zone(pkg1, "package-1", 0, 10_000_000)
    write_zone(tmp_path / "intel-rapl:2", "psys", 3, 10_000_000)  # overlaps the packages: skipped
    r = RaplReader(str(tmp_path))
    assert r.kind == MEASURED
    assert r.source == "rapl:package-0+package-0/dram+package-1"
    assert r.read_J() == 0.0
    set_energy(pkg0, 1_000_000)  # wrapped: +3 J
    set_energy(tmp_path / "intel-rapl:0:1", 1_500_000)  # +0.5 J
    set_energy(pkg1, 2_000_000)  # +2 J
    assert r.read_J() == pytest.approx(5.5)
    set_energy(pkg0, 9_000_000)  # +8 J, no wrap
    set_energy(tmp_path / "intel-rapl:0:0", 7)  # ignored
    assert r.read_J() == pytest.approx(13.5)
    set_energy(pkg0, 500_000)  # wrapped again: +1.5 J
    assert r.read_J() == pytest.approx(15.0)


def test_rapl_without_dram_and_unreadable_counter(tmp_path):
    write_zone(tmp_path / "intel-rapl:0", "package-0", 10, 1000)
    write_zone(tmp_path / "intel-rapl:0:1", "dram", 10, 1000)
    assert RaplReader(str(tmp_path), include_dram=False).source == "rapl:package-0"
    os.remove(tmp_path / "intel-rapl:0" / "energy_uj")  # what a non-root user sees as unreadable
    with pytest.raises(EnergyUnavailable, match="cannot read .*intel-rapl:0/energy_uj"):
        RaplReader(str(tmp_path))


def test_rapl_on_other_local_ranks_counts_zero(tmp_path):
    write_zone(tmp_path / "intel-rapl:0", "package-0", 10, 1000)
    reader, _ = open_energy_reader("auto", cuda_index=None, read_rapl=False, rapl_root=str(tmp_path))
    set_energy(tmp_path / "intel-rapl:0", 500)
    assert reader.kind == MEASURED and reader.read_J() == 0.0
    assert "counted by local rank 0" in reader.source


# ------------------------------------------------------------------------------------ estimate
def test_estimate_is_watts_times_busy_seconds():
    t = [2.0]
    r = EstimateReader(10.0, basis="cpu", cpu_clock=lambda: t[0])
    assert r.kind == ESTIMATED and r.source == "estimate:10W x cpu_s"
    t[0] = 5.5
    assert r.read_J() == pytest.approx(35.0)
    w = EstimateReader(150.0, basis="wall", clock=lambda: t[0])
    t[0] = 6.0
    assert w.read_J() == pytest.approx(75.0)


def test_estimate_cpu_basis_counts_this_process():
    r = EstimateReader(1.0, basis="cpu")
    x = 0
    for i in range(300_000):  # burn some CPU
        x += i * i
    assert r.read_J() > 0.0


def test_estimate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="watts=0"):
        EstimateReader(0)
    with pytest.raises(ValueError, match=r"basis='tdp'.*valid choices"):
        EstimateReader(5.0, basis="tdp")


def test_machine_without_counters_gets_estimate(tmp_path):
    reader, notes = open_energy_reader("auto", cuda_index=None, rapl_root=str(tmp_path / "no_powercap"))
    assert reader.kind == ESTIMATED and len(notes) == 2
    with pytest.raises(EnergyUnavailable, match="rapl"):
        open_energy_reader("rapl", rapl_root=str(tmp_path / "no_powercap"))
