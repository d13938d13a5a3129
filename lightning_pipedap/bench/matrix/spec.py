"""Strategy names of the benchmark matrix and the constants shared by its parts.

A strategy name is taken apart by :func:`parse_strategy` into a :class:`StrategySpec`; the lists of valid
names come from the strategy and compress packages themselves (:func:`pipedap_schedules`,
:func:`compressor_names`), so new planners and compressors appear here without edits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

MODELS = ("mlp", "resnet", "gpt")
LINKS = ("1gbit", "10gbit", "none")
SIZES = ("bench", "tiny")
BASE_STRATEGIES = ("ddp", "ddp_tuned", "fsdp2")
#: DDP with a PyTorch communication hook -> the hook's description (registered on CPU by the matrix)
DDP_HOOKS = {
    "ddp+fp16hook": "fp16_compress_hook",
    "ddp+powersgdhook": "powerSGD_hook rank=4 start_iter=2, one DDP bucket (gloo)",
}
#: PowerSGD settings shared by ``ddp+powersgdhook`` and ``pipedap-...+powersgd``
POWERSGD_RANK = 4
POWERSGD_START = 2
#: DDP bucket cap for ``ddp+powersgdhook`` on gloo: large enough for every bench model's gradients
POWERSGD_ONE_BUCKET_MB = 4096
#: measured plan selection of ``pipedap-optimal``: candidates and measured steps per candidate
#: (the strategy's defaults)
PLAN_TRIALS, TRIAL_STEPS, TRIAL_ROUNDS = 4, 3, 2
#: ``--quick``: measured steps per candidate (the 60 s budget of the headline cell)
QUICK_TRIAL_STEPS = 2
#: ``--quick``: candidates of the measured plan selection (the plan, DeAR and WFBP at 25 MiB)
QUICK_PLAN_TRIALS = 3
#: ``--quick``: one round over the candidates
QUICK_TRIAL_ROUNDS = 1
#: ``--quick``: warm-up steps of ``ddp`` (no warm-up phases; two steps settle its buckets, as in the cap sweep)
QUICK_DDP_WARMUP = 2
PIPEDAP_PREFIX = "pipedap-"
COMPRESS_SEP = "+"
INLINE_SUFFIX = ":inline"
#: ``pipedap-...@nice<N>``: ``PipeDAPStrategy(train_thread_nice=N)`` (communication threads first)
NICE_SUFFIX = "@nice"
#: ``pipedap-...@part<MiB>``: ``PipeDAPStrategy(partition_mb=MiB)`` (tensor partitioning of layers larger than that)
PART_SUFFIX = "@part"
#: ``pipedap-...@margin<percent>``: ``PipeDAPStrategy(torch_ddp_margin=percent / 100)`` (how much faster than DDP's
#: reducer a candidate must measure to displace it)
MARGIN_SUFFIX = "@margin"
#: ``ddp@clip<max_norm>`` / ``pipedap-...@clip<max_norm>``: ``Trainer(gradient_clip_val=max_norm,
#: gradient_clip_algorithm="norm")`` (clip-by-norm, which pipedap computes exactly as ``clip_grad_norm_`` does:
#: every bucket's all-gather before the first bucket's update of the step)
CLIP_SUFFIX = "@clip"
#: the strategies a ``@clip<max_norm>`` suffix is accepted on besides the uncompressed pipedap variants
CLIP_BASES = ("ddp",)
#: ``pipedap-...@shard``: ``PipeDAPStrategy(shard_optimizer=True)`` (each rank steps its 1/N shard of every bucket
#: between the reduce-scatter and the all-gather of the updated parameters; docs/SHARDING.md)
SHARD_SUFFIX = "@shard"
#: the strategy's fixed schedules (no planning, so no partitioning)
FIXED_SCHEDULES = ("allreduce", "dear")
#: ``pipedap-...@fp16`` / ``@bf16``: ``PipeDAPStrategy(wire_dtype=...)`` (16-bit wire format of the ring)
WIRE_SUFFIXES = ("@fp16", "@bf16")
#: compressors that ``--strategies all`` pairs with the default schedule (``--compressors`` default)
DEFAULT_COMPRESSORS = ("fp16", "powersgd", "topk")
#: keyword arguments of ``PipeDAPStrategy(compression_kwargs=...)`` per compressor (others: defaults)
COMPRESSOR_KWARGS: dict[str, dict[str, Any]] = {
    "powersgd": {"rank": POWERSGD_RANK, "start_step": POWERSGD_START},
    "topk": {"ratio": 0.01},
}
#: the variant every speedup is relative to
REFERENCE = "ddp"
#: default pipedap schedule (PipeDAPStrategy's default)
DEFAULT_PIPEDAP = "pipedap-optimal"
QUICK_STRATEGIES = ("ddp", DEFAULT_PIPEDAP)

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # mlp: 1024 input features, 16 hidden layers of 1024, 10 classes: 16.8 M parameters (67 MB of fp32
    # gradients: ~0.56 s all-reduce at 1 Gbit/s); fwd+bwd+step of batch 512 ~0.55 s at 1 thread on this
    # CPU (AMD EPYC) when the machine is quiet, so compute ~ communication at 1 Gbit/s. Many equal layers
    # rather than a few wide ones: with 5 layers of 2048 the last layer's backward (1/5 of compute) has to
    # finish before any of its 17 MB can move, which puts the window bound ~15% above max(compute, comm).
    "mlp": {"bench": dict(features=1024, width=1024, depth=16, batch=512),
            "tiny": dict(features=16, width=32, depth=2, batch=4)},
    # resnet: ResNet-18 layout at width 32 (2.8 M parameters), CIFAR-size 32x32 images
    "resnet": {"bench": dict(width=32, layers=(2, 2, 2, 2), image=32, batch=32),
               "tiny": dict(width=4, layers=(1, 1), image=8, batch=2)},
    # gpt: 6 layers x 384 wide (10.7 M parameters), context 128, byte vocabulary
    "gpt": {"bench": dict(n_layer=6, n_head=6, n_embd=384, block=128, batch=4),
            "tiny": dict(n_layer=1, n_head=2, n_embd=16, block=8, batch=2)},
}


def pipedap_schedules() -> tuple[str, ...]:
    """Schedule names :class:`PipeDAPStrategy` accepts (its own list, so new planners appear here)."""
    from lightning_pipedap.strategy import valid_schedule_names

    return tuple(valid_schedule_names())


def compressor_names() -> tuple[str, ...]:
    """Compressor names ``PipeDAPStrategy(compression=...)`` accepts (the compress package's own list)."""
    from lightning_pipedap.compress import valid_compressor_names

    return tuple(valid_compressor_names())


@dataclass(frozen=True)
class StrategySpec:
    """A matrix strategy name taken apart.

    Attributes:
        name: the full name, e.g. ``"pipedap-optimal+powersgd:inline"``.
        family: ``"ddp"``, ``"ddp_tuned"``, ``"fsdp2"``, ``"ddp_hook"`` or ``"pipedap"``.
        schedule: pipedap schedule (``"optimal"``, ...); ``None`` for the others.
        compressor: pipedap compressor name, or ``None`` (uncompressed / not pipedap).
        mode: ``"process"`` (helper process, pipelined) or ``"inline"`` for compressed pipedap, else ``None``.
        nice: pipedap's ``train_thread_nice`` (``@nice<N>`` suffix), 0 = off.
        wire: pipedap's ``wire_dtype`` (``@fp16`` / ``@bf16`` suffix; ``"fp32"`` without).
        partition_mb: pipedap's ``partition_mb`` (``@part<MiB>`` suffix), None = off.
        torch_ddp_margin: pipedap's ``torch_ddp_margin`` (``@margin<percent>`` suffix), None = the default.
        clip: the Trainer's ``gradient_clip_val`` with ``gradient_clip_algorithm="norm"`` (``@clip<max_norm>``
            suffix), None = no clipping.
        shard: pipedap's ``shard_optimizer=True`` (``@shard`` suffix), False = unsharded (the default).
    """

    name: str
    family: str
    schedule: Optional[str] = None
    compressor: Optional[str] = None
    mode: Optional[str] = None
    nice: int = 0
    wire: str = "fp32"
    partition_mb: Optional[float] = None
    torch_ddp_margin: Optional[float] = None
    clip: Optional[float] = None
    shard: bool = False

    @property
    def trainer_kwargs(self) -> dict[str, Any]:
        """Extra ``Trainer`` arguments of the variant: clip-by-norm for ``@clip<max_norm>``, else none."""
        return {} if self.clip is None else dict(gradient_clip_val=self.clip, gradient_clip_algorithm="norm")

    @property
    def compression(self) -> str:
        """Human description of the compression (``""`` when none), e.g.
        ``"powersgd rank=4 start_step=2, helper process"``."""
        if self.family == "ddp_hook":
            return DDP_HOOKS[self.name]
        if self.wire != "fp32":
            return f"{self.wire} wire format (cast in the ring's send path, fp32 sums)"
        if self.compressor is None:
            return ""
        kw = " ".join(f"{k}={v}" for k, v in COMPRESSOR_KWARGS.get(self.compressor, {}).items())
        where = "helper process" if self.mode == "process" else "inline"
        return f"{self.compressor}{' ' + kw if kw else ''}, {where}"


def strategy_forms() -> str:
    """One line naming every accepted strategy form, for error messages."""
    return (f"{', '.join(BASE_STRATEGIES + tuple(DDP_HOOKS))}, {PIPEDAP_PREFIX}<schedule> "
            f"(schedules: {', '.join(pipedap_schedules())}), {PIPEDAP_PREFIX}<schedule>{COMPRESS_SEP}<compressor>"
            f"[{INLINE_SUFFIX}] (compressors: {', '.join(compressor_names())}); any pipedap name may end in "
            f"{NICE_SUFFIX}<N> (train_thread_nice=N, 1..19) and an uncompressed one in {' or '.join(WIRE_SUFFIXES)} "
            f"(wire_dtype) or {PART_SUFFIX}<MiB> (partition_mb: split layers larger than that), and a planned "
            f"uncompressed fp32 one in {MARGIN_SUFFIX}<percent> (torch_ddp_margin, 0..99); "
            f"any uncompressed pipedap name may end in {SHARD_SUFFIX} (shard_optimizer=True; not with "
            f"{PART_SUFFIX}); {', '.join(CLIP_BASES)} and any "
            f"uncompressed pipedap name may end in {CLIP_SUFFIX}<max_norm> (Trainer gradient_clip_val=max_norm, "
            "algorithm norm), e.g. ddp@clip1")


def parse_strategy(name: str) -> StrategySpec:
    """Take a strategy name apart: ``ddp``, ``ddp_tuned``, ``fsdp2``, ``ddp+fp16hook``, ``ddp+powersgdhook``,
    ``pipedap-<schedule>``, ``pipedap-<schedule>+<compressor>`` (helper process) or
    ``pipedap-<schedule>+<compressor>:inline``, each pipedap form optionally followed by ``@nice<N>``, an
    uncompressed one also by ``@fp16`` or ``@bf16`` (``wire_dtype``) or ``@part<MiB>`` (``partition_mb``), e.g.
    ``pipedap-optimal@fp16@nice5``, ``pipedap-optimal@part1``; a planned, uncompressed fp32 one by
    ``@margin<percent>`` (``torch_ddp_margin``), e.g. ``pipedap-optimal@margin5``. ``ddp`` and every uncompressed
    pipedap form may end in ``@clip<max_norm>`` (``Trainer(gradient_clip_val=max_norm,
    gradient_clip_algorithm="norm")``), e.g. ``ddp@clip1``, ``pipedap-dear@clip1``, ``pipedap-optimal@fp16@clip0.5``;
    every uncompressed pipedap form without ``@part`` by ``@shard`` (``shard_optimizer=True``), e.g.
    ``pipedap-optimal@shard``, ``pipedap-optimal@fp16@shard``.

    Raises:
        ValueError: an unknown name, schedule, compressor or suffix; the message names the bad part
            and the valid choices.
    """
    if name in BASE_STRATEGIES:
        return StrategySpec(name, name)
    if name in DDP_HOOKS:
        return StrategySpec(name, "ddp_hook")
    base, at, tail = name.partition("@")
    if at and (base in BASE_STRATEGIES or base in DDP_HOOKS):
        return _parse_clipped_base(name, base, tail)
    if not name.startswith(PIPEDAP_PREFIX):
        raise ValueError(f"unknown strategy {name!r}; valid: {strategy_forms()} (or 'all')")
    rest, *suffixes = name[len(PIPEDAP_PREFIX):].split("@")
    nice, wire, part, margin, clip, shard = 0, "fp32", None, None, None, False
    for text in suffixes:
        if "@" + text == SHARD_SUFFIX and not shard:
            shard = True
            continue
        if ("@" + text).startswith(CLIP_SUFFIX) and clip is None:
            clip = _clip_value(name, text[len(CLIP_SUFFIX) - 1:])
            continue
        if ("@" + text).startswith(MARGIN_SUFFIX) and margin is None:
            digits = text[len(MARGIN_SUFFIX) - 1:]
            if not (digits.isdigit() and 0 <= int(digits) <= 99 and str(int(digits)) == digits):
                raise ValueError(f"bad suffix {'@' + text!r} in strategy {name!r}; "
                                 f"valid: {MARGIN_SUFFIX}<percent> with "
                                 "an integer percent in 0..99 without leading zeros, e.g. @margin5")
            margin = int(digits) / 100
            continue
        if "@" + text in WIRE_SUFFIXES and wire == "fp32":
            wire = text
            continue
        if ("@" + text).startswith(PART_SUFFIX) and part is None:
            part = _part_mb(name, text[len(PART_SUFFIX) - 1:])
            continue
        digits = text[len(NICE_SUFFIX) - 1:] if text.startswith(NICE_SUFFIX[1:]) and not nice else ""
        if not digits.isdigit() or not 1 <= int(digits) <= 19:
            raise ValueError(f"bad suffix {'@' + text!r} in strategy {name!r}; "
                             f"valid: {NICE_SUFFIX}<N> with N in 1..19, "
                             f"{', '.join(WIRE_SUFFIXES)}, {PART_SUFFIX}<MiB> with MiB > 0, {SHARD_SUFFIX}, "
                             f"{CLIP_SUFFIX}<max_norm> with "
                             f"max_norm > 0, {MARGIN_SUFFIX}<percent> with percent in 0..99 (each at most once)")
        nice = int(digits)
    spec = _parse_pipedap(name, rest)
    if wire != "fp32" and spec.compressor is not None:
        raise ValueError(f"strategy {name!r}: a wire format suffix ({', '.join(WIRE_SUFFIXES)}) needs an uncompressed "
                         "pipedap variant (wire_dtype and compression exclude each other)")
    if part is not None and (spec.compressor is not None or spec.schedule in FIXED_SCHEDULES):
        raise ValueError(f"strategy {name!r}: {PART_SUFFIX}<MiB> needs an uncompressed pipedap variant with a planned "
                         f"schedule (the strategy partitions neither with compression nor the fixed schedules "
                         f"{', '.join(FIXED_SCHEDULES)})")
    if margin is not None and (spec.compressor is not None or spec.schedule in FIXED_SCHEDULES or wire != "fp32"):
        raise ValueError(f"strategy {name!r}: {MARGIN_SUFFIX}<percent> needs an uncompressed fp32 pipedap variant "
                         "with a "
                         f"planned schedule (only there is DDP's reducer a trial candidate)")
    if clip is not None and spec.compressor is not None:
        raise ValueError(f"strategy {name!r}: {CLIP_SUFFIX}<max_norm> needs {' or '.join(CLIP_BASES)} or an "
                         "uncompressed "
                         "pipedap variant (the clip measurement covers the uncompressed engine only)")
    if shard and spec.compressor is not None:
        raise ValueError(f"strategy {name!r}: {SHARD_SUFFIX} needs an uncompressed pipedap variant (the strategy steps "
                         "a compressed bucket unsharded, so the variant would not be the sharded step it names)")
    if shard and part is not None:
        raise ValueError(f"strategy {name!r}: {SHARD_SUFFIX} and {PART_SUFFIX}<MiB> exclude each other (partition_mb "
                         "is not planned with shard_optimizer=True: the buckets would hold whole parameters)")
    return StrategySpec(spec.name, spec.family, spec.schedule, spec.compressor, spec.mode, nice, wire, part, margin,
                        clip, shard)


def _parse_clipped_base(name: str, base: str, tail: str) -> StrategySpec:
    """``<base>@<tail>`` for a non-pipedap ``base``: only ``@clip<max_norm>`` on :data:`CLIP_BASES`.

    Raises:
        ValueError: another suffix, a second one, or ``@clip`` on a baseline other than :data:`CLIP_BASES`.
    """
    if base not in CLIP_BASES or not ("@" + tail).startswith(CLIP_SUFFIX):
        raise ValueError(f"strategy {name!r}: {base!r} takes no suffix but {CLIP_SUFFIX}<max_norm>, and only "
                         f"{', '.join(CLIP_BASES)} takes that (e.g. {CLIP_BASES[0]}{CLIP_SUFFIX}1); the other suffixes "
                         "are pipedap's")
    text = tail[len(CLIP_SUFFIX) - 1:]
    if "@" in text:
        raise ValueError(f"bad suffix {'@' + text.split('@', 1)[1]!r} in strategy {name!r}: {base!r} takes "
                         f"{CLIP_SUFFIX}<max_norm> once and nothing else")
    return StrategySpec(name, base, clip=_clip_value(name, text))


def _clip_value(name: str, text: str) -> float:
    """The max norm of a ``@clip<max_norm>`` suffix: plain decimal digits (``1``, ``0.5``), > 0."""
    value = float(text) if re.fullmatch(r"[0-9]+(\.[0-9]*)?|\.[0-9]+", text) else 0.0
    if not value > 0:
        raise ValueError(f"bad suffix {CLIP_SUFFIX + text!r} in strategy {name!r}; valid: {CLIP_SUFFIX}<max_norm> with "
                         f"a decimal number > 0 (Trainer gradient_clip_val, algorithm norm), e.g. {CLIP_SUFFIX}1 or "
                         f"{CLIP_SUFFIX}0.5")
    return value


def _part_mb(name: str, text: str) -> float:
    """The MiB of a ``@part<MiB>`` suffix: plain decimal digits (``1``, ``0.5``), at least the strategy's smallest
    ``partition_mb``."""
    from lightning_pipedap.strategy.config import MIN_PARTITION_MB  # noqa: PLC0415

    mb = float(text) if re.fullmatch(r"[0-9]+(\.[0-9]*)?|\.[0-9]+", text) else -1.0
    if not mb >= MIN_PARTITION_MB:
        raise ValueError(f"bad suffix {PART_SUFFIX + text!r} in strategy {name!r}; valid: {PART_SUFFIX}<MiB> with a "
                         f"decimal number of MiB >= 1/1024 = {MIN_PARTITION_MB!r}, e.g. @part1 or @part0.5")
    return mb


def _parse_pipedap(name: str, rest: str) -> StrategySpec:
    """``rest`` = ``<schedule>[+<compressor>[:inline]]`` of the pipedap name ``name``."""
    schedule, sep, comp = rest.partition(COMPRESS_SEP)
    if schedule not in pipedap_schedules():
        raise ValueError(f"unknown strategy {name!r}: unknown schedule {schedule!r}; "
                         f"valid: {strategy_forms()} (or 'all')")
    if not sep:
        return StrategySpec(name, "pipedap", schedule)
    comp, colon, mode = comp.partition(":")
    if comp not in compressor_names():
        raise ValueError(f"unknown compressor {comp!r} in strategy {name!r}; valid: {', '.join(compressor_names())}")
    if colon and mode != INLINE_SUFFIX[1:]:
        raise ValueError(f"unknown compression mode {':' + mode!r} in strategy {name!r}; valid: {INLINE_SUFFIX!r} "
                         f"(no suffix = pipelined in the helper process)")
    return StrategySpec(name, "pipedap", schedule, comp, "inline" if colon else "process")


def plan_trials(name: str, candidates: int = PLAN_TRIALS) -> int:
    """``PipeDAPStrategy(plan_trials=...)`` of a pipedap variant: the default measured plan selection
    (:data:`PLAN_TRIALS` candidates) for ``pipedap-optimal`` without compression, the strategy's
    default; 1 (the named planner's schedule, nothing else) for the other planners, so that each
    planner's own schedule is what is measured, and with compression (the strategy runs no trials there).
    ``candidates`` replaces :data:`PLAN_TRIALS` (``--quick`` measures 3).

    Raises:
        ValueError: a bad name (see :func:`parse_strategy`).
    """
    sp = parse_strategy(name)
    return candidates if sp.family == "pipedap" and sp.schedule == DEFAULT_PIPEDAP[len(PIPEDAP_PREFIX):] \
        and sp.compressor is None else 1


def extra_warmup_steps(name: str, trial_steps: int = TRIAL_STEPS, candidates: int = PLAN_TRIALS,
                       rounds: int = TRIAL_ROUNDS) -> int:
    """Warm-up steps a variant runs on top of ``--warmup``: ``POWERSGD_START`` (2) for pipedap with PowerSGD,
    whose first ``start_step`` compressed-engine steps send dense gradients (as ``start_powerSGD_iter`` does
    in the DDP hook, which counts from step 0 and is past them before the measured steps begin), so that
    every measured step is compressed; with measured plan selection (:func:`plan_trials` > 1), the
    trial steps (``trial_steps + 1`` per candidate and round, the strategy's ``torch_ddp`` candidate
    included, and the windows of a confirmation against ``torch_ddp``, counted whether it happens or not:
    ``rounds`` more rounds of two candidates); 0 otherwise.

    Raises:
        ValueError: a bad name (see :func:`parse_strategy`).
    """
    extra = POWERSGD_START if parse_strategy(name).compressor == "powersgd" else 0
    trials = plan_trials(name, candidates)
    windows = rounds * (trials + 1) + rounds * 2
    return extra + (windows * (trial_steps + 1) if trials > 1 else 0)


def all_strategies(compressors: Sequence[str] = DEFAULT_COMPRESSORS) -> tuple[str, ...]:
    """What ``--strategies all`` runs: ``ddp``, ``ddp_tuned``, ``fsdp2``, the DDP hook baselines, every
    ``pipedap-<schedule>``, and ``pipedap-optimal+<c>`` (pipelined) for each ``c`` in ``compressors``."""
    return (BASE_STRATEGIES + tuple(DDP_HOOKS) + tuple(PIPEDAP_PREFIX + s for s in pipedap_schedules())
            + tuple(f"{DEFAULT_PIPEDAP}{COMPRESS_SEP}{c}" for c in compressors))


def valid_strategies(compressors: Sequence[str] = DEFAULT_COMPRESSORS) -> tuple[str, ...]:
    """:func:`all_strategies` plus the inline forms ``pipedap-optimal+<c>:inline``, the 16-bit wire forms
    ``pipedap-optimal@fp16`` / ``@bf16`` and the clip-by-norm forms ``ddp@clip1``, ``pipedap-dear@clip1``,
    ``pipedap-optimal@clip1`` and the sharded optimizer step ``pipedap-optimal@shard`` (for ``--list``; any other
    ``pipedap-<schedule>+<compressor>[:inline]``, ``pipedap-<schedule>@fp16``, ``...@clip<max_norm>`` or
    uncompressed ``...@shard`` is accepted too, see :func:`parse_strategy`)."""
    return (all_strategies(compressors)
            + tuple(f"{DEFAULT_PIPEDAP}{COMPRESS_SEP}{c}{INLINE_SUFFIX}" for c in compressors)
            + tuple(DEFAULT_PIPEDAP + w for w in WIRE_SUFFIXES)
            + tuple(f"{n}{CLIP_SUFFIX}1" for n in (*CLIP_BASES, PIPEDAP_PREFIX + "dear", DEFAULT_PIPEDAP))
            + (DEFAULT_PIPEDAP + SHARD_SUFFIX,))


def parse_strategies(text: str, compressors: Sequence[str] = DEFAULT_COMPRESSORS) -> list[str]:
    """Comma list of strategy names (``"all"``: :func:`all_strategies` for ``compressors``), each checked by
    :func:`parse_strategy`; duplicates dropped, order kept.

    Raises:
        ValueError: an empty list or a bad name (message from :func:`parse_strategy`).
    """
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if items == ["all"]:
        return list(all_strategies(compressors))
    if not items:
        raise ValueError(f"empty list of strategies; valid: {strategy_forms()} (or 'all')")
    for t in items:
        parse_strategy(t)
    return list(dict.fromkeys(items))


def uncompressed_name(name: str) -> Optional[str]:
    """The uncompressed counterpart of a compressed variant: ``ddp`` for the DDP hooks,
    ``pipedap-<schedule>`` for ``pipedap-<schedule>+<compressor>[:inline]`` and for the 16-bit wire forms
    ``pipedap-<schedule>@fp16`` / ``@bf16``; ``None`` for the others."""
    if name in DDP_HOOKS:
        return REFERENCE
    if name.startswith(PIPEDAP_PREFIX) and COMPRESS_SEP in name:
        return name.split(COMPRESS_SEP, 1)[0]
    if name.startswith(PIPEDAP_PREFIX):
        head, *suffixes = name.split("@")
        kept = [s for s in suffixes if "@" + s not in WIRE_SUFFIXES]
        if len(kept) < len(suffixes):
            return "@".join([head, *kept])
    return None
