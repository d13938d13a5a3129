"""``ModelHooks`` (``lightning_pipedap.strategy.hooks``) in process: which modules get a forward pre-hook,
gradient hooks, removal for DDP's reducer and reinstallation."""

import torch

from lightning_pipedap.strategy.hooks import ModelHooks


class Scale(torch.nn.Module):
    """No parameter of its own: reads another module's weight (a first consumer without parameters)."""

    def __init__(self, source: torch.nn.Linear) -> None:
        super().__init__()
        object.__setattr__(self, "source", source)  # not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.source.weight.sum()


def _model():
    lin1, lin2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    return torch.nn.Sequential(lin1, torch.nn.ReLU(), torch.nn.Dropout(0.0), Scale(lin1), lin2)


def _run(model, x):
    calls, grads = [], []
    hooks = ModelHooks(model)
    hooks.install([p for p in model.parameters()], grads.append, lambda m, args: calls.append(type(m).__name__))
    model(x).sum().backward()
    return hooks, calls, grads


def test_only_modules_holding_parameters_get_forward_hooks_and_every_parameter_a_gradient_hook():
    model = _model()
    hooks, calls, grads = _run(model, torch.ones(3, 4))
    assert calls == ["Sequential", "Linear", "Linear"]  # no hook on ReLU, Dropout or the parameterless Scale
    assert len(grads) == 4
    hooks.add_modules([model[3]])  # the trace found Scale to be lin1.weight's first consumer
    hooks.add_modules([model[3]])  # (once)
    calls.clear()
    model(torch.ones(3, 4))
    assert calls == ["Sequential", "Linear", "Scale", "Linear"]
    hooks.close()


def test_remove_and_reinstall_keep_the_same_hooks_and_modules_added_meanwhile():
    model = _model()
    hooks, calls, grads = _run(model, torch.ones(3, 4))
    hooks.remove()  # DDP's reducer runs now
    hooks.add_modules([model[3]])  # recorded, not hooked while removed
    calls.clear(), grads.clear()
    model(torch.ones(3, 4)).sum().backward()
    assert calls == [] and grads == []
    hooks.reinstall()
    hooks.reinstall()  # (idempotent)
    model(torch.ones(3, 4)).sum().backward()
    assert calls == ["Sequential", "Linear", "Scale", "Linear"] and len(grads) == 4
    hooks.close()
    calls.clear(), grads.clear()
    model(torch.ones(3, 4)).sum().backward()
    assert calls == [] and grads == []


def test_train_wrappers_run_before_train_and_are_removed_at_close():
    model = _model()
    hooks = ModelHooks(model)
    seen = []
    hooks.wrap_train(model[4], lambda m: seen.append(m.training))
    model.train(False)  # (the parent calls each child's train)
    assert seen == [True] and not model[4].training
    hooks.close()
    model.train(True)
    assert seen == [True] and "train" not in model[4].__dict__
