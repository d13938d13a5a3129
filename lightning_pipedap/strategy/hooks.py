"""The hooks pipedap puts on one model, and their removal.

Three kinds, all owned by one :class:`ModelHooks` per fit:

* a post-accumulate-grad hook on every trainable parameter: it hands the finished gradient to the
  engine (the reduce-scatter or all-reduce of its bucket starts when the bucket is full);
* a forward pre-hook on every eager module that holds parameters (itself or below it) and on every
  module the trace found to be a parameter's first consumer (prepended, so it runs before hooks
  registered earlier, such as legacy ``weight_norm``'s recomputation of ``weight``): it applies the
  bucket updates whose first consumer the module is. Modules without parameters (activations,
  pooling, dropout) cannot read a pending parameter and get no hook: a hook costs every call of the
  module a few microseconds (``nn.Module``'s slow call path);
* a wrapper around ``train(mode)`` of modules that override it (a LoRA merge reads the weights
  there): pending updates are applied first.

Handing the model to DDP's reducer removes the first two and installs them again on the way back;
the ``train()`` wrappers stay for the whole fit.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_pipedap.probe.consumers import eager_modules


class ModelHooks:
    """pipedap's gradient hooks, forward pre-hooks and ``train()`` wrappers on ``module``.

    Args:
        module: the model pipedap trains (the LightningModule, or Fabric's module).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._on_grad: Optional[Callable[[Tensor], None]] = None
        self._on_forward: Optional[Callable[..., Any]] = None
        self._params: list[Tensor] = []
        self._hooked: set[int] = set()
        self._grad_handles: list[Any] = []
        self._module_handles: list[Any] = []
        self._modules: dict[int, torch.nn.Module] = {}  # modules with a forward pre-hook (while active)
        self._active = True  # False between remove() and reinstall(): DDP's reducer runs
        self._wrapped: list[torch.nn.Module] = []

    def install(self, params: list[Tensor], on_grad: Callable[[Tensor], None],
                on_forward: Callable[..., Any]) -> None:
        """Hook ``on_grad(p)`` after each of ``params`` accumulates its gradient, and ``on_forward(module, args)``
        before the forward of each eager module that holds parameters."""
        self._on_grad, self._on_forward = on_grad, on_forward
        self.add_params(params)
        self.add_modules([m for m in eager_modules(self.module) if next(m.parameters(), None) is not None])

    def add_modules(self, modules: list[torch.nn.Module]) -> None:
        """Forward pre-hooks on the modules of ``modules`` not hooked yet (first consumers found by the trace
        that hold no parameter of their own: they read another module's)."""
        for m in modules:
            if id(m) not in self._modules:
                self._modules[id(m)] = m
                self._hook_module(m)

    def _hook_module(self, m: torch.nn.Module) -> None:
        if self._active and self._on_forward is not None:
            self._module_handles.append(m.register_forward_pre_hook(self._on_forward, prepend=True))

    def add_params(self, params: list[Tensor]) -> None:
        """Gradient hooks on the parameters of ``params`` not hooked yet (after unfreezing: the new trainable set)."""
        self._params = params
        if self._on_grad is None or not self._active:
            return
        for p in params:
            if id(p) in self._hooked:
                continue
            self._hooked.add(id(p))
            toggled_off = not p.requires_grad  # (switched off by toggle_optimizer right now)
            if toggled_off:
                p.requires_grad_(True)
            try:
                self._grad_handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
            finally:
                if toggled_off:
                    p.requires_grad_(False)

    def remove(self) -> None:
        """Remove the gradient hooks and forward pre-hooks (``train()`` wrappers stay); :meth:`reinstall` puts
        them back."""
        for h in self._grad_handles + self._module_handles:
            h.remove()
        self._grad_handles, self._module_handles, self._hooked = [], [], set()
        self._active = False

    def reinstall(self) -> None:
        """Install the hooks removed by :meth:`remove` again, on the current trainable set and the same modules
        (with those added meanwhile)."""
        if self._active:
            return
        self._active = True
        self.add_params(self._params)
        for m in self._modules.values():
            self._hook_module(m)

    def wrap_train(self, module: torch.nn.Module, before: Callable[[torch.nn.Module], None]) -> None:
        """Call ``before(module)`` ahead of ``module.train(mode)``."""
        original = module.train

        def train(mode: bool = True) -> torch.nn.Module:
            before(module)
            return original(mode)

        module.train = train  # instance attribute: found before the class's method
        self._wrapped.append(module)

    def close(self) -> None:
        """Remove every hook and ``train()`` wrapper."""
        self.remove()
        for m in self._wrapped:
            m.__dict__.pop("train", None)
        self._wrapped = []
