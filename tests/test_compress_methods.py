"""Known-value tests of the compressors, error feedback, PowerSGD rounds and the registry (no processes)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_pipedap.compress import CompressionRuntime, Payload, get_compressor, valid_compressor_names
from lightning_pipedap.compress.base import mix_seed
from lightning_pipedap.compress.memory import compensate, update_dense, update_sparse
from lightning_pipedap.compress.powersgd import PowerSGDCompressor, orthogonalize_


def t(*xs, dtype=torch.float32):
    return torch.tensor(xs, dtype=dtype)


def one_step(rt: CompressionRuntime, bucket: int, grad: torch.Tensor) -> tuple[Payload, torch.Tensor]:
    """Single-rank step: compress, (sum over one rank = identity) rounds, decompress."""
    p = rt.compress(bucket, grad)
    while not p.final:
        p = rt.next_round(bucket, p)
    return p, rt.decompress(bucket, p)


# ------------------------------------------------------------------------------------ registry


def test_registry_names_and_errors():
    assert set(valid_compressor_names()) == {"none", "fp16", "bf16", "powersgd", "randomk", "topk", "dgc", "qsgd",
                                             "efsignsgd"}
    with pytest.raises(ValueError, match=r"unknown compressor 'zip'; valid names: none, fp16"):
        get_compressor("zip")
    with pytest.raises(ValueError,
                       match=r"does not take \['rank'\]; valid keyword arguments: \['error_feedback', 'ratio'\]"):
        get_compressor("topk", rank=2)
    with pytest.raises(ValueError, match="does not take"):
        get_compressor("fp16", ratio=0.1)


@pytest.mark.parametrize(
    "name,kwargs,msg",
    [
        ("topk", {"ratio": 0.0}, r"ratio must be a number in \(0, 1\], got 0.0"),
        ("randomk", {"ratio": 1.5}, r"ratio must be a number in \(0, 1\], got 1.5"),
        ("dgc", {"sample_ratio": -1}, "sample_ratio"),
        ("powersgd", {"rank": 0}, r"rank must be an integer >= 1, got 0"),
        ("powersgd", {"start_step": 1}, r"start_step must be an integer >= 2"),
        ("powersgd", {"eps": 0.0}, r"eps must be a number > 0"),
        ("powersgd", {"min_compression_rate": 0.5}, r"min_compression_rate must be a number >= 1"),
        ("qsgd", {"levels": 128}, r"levels must be an integer in \[1, 127\], got 128"),
        ("qsgd", {"levels": 2.0}, r"levels must be an integer"),
        ("topk", {"error_feedback": 1}, r"error_feedback must be True or False, got 1"),
    ],
)
def test_registry_validates_kwargs(name, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        get_compressor(name, **kwargs)


def test_bad_gradient_rejected():
    rt = CompressionRuntime([4], "fp16")
    with pytest.raises(ValueError, match=r"expects a flat \[4\] gradient, got \(5,\)"):
        rt.compress(0, torch.zeros(5))
    with pytest.raises(ValueError, match="expects float32, got torch.float64"):
        rt.compress(0, torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"bucket 3 out of range; there are 1 buckets"):
        rt.compress(3, torch.zeros(4))


# ------------------------------------------------------------------------------------ casts


def test_none_is_identity_and_aliases():
    g = t(0.5, -2.0, 0.1)
    p, out = one_step(CompressionRuntime([3], "none"), 0, g)
    assert p.data is g and out is g
    assert p.nbytes == 12


def test_fp16_bf16_known_values_and_sum():
    g = t(1.0, 0.1, -2.5, 65504.0)
    rt16 = CompressionRuntime([4], "fp16")
    p, out = one_step(rt16, 0, g)
    assert p.data.dtype == torch.float16 and p.nbytes == 8
    # 0.1 rounds to 1638/16384 in half precision; 65504 is the largest finite half
    assert out.tolist() == [1.0, 1638 / 16384, -2.5, 65504.0]
    pb, outb = one_step(CompressionRuntime([4], "bf16"), 0, g)
    assert pb.data.dtype == torch.bfloat16
    # bf16 keeps 8 mantissa bits: 0.1 = 1.6 * 2^-4 -> round(1.6 * 128) / 128 * 2^-4 = 205/2048
    assert outb[:3].tolist() == [1.0, 205 / 2048, -2.5]
    # summable: two ranks' payloads summed element-wise decompress to the sum
    c = get_compressor("fp16")
    a = c.compress(t(0.5, 1.5), c.init_state(0, 2))
    b = c.compress(t(0.25, -1.0), c.init_state(0, 2))
    assert c.decompress(a.with_data(a.data + b.data)).tolist() == [0.75, 0.5]


# ------------------------------------------------------------------------------------ sparsifiers


def test_topk_known_values_and_error_feedback_over_three_steps():
    g = t(1.0, -3.0, 4.0, 0.5)
    rt = CompressionRuntime([4], "topk", {"ratio": 0.25})  # k = 1
    sent = []
    expected = [  # (index sent, value, residual after) computed by hand
        (2, 4.0, [1.0, -3.0, 0.0, 0.5]),  # corrected = g
        (1, -6.0, [2.0, 0.0, 4.0, 1.0]),  # corrected = [2, -6, 4, 1]
        (2, 8.0, [3.0, -3.0, 0.0, 1.5]),  # corrected = [3, -3, 8, 1.5]
    ]
    for idx, val, residual in expected:
        p, out = one_step(rt, 0, g)
        assert p.tensors["indices"].tolist() == [idx] and p.tensors["indices"].dtype == torch.int32
        assert p.tensors["values"].tolist() == [val]
        assert rt.states[0].residual.tolist() == residual
        sent.append(out)
    # nothing is lost: everything sent plus the residual equals the sum of the gradients
    assert torch.equal(sum(sent) + rt.states[0].residual, 3 * g)
    assert g.tolist() == [1.0, -3.0, 4.0, 0.5]  # input untouched


def test_topk_without_error_feedback_keeps_no_residual():
    rt = CompressionRuntime([4], "topk", {"ratio": 0.5, "error_feedback": False})
    p, out = one_step(rt, 0, t(1.0, -3.0, 4.0, 0.5))
    assert sorted(p.tensors["indices"].tolist()) == [1, 2]
    assert out.tolist() == [0.0, -3.0, 4.0, 0.0]
    assert rt.states[0].residual is None


def test_topk_aggregate_mean_and_sum_of_two_ranks():
    c = get_compressor("topk", ratio=0.5)
    p0 = c.compress(t(1.0, -3.0, 4.0, 0.5), c.init_state(0, 4))  # sends idx 2, 1
    p1 = c.compress(t(2.0, 0.0, -1.0, 5.0), c.init_state(0, 4))  # sends idx 3, 0
    assert c.aggregate([p0, p1]).tolist() == [1.0, -1.5, 2.0, 2.5]
    assert c.aggregate([p0, p1], average=False).tolist() == [2.0, -3.0, 4.0, 5.0]
    with pytest.raises(ValueError, match="at least one payload"):
        c.aggregate([])


def test_dgc_full_sample_equals_topk_and_reports_count():
    g = t(0.5, -2.0, 0.1, 3.0, -0.2, 0.0, 1.0, -1.5)
    rt = CompressionRuntime([8], "dgc", {"ratio": 0.25, "sample_ratio": 1.0})
    p, out = one_step(rt, 0, g)
    assert p.meta == {"count": 2}
    assert out.tolist() == [0.0, -2.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0]
    assert rt.states[0].residual.tolist() == pytest.approx([0.5, 0.0, 0.1, 0.0, -0.2, 0.0, 1.0, -1.5])


def test_dgc_sampled_threshold_selects_a_top_set_of_at_most_k():
    torch.manual_seed(0)
    g = torch.randn(1000)
    c = get_compressor("dgc", ratio=0.01, sample_ratio=0.1, seed=3)
    p = c.compress(g, c.init_state(0, 1000))
    count = p.meta["count"]
    assert 1 <= count <= 10 and p.tensors["values"].numel() == count
    # the selected entries are the `count` largest magnitudes of g (threshold selection)
    top = torch.topk(g.abs(), count).indices.sort().values
    assert p.tensors["indices"].long().sort().values.tolist() == top.tolist()
    assert torch.equal(p.tensors["values"], g[p.tensors["indices"].long()])


def test_randomk_shared_seed_same_indices_summable():
    n = 50
    c = get_compressor("randomk", ratio=0.2, seed=7)
    s0, s1 = c.init_state(3, n), c.init_state(3, n)  # same bucket on two ranks
    g0, g1 = torch.arange(n, dtype=torch.float32), -2.0 * torch.arange(n, dtype=torch.float32) + 1.0
    p0, p1 = c.compress(g0, s0), c.compress(g1, s1)
    assert p0.meta == p1.meta == {"seed": mix_seed(7, 3, 0)}
    assert p0.data.numel() == math.ceil(0.2 * n) == 10
    idx = c.indices(n, p0.meta["seed"])
    assert torch.equal(p0.data, g0[idx]) and torch.equal(p1.data, g1[idx])
    summed = c.decompress(p0.with_data(p0.data + p1.data))
    assert torch.equal(summed, c.decompress(p0) + c.decompress(p1))
    mask = torch.zeros(n, dtype=torch.bool)
    mask[idx] = True
    assert torch.equal(summed[mask], (g0 + g1)[mask]) and not summed[~mask].any()
    # error feedback: residual = the unsent entries
    assert torch.equal(s0.residual, torch.where(mask, torch.zeros(n), g0))
    # next step and another bucket draw other indices
    assert c.compress(g0, s0).meta["seed"] != p0.meta["seed"]
    assert c.compress(g0, c.init_state(4, n)).meta["seed"] != p0.meta["seed"]


# ------------------------------------------------------------------------------------ quantisers


def test_qsgd_known_values_exact_levels():
    rt = CompressionRuntime([3], "qsgd", {"levels": 5})
    p, out = one_step(rt, 0, t(3.0, 0.0, -4.0))  # norm 5: s|v_i|/||v|| = 3, 0, 4 exactly
    assert p.tensors["levels"].tolist() == [3, 0, -4] and p.tensors["levels"].dtype == torch.int8
    assert p.tensors["norm"].tolist() == [5.0]
    assert out.tolist() == [3.0, 0.0, -4.0]
    _, zero = one_step(rt, 0, torch.zeros(3))
    assert zero.tolist() == [0.0, 0.0, 0.0]


def test_qsgd_levels_are_neighbours_and_unbiased_over_seeds():
    g = t(3.0, -4.0)  # s = 2: scaled = 1.2, 1.6 -> levels {1, 2}, expected value 1.2, -1.6
    rt = CompressionRuntime([2], "qsgd", {"levels": 2})
    outs = []
    for _ in range(2000):  # each step uses another rounding seed
        p, out = one_step(rt, 0, g)
        assert set(p.tensors["levels"].abs().tolist()) <= {1, 2}
        outs.append(out)
    mean = torch.stack(outs).mean(0)
    # std of one sample <= 2.5 * 0.5; of the mean <= 0.028; 0.15 is > 5 sigma
    assert mean.tolist() == pytest.approx([3.0, -4.0], abs=0.15)


def test_efsignsgd_known_values_two_steps():
    g = t(1.0, -3.0, 0.5, 0.0, -0.5)
    rt = CompressionRuntime([5], "efsignsgd")
    p, out = one_step(rt, 0, g)
    assert p.tensors["scale"].tolist() == [1.0]  # ||g||_1 / n = 5 / 5
    assert p.tensors["bits"].tolist() == [1 + 4 + 8]  # signs + - + + -  (0 counts as +)
    assert out.tolist() == [1.0, -1.0, 1.0, 1.0, -1.0]
    assert rt.states[0].residual.tolist() == [0.0, -2.0, -0.5, -1.0, 0.5]
    p, out = one_step(rt, 0, g)  # corrected = [1, -5, 0, -1, 0]
    assert p.tensors["scale"].tolist() == pytest.approx([1.4])
    assert p.tensors["bits"].tolist() == [1 + 4 + 16]
    assert out.tolist() == pytest.approx([1.4, -1.4, 1.4, -1.4, 1.4])
    assert rt.states[0].residual.tolist() == pytest.approx([-0.4, -3.6, -1.4, 0.4, -1.4])


def test_efsignsgd_packs_eight_per_byte():
    c = get_compressor("efsignsgd")
    g = t(1, -1, -1, -1, -1, -1, -1, 1, 1, -1)  # bits 0 and 7 of byte 0, bit 0 of byte 1
    p = c.compress(g, c.init_state(0, 10))
    assert p.tensors["bits"].tolist() == [1 + 128, 1] and p.nbytes == 2 + 4


@pytest.mark.parametrize("name,kwargs", [("topk", {"ratio": 0.3}), ("dgc", {"ratio": 0.3, "sample_ratio": 0.5}),
                                         ("qsgd", {"levels": 4}), ("efsignsgd", {})])
def test_pack_unpack_roundtrip_fixed_size(name, kwargs):
    c = get_compressor(name, **kwargs)
    torch.manual_seed(1)
    g = torch.randn(37)
    p = c.compress(g, c.init_state(0, 37))
    buf = c.pack(p)
    assert buf.dtype == torch.uint8 and buf.numel() == c.packed_nbytes(37)
    q = c.unpack(buf, 37)
    assert q.meta == p.meta
    assert torch.equal(c.decompress(q), c.decompress(p))
    with pytest.raises(ValueError, match="packed buffer must be 1-D uint8"):
        c.unpack(buf[:-1], 37)


# ------------------------------------------------------------------------------------ error feedback


def test_memory_compensate_and_updates():
    c = get_compressor("topk")
    st = c.init_state(0, 3)
    g = t(1.0, 2.0, 3.0)
    corr = compensate(g, st)
    assert corr is st.residual and corr.tolist() == [1.0, 2.0, 3.0]
    update_sparse(st, corr, torch.tensor([1]))
    assert st.residual.tolist() == [1.0, 0.0, 3.0]
    corr = compensate(g, st)
    assert corr.tolist() == [2.0, 2.0, 6.0] and g.tolist() == [1.0, 2.0, 3.0]
    update_dense(st, corr, t(1.0, 1.0, 1.0))
    assert st.residual.tolist() == [1.0, 1.0, 5.0]
    assert compensate(g, st, enabled=False) is g


# ------------------------------------------------------------------------------------ PowerSGD


def square(name: str, rows: int, cols: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Layout of one bucket holding one ``rows x cols`` parameter."""
    return [[(name, (rows, cols))]]


def test_powersgd_matrix_view_per_parameter_and_start_step():
    assert PowerSGDCompressor.matrix_shape((4, 3)) == (4, 3)
    assert PowerSGDCompressor.matrix_shape((8, 2, 3, 3)) == (8, 18)  # conv weight: out x in*kh*kw
    assert PowerSGDCompressor.matrix_shape((5,)) is None and PowerSGDCompressor.matrix_shape(()) is None
    c = get_compressor("powersgd", rank=2)  # default min_compression_rate 2
    assert c.compresses((8, 18)) and not c.compresses((5,))
    # (4 + 4) * 1 * 2 = 16 is not < 16: too small to pay off at rate 2; at rate 1 it does
    assert not get_compressor("powersgd", rank=1).compresses((4, 4))
    assert get_compressor("powersgd", rank=1, min_compression_rate=1.0).compresses((4, 4))
    # bucket [conv 8x2x3x3 | bias 8 | tiny 2x3 | linear 6x20]: the bias and the tiny matrix are sent dense
    # ((2 + 3) * 2 * 2 = 20 >= 6; the linear one pays: (6 + 20) * 2 * 2 = 104 < 120)
    shapes = [(8, 2, 3, 3), (8,), (2, 3), (6, 20)]
    lay = c.layout(shapes)
    assert [(m.slot, m.offset, m.rows, m.cols, m.r) for m in lay.matrices] == [(0, 0, 8, 18, 2), (3, 158, 6, 20, 2)]
    assert lay.dense == ((144, 14),)  # neighbouring dense spans merged: bias 144..151, tiny 152..157
    assert (lay.p_numel, lay.q_numel, lay.dense_numel) == (28, 76, 14)
    assert {k: (s.numel, s.local) for k, s in c.payload_spec(278, shapes).items()} \
        == {"data": (278, False), "phat": (28, True), "dense": (14, True)}
    assert set(c.payload_spec(278)) == {"data"}  # a bucket without shapes is one 1-D tensor: never compressed

    c = get_compressor("powersgd", rank=1, start_step=3, min_compression_rate=1.0)
    st = c.init_state(0, 16, [(4, 4)])
    g = torch.arange(16, dtype=torch.float32)
    for step in range(3):  # steps 0, 1, 2 < start_step: the uncompressed gradient, one round
        p = c.compress(g, st)
        assert (p.stage, p.final, p.meta) == (0, True, {"step": step}) and p.data is g
    p = c.compress(g, st)
    assert (p.stage, p.final, p.data.numel()) == (1, False, 4)
    # a bucket of 1-D tensors only is always sent dense, in one round
    st = c.init_state(0, 16, [(10,), (6,)])
    for _ in range(4):
        p = c.compress(g, st)
        assert p.stage == 0 and p.data is g
    with pytest.raises(ValueError, match=r"parameter shapes \[\(4, 4\)\] hold 16 elements, the bucket has 17"):
        c.init_state(0, 17, [(4, 4)])


def test_powersgd_rank1_matrix_reconstructed_exactly():
    u, v = t(1.0, 2.0, 0.0, -1.0), t(1.0, 0.0, 1.0, 1.0)
    m = torch.outer(u, v)
    rt = CompressionRuntime([16], "powersgd", {"rank": 1, "min_compression_rate": 1.0}, square("w", 4, 4))
    for _ in range(2):
        one_step(rt, 0, m.reshape(-1))
    p, out = one_step(rt, 0, m.reshape(-1))
    assert p.stage == 2 and p.data.numel() == 4 and p.local["phat"].numel() == 4 and "dense" not in p.local
    assert out.tolist() == pytest.approx(m.reshape(-1).tolist(), abs=1e-5)
    assert rt.states[0].residual.abs().max().item() < 1e-5


def test_powersgd_one_matrix_per_parameter_exact_for_rank1_parameters_and_dense_bias():
    """Two rank-1 parameters and a bias in one bucket: rank 1 per parameter reconstructs all of it
    exactly (one near-square matrix over the whole bucket would not be rank 1), and the bias is sent
    as is, in round 1."""
    w1 = torch.outer(t(1.0, -2.0, 0.5, 3.0), t(2.0, 0.0, 1.0, 1.0, -1.0))  # 4 x 5, rank 1
    w2 = torch.outer(t(0.0, 1.0, 1.0, 2.0, -1.0, 1.0), t(1.0, 3.0, -1.0, 0.5, 2.0, 0.0))  # 6 x 6, rank 1
    bias = t(0.25, -0.5, 4.0)
    g = torch.cat([w1.reshape(-1), bias, w2.reshape(-1)])  # 20 + 3 + 36 = 59
    lay = [[("w1", (4, 5)), ("bias", (3,)), ("w2", (6, 6))]]
    rt = CompressionRuntime([59], "powersgd", {"rank": 1, "min_compression_rate": 1.0}, lay)
    for _ in range(2):
        one_step(rt, 0, g)
    p1 = rt.compress(0, g)
    # round 1: P of w1 (4), P of w2 (6), then the bias as is
    assert p1.stage == 1 and p1.data.numel() == 4 + 6 + 3 and p1.data[10:].tolist() == bias.tolist()
    p2 = rt.next_round(0, p1)
    assert p2.data.numel() == 5 + 6 and p2.local["dense"].tolist() == bias.tolist()
    out = rt.decompress(0, p2)
    assert out.tolist() == pytest.approx(g.tolist(), abs=1e-5)
    assert rt.states[0].residual[20:23].tolist() == [0.0, 0.0, 0.0]  # the dense span leaves no error
    assert rt.states[0].residual.abs().max().item() < 1e-5
    assert [sorted(d) for d in rt.states[0].param_tensors] == [["q"], [], ["q"]]


def test_powersgd_two_rank_sum_simulated():
    """Two fake ranks: sum the P payloads, orthogonalise on each, sum the Q payloads, decompress."""
    a, b = t(1.0, 0.0, 2.0, 0.0, 1.0, 0.0, 0.0, 1.0), t(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    c, d = t(0.0, 1.0, 0.0, -1.0, 0.0, 2.0, 0.0, 0.0), t(2.0, 0.0, 0.0, 1.0, 0.0, 0.0, 3.0, 0.0)
    bias = [t(1.0, 2.0), t(0.5, -4.0)]
    grads = [torch.cat([torch.outer(a, b).reshape(-1), bias[0]]), torch.cat([torch.outer(c, d).reshape(-1), bias[1]])]
    kwargs = {"rank": 2, "min_compression_rate": 1.0, "seed": 5}
    lay = [[("w", (8, 8)), ("bias", (2,))]]
    ranks = [CompressionRuntime([66], "powersgd", kwargs, lay) for _ in range(2)]
    for step in range(3):
        ps = [rt.compress(0, g) for rt, g in zip(ranks, grads)]
        if step < 2:
            assert all(p.final and p.stage == 0 for p in ps)
            continue
        # both ranks drew the same Q: P_0 + P_1 = (M_0 + M_1) Q; the bias is summed in the same round
        summed_p = ps[0].with_data(ps[0].data + ps[1].data)
        qs = [rt.next_round(0, summed_p) for rt in ranks]
        assert torch.equal(qs[0].local["phat"], qs[1].local["phat"])
        assert qs[0].local["dense"].tolist() == [1.5, -2.0]
        summed_q = qs[0].with_data(qs[0].data + qs[1].data)
        outs = [rt.decompress(0, replace_q(q, summed_q.data)) for rt, q in zip(ranks, qs)]
        # the sum has rank 2 = r, so the approximation is exact and identical on both ranks
        expected = grads[0] + grads[1]
        assert outs[0].tolist() == pytest.approx(expected.tolist(), abs=1e-4)
        assert torch.equal(outs[0], outs[1])
        # each rank's own error: M_w lies in span(P̂), so the residual is ~0
        assert all(rt.states[0].residual.abs().max().item() < 1e-4 for rt in ranks)
        # warm start stores the summed Q
        assert torch.equal(ranks[0].states[0].param_tensors[0]["q"], summed_q.data.reshape(8, 2))


def replace_q(own: Payload, summed: torch.Tensor) -> Payload:
    return own.with_data(summed)


def test_powersgd_error_feedback_invariant_and_warm_start():
    torch.manual_seed(2)
    g = torch.randn(100)
    rt = CompressionRuntime([100], "powersgd", {"rank": 1}, square("w", 10, 10))
    for _ in range(2):
        one_step(rt, 0, g)
    st = rt.states[0]
    p1 = rt.compress(0, g)
    p2 = rt.next_round(0, p1)
    own = (p2.local["phat"].reshape(10, 1) @ p2.data.reshape(10, 1).t()).reshape(-1)
    assert torch.allclose(own + st.residual, g, atol=1e-5)  # residual = corrected - own decompressed
    rt.decompress(0, p2)
    q_saved = st.param_tensors[0]["q"].clone()
    corrected = g + st.residual
    p3 = rt.compress(0, g)  # warm start: P = M Q_prev
    assert torch.allclose(p3.data, (corrected.reshape(10, 10) @ q_saved).reshape(-1), atol=1e-5)


def test_powersgd_zero_gradient_no_nan():
    rt = CompressionRuntime([100], "powersgd", {"rank": 3, "min_compression_rate": 1.0}, square("w", 10, 10))
    for step in range(4):
        p, out = one_step(rt, 0, torch.zeros(100))
        assert not torch.isnan(out).any() and not out.any()
        if step >= 2:
            assert p.stage == 2 and not torch.isnan(p.local["phat"]).any()
    assert not torch.isnan(rt.states[0].residual).any()


def test_orthogonalize_zero_and_dependent_columns():
    m = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # col 1 zero, col 2 = 2 * col 0
    out = orthogonalize_(m.clone())
    assert not torch.isnan(out).any()
    assert out[:, 0].tolist() == [1.0, 0.0, 0.0] and not out[:, 1].any() and not out[:, 2].any()
    r = orthogonalize_(torch.tensor([[3.0, 1.0], [4.0, 1.0]]))
    assert (r.t() @ r).reshape(-1).tolist() == pytest.approx([1.0, 0.0, 0.0, 1.0], abs=1e-6)
    assert r[:, 0].tolist() == pytest.approx([0.6, 0.8])


def test_powersgd_rounds_misuse_errors():
    rt = CompressionRuntime([64], "powersgd", {"rank": 1, "min_compression_rate": 1.0, "start_step": 2},
                            square("w", 8, 8))
    p, _ = one_step(rt, 0, torch.ones(64))
    with pytest.raises(ValueError, match="is final; decompress it instead"):
        rt.next_round(0, p)
    one_step(rt, 0, torch.ones(64))
    p1 = rt.compress(0, torch.ones(64))
    with pytest.raises(ValueError, match="is not final; call next_round"):
        rt.decompress(0, p1)
    with pytest.raises(ValueError, match="powersgd payloads are summed"):
        rt.aggregate(0, [p1])
    with pytest.raises(ValueError, match="decompressing factors needs the bucket's state"):
        rt.compressor.decompress(rt.next_round(0, p1))


# ------------------------------------------------------------------------------------ checkpoints


def test_runtime_state_dict_roundtrip_continues_identically():
    torch.manual_seed(4)
    grads = [torch.randn(74) for _ in range(6)]
    kw = {"rank": 2, "min_compression_rate": 1.0}
    lay = [[("w", (8, 8)), ("b", (10,))]]
    a = CompressionRuntime([74], "powersgd", kw, lay)
    for g in grads[:3]:
        one_step(a, 0, g)
    sd = a.state_dict()
    assert sd["version"] == 1 and sd["compressor"] == "powersgd" and sd["kwargs"] == kw
    assert sd["params"]["w"]["step"] == 3 and set(sd["params"]["w"]["tensors"]) == {"q"}
    assert sd["params"]["w"]["shape"] == [8, 8] and sd["params"]["b"]["tensors"] == {}
    assert torch.equal(torch.cat([sd["params"]["w"]["residual"], sd["params"]["b"]["residual"]]), a.states[0].residual)
    b = CompressionRuntime([74], "powersgd", kw, lay)
    assert b.load_state_dict(sd) == []
    for g in grads[3:]:
        assert torch.equal(one_step(a, 0, g)[1], one_step(b, 0, g)[1])
    with pytest.raises(ValueError, match=r"parameter 'w': saved compression state has shape \(8, 8\), this run's "
                                         r"parameter has shape \(4, 16\)"):
        CompressionRuntime([74], "powersgd", kw, [[("w", (4, 16)), ("b", (10,))]]).load_state_dict(sd)
    with pytest.raises(ValueError, match="holds compression state of 'powersgd', this run uses 'topk'"):
        CompressionRuntime([74], "topk", {}, lay).load_state_dict(sd)
