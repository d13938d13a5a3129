"""DDP's reducer without ``find_unused_parameters`` when a parameter stops getting a gradient.

The ``torch_ddp`` candidate runs DDP without the option when every parameter had a gradient in the profiled
steps (the option costs one more all-reduce per step). A later backward that leaves a parameter out stalls
DDP's reduction: ``.grad`` keeps the local gradients (DDP writes back only when every bucket is reduced) and
the next forward raises. :func:`ddp_reduction_finished` sees the stall, :func:`finish_stalled_reduction`
averages the local gradients as DDP *with* the option does. Checked on 2 gloo ranks against DDP with
``find_unused_parameters=True`` on the same inputs, with several buckets so that some were launched before the
stall and some not; the parameters unused on every rank keep ``.grad = None``. (A parameter unused on some
ranks only stalls those ranks alone: DDP on the others then waits for bucket all-reduces that never come, and
the stalled ranks' averaging, on pipedap's own group, times out with gloo's error instead of pairing with them.)
"""

from __future__ import annotations

import pytest
import torch

from tests._dist_util import run_ranks


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 5)

    def forward(self, x: torch.Tensor, skip_a: bool) -> torch.Tensor:
        x = x if skip_a else torch.tanh(self.a(x))
        return self.c(torch.tanh(self.b(x)))


def _grads(rank: int, world: int, find_unused: bool, comm) -> tuple[list, tuple]:
    import lightning_pipedap.engine.collectives as C

    torch.manual_seed(0)
    net = _Net()
    ddp = torch.nn.parallel.DistributedDataParallel(net, find_unused_parameters=find_unused, bucket_cap_mb=0.01)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    ddp(x, False).pow(2).sum().backward()  # every parameter used: DDP finishes
    first = C.ddp_reduction_finished(ddp)
    net.zero_grad()
    ddp(x, True).pow(2).sum().backward()  # a.* unused on every rank
    finished = C.ddp_reduction_finished(ddp)
    unused = None if finished else C.finish_stalled_reduction([p for p in net.parameters()], comm)
    return [None if p.grad is None else p.grad.tolist() for p in net.parameters()], (first, finished, unused)


def _case(rank: int, world: int) -> dict:
    import lightning_pipedap.engine.collectives as C

    comm = C.new_comm_group(timeout_s=30)
    ref, _ = _grads(rank, world, True, comm)
    got, state = _grads(rank, world, False, comm)
    C.destroy_comm_group(comm)
    return {"ref": ref, "got": got, "state": state}


@pytest.mark.multiprocess
def test_a_stalled_ddp_reduction_is_finished_as_ddp_with_find_unused_parameters():
    out = run_ranks(_case, 2, timeout_s=120)
    for rank, r in out.items():
        first, finished, unused = r["state"]
        assert first is True and finished is False  # (DDP finished with every parameter used, then stalled)
        assert unused == [0, 1]  # a.weight, a.bias: no rank had a gradient
        assert r["got"][0] is None and r["got"][1] is None  # (.grad None kept, as DDP with the option)
        for g, ref in zip(r["got"], r["ref"]):
            assert (g is None) == (ref is None)
            if ref is not None:  # (2 ranks: a/2 + b/2 in either layout, bit-identical)
                assert torch.equal(torch.tensor(g), torch.tensor(ref)), (rank, g, ref)
