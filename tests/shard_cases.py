"""What user code sees under ``shard_optimizer=True`` in a real fit (``tests/test_shard_step.py`` starts 2 ranks).

One launch, two fits of the same seeded MLP with Adam (``ddp``, then pipedap ``dear`` with ``shard_optimizer``).
``training_step`` reads, at steps 3 and 6, the previous step's ``.grad`` of the first layer (the guard all-gathers
it: DDP's averaged gradient) and tries ``optimizer.state[p]`` and ``optimizer.state_dict()`` (a sharded fit raises
``ShardedStateError`` naming the parameter). A callback at the last step reads the rank's state bytes and
``trainer.strategy.optimizer_state`` (the whole state on rank 0, ``{}`` elsewhere). A StepLR scheduler steps every
step; the warnings torch's schedulers give are kept (none, as under DDP). Rank 0 writes the results.

Run as a script on every rank: ``python -m tests.shard_cases OUT.json``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipedap import PipeDAPStrategy

RANK = int(os.environ.get("RANK", "0"))
STEPS = 8


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 3))
        self.grads: list[list[float]] = []
        self.errors: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        w = self.net[0].weight
        opt = self.optimizers().optimizer
        if self.global_step in (3, 6):
            self.grads.append(w.grad.detach().reshape(-1).tolist())
            for read in (lambda: opt.state[w], lambda: opt.state_dict()):
                try:
                    read()
                except RuntimeError as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class LastStep(pl.Callback):
    """At the last step's start: the state bytes this rank holds and the state dict the strategy gives."""

    pipedap_reads_model = False  # (reads no parameter; optimizer_state applies pending updates itself)

    def __init__(self) -> None:
        self.nbytes = None
        self.max_nbytes = 0
        self.state_keys: list[int] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        opt = trainer.optimizers[0]
        nbytes = getattr(trainer.strategy, "optimizer_state_nbytes", None)
        now = nbytes(opt) if nbytes else sum(v.numel() * v.element_size() for s in opt.state.values()
                                             for v in s.values() if torch.is_tensor(v))
        self.max_nbytes = max(self.max_nbytes, now)  # (the start-up's sync steps included)
        if trainer.global_step == STEPS - 1:
            self.nbytes = now
            self.state_keys = sorted(trainer.strategy.optimizer_state(opt).get("state", {}))


def fit(strategy: Any) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1 + RANK)
    data = TensorDataset(torch.randn(8 * STEPS, 12, generator=g), torch.randint(0, 3, (8 * STEPS,), generator=g))
    model, cb = Net(), LastStep()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[cb])
    with warnings.catch_warnings(record=True) as seen:  # (torch's "lr_scheduler.step() before optimizer.step()")
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(data, batch_size=8))
    opt = trainer.optimizers[0]
    return {"grads": model.grads, "errors": model.errors, "nbytes": cb.nbytes, "max_nbytes": cb.max_nbytes,
            "state_keys": cb.state_keys,
            "scheduler_warnings": [str(w.message)[:80] for w in seen if "lr_scheduler.step()" in str(w.message)],
            "after_fit": {str(i): {k: str(v.device) for k, v in st.items() if torch.is_tensor(v)}
                          for i, st in enumerate(opt.state.values())},
            "params": [p.detach().reshape(-1).tolist() for p in model.parameters()]}


def main(out: str) -> None:
    torch.set_num_threads(1)
    res = {"ddp": fit("ddp"),
           "shard": fit(PipeDAPStrategy(schedule="dear", bucket_cap_mb=0.002, shard_optimizer=True))}
    if RANK == 0:
        with open(out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
