"""The compression pipeline: helper process vs inline parity, checkpoints, slots, liveness and errors.

Each helper start imports torch and this package in a fresh interpreter (a few seconds), so the
tests share helpers where they can.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from multiprocessing import resource_tracker
import time
from pathlib import Path

import pytest
import torch

from lightning_pipedap.compress.pipeline import (
    CompressionPipeline,
    HelperDiedError,
    HelperTimeoutError,
)

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[1]
NUMELS = [100, 37]
# bucket 0: one 10 x 10 matrix; bucket 1: a 6 x 6 matrix and a 1-element bias (sent dense by PowerSGD)
LAYOUTS = [[("w0", (10, 10))], [("w1", (6, 6)), ("b1", (1,))]]


def run_step(pipe: CompressionPipeline, bucket: int, grad: torch.Tensor):
    """One single-rank step through the pipeline; returns (payload tensors, dense gradient), cloned."""
    t = pipe.submit(bucket, grad)
    p = pipe.result(t)
    while not p.final:
        p = pipe.next_round(t, p)  # one rank: the sum over ranks is the payload itself
    tensors = {k: v.clone() for k, v in {**p.tensors, **p.local}.items()}
    meta = dict(p.meta)
    if pipe.compressor.summable:
        dense = pipe.decompress(t, p).clone()
    else:
        dense = pipe.compressor.aggregate([p])
    pipe.release(t)
    return tensors, meta, dense


def fd_count() -> int:
    """Open file descriptors of this process (after starting multiprocessing's resource tracker,
    which the first spawn starts once and keeps)."""
    resource_tracker.ensure_running()
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def one_thread():
    """Run the inline side with the helper's thread count, so float reductions split the same way."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "name,kwargs",
    [("powersgd", {"rank": 2, "min_compression_rate": 1.0}), ("qsgd", {"levels": 8, "error_feedback": True}),
     ("topk", {"ratio": 0.1})],
)
def test_process_matches_inline_and_checkpoint_roundtrip(name, kwargs, one_thread):
    torch.manual_seed(0)
    grads = [[torch.randn(n) for n in NUMELS] for _ in range(5)]
    shm_before, fds = set(os.listdir("/dev/shm")), fd_count()
    with CompressionPipeline(NUMELS, name, kwargs, threads=1, layouts=LAYOUTS) as proc, \
            CompressionPipeline(NUMELS, name, kwargs, mode="inline", layouts=LAYOUTS) as inline:
        assert proc.helper_pid is not None and proc.helper_pid != os.getpid() and inline.helper_pid is None
        assert fd_count() > fds
        if name == "topk":  # k = 10 and 4: 2 slots x (grad + int32 indices + fp32 values) per bucket
            assert proc.shared_nbytes == 2 * ((400 + 40 + 40) + (148 + 16 + 16))
        if name == "powersgd":  # 2 slots x (grad + data [n] + phat [rows * r] (+ dense [1])) per bucket
            assert proc.shared_nbytes == 2 * ((400 + 400 + 80) + (148 + 148 + 48 + 4))
        for step in range(3):
            for b in range(len(NUMELS)):
                tp, mp_, dp = run_step(proc, b, grads[step][b])
                ti, mi, di = run_step(inline, b, grads[step][b])
                assert mp_ == mi and tp.keys() == ti.keys()
                assert all(torch.equal(tp[k], ti[k]) for k in tp), (name, step, b)
                assert torch.equal(dp, di)
        sd = proc.state_dict()  # fetched from the helper
        sdi = inline.state_dict()
        assert sorted(sd["params"]) == ["b1", "w0", "w1"]
        assert [sd["params"][k]["step"] for k in ("w0", "w1", "b1")] == [3, 3, 3]
        if name == "powersgd":  # compressed at step 2 only (start_step 2)
            assert sd["params"]["w1"]["tensors"]["q"].shape == (6, 2) and sd["params"]["b1"]["tensors"] == {}
            assert sd["params"]["b1"]["residual"].tolist() == [0.0]  # sent exactly
        for k in sd["params"]:
            a, b = sd["params"][k], sdi["params"][k]
            assert (a["residual"] is None) == (b["residual"] is None)
            if a["residual"] is not None:
                assert torch.equal(a["residual"], b["residual"])
            assert a["tensors"].keys() == b["tensors"].keys()
            assert all(torch.equal(a["tensors"][k], b["tensors"][k]) for k in a["tensors"])
        # restore the helper's state into a fresh inline pipeline: both continue identically
        with CompressionPipeline(NUMELS, name, kwargs, mode="inline", layouts=LAYOUTS) as resumed:
            resumed.load_state_dict(sd)
            for step in (3, 4):
                for b in range(len(NUMELS)):
                    assert torch.equal(run_step(proc, b, grads[step][b])[2], run_step(resumed, b, grads[step][b])[2])
        if name == "powersgd":  # and back into the helper
            assert proc.load_state_dict(sdi) == []
            assert [proc.state_dict()["params"][k]["step"] for k in ("w0", "w1", "b1")] == [3, 3, 3]
    # close() stopped the helper politely and released the shared slots (fds) and pipes
    assert proc.exitcode == 0
    assert fd_count() == fds
    assert set(os.listdir("/dev/shm")) == shm_before


@pytest.fixture(scope="module")
def fp16_pipe():
    with CompressionPipeline(NUMELS, "fp16", slots_per_bucket=2, timeout_s=30.0) as pipe:
        yield pipe


def test_slots_views_tickets_and_release(fp16_pipe):
    pipe = fp16_pipe
    g = torch.linspace(-1, 1, 100)
    t1 = pipe.submit(0, g)
    t2 = pipe.submit(0, g * 2)
    assert {t1.slot, t2.slot} == {0, 1}
    with pytest.raises(RuntimeError, match=r"bucket 0: all 2 slots hold unreleased tickets"):
        pipe.submit(0, g)
    p2 = pipe.result(t2)  # out of order: t1's answer is kept for later
    p1 = pipe.result(t1)
    assert torch.equal(p1.data, g.half()) and torch.equal(p2.data, (g * 2).half())
    with pytest.raises(RuntimeError, match="has no operation in flight"):
        pipe.result(t1)
    summed = p1.with_data(p1.data + p2.data)
    dense = pipe.decompress(t1, summed)
    assert torch.equal(dense, (g.half() + (g * 2).half()).float())
    pipe.submit_decompress(t2, p2)
    with pytest.raises(RuntimeError, match="still has 'decompress' in flight"):
        pipe.release(t2)
    pipe.result(t2)
    timings = pipe.timings(t1)
    assert set(timings) == {"compress", "decompress", "wait"} and all(v >= 0 for v in timings.values())
    pipe.release(t1)
    pipe.release(t2)
    with pytest.raises(RuntimeError, match="unknown or released ticket"):
        pipe.result(t1)
    with pytest.raises(ValueError, match=r"bucket 1 expects a flat \[37\] float32 gradient"):
        pipe.submit(1, torch.zeros(36))
    with pytest.raises(ValueError, match=r"bucket 2 out of range; valid buckets 0..1"):
        pipe.submit(2, torch.zeros(37))


def test_threads_collect_different_tickets_concurrently(fp16_pipe):
    """Tickets submitted in one thread, collected by two threads sharing the result pipe."""
    for step in range(20):
        tickets = [fp16_pipe.submit(b, torch.full((n,), float(step + b))) for b, n in enumerate(NUMELS)]
        got, errors = {}, []

        def collect(t):
            try:
                got[t.bucket] = fp16_pipe.result(t).data.clone()
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=collect, args=(t,)) for t in reversed(tickets)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors
        for b, n in enumerate(NUMELS):
            assert torch.equal(got[b], torch.full((n,), float(step + b), dtype=torch.float16))
        for t in tickets:
            fp16_pipe.release(t)


def test_helper_errors_are_reported_with_traceback(fp16_pipe):
    sd = fp16_pipe.state_dict()
    sd["params"]["<bucket 1>"]["shape"] = [38]
    with pytest.raises(RuntimeError, match=r"(?s)failed in load_state_dict.*parameter '<bucket 1>': saved compression "
                                           r"state has shape \(38,\), this run's parameter has shape \(37,\)"):
        fp16_pipe.load_state_dict(sd)
    with pytest.raises(ValueError, match="holds compression state of 'topk', this run uses 'fp16'"):
        fp16_pipe.load_state_dict({**sd, "compressor": "topk"})
    # the helper survived its error
    assert torch.equal(run_step(fp16_pipe, 1, torch.ones(37))[2], torch.ones(37))


def test_timeout_names_bucket_when_helper_stalls(fp16_pipe):
    pid = fp16_pipe.helper_pid
    os.kill(pid, signal.SIGSTOP)
    try:
        t = fp16_pipe.submit(1, torch.ones(37))
        with pytest.raises(HelperTimeoutError,
                           match=rf"helper \(pid {pid}, alive\) did not finish compress of bucket 1 .* within 1 s"):
            fp16_pipe.result(t, timeout_s=1.0)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert torch.equal(fp16_pipe.result(t).data, torch.ones(37).half())  # late answer still arrives
    fp16_pipe.release(t)


def test_dead_helper_raises_named_error_not_hang():
    fds = fd_count()
    pipe = CompressionPipeline([1000], "topk", {"ratio": 0.1}, timeout_s=60.0)
    pid = pipe.helper_pid
    t = pipe.submit(0, torch.randn(1000))
    pipe.result(t)
    pipe.release(t)
    os.kill(pid, signal.SIGSTOP)  # stopped helper: the next request stays in flight
    t = pipe.submit(0, torch.randn(1000))
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(HelperDiedError,
                       match=rf"helper \(pid {pid}\) died during compress of bucket 0 .*killed by signal 9"):
        pipe.result(t)
    with pytest.raises(HelperDiedError, match="killed by signal 9"):  # and on every later call
        pipe.submit(0, torch.randn(1000))
    pipe.close()
    assert pipe.exitcode == -signal.SIGKILL
    pipe.close()  # idempotent
    with pytest.raises(RuntimeError, match="compression pipeline is closed"):
        pipe.submit(0, torch.randn(1000))
    del pipe, t
    assert fd_count() == fds  # slots (shared-memory fds) and pipes released


def test_helper_exits_when_parent_is_sigkilled(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time, torch
        from lightning_pipedap.compress.pipeline import CompressionPipeline
        if __name__ == "__main__":
            torch.set_num_threads(1)
            pipe = CompressionPipeline([16], "fp16")
            # a forked child (like a DataLoader worker) inherits the pipes to the helper, so the
            # helper sees neither EOF nor its parent sentinel when this process dies
            holder = os.fork()
            if holder == 0:
                time.sleep(600)
                os._exit(0)
            print(pipe.helper_pid, holder, flush=True)
            time.sleep(600)
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    holder = 0
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = parent.stdout.readline()
        assert len(line.split()) == 2, f"parent did not print the helper and holder pids: {line!r}"
        helper, holder = map(int, line.split())
        assert _running(helper)
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        deadline = time.monotonic() + 30.0
        while _running(helper) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(helper), f"helper {helper} outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if holder:
            os.kill(holder, signal.SIGKILL)
        parent.stdout.close()


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_constructor_validation():
    with pytest.raises(ValueError, match=r"slots_per_bucket must be an integer >= 2, got 1"):
        CompressionPipeline([4], "fp16", slots_per_bucket=1)
    with pytest.raises(ValueError, match=r"threads must be an integer >= 1, got 0"):
        CompressionPipeline([4], "fp16", threads=0)
    with pytest.raises(ValueError, match=r"mode must be one of \('process', 'inline'\), got 'thread'"):
        CompressionPipeline([4], "fp16", mode="thread")
    with pytest.raises(ValueError, match="unknown compressor 'zip'"):
        CompressionPipeline([4], "zip")
    with pytest.raises(ValueError, match=r"bucket_numels must be a non-empty sequence of integers >= 1, got \[4, 0\]"):
        CompressionPipeline([4, 0], "fp16")
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds > 0"):
        CompressionPipeline([4], "fp16", timeout_s=0)
    with pytest.raises(ValueError, match=r"bucket 0: layout \['w\[2, 3\]'\] holds 6 elements, the bucket has 4"):
        CompressionPipeline([4], "fp16", layouts=[[("w", (2, 3))]])
    with pytest.raises(ValueError, match="layouts describe 1 buckets, but there are 2 buckets"):
        CompressionPipeline([4, 4], "fp16", layouts=[[("w", (2, 2))]])


def test_inline_mode_same_slot_rules_and_errors():
    with CompressionPipeline([4], "powersgd", {"rank": 1}, mode="inline") as pipe:
        t1 = pipe.submit(0, torch.ones(4))
        pipe.submit(0, torch.ones(4))
        with pytest.raises(RuntimeError, match="all 2 slots hold unreleased tickets"):
            pipe.submit(0, torch.ones(4))
        p = pipe.result(t1)
        with pytest.raises(ValueError, match="is final; use submit_decompress"):
            pipe.submit_round(t1, p)
        assert torch.equal(pipe.decompress(t1, p), torch.ones(4))
