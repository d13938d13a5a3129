"""Parity with Lightning's ``"ddp"`` (1e-6 after 3 epochs on 2 gloo ranks) when the planned schedule splits
the largest parameter over two buckets (``Schedule.pieces``): deferred updates, SGD with momentum, AdamW
with param groups and a step LR scheduler, clip by norm and by value, gradient accumulation over 2
micro-batches, a parameter unused in some steps (whole, or itself split: with ``.grad`` None, or a kept
zero ``.grad`` under ``defer_update=True``), ``gradient_as_bucket_view`` and sync mode
(``defer_update=False``); under the planner's op list and under DeAR's (reduce-scatter in backward
order, all-gather in forward order); and a resume from a mid-epoch checkpoint, which installs the
checkpoint's split plan.

All cases run in one launch of 2 processes (:mod:`tests.parity_pieces_cases`).
"""

import json
from pathlib import Path

import pytest

from tests._dist_util import run_lightning_ranks
from tests.parity_pieces_cases import (OPTION_CASE, PIECES_CASES, RESUME_CASE, SYNC_CASES, UNUSED_CASES,
                                      VIEW_CASES, split_largest)

TOL = 1e-6
ROOT = Path(__file__).resolve().parents[1]
NAMES = [*PIECES_CASES, *(f"{c}_dear" for c in PIECES_CASES), *(f"{c}_view" for c in VIEW_CASES), *UNUSED_CASES,
         *SYNC_CASES]
CASE_NAMES = [*NAMES, RESUME_CASE, OPTION_CASE]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity_pieces") / "results.json"
    run_lightning_ranks(["-m", "tests.parity_pieces_cases", str(out), *CASE_NAMES], world=2, timeout_s=1200,
                        cwd=str(ROOT))
    return json.loads(out.read_text())


def test_split_largest_makes_two_buckets_of_the_largest_parameter():
    from lightning_pipedap.schedule import Schedule, dear_ops

    s = split_largest(Schedule(((0, 1), (2, 3, 4)), dear_ops(2), "dear"), [4, 2, 3, 10, 1])
    assert s.buckets == ((0, 1), (2, 3), (4, 5)) and s.pieces == ((0, 0, 4), (1, 0, 2), (2, 0, 3), (3, 0, 5),
                                                                     (3, 5, 10), (4, 0, 1))
    assert s.describe() == "dear: 3 buckets (2 pieces of 1 split parameters): RS2 RS1 RS0 AG0 AG1 AG2"


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", NAMES)
def test_parity_with_ddp_with_a_split_parameter(results, case):
    res = results[case]
    assert "error" not in res, res.get("error")
    assert "2 pieces of 1 split parameters" in res["installed"], res["installed"]  # the split plan really ran
    if case.endswith("_dear"):
        assert " RS" in res["installed"] and " AG" in res["installed"], res["installed"]
    if case.endswith("_sync"):
        assert res["forward"] == 0  # sync mode: stepped by the optimizer on the written-back .grad
    else:
        assert res["forward"] > 0  # updates really deferred into the next forward
    assert res["diff"] <= TOL, f"{case}: max |param - ddp| = {res['diff']:.3e} ({res['installed']})"


@pytest.mark.multiprocess
def test_resume_installs_the_checkpoints_split_plan(results):
    res = results[RESUME_CASE]
    assert "error" not in res, res.get("error")
    assert "2 pieces of 1 split parameters" in res["installed"], res["installed"]
    assert res["plans_in_resumed_run"] == 0  # the checkpoint's schedule (with its pieces), not a new plan
    assert res["forward"] > 0
    assert res["diff"] <= TOL and res["ddp_diff"] <= TOL, res


@pytest.mark.multiprocess
def test_the_partition_mb_option_trains_exactly_as_ddp(results):
    """The option end to end, no patched planning: the real planner plans on the partitioned profile, the
    partitioned plan runs as a trial candidate and then (the selection forced to it) to the end of the fit."""
    res = results[OPTION_CASE]
    assert "error" not in res, res.get("error")
    assert "+pieces0.001MiB" in res["installed"] and "split parameters" in res["installed"], res["installed"]
    assert res["forward"] > 0
    assert res["diff"] <= TOL, f"max |param - ddp| = {res['diff']:.3e} ({res['installed']})"
