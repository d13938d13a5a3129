"""The multi-process cases of ``tests/test_sharded_checkpoint.py`` (``sharded_checkpoint=True``).

Run on every rank (the test starts them with Lightning's environment variables)::

    python -m tests.sharded_checkpoint_cases DIR save      # 2 ranks
    python -m tests.sharded_checkpoint_cases DIR resume    # 3 ranks, after save

``save``: the uninterrupted sharded run (18 steps); the same run stopped at step 8 with a sharded checkpoint
(``DIR/dcp``) and with a consolidated one (``DIR/full``); the resume from the sharded one at 2 ranks. Rank 0 writes
``DIR/save.json``. ``resume``: at 3 ranks, resumed from the sharded and from the consolidated checkpoint (shard
sizes and slices differ from the 2-rank ones), the gathered optimizer state at the start and parameters and
optimizer state after the remaining steps compared; also an unsharded run's start state from the sharded checkpoint.
Rank 0 writes ``DIR/resume.json``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pipedap import PipeDAPStrategy
from lightning_pipedap.strategy.sharded_checkpoint import consolidate_sharded_checkpoint
from tests.parity_cases import max_diff, train

KW = {"opt": "adamw", "sched": "step"}
AT = 8


def _strategy(**options: Any) -> PipeDAPStrategy:
    options.setdefault("shard_optimizer", True)
    return PipeDAPStrategy(bucket_cap_mb=0.002, schedule="dear", **options)


class StartState(pl.Callback):
    """At ``on_train_start`` (after the checkpoint was loaded): the whole optimizer state dict as rank 0 sees it
    (``trainer.strategy.optimizer_state``: gathered from the shards when they hold it)."""

    pipedap_reads_model = False

    def __init__(self) -> None:
        self.state: Any = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # (a copy: an unsharded optimizer's state_dict holds its live tensors)
        self.state = copy.deepcopy(trainer.strategy.optimizer_state(trainer.optimizers[0]))


def _flat(sd: dict) -> dict[str, torch.Tensor]:
    return {f"{i}/{k}": torch.as_tensor(v).reshape(-1).double() for i, st in sd["state"].items() for k, v in st.items()}


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def save(d: Path) -> dict[str, Any]:
    full = train("mlp", KW, {}, _strategy())
    for sub, options in (("dcp", {"sharded_checkpoint": True}), ("full", {})):
        cb = ModelCheckpoint(dirpath=str(d / sub), every_n_train_steps=AT, save_top_k=-1, filename="mid-{step}")
        train("mlp", KW, {}, _strategy(**options), callbacks=[cb], max_steps=AT, root_dir=str(d / sub))
    dcp_path, full_path = d / "dcp" / f"mid-step={AT}.ckpt", d / "full" / f"mid-step={AT}.ckpt"
    resumed = train("mlp", KW, {}, _strategy(), ckpt_path=str(dcp_path), root_dir=str(d / "dcp"))
    out: dict[str, Any] = {"two_to_two": max_diff(resumed, full)}
    if int(os.environ.get("RANK", "0")) == 0:
        files = sorted(p.name for p in dcp_path.iterdir() if p.suffix == ".distcp")
        from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415

        md = FileSystemReader(str(dcp_path)).read_metadata()
        by_rank = [0, 0]
        for key, item in md.storage_data.items():  # (which rank's file holds each optimizer piece)
            if key.fqn.startswith("optim/"):
                by_rank[int(item.relative_path.split("_")[2])] += item.length
        a = consolidate_sharded_checkpoint(dcp_path)
        b = torch.load(full_path, weights_only=False)
        diffs = [k for k in ("state_dict", "optimizer_states", "lr_schedulers", "global_step", "epoch")
                 if not _same(a[k], b[k])]
        out.update(files=files, optim_bytes_by_rank=by_rank,
                   consolidated_vs_gathered="equal" if not diffs else f"differ: {diffs}")
    return out


def resume(d: Path) -> dict[str, Any]:
    dcp_path, full_path = d / "dcp" / f"mid-step={AT}.ckpt", d / "full" / f"mid-step={AT}.ckpt"
    three = {"devices": 3}
    runs = {}
    for name, path, options, steps in (("sharded", dcp_path, {}, -1), ("consolidated", full_path, {}, -1),
                                        ("unsharded", dcp_path, {"shard_optimizer": False}, AT + 1)):
        cb = StartState()
        res = train("mlp", KW, three, _strategy(**options), callbacks=[cb], ckpt_path=str(path), max_steps=steps,
                    root_dir=str(d / f"r3_{name}"))
        runs[name] = (res, cb.state)
    out: dict[str, Any] = {}
    if int(os.environ.get("RANK", "0")) == 0:
        ref = _flat(runs["consolidated"][1])
        out["start_state_sharded"] = max_diff(_flat(runs["sharded"][1]), ref)
        out["start_state_unsharded"] = max_diff(_flat(runs["unsharded"][1]), ref)
        out["after_steps"] = max_diff(runs["sharded"][0], runs["consolidated"][0])
        b = torch.load(full_path, weights_only=False)["state_dict"]
        out["moved"] = max(float((runs["sharded"][0][k].double() - v.double()).abs().max()) for k, v in b.items())
    return out


def main(d: str, phase: str) -> None:
    torch.set_num_threads(1)
    try:
        out = save(Path(d)) if phase == "save" else resume(Path(d))
    except Exception as exc:  # (reported by the test, with the traceback)
        import traceback

        out = {"error": f"{exc!r}\n{traceback.format_exc()}"}
    if int(os.environ.get("RANK", "0")) == 0:
        (Path(d) / f"{phase}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
