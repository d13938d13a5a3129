"""Per-layer forward/backward times from hook timestamps (wall clock; pure Python).

A *layer* is a run of consecutive parameters (forward order) owned by the same module. During a
profiled step the strategy reports:

* ``forward_start()`` when ``training_step`` is entered, ``layer_used(k)`` when the module of layer
  ``k`` is called (the first call counts, again after each backward pass), ``forward_end()`` when
  ``training_step`` returns;
* ``backward_start()`` in ``pre_backward``, ``param_ready(i)`` from each parameter's
  post-accumulate-grad hook, ``backward_end()`` in ``post_backward``: one *pass* each time.

With automatic optimization a step has one pass, after ``training_step`` returned. Under manual
optimization ``training_step`` itself runs several forward segments, backward passes and optimizer
steps (a GAN: the generator's, then the discriminator's); each pass reduces every bucket, so the
step is profiled as a whole and :attr:`StepRecorder.passes` says how many passes it had.

Forward time of a layer is the host time (outside backward passes) from its first use in a forward
segment to the next layer's first use, or to the next pass, or to the end of the step's forward part
(the time before the first use goes to the first layer used, with ``pre_gap``: the host work between
the previous step's end and this forward, such as data loading and loop bookkeeping; the time after
the last use, such as ``zero_grad`` before backward or a manual ``optimizer.step()``, to the layer
used last). These serial host costs are real per-iteration compute that communication can overlap,
so they belong in the profile.
Backward time of layer k, per pass, is the time between the moment the gradients of layers ``> k``
were all ready and the moment its own were (the rest of the pass after layer 0 is added to layer 0);
a step's backward times add its passes. The segments add up to the measured forward and backward
wall times exactly, which is what the timeline simulator needs. On CUDA, timestamps are taken after
``torch.cuda.synchronize`` by the caller.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional, Sequence

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


class _Pass:
    """One backward pass of a profiled step: its start, end and the time each layer's gradients were ready."""

    __slots__ = ("t0", "t1", "ready")

    def __init__(self, t0: float, num_layers: int) -> None:
        self.t0: float = t0
        self.t1: Optional[float] = None
        self.ready: list[Optional[float]] = [None] * num_layers


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
        #: first use of each layer in each forward segment, in time order: ``(t, k)``
        self.uses: list[tuple[float, int]] = []
        self._seg_seen: set[int] = set()
        self._passes: list[_Pass] = []
        self.t_fwd0: Optional[float] = None
        self.t_fwd1: Optional[float] = None
        #: seconds of host work between the previous step's end and this step's forward
        self.pre_gap = 0.0

    def forward_start(self) -> None:
        self.t_fwd0 = self.clock()

    def layer_used(self, k: int) -> None:
        if k in self._seg_seen or (self._passes and self._passes[-1].t1 is None):
            return  # (used before in this forward segment, or a recomputation inside a backward pass)
        self._seg_seen.add(k)
        self.uses.append((self.clock(), k))

    def forward_end(self) -> None:
        self.t_fwd1 = self.clock()

    def backward_start(self) -> None:
        self._passes.append(_Pass(self.clock(), self.num_layers))
        self._seg_seen = set()  # (a forward after this pass is a new segment: its first uses count again)

    def param_ready(self, i: int) -> None:
        if self._passes and self._passes[-1].t1 is None:
            k = self.layer_of_param[i]
            self._passes[-1].ready[k] = self.clock()  # the last parameter of a layer to be ready wins

    def backward_end(self) -> None:
        if self._passes and self._passes[-1].t1 is None:
            self._passes[-1].t1 = self.clock()

    @property
    def passes(self) -> int:
        """Backward passes observed from start to end (several in a ``training_step`` of manual optimization)."""
        return sum(1 for p in self._passes if p.t1 is not None)

    @property
    def t_bwd0(self) -> Optional[float]:
        """Start of the first backward pass."""
        return self._passes[0].t0 if self._passes else None

    @property
    def t_bwd1(self) -> Optional[float]:
        """End of the last complete backward pass."""
        done = [p.t1 for p in self._passes if p.t1 is not None]
        return done[-1] if done else None

    @property
    def complete(self) -> bool:
        """Whether the forward and at least one whole backward pass were observed."""
        return self.t_fwd0 is not None and self.t_fwd1 is not None and self.passes > 0

    def times(self) -> tuple[list[float], list[float]]:
        """Per-layer ``(t_f, t_b)`` in seconds, all passes of the step together; layers never seen get 0.

        Raises:
            ValueError: if the step was not completely observed.
        """
        if not self.complete:
            raise ValueError("profiled step incomplete: forward or backward timestamps are missing")
        assert self.t_fwd0 is not None and self.t_fwd1 is not None
        L = self.num_layers
        passes = [p for p in self._passes if p.t1 is not None]
        # forward: host time outside the passes, from t_fwd0 to the forward part's end (the last pass's start
        # when it came after training_step returned, as with automatic optimization; else training_step's end)
        end = max(self.t_fwd1, passes[-1].t0)
        gaps = [(p.t0, p.t1) for p in passes]

        def host(a: float, b: float) -> float:
            if b <= a:
                return 0.0
            inside = sum(max(0.0, min(b, t1) - max(a, t0)) for t0, t1 in gaps)
            return max(0.0, b - a - inside)

        t_f = [0.0] * L
        if self.uses:
            bounds = [t for t, _ in self.uses[1:]] + [end]
            for (t, k), nxt in zip(self.uses, bounds):
                t_f[k] += host(t, nxt)
            t_f[self.uses[0][1]] += host(self.t_fwd0, self.uses[0][0]) + self.pre_gap
        elif L:
            t_f[0] = host(self.t_fwd0, end) + self.pre_gap
        # backward: per pass, in backward order (last layer first), cumulative max of ready times
        t_b = [0.0] * L
        for p in passes:
            prev = p.t0
            for k in reversed(range(L)):
                r = p.ready[k]
                if r is None:
                    continue
                r = max(r, prev)
                t_b[k] += r - prev
                prev = r
            if L:
                t_b[0] += max(0.0, p.t1 - prev)
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
        raise ValueError(f"profile length mismatch: {L} layers, bytes {len(layer_bytes)}, "
                         f"steps {[len(f) for f, _ in steps]}")
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
