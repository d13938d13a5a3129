"""Checks on the numbers: non-finite averaged gradients (``nonfinite=``) and replicas that diverge
(``check_params_every_n_steps=``).

**Non-finite gradients.** The decision is taken from the *reduced* buckets. After a bucket's
all-gather (or all-reduce) every rank holds the same averaged values, and a NaN or inf on one rank
is in the reduced sum of all, so every rank finds the same first non-finite parameter without an
extra collective. :class:`NonFiniteCheck` holds the mode and what the last reduction showed:

- sync mode: :meth:`NonFiniteCheck.scan` runs at the end of backward, once every bucket is reduced;
  ``"raise"`` raises at the end of the strategy's ``backward``, ``"skip"`` drops the optimizer's
  ``step`` call (:func:`skippable_step`);
- deferred mode (:class:`~lightning_pipedap.strategy.deferred.DeferredUpdates`): ``"warn"`` scans
  each bucket when its update is applied; ``"raise"`` and ``"skip"`` wait for every bucket of the
  step and scan them all before the first of them is applied, so no part of the step lands.

**Diverged replicas.** :func:`check_replicas_agree` hashes every parameter's bytes on every rank and
compares the hashes (one ``all_gather_object`` on the default group, through
:mod:`lightning_pipedap.engine.collectives`).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

import lightning_pipedap.engine.collectives as C


class NonFiniteGradientError(RuntimeError):
    """The averaged gradients of a step hold NaN or inf and ``nonfinite="raise"`` (raised on every rank)."""


class ParameterDivergenceError(RuntimeError):
    """A parameter differs between ranks (``check_params_every_n_steps``; raised on every rank)."""


@dataclass(frozen=True)
class Finding:
    """The first non-finite values of one step's averaged gradients.

    Attributes:
        step: the optimizer step (Lightning's ``global_step`` while the step ran).
        bucket: engine bucket holding the parameter; -1 for a sparse gradient (reduced outside the buckets).
        name: the first parameter (in bucket order) with a non-finite averaged gradient.
        nan: NaN elements of that parameter's gradient.
        inf: infinite elements of that parameter's gradient.
        numel: elements of that parameter.
    """

    step: int
    bucket: int
    name: str
    nan: int
    inf: int
    numel: int

    def describe(self) -> str:
        where = ", a sparse gradient," if self.bucket < 0 else f" in bucket {self.bucket},"
        return (f"step {self.step}: the averaged gradients are not finite (first: {self.name!r}{where} "
                f"{self.nan} NaN and {self.inf} inf of {self.numel} values)")


def first_nonfinite(buckets: Sequence[Any], name_of: Callable[[Tensor], str], step: int) -> Optional[Finding]:
    """The first parameter whose reduced gradient (in ``buckets``, in order) holds NaN/inf, or None.

    A piece of a split parameter is named by its parameter (the counts are those of the piece).

    ``buckets`` are :class:`~lightning_pipedap.engine.buckets.FlatBucket` whose reduction has finished
    (identical data on every rank). One sum per bucket and one host sync: a sum is finite only if every
    element is (NaN and inf propagate); a bucket whose sum is not finite is then checked element by
    element (its sum may have overflowed with finite elements: that bucket is then finite).
    """
    if not buckets:
        return None
    sums = torch.stack([b.buffer[: b.numel].sum() for b in buckets])
    if bool(sums.isfinite().all()):
        return None
    for k in (~sums.isfinite()).nonzero()[:, 0].tolist():
        bucket = buckets[k]
        for slot, p in enumerate(bucket.params):
            g = bucket.grad_view(slot)
            if not bool(g.isfinite().all()):
                return Finding(step, bucket.index, name_of(p), int(g.isnan().sum()), int(g.isinf().sum()), g.numel())
    return None


class NonFiniteCheck:
    """The ``nonfinite`` option of one fit and what the last reduction showed.

    Args:
        mode: ``"warn"``, ``"raise"``, ``"skip"`` or ``"ignore"`` (see ``PipeDAPConfig.nonfinite``).
        name_of: ``parameter -> name``.
        warn: rank-0 warning logger (a message and a ``UserWarning``).
        wire_dtype: the strategy's ``wire_dtype`` (``"fp32"``, ``"fp16"``, ``"bf16"``).
        is_wire16: ``bucket index -> bool``, whether the installed schedule sends that bucket in the 16-bit
            wire format (default: none). A finding in an fp16 bucket says that the overflow may be the wire
            format's: fp16 holds at most 65504, where DDP sums in fp32.

    Attributes:
        enabled: False with an fp16 grad scaler (set by the strategy): the scaler skips non-finite steps.
        step_of: ``() -> int``, the current optimizer step (set by the strategy).
        verdict: sync mode: the finding of the last synced backward (None: finite or not checked).
        skipped: steps skipped (``"skip"``) in this fit.
    """

    def __init__(self, mode: str, name_of: Callable[[Tensor], str], warn: Callable[[str], None],
                 wire_dtype: str = "fp32", is_wire16: Callable[[int], bool] = lambda bucket: False) -> None:
        self.mode, self.name_of, self.warn = mode, name_of, warn
        self.wire_dtype, self.is_wire16 = wire_dtype, is_wire16
        self.enabled = True
        self.step_of: Callable[[], int] = lambda: -1
        self.verdict: Optional[Finding] = None
        self.skipped: list[int] = []
        self._warned = False
        self._logged: Optional[Finding] = None

    def fp16_wire(self, found: Finding) -> bool:
        """Whether ``found``'s bucket went over the wire in fp16 (where DDP's fp32 sum might not overflow)."""
        return self.wire_dtype == "fp16" and self.is_wire16(found.bucket)

    def describe(self, found: Finding) -> str:
        """``found.describe()``, plus, for a bucket sent in fp16, that the wire format may be the cause."""
        text = found.describe()
        if self.fp16_wire(found):
            text += (f"; bucket {found.bucket} is sent in fp16 on the wire (wire_dtype='fp16'), which overflows to "
                     "inf above 65504 where DDP, summing in fp32, would not: DDP may see finite values here. Use "
                     "wire_dtype='bf16' (fp32's range) or wire_dtype='fp32'")
        return text

    @property
    def active(self) -> bool:
        """Whether reductions are scanned at all."""
        return self.enabled and self.mode != "ignore"

    @property
    def decides_first(self) -> bool:
        """Whether the whole step must be scanned before any part of it is applied (``raise``, ``skip``)."""
        return self.enabled and self.mode in ("raise", "skip")

    def scan(self, buckets: Sequence[Any], step: Optional[int] = None) -> Optional[Finding]:
        """:func:`first_nonfinite` of ``buckets``; in ``"warn"`` mode the first finding of the fit is logged."""
        if not self.active or (self.mode == "warn" and self._warned):
            return None
        return self._found(first_nonfinite(buckets, self.name_of, self.step_of() if step is None else step))

    def scan_sparse(self, reducer: Any) -> Optional[Finding]:
        """As :meth:`scan`, for the averaged sparse gradients of a
        :class:`~lightning_pipedap.engine.sparse.SparseGradReducer` (after its ``finish``; bucket -1)."""
        if not self.active or (self.mode == "warn" and self._warned):
            return None
        hit = reducer.first_nonfinite()
        return None if hit is None else self._found(Finding(self.step_of(), -1, *hit))

    def report(self, found: Finding) -> None:
        """A finding made elsewhere (a sharded step's verdict): logged as :meth:`scan` logs its first one."""
        if self.active and not (self.mode == "warn" and self._warned):
            self._found(found)

    def _found(self, found: Optional[Finding]) -> Optional[Finding]:
        """``found``; in ``"warn"`` mode the first finding of the fit is logged."""
        if found is not None and self.mode == "warn":
            self._warned = True
            how = "applied" if self.fp16_wire(found) else "applied as DDP applies it"
            self.warn(f"pipedap: {self.describe(found)}; the update is {how} (nonfinite='warn', "
                      "said once per fit; 'raise' stops training, 'skip' skips such steps)")
        return found

    def check_params_under_ddp(self, params: Sequence[Tensor], every: int = 1) -> None:
        """``"warn"`` while DDP's reducer runs (the ``torch_ddp`` candidate, whose gradients pipedap does not
        see): every ``every`` calls (one per optimizer step, after it: the same cadence and the same cost, one read
        of every parameter, as the own engine's read of the reduced gradients), one sum per parameter; a non-finite
        update leaves non-finite parameters, so the first one is named, once per fit, at the step that applied it."""
        if not self.active or self.mode != "warn" or self._warned:
            return
        self._ddp_calls = getattr(self, "_ddp_calls", 0) + 1
        if self._ddp_calls % every or not params:
            return
        with torch.no_grad():
            sums = torch.stack([p.detach().sum() for p in params])
        if bool(sums.isfinite().all()):
            return
        bad = next(p for p, t in zip(params, sums.tolist()) if not math.isfinite(t))
        self._warned = True
        cadence = f"every {every} steps" if every > 1 else "every step"
        self.warn(f"pipedap: step {self.step_of()}: parameter {self.name_of(bad)!r} is not finite under DDP's reducer "
                  f"(the torch_ddp candidate; checked after {cadence}): a non-finite update was applied, as DDP "
                  "applies it (nonfinite='warn', said once per fit)")

    def error(self, found: Finding) -> NonFiniteGradientError:
        """The error of ``found`` under ``nonfinite="raise"`` (naming ``wire_dtype`` for an fp16 bucket)."""
        as_ddp = "" if self.fp16_wire(found) else " as DDP"
        return NonFiniteGradientError(f"pipedap: {self.describe(found)}; nonfinite='raise' stops training on every "
                                      f"rank (use nonfinite='skip' to skip such steps, 'warn' to apply them{as_ddp})")

    def skip(self, found: Finding) -> None:
        """Log that the step of ``found`` is skipped on every rank."""
        self.skipped.append(found.step)
        self.warn(f"pipedap: {self.describe(found)}; the optimizer step is skipped on every rank (nonfinite='skip'; "
                  f"{len(self.skipped)} step(s) skipped in this fit)")

    def raise_if_bad(self) -> None:
        """Sync mode, ``"raise"``: raise for the last synced backward's finding.

        Raises:
            NonFiniteGradientError: naming the step, the bucket and the first parameter.
        """
        if self.verdict is not None and self.mode == "raise" and self.enabled:
            raise self.error(self.verdict)

    def skip_now(self) -> bool:
        """Sync mode: whether the optimizer step about to run must be skipped: the last synced backward was not
        finite (every optimizer stepped after it is skipped, e.g. two in manual optimization; logged once).

        Raises:
            NonFiniteGradientError: ``"raise"`` (see :meth:`raise_if_bad`).
        """
        self.raise_if_bad()
        if self.verdict is not None and self.mode == "skip" and self.enabled:
            if self._logged is not self.verdict:
                self._logged = self.verdict
                self.skip(self.verdict)
            return True
        return False


@contextlib.contextmanager
def skippable_step(optimizer: Any, check: NonFiniteCheck) -> Iterator[None]:
    """Sync mode with ``nonfinite="skip"`` / ``"raise"``: inside the block, ``optimizer.step(closure)``
    runs the closure (forward, backward, hooks, clipping), then steps only if the averaged gradients
    were finite. The optimizer's own ``step`` runs with a closure whose first call returns the result
    already computed (a closure-based optimizer such as LBFGS evaluates it again for later calls).
    The optimizer object user hooks receive is the user's own (``step`` is replaced on the instance
    for the block and restored after).
    """
    original = optimizer.step
    had_own = "step" in optimizer.__dict__
    saved = optimizer.__dict__.get("step")

    def step(closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        if closure is None:
            return None if check.skip_now() else original(**kwargs)
        result = closure()
        if check.skip_now():
            return result
        first = [True]

        def again() -> Any:
            if first[0]:
                first[0] = False
                return result
            return closure()

        return original(closure=again, **kwargs)

    optimizer.step = step
    try:
        yield
    finally:
        if had_own:
            optimizer.step = saved
        else:
            optimizer.__dict__.pop("step", None)


def nonfinite_parameters(module: torch.nn.Module) -> Optional[str]:
    """What is not finite among ``module``'s parameters, in words, or None when every value is finite.

    ``"2 of 5 parameters hold NaN or inf (first: 'net.0.weight', 512 NaN and 0 inf of 512 values)"``. One sum per
    parameter (NaN and inf propagate), element counts only for the first bad one; the replicas are identical, so
    every rank finds the same.
    """
    bad = []
    for name, p in module.named_parameters():
        total = p.detach().float().sum()
        if not bool(torch.isfinite(total)):
            data = p.detach()
            if bool(torch.isfinite(data).all()):  # (the sum overflowed; the values are finite)
                continue
            bad.append((name, data))
    if not bad:
        return None
    name, data = bad[0]
    nan, inf = int(torch.isnan(data).sum()), int(torch.isinf(data).sum())
    count = sum(1 for _ in module.parameters())
    return (f"{len(bad)} of {count} parameters hold NaN or inf (first: {name!r}, {nan} NaN and {inf} inf of "
            f"{data.numel()} values)")


def parameter_hashes(module: torch.nn.Module) -> list[tuple[str, str]]:
    """``(name, blake2b-64 hex digest of the bytes)`` of every parameter of ``module``, in registration order."""
    out = []
    for name, p in module.named_parameters():
        data = p.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy()
        out.append((name, hashlib.blake2b(data.tobytes(), digest_size=8).hexdigest()))
    return out


def check_replicas_agree(module: torch.nn.Module, step: int, every: int) -> None:
    """Compare every parameter's hash across ranks (one ``all_gather_object``; every rank must call it).

    Raises:
        ParameterDivergenceError: on every rank, naming the first parameter (registration order) that
            differs, the ranks whose copy differs from rank 0's and the hashes.
    """
    everyone = C.all_gather_object(parameter_hashes(module))
    ref = everyone[0]
    for i, (name, digest) in enumerate(ref):
        differ = [r for r in range(1, len(everyone)) if everyone[r][i] != (name, digest)]
        if differ:
            theirs = ", ".join(f"rank {r}: {everyone[r][i][1]}" for r in differ)
            raise ParameterDivergenceError(
                f"pipedap: step {step}: parameter {name!r} differs between ranks: rank(s) "
                f"{', '.join(map(str, differ))} hold other values than rank 0 (hash on rank 0: {digest}; {theirs}). "
                "The replicas diverged: a rank-dependent in-place change of a weight, a non-deterministic "
                f"update or a bug (check_params_every_n_steps={every})")
