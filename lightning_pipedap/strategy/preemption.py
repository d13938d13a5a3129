"""A pre-empted job ends every rank with exit code 143, through a path that runs no C++ destructor; a fit whose
final parameters are not finite ends the process with exit code 3.

A scheduler pre-empts a job by sending SIGTERM to one of its tasks or to all of them, and a launcher
(torchrun, Lightning's) forwards it, sometimes twice. Whichever rank received it, the fit stops and every
rank's process exits with 143 (128 + 15, what the shell reports for a SIGTERM'd process), so the job is
recorded as pre-empted, not as failed (1) or as killed by a signal (-15).

How:

- A rank that receives SIGTERM (:func:`note`, from the strategy's SIGTERM handler) and a rank that learns
  through the heartbeat that a peer received it or stopped on it (``"sigterm"`` / ``"stopped"``) mark this
  process as pre-empted. Whatever then ends the fit (Lightning's ``SIGTERMException``, a collective whose peer
  left, the lost-peer watchdog), the process exits with 143.
- The exit is ``os._exit(143)`` after flushing the log handlers and stdio, from an ``atexit`` callback (after
  the script's own code and the traceback of an uncaught error, before the interpreter's finalisation) or from
  the watchdog. Interpreter finalisation after a fit that stopped mid-step destroys the live process groups
  and their C++ threads (gloo's, the rendezvous store's) while a peer may still be talking to them, which can
  end in ``std::terminate`` (``terminate called without an active exception``, exit -6); ``os._exit`` skips it.
- SIGTERM is handled from the strategy's set-up to the end of the process: during set-up it raises
  ``SystemExit(143)`` in the main thread (so the fit's failure path runs); during the fit the strategy's
  notifier sets the stop flag (a second SIGTERM does nothing more); after the fit, in a pre-empted process, it
  exits with 143 at once, and in any other process it does what the default disposition does (the process
  is killed by SIGTERM). A handler the user installed before the fit is left in place.

A fit that ended with NaN or inf in its parameters (``nonfinite="warn"`` applies such updates, as DDP does) is
noted by the strategy at its teardown (:func:`note_nonfinite_parameters`); the process then exits with
:data:`NONFINITE_EXIT_CODE` at its end (the same ``atexit`` path), so a job that trained into NaN does not
report success. A later fit in the same process that ends finite clears it. A fit that stopped on an
exception which then ends the process uncaught exits with 1, Python's code, through the same ``os._exit``.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from typing import Any, Optional

#: exit code of every rank of a pre-empted job (128 + SIGTERM)
PREEMPTED_EXIT_CODE = 143
#: exit code of a process whose last fit ended with parameters that are not finite (``nonfinite="warn"``)
NONFINITE_EXIT_CODE = 3
#: heartbeat words that mean "this peer was pre-empted"
PEER_WORDS = ("sigterm", "preempted", "stopped")

log = logging.getLogger("lightning_pipedap")


class _State:
    """Per process: whether the current (or last) fit ends on a SIGTERM, who received it, and the phase."""

    def __init__(self) -> None:
        self.source: Optional[str] = None  # "this rank" or "rank N" (None: not pre-empted)
        self.rank: Optional[int] = None  # this process's global rank (for the messages)
        self.phase = "idle"  # "setup" | "fit" | "ended" (| "idle": no fit in this process)
        self.own_signals = 0  # SIGTERMs this process received
        self.heartbeat: Any = None  # the fit's Heartbeat (rank 0 waits for the peers' last words before exiting)
        self.nonfinite: Optional[str] = None  # the last fit's final parameters are not finite: what (exit code 3)
        self.failed = False  # the last fit stopped on an exception (strategy's abort)


_state = _State()


def start_fit(rank: Optional[int]) -> None:
    """A fit starts (the strategy's set-up): forget an earlier pre-emption, handle SIGTERM (:func:`install`)."""
    _state.source, _state.rank, _state.own_signals, _state.phase = None, rank, 0, "setup"
    _state.heartbeat, _state.nonfinite, _state.failed = None, None, False
    install()


def enter_fit(heartbeat: Any = None) -> None:
    """The training loop runs: SIGTERM goes to the strategy's notifier (it sets Lightning's stop flag).
    ``heartbeat``: the fit's :class:`~lightning_pipedap.engine.collectives.Heartbeat` (None: one process)."""
    _state.phase, _state.heartbeat = "fit", heartbeat


def check_peers(heartbeat: Any, timeout_s: float = 2.0) -> bool:
    """After a failure on this rank: :func:`note_peer_words` with the peers' words read from the store now (in a
    thread, at most ``timeout_s`` seconds: the store's host may hang), else with those the heartbeat last saw.
    Returns whether this process is pre-empted."""
    if preempted() or heartbeat is None:
        return preempted()
    words: dict[int, str] = {}

    def read() -> None:
        words.update(heartbeat.peer_words())

    reader = threading.Thread(target=read, name="pipedap-peer-words", daemon=True)
    reader.start()
    reader.join(timeout_s)
    return note_peer_words({**heartbeat.peer_words(cached=True), **words})


def end_fit() -> None:
    """The strategy tore down: a SIGTERM now ends a pre-empted process at once."""
    _state.phase = "ended"


def note(source: str) -> bool:
    """Mark this process as pre-empted; ``source``: ``"this rank"`` or ``"rank N"`` (who received the SIGTERM).

    Returns whether this is the first note (the first source is kept and logged)."""
    if source == "this rank":
        _state.own_signals += 1
    if _state.source is not None:
        return False
    _state.source = source
    log.info("pipedap: rank %s: the job is pre-empted (SIGTERM received by %s); this rank will exit with %d",
             "?" if _state.rank is None else _state.rank, source, PREEMPTED_EXIT_CODE)
    return True


def note_peer_words(words: dict[int, str]) -> bool:
    """:func:`note` the first peer whose heartbeat word (:meth:`~lightning_pipedap.engine.collectives.Heartbeat.
    peer_words`) says it was pre-empted; returns whether one did."""
    for rank, word in sorted(words.items()):
        if word in PEER_WORDS:
            note(f"rank {rank}")
            return True
    return False


def note_failed_fit() -> None:
    """The fit stopped on an exception (the strategy's ``abort``): if that exception ends the process uncaught, the
    process exits with 1 (Python's code for it) without the interpreter's finalisation (see the module docstring:
    a communication worker may still be inside a collective its lost peer will never finish)."""
    _state.failed = True


def note_nonfinite_parameters(what: str) -> None:
    """The fit ended with parameters that are not finite (``what``: :func:`~.numerics.nonfinite_parameters`): the
    process exits with :data:`NONFINITE_EXIT_CODE` (unless pre-empted: 143), logged at exit."""
    _state.nonfinite = what


def preempted() -> bool:
    """Whether this process's fit ends on a SIGTERM (its own or a peer's)."""
    return _state.source is not None


def own_signals() -> int:
    """How many SIGTERMs this process received since the fit started."""
    return _state.own_signals


def exit_code(default: int) -> int:
    """:data:`PREEMPTED_EXIT_CODE` when pre-empted, else ``default``."""
    return PREEMPTED_EXIT_CODE if preempted() else default


def exit_now(code: int) -> None:
    """Flush every log handler and stdio, then ``os._exit(code)`` (no interpreter finalisation)."""
    try:
        for handler in list(logging.getLogger().handlers) + list(log.handlers):
            try:
                handler.flush()
            except Exception:  # noqa: BLE001  (a closed stream: nothing to flush)
                pass
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
    finally:
        os._exit(code)


def install() -> None:
    """Handle SIGTERM with :func:`_on_sigterm` in this process (main thread only), unless a handler other than
    the default one is installed (the user's, kept) or ours already is."""
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm or current not in (signal.SIG_DFL, None):
        return
    signal.signal(signal.SIGTERM, _on_sigterm)


def is_handler(handler: Any) -> bool:
    """Whether ``handler`` is this module's SIGTERM handler (the strategy's notifier replaces it during the fit)."""
    return handler is _on_sigterm


def _on_sigterm(signum: int, frame: Any) -> None:
    if _state.phase == "setup":
        note("this rank")
        if _state.own_signals == 1:  # (a second one while the first unwinds: the failure path is running)
            raise SystemExit(PREEMPTED_EXIT_CODE)
        return
    if _state.phase == "fit":  # (the strategy's notifier did not replace Lightning's: only mark)
        note("this rank")
        return
    if preempted():
        exit_now(PREEMPTED_EXIT_CODE)
        return
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        # not pre-empted, no fit running, this is the process's handler: what the default disposition does
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    # (else another handler called this one as the one it replaced, e.g. Lightning's during a later fit with another
    # strategy: that handler decides)


def _at_exit() -> None:
    if preempted():
        if _state.heartbeat is not None:
            # every peer must learn that the job is pre-empted (it exits 143, not 1) before this rank's exit breaks
            # its collectives, and rank 0 hosts the rendezvous store where they read it; under Lightning's launcher,
            # rank 0 must learn it before its child-process observer sees this rank's exit (it would SIGKILL rank 0):
            # wait until each peer has published that it knows ("sigterm", "preempted") or stopped, or is dead
            _state.heartbeat.wait_peers_noted(timeout_s=3.0)
        log.info("pipedap: rank %s: exiting with %d (pre-empted: SIGTERM received by %s)",
                 "?" if _state.rank is None else _state.rank, PREEMPTED_EXIT_CODE, _state.source)
        exit_now(PREEMPTED_EXIT_CODE)
        return
    if _state.failed and getattr(sys, "last_value", None) is not None:  # (uncaught: Python prints it, exits 1)
        exit_now(1)
        return
    if _state.nonfinite is not None:
        log.error("pipedap: rank %s: exiting with %d: the fit ended with parameters that are not finite (%s)",
                  "?" if _state.rank is None else _state.rank, NONFINITE_EXIT_CODE, _state.nonfinite)
        exit_now(NONFINITE_EXIT_CODE)


atexit.register(_at_exit)
