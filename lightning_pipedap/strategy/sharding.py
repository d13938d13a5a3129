"""The Lightning strategy's glue for ``shard_optimizer`` (issue 30; the step itself:
:mod:`lightning_pipedap.engine.shard_step`): which mode applies to the fit (:func:`resolve_shard_mode`), parameter
ownership for whole-tensor optimizers (:func:`use_ownership`, :func:`owner_costs`, :func:`ownership_summary`) and a
sync-mode optimizer step that stays sharded (:func:`sharded_sync`)."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Optional

import lightning_pipedap.engine.collectives as C
import lightning_pipedap.strategy.messages as M
from lightning_pipedap import compat
from lightning_pipedap.engine.shard_step import WHOLE_TENSOR_OPTIMIZERS
from lightning_pipedap.strategy.refusals import refuse_unshardable

__all__ = ["owner_costs", "ownership_summary", "resolve_shard_mode", "sharded_sync", "use_ownership"]


def resolve_shard_mode(strategy: Any) -> None:
    """Set-up of a fit with ``shard_optimizer`` True or ``"auto"`` (``strategy``: the
    :class:`~lightning_pipedap.strategy.lightning.PipeDAPStrategy`, its optimizers built): refuse what cannot be
    sharded (True) or run unsharded, saying why (``"auto"``; also with a fixed schedule or a timing-free start-up,
    where nothing is measured to choose by); with a whole-tensor optimizer, parameter ownership.

    Raises:
        ValueError: ``shard_optimizer=True`` and :func:`~lightning_pipedap.strategy.refusals.refuse_unshardable`
            refuses the fit (its message).
    """
    rt, cfg, optimizers = strategy._rt, strategy.config, strategy.optimizers
    try:
        refuse_unshardable(optimizers, getattr(strategy.precision_plugin, "scaler", None))
        if cfg.shard_optimizer == "auto" and (not cfg.planned or rt.timing_free):
            raise ValueError("shard_optimizer='auto' chooses by measured plan selection, which "
                             + (f"schedule={cfg.schedule!r} does not run" if not cfg.planned else
                                f"does not run here ({rt.timing_free})"))
    except ValueError as exc:
        if cfg.shard_optimizer is True:
            raise
        rt.slot.shard_mode = False
        M.info(f"pipedap: shard_optimizer='auto': every candidate unsharded: {exc}")
        return
    if any(isinstance(o, WHOLE_TENSOR_OPTIMIZERS) for o in optimizers):  # (each parameter stepped whole by one rank)
        use_ownership(rt.slot, owner_costs(rt, optimizers))


def owner_costs(rt: Any, optimizers: list) -> Optional[dict[int, float]]:
    """``id(parameter) -> seconds`` of each trainable parameter's optimizer step (``rt``: the run-time), measured on
    rank 0 (:func:`~lightning_pipedap.probe.optimizer_time.optimizer_step_times`) and broadcast, so every rank lays
    the buckets out alike; None (owners balanced by elements) with a fixed schedule or under
    ``Trainer(deterministic=True)`` (``rt.timing_free``), where the layout must not depend on timing: at 3+ ranks it
    sets the order of the sums, and so the bits."""
    from lightning_pipedap.probe.optimizer_time import optimizer_step_times  # noqa: PLC0415

    cfg = rt.ctx.config
    if rt.timing_free or not cfg.planned:  # (a fixed schedule's layout, and so its bits, must not depend on timing)
        why = rt.timing_free or f"schedule={cfg.schedule!r} is fixed: identical runs give identical bits"
        rt.ctx.info(f"pipedap: shard_optimizer: parameter owners balanced by elements, not by measured optimizer "
                    f"time ({why})")
        return None
    params = list(rt.params)
    t0 = time.perf_counter()
    times = optimizer_step_times(optimizers, params) if rt.ctx.rank == 0 else None
    times = C.broadcast_object(times, what="the parameters' optimizer step times")
    rt.ctx.info(f"pipedap: shard_optimizer: parameter owners balanced by each parameter's measured optimizer step "
                f"({sum(times) * 1e3:.1f} ms per step in all, measured in {time.perf_counter() - t0:.2f} s)")
    return {id(p): t for p, t in zip(params, times)}


def use_ownership(slot: Any, costs: Optional[dict[int, float]] = None) -> None:
    """A whole-tensor optimizer (known once the optimizers exist, after the warm-up engine was built): every later
    engine of ``slot`` (the :class:`~lightning_pipedap.strategy.engine_slot.EngineSlot`) lays its buckets out by
    parameter ownership, and the installed one, which has not stepped yet, is built again so. ``costs``:
    ``id(parameter) -> seconds`` of its optimizer step (the same on every rank) to balance, else elements."""
    if slot.shard_owned:
        return
    slot.shard_owned, slot.owner_costs = True, costs
    if slot.engine is not None and slot.installed is not None:
        slot.install(*slot.installed)


def ownership_summary(engine: Any, costs: Optional[dict[int, float]]) -> str:
    """One line on ``engine``'s parameter-ownership layout: per rank its parameters (and measured step ms), and the
    padding the layout adds to the sharded buckets' elements on the wire."""
    n = engine.comm.world_size
    count, ms = [0] * n, [0.0] * n
    data = padded = 0
    for b in engine.buckets:
        if not b.owners:
            continue
        padded += b.buffer.numel()
        for slot, p in enumerate(b.params):
            r = b.owners[slot]
            count[r] += 1
            data += p.numel()
            ms[r] += 1e3 * (costs or {}).get(id(p), 0.0)
    ranks = ", ".join(f"rank {r}: {count[r]}" + (f" ({ms[r]:.1f} ms)" if costs else "") for r in range(n))
    pad = 100.0 * (padded - data) / padded if padded else 0.0
    return (f"parameters stepped whole by their owners ({ranks}); the shards end at parameter boundaries, "
            f"padding {pad:.1f}% of the sharded buckets' elements (sent in the reduce-scatter and the all-gather)")


@contextlib.contextmanager
def sharded_sync(slot: Any, optimizer: Any) -> Iterator[None]:
    """Inside the block (a sync-mode optimizer step with ``shard_optimizer``), ``optimizer.step(closure)`` runs
    the closure (forward, backward, hooks, clipping), then the installed engine's
    :meth:`~lightning_pipedap.engine.shard_step.ShardedStep.sync_step` after its round; without a sharded engine
    (DDP's reducer, an unsharded candidate) the optimizer's own step. ``step`` is replaced on the instance for the
    block and restored after."""
    original = optimizer.step
    saved = optimizer.__dict__.get("step")

    def step(closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        result = closure() if closure is not None else None
        engine = slot.engine
        if engine is not None and engine.shard is not None:
            engine.wait_idle()
            engine.shard.sync_step(optimizer)
            compat.mark_optimizer_stepped(optimizer)  # (what the scheduler's wrapper of the replaced step sets)
        else:
            original(**kwargs)
        return result

    optimizer.step = step
    try:
        yield
    finally:
        if saved is not None:
            optimizer.step = saved
        else:
            optimizer.__dict__.pop("step", None)
