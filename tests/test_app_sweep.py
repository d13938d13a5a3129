"""Sweep summary (pure: fake results.json files, hand-computed speedups)."""

from __future__ import annotations

import csv
import glob
import json
import os

from lightning_pipedap.app.sweep import add_speedup, markdown_table, table_rows, write_summary


def _job(root, num, strategy, schedule, overrides, it_ms, energy=None):
    d = os.path.join(root, str(num))
    os.makedirs(d)
    res = {"job_num": num, "strategy": strategy, "schedule": schedule, "overrides": overrides, "processes": 2,
           "val_acc": 0.9, "iteration_ms": it_ms, "energy_J_per_step": energy,
           "energy_kind": "estimated" if energy else None, "fit_s": 1.0, "metrics": {}}
    with open(os.path.join(d, "results.json"), "w") as f:
        json.dump(res, f)


def test_speedup_is_against_the_ddp_job_with_the_same_other_overrides():
    rows = [
        {"strategy": "ddp", "overrides": ["strategy=ddp", "model=a"], "iteration_ms": 10.0},
        {"strategy": "pipedap", "overrides": ["strategy=pipedap", "scheduler=dear", "model=a"], "iteration_ms": 8.0},
        {"strategy": "ddp", "overrides": ["strategy=ddp", "model=b"], "iteration_ms": 30.0},
        {"strategy": "ddp", "overrides": ["model=b", "strategy=ddp", "scheduler=dear"], "iteration_ms": 50.0},
        {"strategy": "pipedap", "overrides": ["strategy=pipedap", "strategy.bucket_cap_mb=4", "model=b"],
         "iteration_ms": 20.0},
        {"strategy": "pipedap", "overrides": ["strategy=pipedap", "model=c"], "iteration_ms": 5.0},
    ]
    out = [r["speedup_vs_ddp"] for r in add_speedup(rows)]
    # model=a: 10/10, 10/8; model=b: reference = median(30, 50) = 40; model=c: no DDP job
    assert out == [1.0, 1.25, 40 / 30, 40 / 50, 2.0, None]


def test_write_summary_csv_markdown_png_tensorboard(tmp_path):
    root = str(tmp_path)
    _job(root, 0, "ddp", None, ["strategy=ddp"], 12.0, energy=0.3)
    _job(root, 1, "pipedap", "dear", ["strategy=pipedap"], 8.0, energy=0.2)
    paths = write_summary(root)
    with open(paths["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert [r["strategy"] for r in rows] == ["ddp", "pipedap"]
    assert [float(r["speedup_vs_ddp"]) for r in rows] == [1.0, 1.5]
    md = open(paths["md"]).read().splitlines()
    assert md[0].startswith("| job | strategy | schedule |") and len(md) == 4
    assert "| 1 | pipedap | dear |" in md[3] and "| 1.5 |" in md[3]
    with open(paths["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert glob.glob(os.path.join(paths["tensorboard"], "events.out.tfevents.*"))


def test_empty_sweep_writes_nothing(tmp_path):
    assert write_summary(str(tmp_path)) is None
    assert os.listdir(tmp_path) == []


def test_markdown_escapes_pipes():
    rows = table_rows([{"job_num": 0, "strategy": "ddp", "overrides": ["a=x|y"], "iteration_ms": None}])
    assert "a=x\\|y" in markdown_table(rows)


def test_a_speedup_from_ddps_reducer_says_so(tmp_path):
    """A pipedap job whose measured selection installed torch_ddp: the Markdown speedup names DDP's reducer,
    the CSV stays numeric with the schedule in its own column."""
    root = str(tmp_path)
    _job(root, 0, "ddp", None, ["strategy=ddp"], 10.1)
    _job(root, 1, "pipedap", "optimal", ["strategy=pipedap"], 10.0)
    _job(root, 2, "pipedap", "dear", ["strategy=pipedap", "scheduler=dear"], 5.05)
    for num, name in ((1, "torch_ddp"), (2, "dear")):
        path = os.path.join(root, str(num), "results.json")
        with open(path) as f:
            res = json.load(f)
        res["pipedap"] = {"installed": {"name": name}, "plan_selection": "finished (4 of 4 candidates measured)"}
        with open(path, "w") as f:
            json.dump(res, f)
    paths = write_summary(root, tensorboard=False)
    with open(paths["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert [r["installed"] for r in rows] == ["", "torch_ddp", "dear"]
    assert [round(float(r["speedup_vs_ddp"]), 3) for r in rows] == [1.0, 1.01, 2.0]
    md = open(paths["md"]).read()
    assert "| torch_ddp | finished (4 of 4 candidates measured) |" in md
    assert "| 1.01 (torch_ddp: DDP's reducer) |" in md
    assert "| 2 |" in md and "2 (torch_ddp" not in md
    assert "Job(s) #1: measured plan selection installed `torch_ddp`, PyTorch's own DDP reducer" in md


def test_a_job_that_was_not_run_again_is_marked(tmp_path):
    """A sweep job whose effective configuration an earlier job ran copies its results (``duplicate_of``): the
    Markdown table marks it, the CSV keeps its columns."""
    rows = table_rows([{"job_num": 0, "strategy": "ddp", "overrides": ["strategy=ddp", "scheduler=allreduce"],
                        "iteration_ms": 5.0},
                       {"job_num": 1, "strategy": "ddp", "overrides": ["strategy=ddp", "scheduler=dear"],
                        "iteration_ms": 5.0, "duplicate_of": 0}])
    md = markdown_table(rows).splitlines()
    assert md[2].startswith("| 0 | ddp |") and md[3].startswith("| 1 (= #0, not run again) | ddp |")
    _job(str(tmp_path), 0, "ddp", None, ["strategy=ddp"], 5.0)
    paths = write_summary(str(tmp_path), tensorboard=False)
    with open(paths["csv"]) as f:
        assert "duplicate_of" not in f.readline()


def test_the_bar_chart_marks_a_job_not_run_again_and_says_energy_was_estimated():
    """The plot drew a de-duplicated job (``strategy=ddp`` under two scheduler values) as a full bar of its own, and
    its energy panel did not say the energy was estimated, as the summary does."""
    from lightning_pipedap.app.sweep import bar_chart_figure

    raw = [{"job_num": 0, "strategy": "ddp", "overrides": ["strategy=ddp", "scheduler=allreduce"], "iteration_ms": 5.0,
            "energy_J_per_step": 0.3, "energy_kind": "estimated"},
           {"job_num": 1, "strategy": "ddp", "overrides": ["strategy=ddp", "scheduler=dear"], "iteration_ms": 5.0,
            "energy_J_per_step": 0.3, "energy_kind": "estimated", "duplicate_of": 0},
           {"job_num": 2, "strategy": "pipedap", "schedule": "dear", "overrides": ["strategy=pipedap"],
            "iteration_ms": 4.0, "energy_J_per_step": 0.25, "energy_kind": "estimated"}]
    rows = table_rows(add_speedup(raw))
    fig = bar_chart_figure(rows)
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["median iteration time (ms)", "speedup vs DDP",
                                               "energy per step (J, estimated)"]
    for ax in axes:
        assert [t.get_text() for t in ax.get_yticklabels()] == ["#0 ddp", "#1 ddp (same run as #0)",
                                                                "#2 pipedap/dear"]
        bars = [p for p in ax.patches if p.get_height() > 0.5]
        assert [bool(b.get_hatch()) for b in bars] == [False, True, False]
    # a sweep with both kinds labels each energy bar
    rows[0]["energy_kind"] = "measured"
    energy = bar_chart_figure(rows).axes[-1]
    assert energy.get_title() == "energy per step (J)"
    assert [t.get_text().strip() for t in energy.texts] == ["measured", "estimated", "estimated"]


def test_a_sweep_run_again_into_its_directory_is_read_from_the_fresh_version_folders(tmp_path):
    """A sweep run again into the same hydra.sweep.dir writes each job into <job>/version_N (the earlier results are
    kept): the summary reads the latest run of every job and says where it is."""
    root = str(tmp_path)
    _job(root, 0, "ddp", None, ["strategy=ddp"], 12.0)
    _job(root, 1, "pipedap", "dear", ["strategy=pipedap"], 8.0)
    for num, it_ms in ((0, 10.0), (1, 5.0)):
        d = os.path.join(root, str(num), "version_1")
        os.makedirs(d)
        with open(os.path.join(d, "results.json"), "w") as f:
            json.dump({"job_num": num, "strategy": "ddp" if num == 0 else "pipedap", "overrides": [],
                       "iteration_ms": it_ms, "output_dir": d, "earlier_run": f"{root}/{num} already holds a run",
                       "metrics": {}}, f)
    from lightning_pipedap.app.sweep import latest_results_file, read_results

    assert latest_results_file(os.path.join(root, "0")) == os.path.join(root, "0", "version_1", "results.json")
    assert [r["iteration_ms"] for r in read_results(root)] == [10.0, 5.0]
    paths = write_summary(root, tensorboard=False)
    with open(paths["csv"]) as f:
        assert [float(r["speedup_vs_ddp"]) for r in csv.DictReader(f)] == [1.0, 2.0]
    md = open(paths["md"]).read()
    assert "Job(s) #0, #1: the job directory already held an earlier run, kept as it was; this sweep's run is in " \
           f"`{root}/0/version_1`, `{root}/1/version_1`." in md
