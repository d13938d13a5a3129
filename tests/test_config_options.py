"""Options declared once: ``PipeDAPConfig``'s groups are the only declaration; the flat access, the strategies'
keyword arguments and LightningCLI's view derive from them (the Hydra schema and YAML: tests/test_app_config.py,
docs/OPTIONS.md: tests/test_readme.py). In-process, no training."""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing

import pytest

from lightning_pipedap import PipeDAPFabricStrategy, PipeDAPStrategy
from lightning_pipedap.strategy.config import (OPTION_GROUP, PipeDAPConfig, ScheduleOptions, TrialOptions,
                                               build_config)
from lightning_pipedap.strategy.fabric import _TRAINER_ONLY

#: a value other than the default for each option (None: the option takes no cheap non-default value here)
CHANGED = {"schedule": "dear", "bucket_cap_mb": 4.0, "defer_update": True, "shard_optimizer": True, "warmup_steps": 2,
           "sharded_checkpoint": True,
           "ring_chunk_mb": 1.0,
           "deferrable_optimizers": (), "wire_dtype": "bf16", "gradient_as_bucket_view": True, "train_thread_nice": 3,
           "profile_steps": 2, "cost_model": None, "cost_model_cache": False, "calibrate_cost_model": False,
           "model_contention": False, "partition_mb": 4.0, "plan_cache": False, "replan_margin": 0.3,
           "replan_every": 10, "max_replans": 0, "plan_trials": 2, "trial_steps": 5, "trial_rounds": 3,
           "trial_window_s": 0.5, "startup_budget": None, "torch_ddp_candidate": False, "torch_ddp_margin": 0.05,
           "find_unused_parameters": False, "compression": None, "compression_kwargs": {},
           "compression_mode": "process", "compression_threads": 2, "wait_timeout_s": 60.0, "nonfinite": "skip",
           "check_params_every_n_steps": 7}


def _explicit(cls: type) -> list[str]:
    """The options ``cls.__init__`` names in its signature."""
    return [n for n in inspect.signature(cls.__init__).parameters if n in OPTION_GROUP]


def test_each_option_is_declared_once_in_one_group():
    names = [f.name for _, f in PipeDAPConfig.option_fields()]
    assert len(names) == len(set(names)) == len(OPTION_GROUP) and set(CHANGED) == set(names)
    assert not set(names) & set(PipeDAPConfig.groups()), "an option named like a group"
    assert list(PipeDAPConfig.groups()) == ["scheduling", "planning", "trials", "gradient_compression", "safety"]


def test_flat_read_access_is_the_group_field_and_read_only():
    cfg = PipeDAPConfig(**CHANGED)
    for name, group in OPTION_GROUP.items():
        assert getattr(cfg, name) == getattr(getattr(cfg, group), name) == CHANGED[name], name
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bucket_cap_mb = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.scheduling.bucket_cap_mb = 1.0  # type: ignore[misc]


def test_groups_names_and_replace_build_the_same_config():
    by_name = PipeDAPConfig(schedule="dear", bucket_cap_mb=4, torch_ddp_margin=0.05, nonfinite="skip")
    by_group = PipeDAPConfig(scheduling=ScheduleOptions(schedule="dear", bucket_cap_mb=4.0),
                             trials=TrialOptions(torch_ddp_margin=0.05), nonfinite="skip")
    assert by_name == by_group == PipeDAPConfig().replace(schedule="dear", bucket_cap_mb=4, torch_ddp_margin=0.05,
                                                          nonfinite="skip")
    assert PipeDAPConfig(**by_name.options()) == by_name
    assert dataclasses.replace(by_name, trials=TrialOptions()).torch_ddp_margin == 0.10
    with pytest.raises(TypeError, match=r"unknown options \['bucket_cap'\]; valid: schedule, bucket_cap_mb"):
        PipeDAPConfig(bucket_cap=4)
    with pytest.raises(TypeError, match="trials must be a TrialOptions or None"):
        PipeDAPConfig(trials=ScheduleOptions())


def test_plan_trials_is_resolved_from_the_schedule_without_going_stale():
    assert PipeDAPConfig().trials.plan_trials is None and PipeDAPConfig().plan_trials == 4
    assert PipeDAPConfig(schedule="pipedap").plan_trials == 1 and PipeDAPConfig(schedule="dear").plan_trials is None
    assert PipeDAPConfig().replace(schedule="dear").plan_trials is None  # (not the 4 resolved for "optimal")
    assert PipeDAPConfig(plan_trials=2, schedule="wfbp").plan_trials == 2
    assert dict(PipeDAPConfig().signature())["plan_trials"] == "4"


def test_validation_lives_with_the_group():
    with pytest.raises(ValueError, match=r"torch_ddp_margin must be a fraction in \[0, 1\)"):
        TrialOptions(torch_ddp_margin=1.0)
    with pytest.raises(ValueError, match="unknown schedule 'fastest'; valid: allreduce, dear"):
        ScheduleOptions(schedule="fastest")
    with pytest.raises(ValueError, match="wire_dtype='fp16' and compression='topk' exclude each other"):
        PipeDAPConfig(wire_dtype="fp16", compression="topk")


@pytest.mark.parametrize("cls", [PipeDAPStrategy, PipeDAPFabricStrategy])
def test_explicit_parameters_are_the_config_fields(cls):
    """Each option a strategy names in its signature has its field's type and default (LightningCLI and IDEs read
    the signature); ``config`` comes first, the rest are keyword-only."""
    params = inspect.signature(cls.__init__).parameters
    hints = typing.get_type_hints(cls.__init__)
    defaults = PipeDAPConfig.defaults()
    assert list(params)[1] == "config" and params["config"].default is None
    common = {"schedule", "bucket_cap_mb", "defer_update", "wire_dtype", "plan_trials", "plan_cache"}
    assert common <= set(_explicit(cls))
    for name in _explicit(cls):
        group = PipeDAPConfig.groups()[OPTION_GROUP[name]]
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert params[name].default == defaults[name], name
        assert hints[name] == typing.get_type_hints(group)[name], name


def test_trainer_strategy_takes_every_option_by_keyword():
    s = PipeDAPStrategy(**CHANGED)
    assert s.config == PipeDAPConfig(**CHANGED)
    assert {n: getattr(s, n) for n in CHANGED} == CHANGED  # (strategy.<option> reads the config)
    assert PipeDAPStrategy(schedule="dear", bucket_cap_mb=0.02, torch_ddp_margin=0.99).config.torch_ddp_margin == 0.99


def test_keywords_apply_over_a_config():
    base = PipeDAPConfig(schedule="dear", bucket_cap_mb=4, torch_ddp_margin=0.05)
    s = PipeDAPStrategy(config=base, wire_dtype="bf16", nonfinite="skip")
    assert (s.config.schedule, s.config.bucket_cap_mb, s.config.torch_ddp_margin) == ("dear", 4.0, 0.05)
    assert (s.config.wire_dtype, s.config.nonfinite) == ("bf16", "skip")
    assert PipeDAPStrategy(config=base).config is base
    assert PipeDAPStrategy(config=base, schedule="optimal").config.schedule == "dear"  # (a keyword at its default)
    assert build_config(base, {"bucket_cap_mb": 25}, {}).bucket_cap_mb == 25.0  # (an int is not the float default)
    with pytest.raises(TypeError, match=r"config must be a PipeDAPConfig or None, got 'dear' \(str\)"):
        PipeDAPStrategy("dear")


def test_unknown_keywords_are_refused_naming_every_valid_option():
    with pytest.raises(TypeError, match=r"\['bucket_cap'\] \(bucket_cap: unknown argument; did you mean "
                                        r"'bucket_cap_mb'\?\); valid arguments: config, schedule") as err:
        PipeDAPStrategy(bucket_cap=1)
    valid = str(err.value).split("valid arguments: ")[1].split(", ")
    assert set(OPTION_GROUP) <= set(valid) and "start_method" in valid and "options" not in valid
    with pytest.raises(TypeError, match=r"torch_ddp_margin: an option of the Trainer strategy") as err:
        PipeDAPFabricStrategy(torch_ddp_margin=0.05)
    valid = str(err.value).split("valid arguments: ")[1].split(", ")
    assert set(valid) & set(OPTION_GROUP) == set(OPTION_GROUP) - set(_TRAINER_ONLY)


def test_fabric_takes_its_options_by_keyword_or_config():
    fabric_options = {k: v for k, v in CHANGED.items() if k not in _TRAINER_ONLY}
    fabric_options["defer_update"] = False  # (Fabric's only value other than the default)
    assert PipeDAPFabricStrategy(**fabric_options).config == PipeDAPConfig(**fabric_options)
    s = PipeDAPFabricStrategy(config=PipeDAPConfig(schedule="dear", trial_steps=5), bucket_cap_mb=2)
    assert (s.config.schedule, s.config.trial_steps, s.config.bucket_cap_mb) == ("dear", 5, 2.0)
    for bad, match in (({"nonfinite": "raise"}, "config sets nonfinite='raise': an option of the Trainer strategy"),
                       ({"defer_update": True}, "defer_update=True is not supported under Fabric"),
                       ({"compression": "fp16"}, "compression='fp16' is not supported under Fabric")):
        with pytest.raises(ValueError, match=match):
            PipeDAPFabricStrategy(config=PipeDAPConfig(**bad))


def test_lightning_cli_reads_the_signature_and_the_config_groups(monkeypatch):
    """LightningCLI (jsonargparse) resolves the explicit options and the nested config groups (no process is
    started: ``run=False``)."""
    pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse (pip install -e '.[dev]')")
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    monkeypatch.setattr(sys, "argv", ["cli"])  # (pytest's own arguments are not the CLI's)
    cli = LightningCLI(BoringModel, BoringDataModule, run=False, save_config_callback=None, args=[
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.logger=false",
        "--trainer.strategy=lightning_pipedap.PipeDAPStrategy", "--trainer.strategy.schedule=dear",
        "--trainer.strategy.bucket_cap_mb=1", "--trainer.strategy.config.trials.torch_ddp_margin=0.05",
        "--trainer.strategy.config.safety.nonfinite=skip"])
    cfg = cli.trainer.strategy.config
    assert (cfg.schedule, cfg.bucket_cap_mb, cfg.torch_ddp_margin, cfg.nonfinite) == ("dear", 1.0, 0.05, "skip")


def test_deferrable_optimizers_take_classes_or_dotted_names_and_refuse_the_rest():
    """Found by a new user: strings and numbers were accepted, then the fit crashed at set-up on every rank."""
    import pytest
    import torch

    from lightning_pipedap.strategy.config import PipeDAPConfig

    assert PipeDAPConfig(deferrable_optimizers=["torch.optim.SGD"]).deferrable_optimizers == (torch.optim.SGD,)
    assert PipeDAPConfig(deferrable_optimizers=(torch.optim.Adam,)).deferrable_optimizers == (torch.optim.Adam,)
    for bad, match in [([3], "3 is not a torch.optim.Optimizer subclass"),
                       (["torch.optim.NoSuchOpt"], "cannot import 'torch.optim.NoSuchOpt'"),
                       (["torch.nn.Linear"], "'torch.nn.Linear' is not a torch.optim.Optimizer subclass"),
                       (torch.optim.SGD, "must be a list"), ("torch.optim.SGD", "must be a list")]:
        with pytest.raises(ValueError, match=match):
            PipeDAPConfig(deferrable_optimizers=bad)


def test_an_infinite_size_is_refused():
    import pytest

    from lightning_pipedap.strategy.config import PipeDAPConfig

    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive finite number, got inf"):
        PipeDAPConfig(bucket_cap_mb=float("inf"))
