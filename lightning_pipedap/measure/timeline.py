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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

if TYPE_CHECKING:
    from lightning_pipedap.schedule import Op

KINDS = ("RS", "AG", "AR", "compress", "decompress", "forward", "backward", "update", "wait", "step")
LANES = ("compute", "comm", "compress")
COMM_KINDS = ("RS", "AG", "AR")
COMPUTE_KINDS = ("forward", "backward", "update")
COMPRESS_KINDS = ("compress", "decompress")
#: the sharded optimizer step of one bucket's shard (``shard_optimizer``), run by the communication worker
STEP_KIND = "step"
#: the training thread blocked on communication (e.g. waiting for an all-gather in a forward pre-hook);
#: subtracted from compute, because a stalled forward hides nothing
WAIT_KIND = "wait"
_LANE_OF_KIND = {**{k: "comm" for k in COMM_KINDS}, **{k: "compute" for k in COMPUTE_KINDS},
                 **{k: "compress" for k in COMPRESS_KINDS}, WAIT_KIND: "compute",
                 STEP_KIND: "comm"}

Interval = tuple[float, float]


@dataclass
class OpRecord:
    """One timed operation of a training step on one rank.

    Attributes:
        name: display name, e.g. ``"RS3"``, ``"forward"``.
        kind: one of :data:`KINDS` (``"RS"``, ``"AG"``, ``"AR"``, ``"compress"``, ``"decompress"``,
            ``"forward"``, ``"backward"``, ``"update"``, ``"wait"``: the training thread blocked on
            communication, which is not compute; ``"step"``: a sharded optimizer step on the communication lane).
        bucket: bucket index (forward order) for per-bucket operations, else ``None``.
        start_s, end_s: ``time.perf_counter()`` seconds; ``end_s >= start_s``.
        lane: ``"compute"``, ``"comm"`` or ``"compress"`` (see :func:`lane_of_kind` for the usual one).
        iteration: the training iteration (optimizer step) the operation belongs to, or ``None`` when unknown.
            A pipelined schedule runs one iteration's all-gathers, all-reduces and updates during the next
            one's forward: the Gantt chart and the Chrome trace name it (``"it 12: AR0"``, :func:`display_name`).

    Raises:
        ValueError: unknown ``kind`` or ``lane``, ``end_s < start_s``, or a non-integer ``bucket`` or
            ``iteration``.
    """

    name: str
    kind: str
    bucket: Optional[int]
    start_s: float
    end_s: float
    lane: str
    iteration: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"OpRecord {self.name!r}: kind={self.kind!r}; valid choices: {KINDS}")
        if self.lane not in LANES:
            raise ValueError(f"OpRecord {self.name!r}: lane={self.lane!r}; valid choices: {LANES}")
        if self.bucket is not None and (isinstance(self.bucket, bool) or not isinstance(self.bucket, int)):
            raise ValueError(f"OpRecord {self.name!r}: bucket={self.bucket!r} must be an int or None")
        if self.iteration is not None and (isinstance(self.iteration, bool) or not isinstance(self.iteration, int)):
            raise ValueError(f"OpRecord {self.name!r}: iteration={self.iteration!r} must be an int or None")
        if not self.end_s >= self.start_s:
            raise ValueError(f"OpRecord {self.name!r}: end_s={self.end_s} < start_s={self.start_s}")

    @property
    def duration_s(self) -> float:
        """``end_s - start_s`` in seconds."""
        return self.end_s - self.start_s


def display_name(record: OpRecord) -> str:
    """``record.name`` with its iteration when known: ``"it 12: AR0"`` (the Gantt chart's and the trace's label)."""
    return record.name if record.iteration is None else f"it {record.iteration}: {record.name}"


def lane_of_kind(kind: str) -> str:
    """The usual lane of ``kind``: RS/AG/AR and step -> comm, compress/decompress -> compress, else compute
    (forward, backward, update, wait).

    Raises:
        ValueError: unknown ``kind``.
    """
    try:
        return _LANE_OF_KIND[kind]
    except KeyError:
        raise ValueError(f"kind={kind!r}; valid choices: {KINDS}") from None


@dataclass
class OpTiming:
    """Host-clock start/end of one op executed by the communication engine (``time.perf_counter()``
    seconds); :func:`as_op_records` turns it into an :class:`OpRecord` on lane ``"comm"``.

    On CUDA these are the times the op was *issued* and its issue returned, not device times.
    ``iteration``: the training iteration whose gradients the op communicates (None: unknown).
    """

    op: Op
    start_s: float
    end_s: float
    iteration: Optional[int] = None


def as_op_records(items: Iterable[Any]) -> list[OpRecord]:
    """Normalise a strategy's timeline to :class:`OpRecord`.

    Accepts :class:`OpRecord` as is, and op-timing objects with attributes ``op`` (having ``kind``,
    an enum whose ``value`` or a string is ``"RS"``/``"AG"``/``"AR"``, and ``bucket``), ``start_s``
    and ``end_s`` (such as :class:`OpTiming`; its ``iteration``, when it has one, is kept), which become
    records on lane ``"comm"``.

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
        iteration = getattr(it, "iteration", None)
        out.append(OpRecord(name, str(kind), bucket, float(it.start_s), float(it.end_s), lane_of_kind(str(kind)),
                            None if iteration is None else int(iteration)))
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
def chrome_trace(records: Iterable[OpRecord], rank: int = 0, origin_s: Optional[float] = None, *,
                 process_name: Optional[str] = None) -> dict[str, Any]:
    """Chrome trace-event JSON object (loads in Perfetto / ``chrome://tracing``).

    One complete event (``"ph": "X"``) per record, ``pid`` = rank, ``tid`` = lane (0 compute, 1 comm,
    2 compress, named by metadata events); ``ts``/``dur`` in µs relative to ``origin_s`` (default:
    the earliest start). An event is named :func:`display_name` (``"it 12: AR0"`` when the record's iteration is
    known). ``args`` hold ``bucket``, ``kind``, ``iteration``, the record's own name ``op`` and the absolute
    ``start_s``. The
    process is named ``process_name`` (default ``"rank <rank>"``); the ``traceEvents`` of several
    calls with distinct ``rank`` can be concatenated into one trace (e.g. one process per planner).
    """
    records = list(records)
    if origin_s is None:
        origin_s = min((r.start_s for r in records), default=0.0)
    name = f"rank {rank}" if process_name is None else process_name
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": name}},
    ]
    for tid, lane in enumerate(LANES):
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}})
    for r in sorted(records, key=lambda r: (r.start_s, r.end_s)):
        events.append({
            "name": display_name(r), "cat": r.kind, "ph": "X", "pid": rank, "tid": LANES.index(r.lane),
            "ts": (r.start_s - origin_s) * 1e6, "dur": r.duration_s * 1e6,
            "args": {"kind": r.kind, "bucket": r.bucket, "iteration": r.iteration, "op": r.name,
                     "start_s": r.start_s},
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
        args = ev["args"]
        out.append(OpRecord(args.get("op", ev["name"]), args["kind"], args["bucket"], start,
                            start + ev["dur"] / 1e6, LANES[ev["tid"]], args.get("iteration")))
    return out


_COLORS = {"forward": "#4c72b0", "backward": "#55a868", "update": "#8172b2", "RS": "#dd8452",
           "AG": "#c44e52", "AR": "#937860", "compress": "#da8bc3", "decompress": "#8c8c8c",
           "wait": "#ffffff", "step": "#ccb974"}
_EXPOSED_COLOR = "#d62728"
#: hatch of the operations of odd iterations (even ones are plain), so that two consecutive iterations' operations
#: are told apart where a bar is too narrow for its "it N: ..." label
_ODD_ITERATION_HATCH = ".."
#: the legend names each iteration drawn up to this many, else says "even / odd iteration"
_MAX_ITERATIONS_IN_LEGEND = 4
#: a bar gets its name written on it when it is at least this fraction of the visible time span wide
_LABEL_MIN_FRACTION = 0.02

Panel = tuple[str, Sequence[OpRecord]]


def pack_rows(records: Sequence[OpRecord]) -> list[tuple[int, int]]:
    """Sub-rows for concurrent records of one lane (greedy interval partitioning, by start time).

    Returns:
        For each record, in input order, ``(row, rows)``: its sub-row index and the number of
        sub-rows its lane needs (1 when no two records of the lane overlap). ``wait`` records take
        no sub-row: they are drawn over the compute phase they interrupt (``(0, rows)``).
    """
    out: list[tuple[int, int]] = [(0, 1)] * len(records)
    for lane in LANES:
        idx = sorted((i for i, r in enumerate(records) if r.lane == lane and r.kind != WAIT_KIND),
                     key=lambda i: (records[i].start_s, records[i].end_s))
        ends: list[float] = []
        rows = {}
        for i in idx:
            r = records[i]
            k = next((j for j, e in enumerate(ends) if e <= r.start_s), len(ends))
            if k == len(ends):
                ends.append(r.end_s)
            else:
                ends[k] = r.end_s
            rows[i] = k
        n = max(1, len(ends))
        for i, r in enumerate(records):
            if r.lane == lane:
                out[i] = (rows.get(i, 0), n)
    return out


def exposed_intervals(records: Iterable[OpRecord], window: Optional[Interval] = None,
                      comm_kinds: Sequence[str] = COMM_KINDS,
                      compute_kinds: Sequence[str] = COMPUTE_KINDS) -> list[Interval]:
    """The exposed communication as sorted disjoint ``(start_s, end_s)`` intervals: union of the
    ``comm_kinds`` records minus busy compute (compute minus ``wait``), clipped to ``window``.
    Their total length is :func:`exposed_communication_ms` / 1000."""
    records = list(records)
    return subtract(_intervals(records, comm_kinds, window), _busy_compute(records, compute_kinds, window))


def _iteration_hatch(iteration: Optional[int]) -> Optional[str]:
    return _ODD_ITERATION_HATCH if iteration is not None and iteration % 2 else None


def _draw_panel(ax, records: list[OpRecord], origin_s: float, window: Optional[Interval], highlight_exposed: bool,
                title: str) -> tuple[set[str], set[int]]:
    """Draw one timeline on ``ax`` (lanes top to bottom); return the kinds and the iterations drawn (for the
    legend)."""
    lanes = [ln for ln in LANES if ln != "compress" or any(r.lane == ln for r in records)]
    if window is not None:
        records = [r for r in records if r.end_s > window[0] and r.start_s < window[1]]
    rows = pack_rows(records)
    if window is not None:
        span = (window[1] - window[0]) * 1000.0
    else:
        span = (max((r.end_s for r in records), default=origin_s) - origin_s) * 1000.0
    for r, (row, nrows) in zip(records, rows):
        s, e = r.start_s, r.end_s
        if window is not None:
            s, e = max(s, window[0]), min(e, window[1])
        h = 0.8 / nrows
        y0 = lanes.index(r.lane) - 0.4 + row * h
        x0 = (s - origin_s) * 1000.0
        w = (e - s) * 1000.0
        wait = r.kind == WAIT_KIND  # drawn hatched on top of the compute phase it interrupts
        ax.broken_barh([(x0, max(w, 1e-6))], (y0, h if not wait else 0.8), facecolors=_COLORS[r.kind],
                       edgecolor="black", linewidth=0.3, hatch="///" if wait else _iteration_hatch(r.iteration),
                       zorder=3 if wait else 2)
        if (r.bucket is not None or r.iteration is not None) and not wait and w >= _LABEL_MIN_FRACTION * span:
            ax.text(x0 + w / 2, y0 + h / 2, display_name(r), fontsize=6, va="center", ha="center", clip_on=True,
                    zorder=5, bbox={"facecolor": "white", "alpha": 0.6, "pad": 0.5, "linewidth": 0}
                    if r.iteration is not None and r.iteration % 2 else None)
    exposed = exposed_intervals(records, window) if highlight_exposed else []
    y = lanes.index("comm")
    for s, e in exposed:
        ax.axvspan((s - origin_s) * 1000.0, (e - origin_s) * 1000.0, ymin=0.0, ymax=1.0, facecolor=_EXPOSED_COLOR,
                   alpha=0.15, zorder=1, linewidth=0)
        ax.broken_barh([((s - origin_s) * 1000.0, (e - s) * 1000.0)], (y + 0.42, 0.12), facecolors=_EXPOSED_COLOR,
                       zorder=4)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(lanes)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    if window is not None:
        ax.set_xlim((window[0] - origin_s) * 1000.0, (window[1] - origin_s) * 1000.0)
    ax.invert_yaxis()
    if title:
        ax.set_title(title, fontsize=8, loc="left")
    kinds = {r.kind for r in records}
    if exposed:
        kinds.add("exposed")
    return kinds, {r.iteration for r in records if r.iteration is not None and r.kind != WAIT_KIND}


def _legend(target, kinds: set[str], iterations: set[int] = frozenset(), **kw) -> None:
    """The kinds' colours, then which hatch is which iteration: ``it 11`` (dotted), ``it 12`` (plain), or
    ``odd iteration`` / ``even iteration`` when more than :data:`_MAX_ITERATIONS_IN_LEGEND` are drawn."""
    used = [k for k in (*KINDS, "exposed") if k in kinds]
    if not used and not iterations:
        return
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=_EXPOSED_COLOR, label="exposed comm.") if k == "exposed" else
               Patch(facecolor=_COLORS[k], edgecolor="black", linewidth=0.3, hatch="///" if k == WAIT_KIND else None,
                     label=k) for k in used]
    if len(iterations) > 1:
        if len(iterations) <= _MAX_ITERATIONS_IN_LEGEND:
            named = [(_iteration_hatch(i), f"it {i}") for i in sorted(iterations)]
        else:
            named = [(_iteration_hatch(1), "odd iteration"), (None, "even iteration")]
        handles += [Patch(facecolor="white", edgecolor="black", linewidth=0.3, hatch=h, label=label)
                    for h, label in named]
    target.legend(handles=handles, fontsize=6, ncol=len(handles), framealpha=0.7, **kw)


def _figure(panels: Sequence[Panel], origin_s: Optional[float], window: Optional[Interval], highlight_exposed: bool,
            figsize: tuple[float, float]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [(t, list(recs)) for t, recs in panels] or [("", [])]
    if origin_s is None:
        origin_s = window[0] if window is not None else min(
            (r.start_s for _, recs in panels for r in recs), default=0.0)
    fig = Figure(figsize=figsize, dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    kinds: set[str] = set()
    iterations: set[int] = set()
    for ax, (title, recs) in zip(axes, panels):
        k, its = _draw_panel(ax, recs, origin_s, window, highlight_exposed, title)
        kinds |= k
        iterations |= its
    axes[-1].set_xlabel("time since step start (ms)")
    if len(panels) == 1:
        # above the plot, beside the title
        _legend(axes[0], kinds, iterations, loc="lower right", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
    else:
        _legend(fig, kinds, iterations, loc="upper right")
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / figsize[1]))
    return fig


def gantt_panels_figure(panels: Sequence[Panel], origin_s: Optional[float] = None, *,
                        window: Optional[Interval] = None, highlight_exposed: bool = True, width_in: float = 10.0):
    """A matplotlib ``Figure`` with one Gantt panel per ``(title, records)``, sharing the time axis.

    Each panel has a ``compute`` lane (forward, backward, update; ``wait`` hatched on top: the
    training thread blocked on communication), a ``comm`` lane (RS/AG/AR; concurrent operations
    are stacked in sub-rows, see :func:`pack_rows`) and, when used, a ``compress`` lane. An operation
    whose iteration is known is labelled with it (``"it 12: AR0"``, when its bar is wide enough) and the
    operations of odd iterations are dotted, so an update or all-reduce of one iteration drawn across
    another's operations is told apart; the legend says which hatch is which iteration. With
    ``highlight_exposed`` the exposed communication (:func:`exposed_intervals`) is shaded red
    across the panel and marked by a red bar under the ``comm`` lane. Used for measured timelines
    (:class:`~lightning_pipedap.measure.comm_timeline.CommTimeline`) and simulated ones
    (:func:`lightning_pipedap.plan.simulator.to_op_records`).

    Args:
        panels: ``(title, records)`` pairs; times in seconds.
        origin_s: time drawn as 0 ms; default ``window[0]``, else the earliest start of all panels.
        window: ``(start_s, end_s)`` to show; records are clipped to it (and so is the exposed
            communication). Default: everything.
        highlight_exposed: shade the exposed communication.
        width_in: figure width in inches (height: 1.3 in per panel plus 0.9 in, at 100 dpi).

    Returns:
        ``matplotlib.figure.Figure`` with a ``FigureCanvasAgg`` attached (no pyplot state).
    """
    return _figure(panels, origin_s, window, highlight_exposed, (width_in, 0.9 + 1.3 * max(1, len(panels))))


def gantt_figure(records: Iterable[OpRecord], title: str = "", origin_s: Optional[float] = None, *,
                 window: Optional[Interval] = None, highlight_exposed: bool = True):
    """A matplotlib ``Figure`` (Agg canvas, no pyplot state) of one timeline: one row per lane, ms.

    The drawing of :func:`gantt_panels_figure` with a single panel, 10 x 2.6 inches at 100 dpi.

    Returns:
        ``matplotlib.figure.Figure`` with a ``FigureCanvasAgg`` attached.
    """
    return _figure([(title, records)], origin_s, window, highlight_exposed, (10.0, 2.6))


def _save_png(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png")
    return path


def gantt_png(records: Iterable[OpRecord], path: str, title: str = "", origin_s: Optional[float] = None, *,
              window: Optional[Interval] = None, highlight_exposed: bool = True) -> str:
    """Render :func:`gantt_figure` to a PNG file at ``path`` (parent folders created); return the path."""
    return _save_png(gantt_figure(records, title, origin_s, window=window, highlight_exposed=highlight_exposed), path)


def gantt_panels_png(panels: Sequence[Panel], path: str, origin_s: Optional[float] = None, *,
                     window: Optional[Interval] = None, highlight_exposed: bool = True, width_in: float = 10.0) -> str:
    """Render :func:`gantt_panels_figure` to a PNG file at ``path`` (parent folders created); return the path."""
    return _save_png(gantt_panels_figure(panels, origin_s, window=window, highlight_exposed=highlight_exposed,
                                         width_in=width_in), path)


def gantt_rgb(records: Iterable[OpRecord], title: str = "", origin_s: Optional[float] = None, *,
              window: Optional[Interval] = None, highlight_exposed: bool = True):
    """Render :func:`gantt_figure` to an ``uint8`` numpy array of shape ``(H, W, 3)`` (for TensorBoard)."""
    import numpy as np

    fig = gantt_figure(records, title, origin_s, window=window, highlight_exposed=highlight_exposed)
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()

