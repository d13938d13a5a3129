"""Per-layer forward/backward times from hook timestamps (wall clock; pure Python).

A *layer* is a run of consecutive parameters (forward order) owned by the same module. During a
profiled step the strategy reports:

* ``forward_start()`` when ``training_step`` is entered, ``layer_used(k)`` when the module of layer
  ``k`` is first called, ``forward_end()`` when ``training_step`` returns;
* ``backward_start()`` in ``pre_backward``, ``param_ready(i)`` from each parameter's
  post-accumulate-grad hook, ``backward_end()`` in ``post_backward``.

Forward time of layer k is the time between its first use and the first use of the next layer
(layer 0 also gets the time before it and ``pre_gap``: the host work between the previous step's
end and this forward, such as data loading and loop bookkeeping; the last layer gets the time until
the forward returns and the work between forward and backward, such as ``zero_grad``). These
serial host costs are real per-iteration compute that communication can overlap, so they belong in
the profile.
Backward time of layer k is the time between the moment the gradients of layers ``> k`` were all
ready and the moment its own were (the rest of backward after layer 0 is added to layer 0). The
segments add up to the measured forward and backward wall times exactly, which is what the timeline
simulator needs. On CUDA, timestamps are taken after ``torch.cuda.synchronize`` by the caller.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

from lightning_pipedap.plan.profile import LayerProfile, ModelProfile


def group_layers(owner_ids: Sequence[object]) -> list[list[int]]:
    """Group parameter indices (forward order) into layers: consecutive runs with the same owner."""
    layers: list[list[int]] = []
    for i, owner in enumerate(owner_ids):
        if layers and owner_ids[layers[-1][-1]] == owner:
            layers[-1].append(i)
        else:
            layers.append([i])
    return layers


class StepRecorder:
    """Collects one step's timestamps (``time.perf_counter`` seconds) and converts them to times.

    Args:
        layer_of_param: layer index of each parameter (forward order).
        num_layers: number of layers.
        clock: time source (injectable for tests).
    """

    def __init__(self, layer_of_param: Sequence[int], num_layers: int, clock=time.perf_counter) -> None:
        self.layer_of_param = list(layer_of_param)
        self.num_layers = num_layers
        self.clock = clock
        self.f_first: list[float | None] = [None] * num_layers
        self.ready: list[float | None] = [None] * num_layers
        self.t_fwd0 = self.t_fwd1 = self.t_bwd0 = self.t_bwd1 = None
        #: seconds of host work between the previous step's end and this step's forward
        self.pre_gap = 0.0

    def forward_start(self) -> None:
        self.t_fwd0 = self.clock()

    def layer_used(self, k: int) -> None:
        if self.f_first[k] is None:
            self.f_first[k] = self.clock()

    def forward_end(self) -> None:
        self.t_fwd1 = self.clock()

    def backward_start(self) -> None:
        self.t_bwd0 = self.clock()

    def param_ready(self, i: int) -> None:
        k = self.layer_of_param[i]
        self.ready[k] = self.clock()  # the last parameter of a layer to be ready wins

    def backward_end(self) -> None:
        self.t_bwd1 = self.clock()

    @property
    def complete(self) -> bool:
        """Whether forward and backward were both observed."""
        return None not in (self.t_fwd0, self.t_fwd1, self.t_bwd0, self.t_bwd1)

    def times(self) -> tuple[list[float], list[float]]:
        """Per-layer ``(t_f, t_b)`` in seconds; layers never seen get 0.

        Raises:
            ValueError: if the step was not completely observed.
        """
        if not self.complete:
            raise ValueError("profiled step incomplete: forward or backward timestamps are missing")
        L = self.num_layers
        # forward: sort observed first-use times; a layer's segment runs to the next observed one
        t_f = [0.0] * L
        seen = sorted((t, k) for k, t in enumerate(self.f_first) if t is not None)
        if seen:
            bounds = [t for t, _ in seen] + [self.t_fwd1]
            for j, (t, k) in enumerate(seen):
                t_f[k] = max(0.0, bounds[j + 1] - t)
            t_f[seen[0][1]] += max(0.0, seen[0][0] - self.t_fwd0) + self.pre_gap
            t_f[seen[-1][1]] += max(0.0, self.t_bwd0 - self.t_fwd1)
        elif L:
            t_f[0] = self.t_fwd1 - self.t_fwd0 + self.pre_gap + max(0.0, self.t_bwd0 - self.t_fwd1)
        # backward: in backward order (last layer first), cumulative max of ready times
        t_b = [0.0] * L
        prev = self.t_bwd0
        for k in reversed(range(L)):
            r = self.ready[k]
            if r is None:
                continue
            r = max(r, prev)
            t_b[k] = r - prev
            prev = r
        if L:
            t_b[0] += max(0.0, self.t_bwd1 - prev)
        return t_f, t_b


def merge_steps(
    name: str,
    layer_names: Sequence[str],
    layer_bytes: Sequence[int],
    steps: Sequence[tuple[Sequence[float], Sequence[float]]],
    t_update: Sequence[float] = (),
    meta: dict | None = None,
) -> ModelProfile:
    """Median per-layer times over several profiled steps -> :class:`ModelProfile`.

    Args:
        name: model name.
        layer_names, layer_bytes: per layer (forward order), gradient bytes per layer.
        steps: ``(t_f, t_b)`` per profiled step (seconds).
        t_update: measured optimizer-update seconds per step (median used; 0 when empty).

    Raises:
        ValueError: if ``steps`` is empty or lengths disagree.
    """
    if not steps:
        raise ValueError("no profiled steps to merge")
    L = len(layer_names)
    if len(layer_bytes) != L or any(len(f) != L or len(b) != L for f, b in steps):
        raise ValueError(f"profile length mismatch: {L} layers, bytes {len(layer_bytes)}, steps {[len(f) for f, _ in steps]}")
    layers = tuple(
        LayerProfile(
            name=layer_names[k],
            nbytes=int(layer_bytes[k]),
            t_f=statistics.median(f[k] for f, _ in steps),
            t_b=statistics.median(b[k] for _, b in steps),
        )
        for k in range(L)
    )
    upd = statistics.median(t_update) if t_update else 0.0
    return ModelProfile(name=name, layers=layers, t_update=upd, meta=dict(meta or {}, profiled_steps=len(steps)))
