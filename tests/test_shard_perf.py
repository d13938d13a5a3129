"""The sharded step's cheap paths (issue 30, step time): the shards' non-finite check by sums, and the ring
all-gather's ``during`` work (the worker steps bucket b+1 while AG(b) is in flight)."""

import pytest
import torch

from lightning_pipedap.engine.shard_step import nonfinite_shards
from tests._dist_util import run_ranks


class _Bucket:
    """The two things :func:`nonfinite_shards` reads of a bucket: its buffer and each rank's data range."""

    def __init__(self, buffer: torch.Tensor, world: int) -> None:
        self.buffer, self.world = buffer, world

    def own_data_range(self, rank: int) -> tuple[int, int]:
        s = self.buffer.numel() // self.world
        return rank * s, (rank + 1) * s


def test_nonfinite_shards_flags_only_buckets_with_nan_or_inf_in_this_ranks_shard():
    buckets = [_Bucket(torch.randn(8), 2), _Bucket(torch.randn(8), 2),
               _Bucket(torch.randn(8).to(torch.bfloat16), 2), _Bucket(torch.randn(6, dtype=torch.float64), 2)]
    assert nonfinite_shards(buckets, [0, 1, 2, 3], rank=0) == set()
    buckets[1].buffer[2] = float("nan")  # rank 0's shard of bucket 1
    buckets[2].buffer[1] = float("-inf")  # rank 0's shard of the bf16 bucket
    buckets[0].buffer[6] = float("inf")  # rank 1's shard: not this rank's
    assert nonfinite_shards(buckets, [0, 1, 2, 3], rank=0) == {1, 2}
    assert nonfinite_shards(buckets, [0, 1, 2, 3], rank=1) == {0}
    assert nonfinite_shards(buckets, [0, 3], rank=0) == set()  # (only the sharded buckets are read)
    assert nonfinite_shards(buckets, [], rank=0) == set()


def test_nonfinite_shards_returns_a_shard_whose_sum_overflowed_so_it_is_counted_element_by_element():
    big = torch.full((4,), 3e38)  # finite elements whose fp32 sum is inf
    assert nonfinite_shards([_Bucket(big, 2)], [0], rank=0) == {0}
    assert bool(big[:2].isfinite().all())  # (the element-wise counts the caller then takes are zero)


def _gather_during(rank: int, world: int, numel: int, chunk_bytes: int):
    from lightning_pipedap.engine import collectives as C

    comm = C.new_comm_group(timeout_s=60, chunk_bytes=chunk_bytes)
    data = torch.arange(world * numel, dtype=torch.float32) * (rank + 1)
    plain = data.clone()
    plain.view(world, -1)[rank].copy_(data.view(world, -1)[rank])
    C.ring_all_gather_(plain, comm)
    calls = []
    other = torch.zeros(3)
    buf = data.clone()
    C.all_gather_(buf, comm, during=lambda: (calls.append(1), other.add_(1)))
    failing = data.clone()
    error = ""
    try:
        C.ring_all_gather_(failing, comm, during=lambda: 1 / 0)
    except ZeroDivisionError as exc:
        error = type(exc).__name__
    after = data.clone()
    C.ring_all_gather_(after, comm)  # (the group still works: the failed call finished its transfers)
    C.destroy_comm_group(comm)
    return {"same": bool(torch.equal(buf, plain)), "calls": len(calls), "other": other.tolist(), "error": error,
            "failing_same": bool(torch.equal(failing, plain)), "after_same": bool(torch.equal(after, plain))}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,numel,chunk_bytes", [(2, 1001, 64), (3, 333, 128)])
def test_ring_all_gather_runs_during_once_while_in_flight_and_reraises_after_the_transfers(world, numel, chunk_bytes):
    res = run_ranks(_gather_during, world, numel, chunk_bytes)
    for rank, r in res.items():
        assert r == {"same": True, "calls": 1, "other": [1.0, 1.0, 1.0], "error": "ZeroDivisionError",
                     "failing_same": True, "after_same": True}, (rank, r)


def test_land_params_skips_the_in_place_range_of_contiguous_parameters_only():
    from lightning_pipedap.engine.shard_step import land_params
    from tests.test_shard_step import land_case

    params, buckets = land_case()
    land_params(buckets[0], (5, 17))  # (parameter 0's elements 5..11 and the transposed one's 0..4 are "in place")
    flat0 = torch.arange(12.0)
    flat0[5:] = 0.0
    assert torch.equal(params[0].reshape(-1), flat0)
    assert torch.equal(params[1].reshape(-1), torch.arange(12.0, 24.0))  # (not contiguous: copied whole)
    land_params(buckets[1], (1, 2))
    land_params(buckets[2], (0, 3))  # (the whole piece held already)
    assert torch.equal(params[2], torch.tensor([100.0, 0.0, 0.0, 0.0, 0.0]))
