"""After a failure no rank enters a collective its peers will not enter, and a lost peer ends the process.

Lightning runs the callbacks' ``on_exception`` hooks (a ``ModelCheckpoint(save_on_exception=True)``
saves there, which ends in a barrier) before the strategy's, and the rank that failed and the ranks
that did not are then at different places: one in a checkpoint barrier, another in the next step's
broadcast. Waiting there only delays the error by the process group's timeout. So once a rank has
seen an exception (:meth:`CollectivesOffAfterFailure.abort`, called from the first callback's
``on_exception``), the strategy's collectives are local: ``barrier`` returns, ``broadcast`` returns
the object, ``reduce`` and ``all_gather`` return this rank's tensor.

:func:`exit_on_lost_peer` is what the strategy does when the heartbeat watchdog
(:class:`~lightning_pipedap.engine.collectives.Heartbeat`) finds a peer silent for longer than the
communication timeout plus a grace period: log the message naming the rank and end the process
with exit code 1.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

from torch import Tensor

from lightning_pipedap import compat
from lightning_pipedap.engine import collectives as C
from lightning_pipedap.strategy import preemption
from lightning_pipedap.strategy.lightning_reads import trainer_of
from lightning_pipedap.strategy.messages import failure, log

#: exit code of a process ended because a peer stopped answering
LOST_PEER_EXIT_CODE = 1
#: exit code of a fit stopped by SIGTERM before it finished (128 + 15, as the shell reports a SIGTERM'd process)
SIGTERM_EXIT_CODE = 143


class CollectivesOffAfterFailure:
    """Mixin for a Lightning ``ParallelStrategy``: no collective on the default group after :meth:`abort`.

    Needs ``self._aborted`` (bool) and, for :meth:`abort`, ``self.stop_fit_after_failure(word)`` (tell the peers
    ``word`` and stop the communication worker without waiting: :class:`~.results.RunResults`).
    """

    _aborted: bool
    stop_fit_after_failure: Callable[[str], None]
    #: the last fit's final parameters that are not finite, in words (None: finite, or not checked)
    final_parameters: Optional[str] = None

    def abort(self, exception: Optional[BaseException] = None) -> None:
        """Mark this rank as failed: stop the communication worker without waiting, make collectives local."""
        if isinstance(exception, SystemExit) and not exception.code:
            # Lightning ends a SIGTERM'd fit with SIGTERMException (a SystemExit, code 0); a job scheduler
            # must not record an interrupted fit as a success: exit as a SIGTERM'd process does
            exception.code = SIGTERM_EXIT_CODE
        if self._aborted:
            return
        self._aborted = True
        if getattr(self, "local_rank", None) == 0:  # every rank sees the failure: reap_children waits at teardown
            disarm_child_observer()
        # a failure caused by a peer that stopped on SIGTERM (it left a collective): the job is pre-empted, exit 143
        heartbeat = getattr(self, "peer_heartbeat", None)  # (None: one process, nothing to lose at exit)
        pre_empted = preemption.check_peers(heartbeat)
        if heartbeat is not None:
            preemption.note_failed_fit()
        # tell the peers now (they stop waiting for this rank) and stop the communication worker
        self.stop_fit_after_failure("interrupted" if isinstance(exception, KeyboardInterrupt)
                                    else "stopped" if isinstance(exception, SystemExit) or pre_empted else "failed")
        settle = getattr(self, "settle_after_failure", None)  # (the last completed step: failure_state.settle)
        if settle is not None:
            settle()
        if exception is not None and not isinstance(exception, (SystemExit, KeyboardInterrupt)):
            # on every rank, so each rank's own log file (train_ddp_process_<r>.log, [rank r]-prefixed) has it; not on
            # the terminal, where Python/Hydra print the exception once (a console copy printed every error twice)
            failure(f"pipedap: rank {getattr(self, 'global_rank', '?')} failed; collectives of the default group are "
                    "skipped from now on", exception)

    def setup_environment(self) -> None:
        preemption.start_fit(getattr(self, "global_rank", None))  # (SIGTERM during set-up: SystemExit(143))
        super().setup_environment()  # type: ignore[misc]

    def on_train_start(self) -> None:
        preemption.enter_fit()
        route_sigterm(self)
        super().on_train_start()  # type: ignore[misc]

    def teardown(self) -> None:
        super().teardown()  # type: ignore[misc]
        preemption.end_fit()

    def check_final_parameters(self, module: Any) -> None:
        """At the end of a fit that did not fail (pending updates applied): note parameters that are not finite
        (:attr:`final_parameters`, the summary, exit code 3: :mod:`.preemption`); ``nonfinite="ignore"``: no
        check."""
        self.final_parameters = None
        if getattr(self, "config", None) is None or self.config.nonfinite == "ignore" or module is None:
            return
        from lightning_pipedap.strategy.numerics import nonfinite_parameters  # noqa: PLC0415

        self.final_parameters = nonfinite_parameters(module)
        if self.final_parameters is not None:
            log.error("pipedap: rank %s: the fit ended with parameters that are not finite: %s; the process will "
                      "exit with %d", getattr(self, "global_rank", "?"), self.final_parameters,
                      preemption.NONFINITE_EXIT_CODE)
            preemption.note_nonfinite_parameters(self.final_parameters)

    # Lightning's collectives: a lost peer's bare backend error (gloo's "Connection reset by peer") is re-raised as
    # PeerLostError naming this rank, the operation and the peer (engine.collectives.named_peer_failure)
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._aborted:
            return
        name = args[0] if args else kwargs.get("name")
        with C.naming_peer_failures(f"Lightning's barrier{f' {name!r}' if name else ''}"):
            super().barrier(*args, **kwargs)  # type: ignore[misc]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._aborted:
            return obj
        with C.naming_peer_failures(f"Lightning's broadcast of a {type(obj).__name__} from rank {src}"):
            return super().broadcast(obj, src)  # type: ignore[misc]

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        if self._aborted:
            return tensor
        with C.naming_peer_failures(f"Lightning's reduce ({reduce_op})"):
            return super().reduce(tensor, group=group, reduce_op=reduce_op)  # type: ignore[misc]

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        if self._aborted:
            return tensor.unsqueeze(0)
        with C.naming_peer_failures("Lightning's all_gather"):
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)  # type: ignore[misc]


def exit_on_lost_peer(message: str) -> None:
    """Log ``message`` (to the ``lightning_pipedap`` logger and stderr) and end the process with exit code 1, or
    143 when the job is pre-empted (this rank or a peer received SIGTERM: :mod:`.preemption`).

    Called from the heartbeat thread: the main thread may be blocked inside a collective that only
    the lost peer could complete, so an exception could not reach it.
    """
    code = preemption.exit_code(LOST_PEER_EXIT_CODE)
    if code == preemption.PREEMPTED_EXIT_CODE:
        message += f" (the job is pre-empted: exit code {code})"
    log.error(message)
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    finally:
        preemption.exit_now(code)


def reap_children(launcher: Any, wait_s: float = 5.0) -> list[int]:
    """After a failure on the launching rank: give the ranks it started ``wait_s`` seconds to exit by
    themselves (they see the failure through their own collectives), then SIGKILL the rest (a rank
    stopped with SIGSTOP, or hung), so no process outlives the job. Returns the pids killed.

    ``launcher``: Lightning's subprocess launcher (its ``procs``: ``subprocess.Popen`` of the other
    local ranks); anything else (spawned processes, which torch's spawn joins, or ranks started by
    torchrun/SLURM) is left alone.
    """
    import time  # noqa: PLC0415

    procs = [p for p in getattr(launcher, "procs", None) or [] if hasattr(p, "poll")]  # (Popen only)
    deadline = time.monotonic() + wait_s
    while procs and time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    killed = []
    for local_rank, p in enumerate(procs, start=1):
        if p.poll() is None:
            log.error("pipedap: local rank %d (pid %d) did not exit within %.0f s of the failure; killing it",
                      local_rank, p.pid, wait_s)
            p.kill()
            killed.append(p.pid)
    return killed


def disarm_child_observer() -> int:
    """Stop Lightning's child-process observer in this process from SIGKILLing it; returns how many it stopped.

    Lightning's subprocess launcher starts, on the launching rank, a thread that polls the ranks it
    started every 5 s and, on the first non-zero exit code, SIGKILLs every process including the
    launching one. After a SIGTERM or a failure that every rank sees, the other ranks exit with their
    own code (143, or 1) moments before the launching rank; the observer would then turn the launching
    rank's own exit code into -9. :func:`reap_children` (run at teardown after a failure) takes over its
    other duty: no rank outlives the job. The observer is found among the live threads by its class
    (Lightning's ``_ChildProcessObserver``, a private name: with another Lightning nothing is stopped;
    :func:`~lightning_pipedap.compat.forget_observed_children`).
    """
    return compat.forget_observed_children()


def route_sigterm(strategy: Any) -> None:
    """Replace Lightning's SIGTERM notifier (it runs a ``broadcast`` inside the signal handler, which pairs
    with whatever collective the other ranks are in and desynchronises them) with one that only sets the
    trainer's ``received_sigterm`` flag (and, on the launching rank, forwards the signal to the ranks it
    started, as Lightning does). The flag reaches the other ranks through the heartbeat within a second;
    Lightning's per-step broadcast of rank 0's flag then stops every rank at the same step.

    Other handlers in Lightning's composed SIGTERM handler (the user's) are kept.
    """
    import signal  # noqa: PLC0415
    import threading  # noqa: PLC0415

    hooks = compat.sigterm_hooks()  # (Lightning's private names: with another Lightning, keep its handler, not fail)
    if hooks is None:
        log.info("pipedap: this Lightning has no _SignalConnector._sigterm_notifier_fn; its SIGTERM handler is kept")
        return
    lightning_notifier = hooks.notifier

    trainer = trainer_of(strategy.lightning_module)
    heartbeat = strategy.peer_heartbeat  # (None: no multi-process fit)
    if trainer is None or heartbeat is None or threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGTERM)
    if not isinstance(handler, hooks.composed):
        return
    connector = compat.signal_connector(trainer)

    def notify(signum: int, frame: Any) -> None:
        # idempotent: a second SIGTERM (torchrun forwards the scheduler's, Lightning's launcher forwards rank 0's)
        # only counts; the first already stops the fit at the next step and makes the exit code 143
        preemption.note("this rank")
        if preemption.own_signals() > 1:
            return
        log.info("pipedap: rank %s received SIGTERM; stopping every rank at the next step", trainer.global_rank)
        if strategy.launcher is not None:
            disarm_child_observer()  # the ranks it started now exit 143; this rank must too, not -9
            strategy.launcher.kill(signum)
        connector.received_sigterm = True
        heartbeat.publish("sigterm")

    def peer_noted(rank: int, word: str) -> None:
        if word in preemption.PEER_WORDS:
            connector.received_sigterm = True
            if preemption.note(f"rank {rank}") and heartbeat.note is None:
                if strategy.local_rank == 0:
                    disarm_child_observer()  # (the ranks it started exit 143 now; this rank must too, not -9)
                heartbeat.publish("preempted")  # (the signalled rank waits at exit until every peer knows)

    # (preemption's own handler, installed at set-up, is the "original" Lightning appended: notify replaces both)
    handler.signal_handlers = [notify if getattr(h, "__func__", None) is lightning_notifier else h
                               for h in handler.signal_handlers if not preemption.is_handler(h)]
    heartbeat.on_note = peer_noted
    preemption.enter_fit(heartbeat)
