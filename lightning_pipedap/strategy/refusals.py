"""What both strategy front ends (Lightning's Trainer, Fabric) refuse, and how they register their names.

Plain functions without Lightning imports: the keyword arguments of DDP that do not apply, optimizers
that communicate by themselves, and the ``"pipedap"`` / ``"pipedap_spawn"`` registry entries.
"""

from __future__ import annotations

import difflib
import inspect
import math
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional, Sequence

#: DDP keyword arguments that do not apply, and why
REJECTED_DDP_KWARGS = {
    "ddp_comm_state": "pipedap does its own gradient communication; compression comes with `compression=`",
    "ddp_comm_hook": "pipedap does its own gradient communication; compression comes with `compression=`",
    "ddp_comm_wrapper": "pipedap does its own gradient communication",
    "model_averaging_period": "post-local SGD is a DDP feature; use strategy='ddp'",
    "static_graph": "not needed: pipedap traces the forward order itself",
    "gradient_as_bucket_view": "pipedap always uses its own flat buckets",
}
#: optimizers (by class name) that communicate by themselves
SELF_COMMUNICATING_OPTIMIZERS = ("ZeroRedundancyOptimizer", "PostLocalSGDOptimizer", "DistributedOptimizer")


def refuse_kwargs(owner: str, init: Callable[..., Any], bad: list[str],
                  reasons: Optional[Mapping[str, str]] = None, more_valid: Sequence[str] = ()) -> None:
    """Refuse keyword arguments ``bad`` of ``owner`` (a class name) whose ``__init__`` is ``init``.

    Args:
        owner: the class name, for the message.
        init: its ``__init__`` (the valid names are its parameters).
        bad: the unsupported names.
        reasons: extra ``name -> why`` beyond :data:`REJECTED_DDP_KWARGS`.
        more_valid: more valid names, which ``init`` takes through its ``**`` parameter (those of its signature
            are skipped).

    Raises:
        TypeError: always, naming each argument, why (or the closest valid name), and the valid arguments.
    """
    valid = [n for n, p in inspect.signature(init).parameters.items()
             if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    valid += [n for n in more_valid if n not in valid]
    known = {**REJECTED_DDP_KWARGS, **(reasons or {})}

    def why(k: str) -> str:
        if known.get(k):
            return known[k]
        close = difflib.get_close_matches(k, valid, n=1)
        return f"unknown argument{'; did you mean ' + repr(close[0]) + '?' if close else ''}"

    detail = "; ".join(f"{k}: {why(k)}" for k in bad)
    raise TypeError(f"{owner} got unsupported keyword arguments {bad} ({detail}); valid arguments: {', '.join(valid)}")


def group_timeout(owner: str, timeout: Any, wait_timeout_s: float) -> timedelta:
    """The default process group's ``timeout`` from the ``timeout`` argument of ``owner`` (a class name).

    Args:
        owner: the class name, for the message.
        timeout: None (then ``wait_timeout_s``), a :class:`datetime.timedelta`, or a number of seconds
            (an ``int`` or ``float`` > 0, converted to a ``timedelta``; ``bool`` is not a number here).
        wait_timeout_s: the strategy's ``wait_timeout_s`` (seconds), the default.

    Returns:
        The timeout as a positive :class:`datetime.timedelta`.

    Raises:
        TypeError: ``timeout`` is of another type (naming the value and the accepted types).
        ValueError: ``timeout`` is not positive or not finite.
    """
    if timeout is None:
        return timedelta(seconds=wait_timeout_s)
    if isinstance(timeout, timedelta):
        if timeout.total_seconds() <= 0:
            raise ValueError(f"{owner}: timeout={timeout!r} must be positive (a datetime.timedelta or seconds > 0)")
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        if not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"{owner}: timeout={timeout!r} must be a finite number of seconds > 0 "
                             "(or a datetime.timedelta)")
        return timedelta(seconds=float(timeout))
    raise TypeError(f"{owner}: timeout={timeout!r} ({type(timeout).__name__}) is not accepted; valid: None "
                    "(= wait_timeout_s), a datetime.timedelta, or a number of seconds (int or float > 0)")


def refuse_self_communicating(optimizers: list) -> None:
    """Raises:
        ValueError: naming an optimizer that communicates by itself (ZeRO, post-local SGD, ...)."""
    for opt in optimizers:
        if type(opt).__name__ in SELF_COMMUNICATING_OPTIMIZERS:
            raise ValueError(f"pipedap: optimizer {type(opt).__name__} communicates by itself and cannot run under "
                             "pipedap; use a local optimizer (torch.optim.SGD, Adam, AdamW, ...) or strategy='ddp'")


def refuse_unshardable(optimizers: list, scaler: Any) -> None:
    """``shard_optimizer=True``: the fit must be one the sharded step can run (checked at set-up, once per rank).

    Manual optimization and several optimizers (Muon for the matrices, AdamW for the rest) run sharded in sync
    mode (each ``optimizer.step()`` steps its own parameters' shards and all-gathers them).

    Raises:
        ValueError: the fp16 grad scaler (it unscales and checks the whole gradient), or an optimizer that is
            neither element-wise nor whole-tensor (named, with the valid classes).
    """
    from lightning_pipedap.engine.shard_step import ELEMENTWISE_OPTIMIZERS, WHOLE_TENSOR_OPTIMIZERS  # noqa: PLC0415

    if scaler is not None:
        raise ValueError("pipedap: shard_optimizer=True does not run under the fp16 grad scaler (precision='16-mixed' "
                         "unscales and checks the whole gradient on every rank); use precision='bf16-mixed' or "
                         "shard_optimizer=False")
    for opt in optimizers:
        base = next((c for c in type(opt).__mro__ if c in ELEMENTWISE_OPTIMIZERS + WHOLE_TENSOR_OPTIMIZERS), None)
        if base is not None and inspect.unwrap(type(opt).step) is not inspect.unwrap(base.step):
            raise ValueError(f"pipedap: shard_optimizer=True cannot split {type(opt).__name__}: it subclasses "
                             f"{base.__name__} but overrides step(), which may mix elements of a parameter or of "
                             f"several parameters (a trust ratio, a norm), so the sharded step could differ from "
                             f"DDP's; use {base.__name__} itself or shard_optimizer=False")
        if base is None:
            valid = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
            whole = ", ".join(c.__name__ for c in WHOLE_TENSOR_OPTIMIZERS)
            raise ValueError(f"pipedap: shard_optimizer=True needs an optimizer whose step it can split: element-wise "
                             f"(sharded by element range: {valid}) or whole-tensor (sharded by parameter ownership: "
                             f"{whole}); got {type(opt).__name__}, which is neither as far as pipedap knows (its "
                             "step may mix elements of a parameter or of several parameters): use "
                             "shard_optimizer=False")


def register_names(registry: Any, cls: type, description: str) -> None:
    """Register ``cls`` as ``"pipedap"`` (popen launcher) and ``"pipedap_spawn"`` (spawn launcher) in a
    Lightning or Fabric strategy registry, each described as ``description`` plus its start method; idempotent."""
    for name, start_method in (("pipedap", "popen"), ("pipedap_spawn", "spawn")):
        if name not in registry:
            registry.register(name, cls, start_method=start_method,
                              description=f"{description}, start_method '{start_method}'")
