"""Measuring the compression cost for the planner: payload models against real payloads, and the fit."""

from __future__ import annotations

import pytest
import torch

from lightning_pipedap.compress.compressors import get_compressor
from lightning_pipedap.compress.runtime import CompressionRuntime
from lightning_pipedap.probe.compression_cost import measure_compression_cost, payload_model

LAYERS = [[(8, 16), (8,)], [(4,)]]  # layer 0: an 8x16 weight and its bias; layer 1: a 1-D tensor


def test_payload_model_fp16_and_sparse():
    m = payload_model("fp16", {}, LAYERS)
    assert (m["collective"], m["rounds"], m["payload_ratio"], m["payload_const_bytes"]) == ("AR", 1, 0.5, 0.0)
    t = payload_model("topk", {"ratio": 0.01}, LAYERS)
    assert t["collective"] == "AG" and t["payload_ratio"] == pytest.approx(0.02, rel=0.01)
    comp = get_compressor("topk", ratio=0.01)
    for n in (5_000, 300_000, 3_000_000):  # packed size (header + aligned regions) within a few bytes
        assert t["payload_ratio"] * 4 * n + t["payload_const_bytes"] == pytest.approx(comp.packed_nbytes(n), abs=16)


def test_payload_model_powersgd_matches_the_payload_it_sends():
    m = payload_model("powersgd", {"rank": 2}, LAYERS)
    # layer 0: P 8x2 + Q 16x2 + bias 8, fp32 = 224 bytes; layer 1 is sent as is: 16 bytes; two rounds
    assert m["layer_payload_bytes"] == [224.0, 16.0] and m["rounds"] == 2 and m["collective"] == "AR"
    rt = CompressionRuntime([136], "powersgd", {"rank": 2}, [[("w", (8, 16)), ("b", (8,))]])
    grad = torch.randn(136, generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # start_step = 2: the first steps go uncompressed
        p = rt.compress(0, grad)
        rt.decompress(0, p)
    sent = 0
    p = rt.compress(0, grad)
    while True:
        sent += p.nbytes
        if p.final:
            break
        p = rt.next_round(0, p)
    assert sent == 224


def test_measure_fits_a_cost_within_the_budget():
    threads = torch.get_num_threads()
    layers = [[(64, 64), (64,)]] * 4
    c = measure_compression_cost("powersgd", {"rank": 2}, layers, world_size=2, threads=1 if threads > 1 else 2,
                                 budget_s=1.0, repeats=2)
    assert c.method == "powersgd" and c.where == "helper" and c.collective == "AR" and c.rounds == 2
    assert c.layer_payload_bytes == tuple(payload_model("powersgd", {"rank": 2}, layers)["layer_payload_bytes"])
    assert c.alpha_c_s >= 0 and c.beta_c_s_per_byte > 0 and 0 < c.post_share < 1
    assert c.extra_allreduces == 1 and len(c.meta["samples"]) >= 2
    assert torch.get_num_threads() == threads  # the helper's thread count was set for the timing only
    q = measure_compression_cost("qsgd", {}, [[(1000,)]], world_size=4, where="inline", budget_s=2.0, repeats=5)
    assert q.collective == "AG" and q.where == "inline" and q.beta_c_s_per_byte > 0


def test_measure_rejects_bad_arguments():
    with pytest.raises(ValueError, match="where must be one of"):
        measure_compression_cost("fp16", {}, LAYERS, world_size=2, where="gpu")
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        measure_compression_cost("fp16", {}, LAYERS, world_size=0)
    with pytest.raises(ValueError, match="no elements"):
        measure_compression_cost("fp16", {}, [[]], world_size=2)
