"""Train Lightning's BoringModel with one strategy, optionally resuming a checkpoint; save weights.

Usage: python portable.py OUT_DIR STRATEGY DEVICES MAX_STEPS [CKPT]. Writes OUT_DIR/last.ckpt (a
ModelCheckpoint with save_last) and OUT_DIR/weights.pt (rank 0's state_dict at the end).
"""

import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

import lightning_pipedap  # noqa: F401

OUT, STRATEGY, DEVICES, MAX_STEPS = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
CKPT = sys.argv[5] if len(sys.argv) > 5 else None

if __name__ == "__main__":
    pl.seed_everything(0)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=OUT, save_last=True, every_n_train_steps=1)
    trainer = pl.Trainer(accelerator="cpu", devices=DEVICES, strategy=STRATEGY, max_steps=MAX_STEPS, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[ckpt],
                         limit_val_batches=0, use_distributed_sampler=False)
    model = BoringModel()
    trainer.fit(model, BoringDataModule(), ckpt_path=CKPT)
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), os.path.join(OUT, "weights.pt"))
