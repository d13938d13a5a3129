"""Helpers for tests that start several gloo processes (no Lightning)."""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, queue) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        out = fn(rank, world, *args)
        queue.put((rank, "ok", out))
    except BaseException:  # report the failure to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout_s: float = 120.0) -> dict[int, object]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return ``{rank: result}``.

    Raises:
        AssertionError: with the remote traceback if a rank failed.
        TimeoutError: if ranks do not report within ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        import queue as _q

        for _ in range(world):
            try:
                rank, status, out = queue.get(timeout=timeout_s)
            except _q.Empty:
                raise TimeoutError(f"ranks did not report within {timeout_s} s; got {sorted(results)}") from None
            assert status == "ok", f"rank {rank} failed:\n{out}"
            results[rank] = out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results


def run_lightning_ranks(args: list[str], world: int = 2, timeout_s: float = 900.0, cwd: str | None = None) -> None:
    """Start ``python *args`` once per rank with Lightning's environment variables set.

    Lightning then sees processes created externally (``LOCAL_RANK`` set) and each ``Trainer``
    joins them, so one launch can run many ``fit`` calls. Raises ``AssertionError`` with the
    output of a failed rank (its return code: -11 is a segfault), ``TimeoutError`` (after killing all ranks) past
    ``timeout_s``. ``PIPEDAP_TEST_RANK_LOGS=DIR`` keeps each rank's whole output in DIR (post-mortem of a crash).
    """
    import subprocess
    import sys
    import tempfile
    import time

    port = free_port()
    procs = []
    logs = []
    for r in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                   NODE_RANK="0", LOCAL_RANK=str(r), RANK=str(r), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONFAULTHANDLER="1")  # (a crashed rank prints every thread's stack)
        keep = os.environ.get("PIPEDAP_TEST_RANK_LOGS")
        if keep:
            os.makedirs(keep, exist_ok=True)
            log = open(os.path.join(keep, f"{port}-rank{r}.log"), "w+")
        else:
            log = tempfile.TemporaryFile("w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, *args], env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks still running after {timeout_s} s: {args}")
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
        for _ in range(50):  # give the others a moment to fail too
            if all(p.poll() is not None for p in procs):
                break
            time.sleep(0.1)
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
        if bad:
            outs = []
            for r, log in enumerate(logs):
                log.seek(0)
                text = log.read()
                fatal = text.find("Fatal Python error")  # (faulthandler: every thread's stack, then a module list)
                outs.append(f"--- rank {r} (exit {procs[r].returncode}) ---\n"
                            + (text[fatal:fatal + 5000] + "\n[...]\n" if fatal >= 0 else "") + text[-3000:])
            raise AssertionError(f"ranks failed {bad} (rank, exit code):\n" + "\n".join(outs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()


def launch_results(module: str, out, names: list[str], world: int, timeout_s: float, cwd: str) -> dict:
    """Run ``python -m module OUT names...`` on ``world`` ranks (:func:`run_lightning_ranks`) and return the JSON
    the ranks wrote to ``out`` (a path), with ``"_launch_error"``: the error (every rank's tail) when a rank failed
    or hung, else None.

    A launch that dies (a rank crashed: rarely, under load, a segfault inside torch's own code; or a hang) loses
    every case after the one in flight. The cases with no result are then run once more in a second launch, so one
    crash fails only the case it happened in, if that case fails again: the first launch's error is kept in
    ``"_first_launch_error"`` and warned about, never dropped. A case that crashes twice has no result, and its
    test fails with the second launch's error."""
    import json
    import warnings
    from pathlib import Path

    def launch(path, todo):
        try:
            run_lightning_ranks(["-m", module, str(path), *todo], world=world, timeout_s=timeout_s, cwd=cwd)
            error = None
        except (AssertionError, TimeoutError) as exc:  # keep the cases that finished before a hang or crash
            error = str(exc)[:16000]  # (every rank's tail: the first to fail is often rank 0)
        return (json.loads(path.read_text()) if path.exists() else {}), error

    out = Path(out)
    results, launch_error = launch(out, names)
    results["_first_launch_error"] = None
    missing = [n for n in names if n not in results]
    if launch_error is not None and missing:
        warnings.warn(f"{module}: a launch died with {len(missing)} case(s) left ({missing[0]} and after); running "
                      f"those again. The error:\n{launch_error}", stacklevel=2)
        again, second_error = launch(out.with_name(out.stem + "-relaunch.json"), missing)
        results.update({n: again[n] for n in missing if n in again})
        results["_first_launch_error"], launch_error = launch_error, second_error
    results["_launch_error"] = launch_error
    return results


def load_script(path, name: str):
    """Import the script at ``path`` (a benchmark under benchmarks/, not a package) as module ``name``, registered in
    ``sys.modules`` (dataclasses resolve their module by name); the caller pops it when done."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
