"""Measure how compute and communication slow each other on the live group (the contention model).

A micro-benchmark run on every rank of the group at the same time, in three phases separated by
barriers so the ranks line up:

(a) **compute alone**: a loop of ``k`` matrix multiplications (``matmul_size`` square, fp32) on
    ``device``, on the calling thread, with the process's torch thread setting (the training's);
    ``k`` is chosen so the loop lasts about as long as one all-reduce of ``nbytes`` alone;
(b) **communication alone**: one all-reduce of ``nbytes`` on ``comm``
    (:func:`lightning_pipedap.engine.collectives.all_reduce_`), on the calling thread;
(c) **both together**: the all-reduce on a worker thread, released by an event right before the
    compute loop starts; both durations are measured from that common start.

(d) **an optimizer step instead of the all-reduce** (the sharded optimizer step's load, ``shard_optimizer``: CPU
    work on the communication worker): ``j`` steps of ``torch.optim.Adam`` on an fp32 tensor of ``nbytes`` (``j``
    chosen so they last about as long as the compute loop), alone on the calling thread, then on a worker thread
    together with the compute loop, from a common start. Fitted the same way, it gives the step's slowdowns
    (``step_slowdown``, ``compute_slowdown_step``; ``meta["step"]``). Adam stands for the element-wise optimizers:
    what is measured is how two CPU loads of one rank, with every rank doing the same, share the cores.

Each phase runs ``repeats`` times (the median is kept), after one untimed all-reduce and matmul
warm-up. The medians of all ranks are gathered and averaged, so every rank returns the same
:class:`~lightning_pipedap.plan.contention.Contention`, fitted by
:func:`~lightning_pipedap.plan.contention.fit_contention` (σ_m, σ_c; δ is not separable with one
message size and is left at ``op_overhead_s``). Budget: about ``(1 + 4·repeats)`` all-reduce times
plus barriers and phase (d)'s ``(1 + 2·repeats)`` compute loops, e.g. ~1.5 s for 8 MiB at 1 Gbit/s with
``repeats=3``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import threading
import time
from typing import Callable, Optional

import torch

from lightning_pipedap.engine import collectives as C
from lightning_pipedap.plan.contention import Contention, fit_contention

__all__ = ["measure_contention"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_contention(comm: C.CommGroup, device: torch.device, nbytes: int = 8 << 20, repeats: int = 3, *,
                       matmul_size: int = 256, timeout_s: float = 120.0, op_overhead_s: float = 0.0,
                       max_matmuls: int = 100_000, with_step: bool = True) -> Contention:
    """Run the micro-benchmark of the module docstring on every rank; return the fitted contention.

    Must be called by every rank of ``comm`` at the same point (it issues collectives on ``comm``
    and barriers / object gathers on the default group).

    Args:
        comm: the dedicated group (the engine's), whose all-reduce is timed.
        device: device of the buffer and the matmul load (``cpu`` or ``cuda``; on CUDA the
            all-reduce of phase (c) runs on a side stream).
        nbytes: bytes of the all-reduced fp32 buffer (>= 4).
        repeats: timed runs per phase (>= 1); the median is kept.
        matmul_size: side of the square fp32 matrices of the compute load (>= 1).
        timeout_s: timeout of every wait on the worker thread of phase (c), seconds (> 0).
        op_overhead_s: ``δ`` to assume in the fit (seconds, >= 0).
        max_matmuls: upper limit of the compute loop length ``k``.
        with_step: run phase (d) (only a run that may step sharded needs it; without it the step's slowdowns are
            0 and ``meta["step"]`` is None).

    Returns:
        :class:`Contention` (with ``step_slowdown`` and ``compute_slowdown_step`` from phase (d)) with ``meta``:
        the fitted (rank-averaged) times ``alone_compute_s``,
        ``alone_comm_s``, ``loaded_compute_s``, ``loaded_comm_s`` (s), ``case``, ``clamped``,
        ``step`` (phase (d)'s fit: its times, ``case``, ``clamped``, ``steps``),
        ``per_rank`` (each rank's raw lists ``compute_alone_s``, ``comm_alone_s``,
        ``compute_loaded_s``, ``comm_loaded_s``, ``step_alone_s``, ``compute_loaded_step_s``, ``step_loaded_s``),
        ``nbytes``, ``repeats``, ``matmuls`` (``k``), ``matmul_size``, ``backend``, ``world_size``, ``elapsed_s``.

    Raises:
        ValueError: naming the argument, for ``nbytes < 4``, ``repeats < 1``, ``matmul_size < 1``,
            ``timeout_s <= 0`` or ``max_matmuls < 1``.
        TimeoutError: if the all-reduce of phase (c) does not finish within ``timeout_s``.
        RuntimeError: if that all-reduce raised (the original error is chained).
    """
    _check_args(nbytes, repeats, matmul_size, timeout_s, max_matmuls)
    t_begin = time.perf_counter()
    load = _Load(comm, device, nbytes, matmul_size)
    # warm-up, then (b) the all-reduce alone and one matmul's time -> the loop length k (rank 0 decides)
    comm_alone, k = load.comm_alone_and_loop(repeats, max_matmuls)
    # (a) compute alone
    compute_alone = [load.timed(lambda: load.compute(k)) for _ in range(repeats)]
    # (c) both together, from a common start
    compute_loaded: list[float] = []
    comm_loaded: list[float] = []
    for _ in range(repeats):
        compute_s, comm_s = load.both_together(k, timeout_s)
        compute_loaded.append(compute_s)
        comm_loaded.append(comm_s)
    raw = {"compute_alone_s": compute_alone, "comm_alone_s": comm_alone,
           "compute_loaded_s": compute_loaded, "comm_loaded_s": comm_loaded}
    j = 0
    if with_step:  # (d) an optimizer step in place of the all-reduce: alone, then together with the compute loop
        j = load.step_loop(statistics.median(compute_alone))
        raw["step_alone_s"] = [load.timed(lambda: load.step(j)) for _ in range(repeats)]
        raw["compute_loaded_step_s"], raw["step_loaded_s"] = [], []
        for _ in range(repeats):
            compute_s, step_s = load.both_together(k, timeout_s, lambda: load.step(j))
            raw["compute_loaded_step_s"].append(compute_s)
            raw["step_loaded_s"].append(step_s)
    per_rank = C.all_gather_object(raw)
    mean = {key: statistics.fmean(statistics.median(r[key]) for r in per_rank) for key in raw}
    step = fit_contention(mean["compute_alone_s"], mean["step_alone_s"], mean["compute_loaded_step_s"],
                          mean["step_loaded_s"], meta={"source": "measure_contention (d)", "steps": j}) \
        if with_step else None
    fit = fit_contention(
        mean["compute_alone_s"], mean["comm_alone_s"], mean["compute_loaded_s"], mean["comm_loaded_s"],
        op_overhead_s=op_overhead_s,
        meta={"per_rank": per_rank, "nbytes": nbytes, "repeats": repeats, "matmuls": k, "matmul_size": matmul_size,
              "backend": comm.backend, "world_size": comm.world_size, "source": "measure_contention",
              "step": step.meta if step else None,
              "elapsed_s": C.broadcast_object(time.perf_counter() - t_begin, src=0)},
    )
    if step is None:
        return fit
    return dataclasses.replace(fit, step_slowdown=step.comm_slowdown, compute_slowdown_step=step.compute_slowdown)


def _check_args(nbytes: int, repeats: int, matmul_size: int, timeout_s: float, max_matmuls: int) -> None:
    """Raise ValueError naming the first bad argument of :func:`measure_contention`."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 4:
        raise ValueError(f"nbytes must be an int >= 4 (one fp32 element), got {nbytes!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if isinstance(matmul_size, bool) or not isinstance(matmul_size, int) or matmul_size < 1:
        raise ValueError(f"matmul_size must be an int >= 1, got {matmul_size!r}")
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    if isinstance(max_matmuls, bool) or not isinstance(max_matmuls, int) or max_matmuls < 1:
        raise ValueError(f"max_matmuls must be an int >= 1, got {max_matmuls!r}")


class _Load:
    """The benchmark's buffers on ``device``: the all-reduced fp32 buffer of ``nbytes`` and the seeded
    ``matmul_size`` square matrices of the compute load (and, on CUDA, the side stream of phase (c))."""

    def __init__(self, comm: C.CommGroup, device: torch.device, nbytes: int, matmul_size: int) -> None:
        self.comm, self.device, self.nbytes = comm, device, nbytes
        self.buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        g = torch.Generator(device="cpu").manual_seed(0)
        self.a = torch.randn(matmul_size, matmul_size, generator=g).to(device)
        self.b = torch.randn(matmul_size, matmul_size, generator=g).to(device)
        self.out = torch.empty_like(self.a)
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.q = torch.nn.Parameter(torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device))
        self.q.grad = torch.full_like(self.q, 1e-3)
        self.adam = torch.optim.Adam([self.q], lr=1e-3)

    def compute(self, k: int) -> None:
        """``k`` matrix multiplications on the calling thread."""
        for _ in range(k):
            torch.mm(self.a, self.b, out=self.out)

    def all_reduce(self) -> None:
        """One all-reduce of the buffer on ``comm``."""
        C.all_reduce_(self.buf, self.comm)

    def step(self, j: int) -> None:
        """``j`` Adam steps of the ``nbytes`` tensor (phase (d)'s load)."""
        for _ in range(j):
            self.adam.step()

    def step_loop(self, compute_s: float) -> int:
        """Warm-up, one step's time -> the number of steps ``j`` lasting about ``compute_s`` (rank 0's, 1..1000)."""
        self.step(1)
        _sync(self.device)
        t0 = time.perf_counter()
        self.step(2)
        _sync(self.device)
        per = max((time.perf_counter() - t0) / 2, 1e-9)
        return int(C.broadcast_object(min(1000, max(1, round(compute_s / per))), src=0))

    def timed(self, fn: Callable[[], None]) -> float:
        """Seconds ``fn`` takes, after a barrier, the device synchronized before and after."""
        C.barrier()
        _sync(self.device)
        t0 = time.perf_counter()
        fn()
        _sync(self.device)
        return time.perf_counter() - t0

    def comm_alone_and_loop(self, repeats: int, max_matmuls: int) -> tuple[list[float], int]:
        """Warm-up, phase (b) ``repeats`` times, and one matmul's time: returns the all-reduce times alone (s)
        and the loop length ``k`` (rank 0's: about one all-reduce alone, at most ``max_matmuls``)."""
        self.all_reduce()
        self.compute(2)
        comm_alone = [self.timed(self.all_reduce) for _ in range(repeats)]
        _sync(self.device)
        t0 = time.perf_counter()
        self.compute(4)
        _sync(self.device)
        per_mm = max((time.perf_counter() - t0) / 4, 1e-9)
        k = int(C.broadcast_object(min(max_matmuls, max(1, round(statistics.median(comm_alone) / per_mm))), src=0))
        return comm_alone, k

    def both_together(self, k: int, timeout_s: float,
                      other: Optional[Callable[[], None]] = None) -> tuple[float, float]:
        """Phase (c) once: the all-reduce (or ``other``: phase (d)'s step) on a worker thread released right before
        ``k`` matmuls start; returns the seconds from that common start to the end of the compute and of the
        all-reduce.

        Raises:
            TimeoutError: the all-reduce did not finish within ``timeout_s``.
            RuntimeError: the all-reduce raised (chained).
        """
        go = threading.Event()
        box: dict = {}
        th = threading.Thread(target=self._worker, args=(go, box, timeout_s, other or self.all_reduce),
                              name="pipedap-contention-comm", daemon=True)
        th.start()
        C.barrier()
        _sync(self.device)
        start = time.perf_counter()
        go.set()
        self.compute(k)
        _sync(self.device)
        compute_s = time.perf_counter() - start
        th.join(timeout_s)
        if th.is_alive():
            raise TimeoutError(f"contention benchmark: the all-reduce of {self.nbytes} bytes on the "
                               f"{self.comm.backend} group did not finish within {timeout_s} s")
        if "error" in box:
            raise RuntimeError(f"contention benchmark: the all-reduce of {self.nbytes} bytes failed") from box["error"]
        return compute_s, box["end"] - start

    def _worker(self, go: threading.Event, box: dict, timeout_s: float, work: Callable[[], None]) -> None:
        """Phase (c)'s thread: wait for ``go``, run ``work`` (the all-reduce; on the side stream on CUDA), put the end
        time (or the error) in ``box``."""
        if not go.wait(timeout_s):
            box["error"] = TimeoutError(f"contention benchmark: start signal not given within {timeout_s} s")
            return
        try:
            if self.side is not None:
                with torch.cuda.stream(self.side):
                    work()
                self.side.synchronize()
            else:
                work()
            box["end"] = time.perf_counter()
        except BaseException as e:  # reported to the calling thread by both_together
            box["error"] = e
