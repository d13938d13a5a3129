"""Parameters with sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``), reduced as
DDP reduces them, outside the dense buckets.

A sparse gradient has no fixed size (its rows are the tokens of the batch), so it cannot sit in a flat bucket
or be reduce-scattered. DDP's reducer (``torch/csrc/distributed/c10d/reducer.cpp``) gives each such parameter a
bucket of its own, divides the gradient by the world size and calls the process group's all-reduce on the sparse
tensor; gloo all-gathers every rank's indices and values, adds them in rank order and coalesces. The
:class:`SparseGradReducer` makes the same call on the same tensor
(:func:`~lightning_pipedap.engine.collectives.start_sparse_all_reduce`), so the averaged gradients are DDP's, bit
for bit, at any world size.

Where it runs: on a process group of its own (created at set-up on every rank, in the same order), from the
training thread at the end of a communicating backward, in registration order on every rank. Not on the
engine's group: its worker thread issues the bucket ops on that group whenever buckets fill, and gloo pairs
collectives by their order on a group, so a second thread issuing on it would interleave differently on each
rank. Not through the worker's queue either: the worker runs a round's op list, waiting for each bucket in turn;
a sparse op queued there would wait behind every dense bucket and could only start when the last one is done.
On its own group the sparse all-reduces start as soon as backward ends and run while the training thread waits
for the engine's last buckets.

Unused parameters: a rank whose backward gave a parameter no gradient contributes an empty sparse tensor (the
result is what DDP computes when that rank's embedding looks up no row); a parameter no rank has a gradient for
keeps ``.grad`` None (not stepped), as pipedap and DDP do for dense parameters. DDP itself raises "Expected
sparse gradient to be defined." in both cases. One small flags all-reduce per step tells every rank which
parameters have a gradient somewhere.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from lightning_pipedap import compat
from lightning_pipedap.engine import collectives as C

__all__ = ["SparseGradReducer", "empty_sparse_like", "sparse_gradient_params"]


def sparse_gradient_params(module: torch.nn.Module) -> dict[int, str]:
    """``id(parameter) -> its module's type name`` for the parameters whose gradient is sparse: the ``weight`` of
    every ``nn.Embedding`` / ``nn.EmbeddingBag`` built with ``sparse=True`` (frozen or not)."""
    return {id(m.weight): f"{type(m).__name__}(sparse=True)" for m in module.modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}


def empty_sparse_like(p: Tensor, sparse_dim: int = 1) -> Tensor:
    """A sparse COO tensor of ``p``'s shape, dtype and device holding no element: what a rank without a gradient
    contributes (``sparse_dim`` 1: rows of an embedding table, as ``nn.Embedding`` / ``nn.EmbeddingBag`` give;
    every rank's tensor must have the same sparse and dense dimensions)."""
    return torch.sparse_coo_tensor(torch.empty(sparse_dim, 0, dtype=torch.long, device=p.device),
                                   torch.empty(0, *p.shape[sparse_dim:], dtype=p.dtype, device=p.device), p.shape)


class SparseGradReducer:
    """Averages the sparse gradients of ``params`` over the ranks of ``comm`` (module docstring).

    Two verbs, called on every rank at the same point, the end of a backward that communicates:
    :meth:`start` (one flags all-reduce, then one asynchronous sparse all-reduce per parameter) and
    :meth:`finish` (wait, and ``.grad`` := the averaged gradient).

    Args:
        comm: a group of its own (:func:`~lightning_pipedap.engine.collectives.new_comm_group`), used by nothing
            else.
        params: the sparse-gradient parameters, the same (names, shapes) in the same order on every rank.
        name_of: ``parameter -> name`` for messages.
    """

    def __init__(self, comm: C.CommGroup, params: Sequence[Tensor], name_of: Callable[[Tensor], str]) -> None:
        self.comm, self.name_of = comm, name_of
        self.params: list[Tensor] = list(params)
        #: a step left a parameter without a gradient on some rank (identical on every rank: read from the
        #: reduced flags); DDP's reducer raises for such a step
        self.saw_unused = False
        self._inflight: list[tuple[Tensor, C.SparseReduction]] = []

    def start(self) -> None:
        """Start the reduction of every parameter's ``.grad`` (this rank's gradient, accumulated over the
        micro-batches since the last communicating backward).

        Raises:
            ValueError: on every rank alike, when a parameter got a dense gradient on some rank (its weight is
                also read by a dense op, e.g. tied to an output layer; DDP refuses it too: "Expected variable to
                have sparse gradient"), naming it.
        """
        if not self.params:
            return
        n = len(self.params)
        flags = torch.zeros(2 * n)  # [has a gradient] * n + [has a dense gradient] * n, summed over the ranks
        for k, p in enumerate(self.params):
            if p.grad is not None:
                flags[k] = 1.0
                flags[n + k] = float(p.grad.layout == torch.strided)
        C.all_reduce_(flags, self.comm)
        counts = flags.tolist()
        dense = [self.name_of(p) for k, p in enumerate(self.params) if counts[n + k] > 0]
        if dense:
            raise ValueError(f"pipedap: parameter(s) {', '.join(map(repr, dense))} of a sparse=True embedding got a "
                             "dense gradient on some rank (the weight is also used outside the embedding lookup, e.g. "
                             "tied to an output layer); DDP refuses this too. Use sparse=False for such a weight")
        world = self.comm.world_size
        self.saw_unused = self.saw_unused or any(c < world for c in counts[:n])
        for k, p in enumerate(self.params):
            if counts[k] == 0:
                continue  # no rank has a gradient: .grad stays None (or as zero_grad left it), not reduced
            grad = p.grad if p.grad is not None else empty_sparse_like(p)
            self._inflight.append((p, C.start_sparse_all_reduce(grad, self.comm)))

    def finish(self) -> list[Tensor]:
        """Wait for the reductions :meth:`start` began and set each parameter's ``.grad`` to its averaged
        gradient (sparse, coalesced, identical on every rank).

        Returns:
            The parameters whose ``.grad`` was set (those with a gradient on some rank).

        Raises:
            RuntimeError: the backend's error when a peer does not take part within the group's timeout.
        """
        inflight, self._inflight = self._inflight, []
        done = []
        for p, red in inflight:
            red.work.wait()
            if p.grad is not red.grad:
                p.grad = red.grad
            done.append(p)
        return done

    def reduce(self) -> list[Tensor]:
        """:meth:`start` then :meth:`finish`."""
        self.start()
        return self.finish()

    def first_nonfinite(self) -> Optional[tuple[str, int, int, int]]:
        """After :meth:`finish`: ``(name, NaN count, inf count, number of stored values)`` of the first parameter
        whose averaged gradient holds a non-finite value, or None (identical on every rank)."""
        for p in self.params:
            g = p.grad
            if g is None:
                continue
            values = compat.sparse_stored_values(g) if g.layout == torch.sparse_coo else g
            if values.numel() and not bool(values.isfinite().all()):
                return self.name_of(p), int(values.isnan().sum()), int(values.isinf().sum()), values.numel()
        return None
