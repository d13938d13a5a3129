"""Fault matrix, checkpoints after a failure: ``ModelCheckpoint(save_on_exception=True)`` writes the state of the last
step whose update completed, assembled on rank 0 without a collective (:mod:`lightning_pipedap.strategy.failure_state`),
and a resume from it is exact.

Jobs of 2 ranks (``tests/faults/train.py``: MLP, ``schedule="dear"``, deferred updates, SGD with momentum and a StepLR
stepping every 2 optimizer steps, so parameters, optimizer state and hyper-parameters all change per step), run at the
same time to save wall time:

- *back*: rank 1 raises at step 5; rank 0 fails when the update of the step it recorded after that cannot be gathered,
  with none of it applied: the trainer is set back to the step before it.
- *forward*: rank 0 raises 0.5 s into step 5 (``on_train_batch_start``, ``defer_update=True``): the previous step's
  update was gathered but not applied yet; rank 0 applies it and writes the step Lightning counts.
- *reference*: the same job uninterrupted, with a checkpoint after every step.

Asserted: the log names the step written; each exception checkpoint holds the reference checkpoint's parameters,
optimizer state, hyper-parameters and schedulers of that step, bit for bit; and resuming the *back* checkpoint to the
end of the epoch gives, bit for bit, what resuming the reference's checkpoint of the same step gives.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.test_faults import BOUND_S, Job, _shm

pytestmark = pytest.mark.multiprocess

COMMON = {"batches": 8, "momentum": 0.9, "sched": 1}


def _finish(jobs: list[Job]) -> list[list[int | None]]:
    codes = [j.wait(BOUND_S + 60) for j in jobs]
    left = [pid for j in jobs for pid in j.leftover()]
    for j in jobs:
        j.kill_all()
    assert not left, f"processes left behind: {left}"
    return codes


def _start(tmp: Path, name: str, fault: str, rank: int, **opts: object) -> Job:
    d = tmp / name
    d.mkdir()
    return Job(d, fault, rank, **{**COMMON, **opts})


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def _written(j: Job) -> tuple[Path, int]:
    """The exception checkpoint rank 0 wrote and the global_step its log names."""
    files = sorted((j.tmp / "ckpt").glob("*.ckpt"))
    assert len(files) == 1, (files, j.output(0)[-3000:])
    m = re.search(r"pipedap: writing (\S+) after the failure: the state of global_step (\d+), the last step whose "
                  r"update completed", j.output(0))
    assert m, j.output(0)[-3000:]
    assert Path(m.group(1)) == files[0]
    return files[0], int(m.group(2))


def _assert_same_state(ckpt: dict, ref: dict) -> None:
    assert ckpt["global_step"] == ref["global_step"]
    for k, v in ref["state_dict"].items():
        assert torch.equal(ckpt["state_dict"][k], v), k
    got, want = ckpt["optimizer_states"][0], ref["optimizer_states"][0]
    assert got["param_groups"] == want["param_groups"]
    for i, st in want["state"].items():
        assert torch.equal(got["state"][i]["momentum_buffer"], st["momentum_buffer"]), i
    assert ckpt["lr_schedulers"] == ref["lr_schedulers"]
    # what a resume restarts from: batches processed, optimizer steps completed (a checkpoint written at a batch's end
    # counts the batch as processed, not completed; Lightning's restart completes it)
    loops, want_loops = ckpt["loops"]["fit_loop"], ref["loops"]["fit_loop"]
    batches = "epoch_loop.batch_progress"
    assert loops[batches]["total"]["processed"] == want_loops[batches]["total"]["processed"]
    steps = "epoch_loop.automatic_optimization.optim_progress"
    assert loops[steps]["optimizer"]["step"]["total"]["completed"] == ckpt["global_step"]


def test_save_on_exception_writes_the_last_completed_step_and_resumes_exactly(tmp_path):
    shm_before = _shm()
    back = _start(tmp_path, "back", "raise", 1, at=5, save_on_exception=1)
    forward = _start(tmp_path, "forward", "raise_late", 0, at=5, save_on_exception=1, defer="true")
    ref = _start(tmp_path, "ref", "none", 0, ckpt_every=1)
    codes = _finish([back, forward, ref])
    assert codes[2] == [0, 0], ref.output()[-3000:]
    assert all(c not in (None, 0) for c in codes[0] + codes[1]), (codes, back.output()[-2000:],
                                                                  forward.output()[-2000:])
    assert "injected failure on rank 1 at step 5" in back.output(1)

    path, step = _written(back)
    assert step in (4, 5), back.output(0)[-3000:]  # (5 unless rank 1 left before step 5's update was gathered)
    assert "counters set back from" in back.output(0), back.output(0)[-3000:]
    _assert_same_state(_load(path), _load(ref.tmp / "ckpt" / f"epoch=0-step={step}.ckpt"))

    fpath, fstep = _written(forward)
    assert fstep == 5 and "its update had been gathered completely and was applied on this rank" in forward.output(0)
    _assert_same_state(_load(fpath), _load(ref.tmp / "ckpt" / "epoch=0-step=5.ckpt"))

    resumed = _start(tmp_path, "resumed", "none", 0, resume=path)
    resumed_ref = _start(tmp_path, "resumed_ref", "none", 0, resume=ref.tmp / "ckpt" / f"epoch=0-step={step}.ckpt")
    codes = _finish([resumed, resumed_ref])
    assert codes == [[0, 0], [0, 0]], (codes, resumed.output()[-3000:], resumed_ref.output()[-3000:])
    for r in range(2):
        got, want = _load(resumed.tmp / f"params.{r}.pt"), _load(resumed_ref.tmp / f"params.{r}.pt")
        for k, v in want.items():
            assert torch.equal(got[k], v), (r, k)
    new_shm = _shm() - shm_before
    assert not {n for n in new_shm if "torch" in n or "pipedap" in n}, f"/dev/shm entries left: {new_shm}"
