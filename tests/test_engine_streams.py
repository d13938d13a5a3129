"""Streams and events of the engine (:mod:`lightning_pipedap.engine.streams`) on CPU: the stand-ins keep the
hand-off order the CUDA path relies on (each wait after its record), an out-of-order wait raises, and a real engine
round at 2 gloo ranks walks ready -> (comm stream waits) -> reduced/gathered recorded on the comm stream -> the
compute stream waits before the update reads the bucket."""

from __future__ import annotations

import pytest
import torch

from lightning_pipedap.engine.bucket_sync import BucketSync
from lightning_pipedap.engine.buckets import FlatBucket
from lightning_pipedap.engine.streams import HostEvent, HostStream, StreamOrderError, streams_for
from lightning_pipedap.schedule import OpKind
from tests._dist_util import run_ranks


def _sync() -> BucketSync:
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    return BucketSync(FlatBucket.allocate(7, (0, 1), params, world_size=2))


def test_host_stream_refuses_a_wait_for_an_event_never_recorded():
    ev, s = HostEvent("gathered"), HostStream("compute")
    with pytest.raises(StreamOrderError, match="'compute' waits for event 'gathered'"):
        s.wait_event(ev)
    ev.record(s)
    s.wait_event(ev)
    assert list(s.log) == [("record", "gathered"), ("wait", "gathered")] and ev.records == 1 and ev.query()


def test_cpu_streams_are_stand_ins_and_an_unknown_accelerator_is_refused():
    st = streams_for("cpu")
    assert not st.accelerated and isinstance(st.new_stream(), HostStream) and isinstance(st.new_event(), HostEvent)
    with st.use(st.new_stream()):
        pass
    st.bind_thread()
    if not torch.accelerator.is_available():
        with pytest.raises(ValueError, match="cuda:0 has no streams here.*valid: 'cpu'"):
            streams_for("cuda:0")


@pytest.mark.parametrize("done", [OpKind.REDUCE_SCATTER, OpKind.ALL_REDUCE])
def test_a_bucket_round_records_before_every_wait(done):
    s = _sync()
    comm, compute = HostStream("comm"), s.streams.current()
    s.start_collect()
    s.fill(0)
    s.fill(1)
    s.mark_ready()
    assert s.wait_ready(1.0, comm)
    s.start_grad_sync()
    s.finish_grad_sync(done, comm)
    if done is OpKind.REDUCE_SCATTER:
        s.start_param_sync()
        s.finish_param_sync(comm)
    assert s.wait_gathered(1.0)
    assert list(compute.log) == [("record", "ready"), ("wait", "gathered")]
    assert list(comm.log) == [("wait", "ready"), ("record", "reduced"), ("record", "gathered")]


def test_a_gathered_wait_before_any_record_raises():
    s = _sync()
    s._gathered.set()  # (the host hand-off without its device event: the bug the stand-in catches)
    with pytest.raises(StreamOrderError, match="'gathered'"):
        s.wait_gathered(1.0)


def _engine_round(rank: int, world: int) -> dict:
    from lightning_pipedap.engine import collectives as C
    from lightning_pipedap.engine.engine import CommEngine
    from lightning_pipedap.schedule import builtin_schedule

    comm = C.new_comm_group(timeout_s=30, chunk_bytes=64)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    params = list(model.parameters())
    out = {}
    for name in ("allreduce", "dear"):
        engine = CommEngine(comm, params, builtin_schedule(name, [p.numel() * 4 for p in params], 200),
                            wait_timeout_s=30)
        hooks = [p.register_post_accumulate_grad_hook(lambda q, i=i: engine.grad_ready(i, q.grad))
                 for i, p in enumerate(params)]
        model.zero_grad()
        engine.begin_iteration()
        torch.manual_seed(1 + rank)
        model(torch.randn(4, 8)).square().mean().backward()
        engine.finish_backward()
        for b in range(engine.num_buckets):
            engine.wait_done(b)
        comm_log = list(engine.worker.stream.log)
        compute_log = list(engine.syncs[0].streams.current().log)
        engine.close()
        for h in hooks:
            h.remove()
        out[name] = (engine.num_buckets, comm_log, compute_log)
    C.destroy_comm_group(comm)
    return out


def test_engine_round_on_cpu_orders_every_hand_off():
    res = run_ranks(_engine_round, 2, timeout_s=120)
    for rank, per in res.items():
        for name, (n, comm_log, compute_log) in per.items():
            assert n >= 2, name
            # the comm stream waits for each bucket's copies before its collective and records its results
            assert comm_log.count(("wait", "ready")) == n, (name, comm_log)
            assert comm_log.count(("record", "gathered")) == n, (name, comm_log)
            for i, entry in enumerate(comm_log):
                if entry == ("record", "reduced"):
                    assert ("wait", "ready") in comm_log[:i], (name, comm_log)
            # the compute stream recorded every ready and waited for every gathered bucket before using it
            assert compute_log.count(("record", "ready")) == n and compute_log.count(("wait", "gathered")) == n
