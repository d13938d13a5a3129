"""``partition_mb``: the option, and rank 0's plan with a partitioned candidate (one-process gloo group)."""

from __future__ import annotations


import re

import pytest
import torch

from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.strategy.config import PipeDAPConfig


@pytest.mark.parametrize("bad", [0, -2.5, 1e-9, 0.000976562, float("inf"), float("nan"), True, "4"])
def test_partition_mb_is_validated(bad):
    with pytest.raises(ValueError, match=r"partition_mb must be None \(off\) or a finite number of MiB "
                                         r">= 1/1024 = 0.0009765625 "
                                         r"\(1 KiB; split layers larger than that before planning, e.g. 4\), got "
                                         + re.escape(repr(bad))):
        PipeDAPConfig(partition_mb=bad)


def test_partition_mb_takes_any_real_number():
    import numpy as np

    assert PipeDAPConfig(partition_mb=np.float32(2.0)).partition_mb == 2.0
    assert PipeDAPConfig(partition_mb=np.int64(4)).partition_mb == 4.0
    assert PipeDAPConfig(partition_mb=1 / 1024).partition_mb == 1 / 1024


def test_a_tiny_piece_size_is_raised_to_keep_the_plan_bounded():
    from lightning_pipedap.plan.partition import MAX_PIECE_LAYERS, choose_partition
    from lightning_pipedap.plan.planners import get_planner
    from lightning_pipedap.plan.profile import LayerProfile, ModelProfile

    prof = ModelProfile("m", tuple(LayerProfile(f"l{i}", 4 << 20, 1e-3, 2e-3) for i in range(2)), 0.0)
    cm = CostModel.from_allreduce(1e-4, 1e-9)
    base = get_planner("wfbp")(prof, cm, 2)
    choice = choose_partition(prof, cm, 2, "wfbp", base, 4)  # (4-byte pieces: 2 M piece-layers asked)
    assert len(choice.piece_map) <= MAX_PIECE_LAYERS
    assert f"at most {MAX_PIECE_LAYERS} piece-layers are planned" in choice.line


def test_partition_mb_option_is_threaded_through_every_front_end():
    from lightning_pipedap import PipeDAPStrategy
    from lightning_pipedap.app.schema import PipeDAPStrategyConf
    from lightning_pipedap.strategy.fabric import PipeDAPFabricStrategy

    assert PipeDAPConfig().partition_mb is None and PipeDAPConfig(partition_mb=4).partition_mb == 4.0
    assert PipeDAPConfig.defaults()["partition_mb"] is None  # (both strategies take it by name, through **options)
    assert PipeDAPStrategyConf().partition_mb is None
    assert PipeDAPStrategy(partition_mb=2).config.partition_mb == 2.0
    assert PipeDAPFabricStrategy(partition_mb=0.25).config.partition_mb == 0.25
    with pytest.raises(ValueError, match="partition_mb must be None"):
        PipeDAPFabricStrategy(partition_mb=-1)
    assert PipeDAPConfig(schedule="dear", partition_mb=4).ignored_options() == [
        "pipedap: partition_mb=4 not used: schedule 'dear' is fixed (only planned schedules are partitioned)"]
    assert PipeDAPConfig(partition_mb=0.5, compression="fp16").ignored_options() == [
        "pipedap: partition_mb=0.5 not used: compression='fp16' is set (a compressor works on whole parameters)"]
    assert PipeDAPConfig(partition_mb=4).ignored_options() == []


def _plan(partition_mb, plan_trials=1, alpha=0.0):
    """The hand case of tests/test_plan_partition.py (``test_simulated_split_layer_by_hand``) through Planning.plan,
    sizes x 2**15: l0 (25 * 2**15 fp32 elements = 3.125 MiB, t_f 2 s, t_b 0.5 s), l1 (76 * 2**15 elements =
    9.5 MiB, t_f 0.5 s, t_b 0.5 s), alpha 0, beta 0.01 s per 2**17 B: AR(3.125 MiB) = 1 s, AR(4.75 MiB) = 1.52 s."""
    import torch.distributed as dist

    from lightning_pipedap.strategy.planning import Measured, Planning

    said: list[str] = []
    cfg = PipeDAPConfig(cost_model=CostModel.from_allreduce(alpha, 0.01 / 2**15), partition_mb=partition_mb,
                        plan_trials=plan_trials, model_contention=False)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        pl = Planning(cfg, None, torch.device("cpu"), 2, 0, Measured(), said.append, said.append)
        pl.layers, pl.cost_model = [[0], [1]], cfg.cost_model
        pl._profiled = [([2.0, 0.5], [0.5, 0.5])]
        params = [torch.zeros(5, 5 * 2**15), torch.zeros(76 * 2**15)]
        schedules, no_overlap = pl.plan("m", ["l0", "l1"], params, engine=None)
    finally:
        dist.destroy_process_group()
    return schedules, no_overlap, said, pl


def test_plan_keeps_the_partitioned_schedule_when_it_is_predicted_faster():
    schedules, no_overlap, said, pl = _plan(4.75)
    (s,) = schedules
    assert s.name == "optimal+pieces4.75MiB"
    assert s.pieces == ((0, 0, 25 * 2**15), (1, 0, 38 * 2**15), (1, 38 * 2**15, 76 * 2**15))
    assert s.predicted_iteration_s == pytest.approx(5.04)
    assert s.split_params() == {1: (1, 2)}
    s.validate(2, [25 * 2**15, 76 * 2**15])
    assert pl.predictions[s.name] == {"ab_s": pytest.approx(5.04), "calibrated_s": pytest.approx(5.04)}
    # no overlap: compute 3.5 + AR of every bucket (100 B, 152 B, 152 B: 1 + 1.52 + 1.52 s)
    assert no_overlap == [pytest.approx(3.5 + 4.04)]
    (line,) = [m for m in said if "partition_mb" in m]
    assert line == ("pipedap: partition_mb=4.75: 1 layer split into 2 pieces (l1: 2) for planning; predicted "
                    "iteration 5040.0 ms partitioned (optimal+pieces4.75MiB, 3 buckets, after tensor fusion 1 layer "
                    "in 2 pieces) vs 5520.0 ms unpartitioned (optimal, 2 buckets; "
                    "α-β model with the engine's update rule, without the contention model of the candidates' "
                    "predictions): keeping the partitioned plan")


def test_plan_trials_get_both_and_nothing_to_split_changes_nothing():
    schedules, _, said, _ = _plan(4.75, plan_trials=3)
    assert [s.name for s in schedules][:2] == ["optimal+pieces4.75MiB", "optimal"] and len(schedules) == 3
    assert schedules[0].pieces is not None and all(s.pieces is None for s in schedules[1:])
    schedules, _, said, _ = _plan(16.0, plan_trials=3)
    assert all(s.pieces is None for s in schedules) and schedules[0].name == "optimal"
    assert [m for m in said if "partition_mb" in m] == [
        "pipedap: partition_mb=16: no layer is larger than 16 MiB, nothing to split; predicted iteration 5520.0 ms "
        "unpartitioned (optimal)"]


def test_plan_keeps_the_unpartitioned_schedule_when_pieces_do_not_pay():
    # a 2 s start-up per all-reduce: a third bucket costs more than the pieces' overlap gains
    schedules, _, said, _ = _plan(4.75, plan_trials=1, alpha=2.0)
    assert [s.name for s in schedules] == ["optimal"] and schedules[0].pieces is None
    (line,) = [m for m in said if "partition_mb" in m]
    assert line.startswith("pipedap: partition_mb=4.75: 1 layer split into 2 pieces (l1: 2) for planning; predicted "
                           "iteration ")
    assert line.endswith("keeping the unpartitioned plan (the partitioned one is not predicted faster)")
    schedules, _, _, _ = _plan(4.75, plan_trials=3, alpha=2.0)
    assert schedules[0].name == "optimal" and schedules[-1].name == "optimal+pieces4.75MiB" and len(schedules) == 3
