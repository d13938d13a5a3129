"""From the traced step to the parameter order and the owner (trigger module) of each parameter.

The trace (:class:`~lightning_pipedap.probe.consumers.ConsumerTrace`, first sync step) records
each parameter's first consuming op. Rank 0 turns it into plain data, module *names*, which every
rank maps back to its own module objects, so the layout and the triggers are identical everywhere
even when control flow differs between ranks (experts that get no tokens on one rank).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional

import torch
from torch import Tensor

from lightning_pipedap import compat
from lightning_pipedap.probe.consumers import ConsumerTrace, Consumption, ModuleStack, consumer_order


def plan_owners(first: dict[int, Consumption], num_params: int,
                module_names: dict[int, str]) -> tuple[list[int], list[str]]:
    """Rank 0: parameter order (first consumption) and the owner's module name of each, in that order.

    Args:
        first: parameter index -> its first :class:`Consumption` (indices into the trainable list).
        num_params: number of trainable parameters.
        module_names: ``id(module) -> name`` of the LightningModule's modules (``""`` is the root).

    Returns:
        ``(order, owners)``; an owner ``""`` (the root: applied before ``training_step``) for parameters
        read outside every module forward, inside a ``torch.func`` transform, or not read at all.
    """
    order = consumer_order(num_params, first)
    owners = []
    for i in order:
        c = first.get(i)
        module = None if c is None or c.in_transform else c.module
        owners.append(module_names.get(id(module), "") if module is not None else "")
    return order, owners


def outside_compiled(name: str, modules: dict[str, torch.nn.Module]) -> str:
    """The owner to trigger instead of module ``name``: the parent of the outermost ``torch.compile``d
    module around it (hooks of modules inside a compiled region do not run eagerly), else ``name``."""
    compiled = compat.compiled_module_type()  # (torch.compile's wrapper class)
    parts = name.split(".") if name else []
    for k in range(1, len(parts) + 1):
        if isinstance(modules.get(".".join(parts[:k])), compiled):
            return ".".join(parts[:k - 1])
    return name


def owner_modules(owner_names: list[Optional[str]], root: torch.nn.Module) -> list[torch.nn.Module]:
    """Each rank's own module objects for rank 0's owner names (unknown or ``None`` names: the root)."""
    modules = dict(root.named_modules())
    return [root if n is None else modules.get(outside_compiled(n, modules), root) for n in owner_names]


@contextmanager
def consumer_mode(stack: ModuleStack, params: list[Tensor], optimizers: list[Any],
                  on_consume: Optional[Callable[[int, bool], None]],
                  track: bool) -> Generator[ConsumerTrace, None, None]:
    """A :class:`~lightning_pipedap.probe.consumers.ConsumerTrace` over ``params`` for one
    ``training_step``. With ``on_consume``, a read of a parameter's optimizer state (a tensor in
    ``optimizer.state[p]``) counts as a read of ``p``. ``track``: with the module stack recording which
    forward is running (the trace step)."""
    aliases = {}
    if on_consume is not None:
        for opt in optimizers:
            for k, p in enumerate(params):
                for v in dict.get(opt.state, p, {}).values():  # (dict.get: a sharded entry is simply absent)
                    if isinstance(v, Tensor):
                        aliases[id(v)] = k
    mode = ConsumerTrace(params, stack, on_consume, aliases)
    stack.install(track)
    stack.pause_in_compiled(mode)
    mode.push()
    try:
        yield mode
    finally:
        mode.pop()
        stack.remove()
