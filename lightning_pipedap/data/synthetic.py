"""Seeded random data for throughput benchmarks (no real signal: accuracy stays at chance)."""

from __future__ import annotations

from typing import Optional, Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class _Synthetic(pl.LightningDataModule):
    def __init__(self, num_samples: int, val_samples: int, batch_size: int, seed: int) -> None:
        super().__init__()
        if num_samples < 1 or val_samples < 1 or batch_size < 1:
            raise ValueError(f"num_samples, val_samples, batch_size must be >= 1, "
                             f"got {num_samples}, {val_samples}, {batch_size}")
        self.num_samples = num_samples
        self.val_samples = val_samples
        self.batch_size = batch_size
        self.seed = seed
        self.train_set: Optional[TensorDataset] = None
        self.val_set: Optional[TensorDataset] = None

    def _make(self, n: int, gen: torch.Generator) -> TensorDataset:
        """Build ``n`` samples with ``gen`` (subclasses define it)."""
        raise TypeError(f"{type(self).__name__} is an abstract base: subclasses define _make(n, generator)")

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is None:
            gen = torch.Generator().manual_seed(self.seed)
            self.train_set = self._make(self.num_samples, gen)
            self.val_set = self._make(self.val_samples, gen)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class SyntheticImagesDataModule(_Synthetic):
    """Random images ``(B, *shape)`` float32 ~ N(0, 1) and labels ``(B,)`` int64 uniform in
    ``[0, num_classes)``, from ``torch.Generator().manual_seed(seed)`` (same on every rank).

    Args:
        num_samples, val_samples: sizes of the train and validation sets.
        shape: image shape ``(C, H, W)``.
        num_classes: label range.
        batch_size: per process.
        seed: generator seed.
    """

    def __init__(self, num_samples: int = 1024, val_samples: int = 128, shape: Sequence[int] = (3, 32, 32),
                 num_classes: int = 10, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__(num_samples, val_samples, batch_size, seed)
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError(f"shape must be (C, H, W) with positive sizes, got {list(shape)}")
        self.shape = tuple(int(s) for s in shape)
        self.num_classes = num_classes

    def _make(self, n: int, gen: torch.Generator) -> TensorDataset:
        x = torch.randn((n, *self.shape), generator=gen)
        y = torch.randint(0, self.num_classes, (n,), generator=gen)
        return TensorDataset(x, y)


class SyntheticTokensDataModule(_Synthetic):
    """Random token sequences: ``x`` ``(B, T)`` int64 uniform in ``[0, vocab_size)``, ``y`` = ``x``
    shifted by one (so the batch format matches :class:`StdlibTextDataModule`).

    Args:
        num_samples, val_samples: numbers of sequences.
        block_size: sequence length T.
        vocab_size: token range.
        batch_size: per process.
        seed: generator seed.
    """

    def __init__(self, num_samples: int = 512, val_samples: int = 64, block_size: int = 128,
                 vocab_size: int = 256, batch_size: int = 16, seed: int = 0) -> None:
        super().__init__(num_samples, val_samples, batch_size, seed)
        if block_size < 1 or vocab_size < 1:
            raise ValueError(f"block_size and vocab_size must be >= 1, got {block_size}, {vocab_size}")
        self.block_size = block_size
        self.vocab_size = vocab_size

    def _make(self, n: int, gen: torch.Generator) -> TensorDataset:
        seq = torch.randint(0, self.vocab_size, (n, self.block_size + 1), generator=gen)
        return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())
