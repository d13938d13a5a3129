"""Fabric training loops that compare ``strategy="pipedap"`` with Fabric's ``"ddp"`` value by value.

Run on every rank (the test starts the ranks with the launcher's environment variables, so each
``Fabric`` joins the existing processes instead of launching new ones)::

    LOCAL_RANK=r WORLD_SIZE=2 ... python -m tests.fabric.parity_cases OUT.json

Each case (a model of Lightning's Fabric examples, :mod:`tests.fabric.models`) trains with
gradient accumulation (``fabric.no_backward_sync``) and ``fabric.clip_gradients`` under ``"ddp"`` and
under pipedap with a fixed RS/AG schedule, the WFBP all-reduce schedule and a planned one; the
checkpoints written by ``fabric.save`` mid-run are resumed under the other strategy. Rank 0 writes,
per case and variant, the largest absolute difference from ``"ddp"`` of every value user code sees.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

import lightning_pipedap  # noqa: F401  (registers "pipedap" with Fabric)
from lightning_pipedap import PipeDAPFabricStrategy
from tests.fabric.models import MnistNet, TransformerLM

warnings.filterwarnings("ignore")
GRAD_STEP = 1  # the step whose .grad (after backward, before clipping) is compared


@dataclass
class Case:
    """A training loop: model, optimizer, scheduler, batches and how the step clips."""

    build: Callable[[], torch.nn.Module]
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]
    batch: Callable[[int, int, int], tuple]  # (rank, step, micro) -> (inputs tuple, target)
    loss: Callable[[torch.nn.Module, tuple], torch.Tensor]
    clip: dict[str, float]
    accumulate: int
    steps: int
    scheduler: Optional[Callable[[torch.optim.Optimizer], Any]] = None
    sched_every: int = 3
    eval_batch: tuple = field(default_factory=tuple)


def _images(rank: int, step: int, micro: int) -> tuple:
    g = torch.Generator().manual_seed(1 + 7919 * rank + 101 * step + micro)
    return (torch.randn(8, 1, 28, 28, generator=g),), torch.randint(0, 10, (8,), generator=g)


def _text() -> torch.Tensor:
    import json.decoder  # noqa: PLC0415  (a real text: one of Python's own source files)

    with open(json.decoder.__file__, "rb") as f:
        return torch.tensor(list(f.read()), dtype=torch.long)


TEXT = _text()


def _windows(rank: int, step: int, micro: int, block: int = 32) -> tuple:
    g = torch.Generator().manual_seed(5 + 7919 * rank + 101 * step + micro)
    starts = torch.randint(0, len(TEXT) - block - 1, (4,), generator=g)
    x = torch.stack([TEXT[s:s + block] for s in starts])
    y = torch.stack([TEXT[s + 1:s + block + 1] for s in starts])
    return (x, y), y


CASES = {
    # examples/fabric/image_classifier: Adadelta(lr=1.0) + StepLR(gamma=0.7), NLL loss; here with clip by norm
    "mnist_cnn": Case(build=MnistNet, optimizer=lambda m: torch.optim.Adadelta(m.parameters(), lr=1.0),
                      scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7),
                      batch=_images, loss=lambda m, b: F.nll_loss(m(*b[0]), b[1]), clip={"max_norm": 1.0},
                      accumulate=2, steps=10, eval_batch=_images(0, 999, 0)),
    # examples/fabric/language_model: SGD(lr=0.1) + clip_gradients(clip_val=0.25); here with momentum
    "transformer_lm": Case(build=TransformerLM,
                           optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                           batch=_windows, loss=lambda m, b: F.nll_loss(m(*b[0]), b[1].reshape(-1)),
                           clip={"clip_val": 0.25}, accumulate=3, steps=10, eval_batch=_windows(0, 999, 0)),
}
VARIANTS: dict[str, Callable[[], Any]] = {
    "ddp": lambda: "ddp",
    "dear": lambda: PipeDAPFabricStrategy(schedule="dear", bucket_cap_mb=0.25),
    "allreduce": lambda: PipeDAPFabricStrategy(schedule="allreduce", bucket_cap_mb=0.25),
    # planned: trace 1 step, profile 2, measure 2 candidates x 2 steps, then run (10 steps reach RUN)
    "optimal": lambda: PipeDAPFabricStrategy(schedule="optimal", profile_steps=2, plan_trials=2, trial_steps=1,
                                             trial_rounds=1, trial_window_s=0, model_contention=False),
    # gradient_as_bucket_view: .grad is a view into its bucket (accumulation and clipping act on the bucket)
    "dear_view": lambda: PipeDAPFabricStrategy(schedule="dear", bucket_cap_mb=0.25, gradient_as_bucket_view=True),
    "optimal_view": lambda: PipeDAPFabricStrategy(schedule="optimal", profile_steps=2, plan_trials=2, trial_steps=1,
                                                  trial_rounds=1, trial_window_s=0, model_contention=False,
                                                  gradient_as_bucket_view=True),
}


def _flat(tensors: list[Optional[torch.Tensor]]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors if t is not None]) if tensors else torch.zeros(0)


def train(strategy: Any, case: Case, *, load: Optional[str] = None, save_at: Optional[int] = None,
          save_path: Optional[str] = None) -> dict[str, Any]:
    """One run; returns every value user code saw (losses, .grad, clip norms, params, optimizer state)."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    rank = fabric.global_rank
    torch.manual_seed(0)
    model = case.build()
    optimizer = case.optimizer(model)
    scheduler = case.scheduler(optimizer) if case.scheduler else None
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, **({"scheduler": scheduler} if scheduler else {})}
    start = 0
    if load is not None:
        start = fabric.load(load, state)["step"]
    out: dict[str, Any] = {"losses": [], "norms": [], "grads": None}
    for step in range(start, case.steps):
        model.train()
        for micro in range(case.accumulate):
            torch.manual_seed(10_000 * rank + 100 * step + micro)  # dropout masks: per rank and step
            batch = case.batch(rank, step, micro)
            with fabric.no_backward_sync(model, enabled=micro < case.accumulate - 1):
                loss = case.loss(model, batch) / case.accumulate
                fabric.backward(loss)
            out["losses"].append(loss.item())
        if step == GRAD_STEP:
            out["grads"] = _flat([p.grad for p in model.parameters()])
            if isinstance(fabric.strategy, PipeDAPFabricStrategy):  # (gradient_as_bucket_view: .grad is the bucket)
                engine = fabric.strategy._rt.engine
                out["grads_in_buckets"] = all(b.is_view(k, p.grad) for b in engine.buckets
                                              for k, p in enumerate(b.params))
        norm = fabric.clip_gradients(model, optimizer, **case.clip)
        out["norms"].append(None if norm is None else float(norm))
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None and (step + 1) % case.sched_every == 0:
            scheduler.step()
        if save_at is not None and step + 1 == save_at:
            fabric.save(save_path, {**state, "step": step + 1})
    model.eval()
    with torch.no_grad():
        out["eval"] = model(*case.eval_batch[0]).float()
    out["params"] = _flat(list(model.parameters()))
    out["opt_state"] = _flat([t for p in model.parameters() for t in optimizer.state.get(p, {}).values()
                              if isinstance(t, torch.Tensor)])
    gathered = fabric.all_gather(out["params"])
    out["rank_spread"] = float((gathered[0] - gathered[1]).abs().max())
    s = fabric.strategy
    if isinstance(s, PipeDAPFabricStrategy):
        rt = s._rt
        out["info"] = {"phase": rt.controller.phase.value, "installed": s.installed_schedule,
                       "engine_rounds": rt.engine.iteration, "trials": len(s.trial_results),
                       "engine_copies": rt.engine.copies,
                       "engine_params": sum(len(b.params) for b in rt.engine.buckets),
                       "grads_in_buckets": out.pop("grads_in_buckets", None)}
    fabric.barrier()
    world = os.environ.get("WORLD_SIZE")
    s.teardown()  # (Lightning's environment teardown drops WORLD_SIZE; the next Fabric of this process needs it)
    if world is not None:
        os.environ["WORLD_SIZE"] = world
    return out


def _diff(a: Any, b: Any) -> float:
    if isinstance(a, torch.Tensor):
        return float((a - b).abs().max()) if a.numel() else 0.0
    if isinstance(a, list):
        if len(a) != len(b):
            return float("inf")
        return max((abs(x - y) for x, y in zip(a, b) if x is not None), default=0.0)
    raise TypeError(type(a))


KEYS = ("losses", "norms", "grads", "params", "opt_state", "eval")


def compare(run: dict, ref: dict, keys: tuple = KEYS) -> dict[str, float]:
    return {k: _diff(run[k], ref[k]) for k in keys}


def main(out_path: str) -> None:
    results: dict[str, Any] = {}
    tmp = os.path.dirname(os.path.abspath(out_path))  # (shared by the ranks: every rank loads the checkpoint)
    for name, case in CASES.items():
        res: dict[str, Any] = {}
        try:
            ckpt = {v: os.path.join(tmp, f"{name}_{v}.ckpt") for v in ("ddp", "dear")}
            ref = train(VARIANTS["ddp"](), case, save_at=case.steps // 2, save_path=ckpt["ddp"])
            res["ddp_moved"] = float((ref["params"] - _initial(case)).abs().max())
            res["ddp_grad_absmax"] = float(ref["grads"].abs().max())  # (> clip_val: value clipping acts)
            res["ddp_clipped"] = any(n is not None and n > case.clip.get("max_norm", float("inf"))
                                     for n in ref["norms"])
            for v in ("dear", "allreduce", "optimal", "dear_view", "optimal_view"):
                run = train(VARIANTS[v](), case, save_at=case.steps // 2 if v == "dear" else None,
                            save_path=ckpt["dear"])
                res[v] = {**compare(run, ref), "rank_spread": run["rank_spread"], **run["info"]}
            # checkpoints cross over: pipedap's resumed under ddp, ddp's resumed under pipedap
            tail = ("params", "opt_state", "eval")
            res["pipedap_ckpt_resumed_by_ddp"] = compare(train(VARIANTS["ddp"](), case, load=ckpt["dear"]), ref, tail)
            res["ddp_ckpt_resumed_by_pipedap"] = compare(train(VARIANTS["dear"](), case, load=ckpt["ddp"]), ref, tail)
        except Exception as exc:  # noqa: BLE001  (reported per case; the test shows it)
            import traceback  # noqa: PLC0415

            res["error"] = f"{exc!r}\n{traceback.format_exc()[-3000:]}"
        results[name] = res
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


def _initial(case: Case) -> torch.Tensor:
    torch.manual_seed(0)
    return _flat(list(case.build().parameters()))


if __name__ == "__main__":
    main(sys.argv[1])
