"""Short CUDA/NCCL check of the engine (run on a GPU machine; exits 0 with SKIP without one).

    python scripts/gpu_check.py

With one GPU it runs a 1-rank NCCL group (collectives are then local copies, but the CUDA path is
real: the comm stream, event hand-offs between the autograd thread, the worker and the main
stream, and the deferred per-bucket update). With N GPUs it starts N ranks and also checks that
the reduced gradient equals the mean over ranks. Prints one line per check and ``GPU CHECK OK``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    from lightning_pipedap.engine import collectives as C
    from lightning_pipedap.engine.engine import CommEngine
    from lightning_pipedap.engine.update import BucketOptimizer, snapshot_hparams
    from lightning_pipedap.schedule import builtin_schedule

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    comm = C.new_comm_group(timeout_s=120)
    assert comm.backend == "nccl" and not comm.uses_ring
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)]).cuda()
    params = list(model.parameters())
    sizes = [p.numel() * 4 for p in params]
    for name in ("allreduce", "dear"):
        sched = builtin_schedule(name, sizes, 2 << 20)
        engine = CommEngine(comm, params, sched, wait_timeout_s=120)
        torch.manual_seed(1 + rank)
        x = torch.randn(64, 512, device="cuda")
        model.zero_grad()
        engine.begin_iteration()
        handles = [p.register_post_accumulate_grad_hook(lambda q, i=i: engine.grad_ready(i, q.grad))
                   for i, p in enumerate(params)]
        model(x).square().mean().backward()
        engine.finish_backward()
        local = [p.grad.detach().clone() for p in params]
        mean = [g.clone() for g in local]
        for g in mean:
            dist.all_reduce(g)
            g /= world
        opt = torch.optim.SGD(params, lr=0.1)
        upd = BucketOptimizer(opt, engine.buckets, lambda b: False)  # (no split parameter)
        hp = snapshot_hparams(opt)
        before = [p.detach().clone() for p in params]
        with torch.no_grad():
            for b in range(engine.num_buckets):
                upd.step(engine.wait_done(b), hp, None, None)
        torch.cuda.synchronize()
        err = max(float((p - (b0 - 0.1 * m)).abs().max()) for p, b0, m in zip(params, before, mean))
        engine.close()
        for h in handles:
            h.remove()
        print(f"rank {rank} {name}: max |update - expected| = {err:.2e}", flush=True)
        assert err < 1e-5, err
    C.destroy_comm_group(comm)
    dist.destroy_process_group()


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device (this check needs a GPU)")
        return 0
    world = torch.cuda.device_count()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(world, port), nprocs=world, start_method="spawn")
    print("GPU CHECK OK")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
