"""The replay sleep model trained by Lightning's ``"ddp"`` and by pipedap (``dear``, ``allreduce``) on 2 gloo
ranks; rank 0 writes ``{"ddp_moved": .., "<schedule>": max |param - ddp param|, "<schedule>_updates_in_forward": ..}``.

Run by ``tests/test_bench_replay.py`` on every rank with Lightning's environment variables::

    python -m tests.replay_parity_case OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipedap import PipeDAPStrategy
from lightning_pipedap.bench.matrix.models import REPLAY_MODEL, build_net, make_module

warnings.filterwarnings("ignore")

#: resnet50's 107 layers at 1/1000 of their sizes (about 26 k parameters) and 1/100 of their times
OPTIONS = {"profile": "resnet50", "size_scale": 1e-3, "time_scale": 1e-2, "repaired": True}
STEPS, BATCH = 12, 8
SCHEDULES = ("dear", "allreduce")


def train(strategy) -> dict[str, torch.Tensor]:
    """``STEPS`` steps of the sleep model on ``strategy``; the final parameters."""
    pl.seed_everything(0, verbose=False)
    module = make_module(REPLAY_MODEL, "bench", options=OPTIONS)
    _, _, make_batch = build_net(REPLAY_MODEL, "bench", OPTIONS)
    ds = TensorDataset(*make_batch(2 * BATCH * STEPS, torch.Generator().manual_seed(1)))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, DataLoader(ds, batch_size=BATCH))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| over every tensor (the two state dicts must have the same keys)."""
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    init = {k: v.clone() for k, v in make_module(REPLAY_MODEL, "bench", options=OPTIONS).state_dict().items()}
    ref = train("ddp")
    res = {"ddp_moved": max_diff(ref, init)}
    for sched in SCHEDULES:
        strategy = PipeDAPStrategy(schedule=sched, bucket_cap_mb=0.02)
        res[sched] = max_diff(train(strategy), ref)
        res[f"{sched}_updates_in_forward"] = strategy.update_counts["forward"]
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
