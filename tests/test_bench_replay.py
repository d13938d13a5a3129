"""Profile replay (lightning_pipedap.bench.replay): the sleep model, the virtual stream, the link-rate
helpers, the cell set-up, the verdicts, and a 2-process parity check against ddp on the sleep model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from lightning_pipedap.bench.matrix.models import REPLAY_MODEL, build_net
from lightning_pipedap.bench.matrix.results import CellResult, VariantResult
from lightning_pipedap.bench.replay import analysis as A
from lightning_pipedap.bench.replay import cells as CE
from lightning_pipedap.bench.replay import rates as R
from lightning_pipedap.bench.replay.cli import parse_args
from lightning_pipedap.bench.replay.model import (FEATURES, ReplayNet, ReplayOptions, VirtualStream, _SleepScale,
                                                  replay_profile)
from lightning_pipedap.plan.profile import LayerProfile, ModelProfile, load_profile, save_profile
from tests._dist_util import run_lightning_ranks

ROOT = Path(__file__).resolve().parents[1]


def _profile(*layers: tuple[int, float, float]) -> ModelProfile:
    """Profile of (bytes, t_f, t_b) layers."""
    return ModelProfile("toy", tuple(LayerProfile(f"l{i}", b, f, bw, b // 4) for i, (b, f, bw) in enumerate(layers)))


# ------------------------------------------------------------------------------------------ the model
def test_replay_profile_scales_sizes_and_times_of_the_published_profile():
    base = load_profile("vgg16", repaired=True)
    same = replay_profile(ReplayOptions("vgg16"))
    assert same.sizes_bytes == base.sizes_bytes and same.total_bytes == 553_430_176
    assert same.t_compute == pytest.approx(base.t_compute)
    half = replay_profile(ReplayOptions("vgg16", size_scale=0.5, time_scale=0.25))
    assert [layer.numel for layer in half.layers] == [max(1, round(layer.numel * 0.5)) for layer in base.layers]
    assert half.t_forward == pytest.approx(base.t_forward * 0.25)
    assert half.t_backward == pytest.approx(base.t_backward * 0.25)
    with pytest.raises(ValueError, match="size_scale"):
        ReplayOptions("vgg16", size_scale=0)


def test_replay_net_has_one_layer_per_profile_layer_holding_its_bytes():
    prof = replay_profile(ReplayOptions("resnet50", size_scale=1e-3, time_scale=0.0 + 1e-9))
    net = ReplayNet(prof)
    assert len(net.layers) == prof.num_layers == 107
    assert [layer.weight.numel() * 4 for layer in net.layers] == list(prof.sizes_bytes)
    assert all(layer.weight.dtype == torch.float32 for layer in net.layers)
    # the matrix builds it from plain options, its layers are the FSDP2 units
    net2, units, make_batch = build_net(REPLAY_MODEL, "bench", {"profile": "resnet50", "size_scale": 1e-3,
                                                                "time_scale": 1e-9})
    assert units == list(net2.layers)
    x, y = make_batch(5, torch.Generator().manual_seed(0))
    assert x.shape == (5, FEATURES) and y.shape == (5,) and net2(x).shape == (5, FEATURES)
    with pytest.raises(ValueError, match="needs options"):
        build_net(REPLAY_MODEL, "bench")


def test_sleep_layer_gradients_are_exact():
    x = torch.randn(3, FEATURES, dtype=torch.double, requires_grad=True)
    w = torch.randn(17, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: _SleepScale.apply(a, b, 0.0, 0.0), (x, w))
    # every parameter gets its own gradient value (w_i scaled by one factor), none is zero
    out = _SleepScale.apply(x, w, 0.0, 0.0)
    (g,) = torch.autograd.grad(out.pow(2).sum(), w)
    assert torch.allclose(g / w, (g / w)[0].expand(17)) and bool((g != 0).all())


def test_forward_and_backward_take_the_profile_times():
    prof = _profile((400, 0.02, 0.03), (400, 0.02, 0.03), (400, 0.02, 0.03))
    net = ReplayNet(prof)
    x = torch.randn(4, FEATURES)
    t0 = time.perf_counter()
    loss = net(x).sum()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    # sleeps end up to LOOKAHEAD_S (1 ms) early per call; a shared machine may add time, never remove it
    assert 0.057 <= t1 - t0 <= 0.060 + 0.05
    assert 0.087 <= t2 - t1 <= 0.090 + 0.05
    assert all(layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0 for layer in net.layers)


def test_virtual_stream_absorbs_overhead_and_oversleep():
    now = [0.0]
    slept = []

    def sleep(s):
        slept.append(round(s, 9))
        now[0] += s + 0.0002  # every sleep overshoots by 0.2 ms

    st = VirtualStream(lookahead_s=0.001, clock=lambda: now[0], sleep=sleep)
    st.run(0.010)                 # stream ends at 10 ms; sleep to 9 ms
    now[0] += 0.0005              # 0.5 ms of Python between layers (now 9.7 ms)
    st.run(0.005)                 # stream ends at 15 ms; sleep 14 - 9.7 = 4.3 ms
    assert slept == [0.009, 0.0043]
    assert st.end == pytest.approx(0.015)
    now[0] = 1.0                  # idle (waiting on communication): the stream starts again from now
    st.run(0.002)
    assert st.end == pytest.approx(1.002) and slept[-1] == pytest.approx(0.001)
    st.run(0.0)                   # no work, no sleep
    assert len(slept) == 3


# ------------------------------------------------------------------------------------------ rates
def test_ring_allreduce_time_by_hand():
    # 125 MB = 1 Gbit; 2 ranks send 2 * 1/2 of it: 1 s at 1 Gbit/s; 4 ranks 2 * 3/4: 1.5 s
    assert R.ring_allreduce_s(125e6, 2, 1e9) == pytest.approx(1.0)
    assert R.ring_allreduce_s(125e6, 4, 1e9) == pytest.approx(1.5)
    assert R.ring_allreduce_s(125e6, 8, 1e9, alpha_s=0.01) == pytest.approx(1.76)
    with pytest.raises(ValueError, match="world"):
        R.ring_allreduce_s(1, 1, 1e9)
    with pytest.raises(ValueError, match="rate_bps"):
        R.ring_allreduce_s(1, 2, 0)


def test_ratio_and_rate_for_ratio_by_hand():
    prof = _profile((125_000_000, 0.25, 0.75))  # compute 1 s, all-reduce 1 s at 1 Gbit/s on 2 ranks
    assert R.comm_compute_ratio(prof, 2, 1e9) == pytest.approx(1.0)
    assert R.comm_compute_ratio(prof, 4, 1e9) == pytest.approx(1.5)
    assert R.rate_for_ratio_bps(prof, 2, 0.5) == pytest.approx(2e9)
    assert R.rate_for_ratio_bps(prof, 4, 3.0) == pytest.approx(0.5e9)
    # the reference's constants for 2 workers: 5.566e-4 s + 3.52e-11 s/element * 31.25e6 elements
    assert R.reference_ratio(prof, 2) == pytest.approx(5.566e-4 + 3.52e-11 * 31.25e6)
    assert R.reference_ratio(prof, 2, beta_scale=10) == pytest.approx(5.566e-4 + 3.52e-10 * 31.25e6)
    assert R.scaled_rate_bps(1e9, 0.1, 0.2) == pytest.approx(0.5e9)


def test_tbf_rate_strings():
    assert R.tbf_rate(237.4e6) == "237mbit" and R.tbf_rate(1e9) == "1000mbit" and R.tbf_rate(10) == "1mbit"
    assert R.tbf_rate_bps("1gbit") == 1e9 and R.tbf_rate_bps("237mbit") == 237e6 and R.tbf_rate_bps("5kbit") == 5e3
    with pytest.raises(ValueError, match="unit"):
        R.tbf_rate_bps("12")


# ------------------------------------------------------------------------------------------ cells
def test_plan_cell_at_1gbit_scales_sizes_and_times_alike():
    c = CE.plan_cell("vgg16", 2, "1gbit", target_mb=60)
    s = 60e6 / 553_430_176
    assert c.options.size_scale == pytest.approx(s) and c.options.time_scale == pytest.approx(s)
    assert c.rate == "1000mbit"
    # vgg16 on 1 Gbit/s, 2 ranks: 553.4 MB * 8 / 1e9 = 4.427 s of all-reduce over 0.547 s of compute
    assert c.ratio == pytest.approx(4.42744 / 0.546898, rel=2e-3)
    assert CE.ReplayCell.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_plan_cell_stretches_times_instead_of_exceeding_the_rate_cap():
    c = CE.plan_cell("gpt2", 8, "paper*30", target_mb=60, max_rate_bps=1e9)
    want = CE.target_ratio("gpt2", 8, "paper*30")
    assert R.tbf_rate_bps(c.rate) <= 1e9
    assert c.ratio == pytest.approx(want, rel=0.01)
    assert c.options.time_scale > c.options.size_scale
    assert CE.target_ratio("gpt2", 2, "0.5") == 0.5
    with pytest.raises(ValueError, match="ratio"):
        CE.target_ratio("gpt2", 2, "fast")


# ------------------------------------------------------------------------------------------ verdicts
def _one_layer_cell(tmp_path: Path) -> CE.ReplayCell:
    path = save_profile(_profile((4000, 0.1, 0.3)), tmp_path / "one.json")
    return CE.ReplayCell("one", 2, "1", 1.0, ReplayOptions(str(path)), "1000mbit")


def test_window_bound_of_a_single_layer_is_compute_plus_comm(tmp_path):
    # one layer: its gradient is ready only when backward ends and needed when forward starts
    assert A.window_bound_s(_one_layer_cell(tmp_path), 0.2, 0.1) == pytest.approx(0.3)


def test_judge_ratios_and_simulator_error(tmp_path):
    res = CellResult("one", "1000mbit", 2, 0.001, 8, compute_s=0.2, allreduce_s=0.1, rs_ag_s=0.12, variants=[
        VariantResult("ddp", 0.40, 10), VariantResult("ddp_tuned", 0.36, 10), VariantResult("fsdp2", 0.5, 10),
        VariantResult("pipedap-optimal", 0.30, 10, predicted_s=0.32),
        VariantResult("pipedap-dear", 0.40, 10, predicted_s=0.30)])
    v = A.judge(_one_layer_cell(tmp_path), res)
    assert v.bound_s == pytest.approx(0.3) and v.hideable and v.best_baseline == "ddp_tuned"
    opt = v.variant("pipedap-optimal")
    assert opt.vs_ddp == pytest.approx(4 / 3) and opt.vs_best_baseline == pytest.approx(1.2)
    assert opt.to_bound == pytest.approx(1.0) and opt.sim_error == pytest.approx(0.02 / 0.3)
    assert v.variant("pipedap-dear").sim_error == pytest.approx(-0.25)
    assert v.variant("ddp").vs_best_baseline is None and v.variant("ddp").sim_error is None
    lines = A.targets_summary([v])
    assert "every fp32 baseline" in lines[0] and "1 of 1 cells" in lines[0]
    assert "1 of 1 such cells" in lines[1] and "1 of 2 predictions" in lines[2]
    assert "| one 2r | pipedap-optimal | 300 | 1.33 | 1.20 (ddp_tuned) | 1.00 | 320 | +7% |" in A.variants_table([v])
    # the 16-bit wire format is judged against every baseline, DDP's fp16 hook included
    res.variants += [VariantResult("ddp+fp16hook", 0.20, 10), VariantResult("pipedap-optimal@fp16", 0.24, 10)]
    v = A.judge(_one_layer_cell(tmp_path), res)
    assert v.variant("pipedap-optimal@fp16").vs_best_baseline == pytest.approx(0.20 / 0.24)
    assert v.variant("pipedap-optimal").vs_best_baseline == pytest.approx(1.2)  # (fp32: against ddp_tuned)
    lines = A.targets_summary([v])
    assert any(line.startswith("- `pipedap-optimal@fp16` at least as fast as every baseline (")
               and "0 of 1 cells" in line and "0.83× ddp+fp16hook" in line for line in lines), lines
    assert A.sends_fewer_bytes("pipedap-optimal@bf16@nice5") and not A.sends_fewer_bytes("pipedap-optimal@part1")


def test_cli_quick_and_bad_values():
    a = parse_args(["--quick"])
    assert a.profiles == ["densenet201"] and a.ranks == [2] and a.strategies == ["ddp", "pipedap-optimal"]
    with pytest.raises(SystemExit):
        parse_args(["--ratio", "fast"])
    with pytest.raises(SystemExit):
        parse_args(["--profiles", "lstm"])


# ------------------------------------------------------------------------------------------ parity
@pytest.mark.multiprocess
def test_sleep_model_trains_identically_under_ddp_and_pipedap(tmp_path):
    out = tmp_path / "parity.json"
    run_lightning_ranks(["-m", "tests.replay_parity_case", str(out)], world=2, timeout_s=300, cwd=str(ROOT))
    res = json.loads(out.read_text())
    assert res["ddp_moved"] > 1e-4, "the reference run must actually train"
    for sched in ("dear", "allreduce"):
        assert res[sched] <= 1e-6, f"{sched}: max |param - ddp| = {res[sched]:.3e}"
    assert res["dear_updates_in_forward"] > 0  # updates really deferred into the next forward


def test_cli_names_the_bad_argument(tmp_path, capsys):
    """A missing results file, an empty profile name and an out-of-range number are argparse errors (status 2)
    naming the argument and the value, not a traceback or an accepted typo."""
    def error(argv):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2
        return capsys.readouterr().err

    assert "--from-json: no such file '/nonexistent'" in error(["--from-json", "/nonexistent"])
    err = error(["--profiles", "vgg16,,"])
    assert "empty profile name in the list of profiles 'vgg16,,'" in err and "valid: " in err and "vgg16" in err
    assert "--warmup must be >= 5, got 3" in error(["--warmup", "3"])
    assert "--trial-rounds must be >= 1, got 0" in error(["--trial-rounds", "0"])
    assert "--target-mb must be > 0, got -1.0" in error(["--target-mb", "-1"])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    from lightning_pipedap.bench.replay.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--from-json", str(bad)])
    assert e.value.code == 2 and f"--from-json {bad}: not a replay results file" in capsys.readouterr().err
    assert parse_args(["--profiles", "vgg16"]).profiles == ["vgg16"]


def test_matrix_cli_refuses_a_missing_results_file(capsys):
    from lightning_pipedap.bench.matrix.args import parse_args as matrix_args

    with pytest.raises(SystemExit):
        matrix_args(["--from-json", "/nonexistent"])
    assert "--from-json: no such file '/nonexistent'" in capsys.readouterr().err
