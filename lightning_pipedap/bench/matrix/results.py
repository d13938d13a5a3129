"""Results of the benchmark matrix: one strategy's (:class:`VariantResult`), one cell's (:class:`CellResult`),
the iteration-time bounds they are compared with, and the merge of the ranks' raw results (:func:`combine`)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from lightning_pipedap.bench.matrix.spec import REFERENCE

#: the measured-selection candidate that hands the model to PyTorch's DDP reducer (no pipedap engine)
DDP_REDUCER = "torch_ddp"


@dataclass
class VariantResult:
    """Measured result of one strategy in one cell.

    Attributes:
        name: strategy name (``"ddp"``, ``"pipedap-optimal"``, ...).
        iter_s: median iteration time, start-to-start, s (rank 0).
        steps: number of measured iterations.
        energy_J: estimated energy per iteration summed over ranks, J (``None`` if not measured).
        predicted_s: the planner's predicted iteration time, s (planned pipedap schedules only).
        wait_s: time per iteration the training thread waited on communication (pipedap timeline), s.
        comm_busy_s: time per iteration the communication worker was busy (RS/AG/AR), s.
        note: free text (e.g. the bucket cap chosen for ``ddp_tuned``).
        plan: pipedap: the strategy's account of its plan (installed schedule, prediction, calibration,
            contention, measured candidates; :func:`~lightning_pipedap.bench.matrix.worker.plan_record`), for the
            record.
        compression: what the variant compresses with
            (:attr:`~lightning_pipedap.bench.matrix.spec.StrategySpec.compression`; ``""``: nothing).
        compress_s: compressed pipedap: compression time per iteration, s (rank 0, :func:`summarize_compression`).
        hidden_share: compressed pipedap, pipelined: share of ``compress_s`` hidden by the pipeline (0..1).
        compression_ratio: compressed pipedap: dense bytes / payload bytes over the measured rounds.
        compressed_rounds: bucket rounds the three compression numbers come from.
        trials: ``pipedap-optimal``: the measured plan selection, one dict per candidate schedule
            (name, describe, predicted_s, measured_s, chosen; :attr:`PipeDAPStrategy.trial_results`);
            the measured steps run the chosen one.
        predictions: planned pipedap, rank 0: every prediction per candidate schedule name, s
            (:attr:`PipeDAPStrategy.predictions`: α-β ``ab_s``, ``calibrated_s``, contention-aware
            ``contended_s``, ``contended_calibrated_s``).
        all_steps_ms: every start-to-start interval of the run, warm-up included, ms (rank 0), for
            looking at noise and at the warm-up phases (trace, profile, trials).
        installed: pipedap: the name of the schedule installed at the end (``what_ran()["installed"]["name"]``:
            ``"torch_ddp"`` when measured selection handed the model to DDP's own reducer); ``""`` otherwise.
        optimizer: the class name of the optimizer the variant trained with (``"SGD"``, ``"Adam"``; the matrix's
            ``--optimizer``), ``""`` in results written without it.
    """

    name: str
    iter_s: float
    steps: int
    energy_J: Optional[float] = None
    predicted_s: Optional[float] = None
    wait_s: Optional[float] = None
    comm_busy_s: Optional[float] = None
    note: str = ""
    plan: str = ""
    compression: str = ""
    compress_s: Optional[float] = None
    hidden_share: Optional[float] = None
    compression_ratio: Optional[float] = None
    compressed_rounds: Optional[int] = None
    trials: list = field(default_factory=list)
    predictions: dict = field(default_factory=dict)
    all_steps_ms: list = field(default_factory=list)
    installed: str = ""
    optimizer: str = ""

    @property
    def installed_name(self) -> str:
        """:attr:`installed`, or for results written without it the chosen trial candidate's name (``""``)."""
        return self.installed or next((t["name"] for t in self.trials if t.get("chosen")), "")

    @property
    def ran_ddp_reducer(self) -> bool:
        """Whether measured selection installed ``torch_ddp`` (DDP's reducer): the variant's speedup vs ``ddp``
        is then DDP's own all-reduce against itself, not a pipedap schedule's."""
        return self.installed_name == DDP_REDUCER


def installed_note(v: VariantResult) -> str:
    """``" (torch_ddp: DDP's reducer)"`` for a variant that ran DDP's reducer (:attr:`VariantResult.ran_ddp_reducer`),
    else ``""``: appended to its speedup wherever one is shown."""
    return f" ({DDP_REDUCER}: DDP's reducer)" if v.ran_ddp_reducer else ""


@dataclass
class CellResult:
    """All variants of one (model, link, ranks) cell plus the references measured in the same launch.

    Attributes:
        model, link, ranks: the cell (``link`` ``"none"`` = uncapped).
        params_M: trainable parameters, millions. batch: per-rank batch size (samples).
        compute_s: compute-only iteration time, s (slowest rank's median).
        allreduce_s: gloo all-reduce of all gradients as one fp32 buffer, s (median).
        rs_ag_s: ring reduce-scatter + all-gather of the same buffer, s (median).
        first_layer_comm_s: the faster of all-reduce and RS + AG of the first layer's parameters alone, s.
        allreduce_cpu_s: CPU time (user + system, all threads) one rank spends in that all-reduce, s
            (the busiest rank; see :func:`~lightning_pipedap.bench.matrix.worker.comm_only`).
        variants: per strategy.
        skipped: strategy -> reason, for strategies that could not run in this cell.
    """

    model: str
    link: str
    ranks: int
    params_M: float
    batch: int
    compute_s: float
    allreduce_s: float
    rs_ag_s: float
    first_layer_comm_s: Optional[float] = None
    allreduce_cpu_s: Optional[float] = None
    variants: list[VariantResult] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def comm_s(self) -> float:
        """Communication-only time of the bound: the faster of all-reduce and RS + AG, s."""
        return min(self.allreduce_s, self.rs_ag_s)

    @property
    def bound_s(self) -> float:
        """Lower bound of an iteration, ``max(compute, communication)``, s."""
        return lower_bound_s(self.compute_s, self.comm_s)

    @property
    def cpu_bound_s(self) -> Optional[float]:
        """Lower bound when each rank has one core for compute *and* its communication's CPU work (the
        bench runs one torch thread per rank, as many ranks as cores): ``max(compute + CPU time of the
        all-reduce, communication)``, s; None when the CPU time was not measured. Kernel network work
        outside the process is not in it, so the true bound is higher still."""
        if self.allreduce_cpu_s is None:
            return None
        return max(self.compute_s + self.allreduce_cpu_s, self.comm_s)

    @property
    def dep_bound_s(self) -> Optional[float]:
        """Dependency-aware lower bound, :func:`dependency_bound_s` (s), when the first layer was measured."""
        if self.first_layer_comm_s is None:
            return None
        return dependency_bound_s(self.compute_s, self.comm_s, self.first_layer_comm_s)

    def variant(self, name: str) -> Optional[VariantResult]:
        """The result of strategy ``name`` or ``None``."""
        return next((v for v in self.variants if v.name == name), None)

    def speedup(self, name: str) -> Optional[float]:
        """``ddp`` iteration time / ``name``'s (``None`` when either is missing)."""
        ref, v = self.variant(REFERENCE), self.variant(name)
        return speedup(ref.iter_s, v.iter_s) if ref and v else None

    def ratio(self, name: str) -> Optional[float]:
        """``name``'s iteration time / the lower bound (``None`` when missing)."""
        v = self.variant(name)
        return ratio_to_bound(v.iter_s, self.bound_s) if v else None

    @staticmethod
    def from_dict(d: dict) -> "CellResult":
        """Inverse of ``dataclasses.asdict``."""
        d = dict(d)
        d["variants"] = [VariantResult(**v) for v in d.get("variants", [])]
        return CellResult(**d)


def _check_time(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite time in seconds, got {value!r}")
    return float(value)


def lower_bound_s(compute_s: float, comm_s: float) -> float:
    """Iteration-time lower bound of data-parallel training, ``max(compute, communication)`` (s).

    With perfect overlap an iteration can hide the shorter of compute and communication behind the
    longer one but no more (the bound the DeAR and PipeDAP papers compare against).

    Raises:
        ValueError: a time that is not a positive finite number.
    """
    return max(_check_time("compute_s", compute_s), _check_time("comm_s", comm_s))


def dependency_bound_s(compute_s: float, comm_s: float, first_layer_comm_s: float) -> float:
    """A tighter lower bound for synchronous data parallelism: ``max(compute + first-layer comm, comm)`` (s).

    The first layer's gradient is the last one backward produces and its updated weights are the first
    ones the next forward needs, so its communication cannot overlap any compute of the step (only the
    ``max(compute, comm)`` bound ignores this dependency). ``first_layer_comm_s`` is the communication time
    of the first layer's parameters alone; the update's own compute is left out.

    Raises:
        ValueError: a time that is not a positive finite number.
    """
    return max(_check_time("compute_s", compute_s) + _check_time("first_layer_comm_s", first_layer_comm_s),
               _check_time("comm_s", comm_s))


def ratio_to_bound(iter_s: float, bound_s: float) -> float:
    """Measured iteration time over the lower bound (>= 1 up to noise; 1.0 = perfect overlap).

    Raises:
        ValueError: a time that is not a positive finite number.
    """
    return _check_time("iter_s", iter_s) / _check_time("bound_s", bound_s)


def speedup(ref_s: float, iter_s: float) -> float:
    """Speedup of a variant over the reference: ``ref_s / iter_s`` (> 1 = faster than the reference).

    Raises:
        ValueError: a time that is not a positive finite number.
    """
    return _check_time("ref_s", ref_s) / _check_time("iter_s", iter_s)


def median_step_s(starts: Sequence[float], warmup: int) -> tuple[float, int]:
    """Median start-to-start iteration time after ``warmup`` iterations.

    Args:
        starts: ``time.perf_counter()`` stamps (s) of every training-batch start, plus the end of training.
        warmup: iterations to drop at the front.

    Returns:
        ``(median seconds, number of iterations used)``.

    Raises:
        ValueError: fewer than one iteration left after the warm-up.
    """
    gaps = [b - a for a, b in zip(starts[:-1], starts[1:])][warmup:]
    if not gaps:
        raise ValueError(f"no iteration left after {warmup} warm-up steps ({len(starts)} time stamps)")
    return statistics.median(gaps), len(gaps)


@dataclass
class CompressionSummary:
    """Compression telemetry of one variant over its measured steps (:func:`summarize_compression`).

    Attributes:
        compress_s: compression time per iteration, s: per bucket the mean over its rounds of the time spent
            compressing (first pass, extra rounds, decompression), summed over buckets.
        hidden_share: :func:`hidden_share` of all rounds (``None`` inline or when nothing was compressed).
        ratio: sum of dense bytes / sum of payload bytes over all rounds (``None`` when nothing was sent).
        rounds: number of (bucket, step) rounds summarised.
    """

    compress_s: float
    hidden_share: Optional[float]
    ratio: Optional[float]
    rounds: int


def _stat(st: Any, field_name: str) -> float:
    v = getattr(st, field_name)
    if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"compression stats: {field_name} must be a finite number >= 0, got {v!r}")
    return float(v)


def hidden_share(stats: Sequence[Any]) -> Optional[float]:
    """Share of compression time hidden by the pipeline: ``sum(compress_s - wait_s) / sum(compress_s)``.

    ``stats`` are per-round :class:`~lightning_pipedap.engine.compressed.CompressionStats` (any objects with
    ``compress_s`` and ``wait_s`` in s): ``compress_s`` is the helper's time on the round, ``wait_s`` the time
    the communication worker blocked for its results, so ``compress_s - wait_s`` ran while the trainer went
    on (PipeCompress, Wu et al., ICC 2022). Clamped at 0: a worker that waits longer than the helper worked
    (queued behind other buckets, hand-off latency) hid nothing.

    Returns:
        a share in ``[0, 1]``, or ``None`` when ``sum(compress_s)`` is 0 (nothing compressed).

    Raises:
        ValueError: a negative or non-finite time (naming the field).
    """
    comp = sum(_stat(st, "compress_s") for st in stats)
    if comp <= 0:
        return None
    return max(0.0, comp - sum(_stat(st, "wait_s") for st in stats)) / comp


def summarize_compression(rounds: Sequence[tuple[int, Any]], pipelined: bool = True) -> Optional[CompressionSummary]:
    """Summarise per-bucket compression rounds taken over the measured steps.

    Args:
        rounds: ``(bucket index, stats)`` per round; ``stats`` has ``compress_s``, ``wait_s`` (s),
            ``payload_bytes`` and ``dense_bytes`` (bytes), like
            :class:`~lightning_pipedap.engine.compressed.CompressionStats`.
        pipelined: compression ran in the helper process; ``False`` (inline) reports no hidden share.

    Returns:
        :class:`CompressionSummary`, or ``None`` without rounds. Compression time per iteration is the
        per-bucket mean summed over buckets, so a bucket caught in one step more or fewer than the others
        (a round that lands just before or after the window) does not skew it.

    Raises:
        ValueError: a negative or non-finite time or byte count (naming the field).
    """
    if not rounds:
        return None
    per_bucket: dict[int, list[float]] = {}
    for b, st in rounds:
        per_bucket.setdefault(int(b), []).append(_stat(st, "compress_s"))
    stats = [st for _, st in rounds]
    payload = sum(_stat(st, "payload_bytes") for st in stats)
    dense = sum(_stat(st, "dense_bytes") for st in stats)
    return CompressionSummary(compress_s=sum(statistics.fmean(v) for v in per_bucket.values()),
                              hidden_share=hidden_share(stats) if pipelined else None,
                              ratio=dense / payload if payload > 0 else None, rounds=len(rounds))


def _max_or_none(values: Sequence[Optional[float]]) -> Optional[float]:
    """The largest value, or None when any is None (a rank that did not measure it)."""
    return None if not values or any(v is None for v in values) else max(values)


def combine(model: str, link: str, raw: Sequence[dict], batch: int) -> CellResult:
    """Merge the ranks' raw results: rank 0's iteration times and references, the slowest rank's compute,
    energy summed over ranks.

    Raises:
        ValueError: no rank results, or ranks that disagree on the strategies run.
    """
    if not raw:
        raise ValueError("no rank reported a result")
    raw = sorted(raw, key=lambda r: r["rank"])
    r0 = raw[0]
    names = [v["name"] for v in r0["variants"]]
    for r in raw[1:]:
        if [v["name"] for v in r["variants"]] != names:
            raise ValueError(f"rank {r['rank']} ran {[v['name'] for v in r['variants']]}, rank 0 ran {names}")
    variants = []
    for k, v in enumerate(r0["variants"]):
        energies = [r["variants"][k].get("energy_J") for r in raw]
        e = sum(energies) if all(x is not None for x in energies) else None
        variants.append(VariantResult(**dict(v, energy_J=e)))
    return CellResult(model=model, link=link, ranks=len(raw), params_M=r0["params"] / 1e6, batch=batch,
                      compute_s=max(r["compute_s"] for r in raw), allreduce_s=r0["allreduce_s"], rs_ag_s=r0["rs_ag_s"],
                      first_layer_comm_s=r0.get("first_layer_comm_s"),
                      allreduce_cpu_s=_max_or_none([r.get("allreduce_cpu_s") for r in raw]),
                      variants=variants,
                      skipped=dict(r0.get("skipped", {})))
