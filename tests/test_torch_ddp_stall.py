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


def _rank_dependent_stall_fit(out_dir: str) -> None:
    """One rank's fit (run by :func:`test_a_parameter_unused_on_one_rank_only_names_the_cause_on_every_rank`):
    ``extra`` is used on every rank until DDP's reducer is installed (forced as the trial's choice), then on
    rank 0 only. Each rank writes the error its fit ended with."""
    import json
    import os

    import torch.nn.functional as F

    import lightning.pytorch as pl
    import lightning_pipedap.strategy.controller as ctl
    from lightning_pipedap import PipeDAPStrategy
    from tests.parity_cases import Unused, make_data

    real = ctl.choose_candidate

    def forced(names, windows, floor=None, **kw):
        best, medians, notes = real(names, windows, floor, **kw)
        return (list(names).index("torch_ddp") if "torch_ddp" in names else best), medians, notes

    ctl.choose_candidate = forced

    class UnusedOnRank1AfterInstall(Unused):
        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self(x)
            under_ddp = (self.trainer.strategy.installed_schedule or "").startswith("torch_ddp")
            if self.global_rank == 0 or not under_ddp:
                out = self.extra(out)
            return F.cross_entropy(out, y)

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    strategy = PipeDAPStrategy(schedule="optimal", bucket_cap_mb=0.002, plan_trials=2, trial_steps=1,
                               startup_budget=None, trial_rounds=1, trial_window_s=0, wait_timeout_s=5, timeout=60,
                               find_unused_parameters=False)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    rank = int(os.environ["RANK"])
    try:
        trainer.fit(UnusedOnRank1AfterInstall(opt="sgd"), make_data()[0])
        error = None
    except Exception as exc:  # noqa: BLE001  (the test reads the message)
        error = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"error": error, "installed": strategy.installed_schedule}, f)
    os._exit(0)  # (the group is broken: no teardown collective)


@pytest.mark.multiprocess
def test_a_parameter_unused_on_one_rank_only_names_the_cause_on_every_rank(tmp_path):
    """``extra`` stops getting a gradient on rank 1 only, after DDP's reducer (without
    ``find_unused_parameters``: passed False here, the user vouching as under DDP's default) took over: rank 1's
    reduction stalls while rank 0's bucket all-reduces wait for it. Rank 1 raises an error naming the parameter and the
    remedy after ``min(60 s, wait_timeout_s)``; rank 0, whose DDP backward then fails inside gloo, raises one that names
    rank 1's stall (it printed only gloo's error before)."""
    import json
    import os

    from tests._dist_util import run_lightning_ranks

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run_lightning_ranks(["-m", "tests.test_torch_ddp_stall", str(tmp_path)], world=2, timeout_s=300, cwd=root)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["installed"].startswith("torch_ddp") and "find_unused_parameters" not in r0["installed"], r0
    assert r1["error"] and "rank 1: extra.weight, extra.bias got no gradient" in r1["error"], r1
    assert "but rank(s) [0] had one" in r1["error"] and "find_unused_parameters at its default" in r1["error"], r1
    assert r0["error"] and "rank 0: DDP's reducer failed" in r0["error"], r0
    assert "rank(s) [1] got no gradient for a parameter that this rank used" in r0["error"], r0
    assert "find_unused_parameters at its default" in r0["error"], r0


if __name__ == "__main__":
    import sys

    _rank_dependent_stall_fit(sys.argv[1])
