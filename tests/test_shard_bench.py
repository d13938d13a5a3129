"""benchmarks/shard_bench.py: the table from synthetic results, and one tiny ``--quick`` run on loopback.

No timing assertions: the run checks that the markdown table parses (one row per variant and rank, numbers where a
variant ran, the reason where it did not) and the optimizer-state bytes, which do not depend on the machine: Adam's
state under ``pipedap`` equals ``ddp``'s, and ``ZeroRedundancyOptimizer``'s ranks hold disjoint parts that add up to
it. The ``pipedap-sharded`` checks skip, with the reason, while the strategy has no ``shard_optimizer``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "shard_bench.py"
RANKS = 2


@pytest.fixture(scope="module")
def bench():
    from tests._dist_util import load_script

    yield load_script(SCRIPT, "shard_bench")
    sys.modules.pop("shard_bench", None)


def _rank(variant: str, rank: int, step_ms: float, state: int = 1000, rss: float = 500.0) -> dict:
    return dict(variant=variant, rank=rank, world=2, params=10, state_bytes=state, peak_rss_mib=rss, fit_rss_mib=50.0,
                step_ms=step_ms, cpu_ms=step_ms / 2, fit_s=1.0, steps=10, first_step=3, note="")


def parse_table(text: str) -> tuple[list[str], list[list[str]]]:
    """(header cells, row cells) of the first markdown table in ``text``."""
    rows = [ln for ln in text.splitlines() if ln.startswith("|")]
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in rows]
    assert len(cells) >= 2 and set("".join(cells[1])) <= set("-:"), text
    return cells[0], cells[2:]


def test_table_best_round_ratios_and_errors(bench):
    runs = {
        "ddp": [[_rank("ddp", 0, 100.0), _rank("ddp", 1, 110.0)], [_rank("ddp", 0, 90.0), _rank("ddp", 1, 95.0)]],
        "zero": [[_rank("zero", 0, 150.0, state=600), _rank("zero", 1, 140.0, state=400)],
                 [{"variant": "zero", "rank": r, "error": "failed: TimeoutError: rank 1 still running"}
                  for r in range(2)]],
        "pipedap-sharded": [[{"variant": "pipedap-sharded", "rank": r, "error": "not available: TypeError: x | y"}
                             for r in range(2)]],
    }
    header, rows = parse_table(bench.render_table({2: runs}))
    assert len(header) == 3 + bench.NUMERIC_COLUMNS + 1
    assert all(len(r) == len(header) for r in rows)
    by = {(r[1], r[2]): dict(zip(header, r)) for r in rows}
    assert set(by) == {("ddp", "0"), ("ddp", "1"), ("zero", "0"), ("zero", "1"), ("pipedap-sharded", "–")}
    # ddp keeps its second round (slowest rank 95 < 110 ms); zero its only good one, against that ddp
    assert by["ddp", "0"]["step ms"] == "90.0" and "best of 110/95 ms" in by["ddp", "0"]["note"]
    state_ratio = header.index("optimizer state MiB") + 1  # (every ratio column is named "x ddp")
    zero1 = next(r for r in rows if r[1] == "zero" and r[2] == "1")
    assert by["zero", "1"]["step ms"] == "140.0" and zero1[state_ratio] == "0.40"  # 400 / 1000 bytes
    assert "1 round(s) failed" in by["zero", "0"]["note"]
    assert by["pipedap-sharded", "–"]["note"] == "not available: TypeError: x / y"


def test_bad_arguments_name_the_choices(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--variants", "ddp,nope"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--ranks", "1"])
    a = bench.parse_args(["--quick"])
    assert (a.link, a.size, a.ranks, a.rounds) == ("loopback", "small", [2], 2)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("shard") / "quick.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--size", "tiny", "--rounds", "1", "--steps", "4",
                           "--warmup", "2", "--json", str(out)], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(out) as f:
        raw = json.load(f)["cells"][str(RANKS)]
    header, rows = parse_table(done.stdout)
    return header, rows, raw


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_quick_table_parses(bench, quick_run):
    header, rows, raw = quick_run
    assert all(len(r) == len(header) for r in rows)
    for v in bench.VARIANTS:
        mine = [dict(zip(header, r)) for r in rows if r[1] == v]
        assert mine, f"no row for {v}"
        if mine[0]["rank"] == "–":  # a variant that did not run says why
            assert mine[0]["note"].startswith(("not available: ", "failed: ")), mine[0]
            assert v == "pipedap-sharded", f"{v} did not run: {mine[0]['note']}"
            continue
        assert sorted(int(m["rank"]) for m in mine) == list(range(RANKS))
        for m in mine:
            for col in ("optimizer state MiB", "peak RSS MiB", "step ms", "CPU ms/step", "fit s"):
                assert float(m[col]) > 0, (v, col, m)
    ratios = [i for i, h in enumerate(header) if h == "x ddp"]
    assert len(ratios) == 6
    assert all(r[i] == "1.00" for r in rows if r[1] == "ddp" for i in ratios)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_quick_optimizer_state_bytes(quick_run):
    _, _, raw = quick_run
    state = {v: [d["state_bytes"] for d in rr[0]] for v, rr in raw.items() if "error" not in rr[0][0]}
    params = raw["ddp"][0][0]["params"]
    # Adam: exp_avg + exp_avg_sq (fp32) per parameter and a scalar step per tensor, on every ddp rank
    assert state["ddp"][0] == state["ddp"][1] > 2 * 4 * params
    assert state["pipedap"] == state["ddp"]
    # ZeRO-1 partitions whole parameters: disjoint parts on the ranks, together ddp's state
    assert all(0 < s < state["ddp"][0] for s in state["zero"]) and sum(state["zero"]) == state["ddp"][0]
    # FSDP2 shards every parameter: each rank holds part of the moments (and its own step scalars)
    assert all(0 < s < state["ddp"][0] for s in state["fsdp2"])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_quick_sharded_pipedap_holds_a_shard(quick_run):
    _, _, raw = quick_run
    first = raw["pipedap-sharded"][0][0]
    if "error" in first:
        if first["error"].startswith("not available: "):
            pytest.skip(f"pipedap-sharded: {first['error']}")
        pytest.fail(f"pipedap-sharded: {first['error']}")
    ddp = raw["ddp"][0][0]["state_bytes"]
    sharded = [d["state_bytes"] for d in raw["pipedap-sharded"][0]]
    # each rank holds less than the whole state, and the ranks together hold at least both moments of every element
    assert all(0 < s < ddp for s in sharded), (sharded, ddp)
    assert sum(sharded) >= 2 * 4 * raw["ddp"][0][0]["params"], (sharded, ddp)
