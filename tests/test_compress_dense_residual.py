"""Error-feedback residuals of parameters that are now sent dense reach the other ranks exactly once.

A re-plan (or the warm-up/profiling steps, or a resumed run's plan) can stop compressing a parameter
whose residual holds what earlier compressions of this rank left out. The strategy then adds that
residual once to the parameter's next gradient in its bucket (``CommEngine.carry``)
and clears it; residuals of parameters that stay compressed go into the helper's state as before.
Units: the bucket holds the local gradient divided by the world size N, and so does a residual, so
after the reduction a dense bucket holds ``sum_r (g_r / N + res_r)``, the same as a compressed bucket
whose compressor sends everything (top-k with ratio 1) after compensating its residual.
"""

from __future__ import annotations

import pytest
import torch

from lightning_pipedap.compress.state import add_residuals, split_residuals
from tests._dist_util import run_ranks

SHAPES = {"0.weight": (2, 3), "0.bias": (2,), "1.weight": (2, 2), "1.bias": (2,)}


def _residual(name: str, rank: int) -> torch.Tensor | None:
    """This rank's saved residual of ``name`` (flat fp32), known values; None for ``1.bias``."""
    n = torch.Size(SHAPES[name]).numel()
    if name == "0.weight":
        return (rank + 1) * 0.25 * torch.arange(n, dtype=torch.float32)  # dense bucket 0
    if name == "1.weight":
        return (rank + 1) * 0.5 * torch.ones(n)  # compressed bucket 1
    if name == "0.bias":
        return torch.zeros(n)  # nothing to deliver
    return None


def _grad(i: int, rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    n = torch.Size(shape).numel()
    return ((rank + 1) * torch.arange(n, dtype=torch.float32) + 10 * i).reshape(shape)


def _state(rank: int) -> dict:
    return {"version": 1, "compressor": "topk", "kwargs": {"ratio": 1.0},
            "params": {name: {"shape": list(s), "step": 3, "residual": _residual(name, rank), "tensors": {}}
                       for name, s in SHAPES.items()}}


def _ranks(rank: int, world: int) -> dict:
    import torch.nn as nn

    from lightning_pipedap.compress import CompressionPipeline
    from lightning_pipedap.engine import collectives as C
    from lightning_pipedap.engine.compressed import CompressedTransport
    from lightning_pipedap.engine.engine import CommEngine
    from lightning_pipedap.schedule import Op, OpKind, Schedule

    RS, AG = OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER
    comm = C.new_comm_group(timeout_s=60)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    from lightning_pipedap.strategy.resume import CompressionCarry

    name_of = {id(p): n for n, p in model.named_parameters()}

    def info(engine):
        return {i: (name_of[id(p)], tuple(p.shape)) for b in engine.buckets for i, p in zip(b.param_indices, b.params)}

    carry = CompressionCarry("topk", {"ratio": 1.0}, info, log=lambda message: None)

    def factory(buckets):
        pipe = CompressionPipeline([b.numel for b in buckets], "topk", {"ratio": 1.0}, threads=1, timeout_s=60,
                                   mode="inline",
                                   layouts=[[(name_of[id(p)], tuple(p.shape)) for p in b.params] for b in buckets])
        return CompressedTransport(pipe, comm)

    # bucket 0 (0.weight, 0.bias) dense RS + AG; bucket 1 (1.weight, 1.bias) compressed at its RS slot
    schedule = Schedule(((0, 1), (2, 3)), (Op(RS, 1), Op(RS, 0), Op(AG, 0), Op(AG, 1)), "mixed",
                        compressed=(False, True)).validate(len(params))
    engine = CommEngine(comm, params, schedule, wait_timeout_s=60, transport_factory=factory)
    out: dict = {"names": names}
    try:
        carry.state = _state(rank)
        carry.restore(engine)
        carried = engine.carry.take(clear=False)
        out["carried"] = {names[i]: v.tolist() for i, v in carried.items()}
        helper = engine.transport.pipeline.state_dict()["params"]
        out["helper_residual"] = {n: None if e["residual"] is None else e["residual"].tolist()
                                  for n, e in helper.items()}
        out["kept_after_restore"] = carry.state
        ckpt = carry.now(engine, take=False)["params"]  # what a checkpoint would hold
        out["ckpt_residual_0w"] = ckpt["0.weight"]["residual"].tolist()
        out["still_carried"] = sorted(names[i] for i in engine.carry.take(clear=False))
        rounds = []
        for _ in range(2):
            engine.begin_iteration()
            for i, p in enumerate(params):
                engine.grad_ready(i, _grad(i, rank, tuple(p.shape)))
            engine.finish_backward()
            got = {}
            for b in range(engine.num_buckets):
                bucket = engine.wait_done(b)
                for slot, i in enumerate(bucket.param_indices):
                    got[names[i]] = bucket.grad_view(slot).clone()
            rounds.append({n: v.tolist() for n, v in got.items()})
            out.setdefault("carried_after_round", sorted(names[i] for i in engine.carry.take(clear=False)))
        out["rounds"] = rounds
        engine.wait_idle()
        # a carried value not used before the engine is replaced goes back into the kept state
        engine.carry.add({1: torch.tensor([7.0, -7.0])})
        carry.keep(engine)
        out["kept_0b"] = carry.state["params"]["0.bias"]["residual"].tolist()
        out["carried_after_keep"] = len(engine.carry.take(clear=False))
        errors = []
        for bad in ({9: torch.zeros(1)}, {0: torch.zeros(5)}):
            try:
                engine.carry.add(bad)
            except ValueError as e:
                errors.append(str(e))
        out["errors"] = errors
    finally:
        engine.close()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_ranks, 2, timeout_s=120)


def test_dense_residual_added_once_and_compressed_one_goes_to_the_helper(results):
    world = 2
    for rank, out in results.items():
        assert out["carried"] == {"0.weight": _residual("0.weight", rank).tolist()}  # only the dense, non-zero one
        assert out["helper_residual"]["1.weight"] == _residual("1.weight", rank).tolist()
        assert out["helper_residual"]["0.weight"] is None  # not also in the helper: once
        assert out["kept_after_restore"] is None
        assert out["ckpt_residual_0w"] == _residual("0.weight", rank).tolist()  # a checkpoint keeps it
        assert out["still_carried"] == ["0.weight"]  # ... without consuming it
        assert out["carried_after_round"] == []
    dense_sum = lambda i, name: sum(_grad(i, r, SHAPES[name]).reshape(-1) / world for r in range(world))  # noqa: E731
    res_sum = lambda name: sum(_residual(name, r) for r in range(world))  # noqa: E731
    first = {"0.weight": dense_sum(0, "0.weight") + res_sum("0.weight"), "0.bias": dense_sum(1, "0.bias"),
             "1.weight": dense_sum(2, "1.weight") + res_sum("1.weight"), "1.bias": dense_sum(3, "1.bias")}
    second = {"0.weight": dense_sum(0, "0.weight"), "0.bias": dense_sum(1, "0.bias"),
              "1.weight": dense_sum(2, "1.weight"), "1.bias": dense_sum(3, "1.bias")}
    for out in results.values():
        for name in SHAPES:
            for k, expected in enumerate((first, second)):
                got = torch.tensor(out["rounds"][k][name]).reshape(-1)
                assert torch.allclose(got, expected[name], atol=1e-6), (k, name, got, expected[name])
    # hand check of one entry: 0.weight[1] in round 1 = (1 + 2) * 1 / 2 + (1 + 2) * 0.25 * 1
    assert results[0]["rounds"][0]["0.weight"][0][1] == pytest.approx(1.5 + 0.75)


def test_unused_carry_returns_to_the_kept_state_and_bad_input_is_named(results):
    for out in results.values():
        assert out["kept_0b"] == [7.0, -7.0]
        assert out["carried_after_keep"] == 0
        assert "parameter index 9 out of range; valid: 0..3" in out["errors"][0]
        assert "parameter 0 has 6 elements, the value has 5" in out["errors"][1]


def test_split_and_add_residuals_round_trip_without_modifying_the_input():
    saved = _state(1)
    state, taken = split_residuals(saved, ["0.weight", "0.bias", "1.bias", "not.a.param"])
    assert list(taken) == ["0.weight"]  # zero and missing residuals are not delivered
    assert torch.equal(taken["0.weight"], _residual("0.weight", 1))
    assert state["params"]["0.weight"]["residual"] is None and state["params"]["0.weight"]["step"] == 3
    assert state["params"]["0.bias"]["residual"] is None
    assert torch.equal(state["params"]["1.weight"]["residual"], _residual("1.weight", 1))
    assert torch.equal(saved["params"]["0.weight"]["residual"], _residual("0.weight", 1))  # input untouched
    back = add_residuals(state, taken, SHAPES, "topk", {"ratio": 1.0})
    assert torch.equal(back["params"]["0.weight"]["residual"], _residual("0.weight", 1))
    summed = add_residuals(back, {"0.weight": torch.ones(6)}, SHAPES, "topk", {})
    assert summed["params"]["0.weight"]["residual"].tolist() == [1.0 + 0.5 * k for k in range(6)]
    assert back["params"]["0.weight"]["residual"].tolist() == [0.5 * k for k in range(6)]
    fresh = add_residuals(None, {"1.bias": torch.tensor([[2.0, 3.0]])}, SHAPES, "topk", {"ratio": 1.0})
    assert fresh["compressor"] == "topk" and fresh["params"]["1.bias"]["residual"].tolist() == [2.0, 3.0]
    assert add_residuals(None, {}, SHAPES, "topk", {}) is None
    with pytest.raises(ValueError, match=r"'0.bias': residual has 3 elements, the parameter \(2,\) has 2"):
        add_residuals(saved, {"0.bias": torch.zeros(3)}, SHAPES, "topk", {})
    with pytest.raises(ValueError, match="no shape for parameter 'x'"):
        add_residuals(None, {"x": torch.zeros(1)}, {}, "topk", {})
