"""One rank of a multi-node parity run (tests/test_multinode_testbed.py): the same model trained with
``strategy="ddp"`` and with ``PipeDAPStrategy(schedule="dear")``, one after the other in this process.

Usage: ``python parity.py OUT_DIR`` under ``torchrun --nnodes N ...`` or with SLURM's variables; each rank
writes ``OUT_DIR/rank.<global rank>.json`` with the largest |pipedap - ddp| parameter difference, the
schedule it installed, its node rank and the world size.
"""

import json
import os
import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_pipedap  # noqa: F401
from lightning_pipedap import PipeDAPStrategy

OUT = sys.argv[1]
PER_NODE = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or 1)
NODES = int(os.environ.get("SLURM_NNODES") or int(os.environ["WORLD_SIZE"]) // PER_NODE)


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                       torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def fit(strategy):
    pl.seed_everything(0, verbose=False)
    model = Net()
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(512, 16, generator=g), torch.randint(0, 4, (512,), generator=g))
    trainer = pl.Trainer(accelerator="cpu", devices=PER_NODE, num_nodes=NODES, strategy=strategy, max_steps=12,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True))
    return trainer, {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    torch.set_num_threads(1)
    _, ref = fit("ddp")
    st = PipeDAPStrategy(schedule="dear", bucket_cap_mb=0.002, wait_timeout_s=60)
    trainer, out = fit(st)
    diff = max(float((out[k] - ref[k]).abs().max()) for k in ref)
    with open(os.path.join(OUT, f"rank.{trainer.global_rank}.json"), "w") as f:
        json.dump({"diff": diff, "installed": st.installed_schedule, "node_rank": trainer.node_rank,
                   "world": trainer.world_size, "updates_in_forward": st.update_counts["forward"]}, f)


if __name__ == "__main__":
    main()
