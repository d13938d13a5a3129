"""Which parameters one fit trains and how their gradients are reduced (:class:`Trainables`): the dense ones go
to the engine's buckets, those with sparse gradients (``nn.Embedding(sparse=True)``) to a
:class:`~lightning_pipedap.engine.sparse.SparseGradReducer` on a group of their own."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

import lightning_pipedap.engine.collectives as C
from lightning_pipedap.engine.sparse import SparseGradReducer, sparse_gradient_params
from lightning_pipedap.strategy.config import PipeDAPConfig
from lightning_pipedap.strategy.context import FitContext
from lightning_pipedap.strategy.params import TrainableSet


def refuse_sparse_with(config: PipeDAPConfig, name: str, kind: str) -> None:
    """Options that change what the dense buckets carry do not combine with sparse gradients, which are
    all-reduced exactly as DDP does.

    Raises:
        ValueError: ``compression`` set or ``wire_dtype`` not ``"fp32"``, naming the parameter ``name`` (of a
            ``kind`` module) and the valid choices.
    """
    if config.compression is not None:
        bad, valid = f"compression={config.compression!r}", "compression=None"
    elif config.wire_dtype != "fp32":
        bad, valid = f"wire_dtype={config.wire_dtype!r}", "wire_dtype='fp32'"
    else:
        return
    raise ValueError(f"pipedap: parameter {name!r} has sparse gradients ({kind}), which pipedap all-reduces exactly "
                     f"as DDP does; {bad} is not supported together with sparse gradients. Valid: {valid}, or "
                     "sparse=False for that embedding")


class Trainables:
    """The trainable parameters of one fit (checked identical on every rank), split by gradient layout.

    Args:
        ctx: the fit's context.

    Attributes:
        tset: the :class:`~lightning_pipedap.strategy.params.TrainableSet` (names, signatures).
        params: the trainable parameters with dense gradients (the engine's), in registration order.
        sparse: the reducer of those with sparse gradients (None: there never were any).

    Raises:
        ValueError: no trainable parameter, trainable parameters that differ between ranks, or a sparse-gradient
            parameter with compression or a 16-bit wire format.
    """

    def __init__(self, ctx: FitContext) -> None:
        self.ctx = ctx
        self.tset = TrainableSet(ctx.module, ctx.rank)
        self.name_of = self.tset.name_of
        self.sparse: Optional[SparseGradReducer] = None
        self.params: list[Tensor] = []
        self._key = 0
        self.params = self._dense(self.tset.collect())

    @property
    def has_sparse(self) -> bool:
        """Whether some trainable parameter has a sparse gradient. The strategies then run every step in sync mode:
        the deferred per-bucket updates step only the buckets' parameters."""
        return self.sparse is not None and bool(self.sparse.params)

    def remember(self) -> None:
        """Take the current trainable set and param groups as the reference of :meth:`changed`."""
        self._key = self.tset.key(self.ctx.optimizers())

    def changed(self) -> bool:
        """Whether parameters were (un)frozen or a param group added since the reference (which becomes the
        current set)."""
        key = self.tset.key(self.ctx.optimizers())
        if key == self._key:
            return False
        self._key = key
        return True

    def collect(self) -> list[Tensor]:
        """Collect the trainable set again (every rank alike; compared across ranks); returns the dense ones."""
        self.params = self._dense(self.tset.collect())
        return self.params

    def _dense(self, trainable: list[Tensor]) -> list[Tensor]:
        """The parameters of ``trainable`` with dense gradients (the engine's); those with sparse gradients go to
        :attr:`sparse` (its group is created here at the first one: every rank reaches this point alike).

        Raises:
            ValueError: a sparse-gradient parameter with ``compression`` or a 16-bit ``wire_dtype``
                (:func:`refuse_sparse_with`).
        """
        cfg = self.ctx.config
        kinds = sparse_gradient_params(self.ctx.module)
        sparse = [p for p in trainable if id(p) in kinds]
        for p in sparse[:1]:
            refuse_sparse_with(cfg, self.name_of(p), kinds[id(p)])
        dense = [p for p in trainable if id(p) not in kinds]
        if not sparse and self.sparse is None:
            return dense
        if self.sparse is None:
            group = C.new_comm_group(cfg.wait_timeout_s)
            self.sparse = SparseGradReducer(group, sparse, self.name_of)
        self.sparse.params = sparse
        if sparse:
            names = ", ".join(self.name_of(p) for p in sparse[:4]) + (", ..." if len(sparse) > 4 else "")
            only = ("; no parameter has a dense gradient, so there is no bucket to plan"
                    f"{f' (schedule {cfg.schedule!r} is not used)' if cfg.planned else ''}"
                    if not dense else "")
            self.ctx.say("sparse", f"pipedap: {len(sparse)} parameter(s) with sparse gradients ({names}): each is "
                         "all-reduced as DDP does (divided by the world size, one sparse all-reduce per parameter at "
                         "the end of backward, on a process group of its own), and every step runs in sync mode (as "
                         f"defer_update=False){only}")
        return dense
