"""The schedule: plain data shared by the planners (producers) and the engine (consumer).

A :class:`Schedule` says two things for one training iteration:

* **tensor fusion** -- which parameters are fused into which bucket (``Schedule.buckets``), and
* **the op list** -- the order in which the communication worker issues reduce-scatter (RS),
  all-gather (AG) and fused all-reduce (AR) operations on those buckets (``Schedule.ops``).

Buckets are numbered in *forward order*: bucket 0 holds the parameters used first in the forward
pass, so its gradients are ready last in backward (WFBP order is ``B-1, ..., 0``). Parameters are
named by their index in the model's ordered list of trainable parameters (``param_index``).

**Tensor partitioning** (ByteScheduler, SOSP 2019; PipeDAP TETC 2025 §IV-C). A bucket holds *units*.
Without ``Schedule.pieces`` unit ``u`` is parameter ``u``, whole. With it, unit ``u`` is the element
range ``[start, stop)`` of one parameter, flattened: ``pieces[u] = (param, start, stop)``, so one large
parameter can be split over several buckets (on element boundaries) and its communication pipelined
with its neighbours'. A split parameter's gradient is complete for every piece at once (backward
produces it whole); its optimizer update runs once, when the last of its buckets (in forward order)
is applied, from the reduced pieces of all of them.

Execution semantics (what the engine guarantees, DeAR ICDCS 2023 §III, PipeDAP TETC 2025 §IV):

* ops run one at a time, in list order, identically on every rank;
* ``RS(b)`` and ``AR(b)`` first wait until every gradient of bucket ``b`` is complete;
* ``AG(b)`` needs ``RS(b)`` earlier in the list;
* bucket ``b``'s update is applied (forward pre-hook of the next iteration) once its ``AG`` or ``AR``
  has finished;
* a bucket flagged in ``Schedule.compressed`` (with a compression transport configured) is
  compressed by the helper process as soon as its gradients are complete (inline mode: by the
  worker at its slot), and its ``RS`` or ``AR`` slot communicates the payload and completes the
  bucket (its ``AG``, if listed, does nothing);
* a bucket flagged in ``Schedule.wire16`` travels in the engine's 16-bit wire format (its ``RS``
  and ``AG`` cast each piece in the send path and accumulate in fp32; its ``AR`` runs as that
  ``RS`` followed by that ``AG``), so it puts half the bytes of fp32 gradients on the wire.

Nothing here imports ``torch``; schedules are built and checked in pure Python. A schedule's plain-data
form (:meth:`Schedule.to_dict`, read back by :meth:`Schedule.from_dict`) is what checkpoints store and
what the what-if CLI writes and reads.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

#: ``format`` tag of :meth:`Schedule.to_dict`
SCHEDULE_FORMAT = "lightning_pipedap.schedule"
SCHEDULE_VERSION = 1
_DICT_KEYS = ("format", "version", "name", "buckets", "ops", "compressed", "predicted_iteration_s", "wire16", "pieces",
              "sharded")


class OpKind(str, enum.Enum):
    """Kind of a communication operation on one bucket."""

    REDUCE_SCATTER = "RS"
    ALL_GATHER = "AG"
    ALL_REDUCE = "AR"


@dataclass(frozen=True)
class Op:
    """One communication operation of the op list.

    Attributes:
        kind: RS, AG or AR.
        bucket: index of the bucket in ``Schedule.buckets`` (forward order).
    """

    kind: OpKind
    bucket: int

    def __str__(self) -> str:  # compact form used in logs and error messages: "RS3"
        return f"{self.kind.value}{self.bucket}"


@dataclass(frozen=True)
class Schedule:
    """Tensor fusion plus ordered op list for one iteration.

    Attributes:
        buckets: ``buckets[b]`` is the tuple of unit indices fused into bucket ``b`` (a unit is a parameter
            index when ``pieces`` is None); buckets are listed in forward order and partition the units.
        ops: the ordered op list executed by the communication worker of every rank.
        name: the planner that produced it (``"allreduce"``, ``"dear"``, ...), for logs.
        predicted_iteration_s: the planner's predicted steady-state iteration time in seconds,
            or ``None`` when the planner made no prediction.
        compressed: ``compressed[b]`` is True when bucket ``b`` goes through gradient compression
            (one flag per bucket), or ``None``: no bucket is compressed. A compressed bucket is
            reduced in the slot of its ``RS``/``AR`` op; planners give it a single ``AR``.
        wire16: ``wire16[b]`` is True when bucket ``b``'s dense ops use the 16-bit wire format
            (``wire_dtype`` of the strategy), or ``None``: every bucket travels in its own dtype. A
            bucket is never both compressed and ``wire16``.
        pieces: ``pieces[u] = (param, start, stop)``: unit ``u`` is elements ``[start, stop)`` of parameter
            ``param`` flattened (a whole parameter is ``(param, 0, numel)``); or ``None``: unit ``u`` is
            parameter ``u``. A parameter's pieces are consecutive, non-overlapping ranges from 0 to its numel,
            listed in element order. A compressed bucket holds no piece of a split parameter.
        sharded: whether the engine steps the optimizer sharded with this schedule (``shard_optimizer``; a
            candidate of ``shard_optimizer="auto"``), or ``None``: as the strategy is configured.

    Raises:
        ValueError: from :meth:`validate` when the op list is not executable.
    """

    buckets: tuple[tuple[int, ...], ...]
    ops: tuple[Op, ...]
    name: str = "custom"
    predicted_iteration_s: float | None = None
    compressed: tuple[bool, ...] | None = None
    wire16: tuple[bool, ...] | None = None
    pieces: tuple[tuple[int, int, int], ...] | None = None
    sharded: bool | None = None

    @property
    def num_units(self) -> int:
        """Number of units the buckets partition (``len(pieces)``, or the number of parameters named)."""
        if self.pieces is not None:
            return len(self.pieces)
        return sum(len(b) for b in self.buckets)

    def unit_param(self, u: int) -> int:
        """The parameter index of unit ``u``."""
        return u if self.pieces is None else self.pieces[u][0]

    def split_params(self) -> dict[int, tuple[int, ...]]:
        """``{param: (unit, ...)}`` for every parameter split into more than one piece (element order)."""
        if self.pieces is None:
            return {}
        units: dict[int, list[int]] = {}
        for u, (p, _, _) in enumerate(self.pieces):
            units.setdefault(p, []).append(u)
        return {p: tuple(us) for p, us in units.items() if len(us) > 1}

    def is_wire16(self, b: int) -> bool:
        """Whether bucket ``b`` travels in the 16-bit wire format (False for every bucket when ``wire16`` is None)."""
        return self.wire16 is not None and bool(self.wire16[b])

    @property
    def num_wire16(self) -> int:
        """Number of buckets in the 16-bit wire format."""
        return 0 if self.wire16 is None else sum(1 for w in self.wire16 if w)

    def is_compressed(self, b: int) -> bool:
        """Whether bucket ``b`` is compressed (False for every bucket when ``compressed`` is None)."""
        return self.compressed is not None and bool(self.compressed[b])

    @property
    def num_compressed(self) -> int:
        """Number of compressed buckets."""
        return 0 if self.compressed is None else sum(1 for c in self.compressed if c)

    def validate(self, num_params: int | None = None, numels: Sequence[int] | None = None) -> "Schedule":
        """Check that the schedule is executable; return ``self``.

        Checks: buckets are non-empty and partition the units (``range(num_params)`` when ``pieces`` is None
        and ``num_params`` is given); ``pieces``, when given, cover each of ``range(num_params)`` with
        consecutive ranges from 0 (to ``numels[p]`` elements when ``numels`` is given) and no compressed
        bucket holds a piece of a split parameter; every bucket is reduced exactly once, either by one ``AR``
        or by one ``RS`` followed later by one ``AG``; ``compressed``, when given, holds one bool per bucket.

        Raises:
            ValueError: naming the first offending bucket, piece or op.
        """
        if self.pieces is not None:
            self._validate_pieces(num_params, numels)
            num_params = len(self.pieces)
        seen: set[int] = set()
        for b, params in enumerate(self.buckets):
            if not params:
                raise ValueError(f"bucket {b} is empty; every bucket needs at least one parameter")
            dup = seen.intersection(params)
            if dup:
                raise ValueError(f"parameters {sorted(dup)} appear in more than one bucket (bucket {b})")
            seen.update(params)
        if num_params is not None and seen != set(range(num_params)):
            missing = sorted(set(range(num_params)) - seen)
            extra = sorted(seen - set(range(num_params)))
            what = "units (pieces)" if self.pieces is not None else "trainable parameters"
            raise ValueError(
                f"buckets must partition the {num_params} {what}; "
                f"missing {missing[:10]}, out of range {extra[:10]}"
            )
        for key, flags, none in (("compressed", self.compressed, "nothing compressed"),
                                 ("wire16", self.wire16, "no bucket in the 16-bit wire format")):
            if flags is None:
                continue
            if len(flags) != len(self.buckets):
                raise ValueError(f"{key} has {len(flags)} flags for {len(self.buckets)} buckets; "
                                 f"give one bool per bucket (or None: {none})")
            bad = [f for f in flags if not isinstance(f, bool)]
            if bad:
                raise ValueError(f"{key} flags must be bools, got {bad[0]!r}")
        both = [b for b in range(len(self.buckets)) if self.is_wire16(b) and self.is_compressed(b)]
        if both:
            raise ValueError(f"buckets {both[:10]} are flagged both compressed and wire16; a compressed bucket "
                             "sends its compressor's payload, so flag it one or the other")
        if self.pieces is not None and self.compressed is not None:
            split = {u for us in self.split_params().values() for u in us}
            bad = [b for b, bk in enumerate(self.buckets) if self.is_compressed(b) and split.intersection(bk)]
            if bad:
                raise ValueError(f"compressed buckets {bad[:10]} hold pieces of a split parameter; a compressor "
                                 "works on whole parameters, so keep split parameters in uncompressed buckets")
        state: dict[int, str] = {}
        for op in self.ops:
            if not 0 <= op.bucket < len(self.buckets):
                raise ValueError(f"op {op} names bucket {op.bucket}; valid buckets are 0..{len(self.buckets) - 1}")
            prev = state.get(op.bucket)
            if op.kind is OpKind.ALL_REDUCE and prev is None:
                state[op.bucket] = "done"
            elif op.kind is OpKind.REDUCE_SCATTER and prev is None:
                state[op.bucket] = "rs"
            elif op.kind is OpKind.ALL_GATHER and prev == "rs":
                state[op.bucket] = "done"
            else:
                raise ValueError(f"op {op} is not valid after {prev or 'nothing'} on bucket {op.bucket}")
        unfinished = [b for b in range(len(self.buckets)) if state.get(b) != "done"]
        if unfinished:
            raise ValueError(f"buckets {unfinished} are never fully reduced (need AR, or RS then AG)")
        return self

    def _validate_pieces(self, num_params: int | None, numels: Sequence[int] | None) -> None:
        pieces = self.pieces or ()
        by_param: dict[int, list[tuple[int, int, int]]] = {}
        for u, piece in enumerate(pieces):
            if not (isinstance(piece, tuple) and len(piece) == 3 and all(_is_int(v) for v in piece)):
                raise ValueError(f"pieces[{u}] must be a (param, start, stop) triple of ints, got {piece!r}")
            p, start, stop = piece
            if p < 0 or not (0 <= start < stop or start == stop == 0):
                raise ValueError(f"pieces[{u}] = {piece}: need param >= 0 and 0 <= start < stop (or (param, 0, 0), "
                                 "the one piece of a parameter without elements)")
            by_param.setdefault(p, []).append((start, stop, u))
        if num_params is None:
            num_params = len(numels) if numels is not None else (max(by_param) + 1 if by_param else 0)
        if numels is not None and len(numels) != num_params:
            raise ValueError(f"numels has {len(numels)} entries for {num_params} parameters")
        missing = sorted(set(range(num_params)) - set(by_param))
        extra = sorted(set(by_param) - set(range(num_params)))
        if missing or extra:
            raise ValueError(f"pieces must cover the {num_params} trainable parameters; "
                             f"missing {missing[:10]}, out of range {extra[:10]}")
        for p, ranges in by_param.items():
            if [u for _, _, u in ranges] != sorted(u for _, _, u in ranges) or sorted(ranges) != ranges:
                raise ValueError(f"the pieces of parameter {p} must be listed in element order")
            if len(ranges) > 1 and any(start == stop for start, stop, _ in ranges):
                raise ValueError(f"parameter {p} has an empty piece among {len(ranges)}; only a parameter without "
                                 "elements has one, and it is its only piece")
            end = 0
            for start, stop, u in ranges:
                if start != end:
                    raise ValueError(f"pieces[{u}] of parameter {p} starts at element {start}; the previous piece "
                                     f"ends at {end} (pieces are consecutive, non-overlapping ranges from 0)")
                end = stop
            if numels is not None and end != numels[p]:
                raise ValueError(f"the pieces of parameter {p} end at element {end}; it has {numels[p]} elements")

    def to_dict(self) -> dict[str, Any]:
        """The schedule as plain JSON-able data (format ``lightning_pipedap.schedule`` version 1).

        Keys: ``format``, ``version``, ``name``; ``buckets`` (a list of index lists); ``ops`` (a list
        of ``[kind, bucket]`` pairs, kind ``"RS"``, ``"AG"`` or ``"AR"``); ``compressed`` (a list of
        bools, or ``None``); ``predicted_iteration_s`` (seconds, or ``None``); ``wire16`` (a list of
        bools, or ``None``; left out by readers older than it, which then send every bucket in fp32);
        ``pieces`` (a list of ``[param, start, stop]`` triples, or ``None``: buckets name whole parameters);
        ``sharded`` (a bool, or ``None``: as configured; left out when ``None``, for readers older than it).
        """
        return {
            "format": SCHEDULE_FORMAT, "version": SCHEDULE_VERSION, "name": self.name,
            "buckets": [list(b) for b in self.buckets], "ops": [[op.kind.value, op.bucket] for op in self.ops],
            "compressed": None if self.compressed is None else list(self.compressed),
            "predicted_iteration_s": self.predicted_iteration_s,
            "wire16": None if self.wire16 is None else list(self.wire16),
            "pieces": None if self.pieces is None else [list(pc) for pc in self.pieces],
        } | ({} if self.sharded is None else {"sharded": self.sharded})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Schedule":
        """Inverse of :meth:`to_dict`; the result is validated (:meth:`validate`, without a parameter count).

        ``name`` (default ``"custom"``), ``compressed``, ``predicted_iteration_s`` and ``wire16`` (default
        ``None``) may be left out.

        Raises:
            ValueError: naming the offending key and value: not a dict, another format tag or version,
                an unknown or missing key, a bucket that is not a list of ints >= 0, an op that is not a
                ``[kind, bucket]`` pair, a flag that is not a bool, a negative or non-finite prediction;
                or an op list that :meth:`validate` rejects.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a schedule is a dict with keys {list(_DICT_KEYS)}, got {type(data).__name__}")
        if data.get("format") != SCHEDULE_FORMAT:
            raise ValueError(f"not a schedule: format is {data.get('format')!r}, expected {SCHEDULE_FORMAT!r}")
        if data.get("version") != SCHEDULE_VERSION:
            raise ValueError(f"unsupported schedule version {data.get('version')!r}; valid: {SCHEDULE_VERSION}")
        unknown = sorted(set(data) - set(_DICT_KEYS))
        if unknown:
            raise ValueError(f"unknown schedule keys {unknown}; valid: {list(_DICT_KEYS)}")
        missing = [k for k in ("buckets", "ops") if k not in data]
        if missing:
            raise ValueError(f"schedule lacks {missing}")
        return cls(
            buckets=_buckets_from(data["buckets"]), ops=_ops_from(data["ops"]),
            name=_name_from(data.get("name", "custom")),
            predicted_iteration_s=_prediction_from(data.get("predicted_iteration_s")),
            compressed=_flags_from(data.get("compressed")),
            wire16=_flags_from(data.get("wire16"), "wire16"),
            pieces=_pieces_from(data.get("pieces")),
            sharded=_sharded_from(data.get("sharded")),
        ).validate()

    def describe(self) -> str:
        """One line: name, bucket count and the op list, e.g. ``dear: 3 buckets: RS2 RS1 RS0 AG0 AG1 AG2``.

        Ops on compressed buckets carry a ``C`` prefix, ops on 16-bit wire buckets an ``H`` prefix, and
        the counts follow the bucket count, e.g. ``optimal: 3 buckets (2 compressed): CAR2 CAR1 AR0``
        (split parameters: ``(4 pieces of 2 split parameters)``).
        """
        n, h, sp = self.num_compressed, self.num_wire16, self.split_params()
        counts = [f"{n} compressed"] * bool(n) + [f"{h} wire16"] * bool(h)
        counts += [f"{sum(len(us) for us in sp.values())} pieces of {len(sp)} split parameters"] * bool(sp)
        head = f"{self.name}: {len(self.buckets)} buckets" + (f" ({', '.join(counts)})" if counts else "")
        return head + ": " + " ".join(("C" if self.is_compressed(o.bucket) else "H" if self.is_wire16(o.bucket) else "")
                                      + str(o) for o in self.ops)


def _sharded_from(value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"sharded must be true, false or null, got {value!r}")
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _buckets_from(value: Any) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"buckets must be a list of buckets (lists of parameter indices), got {value!r}")
    for b, bk in enumerate(value):
        if not isinstance(bk, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in bk):
            raise ValueError(f"buckets[{b}] must be a list of parameter indices (ints >= 0), got {bk!r}")
    return tuple(tuple(bk) for bk in value)


def _ops_from(value: Any) -> tuple[Op, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"ops must be a list of [kind, bucket] pairs, got {value!r}")
    kinds = [k.value for k in OpKind]
    ops = []
    for i, op in enumerate(value):
        if not (isinstance(op, (list, tuple)) and len(op) == 2 and op[0] in kinds and _is_int(op[1])):
            raise ValueError(f"ops[{i}] must be a [kind, bucket] pair with kind one of {kinds} and an int bucket, "
                             f"got {op!r}")
        ops.append(Op(OpKind(op[0]), op[1]))
    return tuple(ops)


def _pieces_from(value: Any) -> tuple[tuple[int, int, int], ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"pieces must be a list of [param, start, stop] triples or null, got {value!r}")
    for u, pc in enumerate(value):
        if not (isinstance(pc, (list, tuple)) and len(pc) == 3 and all(_is_int(v) for v in pc)):
            raise ValueError(f"pieces[{u}] must be a [param, start, stop] triple of ints, got {pc!r}")
    return tuple(tuple(pc) for pc in value)


def _name_from(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"name must be a string, got {value!r}")
    return value


def _prediction_from(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"predicted_iteration_s must be a finite number >= 0 (seconds) or null, got {value!r}")
    return float(value)


def _flags_from(value: Any, key: str = "compressed") -> tuple[bool, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{key} must be a list of bools (one per bucket) or null, got {value!r}")
    for b, f in enumerate(value):
        if not isinstance(f, bool):
            raise ValueError(f"{key}[{b}] must be true or false, got {f!r}")
    return tuple(value)


def sharded_ops(schedule: Schedule, compressed: bool = True) -> Schedule:
    """``schedule`` for the sharded optimizer step (``shard_optimizer``): every gradient op in its place, an
    uncompressed bucket's ``AR`` turned into an ``RS`` (each rank steps its shard), then one ``AG`` per
    uncompressed bucket in forward order (the order of first use in the next forward). The step of a shard needs
    the whole step's used flags, clip factor and non-finite verdict, so every gradient op comes before the first
    ``AG``. ``compressed``: whether the flagged buckets are compressed (they keep their single reduction op).
    Pure: the fusion and the flags are kept."""
    def kept(b: int) -> bool:
        return compressed and schedule.is_compressed(b)

    grads = [Op(OpKind.REDUCE_SCATTER, op.bucket) if op.kind is OpKind.ALL_REDUCE and not kept(op.bucket) else op
             for op in schedule.ops if op.kind is not OpKind.ALL_GATHER]
    gathers = [Op(OpKind.ALL_GATHER, b) for b in range(len(schedule.buckets)) if not kept(b)]
    return replace(schedule, ops=tuple(grads + gathers))


def allreduce_ops(num_buckets: int) -> tuple[Op, ...]:
    """WFBP op list: one all-reduce per bucket in gradient-ready order ``B-1, ..., 0``."""
    return tuple(Op(OpKind.ALL_REDUCE, b) for b in reversed(range(num_buckets)))


def dear_ops(num_buckets: int) -> tuple[Op, ...]:
    """DeAR op list (Zhang et al., ICDCS 2023): RS in backward order, then AG in forward order.

    ``RS(B-1) ... RS(0) AG(0) ... AG(B-1)``: the all-gathers overlap the next forward pass.
    """
    rs = tuple(Op(OpKind.REDUCE_SCATTER, b) for b in reversed(range(num_buckets)))
    ag = tuple(Op(OpKind.ALL_GATHER, b) for b in range(num_buckets))
    return rs + ag


def fuse_by_size(
    sizes_bytes: Sequence[int], cap_bytes: int, keys: Sequence[object] | None = None
) -> tuple[tuple[int, ...], ...]:
    """Greedy tensor fusion of consecutive parameters (forward order) up to ``cap_bytes`` each.

    Args:
        sizes_bytes: size in bytes of each parameter, in forward order.
        cap_bytes: bucket size cap in bytes (> 0); a parameter larger than the cap gets its own bucket.
        keys: optional per-parameter key (for example the dtype); a new bucket starts where it changes.

    Returns:
        Buckets as tuples of parameter indices, in forward order.

    Raises:
        ValueError: if ``cap_bytes`` is not positive.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    buckets: list[tuple[int, ...]] = []
    cur: list[int] = []
    cur_bytes = 0
    for i, s in enumerate(sizes_bytes):
        if cur and (cur_bytes + s > cap_bytes or (keys is not None and keys[i] != keys[cur[-1]])):
            buckets.append(tuple(cur))
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += s
    if cur:
        buckets.append(tuple(cur))
    return tuple(buckets)


BUILTIN_SCHEDULES = ("allreduce", "dear")


def builtin_schedule(
    name: str, sizes_bytes: Sequence[int], cap_bytes: int, keys: Sequence[object] | None = None,
    compress_all: bool = False, wire16_all: bool = False,
) -> Schedule:
    """Build one of the fixed-order schedules (``"allreduce"`` or ``"dear"``) with greedy fusion.

    ``compress_all``: flag every bucket compressed (the fixed schedules compress every bucket
    when compression is configured); otherwise ``compressed`` is None. ``wire16_all``: flag every
    bucket that is not compressed for the 16-bit wire format (the fixed schedules use it everywhere).

    Raises:
        ValueError: for an unknown ``name`` (the message lists the valid names).
    """
    buckets = fuse_by_size(sizes_bytes, cap_bytes, keys)
    if name == "allreduce":
        ops = allreduce_ops(len(buckets))
    elif name == "dear":
        ops = dear_ops(len(buckets))
    else:
        raise ValueError(f"unknown fixed schedule {name!r}; valid: 'allreduce', 'dear'")
    compressed = (True,) * len(buckets) if compress_all else None
    wire16 = (True,) * len(buckets) if wire16_all and not compress_all else None
    return Schedule(buckets=buckets, ops=ops, name=name, compressed=compressed,
                    wire16=wire16).validate(len(sizes_bytes))


def expand_layers(schedule: Schedule, layers: Sequence[Sequence[int]],
                  keys: Sequence[object] | None = None) -> Schedule:
    """Turn a schedule over *layers* into one over *parameters*, splitting buckets where ``keys`` change.

    Planners fuse layers (groups of parameters); the engine needs parameter indices and buckets of
    one dtype/device. A bucket whose parameters have several keys becomes several consecutive
    buckets, and each op on it becomes the same op on each part, in place.

    Args:
        schedule: buckets as tuples of layer indices.
        layers: ``layers[k]`` = parameter indices of layer ``k``.
        keys: optional per-parameter key (for example ``(dtype, device)``).

    Returns:
        The expanded, validated schedule (same name and prediction); every part of a compressed
        (16-bit wire) bucket is compressed (16-bit wire).
    """
    parts: list[list[tuple[int, ...]]] = []
    for bucket in schedule.buckets:
        params = [i for k in bucket for i in layers[k]]
        groups: list[list[int]] = []
        for i in params:
            if groups and (keys is None or keys[i] == keys[groups[-1][-1]]):
                groups[-1].append(i)
            else:
                groups.append([i])
        parts.append([tuple(g) for g in groups])
    n = sum(len(layer_params) for layer_params in layers)
    return split_buckets(schedule, parts, n)


def split_buckets(schedule: Schedule, parts: Sequence[Sequence[tuple[int, ...]]], num_params: int,
                  numels: Sequence[int] | None = None,
                  pieces: tuple[tuple[int, int, int], ...] | None = None) -> Schedule:
    """``schedule`` with bucket ``b`` replaced by the consecutive buckets ``parts[b]`` (tuples of unit indices).

    Each op on ``b`` becomes the same op on each of its parts, in place: reductions in backward order (the last
    part is ready first), gathers in forward order; every part of a compressed (16-bit wire) bucket is compressed
    (16-bit wire). The result (same name and prediction, ``pieces`` as given) is validated with
    ``validate(num_params, numels)``.
    """
    new_index: list[list[int]] = []
    buckets: list[tuple[int, ...]] = []
    for groups in parts:
        new_index.append(list(range(len(buckets), len(buckets) + len(groups))))
        buckets.extend(tuple(g) for g in groups)
    ops = tuple(Op(op.kind, nb) for op in schedule.ops
                for nb in (new_index[op.bucket] if op.kind is OpKind.ALL_GATHER else reversed(new_index[op.bucket])))

    def per_part(flags: tuple[bool, ...] | None) -> tuple[bool, ...] | None:
        return None if flags is None else tuple(bool(flags[b]) for b, groups in enumerate(parts) for _ in groups)

    return Schedule(tuple(buckets), ops, schedule.name, schedule.predicted_iteration_s, per_part(schedule.compressed),
                    per_part(schedule.wire16), pieces).validate(num_params, numels)
