"""The Hydra app end to end in subprocesses: fail-fast validation, and 2-job x 2-rank multiruns that
finish, write their job directories and the sweep summary, and leave no process behind."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import uuid

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.multiprocess


def _run(args, cwd, timeout=300):
    marker = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, PIPEDAP_TEST_MARKER=marker, HYDRA_FULL_ERROR="0")
    for k in ("LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "NODE_RANK", "RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "lightning_pipedap.app.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, marker


def _processes_with(marker):
    """PIDs of live processes whose environment carries ``marker`` (children inherit it)."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"PIPEDAP_TEST_MARKER={marker}".encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def test_bad_value_fails_before_any_process(tmp_path):
    proc, marker = _run(["strategy.bucket_cap_mb=-1", f"hydra.run.dir={tmp_path}/run"], tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "strategy: bucket_cap_mb must be a positive number, got -1.0" in proc.stderr
    assert "Initializing distributed" not in proc.stdout + proc.stderr
    assert not os.path.exists(tmp_path / "run" / "results.json")


def test_bad_sweep_value_stops_the_sweep_before_the_first_job(tmp_path):
    proc, _ = _run(["-m", "scheduler=dear,foo", f"hydra.sweep.dir={tmp_path}/sweep"], tmp_path, timeout=120)
    assert proc.returncode == 1
    assert "Error in sweep job #1 (scheduler=foo)" in proc.stderr
    assert "Available options in 'scheduler'" in proc.stderr and "allreduce" in proc.stderr
    assert not os.path.exists(tmp_path / "sweep" / "0")


def test_strategy_schedule_against_the_scheduler_group_stops_before_any_process(tmp_path):
    """`scheduler=dear strategy.schedule=allreduce` ran allreduce while recording dear (and a sweep ran it twice)."""
    proc, _ = _run(["scheduler=dear", "strategy.schedule=allreduce", f"hydra.run.dir={tmp_path}/run"], tmp_path,
                   timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "strategy.schedule='allreduce' conflicts with scheduler='dear'" in proc.stderr
    assert "Initializing distributed" not in proc.stdout + proc.stderr
    proc, _ = _run(["-m", "scheduler=dear", "strategy.schedule=dear,allreduce", f"hydra.sweep.dir={tmp_path}/sweep"],
                   tmp_path, timeout=120)
    assert proc.returncode == 1 and "Error in sweep job #1 (scheduler=dear strategy.schedule=allreduce)" in proc.stderr
    assert not os.path.exists(tmp_path / "sweep" / "0")


TINY = ["data.limit=192", "data.batch_size=16", "trainer.max_epochs=1", "trainer.enable_progress_bar=false",
        "callbacks.speedup.warmup_steps=1", "callbacks.speedup.window_steps=2", "~callbacks.comm_timeline"]


def _check_sweep(tmp_path, proc, marker, strategies):
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    sweep = tmp_path / "sweep"
    assert sorted(os.listdir(tmp_path)) == ["sweep"]  # nothing written outside the sweep dir
    assert ({"0", "1", "sweep_summary.csv", "sweep_summary.md", "sweep_summary.png", "tensorboard"}
            <= set(os.listdir(sweep)))
    for job in ("0", "1"):
        res = json.loads((sweep / job / "results.json").read_text())
        assert res["processes"] == 2 and res["strategy"] == strategies[int(job)]
        assert res["output_dir"] == str(sweep / job)
        assert 0.0 <= res["val_acc"] <= 1.0 and res["iteration_ms"] > 0
        assert os.path.isdir(sweep / job / "tensorboard") and os.listdir(sweep / job / "checkpoints")
    with open(sweep / "sweep_summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["job"] for r in rows] == ["0", "1"]
    assert out.count("All distributed processes registered. Starting with 2 processes") == 2
    assert _processes_with(marker) == []


def test_sweep_runs_each_distinct_job_once(tmp_path):
    """``strategy=ddp scheduler=allreduce,dear``: the scheduler does not apply to DDP, so job 1 is job 0;
    it is not run again and its results.json says so (the sweep of docs/LAUNCHING.md runs 3 distinct jobs, not 4)."""
    proc, marker = _run(["-m", "strategy=ddp", "scheduler=allreduce,dear", *TINY,
                         f"hydra.sweep.dir={tmp_path}/sweep"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    sweep = tmp_path / "sweep"
    first, second = (json.loads((sweep / j / "results.json").read_text()) for j in ("0", "1"))
    assert first["duplicate_of"] is None and second["duplicate_of"] == 0
    assert second["job_num"] == 1 and "scheduler=dear" in second["overrides"]
    assert "scheduler=allreduce" in first["overrides"]
    assert second["effective_key"] == first["effective_key"] and second["iteration_ms"] == first["iteration_ms"]
    assert out.count("All distributed processes registered. Starting with 2 processes") == 1
    assert "job #1" in out and "not run again" in out, out[-3000:]
    with open(sweep / "sweep_summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["job"] for r in rows] == ["0", "1"] and rows[0]["iteration_ms"] == rows[1]["iteration_ms"]
    assert _processes_with(marker) == []


def _pipedap_registered() -> bool:
    try:
        import lightning_pipedap  # noqa: F401
        from lightning.pytorch.strategies import StrategyRegistry
    except Exception:  # noqa: BLE001
        return False
    return "pipedap" in StrategyRegistry


@pytest.mark.skipif(not _pipedap_registered(), reason="`import lightning_pipedap` does not register 'pipedap' yet")
def test_multirun_two_jobs_two_ranks_pipedap(tmp_path):
    # two pipedap jobs back to back in one Hydra process: the second must start its own ranks again
    proc, marker = _run(["-m", "strategy=pipedap", "scheduler=allreduce,dear", *TINY,
                         f"hydra.sweep.dir={tmp_path}/sweep"], tmp_path)
    _check_sweep(tmp_path, proc, marker, ["pipedap", "pipedap"])
    res = [json.loads((tmp_path / "sweep" / j / "results.json").read_text()) for j in ("0", "1")]
    assert [r["schedule"] for r in res] == ["allreduce", "dear"]
    # what ran: the installed final schedule in results.json and the log file, not only the configured name
    ran = [r["pipedap"] for r in res]
    assert [r["installed"]["name"] for r in ran] == ["allreduce", "dear"]
    assert [op[0] for op in ran[1]["installed"]["ops"]] == ["RS", "AG"] * ran[1]["buckets"]
    assert all(r["compressed_buckets"] == 0 and r["compression_note"] is None for r in ran)
    for j in ("0", "1"):
        hparams = list((tmp_path / "sweep" / j).rglob("hparams.yaml"))
        assert hparams and "_target_: lightning_pipedap.PipeDAPStrategy" in hparams[0].read_text()
        logs = list((tmp_path / "sweep" / j).glob("*.log"))
        text = "".join(f.read_text() for f in logs)
        assert "[lightning_pipedap][INFO] - pipedap: schedule " in text, [f.name for f in logs]
        # rank 1's own file (the name of a single run's rank-1 log) carries its own set-up line (it was empty)
        rank1 = (tmp_path / "sweep" / j / "train_ddp_process_1.log").read_text()
        assert "[lightning_pipedap][INFO] - [rank 1] pipedap: rank 1 of 2 set up on " in rank1, rank1
        assert not list((tmp_path / "sweep" / j).glob("*_rank1.log"))
        # and in TensorBoard's TEXT tab
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

        events = list((tmp_path / "sweep" / j).rglob("events.out.tfevents.*"))
        acc = [EventAccumulator(str(e), size_guidance={"tensors": 0}).Reload() for e in events]
        texts = [t.tensor_proto.string_val[0].decode()
                 for a in acc if "pipedap/what_ran/text_summary" in a.Tags()["tensors"]
                 for t in a.Tensors("pipedap/what_ran/text_summary")]
        assert texts and f"**installed** `{ran[int(j)]['installed']['name']}`" in texts[0], texts
    # same seed and data: both schedules apply the same averaged gradients, so the same model
    assert res[1]["val_acc"] == pytest.approx(res[0]["val_acc"], abs=1e-6)
    assert res[1]["val_loss"] == pytest.approx(res[0]["val_loss"], rel=1e-5)


def test_multirun_with_the_default_sweep_dir(tmp_path):
    """The form of docs/LAUNCHING.md (no hydra.sweep.dir): the sweep lands under <launch dir>/logs/train/multiruns."""
    proc, marker = _run(["-m", "strategy=ddp", *TINY], tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    runs = os.listdir(tmp_path / "logs" / "train" / "multiruns")
    assert len(runs) == 1
    sweep = tmp_path / "logs" / "train" / "multiruns" / runs[0]
    assert json.loads((sweep / "0" / "results.json").read_text())["output_dir"] == str(sweep / "0")
    assert (sweep / "sweep_summary.csv").is_file()
    assert _processes_with(marker) == []


def test_ckpt_path_resumes_as_ddp_does(tmp_path):
    """``pipedap-train ckpt_path=...``: one epoch, then a second from its last.ckpt, gives exactly what DDP's
    resumed run gives (a resumed run is not the uninterrupted one under DDP either: the shuffling RNG restarts)."""
    common = [*TINY, "callbacks.model_checkpoint.save_last=true", "scheduler=dear"]
    res = {}
    for strategy in ("ddp", "pipedap"):
        out = tmp_path / strategy
        first, marker = _run([*common, f"strategy={strategy}", "trainer.max_epochs=1", f"paths.output_dir={out}/1"],
                             tmp_path)
        assert first.returncode == 0, first.stderr[-3000:]
        resumed, _ = _run([*common, f"strategy={strategy}", "trainer.max_epochs=2",
                           f"ckpt_path={out / '1' / 'checkpoints' / 'last.ckpt'}", f"paths.output_dir={out}/2"],
                          tmp_path)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "Restoring states from the checkpoint path" in resumed.stdout + resumed.stderr
        res[strategy] = [json.loads((out / k / "results.json").read_text()) for k in ("1", "2")]
        assert _processes_with(marker) == []
    for k in range(2):
        assert res["pipedap"][k]["val_loss"] == pytest.approx(res["ddp"][k]["val_loss"], abs=1e-6)
        assert res["pipedap"][k]["val_acc"] == res["ddp"][k]["val_acc"]
    assert res["pipedap"][1]["val_loss"] != res["pipedap"][0]["val_loss"]  # the second epoch trained


def test_missing_ckpt_path_is_refused_before_any_process(tmp_path):
    proc, _ = _run(["ckpt_path=/nonexistent/x.ckpt"], tmp_path, timeout=120)
    assert proc.returncode == 2 and "no such checkpoint file" in proc.stderr, proc.stderr[-2000:]


def test_single_run_rank_one_log_has_its_own_messages(tmp_path):
    """A single (popen) run: Lightning names rank 1's Hydra log train_ddp_process_1.log; it used to stay empty
    (every pipedap message was rank-0-only). Now it has rank 1's set-up line, rank-prefixed, and no plan lines."""
    proc, marker = _run([*TINY, "scheduler=dear", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank1 = (tmp_path / "run" / "train_ddp_process_1.log").read_text()
    assert "[lightning_pipedap][INFO] - [rank 1] pipedap: rank 1 of 2 set up on " in rank1, rank1
    assert "schedule dear)" in rank1 and "pipedap: schedule dear:" not in rank1
    rank0 = (tmp_path / "run" / "train.log").read_text()
    assert "[lightning_pipedap][INFO] - pipedap: rank 0 of 2 set up on " in rank0 and "[rank 1]" not in rank0
    assert _processes_with(marker) == []


def test_a_second_run_into_the_same_directory_keeps_the_first_and_writes_a_fresh_version(tmp_path):
    """``hydra.run.dir=X`` twice: the second run silently overwrote results.json and wrote its events into the first
    run's TensorBoard folder. Now X is kept as it is, the second run (both ranks) writes into X/version_1 and the log
    and the summary say so."""
    run = tmp_path / "run"
    args = [*TINY, "strategy=ddp", "~callbacks.energy", f"hydra.run.dir={run}"]
    first, marker = _run(args, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before = (run / "results.json").read_text()
    events = sorted(p.name for p in (run / "tensorboard").iterdir())
    second, _ = _run(args, tmp_path)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert (run / "results.json").read_text() == before  # the first run is untouched
    assert sorted(p.name for p in (run / "tensorboard").iterdir()) == events
    res = json.loads((run / "version_1" / "results.json").read_text())
    assert res["output_dir"] == str(run / "version_1") and res["tensorboard_dir"].startswith(str(run / "version_1"))
    assert os.listdir(run / "version_1" / "tensorboard") and os.listdir(run / "version_1" / "checkpoints")
    said = (f"{run} already holds a run (results.json, measure_summary.json, tensorboard, checkpoints): "
            "its results are kept")
    assert said in (run / "train.log").read_text() and f"output dir      {said}" in second.stdout, out[-3000:]
    assert f"results         {run / 'version_1' / 'results.json'}" in second.stdout
    assert not (run / "version_2").exists()  # rank 1 wrote where rank 0 did
    assert _processes_with(marker) == []
