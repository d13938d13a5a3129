"""The compression helper process: what runs in the child that :class:`~.pipeline.CompressionPipeline` starts.

:func:`helper_main` is the process target. It ignores SIGINT (the trainer stops it), limits its
intra-op threads with ``torch.set_num_threads(threads)``, starts the parent-death watchdog
(:func:`watch_parent`), announces itself with a ``ready`` answer and then serves requests from
the trainer until ``stop`` or until the trainer closes its end of the request pipe.

Protocol. Requests are tuples ``(op, id, *args)`` on a one-way request pipe; every request but
``stop`` gets exactly one answer ``(kind, id, value, seconds)`` on a one-way result pipe, ``kind``
``"ok"`` or ``"error"`` (value: the traceback text), ``seconds`` the time the helper spent on it.
The start-up answer has id :data:`READY_ID`, value ``(pid, wall-clock time when ready)``.

======================  ==========================================  ==============================
op                      args                                        value
======================  ==========================================  ==============================
``compress``            bucket, slot                                payload descriptor
``round``               bucket, slot, descriptor of the summed one  payload descriptor
``decompress``          bucket, slot, descriptor of the summed one  None (dense result in ``grad``)
``state_dict``                                                      ``torch.save`` bytes
``load_state_dict``     ``torch.save`` bytes                        names without saved state
``relayout``            numels, layouts, slots, keep_state          names without carried state
======================  ==========================================  ==============================

``relayout`` replaces the helper's buckets: the new shared-memory slots arrive through the request
pipe (torch's reductions for shared tensors pass their file descriptors), and the runtime is
rebuilt with :func:`~.runtime.relayout_runtime`. On any error the helper keeps its old layout.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import threading
import time
import traceback
from typing import Any, Sequence

import torch
import torch.multiprocessing  # noqa: F401  (registers the reductions that rebuild shared tensors)

from lightning_pipedap.compress.runtime import CompressionRuntime, relayout_runtime
from lightning_pipedap.compress.slots import Slot, read_payload, write_payload

#: exit code of the helper when its parent died
EXIT_PARENT_DIED = 3
#: id of the helper's start-up answer
READY_ID = -1


def watch_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Helper thread: exit the process (code :data:`EXIT_PARENT_DIED`) as soon as the parent dies.

    Waits on the parent's sentinel (fires when the parent's end of the spawn pipe closes) and, every
    ``poll_s`` seconds, checks ``os.getppid()``: the sentinel alone misses the parent's death when a
    process forked from the parent (e.g. a DataLoader worker) still holds that pipe open. Exits with
    ``os._exit``, also in the middle of a compression.
    """
    parent = mp.parent_process()
    sentinel = None if parent is None else parent.sentinel
    while os.getppid() == parent_pid:
        if sentinel is not None:
            if mpc.wait([sentinel], timeout=poll_s):
                break
        else:
            time.sleep(poll_s)
    os._exit(EXIT_PARENT_DIED)


class _Helper:
    """The helper's compressor state and slots, one method per request operation."""

    def __init__(self, compressor_name: str, compressor_kwargs: dict[str, Any]) -> None:
        self.name = compressor_name
        self.kwargs = compressor_kwargs
        self.rt: CompressionRuntime | None = None
        self.slots: Sequence[Sequence[Slot]] = ()

    def _runtime(self) -> CompressionRuntime:
        if self.rt is None:
            raise RuntimeError("the helper has no bucket layout yet; relayout first")
        return self.rt

    def relayout(self, numels, layouts, slots, keep_state: bool) -> list[str]:
        self.rt, fresh = relayout_runtime(self.rt, numels, self.name, self.kwargs, layouts, keep_state)
        self.slots = slots
        return fresh

    def compress(self, b: int, s: int) -> tuple:
        slot = self.slots[b][s]
        return write_payload(slot.out, self._runtime().compress(b, slot.grad))

    def round(self, b: int, s: int, desc: tuple) -> tuple:
        rt, out = self._runtime(), self.slots[b][s].out
        return write_payload(out, rt.next_round(b, read_payload(out, desc, self.name, rt.bucket_numels[b])))

    def decompress(self, b: int, s: int, desc: tuple) -> None:
        rt, slot = self._runtime(), self.slots[b][s]
        dense = rt.decompress(b, read_payload(slot.out, desc, self.name, rt.bucket_numels[b]))
        if dense.data_ptr() != slot.grad.data_ptr():
            slot.grad.copy_(dense)

    def state_dict(self) -> bytes:
        buf = io.BytesIO()
        torch.save(self._runtime().state_dict(), buf)
        return buf.getvalue()

    def load_state_dict(self, blob: bytes) -> list[str]:
        return self._runtime().load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))

    def serve(self, req, res) -> None:
        """Answer requests until ``stop`` or end of file on ``req``."""
        ops = {"compress": self.compress, "round": self.round, "decompress": self.decompress,
               "state_dict": self.state_dict, "load_state_dict": self.load_state_dict, "relayout": self.relayout}
        while True:
            try:
                msg = req.recv()
            except (EOFError, OSError):
                return  # the trainer closed its end
            if msg[0] == "stop":
                return
            t0 = time.perf_counter()
            try:
                if msg[0] not in ops:
                    raise ValueError(f"unknown helper operation {msg[0]!r}")
                res.send(("ok", msg[1], ops[msg[0]](*msg[2:]), time.perf_counter() - t0))
            except Exception:
                res.send(("error", msg[1], traceback.format_exc(), time.perf_counter() - t0))


def helper_main(req, res, compressor_name: str, compressor_kwargs: dict[str, Any], threads: int, parent_pid: int,
                layout: tuple | None) -> None:
    """Entry point of the helper process (see the module docstring).

    Args:
        req, res: the helper's ends of the request and result pipes.
        compressor_name, compressor_kwargs: the compressor (validated by the trainer).
        threads: ``torch.set_num_threads`` of the helper.
        parent_pid: the trainer's pid, for :func:`watch_parent`.
        layout: ``(numels, layouts, slots)`` of the first buckets, or None to start without buckets.
    """
    # SIGINT and SIGTERM are for the trainer (a pre-empted job's SIGTERM reaches its whole process group): the helper
    # keeps serving while the trainer stops, and ends on the trainer's ``stop``, its SIGKILL or its death
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    helper = _Helper(compressor_name, compressor_kwargs)
    try:
        if layout is not None:
            helper.relayout(*layout, keep_state=False)
    except Exception:
        res.send(("error", READY_ID, traceback.format_exc(), time.perf_counter() - t0))
        return
    res.send(("ok", READY_ID, (os.getpid(), time.time()), time.perf_counter() - t0))
    helper.serve(req, res)
