"""Three ranks: pipedap's engine averages gradients as DDP does (scaled by 1/N while copied into the bucket)."""

from __future__ import annotations

import pytest

from tests._dist_util import run_ranks


def _engine_vs_ddp(rank, world):
    """One backward of a small MLP under DDP and the same local gradients through pipedap's engine (one bucket,
    all-reduce: gloo's all-reduce, the reducer DDP uses): the averaged gradients, element by element."""
    import torch

    from lightning_pipedap.engine import collectives as C
    from lightning_pipedap.engine.engine import CommEngine
    from lightning_pipedap.schedule import Op, OpKind, Schedule

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 + rank)) * 1.7
    params = list(model.parameters())
    local = [g.clone() for g in torch.autograd.grad(model(x).pow(2).sum(), params)]
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(x).pow(2).sum().backward()
    expect = torch.cat([p.grad.reshape(-1) for p in params])
    comm = C.new_comm_group(timeout_s=20, chunk_bytes=1 << 20)
    engine = CommEngine(comm, [torch.zeros_like(p) for p in params],
                        Schedule(buckets=(tuple(range(len(params))),), ops=(Op(OpKind.ALL_REDUCE, 0),), name="ar"),
                        wait_timeout_s=20)
    try:
        engine.begin_iteration()
        for i in reversed(range(len(params))):
            engine.grad_ready(i, local[i])
        engine.finish_backward()
        bucket = engine.wait_done(0)
        got = torch.cat([bucket.grad_view(k).reshape(-1) for k in range(len(params))])
        engine.wait_idle()
    finally:
        engine.close()
    C.destroy_comm_group(comm)
    return int((got != expect).sum()), got.numel(), float((got - expect).abs().max())


@pytest.mark.multiprocess
def test_engine_averages_like_ddp_at_three_ranks():
    """DDP scales each gradient by 1/N while copying it into its bucket (``mul_out`` with ``1. / div_factor``,
    torch/csrc/distributed/c10d/reducer.cpp), then all-reduces: at 3 ranks ``g * (1/3)`` and ``g / 3`` differ in the
    last bit for about a third of the elements, and dividing put 43% of a BERT model's averaged gradients off DDP's
    at the first step. The engine scales as DDP does, so with the same all-reduce the average is DDP's bit for bit."""
    res = run_ranks(_engine_vs_ddp, 3, timeout_s=120)
    for rank, (differ, n, worst) in res.items():
        assert differ == 0, f"rank {rank}: {differ} of {n} averaged gradient elements differ from DDP's (max {worst})"
