"""The trainer's end of the compression helper: start, requests, answers by id, liveness, stop.

:class:`HelperChannel` starts :func:`~.helper.helper_main` in a fresh interpreter (``spawn``
context: safe with CUDA and with ``torch.distributed``; ``daemon=True``) and talks to it over two
one-way ``Pipe`` s (the transport of ``SimpleQueue``, used directly because its ``poll(timeout)``
makes timed waits possible); the protocol is in :mod:`.helper`.

* **No second run of the training script.** ``spawn`` normally re-runs the parent's main script
  in the child; :func:`start_without_main` keeps it from doing so (see there).
* **Answers by id.** One thread at a time reads the result pipe and files every answer under its
  id, so threads waiting for different requests can share the pipe; an answer that arrives after
  its waiter timed out is kept for the next wait on that id.
* **Every wait is bounded.** Start-up, answers and large requests (a request that does not fit in
  the pipe is written by a thread the caller waits for) raise :class:`HelperTimeoutError` after
  their timeout, naming the operation and the helper's pid; the result pipe is watched together
  with the helper's sentinel, so a dead helper raises :class:`HelperDiedError` (operation, pid,
  exit code or signal) at once, and on every later call.
* **Liveness the other way.** The helper exits when the trainer dies (:func:`~.helper.watch_parent`).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import sys
import threading
import time
import types
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch.multiprocessing  # noqa: F401  (registers tensor reductions for the spawn pickler)

from lightning_pipedap.compress.helper import EXIT_PARENT_DIED, READY_ID, helper_main

#: requests up to this size are written directly (they fit in a Linux pipe's 64 KiB buffer with room
#: to spare); larger ones through a thread, so a stalled helper cannot block the trainer forever
DIRECT_SEND_BYTES = 16 << 10
_START_LOCK = threading.Lock()


class HelperDiedError(RuntimeError):
    """The compression helper process is not running (crashed, killed, or exited)."""


class HelperTimeoutError(RuntimeError):
    """The compression helper did not answer within the timeout."""


def start_without_main(proc: mp.process.BaseProcess) -> None:
    """``proc.start()`` for a ``spawn`` process, without the child importing the parent's ``__main__``.

    CPython's ``multiprocessing.spawn.get_preparation_data`` (called by ``start()``) tells the child
    to import the parent's main module, by ``__main__.__spec__.name`` or else ``__main__.__file__``,
    and the child runs it as ``__mp_main__``: a training script without an
    ``if __name__ == "__main__":`` guard would train again inside the helper. The helper's target and
    arguments come from this package, torch and multiprocessing only, so while ``start()`` runs,
    ``sys.modules["__main__"]`` is a bare module without ``__file__`` and ``__spec__``; the child then
    keeps its own ``__main__``. The original module is restored in ``finally``; starts are
    serialised by a lock. Other threads that look up ``__main__`` during those milliseconds see the
    bare module.
    """
    with _START_LOCK:
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            proc.start()
        finally:
            sys.modules["__main__"] = main


def stop_helper(proc: mp.process.BaseProcess, req, res, timeout_s: float = 10.0, polite: bool = True) -> int | None:
    """Stop the helper: a ``stop`` request (when ``polite``), then SIGKILL (the helper ignores SIGTERM); close the
    pipes and the process handle (its sentinel fd).

    Waits at most ``timeout_s`` for the polite stop and 2 s after the signal.

    Returns:
        the helper's exit code (negative: killed by that signal).
    """
    try:
        if proc.is_alive():
            if polite:
                try:
                    req.send(("stop",))
                except (BrokenPipeError, ConnectionResetError, OSError):
                    pass
                proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        else:
            proc.join(0.1)
        return proc.exitcode
    finally:
        for conn in (req, res):
            try:
                conn.close()
            except OSError:
                pass
        try:
            proc.close()
        except ValueError:  # still running after kill (should not happen): leave the handle open
            pass


class HelperChannel:
    """A started helper process and the trainer's ends of its pipes.

    Args:
        helper_args: :func:`~.helper.helper_main`'s arguments after the two pipe ends.
        start_timeout_s: seconds from now within which the helper must announce itself.

    Attributes:
        pid: the helper's process id.
        startup_s: seconds from ``start()`` to the helper being ready (wall clock), None until known.
    """

    def __init__(self, helper_args: tuple, start_timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        req_r, self._req = ctx.Pipe(duplex=False)
        self._res, res_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=helper_main, name="pipedap-compress-helper", daemon=True,
                                 args=(req_r, res_w) + tuple(helper_args))
        self.start_timeout_s = float(start_timeout_s)
        started = time.time()
        self._start_deadline = time.monotonic() + self.start_timeout_s
        start_without_main(self._proc)
        self.pid: int = self._proc.pid
        req_r.close()
        res_w.close()
        self._finalizer = weakref.finalize(self, stop_helper, self._proc, self._req, self._res)
        self._started = started
        self.startup_s: float | None = None
        self._lock = threading.Lock()  # answers and expected ids
        self._send_lock = threading.Lock()  # one writer of the request pipe at a time
        self._recv_lock = threading.Lock()  # one reader of the result pipe at a time
        self._ready_lock = threading.Lock()  # one waiter for the start-up answer
        self._expected: set[int] = {READY_ID}
        self._answers: dict[int, tuple[str, Any, float]] = {}
        self._next_call = READY_ID - 1  # ids of requests without a ticket: -2, -3, ...
        self._fault: tuple[type[RuntimeError], str] | None = None

    # ------------------------------------------------------------------ start-up
    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until the helper is ready.

        Args:
            timeout_s: seconds from now; None: until ``start_timeout_s`` after the start.

        Raises:
            HelperDiedError: the helper died or reported an error while starting (with its traceback).
            HelperTimeoutError: not ready in time.
        """
        if self.startup_s is not None:
            return
        if timeout_s is None:
            wait_s, shown = self._start_deadline - time.monotonic(), self.start_timeout_s
        else:
            wait_s = shown = float(timeout_s)
        t0 = time.monotonic()
        if not self._ready_lock.acquire(timeout=max(wait_s, 0.0)):  # another thread is waiting for it
            self._raise_timeout("start-up", shown)
        try:
            if self.startup_s is not None:
                return
            wait_s -= time.monotonic() - t0
            (kind, value, _), _ = self.wait(READY_ID, wait_s, "start-up", shown)
            if kind != "ok":
                self._fault = (HelperDiedError, f"compression helper (pid {self.pid}) failed to start:\n{value}")
                raise HelperDiedError(self._fault[1])
            self.startup_s = max(value[1] - self._started, 0.0)
        finally:
            self._ready_lock.release()

    def start_expired(self) -> bool:
        """True when ``start_timeout_s`` has passed since the start."""
        return time.monotonic() >= self._start_deadline

    # ------------------------------------------------------------------ requests and answers
    def check(self) -> None:
        """Raise the channel's fault, if any (helper died, failed to start, request stream blocked)."""
        if self._fault is not None:
            raise self._fault[0](self._fault[1])

    def send(self, msg: tuple, what: str, timeout_s: float) -> None:
        """Send request ``msg`` (its id ``msg[1]`` is then expected to be answered).

        Raises:
            HelperDiedError: the helper is gone (broken pipe).
            HelperTimeoutError: a large request was not taken within ``timeout_s``; the request pipe
                holds a partial message, so every later call raises this too.
        """
        data = ForkingPickler.dumps(msg)
        with self._send_lock:
            self.check()
            if len(msg) > 1:
                with self._lock:
                    self._expected.add(msg[1])
            errors: list[BaseException] = []
            if len(data) <= DIRECT_SEND_BYTES:
                try:
                    self._req.send_bytes(data)
                except (BrokenPipeError, ConnectionResetError, OSError) as e:
                    errors.append(e)
            else:
                writer = threading.Thread(target=_write, args=(self._req, data, errors), daemon=True,
                                          name="pipedap-helper-send")
                writer.start()
                writer.join(timeout_s)
                if writer.is_alive():
                    self._fault = (HelperTimeoutError, f"compression helper (pid {self.pid}, alive) did not take "
                                                       f"the {len(data)}-byte request of {what} within {timeout_s:g} s")
                    raise HelperTimeoutError(self._fault[1])
            if errors:
                self._mark_dead(what, errors[0])

    def wait(self, key: int, timeout_s: float, what: str, shown_timeout_s: float | None = None,
             ) -> tuple[tuple[str, Any, float], float]:
        """The answer ``(kind, value, seconds)`` to request ``key`` and the seconds waited for it.

        Raises:
            HelperDiedError: the helper died before answering.
            HelperTimeoutError: no answer within ``timeout_s`` (the message shows ``shown_timeout_s``
                when given); the answer is still filed when it comes.
        """
        t0 = time.perf_counter()
        deadline = t0 + timeout_s
        while True:
            with self._lock:
                if key in self._answers:
                    self._expected.discard(key)
                    return self._answers.pop(key), time.perf_counter() - t0
            self.check()
            remaining = max(deadline - time.perf_counter(), 0.0)
            if self._recv_lock.acquire(timeout=remaining):
                try:
                    with self._lock:
                        filed = key in self._answers
                    if not filed:
                        self._receive(remaining, what)
                finally:
                    self._recv_lock.release()
            if remaining <= 0.0:
                with self._lock:
                    if key in self._answers:
                        continue
                self._raise_timeout(what, timeout_s if shown_timeout_s is None else shown_timeout_s)

    def call(self, op: str, args: tuple, what: str, timeout_s: float) -> Any:
        """Send request ``op`` (not a ticket's) with ``args`` and return the value of its answer.

        Raises:
            RuntimeError: the helper reported an error (message with its traceback).
            HelperDiedError, HelperTimeoutError: as for :meth:`send` and :meth:`wait`; after a timeout
                a late answer is dropped.
        """
        with self._lock:
            key = self._next_call
            self._next_call -= 1
        self.send((op, key) + tuple(args), what, timeout_s)
        try:
            (kind, value, _), _ = self.wait(key, timeout_s, what)
        except HelperTimeoutError:
            self.forget(key)
            raise
        if kind == "error":
            raise RuntimeError(f"compression helper failed in {what}:\n{value}")
        return value

    def forget(self, key: int) -> None:
        """Stop expecting an answer to ``key`` (dropped if it arrives)."""
        with self._lock:
            self._expected.discard(key)
            self._answers.pop(key, None)

    def close(self, timeout_s: float = 10.0) -> int | None:
        """Stop the helper (:func:`stop_helper`, not politely when the request pipe is blocked);
        returns its exit code. Call once."""
        self._finalizer.detach()
        blocked = self._fault is not None and self._fault[0] is HelperTimeoutError
        self._fault = (RuntimeError, "compression pipeline is closed")
        return stop_helper(self._proc, self._req, self._res, timeout_s, polite=not blocked)

    # ------------------------------------------------------------------ internals
    def _receive(self, timeout_s: float, what: str) -> None:
        """File the next answer that arrives within ``timeout_s``; watches the helper's sentinel."""
        ready = mpc.wait([self._res, self._proc.sentinel], timeout=timeout_s)
        if self._res in ready:
            try:
                kind, key, value, seconds = self._res.recv()
            except (EOFError, OSError) as e:
                self._mark_dead(what, e)
            with self._lock:
                if key in self._expected:
                    self._answers[key] = (kind, value, seconds)
        elif ready:  # sentinel only: the process ended without a pending answer
            self._mark_dead(what, None)

    def _raise_timeout(self, what: str, timeout_s: float) -> None:
        if not self._proc.is_alive():
            self._mark_dead(what, None)
        raise HelperTimeoutError(f"compression helper (pid {self.pid}, alive) did not finish {what} within "
                                 f"{timeout_s:g} s")

    def _mark_dead(self, what: str, cause: BaseException | None) -> None:
        self._proc.join(timeout=2.0)
        code = self._proc.exitcode
        reason = ("killed by signal %d" % -code) if code is not None and code < 0 else f"exit code {code}"
        if code == EXIT_PARENT_DIED:
            reason += " (parent-death watchdog)"
        message = (f"compression helper (pid {self.pid}) died during {what}: {reason}"
                   + (f" ({type(cause).__name__})" if cause is not None else ""))
        self._fault = (HelperDiedError, message)
        raise HelperDiedError(message) from cause


def _write(conn, data: bytes, errors: list[BaseException]) -> None:
    """Thread body of a large request: ``conn.send_bytes(data)``, an error appended to ``errors``."""
    try:
        conn.send_bytes(data)
    except (BrokenPipeError, ConnectionResetError, OSError) as e:
        errors.append(e)
