"""Per-step operation timeline: records, exposed communication, overlap ratio, Chrome trace, Gantt chart.

An :class:`OpRecord` is one interval on one *lane* of one rank: compute (forward, backward, update),
communication (reduce-scatter RS, all-gather AG, all-reduce AR) or compression (compress, decompress,
possibly in a helper process). Times are host ``time.perf_counter()`` seconds of the same process.

Definitions (DeAR ICDCS'23 and PipeDAP TETC'25 measure iteration time as compute plus the
communication that is *not* hidden behind compute):

* **communication time** ``T_comm`` = length of the union of the communication intervals;
* **busy compute** = union of the compute intervals (forward, backward, update) minus the union of
  ``wait`` intervals (the training thread blocked on communication inside a compute phase);
* **exposed communication** = length of (union of communication) minus (union of communication
  intersected with busy compute) -- the time when the network works and compute does not;
* **overlap ratio** = 1 - exposed / ``T_comm`` (1: fully hidden, 0: fully exposed).

Unions are used so that concurrent operations on one lane are not counted twice. All functions here
are pure Python over lists of records.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Optional, Sequence

KINDS = ("RS", "AG", "AR", "compress", "decompress", "forward", "backward", "update", "wait")
LANES = ("compute", "comm", "compress")
COMM_KINDS = ("RS", "AG", "AR")
COMPUTE_KINDS = ("forward", "backward", "update")
COMPRESS_KINDS = ("compress", "decompress")
#: the training thread blocked on communication (e.g. waiting for an all-gather in a forward pre-hook);
#: subtracted from compute, because a stalled forward hides nothing
WAIT_KIND = "wait"
_LANE_OF_KIND = {**{k: "comm" for k in COMM_KINDS}, **{k: "compute" for k in COMPUTE_KINDS},
                 **{k: "compress" for k in COMPRESS_KINDS}, WAIT_KIND: "compute"}

Interval = tuple[float, float]


@dataclass
class OpRecord:
    """One timed operation of a training step on one rank.

    Attributes:
        name: display name, e.g. ``"RS3"``, ``"forward"``.
        kind: one of :data:`KINDS` (``"RS"``, ``"AG"``, ``"AR"``, ``"compress"``, ``"decompress"``,
            ``"forward"``, ``"backward"``, ``"update"``, ``"wait"``: the training thread blocked on
            communication, which is not compute).
        bucket: bucket index (forward order) for per-bucket operations, else ``None``.
        start_s, end_s: ``time.perf_counter()`` seconds; ``end_s >= start_s``.
        lane: ``"compute"``, ``"comm"`` or ``"compress"`` (see :func:`lane_of_kind` for the usual one).

    Raises:
        ValueError: unknown ``kind`` or ``lane``, ``end_s < start_s``, or a non-integer ``bucket``.
    """

    name: str
    kind: str
    bucket: Optional[int]
    start_s: float
    end_s: float
    lane: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"OpRecord {self.name!r}: kind={self.kind!r}; valid choices: {KINDS}")
        if self.lane not in LANES:
            raise ValueError(f"OpRecord {self.name!r}: lane={self.lane!r}; valid choices: {LANES}")
        if self.bucket is not None and (isinstance(self.bucket, bool) or not isinstance(self.bucket, int)):
            raise ValueError(f"OpRecord {self.name!r}: bucket={self.bucket!r} must be an int or None")
        if not self.end_s >= self.start_s:
            raise ValueError(f"OpRecord {self.name!r}: end_s={self.end_s} < start_s={self.start_s}")

    @property
    def duration_s(self) -> float:
        """``end_s - start_s`` in seconds."""
        return self.end_s - self.start_s


def lane_of_kind(kind: str) -> str:
    """The usual lane of ``kind``: RS/AG/AR -> comm, compress/decompress -> compress, else compute
    (forward, backward, update, wait).

    Raises:
        ValueError: unknown ``kind``.
    """
    try:
        return _LANE_OF_KIND[kind]
    except KeyError:
        raise ValueError(f"kind={kind!r}; valid choices: {KINDS}") from None


def as_op_records(items: Iterable[Any]) -> list[OpRecord]:
    """Normalise a strategy's timeline to :class:`OpRecord`.

    Accepts :class:`OpRecord` as is, and op-timing objects with attributes ``op`` (having ``kind``,
    an enum whose ``value`` or a string is ``"RS"``/``"AG"``/``"AR"``, and ``bucket``), ``start_s``
    and ``end_s`` (the engine's ``OpTiming``), which become records on lane ``"comm"``.

    Raises:
        TypeError: an item is neither.
    """
    out: list[OpRecord] = []
    for it in items:
        if isinstance(it, OpRecord):
            out.append(it)
            continue
        op = getattr(it, "op", None)
        if op is None or not hasattr(it, "start_s") or not hasattr(it, "end_s"):
            raise TypeError(f"timeline item {it!r} is neither an OpRecord nor an op timing (op, start_s, end_s)")
        kind = getattr(op.kind, "value", op.kind)
        bucket = getattr(op, "bucket", None)
        name = f"{kind}{bucket}" if bucket is not None else str(kind)
        out.append(OpRecord(name, str(kind), bucket, float(it.start_s), float(it.end_s), lane_of_kind(str(kind))))
    return out


# ------------------------------------------------------------------------------------ interval math
def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Merge intervals into a sorted list of disjoint ``(start, end)`` pairs (touching ones merge)."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def total_length(intervals: Iterable[Interval]) -> float:
    """Length of the union of ``intervals`` (same unit as the inputs)."""
    return sum(e - s for s, e in union(intervals))


def intersection_length(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """Length of ``union(a) ∩ union(b)``."""
    ua, ub = union(a), union(b)
    i = j = 0
    total = 0.0
    while i < len(ua) and j < len(ub):
        lo = max(ua[i][0], ub[j][0])
        hi = min(ua[i][1], ub[j][1])
        if hi > lo:
            total += hi - lo
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """``union(a)`` minus ``union(b)`` as sorted disjoint intervals."""
    out: list[Interval] = []
    ub = union(b)
    for s, e in union(a):
        cur = s
        for bs, be in ub:
            if be <= cur or bs >= e:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
            if cur >= e:
                break
        if cur < e:
            out.append((cur, e))
    return out


def _busy_compute(records: list[OpRecord], compute_kinds: Sequence[str], window: Optional[Interval]) -> list[Interval]:
    return subtract(_intervals(records, compute_kinds, window), _intervals(records, (WAIT_KIND,), window))


def _intervals(records: Iterable[OpRecord], kinds: Sequence[str], window: Optional[Interval]) -> list[Interval]:
    out = []
    for r in records:
        if r.kind not in kinds:
            continue
        s, e = r.start_s, r.end_s
        if window is not None:
            s, e = max(s, window[0]), min(e, window[1])
        if e > s:
            out.append((s, e))
    return out


def communication_ms(records: Iterable[OpRecord], kinds: Sequence[str] = COMM_KINDS,
                     window: Optional[Interval] = None) -> float:
    """Length (ms) of the union of the records of ``kinds`` (default RS/AG/AR), clipped to ``window``."""
    return 1000.0 * total_length(_intervals(records, kinds, window))


def compute_ms(records: Iterable[OpRecord], kinds: Sequence[str] = COMPUTE_KINDS,
               window: Optional[Interval] = None) -> float:
    """Busy compute time (ms): union of the ``kinds`` records minus the ``wait`` records, in ``window``."""
    return 1000.0 * total_length(_busy_compute(list(records), kinds, window))


def exposed_communication_ms(
    records: Iterable[OpRecord],
    comm_kinds: Sequence[str] = COMM_KINDS,
    compute_kinds: Sequence[str] = COMPUTE_KINDS,
    window: Optional[Interval] = None,
) -> float:
    """Communication time (ms) not overlapped by compute.

    ``|U_comm| - |U_comm ∩ (U_compute - U_wait)|`` where ``U_x`` is the union of the intervals of
    kinds ``x``, optionally clipped to ``window = (start_s, end_s)``. Pass
    ``comm_kinds=COMPRESS_KINDS`` for the exposed compression time.
    """
    records = list(records)
    comm = _intervals(records, comm_kinds, window)
    comp = _busy_compute(records, compute_kinds, window)
    return 1000.0 * (total_length(comm) - intersection_length(comm, comp))


def overlap_ratio(
    records: Iterable[OpRecord],
    comm_kinds: Sequence[str] = COMM_KINDS,
    compute_kinds: Sequence[str] = COMPUTE_KINDS,
    window: Optional[Interval] = None,
) -> Optional[float]:
    """Fraction of communication time hidden behind compute, in [0, 1]; ``None`` without communication."""
    records = list(records)
    comm = _intervals(records, comm_kinds, window)
    t = total_length(comm)
    if t <= 0.0:
        return None
    return intersection_length(comm, _busy_compute(records, compute_kinds, window)) / t


# ----------------------------------------------------------------------------------------- exports
def chrome_trace(records: Iterable[OpRecord], rank: int = 0, origin_s: Optional[float] = None) -> dict[str, Any]:
    """Chrome trace-event JSON object (loads in Perfetto / ``chrome://tracing``).

    One complete event (``"ph": "X"``) per record, ``pid`` = rank, ``tid`` = lane (0 compute, 1 comm,
    2 compress, named by metadata events); ``ts``/``dur`` in µs relative to ``origin_s`` (default:
    the earliest start). ``args`` hold ``bucket``, ``kind`` and the absolute ``start_s``.
    """
    records = list(records)
    if origin_s is None:
        origin_s = min((r.start_s for r in records), default=0.0)
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
    ]
    for tid, lane in enumerate(LANES):
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}})
    for r in sorted(records, key=lambda r: (r.start_s, r.end_s)):
        events.append({
            "name": r.name, "cat": r.kind, "ph": "X", "pid": rank, "tid": LANES.index(r.lane),
            "ts": (r.start_s - origin_s) * 1e6, "dur": r.duration_s * 1e6,
            "args": {"kind": r.kind, "bucket": r.bucket, "start_s": r.start_s},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(records: Iterable[OpRecord], path: str, rank: int = 0,
                       origin_s: Optional[float] = None) -> str:
    """Write :func:`chrome_trace` to ``path`` (parent folders created); return the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(chrome_trace(records, rank, origin_s), f)
    return path


def records_from_chrome_trace(trace: dict[str, Any]) -> list[OpRecord]:
    """Inverse of :func:`chrome_trace` for its complete events (absolute times from ``args.start_s``)."""
    out = []
    for ev in trace["traceEvents"]:
        if ev.get("ph") != "X":
            continue
        start = ev["args"]["start_s"]
        out.append(OpRecord(ev["name"], ev["args"]["kind"], ev["args"]["bucket"], start,
                            start + ev["dur"] / 1e6, LANES[ev["tid"]]))
    return out


_COLORS = {"forward": "#4c72b0", "backward": "#55a868", "update": "#8172b2", "RS": "#dd8452",
           "AG": "#c44e52", "AR": "#937860", "compress": "#da8bc3", "decompress": "#8c8c8c",
           "wait": "#ffffff"}


def gantt_figure(records: Iterable[OpRecord], title: str = "", origin_s: Optional[float] = None):
    """A matplotlib ``Figure`` (Agg canvas, no pyplot state): one row per lane, times in ms.

    Returns:
        ``matplotlib.figure.Figure`` with a ``FigureCanvasAgg`` attached.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    records = list(records)
    if origin_s is None:
        origin_s = min((r.start_s for r in records), default=0.0)
    fig = Figure(figsize=(10, 2.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    lanes = list(LANES)
    for r in records:
        y = lanes.index(r.lane)
        x0 = (r.start_s - origin_s) * 1000.0
        wait = r.kind == WAIT_KIND  # drawn hatched on top of the compute phase it interrupts
        ax.broken_barh([(x0, max(r.duration_s * 1000.0, 1e-6))], (y - 0.4, 0.8), facecolors=_COLORS[r.kind],
                       edgecolor="black", linewidth=0.3, hatch="///" if wait else None, zorder=3 if wait else 2)
        if r.bucket is not None:
            ax.text(x0, y, r.name, fontsize=6, va="center", ha="left", clip_on=True)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(lanes)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_xlabel("time since step start (ms)")
    ax.invert_yaxis()
    used = [k for k in KINDS if any(r.kind == k for r in records)]
    if used:
        ax.legend(handles=[Patch(color=_COLORS[k], label=k) for k in used], fontsize=6, ncol=len(used),
                  loc="upper right", framealpha=0.7)
    if title:
        ax.set_title(title, fontsize=8)
    fig.tight_layout()
    return fig


def gantt_png(records: Iterable[OpRecord], path: str, title: str = "", origin_s: Optional[float] = None) -> str:
    """Render :func:`gantt_figure` to a PNG file at ``path``; return the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    gantt_figure(records, title, origin_s).savefig(path, format="png")
    return path


def gantt_rgb(records: Iterable[OpRecord], title: str = "", origin_s: Optional[float] = None):
    """Render :func:`gantt_figure` to an ``uint8`` numpy array of shape ``(H, W, 3)`` (for TensorBoard)."""
    import numpy as np

    fig = gantt_figure(records, title, origin_s)
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def to_dicts(records: Iterable[OpRecord]) -> list[dict[str, Any]]:
    """Records as plain dicts (for JSON or callback state)."""
    return [asdict(r) for r in records]
