"""Fit the α-β cost model of RS, AG and AR on the live dedicated process group.

A short micro-benchmark (all ranks together): for a geometric range of bucket sizes it times each
primitive a few times (median), then fits ``T = α + β·bytes`` per primitive with
:func:`lightning_pipedap.plan.cost_model.fit_cost_model` (non-negative least squares, R² reported).
With a 16-bit ``wire_dtype`` the reduce-scatter and all-gather are also timed in that wire format
(cast in the send path, fp32 sums) and fitted over the fp32 bytes (:attr:`CostModel.rs16`,
:attr:`CostModel.ag16`). Rank 0's timings are broadcast so every rank plans with the same model. Results are cached per
(backend, world size, host set with one entry per process, master address, device kind other than the CPU)
in ``$PIPEDAP_CACHE_DIR`` (default ``~/.cache/lightning_pipedap``) unless disabled; the returned model's
``meta`` says which (:func:`describe_origin`), and which job wrote a cached model when it was another one. The
same key is the link fingerprint of the plan cache (:mod:`lightning_pipedap.plan.plan_cache`).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from lightning_pipedap.engine import collectives as C
from lightning_pipedap.plan.cost_model import CostModel, fit_cost_model
from lightning_pipedap.schedule import OpKind

CACHE_DIR = Path(os.environ.get("PIPEDAP_CACHE_DIR", Path.home() / ".cache" / "lightning_pipedap"))


def device_kind(device: Optional[torch.device]) -> str:
    """``"cpu"``, ``"cuda:<device name>"`` (``"cuda:NVIDIA H200"``), or the device type."""
    if device is None or device.type == "cpu":
        return "cpu"
    if device.type == "cuda" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def cache_key(comm: C.CommGroup, device: Optional[torch.device] = None) -> str:
    """The α-β cache entry of this group (a collective: every rank's host name): backend, world size, host set
    (one entry per process, so the layout too), ``MASTER_ADDR`` and, off the CPU, the device kind; 16 hex digits."""
    hosts = C.all_gather_object(socket.gethostname())
    kind = device_kind(device)
    raw = json.dumps([comm.backend, comm.world_size, sorted(hosts), os.environ.get("MASTER_ADDR", "")]
                     + ([kind] if kind != "cpu" else []))  # (CPU keys as before device kinds were keyed)
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def describe_origin(meta: Mapping[str, Any]) -> str:
    """Where a cost model came from, in words, from its ``meta``: ``"cached α-β model from <path> (fitted
    <time>)"`` for one read from the cache, ``"α-β model fitted on the live group in 2.3 s"`` for a fresh fit,
    ``"given"`` otherwise (a model passed as ``cost_model=`` is described by its caller)."""
    source = meta.get("source")
    if source == "cached":
        other = f", cached by another job: {meta['cached_by']}" if meta.get("cached_by") else ""
        return (f"cached α-β model from {meta.get('cache_path')} (fitted "
                f"{meta.get('fitted_at') or 'at an unknown time'}{other})")
    if source == "measured":
        took = meta.get("fit_s")
        return "α-β model fitted on the live group" + (f" in {took:.1f} s" if isinstance(took, (int, float)) else "")
    return "α-β model given"


def measure_cost_model(
    comm: C.CommGroup,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    max_bytes: int = 16 << 20,
    min_bytes: int = 4 << 10,
    repeats: int = 3,
    budget_s: float = 8.0,
    use_cache: bool = True,
    wire_dtype: str = "fp32",
    job: Optional[str] = None,
) -> CostModel:
    """Time RS/AG/AR for sizes ``min_bytes·4^k ≤ max_bytes`` and fit the α-β model.

    Args:
        comm: the dedicated group (the engine's, so the fit covers what the engine will use).
        device: device of the test buffers.
        max_bytes, min_bytes: size range of the test buckets in bytes.
        repeats: timed runs per size and primitive (median kept; one untimed warm-up run first).
        budget_s: stop adding larger sizes once this many seconds have been spent (rank 0 decides).
        use_cache: read/write the fitted model from/to the cache directory (a separate file per 16-bit
            ``wire_dtype``).
        wire_dtype: ``"fp32"``, or ``"fp16"`` / ``"bf16"``: also fit the 16-bit wire format's RS and AG.
        job: what this job is, in words (``"pipedap-train: DigitsCNN (model 1a2b...)"``): recorded with a fit
            written to the cache; a cached fit recorded by another job is reused with ``meta["cached_by"]`` set
            to that job (or ``"an unrecorded job"``), which :func:`describe_origin` and so the log mention.

    Returns:
        The fitted :class:`CostModel` (``meta`` holds backend, world size, ``source``: ``"measured"``
        with ``fit_s`` and ``fitted_at``, or ``"cached"`` with ``cache_path``, the ``fitted_at`` of
        the cached fit and, when another job cached it, ``cached_by``; ``not_cached`` says why a good fit
        could not be written to the cache).

    Raises:
        ValueError: if the size range is empty or ``wire_dtype`` is not one of the choices.
    """
    if min_bytes > max_bytes:
        raise ValueError(f"empty size range for the α-β fit: min {min_bytes} > max {max_bytes} bytes")
    if wire_dtype != "fp32" and wire_dtype not in C.WIRE_DTYPES:
        raise ValueError(f"wire_dtype must be 'fp32' or one of {sorted(C.WIRE_DTYPES)}, got {wire_dtype!r}")
    wire = C.WIRE_DTYPES[wire_dtype] if wire_dtype != "fp32" else None
    key = cache_key(comm, device) if use_cache else None
    path = CACHE_DIR / f"alpha_beta-{key}{'' if wire is None else '-' + wire_dtype}.json" if key else None
    cached = _read_cached(path, wire, job) if path is not None and comm.rank == 0 else None
    cached = C.broadcast_object(cached.to_dict() if cached is not None else None, src=0)
    if cached is not None:
        return CostModel.from_dict(cached)

    ops = _primitives(wire)
    t_start = time.perf_counter()
    samples = _time_sizes(comm, device, dtype, ops, min_bytes, max_bytes, repeats, budget_s, t_start)
    samples = C.broadcast_object({getattr(k, "value", k): v for k, v in samples.items()}, src=0)
    fit_s, fitted_at = C.broadcast_object((time.perf_counter() - t_start, _utc(time.time())), src=0)
    wire16 = {"RS": samples.pop("RS16"), "AG": samples.pop("AG16")} if wire is not None else None
    model = fit_cost_model(samples, wire16_samples=wire16,
                           meta={"backend": comm.backend, "world_size": comm.world_size, "source": "measured",
                                 "sizes": len(samples["RS"]), "fit_s": fit_s, "fitted_at": fitted_at,
                                 **({"job": job} if job is not None else {}),
                                 **({"wire_dtype": wire_dtype} if wire is not None else {})})
    good = all(ab is None or ab.r2 is None or ab.r2 >= 0.5
               for ab in (model.rs, model.ag, model.ar, model.rs16, model.ag16))
    if path is not None and comm.rank == 0 and good:  # never cache a poor fit
        _remember(model, path)
    return model


def _read_cached(path: Path, wire: Any, job: Optional[str]) -> Optional[CostModel]:
    """The fit cached at ``path`` (rank 0), or None: no file, unreadable, or without the 16-bit constants a
    ``wire`` format needs. Its ``meta`` says where it came from (``source``, ``cache_path``, ``fitted_at``,
    ``cached_by`` when another ``job`` cached it)."""
    if not path.exists():
        return None
    try:
        cached = CostModel.from_dict(json.loads(path.read_text()))
        if wire is not None and cached.rs16 is None:
            raise ValueError("no 16-bit constants in the cached model")
        # (a file written before fitted_at was recorded: its modification time is when it was fitted)
        cached.meta.update(source="cached", cache_path=str(path),
                           fitted_at=cached.meta.get("fitted_at") or _utc(path.stat().st_mtime))
        if job is not None and cached.meta.get("job") != job:
            cached.meta["cached_by"] = cached.meta.get("job") or "an unrecorded job"
    except (ValueError, KeyError, json.JSONDecodeError, OSError):
        cached = None
    return cached


def _primitives(wire: Any) -> dict[Any, Any]:
    """The timed primitives, ``fn(buffer, comm)`` by name: RS, AG and AR by :class:`OpKind`, and with a 16-bit
    ``wire`` format its RS and AG (``"RS16"``, ``"AG16"``)."""
    ops: dict[Any, Any] = {
        OpKind.REDUCE_SCATTER: C.reduce_scatter_,
        OpKind.ALL_GATHER: C.all_gather_,
        OpKind.ALL_REDUCE: C.all_reduce_,
    }
    if wire is not None:
        ops["RS16"] = lambda b, c: C.reduce_scatter_wire_(b, c, wire)
        ops["AG16"] = lambda b, c: C.all_gather_wire_(b, c, wire)
    return ops


def _time_sizes(comm: C.CommGroup, device: torch.device, dtype: torch.dtype, ops: dict[Any, Any],
                min_bytes: int, max_bytes: int, repeats: int, budget_s: float,
                t_start: float) -> dict[Any, list[tuple[float, float]]]:
    """Per primitive of ``ops``, ``(bytes, median seconds of repeats)`` for sizes ``min_bytes·4^k ≤ max_bytes``,
    stopping once ``budget_s`` seconds passed since ``t_start`` (rank 0's clock)."""
    samples: dict[Any, list[tuple[float, float]]] = {k: [] for k in ops}
    elem = torch.tensor([], dtype=dtype).element_size()
    nbytes = min_bytes
    while nbytes <= max_bytes:
        numel = max(comm.world_size, nbytes // elem // comm.world_size * comm.world_size)
        buf = torch.zeros(numel, dtype=dtype, device=device)
        for kind, fn in ops.items():
            samples[kind].append((float(numel * elem), _median_time(fn, buf, comm, device, repeats)))
        spent = C.broadcast_object(time.perf_counter() - t_start, src=0)
        if spent > budget_s:
            break
        nbytes *= 4
    return samples


def _median_time(fn: Any, buf: torch.Tensor, comm: C.CommGroup, device: torch.device,
                 repeats: int) -> float:
    """Median seconds of ``repeats`` runs of ``fn(buf, comm)`` after one untimed warm-up run, each after a barrier
    (the device synchronized around it)."""
    times = []
    for r in range(repeats + 1):
        C.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn(buf, comm)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if r:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _remember(model: CostModel, path: Path) -> None:
    """Write ``model`` to the cache at ``path`` atomically; an unwritable cache sets ``meta["not_cached"]``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # (atomic: concurrent jobs read whole files)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(model.to_dict(), indent=1))
        os.replace(tmp, path)
    except OSError as exc:  # (an unwritable cache: the fit is used, not remembered)
        model.meta["not_cached"] = f"{path.parent} is not writable ({exc.strerror or exc})"
