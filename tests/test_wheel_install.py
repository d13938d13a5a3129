"""A built wheel (not an editable install) gives a working ``pipedap-train`` from any directory."""

import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_wheel_carries_the_configs_and_profiles(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("lightning_pipedap-*.whl")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)  # torch, lightning from outside
    py = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(py), "-c", "import lightning_pipedap; print(lightning_pipedap.__file__)"],
                           cwd=elsewhere, capture_output=True, text=True, timeout=120)
    assert str(env_dir) in where.stdout, where.stdout + where.stderr  # the wheel, not the checkout
    job = subprocess.run([str(env_dir / "bin" / "pipedap-train"), "--cfg", "job"], cwd=elsewhere,
                         capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "_target_: lightning_pipedap.PipeDAPStrategy" in job.stdout and "name: optimal" in job.stdout
    cli = subprocess.run([str(env_dir / "bin" / "pipedap-simulate"), "--profile", "resnet50", "--world-size", "4",
                          "--planner", "dear"], cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "dear" in cli.stdout
