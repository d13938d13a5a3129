"""Layout-independent compression state: per parameter name, across re-fused buckets, in checkpoints (no processes)."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from lightning_pipedap.compress import CompressionRuntime
from lightning_pipedap.compress.state import (
    CHECKPOINT_KEY,
    check_layouts,
    checkpoint_entry,
    state_for_rank,
)

W1, B1, W2 = ("w1", (6, 8)), ("b1", (6,)), ("w2", (5, 6))
NUMEL = 48 + 6 + 30
TWO_BUCKETS = [[W1, B1], [W2]]  # one plan's fusion ...
OTHER_TWO = [[W1], [B1, W2]]  # ... and another's, after a re-plan or a resume
PSGD = {"rank": 2, "min_compression_rate": 1.0}


def step(rt: CompressionRuntime, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One single-rank step over every bucket; returns the decompressed gradient per parameter name."""
    out = {}
    for b, entries in enumerate(rt.layouts):
        g = torch.cat([grads[name].reshape(-1) for name, _ in entries])
        p = rt.compress(b, g)
        while not p.final:
            p = rt.next_round(b, p)
        dense = rt.decompress(b, p) if rt.compressor.summable else rt.compressor.aggregate([p])
        off = 0
        for name, shape in entries:
            k = torch.Size(shape).numel()
            out[name] = dense[off : off + k].clone()
            off += k
    return out


def random_grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in (W1, B1, W2)}


def numels(layout) -> list[int]:
    return [sum(torch.Size(s).numel() for _, s in entries) for entries in layout]


def test_powersgd_state_moves_to_other_buckets_and_continues_identically():
    a = CompressionRuntime(numels(TWO_BUCKETS), "powersgd", PSGD, TWO_BUCKETS)
    for s in range(4):  # steps 0, 1 dense; 2, 3 compressed
        step(a, random_grads(s))
    sd = a.state_dict()
    assert sorted(sd["params"]) == ["b1", "w1", "w2"]
    assert {k: p["step"] for k, p in sd["params"].items()} == {"w1": 4, "b1": 4, "w2": 4}
    assert sd["params"]["w1"]["tensors"]["q"].shape == (8, 2) and sd["params"]["w2"]["tensors"]["q"].shape == (6, 2)
    assert sd["params"]["b1"]["tensors"] == {} and not sd["params"]["b1"]["residual"].any()  # biases are sent exactly
    # the residual slices are the bucket residuals cut at the parameter offsets
    assert torch.equal(torch.cat([sd["params"]["w1"]["residual"], sd["params"]["b1"]["residual"]]),
                       a.states[0].residual)
    assert torch.equal(sd["params"]["w2"]["residual"], a.states[1].residual)

    b = CompressionRuntime(numels(OTHER_TWO), "powersgd", PSGD, OTHER_TWO)
    assert b.load_state_dict(sd) == []
    assert [st.step for st in b.states] == [4, 4]
    assert torch.equal(b.states[1].residual,
                       torch.cat([sd["params"]["b1"]["residual"], sd["params"]["w2"]["residual"]]))
    for s in range(4, 7):  # one matrix per parameter, seeds by name: the fusion does not matter
        ga, gb = step(a, random_grads(s)), step(b, random_grads(s))
        assert all(torch.equal(ga[k], gb[k]) for k in ga), s
    # and without the state the continuation differs (warm start and error feedback matter)
    c = CompressionRuntime(numels(OTHER_TWO), "powersgd", PSGD, OTHER_TWO)
    c.load_state_dict({**sd, "params": {k: {**p, "residual": None, "tensors": {}} for k, p in sd["params"].items()}})
    a2 = CompressionRuntime(numels(TWO_BUCKETS), "powersgd", PSGD, TWO_BUCKETS)
    a2.load_state_dict(sd)
    assert not torch.equal(step(a2, random_grads(9))["w1"], step(c, random_grads(9))["w1"])


def test_topk_residual_mapped_by_name_and_new_parameters_start_from_zero():
    a = CompressionRuntime(numels(TWO_BUCKETS), "topk", {"ratio": 0.1}, TWO_BUCKETS)
    step(a, random_grads(0))
    sd = a.state_dict()
    w3 = ("w3", (2, 2))
    layout = [[W2, w3], [B1], [W1]]
    b = CompressionRuntime(numels(layout), "topk", {"ratio": 0.1}, layout)
    assert b.load_state_dict(sd) == ["w3"]
    assert torch.equal(b.states[0].residual[:30], sd["params"]["w2"]["residual"])
    assert b.states[0].residual[30:].tolist() == [0.0] * 4
    assert torch.equal(b.states[2].residual, sd["params"]["w1"]["residual"])
    assert [st.step for st in b.states] == [1, 1, 1]
    # a bucket none of whose parameters has saved state starts at step 0 without a residual
    c = CompressionRuntime([4], "topk", {"ratio": 0.1}, [[w3]])
    assert c.load_state_dict(sd) == ["w3"] and c.states[0].step == 0 and c.states[0].residual is None


def test_state_errors_name_the_bad_value():
    a = CompressionRuntime(numels(TWO_BUCKETS), "powersgd", PSGD, TWO_BUCKETS)
    sd = a.state_dict()
    with pytest.raises(ValueError, match=r"compression state version 7 is not supported; valid: 1"):
        a.load_state_dict({**sd, "version": 7})
    with pytest.raises(ValueError, match="holds compression state of 'powersgd', this run uses 'topk'"):
        CompressionRuntime(numels(TWO_BUCKETS), "topk", {}, TWO_BUCKETS).load_state_dict(sd)
    with pytest.raises(ValueError, match=r"parameter names \['w1'\] appear twice in the layouts \(bucket 1\)"):
        check_layouts([48, 48], [[W1], [W1]])
    with pytest.raises(ValueError, match=r"bucket 0: layout is empty"):
        check_layouts([1], [[]])
    assert check_layouts([3, 2], None) == ((("<bucket 0>", (3,)),), (("<bucket 1>", (2,)),))


def test_checkpoint_entry_selects_this_ranks_part_and_explains_mismatches():
    per_rank = [{"params": {"w": 0}}, {"params": {"w": 1}}]
    entry = checkpoint_entry(per_rank, "powersgd", {"rank": 4}, 2)
    assert entry == {"version": 1, "compressor": "powersgd", "kwargs": {"rank": 4}, "world_size": 2,
                     "per_rank": per_rank}
    assert state_for_rank(entry, "powersgd", 2, 1) == (per_rank[1], None)
    assert state_for_rank(None, "powersgd", 2, 0) == (None, None)
    state, why = state_for_rank(entry, "topk", 2, 0)
    assert state is None and why == ("the checkpoint holds compression state of compressor 'powersgd', this run uses "
                                     "compression='topk'")
    state, why = state_for_rank(entry, None, 2, 0)
    assert state is None and "compressor 'powersgd', this run uses compression=None" in why
    state, why = state_for_rank(entry, "powersgd", 4, 0)
    assert state is None and "world size 2, this run has world size 4" in why
    assert "format version 0" in state_for_rank({**entry, "version": 0}, "powersgd", 2, 0)[1]
    with pytest.raises(ValueError, match="got compression state of 2 ranks for world size 3"):
        checkpoint_entry(per_rank, "powersgd", {}, 3)


def test_checkpoint_entry_loads_with_weights_only():
    """Lightning loads local checkpoints with torch's default ``weights_only=True``: plain data only."""
    a = CompressionRuntime(numels(TWO_BUCKETS), "powersgd", PSGD, TWO_BUCKETS)
    for s in range(3):
        step(a, random_grads(s))
    buf = io.BytesIO()
    torch.save({CHECKPOINT_KEY: checkpoint_entry([a.state_dict(), a.state_dict()], "powersgd", PSGD, 2)}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)[CHECKPOINT_KEY]
    assert torch.equal(back["per_rank"][1]["params"]["w1"]["tensors"]["q"], a.states[0].param_tensors[0]["q"])


def test_strategy_load_checkpoint_keeps_rank_state_or_warns(tmp_path):
    from lightning_pipedap import PipeDAPStrategy
    from lightning_pipedap.strategy import PLAN_KEY

    st = PipeDAPStrategy(compression="powersgd", compression_kwargs={"rank": 4})
    assert (st.world_size, st.global_rank) == (1, 0)  # no cluster environment outside a Trainer
    mine = {"version": 1, "compressor": "powersgd", "kwargs": {}, "params": {}}
    path = tmp_path / "c.ckpt"
    plan = {"version": 1, "world_size": 1}
    torch.save({"state_dict": {}, PLAN_KEY: plan,
                CHECKPOINT_KEY: checkpoint_entry([mine], "powersgd", {"rank": 4}, 1)}, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a matching checkpoint gives no warning
        st.load_checkpoint(path)
    assert st._resume.compression == mine and st._resume.plan == plan

    for entry, words in [(checkpoint_entry([mine, mine], "powersgd", {}, 2), ["world size 2", "world size 1"]),
                         (checkpoint_entry([mine], "topk", {}, 1), ["'topk'", "compression='powersgd'"])]:
        torch.save({"state_dict": {}, CHECKPOINT_KEY: entry}, path)
        with pytest.warns(UserWarning, match="compression starts with fresh error-feedback state") as rec:
            st.load_checkpoint(path)
        assert all(w in str(rec[0].message) for w in words), str(rec[0].message)
        assert st._resume.compression is None and st._resume.plan is None
