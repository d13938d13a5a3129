"""The pipeline's life cycle: start without buckets, wait for readiness, re-lay out in the same helper,
bounded waits, and a training script without a main guard.

Each helper start imports torch and this package in a fresh interpreter (a few seconds).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lightning_pipedap.compress.channel import start_without_main
from lightning_pipedap.compress.pipeline import CompressionPipeline, HelperDiedError, HelperTimeoutError

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[1]


def topk_once(pipe: CompressionPipeline, bucket: int, grad: torch.Tensor) -> dict[int, float]:
    """Compress ``grad`` once with a topk pipeline; the sent entries as {index: value}."""
    t = pipe.submit(bucket, grad)
    p = pipe.result(t)
    sent = dict(zip(p.tensors["indices"].tolist(), p.tensors["values"].tolist()))
    pipe.release(t)
    return sent


def fd_count(pid: int | str = "self", expect: int | None = None) -> int:
    """Open file descriptors of process ``pid``; with ``expect``, waits up to 5 s for that count
    (multiprocessing's resource sharer closes its copies of passed descriptors asynchronously)."""
    deadline = time.monotonic() + 5.0
    while True:
        n = len(os.listdir(f"/proc/{pid}/fd"))
        if expect is None or n == expect or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def f32(*values: float) -> list[float]:
    """``values`` rounded to float32, as Python floats."""
    return torch.tensor(values, dtype=torch.float32).tolist()


def test_relayout_keeps_the_helper_and_carries_residuals_by_name():
    with CompressionPipeline.start("topk", {"ratio": 0.5}, threads=1) as pipe:
        assert pipe.bucket_numels == () and pipe.shared_nbytes == 0
        startup = pipe.wait_ready()
        assert 0.0 < startup < 120.0 and pipe.ready and pipe.wait_ready() == startup
        pid = pipe.helper_pid
        assert pipe.relayout([6, 4], [[("a", (2, 3))], [("b", (4,))]]) == ["a", "b"]
        fds = fd_count(), fd_count(pid)
        # k = 3 of 6 and 2 of 4: the largest magnitudes are sent exactly, the rest is the residual
        assert topk_once(pipe, 0, torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 4.0])) == {1: -5.0, 3: 3.0, 5: 4.0}
        assert topk_once(pipe, 1, torch.tensor([1.0, -2.0, 0.5, 0.25])) == {0: 1.0, 1: -2.0}
        before = pipe.state_dict()
        assert before["params"]["a"]["residual"].tolist() == f32(0.1, 0.0, 0.2, 0.0, -0.3, 0.0)
        assert before["params"]["b"]["residual"].tolist() == [0.0, 0.0, 0.5, 0.25]

        # new layout: b alone first, then a followed by a new parameter c
        assert pipe.relayout([4, 9], [[("b", (4,))], [("a", (2, 3)), ("c", (3,))]]) == ["c"]
        assert pipe.helper_pid == pid and pipe.bucket_numels == (4, 9)
        assert pipe.shared_nbytes == 2 * ((16 + 8 + 8) + (36 + 20 + 20))  # k = 2 and 5
        after = pipe.state_dict()
        for name in ("a", "b"):
            assert torch.equal(after["params"][name]["residual"], before["params"][name]["residual"])
            assert after["params"][name]["step"] == before["params"][name]["step"] == 1
        assert after["params"]["c"]["residual"].tolist() == [0.0, 0.0, 0.0]
        # a's residual now sits at offset 0 of bucket 1: zero gradient there sends it, next to c's entries
        sent = topk_once(pipe, 1, torch.tensor([0.0] * 6 + [7.0, -0.05, 0.01]))
        assert sent == dict(zip([0, 2, 4, 6, 7], f32(0.1, 0.2, -0.3, 7.0, -0.05)))
        assert topk_once(pipe, 0, torch.tensor([0.0, 0.0, 0.0, 0.0])) == {2: 0.5, 3: 0.25}  # b's residual

        # keep_state=False starts afresh
        assert pipe.relayout([4], [[("b", (4,))]], keep_state=False) == ["b"]
        assert pipe.state_dict()["params"]["b"] == {"shape": [4], "step": 0, "residual": None, "tensors": {}}
        assert pipe.helper_pid == pid
        # old slots are freed on both sides: one bucket less is 2 slots x 3 shared tensors less
        assert (fd_count(expect=fds[0] - 6), fd_count(pid, expect=fds[1] - 6)) == (fds[0] - 6, fds[1] - 6)
    assert pipe.exitcode == 0


def test_relayout_refuses_held_tickets_keeps_layout_on_error_and_times_out():
    with CompressionPipeline([8, 3], "fp16", timeout_s=30.0) as pipe:
        pid = pipe.helper_pid
        g = torch.linspace(-1.0, 1.0, 3)
        t = pipe.submit(1, g)
        with pytest.raises(RuntimeError, match=r"relayout\(\) needs every ticket released; held: "
                                               rf"bucket 1 \(ticket {t.id}, 'compress' in flight\)"):
            pipe.relayout([5, 7])
        assert torch.equal(pipe.result(t).data, g.half())
        with pytest.raises(RuntimeError, match=rf"held: bucket 1 \(ticket {t.id}, not released\)"):
            pipe.relayout([5, 7])
        pipe.release(t)
        # the default names "<bucket b>" now have other sizes: the helper refuses to carry, keeps the layout
        with pytest.raises(RuntimeError, match=r"(?s)failed in relayout to 2 buckets.*parameter '<bucket 0>': "
                                               r"saved compression state has shape \(8,\)"):
            pipe.relayout([5, 7])
        assert pipe.bucket_numels == (8, 3)
        g8 = torch.arange(8, dtype=torch.float32) / 3
        t = pipe.submit(0, g8)
        assert torch.equal(pipe.result(t).data, g8.half())
        pipe.release(t)
        assert pipe.relayout([5, 7], keep_state=False) == ["<bucket 0>", "<bucket 1>"]
        g7 = torch.linspace(-3.0, 3.0, 7)
        t = pipe.submit(1, g7)
        p = pipe.result(t)
        assert torch.equal(p.data, g7.half())
        assert torch.equal(pipe.decompress(t, p), g7.half().float())
        pipe.release(t)
        assert pipe.helper_pid == pid

        os.kill(pid, signal.SIGSTOP)  # an unresponsive helper: the relayout is bounded, the pipeline closed
        t0 = time.monotonic()
        with pytest.raises(HelperTimeoutError, match=rf"helper \(pid {pid}, alive\) did not finish relayout to 1 "
                                                     r"buckets within 1 s; the pipeline is closed"):
            pipe.relayout([4], timeout_s=1.0)
        assert time.monotonic() - t0 < 20.0
        with pytest.raises(RuntimeError, match="compression pipeline is closed"):
            pipe.submit(0, torch.zeros(4))
    assert pipe.exitcode == -signal.SIGKILL  # a stopped process only goes with SIGKILL


def test_helper_killed_before_and_after_ready_raises_died_in_bounded_time():
    pipe = CompressionPipeline.start("topk", {"ratio": 0.1})
    pid = pipe.helper_pid
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(HelperDiedError, match=rf"helper \(pid {pid}\) died during start-up: killed by signal 9"):
        pipe.relayout([10])
    assert time.monotonic() - t0 < 10.0
    with pytest.raises(RuntimeError, match="compression pipeline is closed"):
        pipe.wait_ready()

    pipe = CompressionPipeline.start("topk", {"ratio": 0.1})
    with pytest.raises(HelperTimeoutError, match=rf"helper \(pid {pipe.helper_pid}, alive\) did not finish "
                                                 r"start-up within 0.01 s"):
        pipe.wait_ready(0.01)  # a short wait before start_timeout_s leaves the pipeline usable
    assert pipe.wait_ready() > 0.0
    pid = pipe.helper_pid
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(HelperDiedError, match=rf"helper \(pid {pid}\) died during relayout to 1 buckets: "
                                              r"killed by signal 9"):
        pipe.relayout([10])
    assert time.monotonic() - t0 < 10.0
    with pytest.raises(HelperDiedError, match="killed by signal 9"):  # and on every later call
        pipe.state_dict()
    pipe.close()
    assert pipe.exitcode == -signal.SIGKILL


def test_start_timeout_names_start_up_and_stops_the_helper():
    pipe = CompressionPipeline.start("fp16", start_timeout_s=0.5)
    pid = pipe.helper_pid
    t0 = time.monotonic()
    with pytest.raises(HelperTimeoutError, match=rf"helper \(pid {pid}, alive\) did not finish start-up within 0.5 s"):
        pipe.relayout([4])
    assert time.monotonic() - t0 < 10.0
    assert pipe.exitcode is not None  # stopped
    with pytest.raises(RuntimeError, match="compression pipeline is closed"):
        pipe.submit(0, torch.zeros(4))


def test_large_request_to_a_stalled_helper_is_bounded():
    n = 100_000
    with CompressionPipeline([n], "topk", {"ratio": 0.01}, timeout_s=30.0) as pipe:
        torch.manual_seed(0)
        topk_once(pipe, 0, torch.randn(n))
        state = pipe.state_dict()  # a 400 KB residual: more than the request pipe holds
        pid = pipe.helper_pid
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(HelperTimeoutError, match=rf"helper \(pid {pid}, alive\) did not take the \d+-byte "
                                                         r"request of load_state_dict within 1 s"):
                pipe.load_state_dict(state, timeout_s=1.0)
            assert time.monotonic() - t0 < 10.0
            with pytest.raises(HelperTimeoutError, match="did not take the"):  # the request pipe is unusable now
                pipe.submit(0, torch.zeros(n))
        finally:
            os.kill(pid, signal.SIGCONT)


def test_inline_mode_same_life_cycle():
    with CompressionPipeline.start("topk", {"ratio": 0.5}, mode="inline") as pipe:
        assert pipe.ready and pipe.wait_ready() == 0.0 and pipe.helper_pid is None
        with pytest.raises(ValueError, match=r"no buckets yet \(call relayout\(\)\)"):
            pipe.submit(0, torch.zeros(4))
        with pytest.raises(RuntimeError, match=r"state_dict\(\) needs a bucket layout; call relayout\(\) first"):
            pipe.state_dict()
        assert pipe.relayout([4, 2], [[("b", (4,))], [("e", (2,))]]) == ["b", "e"]
        assert topk_once(pipe, 0, torch.tensor([1.0, -2.0, 0.5, 0.25])) == {0: 1.0, 1: -2.0}
        t = pipe.submit(1, torch.zeros(2))
        with pytest.raises(RuntimeError, match=rf"held: bucket 1 \(ticket {t.id}, 'compress' in flight\)"):
            pipe.relayout([6], [[("d", (2,)), ("b", (4,))]])
        pipe.result(t)
        pipe.release(t)
        before = pipe.state_dict()
        assert pipe.relayout([6], [[("d", (2,)), ("b", (4,))]]) == ["d"]  # e leaves the layout
        assert sorted(pipe.state_dict()["params"]) == ["b", "d"]
        after = pipe.state_dict()
        assert torch.equal(after["params"]["b"]["residual"], before["params"]["b"]["residual"])
        # b's residual now at offset 2, after d's zeros: sent with d's largest entry
        assert topk_once(pipe, 0, torch.tensor([0.0, 9.0, 0.0, 0.0, 0.0, 0.0])) == {1: 9.0, 4: 0.5, 5: 0.25}
    with CompressionPipeline.start("fp16", mode="inline") as pipe:
        assert pipe.relayout([3]) == ["<bucket 0>"]
        g = torch.tensor([0.1, -70000.0, 1e-8])
        t = pipe.submit(0, g)
        assert torch.equal(pipe.result(t).data, g.half())
        pipe.release(t)


def test_layouts_without_bucket_numels_and_infinite_timeouts_are_refused():
    with pytest.raises(ValueError, match="layouts given without bucket_numels"):
        CompressionPipeline(None, "fp16", layouts=[[("w", (2,))]])
    with pytest.raises(ValueError, match=r"start_timeout_s must be a number of seconds > 0 and finite, got inf"):
        CompressionPipeline.start("fp16", start_timeout_s=float("inf"))
    with CompressionPipeline.start("fp16", mode="inline") as pipe:
        with pytest.raises(ValueError, match=r"bucket_numels must be a non-empty sequence of integers >= 1, got \[\]"):
            pipe.relayout([])
        assert pipe.bucket_numels == ()
        with pytest.raises(ValueError, match=r"timeout_s must be a finite number of seconds >= 0, got inf"):
            pipe.relayout([4], timeout_s=float("inf"))


def test_start_without_main_restores_main_when_start_fails():
    main = sys.modules["__main__"]
    proc = mp.get_context("spawn").Process(target=print, args=(lambda: 0,))  # a lambda does not pickle
    with pytest.raises(Exception, match="pickle"):
        start_without_main(proc)
    assert sys.modules["__main__"] is main


def test_script_without_main_guard_runs_once(tmp_path):
    """spawn would re-run a guard-less script in the helper; the helper must not import it."""
    log = tmp_path / "runs.txt"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, sys, torch
        from lightning_pipedap.compress import CompressionPipeline

        with open(sys.argv[1], "a") as f:
            f.write(f"{os.getpid()} {__name__}\\n")
        torch.set_num_threads(1)
        pipe = CompressionPipeline([6], "topk", {"ratio": 0.5}, start_timeout_s=100)
        t = pipe.submit(0, torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 4.0]))
        p = pipe.result(t)
        print(sorted(zip(p.tensors["indices"].tolist(), p.tensors["values"].tolist())), flush=True)
        pipe.release(t)
        pipe.close()
        print(pipe.exitcode, flush=True)
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(script), str(log)], capture_output=True, text=True, env=env,
                          timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["[(1, -5.0), (3, 3.0), (5, 4.0)]", "0"]
    runs = log.read_text().splitlines()
    assert len(runs) == 1 and runs[0].endswith(" __main__"), runs
