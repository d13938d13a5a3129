"""``optimal``: search over contiguous tensor fusion, op order and op mode (AR or RS + AG).

The simulator (:class:`~lightning_pipedap.plan.evaluator.Evaluator`) is the objective. The search
keeps the best schedule of these stages, so its prediction is never worse than any of them:

1. **Known planners.** ``no_overlap``, ``wfbp``, ``dear`` and ``pipedap`` (each with its own fusion
   search) are run and evaluated; the best is the incumbent.
2. **Structured op lists** for a given fusion. All gradients are complete when the backward ends
   (``Σ t_b``), so for the ops that start after that moment, issuing them bucket by bucket in
   forward order (RS then AG, or one AR) is optimal (exchange argument: the next forward needs
   bucket 0 first, then 1, ...; moving the ops of a lower bucket ahead of those of a higher one
   never delays any forward). So an op list is a *prefix* issued during the backward plus that
   sorted *suffix*. Prefixes tried: reduce-scatters in backward order with or without PipeDAP's gap
   filling, all-reduces in backward order, and all-reduce only where it saves a start-up; each cut
   at the last ``cut_window + 1`` positions before the backward ends (leaving a ready RS for later
   can pay off when it would delay bucket 0); then, for fusions of at most 48 buckets, single ops
   are greedily dropped from the best prefix into the suffix while that helps. Adjacent RS + AG
   pairs become AR where cheaper.
3. **Fusion hill climbing** from the best candidate fusions, with the structured op lists as inner
   solver: merge two adjacent buckets, move a boundary by 1, 4 or 16 layers, or split a bucket
   (after its first layer, before its last, or at a quarter, half or three quarters of its bytes).
   First improvement; stops at a local optimum, after ``max_fusion_evals`` fusions, or once the
   evaluated fusions hold ``max_fusion_work`` buckets in total (a size-aware cap: large models with
   hundreds of buckets get fewer, costlier evaluations).
4. **Op-list polish** of the incumbent and of the ``polish_fusions`` best fusions of stages 2-3
   (a fusion whose structured op list is second best can polish into the best schedule, e.g. when
   an all-gather must run early even though it delays later reduce-scatters): move any op to any
   valid position, split an AR into RS + AG, merge RS + AG into an AR (at either position). First
   improvement; each polish stops at a local optimum or after ``max_polish_evals`` evaluations, and
   the stage stops once the evaluated op lists hold ``max_polish_work`` ops in total.
5. **Exact branch and bound** (:mod:`._exact`) when the model has at most ``exact_max_layers``
   layers: every contiguous fusion, depth-first over op lists, pruned by a lower bound and by
   dominance between partial op lists. With the node budget ``max_exact_nodes`` not exhausted, the
   result is optimal over all contiguous fusions, modes and orders.
6. **Compression** (only with a :class:`~lightning_pipedap.plan.compression.CompressionCost`):
   which buckets to compress. Stages 1-5 plan without compression (the incumbent, so the plan never
   predicts worse than not compressing). Then: the known planners with every bucket compressed;
   stages 2-3 with every bucket compressed (the best fusion for compressed buckets differs: fewer,
   larger buckets amortise compression start-ups); and greedy flips of single buckets' flags
   (first improvement, largest buckets first, each flag vector evaluated with the structured op
   lists of stage 2 and the previous op list adapted) from four starts: the incumbent's fusion with
   no bucket and with every bucket compressed, the best all-compressed fusion, and the known
   planners' compressed schedules; at most ``max_compress_evals`` flag vectors in total. The best
   is polished (stage 4). When the model has at most ``exact_compress_max_layers`` layers, branch
   and bound runs on every contiguous fusion (or the fixed one) for every flag vector (node budget
   ``max_exact_nodes``; ``2·3^(L-1)`` searches for ``L`` layers), so small instances are solved
   exactly. The compressed plan replaces the incumbent only if it predicts a shorter iteration.
7. **16-bit wire format** (only with ``wire16=True``): which uncompressed buckets travel as 16-bit
   (their RS and AG cost the cost model's measured 16-bit constants, cast included, else ``T(n/2)``:
   :meth:`~lightning_pipedap.plan.cost_model.CostModel.reduce_scatter16`). A 16-bit op can be slower than
   the fp32 one where the cast costs more than the halved transfer saves (a fast link), and it rounds the
   gradients, so a bucket goes 16-bit only where that shortens the predicted iteration: greedy flips (largest
   buckets first, each flag vector evaluated with the structured op lists of stage 2 and the previous op list adapted)
   from no bucket 16-bit (a flip must shorten the prediction) and from every bucket 16-bit, on the
   incumbent's fusion and on the best fusion of stages 2-3 with every bucket 16-bit (a flip back
   to fp32 is taken whenever it does not lengthen the prediction: fp32 where communication is
   hidden anyway); at most ``max_compress_evals`` flag vectors. Of the predictions within ``TOL``
   of the best, the one with the fewest 16-bit buckets wins; it is polished (stage 4) and replaces
   the incumbent only if it predicts a shorter iteration.

8. **Sharded optimizer step** (``sharded=True`` or a :class:`~lightning_pipedap.plan.sharding.Sharding`): every
   stage evaluates with the sharded model of :mod:`lightning_pipedap.plan.simulator`, and the schedule returned
   is the engine's sharded op list (:func:`~lightning_pipedap.schedule.sharded_ops` order). There the all-gathers
   always follow every gradient op (in forward order, after the steps), so for a fusion without compressed
   buckets the iteration depends on the gradient ops only through the end of the last one, which reduce-scatters
   in backward order minimise (earliest ready first minimises the end of one machine's jobs with release times):
   the structured op list (stage 2) is exactly that, the polish (stage 4) has nothing to improve and is skipped,
   and the exact stage (5) evaluates every contiguous fusion (``2^(L-1)``) with it, so small models are solved
   exactly. With compression the stages run as above on the sharded model, except stage 6's exact search (its
   branch and bound models unsharded op lists), which is skipped. Last, the plan made without ``sharded`` is
   evaluated with the sharded model and kept if it predicts shorter (so a sharded plan is never predicted worse
   than sharding the unsharded one; the planning takes about twice as long).

Budgets are counts of evaluations, not wall time, so results are deterministic. For the shared
profiles (16 to 402 layers) with the defaults a plan takes about a second on one CPU core.
"""

from __future__ import annotations

import bisect
import logging
import math
from typing import Any, Iterator, Sequence

from lightning_pipedap.plan.compression import CompressionCost
from lightning_pipedap.plan.cost_model import CostModel
from lightning_pipedap.plan.evaluator import Evaluator, op_code
from lightning_pipedap.plan.planners import dear as _dear
from lightning_pipedap.plan.planners import no_overlap as _no_overlap
from lightning_pipedap.plan.planners import pipedap as _pipedap
from lightning_pipedap.plan.planners import wfbp as _wfbp
from lightning_pipedap.plan.planners._common import (
    AG, AR, RS, TOL, Starts, buckets_of, check_common, dear_codes, dp_backward_fusion, evaluator, finish,
    merge_adjacent, normalize_compressed, resolve_fusion, starts_of,
)
from lightning_pipedap.plan.planners._exact import (
    branch_and_bound, exact_compressed_search, exact_search, exact_sharded_search,
)
from lightning_pipedap.plan.planners.pipedap import pipedap_codes
from lightning_pipedap.plan.profile import ModelProfile
from lightning_pipedap.plan.sharding import ShardingArg
from lightning_pipedap.schedule import Schedule

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- structured op lists (stage 2)
def _suffix(ev: Evaluator, status: Sequence[int]) -> list[int]:
    """Remaining ops bucket by bucket in forward order; status 0 = nothing issued, 1 = RS issued."""
    cost = ev.cost
    out: list[int] = []
    for b in range(ev.B):
        s = status[b]
        c = 3 * b
        if s == 0:
            if cost[c + AR] <= cost[c + RS] + cost[c + AG]:
                out.append(c + AR)
            else:
                out += [c + RS, c + AG]
        elif s == 1:
            out.append(c + AG)
    return out


def _prefixes(ev: Evaluator) -> list[list[int]]:
    cost = ev.cost
    B = ev.B
    rs_fill = [c for c in pipedap_codes(ev, gap_fill=True, merge=False)]
    # drop the trailing all-gathers (they belong to the suffix, which re-sorts them)
    while rs_fill and rs_fill[-1] % 3 == AG:
        rs_fill.pop()
    rs = [3 * b + RS for b in range(B - 1, -1, -1)]
    ar = [3 * b + AR for b in range(B - 1, -1, -1)]
    mixed = [3 * b + (AR if cost[3 * b + AR] < cost[3 * b + RS] + cost[3 * b + AG] else RS)
             for b in range(B - 1, -1, -1)]
    out, seen = [], set()
    for p in (rs_fill, rs, ar, mixed):
        t = tuple(p)
        if t not in seen:
            seen.add(t)
            out.append(p)
    return out


def _start_times(ev: Evaluator, seq: Sequence[int]) -> list[float]:
    """Start time of each op of ``seq`` issued first on the channel(s) (anchor: backward start 0)."""
    cost, ready, chan = ev.cost, ev.ready, ev.chan
    free = [0.0, 0.0]
    rs_end: dict[int, float] = {}
    out = []
    for c in seq:
        b, k = divmod(c, 3)
        dep = rs_end.get(b, 0.0) if k == AG else ready[b]
        s = max(free[chan[c]], dep)
        free[chan[c]] = s + cost[c]
        if k == RS:
            rs_end[b] = s + cost[c]
        out.append(s)
    return out


def _compose(ev: Evaluator, prefix: Sequence[int]) -> list[int]:
    status = [0] * ev.B
    for c in prefix:
        b, kk = divmod(c, 3)
        status[b] = 2 if kk != RS else (1 if status[b] == 0 else 2)
    return merge_adjacent(ev, list(prefix) + _suffix(ev, status))


def structured_best(ev: Evaluator, cut_window: int = 6, drop_max_buckets: int = 48) -> tuple[float, list[int]]:
    """Best structured op list (stage 2 of the module docstring) for the evaluator's fusion.

    After the cuts, when the fusion has at most ``drop_max_buckets`` buckets, single ops are
    greedily dropped from the best prefix (moved to the sorted suffix) while that helps: the best
    prefix need not be contiguous (e.g. a huge bucket's all-reduce first, smaller ready ones later).

    With a sharded model and no compressed bucket: reduce-scatters in backward order, which is optimal for
    the fusion (module docstring, stage 8).

    Returns:
        ``(iteration seconds, op codes)``.
    """
    if _sharded_only(ev):
        codes = dear_codes(ev)
        return ev.period_codes(codes), codes
    Tb = ev.t_backward
    best_p, best, best_prefix = math.inf, [], []
    for seq in _prefixes(ev):
        starts = _start_times(ev, seq)
        kmax = sum(1 for x in starts if x < Tb)
        for k in range(kmax, max(-1, kmax - cut_window - 1), -1):
            codes = _compose(ev, seq[:k])
            p = ev.period_codes(codes)
            if p < best_p:
                best_p, best, best_prefix = p, codes, seq[:k]
    if ev.B <= drop_max_buckets:
        improved = True
        while improved:
            improved = False
            for i, c in enumerate(best_prefix):
                if c % 3 == RS and c + 1 in best_prefix:
                    continue  # its all-gather is in the prefix too: dropping the RS alone is invalid
                cand = best_prefix[:i] + best_prefix[i + 1:]
                codes = _compose(ev, cand)
                p = ev.period_codes(codes)
                if p < best_p * (1 - TOL):
                    best_p, best, best_prefix, improved = p, codes, cand, True
                    break
    return best_p, best


# ------------------------------------------------------------------ fusion hill climbing (stage 3)
def _fusion_neighbors(starts: Starts, L: int, pre: Sequence[int]) -> Iterator[Starts]:
    S = list(starts)
    B = len(S)
    ends = S[1:] + [L]
    for i in range(1, B):  # merge bucket i-1 and i
        yield tuple(S[:i] + S[i + 1:])
    for i in range(1, B):  # move boundary i
        lo, hi = S[i - 1], ends[i]
        for d in (-1, 1, -4, 4, -16, 16):
            x = S[i] + d
            if lo < x < hi:
                yield tuple(S[:i] + [x] + S[i + 1:])
    for b in range(B):  # split bucket b
        s, e = S[b], ends[b]
        if e - s < 2:
            continue
        cands = {s + 1, e - 1}
        tot = pre[e] - pre[s]
        for q in (0.25, 0.5, 0.75):
            x = bisect.bisect_left(pre, pre[s] + q * tot, s + 1, e)
            cands.add(x)
        for x in sorted(cands):
            if s < x < e:
                yield tuple(S[:b + 1] + [x] + S[b + 1:])


class _FusionSearch:
    """Stages 2-3 over fusions; with ``compression`` every bucket of every fusion is compressed, with
    ``wire16`` every bucket travels in the 16-bit wire format."""

    def __init__(self, profile: ModelProfile, cost_model: CostModel, channels: int, cut_window: int,
                 compression: CompressionCost | None = None, world_size: int | None = None,
                 wire16: bool = False, sharded: ShardingArg = False) -> None:
        self.profile, self.cost_model, self.channels, self.cut_window = profile, cost_model, channels, cut_window
        self.compression, self.world_size, self.wire16, self.sharded = compression, world_size, wire16, sharded
        self.cache: dict[Starts, tuple[float, list[int], Evaluator]] = {}
        self.pre = [0]
        for layer in profile.layers:
            self.pre.append(self.pre[-1] + layer.nbytes)

    def evaluate(self, starts: Starts) -> tuple[float, list[int], Evaluator]:
        hit = self.cache.get(starts)
        if hit is None:
            ev = evaluator(self.profile, self.cost_model, buckets_of(starts, self.profile.num_layers), self.channels,
                           self.world_size, self.compression, wire16=self.wire16, sharded=self.sharded)
            p, codes = structured_best(ev, self.cut_window)
            hit = self.cache[starts] = (p, codes, ev)
        return hit

    def work(self) -> int:
        """Buckets summed over the evaluated fusions (one structured search costs O(buckets))."""
        return sum(len(st) for st in self.cache)

    def best_fusion(self, seeds: Sequence[Starts], climb: bool, max_evals: int, max_work: int) -> Starts:
        """Stage 2 on every seed, then, with ``climb``, stage 3 from the best three (at most
        ``max_evals`` more fusions and ``max_work`` more buckets); the best fusion evaluated."""
        scored = sorted({st: self.evaluate(st)[0] for st in seeds}.items(), key=lambda kv: (kv[1], kv[0]))
        if climb:
            budget = len(self.cache) + max_evals
            work_budget = self.work() + max_work
            for st, _ in scored[:3]:
                self.climb(st, budget, work_budget)
        return min(self.cache, key=lambda st: (self.cache[st][0], st))

    def climb(self, start: Starts, max_evals: int, max_work: int) -> tuple[float, Starts]:
        cur = start
        cur_p = self.evaluate(cur)[0]
        L = self.profile.num_layers
        work = self.work()
        improved = True
        while improved and len(self.cache) < max_evals and work < max_work:
            improved = False
            for nb in _fusion_neighbors(cur, L, self.pre):
                if nb not in self.cache:
                    if len(self.cache) >= max_evals or work >= max_work:
                        break
                    work += len(nb)
                p = self.evaluate(nb)[0]
                if p < cur_p * (1 - TOL):
                    cur, cur_p, improved = nb, p, True
                    break
        return cur_p, cur


# ----------------------------------------------------------------------- op-list polish (stage 4)
def _polish_moves(codes: list[int], cost: Sequence[float]) -> Iterator[list[int]]:
    n = len(codes)
    for i, c in enumerate(codes):  # mode changes
        b, k = divmod(c, 3)
        if k == AR:
            yield codes[:i] + [3 * b + RS, 3 * b + AG] + codes[i + 1:]
        elif k == RS:
            j = codes.index(3 * b + AG)
            rest = codes[:i] + codes[i + 1:j] + codes[j + 1:]
            yield rest[:i] + [3 * b + AR] + rest[i:]
            yield rest[:j - 1] + [3 * b + AR] + rest[j - 1:]
    for i, c in enumerate(codes):  # moves of one op to every valid position
        b, k = divmod(c, 3)
        base = codes[:i] + codes[i + 1:]
        lo, hi = 0, n - 1  # insertion indices into base
        if k == RS:
            p = codes.index(3 * b + AG)
            hi = p - 1  # insert before the AG (which sits at p - 1 in base)
        elif k == AG:
            p = codes.index(3 * b + RS)
            lo = p + 1  # insert after the RS (p < i, unchanged in base)
        for j in range(lo, hi + 1):
            if j != i:
                yield base[:j] + [c] + base[j:]


def _sharded_only(ev: Evaluator) -> bool:
    """Whether every bucket of ``ev`` is stepped sharded (then the backward-order reduce-scatters are optimal)."""
    return ev.sharding is not None and all(ev.sharded)


def polish(ev: Evaluator, codes: list[int], max_evals: int) -> tuple[float, list[int], int]:
    """Local search on the op list (stage 4). Returns ``(iteration s, codes, evaluations used)``; with every
    bucket sharded the op list is returned as it is (nothing to improve, module docstring, stage 8)."""
    best_p = ev.period_codes(codes)
    if _sharded_only(ev):
        return best_p, codes, 1
    evals = 1
    improved = True
    while improved and evals < max_evals:
        improved = False
        for cand in _polish_moves(codes, ev.cost):
            evals += 1
            p = ev.period_codes(cand)
            if p < best_p * (1 - TOL):
                best_p, codes, improved = p, cand, True
                break
            if evals >= max_evals:
                break
    return best_p, codes, evals


# ------------------------------------------------------------------------ known planners (stage 1)
def _known_plans(profile: ModelProfile, cost_model: CostModel, world_size: int, fusion: Any, channels: int,
                 compression: CompressionCost | None = None, sharded: ShardingArg = False) -> list[Schedule]:
    """The schedules of ``no_overlap`` (with ``fusion="auto"`` only), ``wfbp``, ``dear`` and ``pipedap``."""
    kw = {"channels": channels, "compression": compression, "sharded": sharded}
    known = [_no_overlap.plan(profile, cost_model, world_size, **kw)] if fusion == "auto" else []
    for mod in (_wfbp, _dear, _pipedap):
        known.append(mod.plan(profile, cost_model, world_size, fusion=fusion, **kw))
    return known


# ------------------------------------------------------------------- compression flags (stage 6)
Flags = tuple[bool, ...]


def _with_hint(hit: tuple[float, list[int], Evaluator],
               hint: Sequence[int] | None) -> tuple[float, list[int], Evaluator]:
    """``hit`` (``(s, codes, evaluator)``), or ``hint`` (an op list of other flags) adapted to the
    evaluator's flags (:func:`normalize_compressed`) when that predicts a shorter iteration."""
    if hint is None:
        return hit
    ev = hit[2]
    codes = normalize_compressed(ev, hint)
    p = ev.period_codes(codes)
    return (p, codes, ev) if p < hit[0] * (1 - TOL) else hit


class _FlagSearch:
    """Per-bucket compression flags for given fusions (stage 6), flag vectors cached."""

    def __init__(self, profile: ModelProfile, cost_model: CostModel, channels: int, cut_window: int,
                 compression: CompressionCost, world_size: int, sharded: ShardingArg = False) -> None:
        self.profile, self.cost_model, self.channels, self.cut_window = profile, cost_model, channels, cut_window
        self.compression, self.world_size, self.sharded = compression, world_size, sharded
        self.cache: dict[tuple[Starts, Flags], tuple[float, list[int], Evaluator]] = {}
        self.evals = 0

    def evaluate(self, starts: Starts, flags: Flags,
                 hint: Sequence[int] | None = None) -> tuple[float, list[int], Evaluator]:
        """Best of the structured op lists (stage 2, without drops) and ``hint`` adapted to ``flags``."""
        key = (starts, flags)
        hit = self.cache.get(key)
        if hit is None:
            ev = evaluator(self.profile, self.cost_model, buckets_of(starts, self.profile.num_layers), self.channels,
                           self.world_size, self.compression, flags, sharded=self.sharded)
            p, codes = structured_best(ev, self.cut_window, drop_max_buckets=0)
            self.evals += 1
            hit = (p, codes, ev)
        hit = self.cache[key] = _with_hint(hit, hint)
        return hit

    def climb(self, starts: Starts, flags: Flags, codes: Sequence[int] | None,
              max_evals: int) -> tuple[float, list[int], Evaluator]:
        """Flip one bucket's flag at a time (largest buckets first) while the iteration gets shorter."""
        cur_p, cur_codes, cur_ev = self.evaluate(starts, flags, codes)
        order = sorted(range(len(flags)), key=lambda b: (-cur_ev.nbytes[b], b))
        improved = True
        while improved and self.evals < max_evals:
            improved = False
            for b in order:
                nf = flags[:b] + (not flags[b],) + flags[b + 1:]
                p, c, ev = self.evaluate(starts, nf, cur_codes)
                if p < cur_p * (1 - TOL):
                    flags, cur_p, cur_codes, cur_ev, improved = nf, p, c, ev, True
                    break
                if self.evals >= max_evals:
                    break
        return cur_p, cur_codes, cur_ev


def _compression_stage(profile: ModelProfile, cost_model: CostModel, world_size: int, channels: int,
                       compression: CompressionCost, fusion: Any, fusions: Sequence[Starts],
                       incumbent: tuple[float, Evaluator, list[int]], cut_window: int, max_fusion_evals: int,
                       max_fusion_work: int, max_compress_evals: int, max_polish_evals: int,
                       exact_compress_max_layers: int, max_exact_nodes: int,
                       sharded: ShardingArg = False) -> tuple[float, Evaluator, list[int]] | None:
    """Stage 6 (module docstring): the best plan with at least one compressed bucket, or ``None``
    when none beats ``incumbent`` (``(s, evaluator, codes)`` of the plan without compression)."""
    L = profile.num_layers
    fixed = fusion != "auto"
    best_p, _, _ = incumbent
    known = [k for k in _known_plans(profile, cost_model, world_size, fusion, channels, compression, sharded)
             if k.buckets and k.buckets[0][0] == 0]
    # the best fusion when every bucket is compressed (stages 2-3)
    search = _FusionSearch(profile, cost_model, channels, cut_window, compression, world_size, sharded=sharded)
    seeds = list(fusions) + [starts_of(k.buckets) for k in known] + [starts_of(incumbent[1].buckets)]
    st_c = search.best_fusion(seeds, not fixed, max_fusion_evals, max_fusion_work)
    # greedy flag flips from several starts, best start first
    flags_search = _FlagSearch(profile, cost_model, channels, cut_window, compression, world_size, sharded)
    st_d = starts_of(incumbent[1].buckets)
    starts: list[tuple[Starts, Flags, Sequence[int] | None]] = [
        (st_d, (False,) * len(st_d), incumbent[2]),
        (st_d, (True,) * len(st_d), None),
        (st_c, (True,) * len(st_c), search.cache[st_c][1]),
    ] + [(starts_of(k.buckets), (True,) * len(k.buckets), [op_code(o) for o in k.ops]) for k in known]
    ranked = sorted(starts, key=lambda s3: flags_search.evaluate(*s3)[0])
    results = [flags_search.climb(st, fl, codes, max_compress_evals) for st, fl, codes in ranked]
    results += list(flags_search.cache.values())
    p, codes, ev = min(((p, c, e) for p, c, e in results if any(e.compressed)), key=lambda r: r[0],
                       default=(math.inf, [], None))
    if ev is not None and max_polish_evals > 0:
        p, codes, _ = polish(ev, list(codes), max_polish_evals)
    if L <= exact_compress_max_layers and not sharded:  # (its branch and bound models unsharded op lists)
        upper = min(p, best_p)
        q, qev, qcodes, complete = exact_compressed_search(
            profile, cost_model, channels, world_size, compression, [fusions[0]] if fixed else None, upper,
            max_exact_nodes)
        if qcodes is not None and q < p:
            p, ev, codes = q, qev, qcodes
        if not complete:
            log.warning("optimal: exact search over compression flags stopped after %d nodes; the plan is the "
                        "best found, not proven optimal", max_exact_nodes)
    if ev is None or not p < best_p * (1 - TOL):
        return None
    return p, ev, codes


# ------------------------------------------------------------------- 16-bit wire format (stage 7)
class _WireSearch:
    """Per-bucket 16-bit wire flags for given buckets and compressed flags (stage 7), flag vectors cached."""

    def __init__(self, profile: ModelProfile, cost_model: CostModel, channels: int, cut_window: int,
                 world_size: int, compression: CompressionCost | None, sharded: ShardingArg = False) -> None:
        self.profile, self.cost_model, self.channels, self.cut_window = profile, cost_model, channels, cut_window
        self.world_size, self.compression, self.sharded = world_size, compression, sharded
        self.cache: dict[tuple, tuple[float, list[int], Evaluator]] = {}

    def evaluate(self, buckets: tuple, compressed: Flags, half: Flags,
                 hint: Sequence[int] | None = None) -> tuple[float, list[int], Evaluator]:
        """Best of the structured op lists (stage 2, without drops) and ``hint`` adapted to the flags."""
        key = (buckets, compressed, half)
        hit = self.cache.get(key)
        if hit is None:
            ev = evaluator(self.profile, self.cost_model, buckets, self.channels, self.world_size, self.compression,
                           compressed, half, sharded=self.sharded)
            hit = (*structured_best(ev, self.cut_window, drop_max_buckets=0), ev)
        hit = self.cache[key] = _with_hint(hit, hint)
        return hit

    def climb(self, buckets: tuple, compressed: Flags, half: Flags, codes: Sequence[int] | None,
              max_evals: int) -> tuple[float, list[int], Evaluator]:
        """Flip one uncompressed bucket at a time (largest first): to 16-bit when that shortens the
        prediction, back to fp32 when that does not lengthen it."""
        cur_p, cur_codes, cur_ev = self.evaluate(buckets, compressed, half, codes)
        order = sorted((b for b in range(len(half)) if not compressed[b]), key=lambda b: (-cur_ev.nbytes[b], b))
        improved = True
        while improved and len(self.cache) < max_evals:
            improved = False
            for b in order:
                nh = half[:b] + (not half[b],) + half[b + 1:]
                p, c, ev = self.evaluate(buckets, compressed, nh, cur_codes)
                better = p <= cur_p * (1 + TOL) if half[b] else p < cur_p * (1 - TOL)
                if better:
                    half, cur_p, cur_codes, cur_ev, improved = nh, p, c, ev, True
                    break
                if len(self.cache) >= max_evals:
                    break
        return cur_p, cur_codes, cur_ev


def _wire_stage(profile: ModelProfile, cost_model: CostModel, world_size: int, channels: int,
                compression: CompressionCost | None, fusion: Any, fusions: Sequence[Starts],
                incumbent: tuple[float, Evaluator, list[int]], cut_window: int, max_fusion_evals: int,
                max_fusion_work: int, max_evals: int, max_polish_evals: int,
                sharded: ShardingArg = False) -> tuple[float, Evaluator, list[int]] | None:
    """Stage 7 (module docstring): the best plan with at least one 16-bit wire bucket, or ``None`` when
    none beats ``incumbent`` (``(s, evaluator, codes)``)."""
    best_p, inc_ev, inc_codes = incumbent
    search = _WireSearch(profile, cost_model, channels, cut_window, world_size, compression, sharded)
    comp = tuple(inc_ev.compressed)
    B = inc_ev.B
    starts: list[tuple[tuple, Flags, Flags, Sequence[int] | None]] = [
        (inc_ev.buckets, comp, (False,) * B, inc_codes),
        (inc_ev.buckets, comp, tuple(not c for c in comp), inc_codes),
    ]
    if compression is None and fusion == "auto":  # the best fusion when every bucket is 16-bit (stages 2-3)
        fs = _FusionSearch(profile, cost_model, channels, cut_window, world_size=world_size, wire16=True,
                           sharded=sharded)
        st = fs.best_fusion(list(fusions) + [starts_of(inc_ev.buckets)], True, max_fusion_evals, max_fusion_work)
        bk = buckets_of(st, profile.num_layers)
        starts.append((bk, (False,) * len(bk), (True,) * len(bk), fs.cache[st][1]))
    results = [search.climb(bk, c, h, codes, max_evals) for bk, c, h, codes in starts]
    results += list(search.cache.values())
    found = [(p, c, e) for p, c, e in results if any(e.wire16)]
    if not found:
        return None
    top = min(p for p, _, _ in found)
    p, codes, ev = min((r for r in found if r[0] <= top * (1 + TOL)),
                       key=lambda r: (sum(r[2].wire16), r[0], r[2].buckets))
    if max_polish_evals > 0:
        p, codes, _ = polish(ev, list(codes), max_polish_evals)
    if not p < best_p * (1 - TOL):
        return None
    return p, ev, codes


#: the best plan so far: ``(predicted iteration (s), its Evaluator, its op codes)``
_Incumbent = tuple[float, Evaluator, list[int]]


def _check_budgets(**budgets: int) -> None:
    """Raise ValueError naming the first budget that is not an int at or above its minimum (1 for
    ``max_fusion_evals``, else 0)."""
    for name, v in budgets.items():
        lo = 1 if name == "max_fusion_evals" else 0
        if not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


def _search_fusions(search: _FusionSearch, profile: ModelProfile, cost_model: CostModel, known: list[Schedule],
                    fusions: Any, fixed: bool, best: _Incumbent, max_fusion_evals: int,
                    max_fusion_work: int) -> _Incumbent:
    """Stages 2-3: structured op lists on every candidate fusion (``fusions``, the known planners' fusions and,
    unless the fusion is ``fixed``, the backward-order DP's), then hill climbing from the best few; returns the
    better of ``best`` and the best found (by more than ``TOL``)."""
    seeds = list(fusions) + [starts_of(s.buckets) for s in known if len(s.buckets) and s.buckets[0][0] == 0]
    if not fixed:
        seeds.append(dp_backward_fusion(profile, cost_model.all_reduce))
    st_best = search.best_fusion(seeds, not fixed, max_fusion_evals, max_fusion_work)
    p, codes, ev = search.cache[st_best]
    return (p, ev, codes) if p < best[0] * (1 - TOL) else best


def _polish_best(search: _FusionSearch, best: _Incumbent, polish_fusions: int, max_polish_evals: int,
                 max_polish_work: int) -> _Incumbent:
    """Stage 4: polish the op list of the incumbent and of the next ``polish_fusions`` best fusions of stages
    2-3 (at most ``max_polish_evals`` op lists each, ``max_polish_work`` ops in all); returns the best."""
    best_p, best_ev, best_codes = best
    ranked = sorted(search.cache.items(), key=lambda kv: (kv[1][0], kv[0]))
    to_polish = [(best_ev, best_codes)] + [(ev, codes) for st, (_, codes, ev) in ranked[:polish_fusions]
                                           if ev is not best_ev]
    work_left = max_polish_work
    for ev, codes in to_polish:
        evals = min(max_polish_evals, work_left // max(1, len(codes)))
        if evals <= 0:
            break
        p, codes, used = polish(ev, list(codes), evals)
        work_left -= used * len(codes)
        if p < best_p * (1 - TOL):
            best_p, best_ev, best_codes = p, ev, codes
    return best_p, best_ev, best_codes


def _exact_stage(profile: ModelProfile, cost_model: CostModel, channels: int, fusions: Any, fixed: bool,
                 best: _Incumbent, max_exact_nodes: int, world_size: int | None = None,
                 sharded: ShardingArg = False) -> _Incumbent:
    """Stage 5 (small models): the exact search over fusions and op lists (over op lists of the ``fixed``
    fusion only), bounded by ``best``; returns the better. Logs a warning when the node budget stopped it.
    ``sharded``: the sharded model's exact search (every fusion with its optimal op list, stage 8)."""
    L = profile.num_layers
    if sharded:
        p, ev, codes, complete = exact_sharded_search(profile, cost_model, channels, world_size, sharded,
                                                      [fusions[0]] if fixed else None, best[0])
    elif fixed:
        p, ev, codes, complete = branch_and_bound(
            [Evaluator(profile, cost_model, buckets_of(fusions[0], L), channels)], best[0], max_exact_nodes)
    else:
        p, ev, codes, complete = exact_search(profile, cost_model, channels, best[0], max_exact_nodes)
    if not complete:
        log.warning("optimal: exact search stopped after %d nodes; the plan is the best found, "
                    "not proven optimal", max_exact_nodes)
    return (p, ev, codes) if codes is not None and p < best[0] else best


# ----------------------------------------------------------------------------------- planner
def plan(profile: ModelProfile, cost_model: CostModel, world_size: int, *, fusion: Any = "auto",
         channels: int = 1, cut_window: int = 6, max_fusion_evals: int = 400, max_fusion_work: int = 12_000,
         max_polish_evals: int = 3000, polish_fusions: int = 4, max_polish_work: int = 2_000_000,
         exact_max_layers: int = 8, max_exact_nodes: int = 200_000, compression: CompressionCost | None = None,
         max_compress_evals: int = 400, exact_compress_max_layers: int = 6, wire16: bool = False,
         sharded: ShardingArg = False) -> Schedule:
    """Search fusion, op order and op mode, and with ``compression`` which buckets to compress; never
    predicts worse than ``no_overlap``, ``wfbp``, ``dear`` or ``pipedap`` (they are evaluated, with
    and without compression, and kept if best), nor than planning without compression; with
    ``wire16`` also which buckets travel in the 16-bit wire format (stage 7).

    Args:
        profile: layers in forward order.
        cost_model: op costs.
        world_size: number of data-parallel workers (checked against ``cost_model.meta``).
        fusion: ``"auto"`` (search fusions) or a fixed fusion (``"none"``, ``"single"``, a cap in
            bytes, explicit contiguous buckets); with a fixed fusion only stages 2, 4 and, for
            small models, 5 restricted to that fusion run, and the other planners use it too.
        channels: 1 or 2 communication channels.
        cut_window: prefix cuts tried per structured op list (stage 2), >= 0.
        max_fusion_evals: fusions evaluated by the hill climbing (stage 3), >= 1.
        max_fusion_work: stage 3 also stops once the fusions it evaluated hold this many buckets in
            total (the cost of one evaluation grows with the bucket count), >= 0.
        max_polish_evals: op lists evaluated per polished schedule (stage 4), >= 0.
        polish_fusions: besides the incumbent, polish the best this many fusions of stages 2-3, >= 0.
        max_polish_work: stage 4 stops once the evaluated op lists hold this many ops in total, >= 0.
        exact_max_layers: run the exact search (stage 5) when ``num_layers <= exact_max_layers``.
        max_exact_nodes: node budget of the exact search (and again of stage 6's).
        compression: the measured compression cost; None plans without compression.
        max_compress_evals: flag vectors evaluated by stage 6's flips, >= 0.
        exact_compress_max_layers: run stage 6's exact search when ``num_layers <=`` this, >= 0.
        wire16: allow the 16-bit wire format per bucket (stage 7; its flag vectors count against
            ``max_compress_evals``).
        sharded: plan for the sharded optimizer step (``True`` or a
            :class:`~lightning_pipedap.plan.sharding.Sharding`; stage 8): the returned op list is the engine's
            sharded one, the prediction the sharded model's.

    Returns:
        The schedule, ``name="optimal"``, with ``predicted_iteration_s`` set; with ``compression``
        its ``compressed`` flags say which buckets to compress (possibly none); its ``wire16``
        flags which travel as 16-bit (None: none).

    Raises:
        ValueError: for a bad ``fusion``, ``world_size``, ``channels``, ``compression`` or a
            negative budget.
    """
    check_common(profile, cost_model, world_size, channels, compression, sharded)
    _check_budgets(cut_window=cut_window, max_fusion_evals=max_fusion_evals, max_fusion_work=max_fusion_work,
                   max_polish_evals=max_polish_evals, polish_fusions=polish_fusions, max_polish_work=max_polish_work,
                   exact_max_layers=exact_max_layers, max_exact_nodes=max_exact_nodes,
                   max_compress_evals=max_compress_evals, exact_compress_max_layers=exact_compress_max_layers)
    fixed = fusion != "auto"
    fusions = resolve_fusion(fusion, profile, cost_model)

    # stage 1: the known planners
    known = _known_plans(profile, cost_model, world_size, fusion, channels, sharded=sharded)
    best_sched = min(known, key=lambda s: s.predicted_iteration_s)
    best = (best_sched.predicted_iteration_s,
            Evaluator(profile, cost_model, best_sched.buckets, channels, world_size=world_size, sharded=sharded),
            [op_code(o) for o in best_sched.ops])
    # stages 2-3, 4 and 5
    search = _FusionSearch(profile, cost_model, channels, cut_window, world_size=world_size, sharded=sharded)
    best = _search_fusions(search, profile, cost_model, known, fusions, fixed, best, max_fusion_evals, max_fusion_work)
    best = _polish_best(search, best, polish_fusions, max_polish_evals, max_polish_work)
    if profile.num_layers <= exact_max_layers:
        best = _exact_stage(profile, cost_model, channels, fusions, fixed, best, max_exact_nodes, world_size, sharded)
    best_p, best_ev, best_codes = best

    # stage 6
    if compression is not None:
        found = _compression_stage(profile, cost_model, world_size, channels, compression, fusion, fusions,
                                   (best_p, best_ev, best_codes), cut_window, max_fusion_evals, max_fusion_work,
                                   max_compress_evals, max_polish_evals, exact_compress_max_layers, max_exact_nodes,
                                   sharded)
        if found is not None:
            best_p, best_ev, best_codes = found
        else:  # no bucket compressed: the same plan, with explicit flags
            best_ev = evaluator(profile, cost_model, best_ev.buckets, channels, world_size, compression, False,
                                sharded=sharded)

    # stage 7
    if wire16:
        found = _wire_stage(profile, cost_model, world_size, channels, compression, fusion, fusions,
                            (best_p, best_ev, best_codes), cut_window, max_fusion_evals, max_fusion_work,
                            max_compress_evals, max_polish_evals, sharded)
        if found is not None:
            best_p, best_ev, best_codes = found

    # stage 8: never worse than the unsharded plan run sharded
    if sharded:
        plain = plan(profile, cost_model, world_size, fusion=fusion, channels=channels, cut_window=cut_window,
                     max_fusion_evals=max_fusion_evals, max_fusion_work=max_fusion_work,
                     max_polish_evals=max_polish_evals, polish_fusions=polish_fusions, max_polish_work=max_polish_work,
                     exact_max_layers=exact_max_layers, max_exact_nodes=max_exact_nodes, compression=compression,
                     max_compress_evals=max_compress_evals, exact_compress_max_layers=exact_compress_max_layers,
                     wire16=wire16)
        ev = evaluator(profile, cost_model, plain.buckets, channels, world_size, compression,
                       plain.compressed if plain.compressed is not None else False,
                       plain.wire16 if plain.wire16 is not None else False, sharded=sharded)
        codes = [op_code(o) for o in plain.ops]
        p = ev.period_codes(codes)
        if p < best_p * (1 - TOL):
            best_p, best_ev, best_codes = p, ev, codes
    return finish("optimal", profile, best_ev, best_codes)
