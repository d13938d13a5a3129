"""Property test of the engine: any valid schedule over any bucket layout reduces like a plain all-reduce.

Hypothesis draws the cases (parameter sizes including 0, 1 and odd sizes; a bucket partition; per
bucket an all-reduce or a reduce-scatter whose all-gather comes at any later point of the op list;
parameters some ranks give no gradient), then every case runs on 2 and on 3 gloo ranks in one
launch. For each case the engine must finish (no deadlock: every wait has the 20 s timeout) and
every gradient must equal the all-reduce average of the ranks' gradients, with the used flags
saying which parameters got a gradient on any rank.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from lightning_pipedap.schedule import Op, OpKind, Schedule
from tests._dist_util import run_ranks

CASES = 30


@st.composite
def _case(draw):
    sizes = draw(st.lists(st.sampled_from([0, 1, 2, 3, 7, 64, 513, 4097]), min_size=1, max_size=7))
    n = len(sizes)
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    bounds = [0, *cuts, n]
    buckets = [tuple(range(a, b)) for a, b in zip(bounds, bounds[1:])]
    kinds = [draw(st.sampled_from(["AR", "RSAG"])) for _ in buckets]
    ops: list[Op] = []
    for b in reversed(range(len(buckets))):  # reductions in backward order
        ops.append(Op(OpKind.ALL_REDUCE if kinds[b] == "AR" else OpKind.REDUCE_SCATTER, b))
    for b in range(len(buckets)):  # each all-gather anywhere after its reduce-scatter
        if kinds[b] == "RSAG":
            after = next(i for i, op in enumerate(ops) if op.bucket == b) + 1
            ops.insert(draw(st.integers(after, len(ops))), Op(OpKind.ALL_GATHER, b))
    unused = [draw(st.sets(st.integers(0, 2), max_size=2)) for _ in sizes]  # ranks without a gradient
    return sizes, buckets, ops, unused


def _grad(case_no: int, i: int, rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case_no + 10 * i + rank)
    return torch.randn(n, generator=g)


def _run(rank, world, cases):
    from lightning_pipedap.engine import collectives as C
    from lightning_pipedap.engine.engine import CommEngine

    comm = C.new_comm_group(timeout_s=20, chunk_bytes=1024)
    worst = 0.0
    for c, (sizes, buckets, ops, unused) in enumerate(cases):
        params = [torch.zeros(s) for s in sizes]
        schedule = Schedule(buckets=tuple(buckets), ops=tuple(ops), name="random")
        engine = CommEngine(comm, params, schedule, wait_timeout_s=20)
        try:
            engine.begin_iteration()
            for i in reversed(range(len(sizes))):
                if rank not in unused[i]:
                    engine.grad_ready(i, _grad(c, i, rank, sizes[i]))
            engine.finish_backward()
            for b, idxs in enumerate(buckets):
                bucket = engine.wait_done(b)
                used = engine.used_flags(b)
                for slot, i in enumerate(idxs):
                    expect = sum((_grad(c, i, r, sizes[i]) for r in range(world) if r not in unused[i]),
                                 torch.zeros(sizes[i])) / world
                    got = bucket.grad_view(slot)
                    worst = max(worst, float((got - expect).abs().max()) if sizes[i] else 0.0)
                    assert used[slot] == any(r not in unused[i] for r in range(world)), (c, i, used)
            engine.wait_idle()
        finally:
            engine.close()
    C.destroy_comm_group(comm)
    return worst


_DRAWN: list = []


@settings(max_examples=CASES, derandomize=True, phases=[Phase.generate], deadline=None,
          suppress_health_check=list(HealthCheck))
@given(_case())
def _draw(case):
    _DRAWN.append(case)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_random_layouts_and_schedules_reduce_like_all_reduce(world):
    if not _DRAWN:
        _draw()
    cases = _DRAWN[:CASES]
    assert len(cases) == CASES and any(0 in c[0] for c in cases) and any(len(c[1]) > 2 for c in cases)
    res = run_ranks(_run, world, cases, timeout_s=300)
    assert all(err < 1e-6 for err in res.values()), res
