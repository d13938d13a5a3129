"""``nonfinite=`` and ``check_params_every_n_steps=``: options, the pieces, and parity with DDP.

The parity runs (``tests/nonfinite_cases.py``, one launch of 2 ranks) give rank 1 a NaN/inf gradient
of one parameter at step 4: ``"warn"`` and ``"ignore"`` must leave DDP's parameters bit for bit (NaN
and inf at the same places), ``"skip"`` those of a DDP run whose step 4 ``optimizer.step`` was not
called. ``"raise"`` and the parameter-hash check are fault-matrix rows (``tests/test_faults.py``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lightning_pipedap import PipeDAPStrategy
from lightning_pipedap.engine.buckets import FlatBucket
from lightning_pipedap.engine.update import clip_norm_coefficient
from lightning_pipedap.strategy.config import PER_RANK_OPTIONS, PipeDAPConfig
from lightning_pipedap.strategy.numerics import (NonFiniteCheck, NonFiniteGradientError, first_nonfinite,
                                                 parameter_hashes, skippable_step)
from tests._dist_util import run_lightning_ranks

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------- options
@pytest.mark.parametrize("kwargs,match", [
    ({"nonfinite": "nan"}, r"nonfinite must be one of 'warn', 'raise', 'skip', 'ignore', got 'nan'"),
    ({"nonfinite": None}, r"nonfinite must be one of .*, got None"),
    ({"check_params_every_n_steps": 0}, r"check_params_every_n_steps must be an integer >= 1 or None \(off\), got 0"),
    ({"check_params_every_n_steps": 2.5}, r"check_params_every_n_steps must be an integer >= 1 .*got 2\.5"),
    ({"check_params_every_n_steps": True}, r"check_params_every_n_steps must be an integer >= 1 .*got True"),
])
def test_bad_values_are_refused_naming_the_value_and_the_choices(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipeDAPStrategy(**kwargs)


def test_defaults_and_attributes():
    s = PipeDAPStrategy(check_params_every_n_steps=10, nonfinite="skip")
    assert (s.nonfinite, s.check_params_every_n_steps) == ("skip", 10)
    assert (PipeDAPConfig().nonfinite, PipeDAPConfig().check_params_every_n_steps) == ("warn", None)


def test_signature_holds_every_shared_option_and_orders_dicts():
    a = dict(PipeDAPConfig(compression="topk", compression_kwargs={"ratio": 0.1, "error_feedback": True}).signature())
    b = dict(PipeDAPConfig(compression="topk", compression_kwargs={"error_feedback": True, "ratio": 0.1}).signature())
    assert a == b  # key order of the kwargs does not matter
    assert a["compression"] == "'topk'" and a["compression_mode"] == "'process'" and a["schedule"] == "'optimal'"
    assert a["compression_kwargs"] == "{'error_feedback': True, 'ratio': 0.1}"
    assert set(a) == set(PipeDAPConfig.option_names()) - set(PER_RANK_OPTIONS)


def test_clip_coefficient_of_a_nan_norm_is_nan_as_torch_clip_grad_norm():
    g = torch.tensor([1.0, float("nan")], requires_grad=True)
    g.grad = torch.tensor([3.0, float("nan")])
    torch.nn.utils.clip_grad_norm_([g], 1.0)
    assert g.grad.isnan().all()  # torch: every gradient becomes NaN
    assert math.isnan(float(clip_norm_coefficient([torch.tensor([3.0, float("nan")])], 1.0)))
    assert float(clip_norm_coefficient([torch.tensor([float("inf")])], 1.0)) == 0.0


# ---------------------------------------------------------------------------------------- pieces
def _bucket(values: list[list[float]]) -> FlatBucket:
    params = [torch.zeros(len(v)) for v in values]
    b = FlatBucket.allocate(0, tuple(range(len(params))), params, world_size=2)
    for slot, v in enumerate(values):
        b.grad_view(slot).copy_(torch.tensor(v))
    return b


def test_first_nonfinite_names_the_first_parameter_and_counts():
    b = _bucket([[1.0, 2.0], [0.0, float("nan"), float("-inf")], [float("inf")]])
    names = {id(p): n for p, n in zip(b.params, ("a", "b", "c"))}
    found = first_nonfinite([b], lambda p: names[id(p)], step=7)
    assert (found.step, found.bucket, found.name, found.nan, found.inf, found.numel) == (7, 0, "b", 1, 1, 3)
    assert "step 7: the averaged gradients are not finite (first: 'b' in bucket 0, 1 NaN and 1 inf of 3" \
        in found.describe()
    assert first_nonfinite([_bucket([[1.0], [2.0]])], lambda p: "x", step=0) is None


def test_warn_mode_says_it_once_and_ignore_never_looks():
    said: list[str] = []
    bad = _bucket([[float("nan")]])
    check = NonFiniteCheck("warn", lambda p: "w", said.append)
    assert check.scan([bad], 3) is not None and check.scan([bad], 4) is None
    assert len(said) == 1 and "step 3" in said[0]
    assert NonFiniteCheck("ignore", lambda p: "w", said.append).scan([bad], 5) is None


def _sgd_step(mode: str, bad: bool) -> tuple[torch.Tensor, dict, list[str]]:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5, momentum=0.9)
    said: list[str] = []
    check = NonFiniteCheck(mode, lambda q: "p", said.append)
    check.step_of = lambda: 0

    def closure():
        p.grad = torch.ones(2)
        check.verdict = first_nonfinite([_bucket([[float("nan") if bad else 1.0, 1.0]])], lambda q: "p", 0)
        return torch.tensor(1.0)

    with skippable_step(opt, check):
        opt.step(closure=closure)
    assert "step" not in opt.__dict__  # the instance's step is restored
    return p.detach().clone(), opt.state_dict()["state"], said


def test_skippable_step_skips_only_a_nonfinite_step_and_runs_the_closure_once():
    p, state, said = _sgd_step("skip", bad=True)
    assert torch.equal(p, torch.ones(2)) and state == {} and "skipped on every rank" in said[0]
    p, state, said = _sgd_step("skip", bad=False)
    assert torch.equal(p, torch.full((2,), 0.5)) and 0 in state and not said
    with pytest.raises(NonFiniteGradientError, match="step 0: the averaged gradients are not finite"):
        _sgd_step("raise", bad=True)


def test_parameter_hashes_see_one_changed_bit():
    m = torch.nn.Linear(3, 2)
    before = parameter_hashes(m)
    with torch.no_grad():
        m.weight.view(torch.int32)[0, 0] ^= 1
    after = parameter_hashes(m)
    assert [n for n, _ in before] == ["weight", "bias"]
    assert before[0] != after[0] and before[1] == after[1]


# ---------------------------------------------------------------------------------------- parity with DDP
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("nonfinite") / "results.json"
    run_lightning_ranks(["-m", "tests.nonfinite_cases", str(out)], world=2, timeout_s=600, cwd=str(ROOT))
    return json.loads(out.read_text())


@pytest.mark.multiprocess
def test_the_skip_reference_differs_from_ddp(results):
    assert results["ddp_steps"] == 12
    assert results["ddp_skip_vs_ddp"]["max_diff"] > 1e-3 and results["ddp_skip_vs_ddp"]["ref_nonfinite"] == 3


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["warn_deferred", "warn_sync", "ignore_deferred", "warn_clip_deferred",
                                     "warn_shard", "warn_clip_shard"])
def test_warn_and_ignore_equal_ddp_bit_for_bit_nan_included(results, variant):
    res = results[variant]
    assert res["bit_equal"] and res["same_nonfinite"], res
    assert res["nonfinite"] >= 3, res  # extra[1:] (every parameter after the NaN norm when clipping)
    if variant.endswith(("deferred", "shard")):
        assert res["forward_updates"] > 0, res  # the updates were really deferred
    if variant.startswith("warn"):
        assert len(res["warnings"]) == 1 and "step 4: the averaged gradients are not finite (first: 'extra'" \
            in res["warnings"][0], res
    else:
        assert res["warnings"] == [], res


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["skip_deferred", "skip_sync", "skip_clip_deferred", "skip_shard",
                                     "skip_clip_shard"])
def test_skip_equals_ddp_without_that_optimizer_step(results, variant):
    res = results[variant]
    assert res["bit_equal"] and res["nonfinite"] == 0 and res["steps"] == 12, res
    assert len(res["warnings"]) == 1 and "optimizer step is skipped on every rank" in res["warnings"][0], res
    if variant.endswith(("deferred", "shard")):
        assert res["forward_updates"] > 0, res


def test_a_sum_that_overflows_with_finite_values_is_not_a_finding():
    big = torch.finfo(torch.float32).max
    assert first_nonfinite([_bucket([[big, big], [1.0]])], lambda p: "x", step=0) is None
    found = first_nonfinite([_bucket([[big, big]]), _bucket([[1.0, float("inf")]])], lambda p: "y", step=2)
    assert found is not None and (found.name, found.inf) == ("y", 1)


def test_warn_under_ddps_reducer_checks_the_parameters_at_the_given_cadence_once():
    from lightning_pipedap.strategy.numerics import NonFiniteCheck  # noqa: PLC0415

    said: list[str] = []
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    names = {id(a): "net.a", id(b): "net.b"}
    check = NonFiniteCheck("warn", lambda p: names[id(p)], said.append)
    check.step_of = lambda: 100
    for _ in range(50):  # the check at call 50 sees finite parameters
        check.check_params_under_ddp([a, b], every=50)
    with torch.no_grad():
        b[1] = float("nan")
    for _ in range(49):
        check.check_params_under_ddp([a, b], every=50)
    assert said == []  # calls 51-99 do not look
    check.check_params_under_ddp([a, b], every=50)  # the 100th call checks
    assert len(said) == 1 and "parameter 'net.b' is not finite under DDP's reducer" in said[0]
    for _ in range(100):
        check.check_params_under_ddp([a, b])
    assert len(said) == 1  # once per fit
    quiet = NonFiniteCheck("ignore", lambda p: "p", said.append)
    for _ in range(100):
        quiet.check_params_under_ddp([b])
    assert len(said) == 1
    every_step = NonFiniteCheck("warn", lambda p: names[id(p)], said.append)  # (the default: after every step,
    every_step.step_of = lambda: 7                                            # as the own engine's check)
    every_step.check_params_under_ddp([a, b])
    assert len(said) == 2 and "step 7: parameter 'net.b' is not finite" in said[1] and "after every step" in said[1]


def test_an_fp16_wire_overflow_names_wire_dtype_instead_of_implying_ddp_sees_the_same():
    """fp16 on the wire overflows above 65504 where DDP's fp32 sum would not: the error, the warning and the skip
    message say so and suggest bf16 or fp32, for the buckets the schedule sends in fp16 only."""
    found = first_nonfinite([_bucket([[1.0], [float("inf")]])], lambda p: "fc.weight", step=9)
    wire = NonFiniteCheck("raise", lambda p: "fc.weight", lambda m: None, wire_dtype="fp16", is_wire16=lambda b: b == 0)
    msg = str(wire.error(found))
    assert "bucket 0 is sent in fp16 on the wire (wire_dtype='fp16'), which overflows to inf above 65504 where " \
           "DDP, summing in fp32, would not" in msg
    assert "wire_dtype='bf16'" in msg and "wire_dtype='fp32'" in msg and "as DDP" not in msg
    said: list[str] = []
    NonFiniteCheck("warn", lambda p: "w", said.append, wire_dtype="fp16", is_wire16=lambda b: True).scan(
        [_bucket([[float("inf")]])], 3)
    assert "wire_dtype='fp16'" in said[0] and "as DDP applies it" not in said[0]
    NonFiniteCheck("skip", lambda p: "w", said.append, wire_dtype="fp16", is_wire16=lambda b: True).skip(found)
    assert "wire_dtype='bf16'" in said[1]
    # an fp32 bucket (or wire_dtype fp32/bf16) keeps the DDP comparison
    for check in (NonFiniteCheck("raise", lambda p: "x", said.append, wire_dtype="fp16", is_wire16=lambda b: False),
                  NonFiniteCheck("raise", lambda p: "x", said.append, wire_dtype="bf16", is_wire16=lambda b: True),
                  NonFiniteCheck("raise", lambda p: "x", said.append)):
        msg = str(check.error(found))
        assert "wire_dtype" not in msg and msg.endswith("'warn' to apply them as DDP)")
