"""Config composition and validation of the Hydra app (in-process, no training)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

from lightning_pipedap.app.launch import DIST_ENV_VARS, distributed_env, named_strategy_for, start_method_for
from lightning_pipedap.app.schema import ConfigError, validate
from lightning_pipedap.app.sweep import expand_sweep
from lightning_pipedap.app.train import CONFIG_PATH, strategy_label


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_default_config_is_digits_pipedap_on_two_cpu_processes():
    cfg = _compose()
    validate(cfg)
    assert cfg.model.net._target_ == "lightning_pipedap.models.DigitsCNN"
    assert cfg.data._target_ == "lightning_pipedap.data.DigitsDataModule"
    assert cfg.strategy._target_ == "lightning_pipedap.PipeDAPStrategy"
    assert cfg.strategy.schedule == "optimal"  # interpolated from the scheduler group
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.trainer.num_nodes) == ("cpu", 2, 1)
    assert strategy_label(cfg) == ("pipedap", "optimal")


def test_scheduler_group_sets_strategy_schedule():
    cfg = _compose("scheduler=allreduce")
    assert cfg.strategy.schedule == "allreduce"
    assert strategy_label(_compose("strategy=ddp")) == ("ddp", None)


@pytest.mark.parametrize("overrides, given, group", [
    (("scheduler=dear", "strategy.schedule=allreduce"), "allreduce", "dear"),
    (("strategy.schedule=dear",), "dear", "optimal"),  # the group's default, optimal, would be recorded
])
def test_strategy_schedule_conflicting_with_the_scheduler_group_is_an_error(overrides, given, group):
    """It used to run strategy.schedule while the config (and the sweep's duplicate key) kept the group's name."""
    cfg = _compose(*overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert (f"strategy.schedule={given!r} conflicts with scheduler={group!r}: the schedule comes from the "
            "scheduler group; choose it with scheduler=<name> (valid choices: allreduce, dear,") in str(e.value)
    validate(_compose("scheduler=dear", "strategy.schedule=dear"))  # the same value is no conflict
    validate(_compose("strategy=ddp", "scheduler=dear"))  # ddp has no schedule: the group does not apply


def test_unknown_group_option_names_valid_choices():
    with pytest.raises(MissingConfigException) as e:
        _compose("scheduler=foo")
    msg = str(e.value)
    assert "scheduler/foo" in msg
    for name in ("allreduce", "dear", "no_overlap", "wfbp", "dear_tuned", "pipedap", "optimal"):
        assert name in msg


def test_unknown_strategy_key_fails_at_compose():
    # the ddp schema has no bucket_cap_mb: a typo or a pipedap-only key is caught by the schema
    with pytest.raises(Exception, match="bucket_cap_mb"):
        _compose("strategy=ddp", "strategy.bucket_cap_mb=3")


def test_wrong_type_fails_at_compose():
    with pytest.raises(Exception, match="bucket_cap_mb"):
        _compose("strategy.bucket_cap_mb=abc")


@pytest.mark.parametrize("override, needle", [
    ("strategy.bucket_cap_mb=-1", "strategy: bucket_cap_mb must be a positive number, got -1.0"),
    ("strategy.bucket_cap_mb=0", "strategy: bucket_cap_mb must be a positive number, got 0.0"),
    ("strategy.wait_timeout_s=0", "strategy: wait_timeout_s"),
    ("strategy.warmup_steps=0", "strategy: warmup_steps must be an integer >= 1, got 0"),
    ("strategy.start_method=thread", "valid choices: popen, spawn, fork, forkserver"),
    ("strategy.schedule=nope", "strategy: unknown schedule 'nope'; valid: allreduce, dear"),
])
def test_bad_values_fail_validation_with_choices(override, needle):
    cfg = _compose(override)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert needle in str(e.value)


def test_schedule_choices_follow_the_installed_strategy():
    import lightning_pipedap

    for name in ("allreduce", "dear", "no_overlap", "wfbp", "dear_tuned", "pipedap", "optimal"):
        cfg = _compose(f"scheduler={name}")
        if name in lightning_pipedap.valid_schedule_names():
            validate(cfg)
        else:
            with pytest.raises(ConfigError, match=f"unknown schedule '{name}'"):
                validate(cfg)


def test_default_callbacks_exist_and_every_callback_config_resolves():
    cfg = _compose()
    targets = {k: v._target_ for k, v in cfg.callbacks.items()}
    assert "model_checkpoint" in targets
    for name, target in targets.items():
        mod, _, cls = target.rpartition(".")
        assert hasattr(importlib.import_module(mod), cls), f"callbacks.{name}: {target} does not exist"
    measure = importlib.import_module("lightning_pipedap.measure")
    for key, cls in (("speedup", "SpeedupMonitor"), ("energy", "EnergyMonitor"), ("comm_timeline", "CommTimeline")):
        assert (key in targets) == hasattr(measure, cls)


def test_every_experiment_composes_and_validates():
    exp_dir = os.path.join(CONFIG_PATH, "experiment")
    names = sorted(f[:-5] for f in os.listdir(exp_dir) if f.endswith(".yaml"))
    assert {"digits", "gpt_stdlib", "bert_stdlib", "resnet18_synthetic", "compare_schedules"} <= set(names)
    for name in names:
        cfg = _compose(f"experiment={name}")
        validate(cfg)
    cfg = _compose("experiment=resnet50_synthetic")
    assert cfg.model.net._target_.endswith("resnet50") and cfg.data._target_.endswith("SyntheticImagesDataModule")


def test_callbacks_none_builds_no_callbacks():
    from lightning_pipedap.app.train import _instantiate_group

    assert _instantiate_group(_compose("callbacks=none").get("callbacks")) == []


def test_trainer_and_logger_groups():
    cfg = _compose("trainer=multi_node", "logger=[tensorboard,csv]")
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.trainer.num_nodes) == ("gpu", 8, 2)
    assert set(cfg.logger) == {"tensorboard", "csv"}


def test_expand_sweep_matches_basic_sweeper_order():
    jobs = expand_sweep(["strategy=ddp,pipedap", "trainer.max_epochs=1", "scheduler=allreduce,dear"])
    assert jobs == [
        ["strategy=ddp", "trainer.max_epochs=1", "scheduler=allreduce"],
        ["strategy=ddp", "trainer.max_epochs=1", "scheduler=dear"],
        ["strategy=pipedap", "trainer.max_epochs=1", "scheduler=allreduce"],
        ["strategy=pipedap", "trainer.max_epochs=1", "scheduler=dear"],
    ]
    # hydra.sweeper.params come first; a command-line override of the same key replaces them
    assert expand_sweep(["seed=1"], {"seed": "3,4", "x": "range(2)"}) == [["seed=1", "x=0"], ["seed=1", "x=1"]]


def test_start_method_under_multirun():
    assert start_method_for("popen", multirun=True) == "spawn"
    assert start_method_for("popen", multirun=False) == "popen"
    assert start_method_for("fork", multirun=True) == "fork"
    assert named_strategy_for("ddp", multirun=True) == "ddp_spawn"
    assert named_strategy_for("auto", multirun=True) == "auto"


def test_distributed_env_sets_a_port_and_restores(monkeypatch):
    for k in DIST_ENV_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NODE_RANK", "0")
    with distributed_env() as info:
        assert os.environ["MASTER_PORT"] == str(info["master_port"]) and 1024 <= info["master_port"] <= 65535
        os.environ["LOCAL_RANK"] = "0"  # what Lightning's launcher leaves behind
        os.environ["NODE_RANK"] = "5"
    assert "MASTER_PORT" not in os.environ and "LOCAL_RANK" not in os.environ
    assert os.environ["NODE_RANK"] == "0"
    # started by an external launcher (torchrun, or Lightning's popen for rank > 0): no new port
    monkeypatch.setenv("LOCAL_RANK", "1")
    with distributed_env() as info:
        assert info["master_port"] is None and "MASTER_PORT" not in os.environ


def test_schema_types_the_strategy_node():
    cfg = _compose()
    obj = OmegaConf.to_object(cfg.strategy)
    assert type(obj).__name__ == "PipeDAPStrategyConf" and obj.bucket_cap_mb == 25.0


def test_strategy_node_has_the_planning_options():
    """plan_trials, trial_steps, model_contention, calibrate_cost_model, train_thread_nice are schema keys
    (no '+strategy.X=' needed), typed and range-checked before anything launches."""
    obj = OmegaConf.to_object(_compose("strategy.plan_trials=2", "strategy.model_contention=false").strategy)
    assert (obj.plan_trials, obj.trial_steps, obj.model_contention, obj.calibrate_cost_model, obj.train_thread_nice) \
        == (2, 3, False, True, 0)
    for bad, match in (("strategy.plan_trials=0", "strategy: plan_trials must be an integer >= 1 or None .*, got 0"),
                       ("strategy.train_thread_nice=25", r"strategy: train_thread_nice must be an integer in 0\.\.19")):
        with pytest.raises(ConfigError, match=match):
            validate(_compose(bad))


def test_strategy_node_takes_plan_cache_as_a_bool_or_a_directory(tmp_path):
    for value, expected in (("false", False), ("true", True), (str(tmp_path / "plans"), str(tmp_path / "plans"))):
        obj = OmegaConf.to_object(_compose(f"strategy.plan_cache={value}").strategy)
        assert obj.plan_cache == expected
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"strategy: plan_cache=.* is a file; give a directory"):
        validate(_compose(f"strategy.plan_cache={tmp_path / 'f'}"))
    with pytest.raises(ConfigError, match=r"strategy: plan_cache must be True .* got 3"):
        validate(_compose("strategy.plan_cache=3"))


def test_schema_has_every_strategy_option_with_the_same_default():
    """The Hydra schema is generated from ``PipeDAPConfig``'s fields: every option a YAML value can hold, with its
    default."""
    import dataclasses

    from lightning_pipedap.app.schema import PipeDAPStrategyConf
    from lightning_pipedap.strategy.config import PipeDAPConfig

    schema = {f.name: f for f in dataclasses.fields(PipeDAPStrategyConf)}
    options = set(PipeDAPConfig.option_names()) - {"deferrable_optimizers"}  # (classes: not a config value)
    assert set(schema) - {"_target_", "start_method", "process_group_backend"} == options
    for name, mine in PipeDAPConfig.defaults().items():
        if name in schema:
            f = schema[name]
            assert (f.default_factory() if f.default is dataclasses.MISSING else f.default) == mine, name


def test_strategy_yaml_lists_every_schema_key_with_the_option_default():
    """``conf/strategy/pipedap.yaml`` is hand-written (its comments); it must set every key of the schema, each
    literal value equal to the option's default (``${...}`` interpolations aside), so that adding, removing or
    re-defaulting an option fails here until the YAML follows."""
    import dataclasses

    import yaml

    from lightning_pipedap.app.schema import PipeDAPStrategyConf

    text = (Path(CONFIG_PATH) / "strategy" / "pipedap.yaml").read_text()
    values = {k: v for k, v in yaml.safe_load(text).items() if k != "defaults"}
    schema = {f.name: f for f in dataclasses.fields(PipeDAPStrategyConf)}
    assert set(values) == set(schema), (f"pipedap.yaml lacks {sorted(set(schema) - set(values))}, "
                                        f"names no option {sorted(set(values) - set(schema))}")
    for name, value in values.items():
        if isinstance(value, str) and value.startswith("${"):
            continue
        f = schema[name]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert value == default and type(value) is type(default), (name, value, default)


@pytest.mark.parametrize("strategy", ["ddp", "auto"])
def test_compression_with_a_strategy_that_does_not_compress_is_refused(strategy):
    cfg = _compose(f"strategy={strategy}", "compression=powersgd")
    with pytest.raises(ConfigError, match="compression=powersgd applies to strategy=pipedap only"):
        validate(cfg)
    validate(_compose(f"strategy={strategy}"))  # compression=none (the default) is fine
    validate(_compose("compression=powersgd"))  # and so is compression with pipedap
