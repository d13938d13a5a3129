"""Train a small CNN on scikit-learn's digits with strategy="pipedap" on 2 CPU processes (no Hydra).

    python examples/train_digits.py                   # pipedap, schedule optimal
    python examples/train_digits.py --strategy ddp    # the DDP baseline, for comparison
    python examples/train_digits.py --schedule allreduce

The digits (1,797 real 8x8 images) ship with scikit-learn, so nothing is downloaded. Lightning
starts rank 1 by running this script again with the same arguments. Expected: val/acc >= 0.95
after 8 epochs, the same as with --strategy ddp.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl

import lightning_pipedap  # registers "pipedap" and "pipedap_spawn" with Lightning
from lightning_pipedap.data import DigitsDataModule
from lightning_pipedap.models import DigitsCNN, ImageClassifier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("pipedap", "ddp"), default="pipedap")
    schedules = ", ".join(lightning_pipedap.valid_schedule_names())
    parser.add_argument("--schedule", default="optimal", help=f"pipedap schedule: {schedules}")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()

    pl.seed_everything(42, workers=True, verbose=False)
    datamodule = DigitsDataModule(batch_size=32)
    model = ImageClassifier(DigitsCNN(), num_classes=10, lr=3e-3)
    strategy = lightning_pipedap.PipeDAPStrategy(schedule=args.schedule) if args.strategy == "pipedap" else "ddp"
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.epochs,
        num_sanity_val_steps=0,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        default_root_dir="logs/examples",
    )
    trainer.fit(model, datamodule=datamodule)
    if trainer.is_global_zero:
        acc = float(trainer.callback_metrics["val/acc"])
        print(f"{args.strategy}{'/' + args.schedule if args.strategy == 'pipedap' else ''}: val/acc = {acc:.4f}")


if __name__ == "__main__":
    main()
