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
