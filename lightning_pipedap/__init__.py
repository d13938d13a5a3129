"""lightning_pipedap: a PyTorch Lightning strategy for scheduled, decoupled gradient communication.

``import lightning_pipedap`` registers the strategy names ``"pipedap"`` and ``"pipedap_spawn"`` in
Lightning's strategy registry (Lightning 2.6 has no entry-point discovery for strategies, so the
import is what registers). Then ``Trainer(strategy="pipedap", devices=2)`` trains with it;
``PipeDAPStrategy(...)`` works as an instance too.
"""

from lightning_pipedap.schedule import Op, OpKind, Schedule
from lightning_pipedap.strategy import PipeDAPStrategy, valid_schedule_names

__all__ = ["PipeDAPStrategy", "Schedule", "Op", "OpKind", "register", "valid_schedule_names"]
__version__ = "0.1.0"


def register() -> None:
    """Register ``"pipedap"`` and ``"pipedap_spawn"`` in Lightning's ``StrategyRegistry`` (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    PipeDAPStrategy.register_strategies(StrategyRegistry)


register()
