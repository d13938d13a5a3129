"""What a replay cell's measurements say against the targets (pure): the window bound from the measured
compute and communication, each variant's ratio to ``ddp``, to the best baseline and to the bound, and the
simulator's error; rendered as Markdown tables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_pipedap.bench.matrix.report import _ms, _x
from lightning_pipedap.bench.matrix.results import CellResult, installed_note
from lightning_pipedap.bench.matrix.spec import (BASE_STRATEGIES, COMPRESS_SEP, DDP_HOOKS, DEFAULT_PIPEDAP,
                                                 PIPEDAP_PREFIX, REFERENCE, WIRE_SUFFIXES)
from lightning_pipedap.bench.replay.cells import ReplayCell
from lightning_pipedap.bench.replay.model import replay_profile
from lightning_pipedap.plan.bounds import lower_bounds
from lightning_pipedap.plan.cost_model import CostModel

#: the variants every pipedap variant is compared with
BASELINES = BASE_STRATEGIES + tuple(DDP_HOOKS)
#: the baselines that send every gradient byte (fp32), the ones an uncompressed pipedap variant is held to;
#: a compressed one (``pipedap-...+<compressor>``) or a 16-bit wire one (``@fp16``, ``@bf16``) is held to all of
#: :data:`BASELINES`, DDP's fp16 hook included
DENSE_BASELINES = BASE_STRATEGIES
#: targets of issue 17 item 5
BOUND_TARGET, SIM_TOLERANCE, SIM_SHARE_TARGET = 1.05, 0.10, 0.90


def window_bound_s(cell: ReplayCell, compute_s: float, comm_s: float) -> float:
    """The tighter of the sum and window bounds (:func:`~lightning_pipedap.plan.bounds.lower_bounds`, no
    schedule: any fusion) of the replayed profile with its times scaled so that they add up to the measured
    compute-only iteration ``compute_s`` and a cost model whose all-reduce moves all gradient bytes in the
    measured ``comm_s`` (α = 0: one start-up less than any real bucket, so the bound stays a lower bound), s.

    Raises:
        ValueError: a non-positive time.
    """
    if compute_s <= 0 or comm_s <= 0:
        raise ValueError(f"compute_s and comm_s must be > 0, got {compute_s}, {comm_s}")
    prof = replay_profile(cell.options)
    prof = prof.scaled(compute_s / prof.t_compute)
    cm = CostModel.from_allreduce(0.0, comm_s / prof.total_bytes)
    return lower_bounds(prof, cm).best_s


@dataclass(frozen=True)
class VariantVerdict:
    """One variant of one cell against the targets.

    Attributes:
        name: strategy name.
        iter_s: measured median iteration, s.
        vs_ddp: ``ddp`` time / this time (> 1: faster than ddp).
        vs_best_baseline: pipedap variants: the fastest comparable baseline's time / this time (> 1: faster
            than all of them); uncompressed variants are compared with :data:`DENSE_BASELINES`, compressed ones
            with :data:`BASELINES` (the DDP compression hooks included).
        best_baseline: the name of that baseline (``None`` for the baselines themselves).
        to_bound: this time / the window bound.
        predicted_s: the planner's prediction (pipedap variants), s.
        sim_error: ``predicted / measured - 1`` (``None`` without a prediction).
        note: ``" (torch_ddp: DDP's reducer)"`` when measured selection installed DDP's reducer (then neither the
            time nor the prediction is a pipedap schedule's, nor, for ``@shard``, a sharded step's), else ``""``.
    """

    name: str
    iter_s: float
    vs_ddp: Optional[float]
    vs_best_baseline: Optional[float]
    best_baseline: Optional[str]
    to_bound: float
    predicted_s: Optional[float]
    sim_error: Optional[float]
    note: str = ""


@dataclass(frozen=True)
class CellVerdict:
    """A replay cell's set-up, measurement and verdicts.

    Attributes:
        setup: the cell's :class:`ReplayCell`.
        result: the matrix's :class:`CellResult` of it.
        bound_s: :func:`window_bound_s` of the measured compute and communication (the faster of the
            all-reduce and RS + AG of all gradients), s.
        hideable: the measured communication is shorter than the measured compute (the cells where the
            ≤ 1.05 × bound target applies).
        best_baseline: name of the fastest baseline of all.
        variants: per variant, in run order.
        run: tag of the launch the cell comes from (``""`` alone; ``"A"``, ``"B"``, ... when several results
            files are shown together, in file order).
    """

    setup: ReplayCell
    result: CellResult
    bound_s: float
    hideable: bool
    best_baseline: Optional[str]
    variants: tuple[VariantVerdict, ...]
    run: str = ""

    def variant(self, name: str) -> Optional[VariantVerdict]:
        """The verdict of variant ``name`` or ``None``."""
        return next((v for v in self.variants if v.name == name), None)


def sends_fewer_bytes(name: str) -> bool:
    """Whether pipedap variant ``name`` sends fewer than the fp32 gradient bytes: compressed
    (``pipedap-...+<compressor>``) or in the 16-bit wire format (an ``@fp16`` / ``@bf16`` suffix)."""
    return COMPRESS_SEP in name or any("@" + part in WIRE_SUFFIXES for part in name.split("@")[1:])


def judge(setup: ReplayCell, result: CellResult, run: str = "") -> CellVerdict:
    """The verdicts of one measured cell (``run``: :attr:`CellVerdict.run`)."""
    bound = window_bound_s(setup, result.compute_s, result.comm_s)

    def fastest(names: tuple[str, ...]):
        cands = [v for v in result.variants if v.name in names]
        return min(cands, key=lambda v: v.iter_s) if cands else None

    best_all, best_dense = fastest(BASELINES), fastest(DENSE_BASELINES)
    ref = result.variant(REFERENCE)
    out = []
    for v in result.variants:
        best = None
        if v.name.startswith(PIPEDAP_PREFIX):
            best = best_all if sends_fewer_bytes(v.name) else best_dense
        out.append(VariantVerdict(
            v.name, v.iter_s, ref.iter_s / v.iter_s if ref else None, best.iter_s / v.iter_s if best else None,
            best.name if best else None, v.iter_s / bound, v.predicted_s,
            v.predicted_s / v.iter_s - 1 if v.predicted_s else None, installed_note(v)))
    return CellVerdict(setup, result, bound, result.comm_s < result.compute_s, best_all.name if best_all else None,
                       tuple(out), run)


def _label(c: CellVerdict) -> str:
    return f"{c.setup.profile} {c.setup.ranks}r" + (f" ({c.run})" if c.run else "")


def cells_table(cells: Sequence[CellVerdict]) -> str:
    """Markdown: per cell the set-up (scales, rate, ratio) and the measured references."""
    rows = ["| cell | size scale | time scale | link | comm/compute (nominal) | params (M) | compute-only ms "
            "| all-reduce ms | RS+AG ms | window bound ms | comm hideable |",
            "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for c in cells:
        o, r = c.setup.options, c.result
        rows.append(f"| {_label(c)} | {o.size_scale:.3f} | {o.time_scale:.3f} | {c.setup.rate} | {c.setup.ratio:.2f} "
                    f"| {r.params_M:.1f} | {_ms(r.compute_s)} | {_ms(r.allreduce_s)} | {_ms(r.rs_ag_s)} "
                    f"| {_ms(c.bound_s)} | {'yes' if c.hideable else 'no'} |")
    return "\n".join(rows)


def variants_table(cells: Sequence[CellVerdict]) -> str:
    """Markdown: one row per (cell, variant): iteration ms, × ddp, × best baseline, / bound, prediction, error."""
    rows = ["| cell | strategy | iter ms (median) | speedup vs ddp | vs best baseline | / window bound "
            "| predicted ms | simulator error |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        for v in c.variants:
            err = "–" if v.sim_error is None else f"{v.sim_error * 100:+.0f}%"
            vb = "–" if v.vs_best_baseline is None else f"{v.vs_best_baseline:.2f} ({v.best_baseline})"
            rows.append(f"| {_label(c)} | {v.name}{v.note} | {_ms(v.iter_s)} | {_x(v.vs_ddp)} | {vb} "
                        f"| {_x(v.to_bound)} | {_ms(v.predicted_s)} | {err} |")
    return "\n".join(rows)


def _beats_line(cells: Sequence[CellVerdict], name: str, against: str) -> Optional[str]:
    """``- `name` at least as fast as <against>: k of n cells (misses: ...)``; None when no cell ran ``name``."""
    have = [c for c in cells if c.variant(name) and c.variant(name).vs_best_baseline is not None]
    if not have:
        return None
    miss = [f"{_label(c)} {c.variant(name).vs_best_baseline:.2f}× {c.variant(name).best_baseline}" for c in have
            if c.variant(name).vs_best_baseline < 1.0]
    return (f"- `{name}` at least as fast as {against}: {len(have) - len(miss)} of {len(have)} cells"
            + (f" (misses: {'; '.join(miss)})" if miss else ""))


def targets_summary(cells: Sequence[CellVerdict], pipedap: str = DEFAULT_PIPEDAP) -> list[str]:
    """Markdown bullet lines: how many cells meet each target of issue 17 item 5 (``pipedap`` against the
    fp32 baselines, its compressed (``+fp16``) and 16-bit wire (``@fp16``, ``@bf16``) forms against every baseline,
    the bound where communication can be hidden, the simulator's error)."""
    lines = [_beats_line(cells, pipedap, "every fp32 baseline (" + ", ".join(DENSE_BASELINES) + ")")]
    for name in dict.fromkeys(v.name for c in cells for v in c.variants):
        if name.startswith(pipedap + COMPRESS_SEP) or name in [pipedap + w for w in WIRE_SUFFIXES]:
            ran = [b for b in BASELINES if any(c.variant(b) for c in cells)]
            lines.append(_beats_line(cells, name, "every baseline (" + ", ".join(ran) + ")"))
    hide = [c for c in cells if c.hideable and c.variant(pipedap)]
    near = [c for c in hide if c.variant(pipedap).to_bound <= BOUND_TARGET]
    lines.append(f"- `{pipedap}` ≤ {BOUND_TARGET:.2f} × window bound where communication can be hidden (measured "
                 f"communication < compute): {len(near)} of {len(hide)} such cells"
                 + ("" if hide else " (no cell had compute > communication)")
                 + "".join(f"; {_label(c)} {c.variant(pipedap).to_bound:.2f}×" for c in hide))
    for what, keep in (("", lambda n: True), (" (uncompressed variants only)", lambda n: COMPRESS_SEP not in n)):
        errs = [v.sim_error for c in cells for v in c.variants if v.sim_error is not None and keep(v.name)]
        ok = [e for e in errs if abs(e) <= SIM_TOLERANCE]
        lines.append(f"- simulator within ±{SIM_TOLERANCE * 100:.0f}% of the measurement{what}: {len(ok)} of "
                     f"{len(errs)} predictions ({100 * len(ok) / len(errs):.0f}%; target {SIM_SHARE_TARGET * 100:.0f}%)"
                     if errs else f"- simulator{what}: no prediction recorded")
    return [line for line in lines if line]
