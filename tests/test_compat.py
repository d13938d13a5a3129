"""``lightning_pipedap.compat``: every private torch / Lightning API the package uses resolves on the installed
versions and still behaves as the package expects; no other module of the package reaches a private torch or
Lightning name (issue 29, item 4).

A failure here after upgrading torch or Lightning names the private API that moved: update its entry in
``lightning_pipedap/compat.py`` (and the versions it was checked on).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pathlib
import signal
import textwrap
import threading
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

from lightning_pipedap import compat

PACKAGE = pathlib.Path(compat.__file__).resolve().parent
#: top-level packages whose private names must go through compat
FOREIGN = ("torch", "lightning", "lightning_fabric", "pytorch_lightning")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


# ------------------------------------------------------------------------------ every entry resolves and works

@pytest.mark.parametrize("api", compat.PRIVATE_APIS)
def test_every_private_api_resolves(api: str) -> None:
    try:
        compat.resolve(api)
    except compat.CompatError as exc:
        pytest.fail(f"private API {api} moved in this torch/Lightning: {exc}")


@pytest.mark.parametrize("attribute", compat.PRIVATE_ATTRIBUTES)
def test_every_private_attribute_is_still_set(attribute: str) -> None:
    """Each private attribute compat reads or sets exists on a freshly built object of its class."""
    owner, name = attribute.rsplit(".", 1)
    obj = _instance_of(owner)
    assert hasattr(obj, name), f"{owner} no longer has the private attribute {name} ({attribute}): update compat.py"


def _instance_of(owner: str) -> Any:
    """A cheap live instance of the class ``owner`` (dotted), set up as far as the package uses it."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    cls = compat.resolve(owner)
    if owner == "torch.optim.Optimizer":  # (set by an LR scheduler's wrapper of step when the step runs)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        opt.step()
        return opt
    if owner.endswith("._ChildProcessObserver"):
        return cls(main_pid=os.getpid(), child_processes=[], sleep_period=60)  # (not started)
    if owner == "lightning.pytorch.Trainer":
        return _trainer()
    if owner.endswith("._TrainingEpochLoop"):
        return _trainer().fit_loop.epoch_loop
    if owner == "lightning.pytorch.LightningModule":
        return _toggled_module()
    if owner == "lightning.fabric.strategies.Strategy":
        cls = compat.resolve("lightning.fabric.strategies.DDPStrategy")
    elif owner == "lightning.pytorch.strategies.ParallelStrategy":
        cls = compat.resolve("lightning.pytorch.strategies.DDPStrategy")
    strategy = cls(cluster_environment=LightningEnvironment())
    if hasattr(strategy, "_configure_launcher"):
        strategy._configure_launcher()  # (sets _launcher, as Lightning's accelerator connector does)
    return strategy


def _trainer(**kwargs: Any) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, **kwargs)


def _toggled_module() -> Any:
    """A LightningModule with two optimizers, the first toggled (``toggle_optimizer``)."""
    import lightning.pytorch as pl

    module = pl.LightningModule()
    module.a, module.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt_a = torch.optim.SGD(module.a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(module.b.parameters(), lr=0.1)
    trainer = _trainer()
    trainer.strategy.optimizers = [opt_a, opt_b]
    module.trainer = trainer
    module.toggle_optimizer(opt_a)
    return module


def test_compat_error_names_the_api_and_the_versions() -> None:
    with pytest.raises(compat.CompatError) as info:
        compat.resolve("torch._C._no_such_private_function")
    text = str(info.value)
    assert "torch._C._no_such_private_function" in text and torch.__version__ in text
    assert compat.CHECKED_ON["torch"] in text and compat.CHECKED_ON["lightning"] in text
    assert isinstance(info.value, RuntimeError) and info.value.api == "torch._C._no_such_private_function"


def test_lazy_classes_resolve_and_unknown_names_raise() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    assert isinstance(STRATEGY_REGISTRY, compat.StrategyRegistry)
    assert isinstance(StrategyRegistry, compat.StrategyRegistry)
    assert compat.BackwardSyncControl is compat.resolve("lightning.fabric.strategies.strategy._BackwardSyncControl")
    assert compat.MultiProcessingLauncher is compat.resolve(
        "lightning.pytorch.strategies.launchers._MultiProcessingLauncher")
    with pytest.raises(AttributeError, match="no_such_name"):
        compat.no_such_name  # noqa: B018


@pytest.fixture
def gloo_world_of_one() -> Iterator[None]:
    """The default process group, gloo, one rank, on an in-memory store (destroyed afterwards)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.skippable = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        return self.used(x) if skip else self.skippable(self.used(x))


def test_reducer_finalized_and_default_store(gloo_world_of_one: None) -> None:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(_TwoLayers())
    model(torch.randn(2, 3), skip=False).sum().backward()
    assert compat.reducer_finalized(model.reducer)
    model(torch.randn(2, 3), skip=True).sum().backward()  # (``skippable`` gets no gradient: its bucket stalls)
    assert not compat.reducer_finalized(model.reducer)

    store = compat.default_store()
    store.set("pipedap/compat", "1")
    assert store.get("pipedap/compat") == b"1"


def test_queue_autograd_callback_runs_when_backward_ends() -> None:
    events: list[str] = []
    w = torch.randn(3, requires_grad=True)

    def hook(grad: torch.Tensor) -> None:
        events.append("hook")
        compat.queue_autograd_callback(lambda: events.append("end"))

    w.register_hook(hook)
    (w * 2).sum().backward()
    events.append("returned")
    assert events == ["hook", "end", "returned"]


def test_transform_active_inside_torch_func_only() -> None:
    seen: list[bool] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append(compat.transform_active())
        return x * 2

    assert not compat.transform_active()
    torch.func.vmap(f)(torch.ones(2, 3))
    torch.func.grad(lambda x: f(x).sum())(torch.ones(3))
    assert seen == [True, True]


def test_compiled_module_type_is_what_torch_compile_returns() -> None:
    wrapped = torch.compile(torch.nn.Linear(2, 2), backend="eager")
    assert isinstance(wrapped, compat.compiled_module_type())
    assert not isinstance(torch.nn.Linear(2, 2), compat.compiled_module_type())


class _Recorder(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_torch_function_mode_push_pop_and_disable() -> None:
    mode, x = _Recorder(), torch.ones(2)
    assert not compat.pop_torch_function_mode(mode)  # (not on the stack)
    compat.push_torch_function_mode(mode)
    try:
        torch.add(x, 1)
        assert mode.calls == 1
        with compat.disable_torch_function():
            torch.add(x, 1)
        assert mode.calls == 1  # (handling was off)
        inner = _Recorder()
        with inner:
            assert not compat.pop_torch_function_mode(mode)  # (not the innermost)
    finally:
        assert compat.pop_torch_function_mode(mode)
    torch.add(x, 1)
    assert mode.calls == 1 and not compat.pop_torch_function_mode(mode)


def test_sparse_stored_values_of_an_uncoalesced_tensor() -> None:
    g = torch.sparse_coo_tensor([[1, 1, 3]], [[float("nan"), 1.0], [2.0, 3.0], [float("inf"), 4.0]], (5, 2),
                                check_invariants=True)
    assert not g.is_coalesced()
    values = compat.sparse_stored_values(g)
    assert values.shape == (3, 2) and int(values.isnan().sum()) == 1 and int(values.isinf().sum()) == 1
    c = g.coalesce()
    torch.testing.assert_close(compat.sparse_stored_values(c), c.values(), equal_nan=True)


# -------------------------------------------------------------------------------------------- Lightning entries

def test_attached_trainer_matches_the_private_attribute() -> None:
    import lightning.pytorch as pl

    module = pl.LightningModule()
    assert compat.attached_trainer(module) is None is module._trainer
    trainer = _trainer()
    module.trainer = trainer
    assert compat.attached_trainer(module) is trainer is module._trainer
    assert compat.attached_trainer(torch.nn.Linear(2, 2)) is None
    assert compat.attached_trainer(None) is None
    fabric_module = pl.LightningModule()
    fabric = type("FakeFabric", (), {})()  # (under Fabric: ``.trainer`` is a shim, ``_trainer`` None)
    fabric_module.fabric = fabric
    assert compat.attached_trainer(fabric_module) is None is fabric_module._trainer


def test_toggled_requires_grad_is_what_toggle_optimizer_saves() -> None:
    module = _toggled_module()
    toggled = compat.toggled_requires_grad(module)
    assert toggled and all(p in toggled for p in module.b.parameters())
    assert not any(p.requires_grad for p in module.b.parameters()) and all(toggled[p] for p in module.b.parameters())
    assert compat.toggled_requires_grad(torch.nn.Linear(2, 2)) is None


def test_mark_optimizer_stepped_silences_the_scheduler_as_a_real_step_does() -> None:
    import warnings

    def first_scheduler_step(mark: bool) -> list[str]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        if mark:
            compat.mark_optimizer_stepped(opt)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            sched.step()
        return [str(w.message) for w in seen if "lr_scheduler.step()" in str(w.message)]

    assert first_scheduler_step(False) and not first_scheduler_step(True)
    compat.mark_optimizer_stepped(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))  # (no scheduler)


def test_unwrap_optimizer() -> None:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    wrapped = LightningOptimizer(opt)
    assert compat.unwrap_optimizer(opt) is opt
    assert compat.unwrap_optimizer(wrapped) is opt is wrapped._optimizer


def test_layer_sync_and_start_method() -> None:
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    assert compat.layer_sync(DDPStrategy()) is None
    assert compat.layer_sync(_trainer(strategy=DDPStrategy(), sync_batchnorm=True).strategy) is not None
    assert compat.start_method(DDPStrategy(start_method="spawn", cluster_environment=LightningEnvironment())) == "spawn"
    assert compat.start_method(object()) is None


def test_spawn_launcher_hook_replaces_only_the_spawn_launcher() -> None:
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    class Hooked(compat.SpawnLauncherHook, DDPStrategy):
        def make_spawn_launcher(self, start_method: Any) -> Any:
            return ("mine", start_method)

    spawned = Hooked(start_method="spawn", cluster_environment=LightningEnvironment())
    spawned._configure_launcher()  # (what Lightning's accelerator connector calls)
    assert spawned.launcher == ("mine", "spawn")
    popen = Hooked(cluster_environment=LightningEnvironment())
    popen._configure_launcher()
    assert type(popen.launcher).__name__ == "_SubprocessScriptLauncher"


def test_set_backward_sync_control_is_what_fabric_reads() -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.fabric.strategies import DDPStrategy

    strategy, control = DDPStrategy(cluster_environment=LightningEnvironment()), object()
    compat.set_backward_sync_control(strategy, control)
    assert strategy._backward_sync_control is control
    assert "_backward_sync_control" in inspect.getsource(Fabric.no_backward_sync)
    with pytest.raises(compat.CompatError, match="_backward_sync_control"):
        compat.set_backward_sync_control(object(), control)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signal handlers: main thread")
def test_sigterm_hooks_match_what_lightning_installs() -> None:
    hooks = compat.sigterm_hooks()
    assert hooks is not None
    trainer = _trainer()
    connector = compat.signal_connector(trainer)
    before = signal.getsignal(signal.SIGTERM)
    connector.register_signal_handlers()
    try:
        handler = signal.getsignal(signal.SIGTERM)
        assert isinstance(handler, hooks.composed)
        assert any(getattr(h, "__func__", None) is hooks.notifier for h in handler.signal_handlers)
        assert not trainer.received_sigterm
        connector.received_sigterm = True  # (what route_sigterm's handler sets)
        assert trainer.received_sigterm
    finally:
        connector.teardown()
        signal.signal(signal.SIGTERM, before)


def test_forget_observed_children_without_an_observer() -> None:
    assert compat.forget_observed_children() == 0


# ------------------------------------------------------------------- no private torch / Lightning use elsewhere

def _package_files() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "compat.py" or p.parent != PACKAGE)


def _wrapped_names() -> set[str]:
    """The private names compat wraps or replaced (last parts and private parts of every dotted entry)."""
    out: set[str] = set()
    for api in (*compat.PRIVATE_APIS, *compat.PRIVATE_ATTRIBUTES, *compat.REPLACED_BY_PUBLIC):
        out.update(part for part in api.split(".") if _private(part))
    return out


def _foreign_roots(tree: ast.Module) -> set[str]:
    """Names the module binds to torch / Lightning modules or objects (``torch``, ``dist``, ``pl``, ``Tensor``...)."""
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in FOREIGN:
                    roots.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in FOREIGN:
            roots.update(a.asname or a.name for a in node.names)
    return roots


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _own(receiver: ast.AST) -> bool:
    """``self`` / ``cls`` / ``super()``: the package's own attributes, unless the class derives from a torch/Lightning
    class (:func:`test_no_class_reaches_a_private_name_of_its_torch_or_lightning_base` checks those)."""
    if isinstance(receiver, ast.Call):
        return isinstance(receiver.func, ast.Name) and receiver.func.id == "super"
    return isinstance(receiver, ast.Name) and receiver.id in ("self", "cls")


def _static_findings(path: pathlib.Path, wrapped: set[str]) -> Iterator[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots = _foreign_roots(tree)
    where = path.relative_to(PACKAGE.parent)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
            if isinstance(node, ast.ImportFrom) and (node.level or module.split(".")[0] not in FOREIGN):
                continue
            for a in node.names:
                full = f"{module}.{a.name}" if module else a.name
                if full.split(".")[0] in FOREIGN and any(_private(part) for part in full.split(".")):
                    yield f"{where}:{node.lineno}: imports {full}"
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if _root(node.value) in roots:
                yield f"{where}:{node.lineno}: {ast.unparse(node)}"
            elif node.attr in wrapped and not _own(node.value):
                yield f"{where}:{node.lineno}: {ast.unparse(node)} (a private name compat wraps)"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            if _root(node.args[0]) in roots or (node.args[1].value in wrapped and not _own(node.args[0])):
                yield f"{where}:{node.lineno}: {ast.unparse(node)}"


def test_no_module_but_compat_uses_a_private_torch_or_lightning_name() -> None:
    """Imports of private torch/Lightning modules or names, ``torch._C...``-style attribute chains from any name
    bound to torch/Lightning, and the private names compat wraps read from another object
    (``trainer._signal_connector``, ``getattr(m, "_trainer")``, ``g._values()``...) appear in ``compat.py`` only."""
    wrapped = _wrapped_names()
    by_line: dict[str, str] = {}  # (one finding per line: the longest, ``torch._C._x`` rather than ``torch._C``)
    for p in _package_files():
        for f in _static_findings(p, wrapped):
            line = f.split(": ", 1)[0]
            by_line[line] = max(by_line.get(line, ""), f, key=len)
    found = list(by_line.values())
    assert not found, ("private torch/Lightning APIs used outside lightning_pipedap/compat.py (add an entry there and "
                       "call it):\n" + "\n".join(found))


def _private_names_of(base: type, cache: dict[type, set[str]]) -> set[str]:
    """Private names a torch/Lightning class defines: its class attributes and the ``self._x`` its source assigns."""
    if base not in cache:
        names = {n for n in vars(base) if _private(n)}
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError, SyntaxError):
            tree = None
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and _private(node.attr):
                names.add(node.attr)
        cache[base] = names
    return cache[base]


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_class_reaches_a_private_name_of_its_torch_or_lightning_base() -> None:
    """``self._x`` / ``super()._x`` / ``def _x`` in a class of the package (or in a mixin of one) where ``_x`` is a
    private name of a torch/Lightning base class (Lightning's ``_layer_sync``, ``_launcher``, ...)."""
    modules = {p: importlib.import_module(_module_name(p)) for p in _package_files()}
    foreign_bases: dict[type, set[type]] = {}  # a package class (or mixin) -> the torch/Lightning classes above it
    for module in modules.values():
        for cls in vars(module).values():
            if inspect.isclass(cls) and cls.__module__.startswith(PACKAGE.name):
                theirs = {b for b in cls.__mro__ if b.__module__.split(".")[0] in FOREIGN}
                for k in cls.__mro__:
                    if k.__module__.startswith(PACKAGE.name):
                        foreign_bases.setdefault(k, set()).update(theirs)
    cache: dict[type, set[str]] = {}
    found = []
    for path, module in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            cls = getattr(module, node.name, None) if isinstance(node, ast.ClassDef) else None
            if not inspect.isclass(cls) or not foreign_bases.get(cls):
                continue
            theirs = set().union(*(_private_names_of(b, cache) for b in foreign_bases[cls]))
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name in theirs:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{sub.lineno}: {node.name}: def {sub.name}")
                elif isinstance(sub, ast.Attribute) and sub.attr in theirs and (
                        (isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls"))
                        or (isinstance(sub.value, ast.Call) and isinstance(sub.value.func, ast.Name)
                            and sub.value.func.id == "super")):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{sub.lineno}: {node.name}: {ast.unparse(sub)}")
    assert not found, ("private names of torch/Lightning base classes used outside lightning_pipedap/compat.py:\n"
                       + "\n".join(found))
