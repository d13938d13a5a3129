"""Benchmark matrix: bounds and ratios, table rendering, CLI validation, and a testbed smoke run."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import pytest

from lightning_pipedap.bench import matrix as M


def _cell(**kw) -> M.CellResult:
    base = dict(model="mlp", link="1gbit", ranks=2, params_M=17.9, batch=256, compute_s=0.5, allreduce_s=0.6,
                rs_ag_s=0.55, first_layer_comm_s=0.04,
                variants=[M.VariantResult("ddp", 0.9, 20, energy_J=18.0),
                          M.VariantResult("pipedap-optimal", 0.6, 20, energy_J=12.5, predicted_s=0.58, wait_s=0.05,
                                          comm_busy_s=0.55)])
    base.update(kw)
    return M.CellResult(**base)


# ----------------------------------------------------------------------------- bound, ratio, speedup
def test_lower_bound_is_max_of_compute_and_comm():
    assert M.lower_bound_s(0.512, 0.538) == 0.538
    assert M.lower_bound_s(0.7, 0.2) == 0.7


def test_dependency_bound_adds_first_layer_comm_to_compute():
    # compute 0.5 + first layer 0.04 = 0.54 < comm 0.6 -> comm; with a big first layer compute dominates
    assert M.dependency_bound_s(0.5, 0.6, 0.04) == 0.6
    assert M.dependency_bound_s(0.5, 0.55, 0.14) == pytest.approx(0.64)


def test_ratio_and_speedup():
    assert M.ratio_to_bound(0.66, 0.6) == pytest.approx(1.1)
    assert M.speedup(0.928, 0.58) == pytest.approx(1.6)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "1"])
def test_bad_times_are_rejected_with_the_name(bad):
    with pytest.raises(ValueError, match="comm_s"):
        M.lower_bound_s(0.5, bad)
    with pytest.raises(ValueError, match="iter_s"):
        M.ratio_to_bound(bad, 1.0)


def test_cell_result_uses_faster_comm_and_reference_ddp():
    c = _cell()
    assert c.comm_s == 0.55  # RS+AG beat all-reduce
    assert c.bound_s == 0.55
    assert c.dep_bound_s == pytest.approx(0.55)  # max(0.5 + 0.04, 0.55)
    assert c.speedup("pipedap-optimal") == pytest.approx(1.5)
    assert c.ratio("pipedap-optimal") == pytest.approx(0.6 / 0.55)
    assert c.speedup("ddp") == 1.0
    assert c.speedup("fsdp2") is None and c.ratio("fsdp2") is None
    assert _cell(variants=[M.VariantResult("pipedap-dear", 0.7, 20)]).speedup("pipedap-dear") is None


def test_median_step_is_start_to_start_after_warmup():
    starts = [0.0, 5.0, 6.0, 7.5, 8.0, 9.2]  # gaps 5, 1, 1.5, 0.5, 1.2
    med, n = M.median_step_s(starts, warmup=1)
    assert (med, n) == (pytest.approx(1.1), 4)
    with pytest.raises(ValueError, match="warm-up"):
        M.median_step_s([0.0, 1.0], warmup=1)


def test_combine_takes_rank0_times_slowest_compute_and_summed_energy():
    def raw(rank, compute, it, e):
        return {"rank": rank, "params": 2_000_000, "first_layer_params": 1000, "compute_s": compute,
                "allreduce_s": 0.3, "rs_ag_s": 0.31, "first_layer_comm_s": 0.01, "skipped": {},
                "variants": [{"name": "ddp", "iter_s": it, "steps": 20, "energy_J": e}]}

    c = M.combine("mlp", "none", [raw(1, 0.45, 0.8, 3.0), raw(0, 0.40, 0.7, 2.5)], batch=64)
    assert (c.ranks, c.params_M, c.batch) == (2, 2.0, 64)
    assert c.compute_s == 0.45
    assert c.variants[0].iter_s == 0.7
    assert c.variants[0].energy_J == pytest.approx(5.5)
    bad = raw(1, 0.4, 0.8, 1.0)
    bad["variants"][0]["name"] = "fsdp2"
    with pytest.raises(ValueError, match="rank 1 ran"):
        M.combine("mlp", "none", [raw(0, 0.4, 0.7, 1.0), bad], batch=64)


# ----------------------------------------------------------------------------- rendering
def test_tables_show_the_computed_numbers():
    c = _cell(skipped={"fsdp2": "out of memory"})
    cells_md = M.format_cells_table([c])
    assert "| mlp | 1gbit | 2 | 17.9 | 256 | 500 | 600 | 550 | 40.0 | 550 | 550 |" in cells_md
    md = M.format_variants_table([c])
    lines = md.splitlines()
    assert len(lines) == 2 + 3
    row = next(line for line in lines if "pipedap-optimal" in line)
    cols = [x.strip() for x in row.strip("|").split("|")]
    assert cols[:10] == ["mlp 1gbit 2r", "pipedap-optimal", "600", "1.50", "1.09", "1.09", "12.5", "580", "50", "550"]
    assert "| mlp 1gbit 2r | fsdp2 | not run |" in md and "out of memory" in md
    assert M.format_compression_table([c]) == ""  # no compressed variant: no compression table
    assert "Compression (over the measured steps" not in M.render_markdown([c], {})
    text = M.format_text_report(c)
    assert "lower bound 550 ms" in text and "pipedap-optimal" in text


def _torch_ddp_cell():
    trials = [{"name": "dear@25MiB", "describe": "dear@25MiB: 1 buckets", "predicted_s": 0.0095, "measured_s": 0.0101,
               "deciding_s": 0.0100, "decided_in": "confirmation", "chosen": False},
              {"name": "torch_ddp", "describe": "torch_ddp: DDP's reducer", "predicted_s": None, "measured_s": 0.0111,
               "deciding_s": 0.0096, "decided_in": "confirmation", "chosen": True}]
    return _cell(variants=[M.VariantResult("ddp", 0.9, 20, energy_J=18.0),
                           M.VariantResult("pipedap-optimal", 0.81, 20, trials=trials, installed="torch_ddp")])


def test_a_speedup_from_ddps_reducer_says_so():
    c = _torch_ddp_cell()
    row = next(line for line in M.format_variants_table([c]).splitlines() if "pipedap-optimal" in line)
    assert "| 1.11 (torch_ddp: DDP's reducer) |" in row
    text = M.format_text_report(c)
    line = next(x for x in text.splitlines() if x.strip().startswith("pipedap-optimal"))
    assert "1.11" in line
    assert "[vs ddp (torch_ddp: DDP's reducer): measured selection installed DDP's own reducer]" in line
    assert ("candidate torch_ddp                measured    9.6 ms, predicted      – ms  <- chosen "
            "(confirmation rounds; all windows 11.1 ms)") in text
    assert M.quick_line(c, "pipedap-optimal").startswith("speedup_vs_ddp=1.11 ratio_to_bound=1.47 installed=torch_ddp "
                                                         "(DDP's reducer")
    # results written before `installed` existed: the chosen trial candidate says it
    old = M.CellResult.from_dict(dataclasses.asdict(c))
    old.variants[1].installed = ""
    assert old.variants[1].ran_ddp_reducer and "(torch_ddp: DDP's reducer)" in M.format_variants_table([old])
    trials = M.format_trials_table([c])
    assert "| 9.6 (confirmation) | yes |" in trials
    # a pipedap schedule: no mark, the installed name in the quick line
    plain = _cell()
    plain.variants[1].installed = "optimal"
    assert M.quick_line(plain, "pipedap-optimal") == "speedup_vs_ddp=1.50 ratio_to_bound=1.09 installed=optimal"
    assert "DDP's reducer" not in M.format_variants_table([plain]) + M.format_text_report(plain)


def _stats(compress_s, wait_s, payload, dense):
    from lightning_pipedap.engine.compressed import CompressionStats

    return CompressionStats(compress_s=compress_s, wait_s=wait_s, payload_bytes=payload, dense_bytes=dense)


def test_hidden_share_is_compress_minus_wait_over_compress():
    # (0.010 - 0.002) + (0.030 - 0.000) + (0.020 - 0.008) = 0.050 hidden of 0.060
    rounds = [_stats(0.010, 0.002, 100, 400), _stats(0.030, 0.0, 100, 400), _stats(0.020, 0.008, 50, 400)]
    assert M.hidden_share(rounds) == pytest.approx(0.05 / 0.06)
    assert M.hidden_share([_stats(0.01, 0.01, 1, 4)]) == 0.0
    assert M.hidden_share([_stats(0.01, 0.03, 1, 4)]) == 0.0  # the worker waited longer than the helper worked
    assert M.hidden_share([_stats(0.0, 0.0, 4, 4)]) is None
    with pytest.raises(ValueError, match="wait_s must be a finite number >= 0, got -0.1"):
        M.hidden_share([_stats(0.01, -0.1, 1, 4)])


def test_summarize_compression_averages_per_bucket_and_sums_buckets():
    rounds = [(0, _stats(0.010, 0.002, 100, 400)), (1, _stats(0.030, 0.0, 100, 400)),
              (0, _stats(0.020, 0.008, 50, 400)), (1, _stats(0.030, 0.01, 100, 400)),
              (1, _stats(0.030, 0.0, 100, 400))]  # bucket 1 caught in one round more than bucket 0
    s = M.summarize_compression(rounds)
    assert s.compress_s == pytest.approx(0.015 + 0.030)  # mean of bucket 0 + mean of bucket 1
    assert s.hidden_share == pytest.approx((0.12 - 0.02) / 0.12)
    assert s.ratio == pytest.approx(2000 / 450)
    assert s.rounds == 5
    inline = M.summarize_compression(rounds, pipelined=False)
    assert inline.hidden_share is None and inline.compress_s == s.compress_s
    assert M.summarize_compression([]) is None
    assert M.summarize_compression([(0, _stats(0.0, 0.0, 0, 400))]).ratio is None
    with pytest.raises(ValueError, match="payload_bytes"):
        M.summarize_compression([(0, _stats(0.01, 0.0, float("nan"), 400))])


def test_step_timer_counts_each_compression_round_once_for_the_step_that_made_it():
    from types import SimpleNamespace

    live: dict = {}
    a0, a1, b1, a2 = (_stats(0.001 * k, 0.0, 2, 4) for k in range(1, 5))

    def flush():  # the last step's deferred round lands in the flush
        live[0] = a2

    trainer = SimpleNamespace(strategy=SimpleNamespace(compression_stats=lambda: dict(live), flush=flush))
    timer = M._make_timer(10.0)
    timer.on_train_batch_start(trainer, None, None, 0)
    timer.on_before_backward(trainer, None, None)  # step 0: nothing compressed yet
    live[0] = a0  # step 0's round
    timer.on_train_batch_start(trainer, None, None, 1)
    timer.on_before_backward(trainer, None, None)
    timer.on_train_batch_start(trainer, None, None, 2)  # no sample at batch start
    live[0], live[1] = a1, b1  # step 1's rounds
    timer.on_before_backward(trainer, None, None)
    timer.on_before_backward(trainer, None, None)  # same objects again: not new rounds
    timer.on_train_end(trainer, None)
    assert [(k, b, st) for k, b, st in timer.rounds] == [(0, 0, a0), (1, 0, a1), (1, 1, b1), (2, 0, a2)]
    assert len(timer.starts) == 4 and timer.starts == sorted(timer.starts)


def _compressed_cell() -> M.CellResult:
    return _cell(variants=[
        M.VariantResult("ddp", 0.9, 20),
        M.VariantResult("ddp+fp16hook", 0.75, 20, compression="fp16_compress_hook"),
        M.VariantResult("pipedap-dear", 0.7, 20),
        M.VariantResult("pipedap-optimal", 0.6, 20),
        M.VariantResult("pipedap-optimal+topk", 0.4, 20, compression="topk ratio=0.01, helper process",
                        compress_s=0.0453, hidden_share=0.8234, compression_ratio=49.87, compressed_rounds=80),
        M.VariantResult("pipedap-optimal+topk:inline", 0.5, 20, compression="topk ratio=0.01, inline",
                        compress_s=0.041, hidden_share=None, compression_ratio=50.0, compressed_rounds=80),
    ])


def test_compression_table_rows_and_columns():
    md = M.format_compression_table([_compressed_cell()])
    lines = md.splitlines()
    assert lines[0].startswith("| cell | strategy | compression | iter ms (median) | speedup vs ddp | vs uncompressed ")
    rows = {r[1]: r for r in ([x.strip() for x in line.strip("|").split("|")] for line in lines[2:])}
    # pipedap-dear has no compressed variant: not a reference row here
    assert list(rows) == ["ddp", "ddp+fp16hook", "pipedap-optimal", "pipedap-optimal+topk",
                          "pipedap-optimal+topk:inline"]
    assert rows["ddp"][2:] == ["none", "900", "1.00", "–", "–", "–", "–"]
    assert rows["ddp+fp16hook"][2:] == ["fp16_compress_hook", "750", "1.20", "1.20", "–", "–", "–"]
    assert rows["pipedap-optimal+topk"][2:] == ["topk ratio=0.01, helper process", "400", "2.25", "1.50", "45.3", "82%",
                                                "49.9"]
    assert rows["pipedap-optimal+topk:inline"][5:] == ["1.20", "41.0", "–", "50.0"]
    md_all = M.render_markdown([_compressed_cell()], {"steps": 20, "warmup": 6})
    assert "*hidden* = share of the compression time" in md_all and md in md_all
    text = M.format_text_report(_compressed_cell())
    assert "[topk ratio=0.01, helper process: compression 45.3 ms/iter, hidden 82%, ratio 49.9]" in text
    assert "[fp16_compress_hook]" in text


def test_compression_fields_survive_json_and_old_results_load():
    from dataclasses import asdict

    c = _compressed_cell()
    assert M.CellResult.from_dict(json.loads(json.dumps(asdict(c)))) == c
    old = asdict(_cell())
    for v in old["variants"]:  # a results file written before the compression columns existed
        for k in ("compression", "compress_s", "hidden_share", "compression_ratio", "compressed_rounds"):
            del v[k]
    back = M.CellResult.from_dict(old)
    assert back.variants[1].compress_s is None and back.variants[1].compression == ""


def test_uncapped_label_and_missing_values_are_dashes():
    c = _cell(link="none", first_layer_comm_s=None, variants=[M.VariantResult("ddp", 0.2, 20)])
    assert M.cell_label(c) == "mlp uncapped 2r"
    row = M.format_variants_table([c]).splitlines()[2]
    cols = [x.strip() for x in row.strip("|").split("|")]
    assert cols[3:10] == ["1.00", "0.36", "–", "–", "–", "–", "–"]


def test_marked_section_is_replaced_and_prose_kept():
    first = M.replace_marked_section("# Benchmarks\n\nintro\n", "table v1")
    assert first.startswith("# Benchmarks\n\nintro\n\n" + M.MD_BEGIN)
    again = M.replace_marked_section(first + "\nclosing notes\n", "table v2")
    assert "table v1" not in again and "table v2" in again
    assert again.count(M.MD_BEGIN) == 1 and again.endswith("closing notes\n")
    with pytest.raises(ValueError, match="out of order"):
        M.replace_marked_section(f"{M.MD_END}\n{M.MD_BEGIN}", "x")


def test_json_round_trip_and_chart(tmp_path):
    c = _cell()
    from dataclasses import asdict

    back = M.CellResult.from_dict(json.loads(json.dumps(asdict(c))))
    assert back == c
    png = tmp_path / "img" / "chart.png"
    M.write_chart([c, _cell(link="none")], str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- CLI validation
def test_parse_lists_and_defaults():
    a = M.parse_args(["--models", "mlp,gpt", "--links", "all", "--ranks", "2,4", "--strategies", "ddp,pipedap-dear"])
    assert a.models == ["mlp", "gpt"] and a.links == list(M.LINKS) and a.ranks == [2, 4]
    assert a.strategies == ["ddp", "pipedap-dear"]
    assert a.ddp_bucket_mb == [1.0, 4.0, 10.0]
    assert set(M.valid_strategies()) >= {"ddp", "ddp_tuned", "fsdp2", "pipedap-optimal", "pipedap-allreduce",
                                        "ddp+fp16hook", "ddp+powersgdhook", "pipedap-optimal+topk:inline"}
    assert a.compressors == ["fp16", "powersgd", "topk"]


def test_strategy_names_are_taken_apart():
    sp = M.parse_strategy("pipedap-optimal+powersgd")
    assert (sp.family, sp.schedule, sp.compressor, sp.mode) == ("pipedap", "optimal", "powersgd", "process")
    assert sp.compression == "powersgd rank=4 start_step=2, helper process"
    sp = M.parse_strategy("pipedap-dear+topk:inline")
    assert (sp.schedule, sp.compressor, sp.mode, sp.compression) == ("dear", "topk", "inline",
                                                                      "topk ratio=0.01, inline")
    sp = M.parse_strategy("pipedap-wfbp")
    assert (sp.family, sp.schedule, sp.compressor, sp.mode, sp.compression) == ("pipedap", "wfbp", None, None, "")
    assert M.parse_strategy("ddp+powersgdhook").family == "ddp_hook"
    assert M.parse_strategy("ddp+fp16hook").compression == "fp16_compress_hook"
    assert M.parse_strategy("ddp_tuned").family == "ddp_tuned"
    assert M.extra_warmup_steps("pipedap-optimal+powersgd:inline") == 2
    assert M.extra_warmup_steps("pipedap-optimal+fp16") == 0 and M.extra_warmup_steps("ddp+powersgdhook") == 0
    # measured plan selection: only the default planner without compression; (2 rounds x (4 candidates +
    # torch_ddp) + 2 confirmation rounds x 2 candidates) x (3 + 1) steps
    assert (M.plan_trials("pipedap-optimal"), M.plan_trials("pipedap-wfbp"), M.plan_trials("pipedap-optimal+fp16"),
            M.plan_trials("ddp")) == (4, 1, 1, 1)
    assert M.extra_warmup_steps("pipedap-optimal") == 56 and M.extra_warmup_steps("pipedap-pipedap") == 0
    assert (M.uncompressed_name("pipedap-dear+fp16:inline"), M.uncompressed_name("ddp+fp16hook"),
            M.uncompressed_name("pipedap-dear"), M.uncompressed_name("ddp")) == ("pipedap-dear", "ddp", None, None)


def test_all_strategies_add_hooks_and_pipelined_compressors():
    a = M.parse_args(["--strategies", "all"])
    assert a.strategies[:5] == ["ddp", "ddp_tuned", "fsdp2", "ddp+fp16hook", "ddp+powersgdhook"]
    assert a.strategies[-3:] == ["pipedap-optimal+fp16", "pipedap-optimal+powersgd", "pipedap-optimal+topk"]
    assert not any(s.endswith(":inline") for s in a.strategies)
    assert "pipedap-optimal" in a.strategies and "pipedap-dear" in a.strategies
    b = M.parse_args(["--strategies", "all", "--compressors", "qsgd"])
    assert [s for s in b.strategies if "+" in s and not s.startswith("ddp")] == ["pipedap-optimal+qsgd"]
    c = M.parse_args(["--strategies", "ddp,pipedap-optimal+fp16,pipedap-optimal+fp16:inline,ddp"])
    assert c.strategies == ["ddp", "pipedap-optimal+fp16", "pipedap-optimal+fp16:inline"]


def test_quick_selects_the_headline_cell():
    a = M.parse_args(["--quick", "--models", "gpt"])
    assert (a.models, a.links, a.ranks, a.strategies) == (["mlp"], ["1gbit"], [2], ["ddp", "pipedap-optimal"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--models", "mlp,bert"], "unknown model 'bert'; valid: mlp, resnet, gpt"),
        (["--links", "100mbit"], "unknown link '100mbit'; valid: 1gbit, 10gbit, none"),
        (["--strategies", "pipedap-fast"], "unknown strategy 'pipedap-fast': unknown schedule 'fast'; valid: ddp, "
                                           "ddp_tuned, fsdp2, ddp+fp16hook, ddp+powersgdhook, pipedap-<schedule>"),
        (["--strategies", "ddp+bf16hook"], "unknown strategy 'ddp+bf16hook'; valid: ddp, ddp_tuned"),
        (["--strategies", "pipedap-optimal+zip"],
         "unknown compressor 'zip' in strategy 'pipedap-optimal+zip'; "
         "valid: none, fp16, bf16, powersgd, randomk, topk, dgc, qsgd, efsignsgd"),
        (["--strategies", "pipedap-optimal+fp16:process"], "unknown compression mode ':process' in strategy "
                                                           "'pipedap-optimal+fp16:process'; valid: ':inline'"),
        (["--compressors", "fp16,zip"], "unknown compressor 'zip'; valid: none, fp16, bf16, powersgd"),
        (["--compressors", ","], "empty list of compressors"),
        (["--ranks", "1"], "ranks must be integers >= 2"),
        (["--ranks", "two"], "got 'two'"),
        (["--ddp-bucket-mb", "4,-1"], "got '-1'"),
        (["--size", "huge"], "unknown size 'huge'; valid: bench, tiny"),
        (["--steps", "1"], "--steps must be >= 2"),
        (["--strategies", "pipedap-dear", "--warmup", "3"], "--warmup must be >= 5"),
        (["--models", ""], "empty list of models"),
    ],
)
def test_bad_arguments_exit_with_a_message_naming_the_choices(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        M.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_ddp_hook_strategy_is_a_ddp_strategy_and_names_are_checked():
    from lightning.pytorch.strategies import DDPStrategy

    assert isinstance(M._ddp_with_comm_hook("ddp+fp16hook"), DDPStrategy)
    with pytest.raises(ValueError, match=re.escape("unknown DDP hook variant 'ddp+bf16hook'; "
                                                   "valid: ddp+fp16hook, ddp+powersgdhook")):
        M._ddp_with_comm_hook("ddp+bf16hook")


def test_build_net_rejects_unknown_names_and_has_the_documented_sizes():
    with pytest.raises(ValueError, match="valid: mlp, resnet, gpt"):
        M.build_net("lstm", "tiny")
    with pytest.raises(ValueError, match="valid: bench, tiny"):
        M.build_net("mlp", "large")
    net, units, make_batch = M.build_net("mlp", "bench")
    assert sum(p.numel() for p in net.parameters()) == 16 * (1024 * 1024 + 1024) + 1024 * 10 + 10
    assert M.first_layer_numel(net) == 1024 * 1024 + 1024
    assert len(units) == 17
    import torch

    x, y = make_batch(3, torch.Generator().manual_seed(0))
    assert x.shape == (3, 1024) and y.shape == (3,)
    _, _, gpt_batch = M.build_net("gpt", "tiny")
    x, y = gpt_batch(2, torch.Generator().manual_seed(0))
    assert x.shape == (2, 8) and torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one


# ----------------------------------------------------------------------------- testbed smoke run
def test_tiny_cell_on_the_testbed(tmp_path):
    from lightning_pipedap.testbed import testbed_available

    ok, why = testbed_available()
    if not ok:
        pytest.skip(why)
    out_json = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "lightning_pipedap.bench.matrix", "--size", "tiny", "--links", "none", "--ranks", "2",
           "--strategies", "ddp,ddp+powersgdhook,pipedap-dear+fp16", "--steps", "2", "--warmup", "5",
           "--json", str(out_json), "--markdown", str(tmp_path / "B.md"), "--chart", str(tmp_path / "c.png")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out_json.read_text())
    (cell,) = data["cells"]
    assert (cell["model"], cell["link"], cell["ranks"], cell["batch"]) == ("mlp", "none", 2, 4)
    assert cell["params_M"] == pytest.approx((16 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10) / 1e6)
    assert [v["name"] for v in cell["variants"]] == ["ddp", "ddp+powersgdhook", "pipedap-dear+fp16"]
    for v in cell["variants"]:
        assert v["steps"] == 2 and v["iter_s"] > 0 and math.isfinite(v["iter_s"])
    assert cell["compute_s"] > 0 and cell["allreduce_s"] > 0 and cell["rs_ag_s"] > 0
    ddp, hook, comp = cell["variants"]
    assert ddp["compress_s"] is None
    assert hook["compression"] == "powerSGD_hook rank=4 start_iter=2, one DDP bucket (gloo)"
    assert comp["compression"] == "fp16, helper process"
    assert comp["compression_ratio"] == 2.0  # fp32 gradient / fp16 payload, every round
    # one bucket (dear's 25 MiB fusion of a 2.4 k-parameter model) x 2 measured steps, each round counted once
    assert comp["compressed_rounds"] == 2 and comp["compress_s"] > 0 and 0.0 <= comp["hidden_share"] <= 1.0
    md = (tmp_path / "B.md").read_text()
    assert md.count(M.MD_BEGIN) == 1 and "| mlp uncapped 2r | pipedap-dear+fp16 |" in md
    assert "| mlp uncapped 2r | pipedap-dear+fp16 | fp16, helper process |" in md  # the compression table row
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_nice_suffix_selects_train_thread_nice_and_rejects_bad_values():
    sp = M.parse_strategy("pipedap-optimal@nice10")
    assert (sp.family, sp.schedule, sp.compressor, sp.nice) == ("pipedap", "optimal", None, 10)
    sp = M.parse_strategy("pipedap-dear+fp16:inline@nice5")
    assert (sp.schedule, sp.compressor, sp.mode, sp.nice) == ("dear", "fp16", "inline", 5)
    assert M.parse_strategy("pipedap-optimal").nice == 0
    for bad in ("pipedap-optimal@nice0", "pipedap-optimal@nice20", "pipedap-optimal@fast", "pipedap-optimal@nice"):
        with pytest.raises(ValueError, match=r"valid: @nice<N> with N in 1\.\.19"):
            M.parse_strategy(bad)


def test_trials_table_and_cpu_aware_bound():
    trials = [{"name": "optimal", "describe": "optimal: 2 buckets: AR1 AR0", "predicted_s": 0.5, "measured_s": 0.625,
               "chosen": False},
              {"name": "wfbp@25MiB", "describe": "wfbp@25MiB: 1 buckets: AR0", "predicted_s": 0.55, "measured_s": 0.5,
               "chosen": True}]
    c = M.CellResult(model="mlp", link="none", ranks=2, params_M=1.0, batch=8, compute_s=0.5, allreduce_s=0.1,
                     rs_ag_s=0.12, allreduce_cpu_s=0.08,
                     variants=[M.VariantResult(name="pipedap-optimal", iter_s=0.5, steps=3, trials=trials)])
    table = M.format_trials_table([c]).splitlines()
    assert len(table) == 4
    assert table[2] == ("| mlp uncapped 2r | pipedap-optimal | `optimal: 2 buckets: AR1 AR0` | 500 | 625 | -20.0% "
                        "| 625.0 |  |")
    assert table[3].endswith("| 550 | 500 | +10.0% | 500.0 | yes |")
    assert c.cpu_bound_s == pytest.approx(0.58)  # max(compute + all-reduce CPU, communication)
    assert M.CellResult.from_dict(json.loads(json.dumps(dataclasses.asdict(c)))).variants[0].trials == trials
    c.allreduce_cpu_s = None
    assert c.cpu_bound_s is None
    assert M.format_trials_table([M.CellResult(**{**dataclasses.asdict(c), "variants": []})]) == ""


def test_testbed_cleans_up_on_sigterm():
    """``timeout``/``kill`` send SIGTERM: the testbed must still remove its namespaces, links and bridge."""
    import signal

    from lightning_pipedap.testbed import testbed_available

    ok, why = testbed_available()
    if not ok:
        pytest.skip(why)
    import uuid

    prefix = "pd" + uuid.uuid4().hex[:4]  # the testbed's own naming: "pd" + hex
    code = ("import time\nfrom lightning_pipedap.testbed import Testbed\n"
            f"with Testbed(hosts=2, rate='1gbit', prefix={prefix!r}):\n"
            "    print('up', flush=True)\n    time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"{prefix}h0" in names and f"{prefix}h1" in names
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
    assert prefix not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout


def test_quiet_worker_is_scoped_and_filters_only_its_warnings():
    import logging
    import warnings

    lg = logging.getLogger("lightning.pytorch")
    before_level, before_filters = lg.level, list(warnings.filters)
    with M.quiet_worker():
        assert lg.level == logging.ERROR
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")  # would override the quiet filters: check them without it
        for message, category in M.worker.QUIET_WARNINGS:
            assert any(f[0] == "ignore" and f[1] is not None and f[1].pattern == message and f[2] is category
                       for f in warnings.filters)
        assert not any(f[0] == "ignore" and f[1] is None and f[2] is Warning for f in warnings.filters[:2])
    assert lg.level == before_level and warnings.filters == before_filters
    assert logging.getLogger("lightning.pytorch.utilities.rank_zero").propagate


def test_plan_record_reads_the_strategy_attributes():
    from types import SimpleNamespace

    s = SimpleNamespace(installed_schedule="dear@25MiB: 1 buckets: RS0 AG0", predicted_iteration_s=0.0047,
                        no_overlap_time_s=0.0052, calibration_ratio=1.2, replans_done=0,
                        contention=SimpleNamespace(comm_slowdown=1.5, compute_slowdown=1.25),
                        trial_results=[{"name": "optimal", "measured_s": 0.009, "chosen": False},
                                       {"name": "dear@25MiB", "measured_s": 0.004, "chosen": True}],
                        what_ran=lambda: {"plan_selection_status": "finished"})
    assert M.plan_record(s) == [
        "schedule dear@25MiB: 1 buckets: RS0 AG0", "predicted iteration 4.7 ms", "no-overlap iteration 5.2 ms",
        "α-β model scaled by 1.20 (measured / predicted communication of the profiling steps)",
        "contention: communication 1.50 and compute 1.25 extra slowdown while they overlap",
        "measured candidates (the medians the choice was made on): optimal 9.0 ms; dear@25MiB 4.0 ms (chosen)"]
    noted = SimpleNamespace(**{**vars(s), "what_ran": lambda: {"selection_notes": ["confirmation: a 1 ms, b 2 ms"]}})
    assert M.plan_record(noted)[-1] == "why: confirmation: a 1 ms, b 2 ms"
    confirmed = SimpleNamespace(**{**vars(s), "trial_results": [
        {"name": "dear@25MiB", "measured_s": 0.0101, "deciding_s": 0.0100, "decided_in": "confirmation",
         "chosen": False},
        {"name": "torch_ddp", "measured_s": 0.0111, "deciding_s": 0.0096, "decided_in": "confirmation",
         "chosen": True}]})
    assert M.plan_record(confirmed)[-1] == (
        "measured candidates (the medians the choice was made on): dear@25MiB 10.0 ms [confirmation; all windows "
        "10.1 ms]; torch_ddp 9.6 ms [confirmation; all windows 11.1 ms] (chosen)")
    fresh = SimpleNamespace(installed_schedule=None, predicted_iteration_s=None, no_overlap_time_s=None,
                            calibration_ratio=1.0, contention=None, trial_results=[], replans_done=0,
                            what_ran=lambda: {"plan_selection_status": None})
    assert M.plan_record(fresh) == []
    cut = SimpleNamespace(installed_schedule=None, predicted_iteration_s=None, no_overlap_time_s=None,
                          calibration_ratio=1.0, contention=None, trial_results=[], replans_done=1,
                          what_ran=lambda: {"plan_selection_status": "unfinished", "ran_at_end": "dear@25MiB",
                                            "plan_selection": "unfinished (1 of 4 candidates measured, 1 of 4 "
                                                              "windows, after re-plan 1)"})
    assert M.plan_record(cut) == [
        "re-plans: 1", "plan selection unfinished (1 of 4 candidates measured, 1 of 4 windows, after re-plan 1): "
        "dear@25MiB ran at the end, not a chosen candidate"]


def test_wire_suffix_selects_wire_dtype_and_its_uncompressed_counterpart():
    sp = M.parse_strategy("pipedap-optimal@fp16")
    assert (sp.family, sp.schedule, sp.compressor, sp.wire, sp.nice) == ("pipedap", "optimal", None, "fp16", 0)
    assert sp.compression.startswith("fp16 wire format")
    sp = M.parse_strategy("pipedap-dear@bf16@nice5")
    assert (sp.schedule, sp.wire, sp.nice) == ("dear", "bf16", 5)
    assert M.parse_strategy("pipedap-optimal").wire == "fp32"
    assert M.uncompressed_name("pipedap-optimal@fp16") == "pipedap-optimal"
    assert M.uncompressed_name("pipedap-dear@bf16@nice5") == "pipedap-dear@nice5"
    assert M.uncompressed_name("pipedap-optimal@nice5") is None
    assert "pipedap-optimal@fp16" in M.valid_strategies() and "pipedap-optimal@fp16" not in M.all_strategies()
    with pytest.raises(ValueError, match=r"needs an uncompressed pipedap variant"):
        M.parse_strategy("pipedap-optimal+fp16@fp16")
    for bad in ("pipedap-optimal@fp16@fp16", "pipedap-optimal@fp8"):
        with pytest.raises(ValueError, match=r"valid: @nice<N> with N in 1\.\.19, @fp16, @bf16"):
            M.parse_strategy(bad)


def test_part_suffix_selects_partition_mb_and_rejects_bad_values():
    sp = M.parse_strategy("pipedap-optimal@part1")
    assert (sp.family, sp.schedule, sp.partition_mb, sp.nice, sp.wire) == ("pipedap", "optimal", 1.0, 0, "fp32")
    sp = M.parse_strategy("pipedap-pipedap@part0.5@nice3@bf16")
    assert (sp.schedule, sp.partition_mb, sp.nice, sp.wire) == ("pipedap", 0.5, 3, "bf16")
    assert M.parse_strategy("pipedap-optimal").partition_mb is None
    for bad in ("pipedap-optimal@part0", "pipedap-optimal@part-1", "pipedap-optimal@partx", "pipedap-optimal@partnan",
                "pipedap-optimal@part1_0", "pipedap-optimal@part 1", "pipedap-optimal@part1e-9",
                "pipedap-optimal@part"):
        with pytest.raises(ValueError,
                           match=r"valid: @part<MiB> with a decimal number of MiB >= 1/1024 = 0.0009765625"):
            M.parse_strategy(bad)
    for bad in ("pipedap-optimal+fp16@part1", "pipedap-dear@part1", "pipedap-allreduce@part1"):
        with pytest.raises(ValueError, match=r"needs an uncompressed pipedap variant with a planned schedule"):
            M.parse_strategy(bad)


def test_margin_suffix_selects_torch_ddp_margin_and_rejects_bad_values():
    sp = M.parse_strategy("pipedap-optimal@margin5")
    assert (sp.schedule, sp.torch_ddp_margin, sp.partition_mb) == ("optimal", 0.05, None)
    assert M.parse_strategy("pipedap-optimal@part1@margin0").torch_ddp_margin == 0.0
    assert M.parse_strategy("pipedap-optimal").torch_ddp_margin is None
    for bad in ("pipedap-optimal@margin100", "pipedap-optimal@margin-1", "pipedap-optimal@margin",
                "pipedap-optimal@margin5.5", "pipedap-optimal@margin05"):
        with pytest.raises(ValueError, match=r"valid: @margin<percent> with an integer percent in 0\.\.99 without"):
            M.parse_strategy(bad)
    with pytest.raises(ValueError, match=r"@margin<percent> with percent in 0\.\.99 \(each at most once\)"):
        M.parse_strategy("pipedap-optimal@margin5@margin10")
    for bad in ("pipedap-optimal+fp16@margin5", "pipedap-dear@margin5", "pipedap-optimal@fp16@margin5"):
        with pytest.raises(ValueError, match=r"@margin<percent> needs an uncompressed fp32 pipedap variant"):
            M.parse_strategy(bad)


def test_clip_suffix_selects_clip_by_norm_on_ddp_and_uncompressed_pipedap():
    for name, base in (("ddp@clip1", "ddp"), ("pipedap-dear@clip1", "pipedap"), ("pipedap-optimal@clip1", "pipedap")):
        sp = M.parse_strategy(name)
        assert (sp.name, sp.family, sp.clip) == (name, base, 1.0)
        assert sp.trainer_kwargs == {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "norm"}
    assert M.parse_strategy("pipedap-optimal@clip1").schedule == "optimal"
    sp = M.parse_strategy("pipedap-optimal@fp16@clip0.5@nice3")
    assert (sp.wire, sp.clip, sp.nice) == ("fp16", 0.5, 3)
    assert M.parse_strategy("pipedap-optimal@part1@margin5@clip2").clip == 2.0
    assert M.parse_strategy("ddp").clip is None and M.parse_strategy("pipedap-dear").trainer_kwargs == {}
    # a clipped variant keeps its planner's trials and warm-up; it is not a compressed variant of anything
    assert M.plan_trials("pipedap-optimal@clip1") == 4 and M.extra_warmup_steps("pipedap-optimal@clip1") == 56
    assert M.plan_trials("ddp@clip1") == 1 and M.extra_warmup_steps("ddp@clip1") == 0
    assert M.uncompressed_name("ddp@clip1") is None and M.uncompressed_name("pipedap-dear@clip1") is None
    assert M.uncompressed_name("pipedap-dear@fp16@clip1") == "pipedap-dear@clip1"
    assert {"ddp@clip1", "pipedap-dear@clip1", "pipedap-optimal@clip1"} <= set(M.valid_strategies())
    assert not any("@clip" in s for s in M.all_strategies())
    a = M.parse_args(["--strategies",
                      "ddp,ddp@clip1,pipedap-dear,pipedap-dear@clip1,pipedap-optimal,pipedap-optimal@clip1"])
    assert a.strategies == ["ddp", "ddp@clip1", "pipedap-dear", "pipedap-dear@clip1", "pipedap-optimal",
                            "pipedap-optimal@clip1"]


def test_clip_suffix_rejects_bad_values_and_strategies():
    for bad in ("ddp@clip0", "ddp@clip", "ddp@clip-1", "ddp@clipx", "ddp@clipnan", "ddp@clip1e-3", "pipedap-dear@clip0",
                "pipedap-optimal@clip0.0", "pipedap-optimal@clip 1"):
        with pytest.raises(ValueError, match=r"valid: @clip<max_norm> with a decimal number > 0 \(Trainer "
                                             r"gradient_clip_val, algorithm norm\)"):
            M.parse_strategy(bad)
    for bad in ("pipedap-optimal+fp16@clip1", "pipedap-dear+powersgd:inline@clip1"):
        with pytest.raises(ValueError, match=r"@clip<max_norm> needs ddp or an uncompressed pipedap variant"):
            M.parse_strategy(bad)
    for bad in ("ddp_tuned@clip1", "fsdp2@clip1", "ddp+fp16hook@clip1", "ddp@fp16", "ddp@nice3"):
        with pytest.raises(ValueError, match=r"takes no suffix but @clip<max_norm>, and only ddp takes that"):
            M.parse_strategy(bad)
    with pytest.raises(ValueError,
                       match=r"bad suffix '@clip2' in strategy 'ddp@clip1@clip2': 'ddp' takes @clip<max_norm> once"):
        M.parse_strategy("ddp@clip1@clip2")
    with pytest.raises(ValueError, match=r"@clip<max_norm> with max_norm > 0, @margin<percent>"):
        M.parse_strategy("pipedap-dear@clip1@clip2")
    with pytest.raises(ValueError, match=r"unknown strategy 'dp@clip1'; valid: .*@clip<max_norm>"):
        M.parse_strategy("dp@clip1")


def test_clip_suffix_passes_clip_by_norm_to_the_trainer(monkeypatch):
    import lightning_pipedap.bench.matrix.worker as W

    seen = {}

    def fake_fit(spec, strategy, ds, steps, devices_kw, trainer_kw=None):
        seen[strategy if isinstance(strategy, str) else type(strategy).__name__] = trainer_kw
        timer = W.StepTimer(10.0)
        timer.starts, timer.joules = [float(i) for i in range(steps + 1)], [0.0] * (steps + 1)
        return timer

    monkeypatch.setattr(W, "_fit", fake_fit)
    spec = dict(steps=2, warmup=1, watts=10.0, timeline=False)
    W._run_variant(spec, "ddp@clip1", None, 2)
    assert seen == {"ddp": {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "norm"}}
    W._run_variant(spec, "ddp", None, 2)
    assert seen["ddp"] == {}


def test_pipedap_variants_run_without_a_start_up_budget():
    # extra_warmup_steps budgets the whole measured plan selection; the strategy's default start-up budget (10% of
    # this short fit's steps) would install the planner's schedule without any trial
    import lightning_pipedap.bench.matrix.worker as W

    for name in ("pipedap-optimal", "pipedap-optimal@clip1", "pipedap-dear"):
        assert W._make_strategy(dict(timeline=False), name, 2, None).config.startup_budget is None


def test_machine_description_counts_cores_whatever_omp_num_threads_says(monkeypatch):
    # GNU nproc honours OMP_NUM_THREADS, which every documented command sets to 1
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert f", {len(os.sched_getaffinity(0))} cores (nproc)," in M.machine_description()
