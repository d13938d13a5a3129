"""A small pipedap training job for the fault matrix (tests/test_faults.py); one run = one fault.

Usage: python train.py OUT_DIR FAULT FAULT_RANK [options as KEY=VALUE]. FAULT is one of ``none``,
``raise`` (RuntimeError in training_step at step ``at``), ``uneven`` (FAULT_RANK has ``at`` batches,
the others 40), ``mismatch`` (FAULT_RANK's model is wider), ``mismatch_compression`` (FAULT_RANK asks for
top-k with ``ratio=0.02``, the others ``0.01``), ``nan`` (FAULT_RANK's gradient of the parameter ``extra``
holds NaN and inf at step ``at``), ``perturb`` (FAULT_RANK adds 1 to ``net.0.weight[0, 0]`` after step
``at``). Signals are sent by the test from outside, after the rank has written ``step.<rank>`` >= ``at``.
``nonfinite=``, ``defer=`` (auto/true/false), ``check_params=``, ``torch_ddp_margin=``, ``startup_budget=``
(a number or ``none``) and ``shard_optimizer=true`` set the strategy options of
those names; ``schedule=`` (default ``dear``). ``resignal=1``: the process sends itself SIGTERM again in the last
callback's ``on_exception`` (while the fit stops) and after ``fit`` returns or raises (after the strategy's teardown).
``launch=lightning`` (default): Lightning's
subprocess launcher starts the other rank; ``launch=external``: the test starts every rank with
torchrun-style variables. ``save_on_exception=1`` adds ``ModelCheckpoint(save_on_exception=True)``; ``ckpt_every=1``
also saves after every step (``save_top_k=-1``); ``resume=PATH`` resumes from that checkpoint; ``momentum=`` and
``sched=1`` (StepLR every 2 steps, gamma 0.5) give the optimizer state and hyper-parameters that change per step;
``raise_late``: a callback's ``on_train_batch_start`` raises at step ``at`` after 0.5 s (with ``defer=true``: the
previous step's update is then gathered but not applied). At the end
of the fit (or of a failed one) each rank writes its parameters to ``params.<rank>.pt``. ``fail_save=1``: FAULT_RANK's
checkpoint writes raise ``OSError(28, 'No space left on device')`` (a full disk).
"""

import os
import signal
import sys
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_pipedap  # noqa: F401
from lightning_pipedap import PipeDAPStrategy

OUT, FAULT, FAULT_RANK = sys.argv[1], sys.argv[2], int(sys.argv[3])
OPTS = dict(a.split("=", 1) for a in sys.argv[4:])
AT = int(OPTS.get("at", 5))
TIMEOUT = float(OPTS.get("timeout", 10))
RANK = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


class Net(pl.LightningModule):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))
        self.extra = torch.nn.Parameter(torch.zeros(4))

    def training_step(self, batch, batch_idx):
        rank = self.global_rank
        with open(os.path.join(OUT, f"step.{rank}"), "w") as f:
            f.write(f"{self.global_step} {os.getpid()}")
        if FAULT == "raise" and rank == FAULT_RANK and self.global_step == AT:
            raise RuntimeError(f"injected failure on rank {rank} at step {AT}")
        time.sleep(float(OPTS.get("step_sleep", 0.05)))
        x, y = batch
        w = torch.zeros(4)
        if FAULT == "nan" and rank == FAULT_RANK and self.global_step == AT:
            w = torch.tensor([0.0, float("nan"), float("inf"), 0.0])
        return torch.nn.functional.cross_entropy(self.net(x), y) + (self.extra * w).sum()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=float(OPTS.get("momentum", 0)))
        if OPTS.get("sched") != "1":
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        n = AT if FAULT == "uneven" and self.global_rank == FAULT_RANK else int(OPTS.get("batches", 40))
        g = torch.Generator().manual_seed(self.global_rank)
        data = TensorDataset(torch.randn(n * 4, 16, generator=g), torch.randint(0, 4, (n * 4,), generator=g))
        return DataLoader(data, batch_size=4)


class Perturb(pl.Callback):
    """``perturb``: FAULT_RANK changes one weight after step ``at`` (a replica that diverges)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == FAULT_RANK and trainer.global_step == AT + 1:
            with torch.no_grad():
                pl_module.net[0].weight[0, 0] += 1.0


class RaiseLate(pl.Callback):
    """``raise_late``: FAULT_RANK raises in ``on_train_batch_start`` of step ``at``, 0.5 s in."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == FAULT_RANK and trainer.global_step == AT:
            time.sleep(0.5)
            raise RuntimeError(f"injected failure on rank {FAULT_RANK} at step {AT}")


class Resignal(pl.Callback):
    """``resignal=1``: SIGTERM to this process while the fit stops (the last ``on_exception``)."""

    def on_exception(self, trainer, pl_module, exception):
        os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    torch.manual_seed(0)
    hidden = 48 if FAULT == "mismatch" and RANK == FAULT_RANK else 32
    callbacks = []
    if FAULT == "perturb":
        callbacks.append(Perturb())
    if FAULT == "raise_late":
        callbacks.append(RaiseLate())
    if OPTS.get("resignal") == "1":
        callbacks.append(Resignal())
    if OPTS.get("save_on_exception") == "1" or "ckpt_every" in OPTS:
        every = {"every_n_train_steps": int(OPTS["ckpt_every"]), "save_top_k": -1} if "ckpt_every" in OPTS else {}
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=os.path.join(OUT, "ckpt"), save_on_exception=True,
                                                      **every))
    compression, kwargs = OPTS.get("compression"), {}
    if FAULT == "mismatch_compression":
        compression, kwargs = "topk", {"ratio": 0.02 if RANK == FAULT_RANK else 0.01}
    defer = {"auto": "auto", "true": True, "false": False}[OPTS.get("defer", "auto")]
    check = int(OPTS["check_params"]) if "check_params" in OPTS else None
    extra = {"torch_ddp_margin": float(OPTS["torch_ddp_margin"])} if "torch_ddp_margin" in OPTS else {}
    if OPTS.get("shard_optimizer") == "true":
        extra["shard_optimizer"] = True
    if "startup_budget" in OPTS:  # ("none": no budget, every trial window measured)
        extra["startup_budget"] = None if OPTS["startup_budget"] == "none" else float(OPTS["startup_budget"])
    strategy = PipeDAPStrategy(schedule=OPTS.get("schedule", "dear"), wait_timeout_s=TIMEOUT, compression=compression,
                               compression_kwargs=kwargs, defer_update=defer, nonfinite=OPTS.get("nonfinite", "warn"),
                               check_params_every_n_steps=check, **extra)
    trainer = pl.Trainer(accelerator="cpu", devices=int(OPTS.get("devices", 2)), num_nodes=int(OPTS.get("nodes", 1)),
                         strategy=strategy, max_epochs=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=OPTS.get("save_on_exception") == "1" or "ckpt_every" in OPTS,
                         callbacks=callbacks, use_distributed_sampler=False)
    if OPTS.get("fail_save") == "1" and RANK == FAULT_RANK:
        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device")

        trainer.strategy.checkpoint_io.save_checkpoint = full_disk
    model = Net(hidden)
    try:
        trainer.fit(model, ckpt_path=OPTS.get("resume"))
    finally:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                   os.path.join(OUT, f"params.{trainer.global_rank}.pt"))
        if OPTS.get("resignal") == "1":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # (never reached: the strategy's handler ends the pre-empted process at once)
    with open(os.path.join(OUT, f"done.{trainer.global_rank}"), "w") as f:
        f.write(str(trainer.global_step))


if __name__ == "__main__":
    main()
