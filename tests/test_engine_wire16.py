"""The engine's 16-bit wire format on 2 gloo ranks against its exact arithmetic, and its refusals.

With 2 ranks the ring's arithmetic is short enough to write down: rank ``r`` owns segment ``r`` of a
bucket buffer, receives the other rank's values of that segment cast to the wire dtype, adds them
to its own fp32 values in fp32 and rounds the sum to the wire dtype; the all-gather hands that
rounded sum to the other rank unchanged. So every element equals
``wire(x_owner + float(wire(x_other)))`` with ``x_k = g_k / 2`` (what ``grad_ready`` writes), bit
for bit, on both ranks. This exact reference is used rather than DDP's ``fp16_compress_hook``, whose
arithmetic differs (it rounds both addends and sums in fp16); a Lightning comparison with that hook
is in ``tests/test_wire16_training.py``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_pipedap.schedule import Op, OpKind, Schedule
from tests._dist_util import run_ranks

RS, AG, AR = OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.ALL_REDUCE
SIZES = [37, 300, 5, 64]
# bucket 0 (params 0, 1): RS + AG, 16-bit; bucket 1 (param 2): AR, 16-bit; bucket 2 (param 3): AR, fp32
SCHEDULE = Schedule(buckets=((0, 1), (2,), (3,)), ops=(Op(AR, 2), Op(AR, 1), Op(RS, 0), Op(AG, 0)),
                    name="wire", wire16=(True, True, False))


def _grad(i: int, rank: int) -> torch.Tensor:
    return torch.randn(SIZES[i], generator=torch.Generator().manual_seed(50 * i + rank)) * 3


def _run(rank, world, wire_name):
    from lightning_pipedap.engine import collectives as C
    from lightning_pipedap.engine.engine import CommEngine

    comm = C.new_comm_group(timeout_s=30, chunk_bytes=64)
    params = [torch.zeros(s) for s in SIZES]
    engine = CommEngine(comm, params, SCHEDULE, wait_timeout_s=30, wire_dtype=wire_name)
    out = []
    try:
        for _ in range(2):  # twice: the scratch buffers are reused
            engine.begin_iteration()
            for i in reversed(range(len(SIZES))):
                engine.grad_ready(i, _grad(i, rank))
            engine.finish_backward()
            bufs = [engine.wait_done(b).buffer.clone() for b in range(engine.num_buckets)]
            engine.wait_idle()
            out.append([b.numpy().copy() for b in bufs])
    finally:
        engine.close()
    C.destroy_comm_group(comm)
    return out


def _expected(wire: torch.dtype) -> list[torch.Tensor]:
    """Each bucket's buffer by the formula of the module docstring (flags: 1 + 1 = 2, exact)."""
    out = []
    for b, idxs in enumerate(SCHEDULE.buckets):
        x = []
        for r in range(2):
            data = torch.cat([torch.div(_grad(i, r), 2) for i in idxs] + [torch.ones(len(idxs))])
            x.append(torch.cat([data, torch.zeros(data.numel() % 2)]))
        n = x[0].numel() // 2
        if not SCHEDULE.is_wire16(b):
            out.append(x[0] + x[1])
            continue
        segs = []
        for owner in range(2):
            mine, other = x[owner][owner * n:(owner + 1) * n], x[1 - owner][owner * n:(owner + 1) * n]
            segs.append((mine + other.to(wire).float()).to(wire).float())
        out.append(torch.cat(segs))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("wire_name", ["fp16", "bf16"])
def test_engine_wire16_buckets_follow_the_exact_arithmetic_on_both_ranks(wire_name):
    from lightning_pipedap.engine.collectives import WIRE_DTYPES

    res = run_ranks(_run, 2, wire_name)
    expected = _expected(WIRE_DTYPES[wire_name])
    for rank, rounds in res.items():
        for bufs in rounds:
            for b, (got, want) in enumerate(zip(bufs, expected)):
                assert torch.equal(torch.from_numpy(got), want), (rank, b)
    # the 16-bit buckets really rounded: they differ from the fp32 sum
    exact = torch.cat([torch.div(_grad(0, 0), 2) + torch.div(_grad(0, 1), 2)])
    assert not torch.equal(torch.from_numpy(res[0][0][0])[:SIZES[0]], exact)


def test_engine_refuses_wire16_flags_without_a_wire_dtype():
    from lightning_pipedap.engine import collectives as C
    from lightning_pipedap.engine.engine import CommEngine

    comm = C.CommGroup(group=None, rank=0, world_size=2, backend="gloo")
    with pytest.raises(ValueError, match=r"sends 2 bucket\(s\) in the 16-bit wire format but wire_dtype='fp32'; "
                                         r"valid: 'fp16', 'bf16'"):
        CommEngine(comm, [torch.zeros(s) for s in SIZES], SCHEDULE, wait_timeout_s=1)


@pytest.mark.parametrize("kwargs,match", [
    ({"wire_dtype": "fp8"}, r"wire_dtype must be one of 'fp32', 'fp16', 'bf16', got 'fp8'"),
    ({"wire_dtype": "fp16", "compression": "fp16"}, r"wire_dtype='fp16' and compression='fp16' exclude each other"),
])
def test_config_refuses_bad_wire_dtype(kwargs, match):
    from lightning_pipedap import PipeDAPStrategy
    from lightning_pipedap.strategy.fabric import PipeDAPFabricStrategy

    with pytest.raises(ValueError, match=match):
        PipeDAPStrategy(**kwargs)
    if "compression" not in kwargs:
        with pytest.raises(ValueError, match=match):
            PipeDAPFabricStrategy(**kwargs)
    assert PipeDAPFabricStrategy(wire_dtype="bf16").wire_dtype == "bf16"
