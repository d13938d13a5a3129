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
    output of a failed rank, ``TimeoutError`` (after killing all ranks) past ``timeout_s``.
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
                outs.append(f"--- rank {r} ---\n" + log.read()[-6000:])
            raise AssertionError(f"ranks failed {bad}:\n" + "\n".join(outs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()


def launch_results(module: str, out, names: list[str], world: int, timeout_s: float, cwd: str) -> dict:
    """Run ``python -m module OUT names...`` on ``world`` ranks (:func:`run_lightning_ranks`) and return the JSON
    the ranks wrote to ``out`` (a path), with ``"_launch_error"``: the tail of the error when a rank failed or hung
    (the cases that finished before it are kept), else None."""
    import json

    launch_error = None
    try:
        run_lightning_ranks(["-m", module, str(out), *names], world=world, timeout_s=timeout_s, cwd=cwd)
    except (AssertionError, TimeoutError) as exc:  # keep the cases that finished before a hang or crash
        launch_error = str(exc)[-4000:]
    results = json.loads(out.read_text()) if out.exists() else {}
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
