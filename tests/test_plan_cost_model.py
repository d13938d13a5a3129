"""Alpha-beta cost model: non-negative least-squares fit, R², start-up sharing, JSON round trip."""

from __future__ import annotations

import json

import pytest

from lightning_pipedap.plan.cost_model import AlphaBeta, CostModel, fit_alpha_beta, fit_cost_model, load_cost_model
from lightning_pipedap.schedule import OpKind


def test_fit_recovers_exact_line_with_r2_one():
    alpha, beta = 1e-4, 2e-9
    ab = fit_alpha_beta([(n, alpha + beta * n) for n in (4096, 65536, 1 << 20, 1 << 24)])
    assert ab.alpha_s == pytest.approx(alpha, rel=1e-9)
    assert ab.beta_s_per_byte == pytest.approx(beta, rel=1e-9)
    assert ab.r2 == pytest.approx(1.0)
    assert ab.n_samples == 4


def test_fit_noisy_points_matches_hand_computed_ols_and_r2():
    # x = 0..3, y = 1, 2, 4, 5: beta = Sxy/Sxx = 7/5, alpha = 3 - 1.4*1.5 = 0.9, SSres = 0.2, SStot = 10
    ab = fit_alpha_beta([(0, 1), (1, 2), (2, 4), (3, 5)])
    assert ab.alpha_s == pytest.approx(0.9)
    assert ab.beta_s_per_byte == pytest.approx(1.4)
    assert ab.r2 == pytest.approx(0.98)


def test_fit_clamps_negative_intercept_to_zero():
    # OLS gives alpha = -1; the constrained optimum is alpha = 0, beta = Σxy/Σx² = 15/14
    ab = fit_alpha_beta([(1, 0.5), (2, 2.0), (3, 3.5)])
    assert ab.alpha_s == 0.0
    assert ab.beta_s_per_byte == pytest.approx(15 / 14)
    assert ab.time(0) == 0.0


def test_fit_clamps_negative_slope_to_zero():
    ab = fit_alpha_beta([(1, 3.0), (2, 2.0), (3, 1.0)])
    assert ab.beta_s_per_byte == 0.0
    assert ab.alpha_s == pytest.approx(2.0)
    assert ab.r2 == pytest.approx(0.0)


@pytest.mark.parametrize("samples, match", [
    ([(10, 1.0)], "at least 2"),
    ([(10, 1.0), (10, 2.0)], "distinct message sizes"),
    ([(10, 1.0), (-1, 2.0)], "invalid"),
    ([(10, 1.0), (20, float("nan"))], "invalid"),
])
def test_fit_rejects_bad_samples(samples, match):
    with pytest.raises(ValueError, match=match):
        fit_alpha_beta(samples)


def test_alpha_beta_rejects_negative_constants_and_sizes():
    with pytest.raises(ValueError, match="never negative"):
        AlphaBeta(-1e-6, 1e-9)
    with pytest.raises(ValueError, match="beta_s_per_byte"):
        AlphaBeta(1e-6, -1e-9)
    with pytest.raises(ValueError, match=">= 0 bytes"):
        AlphaBeta(1e-6, 1e-9).time(-1)


def test_from_allreduce_reference_split_has_no_fusion_saving():
    cm = CostModel.from_allreduce(2e-3, 1e-9)
    for n in (0, 1000, 10**8):
        assert cm.all_reduce(n) == pytest.approx(2e-3 + 1e-9 * n)
        assert cm.reduce_scatter(n) == pytest.approx(cm.all_reduce(n) / 2)
        assert cm.all_gather(n) == pytest.approx(cm.all_reduce(n) / 2)
        assert cm.fused_saving(n) == pytest.approx(0.0, abs=1e-18)


@pytest.mark.parametrize("s", [0.25, 1.0])
def test_startup_sharing_saves_that_fraction_of_alpha(s):
    cm = CostModel.from_allreduce(2e-3, 1e-9, startup_sharing=s)
    assert cm.rs.alpha_s == pytest.approx(2e-3 * (1 + s) / 2)
    for n in (0, 5000, 10**7):
        assert cm.fused_saving(n) == pytest.approx(s * 2e-3)
        assert cm.min_reduce(n) == pytest.approx(cm.all_reduce(n))


@pytest.mark.parametrize("s", [-0.1, 1.5])
def test_startup_sharing_out_of_range(s):
    with pytest.raises(ValueError, match=r"startup_sharing must be in \[0, 1\]"):
        CostModel.from_allreduce(1e-3, 1e-9, startup_sharing=s)


def test_from_reference_converts_per_element_beta_to_bytes(tmp_path):
    p = tmp_path / "alpha_beta.json"
    p.write_text(json.dumps({"8": {"alpha_s": 1.3186e-3, "beta_s_per_element": 2.406e-10},
                             "2": {"alpha_s": 5.566e-4, "beta_s_per_element": 3.52e-11}}))
    cm = CostModel.from_reference(p, 8)
    assert cm.ar.alpha_s == pytest.approx(1.3186e-3)
    assert cm.ar.beta_s_per_byte == pytest.approx(2.406e-10 / 4)
    # an all-reduce of M fp32 elements costs alpha + beta_elem * M, as in the reference
    assert cm.all_reduce(4 * 1_000_000) == pytest.approx(1.3186e-3 + 2.406e-10 * 1_000_000)
    assert cm.meta["world_size"] == 8
    with pytest.raises(ValueError, match=r"world size 4.*valid: \['2', '8'\]"):
        CostModel.from_reference(p, 4)


def test_json_round_trip(tmp_path):
    cm = fit_cost_model({"RS": [(1e3, 1e-4), (1e6, 2e-3)], OpKind.ALL_GATHER: [(1e3, 2e-4), (1e6, 1e-3)],
                         "ar": [(1e3, 3e-4), (1e6, 3e-3), (4e6, 1.1e-2)]}, meta={"backend": "gloo", "world_size": 2})
    path = cm.save(tmp_path / "cm.json")
    back = load_cost_model(path)
    assert back == cm
    assert back.meta == {"backend": "gloo", "world_size": 2}
    assert back.ar.r2 == cm.ar.r2 and back.ar.n_samples == 3
    assert back.cost("AG", 5e5) == pytest.approx(cm.all_gather(5e5))


def test_load_rejects_other_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a cost model file"):
        load_cost_model(p)


def test_fit_cost_model_without_allreduce_samples_sums_rs_and_ag():
    cm = fit_cost_model({"RS": [(0, 1e-4), (1e6, 1.1e-3)], "AG": [(0, 2e-4), (1e6, 2.2e-3)]})
    assert cm.ar.alpha_s == pytest.approx(3e-4)
    assert cm.ar.beta_s_per_byte == pytest.approx(1e-9 + 2e-9)
    assert cm.ar.r2 is None
    assert cm.rs.r2 == pytest.approx(1.0)


def test_fit_cost_model_errors():
    with pytest.raises(ValueError, match="no samples for AG"):
        fit_cost_model({"RS": [(0, 1e-4), (1e6, 1e-3)]})
    with pytest.raises(ValueError, match="unknown primitive 'XX'"):
        fit_cost_model({"XX": [(0, 1.0), (1, 2.0)]})


def test_scaled_multiplies_beta_only():
    cm = CostModel.from_allreduce(1e-3, 1e-9).scaled(beta_factor=10)
    assert cm.ar.alpha_s == pytest.approx(1e-3)
    assert cm.all_reduce(1e6) == pytest.approx(1e-3 + 1e-2)
    assert cm.meta["beta_factor"] == 10


def test_describe_uses_one_unit_convention():
    """α in µs, β in ns/B with its bandwidth in GB/s beside it, R² when fitted (the log and the what-if CLI
    both print this; they used to print ns/bit and ps/B)."""
    ab = AlphaBeta(789e-6, 8.313e-9, r2=0.99934)
    assert ab.describe() == "α=789 µs β=8.313 ns/B (0.12 GB/s) R²=0.9993"
    assert ab.describe(with_r2=False) == "α=789 µs β=8.313 ns/B (0.12 GB/s)"
    assert AlphaBeta(1e-4, 1e-10).describe() == "α=100 µs β=0.100 ns/B (10 GB/s)"
    assert AlphaBeta(0.0, 0.0).describe() == "α=0 µs β=0.000 ns/B (unbounded)"


def test_16bit_wire_constants_fit_round_trip_and_scale(tmp_path):
    """The 16-bit wire constants (over the fp32 bytes): fitted from their own samples, kept by the JSON file
    and by :meth:`CostModel.scaled`; a model without them costs a 16-bit op as the fp32 one at half the bytes."""
    pts = lambda a, b: [(n, a + b * n) for n in (1e3, 1e5, 1e7)]  # noqa: E731
    cm = fit_cost_model({"RS": pts(1e-4, 1e-9), "AG": pts(1e-4, 1e-9)},
                        wire16_samples={"RS": pts(2e-4, 0.6e-9), "AG": pts(3e-4, 0.7e-9)})
    assert cm.rs16.alpha_s == pytest.approx(2e-4) and cm.rs16.beta_s_per_byte == pytest.approx(0.6e-9)
    assert cm.all_gather16(1e6) == pytest.approx(3e-4 + 0.7e-3)
    back = load_cost_model(cm.save(tmp_path / "cm.json"))
    assert back.rs16 == cm.rs16 and back.ag16 == cm.ag16
    assert cm.scaled(beta_factor=2.0).rs16.beta_s_per_byte == pytest.approx(1.2e-9)
    plain = CostModel.from_allreduce(0.0, 2e-9)
    assert plain.rs16 is None and plain.reduce_scatter16(1e6) == pytest.approx(plain.reduce_scatter(5e5))
    assert "wire16" not in plain.to_dict() and load_cost_model(plain.save(tmp_path / "p.json")).rs16 is None
    with pytest.raises(ValueError, match="for both RS and AG or for neither"):
        CostModel(cm.rs, cm.ag, cm.ar, {}, cm.rs16, None)
    with pytest.raises(ValueError, match="wire16_samples needs 'RS' and 'AG'"):
        fit_cost_model({"RS": pts(1e-4, 1e-9), "AG": pts(1e-4, 1e-9)}, wire16_samples={"RS": pts(1e-4, 1e-9)})
