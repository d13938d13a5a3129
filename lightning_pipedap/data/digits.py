"""scikit-learn's handwritten digits (UCI optdigits test set: 1,797 images, 8x8, 10 classes)."""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset


class DigitsDataModule(pl.LightningDataModule):
    """Digits from :func:`sklearn.datasets.load_digits` (bundled with scikit-learn, no download).

    Pixels (0..16) are scaled to [0, 1]. The train/val split is a permutation from
    ``numpy.random.RandomState(split_seed)``, so it is the same on every rank and every run.
    Batches: ``x`` ``(B, 1, 8, 8)`` float32, ``y`` ``(B,)`` int64. Under a distributed strategy
    Lightning adds a ``DistributedSampler``, so ``batch_size`` is per process.

    Args:
        batch_size: samples per batch per process.
        val_fraction: fraction of the 1,797 images held out for validation (0 < f < 1).
        split_seed: seed of the split permutation.
        limit: use only the first ``limit`` images of the permutation (tests); ``None``: all.
        num_workers: DataLoader workers (0 keeps everything in-process).

    Raises:
        ValueError: ``val_fraction`` outside (0, 1), non-positive ``batch_size``, or a ``limit`` that
            leaves an empty split.
    """

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.2, split_seed: int = 0,
                 limit: Optional[int] = None, num_workers: int = 0) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.limit = limit
        self.num_workers = num_workers
        self.train_set: Optional[TensorDataset] = None
        self.val_set: Optional[TensorDataset] = None

    def split_indices(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``(train_idx, val_idx)`` over ``n`` samples (after ``limit``)."""
        perm = np.random.RandomState(self.split_seed).permutation(n)
        if self.limit is not None:
            perm = perm[: self.limit]
        n_val = int(round(len(perm) * self.val_fraction))
        if n_val < 1 or n_val >= len(perm):
            raise ValueError(f"split of {len(perm)} samples with val_fraction={self.val_fraction} leaves an empty set")
        return perm[n_val:], perm[:n_val]

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        from sklearn.datasets import load_digits  # noqa: PLC0415 (import cost only when used)

        data = load_digits()
        x = torch.from_numpy((data.images / 16.0).astype(np.float32)).unsqueeze(1)  # (1797, 1, 8, 8)
        y = torch.from_numpy(data.target.astype(np.int64))
        tr, va = self.split_indices(len(y))
        self.train_set = TensorDataset(x[tr], y[tr])
        self.val_set = TensorDataset(x[va], y[va])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size * 4, num_workers=self.num_workers)
