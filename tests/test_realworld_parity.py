"""Real-world parity: patterns of public Lightning code (``tests/realworld_models.py``) trained with pipedap must
equal their reference run (DDP, or a single-process union-batch run where DDP itself is wrong).

All cases run in one launch of 2 processes (``tests/realworld_cases.py``, module-scoped fixture). Per case and
pipedap variant (``default`` = ``PipeDAPStrategy()``, ``dear`` = ``PipeDAPStrategy(schedule="dear",
bucket_cap_mb=0.002)``, ``switching`` = measured selection forced through every candidate, DDP's reducer included,
in 2-step windows: ``realworld_cases.SWITCHING``; ``dear_shard`` and ``switching_shard``: the same with
``shard_optimizer=True``, the optimizer state gathered back and compared too), each run twice: every tensor within
1e-6 of the reference, both runs bit-identical, replicas equal (state DDP itself keeps per rank, a case's
``rank_local``, is compared per rank only), and the reference trained. Issue 26: measured selection and the
hand-over to DDP's reducer never change results, so ``switching`` must also show that it switched
(``_check_switched``).

Quick iteration: ``REALWORLD_CASES=mha,ema_weight_averaging python -m pytest -q tests/test_realworld_parity.py``
(other cases are skipped); ``REALWORLD_VARIANTS=dear`` and ``REALWORLD_RUNS=1`` shorten it further.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._dist_util import launch_results
from tests.realworld_models import CASES

TOL = 1e-6
REPLICA_TOL = 1e-7
ROOT = Path(__file__).resolve().parents[1]
#: the fixture's launch, and a second one for the cases a crash lost (``launch_results``), run in the first test
pytestmark = pytest.mark.timeout(3300)
SELECTED = [n for n in os.environ.get("REALWORLD_CASES", "").split(",") if n] or sorted(CASES)


@pytest.fixture(scope="module")
def realworld_results(tmp_path_factory):
    unknown = [n for n in SELECTED if n not in CASES]
    assert not unknown, f"REALWORLD_CASES names unknown cases {unknown}"
    out = tmp_path_factory.mktemp("realworld") / "results.json"
    return launch_results("tests.realworld_cases", out, SELECTED, world=2, timeout_s=1500, cwd=str(ROOT))


def _get(results: dict, case: str) -> dict:
    if case not in SELECTED:
        pytest.skip("not selected by REALWORLD_CASES")
    res = results.get(case)
    assert res is not None, f"no result for {case}; launch error: {results.get('_launch_error')}"
    assert "error" not in res or "variants" in res, res.get("error")
    if "skipped" in res:
        pytest.skip(res["skipped"])
    if not res.get("variants") and res.get("no_shard"):  # (only shard variants were selected: REALWORLD_VARIANTS)
        pytest.skip(res["no_shard"])
    assert not res.get("ref_error"), f"reference run failed: {res['ref_error']}"
    assert float(res["ref_moved"]) > 1e-3, "the reference run must actually train"
    assert res["variants"], "no variant ran"
    return res


def _check_switched(case: str, variant: str, vr: dict) -> None:
    """Every run of a switching variant switched: each candidate of measured selection installed in turn (at least
    3: two of pipedap's schedules and DDP's reducer, entered at least once), so at least one switch fewer than
    candidates, and at least min(4, candidates) windows measured; ``switching_keep_ddp`` ran DDP's reducer after the
    trials. A case where DDP's reducer is not offered (``no_torch_ddp``) must show ``min_switches`` switches."""
    c = CASES[case]
    sels = vr.get("selection") or []
    assert sels and all(sels), f"{case}/{variant}: no selection record: {sels}"
    for i, sel in enumerate(sels):
        where = f"{case}/{variant} run {i}: {sel}"
        assert "error" not in sel, where
        if c.no_torch_ddp:
            assert sel["switches"] >= (c.min_switches or 0), f"{where}: fewer than {c.min_switches} switches"
            continue
        windows, installs = sel["windows"], sel["installs"]
        assert len(windows) >= 3 and "torch_ddp" in windows, f"{where}: too few candidates, or no DDP's reducer"
        assert set(windows) <= set(installs) and sel["handovers"] >= 1, f"{where}: a candidate never installed"
        assert sel["switches"] >= max(len(windows) - 1, c.min_switches or 0), f"{where}: too few switches"
        assert sum(windows.values()) >= min(4, len(windows)), f"{where}: too few windows measured"
        if variant == "switching_keep_ddp":
            assert sel["ran_at_end"] == "torch_ddp", f"{where}: DDP's reducer was not kept after the trials"


def _check_parity(case: str, variant: str, vr: dict) -> None:
    assert "error" not in vr, f"{case}/{variant} raised:\n{vr['error']}"
    assert float(vr["vs_ref"]) <= TOL, f"{case}/{variant}: max |Δ| vs reference = {vr['vs_ref']} ({vr['worst']})"
    if "repro" in vr:
        assert float(vr["repro"]) == 0.0, f"{case}/{variant}: two runs differ by {vr['repro']}"
    assert float(vr["replicas"]) <= REPLICA_TOL, f"{case}/{variant}: rank 0 and rank 1 differ by {vr['replicas']}"
    if variant.startswith("switching"):
        _check_switched(case, variant, vr)


PARITY = sorted(n for n, c in CASES.items() if c.kind == "parity")
REFUSAL_OK = sorted(n for n, c in CASES.items() if c.kind == "refusal_ok")


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", PARITY)
def test_realworld_parity(realworld_results, case):
    res = _get(realworld_results, case)
    if CASES[case].rank_local:  # DDP keeps them per rank: otherwise the case would not test rank-local state
        assert float(res["ref_replicas_rank_local"]) > 0, f"{case}: {CASES[case].rank_local} equal on every rank"
    if CASES[case].per_rank_steps is not None:  # (the data places steps where one rank skips a module)
        assert res.get("ref_steps_with_per_rank_control_flow") == CASES[case].per_rank_steps, res
    for variant, vr in res["variants"].items():
        if not vr.get("info_only"):
            _check_parity(case, variant, vr)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", REFUSAL_OK)
def test_realworld_match_or_clear_refusal(realworld_results, case):
    """Either exactly DDP's result, or a ValueError at set-up whose message names the parameter."""
    res = _get(realworld_results, case)
    param = CASES[case].param
    for variant, vr in res["variants"].items():
        if "error" not in vr:
            _check_parity(case, variant, vr)
            continue
        assert vr["error_type"] == "ValueError", f"{case}/{variant}: not a clear refusal:\n{vr['error']}"
        assert param in vr["error_msg"], f"{case}/{variant}: the error does not name {param!r}: {vr['error_msg']}"
        assert vr["global_step_at_error"] == 0, f"{case}/{variant}: refused only at step {vr['global_step_at_error']}"
