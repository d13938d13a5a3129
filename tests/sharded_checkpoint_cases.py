"""The multi-process cases of ``tests/test_sharded_checkpoint.py`` (``sharded_checkpoint=True``).

Run on every rank (the test starts them with Lightning's environment variables)::

    python -m tests.sharded_checkpoint_cases DIR save      # 2 ranks
    python -m tests.sharded_checkpoint_cases DIR resume    # 3 ranks, after save

Per case (:data:`CASES`), ``save``: the run stopped at step 8 with a sharded checkpoint (``DIR/<case>/dcp``) and with
a consolidated one (``DIR/<case>/full``); AdamW also the uninterrupted run (18 steps) and the resume from the sharded
checkpoint at 2 ranks. Rank 0 writes ``DIR/save.json``. ``resume``: at 3 ranks, resumed from the sharded and from the
consolidated checkpoint (shard sizes, slices and owners differ from the 2-rank ones): the gathered optimizer state at
the start, and parameters and optimizer state after the remaining steps, compared; AdamW also an unsharded run's
start state from the sharded checkpoint. Rank 0 writes ``DIR/resume.json``.
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
#: case -> (model, model kwargs, trainer kwargs): AdamW with a no-decay group and a step LR schedule (element ranges
#: of the buckets), and Muon + AdamW under manual optimization (parameter ownership: every parameter stepped whole
#: by one rank; ``deterministic``: owners by elements, the same layout in every run)
CASES = {"adamw": ("mlp", KW, {}), "muon_adamw": ("muon_adamw", {}, {"deterministic": True})}


def _strategy(**options: Any) -> PipeDAPStrategy:
    options.setdefault("shard_optimizer", True)
    return PipeDAPStrategy(bucket_cap_mb=0.002, schedule="dear", **options)


class StartState(pl.Callback):
    """At ``on_train_start`` (after the checkpoint was loaded): each optimizer's whole state dict as rank 0 sees it
    (``trainer.strategy.optimizer_state``: gathered from the shards when they hold it)."""

    pipedap_reads_model = False

    def __init__(self) -> None:
        self.state: Any = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # (a copy: an unsharded optimizer's state_dict holds its live tensors)
        self.state = [copy.deepcopy(trainer.strategy.optimizer_state(o)) for o in trainer.optimizers]


def _flat(sds: list[dict]) -> dict[str, torch.Tensor]:
    return {f"{j}/{i}/{k}": torch.as_tensor(v).reshape(-1).double()
            for j, sd in enumerate(sds) for i, st in sd["state"].items() for k, v in st.items()}


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _paths(d: Path, case: str) -> tuple[Path, Path]:
    return d / case / "dcp" / f"mid-step={AT}.ckpt", d / case / "full" / f"mid-step={AT}.ckpt"


def save(d: Path, case: str) -> dict[str, Any]:
    model, model_kw, trainer_kw = CASES[case]
    for sub, options in (("dcp", {"sharded_checkpoint": True}), ("full", {})):
        root = d / case / sub
        cb = ModelCheckpoint(dirpath=str(root), every_n_train_steps=AT, save_top_k=-1, filename="mid-{step}")
        train(model, model_kw, trainer_kw, _strategy(**options), callbacks=[cb], max_steps=AT, root_dir=str(root))
    dcp_path, full_path = _paths(d, case)
    out: dict[str, Any] = {}
    if case == "adamw":  # resumed at 2 ranks against the uninterrupted run
        full = train(model, model_kw, trainer_kw, _strategy())
        resumed = train(model, model_kw, trainer_kw, _strategy(), ckpt_path=str(dcp_path),
                        root_dir=str(d / case / "r2"))
        out["two_to_two"] = max_diff(resumed, full)
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


def resume(d: Path, case: str) -> dict[str, Any]:
    model, model_kw, trainer_kw = CASES[case]
    dcp_path, full_path = _paths(d, case)
    three = dict(trainer_kw, devices=3)
    variants = [("sharded", dcp_path, {}, -1), ("consolidated", full_path, {}, -1)]
    if case == "adamw":  # (one step: the state assembled whole on each rank)
        variants.append(("unsharded", dcp_path, {"shard_optimizer": False}, AT + 1))
    runs = {}
    for name, path, options, steps in variants:
        cb = StartState()
        res = train(model, model_kw, three, _strategy(**options), callbacks=[cb], ckpt_path=str(path),
                    max_steps=steps, root_dir=str(d / case / f"r3_{name}"))
        runs[name] = (res, cb.state)
    out: dict[str, Any] = {}
    if int(os.environ.get("RANK", "0")) == 0:
        ref = _flat(runs["consolidated"][1])
        out["start_state_sharded"] = max_diff(_flat(runs["sharded"][1]), ref)
        if "unsharded" in runs:
            out["start_state_unsharded"] = max_diff(_flat(runs["unsharded"][1]), ref)
        out["after_steps"] = max_diff(runs["sharded"][0], runs["consolidated"][0])
        b = torch.load(full_path, weights_only=False)["state_dict"]
        out["moved"] = max(float((runs["sharded"][0][k].double() - v.double()).abs().max()) for k, v in b.items())
    return out


def main(d: str, phase: str) -> None:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for case in CASES:
        try:
            results[case] = save(Path(d), case) if phase == "save" else resume(Path(d), case)
        except Exception as exc:  # (reported by the test, with the traceback; the other case still runs)
            import traceback

            results[case] = {"error": f"{exc!r}\n{traceback.format_exc()}"}
    if int(os.environ.get("RANK", "0")) == 0:
        (Path(d) / f"{phase}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
