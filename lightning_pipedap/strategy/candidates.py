"""Rank 0's trial candidates from one merged profile (:class:`CandidatePlanner`): the planner's schedule (16-bit
on the wire where configured), the partitioned plan (``partition_mb``), the compressed plan (``compression``) or
the other trial candidates (``plan_trials``), each with the predictions training is checked against."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from lightning_pipedap.plan import CostModel, get_planner
from lightning_pipedap.plan.candidates import trial_candidates, wire16_everywhere
from lightning_pipedap.plan.partition import choose_partition, engine_period, piece_schedule_to_layers
from lightning_pipedap.schedule import Schedule
from lightning_pipedap.strategy.config import PLANNED, PipeDAPConfig


class CandidatePlanner:
    """Rank 0's candidate schedules of one plan (called by
    :meth:`~lightning_pipedap.strategy.planning.Planning.plan`).

    Args:
        config: the strategy's options.
        cost_model: the α-β model to plan with (calibrated when calibration applied).
        raw_cost_model: the α-β model as fitted, before calibration (None: not calibrated).
        world_size: of the default group.
        contention: the measured :class:`~lightning_pipedap.plan.contention.Contention`, or None.
        info: rank-0 logger.
        compression_cost: the compressor's measured cost (None: measured here when compressing).
        shard_mode: ``shard_optimizer`` as it applies (True, False or ``"auto"``: the planner's schedule both
            sharded and unsharded among the candidates, each with ``sharded`` set).
        sharding: the sharded step's model as measured (land copy, parameter ownership:
            :meth:`~lightning_pipedap.strategy.planning.Planning.sharding_model`); None: ``Sharding()``.

    Attributes:
        predictions: every prediction of each candidate, by name (s; see :meth:`_predict`).
        compression_cost: the compressor's cost (measured once per fit).
    """

    def __init__(self, config: PipeDAPConfig, cost_model: CostModel, raw_cost_model: Optional[CostModel],
                 world_size: int, contention: Optional[Any], info: Callable[[str], None],
                 compression_cost: Optional[Any], shard_mode: Any = None, sharding: Optional[Any] = None) -> None:
        self.config, self.cost_model, self.raw_cost_model = config, cost_model, raw_cost_model
        self.shard_mode = config.shard_optimizer if shard_mode is None else shard_mode
        #: ``"auto"`` with dense candidates: each candidate's ``sharded`` decides (set in :meth:`build`)
        self.auto = self.shard_mode == "auto" and not config.compression
        self.world_size, self.contention, self.info = world_size, contention, info
        self.compression_cost = compression_cost
        self.sharding = sharding if sharding is not None else True  # (True: the model's defaults)
        self.predictions: dict[str, dict[str, float]] = {}

    def build(self, profile: Any, params: list[torch.Tensor], layers: list[list[int]],
              passes: int) -> tuple[list[Schedule], list[float], list[Optional[tuple]]]:
        """The candidates over ``profile``'s layers (``layers``: engine positions of each; ``params`` in engine
        order), their no-overlap times (s) and piece maps (None: whole layers); a step of ``passes`` backward
        passes scales the predictions by it.

        With ``partition_mb`` set (planned schedules, no compression) the plan over the profile with every layer
        larger than ``partition_mb`` MiB split into pieces (:meth:`_plan_partitioned`) comes first when it is
        predicted more than 1% faster than the planner's, else it is the last trial candidate (with
        ``plan_trials > 1``) or left out.
        """
        cfg = self.config
        self.layers = layers
        planner = get_planner(PLANNED[cfg.schedule])
        wire16 = cfg.wire_dtype != "fp32"
        # (planned and predicted with the sharded step's model, plan/sharding.py; "auto": the unsharded plan here)
        sharded = self.sharding if self.shard_mode is True else False
        if self.shard_mode == "auto" and cfg.compression:
            self.info("pipedap: shard_optimizer='auto' with compression: unsharded (a compressed bucket is stepped "
                      "unsharded anyway)")
        if self.shard_mode and self.sharding is not True:
            self.info(describe_sharding(self.sharding, profile, self.world_size))
        schedule = planner(profile, self.cost_model, self.world_size, sharded=sharded)
        if wire16:
            fp32_s = schedule.predicted_iteration_s
            if PLANNED[cfg.schedule] == "optimal":  # per bucket
                schedule = planner(profile, self.cost_model, self.world_size, wire16=True, sharded=sharded)
            else:
                schedule = wire16_everywhere(profile, self.cost_model, schedule, sharded=sharded)
            self.info(f"pipedap: {schedule.num_wire16} of {len(schedule.buckets)} buckets {cfg.wire_dtype} on the "
                      f"wire; predicted iteration {schedule.predicted_iteration_s * 1e3:.1f} ms vs "
                      f"{fp32_s * 1e3:.1f} ms all fp32 (same profile and α-β model)")
        candidates: list[Schedule] = [schedule]
        part = None
        if cfg.partition_mb is not None and not cfg.compression:
            if self.shard_mode:  # (plan/partition.py predicts unsharded piece schedules only)
                self.info(f"pipedap: partition_mb is not planned with shard_optimizer={self.shard_mode!r} (the "
                          "partition model predicts unsharded steps); the buckets hold whole parameters")
            else:
                part = self._plan_partitioned(profile, params, schedule, wire16)
        if cfg.compression:
            shapes = [[tuple(params[i].shape) for i in layer] for layer in self.layers]
            candidates = [self._plan_compression(planner, profile, schedule, shapes)]
        elif cfg.plan_trials > 1:
            # the partitioned plan is a candidate beside the others: first when it is kept, else last
            k = cfg.plan_trials - (part is not None)
            candidates = trial_candidates(profile, self.cost_model, self.world_size, schedule,
                                          cap_bytes=int(cfg.bucket_cap_mb * 2**20), k=k, wire16=wire16)
            # (planned unsharded: several fusions, so measured selection has candidates to compare, DDP's reducer
            # among them; the engine runs each as its sharded op list, sharded_ops)
        if self.auto:  # (the planner's schedule planned sharded too, first when it is predicted faster)
            candidates = [dataclasses.replace(c, sharded=False) for c in candidates]
            twin = planner(profile, self.cost_model, self.world_size, sharded=self.sharding)
            if wire16:  # (as the unsharded plan above)
                twin = (planner(profile, self.cost_model, self.world_size, wire16=True, sharded=self.sharding)
                        if PLANNED[cfg.schedule] == "optimal" else
                        wire16_everywhere(profile, self.cost_model, twin, sharded=self.sharding))
            twin = dataclasses.replace(twin, name=f"{twin.name}+shard", sharded=True)
            faster = twin.predicted_iteration_s <= schedule.predicted_iteration_s
            candidates.insert(0 if faster else 1, twin)
            self.info(f"pipedap: shard_optimizer='auto': the plan sharded ({twin.predicted_iteration_s * 1e3:.1f} ms "
                      f"predicted) and unsharded ({schedule.predicted_iteration_s * 1e3:.1f} ms) are both "
                      "candidates: measured selection keeps the faster, or, where the start-up leaves no room for "
                      f"trial windows, the {'sharded' if faster else 'unsharded'} one runs (predicted faster)")
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
        return candidates, no_overlap, maps

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
        numels = [sum(params[i].numel() for i in layer) for layer in self.layers]
        counted = dataclasses.replace(profile, layers=tuple(dataclasses.replace(layer, numel=n)
                                                            for layer, n in zip(profile.layers, numels)))
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
        planner's own (calibrated when calibration applied); a sharded one the same, with the sharded step's
        model (:attr:`sharding`: its measured land copy and ownership padding; the contention of its steps,
        ``step_slowdown``, measured with the rest). A schedule over piece-layers (``piece_map``
        given, ``profile`` partitioned) is predicted with
        :func:`~lightning_pipedap.plan.partition.engine_period` (a split layer's update once, after its last
        bucket); its contention-aware predictions use the simulator's share-by-bytes update.
        """
        from lightning_pipedap.plan.contention import simulate_contended  # noqa: PLC0415
        from lightning_pipedap.plan.simulator import simulate  # noqa: PLC0415

        if self.config.compression:
            return schedule  # compressed plans: the planner's compression-aware prediction
        raw = self.raw_cost_model or self.cost_model
        sharded = schedule.sharded if schedule.sharded is not None else self.shard_mode is True
        sharded = self.sharding if sharded else False
        if piece_map is not None:
            pred = {"ab_s": engine_period(profile, piece_map, raw, schedule),
                    "calibrated_s": engine_period(profile, piece_map, self.cost_model, schedule)}
        else:
            pred = {"ab_s": simulate(profile, raw, schedule, sharded=sharded).iteration_s,
                    "calibrated_s": simulate(profile, self.cost_model, schedule, sharded=sharded).iteration_s}
        keep = schedule.predicted_iteration_s
        if sharded and piece_map is None:  # (issue 30: the trial candidates were planned unsharded; keep the
            keep = pred["calibrated_s"]     # sharded step's prediction, what the engine runs; = the planner's for #0)
        contention = self.contention
        if contention is not None and (not sharded or piece_map is None):
            pred["contended_s"] = simulate_contended(profile, raw, schedule, contention, sharded=sharded).iteration_s
            pred["contended_calibrated_s"] = simulate_contended(profile, self.cost_model, schedule, contention,
                                                                sharded=sharded).iteration_s
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
        schedule = planner(profile, self.cost_model, self.world_size, compression=cost,
                           sharded=self.sharding if self.shard_mode is True else False)
        self.info(f"pipedap: {schedule.num_compressed} of {len(schedule.buckets)} buckets compressed "
                  f"({cfg.compression}); predicted iteration {schedule.predicted_iteration_s * 1e3:.1f} ms vs "
                  f"{dense.predicted_iteration_s * 1e3:.1f} ms without compression")
        return schedule


def _r2(r2: Any) -> str:
    """R² for a log line: 4 decimals, or ``n/a``."""
    return f"{r2:.4f}" if isinstance(r2, (int, float)) else "n/a"


def describe_sharding(sharding: Any, profile: Any, world_size: int) -> str:
    """The log line of the sharded step's measured model: the land copy's rate (ns/B and ms per step) and, under
    parameter ownership, the padding the layout adds with the whole model in one bucket (an upper bound's
    illustration: the planned buckets are laid out each on its own)."""
    from lightning_pipedap.plan.sharding import owned_buckets  # noqa: PLC0415

    total = profile.total_bytes
    line = (f"pipedap: sharded step's model: land copy {sharding.land_s_per_byte * 1e9:.3f} ns/B "
            f"({sharding.land_s_per_byte * total * 1e3:.1f} ms per step, measured in the profiling steps)")
    if sharding.owned is not None and profile.num_layers:
        (ob,) = owned_buckets(sharding.owned, [tuple(range(profile.num_layers))], [True], world_size)
        line += (f"; parameter ownership: {ob.padding:.1%} padding with one bucket, the slowest owner steps "
                 f"{ob.step_share:.0%} of it (the planner models each bucket's padded RS/AG bytes)")
    return line
