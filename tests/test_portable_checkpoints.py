"""Checkpoints move between strategies: pipedap's is resumed by ``ddp`` and on one device, and DDP's by pipedap.

Model and data are Lightning's demo classes (``BoringModel``, ``BoringDataModule``); each run is
``tests/faults/portable.py`` in a subprocess (Lightning's launcher, 2 CPU processes).
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent / "faults" / "portable.py"
pytestmark = pytest.mark.multiprocess


def _train(out: Path, strategy: str, devices: int, steps: int, ckpt: Path | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, str(SCRIPT), str(out), strategy, str(devices), str(steps)] + ([str(ckpt)] if ckpt else [])
    proc = subprocess.run(args, cwd=out, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return torch.load(out / "weights.pt", weights_only=True)


def _same(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_checkpoints_move_between_pipedap_ddp_and_one_device(tmp_path):
    w_pipedap = _train(tmp_path / "pipedap", "pipedap", 2, 6)
    w_ddp = _train(tmp_path / "ddp", "ddp", 2, 6)
    assert _same(w_pipedap, w_ddp) < 1e-6  # the same training: the two checkpoints hold the same weights
    pipedap_ckpt, ddp_ckpt = tmp_path / "pipedap" / "last.ckpt", tmp_path / "ddp" / "last.ckpt"
    # resume each checkpoint for 4 more steps under the other strategy, and pipedap's on one device
    ddp_from_pipedap = _train(tmp_path / "ddp_from_pipedap", "ddp", 2, 10, pipedap_ckpt)
    ddp_from_ddp = _train(tmp_path / "ddp_from_ddp", "ddp", 2, 10, ddp_ckpt)
    pipedap_from_ddp = _train(tmp_path / "pipedap_from_ddp", "pipedap", 2, 10, ddp_ckpt)
    one_from_pipedap = _train(tmp_path / "one_from_pipedap", "auto", 1, 10, pipedap_ckpt)
    assert _same(ddp_from_pipedap, ddp_from_ddp) < 1e-6
    assert _same(pipedap_from_ddp, ddp_from_ddp) < 1e-6
    assert _same(ddp_from_ddp, w_ddp) > 1e-4  # (it trained on)
    assert all(torch.isfinite(v).all() for v in one_from_pipedap.values())
    assert _same(one_from_pipedap, w_pipedap) > 1e-4
