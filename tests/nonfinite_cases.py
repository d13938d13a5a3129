"""Training runs for ``nonfinite=``: a NaN/inf gradient on rank 1 at one step, under DDP and pipedap.

Run on every rank (the test starts the ranks with Lightning's environment variables, so each
``Trainer`` joins the existing processes)::

    LOCAL_RANK=r WORLD_SIZE=2 ... python -m tests.nonfinite_cases OUT.json

At step ``AT`` rank 1's gradient of the parameter ``extra`` is ``[0, nan, inf, -inf]`` (its loss gets
``(extra * w).sum()``; ``w`` is zero at every other step and on rank 0). Rank 0 writes, per pipedap
variant, how its final parameters compare with its reference run: ``"ddp"`` (the update applied, as
DDP does) or ``"ddp_skip"`` (DDP with that step's ``optimizer.step`` not called).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F

import lightning_pipedap  # noqa: F401  (registers "pipedap")
from lightning_pipedap import PipeDAPStrategy
from tests.parity_cases import make_data

warnings.filterwarnings("ignore")

AT = 4  # the step with the non-finite gradient (of 12: 6 steps per epoch per rank, 2 epochs)


class NanNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
        self.extra = nn.Parameter(torch.ones(4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        w = torch.zeros(4)
        if self.global_rank == 1 and self.global_step == AT:
            w = torch.tensor([0.0, float("nan"), float("inf"), float("-inf")])
        return F.cross_entropy(self.net(x), y) + (self.extra * w).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class SkipAtNet(NanNet):
    """DDP reference for ``"skip"``: the closure (forward, backward) runs at step ``AT``, ``optimizer.step`` not."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if self.global_step == AT:
            optimizer_closure()
            return
        optimizer.step(closure=optimizer_closure)


def train(model_cls: type, strategy: Any, **trainer_kw: Any) -> tuple[dict[str, torch.Tensor], int]:
    pl.seed_everything(0, workers=True, verbose=False)
    model = model_cls()
    train_dl, _ = make_data()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         **trainer_kw)
    trainer.fit(model, train_dl)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, trainer.global_step


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``bit_equal``: every bit of every tensor; ``same_nonfinite``: NaN and ±inf at the same places;
    ``max_diff``: max |a - b| where both are finite; ``nonfinite``: non-finite elements in ``a``."""
    bits = all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)
    same = all(torch.equal(a[k].isnan(), b[k].isnan()) and torch.equal(a[k].isposinf(), b[k].isposinf())
               and torch.equal(a[k].isneginf(), b[k].isneginf()) for k in a)
    both = {k: a[k].isfinite() & b[k].isfinite() for k in a}
    diffs = [float((a[k] - b[k])[both[k]].abs().max()) for k in a if both[k].any()]
    return {"bit_equal": bits, "same_nonfinite": same, "max_diff": max(diffs, default=0.0),
            "nonfinite": int(sum((~a[k].isfinite()).sum() for k in a)),
            "ref_nonfinite": int(sum((~b[k].isfinite()).sum() for k in b))}


def pipedap(nonfinite: str, defer: Any, shard: bool = False) -> PipeDAPStrategy:
    return PipeDAPStrategy(schedule="dear", bucket_cap_mb=0.002, defer_update=defer, nonfinite=nonfinite,
                           shard_optimizer=shard)


#: variant -> (reference, strategy factory, trainer kwargs)
VARIANTS = {
    "warn_deferred": ("ddp", lambda: pipedap("warn", True), {}),
    "warn_sync": ("ddp", lambda: pipedap("warn", False), {}),
    "ignore_deferred": ("ddp", lambda: pipedap("ignore", True), {}),
    "warn_clip_deferred": ("ddp_clip", lambda: pipedap("warn", True), {"gradient_clip_val": 1.0}),
    "skip_deferred": ("ddp_skip", lambda: pipedap("skip", True), {}),
    "skip_sync": ("ddp_skip", lambda: pipedap("skip", False), {}),
    "skip_clip_deferred": ("ddp_skip_clip", lambda: pipedap("skip", True), {"gradient_clip_val": 1.0}),
    # shard_optimizer (issue 30): the verdict comes from the worker's NaN/inf counts of every rank's shards
    "warn_shard": ("ddp", lambda: pipedap("warn", True, shard=True), {}),
    "warn_clip_shard": ("ddp_clip", lambda: pipedap("warn", True, shard=True), {"gradient_clip_val": 1.0}),
    "skip_shard": ("ddp_skip", lambda: pipedap("skip", True, shard=True), {}),
    "skip_clip_shard": ("ddp_skip_clip", lambda: pipedap("skip", True, shard=True), {"gradient_clip_val": 1.0}),
}


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    refs = {"ddp": train(NanNet, "ddp"), "ddp_skip": train(SkipAtNet, "ddp"),
            "ddp_clip": train(NanNet, "ddp", gradient_clip_val=1.0),
            "ddp_skip_clip": train(SkipAtNet, "ddp", gradient_clip_val=1.0)}
    results: dict[str, Any] = {"ddp_skip_vs_ddp": compare(refs["ddp_skip"][0], refs["ddp"][0]),
                               "ddp_steps": refs["ddp"][1]}
    for name, (ref, factory, kw) in VARIANTS.items():
        strategy = factory()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            params, steps = train(NanNet, strategy, **kw)
        res = compare(params, refs[ref][0])
        res.update(steps=steps, forward_updates=strategy.update_counts["forward"],
                   warnings=[str(w.message) for w in caught if "pipedap: step" in str(w.message)])
        results[name] = res
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
