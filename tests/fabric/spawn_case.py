"""``Fabric(strategy="pipedap_spawn")``: the spawn launcher pickles the strategy and runs :func:`worker`
on 2 processes; this script prints rank 0's result as JSON (``python -m tests.fabric.spawn_case``).

The model is a small MLP trained with plain SGD, so the reference is one process training on both
ranks' batches at once (:func:`reference`): DDP's averaged gradient of two equal-sized batches is the
gradient of their concatenation's mean loss.
"""

from __future__ import annotations

import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.fabric import Fabric

import lightning_pipedap  # noqa: F401  (registers "pipedap_spawn" with Fabric)

STEPS, LR = 4, 0.2


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 12, generator=g), torch.randint(0, 3, (16,), generator=g)


def worker(fabric: Fabric) -> dict:
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    module = model
    model, optimizer = fabric.setup(model, optimizer)
    for step in range(STEPS):
        x, y = batch(fabric.global_rank, step)
        fabric.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    out = {"params": [p.detach().tolist() for p in module.parameters()],
           "strategy": type(fabric.strategy).__name__, "launcher": type(fabric.strategy.launcher).__name__}
    try:
        fabric.setup(build(), torch.optim.SGD(build().parameters(), lr=LR))
        out["second_model"] = "accepted"
    except ValueError as exc:
        out["second_model"] = str(exc)
    fabric.strategy.teardown()
    out["hooks_left"] = sum(len(m._forward_pre_hooks) for m in module.modules()) + sum(
        len(p._post_accumulate_grad_hooks or {}) for p in module.parameters())
    return out


def reference() -> list:
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        (x0, y0), (x1, y1) = batch(0, step), batch(1, step)
        F.cross_entropy(model(torch.cat([x0, x1])), torch.cat([y0, y1])).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().tolist() for p in model.parameters()]


if __name__ == "__main__":
    result = Fabric(accelerator="cpu", devices=2, strategy="pipedap_spawn").launch(worker)
    print("RESULT " + json.dumps({**result, "reference": reference()}))
