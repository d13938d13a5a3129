"""What every piece of one fit's run-time reads and none of them changes (:class:`FitContext`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lightning_pipedap.strategy.config import PipeDAPConfig


def _no_step() -> int:
    return -1


@dataclass(frozen=True)
class FitContext:
    """The options, the model, the group and the loggers of one fit.

    Attributes:
        config: the strategy's options.
        module: the model trained (the LightningModule, or Fabric's module).
        comm: the engine's dedicated process group.
        world_size, rank: of the default group.
        device: the training device.
        info, warn: rank-0 loggers.
        optimizers: ``() -> list``: the strategy's optimizers (they exist only after set-up).
        step_of: ``() -> int``: the current optimizer step (Lightning's ``global_step``; -1 outside a Trainer).
    """

    config: PipeDAPConfig
    module: torch.nn.Module
    comm: Any
    world_size: int
    rank: int
    device: torch.device
    info: Callable[[str], None]
    warn: Callable[[str], None]
    optimizers: Callable[[], list]
    step_of: Callable[[], int] = _no_step
    _said: set = field(default_factory=set, repr=False)

    def say(self, key: str, message: str) -> None:
        """Log ``message`` on rank 0 once per fit (once per ``key``)."""
        if key not in self._said:
            self._said.add(key)
            self.info(message)

    def step_or_none(self) -> int | None:
        """The current optimizer step, None outside a Trainer (timeline records name the step)."""
        step = self.step_of()
        return step if step >= 0 else None
