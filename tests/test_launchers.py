"""Launches other than Lightning's own: torchrun with two nodes, and SLURM's variables (as ``srun`` sets them).

Each runs ``tests/faults/train.py`` (an MLP, ``schedule="dear"``) to the end of its epoch on every rank.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist_util import free_port

SCRIPT = Path(__file__).resolve().parent / "faults" / "train.py"
pytestmark = pytest.mark.multiprocess


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")
           and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    return {**env, **extra}


def _finish(procs: list, tmp_path: Path) -> None:
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, (out + err)[-3000:]
    assert sorted(f.name for f in tmp_path.glob("done.*")) == ["done.0", "done.1"]
    assert (tmp_path / "done.1").read_text() == "10"  # 10 batches of its own, like rank 0


def test_torchrun_two_nodes_one_process_each(tmp_path):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={n}",
                               "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", str(SCRIPT),
                               str(tmp_path), "none", "0", "batches=10", "devices=1", "nodes=2"],
                              cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in range(2)]
    _finish(procs, tmp_path)


def test_slurm_variables_two_tasks_on_one_node(tmp_path):
    job_id = str(free_port())  # Lightning derives MASTER_PORT from the job id
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path), "none", "0", "batches=10"], cwd=tmp_path,
                              env=_env(SLURM_JOB_ID=job_id, SLURM_JOB_NAME="train", SLURM_NTASKS="2",
                                       SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_NODELIST="localhost",
                                       SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NODEID="0"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    _finish(procs, tmp_path)
