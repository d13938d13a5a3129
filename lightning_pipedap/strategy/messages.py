"""The strategy's messages: Python ``logging`` under the ``lightning_pipedap`` logger.

Messages propagate to the root logger, so an application's handlers (Hydra writes ``<job>.log`` in
the run directory) receive them, each on its own line. When nothing would print them (no handler on
the logger or its ancestors, as in a plain script), a stderr handler is added on first use, as
Lightning does for its own logger. Warnings are also issued as Python warnings (``UserWarning``), so
``warnings`` filters and ``pytest.warns`` see them.

Which rank says what: :func:`info` (the plan, the schedules, the trials: decided on rank 0, identical
everywhere) is said by global rank 0 only. :func:`warn` is said by rank 0 as above and, on the other
ranks, logged to the handlers an application configured for that rank (its own log file: Hydra's
``train_ddp_process_<r>.log`` of a popen rank, ``app.train.LogToJobDir``'s of a spawned one), never to
a stderr handler of our own, so a plain script's terminal shows each warning once. :func:`every_rank`
(the set-up line) is said by every rank. Every record of the ``lightning_pipedap`` logger from a rank
other than 0, errors included, starts with ``[rank <r>] ``. A rank's failure (:func:`failure`, with the
traceback) goes to the log files only: the exception itself is printed on the terminal once per rank, by
Python or Hydra, as under ``strategy="ddp"``.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_only

log = logging.getLogger("lightning_pipedap")


def rank() -> int:
    """This process's global rank as Lightning set it (0 before a strategy set it up)."""
    return int(getattr(rank_zero_only, "rank", 0) or 0)


class RankPrefix(logging.Filter):
    """Prefix each record of a rank other than 0 with ``[rank <r>] `` (the rank read when the record is made)."""

    def filter(self, record: logging.LogRecord) -> bool:
        r = rank()
        if r and not getattr(record, "pipedap_rank_prefixed", False):
            record.msg = f"[rank {r}] {record.msg}"
            record.pipedap_rank_prefixed = True
        return True


if not any(isinstance(f, RankPrefix) for f in log.filters):
    log.addFilter(RankPrefix())


def _ready() -> logging.Logger:
    if not log.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    elif log.getEffectiveLevel() > logging.INFO and log.level == logging.NOTSET:
        log.setLevel(logging.INFO)  # a root logger at WARNING would drop the plan and schedule messages
    return log


def _console_streams() -> tuple:
    return tuple(x for x in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if x is not None)


def is_console(handler: logging.Handler) -> bool:
    """Whether ``handler`` prints to the terminal: a ``StreamHandler`` (not a file's) on stdout or stderr, directly
    or through a wrapper with a ``stream`` attribute."""
    if not isinstance(handler, logging.StreamHandler) or isinstance(handler, logging.FileHandler):
        return False
    stream = getattr(handler, "stream", None)
    stream = getattr(stream, "wrapped_stream", stream)
    return any(stream is s for s in _console_streams())


def failure(message: str, exception: BaseException) -> int:
    """Log ``message`` at ERROR with ``exception``'s traceback to the log *files* of this process only (every
    handler of the ``lightning_pipedap`` logger and its ancestors that does not print to the terminal, e.g. Hydra's
    ``<job>.log``, a rank's ``train_ddp_process_<r>.log``); returns how many handlers got it.

    The exception goes on to end the process, and Python (or Hydra, or the caller) prints its traceback on this
    rank's terminal once: a console copy here would print every traceback twice. Without a file handler nothing
    is logged (no stderr handler is added, and Python's last-resort handler is not used)."""
    if not log.isEnabledFor(logging.ERROR):
        return 0
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, (),
                            (type(exception), exception, exception.__traceback__))
    if not log.filter(record):  # (the rank prefix)
        return 0
    n = 0
    logger: Optional[logging.Logger] = log
    while logger is not None:
        for handler in logger.handlers:
            if not is_console(handler) and record.levelno >= handler.level:
                handler.handle(record)
                n += 1
        logger = logger.parent if logger.propagate else None
    return n


def info(message: str) -> None:
    """Log ``message`` at INFO on global rank 0."""
    if rank() == 0:
        _ready().info(message)


def warn(message: str) -> None:
    """Log ``message`` at WARNING and issue it as a ``UserWarning`` on global rank 0; on another rank, log it
    (``[rank <r>]``-prefixed) to the handlers configured for that rank, if any."""
    if rank() == 0:
        _ready().warning(message)
        warnings.warn(message, UserWarning, stacklevel=2)
    elif log.hasHandlers():
        log.warning(message)


def every_rank(message: str) -> None:
    """Log ``message`` at INFO on every rank: rank 0 as :func:`info`, another rank (``[rank <r>]``-prefixed)
    to the handlers configured for it, if any."""
    if rank() == 0:
        _ready().info(message)
    elif log.hasHandlers():
        if log.getEffectiveLevel() > logging.INFO and log.level == logging.NOTSET:
            log.setLevel(logging.INFO)
        log.info(message)
