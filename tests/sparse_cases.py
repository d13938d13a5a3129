"""Models with sparse gradients trained under ``"ddp"`` and under pipedap, one process per rank (the launcher of
``tests/test_sparse_grads.py`` sets Lightning's environment variables, so every ``Trainer`` and ``Fabric`` joins
the running ranks)::

    python -m tests.sparse_cases OUT_DIR JOB [JOB ...]        # JOB = "<case>:<variant>:<run>"

Every rank writes ``OUT_DIR/<case>.<variant>.<run>.r<rank>.pt``: the model's parameters after the fit and a few
facts (``info``); the test compares them. A variant that must refuse writes the error's type and message instead.

Cases (small: a few hundred parameters, 8-16 steps):

* ``skipgram``: word2vec skip-gram with negative sampling, two ``nn.Embedding(vocab, dim, sparse=True)`` and
  ``torch.optim.SparseAdam`` with a cosine LR schedule. Written anew after Andras7/word2vec-pytorch
  (``word2vec/model.py``: ``SkipGramModel`` with ``u_embeddings`` / ``v_embeddings``, ``sparse=True``, the clamped
  log-sigmoid loss of positive and negative pairs; ``word2vec/trainer.py``: ``optim.SparseAdam`` and
  ``CosineAnnealingLR``), Mikolov et al., NeurIPS 2013 (negative sampling, unigram^0.75 noise) and the PyTorch docs
  of ``nn.Embedding`` ("sparse=True ... optimizers that support sparse gradients: optim.SGD, optim.SparseAdam,
  optim.Adagrad") and ``torch.optim.SparseAdam``.
* ``bag_two_opt``: a fastText-style classifier, ``nn.EmbeddingBag(sparse=True, mode="mean")`` then a dense MLP
  (the PyTorch tutorial "Text classification with the torchtext library", ``TextClassificationModel``, with
  sparse=True); manual optimization with two optimizers, ``SparseAdam`` for the table and ``Adam`` for the rest.
* ``bag_sgd``: the same model, automatic optimization, one ``SGD`` (momentum 0.9) with two param groups
  (table, dense layers), the optimizer the ``nn.Embedding`` docs name for sparse gradients; ``bag_sgd_long``: the
  same for 3 epochs; ``bag_accum``: the same with ``accumulate_grad_batches=2`` (the table's gradient accumulates
  over the micro-batches and is reduced once, as under DDP's ``no_sync``).
* ``bag_skip`` / ``bag_empty``: ``bag_sgd`` where rank 1 leaves the table out of one step per epoch (``skip``: the
  lookup is not called, so the table has no gradient on that rank) or looks up empty bags instead (``empty``: an
  empty sparse gradient, which DDP accepts; DDP raises for ``skip``); ``bag_skip_all``: every rank skips it.
* ``reducer``: the reducer alone on a group of its own (:func:`reducer_unit`).

Variants: ``ddp`` (Lightning's), ``default`` (``strategy="pipedap"``), ``dear``
(``PipeDAPStrategy(schedule="dear", bucket_cap_mb=0.002)``), ``torch_ddp`` (a planned schedule whose measured plan
selection keeps DDP's reducer), ``wire16`` (must refuse), ``fabric_ddp`` / ``fabric_dear`` (Fabric loops).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl

import lightning_pipedap  # noqa: F401  (registers "pipedap")
from lightning_pipedap import PipeDAPStrategy

warnings.filterwarnings("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("lightning.fabric").setLevel(logging.ERROR)

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
VOCAB, DIM, NEG, CLASSES = 48, 8, 4, 3
N = 96 if WORLD == 2 else 72  # 48 or 24 samples per rank: 6 or 3 steps per epoch of 8


# ------------------------------------------------------------------------------------------------ data
def corpus(n_tokens: int = 400) -> torch.Tensor:
    """A token stream with structure (a noisy walk over the vocabulary), so that skip-gram has something to learn."""
    g = torch.Generator().manual_seed(3)
    steps = torch.randint(-2, 3, (n_tokens,), generator=g)
    return torch.cumsum(steps, 0).remainder(VOCAB)


def skipgram_data() -> TensorDataset:
    """``N`` (center, context, negatives) triples: context within a window of 2, ``NEG`` negatives drawn from the
    unigram distribution to the power 0.75 (Mikolov et al. 2013)."""
    tokens = corpus()
    g = torch.Generator().manual_seed(5)
    centers = torch.randint(2, len(tokens) - 2, (N,), generator=g)
    offsets = torch.tensor([-2, -1, 1, 2])[torch.randint(0, 4, (N,), generator=g)]
    noise = torch.bincount(tokens, minlength=VOCAB).double().pow(0.75)
    negatives = torch.multinomial(noise, N * NEG, replacement=True, generator=g).view(N, NEG)
    return TensorDataset(tokens[centers], tokens[centers + offsets], negatives)


def bag_data() -> TensorDataset:
    """``N`` bags of 6 tokens of the corpus, labelled by their mean token bucket."""
    tokens = corpus()
    g = torch.Generator().manual_seed(9)
    starts = torch.randint(0, len(tokens) - 6, (N,), generator=g)
    bags = torch.stack([tokens[s:s + 6] for s in starts.tolist()])
    return TensorDataset(bags, (bags.float().mean(1) * CLASSES / VOCAB).long().clamp(max=CLASSES - 1))


# ------------------------------------------------------------------------------------------------ models
class SkipGram(pl.LightningModule):
    """word2vec skip-gram with negative sampling (module docstring: sources)."""

    def __init__(self) -> None:
        super().__init__()
        self.u_embeddings = nn.Embedding(VOCAB, DIM, sparse=True)  # center words
        self.v_embeddings = nn.Embedding(VOCAB, DIM, sparse=True)  # context words
        nn.init.uniform_(self.u_embeddings.weight, -0.5 / DIM, 0.5 / DIM)
        nn.init.uniform_(self.v_embeddings.weight, -0.1, 0.1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        pos_u, pos_v, neg_v = batch
        emb_u = self.u_embeddings(pos_u)  # (B, D)
        score = (emb_u * self.v_embeddings(pos_v)).sum(1).clamp(-10, 10)
        neg = torch.bmm(self.v_embeddings(neg_v), emb_u.unsqueeze(2)).squeeze(2).clamp(-10, 10)  # (B, NEG)
        return (-F.logsigmoid(score) - F.logsigmoid(-neg).sum(1)).mean()

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SparseAdam(self.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=16)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(skipgram_data(), batch_size=8, shuffle=True)


class BagClassifier(pl.LightningModule):
    """EmbeddingBag(sparse=True) + dense MLP; ``two_opt``: manual optimization with SparseAdam + Adam, else one SGD
    with two param groups. ``drop``: what rank 1 does in step 2 of every epoch: ``None`` (the lookup as usual),
    ``"skip"`` (no lookup: no gradient for the table on that rank), ``"empty"`` (a lookup of empty bags);
    ``"skip_all"``: every rank skips the lookup in that step."""

    def __init__(self, two_opt: bool = False, drop: Any = None) -> None:
        super().__init__()
        self.two_opt, self.drop = two_opt, drop
        self.automatic_optimization = not two_opt
        self.emb = nn.EmbeddingBag(VOCAB, DIM, mode="mean", sparse=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, CLASSES))

    def features(self, bags: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.drop is None or batch_idx != 2 or (self.global_rank != 1 and self.drop != "skip_all"):
            return self.emb(bags)
        if self.drop == "empty":
            return self.emb(bags.new_empty(0), offsets=torch.zeros(len(bags), dtype=torch.long))
        return torch.zeros(len(bags), DIM)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        bags, y = batch
        loss = F.cross_entropy(self.mlp(self.features(bags, batch_idx)), y)
        if not self.two_opt:
            return loss
        opt_sparse, opt_dense = self.optimizers()
        opt_sparse.zero_grad()
        opt_dense.zero_grad()
        self.manual_backward(loss)
        opt_sparse.step()
        opt_dense.step()
        return None

    def configure_optimizers(self) -> Any:
        if self.two_opt:
            return [torch.optim.SparseAdam(self.emb.parameters(), lr=0.05),
                    torch.optim.Adam(self.mlp.parameters(), lr=0.01)]
        return torch.optim.SGD([{"params": self.emb.parameters(), "lr": 0.5},
                                {"params": self.mlp.parameters()}], lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(bag_data(), batch_size=8, shuffle=True)


CASES = {
    "skipgram": lambda: SkipGram(),
    "bag_two_opt": lambda: BagClassifier(two_opt=True),
    "bag_sgd": lambda: BagClassifier(),
    "bag_sgd_long": lambda: BagClassifier(),  # (3 epochs: the torch_ddp candidate runs after its trials)
    "bag_skip": lambda: BagClassifier(drop="skip"),
    "bag_empty": lambda: BagClassifier(drop="empty"),
    "bag_skip_all": lambda: BagClassifier(drop="skip_all"),
    "bag_accum": lambda: BagClassifier(),
}
#: Trainer arguments of a case beyond the defaults
TRAINER_KW: dict[str, dict[str, Any]] = {"bag_accum": {"accumulate_grad_batches": 2}}

STRATEGIES = {
    "ddp": lambda: "ddp",
    "ddp_unused": lambda: "ddp_find_unused_parameters_true",
    "default": lambda: "pipedap",
    "dear": lambda: PipeDAPStrategy(schedule="dear", bucket_cap_mb=0.002),
    # measured plan selection that keeps DDP's reducer unless another candidate is > 99% faster
    "torch_ddp": lambda: PipeDAPStrategy(plan_trials=2, trial_steps=1, trial_rounds=1, trial_window_s=0.0,
                                         startup_budget=None, torch_ddp_margin=0.99, model_contention=False),
    "wire16": lambda: PipeDAPStrategy(schedule="dear", wire_dtype="bf16"),
}


# ------------------------------------------------------------------------------------------------ runs
def fit(case: str, variant: str, epochs: int) -> dict[str, Any]:
    """One Trainer fit; returns the parameters before and after it and what pipedap ran."""
    pl.seed_everything(0, verbose=False)
    model = CASES[case]()
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    strategy = STRATEGIES[variant]()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD, max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         **TRAINER_KW.get(case, {}))
    trainer.fit(model)
    info: dict[str, Any] = {"global_step": trainer.global_step}
    s = trainer.strategy
    if isinstance(s, PipeDAPStrategy):
        info.update(installed=s.installed_schedule, update_counts=dict(s.update_counts),
                    trials=[t["name"] for t in s.trial_results])
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "init": init, "info": info}


def fabric_run(variant: str, steps: int = 6) -> dict[str, Any]:
    """A Fabric loop of the skip-gram model: Fabric's ``"ddp"`` or pipedap's ``dear`` schedule."""
    from lightning.fabric import Fabric  # noqa: PLC0415

    from lightning_pipedap import PipeDAPFabricStrategy  # noqa: PLC0415

    strategy = "ddp" if variant == "fabric_ddp" else PipeDAPFabricStrategy(schedule="dear", bucket_cap_mb=0.002)
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = SkipGram()
    opt = torch.optim.SparseAdam(model.parameters(), lr=0.05)
    model, opt = fabric.setup(model, opt)
    data = skipgram_data().tensors
    per = N // WORLD
    for step in range(steps):
        lo = RANK * per + (step * 8) % per
        batch = tuple(t[lo:lo + 8] for t in data)
        opt.zero_grad()
        fabric.backward(model.training_step(batch, step))
        opt.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    world = os.environ.get("WORLD_SIZE")
    fabric.barrier()
    fabric.strategy.teardown()  # (Lightning's environment teardown drops WORLD_SIZE; the next run needs it)
    if world is not None:
        os.environ["WORLD_SIZE"] = world
    return {"state": state, "info": {}}


def reducer_unit() -> dict[str, Any]:
    """:class:`~lightning_pipedap.engine.sparse.SparseGradReducer` on its own group, without Lightning: parameter
    ``a`` has a gradient on rank 0 only, ``b`` on no rank, ``c`` on every rank; then ``c`` gets a dense gradient on
    the last rank (refused on every rank)."""
    import lightning_pipedap.engine.collectives as C  # noqa: PLC0415
    from lightning_pipedap.engine.sparse import SparseGradReducer  # noqa: PLC0415

    comm = C.new_comm_group(60.0)
    tables = [nn.Embedding(VOCAB, DIM, sparse=True) for _ in range(3)]
    names = {id(t.weight): n for n, t in zip("abc", tables)}
    reducer = SparseGradReducer(comm, [t.weight for t in tables], lambda p: names[id(p)])
    rows = torch.tensor([RANK, RANK + 1, 7])
    if RANK == 0:
        tables[0](rows).sum().backward()
    tables[2](rows).pow(2).sum().backward()
    local_c = tables[2].weight.grad.coalesce().to_dense()
    reducer.reduce()
    grads = [None if t.weight.grad is None else t.weight.grad.to_dense() for t in tables]
    out = {"grads": grads, "local_c": local_c, "saw_unused": reducer.saw_unused,
           "coalesced": tables[2].weight.grad.is_coalesced()}
    tables[2].weight.grad = torch.ones(VOCAB, DIM) if RANK == WORLD - 1 else None
    if RANK != WORLD - 1:
        tables[2](rows).sum().backward()
    try:
        reducer.reduce()
        out["dense_error"] = None
    except ValueError as exc:
        out["dense_error"] = str(exc)
    C.destroy_comm_group(comm)
    return {"state": {}, "info": out}


def main(out_dir: str, jobs: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # env:// from the launcher
    for job in jobs:
        case, variant, run = job.split(":")
        path = os.path.join(out_dir, f"{case}.{variant}.{run}.r{RANK}.pt")
        t0 = time.monotonic()
        try:
            if case == "reducer":
                out = reducer_unit()
            elif variant.startswith("fabric"):
                out = fabric_run(variant)
            else:
                out = fit(case, variant, epochs=3 if case.endswith("_long") else 2)
        except Exception as exc:  # noqa: BLE001  (a refusal is a result; anything else fails the test by its text)
            out = {"error_type": type(exc).__name__, "error": str(exc), "trace": traceback.format_exc()}
        out["wall_s"] = round(time.monotonic() - t0, 2)
        torch.save(out, path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
