"""The plan cache: its key and store (pure, in process), the controller's verification of a remembered plan (fake
effects), and one 2-rank Lightning launch: a first fit selects and remembers its plan, a second installs it after
the trace step and verifies it, a third finds it stale and selects again.

This file is also the script each rank of that launch runs::

    LOCAL_RANK=r WORLD_SIZE=2 ... python -m tests.test_plan_cache OUT.json CACHE_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_pipedap.plan.plan_cache import KEY_PARTS, PlanStore, differing_parts, digest, plan_key

ROOT = Path(__file__).resolve().parents[1]


def _key(**change):
    """A key of a 3-layer model on 2 processes of one node; ``change`` replaces arguments of :func:`plan_key`."""
    kw = dict(model_class="Net", params=[["net.0.weight", [32, 16], "torch.float32", True, "net.0"],
                                         ["net.0.bias", [32], "torch.float32", True, "net.0"],
                                         ["net.2.weight", [4, 32], "torch.float32", True, "net.2"]],
              world_size=2, nodes=1, processes_per_node=2, backend="gloo", device="cpu",
              link={"alpha_beta_key": "0123456789abcdef"}, optimizers=["torch.optim.sgd.SGD"],
              options={"schedule": "'optimal'", "bucket_cap_mb": "25.0", "wire_dtype": "'fp32'"},
              versions={"lightning_pipedap": "0.1.0", "torch": "2.13.0", "entry": "1"})
    kw.update(change)
    return plan_key(**kw)


ENTRY = {"selected_at": "2026-01-02 03:04:05 UTC", "choice": {"kind": "torch_ddp", "bucket_cap_mb": 25.0,
                                                              "find_unused_parameters": False},
         "no_overlap_time_s": 0.01, "measured_s": 0.008, "candidates": []}


# ------------------------------------------------------------------------------------------------ key and store
def test_the_key_is_a_pure_function_of_its_inputs():
    a, b = _key(), _key()
    assert a == b and digest(a) == digest(b) and list(a) == list(KEY_PARTS)
    assert json.loads(json.dumps(a)) == a  # plain JSON data
    assert differing_parts(a, _key(world_size=4, nodes=2)) == ["world"]
    assert differing_parts(a, _key(params=[["net.0.weight", [32, 16], "torch.float32", False, None]])) == ["model"]


def test_a_stored_plan_is_found_under_its_key_and_written_atomically(tmp_path):
    store = PlanStore(tmp_path / "plans")
    path = store.save(_key(), ENTRY)
    assert path.parent == tmp_path / "plans" and path.name.startswith(f"plan-{digest(_key()['model'])}-")
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    found = store.lookup(_key())
    assert found.entry is not None and found.path == path and found.reason is None
    assert found.entry["choice"] == ENTRY["choice"] and found.entry["key"] == _key()


@pytest.mark.parametrize("change, part, detail", [
    (dict(world_size=4, processes_per_node=4), "world", "world_size 4 -> 2"),
    (dict(optimizers=["torch.optim.adam.Adam"]), "optimizers", "torch.optim.adam.Adam"),
    (dict(options={"schedule": "'optimal'", "bucket_cap_mb": "4.0", "wire_dtype": "'fp32'"}), "options",
     "bucket_cap_mb 4.0 -> 25.0"),
    (dict(link={"alpha_beta_key": "fedcba9876543210"}), "link", "alpha_beta_key"),
    (dict(device="cuda:NVIDIA H200"), "device", "cuda:NVIDIA H200 -> cpu"),
    (dict(versions={"lightning_pipedap": "0.0.9", "torch": "2.13.0", "entry": "1"}), "versions", "0.0.9"),
])
def test_a_miss_names_the_key_part_that_differs_from_the_same_models_entry(tmp_path, change, part, detail):
    store = PlanStore(tmp_path)
    store.save(_key(**change), ENTRY)  # what an earlier run of the same model remembered
    found = store.lookup(_key())
    assert found.entry is None and found.path is not None
    assert f"differs in {part} (" in found.reason and detail in found.reason, found.reason


def test_a_miss_on_another_model_says_there_is_no_entry_for_it(tmp_path):
    store = PlanStore(tmp_path)
    store.save(_key(), ENTRY)
    other = [["net.0.weight", [48, 16], "torch.float32", True, "net.0"]]
    found = store.lookup(_key(params=other))
    assert found.entry is None and found.reason == "no entry for this model"
    assert PlanStore(tmp_path / "missing").lookup(_key()).reason == "no entry for this model"


def test_an_entry_whose_stored_key_differs_is_never_reused(tmp_path):
    store = PlanStore(tmp_path)
    path = store.save(_key(), ENTRY)
    data = json.loads(path.read_text())
    data["key"]["world"]["world_size"] = 8  # (a file under the right name whose key does not match)
    path.write_text(json.dumps(data))
    found = store.lookup(_key())
    assert found.entry is None and "world (world_size 8 -> 2)" in found.reason
    path.write_text("{not json")
    found = store.lookup(_key())
    assert found.entry is None and "unreadable" in found.reason


def test_the_options_in_the_key_are_those_that_change_the_plan():
    from lightning_pipedap.strategy.config import PipeDAPConfig
    from lightning_pipedap.strategy.plan_cache import keyed_options

    def opts(**kw):
        return keyed_options(PipeDAPConfig(**kw), 1, "Trainer")

    base = opts()
    for changed in (dict(bucket_cap_mb=4.0), dict(wire_dtype="bf16"), dict(defer_update=False),
                    dict(schedule="wfbp"), dict(torch_ddp_candidate=False), dict(partition_mb=1.0)):
        assert opts(**changed) != base, changed
    for same in (dict(trial_steps=7), dict(replan_margin=0.5), dict(profile_steps=5), dict(wait_timeout_s=60.0),
                 dict(plan_cache=False), dict(cost_model_cache=False)):
        assert opts(**same) == base, same
    assert keyed_options(PipeDAPConfig(), 2, "Trainer") != base  # accumulate_grad_batches
    assert keyed_options(PipeDAPConfig(), 1, "Fabric") != base


def test_where_the_plan_cache_is(tmp_path, monkeypatch):
    from lightning_pipedap.strategy.plan_cache import plan_cache_directory

    monkeypatch.delenv("PIPEDAP_PLAN_CACHE", raising=False)
    monkeypatch.setenv("PIPEDAP_CACHE_DIR", str(tmp_path / "cache"))
    assert plan_cache_directory(True) == (tmp_path / "cache" / "plans", "")
    assert plan_cache_directory(str(tmp_path / "mine")) == (tmp_path / "mine", "")
    assert plan_cache_directory(False) == (None, "plan_cache=False")
    monkeypatch.setenv("PIPEDAP_PLAN_CACHE", str(tmp_path / "sweep"))
    assert plan_cache_directory(True) == (tmp_path / "sweep", "")
    monkeypatch.setenv("PIPEDAP_PLAN_CACHE", "off")
    assert plan_cache_directory(True) == (None, "PIPEDAP_PLAN_CACHE=off")
    assert plan_cache_directory(str(tmp_path / "mine"))[0] == tmp_path / "mine"  # an explicit path wins


def test_plan_cache_option_is_validated_with_its_name(tmp_path):
    from lightning_pipedap.strategy.config import PipeDAPConfig

    assert PipeDAPConfig(plan_cache=tmp_path).plan_cache == str(tmp_path)  # a path-like becomes a str
    for bad in (3, "", None, 0.5):
        with pytest.raises(ValueError, match="plan_cache must be True"):
            PipeDAPConfig(plan_cache=bad)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="plan_cache=.* is a file"):
        PipeDAPConfig(plan_cache=str(tmp_path / "f"))


def test_an_unwritable_directory_is_one_warning_and_the_fit_goes_on(tmp_path):
    from lightning_pipedap.schedule import Schedule
    from lightning_pipedap.strategy.config import PipeDAPConfig
    from lightning_pipedap.strategy.plan_cache import PlanCache

    (tmp_path / "file").write_text("x")
    said, warned = [], []
    cache = PlanCache(PipeDAPConfig(plan_cache=str(tmp_path / "file" / "plans")), 0, said.append, warned.append)
    cache.key = _key()
    rt = SimpleNamespace(final_schedule=Schedule(buckets=((0, 1, 2),), ops=(), name="wfbp@25"),
                         planning=SimpleNamespace(cost_model=None, raw_cost_model=None, cost_model_origin=None),
                         module=SimpleNamespace())
    result = {"name": "wfbp@25", "chosen": True, "measured_s": 0.01}
    cache.store(rt, [result], 0.02, 0.01)
    cache.store(rt, [result], 0.02, 0.01)  # (a re-plan's selection: not warned twice)
    assert len(warned) == 1 and "cannot write to" in warned[0] and "training goes on" in warned[0]
    assert not said


# ------------------------------------------------------------------------------------------------ controller
def _controller(cache, **kw):
    from lightning_pipedap.strategy.controller import Controller
    from tests.test_strategy_controller import Clock, FakeEffects, Sched

    clock = Clock()
    fx = FakeEffects(candidates=[Sched("a", 1.0), Sched("b", 0.9)], profiled=(1,))
    fx.cache = cache
    ctl = Controller(fx, planned=True, clock=clock, profile_steps=1, trial_steps=2, **kw)
    return ctl, fx, clock


def test_a_cached_plan_is_installed_after_the_trace_and_verified():
    from lightning_pipedap.strategy.controller import Phase, describe_startup
    from tests.test_strategy_controller import Sched

    ctl, fx, clock = _controller(("hit", (Sched("b", 0.9), 2.0, 0.10)))
    ctl.after_sync_step(0.0)  # the trace step: then the plan cache's candidate, no profiling
    assert ctl.phase is Phase.VERIFY and ctl.phase.deferrable and ctl.plan_cache == "hit"
    assert [c for c in fx.calls if not (isinstance(c, tuple) and c[0] in ("info", "agree"))] == \
        ["adopt_trace", ("install_run", "b")]
    for dt in (0.5, 0.3, 0.105):  # the first step's start, its (settling) interval, one measured interval
        clock.t += dt
        ctl.at_step_start()
    assert ctl.phase is Phase.VERIFY
    clock.t += 0.11  # the second of trial_steps = 2 measured intervals
    ctl.at_step_start()
    assert ctl.phase is Phase.RUN and ctl.how == "cached" and ctl.trial_reference_s == 0.10
    assert ctl.startup["total_steps"] == 5 and ctl.startup["plan_cache"] == "hit"
    assert ctl.startup["profile_steps"] == 0 and ctl.startup["trial_steps"] == 0 and ctl.startup["verify_steps"] == 4
    assert "start_profiling" not in fx.calls and not fx.stored
    assert describe_startup(ctl.startup).endswith("verifying the cached plan 4 steps 1.02 s; plan cache hit")
    assert ctl.plan_selection()["text"] == "not run (the plan came from the plan cache)"
    assert any("cached plan verified: 105.0 ms" in c[1] for c in fx.calls if c[0] == "info")


def test_a_stale_cached_plan_is_selected_again_and_remembered():
    from lightning_pipedap.strategy.controller import Phase
    from tests.test_strategy_controller import Sched

    ctl, fx, clock = _controller(("hit", (Sched("b", 0.9), 2.0, 0.001)), replan_margin=0.15)  # recorded 1 ms
    ctl.after_sync_step(0.0)
    for _ in range(4):  # the first window: the first step's start, its settling interval, 2 measured ones
        clock.t += 0.1
        ctl.at_step_start()
    assert ctl.phase is Phase.VERIFY and ctl.verify.measured_s == [pytest.approx(0.1)]  # slower: one more window
    for _ in range(2):
        clock.t += 0.1
        ctl.at_step_start()
    assert ctl.phase is Phase.PROFILE and ctl.plan_cache == "stale (re-selected)"
    assert any("in each of 2 windows: 100.0 ms, 100.0 ms): stale, selecting again" in c[1]
               for c in fx.calls if c[0] == "info")
    assert "start_profiling" in fx.calls
    ctl.after_sync_step(clock.t)  # one profiled step: plan, then the trials of a and b
    assert ctl.phase is Phase.TRIAL
    while ctl.phase is Phase.TRIAL:
        clock.t += 0.1
        ctl.at_step_start()
    assert ctl.phase is Phase.RUN and ctl.how == "selected" and len(fx.stored) == 1
    st = ctl.startup
    assert st["plan_cache"] == "stale (re-selected)" and st["verify_steps"] == 6 and st["trial_steps"] > 0
    assert st["total_steps"] == st["trace_steps"] + st["verify_steps"] + st["profile_steps"] + st["trial_steps"]


def test_a_load_burst_in_the_first_verification_window_is_not_stale():
    from lightning_pipedap.strategy.controller import Phase
    from tests.test_strategy_controller import Sched

    ctl, fx, clock = _controller(("hit", (Sched("b", 0.9), 2.0, 0.10)))
    ctl.after_sync_step(0.0)
    for dt in (0.5, 0.3, 0.4, 0.5, 0.1, 0.11):  # a burst over the first window, then the recorded speed
        clock.t += dt
        ctl.at_step_start()
    assert ctl.phase is Phase.RUN and ctl.plan_cache == "hit" and ctl.startup["verify_steps"] == 6
    said = [c[1] for c in fx.calls if c[0] == "info"]
    assert any("cached plan measured 400.0 ms" in m and "measuring another window" in m for m in said), said
    assert any(m.startswith("pipedap: cached plan verified: 100.0 ms") for m in said), said
    assert "start_profiling" not in fx.calls


def test_a_miss_profiles_as_before():
    from lightning_pipedap.strategy.controller import Phase

    ctl, fx, _ = _controller(("miss", None))
    ctl.after_sync_step(0.0)
    assert ctl.phase is Phase.PROFILE and ctl.plan_cache == "miss"
    assert fx.calls[:2] == ["adopt_trace", "start_profiling"]


# ------------------------------------------------------------------------------------------------ 2 ranks, Lightning
def _fits(cache_dir: str) -> dict:
    import logging

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipedap import PipeDAPStrategy

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("lightning_pipedap").addHandler(Keep())
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(1024, 16, generator=g), torch.randint(0, 4, (1024,), generator=g))

    def fit(steps: int, **kw) -> dict:
        del lines[:]
        strategy = PipeDAPStrategy(plan_cache=cache_dir, startup_budget=None, profile_steps=1, plan_trials=2,
                                   trial_steps=2, trial_rounds=1, trial_window_s=0.0, model_contention=False,
                                   wait_timeout_s=60.0, **kw)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        pl.seed_everything(1, verbose=False)
        trainer.fit(Net(), DataLoader(data, batch_size=8))
        ran = strategy.what_ran()
        return {"plan_cache": ran["plan_cache"], "entry": ran["plan_cache_entry"], "startup": ran["startup"],
                "installed": (ran["installed"] or {}).get("name"), "steps": trainer.global_step,
                "lines": [m for m in lines if "plan cache" in m or "cached plan" in m]}

    out = {"first": fit(40)}
    out["second"] = fit(12, replan_margin=20.0)  # (a noisy machine must not make the verification flaky)
    if int(os.environ.get("RANK", "0")) == 0:  # what a much faster machine would have recorded
        entry = next(Path(cache_dir).glob("plan-*.json"))
        data_ = json.loads(entry.read_text())
        data_["measured_s"] = 1e-7
        entry.write_text(json.dumps(data_))
    out["stale"] = fit(40)
    out["files"] = sorted(p.name for p in Path(cache_dir).iterdir())
    out["origin"] = json.loads(next(Path(cache_dir).glob("plan-*.json")).read_text())["cost_model_origin"]
    return out


def main(out_path: str, cache_dir: str) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        results = _fits(cache_dir)
    except Exception as exc:  # noqa: BLE001
        import traceback

        results = {"error": f"{exc!r}\n{traceback.format_exc()}"}
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out_path).write_text(json.dumps(results))


@pytest.mark.multiprocess
def test_a_second_run_installs_the_remembered_plan_after_its_trace_step(tmp_path):
    from tests._dist_util import run_lightning_ranks

    out, cache = tmp_path / "results.json", tmp_path / "plans"
    run_lightning_ranks(["-m", "tests.test_plan_cache", str(out), str(cache)], world=2, timeout_s=600, cwd=str(ROOT))
    res = json.loads(out.read_text())
    assert "error" not in res, res["error"]
    first, second, stale = res["first"], res["second"], res["stale"]
    # first run: a miss, a full selection, remembered
    assert first["plan_cache"] == "miss" and first["startup"]["plan_cache"] == "miss", first
    assert first["startup"]["trial_steps"] > 0 and first["steps"] == 40
    assert any("plan cache miss in" in m and "no entry for this model" in m for m in first["lines"]), first["lines"]
    assert any("plan cache: remembered" in m for m in first["lines"]), first["lines"]
    # second run: the same plan right after the trace step, verified, steady state within 5 steps
    assert second["plan_cache"] == "hit" and second["installed"] == first["installed"], second
    assert second["startup"]["total_steps"] <= 5 and second["startup"]["profile_steps"] == 0, second["startup"]
    assert second["entry"]["chosen"] == first["installed"] and second["steps"] == 12
    assert any(m.startswith("pipedap: plan cache hit") and m.endswith("— verifying") for m in second["lines"])
    assert any("cached plan verified" in m for m in second["lines"]), second["lines"]
    # third run: the entry says it was far faster than it measures: selected again, and remembered again
    assert stale["plan_cache"] == "stale (re-selected)" and stale["startup"]["trial_steps"] > 0, stale
    assert any("stale, selecting again" in m for m in stale["lines"]), stale["lines"]
    assert len(res["files"]) == 1 and res["files"][0].startswith("plan-")
    assert not res["origin"].startswith("α-β model of the plan cache entry"), res["origin"]  # (as first recorded)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
