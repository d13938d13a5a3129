"""Units of ``strategy/failure.py`` that need no distributed job: Lightning's child-process observer is
disarmed, and :func:`reap_children` kills only the ranks that outlive their grace period.

The observer is Lightning's own ``_ChildProcessObserver`` (``lightning/fabric/strategies/launchers/
subprocess_script.py``), started here as its launcher starts it, with a short poll period.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from lightning_pipedap.strategy.failure import disarm_child_observer, reap_children

observer_mod = pytest.importorskip("lightning.fabric.strategies.launchers.subprocess_script")


def _sleeper(seconds: float = 30.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def _exits(code: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])


def _run_observer(disarm: bool) -> int | None:
    """A stand-in for the launching rank (a sleeping process) watched by Lightning's observer whose one
    child exits 143; returns the stand-in's exit code 1.5 s later (None: still running)."""
    main, child = _sleeper(), _exits(143)
    try:
        observer = observer_mod._ChildProcessObserver(main_pid=main.pid, child_processes=[child], sleep_period=0.3)
        observer.start()
        if disarm:
            assert disarm_child_observer() == 1
        child.wait(10)
        time.sleep(1.5)
        observer.join(5)
        assert not observer.is_alive()
        return main.poll()
    finally:
        main.kill()
        main.wait()


def test_lightnings_observer_sigkills_the_launching_rank_when_a_child_exits_143():
    """The behaviour being disarmed, shown on Lightning's own class (this test fails if Lightning changes it)."""
    assert _run_observer(disarm=False) == -9


def test_a_disarmed_observer_leaves_the_launching_rank_to_exit_with_its_own_code():
    assert _run_observer(disarm=True) is None
    assert disarm_child_observer() == 0  # (no observer left alive)


class _Launcher:
    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs = procs


def test_reap_children_waits_for_ranks_that_exit_and_kills_the_one_that_does_not():
    done, hung = _exits(1), _sleeper()
    try:
        t0 = time.monotonic()
        killed = reap_children(_Launcher([done, hung]), wait_s=1.0)
        assert killed == [hung.pid]
        assert 1.0 <= time.monotonic() - t0 < 5.0
        assert hung.wait(5) == -9 and done.wait(5) == 1
    finally:
        hung.kill()


def test_reap_children_ignores_launchers_without_popen_children():
    assert reap_children(object(), wait_s=0.1) == []
