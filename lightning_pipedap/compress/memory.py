"""Error-feedback memory per bucket.

Error feedback (a.k.a. memory / residual accumulation) adds what the previous compression dropped
back into the next gradient before compressing it:

    corrected_t = grad_t + residual_{t-1}
    payload_t   = C(corrected_t)
    residual_t  = corrected_t - D(payload_t)         (D = decompression of this rank's own payload)

Sources: Seide et al., "1-Bit Stochastic Gradient Descent and its Application to Data-Parallel
Distributed Training of Speech DNNs", Interspeech 2014; Stich, Cordonnier, Jaggi, "Sparsified SGD
with Memory", NeurIPS 2018; Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
Compression Schemes", ICML 2019 (Algorithm 2). The residual lives in :class:`~.base.BucketState`
(one ``[n]`` fp32 buffer per bucket, allocated on first use) and is saved in checkpoints.
"""

from __future__ import annotations

import torch

from lightning_pipedap.compress.base import BucketState


def compensate(grad: torch.Tensor, state: BucketState, enabled: bool = True) -> torch.Tensor:
    """Corrected gradient ``grad + residual``, ``[n]``, computed in the residual buffer itself.

    The returned tensor *is* ``state.residual`` (allocated as a copy of ``grad`` on first use), so
    the compressor must read what it needs from it before calling :func:`update_dense` or
    :func:`update_sparse`, which turn it into the new residual in place. ``grad`` is never modified.
    With ``enabled=False`` returns ``grad`` itself and leaves the state alone.
    """
    if not enabled:
        return grad
    if state.residual is None:
        state.residual = grad.detach().clone()
    else:
        state.residual.add_(grad)
    return state.residual


def update_dense(state: BucketState, corrected: torch.Tensor, approx: torch.Tensor) -> None:
    """``residual = corrected - approx`` (``approx``: decompression of this rank's own payload, ``[n]``)."""
    if state.residual is None:
        state.residual = corrected - approx
    else:
        torch.sub(corrected, approx, out=state.residual)


def update_sparse(state: BucketState, corrected: torch.Tensor, sent_indices: torch.Tensor) -> None:
    """``residual = corrected`` with the sent positions zeroed (sparsifiers that send exact values).

    Args:
        state: the bucket's state; its residual is overwritten.
        corrected: ``[n]`` corrected gradient (usually the residual buffer itself, from :func:`compensate`).
        sent_indices: int64 ``[k]`` positions whose exact values were sent (duplicates allowed).
    """
    if state.residual is None:
        state.residual = corrected.clone()
    elif state.residual.data_ptr() != corrected.data_ptr():
        state.residual.copy_(corrected)
    state.residual.index_fill_(0, sent_indices, 0.0)
