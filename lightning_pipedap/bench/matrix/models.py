"""The benchmark models: network presets (:data:`~lightning_pipedap.bench.matrix.spec.PRESETS`) built by
:func:`build_net`, and the lean LightningModule every strategy trains (:class:`BenchModule`)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_pipedap.bench.matrix.spec import MODELS, PRESETS, SIZES

#: ``make_batch(n, generator) -> (inputs, targets)`` of a preset
BatchMaker = Callable[[int, torch.Generator], "tuple[torch.Tensor, torch.Tensor]"]


def _mlp(p: dict) -> tuple[nn.Module, list, BatchMaker]:
    layers: list[nn.Module] = []
    for i in range(p["depth"]):
        layers += [nn.Linear(p["features"] if i == 0 else p["width"], p["width"]), nn.ReLU()]
    net = nn.Sequential(*layers, nn.Linear(p["width"], 10))

    def make_batch(n: int, g: torch.Generator):
        return torch.randn(n, p["features"], generator=g), torch.randint(0, 10, (n,), generator=g)

    return net, [m for m in net if isinstance(m, nn.Linear)], make_batch


def _resnet(p: dict) -> tuple[nn.Module, list, BatchMaker]:
    from lightning_pipedap.models import ResNet

    net = ResNet("basic", p["layers"], 10, p["width"], 3)

    def make_batch(n: int, g: torch.Generator):
        return torch.randn(n, 3, p["image"], p["image"], generator=g), torch.randint(0, 10, (n,), generator=g)

    return net, [net.stem] + [b for stage in net.stages for b in stage] + [net.fc], make_batch


def _gpt(p: dict) -> tuple[nn.Module, list, BatchMaker]:
    from lightning_pipedap.models import GPT

    net = GPT(256, p["block"], p["n_layer"], p["n_head"], p["n_embd"], 0.0)

    def make_batch(n: int, g: torch.Generator):
        seq = torch.randint(0, 256, (n, p["block"] + 1), generator=g)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    return net, [m for m in net.modules() if type(m).__name__ == "Block"], make_batch


_BUILDERS = {"mlp": _mlp, "resnet": _resnet, "gpt": _gpt}


#: the model name of the profile-replay sleep model (:mod:`lightning_pipedap.bench.replay`); it has no
#: preset: its ``options`` (a :class:`~lightning_pipedap.bench.replay.model.ReplayOptions` as a dict) say
#: which profile it replays at which scales
REPLAY_MODEL = "replay"


def build_net(model: str, size: str, options: dict | None = None) -> tuple[nn.Module, list, BatchMaker]:
    """``(net, shard_units, make_batch)`` for a model preset, or for :data:`REPLAY_MODEL` the sleep model
    that ``options`` describes (``size`` is then ignored; see
    :func:`~lightning_pipedap.bench.replay.model.build_replay_net`).

    ``shard_units`` are the modules FSDP2 shards one by one (then the whole net); ``make_batch(n, g)``
    returns ``n`` samples ``(inputs, targets)`` drawn from generator ``g``: mlp ``(n, features)`` floats and
    ``(n,)`` class ids; resnet ``(n, 3, H, W)`` images and ``(n,)`` class ids; gpt ``(n, T)`` token ids and
    ``(n, T)`` next-token targets.

    Raises:
        ValueError: unknown model or size (naming the valid choices), or :data:`REPLAY_MODEL` without options.
    """
    if model == REPLAY_MODEL:
        if not options:
            raise ValueError(f"model {REPLAY_MODEL!r} needs options (profile, size_scale, time_scale)")
        from lightning_pipedap.bench.replay.model import build_replay_net

        return build_replay_net(options)
    if model not in PRESETS:
        raise ValueError(f"unknown model {model!r}; valid: {', '.join(MODELS)}")
    if size not in PRESETS[model]:
        raise ValueError(f"unknown size {size!r}; valid: {', '.join(SIZES)}")
    return _BUILDERS[model](PRESETS[model][size])


#: ``--optimizer`` choices -> (class, default keyword arguments): ``sgd`` (the matrix's optimizer since the start:
#: SGD with momentum 0.9, lr 0.01) and ``adam`` (``torch.optim.Adam``, lr 1e-3: two fp32 state tensors per
#: parameter, the optimizer whose state and step the sharded optimizer step divides by N)
OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
}
DEFAULT_OPTIMIZER = "sgd"


def check_optimizer(name: str) -> str:
    """``name`` if it is an :data:`OPTIMIZERS` key.

    Raises:
        ValueError: an unknown name, naming the valid ones.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")
    return name


def make_optimizer(name: str, params: Iterable[torch.Tensor], lr: Optional[float] = None) -> torch.optim.Optimizer:
    """The :data:`OPTIMIZERS` optimizer ``name`` over ``params`` (``lr``: None = the optimizer's default there).

    Raises:
        ValueError: an unknown name, naming the valid ones.
    """
    cls, kwargs = OPTIMIZERS[check_optimizer(name)]
    return cls(params, **dict(kwargs, **({} if lr is None else {"lr": lr})))


class BenchModule(pl.LightningModule):
    """A lean LightningModule around a network: cross-entropy loss, one optimizer of :data:`OPTIMIZERS` (SGD with
    momentum 0.9 by default), no logging; ``configure_model`` applies FSDP2 ``fully_shard(reshard_after_forward=False)``
    to each of ``units`` and then to the network when the trainer's strategy is Lightning's ``ModelParallelStrategy``.

    Args:
        net: the network (``net(inputs)`` -> logits, last dimension = classes).
        units: the modules FSDP2 shards one by one (kept as a plain list, not registered twice).
        lr: learning rate; None = the optimizer's default in :data:`OPTIMIZERS`.
        optimizer: an :data:`OPTIMIZERS` name.

    Raises:
        ValueError: an unknown optimizer, naming the valid ones.
    """

    def __init__(self, net: nn.Module, units: list, lr: Optional[float] = None,
                 optimizer: str = DEFAULT_OPTIMIZER) -> None:
        super().__init__()
        self.net = net
        self._units = list(units)
        self._lr = lr
        self.optimizer_name = check_optimizer(optimizer)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def configure_model(self) -> None:
        from lightning.pytorch.strategies import ModelParallelStrategy

        if not isinstance(self.trainer.strategy, ModelParallelStrategy):
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for m in self._units:
            fully_shard(m, mesh=mesh, reshard_after_forward=False)
        fully_shard(self.net, mesh=mesh, reshard_after_forward=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.optimizer_name, self.parameters(), self._lr)


def make_module(model: str, size: str, lr: Optional[float] = None, options: dict | None = None,
                optimizer: str = DEFAULT_OPTIMIZER) -> BenchModule:
    """:class:`BenchModule` around :func:`build_net`'s network of the preset (or of ``options`` for
    :data:`REPLAY_MODEL`), training with ``optimizer`` (an :data:`OPTIMIZERS` name; ``lr`` None = its default).

    Raises:
        ValueError: unknown model, size or optimizer.
    """
    net, units, _ = build_net(model, size, options)
    return BenchModule(net, units, lr, optimizer)


def first_layer_numel(net: nn.Module) -> int:
    """Parameters of the first module (registration order, which is forward order for the bench models)
    that owns parameters: its gradient is finished last in backward and needed first in the next forward.

    Raises:
        ValueError: the network has no parameters.
    """
    for m in net.modules():
        own = list(m.parameters(recurse=False))
        if own:
            return sum(p.numel() for p in own)
    raise ValueError(f"{type(net).__name__} has no parameters")
