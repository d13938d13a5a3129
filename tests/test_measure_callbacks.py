"""EnergyMonitor, SpeedupMonitor and CommTimeline in a 1-process CPU Trainer with a tiny model.

Energy counters, clocks and the strategy's op timeline are fakes driven by the training loop, so
every logged value is known exactly.
"""

from __future__ import annotations

import csv
import json
import os
import warnings

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipedap.measure import CommTimeline, EnergyMonitor, SpeedupMonitor
from lightning_pipedap.measure.speedup import SETTLE_STEPS, steady_from_step
from lightning_pipedap.measure._common import batch_size_of
from lightning_pipedap.measure.summary import read_summary
from lightning_pipedap.measure.timeline import OpRecord

BATCH = 4


class Tiny(LightningModule):
    """Linear(4, 2); ``on_step(n)`` is called in every training_step with the number of steps done."""

    def __init__(self, on_step=None, clock=None):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.on_step = on_step
        self.clock = clock  # FakeClock advanced by the phases of a step (CommTimeline test)
        self.steps_done = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.steps_done += 1
        if self.on_step is not None:
            self.on_step(self.steps_done)
        if self.clock is not None:
            self.clock.advance(0.010)  # forward: 10 ms
            loss.register_hook(lambda g: self.clock.advance(0.020))  # backward: 20 ms
        return loss

    def on_before_optimizer_step(self, optimizer):  # runs after the callbacks' hook
        if self.clock is not None:
            self.clock.advance(0.002)  # update: 2 ms

    def on_train_batch_end(self, outputs, batch, batch_idx):  # runs after the callbacks' hook
        if self.clock is not None:
            self.clock.advance(0.008)  # idle until the next step: the step lasts 40 ms

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        ds = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g))
        return DataLoader(ds, batch_size=BATCH)


def make_trainer(tmp_path, callbacks, max_steps, logger="csv", strategy=None):
    lg = CSVLogger(str(tmp_path), name="run") if logger == "csv" else TensorBoardLogger(str(tmp_path), name="run")
    kw = {"strategy": strategy} if strategy is not None else {"devices": 1}
    return Trainer(accelerator="cpu", max_steps=max_steps, logger=lg, callbacks=callbacks,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, limit_val_batches=0, **kw)


def read_metrics(trainer):
    """metrics.csv as {column: [(step, value), ...]} for non-empty cells."""
    out: dict[str, list[tuple[int, float]]] = {}
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if k != "step" and v != "":
                    out.setdefault(k, []).append((int(row["step"]), float(v)))
    return out


def read_hparams(trainer):
    with open(os.path.join(trainer.logger.log_dir, "hparams.yaml")) as f:
        return f.read()


def values(metrics, key):
    return [v for _, v in metrics[key]]


# ------------------------------------------------------------------------------------------ energy
def patch_fake_nvml(monkeypatch, counter_mJ):
    """Make ``pynvml`` report ``counter_mJ()`` and EnergyMonitor see CUDA device 0."""
    import pynvml

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: ("handle", i))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetTotalEnergyConsumption", lambda h: counter_mJ())
    monkeypatch.setattr(EnergyMonitor, "_cuda_index", staticmethod(lambda trainer: 0))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_energy_monitor_logs_nvml_joules(tmp_path, monkeypatch):
    model = Tiny()
    # 2 J per training step on top of an arbitrary driver-lifetime total
    patch_fake_nvml(monkeypatch, lambda: 7_000_000 + 2000 * model.steps_done)
    mon = EnergyMonitor(window_steps=2, reference_J_per_sample=1.0)
    trainer = make_trainer(tmp_path, [mon], max_steps=6)
    trainer.fit(model)

    m = read_metrics(trainer)
    assert not [k for k in m if k.startswith("energy/estimated_")]
    assert values(m, "energy/measured_J_per_step") == pytest.approx([2.0, 2.0, 2.0])
    assert values(m, "energy/measured_J_per_sample") == pytest.approx([0.5, 0.5, 0.5])
    assert values(m, "energy/measured_saving_pct") == pytest.approx([50.0, 50.0, 50.0])
    assert values(m, "energy/measured_total_J") == pytest.approx([4.0, 8.0, 12.0, 12.0])
    assert [s for s, _ in m["energy/measured_J_per_step"]] == [2, 4, 6]
    assert all(v > 0 for v in values(m, "energy/measured_mean_W"))
    assert "energy_source: nvml:gpu0" in read_hparams(trainer)
    assert (mon.energy_source, mon.energy_kind, mon.total_J) == ("nvml:gpu0", "measured", pytest.approx(12.0))
    assert mon.state_dict()["energy_source"] == "nvml:gpu0"
    summary = read_summary(os.path.join(trainer.logger.log_dir, "measure_summary.json"))
    assert summary["energy_kind"] == "measured"
    assert summary["energy_J_per_sample"] == pytest.approx(0.5)
    assert summary["energy_J_per_step"] == pytest.approx(2.0)
    assert summary["energy_total_J"] == pytest.approx(12.0)


def test_energy_monitor_rapl_with_wrap_around(tmp_path, monkeypatch):
    root = tmp_path / "powercap"
    pkg, dram = root / "intel-rapl:0", root / "intel-rapl:0:1"
    for path, name, max_uj in ((pkg, "package-0", 10_000_000), (dram, "dram", 65_000_000)):
        os.makedirs(path)
        (path / "name").write_text(name)
        (path / "max_energy_range_uj").write_text(str(max_uj))

    def set_counters(steps_done):  # package +3 J/step, wraps every ~3 steps; dram +1 J/step
        (pkg / "energy_uj").write_text(str((5_000_000 + 3_000_000 * steps_done) % 10_000_000))
        (dram / "energy_uj").write_text(str(1_000_000 * (1 + steps_done)))

    set_counters(0)
    mon = EnergyMonitor(window_steps=3, rapl_root=str(root))
    trainer = make_trainer(tmp_path, [mon], max_steps=6)
    trainer.fit(Tiny(on_step=set_counters))

    m = read_metrics(trainer)
    assert not [k for k in m if k.startswith("energy/estimated_")]
    assert values(m, "energy/measured_J_per_step") == pytest.approx([4.0, 4.0])
    assert values(m, "energy/measured_J_per_sample") == pytest.approx([1.0, 1.0])
    assert values(m, "energy/measured_total_J")[-1] == pytest.approx(24.0)
    assert "energy_source: rapl:package-0+package-0/dram" in read_hparams(trainer)


def test_without_counters_only_estimated_tags_appear(tmp_path, monkeypatch):
    import pynvml

    def no_driver():
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    mon = EnergyMonitor(window_steps=2, rapl_root=str(tmp_path / "no_powercap"), estimate_watts=12.0,
                        reference_J_per_sample=1.0)
    trainer = make_trainer(tmp_path, [mon], max_steps=4)
    with pytest.warns(UserWarning, match="ESTIMATED energy"):
        trainer.fit(Tiny())

    m = read_metrics(trainer)
    energy_keys = {k for k in m if k.startswith("energy/")}
    assert energy_keys == {"energy/estimated_J_per_step", "energy/estimated_J_per_sample",
                           "energy/estimated_mean_W", "energy/estimated_total_J", "energy/estimated_saving_pct"}
    for per_step, per_sample in zip(values(m, "energy/estimated_J_per_step"),
                                    values(m, "energy/estimated_J_per_sample")):
        assert per_step == pytest.approx(BATCH * per_sample) and per_step >= 0
    hp = read_hparams(trainer)
    assert "energy_source: estimate:12W x cpu_s" in hp and "energy_estimate_watts: 12.0" in hp
    assert mon.energy_kind == "estimated"


def test_energy_reference_file_of_other_kind_is_not_compared(tmp_path, monkeypatch):
    model = Tiny()
    patch_fake_nvml(monkeypatch, lambda: 3000 * model.steps_done)
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"energy_kind": "estimated", "energy_J_per_sample": 2.0}))
    mon = EnergyMonitor(window_steps=2, reference_file=str(ref))
    trainer = make_trainer(tmp_path, [mon], max_steps=2)
    with pytest.warns(UserWarning, match="no energy saving logged"):
        trainer.fit(model)
    m = read_metrics(trainer)
    assert values(m, "energy/measured_J_per_sample") == pytest.approx([0.75])
    assert "energy/measured_saving_pct" not in m

    ref.write_text(json.dumps({"energy_kind": "measured", "energy_J_per_sample": 1.5}))
    model2 = Tiny()
    patch_fake_nvml(monkeypatch, lambda: 3000 * model2.steps_done)
    trainer = make_trainer(tmp_path, [EnergyMonitor(window_steps=2, reference_file=str(ref))], max_steps=2)
    trainer.fit(model2)
    assert values(read_metrics(trainer), "energy/measured_saving_pct") == pytest.approx([50.0])


def test_energy_monitor_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="window_steps=0"):
        EnergyMonitor(window_steps=0)
    with pytest.raises(ValueError, match="not both"):
        EnergyMonitor(reference_J_per_sample=1.0, reference_file="x.json")
    mon = EnergyMonitor(reference_file=str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="missing.json"):
        make_trainer(tmp_path, [mon], max_steps=1).fit(Tiny())


# ----------------------------------------------------------------------------------------- speedup
class ListClock:
    def __init__(self, times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


# batch starts at 0, 10, 20 (two warm-up intervals of 10 s), then intervals 0.1, 0.3, 0.2 s -> median 0.2 s
STARTS = [0.0, 10.0, 20.0, 20.1, 20.4, 20.6]


def test_speedup_from_known_timings(tmp_path):
    mon = SpeedupMonitor(warmup_steps=2, window_steps=3, reference_iteration_s=0.5, clock=ListClock(STARTS))
    trainer = make_trainer(tmp_path, [mon], max_steps=6)
    trainer.strategy.no_overlap_time_s = 0.3  # what the pipedap profiler provides
    trainer.fit(Tiny())

    m = read_metrics(trainer)
    assert values(m, "speed/iteration_time_ms") == pytest.approx([200.0])
    assert values(m, "speed/throughput_samples_per_s") == pytest.approx([BATCH / 0.2])
    assert values(m, "speed/speedup_vs_reference") == pytest.approx([0.5 / 0.2])
    assert values(m, "speed/speedup_vs_no_overlap") == pytest.approx([0.3 / 0.2])
    assert values(m, "speed/no_overlap_time_ms") == pytest.approx([300.0])
    assert mon.intervals_s == pytest.approx([0.1, 0.3, 0.2])
    summary = read_summary(os.path.join(trainer.logger.log_dir, "measure_summary.json"))
    assert summary["iteration_s"] == pytest.approx(0.2)
    assert summary["throughput_samples_per_s"] == pytest.approx(20.0)
    assert summary["samples_per_step"] == BATCH


def test_speedup_against_reference_file_uses_throughput(tmp_path):
    ref = tmp_path / "ddp_summary.json"
    ref.write_text(json.dumps({"iteration_s": 0.4, "throughput_samples_per_s": 8.0}))
    mon = SpeedupMonitor(warmup_steps=2, window_steps=3, reference_file=str(ref), clock=ListClock(STARTS))
    trainer = make_trainer(tmp_path, [mon], max_steps=6)
    trainer.fit(Tiny())
    m = read_metrics(trainer)
    assert values(m, "speed/speedup_vs_reference") == pytest.approx([20.0 / 8.0])
    assert "speed/speedup_vs_no_overlap" not in m  # the strategy has no no_overlap_time_s


class FakeTrainer:
    """Just what SpeedupMonitor's hooks use, for checking which intervals are kept."""

    world_size, is_global_zero, global_step, loggers = 1, True, 0, []

    class strategy:  # noqa: N801 - attribute namespace
        root_device = torch.device("cpu")

        @staticmethod
        def reduce(t, reduce_op="sum"):
            return t


def test_speedup_discards_intervals_across_validation_and_epochs():
    clock = ListClock([0.0, 1.0, 5.0, 6.0, 6.5, 9.0, 9.25])
    mon = SpeedupMonitor(warmup_steps=0, window_steps=100, clock=clock)
    tr, batch = FakeTrainer(), torch.zeros(3, 1)
    for _ in range(2):
        mon.on_train_batch_start(tr, None, batch, 0)  # 0, 1 -> interval 1
    mon.on_validation_start(tr, None)
    for _ in range(3):
        mon.on_train_batch_start(tr, None, batch, 0)  # 5 (after validation), 6, 6.5 -> intervals 1, 0.5
    mon.on_train_epoch_end(tr, None)
    for _ in range(2):
        mon.on_train_batch_start(tr, None, batch, 0)  # 9, 9.25 -> interval 0.25
    assert mon.intervals_s == pytest.approx([1.0, 1.0, 0.5, 0.25])


class StartupStrategy:
    """A strategy with a start-up, as pipedap's: ``startup`` is {} until the chosen schedule runs."""

    root_device = torch.device("cpu")

    def __init__(self):
        self.startup = {}

    @staticmethod
    def reduce(t, reduce_op="sum"):
        return t


def test_speedup_times_only_steady_state_after_a_startup(tmp_path):
    # 12 steps; the strategy's start-up is over after 4 steps (startup set at step 3's start), so steady state
    # starts at step 4 + SETTLE_STEPS = 6: intervals of steps 1..5 (after 1 warm-up) are start-up, 6..10 steady
    starts = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 6.1, 6.3, 6.4, 6.6, 6.7]
    mon = SpeedupMonitor(warmup_steps=1, window_steps=3, clock=ListClock(starts),
                         summary_file=str(tmp_path / "s.json"))
    tr, batch = FakeTrainer(), torch.zeros(3, 1)
    tr.strategy = StartupStrategy()
    for step in range(12):
        if step == 3:
            tr.strategy.startup = {"total_steps": 4, "total_s": 3.5}
        mon.on_train_batch_start(tr, None, batch, step)
    assert mon.startup_intervals_s == pytest.approx([1.0] * 5)  # steps 1..5 (step 0 is the warm-up)
    assert mon.intervals_s == pytest.approx([0.1, 0.2, 0.1, 0.2, 0.1])  # steps 6..10 only
    assert mon.history[0] == pytest.approx({"speed/startup_step_time_ms": 1000.0})
    assert [h["speed/iteration_time_ms"] for h in mon.history if "speed/iteration_time_ms" in h] \
        == pytest.approx([100.0])  # (window 0.1, 0.2, 0.1): no start-up interval in the tag
    mon.on_train_end(tr, None)
    summary = read_summary(str(tmp_path / "s.json"))
    assert summary["iteration_s"] == pytest.approx(0.1)  # the old code: median over 1.0 x5 and 0.1/0.2 -> 0.2
    assert summary["iteration_steps"] == 5
    assert summary["steady_from_step"] == 6
    assert summary["startup_steps"] == 4 and summary["startup_s"] == pytest.approx(3.5)
    assert summary["steady_state"] is True


def test_speedup_fit_ending_before_steady_state_reports_no_iteration_time(tmp_path):
    mon = SpeedupMonitor(warmup_steps=1, window_steps=100, clock=ListClock([0.0, 1.0, 2.0, 3.0, 4.0]),
                         summary_file=str(tmp_path / "s.json"))
    tr, batch = FakeTrainer(), torch.zeros(3, 1)
    tr.strategy = StartupStrategy()  # start-up never over (the fit ends in the trials)
    for step in range(5):
        mon.on_train_batch_start(tr, None, batch, step)
    with pytest.warns(UserWarning, match="before steady state"):
        mon.on_train_end(tr, None)
    summary = read_summary(str(tmp_path / "s.json"))
    assert summary["iteration_s"] is None and summary["steady_state"] is False
    assert summary["iteration_steps"] == 0 and summary["steady_from_step"] is None
    assert "before steady state" in summary["iteration_note"]
    assert mon.startup_intervals_s == pytest.approx([1.0, 1.0, 1.0])


def test_speedup_leaves_out_the_steps_of_a_drift_replan(tmp_path):
    from lightning_pipedap.strategy.controller import Phase  # noqa: PLC0415

    # the phase each step start sees: start-up (trace, profile, 2 trials), run from step 4 (start-up: 4 steps),
    # a drift re-plan seen at step 10 (profile, 2 trials), run again from step 13
    seen = ([Phase.TRACE, Phase.PROFILE, Phase.TRIAL, Phase.TRIAL] + [Phase.RUN] * 6
            + [Phase.PROFILE, Phase.TRIAL, Phase.TRIAL] + [Phase.RUN] * 6)
    steady = {6, 7, 8, 15, 16, 17}  # start-up + 2 settling; re-plan steps 9..14 (up to 3 steps after run again)
    gaps = [0.1 if i in steady else 1.0 for i in range(len(seen) - 1)]
    starts = [sum(gaps[:k]) for k in range(len(seen))]
    mon = SpeedupMonitor(warmup_steps=0, window_steps=100, clock=ListClock(starts),
                         summary_file=str(tmp_path / "s.json"))
    tr, batch = FakeTrainer(), torch.zeros(3, 1)
    tr.strategy = StartupStrategy()
    for step, phase in enumerate(seen):
        tr.strategy.phase = phase
        if step == 4:
            tr.strategy.startup = {"total_steps": 4, "total_s": 1.0}
        mon.on_train_batch_start(tr, None, batch, step)
    assert mon.intervals_s == pytest.approx([0.1] * 6)  # the old code also timed the 6 re-plan steps (1.0 s)
    assert mon.startup_intervals_s == pytest.approx([1.0] * 6)
    assert mon.replan_intervals_s == pytest.approx([1.0] * 6)
    mon.on_train_end(tr, None)
    summary = read_summary(str(tmp_path / "s.json"))
    assert summary["iteration_s"] == pytest.approx(0.1) and summary["replan_steps"] == 6
    assert summary["iteration_steps"] == 6 and summary["steady_from_step"] == 6


def test_speedup_strategy_without_startup_is_steady_from_the_first_step():
    assert steady_from_step("ddp") == 0
    assert steady_from_step(FakeTrainer.strategy) == 0
    s = StartupStrategy()
    assert steady_from_step(s) is None
    s.startup = {"total_steps": 145, "total_s": 2.0}
    assert steady_from_step(s) == 145 + SETTLE_STEPS == 147


def test_batch_size_of_nested_batches():
    assert batch_size_of((torch.zeros(5, 2), torch.zeros(5))) == 5
    assert batch_size_of({"ids": [torch.zeros(7, 3)], "y": torch.zeros(7)}) == 7
    assert batch_size_of({"meta": "x"}) is None
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        SpeedupMonitor(warmup_steps=-1)


# ---------------------------------------------------------------------------------------- timeline
class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t

    def advance(self, dt):
        self.t += dt


class TimelineStrategy(SingleDeviceStrategy):
    """A strategy with the pipedap timeline contract: ``timeline_enabled`` and ``take_timeline()``.

    Hand-made ops per step (ms from the step start, the model's phases are forward 0-10, backward 10-30,
    update 30-32, step end 40): AG0 0-4 (deferred from the previous step), RS0 20-35, compress0 30-33.
    """

    def __init__(self, clock):
        super().__init__(device=torch.device("cpu"))
        self.clock = clock
        self.timeline_enabled = False
        self._records = []

    def training_step(self, *args, **kwargs):
        if self.timeline_enabled:
            t = self.clock.t
            self._records.append(OpRecord("AG0", "AG", 0, t, t + 0.004, "comm"))
        return super().training_step(*args, **kwargs)

    def post_backward(self, closure_loss):
        super().post_backward(closure_loss)
        if self.timeline_enabled:
            t = self.clock.t  # end of backward: 30 ms
            self._records.append(OpRecord("RS0", "RS", 0, t - 0.010, t + 0.005, "comm"))
            self._records.append(OpRecord("compress0", "compress", 0, t, t + 0.003, "compress"))

    def take_timeline(self):
        out, self._records = self._records, []
        return out


def test_comm_timeline_with_strategy_records(tmp_path):
    clock = FakeClock()
    tl = CommTimeline(every_n_steps=2, warmup_steps=1, clock=clock)
    trainer = make_trainer(tmp_path, [tl], max_steps=4, logger="tb", strategy=TimelineStrategy(clock))
    trainer.fit(Tiny(clock=clock))

    # comm union [0,4] + [20,35] = 19 ms; hidden by compute [0,32]: 4 + 12 = 16 ms -> 3 ms exposed
    expected = {"timeline/step_ms": 40.0, "timeline/compute_ms": 32.0, "timeline/comm_ms": 19.0,
                "timeline/exposed_comm_ms": 3.0, "timeline/overlap_ratio": 16.0 / 19.0,
                "timeline/compress_ms": 3.0, "timeline/exposed_compress_ms": 1.0}
    assert len(tl.history) == 2
    for h in tl.history:
        assert h == pytest.approx(expected)
    assert tl.last_window[1] - tl.last_window[0] == pytest.approx(0.040)

    log_dir = trainer.logger.log_dir
    names = [os.path.basename(p) for p in tl.trace_files]
    assert names == ["step0000001_rank0.trace.json", "step0000003_rank0.trace.json"]
    for path in tl.trace_files:
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
        got = sorted((e["name"], round(e["ts"] / 1000, 6), round(e["dur"] / 1000, 6)) for e in events)
        step = int(os.path.basename(path)[4:11])  # the callback's own compute records name the sampled step
        assert got == sorted([(f"it {step}: forward", 0, 10), (f"it {step}: backward", 10, 20),
                              (f"it {step}: update", 30, 2), ("AG0", 0, 4), ("RS0", 20, 15), ("compress0", 30, 3)])
        assert os.path.isfile(path.replace(".trace.json", ".png"))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Images("timeline/gantt")] == [1, 3]
    assert [e.value for e in acc.Scalars("timeline/exposed_comm_ms")] == pytest.approx([3.0, 3.0])


def test_comm_timeline_on_plain_strategy_records_compute_only(tmp_path):
    tl = CommTimeline(every_n_steps=2, warmup_steps=0)
    trainer = make_trainer(tmp_path, [tl], max_steps=3)
    with pytest.warns(UserWarning, match="has no take_timeline"):
        trainer.fit(Tiny())
    m = read_metrics(trainer)
    assert [s for s, _ in m["timeline/step_ms"]] == [0, 2]
    assert "timeline/exposed_comm_ms" not in m and "timeline/overlap_ratio" not in m
    assert len(tl.trace_files) == 2
    for path in tl.trace_files:
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
        assert sorted(e["name"] for e in events) == ["backward", "forward", "update"]
        assert all(e["dur"] >= 0 for e in events)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="every_n_steps=0"):
            CommTimeline(every_n_steps=0)


# ---------------------------------------------------------------------------------- two ranks (gloo)
class RaplTiny(Tiny):
    """Rank 0 advances a fake RAPL package counter by 4 J per step (RAPL counts the whole socket)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 0:
            path = os.path.join(self.root, "intel-rapl:0", "energy_uj")
            with open(path + ".tmp", "w") as f:
                f.write(str(4_000_000 * self.steps_done))
            os.replace(path + ".tmp", path)
        return loss


@pytest.mark.multiprocess
def test_two_ranks_sum_energy_and_samples(tmp_path):
    root = tmp_path / "powercap"
    os.makedirs(root / "intel-rapl:0")
    (root / "intel-rapl:0" / "name").write_text("package-0")
    (root / "intel-rapl:0" / "energy_uj").write_text("0")
    (root / "intel-rapl:0" / "max_energy_range_uj").write_text("262143328850")
    callbacks = [EnergyMonitor(window_steps=2, rapl_root=str(root)), SpeedupMonitor(warmup_steps=1, window_steps=2),
                 CommTimeline(every_n_steps=2, warmup_steps=1)]
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=4, callbacks=callbacks,
                      logger=CSVLogger(str(tmp_path), name="run", version=0), enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0)
    trainer.fit(RaplTiny(str(root)))

    m = read_metrics(trainer)
    # rank 1 reads 0 J (its socket is counted by local rank 0); 2 ranks x 4 samples per step
    assert values(m, "energy/measured_J_per_step") == pytest.approx([4.0, 4.0])
    assert values(m, "energy/measured_J_per_sample") == pytest.approx([0.5, 0.5])
    assert values(m, "energy/measured_total_J")[-1] == pytest.approx(16.0)
    assert len(m["speed/throughput_samples_per_s"]) == 1
    assert [s for s, _ in m["timeline/step_ms"]] == [1, 3]
    summary = read_summary(os.path.join(trainer.logger.log_dir, "measure_summary.json"))
    assert summary["samples_per_step"] == 2 * BATCH
    assert summary["energy_source"] == "rapl:package-0"
    traces = sorted(os.listdir(os.path.join(trainer.logger.log_dir, "timeline")))
    assert [t for t in traces if t.endswith(".json")] == [
        "step0000001_rank0.trace.json", "step0000001_rank1.trace.json",
        "step0000003_rank0.trace.json", "step0000003_rank1.trace.json"]


def test_compression_monitor_logs_ratio_and_hidden_share():
    from types import SimpleNamespace

    from lightning_pipedap.engine.compressed import CompressionStats
    from lightning_pipedap.measure import CompressionMonitor

    logged = []
    logger = SimpleNamespace(log_metrics=lambda m, step: logged.append((step, m)))
    stats = {0: CompressionStats(compress_s=0.010, wait_s=0.002, payload_bytes=100, dense_bytes=400),
             1: CompressionStats(compress_s=0.030, wait_s=0.030, payload_bytes=300, dense_bytes=1200)}
    trainer = SimpleNamespace(is_global_zero=True, global_step=20, loggers=[logger],
                              strategy=SimpleNamespace(compression_stats=lambda: stats))
    CompressionMonitor(every_n_steps=10).on_train_batch_end(trainer, None, None, None, 0)
    (step, m), = logged
    assert step == 20
    assert m["compress/b0/ratio"] == 4.0 and m["compress/ratio"] == 4.0
    assert m["compress/b0/hidden_ms"] == pytest.approx(8.0) and m["compress/b1/hidden_ms"] == 0.0
    assert m["compress/hidden_pct"] == pytest.approx(100 * 0.008 / 0.040)
    trainer.global_step = 21  # not a logging step
    CompressionMonitor(every_n_steps=10).on_train_batch_end(trainer, None, None, None, 0)
    assert len(logged) == 1


def test_speedup_summary_has_the_steady_state_comparison_with_the_strategys_predictions(tmp_path):
    """TensorBoard showed speedup_vs_no_overlap 0.60 and prediction_error_pct 82, but the summary file (which the
    app's summary reads) had neither: now it has both, over the whole steady-state median."""
    mon = SpeedupMonitor(warmup_steps=0, window_steps=100, clock=ListClock([0.0, 0.1, 0.2, 0.3]),
                         summary_file=str(tmp_path / "s.json"))
    tr, batch = FakeTrainer(), torch.zeros(3, 1)
    tr.strategy = StartupStrategy()
    tr.strategy.startup = {"total_steps": 0, "total_s": 0.0}
    tr.strategy.no_overlap_time_s, tr.strategy.predicted_iteration_s = 0.06, 0.055
    for step in range(4):
        mon.on_train_batch_start(tr, None, batch, step)
    mon.on_train_end(tr, None)
    summary = read_summary(str(tmp_path / "s.json"))
    assert summary["iteration_s"] == pytest.approx(0.1)
    assert summary["no_overlap_time_s"] == pytest.approx(0.06)
    assert summary["speedup_vs_no_overlap"] == pytest.approx(0.6)
    assert summary["predicted_iteration_s"] == pytest.approx(0.055)
    assert summary["prediction_error_pct"] == pytest.approx(100 * (0.1 / 0.055 - 1))
