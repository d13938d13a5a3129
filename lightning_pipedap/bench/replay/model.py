"""The sleep model of a published profile: one layer per profile layer, real parameters of that layer's
size, forward and backward that *sleep* for the layer's ``t_f`` / ``t_b``.

On a GPU the training thread launches a layer's kernels and goes on while they run; ``time.sleep``
releases the GIL the same way (:class:`VirtualStream` keeps the time line of such a stream), so the
communication threads of DDP, FSDP2 and pipedap run during the "compute" as they would beside
asynchronous kernels. The layers' gradients are real tensors of
the profile's sizes, so every strategy moves the profile's bytes over the testbed's links.

Each layer ``i`` holds one flat fp32 parameter ``w`` of ``numel_i`` elements and maps the activation
``x`` (shape ``(batch, FEATURES)``) to ``x * (1 + q)`` with ``q = ||w||² / (2 numel_i)`` (a scalar).
Its backward returns ``dL/dx = g (1 + q)`` and ``dL/dw = Σ(g x) · w / numel_i``: one read of ``w``
forward and one scaled copy backward, distinct values per element (so a misplaced slice of a bucket
shows up in a parity check), and a loss that depends on every parameter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from lightning_pipedap.plan.profile import LayerProfile, ModelProfile, load_profile

#: activation width of the sleep model (= number of classes of its cross-entropy loss)
FEATURES = 10
#: standard deviation of the initial weights
INIT_STD = 0.02

BatchMaker = Callable[[int, torch.Generator], "tuple[torch.Tensor, torch.Tensor]"]


@dataclass(frozen=True)
class ReplayOptions:
    """What the sleep model replays (plain data; travels in the matrix worker's JSON spec).

    Attributes:
        profile: a shared profile name (``"vgg16"``, ...) or a profile file (see
            :func:`~lightning_pipedap.plan.profile.load_profile`).
        size_scale: factor on every layer's element count (``numel = max(1, round(numel * size_scale))``);
            1 = the profile's real sizes.
        time_scale: factor on every ``t_f`` / ``t_b`` (s).
        repaired: read the reference profile's ``layers_repaired`` (every tensor counted) instead of its
            ``layers`` (the reference's merge, which drops a few tensors; see the profiles' README).

    Raises:
        ValueError: a scale that is not a finite number > 0.
    """

    profile: str
    size_scale: float = 1.0
    time_scale: float = 1.0
    repaired: bool = True

    def __post_init__(self) -> None:
        for name in ("size_scale", "time_scale"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v < float("inf")):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")

    @staticmethod
    def from_dict(d: dict) -> "ReplayOptions":
        """Inverse of ``dataclasses.asdict``."""
        return ReplayOptions(**d)


def replay_profile(opts: ReplayOptions) -> ModelProfile:
    """The profile the sleep model of ``opts`` replays: the published profile with element counts times
    ``size_scale`` (at least 1 per layer; fp32, 4 bytes each) and times times ``time_scale``."""
    base = load_profile(opts.profile, repaired=opts.repaired)
    layers = []
    for layer in base.layers:
        numel = layer.numel if layer.numel is not None else layer.nbytes // 4
        layers.append(LayerProfile.from_numel(layer.name, max(1, round(numel * opts.size_scale)), 4,
                                              layer.t_f * opts.time_scale, layer.t_b * opts.time_scale))
    return ModelProfile(base.name, tuple(layers), base.t_update * opts.time_scale,
                        dict(base.meta, size_scale=opts.size_scale, time_scale=opts.time_scale))


#: how far (s) the training thread may run ahead of the virtual stream before it sleeps
LOOKAHEAD_S = 1e-3


class VirtualStream:
    """The time line of a GPU stream that the training thread feeds with kernels of known durations.

    ``run(t)`` queues ``t`` s of work: the stream finishes it at ``end = max(end, now) + t`` (it starts when
    the previous kernel ends, or now if the stream is idle) and the caller sleeps until ``end - lookahead_s``.
    So the Python overhead between two layers overlaps the layers' time, as a CPU that launches asynchronous
    kernels overlaps its launches with their execution, and the overshoot of one ``time.sleep`` is taken from
    the next instead of adding up over hundreds of short layers. ``lookahead_s`` bounds how early a layer's
    output (and so its gradient hook) is seen before its time is over.

    Args:
        lookahead_s: s the caller may run ahead of the stream (>= 0).
        clock, sleep: the time source and the sleep function (tests pass fakes).
    """

    def __init__(self, lookahead_s: float = LOOKAHEAD_S, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.lookahead_s, self.clock, self.sleep = lookahead_s, clock, sleep
        self.end = 0.0

    def run(self, t: float) -> None:
        """Queue ``t`` s of work and sleep until it is ``lookahead_s`` from done."""
        if t <= 0:
            return
        now = self.clock()
        self.end = max(self.end, now) + t
        if self.end - self.lookahead_s > now:
            self.sleep(self.end - self.lookahead_s - now)


#: the stream of this process's training thread
STREAM = VirtualStream()


class _SleepScale(torch.autograd.Function):
    """``x * (1 + ||w||² / (2 n))`` whose forward takes ``t_f`` s and whose backward ``t_b`` s of
    :data:`STREAM`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, t_f: float, t_b: float) -> torch.Tensor:
        STREAM.run(t_f)
        q = torch.dot(w, w) * (0.5 / w.numel())
        ctx.save_for_backward(x, w, q)
        ctx.t_b = t_b
        return x * (1 + q)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        STREAM.run(ctx.t_b)
        x, w, q = ctx.saved_tensors
        return g * (1 + q), w * ((g * x).sum() / w.numel()), None, None


class SleepLayer(nn.Module):
    """One profile layer: a flat fp32 parameter ``weight`` of ``numel`` elements; forward sleeps ``t_f`` s,
    backward ``t_b`` s (see the module docstring for the arithmetic).

    Args:
        numel: parameter elements (>= 1).
        t_f, t_b: forward / backward sleep, s (>= 0).
        generator: source of the initial weights (``N(0, INIT_STD²)``).
    """

    def __init__(self, numel: int, t_f: float, t_b: float, generator: torch.Generator | None = None) -> None:
        super().__init__()
        if numel < 1 or t_f < 0 or t_b < 0:
            raise ValueError(f"SleepLayer needs numel >= 1 and sleeps >= 0 s, got {numel}, {t_f}, {t_b}")
        self.weight = nn.Parameter(torch.randn(numel, generator=generator) * INIT_STD)
        self.t_f, self.t_b = float(t_f), float(t_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, FEATURES)`` -> ``(batch, FEATURES)``."""
        return _SleepScale.apply(x, self.weight, self.t_f, self.t_b)


class ReplayNet(nn.Module):
    """The sleep model of a profile: :class:`SleepLayer` per profile layer, in forward order.

    Args:
        profile: the (already scaled) profile; layer ``i`` gets ``profile.layers[i].nbytes // 4``
            fp32 elements (at least 1) and its ``t_f`` / ``t_b``.
        seed: seed of the initial weights (the same on every rank).
    """

    def __init__(self, profile: ModelProfile, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList(SleepLayer(max(1, layer.nbytes // 4), layer.t_f, layer.t_b, g)
                                    for layer in profile.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, FEATURES)`` floats -> ``(batch, FEATURES)`` logits."""
        for layer in self.layers:
            x = layer(x)
        return x


def build_replay_net(opts: ReplayOptions | dict) -> tuple[ReplayNet, list, BatchMaker]:
    """``(net, shard_units, make_batch)`` like :func:`~lightning_pipedap.bench.matrix.models.build_net`:
    the sleep model of ``opts``, its layers as FSDP2 units, and ``make_batch(n, g)`` -> ``(n, FEATURES)``
    floats and ``(n,)`` class ids."""
    if isinstance(opts, dict):
        opts = ReplayOptions.from_dict(opts)
    net = ReplayNet(replay_profile(opts))

    def make_batch(n: int, g: torch.Generator):
        return torch.randn(n, FEATURES, generator=g), torch.randint(0, FEATURES, (n,), generator=g)

    return net, list(net.layers), make_batch
