"""The gloo point-to-point ring reduce-scatter / all-gather against gloo's own collectives."""

import pytest
import torch

from tests._dist_util import run_ranks


def _ring_vs_native(rank: int, world: int, numel_per_rank: int, chunk_bytes: int):
    import torch.distributed as dist

    from lightning_pipedap.engine import collectives as C

    comm = C.new_comm_group(timeout_s=60, chunk_bytes=chunk_bytes)
    g = torch.Generator().manual_seed(1234 + rank)
    data = torch.randn(world * numel_per_rank, generator=g, dtype=torch.float64)
    # expected: the element-wise sum over ranks (computed by gloo's all_reduce)
    expected = data.clone()
    dist.all_reduce(expected)

    ring = data.clone()
    shard = C.ring_reduce_scatter_(ring, comm).clone()
    native = data.clone()
    nshard = C.native_reduce_scatter_(native, comm).clone()

    gathered = ring.clone()
    gathered.view(world, -1)[rank].copy_(shard)
    C.ring_all_gather_(gathered, comm)
    ngathered = torch.zeros_like(data)
    ngathered.view(world, -1)[rank].copy_(nshard)
    C.native_all_gather_(ngathered, comm)
    C.destroy_comm_group(comm)
    seg = expected.view(world, -1)[rank]
    return {
        "rs_err": float((shard - seg).abs().max()),
        "rs_vs_native": float((shard - nshard).abs().max()),
        "ag_err": float((gathered - expected).abs().max()),
        "ag_vs_native": float((gathered - ngathered).abs().max()),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "world,numel,chunk_bytes",
    [(2, 1, 8), (2, 1001, 64), (3, 7, 8), (3, 333, 128), (3, 5000, 1 << 20)],
)
def test_ring_matches_native(world, numel, chunk_bytes):
    res = run_ranks(_ring_vs_native, world, numel, chunk_bytes)
    for rank, r in res.items():
        assert r["rs_err"] < 1e-12, (rank, r)
        assert r["rs_vs_native"] < 1e-12, (rank, r)
        assert r["ag_err"] < 1e-12, (rank, r)
        assert r["ag_vs_native"] < 1e-12, (rank, r)


def _ring_wire(rank: int, world: int, numel_per_rank: int, chunk_bytes: int, wire_name: str, scale: float):
    import torch.distributed as dist

    from lightning_pipedap.engine import collectives as C

    wire = C.WIRE_DTYPES[wire_name]
    comm = C.new_comm_group(timeout_s=60, chunk_bytes=chunk_bytes)
    g = torch.Generator().manual_seed(99 + rank)
    data = (torch.randn(world * numel_per_rank, generator=g) * scale).float()
    exact = data.double()
    dist.all_reduce(exact)  # fp64 sum over ranks: the reference
    absum = data.double().abs()
    dist.all_reduce(absum)  # Σ_k |x_k|, for the rounding bound
    buf = data.clone()
    shard = C.ring_reduce_scatter_(buf, comm, wire).clone()
    C.ring_all_gather_(buf, comm, wire)
    # the same buffer twice more: scratch buffers are reused, results must not change
    again = data.clone()
    C.ring_reduce_scatter_(again, comm, wire)
    C.ring_all_gather_(again, comm, wire)
    gathered = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(gathered, buf)
    C.destroy_comm_group(comm)
    out = {"buf": buf, "shard": shard, "again": again, "exact": exact, "absum": absum}
    out = {k: v.numpy().copy() for k, v in out.items()}  # numpy: tensors do not outlive the rank's process
    out["gathered"] = [t.numpy().copy() for t in gathered]
    return out


def _as_tensors(res: dict) -> dict:
    return {rank: {k: [torch.from_numpy(x) for x in v] if isinstance(v, list) else torch.from_numpy(v)
                   for k, v in r.items()} for rank, r in res.items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,numel,chunk_bytes,wire", [(2, 1001, 64, "fp16"), (3, 333, 128, "fp16"),
                                                           (3, 5000, 1 << 20, "bf16"), (2, 1, 8, "bf16")])
def test_ring_wire_16bit_within_rounding_bound_and_identical_on_every_rank(world, numel, chunk_bytes, wire):
    """16-bit wire: each element within ``(N-1)·u·Σ|x_k| + u·|Σx|`` (u = 2^-11 fp16, 2^-8 bf16; the N-1
    rounded hops plus the owner's final rounding, first order, 1% slack for second-order terms) of the
    fp64 sum; every rank byte-identical; the RS shard already equals what the AG delivers; each result
    representable in the wire dtype; repeat calls (reused scratch) give the same bytes."""
    from lightning_pipedap.engine import collectives as C

    u = {"fp16": 2.0**-11, "bf16": 2.0**-8}[wire]
    res = _as_tensors(run_ranks(_ring_wire, world, numel, chunk_bytes, wire, 1.0))
    r0 = res[0]
    bound = ((world - 1) * u * r0["absum"] + u * r0["exact"].abs()) * 1.01 + 1e-30
    err = (r0["buf"].double() - r0["exact"]).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(err.max()) > 0  # the wire really rounds (fp32 would be exact to ~1e-7 relative)
    for rank, r in res.items():
        for other in r["gathered"]:
            assert torch.equal(other, r0["buf"])
        assert torch.equal(r["again"], r["buf"])
        seg = r["buf"].view(world, -1)[rank]
        assert torch.equal(r["shard"], seg)
        assert torch.equal(seg.to(C.WIRE_DTYPES[wire]).float(), seg)


@pytest.mark.multiprocess
def test_ring_wire_fp16_overflow_becomes_inf_on_every_rank():
    """A sum beyond fp16's 65504 cannot travel as fp16: it arrives as inf on every rank (the strategy's
    ``nonfinite`` option then sees it), bf16 keeps fp32's range."""
    res = _as_tensors(run_ranks(_ring_wire, 2, 64, 64, "fp16", 4.0e4))
    big = res[0]["exact"].abs() > 65504 * (1 + 2.0**-11)
    assert bool(big.any())
    for r in res.values():
        assert bool(torch.isinf(r["buf"][big]).all())
        assert bool(torch.isfinite(r["buf"][res[0]["absum"] < 6e4]).all())  # no addend nor sum overflowed
    ok = _as_tensors(run_ranks(_ring_wire, 2, 64, 64, "bf16", 4.0e4))
    assert bool(torch.isfinite(ok[0]["buf"]).all())
