"""Small transformers: a GPT-style decoder (in the spirit of nanoGPT) and a BERT-style encoder.

Both use pre-LayerNorm blocks (attention + 4x MLP), learned position embeddings and an output head
tied to the token embedding (Press & Wolf, 2017), so they also exercise tied parameters.
GPT: causal self-attention, next-token prediction (Radford et al., 2019).
BERT: bidirectional self-attention and a masked-LM head (Devlin et al., NAACL 2019).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SelfAttention(nn.Module):
    """Multi-head self-attention. ``(B, T, C) -> (B, T, C)``; causal when ``causal=True``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, causal: bool) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_head = n_head
        self.causal = causal
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))  # (B, h, T, d)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=self.causal
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``. ``(B, T, C) -> (B, T, C)``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, causal: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = SelfAttention(n_embd, n_head, dropout, causal)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _Transformer(nn.Module):
    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float, causal: bool
    ) -> None:
        super().__init__()
        for name, v in (("vocab_size", vocab_size), ("block_size", block_size), ("n_layer", n_layer),
                        ("n_head", n_head), ("n_embd", n_embd)):
            if v < 1:
                raise ValueError(f"{type(self).__name__}: {name} must be >= 1, got {v}")
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, causal) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids ``(B, T)`` (int64, ``T <= block_size``) -> logits ``(B, T, vocab_size)``.

        Raises:
            ValueError: ``T > block_size``.
        """
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class GPT(_Transformer):
    """GPT-style decoder-only transformer with causal attention.

    Args:
        vocab_size: token vocabulary (256 for the byte-level stdlib corpus).
        block_size: maximum context length T.
        n_layer, n_head, n_embd: depth, heads, embedding width (``n_embd % n_head == 0``).
        dropout: dropout probability.

    Shapes: ``(B, T)`` token ids -> ``(B, T, vocab_size)`` next-token logits.
    """

    def __init__(self, vocab_size: int = 256, block_size: int = 128, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0) -> None:
        super().__init__(vocab_size, block_size, n_layer, n_head, n_embd, dropout, causal=True)


class BERT(_Transformer):
    """BERT-style encoder with bidirectional attention and a tied masked-LM head.

    Args:
        vocab_size: token vocabulary including the ``[MASK]`` id (257 = 256 bytes + mask).
        block_size, n_layer, n_head, n_embd, dropout: as for :class:`GPT`.

    Shapes: ``(B, T)`` token ids -> ``(B, T, vocab_size)`` logits for every position.
    """

    def __init__(self, vocab_size: int = 257, block_size: int = 128, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.1) -> None:
        super().__init__(vocab_size, block_size, n_layer, n_head, n_embd, dropout, causal=False)
