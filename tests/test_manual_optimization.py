"""Manual optimization with ``strategy="pipedap"`` leaves profiling, plans, measures candidates and installs one,
with DDP's results (issue 26, item 5).

One launch of 2 ranks (``tests/manual_optimization_cases.py``, module-scoped fixture) trains, per case, the
reference (``ddp_find_unused_parameters_true`` for the GANs, ``ddp``) and ``pipedap`` with a short start-up
(``profile_steps=2, trial_steps=1, trial_rounds=1, trial_window_s=0``):

* ``gan``: Lightning's GAN template (two optimizers, two backward passes and optimizer steps per
  ``training_step``, ``toggle_optimizer``);
* ``wgan_gp``: a WGAN-GP (``n_critic=3`` critic steps with a ``create_graph=True`` gradient penalty, then a
  generator step: four passes and steps per ``training_step``);
* ``manual_accumulate``: gradient accumulation written by hand (``opt.step()`` every 2nd batch); and
  ``Trainer(accumulate_grad_batches=2)`` with manual optimization is refused as under DDP.

A callback reads the strategy's run-time in ``on_train_end`` on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._dist_util import run_lightning_ranks

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-6
CASES = ("gan", "wgan_gp", "manual_accumulate")
#: backward passes per training_step of each case (each reduces every bucket)
PASSES = {"gan": 2, "wgan_gp": 4, "manual_accumulate": 1}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("manual") / "out"
    run_lightning_ranks(["-m", "tests.manual_optimization_cases", str(out), *CASES], world=2, timeout_s=600,
                        cwd=str(ROOT))
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_manual_optimization_plans_and_installs_a_final_schedule(results, case):
    for rank, res in enumerate(results):
        run = res[case]["run"]
        what = run["what_ran"]
        assert run["phase"] == "run", f"rank {rank}: the fit ended in phase {run['phase']} ({what['plan_selection']})"
        assert what["plan_selection_status"] == "finished", what["plan_selection"]
        assert run["startup"]["profile_steps"] == 2 and run["startup"]["trial_steps"] > 0, run["startup"]
        chosen = [c for c in what["candidates"] if c["chosen"]]
        assert len(what["candidates"]) >= 2 and len(chosen) == 1, what["candidates"]
        assert all(c["measured_s"] > 0 for c in what["candidates"])
        assert what["ran_at_end"] == chosen[0]["name"] and run["installed"], (what["ran_at_end"], run["installed"])
        assert run["update_counts"] == dict.fromkeys(run["update_counts"], 0)  # (sync mode: nothing deferred)
        # profiled per module (not one root-owned layer), per backward pass
        assert run["profile_meta"]["profiled_steps"] == 2
        assert run["profile_meta"].get("passes_per_step", 1) == PASSES[case], run["profile_meta"]
        assert len(run["profile_layers"]) >= 3 and "<root>" not in run["profile_layers"], run["profile_layers"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_manual_optimization_equals_ddp(results, case):
    r0, r1 = (res[case] for res in results)
    assert r0["ref_moved"] > 1e-3, "the reference run must actually train"
    assert r0["global_step"] == r0["ref_global_step"] > 0
    for res in (r0, r1):
        assert res["max_diff"] <= TOL, f"{case}: max |Δ| vs the reference {res['max_diff']} ({res['worst']})"
        assert res["bit_identical"], f"{case}: within {res['max_diff']} of the reference but not bit-identical"
    assert r0["digest"] == r1["digest"], f"{case}: the replicas differ"


@pytest.mark.multiprocess
def test_accumulate_grad_batches_with_manual_optimization_is_refused_as_under_ddp(results):
    for res in results:
        ref = res["refusal"]
        assert ref["ddp"].startswith("MisconfigurationException") and "accumulat" in ref["ddp"], ref
        assert ref["pipedap"] == ref["ddp"]
