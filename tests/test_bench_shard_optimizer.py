"""Benchmark matrix and profile replay with the sharded optimizer step (issue 30): the ``@shard`` strategy suffix,
the ``--optimizer`` choice reaching every strategy's LightningModule, the sharded prediction a ``@shard`` variant is
judged by, and a tiny end-to-end cell on the testbed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from lightning_pipedap.bench import matrix as M


# ----------------------------------------------------------------------------- @shard: names and validation
def test_shard_suffix_selects_shard_optimizer():
    sp = M.parse_strategy("pipedap-optimal@shard")
    assert (sp.family, sp.schedule, sp.shard, sp.compressor) == ("pipedap", "optimal", True, None)
    assert M.parse_strategy("pipedap-optimal").shard is False
    assert M.parse_strategy("ddp").shard is False
    sp = M.parse_strategy("pipedap-dear@fp16@shard@clip1")  # with the other suffixes, any order
    assert (sp.schedule, sp.wire, sp.clip, sp.shard) == ("dear", "fp16", 1.0, True)
    assert M.parse_strategy("pipedap-optimal@shard@margin5").shard
    assert "pipedap-optimal@shard" in M.valid_strategies()
    assert "pipedap-optimal@shard" not in M.all_strategies()  # run when named, as the other suffixes
    assert M.uncompressed_name("pipedap-optimal@fp16@shard") == "pipedap-optimal@shard"
    assert M.parse_strategies("ddp,pipedap-optimal@shard") == ["ddp", "pipedap-optimal@shard"]


@pytest.mark.parametrize("name, message", [
    ("pipedap-optimal@shard@shard", r"bad suffix '@shard' in strategy 'pipedap-optimal@shard@shard'; valid: .*@shard"),
    ("pipedap-optimal@sharded", r"bad suffix '@sharded' .*@part<MiB> with MiB > 0, @shard, @clip<max_norm>"),
    ("pipedap-optimal+fp16@shard", r"'pipedap-optimal\+fp16@shard': @shard needs an uncompressed pipedap variant"),
    ("pipedap-optimal@part1@shard", r"@shard and @part<MiB> exclude each other"),
    ("ddp@shard", r"'ddp' takes no suffix but @clip<max_norm>"),
    ("fsdp2@shard", r"'fsdp2' takes no suffix"),
])
def test_shard_suffix_errors_name_the_bad_part(name, message):
    with pytest.raises(ValueError, match=message):
        M.parse_strategy(name)


def test_shard_suffix_builds_a_sharded_strategy():
    import lightning_pipedap.bench.matrix.worker as W

    assert W._make_strategy(dict(timeline=False), "pipedap-optimal@shard", 2, None).config.shard_optimizer is True
    assert W._make_strategy(dict(timeline=False), "pipedap-optimal", 2, None).config.shard_optimizer is False


def test_bad_names_and_optimizers_exit_naming_the_choices(capsys):
    for argv, message in ((["--strategies", "pipedap-optimal+topk@shard"], "@shard needs an uncompressed"),
                          (["--optimizer", "lamb"], "unknown optimizer 'lamb'; valid: sgd, adam")):
        with pytest.raises(SystemExit) as e:
            M.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_list_names_the_shard_suffix_and_the_optimizers(capsys):
    from lightning_pipedap.bench.matrix.driver import print_list

    print_list(M.DEFAULT_COMPRESSORS)
    out = capsys.readouterr().out
    assert "pipedap-optimal@shard" in out and "@shard: shard_optimizer=True" in out
    assert "optimizers (--optimizer): sgd, adam (default sgd)" in out


# ----------------------------------------------------------------------------- --optimizer reaches the module
def _opt(module) -> torch.optim.Optimizer:
    return module.configure_optimizers()


def test_optimizer_choice_builds_the_named_optimizer():
    sgd = _opt(M.make_module("mlp", "tiny"))
    assert type(sgd) is torch.optim.SGD and sgd.defaults["lr"] == 0.01 and sgd.defaults["momentum"] == 0.9
    adam = _opt(M.make_module("mlp", "tiny", optimizer="adam"))
    assert type(adam) is torch.optim.Adam and adam.defaults["lr"] == 1e-3
    assert _opt(M.make_module("mlp", "tiny", lr=0.5, optimizer="adam")).defaults["lr"] == 0.5
    # every parameter of the net is stepped (the replay model too: its step is over real parameters)
    opts = dict(profile="resnet50", size_scale=0.001, time_scale=0.001)
    module = M.make_module("replay", "bench", options=opts, optimizer="adam")
    params = [p for g in _opt(module).param_groups for p in g["params"]]
    assert len(params) == len(list(module.net.parameters())) > 1
    with pytest.raises(ValueError, match=r"unknown optimizer 'adamw'; valid: sgd, adam"):
        M.make_module("mlp", "tiny", optimizer="adamw")


def test_optimizer_flag_reaches_the_worker_spec_and_the_fitted_module(monkeypatch):
    import lightning_pipedap.bench.matrix.driver as D
    import lightning_pipedap.bench.matrix.worker as W

    args = M.parse_args(["--optimizer", "adam", "--strategies", "ddp", "--size", "tiny"])
    spec = D.worker_spec("mlp", "none", args)
    assert spec["optimizer"] == "adam"
    assert D.worker_spec("mlp", "none", M.parse_args(["--size", "tiny"]))["optimizer"] == "sgd"

    made = []

    class FakeTrainer:
        def __init__(self, **kw):
            pass

        def fit(self, module, loader):
            made.append(type(module.configure_optimizers()).__name__)

    monkeypatch.setattr(W.pl, "Trainer", FakeTrainer)
    W._fit(dict(spec, watts=10.0), "ddp", None, 1, {"devices": 1})
    W._fit(dict(spec, watts=10.0, optimizer="sgd"), "ddp", None, 1, {"devices": 1})
    assert made == ["Adam", "SGD"]


def test_replay_cli_passes_the_optimizer_through(capsys):
    from lightning_pipedap.bench.replay import cli
    from lightning_pipedap.bench.replay.cells import plan_cell

    args = cli.parse_args(["--optimizer", "adam", "--profiles", "resnet50",
                           "--strategies", "ddp,pipedap-optimal,pipedap-optimal@shard"])
    assert args.optimizer == "adam" and args.strategies[-1] == "pipedap-optimal@shard"
    margs = cli.matrix_args(args, plan_cell("resnet50", 2, "1gbit", 5.0))
    assert margs.optimizer == "adam"
    from lightning_pipedap.bench.matrix.driver import worker_spec

    assert worker_spec("replay", "1gbit", margs)["optimizer"] == "adam"
    assert cli.parse_args(["--profiles", "resnet50"]).optimizer == "sgd"
    with pytest.raises(SystemExit):
        cli.parse_args(["--optimizer", "lbfgs"])
    assert "unknown optimizer 'lbfgs'; valid: sgd, adam" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the sharded prediction
def _planner_inputs(n_layers: int = 6):
    from lightning_pipedap.plan import CostModel
    from lightning_pipedap.plan.profile import LayerProfile, ModelProfile

    layers = tuple(LayerProfile.from_numel(f"l{i}", 250_000 * (1 + i % 3), 4, 0.004, 0.008) for i in range(n_layers))
    profile = ModelProfile("toy", layers, t_update=0.06)
    params = [torch.zeros(layer.nbytes // 4) for layer in layers]
    # (the strategy's measured α-β model carries its world size, which the sharded model divides the update by)
    return profile, CostModel.from_allreduce(1e-3, 8e-9, meta={"world_size": 2}), params, [[i] for i in range(n_layers)]


def test_sharded_candidates_keep_the_sharded_steps_prediction():
    # shard_optimizer=True: the trial candidates are planned unsharded (several fusions), but the engine runs each
    # sharded, so the prediction each carries (what the strategy reports as predicted_iteration_s) is the sharded one
    from lightning_pipedap import PipeDAPStrategy
    from lightning_pipedap.plan.simulator import simulate
    from lightning_pipedap.strategy.candidates import CandidatePlanner

    profile, cm, params, layers = _planner_inputs()
    for shard in (True, False):
        cfg = PipeDAPStrategy(schedule="optimal", plan_trials=3, shard_optimizer=shard).config
        planner = CandidatePlanner(cfg, cm, None, 2, None, lambda _m: None, None)
        candidates, _, _ = planner.build(profile, params, layers, 1)
        assert len(candidates) >= 2
        for c in candidates:
            want = simulate(profile, cm, c, sharded=shard).iteration_s
            assert c.predicted_iteration_s == pytest.approx(want, rel=1e-9), (shard, c.name)
    # the model differs: the sharded step takes 1/N of the update off the compute stream
    c0 = candidates[0]
    assert simulate(profile, cm, c0, sharded=True).iteration_s != pytest.approx(
        simulate(profile, cm, c0, sharded=False).iteration_s, rel=1e-3)


# ----------------------------------------------------------------------------- testbed smoke run
def test_tiny_sharded_adam_cell_on_the_testbed(tmp_path):
    from lightning_pipedap.testbed import testbed_available

    ok, why = testbed_available()
    if not ok:
        pytest.skip(why)
    out_json = tmp_path / "r.json"
    # pipedap-pipedap: one candidate (no measured selection), so the sharded plan is what runs
    cmd = [sys.executable, "-m", "lightning_pipedap.bench.matrix", "--size", "tiny", "--links", "none", "--ranks", "2",
           "--optimizer", "adam", "--strategies", "ddp,pipedap-pipedap@shard", "--steps", "2", "--warmup", "5",
           "--json", str(out_json)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out_json.read_text())
    assert data["meta"]["optimizer"] == "adam"
    (cell,) = data["cells"]
    ddp, shard = cell["variants"]
    assert (ddp["name"], shard["name"]) == ("ddp", "pipedap-pipedap@shard")
    assert ddp["optimizer"] == shard["optimizer"] == "Adam"
    assert shard["installed"] == "pipedap" and shard["predicted_s"] > 0
    # the prediction judged is the strategy's own: the sharded simulation of the installed plan, contention-aware
    # when the contention was measured (as an unsharded plan's)
    pred = shard["predictions"]["pipedap"]
    assert shard["predicted_s"] == pytest.approx(pred.get("contended_s", pred["calibrated_s"]), rel=1e-9)


def test_replay_analysis_marks_a_variant_that_ran_ddps_reducer():
    # a @shard variant whose measured selection installed torch_ddp ran no sharded step: its time and prediction
    # are DDP's reducer's, and the tables say so
    from lightning_pipedap.bench.replay.analysis import judge, variants_table
    from lightning_pipedap.bench.replay.cells import plan_cell

    setup = plan_cell("resnet50", 2, "1gbit", 5.0)
    result = M.CellResult("resnet50", setup.rate, 2, 1.0, 8, 0.5, 0.4, 0.45, 0.01, variants=[
        M.VariantResult("ddp", 0.6, 8),
        M.VariantResult("pipedap-optimal@shard", 0.5, 8, predicted_s=0.55, installed="torch_ddp"),
        M.VariantResult("pipedap-optimal", 0.5, 8, predicted_s=0.45, installed="optimal")])
    verdict = judge(setup, result)
    shard, plain = verdict.variant("pipedap-optimal@shard"), verdict.variant("pipedap-optimal")
    assert shard.note == " (torch_ddp: DDP's reducer)" and plain.note == ""
    assert shard.sim_error == pytest.approx(0.1) and plain.sim_error == pytest.approx(-0.1)
    table = variants_table([verdict])
    assert "| pipedap-optimal@shard (torch_ddp: DDP's reducer) | 500 |" in table
    assert "| pipedap-optimal | 500 |" in table
