"""What the run-time reads from Lightning objects it is handed, in one place.

The run-time is given the module it trains (a ``LightningModule`` under the Trainer, any ``nn.Module`` under
Fabric). The Trainer driving it is found by :func:`trainer_of`, the only place that asks
(:func:`lightning_pipedap.compat.attached_trainer`, through Lightning's public ``trainer`` / ``fabric``
properties).
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_pipedap import compat


def trainer_of(module: Any) -> Optional[Any]:
    """The Lightning ``Trainer`` driving ``module``, or None (Fabric, a plain ``nn.Module``, no module, or a
    ``LightningModule`` not attached to a Trainer)."""
    return compat.attached_trainer(module)


def accumulate_grad_batches(module: Any) -> Any:
    """``Trainer(accumulate_grad_batches=...)`` of ``module``'s Trainer; 1 without a Trainer."""
    return getattr(trainer_of(module), "accumulate_grad_batches", 1)


def step_text(module: Any) -> str:
    """``"global step 12"`` (the Trainer's ``global_step``) for messages; ``"a step"`` without a Trainer."""
    trainer = trainer_of(module)
    return f"global step {trainer.global_step}" if trainer is not None else "a step"
