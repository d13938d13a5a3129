"""CUDA/NCCL path of the engine; skipped without a GPU (CI has none)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; CI machines have none")
def test_gpu_check_script():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "scripts" / "gpu_check.py")], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "GPU CHECK OK" in out.stdout
