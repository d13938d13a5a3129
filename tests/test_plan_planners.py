"""Planners: valid schedules, consistent predictions, lower bounds, optimal vs exhaustive search."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from lightning_pipedap.plan.bounds import lower_bounds
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.partition import is_split, partition_profile
from lightning_pipedap.plan.planners import PLANNERS, get_planner
from lightning_pipedap.plan.profile import LayerProfile, ModelProfile, load_profile
from lightning_pipedap.plan.simulator import simulate
from lightning_pipedap.schedule import Op, OpKind, Schedule
from lightning_pipedap.plan.profile import PACKAGED_PROFILES_DIR

RS, AG, AR = OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.ALL_REDUCE
DATA = Path(__file__).resolve().parent / "data"
SHARED = PACKAGED_PROFILES_DIR  # the reference profiles shipped with the package
NAMES = ("no_overlap", "wfbp", "dear", "pipedap", "optimal")


def _random_instance(rng: random.Random, L: int) -> tuple[ModelProfile, CostModel]:
    prof = ModelProfile("r", tuple(LayerProfile(f"l{i}", rng.randint(0, 4000), rng.uniform(0, 1), rng.uniform(0, 1))
                                   for i in range(L)), t_update=rng.choice([0.0, rng.uniform(0, 0.5)]))
    cm = CostModel.from_allreduce(rng.uniform(0, 0.5), rng.uniform(0, 1e-3),
                                  startup_sharing=rng.choice([0.0, 1.0, rng.random()]))
    return prof, cm


def _all_op_lists(B: int):
    """Every valid op list for B buckets: each bucket one AR, or RS then later AG, in any order."""
    state = [0] * B
    seq: list[Op] = []

    def rec():
        if all(s == 2 for s in state):
            yield tuple(seq)
            return
        for b in range(B):
            if state[b] == 0:
                for kind, new in ((AR, 2), (RS, 1)):
                    state[b] = new
                    seq.append(Op(kind, b))
                    yield from rec()
                    seq.pop()
                    state[b] = 0
            elif state[b] == 1:
                state[b] = 2
                seq.append(Op(AG, b))
                yield from rec()
                seq.pop()
                state[b] = 1

    yield from rec()


def _contiguous_fusions(L: int):
    for mask in range(1 << (L - 1)):
        cuts = [0] + [i for i in range(1, L) if mask >> (i - 1) & 1] + [L]
        yield tuple(tuple(range(a, b)) for a, b in zip(cuts, cuts[1:]))


def _brute_force(prof: ModelProfile, cm: CostModel, channels: int) -> float:
    return min(simulate(prof, cm, Schedule(bk, ops), channels=channels).iteration_s
               for bk in _contiguous_fusions(prof.num_layers) for ops in _all_op_lists(len(bk)))


def test_registry_and_unknown_name():
    assert set(PLANNERS) == set(NAMES)
    assert get_planner("optimal") is PLANNERS["optimal"]
    with pytest.raises(ValueError, match=r"unknown planner 'fastest'; valid: \['dear', 'no_overlap', 'optimal'"):
        get_planner("fastest")


@pytest.mark.parametrize("name", NAMES)
def test_every_planner_on_tiny_profile(name):
    prof = load_profile(DATA / "tiny_profile.json")
    cm = CostModel.from_allreduce(2e-4, 2e-9, meta={"world_size": 4})
    for channels in (1, 2):
        s = get_planner(name)(prof, cm, 4, channels=channels)
        assert isinstance(s, Schedule) and s.name == name
        s.validate(prof.num_layers)
        r = simulate(prof, cm, s, channels=channels)
        assert s.predicted_iteration_s == pytest.approx(r.iteration_s, rel=1e-12)
        assert r.iteration_s >= lower_bounds(prof, cm, channels=channels).best_s * (1 - 1e-12)


def test_no_overlap_formula():
    prof = load_profile(DATA / "tiny_profile.json")
    cm = CostModel.from_allreduce(2e-4, 2e-9)
    s = get_planner("no_overlap")(prof, cm, 4)
    assert s.ops == (Op(AR, 0),)
    expected = prof.t_backward + 2e-4 + 2e-9 * prof.total_bytes + prof.t_update + prof.t_forward
    assert s.predicted_iteration_s == pytest.approx(expected)


@pytest.mark.parametrize("seed", range(14))
def test_optimal_matches_exhaustive_search(seed):
    rng = random.Random(100 + seed)
    L = [1, 2, 3, 3, 4, 4, 4][seed % 7]
    prof, cm = _random_instance(rng, L)
    channels = 1 if seed % 3 else 2
    best = _brute_force(prof, cm, channels)
    s = get_planner("optimal")(prof, cm, 1, channels=channels)
    assert s.predicted_iteration_s == pytest.approx(best, rel=1e-12)
    for name in NAMES:
        assert get_planner(name)(prof, cm, 1, channels=channels).predicted_iteration_s >= best * (1 - 1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_optimal_matches_exhaustive_search_on_a_partitioned_profile(seed):
    # 2-3 layers, the largest split so that there are at most 4 piece-layers: the planners need no change,
    # ``optimal`` still finds the brute-force best over piece-layers, and that is never worse than the
    # unpartitioned best (every unpartitioned schedule is a partitioned one with a layer's pieces in one bucket)
    rng = random.Random(300 + seed)
    L = 2 if seed % 2 else 3
    prof, cm = _random_instance(rng, L)
    sizes = sorted(prof.sizes_bytes)
    largest = sizes[-1]
    # L = 2: both layers may split in 2; L = 3: only the largest, in 2 (the others are <= the piece size)
    piece = largest / 2 if L == 2 else max(largest / 2, sizes[-2])
    assert sizes[-2] < largest and largest >= 2  # (true for these seeds)
    pp, pmap = partition_profile(prof, piece, bytes_per_element=1)
    assert is_split(pmap) and pp.num_layers <= 4
    channels = 1 if seed % 3 else 2
    best = _brute_force(pp, cm, channels)
    s = get_planner("optimal")(pp, cm, 1, channels=channels)
    assert s.predicted_iteration_s == pytest.approx(best, rel=1e-12)
    assert simulate(pp, cm, s, channels=channels).iteration_s == pytest.approx(best, rel=1e-12)
    unsplit = get_planner("optimal")(prof, cm, 1, channels=channels).predicted_iteration_s
    assert best <= unsplit * (1 + 1e-12)
    for name in NAMES:
        assert get_planner(name)(pp, cm, 1, channels=channels).predicted_iteration_s >= best * (1 - 1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_wfbp_fusion_is_optimal_for_its_order(seed):
    rng = random.Random(200 + seed)
    prof, cm = _random_instance(rng, 6)
    best = min(simulate(prof, cm, Schedule(bk, tuple(Op(AR, b) for b in reversed(range(len(bk)))))).iteration_s
               for bk in _contiguous_fusions(6))
    assert get_planner("wfbp")(prof, cm, 1).predicted_iteration_s == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_pipedap_never_slower_than_dear_with_the_same_fusion(seed):
    rng = random.Random(300 + seed)
    prof, cm = _random_instance(rng, 8)
    for fusion in ("none", "single", 5000):
        d = get_planner("dear")(prof, cm, 1, fusion=fusion)
        p = get_planner("pipedap")(prof, cm, 1, fusion=fusion)
        assert p.buckets == d.buckets
        assert p.predicted_iteration_s <= d.predicted_iteration_s * (1 + 1e-12)


def test_pipedap_merges_rs_and_ag_only_when_it_saves_a_startup():
    prof = ModelProfile("one", (LayerProfile("w", 4000, 0.1, 0.1),))
    shared = get_planner("pipedap")(prof, CostModel.from_allreduce(0.01, 1e-6, startup_sharing=1.0), 1)
    assert shared.ops == (Op(AR, 0),)
    assert shared.predicted_iteration_s == pytest.approx(0.1 + 0.01 + 0.004 + 0.1)
    plain = get_planner("pipedap")(prof, CostModel.from_allreduce(0.01, 1e-6), 1)
    assert plain.ops == (Op(RS, 0), Op(AG, 0))
    assert plain.predicted_iteration_s == pytest.approx(0.214)


def test_pipedap_fills_a_backward_gap_with_an_all_gather():
    # layer 1 (top) is ready at t=0.1, layer 0 at 1.1: RS1 [0.1, 0.2] leaves a gap that fits AG1
    prof = ModelProfile("gap", (LayerProfile("l0", 1000, 0.05, 1.0), LayerProfile("l1", 1000, 0.5, 0.1)))
    cm = CostModel.from_allreduce(0.1, 1e-4)  # RS = AG = 0.1 s per 1000 B bucket
    s = get_planner("pipedap")(prof, cm, 1, fusion="none")
    assert s.ops == (Op(RS, 1), Op(AG, 1), Op(RS, 0), Op(AG, 0))
    # RS0 [1.1, 1.2], AG0 [1.2, 1.3]; forward 1.3 + 0.05 + 0.5 (AG1 was done at 0.3)
    assert s.predicted_iteration_s == pytest.approx(1.85)
    # DeAR: AG1 [1.3, 1.4] after AG0, so layer 1 waits until 1.4: 1.4 + 0.5
    assert get_planner("dear")(prof, cm, 1, fusion="none").predicted_iteration_s == pytest.approx(1.9)


@pytest.mark.parametrize("kwargs, match", [
    ({"fusion": "bogus"}, "unknown fusion 'bogus'"),
    ({"fusion": -5}, "fusion cap must be > 0"),
    ({"fusion": ((0, 2), (1,), (3, 4))}, "contiguous buckets"),
    ({"channels": 3}, "channels must be 1 or 2"),
])
def test_bad_options(kwargs, match):
    prof = load_profile(DATA / "tiny_profile.json")
    cm = CostModel.from_allreduce(2e-4, 2e-9)
    with pytest.raises(ValueError, match=match):
        get_planner("optimal")(prof, cm, 4, **kwargs)


def test_world_size_must_match_cost_model():
    prof = load_profile(DATA / "tiny_profile.json")
    cm = CostModel.from_allreduce(2e-4, 2e-9, meta={"world_size": 8})
    with pytest.raises(ValueError, match="built for world size 8, but world_size=4"):
        get_planner("wfbp")(prof, cm, 4)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        get_planner("dear")(prof, CostModel.from_allreduce(2e-4, 2e-9), 0)


@pytest.mark.parametrize("model", ["vgg16", "resnet50", "bert_base", "densenet201", "gpt2"])
@pytest.mark.parametrize("beta_scale", [1, 30])
def test_shared_profiles_optimal_is_never_worse(model, beta_scale):
    prof = load_profile(SHARED / f"{model}.json")
    cm = CostModel.from_reference(SHARED / "alpha_beta.json", 8).scaled(beta_factor=beta_scale)
    bound = lower_bounds(prof, cm).best_s
    times = {n: get_planner(n)(prof, cm, 8).predicted_iteration_s for n in NAMES}
    for n, t in times.items():
        assert t >= bound * (1 - 1e-12), n
        assert times["optimal"] <= t * (1 + 1e-12), n
    # no_overlap: Σt_b + T_AR(all bytes) + Σt_f with the reference's T_AR = alpha + beta_elem * params
    ab = {"alpha": cm.ar.alpha_s, "beta_elem": cm.ar.beta_s_per_byte * 4}
    params = prof.total_bytes // 4
    assert times["no_overlap"] == pytest.approx(prof.t_backward + prof.t_forward + ab["alpha"]
                                                + ab["beta_elem"] * params)


@pytest.mark.parametrize("model", ["vgg16", "resnet50", "bert_base"])
def test_shared_profiles_optimal_reaches_window_bound_at_reference_constants(model):
    # at the shipped 8-worker constants these models are compute-bound: the best plan sits on the bound
    prof = load_profile(SHARED / f"{model}.json")
    cm = CostModel.from_reference(SHARED / "alpha_beta.json", 8)
    lb = lower_bounds(prof, cm)
    assert get_planner("optimal")(prof, cm, 8).predicted_iteration_s == pytest.approx(lb.window_s, rel=1e-9)
