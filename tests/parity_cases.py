"""Training cases that compare ``strategy="pipedap"`` with Lightning's ``"ddp"`` parameter by parameter.

Run as a script on every rank (the test starts the ranks with Lightning's environment variables,
so each ``Trainer`` joins the existing processes instead of launching new ones)::

    LOCAL_RANK=r WORLD_SIZE=2 ... python -m tests.parity_cases OUT.json case1 case2 ...

Rank 0 writes ``{case: {variant: max |param - ddp param|}}`` to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_pipedap  # noqa: F401  (registers "pipedap")
from lightning_pipedap import PipeDAPStrategy

warnings.filterwarnings("ignore")

N_SAMPLES, BATCH = 96, 8
# 6 steps per epoch per rank with 2 ranks
SCHEDULES = os.environ.get("PARITY_SCHEDULES", "allreduce,dear,optimal").split(",")


# ---------------------------------------------------------------------------------------- models
class Base(pl.LightningModule):
    def __init__(self, opt: str = "sgd", sched: str | None = None) -> None:
        super().__init__()
        self.opt, self.sched = opt, sched

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        if self.opt == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
        elif self.opt == "adafactor":  # (a whole-tensor optimizer: factored second moments of the matrices)
            opt = torch.optim.Adafactor(self.parameters(), lr=1e-2)
        else:
            decay = [p for n, p in self.named_parameters() if p.ndim > 1]
            no_decay = [p for n, p in self.named_parameters() if p.ndim <= 1]
            opt = torch.optim.AdamW(
                [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}],
                lr=1e-2,
            )
        if self.sched == "step":
            s = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": s, "interval": "step"}}
        if self.sched == "epoch":
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.7)}
        if self.sched == "plateau":
            s = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": s, "monitor": "val_loss"}}
        return opt


class MLP(Base):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)


class BNNet(Base):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.fc1, self.bn, self.fc2 = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class Tied(Base):
    """Tied input/output weights, a root parameter, and a module called twice per forward."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.inp = nn.Linear(16, 24, bias=False)
        self.mid = nn.Linear(24, 24)
        self.out = nn.Linear(24, 16, bias=False)
        self.out.weight = self.inp.weight  # shared parameter (transposed use below)
        self.scale = nn.Parameter(torch.ones(16))  # registered directly on the LightningModule
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x * self.scale))
        h = torch.tanh(self.mid(h))
        h = torch.tanh(self.mid(h))  # same module twice
        return self.head(F.linear(h, self.inp.weight.t()))


class Frozen(MLP):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        for p in self.net[0].parameters():
            p.requires_grad_(False)


class Unused(MLP):
    """``extra`` gets a gradient only on even steps (a parameter without gradient in some steps)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.extra = nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        if batch_idx % 2 == 0:
            out = self.extra(out)
        return F.cross_entropy(out, y)


class UnusedKeepGrad(Unused):
    """``Unused`` whose ``optimizer_zero_grad`` keeps ``.grad`` as zero tensors (``set_to_none=False``, as in
    older public code): DDP steps a parameter unused on every rank with its zero gradient (momentum and
    weight decay still move it)."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=False)


class UnusedLate(Unused):
    """``extra`` is used in every step before global step 12 and never after (a branch on ``global_step``, as in
    curriculum or warm-up heads): a reducer built while every parameter had a gradient must still cope."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        if self.global_step < 12:
            out = self.extra(out)
        return F.cross_entropy(out, y)


class UnusedOnRank1(Unused):
    """``extra`` is used on rank 0 in every step and on rank 1 only in steps 3-5 (data-dependent routing, as a
    mixture-of-experts layer that gets no tokens on some ranks): DDP's reducer needs ``find_unused_parameters``,
    which the ``torch_ddp`` candidate must get from what the profiled and trial steps saw."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        if self.global_rank == 0 or 3 <= self.global_step < 6:
            out = self.extra(out)
        return F.cross_entropy(out, y)


class Checkpointed(MLP):
    def forward(self, x):
        h = checkpoint(self.net[:3], x, use_reentrant=False)
        return self.net[3:](h)


class Manual(MLP):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


class LBFGSNet(MLP):
    """A closure-based optimizer: runs the synchronous path (the closure is evaluated several times)."""

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


class TwoOptimizers(MLP):
    """Manual optimization with two optimizers (GAN-style alternating updates of two parts)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        x, y = batch
        for opt in (opt_a, opt_b):
            loss = F.cross_entropy(self(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    def configure_optimizers(self):
        return (torch.optim.SGD(self.net[:2].parameters(), lr=0.05, momentum=0.9),
                torch.optim.Adam(self.net[2:].parameters(), lr=1e-2))


class MuonAdamW(MLP):
    """Muon for the 2-D weights, AdamW for the biases (the split of Keller Jordan's Muon recipe, and of
    ``torch.optim.Muon``'s own docstring example); manual optimization steps both after one backward."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opts = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in opts:
            opt.step()
        return loss

    def configure_optimizers(self):
        mats = [p for p in self.parameters() if p.ndim == 2]
        rest = [p for p in self.parameters() if p.ndim != 2]
        return torch.optim.Muon(mats, lr=0.02, weight_decay=0.01), torch.optim.AdamW(rest, lr=3e-3)


MODELS: dict[str, Callable[..., Base]] = {
    "muon_adamw": MuonAdamW,
    "lbfgs": LBFGSNet, "two_opt": TwoOptimizers,
    "mlp": MLP, "bn": BNNet, "tied": Tied, "frozen": Frozen, "unused": Unused, "unused_keep": UnusedKeepGrad,
    "unused_late": UnusedLate,
    "unused_rank1": UnusedOnRank1,
    "ckpt_act": Checkpointed, "manual": Manual,
}

# case -> (model, model kwargs, trainer kwargs)
CASES: dict[str, tuple[str, dict, dict]] = {
    "sgd_momentum": ("mlp", {"opt": "sgd"}, {}),
    "adamw_groups_steplr": ("mlp", {"opt": "adamw", "sched": "step"}, {}),
    "adamw_epoch_sched": ("mlp", {"opt": "adamw", "sched": "epoch"}, {}),
    "accumulate2": ("mlp", {"opt": "adamw", "sched": "step"}, {"accumulate_grad_batches": 2}),
    "clip_norm": ("mlp", {"opt": "sgd"}, {"gradient_clip_val": 0.05}),
    "clip_value": ("mlp", {"opt": "sgd"}, {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
    "batchnorm": ("bn", {"opt": "sgd"}, {}),
    "tied_root_twice": ("tied", {"opt": "adamw"}, {}),
    "frozen": ("frozen", {"opt": "adamw"}, {}),
    "unused_some_steps": ("unused", {"opt": "sgd"}, {}),
    "unused_zero_grad_keep": ("unused_keep", {"opt": "sgd"}, {}),
    # `extra` is used only in the first micro-batch of each window: its accumulated gradient is reduced
    "unused_accumulate2": ("unused", {"opt": "sgd"}, {"accumulate_grad_batches": 2}),
    "unused_late": ("unused_late", {"opt": "sgd"}, {}),
    "unused_rank1": ("unused_rank1", {"opt": "sgd"}, {}),
    "activation_checkpointing": ("ckpt_act", {"opt": "sgd"}, {}),
    "manual_optimization": ("manual", {"opt": "sgd"}, {}),
    "plateau_with_val": ("mlp", {"opt": "sgd", "sched": "plateau"}, {"val_check_interval": 3}),
    "bf16_mixed": ("mlp", {"opt": "adamw"}, {"precision": "bf16-mixed"}),
    "lbfgs_closure": ("lbfgs", {}, {}),
    "manual_two_optimizers": ("two_opt", {}, {}),
    "adafactor": ("mlp", {"opt": "adafactor"}, {}),
    "muon_adamw": ("muon_adamw", {}, {}),
}


class ResumableLoader(DataLoader):
    """A DataLoader that Lightning checkpoints (it is ``_Stateful``): resuming skips consumed batches."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._consumed, self._skip = 0, 0

    def __iter__(self):
        skip, self._skip, self._consumed = self._skip, 0, 0
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                self._consumed = i + 1
                yield batch

    def state_dict(self) -> dict:
        return {"consumed": self._consumed}

    def load_state_dict(self, state: dict) -> None:
        self._skip = state["consumed"]


def make_data(seed: int = 7) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_SAMPLES, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    ds = TensorDataset(x, y)
    return ResumableLoader(ds, batch_size=BATCH, shuffle=True), DataLoader(ds, batch_size=BATCH)


class StateBytes(pl.Callback):
    """With ``shard_optimizer``: at each batch start, the fraction of the whole optimizer state (every optimizer)
    this rank holds (``trainer.strategy.optimizer_state_nbytes``; the whole size from an unsharded count of the
    same optimizers' state kept by the last DDP run: :data:`FULL_STATE_BYTES`). An observer that reads no
    parameter."""

    pipedap_reads_model = False

    def __init__(self) -> None:
        self.fraction = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step >= 2 and FULL_STATE_BYTES:
            held = sum(trainer.strategy.optimizer_state_nbytes(o) for o in trainer.optimizers)
            self.fraction = held / FULL_STATE_BYTES[0]


#: the whole optimizer state's bytes of the last reference (DDP) run of :func:`train`
FULL_STATE_BYTES: list[int] = []


def train(model_name: str, model_kw: dict, trainer_kw: dict, strategy: Any, epochs: int = 3,
          callbacks: list | None = None, ckpt_path: str | None = None, max_steps: int = -1,
          root_dir: str | None = None) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, workers=True, verbose=False)
    model = MODELS[model_name](**model_kw)
    train_dl, val_dl = make_data()
    kw = dict(
        accelerator="cpu", devices=2, max_epochs=epochs, logger=False, enable_checkpointing=bool(callbacks),
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=2, max_steps=max_steps, default_root_dir=root_dir,
    )
    kw.update(trainer_kw)
    has_val = "val_check_interval" in kw
    sharded = isinstance(strategy, PipeDAPStrategy) and strategy.config.shard_optimizer
    observers = [StateBytes()] if sharded else []
    trainer = pl.Trainer(strategy=strategy, callbacks=(callbacks or []) + observers, **kw)
    trainer.fit(model, train_dl, val_dl if has_val or callbacks else None, ckpt_path=ckpt_path)
    if sharded:
        strategy.state_fraction = observers[0].fraction
    elif strategy in ("ddp", "ddp_find_unused_parameters_true"):
        FULL_STATE_BYTES[:] = [sum(v.numel() * v.element_size() for o in trainer.optimizers
                                   for st in o.state.values() for v in st.values() if torch.is_tensor(v))]
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i, opt in enumerate(trainer.optimizers):  # (the optimizer state too: pipedap's sharded state gathered)
        for j, st in opt.state_dict()["state"].items():
            out.update({f"opt{i}/{j}/{k}": torch.as_tensor(v).detach().clone().reshape(-1).float()
                        for k, v in st.items() if torch.is_tensor(v) or isinstance(v, (int, float))})
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel())


def moved(a: dict[str, torch.Tensor], init: dict[str, torch.Tensor]) -> float:
    """How far the model state moved from ``init`` (the optimizer state left out: it starts empty)."""
    return max_diff({k: v for k, v in a.items() if k in init}, init)


def run_case(name: str) -> dict[str, float]:
    model_name, model_kw, trainer_kw = CASES[name]
    ddp_name = "ddp_find_unused_parameters_true" if model_name.startswith("unused") else "ddp"
    ref = train(model_name, model_kw, trainer_kw, ddp_name)
    pl.seed_everything(0, verbose=False)
    init = {k: v.clone() for k, v in MODELS[model_name](**model_kw).state_dict().items()}
    res = {"ddp_moved": moved(ref, init)}
    for sched in SCHEDULES:
        strategy = PipeDAPStrategy(schedule=sched, bucket_cap_mb=0.002)
        out = train(model_name, model_kw, trainer_kw, strategy)
        res[sched] = max_diff(out, ref)
        res[f"{sched}_updates_in_forward"] = strategy.update_counts["forward"]
        for suffix, options in VARIANTS.get(name, {}).items():
            strategy = PipeDAPStrategy(schedule=sched, bucket_cap_mb=0.002, **options)
            out = train(model_name, model_kw, trainer_kw, strategy)
            res[f"{sched}_{suffix}"] = max_diff(out, ref)
            res[f"{sched}_{suffix}_updates_in_forward"] = strategy.update_counts["forward"]
        if sched in SHARD_SCHEDULES and name not in NO_SHARD:  # shard_optimizer (issue 30)
            strategy = PipeDAPStrategy(schedule=sched, bucket_cap_mb=0.002, shard_optimizer=True,
                                       **SHARD_OPTIONS.get(name, {}))
            out = train(model_name, model_kw, trainer_kw, strategy)
            res[f"{sched}_shard"] = max_diff(out, ref)
            res[f"{sched}_shard_updates_in_forward"] = strategy.update_counts["forward"]
            res[f"{sched}_shard_state_fraction"] = strategy.state_fraction
    return res


def run_trials_case() -> dict[str, Any]:
    """Measured plan selection (engine switches between candidates mid-epoch, into DDP's reducer and out
    of it again: 4 candidates in 2 interleaved rounds) keeps DDP parity."""
    kw = {"opt": "adamw", "sched": "step"}
    ref = train("mlp", kw, {}, "ddp", epochs=6)
    strategy = PipeDAPStrategy(schedule="optimal", bucket_cap_mb=0.002, plan_trials=3, trial_steps=1, trial_rounds=2,
                               startup_budget=None, trial_window_s=0)
    out = train("mlp", kw, {}, strategy, epochs=6)
    return {"optimal": max_diff(out, ref), "trials": strategy.trial_results,
            "installed": strategy.installed_schedule}


def run_trials_auto_case() -> dict[str, Any]:
    """``shard_optimizer="auto"``: measured selection between the plan sharded and unsharded (and DDP's reducer):
    the optimizer state moves between the shards and the whole optimizer at every switch, and nothing changes."""
    kw = {"opt": "adamw", "sched": "step"}
    ref = train("mlp", kw, {}, "ddp", epochs=6)
    strategy = PipeDAPStrategy(schedule="optimal", bucket_cap_mb=0.002, plan_trials=2, trial_steps=1, trial_rounds=2,
                               startup_budget=None, trial_window_s=0, shard_optimizer="auto")
    out = train("mlp", kw, {}, strategy, epochs=6)
    return {"optimal": max_diff(out, ref), "trials": strategy.trial_results, "installed": strategy.installed_schedule}


def run_val_ckpt_case() -> dict[str, float]:
    """Validation every 2 steps and a checkpoint every step must not change the trajectory."""
    plain = train("mlp", {"opt": "adamw", "sched": "step"}, {}, PipeDAPStrategy(bucket_cap_mb=0.002))
    with tempfile.TemporaryDirectory() as d:
        d = _shared_dir(d)
        cb = ModelCheckpoint(dirpath=d, every_n_train_steps=1, save_top_k=-1, save_last=True)
        busy = train("mlp", {"opt": "adamw", "sched": "step"}, {"val_check_interval": 2},
                     PipeDAPStrategy(bucket_cap_mb=0.002), callbacks=[cb], root_dir=d)
    return {"dear": max_diff(busy, plain)}


def _resume(strategy_factory: Callable[[], Any], at: int = 8) -> float:
    kw = {"opt": "adamw", "sched": "step"}
    full = train("mlp", kw, {}, strategy_factory())
    with tempfile.TemporaryDirectory() as d:
        d = _shared_dir(d)
        cb = ModelCheckpoint(dirpath=d, every_n_train_steps=at, save_top_k=-1, filename="mid-{step}")
        train("mlp", kw, {}, strategy_factory(), callbacks=[cb], max_steps=at, root_dir=d)
        path = os.path.join(d, f"mid-step={at}.ckpt")
        resumed = train("mlp", kw, {}, strategy_factory(), ckpt_path=path, root_dir=d)
    return max_diff(resumed, full)


def _resume_across(first: Callable[[], Any], then: Callable[[], Any], at: int = 8) -> float:
    """Save at step ``at`` under ``first``, resume under ``then``; max |Δ| (parameters and optimizer state) from the
    uninterrupted ``ddp`` run."""
    kw = {"opt": "adamw", "sched": "step"}
    full = train("mlp", kw, {}, "ddp")
    with tempfile.TemporaryDirectory() as d:
        d = _shared_dir(d)
        cb = ModelCheckpoint(dirpath=d, every_n_train_steps=at, save_top_k=-1, filename="mid-{step}")
        train("mlp", kw, {}, first(), callbacks=[cb], max_steps=at, root_dir=d)
        resumed = train("mlp", kw, {}, then(), ckpt_path=os.path.join(d, f"mid-step={at}.ckpt"), root_dir=d)
    return max_diff(resumed, full)


def run_resume_case() -> dict[str, float]:
    """Stop mid-epoch (step 8 of 18) with a checkpoint, resume, compare with the uninterrupted run; with
    shard_optimizer, also across strategies: a sharded run's checkpoint resumed by ``ddp`` and back."""
    def shard() -> PipeDAPStrategy:
        return PipeDAPStrategy(bucket_cap_mb=0.002, schedule="dear", shard_optimizer=True)

    return {"ddp": _resume(lambda: "ddp"), "dear": _resume(lambda: PipeDAPStrategy(bucket_cap_mb=0.002)),
            "shard": _resume(shard), "shard_to_ddp": _resume_across(shard, lambda: "ddp"),
            "ddp_to_shard": _resume_across(lambda: "ddp", shard)}


def _shared_dir(local: str) -> str:
    """Rank 0's temporary directory, shared with the other ranks (same machine)."""
    from lightning_pipedap.engine import collectives as C

    return C.broadcast_object(local, src=0) if C.is_initialized() else local


def run_replan_case() -> dict[str, float]:
    """A forced re-profile/re-plan in the middle of training keeps DDP parity.

    The drift is made certain: once the plan runs, a callback sleeps 50 ms per step, so the measured
    iteration time is far slower than predicted (only a slower run re-plans)."""
    import time  # noqa: PLC0415

    class SlowDown(pl.Callback):
        pipedap_reads_model = False  # reads no parameter: pipedap need not apply pending updates before it

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            phase = getattr(trainer.strategy, "phase", None)
            if phase is not None and phase.value == "run" and not trainer.strategy.replans_done:
                time.sleep(0.05)


    kw = {"opt": "adamw", "sched": "step"}
    ref = train("mlp", kw, {}, "ddp", epochs=10)  # (60 steps: a re-plan needs 4x its start-up steps left)
    strategy = PipeDAPStrategy(schedule="optimal", replan_every=3, replan_margin=0.5, max_replans=1, plan_trials=1,
                               startup_budget=None)
    import lightning_pipedap.strategy.drift as drift  # noqa: PLC0415  (the drift watch reads its hold-off there)

    holdoff, drift.DRIFT_HOLDOFF_S = drift.DRIFT_HOLDOFF_S, 0.0  # (a short fit: no hold-off after the install)
    try:
        with tempfile.TemporaryDirectory() as d:
            out = train("mlp", kw, {"enable_checkpointing": False}, strategy, epochs=10, callbacks=[SlowDown()],
                        root_dir=_shared_dir(d))
    finally:
        drift.DRIFT_HOLDOFF_S = holdoff
    return {"optimal": max_diff(out, ref), "replans": strategy.replans_done,
            "predicted_ms": (strategy.predicted_iteration_s or 0) * 1e3}


def run_compression_case() -> dict[str, float]:
    """Compression through the helper-process pipeline: ``none`` must equal DDP exactly; lossy
    methods must stay close to DDP's trajectory after 3 epochs."""
    ref = train("mlp", {"opt": "sgd"}, {}, "ddp")
    res = {}
    for name, kw, mode in [("none", {}, "process"), ("fp16", {}, "process"), ("powersgd", {"rank": 2}, "inline"),
                           ("topk", {"ratio": 0.1}, "inline"), ("efsignsgd", {}, "inline")]:
        st = PipeDAPStrategy(schedule="dear", bucket_cap_mb=0.002, compression=name, compression_kwargs=kw,
                             compression_mode=mode)
        out = train("mlp", {"opt": "sgd"}, {}, st)
        res[name] = max_diff(out, ref)
        if name == "powersgd":  # shard_optimizer: every bucket compressed, so stepped unsharded: the same bits
            st = PipeDAPStrategy(schedule="dear", bucket_cap_mb=0.002, compression=name, compression_kwargs=kw,
                                 compression_mode=mode, shard_optimizer=True)
            res["powersgd_shard_vs_unsharded"] = max_diff(train("mlp", {"opt": "sgd"}, {}, st), out)
    return res


def run_resume_boundary_case() -> dict[str, float]:
    """Stop at an epoch boundary (step 6 = end of epoch 0) and at step 12 (end of epoch 1), DeAR and DDP."""
    return {"dear_6": _resume(lambda: PipeDAPStrategy(schedule="dear"), at=6),
            "dear_12": _resume(lambda: PipeDAPStrategy(schedule="dear"), at=12),
            "ddp_6": _resume(lambda: "ddp", at=6), "ddp_12": _resume(lambda: "ddp", at=12)}


#: case -> extra variants ``{schedule}_{suffix}`` run with these strategy options (besides the plain ones)
_VIEW = {"gradient_as_bucket_view": True}
VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    # (its optimizer_zero_grad override makes "auto" run in sync mode; defer_update=True defers anyway)
    "unused_zero_grad_keep": {"defer": {"defer_update": True}, "view": _VIEW,
                              "defer_view": {"defer_update": True, **_VIEW}},
    # (set_to_none=True, Lightning's default: a parameter unused everywhere keeps grad None, not stepped)
    "unused_some_steps": {"sync": {"defer_update": False}, "view": _VIEW,
                          "sync_view": {"defer_update": False, **_VIEW}},
    "unused_accumulate2": {"sync": {"defer_update": False}, "view": _VIEW},
    # gradient_as_bucket_view: .grad is the bucket itself (accumulation in the view, clipping, momentum)
    "sgd_momentum": {"view": _VIEW},
    "accumulate2": {"view": _VIEW},
    "clip_norm": {"view": _VIEW},
    "clip_value": {"view": _VIEW},
    "tied_root_twice": {"view": _VIEW},
    "manual_optimization": {"view": _VIEW},
}


#: shard_optimizer=True is run with these schedules for every case but ``NO_SHARD`` (LBFGS is refused at set-up: its
#: step is neither element-wise nor per parameter), with the case's ``SHARD_OPTIONS``; manual optimization runs
#: sharded in sync mode
SHARD_SCHEDULES = ("dear", "optimal")
NO_SHARD = {"lbfgs_closure"}
SHARD_OPTIONS = {"unused_zero_grad_keep": {"defer_update": True}}  # ("auto": its zero_grad override -> sync mode)


#: cases re-run with DDP's reducer forced as the trial's choice (``run_torch_ddp_case``)
TORCH_DDP_CASES = ("accumulate2", "clip_norm", "batchnorm", "frozen", "unused_some_steps", "manual_optimization",
                   "plateau_with_val", "manual_two_optimizers", "unused_accumulate2", "unused_late", "unused_rank1")


#: ... and with ``gradient_as_bucket_view=True`` (DDP's reducer then gets the option too)
#: find_unused_parameters=False: the user vouches that every parameter gets a gradient (DDP's default)
_VOUCH = {"find_unused_parameters": False}
TORCH_DDP_VOUCH_CASES = ("clip_norm", "batchnorm", "unused_late", "unused_rank1")
TORCH_DDP_VIEW_CASES = ("clip_norm", "unused_some_steps", "unused_late")


def run_torch_ddp_case() -> dict[str, Any]:
    """The ``torch_ddp`` candidate chosen (forced: the trial's choice is patched to it), then trained under
    DDP's reducer to the end: each model must equal DDP's, and the run must really end under it."""
    import lightning_pipedap.strategy.controller as ctl  # noqa: PLC0415

    real = ctl.choose_candidate

    def forced(names: Any, windows: Any, floor: Any = None, **kw: Any) -> Any:
        best, medians, notes = real(names, windows, floor, **kw)
        if "torch_ddp" not in names:  # (left out of the trials, e.g. under accumulation)
            return best, medians, notes
        return list(names).index("torch_ddp"), medians, notes

    import logging  # noqa: PLC0415

    class Said(logging.Handler):  # (pipedap's messages of one fit)
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    out: dict[str, Any] = {}
    ctl.choose_candidate = forced
    log = logging.getLogger("lightning_pipedap")
    try:
        runs = [(name, {}, "") for name in TORCH_DDP_CASES] + [(name, _VIEW, "_view") for name in TORCH_DDP_VIEW_CASES]
        runs += [(name, _VOUCH, "_vouch") for name in TORCH_DDP_VOUCH_CASES]
        for name, options, suffix in runs:
            model_name, model_kw, trainer_kw = CASES[name]
            ref = train(model_name, model_kw, trainer_kw,
                        "ddp_find_unused_parameters_true" if model_name.startswith("unused") else "ddp")
            st = PipeDAPStrategy(schedule="optimal", bucket_cap_mb=0.002, plan_trials=2, trial_steps=1, trial_rounds=1,
                                 startup_budget=None, trial_window_s=0, **options)
            said = Said()
            log.addHandler(said)
            try:
                res = train(model_name, model_kw, trainer_kw, st)
            finally:
                log.removeHandler(said)
            out[name + suffix] = {
                "diff": max_diff(res, ref), "installed": st.installed_schedule,
                "stalled": [m for m in said.lines if "got no gradient" in m and "DDP's reducer" in m]}
    finally:
        ctl.choose_candidate = real
    return out


SPECIAL = {"torch_ddp_forced": run_torch_ddp_case, "resume_epoch_boundary": run_resume_boundary_case,
           "plan_trials": run_trials_case, "plan_trials_auto": run_trials_auto_case,
           "compression": run_compression_case, "replan_on_drift": run_replan_case,
           "val_and_ckpt_every_step": run_val_ckpt_case, "resume_mid_epoch": run_resume_case}


def main(out_path: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name in names:
        try:
            results[name] = SPECIAL[name]() if name in SPECIAL else run_case(name)
        except Exception as exc:  # one failing case must not hide the others
            import traceback

            results[name] = {"error": f"{exc!r}\n{traceback.format_exc()}"}
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
