"""Benchmark matrix: DDP (plain, tuned buckets, fp16 / PowerSGD comm hooks), FSDP2, pipedap's planners and
pipedap with gradient compression (pipelined or inline) on a bandwidth-capped testbed.

::

    python -m lightning_pipedap.bench.matrix --quick                      # headline cell, < 60 s
    python -m lightning_pipedap.bench.matrix --models mlp --links 1gbit,none --ranks 2 \\
        --json bench.json --markdown BENCHMARKS.md --chart docs/img/benchmarks.png

A *cell* is (model, link, ranks). Every cell is one launch on a fresh
:class:`~lightning_pipedap.testbed.Testbed` (one network namespace per rank, ``tc tbf`` cap on each host
link in both directions), and every strategy of the cell runs in that launch, one after another, in the
same processes over the same link, so the variants of one cell are directly comparable. All variants train
through Lightning (``Trainer.fit``) with the same lean LightningModule (loss only; SGD with momentum, or with
``--optimizer adam`` ``torch.optim.Adam`` at lr 1e-3):

* ``ddp``: Lightning's ``"ddp"`` (``DistributedDataParallel``, default 25 MiB buckets, all-reduce in backward).
* ``ddp_tuned``: ``DDPStrategy(bucket_cap_mb=X)``; ``X`` is picked per cell by a short sweep over
  ``--ddp-bucket-mb`` (each candidate a few steps, the fastest median wins, then measured in full).
* ``fsdp2``: Lightning's ``ModelParallelStrategy`` (data-parallel mesh = all ranks, no tensor
  parallelism) with ``torch.distributed.fsdp.fully_shard(..., reshard_after_forward=False)`` applied in
  ``configure_model`` to every layer (Linear / residual block / transformer block) and then to the network.
* ``ddp+fp16hook``, ``ddp+powersgdhook``: DDP with PyTorch's communication hooks
  ``default_hooks.fp16_compress_hook`` (gradients cast to fp16 for the all-reduce: the uncompressed
  16-bit all-reduce baseline) and ``powerSGD_hook`` (``matrix_approximation_rank=4``,
  ``start_powerSGD_iter=2``, error feedback and warm start on, like ``pipedap-...+powersgd``).
  Lightning's ``DDPStrategy`` registers comm hooks only on CUDA, so a small subclass registers the hook
  on the ``DistributedDataParallel`` module right after ``configure_ddp``. ``bf16_compress_hook`` is not
  offered: DDP refuses to register it without NCCL (``TypeError: BF16 all reduce communication hook
  required CUDA 11+ and NCCL 2.10+``, checked on gloo with torch 2.13).
* ``pipedap-<schedule>``: :class:`~lightning_pipedap.strategy.PipeDAPStrategy` with each schedule in
  :func:`~lightning_pipedap.strategy.valid_schedule_names` (fixed ``dear``/``allreduce``, planned
  ``optimal``, ``pipedap``, ``wfbp``, ``dear_tuned``, ``no_overlap``).
* ``pipedap-<schedule>+<compressor>`` and ``pipedap-<schedule>+<compressor>:inline``: the same with
  ``compression=<compressor>`` (any name in :func:`~lightning_pipedap.compress.valid_compressor_names`;
  keyword arguments from :data:`COMPRESSOR_KWARGS`: PowerSGD rank 4, top-k 1%), compressed in the per-rank
  helper process (``compression_mode="process"``, pipelined with backward) or, with ``:inline``, in the
  trainer (``compression_mode="inline"``). ``--strategies all`` runs ``pipedap-optimal+<c>`` (pipelined)
  for every ``c`` in ``--compressors`` (default ``fp16,powersgd,topk``); inline variants run when named.
* ``pipedap-<schedule>@fp16`` / ``@bf16``: ``wire_dtype="fp16"`` / ``"bf16"``: the 16-bit wire format of
  the engine's ring (gradients cast in the send path, summed in fp32; ``optimal`` chooses it per bucket),
  run when named (the counterpart of ``ddp+fp16hook`` without DDP's extra fp16 copy and fp16 sums).
* ``pipedap-<schedule>@part<MiB>``: ``partition_mb`` (tensor partitioning); ``pipedap-<schedule>@margin<percent>``:
  ``torch_ddp_margin`` (how much faster than DDP's reducer a trial candidate must be to displace it).
* ``pipedap-<schedule>[...]@shard`` (uncompressed, not with ``@part``): ``shard_optimizer=True``, the sharded
  optimizer step (docs/SHARDING.md): each rank steps its 1/N shard of every bucket between the reduce-scatter and
  the all-gather of the updated parameters; its prediction is the strategy's sharded one.
* ``ddp@clip<max_norm>`` and ``pipedap-<schedule>[...]@clip<max_norm>`` (uncompressed pipedap only):
  ``Trainer(gradient_clip_val=max_norm, gradient_clip_algorithm="norm")``. pipedap computes the norm exactly as
  ``clip_grad_norm_`` does under DDP, so a clipped step's first update waits for every bucket's all-gather.

Per variant: median *iteration time* (start-to-start of training batches, ``on_train_batch_start``, after
``--warmup`` steps, over ``--steps`` steps), energy per iteration (an *estimate*: ``--watts`` x CPU-seconds
of each rank, summed over ranks; there is no energy counter on these CPUs), and for pipedap the planner's
prediction and the timeline (time the training thread waited on communication, communication busy time).
Per cell, measured in the same processes: *compute-only* time (the same Lightning loop on a single-device
strategy: no communication at all) and *communication-only* time (one gradient's worth of fp32 as one
buffer: gloo all-reduce, and the engine's ring reduce-scatter + all-gather). The *lower bound* of an
iteration is ``max(compute, communication)`` with communication the faster of the two (perfect overlap,
perfect fusion); each variant's ``ratio to bound`` is its iteration time over that bound and its
``speedup`` is ``ddp`` time over its time. A tighter *dependency bound*, ``max(compute + first-layer
communication, communication)``, is reported next to it (:func:`dependency_bound_s`). Compute-only runs
twice (before and after the strategies) and the bound uses the faster run.

``--quick`` runs only the headline cell (mlp, 1gbit, 2 ranks; ``ddp`` and ``pipedap-optimal``, 5 warm-up
and 5 measured steps, one compute-only run) and prints ``speedup_vs_ddp=<x> ratio_to_bound=<y> installed=<schedule>``
last (:func:`~lightning_pipedap.bench.matrix.report.quick_line`), followed by ``(DDP's reducer: ...)`` when measured
plan selection installed ``torch_ddp``: that speedup is DDP's own all-reduce, not a pipedap schedule. The tables mark
such a speedup ``(torch_ddp: DDP's reducer)`` too.

Per compressed pipedap variant, ``strategy.compression_stats()`` (per bucket, the last round) is sampled
before every backward and at the end of training, so each round is counted once for the step that made it,
and the rounds of the measured steps are summarised (:func:`summarize_compression`):
*compression time* per iteration (helper or inline time compressing, in extra rounds and decompressing,
summed over buckets), the share of it *hidden* by the pipeline, ``sum(compress - wait) / sum(compress)``
with ``wait`` the time the communication worker blocked on the helper (pipelined only: inline compression
runs in the trainer and hides nothing), and the *compression ratio* dense bytes / payload bytes. They
appear in a second table, ``compression``, next to the DDP hook baselines. Compression starts with the
final schedule (warm-up and profiling steps are dense), and PowerSGD sends its first 2 compressed-engine
steps dense, so its variants warm up 2 steps longer (:func:`extra_warmup_steps`).

Needs root for the network namespaces; without it the command says why and exits with status 2.
"""
from lightning_pipedap.bench.matrix.args import (build_parser, parse_args, parse_bucket_list, parse_choice_list,
                                                 parse_compressors, parse_ranks)
from lightning_pipedap.bench.matrix.driver import main, run_cell
from lightning_pipedap.bench.matrix.models import (DEFAULT_OPTIMIZER, OPTIMIZERS, BenchModule, build_net,
                                                   check_optimizer, first_layer_numel, make_module, make_optimizer)
from lightning_pipedap.bench.matrix.report import (HIDDEN_NOTE, MD_BEGIN, MD_END, cell_label, format_cells_table,
                                                   format_compression_table, format_text_report, format_trials_table,
                                                   format_variants_table, machine_description, quick_line,
                                                   render_markdown, replace_marked_section, write_chart)
from lightning_pipedap.bench.matrix.results import (DDP_REDUCER, CellResult, CompressionSummary, VariantResult, combine,
                                                    dependency_bound_s, hidden_share, installed_note, lower_bound_s,
                                                    median_step_s,
                                                    ratio_to_bound, speedup, summarize_compression)
from lightning_pipedap.bench.matrix.spec import (BASE_STRATEGIES, CLIP_SUFFIX, COMPRESS_SEP, COMPRESSOR_KWARGS,
                                                 DDP_HOOKS, DEFAULT_COMPRESSORS, DEFAULT_PIPEDAP, INLINE_SUFFIX, LINKS,
                                                 MODELS,
                                                 NICE_SUFFIX, PIPEDAP_PREFIX, PLAN_TRIALS, POWERSGD_ONE_BUCKET_MB,
                                                 POWERSGD_RANK, POWERSGD_START, PRESETS, QUICK_DDP_WARMUP,
                                                 QUICK_PLAN_TRIALS, QUICK_STRATEGIES, QUICK_TRIAL_STEPS, REFERENCE,
                                                 SHARD_SUFFIX, SIZES, TRIAL_STEPS, StrategySpec, all_strategies,
                                                 compressor_names, extra_warmup_steps, parse_strategies, parse_strategy,
                                                 pipedap_schedules, plan_trials, uncompressed_name, valid_strategies)
from lightning_pipedap.bench.matrix.worker import (CommHookDDPStrategy, StepTimer, comm_only, plan_record,
                                                   quiet_worker)
# private helpers, re-exported for tests/test_bench_matrix.py (M._make_timer, M._ddp_with_comm_hook)
from lightning_pipedap.bench.matrix.worker import _ddp_with_comm_hook, _make_timer  # noqa: F401

__all__ = [
    "BASE_STRATEGIES", "CLIP_SUFFIX", "COMPRESS_SEP", "COMPRESSOR_KWARGS", "DDP_REDUCER", "DDP_HOOKS",
    "DEFAULT_COMPRESSORS", "DEFAULT_OPTIMIZER", "DEFAULT_PIPEDAP", "OPTIMIZERS", "SHARD_SUFFIX", "check_optimizer",
    "make_optimizer",
    "HIDDEN_NOTE", "INLINE_SUFFIX", "LINKS", "MD_BEGIN", "MD_END", "MODELS", "NICE_SUFFIX", "PIPEDAP_PREFIX",
    "PLAN_TRIALS", "POWERSGD_ONE_BUCKET_MB", "POWERSGD_RANK", "POWERSGD_START", "PRESETS", "QUICK_DDP_WARMUP",
    "QUICK_PLAN_TRIALS", "QUICK_STRATEGIES", "QUICK_TRIAL_STEPS", "REFERENCE", "SIZES", "TRIAL_STEPS",
    "BenchModule", "CellResult", "CommHookDDPStrategy", "CompressionSummary", "StepTimer", "StrategySpec",
    "VariantResult", "all_strategies", "build_net", "build_parser", "cell_label", "combine", "comm_only",
    "compressor_names", "dependency_bound_s", "extra_warmup_steps", "first_layer_numel", "format_cells_table",
    "format_compression_table", "format_text_report", "format_trials_table", "format_variants_table",
    "hidden_share", "installed_note", "lower_bound_s", "machine_description", "main", "make_module", "median_step_s",
    "parse_args", "parse_bucket_list", "parse_choice_list", "parse_compressors", "parse_ranks",
    "parse_strategies", "parse_strategy", "pipedap_schedules", "plan_record", "plan_trials", "quick_line",
    "quiet_worker",
    "ratio_to_bound", "render_markdown", "replace_marked_section", "run_cell", "speedup", "summarize_compression",
    "uncompressed_name", "valid_strategies", "write_chart",
]
