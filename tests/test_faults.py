"""Fault matrix: every failure of a 2-rank pipedap job becomes a named error on every rank, in bounded time.

Each case runs ``tests/faults/train.py`` (an MLP, ``schedule="dear"``, ``wait_timeout_s=10``), either
with each rank started by the test as torchrun would (``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/
``MASTER_*``), so each rank's exit code is seen, or through Lightning's own subprocess launcher. The
fault is injected from outside (a signal to one rank after it has run 5 steps) or inside (an
exception in ``training_step``, uneven data, a wider model on one rank). Every case asserts the exit
codes, the time to exit (at most the timeout + 30 s), the message, and that no process and no
``/dev/shm`` entry is left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._dist_util import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "faults" / "train.py"
TIMEOUT_S = 10.0
BOUND_S = TIMEOUT_S + 30.0

pytestmark = pytest.mark.multiprocess


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _fresh_signals() -> None:
    """In a rank, before exec: the signal state a shell gives a new job (default SIGINT/SIGTERM dispositions, no
    signal blocked). Both are inherited across fork and exec, so without this a rank started from a pytest process
    that an earlier test left with SIGINT ignored or blocked never sees the SIGINT this file sends (seen in the full
    suite only: both ranks finished the fit and exited 0)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


class Job:
    """The ranks of one run, their output files and their exit codes."""

    def __init__(self, tmp: Path, fault: str, fault_rank: int, external: bool = True, script: Path = SCRIPT,
                 **opts: object) -> None:
        self.tmp, self.script = tmp, script
        args = [sys.executable, str(script), str(tmp), fault, str(fault_rank), f"timeout={TIMEOUT_S}"]
        args += [f"{k}={v}" for k, v in opts.items()]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.procs: list[subprocess.Popen] = []
        self.logs = [tmp / f"out.{r}" for r in range(2)]
        if external:
            port = free_port()
            for r in range(2):
                renv = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                        "RANK": str(r), "LOCAL_RANK": str(r), "NODE_RANK": "0"}
                with open(self.logs[r], "w") as f:
                    self.procs.append(subprocess.Popen(args, env=renv, stdout=f, stderr=subprocess.STDOUT, cwd=tmp,
                                                       preexec_fn=_fresh_signals))
        else:
            with open(self.logs[0], "w") as f:
                self.procs.append(subprocess.Popen(args, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=tmp,
                                                   start_new_session=True, preexec_fn=_fresh_signals))

    def pid_at_step(self, rank: int, step: int, timeout_s: float = 120.0) -> int:
        """The pid of ``rank`` once it has started step ``step``."""
        path, deadline = self.tmp / f"step.{rank}", time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                got, pid = path.read_text().split()
                if int(got) >= step:
                    return int(pid)
            except (OSError, ValueError):
                pass
            if any(p.poll() is not None for p in self.procs):
                raise AssertionError(f"a rank exited before step {step}:\n{self.output()}")
            time.sleep(0.05)
        raise AssertionError(f"rank {rank} did not reach step {step} in {timeout_s} s:\n{self.output()}")

    def wait(self, limit_s: float = BOUND_S, ranks: tuple[int, ...] | None = None) -> list[int | None]:
        """Exit codes after up to ``limit_s`` (None: still running, then killed)."""
        deadline = time.monotonic() + limit_s
        watched = [p for i, p in enumerate(self.procs) if ranks is None or i in ranks]
        while time.monotonic() < deadline and any(p.poll() is None for p in watched):
            time.sleep(0.1)
        codes = [p.poll() for p in self.procs]
        return codes

    def output(self, rank: int | None = None) -> str:
        files = self.logs if rank is None else [self.logs[rank]]
        return "\n".join(f.read_text(errors="replace") for f in files if f.exists())

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait(10)

    def leftover(self) -> list[str]:
        """Processes still running this job's script (any rank, launched by Lightning or not)."""
        out = subprocess.run(["pgrep", "-f", f"{self.script} {self.tmp}"], capture_output=True, text=True).stdout
        return out.split()


@pytest.fixture
def job(tmp_path):
    shm_before = _shm()
    jobs: list[Job] = []

    def start(*args, **kwargs) -> Job:
        j = Job(tmp_path, *args, **kwargs)
        jobs.append(j)
        return j

    yield start
    left = [pid for j in jobs for pid in j.leftover()]
    for j in jobs:
        j.kill_all()
    assert not left, f"processes left behind: {left}"
    new_shm = _shm() - shm_before
    assert not {n for n in new_shm if "torch" in n or "pipedap" in n}, f"/dev/shm entries left: {new_shm}"


def _assert_no_abort(j: Job, codes: list[int | None]) -> None:
    text = j.output()
    assert "terminate called" not in text, text[-3000:]
    assert all(c != -signal.SIGABRT for c in codes), (codes, text[-3000:])


def test_exception_on_one_rank_with_save_on_exception_fails_every_rank_and_prints_the_error(job):
    j = job("raise", 1, save_on_exception=1)
    j.pid_at_step(1, 5)
    t0 = time.monotonic()
    codes = j.wait()
    took = time.monotonic() - t0
    assert None not in codes and all(c != 0 for c in codes), (codes, j.output()[-3000:])
    assert took < BOUND_S
    assert "RuntimeError: injected failure on rank 1 at step 5" in j.output(1)
    assert "rank 1: failed with an exception" in j.output(0) or "rank 1:" in j.output(0), j.output(0)[-3000:]
    assert "pipedap: writing " in j.output(0)  # the last completed step (tests/test_faults_checkpoint.py)
    _assert_no_abort(j, codes)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_lost_peer_is_named_within_the_timeout(job, sig):
    j = job("none", 0, batches=400)
    pid = j.pid_at_step(1, 5)
    os.kill(pid, sig)
    t0 = time.monotonic()
    codes = j.wait(ranks=(0,))
    took = time.monotonic() - t0
    assert codes[0] not in (None, 0), (codes, j.output(0)[-3000:])
    assert took < BOUND_S, took
    text = j.output(0)
    assert "EngineError" in text and "rank 1: no heartbeat" in text, text[-3000:]
    if sig == signal.SIGSTOP:
        j.procs[1].send_signal(signal.SIGCONT)  # it finds its peer gone and fails too
        assert j.wait(ranks=(1,))[1] not in (None, 0), j.output(1)[-3000:]


@pytest.mark.parametrize("sig,rank", [(signal.SIGTERM, 0), (signal.SIGTERM, 1), (signal.SIGINT, 1)])
def test_termination_signals_exit_nonzero_without_aborting(job, sig, rank):
    j = job("none", 0, batches=400)
    pid = j.pid_at_step(rank, 5)
    os.kill(pid, sig)
    codes = j.wait()
    assert None not in codes, (codes, j.output()[-3000:])
    assert all(c != 0 for c in codes), (codes, j.output()[-3000:])
    if sig == signal.SIGTERM:  # a pre-empted job: every rank 143, whichever was signalled
        assert codes == [143, 143], (codes, j.output()[-3000:])
    _assert_no_abort(j, codes)


def test_uneven_inputs_stop_the_rank_left_alone_with_a_named_error(job):
    j = job("uneven", 1, at=5)
    t0 = time.monotonic()
    codes = j.wait()
    assert time.monotonic() - t0 < BOUND_S + 60
    assert codes[1] == 0, j.output(1)[-3000:]  # it finished its 5 batches
    assert codes[0] not in (None, 0), j.output(0)[-3000:]
    assert "rank 1: left the fit" in j.output(0), j.output(0)[-3000:]


def test_mismatched_models_are_refused_on_every_rank_naming_the_parameter(job):
    j = job("mismatch", 1)
    codes = j.wait()
    assert None not in codes and all(c != 0 for c in codes), (codes, j.output()[-3000:])
    for r in range(2):
        assert "net.0.weight" in j.output(r), j.output(r)[-3000:]


def test_exception_under_lightnings_launcher_leaves_no_process(job):
    j = job("raise", 1, external=False, save_on_exception=1)
    t0 = time.monotonic()
    codes = j.wait()
    assert codes[0] not in (None, 0), j.output()[-3000:]
    assert time.monotonic() - t0 < BOUND_S + 60
    assert "injected failure on rank 1" in j.output()


def test_compression_helper_in_a_script_without_main_guard_does_not_rerun_it(job, tmp_path):
    j = job("none", 0, script=SCRIPT.parent / "no_guard.py", compression="fp16", batches=12)
    codes = j.wait()
    assert codes == [0, 0], (codes, j.output()[-3000:])
    assert sorted(p.name.split(".")[1] for p in tmp_path.glob("body_ran.*")) == ["0", "1"]  # once per rank
    assert (tmp_path / "done.0").read_text() == "12"


def test_sigterm_to_the_whole_job_under_lightnings_launcher_exits_143_and_leaves_no_process(job):
    """What a scheduler's pre-emption does: SIGTERM to every process of the job at once."""
    j = job("none", 0, external=False, batches=400)
    j.pid_at_step(1, 5)
    t0 = time.monotonic()
    os.killpg(os.getpgid(j.procs[0].pid), signal.SIGTERM)
    codes = j.wait()
    assert codes[0] == 143, (codes, j.output()[-3000:])
    assert "terminated with code" not in j.output(), j.output()[-3000:]  # (Lightning's observer killed no rank)
    assert time.monotonic() - t0 < BOUND_S
    _assert_no_abort(j, codes)


@pytest.mark.parametrize("defer", ["true", "false"])
def test_nonfinite_raise_stops_every_rank_naming_the_step_and_parameter(job, defer):
    """A NaN/inf gradient on rank 1 only: every rank sees it in the averaged gradients and raises."""
    j = job("nan", 1, at=5, nonfinite="raise", defer=defer)
    t0 = time.monotonic()
    codes = j.wait()
    took = time.monotonic() - t0
    assert None not in codes and all(c != 0 for c in codes), (codes, j.output()[-3000:])
    assert took < BOUND_S + 30, took  # (includes start-up: the fault comes at step 5)
    for r in range(2):
        text = j.output(r)
        assert "NonFiniteGradientError: pipedap: step 5: the averaged gradients are not finite (first: 'extra' " \
               "in bucket" in text, text[-3000:]
        assert "1 NaN and 1 inf of 4 values" in text, text[-3000:]
    assert not (j.tmp / "done.0").exists() and not (j.tmp / "done.1").exists()
    _assert_no_abort(j, codes)


def test_diverged_parameter_is_named_on_every_rank(job):
    """check_params_every_n_steps=2 finds rank 1's changed net.0.weight at the next check (step 6)."""
    j = job("perturb", 1, at=5, check_params=2)
    codes = j.wait()
    assert None not in codes and all(c != 0 for c in codes), (codes, j.output()[-3000:])
    for r in range(2):
        text = j.output(r)
        assert "ParameterDivergenceError: pipedap: step 6: parameter 'net.0.weight' differs between ranks: " \
               "rank(s) 1 hold other values than rank 0" in text, text[-3000:]
    _assert_no_abort(j, codes)


def test_rank_dependent_compression_config_is_refused_on_every_rank_naming_both_values(job):
    j = job("mismatch_compression", 1)
    t0 = time.monotonic()
    codes = j.wait()
    assert None not in codes and all(c != 0 for c in codes), (codes, j.output()[-3000:])
    assert time.monotonic() - t0 < BOUND_S
    for r in range(2):
        text = j.output(r)
        assert ("the strategy options differ between ranks (rank 1: compression_kwargs {'ratio': 0.02} vs "
                "rank 0: {'ratio': 0.01})") in text, text[-3000:]


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                continue
    return out


def test_killed_compression_helper_fails_every_rank_naming_it(job):
    """SIGKILL of rank 1's compression helper process (top-k, process mode) mid-training."""
    j = job("none", 0, batches=400, compression="topk")
    pid = j.pid_at_step(1, 5)
    helpers = _children(pid)
    assert helpers, "rank 1 has no compression helper process"
    for h in helpers:
        os.kill(h, signal.SIGKILL)
    t0 = time.monotonic()
    codes = j.wait()
    took = time.monotonic() - t0
    assert None not in codes and all(c != 0 for c in codes), (codes, j.output()[-3000:])
    assert took < BOUND_S, took
    assert "HelperDiedError" in j.output(1), j.output(1)[-3000:]
    assert "rank 1" in j.output(0), j.output(0)[-3000:]
    _assert_no_abort(j, codes)


def test_lost_peer_under_ddps_reducer_is_named_on_the_survivor(job):
    """SIGKILL of rank 1 once DDP's reducer (the ``torch_ddp`` candidate, kept by ``torch_ddp_margin=0.99``) runs:
    rank 0's error names itself, the operation and rank 1, not only gloo's ``Connection reset by peer``."""
    j = job("none", 0, batches=400, schedule="optimal", torch_ddp_margin=0.99)
    pid = j.pid_at_step(1, 40)  # (trials end by step 30: the start-up budget)
    assert "running: torch_ddp" in j.output(0), j.output(0)[-3000:]
    os.kill(pid, signal.SIGKILL)
    codes = j.wait(ranks=(0,))
    assert codes[0] not in (None, 0), (codes, j.output(0)[-3000:])
    text = j.output(0)
    assert "PeerLostError: pipedap: rank 0: " in text and "rank 1: no heartbeat" in text, text[-3000:]
    _assert_no_abort(j, codes)


def test_nonfinite_warn_run_that_ends_with_nan_parameters_exits_nonzero_naming_them(job):
    """``nonfinite="warn"`` applies the NaN update (as DDP does); the fit then ends with NaN in ``extra``: every rank
    says so and exits 3, not 0."""
    j = job("nan", 1, at=5, batches=10, nonfinite="warn")
    codes = j.wait()
    assert codes == [3, 3], (codes, j.output()[-3000:])
    for r in range(2):
        text = j.output(r)
        assert f"pipedap: rank {r}: exiting with 3: the fit ended with parameters that are not finite (1 of 5 " \
               "parameters hold NaN or inf (first: 'extra', " in text, text[-3000:]
    assert (j.tmp / "done.0").exists()  # (the fit itself finished: the exit code says the result is not usable)
    _assert_no_abort(j, codes)


def test_sigint_under_ddps_reducer_is_named_on_the_survivor(job):
    """SIGINT (Ctrl-C) to rank 1 while DDP's reducer runs: rank 1 stops; rank 0's error names itself, the operation
    and rank 1 (issue 27's fault matrix: SIGINT with ``torch_ddp`` installed)."""
    j = job("none", 0, batches=400, schedule="optimal", torch_ddp_margin=0.99)
    pid = j.pid_at_step(1, 40)  # (trials end by step 30: the start-up budget)
    assert "running: torch_ddp" in j.output(0), j.output(0)[-3000:]
    os.kill(pid, signal.SIGINT)
    t0 = time.monotonic()
    codes = j.wait()
    took = time.monotonic() - t0
    assert None not in codes and all(c != 0 for c in codes), (codes, j.output()[-3000:])
    assert took < BOUND_S, took
    text = j.output(0)  # (the heartbeat's exit, or the reducer's collective wrapped: either names both ranks)
    assert ("PeerLostError: pipedap: rank 0: " in text or "pipedap: rank 0: peer(s) gone (rank 1: was interrupted"
            in text), text[-3000:]
    _assert_no_abort(j, codes)


def test_uneven_inputs_under_ddps_reducer_stop_the_rank_left_alone_with_a_named_error(job):
    """Rank 1 runs out of batches while DDP's reducer runs: rank 0's next reduction names rank 1 (issue 27's fault
    matrix: uneven data with ``torch_ddp`` installed)."""
    # (the ranks agree on 80 steps; a budget of 32 of them ends the trials, DDP's reducer kept, before rank 1 leaves)
    j = job("uneven", 1, at=80, batches=400, schedule="optimal", torch_ddp_margin=0.99, startup_budget=0.4)
    t0 = time.monotonic()
    codes = j.wait(BOUND_S + 60)
    assert time.monotonic() - t0 < BOUND_S + 60
    assert "running: torch_ddp" in j.output(0), j.output(0)[-3000:]
    assert codes[1] == 0, j.output(1)[-3000:]  # it finished its batches
    assert codes[0] not in (None, 0), j.output(0)[-3000:]
    text = j.output(0)
    assert "PeerLostError: pipedap: rank 0: " in text and "rank 1: left the fit" in text, text[-3000:]
    assert "the ranks expect different numbers of optimizer steps (rank 0: 400, rank 1: 80)" in text, text[-3000:]
    _assert_no_abort(j, codes)


def test_uneven_inputs_with_shard_optimizer_are_refused_at_the_first_step_on_every_rank(job):
    """The end of a sharded fit gathers from every rank, so the rank that runs out first cannot leave alone (it waited
    wait_timeout_s: a fresh-user finding): the different step counts are refused at the fit's start, named."""
    j = job("uneven", 1, at=10, batches=40, shard_optimizer="true")
    codes = j.wait()
    assert None not in codes and all(c != 0 for c in codes), (codes, j.output()[-3000:])
    for r in range(2):
        assert "ValueError: pipedap: the ranks expect different numbers of optimizer steps (rank 0: 40, rank 1: " \
               "10): uneven inputs, which shard_optimizer cannot finish" in j.output(r), j.output(r)[-3000:]
    _assert_no_abort(j, codes)
