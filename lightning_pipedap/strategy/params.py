"""The trainable parameters of one fit: which they are and their names.

The trainable set is what the user made trainable (``requires_grad``, seen through
``LightningModule.toggle_optimizer``, which switches other optimizers' parameters off for one step),
checked identical (name, shape, dtype) on every rank. Names key the compression state and the
checkpointed plan. The hooks on them are :mod:`lightning_pipedap.strategy.hooks`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

import lightning_pipedap.engine.collectives as C
from lightning_pipedap import compat
from lightning_pipedap.engine.sparse import sparse_gradient_params

#: engine parameter index -> (parameter name, shape)
ParamInfo = dict[int, tuple[str, tuple[int, ...]]]


class TrainableSet:
    """Trainable parameters of ``module``: which, their names and layouts.

    Args:
        module: the LightningModule.
        rank: this process's rank (for messages).
    """

    def __init__(self, module: torch.nn.Module, rank: int) -> None:
        self.module, self.rank = module, rank
        self._all: Optional[list[Tensor]] = None  # every parameter of the module, listed by the first key()

    def requires_grad(self, p: Tensor) -> bool:
        """``p.requires_grad`` as the user set it (not as ``toggle_optimizer`` switched it for one step)."""
        toggled = compat.toggled_requires_grad(self.module) or {}
        return bool(toggled.get(p, p.requires_grad))

    def collect(self) -> list[Tensor]:
        """The trainable parameters, in registration order.

        Raises:
            ValueError: none is trainable, or they differ from rank 0's (name, shape, dtype, sparse gradient or
                not; the first difference is named).
        """
        named = [(n, p) for n, p in self.module.named_parameters() if self.requires_grad(p)]
        if not named:
            raise ValueError(f"pipedap: {type(self.module).__name__} has no trainable parameters "
                             "(all requires_grad=False)")
        sparse = sparse_gradient_params(self.module)
        same_on_every_rank([(n, tuple(p.shape), str(p.dtype)) + ((sparse[id(p)],) if id(p) in sparse else ())
                            for n, p in named], "trainable parameters",
                           "every rank must build the same model and freeze the same parameters")
        return [p for _, p in named]

    def key(self, optimizers: list) -> int:
        """Hash of which parameters are trainable and of every optimizer's param groups (checked every step).

        The module's parameters are listed once, at the first call: as with DDP's reducer, a parameter
        added to the model during the fit is not seen unless an optimizer gets it (``add_param_group``).
        """
        if self._all is None:
            self._all = list(self.module.parameters())
        toggled = compat.toggled_requires_grad(self.module)
        if toggled:
            trainable = tuple(bool(toggled.get(p, p.requires_grad)) for p in self._all)
        else:
            trainable = tuple(p.requires_grad for p in self._all)
        groups = tuple(tuple(map(id, g["params"])) for opt in optimizers for g in opt.param_groups)
        return hash((trainable, groups))

    def names(self) -> dict[int, str]:
        """``id(parameter) -> name`` in the module."""
        return {id(p): n for n, p in self.module.named_parameters()}

    def name_of(self, p: Tensor) -> str:
        return self.names().get(id(p), "<unnamed parameter>")

    def signature(self, params: list[Tensor]) -> list[list[Any]]:
        """``[name, shape]`` of each of ``params``."""
        names = self.names()
        return [[names.get(id(p), f"<parameter {i}>"), list(p.shape)] for i, p in enumerate(params)]

    def engine_info(self, engine: Any) -> ParamInfo:
        """Engine parameter index -> ``(name, shape)``."""
        names = self.names()
        return {i: (names.get(id(p), f"<parameter {i}>"), tuple(p.shape))
                for b in engine.buckets for i, p in zip(b.param_indices, b.params)}

    def layouts(self, buckets: list) -> list[list[tuple[str, tuple[int, ...]]]]:
        """Per bucket, ``(parameter name, shape)`` in buffer order: what the compression state is keyed by.

        A piece of a split parameter (never in a compressed bucket) is ``("name[start:stop]", (stop - start,))``.
        """
        names = self.names()
        out = []
        for b in buckets:
            entries = []
            for slot, (i, p) in enumerate(zip(b.param_indices, b.params)):
                name = names.get(id(p), f"<parameter {i}>")
                if b.is_piece(slot):
                    start, stop = b.ranges[slot]
                    entries.append((f"{name}[{start}:{stop}]", (stop - start,)))
                else:
                    entries.append((name, tuple(p.shape)))
            out.append(entries)
        return out


def model_signature(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str, bool]]:
    """``(name, shape, dtype, requires_grad)`` of every parameter and buffer, in registration order."""
    return ([(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]
            + [(n, tuple(b.shape), str(b.dtype), False) for n, b in module.named_buffers()])


def same_on_every_rank(signature: list[tuple], what: str, advice: str) -> None:
    """Gather ``signature`` (a list of tuples whose first item is a name) from every rank (one
    ``all_gather_object`` on the default group; every rank must call it) and fail on every rank alike.

    Raises:
        ValueError: on every rank when any rank's list differs from rank 0's, naming the first rank and
            entry that differ: ``rank 1: net.0.weight (48, 16) torch.float32 vs rank 0: (32, 16) ...``.
    """
    everyone = C.all_gather_object(signature)
    ref = everyone[0]
    for r, mine in enumerate(everyone[1:], start=1):
        if mine == ref:
            continue
        diff = next(((a, b) for a, b in zip(mine, ref) if a != b), None)
        if diff is None:
            detail = f"rank {r} has {len(mine)} {what}, rank 0 has {len(ref)}"
            longer = mine if len(mine) > len(ref) else ref
            detail += f" (first extra: {longer[min(len(mine), len(ref))][0]!r})"
        else:
            a, b = diff
            name = a[0] if a[0] == b[0] else f"{a[0]!r} vs {b[0]!r}"
            detail = f"rank {r}: {name} {' '.join(map(str, a[1:]))} vs rank 0: {' '.join(map(str, b[1:]))}"
        raise ValueError(f"pipedap: the {what} differ between ranks ({detail}); {advice}")
