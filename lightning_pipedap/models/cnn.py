"""A small CNN for scikit-learn's 8x8 handwritten digits."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class DigitsCNN(nn.Module):
    """Two 3x3 conv layers, one 2x2 max-pool, two linear layers (about 40 k parameters).

    Shapes: input ``(B, 1, 8, 8)`` (pixel values scaled to [0, 1]) -> logits ``(B, num_classes)``.

    Args:
        num_classes: output classes (10 digits).
        channels: channels of the two conv layers; the second has twice as many.
        hidden: width of the hidden linear layer.
        dropout: dropout probability before the last layer.

    Raises:
        ValueError: a non-positive size or a dropout outside [0, 1).
    """

    def __init__(self, num_classes: int = 10, channels: int = 16, hidden: int = 64, dropout: float = 0.1) -> None:
        super().__init__()
        for name, v in (("num_classes", num_classes), ("channels", channels), ("hidden", hidden)):
            if v < 1:
                raise ValueError(f"DigitsCNN: {name} must be >= 1, got {v}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"DigitsCNN: dropout must be in [0, 1), got {dropout}")
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * channels * 4 * 4, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        """``(B, 1, 8, 8)`` -> ``(B, num_classes)`` logits."""
        if x.dim() != 4 or x.shape[1:] != torch.Size([1, 8, 8]):
            raise ValueError(f"DigitsCNN expects input of shape (B, 1, 8, 8), got {tuple(x.shape)}")
        return self.classifier(self.features(x))
