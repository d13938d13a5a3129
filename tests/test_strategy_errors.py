"""Registration, bad input and no-hang behaviour of the strategy and the engine."""

import time
from datetime import timedelta

import pytest
import torch

import lightning.pytorch as pl
from lightning.pytorch.strategies import StrategyRegistry

import lightning_pipedap
from lightning_pipedap import PipeDAPStrategy
from tests._dist_util import run_ranks


def test_import_registers_names_idempotently():
    lightning_pipedap.register()
    lightning_pipedap.register()
    assert StrategyRegistry["pipedap"]["strategy"] is PipeDAPStrategy
    assert StrategyRegistry["pipedap_spawn"]["init_params"] == {"start_method": "spawn"}
    assert "reduce-scatter" in StrategyRegistry["pipedap"]["description"]
    t = pl.Trainer(strategy="pipedap", accelerator="cpu", devices=2, logger=False)
    assert isinstance(t.strategy, PipeDAPStrategy) and t.strategy.world_size == 2


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        ({"schedule": "fastest"}, ValueError, r"unknown schedule 'fastest'; valid: allreduce, dear"),
        ({"bucket_cap_mb": -1}, ValueError, r"bucket_cap_mb must be a positive number, got -1"),
        ({"wait_timeout_s": 0}, ValueError, r"wait_timeout_s must be a positive number"),
        ({"warmup_steps": 0}, ValueError, r"warmup_steps must be an integer >= 1, got 0"),
        ({"ddp_comm_hook": print}, TypeError, r"unsupported keyword arguments \['ddp_comm_hook'\]"),
        ({"find_unused_parameters": "yes"}, ValueError, r"find_unused_parameters must be None .* got 'yes'"),
        ({"train_thread_nice": 25}, ValueError, r"train_thread_nice must be an integer in 0\.\.19 \(0 = off\), got 25"),
        ({"plan_trials": 0}, ValueError, r"plan_trials must be an integer >= 1 or None .*, got 0"),
        ({"torch_ddp_margin": 1.0}, ValueError, r"torch_ddp_margin must be a fraction in \[0, 1\) .*got 1\.0"),
        ({"torch_ddp_margin": "5%"}, ValueError, r"torch_ddp_margin must be a fraction in \[0, 1\) .*got '5%'"),
        ({"calibrate_cost_model": "yes"}, ValueError, r"calibrate_cost_model must be True or False, got 'yes'"),
        ({"model_contention": 1}, ValueError, r"model_contention must be True or False, got 1"),
        ({"gradient_as_bucket_view": "true"}, ValueError, r"gradient_as_bucket_view must be True or False, got 'true'"),
        ({"compression_mode": "thread"}, ValueError, r"need a compression method"),
        ({"trial_steps": True}, ValueError, r"trial_steps must be an integer >= 1, got True"),
        ({"cost_model": "/nonexistent/cm.json"}, ValueError, r"cost_model='/nonexistent/cm.json': no such file"),
        ({"plan_cache": 1}, ValueError, r"plan_cache must be True \(remember selected plans in the default directory"),
        ({"plan_cache": ""}, ValueError, r"plan_cache must be True .* or a directory path, got ''"),
        ({"nonfinite": "zero"}, ValueError, r"nonfinite must be one of 'warn', 'raise', 'skip', 'ignore', got 'zero'"),
        ({"check_params_every_n_steps": -3}, ValueError,
         r"check_params_every_n_steps must be an integer >= 1 or None \(off\), got -3"),
        ({"timeout": "5"}, TypeError, r"timeout='5' \(str\) is not accepted; valid: None .*datetime\.timedelta, "
                                      r"or a number of seconds"),
        ({"timeout": True}, TypeError, r"timeout=True \(bool\) is not accepted"),
        ({"timeout": 0}, ValueError, r"timeout=0 must be a finite number of seconds > 0"),
        ({"timeout": timedelta(seconds=-1)}, ValueError, r"must be positive"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, err, match):
    with pytest.raises(err, match=match):
        PipeDAPStrategy(**kwargs)


@pytest.mark.parametrize("timeout,seconds", [(5, 5.0), (2.5, 2.5), (timedelta(minutes=2), 120.0), (None, 42.0)])
def test_timeout_seconds_or_timedelta_becomes_the_group_timeout(timeout, seconds):
    """A number of seconds is converted at construction (it used to reach torch's init_process_group
    unconverted and fail there with a TypeError); None takes wait_timeout_s."""
    s = PipeDAPStrategy(timeout=timeout, wait_timeout_s=42)
    assert s._timeout == timedelta(seconds=seconds)
    f = lightning_pipedap.PipeDAPFabricStrategy(timeout=timeout, wait_timeout_s=42)
    assert f._timeout == timedelta(seconds=seconds)
    with pytest.raises(TypeError, match=r"PipeDAPFabricStrategy: timeout=\[5\] \(list\) is not accepted"):
        lightning_pipedap.PipeDAPFabricStrategy(timeout=[5])


class _Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


def _fit_one_process(strategy):
    import torch.distributed as dist

    pl.seed_everything(3, verbose=False)
    model = _Regression()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, max_epochs=2,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    try:
        trainer.fit(model)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return trainer, [p.detach().clone() for p in model.parameters()]


def test_one_process_trains_as_ddp_does_bit_for_bit(caplog):
    """``devices=1`` used to be refused ('needs at least 2 processes') where strategy='ddp' runs: it runs, with no
    engine and no trials, says once that there is nothing to synchronise, and equals DDP's one process exactly."""
    import logging

    _, ddp = _fit_one_process("ddp")
    with caplog.at_level(logging.INFO, logger="lightning_pipedap"):
        trainer, ours = _fit_one_process("pipedap")
    for a, b in zip(ddp, ours):
        assert torch.equal(a, b)
    said = [r.getMessage() for r in caplog.records if r.name == "lightning_pipedap"]
    assert [m for m in said if "nothing to synchronise" in m] == [
        "pipedap: one process: nothing to synchronise; training runs without communication (no engine, no plan, no "
        "trials), as strategy='ddp' does with one process (schedule 'optimal' not used)"], said
    strategy = trainer.strategy
    assert isinstance(strategy, PipeDAPStrategy) and strategy.single_process
    assert strategy._last is None and strategy.trial_results == [] and strategy.startup == {}
    assert not [m for m in said if "schedule" in m and "nothing to synchronise" not in m]  # no plan, no trials
    assert strategy.what_ran()["single_process"] is True and strategy.what_ran()["installed"] is None


def _stalled_peer(rank, world):
    """Rank 1 never joins the round: rank 0 must get a clear timeout error, not hang."""
    from lightning_pipedap.engine import collectives as C
    from lightning_pipedap.engine.engine import CommEngine, EngineError
    from lightning_pipedap.schedule import builtin_schedule

    comm = C.new_comm_group(timeout_s=3)
    params = [torch.zeros(10)]
    engine = CommEngine(comm, params, builtin_schedule("dear", [40], 1 << 20), wait_timeout_s=3)
    if rank == 1:
        time.sleep(8)
        return "idle"
    t0 = time.monotonic()
    engine.begin_iteration()
    engine.grad_ready(0, torch.ones(10))
    try:
        engine.wait_done(0)
    except EngineError as exc:
        return (str(exc), time.monotonic() - t0)
    return ("no error", time.monotonic() - t0)


@pytest.mark.multiprocess
def test_stalled_peer_raises_instead_of_hanging():
    res = run_ranks(_stalled_peer, 2, timeout_s=60)
    msg, took = res[0]
    assert "bucket 0" in msg or "communication worker failed" in msg, msg
    assert took < 30


class _NoTrainable(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.lin.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        return self.lin(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 2)), batch_size=2)


@pytest.mark.multiprocess
def test_model_without_trainable_parameters_is_rejected():
    trainer = pl.Trainer(strategy="pipedap_spawn", accelerator="cpu", devices=2, logger=False, max_steps=1,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with pytest.raises(Exception, match="no trainable parameters"):
        trainer.fit(_NoTrainable())


def test_options_that_do_not_apply_are_named():
    from lightning_pipedap.strategy.config import PipeDAPConfig as Config

    assert Config().ignored_options() == [] and Config(schedule="dear").ignored_options() == []
    (fixed,) = Config(schedule="dear", plan_trials=2, trial_rounds=3).ignored_options()
    assert fixed.startswith("pipedap: plan_trials=2, trial_rounds=3 not used: schedule 'dear' is fixed, and measured "
                            "plan selection runs only for the planned schedules (") and "optimal" in fixed
    (wire,) = Config(wire_dtype="bf16").ignored_options()
    assert wire == ("pipedap: torch_ddp_candidate=True not used: the torch_ddp candidate (DDP's reducer) is not "
                    "trialled with wire_dtype='bf16' (DDP's reducer sends fp32: set wire_dtype='fp32' to measure it)")
    assert Config(wire_dtype="bf16", torch_ddp_candidate=False).ignored_options() == []
    assert Config(wire_dtype="bf16", plan_trials=1).ignored_options() == []  # (no trial at all)
    assert Config(torch_ddp_margin=0.05).ignored_options() == []
    (margin,) = Config(torch_ddp_margin=0.05, torch_ddp_candidate=False).ignored_options()
    assert margin == ("pipedap: torch_ddp_margin=0.05 not used: the torch_ddp candidate is not trialled here "
                      "(torch_ddp_candidate=False)")
    (fixed,) = Config(torch_ddp_margin=0.05, schedule="dear", wire_dtype="bf16").ignored_options()
    assert fixed.endswith("not trialled here (schedule 'dear' is fixed, wire_dtype='bf16')")


def test_a_fit_logs_the_options_that_do_not_apply_and_the_warmup_schedule_once():
    """The run-time of a fit (here in a one-process gloo group) logs them when it starts, once; the warm-up
    schedule's line is not repeated when the profiling steps install it again."""
    import torch.distributed as dist

    from lightning_pipedap.strategy.config import PipeDAPConfig
    from lightning_pipedap.strategy.planning import Measured
    from lightning_pipedap.strategy.resume import ResumeState
    from lightning_pipedap.strategy.runtime import Runtime

    import lightning_pipedap.engine.collectives as C

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        said: list[str] = []
        cfg = PipeDAPConfig(wire_dtype="fp16")
        comm = C.new_comm_group(cfg.wait_timeout_s, int(cfg.ring_chunk_mb * 2**20))
        rt = Runtime(cfg, torch.nn.Linear(2, 2), lambda: [], comm, 1, 0, torch.device("cpu"), Measured(),
                     ResumeState(), said.append, said.append, {}, [], lambda: False)
        # the set-up's warm-up schedule, then the profiling steps re-install the same one: said once
        rt.install_warmup()
        rt.install([0, 1], rt.builtin([0, 1], "allreduce"), [None, None])
        assert rt.running_schedule == "allreduce" and rt.final_schedule is None
        rt.close()
    finally:
        dist.destroy_process_group()
    assert [m for m in said if "not used" in m] == [PipeDAPConfig(wire_dtype="fp16").ignored_options()[0]]
    assert [m for m in said if "warm-up schedule" in m] == [
        "pipedap: warm-up schedule (sync mode, until the plan is ready) allreduce: 1 buckets: AR0"]


_NO_TRAINABLE_SCRIPT = """
import sys
import lightning.pytorch as pl
import lightning_pipedap  # noqa: F401
from tests.test_strategy_errors import _NoTrainable as NoTrainable

if __name__ == "__main__":
    pl.Trainer(strategy=sys.argv[1], accelerator="cpu", devices=2, logger=False, max_steps=1, enable_progress_bar=False,
               enable_model_summary=False, enable_checkpointing=False).fit(NoTrainable())
"""


@pytest.mark.multiprocess
def test_an_error_is_printed_once_per_rank_as_under_ddp(tmp_path):
    """A model without trainable parameters on 2 ranks printed 4 tracebacks under pipedap (each rank's failure record
    with its traceback, then Python's) where DDP prints 2."""
    import os
    import subprocess
    import sys

    script = tmp_path / "no_trainable.py"
    script.write_text(_NO_TRAINABLE_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                           os.environ.get("PYTHONPATH", "")]))
    for k in ("LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "NODE_RANK", "RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(script), "pipedap"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "no trainable parameters" in out, out[-3000:]
    assert out.count("Traceback (most recent call last)") == 2, out  # one per rank, as DDP
    assert "failed; collectives of the default group are skipped" not in out
