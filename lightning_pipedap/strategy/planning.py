"""Profiling steps and rank 0's plan: layers, the α-β model, calibration, predictions, candidates.

:class:`Planning` holds what one fit measures before it plans — the layers (consecutive parameters
with one owner), the profiled steps, the α-β model of the live group (PipeDAP TETC 2025 §III: per
primitive ``T = α + β·bytes``), the contention fit and the compressor's cost — and turns them into
candidate schedules. The planners themselves are pure (:mod:`lightning_pipedap.plan`); what
happens here is measuring their inputs and choosing which of their outputs to try.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

import lightning_pipedap.engine.collectives as C
from lightning_pipedap.plan import CostModel, get_planner, load_cost_model
from lightning_pipedap.plan.candidates import trial_candidates, wire16_everywhere
from lightning_pipedap.plan.partition import (choose_partition, engine_period, expand_pieces,
                                              piece_schedule_to_layers)
from lightning_pipedap.probe.alpha_beta import describe_origin, measure_cost_model
from lightning_pipedap.probe.recorder import StepRecorder, group_layers, merge_steps
from lightning_pipedap.schedule import Schedule, expand_layers
from lightning_pipedap.strategy.config import PLANNED, PipeDAPConfig


@dataclass
class Measured:
    """Measurements that outlive one fit (kept on the strategy).

    Attributes:
        contention: the :class:`~lightning_pipedap.plan.contention.Contention` fit, or None.
        calibration_ratio: measured / predicted communication busy time of the profiling steps (1.0 = none).
    """

    contention: Optional[Any] = None
    calibration_ratio: float = 1.0


def predicted_busy_s(cm: CostModel, engine: Any) -> float:
    """α-β prediction of ``engine``'s communication busy time per round (s), dense costs."""
    return sum(cm.cost(op.kind, engine.buckets[op.bucket].nbytes) for op in engine.schedule.ops)


class Planning:
    """Profiling state and planning of one fit.

    Args:
        config: the strategy's options.
        comm: the engine's process group (micro-benchmarks run on it).
        device: the training device.
        world_size, rank: of the default group (rank 0 plans; the plan is broadcast).
        measured: the strategy's :class:`Measured` (contention measured once per strategy).
        info, warn: rank-0 loggers.
    """

    def __init__(self, config: PipeDAPConfig, comm: Any, device: torch.device, world_size: int, rank: int,
                 measured: Measured, info: Callable[[str], None], warn: Callable[[str], None]) -> None:
        self.config, self.comm, self.device, self.world_size, self.rank = config, comm, device, world_size, rank
        self.measured, self.info, self.warn = measured, info, warn
        self.layers: list[list[int]] = []
        self.layer_of_param: list[int] = []
        self.layer_of_module: dict[int, list[int]] = {}
        self.cost_model: Optional[CostModel] = None
        self.raw_cost_model: Optional[CostModel] = None  # the α-β fit before calibration (rank 0)
        #: where the α-β model came from, in words (:func:`~lightning_pipedap.probe.alpha_beta.describe_origin`)
        self.cost_model_origin: Optional[str] = None
        self.compression_cost: Optional[Any] = None
        #: what this job is, in words, recorded with an α-β fit written to the cache (set by the run-time)
        self.job: Optional[str] = None
        self.profile: Optional[dict] = None
        self.predictions: dict[str, dict[str, float]] = {}
        self._profiled: list[tuple[list[float], list[float]]] = []
        self._t_updates: list[float] = []
        self._profile_busy: list[float] = []
        self._passes: list[int] = []  # backward passes of each profiled step (several under manual optimization)

    # ------------------------------------------------------------------ profiling steps
    def start(self, params: list[torch.Tensor], owners: list[Any]) -> dict[str, float]:
        """Layers from the owners (engine order), the α-β model (once per fit), the contention (once).

        Returns:
            Seconds spent here on the α-β model (``"alpha_beta"``: fit, cache read or file) and the
            contention benchmark (``"contention"``), for the start-up accounting; a part not done now is absent.
        """
        cfg = self.config
        spent: dict[str, float] = {}
        self.layers = group_layers([id(o) if o is not None else None for o in owners])
        self.layer_of_param = [k for k, layer in enumerate(self.layers) for _ in layer]
        self.layer_of_module = {}
        for k, layer in enumerate(self.layers):
            if owners[layer[0]] is not None:
                self.layer_of_module.setdefault(id(owners[layer[0]]), []).append(k)
        if self.cost_model is None:
            t0 = time.perf_counter()
            if isinstance(cfg.cost_model, str):
                self.cost_model = load_cost_model(cfg.cost_model)
                self.cost_model_origin = f"α-β model loaded from cost_model={cfg.cost_model}"
            elif cfg.cost_model is not None:
                self.cost_model = cfg.cost_model
                self.cost_model_origin = "α-β model given as cost_model="
            else:
                largest = max(p.numel() * p.element_size() for p in params)
                self.cost_model = measure_cost_model(self.comm, self.device, max_bytes=min(64 << 20, max(largest, 16 << 20)),
                                                     use_cache=cfg.cost_model_cache, wire_dtype=cfg.wire_dtype,
                                                     job=self.job)
                self.cost_model_origin = describe_origin(self.cost_model.meta)
            spent["alpha_beta"] = time.perf_counter() - t0
            self._log_cost_model()
        if cfg.model_contention and self.measured.contention is None and not cfg.compression:
            from lightning_pipedap.probe.slowdown import measure_contention  # noqa: PLC0415

            t0 = time.perf_counter()
            c = measure_contention(self.comm, self.device, nbytes=8 << 20, repeats=5, timeout_s=cfg.wait_timeout_s)
            spent["contention"] = time.perf_counter() - t0
            self.measured.contention = c
            self.info(describe_contention(c) + f" (measured in {spent['contention']:.2f} s)")
        self._profiled, self._t_updates, self._profile_busy, self._passes = [], [], [], []
        return spent

    def _log_cost_model(self) -> None:
        """Log the α-β model, where it came from (fitted now, the cache, a file), and warn on a poor fit."""
        cm = self.cost_model
        prims = [("RS", cm.rs), ("AG", cm.ag), ("AR", cm.ar)]
        prims += [(f"RS {self.config.wire_dtype}", cm.rs16), (f"AG {self.config.wire_dtype}", cm.ag16)] \
            if cm.rs16 is not None else []
        poor = [k for k, ab in prims if ab.r2 is not None and ab.r2 < 0.5]
        if poor:
            fresh = cm.meta.get("source") == "measured"
            self.warn(f"pipedap: the α-β fit of {poor} is poor (R² < 0.5; typical on an uncontended loopback where "
                      "start-up noise dominates); plans may be off, and the measured selection's trials decide. "
                      + ("It was not cached: the next fit measures again. Pass cost_model=<file> to plan with a "
                         "model of your own." if fresh else
                         "Pass cost_model=<file>, or cost_model_cache=False to measure again."))
        if cm.meta.get("not_cached"):
            self.warn(f"pipedap: the α-β model was not cached: {cm.meta['not_cached']}; the next fit measures it "
                      "again (set PIPEDAP_CACHE_DIR to a writable directory, or cost_model_cache=False)")
        self.info(f"pipedap: {self.cost_model_origin}: " + ", ".join(f"{k} {ab.describe()}" for k, ab in prims)
                  + (" (16-bit wire: over the fp32 bytes, cast included)" if cm.rs16 is not None else ""))

    def recorder(self) -> StepRecorder:
        """A recorder for one profiling step."""
        return StepRecorder(self.layer_of_param, len(self.layers))

    def keep_step(self, rec: StepRecorder, busy_s: Optional[float], t_backward_done: Optional[float],
                  t_step_end: float) -> int:
        """Keep one profiled step (when complete); returns the number kept.

        A step of several backward passes (manual optimization: each pass reduces every bucket) is kept per
        pass: its times divided by the number of passes, which :meth:`plan` multiplies its predictions by."""
        if busy_s is not None:
            self._profile_busy.append(busy_s)
        if rec.complete:
            t_f, t_b = rec.times()
            n = rec.passes
            self._profiled.append(([t / n for t in t_f], [t / n for t in t_b]) if n > 1 else (t_f, t_b))
            self._passes.append(n)
            if t_backward_done is not None:
                self._t_updates.append(max(0.0, t_step_end - t_backward_done) / n)
        return len(self._profiled)

    def communication_share(self) -> Optional[dict[str, float]]:
        """What communication weighs on this machine, measured in the profiling steps: ``{"busy_s": median
        communication busy time per step (s), "compute_s": forward + backward of the median profile (s),
        "share": busy / (busy + compute)}``; None before profiling (a fixed schedule profiles nothing)."""
        if not self._profile_busy or not self.profile:
            return None
        busy = statistics.median(self._profile_busy)
        compute = sum(layer["t_f"] + layer["t_b"] for layer in self.profile["layers"])
        return {"busy_s": busy, "compute_s": compute, "share": busy / (busy + compute) if busy + compute > 0 else 0.0}

    @property
    def passes_per_step(self) -> int:
        """Backward passes per profiled step (median; 1 with automatic optimization)."""
        return max(1, round(statistics.median(self._passes))) if self._passes else 1

    # ------------------------------------------------------------------ planning (rank 0) and broadcast
    def plan(self, model_name: str, layer_names: list[str], params: list[torch.Tensor],
             engine: Any) -> tuple[list[Schedule], list[float]]:
        """Rank 0 plans from the median profile and picks candidates; every rank gets engine schedules.

        Args:
            model_name: for the profile.
            layer_names: owner module name of each layer.
            params: the trainable parameters in engine order.
            engine: the profiling engine (its busy-time prediction calibrates the α-β model).

        With ``partition_mb`` set (planned schedules, no compression) rank 0 also plans on the profile with
        every layer larger than ``partition_mb`` MiB split into pieces (:meth:`_plan_partitioned`); that
        schedule comes first when it is predicted more than 1% faster than the planner's, else it is the last
        trial candidate (with ``plan_trials > 1``) or left out. Its engine schedule has ``pieces``
        (:func:`~lightning_pipedap.plan.partition.expand_pieces`).

        Returns:
            Candidate engine schedules (the planner's first, or the partitioned one, with their predictions)
            and the no-overlap time of each (compute + update + all-reduce of every bucket, s).
        """
        cfg = self.config
        plan = None
        if self.rank == 0:
            self.predictions = {}
            self._calibrate(engine)
            layer_bytes = [sum(params[i].numel() * params[i].element_size() for i in l) for l in self.layers]
            passes = self.passes_per_step
            profile = merge_steps(model_name, layer_names, layer_bytes, self._profiled, self._t_updates,
                                  meta={"passes_per_step": passes} if passes > 1 else None)
            if passes > 1:
                self.info(f"pipedap: {passes} backward passes per training_step (manual optimization), each reducing "
                          f"every bucket: planned for one pass (the profiled times divided by {passes}); predictions "
                          f"are for the whole step ({passes} passes)")
            planner = get_planner(PLANNED[cfg.schedule])
            wire16 = cfg.wire_dtype != "fp32"
            schedule = planner(profile, self.cost_model, self.world_size)
            if wire16:
                fp32_s = schedule.predicted_iteration_s
                if PLANNED[cfg.schedule] == "optimal":  # per bucket
                    schedule = planner(profile, self.cost_model, self.world_size, wire16=True)
                else:
                    schedule = wire16_everywhere(profile, self.cost_model, schedule)
                self.info(f"pipedap: {schedule.num_wire16} of {len(schedule.buckets)} buckets {cfg.wire_dtype} on the "
                          f"wire; predicted iteration {schedule.predicted_iteration_s * 1e3:.1f} ms vs "
                          f"{fp32_s * 1e3:.1f} ms all fp32 (same profile and α-β model)")
            candidates: list[Schedule] = [schedule]
            part = None
            if cfg.partition_mb is not None and not cfg.compression:
                part = self._plan_partitioned(profile, params, schedule, wire16)
            if cfg.compression:
                shapes = [[tuple(params[i].shape) for i in l] for l in self.layers]
                candidates = [self._plan_compression(planner, profile, schedule, shapes)]
            elif cfg.plan_trials > 1:
                # the partitioned plan is a candidate beside the others: first when it is kept, else last
                k = cfg.plan_trials - (part is not None)
                candidates = trial_candidates(profile, self.cost_model, self.world_size, schedule,
                                              cap_bytes=int(cfg.bucket_cap_mb * 2**20), k=k, wire16=wire16)
            maps: list[Optional[tuple]] = [None] * len(candidates)
            profiles = [profile] * len(candidates)
            if part is not None and part.schedule is not None:
                merged = piece_schedule_to_layers(part.schedule, part.piece_map)
                if merged is not None and any(merged.buckets == c.buckets and merged.ops == c.ops for c in candidates):
                    part = None  # (every layer whole in one bucket, as a candidate already has it: not tried twice)
            if part is not None and (part.keep or cfg.plan_trials > 1):
                at = 0 if part.keep else len(candidates)
                candidates.insert(at, part.schedule)
                maps.insert(at, part.piece_map)
                profiles.insert(at, part.profile)
                del candidates[cfg.plan_trials:], maps[cfg.plan_trials:], profiles[cfg.plan_trials:]
            candidates = [self._predict(pr, c, m) for pr, c, m in zip(profiles, candidates, maps)]
            no_overlap = [profile.t_compute + profile.t_update + sum(
                self.cost_model.all_reduce(sum(pr.layers[k].nbytes for k in b)) for b in c.buckets)
                for pr, c in zip(profiles, candidates)]
            if passes > 1:  # (a step is that many passes: what the trials and the drift check measure)
                candidates = [c if c.predicted_iteration_s is None else
                              dataclasses.replace(c, predicted_iteration_s=c.predicted_iteration_s * passes)
                              for c in candidates]
                no_overlap = [t * passes for t in no_overlap]
                self.predictions = {n: {k: v * passes for k, v in p.items()} for n, p in self.predictions.items()}
            plan = (candidates, no_overlap, profile.to_dict(), self.cost_model, maps)
        t0 = time.perf_counter()
        try:
            candidates, no_overlap, self.profile, self.cost_model, maps = C.broadcast_object(plan, src=0)
        except RuntimeError as exc:
            raise RuntimeError(
                f"pipedap: rank {self.rank}: no plan from rank 0 after {time.perf_counter() - t0:.0f} s (phase profile, "
                f"broadcast of the plan): rank 0 planned longer than wait_timeout_s={cfg.wait_timeout_s:g} s or failed; "
                "see rank 0's log, and raise wait_timeout_s or partition_mb (fewer pieces to plan)") from exc
        keys = [(p.dtype, p.device) for p in params]
        numels = [p.numel() for p in params]
        return [expand_layers(c, self.layers, keys) if m is None else expand_pieces(c, m, self.layers, numels, keys)
                for c, m in zip(candidates, maps)], no_overlap

    def _plan_partitioned(self, profile: Any, params: list[torch.Tensor], schedule: Schedule,
                          wire16: bool) -> Optional[Any]:
        """Rank 0: plan again on the profile with every layer larger than ``partition_mb`` MiB split into pieces
        (:func:`~lightning_pipedap.plan.partition.choose_partition`) and log both predictions (ms) and what was
        split into how many pieces.

        Element counts come from the parameters (``numel`` of each layer's parameters together), so pieces
        fall on element boundaries whatever the dtypes. Not called with compression (a compressor works on
        whole parameters; :meth:`PipeDAPConfig.ignored_options` says so at the start of the fit) nor for the
        fixed schedules (they are not planned).

        Returns:
            The :class:`~lightning_pipedap.plan.partition.PartitionChoice` when some layer was split, else
            ``None`` (nothing larger than ``partition_mb``).
        """
        cfg = self.config
        numels = [sum(params[i].numel() for i in l) for l in self.layers]
        counted = dataclasses.replace(profile, layers=tuple(dataclasses.replace(l, numel=n)
                                                            for l, n in zip(profile.layers, numels)))
        choice = choose_partition(counted, self.cost_model, self.world_size, PLANNED[cfg.schedule], schedule,
                                  cfg.partition_mb * 2**20, wire16=wire16)
        self.info(choice.line)
        return choice if choice.schedule is not None else None

    def _predict(self, profile: Any, schedule: Schedule, piece_map: Optional[tuple] = None) -> Schedule:
        """Rank 0: ``schedule`` with the prediction training is checked against, and every prediction in
        :attr:`predictions` (s): α-β as fitted (``ab_s``), α-β calibrated (``calibrated_s``), and each of
        those through the contention-aware simulator (``contended_s``, ``contended_calibrated_s``).

        The prediction kept is the contention-aware one on the *uncalibrated* α-β when the contention was
        measured (the profiling-step calibration already contains some of the same slowdown), else the
        planner's own (calibrated when calibration applied). A schedule over piece-layers (``piece_map``
        given, ``profile`` partitioned) is predicted with
        :func:`~lightning_pipedap.plan.partition.engine_period` (a split layer's update once, after its last
        bucket); its contention-aware predictions use the simulator's share-by-bytes update.
        """
        from lightning_pipedap.plan.contention import simulate_contended  # noqa: PLC0415
        from lightning_pipedap.plan.simulator import simulate  # noqa: PLC0415

        if self.config.compression:
            return schedule  # compressed plans: the planner's compression-aware prediction
        raw = self.raw_cost_model or self.cost_model
        if piece_map is not None:
            pred = {"ab_s": engine_period(profile, piece_map, raw, schedule),
                    "calibrated_s": engine_period(profile, piece_map, self.cost_model, schedule)}
        else:
            pred = {"ab_s": simulate(profile, raw, schedule).iteration_s,
                    "calibrated_s": simulate(profile, self.cost_model, schedule).iteration_s}
        keep = schedule.predicted_iteration_s
        contention = self.measured.contention
        if contention is not None:
            pred["contended_s"] = simulate_contended(profile, raw, schedule, contention).iteration_s
            pred["contended_calibrated_s"] = simulate_contended(profile, self.cost_model, schedule, contention).iteration_s
            keep = pred["contended_s"]
        self.predictions[schedule.name] = pred
        return dataclasses.replace(schedule, predicted_iteration_s=keep)

    def _plan_compression(self, planner: Callable[..., Schedule], profile: Any, dense: Schedule,
                          layer_shapes: list[list[tuple[int, ...]]]) -> Schedule:
        """Rank 0: plan again with the measured compression cost; log what is compressed and what it buys.

        The compressor is timed once per fit (:func:`~lightning_pipedap.probe.compression_cost.
        measure_compression_cost`, about a second at most) with the helper's thread count. ``optimal``
        compresses only the buckets where it pays; the other planners compress every bucket.
        """
        from lightning_pipedap.probe.compression_cost import measure_compression_cost  # noqa: PLC0415

        cfg = self.config
        cost = self.compression_cost
        if cost is None:
            process = cfg.compression_mode == "process"
            cost = measure_compression_cost(cfg.compression, cfg.compression_kwargs, layer_shapes,
                                            world_size=self.world_size, where="helper" if process else "inline",
                                            threads=cfg.compression_threads if process else None)
            self.compression_cost = cost
            self.info(f"pipedap: compression cost of {cost.method}: {cost.alpha_c_s * 1e6:.0f} µs + "
                      f"{cost.beta_c_s_per_byte * 1e9:.3f} ns/B ({cost.post_share:.0%} after the collective, "
                      f"R²={_r2(cost.meta.get('r2'))}), payload via {cost.collective} x{cost.rounds}")
        schedule = planner(profile, self.cost_model, self.world_size, compression=cost)
        self.info(f"pipedap: {schedule.num_compressed} of {len(schedule.buckets)} buckets compressed "
                  f"({cfg.compression}); predicted iteration {schedule.predicted_iteration_s * 1e3:.1f} ms vs "
                  f"{dense.predicted_iteration_s * 1e3:.1f} ms without compression")
        return schedule

    def _calibrate(self, engine: Any) -> None:
        """Scale the measured α-β model by the profiling steps' measured / predicted busy time (rank 0).

        Only for a model measured by the strategy (not one the user passed), only once per strategy, and
        only when communication was > 5% slower during training than the idle micro-benchmark predicts.
        """
        if not (self.config.calibrate_cost_model and self.config.cost_model is None and self._profile_busy
                and self.measured.calibration_ratio == 1.0 and self.cost_model is not None):
            return
        predicted = predicted_busy_s(self.cost_model, engine)
        if predicted <= 0:
            return
        ratio = statistics.median(self._profile_busy) / predicted
        if ratio > 1.05:
            self.measured.calibration_ratio = ratio
            self.raw_cost_model = self.cost_model
            self.cost_model = self.cost_model.scaled(alpha_factor=ratio, beta_factor=ratio)
            self.info(f"pipedap: communication during the profiling steps took {ratio:.2f}x the α-β prediction "
                      "(compute shares the cores); planning with α and β scaled by it")

    def rescale(self, ratio: float) -> bool:
        """Scale α and β by ``ratio`` before a re-plan (not with compression: its cost model is separate)."""
        if self.config.compression or self.cost_model is None:
            return False
        self.cost_model = self.cost_model.scaled(alpha_factor=ratio, beta_factor=ratio)
        return True


def _r2(r2: Any) -> str:
    """R² for a log line: 4 decimals, or ``n/a``."""
    return f"{r2:.4f}" if isinstance(r2, (int, float)) else "n/a"


def describe_contention(c: Any) -> str:
    """The log line of a measured :class:`~lightning_pipedap.plan.contention.Contention`: the slowdowns and the
    measured times (ms) they come from; a slowdown at a bound of its range (noise, or no progress at all)
    is named as such instead of being shown as a measurement."""
    m = getattr(c, "meta", None) or {}
    clamped = set(m.get("clamped", ()))
    parts = []
    for name, what in (("comm_slowdown", "communication"), ("compute_slowdown", "compute")):
        v = getattr(c, name)
        if name in clamped:
            parts.append(f"{what} {'not measurably slowed' if v == 0 else f'stalled while the other ran (the model uses its cap, {v:g})'}")
        else:
            parts.append(f"{what} +{v:.0%}")
    times = ""
    if all(k in m for k in ("alone_comm_s", "loaded_comm_s", "alone_compute_s", "loaded_compute_s")):
        times = (f" (alone: communication {m['alone_comm_s'] * 1e3:.1f} ms, compute {m['alone_compute_s'] * 1e3:.1f} ms;"
                 f" together: {m['loaded_comm_s'] * 1e3:.1f} ms and {m['loaded_compute_s'] * 1e3:.1f} ms)")
    return "pipedap: contention while communication and compute overlap: " + ", ".join(parts) + times
