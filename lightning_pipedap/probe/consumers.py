"""Which module really consumes each parameter: a torch-function trace of one forward.

The module that *registers* a parameter is not always the module whose forward reads it:
``nn.MultiheadAttention.forward`` passes ``self.out_proj.weight`` to
``F.multi_head_attention_forward`` (``out_proj``'s own forward never runs), a timm-style model calls
``backbone.forward_features`` (the backbone's ``forward`` never runs), a ``training_step`` may use
``self.layer.weight`` functionally, and a parent may read a child's weight (weight tying).
A deferred update must land before the first *op* that reads the parameter, so the trigger of a
bucket is decided from ops, not from registration:

- :class:`ModuleStack` keeps the stack of module forwards running right now (global forward
  pre/post hooks, filtered to one model's modules);
- :class:`ConsumerTrace` is a :class:`torch.overrides.TorchFunctionMode`: every torch function and
  tensor method called with a watched parameter among its arguments (one level of lists, as in
  ``_VF.lstm``'s flat weights) reports that parameter with the innermost running module and
  whether a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``, ...) is active.

The strategy runs the trace during its trace step to assign owners, and again as a *guard* during
the first deferred steps after a schedule is installed, where a consumption of a parameter whose
update is still pending applies that update first (the callback runs before the op).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode

from lightning_pipedap import compat


def transform_active() -> bool:
    """True while a ``torch.func`` transform (vmap, grad, jacrev, jvp, ...) is running."""
    return compat.transform_active()


def compiled_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost ``torch.compile``d submodules of ``model`` (``OptimizedModule``; their own hooks run eagerly)."""
    compiled = compat.compiled_module_type()  # (torch.compile's wrapper class)
    out: list[torch.nn.Module] = []

    def visit(m: torch.nn.Module) -> None:
        if isinstance(m, compiled):
            out.append(m)
            return
        for child in m.children():
            visit(child)

    visit(model)
    return out


def eager_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` outside every ``torch.compile``d submodule (whose hooks run eagerly).

    Hooks on modules inside a compiled region are traced by dynamo; hooks that change between runs
    would make it recompile (and, past its recompile limit, fall back to eager code with other
    rounding), so the strategy leaves compiled regions alone.
    """
    compiled = compat.compiled_module_type()  # (torch.compile's wrapper class)
    out: list[torch.nn.Module] = []
    seen: set[int] = set()

    def visit(m: torch.nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        if isinstance(m, compiled):
            return
        out.append(m)
        for child in m.children():
            visit(child)

    visit(model)
    return out


class ModuleStack:
    """The modules of one model whose forward is running now, innermost last.

    Installed with :meth:`install` (forward pre/post hooks, ``always_call=True``, on every module
    outside compiled regions, see :func:`eager_modules`) and removed with :meth:`remove`;
    ``install(track=False)`` registers nothing (only :meth:`pause_in_compiled` hooks, if asked).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._modules = eager_modules(model)
        self._compiled = compiled_modules(model)
        self.stack: list[torch.nn.Module] = []
        self._handles: list[Any] = []

    def pause_in_compiled(self, mode: TorchFunctionMode) -> None:
        """Take ``mode`` off the torch-function stack while a compiled submodule runs (call after
        :meth:`install`): dynamo then compiles exactly what it compiles without the strategy, and the
        compiled module's parameters are simply not seen (the strategy updates them before
        ``training_step``)."""
        for m in self._compiled:
            popped: list[Any] = []

            def pre(module: torch.nn.Module, args: Any, popped: list = popped) -> None:
                if compat.pop_torch_function_mode(mode):
                    popped.append(mode)

            def post(module: torch.nn.Module, args: Any, out: Any, popped: list = popped) -> None:
                if popped:
                    compat.push_torch_function_mode(popped.pop())

            self._handles.append(m.register_forward_pre_hook(pre))
            self._handles.append(m.register_forward_hook(post, always_call=True))

    def install(self, track: bool = True) -> None:
        def pre(module: torch.nn.Module, args: Any) -> None:
            self.stack.append(module)

        def post(module: torch.nn.Module, args: Any, out: Any) -> None:
            if self.stack and self.stack[-1] is module:
                self.stack.pop()

        self.stack.clear()
        self._handles = []
        for m in self._modules if track else ():
            self._handles.append(m.register_forward_pre_hook(pre, prepend=True))
            self._handles.append(m.register_forward_hook(post, always_call=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.stack.clear()

    def top(self) -> Optional[torch.nn.Module]:
        """The innermost running module, or ``None`` outside every forward of the model."""
        return self.stack[-1] if self.stack else None


@dataclass(frozen=True)
class Consumption:
    """The first consumption of one parameter seen by a :class:`ConsumerTrace`.

    Attributes:
        seq: position of the consuming op among all ops of the traced region (0-based).
        module: innermost running module of the model then (``None``: outside every forward).
        in_transform: whether a ``torch.func`` transform was active.
    """

    seq: int
    module: Optional[torch.nn.Module]
    in_transform: bool


class ConsumerTrace(TorchFunctionMode):
    """Torch-function mode that reports ops reading watched parameters.

    Args:
        params: the watched parameters (index = position in this sequence).
        stack: the model's :class:`ModuleStack` (installed by the caller).
        on_consume: optional ``callback(index, grad_read)`` called *before* the op runs, every time a
            watched tensor is an argument (the guard uses it to apply a pending update just in time);
            ``grad_read`` is True for a read of ``param.grad``.
        aliases: ``id(tensor) -> parameter index`` of further tensors that stand for a parameter
            (its optimizer state: a read of ``exp_avg`` is a read of the update's result).

    After the traced region, :attr:`first` maps parameter index -> :class:`Consumption` of its
    first use. The overhead is a Python call and an argument scan per op, so the strategy runs it
    only during trace and verification steps.
    """

    def __init__(self, params: Sequence[torch.Tensor], stack: ModuleStack,
                 on_consume: Optional[Callable[[int, bool], None]] = None,
                 aliases: Optional[dict[int, int]] = None) -> None:
        super().__init__()
        self._index = dict(aliases or {})
        self._index.update({id(p): i for i, p in enumerate(params) if p is not None})
        self._stack = stack
        self._on_consume = on_consume
        self._seq = 0
        self.first: dict[int, Consumption] = {}

    def _hits(self, values: Iterable[Any]) -> list[int]:
        index, out = self._index, []
        for v in values:
            if isinstance(v, torch.Tensor):
                i = index.get(id(v))
                if i is not None:
                    out.append(i)
            elif isinstance(v, (list, tuple)):
                for w in v:
                    if isinstance(w, torch.Tensor):
                        i = index.get(id(w))
                        if i is not None:
                            out.append(i)
        return out

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if _metadata_only(func):
            return func(*args, **kwargs)
        hits = self._hits(args)
        if kwargs:
            hits += self._hits(kwargs.values())
        if hits:
            seq = self._seq
            for i in hits:
                if i not in self.first:
                    self.first[i] = Consumption(seq, self._stack.top(), transform_active())
            if self._on_consume is not None:
                grad_read = getattr(func, "__self__", None) is _GRAD_ATTRIBUTE
                for i in hits:
                    self._on_consume(i, grad_read)
        self._seq += 1
        return func(*args, **kwargs)

    def push(self) -> None:
        """Make this mode active (as ``__enter__``)."""
        compat.push_torch_function_mode(self)

    def pop(self) -> bool:
        """Deactivate this mode if it is the innermost one (never from inside its own handler); True if popped."""
        return compat.pop_torch_function_mode(self)


_GRAD_ATTRIBUTE = torch.Tensor.grad  # the descriptor whose ``__get__`` a read of ``param.grad`` calls
#: attributes (their descriptors' ``__get__`` / ``__set__``) and methods that read no element of a tensor: a
#: pending update cannot change what they see, so they are no consumption (``LightningModule.toggle_optimizer``
#: reads and sets ``requires_grad`` of every parameter at the start of a manual ``training_step``, outside any
#: forward: counted, it made the root the first consumer of every parameter)
_METADATA_ATTRIBUTES = frozenset(id(getattr(torch.Tensor, n)) for n in (
    "requires_grad", "shape", "dtype", "device", "is_leaf", "ndim", "layout", "grad_fn", "is_cuda", "is_sparse",
    "is_meta", "is_quantized", "names") if hasattr(torch.Tensor, n))
_METADATA_METHODS = frozenset(id(getattr(torch.Tensor, n)) for n in (
    "size", "dim", "numel", "requires_grad_", "element_size", "nelement", "is_floating_point", "is_complex",
    "__hash__") if hasattr(torch.Tensor, n))


def _metadata_only(func: Any) -> bool:
    """Whether ``func`` (as given to ``__torch_function__``) reads a tensor's metadata only."""
    return id(getattr(func, "__self__", None)) in _METADATA_ATTRIBUTES or id(func) in _METADATA_METHODS


def consumer_order(num_params: int, first: dict[int, Consumption]) -> list[int]:
    """Parameter indices by first consumption, then the never-consumed ones in index order."""
    used = sorted(first, key=lambda i: (first[i].seq, i))
    seen = set(used)
    return used + [i for i in range(num_params) if i not in seen]
