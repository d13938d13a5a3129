"""Exact search of the ``optimal`` planner (its stage 5): branch and bound over op lists, per fusion.

Depth-first over op lists (every op kind of every unfinished bucket at every step), pruned by

* a lower bound: each unfinished bucket's earliest possible completion fed through the next forward,
  and, on one channel, all remaining work after the channel's free time followed by the shortest
  forward tail;
* dominance between partial op lists with the same ops done (channel free times and completion
  times all no later).

A compressed bucket is reduced by one channel op, so it is only tried as an AR. With the node budget
not exhausted, the result is optimal over the given fusions (and compression flags), modes and orders.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator, Sequence

from lightning_pipedap.plan.compression import CompressionCost
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.evaluator import Evaluator
from lightning_pipedap.plan.planners._common import AG, AR, RS, TOL, Starts, buckets_of, dear_codes, evaluator
from lightning_pipedap.plan.profile import ModelProfile
from lightning_pipedap.plan.sharding import ShardingArg

__all__ = ["all_contiguous_fusions", "branch_and_bound", "exact_compressed_search", "exact_search",
           "exact_sharded_search"]


class _BnB:
    """Depth-first branch and bound over op lists for one evaluator (fusion and flags; module docstring)."""

    def __init__(self, ev: Evaluator, node_budget: int) -> None:
        self.ev = ev
        self.B = ev.B
        self.cost, self.ready = ev.cost, ev.ready
        self.two = ev.channels == 2
        self.steps = ev.fast_steps
        self.minred = [min(ev.cost[3 * b + AR], ev.cost[3 * b + RS] + ev.cost[3 * b + AG]) for b in range(ev.B)]
        tail = 0.0
        self.tailf = [0.0] * ev.B
        for b, d in reversed(self.steps):
            tail += d
            self.tailf[b] = tail
        self.nodes = 0
        self.node_budget = node_budget
        self.aborted = False
        self.memo: dict[tuple[int, ...], list[tuple[float, ...]]] = {}

    def bound(self, status: list[int], done: list[float], rs_end: list[float], free: list[float]) -> float:
        cost = self.cost
        f0 = free[0]
        fa = free[1] if self.two else f0
        cur = self.ev.t_backward
        rem = 0.0
        tmin = math.inf
        for b, d in self.steps:
            s = status[b]
            if s == 2:
                x = done[b]
            elif s == 1:
                r = rs_end[b]
                x = (fa if fa > r else r) + cost[3 * b + AG]
                rem += cost[3 * b + AG]
                tmin = self.tailf[b] if self.tailf[b] < tmin else tmin
            else:
                r = self.ready[b]
                x = (f0 if f0 > r else r) + self.minred[b]
                rem += self.minred[b]
                tmin = self.tailf[b] if self.tailf[b] < tmin else tmin
            if x > cur:
                cur = x
            cur += d
        if not self.two and rem > 0.0:
            lb2 = f0 + rem + tmin
            if lb2 > cur:
                return lb2
        return cur

    def _dominated(self, status: list[int], done: list[float], rs_end: list[float], free: list[float]) -> bool:
        key = tuple(status)
        vec = (free[0], free[1]) + tuple(done[b] if status[b] == 2
                                         else (rs_end[b] if self.two and status[b] == 1 else 0.0)
                                         for b in range(self.B))
        lst = self.memo.setdefault(key, [])
        for v in lst:
            if all(a <= c for a, c in zip(v, vec)):
                return True
        lst[:] = [v for v in lst if not all(c <= a for a, c in zip(v, vec))]
        lst.append(vec)
        return False

    def search(self, best: float) -> tuple[float, list[int] | None]:
        B = self.B
        status = [0] * B
        done = [0.0] * B
        rs_end = [0.0] * B
        free = [0.0, 0.0]
        seq: list[int] = []
        found: list[list[int] | None] = [None]
        best_box = [best]
        cost, ready, chan = self.cost, self.ready, self.ev.chan
        order = list(range(B - 1, -1, -1))
        compressed = self.ev.compressed  # a compressed bucket is reduced by one channel op: AR only

        def rec(left: int) -> None:
            if self.aborted:
                return
            self.nodes += 1
            if self.nodes > self.node_budget:
                self.aborted = True
                return
            lb = self.bound(status, done, rs_end, free)
            if lb >= best_box[0] * (1 - TOL):
                return
            if left == 0:
                best_box[0] = lb
                found[0] = list(seq)
                return
            if self._dominated(status, done, rs_end, free):
                return
            for b in order:
                s = status[b]
                if s == 1:
                    kinds = (AG,)
                elif s == 0 and compressed[b]:
                    kinds = (AR,)
                elif s == 0:
                    kinds = (AR, RS) if cost[3 * b + AR] <= cost[3 * b + RS] + cost[3 * b + AG] else (RS, AR)
                else:
                    continue
                for k in kinds:
                    c = 3 * b + k
                    ch = chan[c]
                    dep = rs_end[b] if k == AG else ready[b]
                    f_old = free[ch]
                    e = (f_old if f_old > dep else dep) + cost[c]
                    old = (status[b], done[b], rs_end[b])
                    free[ch] = e
                    if k == RS:
                        status[b], rs_end[b] = 1, e
                        new_left = left
                    else:
                        status[b], done[b] = 2, e
                        new_left = left - 1
                    seq.append(c)
                    rec(new_left)
                    seq.pop()
                    free[ch] = f_old
                    status[b], done[b], rs_end[b] = old

        rec(B)  # left = number of buckets not yet fully reduced
        return best_box[0], found[0]


def all_contiguous_fusions(L: int) -> Iterator[Starts]:
    """Every contiguous fusion of ``L`` layers (``2^(L-1)``), as bucket start layers."""
    for mask in range(1 << (L - 1)):
        yield (0,) + tuple(i for i in range(1, L) if (mask >> (i - 1)) & 1)


def branch_and_bound(evaluators: Iterable[Evaluator], upper: float,
                     node_budget: int) -> tuple[float, Evaluator | None, list[int] | None, bool]:
    """Stage 5 on each evaluator in turn (its fusion and compression flags), sharing one node budget;
    each search is bounded by the best found so far (initially ``upper``).

    Returns ``(best s, evaluator, codes, complete)``: ``evaluator`` and ``codes`` are ``None`` when
    nothing beat ``upper``; ``complete`` is False when the node budget ran out (the result is then
    the best found, not a proof of optimality; later evaluators are not built).
    """
    best, best_ev, best_codes = upper, None, None
    nodes = 0
    for ev in evaluators:
        bnb = _BnB(ev, node_budget - nodes)
        p, codes = bnb.search(best)
        nodes += bnb.nodes
        if codes is not None and p < best:
            best, best_ev, best_codes = p, ev, codes
        if bnb.aborted:
            return best, best_ev, best_codes, False
    return best, best_ev, best_codes, True


def exact_search(profile: ModelProfile, cost_model: CostModel, channels: int, upper: float,
                 node_budget: int) -> tuple[float, Evaluator | None, list[int] | None, bool]:
    """Stage 5 over every contiguous fusion. Returns ``(best s, evaluator, codes, complete)`` as
    :func:`branch_and_bound`."""
    L = profile.num_layers
    return branch_and_bound((Evaluator(profile, cost_model, buckets_of(st, L), channels)
                             for st in all_contiguous_fusions(L)), upper, node_budget)


def exact_compressed_search(profile: ModelProfile, cost_model: CostModel, channels: int, world_size: int,
                            compression: CompressionCost, fusions: Sequence[Starts] | None, upper: float,
                            node_budget: int) -> tuple[float, Evaluator | None, list[int] | None, bool]:
    """Stage 5 with compression: branch and bound for every fusion (``None``: every contiguous one)
    and every flag vector with at least one compressed bucket.

    Returns ``(best s, evaluator, codes, complete)`` as :func:`branch_and_bound`.
    """
    L = profile.num_layers
    evaluators = (evaluator(profile, cost_model, buckets_of(starts, L), channels, world_size, compression,
                            tuple(bool((fm >> b) & 1) for b in range(len(starts))))
                  for starts in (all_contiguous_fusions(L) if fusions is None else fusions)
                  for fm in range(1, 1 << len(starts)))
    return branch_and_bound(evaluators, upper, node_budget)


def exact_sharded_search(profile: ModelProfile, cost_model: CostModel, channels: int, world_size: int | None,
                         sharded: ShardingArg, fusions: Sequence[Starts] | None,
                         upper: float) -> tuple[float, Evaluator | None, list[int] | None, bool]:
    """Stage 5 for the sharded model without compression: every fusion (``None``: every contiguous one) with
    reduce-scatters in backward order, the optimal op list of a fusion whose buckets are all sharded (the
    all-gathers follow every gradient op in forward order, so only the end of the last reduce-scatter matters,
    and earliest-ready-first minimises it). Returns ``(best s, evaluator, codes, True)`` as
    :func:`branch_and_bound` (no node budget: one evaluation per fusion)."""
    L = profile.num_layers
    best, best_ev, best_codes = upper, None, None
    for starts in (all_contiguous_fusions(L) if fusions is None else fusions):
        ev = evaluator(profile, cost_model, buckets_of(starts, L), channels, world_size, sharded=sharded)
        codes = dear_codes(ev)
        p = ev.period_codes(codes)
        if p < best * (1 - TOL):
            best, best_ev, best_codes = p, ev, codes
    return best, best_ev, best_codes, True
