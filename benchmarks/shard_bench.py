"""Sharded optimizer state against DDP, FSDP2 (ZeRO-2) and ZeroRedundancyOptimizer, with Adam (issue 30).

Variants (every one trains the matrix's bench MLP through ``lightning.pytorch.Trainer.fit`` with
``torch.optim.Adam(lr=1e-3)``, the same per-rank data, 1 torch thread per rank):

- ``ddp``: Lightning's ``DDPStrategy()`` (25 MiB buckets).
- ``pipedap``: ``PipeDAPStrategy(plan_trials=1, replan_every=10**6, startup_budget=None)``, the planned schedule
  installed without measured selection, as ``benchmarks/clip_alternate.py`` and ``grad_memory.py`` configure it.
- ``pipedap-sharded``: the same with ``shard_optimizer=True``. Where the strategy does not take that option yet, its
  rows say ``not available: <the error>``.
- ``fsdp2``: Lightning's ``ModelParallelStrategy`` (data-parallel mesh = every rank); the module calls
  ``torch.distributed.fsdp.fully_shard(m, reshard_after_forward=False)`` on every Linear and then the network
  (ZeRO-2 style: parameters stay gathered between forward and backward).
- ``zero``: ``DDPStrategy`` with ``torch.distributed.optim.ZeroRedundancyOptimizer(optimizer_class=Adam)``. The
  strategy first tries ``overlap_with_ddp=True`` (``ddp_zero_hook.hook_with_zero_step``); where torch refuses that
  for the backend (gloo in torch 2.13), it runs plain ZeRO-1 (``step()`` after backward, then a broadcast of each
  rank's updated parameters) and the note says why.

Per rank and variant:

- *optimizer state*: the bytes this rank holds, the sum of ``nbytes`` of every tensor in the optimizer's state (a
  DTensor counts its local shard; ZeRO its local optimizer; pipedap ``trainer.strategy.optimizer_state_nbytes(
  optimizer)`` where the strategy has that method);
- *optimizer state* and *peak RSS* are read at the start of the last training step (in training: after the fit a
  sharded state is gathered back whole, as the end of the fit and checkpoints need it); *peak at end* is the peak
  after ``Trainer.fit`` returned; *RSS at last step* the resident set at that step (the steady state's memory: the
  peak also holds pipedap's start-up steps, which run unsharded in sync mode with the whole optimizer state);
- *peak RSS*: ``getrusage`` maxrss of the rank process, MiB. About 480 MiB of it is torch and Lightning being
  imported, so *peak - pre-fit* gives what the fit added (the peak minus the RSS just before ``Trainer.fit``, with
  the data and the model built);
- *step*: the median start-to-start time of ``on_train_batch_start`` in steady state, after ``--warmup`` steps and,
  for pipedap, after its start-up (``measure.speedup.steady_from_step``);
- *CPU/step*: the process CPU time (every thread, ``time.process_time``) over the same steps, per step;
- *fit*: the wall time of ``Trainer.fit`` (start-up included);

each with its ratio to ``ddp``'s same rank in the same launch.

One launch per cell (link, ranks): one testbed (network namespaces, ``tc tbf`` on every host link:
``lightning_pipedap.testbed``); in it every variant and round starts fresh rank processes, so that a rank's peak RSS
is its variant's own and one variant's failure does not end the others. Rounds interleave the variants (round ``r``
starts at variant ``r``), and each variant keeps the round with the lowest step time (slowest rank's median).

How to run::

    python benchmarks/shard_bench.py --quick      # small MLP, loopback (no root), 2 ranks, 2 rounds: < 3 min
    python benchmarks/shard_bench.py              # bench MLP (16.8 M), 1 Gbit/s testbed (root), 2 and 4 ranks
    python benchmarks/shard_bench.py --ranks 2 --variants ddp,pipedap,pipedap-sharded --json shard.json

The table is printed as markdown (paste it into BENCHMARKS.md). ``--link none`` is the testbed without a cap,
``--link loopback`` runs the ranks as plain processes on 127.0.0.1 (no namespaces).
"""

from __future__ import annotations

import argparse
import resource
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from typing import Any, Optional, Sequence

VARIANTS = ("ddp", "pipedap", "pipedap-sharded", "fsdp2", "zero")
#: the variant every ratio is relative to
REFERENCE = "ddp"
#: model sizes: the matrix's bench MLP, a small one for ``--quick`` and the matrix's tiny one (tests)
SIZES = {
    "bench": dict(features=1024, width=1024, depth=16, batch=512),
    "small": dict(features=256, width=512, depth=4, batch=64),
    "tiny": dict(features=16, width=32, depth=2, batch=4),
}
LR = 1e-3
#: distinct batches each rank cycles through (its data stays a few MiB: peak RSS is the training's, not the data's)
DISTINCT_BATCHES = 4
#: steps added to a pipedap fit for its start-up (trace, profiling; ``plan_trials=1``: no trials), on top of
#: ``--warmup``; a fit that ends with fewer than half of ``--steps`` in steady state is reported as an error
PIPEDAP_STARTUP_STEPS = 8
RESULT = "RESULT "
BASE_PORT = 29611
MIB = 1024 * 1024


# ============================================================================ one rank of one variant
def _mlp(size: str) -> Any:
    """``(net, units, make_batch)`` of the size preset: the matrix's MLP layout (``features`` -> ``depth`` x
    (Linear ``width`` + ReLU) -> Linear 10 classes); the matrix's own presets, or this script's :data:`SIZES`."""
    from lightning_pipedap.bench.matrix import models

    if size in ("bench", "tiny"):
        return models.build_net("mlp", size)
    return models._mlp(SIZES[size])


def state_nbytes(optimizer: Any) -> int:
    """Bytes of every tensor in ``optimizer.state`` (a DTensor counts its local shard; a
    ``ZeroRedundancyOptimizer`` counts its local optimizer's state, which holds this rank's shard)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer = optimizer.optim
    total = 0
    for per_param in optimizer.state.values():
        for v in per_param.values():
            if hasattr(v, "to_local"):
                v = v.to_local()
            if hasattr(v, "nbytes") and hasattr(v, "dim"):
                total += int(v.nbytes)
    return total


def _classes() -> dict[str, Any]:
    """The Lightning classes of the worker (imported in the rank process only)."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lightning_pipedap.bench.matrix.models import BenchModule

    class AdamModule(BenchModule):
        """:class:`BenchModule` trained with Adam (``zero``: inside ``ZeroRedundancyOptimizer``); with
        ``automatic_optimization`` off (``ZeroDDPStrategy`` with the overlap hook) only backward runs in
        ``training_step``: the hook steps the optimizer."""

        def __init__(self, net: Any, units: list, zero: bool = False) -> None:
            super().__init__(net, units, LR)
            self._zero = zero

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            if not self.automatic_optimization:
                self.manual_backward(loss)
            return loss

        def configure_optimizers(self) -> Any:
            if self._zero:
                return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
            return torch.optim.Adam(self.parameters(), lr=LR)

    class ZeroDDPStrategy(DDPStrategy):
        """``DDPStrategy`` whose optimizer runs as ``ZeroRedundancyOptimizer(overlap_with_ddp=True)`` with its step in
        DDP's communication hook (``hook_with_zero_step``) where torch accepts that for the process group's backend;
        else the plain ``ZeroRedundancyOptimizer`` of ``configure_optimizers`` (ZeRO-1). :attr:`zero_mode` says
        which, and why."""

        zero_mode = ""

        def setup(self, trainer: Any) -> None:
            super().setup(trainer)
            module = self.lightning_module
            overlap = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.Adam, lr=LR,
                                              overlap_with_ddp=True)
            try:
                hook = hook_with_zero_step(allreduce_hook, self.model, overlap)
            except RuntimeError as exc:
                self.zero_mode = f"plain ZeRO-1: overlap_with_ddp=True refused ({type(exc).__name__}: {exc})"
                return
            self.model.register_comm_hook(None, hook)
            self.optimizers = [overlap]
            module.automatic_optimization = False
            self.zero_mode = "overlap_with_ddp=True (hook_with_zero_step; no update in the first 2 steps)"

    class Clock(pl.Callback):
        """Wall and process CPU time at every training-batch start and at the end of training."""

        pipedap_reads_model = False  # reads no parameter: pipedap need not apply pending updates before it

        def __init__(self) -> None:
            self.starts: list[float] = []
            self.cpu: list[float] = []
            #: at each training-batch start: peak RSS so far (KiB) and the optimizer state this rank holds (bytes)
            self.rss_kib: list[int] = []
            self.rss_now = 0
            self.state_bytes: list[int] = []
            #: resident set (MiB) at every training-batch start; glibc malloc's counters and the live tensors'
            #: bytes at the last one (:func:`malloc_stats`, :func:`tensor_census`)
            self.rss_trace: list[float] = []
            self.malloc: dict[str, float] = {}
            self.tensors: dict[str, float] = {}

        def _stamp(self) -> None:
            self.starts.append(time.perf_counter())
            self.cpu.append(time.process_time())

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self._stamp()
            self.rss_kib.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
            self.rss_now = _rss_bytes()  # (the resident set now: the steady state's memory at the last step)
            self.rss_trace.append(round(self.rss_now / MIB, 1))
            self.malloc = malloc_stats()
            if trainer.max_steps > 0 and trainer.global_step == trainer.max_steps - 1:
                self.tensors = tensor_census()
            optimizer = trainer.optimizers[0] if trainer.optimizers else None
            if optimizer is not None:
                nbytes = getattr(trainer.strategy, "optimizer_state_nbytes", None)
                self.state_bytes.append(int(nbytes(optimizer)) if nbytes is not None else state_nbytes(optimizer))

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._stamp()

    return dict(AdamModule=AdamModule, ZeroDDPStrategy=ZeroDDPStrategy, Clock=Clock)


def _make_strategy(variant: str, world: int, classes: dict) -> Any:
    """The Lightning strategy of ``variant``.

    Raises:
        ValueError: unknown variant (naming the valid ones).
        Exception: whatever the strategy's constructor raises (``pipedap-sharded`` before the option exists).
    """
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_pipedap import PipeDAPStrategy

    if variant == "ddp":
        return DDPStrategy()
    if variant in ("pipedap", "pipedap-sharded"):
        extra = {"shard_optimizer": True} if variant == "pipedap-sharded" else {}
        return PipeDAPStrategy(plan_trials=1, replan_every=10**6, startup_budget=None, **extra)
    if variant == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    if variant == "zero":
        return classes["ZeroDDPStrategy"]()
    raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")


def _error_text(exc: BaseException) -> str:
    """``Type: message`` on one line, at most 300 characters."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 300 else text[:297] + "..."


def worker(cfg: dict) -> dict:
    """One rank of one variant: fit, then this rank's measurements (keys: variant, rank, world, params,
    state_bytes, peak_rss_mib, step_ms, cpu_ms, fit_s, steps, first_step, note; or variant, rank and ``error``)."""
    import torch

    from lightning_pipedap.bench.matrix.worker import quiet_worker
    from lightning_pipedap.engine import collectives as C

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    variant = cfg["variant"]
    out: dict[str, Any] = {"variant": variant, "rank": rank, "world": world}
    # (the start-up, imports included, counts in peak RSS alike for every variant)
    with quiet_worker():
        torch.set_num_threads(1)
        classes = _classes()
        try:
            strategy = _make_strategy(variant, world, classes)
        except Exception as exc:  # noqa: BLE001 - the option may not exist yet: the table says so
            out["error"] = "not available: " + _error_text(exc)
            return out
        try:
            _fit_and_measure(cfg, strategy, classes, world, rank, out)
        finally:
            C.shutdown()  # destroy the default group before exit (live gloo threads at exit can abort the process)
    return out


def _fit_and_measure(cfg: dict, strategy: Any, classes: dict, world: int, rank: int, out: dict) -> None:
    """Fit ``cfg``'s variant on ``strategy`` and put this rank's measurements (or ``error``) into ``out``."""
    import resource

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from lightning_pipedap.measure.speedup import steady_from_step

    variant = cfg["variant"]
    total = cfg["warmup"] + cfg["steps"] + (PIPEDAP_STARTUP_STEPS if variant.startswith("pipedap") else 0)
    pl.seed_everything(0, verbose=False)
    net, units, make_batch = _mlp(cfg["size"])
    g = torch.Generator().manual_seed(1234 + rank)
    batches = [make_batch(SIZES[cfg["size"]]["batch"], g) for _ in range(DISTINCT_BATCHES)]
    loader = DataLoader(_Cycle(batches, total), batch_size=None, shuffle=False)
    module = classes["AdamModule"](net, units, zero=variant == "zero")
    clock = classes["Clock"]()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, num_nodes=world, max_steps=total,
                         max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         use_distributed_sampler=False, callbacks=[clock])
    pre_fit_rss = _rss_bytes()
    t0 = time.perf_counter()
    try:
        trainer.fit(module, loader)
    except Exception as exc:  # noqa: BLE001 - reported in the table; the peers fail or time out
        out["error"] = "failed: " + _error_text(exc)
        return
    fit_s = time.perf_counter() - t0
    # (in training: at the last step's start. After the fit a sharded state is gathered back whole, as checkpoints
    # and the end of the fit need it; that end-of-fit peak is reported apart, "peak at end")
    out["state_bytes"] = clock.state_bytes[-1] if clock.state_bytes else state_nbytes(trainer.optimizers[0])
    out["state_source"] = ("strategy.optimizer_state_nbytes" if hasattr(trainer.strategy, "optimizer_state_nbytes")
                           else "sum of optimizer.state nbytes") + " at the last step"
    steady = steady_from_step(trainer.strategy)
    first = max(cfg["warmup"], steady if steady is not None else len(clock.starts))
    # the first --steps steady-state steps (a pipedap fit has room for a longer start-up than it may take)
    gaps = [b - a for a, b in zip(clock.starts[first:-1], clock.starts[first + 1:])][:cfg["steps"]]
    if len(gaps) < max(2, cfg["steps"] // 2):
        out["error"] = (f"failed: {len(gaps)} steady-state steps of {len(clock.starts) - 1} (steady from step "
                        f"{steady}); raise --steps")
        return
    notes = []
    if variant == "zero":
        notes.append(trainer.strategy.zero_mode)
    if getattr(trainer.strategy, "installed_schedule", None):
        # "optimal: 17 buckets: AR16 RS8 ... AG8" -> "optimal: 17 buckets" (the op order is in the JSON)
        out["schedule"] = trainer.strategy.installed_schedule
        notes.append("schedule " + ": ".join(out["schedule"].split(": ")[:2]))
    end_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_kib = clock.rss_kib[-1] if clock.rss_kib else end_kib
    out.update(params=sum(p.numel() for p in module.parameters()),  # (a DTensor's numel is the global one)
               peak_rss_mib=peak_kib / 1024, fit_rss_mib=(peak_kib * 1024 - pre_fit_rss) / MIB,
               end_peak_rss_mib=end_kib / 1024, last_rss_mib=clock.rss_now / MIB,
               rss_trace=clock.rss_trace, peak_trace=[round(k / 1024, 1) for k in clock.rss_kib],
               malloc_at_last=clock.malloc, tensors_at_last=clock.tensors,
               step_ms=1e3 * statistics.median(gaps),
               cpu_ms=1e3 * (clock.cpu[first + len(gaps)] - clock.cpu[first]) / len(gaps),
               fit_s=fit_s, steps=len(gaps), first_step=first, note="; ".join(notes))


def malloc_stats() -> dict[str, float]:
    """glibc malloc's counters over every arena (``mallinfo2``), MiB: ``heap`` (non-mmapped arena memory obtained
    from the system), ``mmap`` (chunks in mmapped blocks), ``in_use`` (allocated non-mmapped), ``free`` (free bytes
    kept in the arenas: resident where touched, returned only by trimming); ``{}`` without glibc."""
    import ctypes

    class _MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return {}
    fn.restype = _MallInfo2
    m = fn()
    return {"heap": m.arena / MIB, "mmap": m.hblkhd / MIB, "in_use": m.uordblks / MIB, "free": m.fordblks / MIB}


def tensor_census() -> dict[str, float]:
    """The live CPU tensors the garbage collector reaches (parameters, gradients, optimizer state, buffers): their
    storages' bytes, each storage counted once: ``total`` (MiB), ``count`` and ``largest`` (the 8 largest, MiB)."""
    import gc

    import torch

    seen: dict[int, int] = {}
    for o in gc.get_objects():
        try:
            if not isinstance(o, torch.Tensor) or o.device.type != "cpu" or o.is_sparse:
                continue
            st = o.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        except Exception:  # noqa: BLE001 - a tensor subclass without storage (DTensor, fake): not counted
            continue
    sizes = sorted(seen.values(), reverse=True)
    return {"total": sum(sizes) / MIB, "count": float(len(sizes)), "largest": [round(b / MIB, 2) for b in sizes[:8]]}


def _rss_bytes() -> int:
    """This process's resident set size now (``/proc/self/statm``), bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Cycle:
    """A map-style dataset of ``n`` items cycling through ``batches`` (each item a whole batch:
    ``DataLoader(batch_size=None)``)."""

    def __init__(self, batches: list, n: int) -> None:
        self.batches, self.n = batches, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.batches[i % len(self.batches)]


# ============================================================================ launching
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local(argv: Sequence[str], ranks: int, timeout_s: float, env: dict[str, str]) -> list[str]:
    """Run ``argv`` once per rank as plain processes on 127.0.0.1 (rank 0 = master); each rank's output.

    Raises:
        TimeoutError: a rank ran past ``timeout_s`` (every rank is killed).
        RuntimeError: a rank exited non-zero (its output tail in the message).
    """
    port = str(_free_port())
    procs = []
    for i in range(ranks):
        e = dict(os.environ, **env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(ranks), RANK=str(i),
                 NODE_RANK=str(i), LOCAL_RANK="0", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen(list(argv), env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [""] * ranks
    deadline = time.monotonic() + timeout_s
    try:
        for i, p in enumerate(procs):
            try:
                outs[i], _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"rank {i} still running after {timeout_s:.0f} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    bad = [i for i, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise RuntimeError(f"ranks {bad} failed:\n" + outs[bad[0]][-3000:])
    return outs


def _failure_line(exc: BaseException) -> str:
    """The most telling line of a failed launch: the last line naming an error, else the exception's first line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    named = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (named[-1] if named else lines[0] if lines else type(exc).__name__)[:300]


def unavailable(variants: Sequence[str], ranks: int) -> dict[str, str]:
    """``{variant: "not available: <error>"}`` for each variant whose strategy cannot be constructed here (as
    :func:`worker` constructs it, before any process group exists): e.g. ``pipedap-sharded`` before the strategy
    takes ``shard_optimizer``."""
    classes = _classes()
    out = {}
    for v in variants:
        try:
            _make_strategy(v, ranks, classes)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            out[v] = "not available: " + _error_text(exc)
    return out


def run_cell(ranks: int, args: argparse.Namespace) -> dict[str, list[list[dict]]]:
    """One launch: ``args.rounds`` rounds over ``args.variants`` (round ``r`` starts at variant ``r``), each in fresh
    rank processes on one testbed (or on loopback). Returns ``{variant: [per round: per rank result dict]}``.

    Raises:
        TestbedUnavailable: the testbed cannot be created here.
    """
    here = os.path.abspath(__file__)
    runs: dict[str, list[list[dict]]] = {v: [] for v in args.variants}
    missing = unavailable(args.variants, ranks)
    for v, why in missing.items():  # every rank would fail alike before any process group exists: no launch
        runs[v] = [[{"variant": v, "rank": i, "error": why} for i in range(ranks)]]
    variants = [v for v in args.variants if v not in missing]
    with tempfile.TemporaryDirectory(prefix="shard-bench-") as cache:
        # one α-β cache per launch: the pipedap variants share one measurement of this link
        env = {"OMP_NUM_THREADS": "1", "PIPEDAP_CACHE_DIR": cache, "PIPEDAP_PLAN_CACHE": "off"}
        if args.link == "loopback":
            bed: Any = nullcontext()
        else:
            from lightning_pipedap.testbed import Testbed

            bed = Testbed(hosts=ranks, rate=None if args.link == "none" else args.link)
        with bed as tb:
            launch = 0
            for r in range(args.rounds):
                k = r % max(1, len(variants))
                for v in variants[k:] + variants[:k]:
                    cfg = dict(variant=v, size=args.size, steps=args.steps, warmup=args.warmup)
                    argv = [sys.executable, here, "--worker", json.dumps(cfg)]
                    t0 = time.monotonic()
                    try:
                        if tb is None:
                            outs = run_local(argv, ranks, args.timeout_s, env)
                        else:
                            outs = tb.run_ranks(argv, timeout_s=args.timeout_s, env=env, port=BASE_PORT + launch)
                        res = [json.loads(ln[len(RESULT):]) for o in outs for ln in o.splitlines()
                               if ln.startswith(RESULT)]
                        if len(res) != ranks:
                            raise RuntimeError(f"{len(res)} of {ranks} ranks reported; rank 0:\n{outs[0][-2000:]}")
                    except (RuntimeError, TimeoutError) as exc:
                        why = "failed: " + _failure_line(exc)
                        res = [{"variant": v, "rank": i, "error": why} for i in range(ranks)]
                    launch += 1
                    runs[v].append(sorted(res, key=lambda d: d["rank"]))
                    print(f"[{ranks} ranks, round {r + 1}, {v}: {time.monotonic() - t0:.0f} s]", file=sys.stderr,
                          flush=True)
    return runs


# ============================================================================ the table
def best_round(rounds: list[list[dict]]) -> tuple[list[dict], list[float]]:
    """The round with the lowest step time (slowest rank's median) among the rounds without an error (else the
    first round), and the step time (ms) of every error-free round."""
    ok = [rr for rr in rounds if not any("error" in d for d in rr)]
    times = [max(d["step_ms"] for d in rr) for rr in ok]
    if not ok:
        return rounds[0], []
    return ok[times.index(min(times))], times


def _ratio(x: float, ref: Optional[float]) -> str:
    return f"{x / ref:.2f}" if ref is not None and ref > 0 else "–"


HEADER = ("| ranks | variant | rank | optimizer state MiB | x ddp | peak RSS MiB | x ddp | peak - pre-fit MiB | x ddp "
          "| peak at end MiB | RSS at last step MiB | x ddp | step ms | x ddp | CPU ms/step | x ddp | fit s | note |")
#: numeric columns of :data:`HEADER` (after ranks, variant, rank; before the note)
NUMERIC_COLUMNS = 14


def render_table(cells: dict[int, dict[str, list[list[dict]]]]) -> str:
    """Markdown table: one row per ranks, variant and rank (one row with the error where a variant has none);
    ratios against ``ddp``'s same rank in the same launch."""
    lines = [HEADER, "|---:|---|---:|" + "---:|" * NUMERIC_COLUMNS + "---|"]
    for ranks, runs in cells.items():
        ref = best_round(runs[REFERENCE])[0] if REFERENCE in runs else None
        ref_ok = ref is not None and not any("error" in d for d in ref)
        for v, rounds in runs.items():
            best, times = best_round(rounds)
            if any("error" in d for d in best):
                err = next(d["error"] for d in best if "error" in d)
                lines.append(f"| {ranks} | {v} | – |" + " – |" * NUMERIC_COLUMNS + f" {err.replace('|', '/')} |")
                continue
            for d in best:
                r = ref[d["rank"]] if ref_ok else None
                note = [d["note"]] if d["note"] else []
                if len(times) > 1:
                    note.append("best of " + "/".join(f"{t:.0f}" for t in times) + " ms")
                failed = len(rounds) - len(times)
                if failed:
                    note.append(f"{failed} round(s) failed")
                lines.append(
                    f"| {ranks} | {v} | {d['rank']} | {d['state_bytes'] / MIB:.3f} | "
                    f"{_ratio(d['state_bytes'], r and r['state_bytes'])} | {d['peak_rss_mib']:.0f} | "
                    f"{_ratio(d['peak_rss_mib'], r and r['peak_rss_mib'])} | {d['fit_rss_mib']:.0f} | "
                    f"{_ratio(d['fit_rss_mib'], r and r['fit_rss_mib'])} | "
                    f"{d.get('end_peak_rss_mib', d['peak_rss_mib']):.0f} | {d.get('last_rss_mib', 0):.0f} | "
                    f"{_ratio(d.get('last_rss_mib', 0), r and r.get('last_rss_mib'))} | {d['step_ms']:.1f} | "
                    f"{_ratio(d['step_ms'], r and r['step_ms'])} | {d['cpu_ms']:.1f} | "
                    f"{_ratio(d['cpu_ms'], r and r['cpu_ms'])} | {d['fit_s']:.2f} | "
                    f"{'; '.join(note).replace('|', '/')} |")
    return "\n".join(lines)


# ============================================================================ command line
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command-line options; ``--quick`` fills in the quick defaults of every option not given.

    Raises:
        SystemExit: an unknown variant, size or a bad count (argparse's message names the valid choices).
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small MLP, loopback, 2 ranks, 12 steps (< 3 min)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--ranks", default=None, help="comma list of rank counts (default 2,4; --quick: 2)")
    p.add_argument("--link", default=None, help="tc rate (1gbit), 'none' (testbed, uncapped) or 'loopback' "
                   "(no testbed); default 1gbit, --quick: loopback")
    p.add_argument("--size", default=None, choices=tuple(SIZES), help="model (default bench, --quick: small)")
    p.add_argument("--steps", type=int, default=None, help="steady-state steps measured (default 20, --quick: 12)")
    p.add_argument("--warmup", type=int, default=None, help="steps skipped at least (default 6, --quick: 3)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over the variants; each keeps its best")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="per launch of one variant (default 900, --quick: 120)")
    p.add_argument("--json", default=None, help="write every round's raw per-rank results here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = dict(ranks="2", link="loopback", size="small", steps=12, warmup=3, timeout_s=120.0)
    full = dict(ranks="2,4", link="1gbit", size="bench", steps=20, warmup=6, timeout_s=900.0)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.variants = list(dict.fromkeys(v.strip() for v in args.variants.split(",") if v.strip()))
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        p.error(f"unknown variants {bad}; valid: {', '.join(VARIANTS)}")
    try:
        args.ranks = [int(x) for x in str(args.ranks).split(",")]
    except ValueError:
        p.error(f"--ranks must be a comma list of integers >= 2, got {args.ranks!r}")
    if min(args.ranks) < 2 or args.steps < 2 or args.warmup < 1 or args.rounds < 1:
        p.error(f"need ranks >= 2, steps >= 2, warmup >= 1, rounds >= 1; got ranks {args.ranks}, steps {args.steps}, "
                f"warmup {args.warmup}, rounds {args.rounds}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: the driver, or (``--worker``) one rank. Returns the exit status (2: testbed unavailable)."""
    args = parse_args(argv)
    if args.worker is not None:
        print(RESULT + json.dumps(worker(json.loads(args.worker))), flush=True)
        sys.stderr.flush()
        os._exit(0)  # skip the interpreter's teardown of torch and Lightning (seconds per launch); nothing is unwritten
    if args.link != "loopback":
        from lightning_pipedap.testbed import testbed_available

        ok, why = testbed_available()
        if not ok:
            print(f"testbed unavailable: {why} (--link loopback runs without it)", file=sys.stderr)
            return 2
    t0 = time.monotonic()
    cells = {n: run_cell(n, args) for n in args.ranks}
    p = SIZES[args.size]
    params = next((d["params"] for runs in cells.values() for rr in runs.values() for r in rr for d in r
                   if "params" in d), None)
    print(f"MLP {args.size} ({p['depth']} x {p['width']}, {params or '?'} parameters, batch {p['batch']} per rank), "
          f"Adam, link {args.link}, {args.steps} steady-state steps after >= {args.warmup}, best of {args.rounds} "
          f"round(s), {time.strftime('%Y-%m-%d %H:%M')}, {time.monotonic() - t0:.0f} s")
    print()
    print(render_table(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"},
                       "cells": {str(n): runs for n, runs in cells.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
