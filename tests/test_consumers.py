"""The op-level consumer trace (``lightning_pipedap.probe.consumers``): which module's forward is
running when an op first reads each parameter. Single process, no Lightning."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_pipedap.probe.consumers import ConsumerTrace, ModuleStack, consumer_order


def _trace(model: nn.Module, fn):
    params = list(model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    modules = {id(m): n for n, m in model.named_modules()}
    stack = ModuleStack(model)
    stack.install()
    try:
        with ConsumerTrace(params, stack) as trace:
            fn()
    finally:
        stack.remove()
    owners = {names[id(params[i])]: (None if c.module is None else modules[id(c.module)], c.in_transform)
              for i, c in trace.first.items()}
    order = [names[id(params[i])] for i in consumer_order(len(params), trace.first)]
    return owners, order


def test_multihead_attention_out_proj_is_consumed_by_the_attention_module():
    """``nn.MultiheadAttention.forward`` reads ``out_proj.weight`` itself: ``out_proj.forward`` never runs."""
    model = nn.Sequential(nn.Linear(8, 8), nn.MultiheadAttention(8, 2, batch_first=True))
    x = torch.randn(2, 3, 8)

    def run():
        h = model[0](x)
        model[1](h, h, h)

    owners, order = _trace(model, run)
    assert owners["1.out_proj.weight"] == ("1", False)
    assert owners["1.in_proj_weight"] == ("1", False)
    assert owners["0.weight"] == ("0", False)
    assert order[:2] == ["0.weight", "0.bias"]


class Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return F.linear(x, self.child.weight) * self.scale  # the child's forward never runs


def test_parent_reading_a_child_weight_and_use_outside_any_forward():
    model = Parent()
    x = torch.randn(3, 4)

    def run():
        y = model(x)
        (y + model.child.bias).sum()  # functional use outside every module forward (a training_step)

    owners, order = _trace(model, run)
    assert owners["child.weight"] == ("", False)
    assert owners["scale"] == ("", False)
    assert owners["child.bias"] == (None, False)
    assert "unused.weight" not in owners
    assert order == ["child.weight", "scale", "child.bias", "unused.weight", "unused.bias"]


def test_parameters_read_inside_a_torch_func_transform_are_flagged():
    """A physics-informed loss: ``vmap(jacrev(net))`` over inputs; an in-place update cannot happen there."""
    net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(5, 2)

    def run():
        torch.func.vmap(torch.func.jacrev(lambda z: net(z).squeeze(-1)))(x)

    owners, _ = _trace(net, run)
    assert owners["0.weight"] == ("0", True)
    assert owners["2.weight"] == ("2", True)


def test_lstm_flat_weights_passed_as_a_list_are_seen():
    lstm = nn.LSTM(4, 4, batch_first=True)
    owners, _ = _trace(lstm, lambda: lstm(torch.randn(2, 3, 4)))
    assert set(owners) == {n for n, _ in lstm.named_parameters()}
    assert all(v == ("", False) for v in owners.values())


def test_on_consume_runs_before_the_op():
    """The guard applies a pending update in ``on_consume``: the op must see the new value."""
    lin = nn.Linear(2, 1, bias=False)
    nn.init.ones_(lin.weight)
    stack = ModuleStack(lin)

    def update(i, grad_read):
        with torch._C.DisableTorchFunction(), torch.no_grad():
            lin.weight.fill_(3.0)

    stack.install()
    try:
        with ConsumerTrace([lin.weight], stack, on_consume=update):
            y = lin(torch.ones(1, 2))
    finally:
        stack.remove()
    assert float(y.detach()) == 6.0
    assert stack.top() is None


def test_grad_reads_and_aliases_are_reported():
    """A read of ``param.grad`` is flagged; a read of an alias (optimizer state) counts as the parameter's."""
    lin = nn.Linear(2, 1)
    lin.weight.grad = torch.ones_like(lin.weight)
    state = torch.zeros(3)
    stack = ModuleStack(lin)
    seen = []
    with ConsumerTrace([lin.weight, lin.bias], stack, on_consume=lambda i, g: seen.append((i, g)),
                       aliases={id(state): 1}):
        lin.weight.grad.sum()
        state.add(1)
    assert seen[0] == (0, True) and (1, False) in seen


def test_metadata_reads_are_no_consumption():
    """``LightningModule.toggle_optimizer`` reads and sets ``requires_grad`` of every parameter at the start of a
    manual ``training_step``, outside any forward; ``zero_grad`` and shape checks read no data either: the first
    consumer stays the module whose forward reads the weights."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    x = torch.randn(3, 4)

    def run():
        state = {p: p.requires_grad for p in model.parameters()}
        for p in model.parameters():
            p.requires_grad = False
            assert p.shape == p.size() and p.dim() in (1, 2) and p.numel() > 0 and p.is_leaf
        for p, rg in state.items():
            p.requires_grad_(rg)
        model(x).sum()

    owners, order = _trace(model, run)
    assert owners == {"0.weight": ("0", False), "0.bias": ("0", False), "1.weight": ("1", False),
                      "1.bias": ("1", False)}
    assert order == ["0.weight", "0.bias", "1.weight", "1.bias"]
