"""What a fit measured and chose, as read-only attributes of the strategy.

:class:`RunResults` is a mixin of :class:`~lightning_pipedap.strategy.lightning.PipeDAPStrategy`:
each attribute reads the current fit's :class:`~lightning_pipedap.strategy.runtime.Runtime` (or,
after teardown, the last fit's), so results stay readable after ``trainer.fit`` returns. The strategy's
constructor calls :meth:`RunResults._init_run_state` once it has its options.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable, Optional

import torch

import lightning_pipedap.engine.collectives as C
import lightning_pipedap.strategy.messages as M
from lightning_pipedap import compat
from lightning_pipedap.measure.timeline import OpRecord, as_op_records
from lightning_pipedap.strategy.config import PipeDAPConfig
from lightning_pipedap.strategy.controller import Phase
from lightning_pipedap.strategy.deferred import UPDATE_PLACES
from lightning_pipedap.strategy.params import model_signature, same_on_every_rank
from lightning_pipedap.strategy.planning import Measured
from lightning_pipedap.strategy.resume import ResumeState
from lightning_pipedap.strategy.runtime import Runtime, refuse_unsupported_modules


class _FromRun:
    """A result attribute of the current (or last) fit's run-time: its controller's or its own."""

    def __init__(self, name: str, default: Any, doc: str) -> None:
        self.name, self.default, self.__doc__ = name, default, doc

    def __get__(self, strategy: Any, owner: type) -> Any:
        if strategy is None:
            return self
        rt = strategy._rt or strategy._last
        if rt is None:
            return self.default
        return getattr(rt.controller, self.name) if hasattr(rt.controller, self.name) else getattr(rt, self.name)


def _entry_of(cache: Any) -> Optional[dict[str, Any]]:
    """What a plan cache hit installed (``PlanCache.entry``), or None."""
    entry = getattr(cache, "entry", None)
    return dict(entry) if entry else None


class RunResults(compat.SpawnLauncherHook):
    """Results of the current or last fit: plan selection, predictions, measured times, the timeline."""

    #: what messages call one training run: ``trainer.fit`` here, a Fabric script's run in the Fabric strategy
    RUN_NOUN = "fit"

    def _init_run_state(self, config: PipeDAPConfig) -> None:
        """The options and the state kept across fits (the current and last run-time, the engine's group,
        timeline records, update counters)."""
        self.config = config
        self._measured = Measured()
        #: how many bucket updates of the last ``fit`` were applied where: "forward" (at their first consumer
        #: in the next forward, the goal), "leftover" (start of backward: the module was not called), "flush"
        #: (validation, checkpoint, engine change, end), "observe" (before a hook that can read them), "guard"
        #: (a read before the trigger, caught in a guard step); all stay 0 in sync mode
        self.update_counts = dict.fromkeys(UPDATE_PLACES, 0)
        self._rt: Optional[Runtime] = None
        self._last: Optional[Runtime] = None  # the last fit's run-time, for its results after teardown
        self._comm: Optional[C.CommGroup] = None
        self._records: list[OpRecord] = []
        self._timeline_enabled = False

    def _start_runtime(self, module: torch.nn.Module, optimizers: Callable[[], list], resume: ResumeState,
                       on_lost_peer: Callable[[str], None], step_of: Optional[Callable[[], int]] = None) -> Runtime:
        """Set-up shared by the Trainer and Fabric strategies: check that every rank has the same model and
        options, broadcast rank 0's parameters and buffers, create the engine's group and the fit's
        :class:`~lightning_pipedap.strategy.runtime.Runtime` with its hooks (the strategy's ``_on_grad_ready``
        and ``_on_module_forward``). ``step_of``: ``() -> int``, the current optimizer step (none: -1).

        Raises:
            ValueError: parameters, buffers or options that differ between ranks (the first difference is
                named), no trainable parameter, a SyncBatchNorm on CPU, a sparse embedding with compression or a
                16-bit wire format.
        """
        refuse_unsupported_modules(module, self.root_device)
        same_on_every_rank(model_signature(module), "parameters and buffers", "every rank must build the same model")
        same_on_every_rank(self.config.signature(), "strategy options",
                           f"every rank must be given the same {type(self).__name__} options")
        with torch.no_grad():
            C.broadcast_coalesced_(list(module.parameters()) + list(module.buffers()), src=0)
        self.update_counts = dict.fromkeys(UPDATE_PLACES, 0)
        self._comm = C.new_comm_group(self.config.wait_timeout_s, int(self.config.ring_chunk_mb * 2**20))
        nodes = int(getattr(self, "num_nodes", 1) or 1)
        self._rt = rt = Runtime(self.config, module, optimizers, self._comm, self.world_size, self.global_rank,
                                self.root_device, self._measured, resume, M.info, M.warn, self.update_counts,
                                self._records, lambda: self._timeline_enabled, run_noun=self.RUN_NOUN,
                                layout=(nodes, max(1, self.world_size // nodes)), step_of=step_of)
        rt.start_heartbeat(on_lost_peer)
        M.every_rank(f"pipedap: rank {self.global_rank} of {self.world_size} set up on {socket.gethostname()} "
                     f"(pid {os.getpid()}, device {self.root_device}, {len(rt.params)} trainable tensors"
                     f"{f' + {len(rt.sparse.params)} with sparse gradients' if rt.has_sparse else ''}, "
                     f"schedule {self.config.schedule})")
        # forward pre-hooks are prepended (legacy weight_norm recomputes `weight` in a pre-hook, which must see
        # the updated values) and not put inside compiled regions, whose hooks dynamo would trace (their
        # parameters are updated before training_step)
        rt.install_hooks(self._on_grad_ready, torch.compiler.disable(self._on_module_forward))
        return rt

    # ------------------------------------------------------------------ for pipedap's callback and failure handling
    def say_once(self, key: str, message: str) -> None:
        """Log ``message`` on rank 0 once per fit (per ``key``); nothing outside a multi-process fit."""
        if self._rt is not None:
            self._rt.say(key, message)

    @property
    def updates_pending(self) -> bool:
        """Whether a deferred update of the current fit has not been applied yet."""
        return self._rt is not None and self._rt.updates_pending

    def apply_pending(self, place: str) -> None:
        """Apply every pending update now, counted under ``place`` in :attr:`update_counts` (all ranks call it)."""
        if self._rt is not None and self._rt.deferred is not None:
            self._rt.deferred.apply_all(place)

    @property
    def peer_heartbeat(self) -> Optional[C.Heartbeat]:
        """The current fit's heartbeat (liveness and notes between the ranks), None outside a multi-process fit."""
        return self._rt.heartbeat if self._rt is not None else None

    def stop_fit_after_failure(self, word: str) -> None:
        """This rank failed: tell the peers (the heartbeat's ``word``) and stop the communication worker without
        waiting (nothing outside a multi-process fit)."""
        if self._rt is not None:
            self._rt.stop_after_failure(word)

    def __getattr__(self, name: str) -> Any:
        """The options as attributes (``strategy.bucket_cap_mb``, ``strategy.compression``, ...)."""
        if name != "config" and name in PipeDAPConfig.option_names():
            return getattr(self.config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    trial_results = _FromRun("trial_results", [], "Measured plan selection of the last finished selection (kept "
                             "across a re-plan the fit did not finish): one dict per candidate (name, describe, "
                             "steps_s, predicted_s, measured_s, deciding_s, decided_in, chosen, predictions).")
    predictions = _FromRun("predictions", {}, "Rank 0: every prediction of each planned candidate, by name (s).")
    predicted_iteration_s = _FromRun("predicted_iteration_s", None,
                                     "The installed plan's predicted iteration time (s).")
    measured_iteration_s = _FromRun("measured_iteration_s", None, "Median measured iteration time of the last drift "
                                    "window (s, refreshed every 5 deferred steps).")
    no_overlap_time_s = _FromRun("no_overlap_time_s", None, "Compute + update + all-reduce of every bucket (s).")
    replans_done = _FromRun("replans_done", 0, "Re-plans triggered by drift in the last fit.")
    installed_schedule = _FromRun("installed_schedule", None, "describe() of the last final schedule (None before).")
    startup = _FromRun("startup", {}, "Time to steady state of the last fit: seconds and steps in trace, profile "
                       "and trials (or verifying a cached plan), seconds of the α-β model, the contention benchmark, "
                       "the compression helper's start and planning, their totals, and plan_cache ('hit', 'miss', "
                       "'off', 'stale (re-selected)') ({} until the plan runs).")

    def what_ran(self) -> dict[str, Any]:
        """What the last fit ran, as plain JSON-able data (for result files and summaries).

        Keys: ``schedule`` (the configured name), ``installed`` (the final schedule's
        :meth:`~lightning_pipedap.schedule.Schedule.to_dict`, or the ``torch_ddp`` candidate's
        :meth:`~lightning_pipedap.strategy.handover.TorchDDPCandidate.to_dict` when DDP's reducer was
        chosen; None before one ran), ``buckets`` (None for ``torch_ddp``) and
        ``compressed_buckets`` (counts), ``compression`` (the configured method), ``compression_note``
        (why nothing is compressed when a method is configured and the plan compresses no bucket),
        ``candidates`` (one dict per measured trial candidate: name, predicted_s, measured_s (median of all its
        windows, s), deciding_s (the median the choice was made on, s: the confirmation windows' for the two
        candidates a confirmation compared, else measured_s), decided_in (``"first pass"`` /
        ``"confirmation"``), windows_s, chosen), ``selection_notes`` (why that selection chose as it did, in
        words: the controller's ``selection_notes``),
        ``predicted_iteration_s``, ``measured_iteration_s``, ``no_overlap_time_s``, ``profiled_compute_s`` and
        ``contention`` (what the predictions rest on: :meth:`_prediction_basis`), ``replans``, ``startup``
        (:attr:`startup`),
        ``cost_model_origin`` (where the α-β model came from, in words: ``"cached α-β model from <path>
        (fitted <time>)"``, ``"α-β model fitted on the live group in 2.1 s"``, ``"α-β model loaded from
        cost_model=<file>"``;
        None without a planned schedule),
        ``plan_selection`` (in words: ``"finished (4 of 4 candidates measured)"``, ``"unfinished (3 of 5
        candidates measured, ...)"`` when the fit ended while (re-)planning or measuring candidates, ``"not
        run (...)"``), ``plan_selection_status`` (``"finished"``, ``"unfinished"``, ``"not run"``; None
        outside a fit), ``unfinished_candidates`` (the measurements of an unfinished selection, as
        ``candidates``; ``candidates`` keeps the last *finished* one), ``ran_at_end`` (the name of the
        schedule communicating when the fit ended: a candidate under measurement or the profiling schedule
        when selection was unfinished), ``wire_dtype`` and ``wire16_buckets`` (buckets sent 16-bit),
        ``plan_cache`` (``"hit"``, ``"miss"``, ``"off"`` or ``"stale (re-selected)"``: whether the plan came from
        the plan cache, see :attr:`Controller.plan_cache`; None outside a fit) and ``plan_cache_entry`` (after a
        hit: the entry's ``path``, ``selected_at``, ``chosen``, ``describe``, ``measured_s`` and the
        ``candidates`` its selection measured; else None),
        ``single_process`` (one process: nothing was synchronised, :attr:`single_process`),
        ``final_parameters_finite`` (False: the fit ended with NaN/inf in its parameters; the process then exits
        with 3) and ``final_parameters_note`` (which, in words; None when finite or not checked).
        """
        rt = self._rt or self._last
        if rt is None and getattr(self, "_what_ran_in_worker", None) is not None:
            return dict(self._what_ran_in_worker)  # (the fit ran in spawned processes)
        final = rt.final_schedule if rt is not None else None
        method = self.config.compression
        planning = getattr(rt, "planning", None)
        compressed = final.num_compressed if final is not None else 0
        note = None
        if method and final is not None and compressed == 0:
            note = (f"the {final.name} plan sends every bucket dense: the planner found no bucket where compression "
                    "pays on this link (the fixed schedules 'dear'/'allreduce' compress every bucket)")
        return {
            "schedule": self.config.schedule, "installed": None if final is None else final.to_dict(),
            "buckets": None if getattr(final, "buckets", None) is None else len(final.buckets),
            "compressed_buckets": compressed,
            "compression": method, "compression_note": note,
            "candidates": [{k: r.get(k) for k in ("name", "predicted_s", "measured_s", "deciding_s", "decided_in",
                                                  "windows_s", "chosen")}
                           for r in self.trial_results],
            "predicted_iteration_s": self.predicted_iteration_s, "measured_iteration_s": self.measured_iteration_s,
            **self._prediction_basis(rt),
            "selection_notes": list(rt.controller.selection_notes) if rt is not None else [],
            "replans": self.replans_done, "startup": dict(self.startup),
            "cost_model_origin": getattr(planning, "cost_model_origin", None),
            "communication": planning.communication_share() if planning is not None else None,
            **self._selection_state(rt),
            "wire_dtype": self.config.wire_dtype,
            "wire16_buckets": getattr(final, "num_wire16", 0) if final is not None else 0,
            "plan_cache": getattr(getattr(rt, "controller", None), "plan_cache", None),
            "plan_cache_entry": _entry_of(getattr(rt, "plan_cache", None)),
            "single_process": self.single_process,
            "final_parameters_finite": getattr(self, "final_parameters", None) is None,
            "final_parameters_note": getattr(self, "final_parameters", None),
        }

    def _prediction_basis(self, rt: Optional[Runtime]) -> dict[str, Any]:
        """What the predictions rest on, for the summary to explain a surprising number: ``no_overlap_time_s``
        (profiled compute + update + the α-β model's all-reduce of every bucket, s), ``profiled_compute_s``
        (forward + backward + update of the profiling steps, s; None without a profile) and ``contention``
        (the measured slowdowns ``compute_slowdown`` σ_c and ``comm_slowdown`` σ_m; None when not measured)."""
        profile = getattr(getattr(rt, "planning", None), "profile", None) if rt is not None else None
        compute = None
        if isinstance(profile, dict) and profile.get("layers"):
            compute = sum(float(layer.get("t_f", 0.0)) + float(layer.get("t_b", 0.0)) for layer in profile["layers"]) \
                + float(profile.get("t_update", 0.0))
        c = self._measured.contention
        return {"no_overlap_time_s": self.no_overlap_time_s, "profiled_compute_s": compute,
                "contention": None if c is None else {"compute_slowdown": c.compute_slowdown,
                                                      "comm_slowdown": c.comm_slowdown}}

    @staticmethod
    def _selection_state(rt: Optional[Runtime]) -> dict[str, Any]:
        """The ``plan_selection*``, ``unfinished_candidates`` and ``ran_at_end`` entries of :meth:`what_ran`."""
        if rt is None:
            return {"plan_selection": None, "plan_selection_status": None, "unfinished_candidates": [],
                    "ran_at_end": None}
        sel = rt.controller.plan_selection()
        return {"plan_selection": sel["text"], "plan_selection_status": sel["status"],
                "unfinished_candidates": [{k: r.get(k) for k in ("name", "predicted_s", "measured_s", "windows_s")}
                                          for r in sel["partial"]],
                "ran_at_end": rt.running_schedule}

    @property
    def single_process(self) -> bool:
        """Whether the run has one process (world size 1): nothing to synchronise, so no run-time (no engine, no
        plan, no trials, no start-up) and the model trains as on a single device."""
        return getattr(self, "cluster_environment", None) is not None and self.world_size == 1

    def note_single_process(self) -> None:
        """The log line of a one-process run (once per strategy)."""
        if not getattr(self, "_said_single_process", False):
            self._said_single_process = True
            M.info(f"pipedap: one process: nothing to synchronise; training runs without communication (no engine, "
                   f"no plan, no trials), as strategy='ddp' does with one process (schedule "
                   f"{self.config.schedule!r} not used)")

    @property
    def phase(self) -> Optional[Phase]:
        """The run-time's :class:`~lightning_pipedap.strategy.controller.Phase` (None outside a fit)."""
        return self._rt.controller.phase if self._rt is not None else None

    @property
    def profile(self) -> Optional[dict]:
        """The merged per-layer profile the plan came from (plain dict), once planned."""
        rt = self._rt or self._last
        return rt.planning.profile if rt is not None else None

    @property
    def contention(self) -> Optional[Any]:
        """The measured :class:`~lightning_pipedap.plan.contention.Contention` (None before, or when off)."""
        return self._measured.contention

    @property
    def calibration_ratio(self) -> float:
        """Measured / predicted communication busy time of the profiling steps (1.0 = not calibrated)."""
        return self._measured.calibration_ratio

    def compression_stats(self) -> dict[int, Any]:
        """Per-bucket :class:`~lightning_pipedap.engine.compressed.CompressionStats` of the last round ({} when not
        compressing)."""
        engine = self._rt.engine if self._rt is not None else None
        transport = engine.transport if engine is not None else None
        return dict(transport.stats) if transport is not None else {}

    @property
    def timeline_enabled(self) -> bool:
        """Record op timings (engine ops, waits on them, bucket updates) for :meth:`take_timeline`."""
        return self._timeline_enabled

    @timeline_enabled.setter
    def timeline_enabled(self, value: bool) -> None:
        self._timeline_enabled = bool(value)
        if self._rt is not None and self._rt.engine is not None:
            self._rt.engine.worker.timeline_enabled = self._timeline_enabled

    def take_timeline(self) -> list[OpRecord]:
        """Return and clear the records taken while :attr:`timeline_enabled` was set.

        RS/AG/AR records (lane ``comm``) come from the communication worker; ``wait`` records are the time the
        training thread blocked on communication; ``update`` records are per-bucket optimizer steps. Times are
        ``time.perf_counter()`` seconds (host issue times on CUDA).
        """
        out = list(self._records)
        self._records.clear()
        if self._rt is not None and self._rt.engine is not None:
            out = as_op_records(self._rt.engine.worker.take_timings()) + out
        return sorted(out, key=lambda r: r.start_s)

    def make_spawn_launcher(self, start_method: Optional[str]) -> Any:
        """Lightning's spawn launcher that also brings :meth:`what_ran` back (:class:`compat.SpawnLauncherHook`)."""
        return _ResultsBackLauncher(self, start_method=start_method)


class _ResultsBackLauncher(compat.MultiProcessingLauncher):
    """Lightning's spawn launcher, also bringing rank 0's :meth:`RunResults.what_ran` back to the main process."""

    def get_extra_results(self, trainer: Any) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        extra["pipedap_what_ran"] = trainer.strategy.what_ran()
        return extra

    def update_main_process_results(self, trainer: Any, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        trainer.strategy._what_ran_in_worker = extra.get("pipedap_what_ran")
