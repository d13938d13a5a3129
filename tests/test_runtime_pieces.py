"""The run-time's pieces without processes: step flags, the schedule record, read-only routes."""

from __future__ import annotations

import pytest
import torch

from lightning_pipedap.schedule import builtin_schedule
from lightning_pipedap.strategy.engine_slot import ScheduleRecord
from lightning_pipedap.strategy.handover import TorchDDPCandidate
from lightning_pipedap.strategy.runtime import Runtime
from lightning_pipedap.strategy.step import ProfileProbe, StepFlags


def test_step_flags_name_the_step_and_restore_after_a_micro_batch():
    f = StepFlags()
    assert f.syncing and not f.in_training_forward and not f.trace_taken and f.buffers_due
    with f.local_gradients():
        assert not f.syncing
        with torch.enable_grad():
            f.forward_ran()  # (a grad-enabled forward of a micro-batch: no buffer broadcast before the next)
        assert not f.buffers_due
    assert f.syncing
    with pytest.raises(KeyError), f.training_forward():
        assert f.in_training_forward
        raise KeyError
    assert not f.in_training_forward
    with torch.enable_grad():
        f.forward_ran()
    assert f.buffers_due
    f.set_buffers_due(False)
    assert not f.buffers_due
    f.take_trace()
    f.trace_over(still_tracing=True)
    assert f.trace_taken
    f.trace_over(still_tracing=False)
    assert not f.trace_taken


def test_profile_probe_records_only_in_a_profiled_step():
    p = ProfileProbe(torch.device("cpu"))
    p.forward_end()  # (nothing to record: no error)
    assert p.take() == (None, None) and not p.recording
    p.backward_done()
    rec, t_done = p.take()
    assert rec is None and t_done is not None
    p.no_update_time()
    assert p.take() == (None, None)


def test_schedule_record_logs_a_repeated_warmup_line_once():
    said: list[str] = []
    r = ScheduleRecord(said.append)
    s = builtin_schedule("allreduce", [64, 64], 1 << 20, [(torch.float32, torch.device("cpu"))] * 2)
    r.engine_runs(s, final=False)
    r.engine_runs(s, final=False)
    assert len(said) == 1 and said[0].startswith("pipedap: warm-up schedule") and r.final is None
    assert r.running == "allreduce"
    r.engine_runs(s, final=True)
    assert r.final is s and r.installed == s.describe() and said[-1] == f"pipedap: schedule {s.describe()}"
    ddp = TorchDDPCandidate(25.0, True)
    r.ddp_runs(ddp)
    assert r.running == "torch_ddp" and r.final is ddp and said[-1] == f"pipedap: schedule {ddp.describe()}"


def test_runtime_attributes_are_read_only():
    with pytest.raises(AttributeError, match=r"Runtime.engine is read-only"):
        Runtime.engine.__set__(object(), None)
    assert Runtime.final_schedule.path == ["slot", "schedules"] and Runtime.final_schedule.name == "final"
