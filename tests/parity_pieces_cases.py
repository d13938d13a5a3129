"""Parity with Lightning's ``"ddp"`` when the planned schedule splits a parameter over two buckets.

Run as a script on every rank (as :mod:`tests.parity_cases`)::

    LOCAL_RANK=r WORLD_SIZE=2 ... python -m tests.parity_pieces_cases OUT.json case1 case2 ...

The planner is not asked for pieces here: ``Planning.plan`` is wrapped so that its candidate (one:
``plan_trials=1``) has its largest parameter re-split into two pieces, element ranges ``[0, n/2)`` and
``[n/2, n)``, the first fused with the parameters before it in its bucket, the second with those after
it (tensor partitioning, ByteScheduler SOSP 2019). Suffixes of a case name: ``_dear`` also replaces the
op list by DeAR's (RS in backward order, AG in forward order), ``_view`` turns ``gradient_as_bucket_view``
on, ``_defer`` passes ``defer_update=True``, ``_sync`` ``defer_update=False`` (write-back after each
backward), and ``_splitunused`` splits the 16-element weight of the ``extra`` layer of the ``unused``
models (no rank uses it in odd steps) instead of the largest parameter. Rank 0 writes ``{case: {"diff":
max |param - ddp param|, "installed": the installed schedule, "forward": buckets applied in the next
forward}}``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Sequence

import torch

from lightning_pipedap import PipeDAPStrategy
from lightning_pipedap.schedule import Op, OpKind, Schedule, dear_ops
from tests.parity_cases import CASES, max_diff, train

#: the parity cases run with a split parameter (model, optimizer, trainer options from ``parity_cases.CASES``)
PIECES_CASES = ("sgd_momentum", "adamw_groups_steplr", "clip_norm", "clip_value", "accumulate2", "unused_some_steps")
#: ... and again with ``gradient_as_bucket_view=True`` (the buckets holding a piece keep the copy path)
VIEW_CASES = ("sgd_momentum", "clip_norm")
#: a parameter split while unused in some steps: ``extra.weight`` (4x4) of ``Unused`` (set_to_none: .grad None
#: then, not stepped) and ``UnusedKeepGrad`` (zero .grad kept: stepped by momentum and weight decay)
UNUSED_CASES = ("unused_some_steps_splitunused", "unused_zero_grad_keep_splitunused_defer")
#: sync mode (``defer_update=False``): the averaged gradients written back to ``.grad`` piece by piece
SYNC_CASES = ("clip_norm_sync", "accumulate2_sync", "unused_some_steps_splitunused_sync")
#: the op list the wrapped planner's candidates get: ``"planned"`` (the planner's own) or ``"dear"``; and
#: which parameter is split: ``"largest"`` or ``"extra"`` (the only one of 16 elements)
OPS: dict[str, Any] = {"kind": "planned", "split": "largest", "plans": 0}
#: stop at step 8 with a checkpoint and resume from it: the resumed run installs the checkpoint's split plan
RESUME_CASE = "resume_mid_epoch"
#: the strategy's own ``partition_mb`` path (no patched planning): the partitioned plan is a trial candidate and
#: the measured selection is forced to choose it
OPTION_CASE = "partition_mb_option"


def split_largest(schedule: Schedule, numels: Sequence[int], big: int | None = None) -> Schedule:
    """``schedule`` (over whole parameters) with its largest parameter (or parameter ``big``) split in two halves
    over two buckets.

    The bucket holding the parameter ``P`` (``[..., P, ...]``) becomes ``[..., P[0:h]]`` and ``[P[h:n], ...]``;
    each op on it becomes the same op on both parts (reductions in backward order, gathers in forward order).
    """
    big = max(range(len(numels)), key=numels.__getitem__) if big is None else big
    half = numels[big] // 2
    pieces: list[tuple[int, int, int]] = []
    buckets: list[tuple[int, ...]] = []
    new_index: list[list[int]] = []
    for bk in schedule.buckets:
        cur: list[int] = []
        parts: list[int] = []
        for i in bk:
            if i == big:
                pieces.append((i, 0, half))
                cur.append(len(pieces) - 1)
                buckets.append(tuple(cur))
                parts.append(len(buckets) - 1)
                pieces.append((i, half, numels[i]))
                cur = [len(pieces) - 1]
            else:
                pieces.append((i, 0, numels[i]))
                cur.append(len(pieces) - 1)
        buckets.append(tuple(cur))
        parts.append(len(buckets) - 1)
        new_index.append(parts)
    ops = tuple(Op(op.kind, nb) for op in schedule.ops
                for nb in (new_index[op.bucket] if op.kind is OpKind.ALL_GATHER else reversed(new_index[op.bucket])))

    def per_part(flags: Any) -> Any:
        return None if flags is None else tuple(bool(flags[b]) for b, parts in enumerate(new_index) for _ in parts)

    return Schedule(tuple(buckets), ops, schedule.name, schedule.predicted_iteration_s, per_part(schedule.compressed),
                    per_part(schedule.wire16), tuple(pieces)).validate(len(numels), numels)


def patch_planning() -> Any:
    """Wrap ``Planning.plan``: every candidate gets its largest parameter split (:func:`split_largest`)."""
    from lightning_pipedap.strategy.planning import Planning

    real = Planning.plan

    def plan(self: Any, model_name: str, layer_names: list[str], params: list[torch.Tensor], engine: Any,
             *args: Any) -> Any:
        schedules, no_overlap = real(self, model_name, layer_names, params, engine, *args)
        OPS["plans"] += 1
        numels = [p.numel() for p in params]
        big = numels.index(16) if OPS["split"] == "extra" else None
        split = [split_largest(s, numels, big) for s in schedules]
        if OPS["kind"] == "dear":
            split = [Schedule(s.buckets, dear_ops(len(s.buckets)), s.name, s.predicted_iteration_s, s.compressed,
                              s.wire16, s.pieces).validate(len(numels), numels) for s in split]
        return split, no_overlap

    Planning.plan = plan
    return real


def run_case(name: str, view: bool, defer: bool | None = None) -> dict[str, Any]:
    model_name, model_kw, trainer_kw = CASES[name]
    ddp_name = "ddp_find_unused_parameters_true" if model_name.startswith("unused") else "ddp"
    ref = train(model_name, model_kw, trainer_kw, ddp_name)
    strategy = PipeDAPStrategy(schedule="optimal", bucket_cap_mb=0.002, plan_trials=1,
                               gradient_as_bucket_view=view, **({} if defer is None else {"defer_update": defer}))
    out = train(model_name, model_kw, trainer_kw, strategy)
    return {"diff": max_diff(out, ref), "installed": strategy.installed_schedule,
            "forward": strategy.update_counts["forward"]}


def run_resume_case(at: int = 8) -> dict[str, Any]:
    """Stop mid-epoch (step 8 of 18) with a checkpoint, resume, compare with the uninterrupted run (and DDP)."""
    import tempfile

    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.parity_cases import _shared_dir

    kw = {"opt": "adamw", "sched": "step"}

    def strategy() -> PipeDAPStrategy:
        return PipeDAPStrategy(schedule="optimal", bucket_cap_mb=0.002, plan_trials=1)

    ref = train("mlp", kw, {}, "ddp")
    full = train("mlp", kw, {}, strategy())
    with tempfile.TemporaryDirectory() as d:
        d = _shared_dir(d)
        cb = ModelCheckpoint(dirpath=d, every_n_train_steps=at, save_top_k=-1, filename="mid-{step}")
        train("mlp", kw, {}, strategy(), callbacks=[cb], max_steps=at, root_dir=d)
        plans = OPS["plans"]
        st = strategy()
        resumed = train("mlp", kw, {}, st, ckpt_path=os.path.join(d, f"mid-step={at}.ckpt"), root_dir=d)
    return {"diff": max_diff(resumed, full), "ddp_diff": max_diff(resumed, ref), "installed": st.installed_schedule,
            "forward": st.update_counts["forward"], "plans_in_resumed_run": OPS["plans"] - plans}


def run_option_case(real_plan: Any) -> dict[str, Any]:
    """``PipeDAPStrategy(partition_mb=...)`` end to end: the real ``Planning.plan`` splits the layers larger than
    0.001 MiB (262 fp32 elements), with an α-β model of no start-up and a slow link, and offers the partitioned plan as
    a trial candidate; the measured selection is forced to pick it (``*+pieces*`` name), and the rest of the fit runs it
    (AdamW, param groups, StepLR)."""
    import lightning_pipedap.strategy.controller as ctl
    from lightning_pipedap.strategy.planning import Planning

    chooser, patched = ctl.choose_candidate, Planning.plan

    def forced(names: Any, windows: Any, floor: Any = None, **kw: Any) -> Any:
        best, medians, notes = chooser(names, windows, floor, **kw)
        split = [k for k, n in enumerate(names) if "+pieces" in n]
        return (split[0] if split else best), medians, notes

    ctl.choose_candidate, Planning.plan = forced, real_plan
    try:
        kw = {"opt": "adamw", "sched": "step"}
        ref = train("mlp", kw, {}, "ddp")
        from lightning_pipedap.plan import CostModel

        # (no start-up cost per op and a slow link: the planner keeps pieces in buckets of their own)
        cm = CostModel.from_allreduce(0.0, 1e-6)
        st = PipeDAPStrategy(schedule="optimal", bucket_cap_mb=0.002, partition_mb=0.001, plan_trials=5,
                             startup_budget=None, trial_steps=1, trial_rounds=1, trial_window_s=0,
                             torch_ddp_candidate=False, cost_model=cm)
        out = train("mlp", kw, {}, st)
        return {"diff": max_diff(out, ref), "installed": st.installed_schedule,
                "forward": st.update_counts["forward"]}
    finally:
        ctl.choose_candidate, Planning.plan = chooser, patched


def main(out_path: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    real_plan = patch_planning()
    results: dict[str, Any] = {}
    for name in names:
        if name == OPTION_CASE:
            try:
                results[name] = run_option_case(real_plan)
            except Exception as exc:
                import traceback

                results[name] = {"error": f"{exc!r}\n{traceback.format_exc()}"}
            continue
        if name == RESUME_CASE:
            OPS["kind"], OPS["split"] = "planned", "largest"
            try:
                results[name] = run_resume_case()
            except Exception as exc:
                import traceback

                results[name] = {"error": f"{exc!r}\n{traceback.format_exc()}"}
            continue
        base, found = name, set()
        for suffix in ("_sync", "_defer", "_splitunused", "_view", "_dear"):
            if base.endswith(suffix):
                base = base[: -len(suffix)]
                found.add(suffix)
        OPS["kind"] = "dear" if "_dear" in found else "planned"
        OPS["split"] = "extra" if "_splitunused" in found else "largest"
        try:
            defer = True if "_defer" in found else False if "_sync" in found else None
            results[name] = run_case(base, "_view" in found, defer)
        except Exception as exc:  # one failing case must not hide the others
            import traceback

            results[name] = {"error": f"{exc!r}\n{traceback.format_exc()}"}
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
