"""Multi-process training under Hydra: what the app does so that ``-m`` sweeps just work.

Lightning's default launcher for ``ddp`` (``start_method="popen"``) starts ranks 1..N-1 by running
``sys.argv`` again (``lightning/fabric/strategies/launchers/subprocess_script.py``,
``_hydra_subprocess_cmd``). Under Hydra multirun that copies ``-m`` and the sweep lists into the
child command: with ``-m`` last the child exits at once and rank 0 hangs in the rendezvous; with
``-m`` first every child runs its own copy of the whole sweep (Lightning #11300, Hydra #2070). And
rank 0 keeps ``LOCAL_RANK``/``MASTER_PORT`` in ``os.environ`` after a job, so the next job of the
sweep believes it was started by an external launcher and creates no ranks.

The app therefore

1. under multirun, switches the strategy to ``start_method="spawn"`` (ranks are
   ``torch.multiprocessing`` children that receive the already-built trainer, model and data, and
   never see ``sys.argv``); in a single run the popen launcher is kept, which handles Hydra
   correctly there (it passes ``hydra.run.dir`` to the children);
2. gives every job a free ``MASTER_PORT`` and restores the distributed environment variables
   after the job (:func:`distributed_env`), unless they were set by an external launcher
   (SLURM, torchrun), which is left alone.
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from typing import Any, Iterator, Optional

#: Variables Lightning and torch.distributed read or write to wire up a job's ranks.
DIST_ENV_VARS = (
    "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "GLOBAL_RANK",
    "WORLD_SIZE", "LOCAL_WORLD_SIZE", "PL_GLOBAL_SEED", "PL_SEED_WORKERS",
)


def in_multirun() -> bool:
    """Whether the current Hydra job is part of a multirun (``-m`` or ``hydra.mode=MULTIRUN``)."""
    from hydra.core.hydra_config import HydraConfig  # noqa: PLC0415
    from hydra.types import RunMode  # noqa: PLC0415

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def externally_launched() -> bool:
    """Whether this process was started as one rank by an outside launcher (torchrun, SLURM tasks,
    or Lightning's popen launcher for ranks > 0): then it must not start processes itself."""
    return "LOCAL_RANK" in os.environ or ("SLURM_NTASKS" in os.environ and "SLURM_JOB_NAME" in os.environ
                                          and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"))


def start_method_for(requested: Optional[str], multirun: bool) -> Optional[str]:
    """The launcher start method to use: ``"spawn"`` instead of ``"popen"`` under multirun.

    ``None`` (a strategy without that argument) stays ``None``; ``fork``/``forkserver`` are kept.
    """
    if multirun and requested == "popen":
        return "spawn"
    return requested


def named_strategy_for(name: str, multirun: bool) -> str:
    """A registry name to use under multirun: ``"<name>_spawn"`` when Lightning registers it
    (``ddp`` -> ``ddp_spawn``, ``pipedap`` -> ``pipedap_spawn``), else ``name``."""
    if not multirun:
        return name
    from lightning.pytorch.strategies import StrategyRegistry  # noqa: PLC0415

    spawn = f"{name}_spawn"
    return spawn if spawn in StrategyRegistry.available_strategies() else name


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bound to port 0 and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextmanager
def distributed_env(fresh_port: bool = True) -> Iterator[dict[str, Any]]:
    """Run one job with a clean distributed environment, and restore it afterwards.

    On entry, when this process launches the ranks itself (no ``LOCAL_RANK`` and no external
    ``MASTER_PORT``), sets ``MASTER_PORT`` to a free port so consecutive or concurrent jobs never
    reuse one still in ``TIME_WAIT``. On exit (also after an exception), every variable of
    :data:`DIST_ENV_VARS` gets back the value it had on entry, or is removed if it had none.

    Yields:
        a dict ``{"master_port": int or None}`` describing what was set.
    """
    saved = {k: os.environ.get(k) for k in DIST_ENV_VARS}
    info: dict[str, Any] = {"master_port": None}
    if fresh_port and saved["MASTER_PORT"] is None and not externally_launched():
        port = free_port()
        os.environ["MASTER_PORT"] = str(port)
        info["master_port"] = port
    try:
        yield info
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
