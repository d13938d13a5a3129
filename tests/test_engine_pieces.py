"""Tensor partitioning in the engine (``Schedule.pieces``; ByteScheduler, SOSP 2019): a parameter split
over several buckets.

Single process: a :class:`FlatBucket` with pieces (offsets, views, flags); :class:`BucketOptimizer` on a
pair of buckets that split one parameter steps it once, when the last of its buckets is applied, and
equals a plain optimizer step on the whole parameter (SGD with momentum, Adam; no clipping, clip by value,
clip by the global norm coefficient; a split parameter unused on every rank with a kept zero ``.grad``
vs None); ``write_back_grads`` assembles ``.grad`` from the pieces.

Two gloo ranks (:func:`tests._dist_util.run_ranks`): Linear(6, 40) -> Tanh -> Linear(40, 3) plus a
parameter no rank uses, the first weight split over 3 buckets and the second over 2, pieces fused with
whole neighbours, under a DeAR op list and an all-reduce op list, with gradient accumulation over two
backward passes: every parameter's reduced gradient (assembled from its pieces) equals the average of
both ranks' local gradients, and stepping bucket by bucket equals a torch optimizer step on the averaged
gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_pipedap.engine.buckets import FlatBucket
from lightning_pipedap.engine.engine import view_refusal
from lightning_pipedap.engine.update import (
    BucketOptimizer,
    ClipRequest,
    clip_norm_coefficient,
    snapshot_hparams,
    write_back_grads,
)
from lightning_pipedap.schedule import Schedule, allreduce_ops, dear_ops
from tests._dist_util import run_ranks


# ------------------------------------------------------------------------------------------- FlatBucket
def test_flat_bucket_with_pieces_offsets_views_and_flags():
    w = torch.nn.Parameter(torch.zeros(4, 5))  # 20 elements, split [0, 8) | [8, 20)
    b = torch.nn.Parameter(torch.zeros(3))
    first = FlatBucket.allocate(0, (0, 1), [w, b], world_size=2, ranges=[(0, 8), (0, 3)], units=(0, 2))
    second = FlatBucket.allocate(1, (0,), [w], world_size=2, ranges=[(8, 20)], units=(1,))
    # 8 + 3 data elements + 2 flags = 13 -> 7 per rank (1 padding element)
    assert (first.numel, first.shard_size, first.buffer.numel()) == (11, 7, 14)
    assert first.offsets == [0, 8] and first.ranges == [(0, 8), (0, 3)] and first.units == (0, 2)
    assert first.pieces == [True, False] and first.has_pieces and first.is_piece(0) and not first.is_piece(1)
    assert first.grad_view(0).shape == (8,) and first.grad_view(1).shape == (3,)
    assert (second.numel, second.shard_size, second.pieces) == (12, 7, [True])
    assert second.grad_view(0).shape == (12,)
    assert first.flags.numel() == 2 and second.flags.numel() == 1
    assert first.own_data_range(0) == (0, 7) and first.own_data_range(1) == (7, 11)
    # the views are the buffer: writes land at the slots' offsets, flags after the data
    first.grad_view(0).copy_(torch.arange(8.0))
    first.grad_view(1).fill_(-1.0)
    first.flags.copy_(torch.tensor([1.0, 0.0]))
    assert first.buffer.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, -1, -1, -1, 1, 0, 0]
    assert first.is_view(0, first.grad_view(0)) and not first.is_view(0, first.grad_view(0).clone())
    # a whole parameter keeps its shaped view
    whole = FlatBucket.allocate(2, (0,), [w], world_size=2)
    assert whole.grad_view(0).shape == (4, 5) and whole.pieces == [False] and not whole.has_pieces
    with pytest.raises(ValueError, match=r"elements \[8, 21\)"):
        FlatBucket.allocate(3, (0,), [w], world_size=2, ranges=[(8, 21)])


def test_view_refusal_names_the_split_parameter():
    w = torch.nn.Parameter(torch.zeros(4, 5))
    b = torch.nn.Parameter(torch.zeros(3))
    bucket = FlatBucket.allocate(1, (1, 4), [b, w], world_size=2, ranges=[(0, 3), (12, 20)])
    reason = view_refusal(bucket, buckets_of={4: (1, 3)})
    assert reason is not None
    assert "holds part of parameter 4" in reason and "[12, 20) of 20" in reason and "split over buckets 1, 3" in reason
    assert view_refusal(FlatBucket.allocate(0, (1, 4), [b, w], world_size=2)) is None  # whole: a view is fine
    named = view_refusal(bucket, buckets_of={4: (1, 3)}, names=["a", "b", "c", "d", "net.0.weight"])
    assert "holds part of net.0.weight (parameter 4)" in named


# ------------------------------------------------------------------------------------------- the update
def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))


def _split_buckets(params: list[torch.Tensor]) -> list[FlatBucket]:
    """Params 0 (weight 4x5), 1 (bias 4), 2 (weight 3x4), 3 (bias 3); parameter 2 is split [0, 5) | [5, 12):
    bucket 0 = [p0, p1, p2[0:5]], bucket 1 = [p2[5:12], p3]."""
    return [FlatBucket.allocate(0, (0, 1, 2), params[:3], 2, ranges=[(0, 20), (0, 4), (0, 5)]),
            FlatBucket.allocate(1, (2, 3), params[2:], 2, ranges=[(5, 12), (0, 3)])]


def _fill(buckets: list[FlatBucket], grads: list[torch.Tensor]) -> None:
    for bk in buckets:
        for slot, i in enumerate(bk.param_indices):
            start, stop = bk.ranges[slot]
            bk.grad_view(slot).copy_(grads[i].reshape(-1)[start:stop].view_as(bk.grad_view(slot)))
        bk.flags.fill_(1)


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("clip", [None, "value", "norm"])
@pytest.mark.parametrize("order", ["forward", "backward"])
def test_split_parameter_stepped_once_equals_full_step(opt_name, clip, order):
    ref = _net()
    ours = copy.deepcopy(ref)
    make = OPTIMIZERS[opt_name]
    opt_ref, opt = make(list(ref.parameters())), make(list(ours.parameters()))
    params = list(ours.parameters())
    buckets = _split_buckets(params)
    landed: set[int] = set()  # (the buckets applied in this step: what the engine's bucket states say)
    upd = BucketOptimizer(opt, buckets, landed.__contains__)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):  # momentum / Adam moments carry over; the split parameter's tracking restarts
        grads = [torch.randn(p.shape, generator=gen) * (step + 1) for p in params]
        for p, g in zip(ref.parameters(), grads):
            p.grad = g.clone()
        if clip == "value":
            torch.nn.utils.clip_grad_value_(list(ref.parameters()), 0.5)
        elif clip == "norm":
            torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0)
        opt_ref.step()
        _fill(buckets, grads)
        request = None if clip is None else ClipRequest(0.5 if clip == "value" else 1.0, clip)
        # (the averaged gradients shaped like their parameters, in the optimizer's order, as clip_grad_norm_ sees)
        coef = clip_norm_coefficient([g.clone() for g in grads], 1.0) if clip == "norm" else None
        hp = snapshot_hparams(opt)
        split_before = params[2].detach().clone()
        first, second = (buckets[0], buckets[1]) if order == "forward" else (buckets[1], buckets[0])
        landed.clear()
        with torch.no_grad():
            upd.step(first, hp, request, coef)
            landed.add(first.index)
            # only the last of its buckets steps the split parameter; the first one's whole params moved
            assert torch.equal(params[2], split_before)
            upd.step(second, hp, request, coef)
        assert not torch.equal(params[2], split_before)
        for a, b in zip(ref.parameters(), ours.parameters()):
            assert torch.allclose(a, b, rtol=0, atol=1e-6), float((a - b).abs().max())
        assert all(p.grad is None for p in params)  # .grad restored
        # clipping happened in place in the buckets: written back, .grad shows the clipped gradients
        write_back_grads(buckets[0])
        write_back_grads(buckets[1])
        for a, b in zip(ref.parameters(), params):
            assert torch.allclose(a.grad, b.grad, rtol=0, atol=1e-6)
            b.grad = None
    if clip == "norm":
        assert coef < 1.0  # (the norm clip really scaled)


@pytest.mark.parametrize("keep", [True, False])
def test_split_parameter_unused_everywhere_keeps_ddp_rule(keep):
    """A split parameter unused on every rank: stepped with its own kept zero ``.grad`` (momentum and weight
    decay move it, as DDP's optimizer step does), not stepped when ``.grad`` is None."""
    ref = _net()
    ours = copy.deepcopy(ref)
    make = lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9, weight_decay=0.1)  # noqa: E731
    opt_ref, opt = make(list(ref.parameters())), make(list(ours.parameters()))
    params, ref_params = list(ours.parameters()), list(ref.parameters())
    buckets = _split_buckets(params)
    landed: set[int] = set()
    upd = BucketOptimizer(opt, buckets, landed.__contains__)
    gen = torch.Generator().manual_seed(2)
    after_step0 = None
    for step in range(2):  # step 0: all used (momentum buffers exist); step 1: parameter 2 unused everywhere
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        unused = step == 1
        if unused:
            grads[2] = torch.zeros_like(grads[2])  # (what finish_backward leaves in its slots)
        for i, (p, r) in enumerate(zip(params, ref_params)):
            if unused and i == 2:
                r.grad = torch.zeros_like(r) if keep else None
                p.grad = torch.zeros_like(p) if keep else None
            else:
                r.grad = grads[i].clamp(-0.3, 0.3)  # (the reference clips by value as Lightning would)
                p.grad = None
        _fill(buckets, grads)
        if unused:
            buckets[0].flags[2] = 0  # both pieces of parameter 2: no rank produced a gradient
            buckets[1].flags[0] = 0
        hp = snapshot_hparams(opt)
        landed.clear()
        with torch.no_grad():
            for bk in buckets:
                upd.step(bk, hp, ClipRequest(0.3, "value"), None)
                landed.add(bk.index)
        opt_ref.step()
        if step == 0:
            after_step0 = params[2].detach().clone()
    for a, b in zip(ref_params, params):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), float((a - b).abs().max())
    assert (params[2].grad is not None) == keep  # .grad itself left as it was
    assert torch.equal(params[2], after_step0) != keep  # moved by its kept zero grad only


def test_write_back_assembles_pieces_and_keeps_unused():
    params = [torch.nn.Parameter(torch.zeros(4, 5)), torch.nn.Parameter(torch.zeros(4)),
              torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(3))]
    buckets = _split_buckets(params)
    grads = [torch.arange(float(p.numel())).view_as(p) + 100 * i for i, p in enumerate(params)]
    _fill(buckets, grads)
    write_back_grads(buckets[0])
    # after the first bucket only its piece of parameter 2 is there (.grad allocated as zeros)
    assert params[2].grad.reshape(-1).tolist() == grads[2].reshape(-1)[:5].tolist() + [0.0] * 7
    write_back_grads(buckets[1])
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g)
    # a non-contiguous .grad (a transposed tensor user code put there) gets the pieces in row-major order
    params[2].grad = torch.zeros(4, 3).t()
    write_back_grads(buckets[0])
    write_back_grads(buckets[1])
    assert torch.equal(params[2].grad, grads[2])
    # unused on every rank: .grad kept as it was
    params[2].grad = torch.full((3, 4), 7.0)
    buckets[0].flags[2] = 0
    buckets[1].flags[0] = 0
    write_back_grads(buckets[0])
    write_back_grads(buckets[1])
    assert torch.equal(params[2].grad, torch.full((3, 4), 7.0))


def test_schedule_with_pieces_fits_the_engine_numels():
    sched = _schedules()["dear"]
    sched.validate(5, [240, 40, 120, 3, 5])
    with pytest.raises(ValueError, match="end at element 240; it has 241"):
        sched.validate(5, [241, 40, 120, 3, 5])


# ------------------------------------------------------------------------------------------- 2 gloo ranks
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))


#: parameter 0 (40x6 = 240) in 3 pieces, 1 (40) whole, 2 (3x40 = 120) in 2 pieces, 3 (3) whole, 4 (5, unused) whole
PIECES = ((0, 0, 50), (0, 50, 170), (0, 170, 240), (1, 0, 40), (2, 0, 70), (2, 70, 120), (3, 0, 3), (4, 0, 5))
BUCKETS = ((0,), (1,), (2, 3, 4), (5, 6, 7))


def _schedules() -> dict[str, Schedule]:
    return {"dear": Schedule(BUCKETS, dear_ops(4), "dear", pieces=PIECES),
            "allreduce": Schedule(BUCKETS, allreduce_ops(4), "allreduce", pieces=PIECES)}


def _batch(rank: int, k: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * k + rank))


def _make_opt(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.Adam(params, lr=1e-2)


#: rounds: the micro-batches each reduction round accumulates (the first over 2 backward passes)
ROUNDS = [[0, 1], [2]]


def _run(rank, world, sched_name, opt_name, clip):
    from lightning_pipedap.engine import collectives as C
    from lightning_pipedap.engine.engine import CommEngine

    comm = C.new_comm_group(timeout_s=30, chunk_bytes=64)
    model = _model()
    unused = torch.nn.Parameter(torch.full((5,), 0.5))  # never in the graph (weight decay moves it)
    params = list(model.parameters()) + [unused]
    schedule = _schedules()[sched_name]
    engine = CommEngine(comm, params, schedule, wait_timeout_s=30, bucket_view=True)
    opt = _make_opt(opt_name, params)
    landed: set[int] = set()
    upd = BucketOptimizer(opt, engine.buckets, landed.__contains__)
    index = {id(p): i for i, p in enumerate(params)}

    def hook(p):
        if engine.collecting:
            engine.grad_ready(index[id(p)], p.grad)
        else:
            engine.local_gradient(index[id(p)])

    hooks = [p.register_post_accumulate_grad_hook(hook) for p in params]
    out: dict = {"refusals": {str(k): v for k, v in engine.view_refusals.items()}, "split": engine.split,
                 "rounds": []}
    try:
        for k, batches in enumerate(ROUNDS):
            for p in params:
                p.grad = None if p is not unused else torch.zeros(5)  # (the unused one keeps a zero .grad)
            engine.attach_views()
            for j, b in enumerate(batches):
                if j == len(batches) - 1:
                    engine.begin_iteration()
                model(_batch(rank, b)).pow(2).sum().backward()
            engine.finish_backward()
            order = [0, 1, 2, 3] if k == 0 else [3, 2, 1, 0]  # apply order must not matter
            rnd: dict = {}
            used = {}
            for b in order:
                engine.wait_done(b)
                used[b] = engine.used_flags(b)
            grads = []
            for i, p in enumerate(params):
                pieces = [engine.buckets[b].grad_view(s).reshape(-1) for b, s, _, _ in engine.places[i]]
                grads.append(torch.cat(pieces).view_as(p).clone())
            rnd["grads"] = [g.tolist() for g in grads]
            rnd["used"] = [used[b] for b in range(4)]
            request, coef = None, None
            if clip:
                request, coef = ClipRequest(1.0, "norm"), clip_norm_coefficient(grads, 1.0)
                rnd["norm"] = float(torch.nn.utils.get_total_norm(grads))
            hp = snapshot_hparams(opt)
            landed.clear()
            with torch.no_grad():
                for b in order:
                    upd.step(engine.buckets[b], hp, request, coef, used[b])
                    landed.add(b)
                    write_back_grads(engine.buckets[b], used[b])
            rnd["params"] = [p.detach().clone().tolist() for p in params]
            rnd["written"] = [None if p.grad is None else p.grad.tolist() for p in params]
            out["rounds"].append(rnd)
        out["copies"] = engine.copies
    finally:
        for h in hooks:
            h.remove()
        engine.close()
    C.destroy_comm_group(comm)
    return out


def _local_grads(batches: list[int], rank: int) -> list[torch.Tensor]:
    m = _model()
    for b in batches:
        m(_batch(rank, b)).pow(2).sum().backward()
    return [p.grad.clone() for p in m.parameters()] + [torch.zeros(5)]


def _reference(opt_name: str, clip: bool) -> list[dict]:
    """Both ranks' averaged gradients computed locally, and a torch optimizer stepping on them."""
    m = _model()
    unused = torch.nn.Parameter(torch.full((5,), 0.5))
    params = list(m.parameters()) + [unused]
    opt = _make_opt(opt_name, params)
    out = []
    for batches in ROUNDS:
        # (the gradients of a round are taken at the round's weights: the reference model steps too)
        per_rank = []
        for r in range(2):
            for p in params:
                p.grad = None
            for b in batches:
                m(_batch(r, b)).pow(2).sum().backward()
            per_rank.append([torch.zeros(5) if p.grad is None else p.grad.clone() for p in params])
        avg = [(a + b) / 2 for a, b in zip(*per_rank)]
        for p, g in zip(params, avg):
            p.grad = g.clone()
        norm = None
        if clip:
            norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        opt.step()
        out.append({"grads": avg, "params": [p.detach().clone() for p in params],
                    "written": [p.grad.clone() for p in params], "norm": norm})
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("sched_name,opt_name,clip", [("dear", "sgd", False), ("allreduce", "adam", True)])
def test_split_parameters_reduce_and_step_like_ddp(sched_name, opt_name, clip):
    res = run_ranks(_run, 2, sched_name, opt_name, clip)
    ref = _reference(opt_name, clip)
    for rank in (0, 1):
        r = res[rank]
        assert r["split"] == {0: (0, 1, 2), 2: (2, 3)}
        # every bucket holds a piece of a split parameter: all keep the copy path, with the reason
        assert sorted(r["refusals"]) == ["0", "1", "2", "3"]
        assert "holds part of parameter 0" in r["refusals"]["0"] and "split over buckets 0, 1, 2" in r["refusals"]["0"]
        assert "holds part of parameter 2" in r["refusals"]["3"] and "split over buckets 2, 3" in r["refusals"]["3"]
        for k, (got, want) in enumerate(zip(r["rounds"], ref)):
            assert got["used"][3] == [True, True, False]  # the unused parameter: no rank produced a gradient
            assert got["used"][0] == [True] and got["used"][2] == [True, True, True]
            for i in range(5):
                g = torch.tensor(got["grads"][i])
                assert torch.allclose(g, want["grads"][i], rtol=0, atol=1e-6), (k, i)
                p = torch.tensor(got["params"][i])
                assert torch.allclose(p, want["params"][i], rtol=0, atol=1e-6), (k, i)
                w = torch.tensor(got["written"][i])
                assert torch.allclose(w, want["written"][i], rtol=0, atol=1e-6), (k, i)
            assert float(torch.tensor(got["grads"][0]).abs().max()) > 1e-3  # (real gradients, not zeros)
            if clip:
                assert got["norm"] == pytest.approx(want["norm"], rel=1e-6) and want["norm"] > 1.0
        # the split parameters moved (stepped once per round, not left out or stepped twice: values above)
        assert r["rounds"][0]["params"][0] != _model()[0].weight.tolist()
    assert res[0]["rounds"] == res[1]["rounds"]  # identical on every rank


# ------------------------------------------------------------------------------------------- deferred updates
#: 4 parameters: 0 (40x6) in 3 pieces over buckets 0, 1, 2; 2 (3x40) in 2 pieces over buckets 2, 3
DEFERRED_PIECES = PIECES[:7]
DEFERRED_BUCKETS = ((0,), (1,), (2, 3, 4), (5, 6))


def _run_deferred(rank, world):
    from lightning_pipedap.engine import collectives as C
    from lightning_pipedap.engine.engine import CommEngine
    from lightning_pipedap.strategy.deferred import UPDATE_PLACES, DeferredUpdates

    comm = C.new_comm_group(timeout_s=30, chunk_bytes=64)
    model = _model()
    params = list(model.parameters())
    engine = CommEngine(comm, params, Schedule(DEFERRED_BUCKETS, dear_ops(4), "dear", pieces=DEFERRED_PIECES),
                        wait_timeout_s=30)
    opt = _make_opt("sgd", params)
    counts = {k: 0 for k in UPDATE_PLACES}
    names = {id(p): n for n, p in model.named_parameters()}
    deferred = DeferredUpdates(engine, lambda p: names[id(p)], lambda k, m: None, [],
                               lambda: False, counts)
    deferred.set_owners([model[0], model[0], model[2], model[2]], model)
    index = {id(p): i for i, p in enumerate(params)}
    hooks = [p.register_post_accumulate_grad_hook(lambda p: engine.grad_ready(index[id(p)], p.grad)) for p in params]
    out: dict = {"buckets_of": deferred.buckets_of, "root": deferred.points.root,
                 "triggers": sorted(deferred.points.triggers.values())}
    try:
        before = [p.detach().clone() for p in params]
        engine.begin_iteration()
        model(_batch(rank, 0)).pow(2).sum().backward()
        engine.finish_backward()
        deferred.record(opt, ClipRequest(0.5, "value"), step=0)
        out["local_grad0"] = params[0].grad.tolist()
        # a read of parameter 2 (split over buckets 2, 3): both land; parameter 0 has a piece in bucket 2 but
        # its buckets 0 and 1 are still pending, so it is not stepped yet
        deferred.guarded_read(2)
        out["after_read2"] = {"remaining": deferred.remaining(), "guard": counts["guard"],
                              "p0_unchanged": torch.equal(params[0], before[0]),
                              "p2_changed": not torch.equal(params[2], before[2])}
        # a .grad read of parameter 0: its pending buckets land with their gradients written, and bucket 2
        # (applied above, not written yet) is written first: .grad is the whole averaged, clipped gradient
        deferred.guarded_read(0, grad_read=True)
        out["after_read0"] = {"pending": deferred.pending is not None, "guard": counts["guard"],
                              "grad0": params[0].grad.tolist()}
        out["params"] = [p.detach().tolist() for p in params]
    finally:
        for h in hooks:
            h.remove()
        engine.close()
    C.destroy_comm_group(comm)
    return out


@pytest.mark.multiprocess
def test_deferred_guard_applies_every_bucket_of_a_split_parameter():
    res = run_ranks(_run_deferred, 2)
    m = _model()
    params = list(m.parameters())
    opt = _make_opt("sgd", params)
    avg = [(a + b) / 2 for a, b in zip(_local_grads([0], 0)[:4], _local_grads([0], 1)[:4])]
    for p, g in zip(params, avg):
        p.grad = g.clamp(-0.5, 0.5)
    opt.step()
    for rank in (0, 1):
        r = res[rank]
        assert r["buckets_of"] == [(0, 1, 2), (2,), (2, 3), (3,)]
        assert r["root"] == [] and r["triggers"] == [[0, 1, 2], [3]]  # bucket 2 lands at the first Linear
        assert r["after_read2"] == {"remaining": [0, 1], "guard": 2, "p0_unchanged": True, "p2_changed": True}
        assert r["after_read0"]["pending"] is False and r["after_read0"]["guard"] == 4
        grad0 = torch.tensor(r["after_read0"]["grad0"])
        assert torch.allclose(grad0, params[0].grad, rtol=0, atol=1e-6)
        assert not torch.allclose(grad0, torch.tensor(r["local_grad0"]).clamp(-0.5, 0.5), rtol=0, atol=1e-3)
        for got, want in zip(r["params"], params):
            assert torch.allclose(torch.tensor(got), want, rtol=0, atol=1e-6)


def test_compression_layouts_name_pieces_and_add_up():
    """The compression pipeline is laid out over every bucket (``TrainableSet.layouts``): a piece is named
    ``name[start:stop]`` with a 1-D shape, so names stay unique and each bucket's shapes add up to its size."""
    from lightning_pipedap.compress.state import check_layouts
    from lightning_pipedap.strategy.params import TrainableSet

    model = _model()
    params = list(model.parameters())
    buckets = [FlatBucket.allocate(b, tuple(PIECES[u][0] for u in units), [params[PIECES[u][0]] for u in units], 2,
                                   [PIECES[u][1:] for u in units], units)
               for b, units in enumerate(DEFERRED_BUCKETS)]
    layouts = TrainableSet(model, 0).layouts(buckets)
    assert layouts == [[("0.weight[0:50]", (50,))], [("0.weight[50:170]", (120,))],
                       [("0.weight[170:240]", (70,)), ("0.bias", (40,)), ("2.weight[0:70]", (70,))],
                       [("2.weight[70:120]", (50,)), ("2.bias", (3,))]]
    assert len(check_layouts([b.numel for b in buckets], layouts)) == 4  # (raises on a size mismatch or a duplicate)


def _train_compressed_with_pieces(rank: int, world: int) -> dict:
    """Buckets 0 and 3 compressed (``none``, inline), the split parameter's two buckets dense, against DDP."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from lightning_pipedap.compress import CompressionPipeline
    from lightning_pipedap.engine import collectives as C
    from lightning_pipedap.engine.compressed import CompressedTransport
    from lightning_pipedap.engine.engine import CommEngine
    from lightning_pipedap.schedule import Op, OpKind

    RS, AG, AR = OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.ALL_REDUCE
    comm = C.new_comm_group(timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4))
    ref = DistributedDataParallel(copy.deepcopy(model))
    params = list(model.parameters())
    # parameter 2 (32x32) split [0, 500) | [500, 1024) over buckets 1 and 2 (the second fused with parameter 3)
    pieces = ((0, 0, 256), (1, 0, 32), (2, 0, 500), (2, 500, 1024), (3, 0, 32), (4, 0, 128), (5, 0, 4))
    schedule = Schedule(((0, 1), (2,), (3, 4), (5, 6)),
                        (Op(AR, 3), Op(RS, 2), Op(RS, 1), Op(AR, 0), Op(AG, 1), Op(AG, 2)),
                        "mixed", compressed=(True, False, False, True), pieces=pieces)

    def factory(buckets):
        pipe = CompressionPipeline([b.numel for b in buckets], "none", {}, threads=1, timeout_s=60, mode="inline")
        return CompressedTransport(pipe, comm)

    engine = CommEngine(comm, params, schedule, wait_timeout_s=60, transport_factory=factory)
    hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: engine.grad_ready(i, p.grad))
             for i, p in enumerate(params)]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    init = [p.detach().clone() for p in params]
    try:
        for _ in range(3):
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
            engine.begin_iteration()
            F.mse_loss(model(x), y).backward()
            engine.finish_backward()
            with torch.no_grad():
                for b in range(engine.num_buckets):
                    write_back_grads(engine.wait_done(b), engine.used_flags(b))
            opt.step()
            opt.zero_grad(set_to_none=True)
            F.mse_loss(ref(x), y).backward()
            opt_ref.step()
            opt_ref.zero_grad(set_to_none=True)
        engine.wait_idle()
        compressed = sorted(engine.transport.stats)
    finally:
        for h in hooks:
            h.remove()
        engine.close()
    return {"diff": max((a - b).abs().max().item() for a, b in zip(params, ref.module.parameters())),
            "moved": max((a - b).abs().max().item() for a, b in zip(params, init)), "compressed": compressed}


@pytest.mark.multiprocess
def test_compressed_buckets_next_to_a_split_parameter_match_ddp():
    res = run_ranks(_train_compressed_with_pieces, 2)
    for rank in (0, 1):
        assert res[rank]["compressed"] == [0, 3]
        assert res[rank]["moved"] > 1e-3
        assert res[rank]["diff"] <= 1e-6, res[rank]


def test_nonfinite_scan_names_the_split_parameter():
    from lightning_pipedap.strategy.numerics import first_nonfinite

    params = [torch.nn.Parameter(torch.zeros(4, 5)), torch.nn.Parameter(torch.zeros(4)),
              torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(3))]
    buckets = _split_buckets(params)
    _fill(buckets, [torch.ones_like(p) for p in params])
    buckets[1].grad_view(0)[3] = float("nan")  # element 8 of parameter 2 (its second piece)
    names = {id(p): n for p, n in zip(params, ("w1", "b1", "w2", "b2"))}
    found = first_nonfinite(buckets, lambda p: names[id(p)], step=3)
    assert (found.bucket, found.name, found.nan, found.inf, found.numel) == (1, "w2", 1, 0, 7)
