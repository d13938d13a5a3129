"""The simulator's model compiled for one tensor fusion (:class:`Evaluator`), and the op codes.

:class:`Evaluator` implements the steady-state model of :mod:`lightning_pipedap.plan.simulator` for a
fixed profile, cost model, fusion and compression flags: :meth:`Evaluator.period_codes` is the
planners' objective (called thousands of times per plan), :meth:`Evaluator.run` the same
computation with every start and end recorded (for :func:`~lightning_pipedap.plan.simulator.simulate`).

**Op codes.** The fast form of an :class:`~lightning_pipedap.schedule.Op`, used by the evaluator,
the planners and :mod:`lightning_pipedap.plan.contention`, is the integer ``3 * bucket + k``, where
``k`` is the position of the op's kind in :class:`~lightning_pipedap.schedule.OpKind` (:data:`K_RS`
0, :data:`K_AG` 1, :data:`K_AR` 2); :func:`op_code` and :func:`code_op` convert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from lightning_pipedap.plan.compression import CompressionCost
from lightning_pipedap.plan.cost_model import WIRE16_RATIO, CostModel
from lightning_pipedap.plan.profile import ModelProfile
from lightning_pipedap.plan.sharding import PREPARE_BYTES_PER_LAYER, ShardingArg, owned_buckets, resolve_sharding
from lightning_pipedap.schedule import Op, OpKind

__all__ = ["Evaluator", "Interval", "K_AG", "K_AR", "K_RS", "K_SKIP", "OpTiming", "WIRE16_RATIO", "check_channels",
           "check_flags", "code_op", "op_code"]


_KIND_OF_CODE: tuple[OpKind, ...] = tuple(OpKind)
_CODE_OF_KIND = {k: i for i, k in enumerate(_KIND_OF_CODE)}
#: ``k`` of reduce-scatter, all-gather and all-reduce codes
K_RS, K_AG, K_AR = (_CODE_OF_KIND[k] for k in (OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.ALL_REDUCE))
# the planners' code arithmetic needs AG(b) == RS(b) + 1 and AR(b) == RS(b) + 2
assert (K_RS, K_AG, K_AR) == (0, 1, 2), "OpKind must list RS, AG, AR in this order"
#: effective kind (:attr:`Evaluator.kind`) of the AG of a compressed bucket: no operation
K_SKIP = len(_KIND_OF_CODE)
assert K_SKIP == 3, "Evaluator.period_codes compares kinds with the literals 0..3"


def op_code(op: Op) -> int:
    """Integer code ``3 * bucket + k`` (k: position of ``op.kind`` in :class:`OpKind`: 0 RS, 1 AG,
    2 AR) used by the fast evaluator and the planners."""
    return 3 * op.bucket + _CODE_OF_KIND[op.kind]


def code_op(code: int) -> Op:
    """Inverse of :func:`op_code`."""
    b, k = divmod(code, 3)
    return Op(_KIND_OF_CODE[k], b)


def check_channels(channels: int) -> int:
    """``channels`` when it is 1 or 2; ``ValueError`` otherwise."""
    if channels not in (1, 2):
        raise ValueError(f"channels must be 1 or 2, got {channels!r}")
    return channels


@dataclass(frozen=True)
class OpTiming:
    """Start and end (seconds, iteration-origin frame) of one op on its channel."""

    op: Op
    channel: int
    start: float
    end: float


@dataclass(frozen=True)
class Interval:
    """A compute-stream interval: ``kind`` is ``forward``, ``backward``, ``update``, ``land`` (a sharded bucket's
    gathered parameters copied into the model) or ``wait``; on the compression helper lane, ``compress``; on the
    channel of the all-gathers, the sharded step's work (:meth:`Evaluator.run`): ``prepare`` (the round's
    all-reduce of used flags), ``gather_grads`` (clip by norm: bucket ``bucket``'s gradients all-gathered) and
    ``step`` (this rank's shard of bucket ``bucket`` stepped).

    ``wait`` intervals are exposed communication: the compute stream idles until bucket
    ``bucket``'s reduction finishes. ``layers`` are the profile layers covered (forward/backward).
    """

    kind: str
    start: float
    end: float
    bucket: int | None = None
    layers: tuple[int, ...] = ()


class Evaluator:
    """A profile + cost model + fixed tensor fusion, compiled for fast evaluation of op lists.

    Planners call :meth:`period_codes` thousands of times; :func:`simulate` uses :meth:`run`, the
    same computation with every start/end recorded. Both implement the model of
    :mod:`lightning_pipedap.plan.simulator`. Cost: O(number of ops + number of forward steps) per evaluation.

    Args:
        profile: layers in forward order.
        cost_model: op costs.
        buckets: ``buckets[b]`` = profile layer indices of bucket ``b``; must partition
            ``range(profile.num_layers)``.
        channels: 1 or 2.
        compressed: optional per-bucket flags (see :mod:`~lightning_pipedap.plan.simulator`); None: nothing compressed.
        compression: the compression cost; required when a flag is set.
        world_size: number of ranks, needed by ``collective="AG"`` compression; default
            ``cost_model.meta["world_size"]``.
        wire16: optional per-bucket flags: the bucket's RS and AG travel in the 16-bit wire format
            (:meth:`CostModel.reduce_scatter16`, :meth:`CostModel.all_gather16`: the measured 16-bit
            constants, else the fp32 ones at ``WIRE16_RATIO`` of the bytes) and its AR is that RS then that AG
            (the engine runs it so);
            None: no bucket. A bucket may not be both compressed and wire16.
        sharded: the sharded optimizer step (``True``, or a :class:`~lightning_pipedap.plan.sharding.Sharding`
            with its options; ``False``: unsharded): every uncompressed bucket is stepped sharded (see
            :mod:`~lightning_pipedap.plan.simulator`); needs ``world_size``.

    Attributes:
        ready: ``ready[b]``, seconds after the backward start at which bucket ``b``'s first channel
            op can start: its gradients are complete (``grad_ready[b]``), and, for a bucket
            compressed on the helper lane, its compression has finished.
        grad_ready: ``grad_ready[b]``, seconds after the backward start at which bucket ``b``'s
            gradients are complete.
        nbytes: bytes per bucket.
        payload: payload bytes per bucket (compressed buckets), else ``None``.
        compressed: the flags, one bool per bucket.
        wire16: the 16-bit wire flags, one bool per bucket.
        helper: ``(bucket, start, end)`` of each helper-lane compression, backward-start frame,
            in helper order.
        t_backward: Σ t_b (the next forward can start then).
        cost, chan, kind: per op code (:func:`op_code`): seconds, channel, and effective kind (the RS
            of a compressed bucket acts as its AR, its AG is :data:`K_SKIP`; the AR of a sharded bucket acts as
            its RS (cost of the RS), its AG is :data:`K_SKIP`: the parameter all-gather runs in the shard tail).
        fast_steps: ``(bucket waited for, its compute share + forward seconds)`` per forward step, in
            forward order (the next forward as :meth:`period_codes` walks it); the share is the bucket's update
            (``t_update * bytes / total``), or its land copy when it is sharded.
        sharding: the :class:`~lightning_pipedap.plan.sharding.Sharding` options, or ``None`` (unsharded).
        sharded: per bucket, whether it is stepped sharded (uncompressed buckets under ``sharding``).
        step_s, gather_s, land_s: per bucket, seconds of the shard step (``t_update * bytes / total / N``; under
            parameter ownership the slowest owner's share instead of ``1/N``), of the parameter all-gather (fp32
            ``AG`` of :attr:`wire_bytes`, also for a wire16 bucket: parameters travel in their own dtype) and of
            the land copy (``land_s_per_byte`` x the bucket's bytes); 0 for an unsharded bucket.
        wire_bytes: per bucket, the bytes its RS and parameter AG move: the bucket's bytes, or under parameter
            ownership (:attr:`~lightning_pipedap.plan.sharding.Sharding.owned`) the padded buffer
            (:func:`~lightning_pipedap.plan.sharding.owned_buckets`; its RS cost is then that of these bytes).
        owned: per bucket the :class:`~lightning_pipedap.plan.sharding.OwnedBucket` (None: unsharded), or None
            without parameter ownership.
        prepare_s: the round's preparation all-reduce (:data:`~lightning_pipedap.plan.sharding.PREPARE_BYTES_PER_LAYER`
            bytes per layer), 0 without a sharded bucket.
        clip_s: with ``clip_norm``, the gradient all-gathers of every sharded bucket (s), else 0.
        shard_tail: ``(bucket, step + parameter all-gather seconds)`` per sharded bucket, forward order.
        compute_s: busy seconds of the compute stream per iteration (Σ t_f + Σ t_b + the compute shares).

    Raises:
        ValueError: if ``buckets`` do not partition the layers, ``channels`` is not 1 or 2, the
            flags do not match the buckets, a bucket is flagged without a ``compression``, or the
            compression's per-layer payloads do not match the profile.
    """

    def __init__(self, profile: ModelProfile, cost_model: CostModel, buckets: Sequence[Sequence[int]],
                 channels: int = 1, *, compressed: Sequence[bool] | None = None,
                 compression: CompressionCost | None = None, world_size: int | None = None,
                 wire16: Sequence[bool] | None = None, sharded: ShardingArg = False) -> None:
        self.channels = check_channels(channels)
        L = profile.num_layers
        buckets = tuple(tuple(int(i) for i in bk) for bk in buckets)
        seen: list[int] = [-1] * L
        for b, bk in enumerate(buckets):
            if not bk:
                raise ValueError(f"bucket {b} is empty; every bucket needs at least one layer")
            for i in bk:
                if not 0 <= i < L:
                    raise ValueError(f"bucket {b} names layer {i}; valid layers are 0..{L - 1}")
                if seen[i] != -1:
                    raise ValueError(f"layer {i} is in buckets {seen[i]} and {b}; buckets must partition the layers")
                seen[i] = b
        missing = [i for i in range(L) if seen[i] == -1]
        if missing:
            raise ValueError(f"layers {missing[:10]} are in no bucket; buckets must partition the {L} layers")
        self.profile, self.cost_model, self.buckets = profile, cost_model, buckets
        self.B = len(buckets)
        flags = check_flags(compressed, self.B, compression, L)
        self.compressed, self.compression = flags, compression
        half = check_flags(wire16, self.B, None, L, "wire16")
        both = [b for b in range(self.B) if half[b] and flags[b]]
        if both:
            raise ValueError(f"buckets {both[:10]} are flagged both compressed and wire16; flag one or the other")
        self.wire16 = half
        self._sharded_arg = sharded
        if world_size is None:
            world_size = cost_model.meta.get("world_size")
        self.world_size = world_size
        layers = profile.layers
        suffix_tb = [0.0] * (L + 1)
        for i in range(L - 1, -1, -1):
            suffix_tb[i] = suffix_tb[i + 1] + layers[i].t_b
        self.suffix_tb = suffix_tb
        self.t_backward = suffix_tb[0]
        self.grad_ready = [suffix_tb[min(bk)] for bk in buckets]
        self.nbytes = [sum(layers[i].nbytes for i in bk) for bk in buckets]
        total = sum(self.nbytes)
        tu = profile.t_update
        self.update = [tu * n / total if total > 0 else tu / self.B for n in self.nbytes]
        cost: list[float] = []
        chan: list[int] = []
        kind: list[int] = []
        self.payload: list[float | None] = [None] * self.B
        for b in range(self.B):
            n = self.nbytes[b]
            if flags[b]:
                assert compression is not None
                self.payload[b] = compression.payload_bytes(n, buckets[b])
                c = compression.channel_s(cost_model, n, buckets[b], world_size)
                cost += [c, 0.0, c]
                kind += [K_AR, K_SKIP, K_AR]
            elif half[b]:
                rs, ag = cost_model.reduce_scatter16(n), cost_model.all_gather16(n)
                cost += [rs, ag, rs + ag]
                kind += [K_RS, K_AG, K_AR]
            else:
                cost += [cost_model.reduce_scatter(n), cost_model.all_gather(n), cost_model.all_reduce(n)]
                kind += [K_RS, K_AG, K_AR]
            chan += [0, 1 if channels == 2 else 0, 0]
        self._shard_init(cost_model, world_size, cost, kind)
        self.cost, self.chan, self.kind = cost, chan, kind
        # helper lane: compressed buckets in gradient-ready order (ties: higher bucket first, as backward)
        self.ready = list(self.grad_ready)
        self.helper: list[tuple[int, float, float]] = []
        if compression is not None and compression.where == "helper":
            h = 0.0
            for b in sorted((b for b in range(self.B) if flags[b]), key=lambda b: (self.grad_ready[b], -b)):
                s = h if h > self.grad_ready[b] else self.grad_ready[b]
                h = s + compression.helper_s(self.nbytes[b])
                self.helper.append((b, s, h))
                self.ready[b] = h
        # forward steps: (bucket waited for, update share, forward seconds until the next new bucket, layers)
        steps: list[list] = []
        waited: set[int] = set()
        for i in range(L):
            b = seen[i]
            if b not in waited:
                waited.add(b)
                steps.append([b, self.land_s[b] if self.sharded[b] else self.update[b], 0.0, []])
            steps[-1][2] += layers[i].t_f
            steps[-1][3].append(i)
        self.steps = [(s[0], s[1], s[2], tuple(s[3])) for s in steps]
        self.fast_steps = [(s[0], s[1] + s[2]) for s in steps]
        self.compute_s = self.t_backward + sum(s[1] + s[2] for s in steps)

    def _shard_init(self, cost_model: CostModel, world_size: int | None, cost: list[float], kind: list[int]) -> None:
        """The sharded step's per-bucket costs (class docstring); rewrites the sharded buckets' entries of
        ``cost`` and ``kind`` in place (AR -> RS, AG -> skipped)."""
        sh = self.sharding = resolve_sharding(self._sharded_arg)
        B = self.B
        self.sharded = tuple(sh is not None and not self.compressed[b] for b in range(B))
        self.step_s = [0.0] * B
        self.gather_s = [0.0] * B
        self.land_s = [0.0] * B
        self.wire_bytes = list(self.nbytes)
        self.owned = None
        self.prepare_s = self.clip_s = self.shard_head = 0.0
        self.shard_tail: list[tuple[int, float]] = []
        if sh is None:
            return
        if not (isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1):
            raise ValueError(f"the sharded model needs world_size (an int >= 1, each rank steps 1/world_size of a "
                             f"bucket), got {world_size!r}; pass world_size= or a cost model with meta['world_size']")
        owned = owned_buckets(sh.owned, self.buckets, self.sharded, world_size) if sh.owned is not None else None
        self.owned = owned
        for b in range(B):
            if not self.sharded[b]:
                continue
            n = self.nbytes[b]
            ob = owned[b] if owned is not None else None
            if ob is not None:  # (parameter ownership: padded regions on the wire, the slowest owner's step)
                self.wire_bytes[b] = w = ob.wire_bytes
                cost[3 * b + K_RS] = cost_model.reduce_scatter16(w) if self.wire16[b] else cost_model.reduce_scatter(w)
                self.step_s[b] = self.update[b] * ob.step_share
            else:
                self.step_s[b] = self.update[b] / world_size
            self.gather_s[b] = cost_model.all_gather(self.wire_bytes[b])
            self.land_s[b] = sh.land_s_per_byte * n
            rs = cost[3 * b + K_RS]
            cost[3 * b + K_AG], cost[3 * b + K_AR] = 0.0, rs
            kind[3 * b + K_AG], kind[3 * b + K_AR] = K_SKIP, K_RS
            self.shard_tail.append((b, self.step_s[b] + self.gather_s[b]))
        if self.shard_tail:
            self.prepare_s = cost_model.all_reduce(PREPARE_BYTES_PER_LAYER * self.profile.num_layers)
            if sh.clip_norm:
                self.clip_s = sum(cost_model.all_gather(self.wire_bytes[b]) for b, _ in self.shard_tail)
        self.shard_head = self.prepare_s + self.clip_s

    def executed_codes(self, codes: Sequence[int]) -> list[int]:
        """The op list the engine runs for ``codes``: unchanged without sharding; with it
        :func:`~lightning_pipedap.schedule.sharded_ops`' order: every gradient op in place (a sharded bucket's
        ``AR`` turned into its ``RS``, every ``AG`` dropped), then ``AG(b)`` of each sharded bucket in forward
        order. :meth:`period_codes` gives both lists the same period."""
        if self.sharding is None:
            return list(codes)
        sharded = self.sharded
        out = [c - 2 if c % 3 == K_AR and sharded[c // 3] else c for c in codes if c % 3 != K_AG]
        return out + [3 * b + K_AG for b, _ in self.shard_tail]

    # ------------------------------------------------------------ evaluation
    def period_codes(self, codes: Sequence[int]) -> float:
        """Steady-state iteration time (s) of the op list given as :func:`op_code` integers.

        The list is not validated (use :meth:`Schedule.validate`); an op list that leaves a bucket
        unreduced gives that bucket done-time 0 here.
        """
        # the effective kinds are literals here (0 K_RS, 1 K_AG, 2 K_AR, 3 K_SKIP): this loop is the planners' hot path
        cost, ready, kind = self.cost, self.ready, self.kind
        done = [0.0] * self.B
        if self.channels == 1:
            t = 0.0
            for c in codes:
                k = kind[c]
                if k == 1:
                    t += cost[c]
                    done[c // 3] = t
                elif k != 3:
                    b = c // 3
                    r = ready[b]
                    t = (t if t > r else r) + cost[c]
                    if k == 2:
                        done[b] = t
        else:
            rs_end = [0.0] * self.B
            free = [0.0, 0.0]
            chan = self.chan
            for c in codes:
                k = kind[c]
                if k == 3:
                    continue
                b = c // 3
                ch = chan[c]
                dep = rs_end[b] if k == 1 else ready[b]
                f = free[ch]
                e = (f if f > dep else dep) + cost[c]
                free[ch] = e
                if k == 0:
                    rs_end[b] = e
                else:
                    done[b] = e
            t = free[0] if free[0] > free[1] else free[1]
        if self.shard_tail:  # the sharded steps and parameter all-gathers, after every gradient op and the backward
            Tb = self.t_backward
            t = (t if t > Tb else Tb) + self.shard_head
            for b, d in self.shard_tail:
                t += d
                done[b] = t
        cur = self.t_backward
        for b, d in self.fast_steps:
            x = done[b]
            if x > cur:
                cur = x
            cur += d
        return cur

    def period(self, ops: Iterable[Op]) -> float:
        """Steady-state iteration time (s) of an op list (not validated)."""
        return self.period_codes([op_code(o) for o in ops])

    def run(self, ops: Sequence[Op],
            shard_out: list[Interval] | None = None) -> tuple[float, list[OpTiming], list[Interval]]:
        """Like :meth:`period` but returns ``(period, op timings, compute intervals)``.

        Times are in the iteration-origin frame (start of this iteration's forward = 0). The AG of
        a compressed bucket gets a zero-length timing at its channel's free time. The helper lane's
        intervals are :meth:`helper_intervals` (same frame, given the period).

        With sharding the timings are those of :meth:`executed_codes` of ``ops`` (the op list the engine runs), and
        ``shard_out``, when given, receives the sharded step's ``prepare``, ``gather_grads`` and ``step`` intervals
        (same frame) on the all-gathers' channel.
        """
        cost, ready, chan, kind = self.cost, self.ready, self.chan, self.kind
        done = [0.0] * self.B
        rs_end = [0.0] * self.B
        free = [0.0, 0.0]
        raw: list[tuple[Op, int, float, float]] = []
        extra: list[tuple[str, int | None, float, float]] = []
        codes = self.executed_codes([op_code(op) for op in ops])
        ntail = len(self.shard_tail)
        grad_ops = [code_op(c) for c in (codes[:-ntail] if ntail else codes)]
        for op in grad_ops:
            c = op_code(op)
            b, k = op.bucket, kind[c]
            ch = chan[c]
            if k == K_SKIP:
                raw.append((op, ch, free[ch], free[ch]))
                continue
            dep = rs_end[b] if k == K_AG else ready[b]
            s = max(free[ch], dep)
            e = s + cost[c]
            free[ch] = e
            if k == K_RS:
                rs_end[b] = e
            else:
                done[b] = e
            raw.append((op, ch, s, e))
        Tb = self.t_backward
        if ntail:
            ch = self.chan[K_AG]
            t = max(free[0], free[1], Tb)
            for what, b, d in ([("gather_grads", b, self.cost_model.all_gather(self.wire_bytes[b]))
                                for b, _ in self.shard_tail if self.sharding.clip_norm]
                               + [("prepare", None, self.prepare_s)]):  # (the engine's order: ShardedStep.prepare)
                extra.append((what, b, t, t + d))
                t += d
            for b, _ in self.shard_tail:
                extra.append(("step", b, t, t + self.step_s[b]))
                t += self.step_s[b]
                raw.append((Op(OpKind.ALL_GATHER, b), ch, t, t + self.gather_s[b]))
                t += self.gather_s[b]
                done[b] = t
        cur = Tb
        fwd: list[Interval] = []
        for b, u, d, lay in self.steps:
            if done[b] > cur:
                fwd.append(Interval("wait", cur - Tb, done[b] - Tb, b))
                cur = done[b]
            if u > 0:
                fwd.append(Interval("land" if self.sharded[b] else "update", cur - Tb, cur + u - Tb, b))
                cur += u
            fwd.append(Interval("forward", cur - Tb, cur + d - Tb, b, lay))
            cur += d
        P = cur
        shift = P - Tb  # anchor frame (backward start = 0) -> iteration-origin frame
        bwd: list[Interval] = []
        layers = self.profile.layers
        t = 0.0
        bucket_of = {i: b for b, bk in enumerate(self.buckets) for i in bk}
        for i in range(len(layers) - 1, -1, -1):
            bwd.append(Interval("backward", t + shift, t + layers[i].t_b + shift, bucket_of[i], (i,)))
            t += layers[i].t_b
        timings = [OpTiming(op, ch, s + shift, e + shift) for op, ch, s, e in raw]
        if shard_out is not None:
            shard_out.extend(Interval(what, s + shift, e + shift, b) for what, b, s, e in extra)
        return P, timings, fwd + bwd

    def helper_intervals(self, period: float) -> list[Interval]:
        """Helper-lane ``compress`` intervals in the iteration-origin frame of an iteration of ``period`` s."""
        shift = period - self.t_backward
        return [Interval("compress", s + shift, e + shift, b) for b, s, e in self.helper]


def check_flags(compressed: Sequence[bool] | None, num_buckets: int, compression: CompressionCost | None,
                num_layers: int, what: str = "compressed") -> tuple[bool, ...]:
    """Validate per-bucket flags (``what``: ``"compressed"`` or ``"wire16"``); return them as a tuple (all False
    for None). Compressed flags need a ``compression``; wire16 flags need nothing."""
    if compression is not None:
        if not isinstance(compression, CompressionCost):
            raise TypeError(f"compression must be a CompressionCost, got {type(compression).__name__}")
        compression.check_layers(num_layers)
    if compressed is None:
        return (False,) * num_buckets
    flags = tuple(compressed)
    if len(flags) != num_buckets:
        raise ValueError(f"{what} has {len(flags)} flags for {num_buckets} buckets; give one bool per bucket")
    if any(not isinstance(f, bool) for f in flags):
        raise ValueError(f"{what} flags must be bools, got {[f for f in flags if not isinstance(f, bool)][0]!r}")
    if what == "compressed" and any(flags) and compression is None:
        raise ValueError(f"buckets {[b for b, f in enumerate(flags) if f][:10]} are flagged compressed but no "
                         "compression cost was given; pass compression=CompressionCost(...)")
    return flags
