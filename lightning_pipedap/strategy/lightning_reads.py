"""What the run-time reads from Lightning objects it is handed, in one place.

The run-time is given the module it trains (a ``LightningModule`` under the Trainer, any ``nn.Module`` under
Fabric). The Trainer driving it is reached through the module's private ``_trainer`` attribute (the public
``trainer`` property raises when none is attached); :func:`trainer_of` is the only place that reads it, so a
Lightning release that renames it is fixed here (and in ``lightning_pipedap.compat`` once that backs it).
"""

from __future__ import annotations

from typing import Any, Optional


def trainer_of(module: Any) -> Optional[Any]:
    """The Lightning ``Trainer`` driving ``module``, or None (Fabric, a plain ``nn.Module``, no module, or a
    ``LightningModule`` not attached to a Trainer). Reads the private ``LightningModule._trainer``."""
    return getattr(module, "_trainer", None)


def accumulate_grad_batches(module: Any) -> Any:
    """``Trainer(accumulate_grad_batches=...)`` of ``module``'s Trainer; 1 without a Trainer."""
    return getattr(trainer_of(module), "accumulate_grad_batches", 1)


def step_text(module: Any) -> str:
    """``"global step 12"`` (the Trainer's ``global_step``) for messages; ``"a step"`` without a Trainer."""
    trainer = trainer_of(module)
    return f"global step {trainer.global_step}" if trainer is not None else "a step"
