"""LightningModules for the app: image classification, causal LM and masked LM.

Each wraps a plain ``nn.Module`` (``net``) and takes the optimizer (and optionally an LR scheduler)
as a factory, so Hydra can pass ``_partial_: true`` configs:
``optimizer(params) -> Optimizer`` and ``lr_scheduler(optimizer) -> LRScheduler``.
Accuracy is torchmetrics' micro-averaged multiclass accuracy (fraction of correct predictions).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import Optimizer
from torchmetrics.classification import MulticlassAccuracy

OptimizerFactory = Callable[[Iterable[Tensor]], Optimizer]
SchedulerFactory = Callable[[Optimizer], Any]

IGNORE_INDEX = -100  # target value skipped by the loss and the accuracy (PyTorch's cross_entropy default)


class _Base(pl.LightningModule):
    """Shared optimizer set-up and logging. Subclasses implement ``_loss_and_preds``."""

    def __init__(
        self,
        net: nn.Module,
        num_classes: int,
        optimizer: Optional[OptimizerFactory] = None,
        lr_scheduler: Optional[SchedulerFactory] = None,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        if not isinstance(net, nn.Module):
            raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        if optimizer is None and not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.save_hyperparameters(ignore=["net", "optimizer", "lr_scheduler"], logger=False)
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.lr = lr
        self.train_acc = MulticlassAccuracy(num_classes, average="micro", ignore_index=IGNORE_INDEX)
        self.val_acc = MulticlassAccuracy(num_classes, average="micro", ignore_index=IGNORE_INDEX)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def _loss_and_preds(self, batch: Any, batch_idx: int, stage: str) -> tuple[Tensor, Tensor, Tensor]:
        """Return ``(loss, logits (N, classes), targets (N,))`` for one batch (subclasses define it)."""
        raise TypeError(f"{type(self).__name__} is an abstract base: "
                        "subclasses define _loss_and_preds(batch, batch_idx, stage)")

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, logits, target = self._loss_and_preds(batch, batch_idx, "train")
        self.train_acc(logits.detach(), target)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, logits, target = self._loss_and_preds(batch, batch_idx, "val")
        self.val_acc(logits, target)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        opt = self.optimizer_factory(params) if self.optimizer_factory else torch.optim.Adam(params, lr=self.lr)
        if self.scheduler_factory is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.scheduler_factory(opt), "interval": "step"}}


class ImageClassifier(_Base):
    """Cross-entropy classifier over ``net``'s logits.

    Batches are ``(x, y)``: images ``(B, C, H, W)`` float, labels ``(B,)`` int64 in ``[0, num_classes)``.
    Logs ``train/loss``, ``train/acc``, ``val/loss``, ``val/acc`` (fraction in [0, 1]).

    Args:
        net: maps ``(B, C, H, W)`` to ``(B, num_classes)`` logits.
        num_classes: classes (for the accuracy metric).
        optimizer: factory ``params -> Optimizer``; default Adam(lr).
        lr_scheduler: factory ``optimizer -> scheduler`` stepped every optimizer step; default none.
        lr: learning rate of the default optimizer.
    """

    def __init__(self, net: nn.Module, num_classes: int = 10, optimizer: Optional[OptimizerFactory] = None,
                 lr_scheduler: Optional[SchedulerFactory] = None, lr: float = 1e-3) -> None:
        super().__init__(net, num_classes, optimizer, lr_scheduler, lr)

    def _loss_and_preds(self, batch: Any, batch_idx: int, stage: str) -> tuple[Tensor, Tensor, Tensor]:
        x, y = batch
        logits = self.net(x)
        return F.cross_entropy(logits, y), logits, y


class CausalLM(_Base):
    """Next-token prediction (GPT). Batches are ``(x, y)``, both ``(B, T)`` int64 with ``y`` = ``x``
    shifted by one token. Accuracy is next-token top-1 accuracy over all ``B*T`` positions.

    Args:
        net: maps ``(B, T)`` ids to ``(B, T, vocab)`` logits and has an int ``vocab_size`` attribute.
        optimizer, lr_scheduler, lr: as for :class:`ImageClassifier`.
    """

    def __init__(self, net: nn.Module, optimizer: Optional[OptimizerFactory] = None,
                 lr_scheduler: Optional[SchedulerFactory] = None, lr: float = 3e-4) -> None:
        super().__init__(net, int(net.vocab_size), optimizer, lr_scheduler, lr)

    def _loss_and_preds(self, batch: Any, batch_idx: int, stage: str) -> tuple[Tensor, Tensor, Tensor]:
        x, y = batch
        logits = self.net(x).flatten(0, 1)  # (B*T, vocab)
        target = y.flatten()
        return F.cross_entropy(logits, target), logits, target


class MaskedLM(_Base):
    """Masked-token prediction (BERT): of each sequence, ``mask_prob`` of the positions are chosen;
    of those 80% become ``mask_token_id``, 10% a random token, 10% stay (Devlin et al., 2019, 3.1).
    The loss and accuracy count chosen positions only. Batches are ``(x, _)`` with ``x`` ``(B, T)``
    int64 ids below ``mask_token_id``. Validation masks are drawn from a generator seeded with the
    batch index, so ``val/acc`` is comparable across epochs.

    Args:
        net: maps ``(B, T)`` ids to ``(B, T, vocab)`` logits; ``vocab_size`` attribute; the last id
            (``vocab_size - 1``) is ``[MASK]`` unless ``mask_token_id`` says otherwise.
        mask_prob: fraction of positions predicted (0 < p <= 1).
        mask_token_id: id of ``[MASK]``; default ``net.vocab_size - 1``.
        optimizer, lr_scheduler, lr: as for :class:`ImageClassifier`.

    Raises:
        ValueError: ``mask_prob`` outside (0, 1] or ``mask_token_id`` outside the vocabulary.
    """

    def __init__(self, net: nn.Module, mask_prob: float = 0.15, mask_token_id: Optional[int] = None,
                 optimizer: Optional[OptimizerFactory] = None, lr_scheduler: Optional[SchedulerFactory] = None,
                 lr: float = 3e-4) -> None:
        vocab = int(net.vocab_size)
        super().__init__(net, vocab, optimizer, lr_scheduler, lr)
        if not 0.0 < mask_prob <= 1.0:
            raise ValueError(f"mask_prob must be in (0, 1], got {mask_prob}")
        self.mask_prob = mask_prob
        self.mask_token_id = vocab - 1 if mask_token_id is None else int(mask_token_id)
        if not 0 <= self.mask_token_id < vocab:
            raise ValueError(f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {vocab})")

    def mask(self, x: Tensor, generator: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor]:
        """Return ``(inputs, targets)``, both ``(B, T)``: masked inputs, and targets equal to ``x`` at
        chosen positions and ``IGNORE_INDEX`` elsewhere. Random numbers are drawn on the CPU."""
        u = torch.rand(x.shape, generator=generator)
        r = torch.rand(x.shape, generator=generator)
        rand_tok = torch.randint(0, self.mask_token_id, x.shape, generator=generator)
        chosen = (u < self.mask_prob).to(x.device)
        inputs = x.clone()
        to_mask = chosen & (r < 0.8).to(x.device)
        to_rand = chosen & ((r >= 0.8) & (r < 0.9)).to(x.device)
        inputs[to_mask] = self.mask_token_id
        inputs[to_rand] = rand_tok.to(x.device)[to_rand]
        targets = torch.where(chosen, x, torch.full_like(x, IGNORE_INDEX))
        return inputs, targets

    def _loss_and_preds(self, batch: Any, batch_idx: int, stage: str) -> tuple[Tensor, Tensor, Tensor]:
        x = batch[0]
        gen = torch.Generator().manual_seed(batch_idx) if stage == "val" else None
        inputs, targets = self.mask(x, gen)
        logits = self.net(inputs).flatten(0, 1)
        target = targets.flatten()
        if not (target != IGNORE_INDEX).any():  # no position chosen: zero loss that still touches the graph
            return logits.sum() * 0.0, logits, target
        return F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX), logits, target
