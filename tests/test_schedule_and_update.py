"""Single-process tests: schedule data, tensor fusion, per-bucket optimizer steps, clipping math."""

import copy

import pytest
import torch

from lightning_pipedap.engine.buckets import FlatBucket
from lightning_pipedap.engine.update import (
    BucketOptimizer,
    ClipRequest,
    clip_norm_coefficient,
    snapshot_hparams,
    write_back_grads,
)
from lightning_pipedap.schedule import Op, OpKind, Schedule, builtin_schedule, dear_ops, fuse_by_size


def NO_SPLIT(b: int) -> bool:  # noqa: N802  (BucketOptimizer's ``landed``: asked only for a split parameter's buckets)
    raise AssertionError(f"landed({b}) asked, but no parameter is split")


def test_fuse_by_size_greedy_and_oversized():
    # caps at 10 bytes: [4,4] fit, 8 starts a new bucket, 100 is alone
    assert fuse_by_size([4, 4, 8, 100, 1], 10) == ((0, 1), (2,), (3,), (4,))
    # a key change (dtype) also starts a bucket
    assert fuse_by_size([1, 1, 1], 10, keys=["f", "f", "h"]) == ((0, 1), (2,))
    with pytest.raises(ValueError, match="positive"):
        fuse_by_size([1], 0)


def test_builtin_schedules_and_validation():
    s = builtin_schedule("dear", [4, 4, 8], 8)
    assert s.describe() == "dear: 2 buckets: RS1 RS0 AG0 AG1"
    assert builtin_schedule("allreduce", [4, 4, 8], 8).describe() == "allreduce: 2 buckets: AR1 AR0"
    with pytest.raises(ValueError, match="valid: 'allreduce', 'dear'"):
        builtin_schedule("fastest", [1], 8)
    with pytest.raises(ValueError, match="AG0 is not valid after nothing"):
        Schedule(((0,),), (Op(OpKind.ALL_GATHER, 0),)).validate(1)
    with pytest.raises(ValueError, match="never fully reduced"):
        Schedule(((0,),), (Op(OpKind.REDUCE_SCATTER, 0),)).validate(1)
    with pytest.raises(ValueError, match="partition"):
        Schedule(((0,),), dear_ops(1)).validate(2)
    with pytest.raises(ValueError, match="more than one bucket"):
        Schedule(((0,), (0,)), dear_ops(2)).validate()


def test_flat_bucket_layout_padding_and_shards():
    params = [torch.zeros(3), torch.zeros(2, 2)]
    b = FlatBucket.allocate(0, (0, 1), params, world_size=3)
    # 7 gradient elements + 2 flags = 9 -> 3 per rank, no padding needed
    assert (b.numel, b.shard_size, b.buffer.numel()) == (7, 3, 9)
    assert b.own_data_range(2) == (6, 7)  # rank 2's shard holds one gradient element, then flags
    b.grad_view(1).fill_(2.0)
    assert b.buffer[3:7].tolist() == [2.0] * 4
    b2 = FlatBucket.allocate(1, (0,), [torch.zeros(4)], world_size=4)
    assert b2.buffer.numel() == 8  # 4 + 1 flag -> padded to 8


def _model_and_grads(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    grads = [torch.randn_like(p) for p in m.parameters()]
    return m, grads


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
        lambda ps: torch.optim.AdamW(
            [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "lr": 1e-2, "weight_decay": 0.0}], lr=1e-3
        ),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    ],
)
def test_bucket_steps_equal_one_full_step(make_opt):
    ref, grads = _model_and_grads()
    ours = copy.deepcopy(ref)
    opt_ref, opt = make_opt(list(ref.parameters())), make_opt(list(ours.parameters()))
    params = list(ours.parameters())
    buckets = [FlatBucket.allocate(0, (0, 1), params[:2], 2), FlatBucket.allocate(1, (2, 3), params[2:], 2)]
    for step in range(3):  # several steps: optimizer state (momentum, Adam moments) must carry over
        for p, g in zip(ref.parameters(), grads):
            p.grad = g.clone() * (step + 1)
        opt_ref.step()
        hp = snapshot_hparams(opt)
        upd = BucketOptimizer(opt, buckets, NO_SPLIT)
        for b in buckets:
            for slot, p in enumerate(b.params):
                b.grad_view(slot).copy_(grads[b.param_indices[slot]] * (step + 1))
            b.flags.fill_(1)
        with torch.no_grad():
            for b in reversed(buckets):
                upd.step(b, hp, None, None)
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(a, b)


def test_bucket_step_uses_snapshot_hparams_and_skips_unused():
    m, grads = _model_and_grads()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    params = list(m.parameters())
    bucket = FlatBucket.allocate(0, (0, 1, 2, 3), params, 2)
    for slot in range(4):
        bucket.grad_view(slot).fill_(1.0)
    bucket.flags.copy_(torch.tensor([1.0, 0.0, 2.0, 1.0]))  # param 1 unused on every rank
    hp = snapshot_hparams(opt)
    opt.param_groups[0]["lr"] = 99.0  # a scheduler stepping after the snapshot must not leak in
    before = [p.detach().clone() for p in params]
    with torch.no_grad():
        BucketOptimizer(opt, [bucket], NO_SPLIT).step(bucket, hp, None, None)
    assert torch.allclose(params[0], before[0] - 0.5)
    assert torch.equal(params[1], before[1])  # no gradient anywhere: untouched
    assert all(p.grad is None for p in params)  # .grad restored afterwards


def test_bucket_step_steps_unused_param_with_kept_zero_grad_as_ddp():
    """``zero_grad(set_to_none=False)``: a parameter unused on every rank keeps a zero ``.grad``; DDP leaves it
    untouched and SGD with momentum and weight decay still moves the parameter. A None ``.grad`` is skipped."""
    for keep in (True, False):
        m, _ = _model_and_grads()
        ref = copy.deepcopy(m)
        opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
        params, ref_params = list(m.parameters()), list(ref.parameters())
        bucket = FlatBucket.allocate(0, (0, 1, 2, 3), params, 2)
        upd = BucketOptimizer(opt, [bucket], NO_SPLIT)
        after_step0 = None
        for step in range(2):  # step 0: every parameter used (momentum buffers exist); step 1: param 1 unused
            for slot, (p, r) in enumerate(zip(params, ref_params)):
                unused = step == 1 and slot == 1
                bucket.grad_view(slot).fill_(0.0 if unused else 1.0 + slot)
                r.grad = (torch.zeros_like(r) if keep else None) if unused else bucket.grad_view(slot).clone()
                p.grad = (torch.zeros_like(p) if keep else None) if unused else None
            bucket.flags.copy_(torch.tensor([1.0, 0.0 if step == 1 else 1.0, 1.0, 1.0]))
            with torch.no_grad():
                upd.step(bucket, snapshot_hparams(opt), None, None)
            ref_opt.step()
            after_step0 = params[1].detach().clone() if step == 0 else after_step0
        for p, r in zip(params, ref_params):
            assert torch.equal(p, r)
        assert (params[1].grad is not None) == keep  # .grad itself left as it was
        assert torch.equal(params[1], after_step0) != keep  # stepped with its zero grad only when kept


def test_clip_norm_coefficient_is_bit_identical_to_clip_grad_norm():
    """The factor is torch's own (per-tensor fp32 norms in order, stacked, 2-norm, max/(n+1e-6), clamp): over
    random gradients of mixed shapes and scales, multiplying by it gives exactly what ``clip_grad_norm_`` leaves
    in ``.grad`` (the earlier float64 sum of squares over shards differed by 1 ulp in the factor on some)."""
    gen = torch.Generator().manual_seed(0)
    old_style_differs = 0
    for trial in range(200):
        shapes = [(int(torch.randint(1, 40, (1,), generator=gen)),) * (1 + trial % 2) for _ in range(1 + trial % 7)]
        grads = [torch.randn(s, generator=gen) * float(10 ** torch.randint(-3, 3, (1,), generator=gen)) for s in shapes]
        ref = [torch.zeros(s, requires_grad=True) for s in shapes]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(ref, 0.5)
        coef = clip_norm_coefficient([g.clone() for g in grads], 0.5)
        for r, g in zip(ref, grads):
            assert torch.equal(r.grad, g * coef), trial
        total64 = float(sum(g.double().pow(2).sum() for g in grads)) ** 0.5
        old = min(1.0, 0.5 / (total64 + 1e-6))
        old_style_differs += any(not torch.equal(r.grad, g * old) for r, g in zip(ref, grads))
    assert old_style_differs > 0  # (the reason for computing it torch's way)
    assert clip_norm_coefficient([], 1.0) is None  # torch clips nothing
    p = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    b = FlatBucket.allocate(0, (0, 1), p, world_size=2)
    b.buffer[:5] = torch.tensor([3.0, 4.0, 1.0, 2.0, 2.0])
    ref = [torch.tensor([3.0, 4.0, 1.0]).requires_grad_(), torch.tensor([2.0, 2.0]).requires_grad_()]
    for r in ref:
        r.grad = r.detach().clone()
    torch.nn.utils.clip_grad_norm_(ref, 1.0)
    opt = torch.optim.SGD(p, lr=1.0)
    b.flags.fill_(1)
    coef = clip_norm_coefficient([b.grad_view(0).clone(), b.grad_view(1).clone()], 1.0)
    with torch.no_grad():
        BucketOptimizer(opt, [b], NO_SPLIT).step(b, snapshot_hparams(opt), ClipRequest(1.0, "norm"), coef)
    got = torch.cat([-q.detach().reshape(-1) for g in opt.param_groups for q in g["params"]])
    assert torch.equal(got, torch.cat([r.grad for r in ref]))


def test_write_back_keeps_globally_unused_grad():
    p = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    p[1].grad = torch.full((2,), 7.0)
    b = FlatBucket.allocate(0, (0, 1), p, world_size=1)
    b.buffer[:4] = torch.tensor([1.0, 2.0, 0.0, 0.0])
    b.flags.copy_(torch.tensor([1.0, 0.0]))
    write_back_grads(b)
    assert p[0].grad.tolist() == [1.0, 2.0]
    assert p[1].grad.tolist() == [7.0, 7.0]
