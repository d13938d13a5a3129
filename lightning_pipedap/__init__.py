"""lightning_pipedap: a PyTorch Lightning strategy for scheduled, decoupled gradient communication.

``import lightning_pipedap`` makes the strategy names ``"pipedap"`` and ``"pipedap_spawn"`` known to
Lightning's strategy registry and to Lightning Fabric's. Then ``Trainer(strategy="pipedap", devices=2)``
and ``Fabric(strategy="pipedap", devices=2)`` train with it; ``PipeDAPStrategy(...)`` and
``PipeDAPFabricStrategy(...)`` work as instances too.

The import itself is light: it does not import Lightning. Lightning 2.6 has no entry-point discovery
for strategies, so registration happens when ``lightning.pytorch`` is imported: at once if it already
is, otherwise through an import hook that registers right after that package (which loads the
strategy registry, and Fabric's) has finished executing. ``import lightning`` and ``import lightning.fabric``
import ``lightning.pytorch`` too, so the hook covers Fabric-only scripts. Processes that only need the planner,
the CLI or the compression helper therefore never pay for importing Lightning. ``PipeDAPStrategy``,
``PipeDAPFabricStrategy`` and ``valid_schedule_names`` are loaded on first access.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Any

from lightning_pipedap.schedule import Op, OpKind, Schedule

__all__ = ["NonFiniteGradientError", "ParameterDivergenceError", "PipeDAPFabricStrategy", "PipeDAPStrategy", "Schedule",
           "Op", "OpKind", "register", "valid_schedule_names"]
__version__ = "0.1.0"

_REGISTRY_MODULE = "lightning.pytorch"
_STRATEGY_MODULE = "lightning_pipedap.strategy.lightning"
_FABRIC_MODULE = "lightning_pipedap.strategy.fabric"
_LAZY = {"PipeDAPStrategy": _STRATEGY_MODULE, "PipeDAPFabricStrategy": _FABRIC_MODULE,
         "valid_schedule_names": "lightning_pipedap.strategy.config",
         "NonFiniteGradientError": "lightning_pipedap.strategy.numerics",
         "ParameterDivergenceError": "lightning_pipedap.strategy.numerics"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib  # noqa: PLC0415

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_pipedap' has no attribute {name!r}")


def register() -> None:
    """Register ``"pipedap"`` and ``"pipedap_spawn"`` in Lightning's ``StrategyRegistry`` and in Fabric's
    ``STRATEGY_REGISTRY`` (idempotent).

    Imports Lightning. Called automatically when ``lightning.pytorch`` is imported after
    ``lightning_pipedap``, or at once by ``import lightning_pipedap`` if it already was.
    """
    from lightning.pytorch.strategies import StrategyRegistry  # noqa: PLC0415

    from lightning_pipedap.strategy.lightning import PipeDAPStrategy  # noqa: PLC0415

    PipeDAPStrategy.register_strategies(StrategyRegistry)
    _register_fabric()


def _register_fabric() -> None:
    """Fabric's registry (the Fabric strategy module registers itself when it loads)."""
    import importlib  # noqa: PLC0415

    importlib.import_module(_FABRIC_MODULE)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Meta-path finder that runs :func:`register` once ``lightning.pytorch`` has executed.

    It finds nothing itself: for that one package it asks the other finders for the spec, wraps the
    loader's ``exec_module`` and removes itself from ``sys.meta_path``.
    """

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _REGISTRY_MODULE or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = None
            for other in sys.meta_path:
                if other is not self and hasattr(other, "find_spec"):
                    spec = other.find_spec(fullname, path, target)
                    if spec is not None:
                        break
        finally:
            self._busy.on = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        inner = spec.loader
        finder = self

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
                return inner.create_module(spec)

            def exec_module(self, module: Any) -> None:
                inner.exec_module(module)
                finder.remove()
                if _STRATEGY_MODULE not in sys.modules:  # (that module registers itself when it has loaded)
                    register()
                else:  # (it is loading now and imported lightning.pytorch: Fabric's registry is left)
                    _register_fabric()

        spec.loader = _Loader()
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


if _REGISTRY_MODULE in sys.modules:
    register()
elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterImport())
