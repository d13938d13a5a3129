"""What ``find_unused_parameters=True`` costs PyTorch's DDP on a small model (the ``torch_ddp`` candidate's choice).

Two ``DistributedDataParallel`` copies of the same tiny MLP on 2 gloo processes, one with and one without the
option, trained in alternating blocks of 25 steps in the same processes (so that load on a shared machine hits
both alike); prints the median step time of each and the per-block ratio (median and quartiles). With the
option DDP all-reduces a map of the parameters used in the step, one more collective per step, which on gloo
costs about as much as the gradient all-reduce itself on a model this small.

    python benchmarks/ddp_find_unused.py [--blocks 40] [--steps 25]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def _run(rank: int, world: int, port: int, blocks: int, steps: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    models = {fu: torch.nn.parallel.DistributedDataParallel(_model(), find_unused_parameters=fu)
              for fu in (False, True)}
    opts = {fu: torch.optim.SGD(m.parameters(), lr=0.01) for fu, m in models.items()}
    x, y = torch.randn(32, 32), torch.randint(0, 10, (32,))
    medians: dict[bool, list[float]] = {False: [], True: []}
    for blk in range(blocks):
        for fu in ((False, True) if blk % 2 == 0 else (True, False)):
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                opts[fu].zero_grad()
                torch.nn.functional.cross_entropy(models[fu](x), y).backward()
                opts[fu].step()
                times.append(time.perf_counter() - t0)
            if blk >= 4:  # (the first blocks warm up)
                medians[fu].append(statistics.median(times))
    if rank == 0:
        off, on = (1e3 * statistics.median(medians[k]) for k in (False, True))
        r = sorted(b / a for a, b in zip(medians[False], medians[True]))
        print(f"find_unused_parameters=False {off:.3f} ms, True {on:.3f} ms per step; per-block ratio median "
              f"{statistics.median(r):.3f} (quartiles {r[len(r) // 4]:.3f}-{r[3 * len(r) // 4]:.3f})")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=40)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--port", type=int, default=29533)
    a = p.parse_args()
    if a.blocks < 6 or a.steps < 1:
        p.error(f"--blocks must be >= 6 (4 warm up) and --steps >= 1, got {a.blocks} and {a.steps}")
    mp.spawn(_run, args=(2, a.port, a.blocks, a.steps), nprocs=2)


if __name__ == "__main__":
    main()
