"""The strategy's messages: Python ``logging`` under the ``lightning_pipedap`` logger.

Messages propagate to the root logger, so an application's handlers (Hydra writes ``<job>.log`` in
the run directory) receive them, each on its own line. When nothing would print them (no handler on
the logger or its ancestors, as in a plain script), a stderr handler is added on first use, as
Lightning does for its own logger. Warnings are also issued as Python warnings (``UserWarning``), so
``warnings`` filters and ``pytest.warns`` see them.

Which rank says what: :func:`info` (the plan, the schedules, the trials: decided on rank 0, identical
everywhere) is said by global rank 0 only. :func:`warn` is said by rank 0 as above and, on the other
ranks, logged to the log files an application configured for that rank (Hydra's
``train_ddp_process_<r>.log`` of a popen rank, ``app.train.LogToJobDir``'s of a spawned one), never to
the terminal (:func:`to_files`): the terminal shows each warning once, and no line of another rank lands
inside rank 0's progress bar. :func:`every_rank` (the set-up line) is said by every rank, on the other
ranks to their log files too. Every record of the ``lightning_pipedap`` logger from a rank
other than 0, errors included, starts with ``[rank <r>] ``. A rank's failure (:func:`failure`, with the
traceback) goes to the log files only: the exception itself is printed on the terminal once per rank, by
Python or Hydra, as under ``strategy="ddp"``.

Progress bars: a console handler's line must not land inside a progress bar's line. The stderr handler added
here, and the console handlers of an application that calls :func:`route_console_handlers` (the Hydra app
does), write through :class:`BarAwareStream`: around tqdm's bars (cleared and redrawn, as ``tqdm.write``
does), or through the console of Lightning's ``RichProgressBar`` while it runs (the strategy registers the
fit's bar with :func:`use_progress_bar`).
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any, Optional

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


#: the trainer's progress-bar callback while a fit runs (:func:`use_progress_bar`): a rich bar's console prints the
#: messages while its live display runs
_progress_bar: list = [None]


def use_progress_bar(bar: Any) -> None:
    """Tell the console handlers which progress-bar callback the running fit shows (None: none).

    Only Lightning's ``RichProgressBar`` needs it (messages are then printed through its console, above the live
    display); tqdm bars (Lightning's ``TQDMProgressBar``) are found by tqdm itself."""
    _progress_bar[0] = bar


def _rich_console(bar: Any) -> Any:
    """The rich console of ``bar`` while its live display runs, else None."""
    progress = getattr(bar, "progress", None)
    live = getattr(progress, "live", None)
    return getattr(progress, "console", None) if getattr(live, "is_started", False) else None


def write_around_bars(stream: Any, text: str) -> int:
    """Write ``text`` to ``stream`` so that it never shares a line with a progress bar.

    With a rich progress bar live (:func:`use_progress_bar`): printed through its console, above the live display.
    With tqdm bars on the terminal (Lightning's ``TQDMProgressBar``): the bars are cleared, ``text`` is written and
    flushed, and the bars are drawn again on the next line (``tqdm.external_write_mode``, what ``tqdm.write`` does).
    Otherwise written as it is."""
    console = _rich_console(_progress_bar[0])
    if console is not None:
        console.print(text[:-1] if text.endswith("\n") else text, markup=False, highlight=False, emoji=False,
                      soft_wrap=True)
        return len(text)
    tqdm_std = sys.modules.get("tqdm.std")  # (loaded by whoever draws a bar; not imported here)
    bars = getattr(getattr(tqdm_std, "tqdm", None), "_instances", None)
    if bars:
        with tqdm_std.tqdm.external_write_mode(file=stream):
            n = stream.write(text)
            stream.flush()
        return n
    return stream.write(text)


class BarAwareStream:
    """The stream of a console log handler that writes through :func:`write_around_bars`: a log line never lands
    inside a progress bar's line. Everything else is the wrapped stream's (``wrapped_stream``)."""

    def __init__(self, stream: Any) -> None:
        self.wrapped_stream = stream

    def write(self, text: str) -> int:
        return write_around_bars(self.wrapped_stream, text)

    def flush(self) -> None:
        self.wrapped_stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped_stream, name)


def around_bars(handler: logging.Handler) -> logging.Handler:
    """Make a console ``StreamHandler`` write through :class:`BarAwareStream` (idempotent); returns ``handler``."""
    if isinstance(handler, logging.StreamHandler) and not isinstance(handler.stream, BarAwareStream):
        handler.setStream(BarAwareStream(handler.stream))
    return handler


def route_console_handlers(*loggers: logging.Logger) -> int:
    """:func:`around_bars` on every terminal handler (:func:`is_console`) of ``loggers`` (default: the root logger,
    where an application such as Hydra puts its console handler, and ``lightning_pipedap``); returns how many."""
    n = 0
    for logger in loggers or (logging.getLogger(), log):
        for handler in logger.handlers:
            if is_console(handler):
                around_bars(handler)
                n += 1
    return n


def _ready() -> logging.Logger:
    if not log.hasHandlers():
        handler = around_bars(logging.StreamHandler(sys.stderr))
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


def to_files(level: int, message: str, exception: Optional[BaseException] = None) -> int:
    """Log ``message`` at ``level`` (with ``exception``'s traceback, if given) to the log *files* of this process
    only: every handler of the ``lightning_pipedap`` logger and its ancestors that does not print to the terminal
    (:func:`is_console`), e.g. Hydra's ``<job>.log``, a rank's ``train_ddp_process_<r>.log``. Returns how many
    handlers got it; without a file handler nothing is logged (Python's last-resort handler is not used)."""
    if not log.isEnabledFor(level):
        return 0
    exc_info = None if exception is None else (type(exception), exception, exception.__traceback__)
    record = log.makeRecord(log.name, level, __file__, 0, message, (), exc_info)
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


def failure(message: str, exception: BaseException) -> int:
    """Log ``message`` at ERROR with ``exception``'s traceback to the log files of this process only
    (:func:`to_files`); returns how many handlers got it.

    The exception goes on to end the process, and Python (or Hydra, or the caller) prints its traceback on this
    rank's terminal once: a console copy here would print every traceback twice."""
    return to_files(logging.ERROR, message, exception)


def info(message: str) -> None:
    """Log ``message`` at INFO on global rank 0."""
    if rank() == 0:
        _ready().info(message)


def warn(message: str) -> None:
    """Log ``message`` at WARNING and issue it as a ``UserWarning`` on global rank 0; on another rank, log it
    (``[rank <r>]``-prefixed) to the log files configured for that rank, if any (:func:`to_files`)."""
    if rank() == 0:
        _ready().warning(message)
        warnings.warn(message, UserWarning, stacklevel=2)
    else:
        to_files(logging.WARNING, message)


def every_rank(message: str) -> None:
    """Log ``message`` at INFO on every rank: rank 0 as :func:`info`, another rank (``[rank <r>]``-prefixed)
    to the log files configured for it, if any (:func:`to_files`)."""
    if rank() == 0:
        _ready().info(message)
    elif log.hasHandlers():
        if log.getEffectiveLevel() > logging.INFO and log.level == logging.NOTSET:
            log.setLevel(logging.INFO)
        to_files(logging.INFO, message)
