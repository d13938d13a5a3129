"""Train a small CNN on scikit-learn's digits with Lightning Fabric and strategy="pipedap" (2 CPU processes).

    python examples/fabric_train.py                     # pipedap, schedule dear
    python examples/fabric_train.py --strategy ddp      # Fabric's DDP, for comparison
    python examples/fabric_train.py --schedule optimal  # planned schedule (a few profiling steps first)

The loop is Fabric's usual one: ``fabric.setup``, ``fabric.backward``, ``fabric.no_backward_sync``
for gradient accumulation, ``fabric.clip_gradients`` and ``fabric.save``. Fabric starts rank 1 by
running this script again with the same arguments. The digits (1,797 real 8x8 images) ship with
scikit-learn; nothing is downloaded. Expected (about 20 s): val acc >= 0.9 after 4 epochs, the
same as with ``--strategy ddp``.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric, seed_everything
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import lightning_pipedap  # registers "pipedap" and "pipedap_spawn" with Fabric (and the Trainer)
from lightning_pipedap.models import DigitsCNN


def digits(val_fraction: float = 0.2) -> tuple[TensorDataset, TensorDataset]:
    """Train and validation sets: ``x`` ``(N, 1, 8, 8)`` float32 in [0, 1], ``y`` ``(N,)`` int64."""
    data = load_digits()
    x = torch.from_numpy((data.images / 16.0).astype(np.float32)).unsqueeze(1)
    y = torch.from_numpy(data.target.astype(np.int64))
    perm = torch.from_numpy(np.random.RandomState(0).permutation(len(y)))
    n_val = int(len(y) * val_fraction)
    return TensorDataset(x[perm[n_val:]], y[perm[n_val:]]), TensorDataset(x[perm[:n_val]], y[perm[:n_val]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("pipedap", "ddp"), default="pipedap")
    parser.add_argument("--schedule", default="dear", help="pipedap schedule: "
                        + ", ".join(lightning_pipedap.valid_schedule_names()))
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--checkpoint", default=os.path.join("logs", "examples", "fabric_digits.ckpt"))
    args = parser.parse_args()

    strategy = (lightning_pipedap.PipeDAPFabricStrategy(schedule=args.schedule) if args.strategy == "pipedap"
                else "ddp")
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    seed_everything(42, verbose=False)

    train_set, val_set = digits()
    train_loader, val_loader = fabric.setup_dataloaders(DataLoader(train_set, batch_size=16, shuffle=True),
                                                        DataLoader(val_set, batch_size=128))
    model = DigitsCNN()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)

    for epoch in range(args.epochs):
        model.train()
        for i, (x, y) in enumerate(train_loader):
            last = (i + 1) % args.accumulate == 0 or i + 1 == len(train_loader)
            with fabric.no_backward_sync(model, enabled=not last):  # micro-batches: no communication
                loss = F.cross_entropy(model(x), y) / args.accumulate
                fabric.backward(loss)  # the last micro-batch returns with averaged gradients in .grad
            if last:
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
                optimizer.zero_grad()
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in val_loader:
                correct += int((model(x).argmax(1) == y).sum())
                total += len(y)
        acc = fabric.all_reduce(torch.tensor(correct / total), reduce_op="mean")
        fabric.print(f"epoch {epoch}: val acc {float(acc):.4f}")

    fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "epoch": args.epochs})
    if args.strategy == "pipedap":
        fabric.print(f"pipedap: installed schedule {fabric.strategy.installed_schedule[:120]}")
    fabric.print(f"{args.strategy}: final val acc {float(acc):.4f}, checkpoint {args.checkpoint}")


if __name__ == "__main__":
    main()
