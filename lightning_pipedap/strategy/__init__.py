"""The Lightning strategy: options (``config``), the run-time state machine (``controller``), one fit's
run-time (``runtime``: engine, ``deferred`` updates, ``tracing``, ``planning``, ``resume``, the ``hooks``
it puts on the model), the user hooks that can observe a deferred update (``observers``), checks on the
numbers (``numerics``: non-finite gradients, diverged replicas), and the Lightning glue (``lightning``;
Fabric's: ``fabric``, imported on its own by ``lightning_pipedap.register``)."""

from lightning_pipedap.strategy.config import PipeDAPConfig, valid_schedule_names
from lightning_pipedap.strategy.lightning import PipeDAPStrategy
from lightning_pipedap.strategy.numerics import NonFiniteGradientError, ParameterDivergenceError
from lightning_pipedap.strategy.resume import PLAN_KEY, PLAN_VERSION

__all__ = ["PLAN_KEY", "PLAN_VERSION", "NonFiniteGradientError", "ParameterDivergenceError", "PipeDAPConfig",
           "PipeDAPStrategy", "valid_schedule_names"]
