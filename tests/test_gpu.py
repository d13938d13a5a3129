"""``scripts/gpu_check.py``: the prepared device check. CI has no GPU, so it runs the script's SKIP mode and its dry
run (``--device cpu``: the same check functions on CPU/gloo, small), which keeps the script from rotting; the full
check runs only where a CUDA device is (docs/gpu_check.md)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_check  # noqa: E402  (the script's check list; importing it runs nothing)


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=str(ROOT))


@pytest.mark.skipif(torch.cuda.is_available(), reason="SKIP mode is for machines without CUDA")
def test_without_a_gpu_every_check_prints_skip_and_exits_0():
    out = _run()
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == len(gpu_check.ALL_CHECKS) + 1 and all(" SKIP " in ln for ln in lines[:-1]), out.stdout
    assert lines[-1].startswith("GPU CHECK SKIPPED")


def test_unknown_check_is_refused_naming_the_valid_ones():
    out = _run("--only", "parity_fp32,nope")
    assert out.returncode == 2 and "['nope']" in out.stderr and "parity_fp32" in out.stderr


@pytest.mark.multiprocess
def test_dry_run_on_cpu_runs_every_check():
    """Every check function on CPU/gloo (2 ranks and 1 rank); compression on CUDA is the documented refusal."""
    out = _run("--device", "cpu")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln and not ln.startswith(("device", "GPU"))]
    status = {ln.split()[0]: ln.split()[1] for ln in lines}
    assert status.pop("compression") == "EXPECTED", out.stdout
    assert set(status.values()) == {"PASS"} and len(status) == len(gpu_check.ALL_CHECKS) - 1, out.stdout
    assert "GPU CHECK OK" in out.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; CI machines have none")
def test_gpu_check_script():
    out = _run(timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "GPU CHECK OK" in out.stdout
