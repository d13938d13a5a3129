"""Two models from Lightning's own Fabric examples, written here from their descriptions.

- :class:`MnistNet`: the CNN of ``examples/fabric/image_classifier/train_fabric.py`` in
  Lightning-AI/pytorch-lightning (two 3x3 convolutions 1→32→64, 2x2 max-pool, dropout 0.25, linear
  9216→128, dropout 0.5, linear 128→10, log-softmax; trained there with Adadelta(lr=1.0) and
  StepLR(gamma=0.7) on MNIST).
- :class:`TransformerLM`: the language model of ``examples/fabric/language_model/train.py`` (same
  repository), i.e. ``lightning.pytorch.demos.Transformer``: token embedding scaled by √d, sinusoidal
  positional encoding with dropout, ``nn.Transformer`` (encoder and decoder, causal target mask,
  batch-first), a linear decoder to the vocabulary and log-softmax; trained there with SGD(lr=0.1) and
  ``fabric.clip_gradients(clip_val=0.25)``. Sizes here are smaller (CPU tests).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


class MnistNet(nn.Module):
    """Input ``(B, 1, 28, 28)`` -> log-probabilities ``(B, 10)``."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(),
                                      nn.MaxPool2d(2), nn.Dropout(0.25))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 12 * 12, 128), nn.ReLU(), nn.Dropout(0.5),
                                  nn.Linear(128, 10))

    def forward(self, x: Tensor) -> Tensor:
        return F.log_softmax(self.head(self.features(x)), dim=1)


class SinusoidalPositions(nn.Module):
    """Adds ``sin``/``cos`` position codes to ``(B, T, D)`` and applies dropout."""

    def __init__(self, dim: int, dropout: float, max_len: int = 512) -> None:
        super().__init__()
        pos = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
        freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
        table = torch.zeros(max_len, dim)
        table[:, 0::2] = torch.sin(pos * freq)
        table[:, 1::2] = torch.cos(pos * freq)
        self.register_buffer("table", table, persistent=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(x + self.table[: x.size(1)])


class TransformerLM(nn.Module):
    """``forward(inputs, target)``: token ids ``(B, T)`` each -> log-probabilities ``(B·T, vocab)``."""

    def __init__(self, vocab_size: int = 256, dim: int = 64, heads: int = 2, ff: int = 128, layers: int = 2,
                 dropout: float = 0.2) -> None:
        super().__init__()
        self.dim, self.vocab_size = dim, vocab_size
        self.embedding = nn.Embedding(vocab_size, dim)
        self.positions = SinusoidalPositions(dim, dropout)
        self.transformer = nn.Transformer(d_model=dim, nhead=heads, num_encoder_layers=layers,
                                          num_decoder_layers=layers, dim_feedforward=ff, dropout=dropout,
                                          batch_first=True)
        self.decoder = nn.Linear(dim, vocab_size)

    def forward(self, inputs: Tensor, target: Tensor) -> Tensor:
        t = inputs.size(1)
        causal = torch.triu(torch.full((t, t), float("-inf"), device=inputs.device), diagonal=1)
        src = self.positions(self.embedding(inputs) * math.sqrt(self.dim))
        tgt = self.positions(self.embedding(target) * math.sqrt(self.dim))
        out = self.decoder(self.transformer(src, tgt, tgt_mask=causal))
        return F.log_softmax(out, dim=-1).reshape(-1, self.vocab_size)
