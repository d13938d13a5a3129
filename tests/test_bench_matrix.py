"""Benchmark matrix: bounds and ratios, table rendering, CLI validation, and a testbed smoke run."""

from __future__ import annotations

import json
import math
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
    c = _cell(skipped={"pipedap-compress": "no compression= argument"})
    cells_md = M.format_cells_table([c])
    assert "| mlp | 1gbit | 2 | 17.9 | 256 | 500 | 600 | 550 | 40.0 | 550 | 550 |" in cells_md
    md = M.format_variants_table([c])
    lines = md.splitlines()
    assert len(lines) == 2 + 3
    row = next(line for line in lines if "pipedap-optimal" in line)
    cols = [x.strip() for x in row.strip("|").split("|")]
    assert cols[:10] == ["mlp 1gbit 2r", "pipedap-optimal", "600", "1.50", "1.09", "1.09", "12.5", "580", "50", "550"]
    assert "| mlp 1gbit 2r | pipedap-compress | not run |" in md and "no compression= argument" in md
    text = M.format_text_report(c)
    assert "lower bound 550 ms" in text and "pipedap-optimal" in text


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
    assert set(M.valid_strategies()) >= {"ddp", "ddp_tuned", "fsdp2", "pipedap-optimal", "pipedap-allreduce"}


def test_quick_selects_the_headline_cell():
    a = M.parse_args(["--quick", "--models", "gpt"])
    assert (a.models, a.links, a.ranks, a.strategies) == (["mlp"], ["1gbit"], [2], ["ddp", "pipedap-optimal"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--models", "mlp,bert"], "unknown model 'bert'; valid: mlp, resnet, gpt"),
        (["--links", "100mbit"], "unknown link '100mbit'; valid: 1gbit, 10gbit, none"),
        (["--strategies", "pipedap-fast"], "unknown strategy 'pipedap-fast'; valid: ddp, ddp_tuned, fsdp2, pipedap-"),
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
           "--strategies", "ddp,pipedap-dear", "--steps", "2", "--warmup", "5", "--json", str(out_json),
           "--markdown", str(tmp_path / "B.md"), "--chart", str(tmp_path / "c.png")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out_json.read_text())
    (cell,) = data["cells"]
    assert (cell["model"], cell["link"], cell["ranks"], cell["batch"]) == ("mlp", "none", 2, 4)
    assert cell["params_M"] == pytest.approx((16 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10) / 1e6)
    assert [v["name"] for v in cell["variants"]] == ["ddp", "pipedap-dear"]
    for v in cell["variants"]:
        assert v["steps"] == 2 and v["iter_s"] > 0 and math.isfinite(v["iter_s"])
    assert cell["compute_s"] > 0 and cell["allreduce_s"] > 0 and cell["rs_ag_s"] > 0
    md = (tmp_path / "B.md").read_text()
    assert md.count(M.MD_BEGIN) == 1 and "| mlp uncapped 2r | pipedap-dear |" in md
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
