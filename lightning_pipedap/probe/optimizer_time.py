"""Per-parameter optimizer step time, for balancing parameter ownership (``shard_optimizer`` with a whole-tensor
optimizer such as Muon or Adafactor, issue 30).

A whole-tensor optimizer's step cost is not proportional to a parameter's elements (Muon's Newton-Schulz iteration
costs about ``m·n·min(m, n)`` per ``m×n`` matrix), so the owners of the parameters are balanced by the measured
time of each parameter's step: the optimizer's class stepping a copy of the parameter alone, with the parameter's
own param-group hyper-parameters and a fixed pseudo-random gradient, median of a few steps after one warm-up step.
The model's parameters, gradients and optimizer state are not touched.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch
from torch.optim import Optimizer

__all__ = ["optimizer_step_times"]


def optimizer_step_times(optimizers: Sequence[Optimizer], params: Sequence[torch.Tensor],
                         repeats: int = 3) -> list[float]:
    """Seconds of one optimizer step of each of ``params`` (in that order), measured on a copy of the parameter.

    Args:
        optimizers: the fit's optimizers; a parameter is stepped by the one whose param group holds it.
        params: the parameters to time (a parameter of no optimizer gets 0.0).
        repeats: timed steps per parameter (the median is kept), after one warm-up step; >= 1.

    Returns:
        Per parameter, seconds (wall clock; CUDA synchronised around each step).

    Raises:
        ValueError: if ``repeats < 1``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    where: dict[int, tuple[Optimizer, dict]] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            hp = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                where.setdefault(id(p), (opt, hp))
    gen = torch.Generator().manual_seed(0)
    out = []
    for p in params:
        found = where.get(id(p))
        if found is None:
            out.append(0.0)
            continue
        opt, hp = found
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = (torch.randn(q.shape, generator=gen, dtype=torch.float32) * 1e-3).to(q.device, q.dtype)
        scratch = type(opt)([dict(hp, params=[q])])
        times = []
        for k in range(repeats + 1):
            _sync(q)
            t0 = time.perf_counter()
            scratch.step()
            _sync(q)
            if k:
                times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out


def _sync(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
