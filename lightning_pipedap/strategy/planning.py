"""Profiling steps and rank 0's plan: layers, the α-β model, calibration, predictions, candidates.

:class:`Planning` holds what one fit measures before it plans — the layers (consecutive parameters
with one owner), the profiled steps, the α-β model of the live group (PipeDAP TETC 2025 §III: per
primitive ``T = α + β·bytes``), the contention fit and the compressor's cost — and turns them into
candidate schedules. The planners themselves are pure (:mod:`lightning_pipedap.plan`); what
happens here is measuring their inputs and choosing which of their outputs to try.
"""

from __future__ import annotations

import statistics
import time
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

import lightning_pipedap.engine.collectives as C
from lightning_pipedap.plan import CostModel, load_cost_model
from lightning_pipedap.plan.partition import expand_pieces
from lightning_pipedap.plan.sharding import Sharding
from lightning_pipedap.probe.alpha_beta import describe_origin, measure_cost_model
from lightning_pipedap.probe.recorder import StepRecorder, group_layers, merge_steps
from lightning_pipedap.schedule import Schedule, expand_layers
from lightning_pipedap.strategy.candidates import CandidatePlanner
from lightning_pipedap.strategy.config import PipeDAPConfig


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
        job: what this job is, in words, recorded with an α-β fit written to the cache.
    """

    def __init__(self, config: PipeDAPConfig, comm: Any, device: torch.device, world_size: int, rank: int,
                 measured: Measured, info: Callable[[str], None], warn: Callable[[str], None],
                 job: Optional[str] = None) -> None:
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
        self.job = job
        self.profile: Optional[dict] = None
        self.predictions: dict[str, dict[str, float]] = {}
        self._profiled: list[tuple[list[float], list[float]]] = []
        self._t_updates: list[float] = []
        self._profile_busy: list[float] = []
        self._passes: list[int] = []  # backward passes of each profiled step (several under manual optimization)
        self._lands: list[tuple[float, int]] = []  # a sharded sync step's land copies: (seconds, bytes) per step

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
                self.cost_model = measure_cost_model(self.comm, self.device,
                                                     max_bytes=min(64 << 20, max(largest, 16 << 20)),
                                                     use_cache=cfg.cost_model_cache, wire_dtype=cfg.wire_dtype,
                                                     job=self.job)
                self.cost_model_origin = describe_origin(self.cost_model.meta)
            spent["alpha_beta"] = time.perf_counter() - t0
            self._log_cost_model()
        if cfg.model_contention and self.measured.contention is None and not cfg.compression:
            from lightning_pipedap.probe.slowdown import measure_contention  # noqa: PLC0415

            t0 = time.perf_counter()
            c = measure_contention(self.comm, self.device, nbytes=8 << 20, repeats=5, timeout_s=cfg.wait_timeout_s,
                                   with_step=bool(cfg.shard_optimizer))  # (the step's phase: sharded runs only)
            spent["contention"] = time.perf_counter() - t0
            self.measured.contention = c
            self.info(describe_contention(c) + f" (measured in {spent['contention']:.2f} s)")
        self._profiled, self._t_updates, self._profile_busy, self._passes, self._lands = [], [], [], [], []
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
                  t_step_end: float, update_s: Optional[float] = None,
                  land: Optional[tuple[float, int]] = None) -> int:
        """Keep one profiled step (when complete); returns the number kept. ``update_s``: the step's optimizer
        update measured by the engine (a sharded sync step: as a whole-model update, without the parameter
        all-gathers, :attr:`~lightning_pipedap.engine.shard_step.ShardedStep.sync_update_s`), else the time from
        the backward's end to the step's end. ``land``: a sharded sync step's land copies, ``(seconds, bytes)``
        (:attr:`~lightning_pipedap.engine.shard_step.ShardedStep.sync_land`), for :meth:`sharding_model`.

        A step of several backward passes (manual optimization: each pass reduces every bucket) is kept per
        pass: its times divided by the number of passes, which :meth:`plan` multiplies its predictions by."""
        if busy_s is not None:
            self._profile_busy.append(busy_s)
        if rec.complete and land is not None and land[1] > 0:
            self._lands.append(land)
        if rec.complete:
            t_f, t_b = rec.times()
            n = rec.passes
            self._profiled.append(([t / n for t in t_f], [t / n for t in t_b]) if n > 1 else (t_f, t_b))
            self._passes.append(n)
            if update_s is not None:
                self._t_updates.append(update_s / n)
            elif t_backward_done is not None:
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

    def sharding_model(self, params: list[torch.Tensor], owner_costs: Optional[dict[int, float]] = None,
                       owned: bool = False) -> Sharding:
        """The sharded step's model as measured (``params``: engine order): the land copy's seconds per byte, the
        median of the profiling steps' (0 when no sharded sync step was profiled: :meth:`keep_step`), and with
        parameter ownership (``owned``: a whole-tensor optimizer) per layer per parameter its bytes and the cost the
        engine balances owners by (``owner_costs``, ``id(parameter) -> seconds``; None: its elements), so the
        planner sees the padded buckets (:func:`~lightning_pipedap.plan.sharding.owned_buckets`)."""
        rates = [s / n for s, n in self._lands if n > 0]
        spec = None
        if owned:
            spec = tuple(tuple((params[i].numel() * params[i].element_size(),
                                owner_costs.get(id(params[i]), 0.0) if owner_costs is not None else
                                float(params[i].numel())) for i in layer) for layer in self.layers)
        return Sharding(land_s_per_byte=statistics.median(rates) if rates else 0.0, owned=spec)

    @property
    def passes_per_step(self) -> int:
        """Backward passes per profiled step (median; 1 with automatic optimization)."""
        return max(1, round(statistics.median(self._passes))) if self._passes else 1

    # ------------------------------------------------------------------ planning (rank 0) and broadcast
    def plan(self, model_name: str, layer_names: list[str], params: list[torch.Tensor],
             engine: Any, shard_mode: Any = False, owner_costs: Optional[dict[int, float]] = None,
             owned: bool = False) -> tuple[list[Schedule], list[float]]:
        """Rank 0 plans from the median profile and picks candidates; every rank gets engine schedules.

        Args:
            model_name: for the profile.
            layer_names: owner module name of each layer.
            params: the trainable parameters in engine order.
            engine: the profiling engine (its busy-time prediction calibrates the α-β model).
            shard_mode: ``shard_optimizer`` as it applies (True, False, ``"auto"``: sharded and unsharded
                candidates, each schedule's ``sharded`` set).
            owner_costs, owned: parameter ownership (a whole-tensor optimizer) and its balancing costs, for the
                sharded model (:meth:`sharding_model`).

        Rank 0's candidates come from :class:`~lightning_pipedap.strategy.candidates.CandidatePlanner` (with
        ``partition_mb`` the partitioned plan among them, whose engine schedule has ``pieces``:
        :func:`~lightning_pipedap.plan.partition.expand_pieces`).

        Returns:
            Candidate engine schedules (the planner's first, or the partitioned one, with their predictions)
            and the no-overlap time of each (compute + update + all-reduce of every bucket, s).
        """
        cfg = self.config
        plan = None
        if self.rank == 0:
            self.predictions = {}
            self._calibrate(engine)
            layer_bytes = [sum(params[i].numel() * params[i].element_size() for i in layer) for layer in self.layers]
            passes = self.passes_per_step
            profile = merge_steps(model_name, layer_names, layer_bytes, self._profiled, self._t_updates,
                                  meta={"passes_per_step": passes} if passes > 1 else None)
            if passes > 1:
                self.info(f"pipedap: {passes} backward passes per training_step (manual optimization), each reducing "
                          f"every bucket: planned for one pass (the profiled times divided by {passes}); predictions "
                          f"are for the whole step ({passes} passes)")
            sharding = self.sharding_model(params, owner_costs, owned) if shard_mode else None
            rank0 = CandidatePlanner(cfg, self.cost_model, self.raw_cost_model, self.world_size,
                                     self.measured.contention, self.info, self.compression_cost, shard_mode,
                                     sharding)
            candidates, no_overlap, maps = rank0.build(profile, params, self.layers, passes)
            self.compression_cost, self.predictions = rank0.compression_cost, rank0.predictions
            plan = (candidates, no_overlap, profile.to_dict(), self.cost_model, maps)
        t0 = time.perf_counter()
        try:
            candidates, no_overlap, self.profile, self.cost_model, maps = C.broadcast_object(plan, src=0)
        except RuntimeError as exc:
            raise RuntimeError(
                f"pipedap: rank {self.rank}: no plan from rank 0 after {time.perf_counter() - t0:.0f} s "
                "(phase profile, broadcast of the plan): rank 0 planned longer than "
                f"wait_timeout_s={cfg.wait_timeout_s:g} s or failed; "
                "see rank 0's log, and raise wait_timeout_s or partition_mb (fewer pieces to plan)") from exc
        keys = [(p.dtype, p.device) for p in params]
        numels = [p.numel() for p in params]
        return [dataclasses.replace(expand_layers(c, self.layers, keys) if m is None else
                                    expand_pieces(c, m, self.layers, numels, keys), sharded=c.sharded)
                for c, m in zip(candidates, maps)], no_overlap

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

    def adopt_cost_model(self, cost_model: CostModel, origin: Optional[str] = None) -> None:
        """Plan with ``cost_model`` as fitted (a checkpoint's or a plan cache entry's; calibrated again by a
        re-plan's profiling steps); ``origin``: where it came from, in words (None: unchanged)."""
        self.cost_model, self.raw_cost_model = cost_model, None
        if origin is not None:
            self.cost_model_origin = origin

    def rescale(self, ratio: float) -> bool:
        """Scale α and β by ``ratio`` before a re-plan (not with compression: its cost model is separate)."""
        if self.config.compression or self.cost_model is None:
            return False
        self.cost_model = self.cost_model.scaled(alpha_factor=ratio, beta_factor=ratio)
        return True


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
            how = ("not measurably slowed" if v == 0
                   else f"stalled while the other ran (the model uses its cap, {v:g})")
            parts.append(f"{what} {how}")
        else:
            parts.append(f"{what} +{v:.0%}")
    if getattr(c, "step_slowdown", 0.0) or getattr(c, "compute_slowdown_step", 0.0):
        step_clamped = set(((m.get("step") or {}).get("clamped", ())))
        words = [f"{what} {'stalled while the other ran (the model uses its cap, ' + format(v, 'g') + ')'}"
                 if name in step_clamped and v else f"{what} +{v:.0%}"
                 for name, what, v in (("comm_slowdown", "an optimizer step on the worker", c.step_slowdown),
                                       ("compute_slowdown", "compute beside it", c.compute_slowdown_step))]
        parts.append(" and ".join(words) + " (the sharded step's model)")
    times = ""
    if all(k in m for k in ("alone_comm_s", "loaded_comm_s", "alone_compute_s", "loaded_compute_s")):
        times = (f" (alone: communication {m['alone_comm_s'] * 1e3:.1f} ms, "
                 f"compute {m['alone_compute_s'] * 1e3:.1f} ms;"
                 f" together: {m['loaded_comm_s'] * 1e3:.1f} ms and {m['loaded_compute_s'] * 1e3:.1f} ms)")
    return "pipedap: contention while communication and compute overlap: " + ", ".join(parts) + times
