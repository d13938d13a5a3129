"""The sharded optimizer step (``shard_optimizer``, issue 30) at the engine level: each rank steps the slices its
reduce-scatter left it and all-gathers parameters (``lightning_pipedap.engine.shard_step``).

Pure parts (no processes): the op list (every gradient op before the first all-gather, AR -> RS), the slices (every
element of every bucket owned by exactly one rank), landing gathered parameters (whole, pieces, non-contiguous).
At 2 and 3 gloo ranks: several rounds of a model with a parameter split over buckets, a non-contiguous parameter,
a scalar parameter and one no rank uses, against the whole optimizer stepped on the averaged gradients (Adam, AdamW
with a no-decay group, SGD with momentum; clip by norm and by value): parameters within 1e-6, the consolidated
optimizer state within 1e-6 with the same keys, state bytes about 1/N. A mutation (slices shifted by one element)
must be caught by the same comparison.
"""

from __future__ import annotations

import pytest
import torch

from lightning_pipedap.engine import shard_step as SS
from lightning_pipedap.engine.buckets import allocate_buckets
from lightning_pipedap.schedule import Op, OpKind, Schedule, allreduce_ops, dear_ops, sharded_ops
from tests._dist_util import run_ranks

TOL = 1e-6


# ----------------------------------------------------------------------------------------------- pure parts
def test_sharded_ops_put_every_gradient_op_before_the_first_all_gather():
    s = Schedule(((0,), (1,), (2,)), (Op(OpKind.REDUCE_SCATTER, 2), Op(OpKind.ALL_GATHER, 2), Op(OpKind.ALL_REDUCE, 1),
                                      Op(OpKind.REDUCE_SCATTER, 0), Op(OpKind.ALL_GATHER, 0)), "x")
    got = [str(op) for op in sharded_ops(s).ops]
    assert got == ["RS2", "RS1", "RS0", "AG0", "AG1", "AG2"]
    sharded_ops(s).validate(3)
    comp = Schedule(((0,), (1,)), allreduce_ops(2), "c", compressed=(True, False))
    assert [str(op) for op in sharded_ops(comp).ops] == ["RS1", "AR0", "AG1"]  # (compressed bucket 0 keeps its AR)
    assert [str(op) for op in sharded_ops(comp, compressed=False).ops] == ["RS1", "RS0", "AG0", "AG1"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_slices_cover_every_element_exactly_once(world):
    params = [torch.zeros(7, 5), torch.zeros(11), torch.zeros(()), torch.zeros(3, 4).t()]
    pieces = ((0, 0, 13), (0, 13, 35), (1, 0, 11), (2, 0, 1), (3, 0, 12))
    sched = Schedule(((0,), (1, 2), (3, 4)), dear_ops(3), "d", pieces=pieces)
    buckets = allocate_buckets(sched, params, world)
    seen = [torch.zeros(p.numel(), dtype=torch.int64) for p in params]
    for rank in range(world):
        for b in buckets:
            start, end = b.own_data_range(rank)
            for s in SS.shard_slices(b, rank):
                assert start <= s.lo < s.hi <= end and s.tensor.numel() == s.hi - s.lo
                assert s.master == (not s.param.is_contiguous())
                seen[s.param_index][s.p_lo:s.p_hi] += 1
    assert all(bool((c == 1).all()) for c in seen)


def land_case() -> tuple[list[torch.Tensor], list]:
    """Three parameters (one transposed, one split in two pieces) in three 2-rank buckets whose buffers hold
    ``100 * bucket + element index``: the gathered parameters a land copy writes (also ``tests/test_shard_perf.py``)."""
    params = [torch.zeros(4, 3), torch.zeros(3, 4).t(), torch.zeros(5)]
    sched = Schedule(((0, 1), (2,), (3,)), dear_ops(3), "d", pieces=((0, 0, 12), (1, 0, 12), (2, 0, 2), (2, 2, 5)))
    buckets = allocate_buckets(sched, params, 2)
    for b in buckets:
        b.buffer[: b.numel].copy_(torch.arange(b.numel, dtype=torch.float32) + 100 * b.index)
    return params, buckets


def test_land_params_writes_whole_parameters_pieces_and_non_contiguous_ones():
    params, buckets = land_case()
    for b in buckets:
        SS.land_params(b)
    assert torch.equal(params[0].reshape(-1), torch.arange(12.0))
    assert torch.equal(params[1].reshape(-1), torch.arange(12.0, 24.0))  # (row-major order of the transposed view)
    assert torch.equal(params[2], torch.tensor([100.0, 101.0, 200.0, 201.0, 202.0]))


def test_refusals_name_the_bad_value_and_the_choices():
    from lightning_pipedap.strategy.config import PipeDAPConfig
    from lightning_pipedap.strategy.refusals import refuse_unshardable

    with pytest.raises(ValueError, match="defer_update=False"):
        PipeDAPConfig(shard_optimizer=True, defer_update=False)
    with pytest.raises(ValueError, match="shard_optimizer must be True, False or 'auto', got 'always'"):
        PipeDAPConfig(shard_optimizer="always")
    with pytest.raises(ValueError, match="shard_optimizer must be True, False or 'auto', got 1"):
        PipeDAPConfig(shard_optimizer=1)
    with pytest.raises(ValueError, match="shard_optimizer='auto' needs deferred steps"):
        PipeDAPConfig(shard_optimizer="auto", defer_update=False)
    PipeDAPConfig(shard_optimizer="auto")
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=r"element-wise \(sharded by element range: SGD, Adam, AdamW.*whole-tensor "
                                         r"\(sharded by parameter ownership: Muon, Adafactor\); got LBFGS"):
        refuse_unshardable([torch.optim.LBFGS(p)], None)
    refuse_unshardable([torch.optim.Adafactor(p)], None)
    with pytest.raises(ValueError, match="bf16-mixed"):
        refuse_unshardable([torch.optim.SGD(p, lr=0.1)], object())
    refuse_unshardable([torch.optim.AdamW(p)], None)

    class Renamed(torch.optim.AdamW):  # (AdamW's own step: split as AdamW's)
        pass

    class TrustRatio(torch.optim.AdamW):  # a LAMB-style step on top of AdamW's: mixes a parameter's elements
        def step(self, closure=None):
            return super().step(closure)

    refuse_unshardable([Renamed(p)], None)
    with pytest.raises(ValueError, match="cannot split TrustRatio: it subclasses AdamW but overrides step"):
        refuse_unshardable([TrustRatio(p)], None)


def test_assign_owners_balances_each_bucket_longest_first():
    from lightning_pipedap.plan.sharding import assign_owners

    assert assign_owners([[10, 1, 1, 8], None, [3, 3, 3]], 2) == [[0, 1, 1, 1], None, [0, 1, 0]]
    assert assign_owners([[10, 2], [4, 4, 4]], 2) == [[0, 1], [1, 0, 1]]  # (ties: the rank with less so far)
    assert assign_owners([[5.0]], 3) == [[0]]
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        assign_owners([[1]], 0)
    with pytest.raises(ValueError, match="bucket 0: costs must be finite and >= 0, got -1"):
        assign_owners([[-1]], 2)


def test_optimizer_step_times_rank_muon_matrices_by_their_cost_not_their_elements():
    from lightning_pipedap.probe.optimizer_time import optimizer_step_times

    square, wide = torch.nn.Parameter(torch.randn(384, 384)), torch.nn.Parameter(torch.randn(36, 4096))
    bias = torch.nn.Parameter(torch.randn(7))
    muon, adamw = torch.optim.Muon([square, wide], lr=0.02), torch.optim.AdamW([bias])
    before = [square.detach().clone(), wide.detach().clone()]
    t_square, t_wide, t_bias, t_none = optimizer_step_times([muon, adamw], [square, wide, bias,
                                                                             torch.nn.Parameter(torch.zeros(2))])
    assert t_square > t_wide > 0 and t_bias > 0 and t_none == 0.0  # (Newton-Schulz: m·n·min(m, n))
    assert torch.equal(square, before[0]) and torch.equal(wide, before[1]) and not muon.state  # (untouched)
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        optimizer_step_times([muon], [square], repeats=0)


# ----------------------------------------------------------------------------------------------- gloo ranks
def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(9, 7, generator=g)),  # split over buckets 0 and 1
            torch.nn.Parameter(torch.randn(13, generator=g)),
            torch.nn.Parameter(torch.randn(5, 4, generator=g).t()),  # non-contiguous (a transposed view)
            torch.nn.Parameter(torch.randn((), generator=g)),  # a scalar
            torch.nn.Parameter(torch.randn(6, generator=g))]  # no rank produces a gradient for it


PIECES = ((0, 0, 40), (0, 40, 63), (1, 0, 13), (2, 0, 20), (3, 0, 1), (4, 0, 6))
BUCKETS = ((0,), (1, 2), (3, 4, 5))
ROUNDS = 4


def _params_2d() -> list[torch.nn.Parameter]:
    """Muon steps 2-D parameters only; Adafactor factors them (and steps 1-D ones whole)."""
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(9, 7, generator=g)),
            torch.nn.Parameter(torch.randn(13, 3, generator=g)),
            torch.nn.Parameter(torch.randn(5, 4, generator=g).t()),  # non-contiguous (a transposed view)
            torch.nn.Parameter(torch.randn(2, 11, generator=g)),
            torch.nn.Parameter(torch.randn(6, 5, generator=g))]  # no rank produces a gradient for it


#: parameter ownership: whole parameters (no pieces), so each lies in one rank's shard
OWNED_BUCKETS = ((0, 1), (2, 3, 4))
WHOLE_TENSOR = ("muon", "adafactor")


def _grad(rank: int, k: int, i: int, p: torch.Tensor) -> torch.Tensor:
    g = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * k + 10 * rank + i))
    return g * (40.0 if i == 1 else 1.0)  # (a large one: clip by norm bites)


def _optimizer(name: str, params: list) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
    if name == "adamw_groups":  # (a no-decay group, as Hugging Face's Trainer builds them)
        return torch.optim.AdamW([{"params": params[:2], "weight_decay": 0.1},
                                  {"params": params[2:], "weight_decay": 0.0}], lr=1e-2)
    if name == "muon":
        return torch.optim.Muon(params, lr=0.02, weight_decay=0.01)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2)
    return torch.optim.Adam(params, lr=1e-2)


def _reference(world: int, opt_name: str, clip):
    """The whole optimizer on the averaged gradients, as DDP steps it (every rank the same)."""
    params = _params_2d() if opt_name in WHOLE_TENSOR else _params()
    opt = _optimizer(opt_name, params)
    for k in range(ROUNDS):
        for i, p in enumerate(params):
            if i == 4:
                continue
            p.grad = sum(_grad(r, k, i, p) * (1.0 / world) for r in range(world))
        if clip is not None and clip.algorithm == "norm":
            torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], clip.value)
        elif clip is not None:
            torch.nn.utils.clip_grad_value_([p for p in params if p.grad is not None], clip.value)
        opt.step()
    return params, opt


def _watch_grad_reads() -> list[str]:
    """Record the name of every thread but the main one that reads or writes a ``Parameter``'s ``.grad``."""
    import threading

    seen: list[str] = []
    base = torch._C.TensorBase.grad

    def note() -> None:
        if threading.current_thread() is not threading.main_thread():
            seen.append(threading.current_thread().name)

    def get(p):
        note()
        return base.__get__(p, type(p))

    def put(p, value):
        note()
        base.__set__(p, value)

    torch.nn.Parameter.grad = property(get, put)
    return seen


def _rank(rank: int, world: int, opt_name: str, clip_spec, mutate: bool, watch: bool = False):
    from lightning_pipedap.engine import collectives as C
    from lightning_pipedap.engine.engine import CommEngine
    from lightning_pipedap.engine.update import ClipRequest, snapshot_hparams

    clip = ClipRequest(*clip_spec) if clip_spec else None
    if mutate:  # (a wrong shard offset: every multi-element slice one element off)
        real = SS.shard_slices

        def shifted(bucket, r):
            out = real(bucket, r)
            for s in out:
                if s.whole and not s.master:  # (parameter ownership: the gradient read one element off)
                    s.lo, s.hi = s.lo + 1, s.hi + 1
                elif s.p_hi < s.param.numel() and not s.master:
                    s.p_lo, s.p_hi = s.p_lo + 1, s.p_hi + 1
                    s.tensor = s.param.detach().view(-1)[s.p_lo:s.p_hi]
            return out

        SS.shard_slices = shifted
    off_main = _watch_grad_reads() if watch else []
    comm = C.new_comm_group(timeout_s=30, chunk_bytes=64)
    owned = opt_name in WHOLE_TENSOR
    params = _params_2d() if owned else _params()
    opt = _optimizer(opt_name, params)
    schedule = (Schedule(OWNED_BUCKETS, dear_ops(2), "dear") if owned else
                Schedule(BUCKETS, dear_ops(3), "dear", pieces=PIECES))
    engine = CommEngine(comm, params, schedule, wait_timeout_s=30, shard=True, shard_owned=owned)
    assert [str(op) for op in engine.schedule.ops] == (["RS1", "RS0", "AG0", "AG1"] if owned else
                                                       ["RS2", "RS1", "RS0", "AG0", "AG1", "AG2"])
    if owned and not mutate:  # (every parameter whole in one rank's shard, each rank owning some of them)
        assert all(s.whole and (s.lo, s.hi) == (b.offsets[s.slot], b.offsets[s.slot] + s.param.numel())
                   for b in engine.buckets for s in SS.shard_slices(b, rank))
        assert {o for b in engine.buckets for o in b.owners} == set(range(world))
    for k in range(ROUNDS):
        engine.shard.armed = True
        engine.begin_iteration()
        engine.shard.armed = False
        for i in range(4):  # (parameter 4: no gradient on any rank)
            engine.grad_ready(i, _grad(rank, k, i, params[i]))
        engine.finish_backward()
        engine.shard.go(opt, snapshot_hparams(opt), clip, None)
        if watch:  # (what Lightning's on_validation_model_zero_grad does while the worker prepares and steps)
            for p in params:
                p.grad = None
        with torch.no_grad():
            for b in range(engine.num_buckets):
                bucket = engine.wait_done(b)
                assert engine.syncs[b].params_gathered
                SS.land_params(bucket)
                engine.syncs[b].land()
    engine.wait_idle()
    nbytes = engine.shard.optimizer.state_nbytes()
    assert not opt.state  # (the full state was moved into the slices)
    engine.shard.consolidate()
    engine.close()
    C.destroy_comm_group(comm)
    state = {f"{i}/{k}": torch.as_tensor(v).numpy().copy() for i, st in opt.state_dict()["state"].items()
             for k, v in st.items()}  # (numpy: tensors would travel through shared memory the rank then frees)
    assert not off_main, f"threads other than the main one touched .grad: {sorted(set(off_main))}"
    return [p.detach().numpy().copy() for p in params], state, nbytes


def _compare(world: int, opt_name: str, clip_spec, mutate: bool = False, watch: bool = False) -> float:
    from lightning_pipedap.engine.update import ClipRequest

    out = run_ranks(_rank, world, opt_name, clip_spec, mutate, watch, timeout_s=120)
    out = {r: ([torch.from_numpy(p) for p in ps], {k: torch.from_numpy(v) for k, v in st.items()}, n)
           for r, (ps, st, n) in out.items()}
    ref_params, ref_opt = _reference(world, opt_name, ClipRequest(*clip_spec) if clip_spec else None)
    ref_state = {f"{i}/{k}": torch.as_tensor(v) for i, st in ref_opt.state_dict()["state"].items()
                 for k, v in st.items()}
    worst = 0.0
    for rank, (params, state, nbytes) in out.items():
        for p, q in zip(params, ref_params):
            worst = max(worst, float((p - q.detach()).abs().max()))
        if set(state) != set(ref_state):  # (a state entry missing or extra: as far off as can be)
            return float("inf")
        for key, v in ref_state.items():
            if state[key].shape != v.shape:
                return float("inf")
            scale = max(1.0, float(v.double().abs().max()))  # (relative for large entries: Adafactor's row sums)
            worst = max(worst, float((state[key].double() - v.double()).abs().max()) / scale)
        full = sum(v.numel() * v.element_size() for k, v in ref_state.items() if v.dim() > 0 or "step" not in k)
        if not mutate and opt_name not in ("sgd",) + WHOLE_TENSOR:  # (1/N of the moments, plus a step per slice)
            assert nbytes <= full / world + 64 * 4 * 3, (rank, nbytes, full)
        if not mutate and opt_name in WHOLE_TENSOR:  # (whole parameters: each one's state on its owner only)
            assert nbytes < full, (rank, nbytes, full)
    if not mutate and opt_name in WHOLE_TENSOR:
        every = sum(v.numel() * v.element_size() for v in ref_state.values())
        assert sum(n for _, _, n in out.values()) == every
    for p in range(len(ref_params)):  # replicas equal
        assert all(torch.equal(out[0][0][p], out[r][0][p]) for r in out)
    return worst


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("opt_name,clip_spec", [("adam", None), ("adamw_groups", (1.0, "norm")),
                                                ("sgd", (0.5, "value")), ("muon", (1.0, "norm")),
                                                ("adafactor", None)])
def test_sharded_step_equals_the_whole_step(world, opt_name, clip_spec):
    assert _compare(world, opt_name, clip_spec) <= TOL


@pytest.mark.parametrize("opt_name,clip_spec", [("adamw_groups", (1.0, "norm")), ("sgd", (0.5, "value"))])
def test_the_worker_never_touches_grad_and_clearing_it_after_the_step_changes_nothing(opt_name, clip_spec):
    """The worker steps from the ``.grad`` snapshot taken when the step was recorded: it never reads ``.grad``
    itself (a read raced with the main thread clearing it, as Lightning's ``on_validation_model_zero_grad`` does
    right after the step, and crashed torch: segfault in ``PyInterpreter::incref``), and results are the same."""
    assert _compare(2, opt_name, clip_spec, watch=True) <= TOL


@pytest.mark.parametrize("opt_name", ["adam", "muon"])
def test_the_comparison_catches_a_wrong_shard_offset(opt_name):
    assert _compare(2, opt_name, None, mutate=True) > 1e-3


def test_owned_layout_puts_each_parameter_whole_in_its_owners_shard():
    from lightning_pipedap.plan.sharding import assign_owners

    params = _params_2d()
    owners = assign_owners([[params[i].numel() for i in b] for b in OWNED_BUCKETS], 3)
    buckets = allocate_buckets(Schedule(OWNED_BUCKETS, dear_ops(2), "dear"), params, 3, owners)
    for b in buckets:
        S = b.shard_size
        for slot, p in enumerate(b.params):
            r = b.owners[slot]
            assert r * S <= b.offsets[slot] and b.offsets[slot] + p.numel() <= (r + 1) * S
        spans = sorted((b.offsets[s], b.offsets[s] + p.numel()) for s, p in enumerate(b.params))
        assert all(a[1] <= c[0] for a, c in zip(spans, spans[1:]))  # (no overlap)
        assert b.numel + len(b.params) <= b.buffer.numel() == 3 * S  # (the used flags after the last rank's data)
        assert b.flags.data_ptr() == b.buffer[b.numel:].data_ptr()
    with pytest.raises(ValueError, match="owners .* a rank in 0..2"):
        allocate_buckets(Schedule(((0, 1),), dear_ops(1), "dear"), params[:2], 3, [[0, 3]])
    with pytest.raises(ValueError, match="partition_mb"):
        allocate_buckets(Schedule(BUCKETS, dear_ops(3), "dear", pieces=PIECES), _params(), 2, [None] * 3)


# ----------------------------------------------------------------------------------------------- a real fit
@pytest.fixture(scope="module")
def fit_results(tmp_path_factory):
    import json
    from pathlib import Path

    from tests._dist_util import run_lightning_ranks

    out = tmp_path_factory.mktemp("shard_fit") / "results.json"
    run_lightning_ranks(["-m", "tests.shard_cases", str(out)], world=2, timeout_s=600,
                        cwd=str(Path(__file__).resolve().parents[1]))
    return json.loads(out.read_text())


@pytest.mark.multiprocess
def test_a_sharded_fit_shows_what_ddp_shows_and_refuses_sharded_state_reads(fit_results):
    """``tests/shard_cases.py``: parameters and the ``.grad`` read in ``training_step`` equal DDP's; a read of
    ``optimizer.state[p]`` or ``optimizer.state_dict()`` raises naming the parameter and the way out; the rank holds
    about half the state at every step, the start-up's included; ``optimizer_state`` gives the whole state on
    rank 0; after the fit the state is whole, in CPU memory."""
    ddp, shard = fit_results["ddp"], fit_results["shard"]
    assert len(shard["grads"]) == 2 and shard["grads"] == ddp["grads"]
    assert shard["params"] == ddp["params"]
    assert len(shard["errors"]) == 4 and not ddp["errors"], shard["errors"]
    assert all("ShardedStateError" in e and "trainer.strategy.optimizer_state" in e for e in shard["errors"])
    assert "net.0.weight" in shard["errors"][0] and "state_dict()" in shard["errors"][1]
    assert ddp["nbytes"] * 0.45 < shard["nbytes"] < ddp["nbytes"] * 0.6, (shard["nbytes"], ddp["nbytes"])
    # (the start-up's sync-mode steps are sharded too: the whole state never exists during the fit)
    assert shard["max_nbytes"] == shard["nbytes"] and ddp["max_nbytes"] == ddp["nbytes"], (shard, ddp)
    assert shard["state_keys"] == ddp["state_keys"] == [0, 1, 2, 3]  # (rank 0: every parameter's state)
    assert len(shard["after_fit"]) == 4 and all(d == "cpu" for st in shard["after_fit"].values() for d in st.values())
    # (the shards are stepped without optimizer.step(): the LR scheduler must still see the step, as under DDP)
    assert shard["scheduler_warnings"] == ddp["scheduler_warnings"] == [], shard["scheduler_warnings"]
