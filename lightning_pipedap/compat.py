"""Every private torch and Lightning API the package uses, in one place.

Each entry below names the private API it wraps, what the package uses it for, and the versions it was
checked on (:data:`CHECKED_ON`). When a release removes or moves one, the entry either falls back to a
behaviour stated in its docstring or raises :class:`CompatError` naming the API and the installed versions.
``tests/test_compat.py`` resolves every entry of :data:`PRIVATE_APIS` (and checks the attributes Lightning
sets), so a release that moves one fails there first; it also checks that no other module of the package
reaches a private torch or Lightning name.

Lightning is imported lazily (inside the entries): ``engine/`` and ``probe/`` import this module, and processes
that only plan or compress never import Lightning (``lightning_pipedap/__init__.py``).

A few entries are public-API replacements of private names used before (:func:`attached_trainer` for
``LightningModule._trainer``, :data:`StrategyRegistry` for the ``_StrategyRegistry`` annotation); they live here
because several modules need them.
"""

from __future__ import annotations

import functools
import importlib
import sys
from importlib import metadata
from typing import Any, Callable, NamedTuple, Optional

import torch

__all__ = [
    "CHECKED_ON", "CompatError", "PRIVATE_APIS", "PRIVATE_ATTRIBUTES", "REPLACED_BY_PUBLIC", "SigtermHooks",
    "SpawnLauncherHook", "attached_trainer", "batches_that_stepped", "compiled_module_type", "default_store",
    "disable_torch_function", "forget_observed_children", "layer_sync", "loop_progress", "mark_optimizer_stepped",
    "pop_torch_function_mode",
    "push_torch_function_mode", "queue_autograd_callback", "reducer_finalized", "resolve",
    "set_backward_sync_control", "signal_connector", "sigterm_hooks", "sparse_stored_values", "start_method",
    "toggled_requires_grad", "transform_active", "unwrap_optimizer",
]

#: the versions every entry was checked on
CHECKED_ON = {"torch": "2.13.0", "lightning": "2.6.6"}


def _installed(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


class CompatError(RuntimeError):
    """A private torch / Lightning API the package needs is missing in the installed versions.

    Args:
        api: the private API, dotted (``"torch._C.DisableTorchFunction"``).
        use: what the package needs it for, in a few words (None: not said).
    """

    def __init__(self, api: str, use: Optional[str] = None) -> None:
        self.api = api
        used = f", used for {use}" if use else ""
        super().__init__(
            f"pipedap: {api} (a private API{used}) is missing in torch {torch.__version__} / lightning "
            f"{_installed('lightning')}; pipedap was checked on torch {CHECKED_ON['torch']} and lightning "
            f"{CHECKED_ON['lightning']}: install those, or a pipedap release that supports yours")


def resolve(api: str) -> Any:
    """The object at the dotted path ``api`` (``"torch._C.DisableTorchFunction"``), importing modules as needed.

    Raises:
        CompatError: it does not exist in the installed versions.
    """
    parts = api.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for name in parts[i:]:
                obj = getattr(obj, name)
        except AttributeError:
            break
        return obj
    raise CompatError(api)


# ----------------------------------------------------------------------------------------------------- torch

def reducer_finalized(reducer: Any) -> bool:
    """Whether DDP's reducer finished averaging the last backward: ``Reducer._check_reducer_finalized()`` (private,
    ``torch._C._distributed_c10d.Reducer``) raises RuntimeError while a bucket is still unreduced.

    Used by :func:`~lightning_pipedap.engine.collectives.ddp_reduction_finished` to see a stalled DDP reduction
    (a parameter that got no gradient) before the next forward raises. No public API tells it. Checked on torch
    2.13.0.

    Raises:
        CompatError: the reducer has no ``_check_reducer_finalized``.
    """
    check = getattr(reducer, "_check_reducer_finalized", None)
    if check is None:
        raise CompatError("torch._C._distributed_c10d.Reducer._check_reducer_finalized",
                          "seeing a stalled DDP reduction")
    try:
        check()
    except RuntimeError:
        return False
    return True


def default_store() -> Any:
    """The default process group's rendezvous store: ``torch.distributed.distributed_c10d._get_default_store()``
    (private).

    Used by the heartbeat (:class:`~lightning_pipedap.engine.collectives.Heartbeat`) and the DDP stall agreement
    (:func:`~lightning_pipedap.engine.collectives.ranks_not_stalled`): key-value messages between ranks without a
    collective. torch has no public getter for the store a group was initialised with. Checked on torch 2.13.0.

    Raises:
        CompatError: the function is missing.
        ValueError / RuntimeError: torch's, when the default group is not initialised.
    """
    get = getattr(torch.distributed.distributed_c10d, "_get_default_store", None)
    if get is None:
        raise CompatError("torch.distributed.distributed_c10d._get_default_store", "the heartbeat between ranks")
    return get()


def queue_autograd_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward pass ends:
    ``torch.autograd.Variable._execution_engine.queue_callback`` (private; FSDP and DDP's Python paths use it).

    Used so that a backward's reduction finishes when ``loss.backward()`` returns, as DDP's reducer does. No
    public API queues a callback on the running backward. Checked on torch 2.13.0.

    Raises:
        CompatError: the engine or its ``queue_callback`` is missing.
    """
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None or not hasattr(engine, "queue_callback"):
        raise CompatError("torch.autograd.Variable._execution_engine.queue_callback", "ending a backward's reduction")
    engine.queue_callback(callback)


_peek_interpreter_stack = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)


def transform_active() -> bool:
    """True while a ``torch.func`` transform (vmap, grad, jacrev, jvp, ...) is running:
    ``torch._C._functorch.peek_interpreter_stack()`` (private) is not None.

    Used to leave parameters read inside a transform to the root (no in-place update inside vmap/grad). No
    public API tells it. Checked on torch 2.13.0. Fallback when missing: False (no transform seen), as on a
    torch without functorch.
    """
    return _peek_interpreter_stack is not None and _peek_interpreter_stack() is not None


@functools.lru_cache(maxsize=None)
def compiled_module_type() -> type:
    """The class ``torch.compile`` wraps a module in: ``torch._dynamo.eval_frame.OptimizedModule`` (private).

    Used to leave ``torch.compile``d submodules alone (their hooks do not run eagerly). Imported on first use
    (``torch._dynamo`` is slow to import). Checked on torch 2.13.0. Fallback when the name moved: the type of
    ``torch.compile(torch.nn.Identity(), backend="eager")`` (public; compiles nothing until called).

    Raises:
        CompatError: neither works.
    """
    try:
        from torch._dynamo.eval_frame import OptimizedModule  # noqa: PLC0415

        return OptimizedModule
    except (ImportError, AttributeError):
        pass
    try:
        return type(torch.compile(torch.nn.Identity(), backend="eager"))
    except Exception as exc:  # noqa: BLE001 - any failure of torch.compile means: no way to know
        raise CompatError("torch._dynamo.eval_frame.OptimizedModule", "finding torch.compile'd submodules") from exc


def disable_torch_function() -> Any:
    """A context manager that turns torch-function handling (modes and subclasses) off:
    ``torch._C.DisableTorchFunction()`` (private).

    Used around the deferred updates, so the strategy's own :class:`~lightning_pipedap.probe.consumers.ConsumerTrace`
    does not see (and attribute) the optimizer's ops. ``torch.overrides`` has no public equivalent. Checked on
    torch 2.13.0.

    Raises:
        CompatError: the class is missing.
    """
    return _disable_torch_function()


def _missing_disable_torch_function() -> Any:
    raise CompatError("torch._C.DisableTorchFunction",
                      "keeping the strategy's updates out of its own torch-function trace")


_disable_torch_function: Callable[[], Any] = getattr(torch._C, "DisableTorchFunction", _missing_disable_torch_function)


def push_torch_function_mode(mode: Any) -> None:
    """Push ``mode`` on the torch-function mode stack: ``torch._C._push_on_torch_function_stack`` (private).

    Used to switch a :class:`~lightning_pipedap.probe.consumers.ConsumerTrace` on and off outside a ``with``
    block, and to put it back after a compiled submodule ran (:meth:`ModuleStack.pause_in_compiled`). The public
    ``TorchFunctionMode.__enter__`` / ``__exit__`` do the same push and pop today, but promise nothing when
    called the other way round (pop then push), which the pause needs. Checked on torch 2.13.0.

    Raises:
        CompatError: the function is missing.
    """
    push = getattr(torch._C, "_push_on_torch_function_stack", None)
    if push is None:
        raise CompatError("torch._C._push_on_torch_function_stack", "switching the parameter-consumer trace on")
    push(mode)


def pop_torch_function_mode(mode: Any) -> bool:
    """Pop ``mode`` off the torch-function mode stack if it is the innermost mode; True if popped:
    ``torch._C._len_torch_function_stack``, ``torch._C._get_function_stack_at`` and
    ``torch._C._pop_torch_function_stack`` (private).

    Used as :func:`push_torch_function_mode`'s counterpart. No public API reads the mode stack. Checked on
    torch 2.13.0.

    Raises:
        CompatError: one of the three functions is missing.
    """
    try:
        length, at, pop = (torch._C._len_torch_function_stack, torch._C._get_function_stack_at,
                           torch._C._pop_torch_function_stack)
    except AttributeError as exc:
        raise CompatError("torch._C._len_torch_function_stack / _get_function_stack_at / _pop_torch_function_stack",
                          "switching the parameter-consumer trace off") from exc
    n = length()
    if n and at(n - 1) is mode:
        pop()
        return True
    return False


def sparse_stored_values(grad: torch.Tensor) -> torch.Tensor:
    """The stored values of a sparse COO tensor, coalesced or not: ``Tensor._values()`` (private).

    Used to scan averaged sparse gradients for NaN/inf, counting the values as stored. The public
    ``Tensor.values()`` raises on an uncoalesced tensor (a gradient straight from an embedding's backward, or
    one set by the user), and ``coalesce()`` would add duplicates and change the counts. Checked on torch
    2.13.0. Fallback when missing: ``grad.coalesce().values()``.
    """
    values = getattr(grad, "_values", None)
    return values() if values is not None else grad.coalesce().values()


# ------------------------------------------------------------------------------------------------- Lightning

def attached_trainer(module: Any) -> Any:
    """The Trainer ``module`` is attached to, or None (not a LightningModule, not attached, or used by Fabric).

    Public API: ``LightningModule.trainer`` (which raises when not attached) and ``LightningModule.fabric``;
    replaces the private ``module._trainer`` read. Does not import Lightning: a module cannot be a
    LightningModule before ``lightning.pytorch`` is imported. Checked on lightning 2.6.6.
    """
    pl = sys.modules.get("lightning.pytorch")
    if pl is None or not isinstance(module, pl.LightningModule) or module.fabric is not None:
        return None
    try:
        return module.trainer
    except RuntimeError:  # "... is not attached to a `Trainer`."
        return None


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside a Lightning ``LightningOptimizer`` or a Fabric-wrapped optimizer, else ``optimizer``.

    Public API: ``LightningOptimizer.optimizer``, ``lightning.fabric.wrappers.is_wrapped`` and the Fabric wrapper's
    ``optimizer``; replaces the private ``_optimizer`` read. Does not import Lightning. Checked on lightning 2.6.6.
    """
    pl = sys.modules.get("lightning.pytorch")
    wrappers = sys.modules.get("lightning.fabric.wrappers")
    if ((pl is not None and isinstance(optimizer, pl.core.optimizer.LightningOptimizer))
            or (wrappers is not None and wrappers.is_wrapped(optimizer))):
        return getattr(optimizer, "optimizer", optimizer)
    return optimizer


def mark_optimizer_stepped(optimizer: Any) -> None:
    """Record that ``optimizer`` stepped, as torch's LR schedulers' wrapper of ``optimizer.step`` does when it runs
    (it sets the private ``Optimizer._opt_called``), for a step the package runs without that wrapper (the sharded
    step runs the optimizer class's ``step`` on the shards). Without it the first ``scheduler.step()`` warns
    "Detected call of lr_scheduler.step() before optimizer.step()", which DDP does not. Set whether or not a
    scheduler wrapped the step (the package may have replaced ``step`` on the instance for the step; the flag is read
    by schedulers only). Checked on torch 2.13.0."""
    unwrap_optimizer(optimizer)._opt_called = True


def toggled_requires_grad(module: Any) -> Optional[dict]:
    """``parameter -> requires_grad`` as the user set it, for the parameters ``LightningModule.toggle_optimizer``
    switched off for one optimizer's step (None or empty: nothing toggled): ``LightningModule.
    _param_requires_grad_state`` (private).

    Used so that a parameter frozen for one step of a multi-optimizer ``training_step`` still counts as
    trainable. No public API gives it. Checked on lightning 2.6.6. Fallback when missing: None (the test
    checks that ``toggle_optimizer`` still sets it).
    """
    return getattr(module, "_param_requires_grad_state", None)


def layer_sync(strategy: Any) -> Any:
    """The strategy's layer-sync plugin (``Trainer(sync_batchnorm=True)`` sets one), or None:
    ``ParallelStrategy._layer_sync`` (private).

    Used to refuse ``sync_batchnorm=True`` on CPU with a clear message. No public getter. Checked on lightning
    2.6.6.

    Raises:
        CompatError: the strategy has no ``_layer_sync``.
    """
    try:
        return strategy._layer_sync
    except AttributeError as exc:
        raise CompatError("lightning.pytorch.strategies.ParallelStrategy._layer_sync",
                          "refusing sync_batchnorm=True on CPU") from exc


def start_method(strategy: Any) -> Optional[str]:
    """The start method (``"popen"``, ``"spawn"``, ``"fork"``, ``"forkserver"``) of a Lightning DDP strategy, or None
    for a strategy without one: ``DDPStrategy._start_method`` (private).

    Used to close the process group of a spawned fit (``app/train.py``) and to build the spawn launcher that
    brings results back (:class:`SpawnLauncherHook`). No public getter. Checked on lightning 2.6.6.
    """
    return getattr(strategy, "_start_method", None)


def set_backward_sync_control(strategy: Any, control: Any) -> None:
    """Install ``control`` as a Fabric strategy's ``fabric.no_backward_sync`` implementation:
    ``lightning.fabric.strategies.Strategy._backward_sync_control`` (private; the base class sets it to None).

    No public setter: Fabric's own strategies assign it in their constructors. Call after the base class's
    ``__init__``. Checked on lightning 2.6.6.

    Raises:
        CompatError: the strategy has no ``_backward_sync_control`` (Fabric would not read ours).
    """
    if not hasattr(strategy, "_backward_sync_control"):
        raise CompatError("lightning.fabric.strategies.Strategy._backward_sync_control", "fabric.no_backward_sync")
    strategy._backward_sync_control = control


class SigtermHooks(NamedTuple):
    """Lightning's SIGTERM handling (:func:`sigterm_hooks`).

    Attributes:
        composed: the class of the handler Lightning installs for SIGTERM (``_HandlersCompose``; its
            ``signal_handlers`` list holds the handlers it calls in turn).
        notifier: ``_SignalConnector._sigterm_notifier_fn`` (the function; the list holds it bound).
    """

    composed: type
    notifier: Callable


def sigterm_hooks() -> Optional[SigtermHooks]:
    """Lightning's composed SIGTERM handler class and its SIGTERM notifier:
    ``lightning.pytorch.trainer.connectors.signal_connector._HandlersCompose`` and
    ``_SignalConnector._sigterm_notifier_fn`` (private).

    Used to replace the notifier (it broadcasts inside the signal handler) with one that only sets the flag.
    No public API. Checked on lightning 2.6.6. Fallback when missing: None (the caller keeps Lightning's
    handler).
    """
    try:
        from lightning.pytorch.trainer.connectors.signal_connector import (  # noqa: PLC0415
            _HandlersCompose,
            _SignalConnector,
        )

        return SigtermHooks(_HandlersCompose, _SignalConnector._sigterm_notifier_fn)
    except (ImportError, AttributeError):
        return None


def signal_connector(trainer: Any) -> Any:
    """The trainer's signal connector (its ``received_sigterm`` flag is the one Lightning's per-step check
    reads; ``Trainer.received_sigterm`` has no setter): ``Trainer._signal_connector`` (private).

    Checked on lightning 2.6.6.

    Raises:
        CompatError: the trainer has no ``_signal_connector``.
    """
    try:
        return trainer._signal_connector
    except AttributeError as exc:
        raise CompatError("lightning.pytorch.Trainer._signal_connector", "stopping every rank after a SIGTERM") from exc


def forget_observed_children() -> int:
    """Empty the child list of every live ``_ChildProcessObserver`` thread that watches children; returns how many:
    ``lightning.fabric.strategies.launchers.subprocess_script._ChildProcessObserver`` and its
    ``_child_processes`` (private). The observer's next poll finds nothing to watch and ends the thread.

    Used by :func:`~lightning_pipedap.strategy.failure.disarm_child_observer`. No public API stops it. Checked
    on lightning 2.6.6. Fallback when missing: 0 (nothing stopped).
    """
    import threading  # noqa: PLC0415

    try:
        from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver  # noqa: PLC0415
    except ImportError:
        return 0
    stopped = 0
    for thread in threading.enumerate():
        if isinstance(thread, _ChildProcessObserver) and getattr(thread, "_child_processes", None):
            thread._child_processes = []
            stopped += 1
    return stopped


def loop_progress(loop: Any, prefix: str = "") -> dict[str, Any]:
    """Every progress tracker under Lightning's loop ``loop`` (its ``_Loop`` tree; trackers are
    ``_BaseProgress``), by attribute path (``"epoch_loop.batch_progress"``): what a failure sets back to the last
    completed step (:mod:`lightning_pipedap.strategy.failure_state`).

    Raises:
        CompatError: ``lightning.pytorch.loops.loop._Loop`` or ``...progress._BaseProgress`` moved.
    """
    loop_type = resolve("lightning.pytorch.loops.loop._Loop")
    progress_type = resolve("lightning.pytorch.loops.progress._BaseProgress")
    out: dict[str, Any] = {}
    for name, value in vars(loop).items():
        if isinstance(value, progress_type):
            out[prefix + name] = value
        elif isinstance(value, loop_type):
            out.update(loop_progress(value, f"{prefix}{name}."))
    return out


def batches_that_stepped(trainer: Any, value: Optional[int] = None) -> int:
    """The training epoch loop's ``_batches_that_stepped`` (the step logged metrics are keyed by); with ``value``,
    set it first (a failure setting the trainer back one step). Returns the value."""
    loop = trainer.fit_loop.epoch_loop
    if value is not None:
        loop._batches_that_stepped = value
    return int(loop._batches_that_stepped)


def _multiprocessing_launcher() -> type:
    """``lightning.pytorch.strategies.launchers._MultiProcessingLauncher`` (private): Lightning's launcher for
    ``start_method`` spawn / fork / forkserver. Checked on lightning 2.6.6.

    Raises:
        CompatError: the class is missing.
    """
    try:
        from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher  # noqa: PLC0415
    except ImportError as exc:
        raise CompatError("lightning.pytorch.strategies.launchers._MultiProcessingLauncher",
                          "bringing a spawned fit's results back") from exc
    return _MultiProcessingLauncher


def _backward_sync_control() -> type:
    """``lightning.fabric.strategies.strategy._BackwardSyncControl`` (private): the base class of a Fabric
    strategy's ``no_backward_sync`` implementation (one abstract method, ``no_backward_sync(module, enabled)``).
    Checked on lightning 2.6.6. Fallback when missing: a class with that abstract method (Fabric only calls it).
    """
    try:
        from lightning.fabric.strategies.strategy import _BackwardSyncControl  # noqa: PLC0415

        return _BackwardSyncControl
    except ImportError:
        import abc  # noqa: PLC0415

        class BackwardSyncControl(abc.ABC):
            @abc.abstractmethod
            def no_backward_sync(self, module: Any, enabled: bool) -> Any:
                """A context manager that turns gradient synchronisation off while ``enabled``."""

        return BackwardSyncControl


def _strategy_registry() -> type:
    """The class of Lightning's strategy registries, from the public instance ``lightning.fabric.strategies.
    STRATEGY_REGISTRY`` (Lightning names the class ``_StrategyRegistry``, a private name this avoids); for
    ``register_strategies`` annotations. Checked on lightning 2.6.6."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY  # noqa: PLC0415

    return type(STRATEGY_REGISTRY)


#: classes resolved on first access (module ``__getattr__``): Lightning is imported only then
_LAZY: dict[str, Callable[[], type]] = {
    "MultiProcessingLauncher": _multiprocessing_launcher,
    "BackwardSyncControl": _backward_sync_control,
    "StrategyRegistry": _strategy_registry,
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = _LAZY[name]()
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class SpawnLauncherHook:
    """Mixin for a Trainer strategy derived from Lightning's ``DDPStrategy``: its spawn launcher is replaced by
    :meth:`make_spawn_launcher`'s.

    Overrides ``DDPStrategy._configure_launcher`` (private; Lightning's accelerator connector calls it once, before
    the launch) and reads and sets ``_launcher`` (private; the public ``launcher`` property has no setter). No
    public hook runs between the launcher's creation and the launch. Checked on lightning 2.6.6. Nothing is
    replaced for a launcher other than ``_MultiProcessingLauncher`` (Fabric's, the subprocess launcher).
    """

    def make_spawn_launcher(self, start_method: Optional[str]) -> Any:
        """The launcher to use instead of Lightning's spawn launcher (None: keep Lightning's)."""
        return None

    def _configure_launcher(self) -> None:
        super()._configure_launcher()  # type: ignore[misc]
        if isinstance(getattr(self, "_launcher", None), _multiprocessing_launcher()):
            launcher = self.make_spawn_launcher(start_method(self))
            if launcher is not None:
                self._launcher = launcher


#: every private torch / Lightning function, method or class the package uses, by dotted name (:func:`resolve` finds
#: each); the private *attributes* it reads or sets on live objects (``_layer_sync``, ``_start_method``,
#: ``_launcher``, ``_backward_sync_control``, ``_signal_connector``, ``_child_processes``,
#: ``_param_requires_grad_state``) are checked on such objects by ``tests/test_compat.py``
PRIVATE_APIS: tuple[str, ...] = (
    "torch._C._distributed_c10d.Reducer._check_reducer_finalized",
    "torch.distributed.distributed_c10d._get_default_store",
    "torch.autograd.Variable._execution_engine.queue_callback",
    "torch._C._functorch.peek_interpreter_stack",
    "torch._dynamo.eval_frame.OptimizedModule",
    "torch._C.DisableTorchFunction",
    "torch._C._push_on_torch_function_stack",
    "torch._C._len_torch_function_stack",
    "torch._C._get_function_stack_at",
    "torch._C._pop_torch_function_stack",
    "torch.Tensor._values",
    "lightning.pytorch.strategies.launchers._MultiProcessingLauncher",
    "lightning.pytorch.strategies.DDPStrategy._configure_launcher",
    "lightning.fabric.strategies.strategy._BackwardSyncControl",
    "lightning.pytorch.trainer.connectors.signal_connector._HandlersCompose",
    "lightning.pytorch.trainer.connectors.signal_connector._SignalConnector._sigterm_notifier_fn",
    "lightning.fabric.strategies.launchers.subprocess_script._ChildProcessObserver",
    "lightning.pytorch.loops.loop._Loop",
    "lightning.pytorch.loops.progress._BaseProgress",
)

#: private attributes the package reads or sets on live torch / Lightning objects, by ``class.attribute`` (checked on
#: such objects by ``tests/test_compat.py``)
PRIVATE_ATTRIBUTES: tuple[str, ...] = (
    "lightning.pytorch.strategies.ParallelStrategy._layer_sync",
    "lightning.pytorch.strategies.DDPStrategy._start_method",
    "lightning.pytorch.strategies.DDPStrategy._launcher",
    "lightning.fabric.strategies.Strategy._backward_sync_control",
    "lightning.pytorch.Trainer._signal_connector",
    "lightning.fabric.strategies.launchers.subprocess_script._ChildProcessObserver._child_processes",
    "lightning.pytorch.LightningModule._param_requires_grad_state",
    "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop._batches_that_stepped",
    "torch.optim.Optimizer._opt_called",
)

#: private names the package used before and now reaches through public APIs: private name -> the entry here
REPLACED_BY_PUBLIC: dict[str, str] = {
    "lightning.pytorch.LightningModule._trainer": "attached_trainer (LightningModule.trainer / .fabric)",
    "lightning.pytorch.core.optimizer.LightningOptimizer._optimizer":
        "unwrap_optimizer (LightningOptimizer.optimizer, lightning.fabric.wrappers.is_wrapped)",
    "lightning.fabric.strategies.registry._StrategyRegistry": "StrategyRegistry (type(STRATEGY_REGISTRY))",
}
