"""Memory of the sharded optimizer step (``shard_optimizer``, issue 30): what a sharded engine must not keep alive.

At 2 gloo ranks, one sharded round of a small model, then:

- the kept averaged-gradient shards are views of ``.grad``; once Lightning sets ``.grad`` to None the views alone
  would keep every old gradient alive next to the ones the next backward allocates (one gradient's worth of memory
  per rank): :meth:`ShardedStep.drop_kept` (called by ``DeferredUpdates.forget_unwritten`` before each backward)
  lets them go;
- a closed sharded engine is freed by reference counting alone (no cycle engine -> sharded step -> engine that only
  the cyclic garbage collector, at a time of its choosing, would free: the start-up closes several engines, each
  holding a copy of the gradients in its buckets);
- a closed engine kept for its sharded optimizer state (the next engine adopts it) has released its buckets'
  buffers before the next engine allocates its own (:meth:`ShardedStep.release_buffers`), and the state still
  moves whole.
"""

from __future__ import annotations

import gc
import weakref

import torch

from tests._dist_util import run_ranks


def _one_round(rank: int) -> tuple:
    """``(comm, params, opt, engine)`` after one sharded round of Adam on three parameters (two buckets)."""
    from lightning_pipedap.engine import collectives as C
    from lightning_pipedap.engine import shard_step as SS
    from lightning_pipedap.engine.engine import CommEngine
    from lightning_pipedap.engine.update import snapshot_hparams
    from lightning_pipedap.schedule import Schedule, dear_ops

    comm = C.new_comm_group(timeout_s=30, chunk_bytes=64)
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(9, 7, generator=g)), torch.nn.Parameter(torch.randn(13, generator=g)),
              torch.nn.Parameter(torch.randn(4, 5, generator=g))]
    opt = torch.optim.Adam(params, lr=1e-2)
    engine = CommEngine(comm, params, Schedule(((0,), (1, 2)), dear_ops(2), "dear"), wait_timeout_s=30, shard=True)
    for p in params:  # (as after a first backward: the kept shards are views of these)
        p.grad = torch.zeros_like(p)
    engine.shard.armed = True
    engine.begin_iteration()
    engine.shard.armed = False
    for i, p in enumerate(params):
        engine.grad_ready(i, torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * rank + i)))
    engine.finish_backward()
    engine.shard.go(opt, snapshot_hparams(opt), None, None)
    with torch.no_grad():
        for b in range(engine.num_buckets):
            SS.land_params(engine.wait_done(b))
            engine.syncs[b].land()
    engine.wait_idle()
    return comm, params, opt, engine


def _rank(rank: int, world: int) -> dict:
    from lightning_pipedap.engine import collectives as C

    comm, params, opt, engine = _one_round(rank)
    out = {"kept": len(engine.shard.keep)}
    # (weak references to the gradients' storages: torch's own, as its multiprocessing uses them; a view of a
    # storage keeps it alive whatever became of the tensor it was taken from)
    old = [p.grad.untyped_storage()._weak_ref() for p in params]
    for p in params:  # (Lightning's zero_grad(set_to_none=True))
        p.grad = None
    out["pinned_before_drop"] = sum(not torch.UntypedStorage._expired(w) for w in old)
    engine.shard.drop_kept(range(engine.num_buckets))
    out["pinned_after_drop"] = sum(not torch.UntypedStorage._expired(w) for w in old)
    for w in old:
        torch.UntypedStorage._free_weak_ref(w)
    engine.shard.consolidate()
    engine.close()
    gc.collect()
    gc.disable()  # (from here on only reference counting frees)
    try:
        ref, buffers = weakref.ref(engine), [weakref.ref(b.buffer) for b in engine.buckets]
        del engine
        out["engine_alive"] = ref() is not None
        out["buffers_alive"] = sum(r() is not None for r in buffers)
    finally:
        gc.enable()
    C.destroy_comm_group(comm)
    return out


def test_a_sharded_engine_keeps_no_old_gradient_and_no_closed_engine_alive():
    out = run_ranks(_rank, 2, timeout_s=120)
    for rank, o in out.items():
        assert o["kept"] > 0, (rank, o)  # (this rank kept gradient shards, as views of .grad)
        assert o["pinned_before_drop"] > 0, (rank, o)  # (the views alone kept the old gradients alive)
        assert o["pinned_after_drop"] == 0, (rank, o)
        assert not o["engine_alive"] and o["buffers_alive"] == 0, (rank, o)


def _rank_adopt(rank: int, world: int) -> dict:
    from lightning_pipedap.engine import collectives as C
    from lightning_pipedap.engine.engine import CommEngine
    from lightning_pipedap.schedule import Schedule, dear_ops

    comm, params, opt, engine = _one_round(rank)
    out = {}
    # the same layout (the state changes hands: ShardedOptimizer.move), then another one (moved by all-gathers of
    # the old layout: ShardedOptimizer.transfer)
    for name, schedule in (("same", Schedule(((0,), (1, 2)), dear_ops(2), "dear")),
                           ("other", Schedule(((0, 1, 2),), dear_ops(1), "dear"))):
        before = engine.shard.sharded_of(opt).gather_state(comm, engine.buckets)
        old = engine.shard
        storages = [b.buffer.untyped_storage()._weak_ref() for b in engine.buckets]
        engine.close()
        old.release_buffers()  # (EngineSlot.close_engine(keep_shards=True), before the next engine is built)
        alive = sum(not torch.UntypedStorage._expired(w) for w in storages)
        for w in storages:
            torch.UntypedStorage._free_weak_ref(w)
        engine = CommEngine(comm, params, schedule, wait_timeout_s=30, shard=True)
        engine.shard.adopt(old)
        after = engine.shard.sharded_of(opt).gather_state(comm, engine.buckets)
        same = sorted(map(id, before)) == sorted(map(id, after)) and all(
            torch.equal(torch.as_tensor(v), torch.as_tensor(after[p][k])) for p, st in before.items()
            for k, v in st.items())
        out[name] = {"buffers_alive": alive, "kept": len(old.keep), "same_state": same,
                     "moved": engine.shard.sharded_of(opt).absorbed and not old.sharded_of(opt).absorbed}
    engine.shard.consolidate()
    engine.close()
    C.destroy_comm_group(comm)
    return out


def test_a_closed_engine_kept_for_its_sharded_state_releases_its_buffers_and_still_moves_the_state():
    out = run_ranks(_rank_adopt, 2, timeout_s=120)
    for rank, o in out.items():
        for layout in ("same", "other"):
            r = o[layout]
            assert r["buffers_alive"] == 0 and r["kept"] == 0, (rank, layout, r)
            assert r["moved"] and r["same_state"], (rank, layout, r)
