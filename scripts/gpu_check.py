"""The prepared device check of the whole strategy: one run on one GPU, one line per check, a final verdict.

    python scripts/gpu_check.py                 # on a CUDA machine: every check (< 8 min on one H200)
    python scripts/gpu_check.py --device cpu    # dry run: the same checks on CPU/gloo, small (the CPU suite runs it)
    python scripts/gpu_check.py --only parity_fp32,energy

Without a CUDA device (and without ``--device cpu``) it prints one SKIP line per check and exits 0 (CI).
Output: ``<check> PASS|FAIL|EXPECTED|SKIP <detail>`` per check, then ``GPU CHECK OK`` (no FAIL) or
``GPU CHECK FAILED``; exit status 0 or 1. docs/gpu_check.md says how to run it and what a run showed.
``GPU_CHECK_LOGS=DIR`` keeps each rank process's whole output in DIR (``<backend><world>_rank<r>.log``).

Checks (one GPU cannot host two NCCL ranks, so):

* in this process: ``streams`` (device events order a comm-stream write before a compute-stream read),
  ``energy`` (EnergyMonitor's reader: NVML, reported as measured), ``compression`` (``compression=`` on CUDA is
  refused with its documented error: the expected result while docs/GPU.md's transport is unverified);
* 2 processes sharing the one GPU over gloo with CUDA tensors (``LOCAL_RANK=0``, ``NODE_RANK=r``, two "nodes"):
  ``parity_fp32`` (``strategy="pipedap"`` with the DeAR schedule vs ``"ddp"``, <= 1e-6, deferred updates landed in
  the forward), ``parity_shard`` (the same with ``shard_optimizer=True``; this rank holds about 1/2 of the AdamW
  state), ``parity_bf16`` (``precision="bf16-mixed"``), ``compile`` (a ``torch.compile``d model),
  ``transformer`` (nanoGPT from tests/realworld_models.py), ``peak_memory`` (``max_memory_allocated`` pipedap vs
  ddp), ``trace`` (the Chrome trace of CommTimeline holds the engine's ops);
* 1 process with an NCCL group: ``nccl_engine`` (the engine's CUDA path: comm stream, events, deferred per-bucket
  update vs the mean) and ``nccl_parity`` (the Trainer, pipedap vs ddp on NCCL; one process builds no engine, by
  design, so this is the strategy's set-up on NCCL, not its communication).

Each launch has a time budget (``--budget-s`` in all); checks that did not report in time FAIL as timed out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

#: fp32 parity bound (max |param - ddp param|, optimizer state included)
FP32_TOL = 1e-6
#: bf16-mixed parity bound: autocast matmuls round to bf16 the same way in both strategies; the reductions are fp32
BF16_TOL = 1e-5
MAIN_CHECKS = ("streams", "energy", "compression")
PAIR_CHECKS = ("parity_fp32", "parity_shard", "parity_bf16", "compile", "transformer", "peak_memory", "trace")
SOLO_CHECKS = ("nccl_engine", "nccl_parity")
ALL_CHECKS = MAIN_CHECKS + PAIR_CHECKS + SOLO_CHECKS


class Expected(Exception):
    """A check whose documented result is a refusal (reported EXPECTED, not FAIL)."""


# ------------------------------------------------------------------------------------------------ in this process
def check_streams(device: torch.device) -> str:
    """A tensor written on the comm stream, read on the compute stream after an event: the value is the written one."""
    from lightning_pipedap.engine.streams import streams_for

    st = streams_for(device)
    buf = torch.zeros(1 << 20, device=device)
    comm, done = st.new_stream("comm"), st.new_event("done")
    ready = st.new_event("ready")
    ready.record(st.current())
    with st.use(comm):
        comm.wait_event(ready)
        for _ in range(20):  # enough work that an unordered read would see a partial sum
            buf.add_(1.0)
        done.record(comm)
    st.current().wait_event(done)
    total = float(buf.sum())
    assert total == 20.0 * buf.numel(), total
    return f"{'device' if st.accelerated else 'host stand-in'} events ordered 20 writes before the read"


def check_energy(device: torch.device) -> str:
    """Open EnergyMonitor's reader for this device and read it twice around some work."""
    from lightning_pipedap.measure.energy import MEASURED, open_energy_reader

    idx = (device.index or 0) if device.type == "cuda" else None
    reader, notes = open_energy_reader("auto", cuda_index=idx)
    try:
        j0 = reader.read_J()
        x = torch.randn(2048, 2048, device=device)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.0:
            x = (x @ x).tanh()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        j1 = reader.read_J()
    finally:
        reader.close()
    if device.type == "cuda":
        assert reader.kind == MEASURED and reader.source.startswith("nvml"), (reader.kind, reader.source, notes)
        assert j1 > j0, (j0, j1)
    return f"{reader.kind} ({reader.source}): {j1 - j0:.1f} J over 1 s of matmuls"


def check_compression(device: torch.device) -> str:
    """``compression=`` on CUDA: refused with the documented error (the transport is unverified, docs/GPU.md)."""
    from lightning_pipedap.strategy.config import PipeDAPConfig
    from lightning_pipedap.strategy.runtime import start_compression_helper

    try:
        start_compression_helper(PipeDAPConfig(compression="powersgd"), torch.device("cuda", 0), 0)
    except ValueError as exc:
        if "compression=" in str(exc) and "CUDA" in str(exc):
            raise Expected(f"refused as documented: {exc}") from None
        raise
    raise AssertionError("compression= on CUDA was accepted; this check expects the documented refusal")


MAIN_FNS: dict[str, Callable[[torch.device], str]] = {
    "streams": check_streams, "energy": check_energy, "compression": check_compression}


# ------------------------------------------------------------------------------------------------ rank processes
class _Ctx:
    """What a rank process trains with: accelerator, backend, world size, sizes."""

    def __init__(self, device: str, backend: str, world: int, root: str) -> None:
        self.cuda = device == "cuda"
        self.accelerator, self.backend, self.world, self.root = device, backend, world, root
        self.epochs = 2 if self.cuda else 1

    def trainer_kw(self, **kw: Any) -> dict:
        out = dict(accelerator=self.accelerator, devices=1, num_nodes=self.world, default_root_dir=self.root)
        out.update(kw)
        return out

    def ddp(self) -> Any:
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend=self.backend)

    def pipedap(self, **kw: Any) -> Any:
        from lightning_pipedap import PipeDAPStrategy

        return PipeDAPStrategy(schedule="dear", bucket_cap_mb=0.002, process_group_backend=self.backend, **kw)

    def peak(self) -> float:
        """MiB allocated at peak since the last reset (0 on CPU), then reset."""
        if not self.cuda:
            return 0.0
        torch.cuda.synchronize()
        mib = torch.cuda.max_memory_allocated() / 2 ** 20
        torch.cuda.reset_peak_memory_stats()
        return mib


def _parity(ctx: _Ctx, model: str, model_kw: dict, tol: float, deferred: bool = True,
            strategy_kw: dict | None = None, **trainer_kw: Any) -> tuple[str, dict]:
    """DDP then pipedap (DeAR schedule) on the same model and data; ``deferred``: updates must land in forwards."""
    from tests import parity_cases as P

    ctx.peak()
    ref = P.train(model, model_kw, ctx.trainer_kw(**trainer_kw), ctx.ddp(), epochs=ctx.epochs)
    ddp_mib = ctx.peak()
    strategy = ctx.pipedap(**(strategy_kw or {}))
    state = _state_bytes()
    out = P.train(model, model_kw, ctx.trainer_kw(**trainer_kw), strategy, epochs=ctx.epochs, callbacks=[state])
    pipedap_mib = ctx.peak()
    diff = P.max_diff(out, ref)
    landed = strategy.update_counts["forward"]
    assert diff <= tol, f"max |pipedap - ddp| = {diff:.3e} > {tol:.0e}"
    if deferred:
        assert landed > 0, f"no deferred update landed in a forward (update_counts={strategy.update_counts})"
    else:
        assert strategy.single_process, "expected one process (no run-time)"
    return (f"max |pipedap - ddp| = {diff:.2e} (<= {tol:.0e}), {landed} updates landed in forwards",
            {"ddp_mib": ddp_mib, "pipedap_mib": pipedap_mib, "state_share": state.share})


def _state_bytes() -> Any:
    """An observer callback (reads no model value): ``.share`` is this rank's share of the AdamW state at the last
    batch start, ``strategy.optimizer_state_nbytes`` over the bytes of a whole optimizer's ``exp_avg`` and
    ``exp_avg_sq`` (fp32; the 0-d step counters aside)."""
    from lightning.pytorch.callbacks import Callback

    class StateBytes(Callback):
        pipedap_reads_model = False
        share = float("nan")

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step >= 2:
                opt = trainer.optimizers[0]
                whole = sum(p.numel() * 2 * 4 for g in opt.param_groups for p in g["params"])
                self.share = trainer.strategy.optimizer_state_nbytes(opt) / whole

    return StateBytes()


def _fit_spec(ctx: _Ctx, build: Callable[[], Any], strategy: Any) -> dict:
    import lightning.pytorch as pl

    pl.seed_everything(0, workers=True, verbose=False)
    spec = build()
    kw = dict(max_epochs=ctx.epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=2)
    kw.update(spec.trainer_kw)
    trainer = pl.Trainer(strategy=strategy, callbacks=list(spec.callbacks), **ctx.trainer_kw(**kw))
    trainer.fit(spec.model, spec.train, spec.val)
    return {k: v.detach().clone() for k, v in spec.model.state_dict().items()}


def rank_parity_fp32(ctx: _Ctx, box: dict) -> str:
    line, mem = _parity(ctx, "mlp", {"opt": "adamw", "sched": "step"}, FP32_TOL)
    box["memory"] = mem
    return line


def rank_parity_shard(ctx: _Ctx, box: dict) -> str:
    line, mem = _parity(ctx, "mlp", {"opt": "adamw", "sched": "step"}, FP32_TOL,
                        strategy_kw={"shard_optimizer": True})
    share = mem["state_share"]
    assert share < 0.75, f"this rank holds {share:.2f} of the AdamW state (expected about 1/{ctx.world})"
    return f"shard_optimizer=True (AdamW): {line}; this rank holds {share:.2f} of the optimizer state"


def rank_parity_bf16(ctx: _Ctx, box: dict) -> str:
    return _parity(ctx, "mlp", {"opt": "adamw"}, BF16_TOL, precision="bf16-mixed")[0]


def rank_compile(ctx: _Ctx, box: dict) -> str:
    from tests import parity_cases as P

    backend = "inductor" if ctx.cuda else "eager"  # (the dry run keeps dynamo, not the C++ compile)

    class CompiledMLP(P.MLP):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.net = torch.compile(self.net, backend=backend)

    P.MODELS["gpu_check_compiled"] = CompiledMLP
    line, _ = _parity(ctx, "gpu_check_compiled", {"opt": "sgd"}, FP32_TOL)
    return f"torch.compile(backend={backend!r}): {line}"


def rank_transformer(ctx: _Ctx, box: dict) -> str:
    from tests import parity_cases as P
    from tests.realworld_models import CASES

    build = CASES["nanogpt_tied"].build
    ref = _fit_spec(ctx, build, ctx.ddp())
    out = _fit_spec(ctx, build, ctx.pipedap())
    diff = P.max_diff(out, ref)
    assert diff <= FP32_TOL, f"nanogpt_tied: max |pipedap - ddp| = {diff:.3e} > {FP32_TOL:.0e}"
    return f"nanogpt_tied (tests/realworld_models.py): max |pipedap - ddp| = {diff:.2e}"


def rank_peak_memory(ctx: _Ctx, box: dict) -> str:
    mem = box.get("memory")
    if mem is None:
        raise AssertionError("needs parity_fp32 (its runs are measured)")
    if not ctx.cuda:
        return "not measured on CPU (torch.cuda.max_memory_allocated needs CUDA)"
    assert mem["ddp_mib"] > 0 and mem["pipedap_mib"] > 0, mem
    return (f"max_memory_allocated: pipedap {mem['pipedap_mib']:.1f} MiB, ddp {mem['ddp_mib']:.1f} MiB "
            f"({mem['pipedap_mib'] / mem['ddp_mib']:.2f}x)")


def rank_trace(ctx: _Ctx, box: dict) -> str:
    from lightning_pipedap.measure.comm_timeline import CommTimeline
    from tests import parity_cases as P

    cb = CommTimeline(every_n_steps=2, warmup_steps=2, log_gantt=False)
    P.train("mlp", {"opt": "sgd"}, ctx.trainer_kw(), ctx.pipedap(), epochs=ctx.epochs, callbacks=[cb])
    assert cb.trace_files, "CommTimeline wrote no trace file"
    events = json.loads(Path(cb.trace_files[-1]).read_text())["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X" and any(k in str(e.get("name")) for k in ("RS", "AG", "AR"))]
    assert ops, f"no engine op in {cb.trace_files[-1]} ({len(events)} events)"
    return (f"{len(ops)} engine ops in {Path(cb.trace_files[-1]).name}; op times are host issue times "
            "(CUDA-event op timing: not implemented, docs/GPU.md)")


def rank_nccl_engine(ctx: _Ctx, box: dict) -> str:
    import torch.distributed as dist

    from lightning_pipedap.engine import collectives as C
    from lightning_pipedap.engine.engine import CommEngine
    from lightning_pipedap.engine.update import BucketOptimizer, snapshot_hparams
    from lightning_pipedap.schedule import builtin_schedule

    device = torch.device("cuda", 0) if ctx.cuda else torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(ctx.backend, device_id=device if ctx.cuda else None)
    comm = C.new_comm_group(timeout_s=120)
    assert comm.backend == ctx.backend, comm.backend
    torch.manual_seed(0)
    width = 512 if ctx.cuda else 32
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(6)]).to(device)
    params = list(model.parameters())
    sizes = [p.numel() * 4 for p in params]
    errs = {}
    for name in ("allreduce", "dear"):
        engine = CommEngine(comm, params, builtin_schedule(name, sizes, 2 << 20 if ctx.cuda else 4096),
                            wait_timeout_s=120)
        model.zero_grad()
        engine.begin_iteration()
        handles = [p.register_post_accumulate_grad_hook(lambda q, i=i: engine.grad_ready(i, q.grad))
                   for i, p in enumerate(params)]
        model(torch.randn(64, width, device=device)).square().mean().backward()
        engine.finish_backward()
        mean = [p.grad.detach().clone() for p in params]
        for g in mean:
            dist.all_reduce(g)
            g /= ctx.world
        opt = torch.optim.SGD(params, lr=0.1)
        upd = BucketOptimizer(opt, engine.buckets, lambda b: False)
        hp = snapshot_hparams(opt)
        before = [p.detach().clone() for p in params]
        with torch.no_grad():
            for b in range(engine.num_buckets):
                upd.step(engine.wait_done(b), hp, None, None)
        if ctx.cuda:
            torch.cuda.synchronize()
        errs[name] = max(float((p - (b0 - 0.1 * m)).abs().max()) for p, b0, m in zip(params, before, mean))
        engine.close()
        for h in handles:
            h.remove()
    C.destroy_comm_group(comm)
    assert max(errs.values()) < 1e-5, errs
    return f"{ctx.backend} engine, {engine.num_buckets} buckets: " + ", ".join(
        f"{k} max |update - expected| = {v:.1e}" for k, v in errs.items())


def rank_nccl_parity(ctx: _Ctx, box: dict) -> str:
    """The Trainer on an NCCL group of 1 process: no run-time by design (nothing to synchronise), so this checks the
    strategy's set-up on CUDA/NCCL and that it trains as DDP; the engine's NCCL path is ``nccl_engine``'s."""
    line = _parity(ctx, "mlp", {"opt": "adamw", "sched": "step"}, FP32_TOL, deferred=False)[0]
    return f"{ctx.backend}, 1 process (no engine by design): {line}"


RANK_FNS: dict[str, Callable[[_Ctx, dict], str]] = {
    "parity_fp32": rank_parity_fp32, "parity_shard": rank_parity_shard, "parity_bf16": rank_parity_bf16,
    "compile": rank_compile,
    "transformer": rank_transformer, "peak_memory": rank_peak_memory, "trace": rank_trace,
    "nccl_engine": rank_nccl_engine, "nccl_parity": rank_nccl_parity}


def rank_main(out: str, device: str, backend: str, checks: list[str]) -> None:
    """One rank of a launch: run ``checks`` in order; rank 0 rewrites ``out`` (JSON) after each."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1 if device == "cpu" else 4)
    rank, world = int(os.environ["NODE_RANK"]), int(os.environ["WORLD_SIZE"])
    with tempfile.TemporaryDirectory() as root:
        ctx, box, results = _Ctx(device, backend, world, root), {}, {}
        for name in checks:
            t0 = time.perf_counter()
            try:
                results[name] = ["PASS", RANK_FNS[name](ctx, box)]
            except Exception as exc:  # one failing check must not hide the others
                tb = traceback.format_exc().strip().splitlines()
                results[name] = ["FAIL", f"{type(exc).__name__}: {exc}".splitlines()[0][:300] + f" [{tb[-3:]}]"]
            results[name].append(time.perf_counter() - t0)
            if rank == 0:
                Path(out).write_text(json.dumps(results))


# ------------------------------------------------------------------------------------------------ the driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(checks: list[str], device: str, backend: str, world: int, budget_s: float) -> dict[str, list]:
    """Run ``checks`` in ``world`` processes of this script (``--rank``); returns ``{check: [status, detail, s]}``;
    checks without a result by the end (a crash or ``budget_s``) FAIL with the tail of rank 0's output."""
    port, procs, logs = _free_port(), [], []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "results.json")
        for r in range(world):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                       NODE_RANK=str(r), LOCAL_RANK="0", RANK=str(r), PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
                       PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
            if device == "cpu":
                env["OMP_NUM_THREADS"] = "1"
            log = open(Path(tmp, f"rank{r}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--rank", str(out),
                                           "--device", device, "--backend", backend, "--only", ",".join(checks)],
                                          env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT)))
        deadline, why = time.monotonic() + budget_s, ""
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                why = f"timed out after {budget_s:.0f} s"
                break
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(5)  # (let the others finish or fail too)
                break
            time.sleep(0.5)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        why = why or ", ".join(f"rank {r} exit {p.returncode}" for r, p in enumerate(procs) if p.returncode)
        results = json.loads(out.read_text()) if out.exists() else {}
        logs[0].seek(0)
        tail = " | ".join(logs[0].read().strip().splitlines()[-3:])[-400:]
        keep = os.environ.get("GPU_CHECK_LOGS")  # a folder that keeps every rank's whole output (the device run's $OUT)
        for r, log in enumerate(logs):
            log.close()
            if keep:
                Path(keep).mkdir(parents=True, exist_ok=True)
                Path(keep, f"{backend}{world}_rank{r}.log").write_bytes(Path(log.name).read_bytes())
    for name in checks:
        results.setdefault(name, ["FAIL", f"no result ({why or 'rank 0 stopped'}): {tail}", 0.0])
    return results


def _print(name: str, status: str, detail: str, seconds: float) -> None:
    print(f"{name:<12} {status:<8} {detail} ({seconds:.1f} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the check (module docstring); returns the exit status (0: no FAIL)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default; SKIP without one) or cpu (the dry run: same checks, CPU/gloo, small)")
    ap.add_argument("--only", default=",".join(ALL_CHECKS), help="comma-separated checks, from: " + ", ".join(
        ALL_CHECKS))
    ap.add_argument("--budget-s", type=float, default=420.0, help="seconds for the whole run (default 420)")
    ap.add_argument("--rank", metavar="OUT", help=argparse.SUPPRESS)  # (a rank process of a launch)
    ap.add_argument("--backend", default="gloo", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    checks = [c for c in args.only.split(",") if c]
    bad = [c for c in checks if c not in ALL_CHECKS]
    if bad:
        ap.error(f"unknown checks {bad}; valid: {', '.join(ALL_CHECKS)}")
    if args.rank:
        rank_main(args.rank, args.device, args.backend, checks)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        for c in checks:
            print(f"{c:<12} SKIP     no CUDA device (this check needs a GPU; --device cpu runs the dry run)")
        print("GPU CHECK SKIPPED: no CUDA device")
        return 0
    t_start = time.monotonic()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}",
              flush=True)
    else:
        print(f"device: cpu (dry run), torch {torch.__version__}", flush=True)
    results: dict[str, list] = {}
    for name in (c for c in MAIN_CHECKS if c in checks):
        t0 = time.perf_counter()
        try:
            results[name] = ["PASS", MAIN_FNS[name](device)]
        except Expected as exc:
            results[name] = ["EXPECTED", str(exc)]
        except Exception as exc:
            results[name] = ["FAIL", f"{type(exc).__name__}: {exc}".splitlines()[0][:300]]
        results[name].append(time.perf_counter() - t0)
        _print(name, *results[name])
    solo_backend = "nccl" if args.device == "cuda" else "gloo"
    for group, world, backend in ((PAIR_CHECKS, 2, "gloo"), (SOLO_CHECKS, 1, solo_backend)):
        todo = [c for c in group if c in checks]
        if not todo:
            continue
        left = args.budget_s - (time.monotonic() - t_start)
        share = left * (0.75 if group is PAIR_CHECKS and any(c in checks for c in SOLO_CHECKS) else 1.0)
        got = launch(todo, args.device, backend, world, max(share, 10.0))
        for name in todo:
            results[name] = got[name]
            _print(name, *got[name])
    failed = [n for n, r in results.items() if r[0] == "FAIL"]
    total = time.monotonic() - t_start
    if failed:
        print(f"GPU CHECK FAILED: {', '.join(failed)} ({total:.0f} s, device {args.device})")
        return 1
    print(f"GPU CHECK OK ({len(results)} checks, {total:.0f} s, device {args.device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
