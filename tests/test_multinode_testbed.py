"""Multi-node launches on the network-namespace testbed (``lightning_pipedap.testbed``): every "host" is a
network namespace with its own address on a bridge, and its ranks talk to the others over that link
(``GLOO_SOCKET_IFNAME``), as separate machines would.

Each host is launched the way a cluster launches it -- ``torchrun --nnodes 2 --node-rank k --master-addr
<host 0>`` per host, or one process per task with SLURM's variables (``SLURM_NTASKS``, ``SLURM_PROCID``,
``SLURM_NODEID``, ... as ``srun`` sets them and Lightning's ``SLURMEnvironment`` reads them) -- with 2 hosts x 1
process and 2 hosts x 2 processes. Every rank trains the same model under ``ddp`` and under pipedap
(``tests/multinode/parity.py``) and must match DDP to 1e-6, with the schedule installed on every rank.
Needs root (namespaces); skipped with the reason otherwise.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lightning_pipedap.testbed as TB
from tests._dist_util import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "multinode" / "parity.py"
OK, WHY = TB.testbed_available()
pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(not OK, reason=f"no namespace testbed here: {WHY}")]


def _env(tb: TB.Testbed, host: int, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")
           and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    return {**env, "GLOO_SOCKET_IFNAME": f"{tb.prefix}e{host}", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", **extra}


def _wait(procs: list, timeout_s: float = 420.0) -> list[str]:
    deadline, outs = time.monotonic() + timeout_s, []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


def _check(out_dir: Path, hosts: int, per_host: int) -> None:
    ranks = [json.loads((out_dir / f"rank.{r}.json").read_text()) for r in range(hosts * per_host)]
    assert all(r["world"] == hosts * per_host for r in ranks)
    assert sorted(r["node_rank"] for r in ranks) == sorted(h for h in range(hosts) for _ in range(per_host))
    assert all(r["diff"] <= 1e-6 for r in ranks), ranks
    assert len({r["installed"] for r in ranks}) == 1 and ranks[0]["installed"].startswith("dear")  # every rank
    assert all(r["updates_in_forward"] > 0 for r in ranks)  # updates really deferred into the next forward


@pytest.mark.parametrize("per_host", [1, 2])
def test_torchrun_per_host_on_the_testbed(tmp_path, per_host):
    with TB.Testbed(hosts=2, rate=None) as tb:
        port = free_port()
        procs = [subprocess.Popen(
            ["ip", "netns", "exec", tb.ns(h), sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
             f"--node-rank={h}", f"--nproc-per-node={per_host}", f"--master-addr={tb.address(0)}",
             f"--master-port={port}", str(SCRIPT), str(tmp_path)],
            cwd=tmp_path, env=_env(tb, h), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for h in range(2)]
        _wait(procs)
    _check(tmp_path, 2, per_host)


@pytest.mark.parametrize("per_host", [1, 2])
def test_slurm_variables_per_task_on_the_testbed(tmp_path, per_host):
    with TB.Testbed(hosts=2, rate=None) as tb:
        job_id, n = str(free_port()), 2 * per_host
        procs = [subprocess.Popen(
            ["ip", "netns", "exec", tb.ns(h), sys.executable, str(SCRIPT), str(tmp_path)], cwd=tmp_path,
            env=_env(tb, h, SLURM_JOB_ID=job_id, SLURM_JOB_NAME="train", SLURM_NTASKS=str(n),
                     SLURM_NTASKS_PER_NODE=str(per_host), SLURM_NNODES="2", SLURM_NODELIST=tb.address(0),
                     SLURM_PROCID=str(h * per_host + r), SLURM_LOCALID=str(r), SLURM_NODEID=str(h)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for h in range(2) for r in range(per_host)]
        _wait(procs)
    _check(tmp_path, 2, per_host)
