"""The strategy's messages: Python ``logging`` under the ``lightning_pipedap`` logger, from global rank 0.

Messages propagate to the root logger, so an application's handlers (Hydra writes ``<job>.log`` in
the run directory) receive them, each on its own line. When nothing would print them (no handler on
the logger or its ancestors, as in a plain script), a stderr handler is added on first use, as
Lightning does for its own logger. Warnings are also issued as Python warnings (``UserWarning``), so
``warnings`` filters and ``pytest.warns`` see them.
"""

from __future__ import annotations

import logging
import sys
import warnings

from lightning.pytorch.utilities.rank_zero import rank_zero_only

log = logging.getLogger("lightning_pipedap")


def _ready() -> logging.Logger:
    if not log.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    elif log.getEffectiveLevel() > logging.INFO and log.level == logging.NOTSET:
        log.setLevel(logging.INFO)  # a root logger at WARNING would drop the plan and schedule messages
    return log


def info(message: str) -> None:
    """Log ``message`` at INFO on global rank 0."""
    if getattr(rank_zero_only, "rank", 0) == 0:
        _ready().info(message)


def warn(message: str) -> None:
    """Log ``message`` at WARNING and issue it as a ``UserWarning``, on global rank 0."""
    if getattr(rank_zero_only, "rank", 0) == 0:
        _ready().warning(message)
        warnings.warn(message, UserWarning, stacklevel=2)
