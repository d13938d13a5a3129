"""Training runs for ``wire_dtype=``: one launch of 2 ranks, rank 0 writes the results.

Run on every rank (the test starts the ranks with Lightning's environment variables)::

    LOCAL_RANK=r WORLD_SIZE=2 ... python -m tests.wire16_cases OUT.json

* ``parity``: the parity MLP (SGD with momentum, 3 epochs) under ``ddp`` (fp32), ``ddp`` with PyTorch's
  ``fp16_compress_hook`` (registered on CPU as the bench matrix's ``ddp+fp16hook``), and pipedap with ``wire_dtype``
  fp16/bf16 (``dear`` and ``optimal``); max |Δparam| of each against both DDP runs, the installed schedule, and whether
  both ranks hold byte-identical parameters.
* ``clip``: the same with ``gradient_clip_val=0.5`` (clip-by-norm from the reduced shards, which the
  wire format rounds before the norm is taken): against DDP with the same clipping, ranks identical.
* ``overflow``: at step ``AT`` rank 1's loss gets ``2e5 * extra[1]``: a local gradient of 2e5, 1e5
  after the division by the world size, beyond fp16's 65504, finite in fp32 and bf16. Per
  ``nonfinite`` mode the run's outcome (warnings, non-finite parameters, the error raised).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

import lightning_pipedap  # noqa: F401  (registers "pipedap")
from lightning_pipedap import PipeDAPStrategy
from lightning_pipedap.bench.matrix.worker import CommHookDDPStrategy
from lightning_pipedap.engine import collectives as C
from tests.nonfinite_cases import AT, NanNet, SkipAtNet
from tests.nonfinite_cases import compare as compare_nonfinite
from tests.parity_cases import max_diff, train

warnings.filterwarnings("ignore")

BIG = 2e5  # rank 1's gradient of extra[1] at step AT


class Overflow(NanNet):
    def training_step(self, batch, batch_idx):
        x, y = batch
        w = torch.zeros(4)
        if self.global_rank == 1 and self.global_step == AT:
            w = torch.tensor([0.0, BIG, 0.0, 0.0])
        return F.cross_entropy(self.net(x), y) + (self.extra * w).sum()


class OverflowSkipAt(SkipAtNet, Overflow):
    """DDP reference for ``"skip"``: step ``AT``'s ``optimizer.step`` not called."""


def _ranks_identical(params: dict[str, torch.Tensor]) -> bool:
    h = hashlib.sha256(b"".join(params[k].numpy().tobytes() for k in sorted(params))).hexdigest()
    return len(set(C.all_gather_object(h))) == 1


def _pipedap(schedule: str, wire: str, **kw: Any) -> PipeDAPStrategy:
    return PipeDAPStrategy(schedule=schedule, bucket_cap_mb=0.002, wire_dtype=wire, **kw)


def run_parity() -> dict[str, Any]:
    ref = train("mlp", {"opt": "sgd"}, {}, "ddp")
    # (Lightning's DDPStrategy registers a comm hook on CUDA only; the bench matrix's strategy does it on CPU)
    hook = train("mlp", {"opt": "sgd"}, {}, CommHookDDPStrategy("ddp+fp16hook"))
    res: dict[str, Any] = {"hook_vs_ddp": max_diff(hook, ref)}
    for name, sched, wire in [("dear_fp16", "dear", "fp16"), ("optimal_fp16", "optimal", "fp16"),
                              ("dear_bf16", "dear", "bf16"), ("dear_fp32", "dear", "fp32")]:
        st = _pipedap(sched, wire)
        out = train("mlp", {"opt": "sgd"}, {}, st)
        res[name] = {"vs_ddp": max_diff(out, ref), "vs_hook": max_diff(out, hook),
                     "ranks_identical": _ranks_identical(out), "installed": st.installed_schedule}
    return res


def run_clip() -> dict[str, Any]:
    ref = train("mlp", {"opt": "sgd"}, {"gradient_clip_val": 0.5}, "ddp")
    out = train("mlp", {"opt": "sgd"}, {"gradient_clip_val": 0.5}, _pipedap("dear", "fp16", defer_update=True))
    return {"vs_ddp": max_diff(out, ref), "ranks_identical": _ranks_identical(out)}


def _train_overflow(model_cls: type, strategy: Any) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, workers=True, verbose=False)
    model = model_cls()
    from tests.parity_cases import make_data  # noqa: PLC0415

    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, make_data()[0])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_overflow() -> dict[str, Any]:
    ddp = _train_overflow(Overflow, "ddp")
    ddp_skip = _train_overflow(OverflowSkipAt, "ddp")
    res: dict[str, Any] = {"ddp_nonfinite": compare_nonfinite(ddp, ddp)["nonfinite"]}
    for name, wire, mode, ref in [("fp16_warn", "fp16", "warn", ddp), ("fp16_skip", "fp16", "skip", ddp_skip),
                                  ("bf16_raise", "bf16", "raise", ddp), ("fp16_raise", "fp16", "raise", ddp)]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                params = _train_overflow(Overflow, _pipedap("dear", wire, nonfinite=mode))
                r = compare_nonfinite(params, ref)
                r["error"] = None
            except Exception as exc:  # noqa: BLE001  (the "raise" mode's error is the result)
                r = {"error": f"{type(exc).__name__}: {exc}"}
        r["warnings"] = [str(w.message) for w in caught if "pipedap: step" in str(w.message)]
        res[name] = r
    return res


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name, fn in (("parity", run_parity), ("clip", run_clip), ("overflow", run_overflow)):
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001  (one failing case must not hide the others)
            import traceback

            results[name] = {"error": f"{exc!r}\n{traceback.format_exc()}"}
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
