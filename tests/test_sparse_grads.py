"""Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) are reduced exactly as DDP
reduces them.

The models and runs are in ``tests/sparse_cases.py`` (one launch of 2 ranks and one of 3, every fit of a launch in
the same processes): a word2vec skip-gram with ``SparseAdam`` (two sparse tables, no dense parameter), a
fastText-style classifier with a sparse ``EmbeddingBag`` and dense layers (``SparseAdam`` + ``Adam`` under manual
optimization; one ``SGD`` with two param groups), trained with ``"ddp"``, ``strategy="pipedap"`` and
``PipeDAPStrategy(schedule="dear", bucket_cap_mb=0.002)``.

Expected: at 2 ranks every parameter is bit-identical to DDP's (a two-term sum does not depend on its order). At 3
ranks the sparse tables are reduced by the same gloo sparse all-reduce as DDP's (every rank's indices and values
added in rank order), so the skip-gram model, whose every gradient is sparse, stays bit-identical; the dense layers
are summed by pipedap's ring reduce-scatter in another order than gloo's dense all-reduce DDP calls, (a + b) + c vs
(b + c) + a, which differs in the last bit of fp32 (2^-24 relative), and the tables then follow those layers: within
1e-6. Two pipedap runs are bit-identical, and so are the replicas.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest
import torch

from lightning_pipedap.strategy.config import PipeDAPConfig
from lightning_pipedap.strategy.runtime import refuse_sparse_with
from tests._dist_util import run_lightning_ranks

ROOT = Path(__file__).resolve().parents[1]
TOL_3 = 1e-6

JOBS_2 = ["reducer:unit:0",
          "skipgram:ddp:0", "skipgram:default:0", "skipgram:default:1", "skipgram:dear:0", "skipgram:dear:1",
          "bag_two_opt:ddp:0", "bag_two_opt:default:0", "bag_two_opt:dear:0", "bag_two_opt:dear:1",
          "bag_sgd_long:ddp:0", "bag_sgd_long:default:0", "bag_sgd_long:dear:0", "bag_sgd_long:torch_ddp:0",
          "bag_accum:ddp:0", "bag_accum:dear:0",
          "bag_empty:ddp:0", "bag_skip:default:0", "bag_skip_all:default:0",
          "skipgram:fabric_ddp:0", "skipgram:fabric_dear:0",
          "skipgram:wire16:0",  # (refused at set-up: the last pipedap fit of the launch)
          "bag_skip_all:ddp_unused:0"]  # (DDP raises inside backward: last)
JOBS_3 = [f"{case}:{variant}:0" for case in ("skipgram", "bag_two_opt", "bag_sgd")
          for variant in ("ddp", "default", "dear")]


def _launch(tmp_path_factory, world: int, jobs: list[str]) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp(f"sparse{world}")
    run_lightning_ranks(["-m", "tests.sparse_cases", str(out), *jobs], world=world, timeout_s=600, cwd=str(ROOT))
    runs: dict[str, list[dict]] = {}
    for job in jobs:
        files = sorted(glob.glob(os.path.join(out, job.replace(":", ".") + ".r*.pt")))
        assert len(files) == world, f"{job}: {len(files)} of {world} ranks wrote a result"
        runs[job] = [torch.load(f, weights_only=False) for f in files]
    return runs


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _launch(tmp_path_factory, 2, JOBS_2)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    return _launch(tmp_path_factory, 3, JOBS_3)


def _ok(runs: dict, job: str) -> list[dict]:
    outs = runs[job]
    for r, o in enumerate(outs):
        assert "error" not in o, f"{job} rank {r}: {o['error_type']}: {o['error']}\n{o.get('trace', '')[-3000:]}"
    return outs


def _diff(a: dict, b: dict) -> tuple[float, bool]:
    """(max |a - b| over every tensor, bitwise equal everywhere)."""
    assert a.keys() == b.keys()
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    return worst, all(torch.equal(a[k], b[k]) for k in a)


def _check(runs: dict, job: str, ref_job: str, exact: bool) -> float:
    """``job`` against ``ref_job`` rank by rank; replicas of ``job`` bit-identical; the reference trained."""
    outs, refs = _ok(runs, job), _ok(runs, ref_job)
    moved = _diff(refs[0]["state"], refs[0]["init"])[0]
    assert moved > 1e-3, f"{ref_job} did not train"
    worst = 0.0
    for r, (o, ref) in enumerate(zip(outs, refs)):
        d, same = _diff(o["state"], ref["state"])
        worst = max(worst, d)
        assert same or (not exact and d <= TOL_3), f"{job} rank {r} vs {ref_job}: max |Δ| = {d:.3e}"
        assert _diff(o["state"], outs[0]["state"])[1], f"{job}: rank {r} differs from rank 0"
    if "installed" in outs[0]["info"]:
        assert outs[0]["info"]["update_counts"]["forward"] == 0  # (sparse gradients: sync mode, nothing deferred)
    return worst


# ------------------------------------------------------------------------------------------------ 2 ranks
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["skipgram", "bag_two_opt", "bag_sgd_long"])
@pytest.mark.parametrize("variant", ["default", "dear"])
def test_two_ranks_bit_identical_to_ddp(two, case, variant):
    _check(two, f"{case}:{variant}:0", f"{case}:ddp:0", exact=True)


@pytest.mark.multiprocess
def test_accumulated_sparse_gradients_bit_identical_to_ddp(two):
    """``accumulate_grad_batches=2``: the micro-batch's sparse gradient stays local and is reduced with the next."""
    _check(two, "bag_accum:dear:0", "bag_accum:ddp:0", exact=True)


@pytest.mark.multiprocess
@pytest.mark.parametrize("job", ["skipgram:default", "skipgram:dear", "bag_two_opt:dear"])
def test_two_pipedap_runs_bit_identical(two, job):
    a, b = _ok(two, f"{job}:0"), _ok(two, f"{job}:1")
    for r in range(2):
        assert _diff(a[r]["state"], b[r]["state"])[1], f"{job}: two runs differ on rank {r}"


@pytest.mark.multiprocess
def test_only_sparse_gradients_runs_an_engine_without_buckets(two):
    info = _ok(two, "skipgram:default:0")[0]["info"]
    assert info["installed"].startswith("allreduce: 0 buckets") and info["trials"] == []  # (nothing to plan)


@pytest.mark.multiprocess
def test_torch_ddp_candidate_stays_bit_identical(two):
    """Measured plan selection keeps DDP's reducer (``torch_ddp_margin=0.99``); DDP reduces the table natively."""
    info = _ok(two, "bag_sgd_long:torch_ddp:0")[0]["info"]
    assert info["installed"].startswith("torch_ddp") and "find_unused_parameters" in info["installed"], info
    _check(two, "bag_sgd_long:torch_ddp:0", "bag_sgd_long:ddp:0", exact=True)


@pytest.mark.multiprocess
def test_rank_without_gradient_contributes_nothing(two):
    """Rank 1 skips the lookup in one step per epoch: pipedap equals DDP run with an empty lookup on that rank
    (an empty sparse gradient); DDP itself raises for the skipped lookup, even with find_unused_parameters."""
    _check(two, "bag_skip:default:0", "bag_empty:ddp:0", exact=True)
    every_rank_skips = _ok(two, "bag_skip_all:default:0")
    assert _diff(every_rank_skips[0]["state"], every_rank_skips[1]["state"])[1]
    ddp = two["bag_skip_all:ddp_unused:0"]
    assert all(o.get("error") == "Expected sparse gradient to be defined." for o in ddp), ddp[0].get("error")


@pytest.mark.multiprocess
def test_reducer_unused_and_dense_gradients(two):
    """``a``: a gradient on rank 0 only; ``b``: none anywhere (``.grad`` stays None); ``c``: on every rank (the
    mean of the ranks' gradients, coalesced); then a dense gradient on one rank is refused on every rank."""
    outs = _ok(two, "reducer:unit:0")
    info = [o["info"] for o in outs]
    a0 = torch.zeros_like(info[0]["grads"][0])
    a0[torch.tensor([0, 1, 7])] = 0.5  # rank 0's rows, each looked up once, divided by the world size
    for i in info:
        assert torch.equal(i["grads"][0], a0) and i["grads"][1] is None and i["saw_unused"] and i["coalesced"]
        assert torch.allclose(i["grads"][2], (info[0]["local_c"] + info[1]["local_c"]) / 2, atol=1e-6)
        assert "'c'" in i["dense_error"] and "dense gradient" in i["dense_error"]
    assert torch.equal(info[0]["grads"][2], info[1]["grads"][2])


@pytest.mark.multiprocess
def test_fabric_bit_identical_to_ddp(two):
    fabric, ref = _ok(two, "skipgram:fabric_dear:0"), _ok(two, "skipgram:fabric_ddp:0")
    for o, r in zip(fabric, ref):
        assert _diff(o["state"], r["state"])[1]


@pytest.mark.multiprocess
def test_wire16_with_sparse_gradients_is_refused_at_setup(two):
    for o in two["skipgram:wire16:0"]:
        assert o.get("error_type") == "ValueError", o.get("error")
        assert "'u_embeddings.weight'" in o["error"] and "Valid: wire_dtype='fp32'" in o["error"]


def test_refusal_names_the_parameter_and_the_valid_choices():
    with pytest.raises(ValueError, match=r"parameter 'emb.weight' has sparse gradients \(EmbeddingBag\(sparse=True\)\)"
                                         r".*compression='topk' is not supported .* Valid: compression=None"):
        refuse_sparse_with(PipeDAPConfig(compression="topk"), "emb.weight", "EmbeddingBag(sparse=True)")
    with pytest.raises(ValueError, match=r"wire_dtype='fp16' is not supported .* Valid: wire_dtype='fp32'"):
        refuse_sparse_with(PipeDAPConfig(wire_dtype="fp16"), "emb.weight", "Embedding(sparse=True)")
    refuse_sparse_with(PipeDAPConfig(), "emb.weight", "Embedding(sparse=True)")  # (the defaults are fine)


# ------------------------------------------------------------------------------------------------ 3 ranks
@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["default", "dear"])
def test_three_ranks(three, variant):
    """Only sparse gradients: bit-identical; with dense layers: within 1e-6 (module docstring: the dense sum's
    order)."""
    _check(three, f"skipgram:{variant}:0", "skipgram:ddp:0", exact=True)
    for case in ("bag_two_opt", "bag_sgd"):
        _check(three, f"{case}:{variant}:0", f"{case}:ddp:0", exact=False)


def test_nonfinite_check_sees_sparse_gradients():
    """``nonfinite``: an averaged sparse gradient with NaN/inf is a finding (bucket -1), named as sparse."""
    from lightning_pipedap.engine.sparse import SparseGradReducer
    from lightning_pipedap.strategy.numerics import NonFiniteCheck

    table = torch.nn.Embedding(5, 2, sparse=True)
    reducer = SparseGradReducer(None, [table.weight], lambda p: "emb.weight")  # (first_nonfinite: no group used)
    said: list[str] = []
    check = NonFiniteCheck("warn", lambda p: "?", said.append)
    table(torch.tensor([1, 3])).sum().backward()
    assert check.scan_sparse(reducer) is None
    table.weight.grad = torch.sparse_coo_tensor([[1, 3]], [[float("nan"), 1.0], [float("inf"), 2.0]], (5, 2),
                                                check_invariants=True)
    found = check.scan_sparse(reducer)
    assert (found.name, found.bucket, found.nan, found.inf, found.numel) == ("emb.weight", -1, 1, 1, 4)
    assert said == [f"pipedap: {found.describe()}; the update is applied as DDP applies it "
                    "(nonfinite='warn', said once per fit; 'raise' stops training, 'skip' skips such steps)"]
    assert "(first: 'emb.weight', a sparse gradient, 1 NaN and 1 inf of 4 values)" in found.describe()
