"""``gradient_as_bucket_view``: ``.grad`` is a view into the engine's flat bucket, nothing is copied.

On 2 gloo ranks with real autograd (post-accumulate-grad hooks hand gradients to the engine, as the
strategy's hooks do): every ``.grad`` lies inside its bucket's storage, holds exactly the averaged
gradient (sum over both ranks / 2, computed locally for both ranks' inputs), and the engine copied
nothing; accumulation over two backward passes happens in the view; ``zero_grad(set_to_none=True)``
is undone by :meth:`CommEngine.attach_views`; a ``.grad`` that user code replaced is copied once and
re-pointed; a parameter that no rank used keeps ``.grad = None``. Refused buckets (16-bit wire format,
compression, non-contiguous parameters) keep the copy path, and the strategy logs the reason once.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest
import torch

from lightning_pipedap.engine.buckets import FlatBucket
from lightning_pipedap.engine.engine import view_refusal
from lightning_pipedap.schedule import Op, OpKind, Schedule
from tests._dist_util import run_lightning_ranks, run_ranks

RS, AG, AR = OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.ALL_REDUCE


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _batch(rank: int, k: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * k + rank))


def _local_grads(xs: list[torch.Tensor], extra: bool = False) -> list[torch.Tensor]:
    """Gradients of ``sum(model(x).pow(2))`` accumulated over ``xs`` (one fresh model, no engine)."""
    m = _model()
    for x in xs:
        m(x).pow(2).sum().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    return grads + [torch.zeros(2)] if extra else grads


def _in_bucket(grad: torch.Tensor, bucket: FlatBucket) -> bool:
    start = bucket.buffer.data_ptr()
    end = start + bucket.buffer.numel() * bucket.buffer.element_size()
    same_storage = grad.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()
    return start <= grad.data_ptr() < end and same_storage


def _run(rank, world, wire):
    from lightning_pipedap.engine import collectives as C
    from lightning_pipedap.engine.engine import CommEngine

    comm = C.new_comm_group(timeout_s=30, chunk_bytes=64)
    model = _model()
    unused = torch.nn.Parameter(torch.zeros(2))  # never in the graph
    params = list(model.parameters()) + [unused]
    # bucket 0: the first Linear (RS + AG), bucket 1: the second (AR), bucket 2: the unused parameter (AR)
    schedule = Schedule(buckets=((0, 1), (2, 3), (4,)), ops=(Op(AR, 1), Op(RS, 0), Op(AR, 2), Op(AG, 0)),
                        name="zc", wire16=(wire, False, False))
    engine = CommEngine(comm, params, schedule, wait_timeout_s=30, wire_dtype="fp16" if wire else "fp32",
                        bucket_view=True)
    index = {id(p): i for i, p in enumerate(params)}
    hooks = [p.register_post_accumulate_grad_hook(
        lambda p: engine.grad_ready(index[id(p)], p.grad) if engine.collecting else None) for p in params]
    out: dict = {"refusals": {str(k): v for k, v in engine.view_refusals.items()}, "rounds": []}

    def reduced() -> dict:
        engine.finish_backward()
        engine.wait_idle()
        used = [engine.used_flags(b) for b in range(engine.num_buckets)]
        return {"used": used, "copies": engine.copies,
                "in_bucket": [p.grad is not None and _in_bucket(p.grad, engine.buckets[engine._slot_of[i][0]])
                              for i, p in enumerate(params)],
                "grads": [None if p.grad is None else p.grad.tolist() for p in params]}

    try:
        # round 1: .grad None -> attached views; one backward; the engine copies nothing
        engine.attach_views()
        out["attached_before_backward"] = [
            p.grad is not None and _in_bucket(p.grad, engine.buckets[engine._slot_of[i][0]])
            for i, p in enumerate(params)]
        engine.begin_iteration()
        model(_batch(rank, 0)).pow(2).sum().backward()
        out["rounds"].append(reduced())
        # round 2: zero_grad(set_to_none=True), then two micro-batches accumulated in the views (the first
        # one without communication, as under no_sync / accumulate_grad_batches)
        for p in params:
            p.grad = None
        engine.attach_views()
        model(_batch(rank, 1)).pow(2).sum().backward()
        engine.begin_iteration()
        model(_batch(rank, 2)).pow(2).sum().backward()
        out["rounds"].append(reduced())
        # round 3: user code replaced one .grad with its own tensor (zero_grad(set_to_none=False) elsewhere)
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        params[2].grad = torch.zeros_like(params[2])
        engine.attach_views()
        engine.begin_iteration()
        model(_batch(rank, 3)).pow(2).sum().backward()
        out["rounds"].append(reduced())
    finally:
        for h in hooks:
            h.remove()
        engine.close()
    C.destroy_comm_group(comm)
    return out


def _average(rounds_of_batches: list[int]) -> list[torch.Tensor]:
    per_rank = [_local_grads([_batch(r, k) for k in rounds_of_batches], extra=True) for r in range(2)]
    return [(a + b) / 2 for a, b in zip(*per_rank)]


@pytest.mark.multiprocess
def test_grads_are_bucket_views_with_ddp_values_and_no_copy():
    res = run_ranks(_run, 2, False)
    for rank in (0, 1):
        r = res[rank]
        assert r["refusals"] == {}
        assert r["attached_before_backward"] == [True] * 5  # every None .grad pointed at its zeroed view
        for k, (batches, copies) in enumerate([([0], 0), ([1, 2], 0), ([3], 1)]):
            rnd = r["rounds"][k]
            assert rnd["copies"] == copies, (k, rnd["copies"])  # only the .grad user code replaced is copied (once)
            assert rnd["in_bucket"][:4] == [True] * 4, k  # (also the replaced one: re-pointed at its view)
            assert rnd["grads"][4] is None  # unused on every rank: .grad None again, as under DDP
            assert rnd["used"][2] == [False]
            want = _average(batches)
            for i in range(4):
                got = torch.tensor(rnd["grads"][i])
                assert torch.allclose(got, want[i], rtol=0, atol=1e-6), (k, i, float((got - want[i]).abs().max()))
    assert res[0]["rounds"] == res[1]["rounds"]  # every rank sees the same averaged gradients


@pytest.mark.multiprocess
def test_refused_bucket_keeps_the_copy_path():
    """A 16-bit wire bucket is refused: its gradients are copied (and ``.grad`` is autograd's own tensor),
    the other buckets stay views."""
    res = run_ranks(_run, 2, True)
    r = res[0]
    assert list(r["refusals"]) == ["0"] and "16-bit wire format" in r["refusals"]["0"]
    assert r["attached_before_backward"] == [False, False, True, True, True]  # (refused: autograd's own tensors)
    rnd = r["rounds"][0]
    assert rnd["in_bucket"][:4] == [False, False, True, True]
    assert rnd["copies"] == 2  # the two parameters of the refused bucket


def test_view_refusal_reasons():
    ok = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(4))]
    bucket = FlatBucket.allocate(0, (0, 1), ok, world_size=2)
    assert view_refusal(bucket) is None
    assert "compressed" in view_refusal(bucket, compressed=True)
    assert "16-bit wire format" in view_refusal(bucket, wire16=True)
    strided = [torch.nn.Parameter(torch.zeros(4, 3).t())]  # a transposed (non-contiguous) weight
    reason = view_refusal(FlatBucket.allocate(0, (7,), strided, world_size=2))
    assert reason is not None and "parameter 7" in reason and "not a contiguous" in reason


# ------------------------------------------------------------------------------- the strategy logs the refusal
def _fit_and_capture(out_path: str) -> None:
    """Run on 2 ranks by the test below: a Lightning fit with ``wire_dtype="fp16"`` (every bucket refused)."""
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipedap import PipeDAPStrategy

    messages: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger("lightning_pipedap").addHandler(Grab())

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 6, generator=g), torch.randn(32, 3, generator=g))
    strategy = PipeDAPStrategy(schedule="dear", bucket_cap_mb=0.0001, wire_dtype="fp16", gradient_as_bucket_view=True)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net(), DataLoader(data, batch_size=4))
    if trainer.global_rank == 0:
        with open(out_path, "w") as f:
            json.dump(messages, f)


@pytest.mark.multiprocess
def test_strategy_logs_the_refusal_once(tmp_path):
    out = tmp_path / "messages.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run_lightning_ranks(["-m", "tests.test_engine_zero_copy", str(out)], world=2, timeout_s=300, cwd=root)
    refusals = [m for m in json.loads(out.read_text()) if "gradient_as_bucket_view" in m]
    assert refusals, "the refusal was not logged"
    assert all("keeps the copy path" in m and "16-bit wire format" in m for m in refusals)
    assert len(refusals) == len(set(refusals)) == 1  # one reason, logged once for the whole fit


if __name__ == "__main__":
    _fit_and_capture(sys.argv[1])
