"""The multi-case launcher of the parity suites (``tests._dist_util.launch_results``): a launch that dies runs the
cases it lost once more, keeps and warns about the first error, and a case that crashes twice has no result."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._dist_util import launch_results

ROOT = Path(__file__).resolve().parents[1]


def test_a_crash_loses_only_its_case_once(tmp_path):
    with pytest.warns(UserWarning, match="a launch died with 2 case"):
        res = launch_results("tests._crash_once_cases", tmp_path / "r.json", ["a", "crash_once", "b"], world=2,
                             timeout_s=60, cwd=str(ROOT))
    assert res["_launch_error"] is None
    assert "ranks failed [(0, -11)]" in res["_first_launch_error"]
    assert "--- rank 0 (exit -11) ---" in res["_first_launch_error"]
    # the crashed rank's Python stack (faulthandler), however long the output after it
    assert "Fatal Python error: Segmentation fault" in res["_first_launch_error"]
    assert 'tests/_crash_once_cases.py", line' in res["_first_launch_error"]
    assert {k: v for k, v in res.items() if not k.startswith("_")} == {n: {"rank": 0} for n in ("a", "crash_once", "b")}


def test_a_case_that_crashes_twice_has_no_result(tmp_path):
    with pytest.warns(UserWarning):
        res = launch_results("tests._crash_once_cases", tmp_path / "r.json", ["a", "crash_always", "b"], world=2,
                             timeout_s=60, cwd=str(ROOT))
    assert "a" in res and "crash_always" not in res and "b" not in res
    assert "(0, -11)" in res["_launch_error"] and "(0, -11)" in res["_first_launch_error"]


def test_a_clean_launch_runs_once(tmp_path):
    res = launch_results("tests._crash_once_cases", tmp_path / "r.json", ["a", "b"], world=2, timeout_s=60,
                         cwd=str(ROOT))
    assert res["_launch_error"] is None and res["_first_launch_error"] is None
    assert not (tmp_path / "r-relaunch.json").exists() and set(res) == {"a", "b", "_launch_error",
                                                                        "_first_launch_error"}
