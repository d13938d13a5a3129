"""Which user hooks can observe parameters or gradients while an update is deferred.

In a deferred step the update of step ``t`` lands in the forward of step ``t+1``, and ``.grad``
holds this rank's *local* gradients (the reduced ones live in the engine's buckets). DDP shows
updated parameters and averaged gradients at every hook. So the strategy asks, at set-up and
whenever the callback list changes, which hooks the user's code overrides:

- *gradient hooks* run inside the step, after backward, and are where user code reads or writes
  ``.grad`` (``on_after_backward``, ``on_before_optimizer_step``, ``configure_gradient_clipping``,
  ``optimizer_step``, ``on_before_zero_grad``, ``optimizer_zero_grad``, ``backward``): with one of them
  present the step runs in *sync
  mode* (averaged gradients in ``.grad`` at the end of backward, the real ``optimizer.step``);
- *between-step hooks* run after ``optimizer_step`` and before the next forward
  (``on_train_batch_start``/``_end``, ``on_train_epoch_start``/``_end``): before each of them the
  pending update is applied and the averaged (clipped) gradients are written to ``.grad``, so the
  hook sees DDP's values; the reduce-scatter still overlaps backward.

A hook is *not* an observer when its class is Lightning's base class (not overridden), one of
Lightning's callbacks listed in :data:`SAFE_CALLBACKS` that provably read neither parameters nor
gradients there, or a callback (class or instance) that sets ``pipedap_reads_model = False`` (this package's
measurement callbacks do). Anything else counts as an observer: a wrong guess costs overlap, never
correctness.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from lightning.pytorch.callbacks import Callback

#: hooks inside a step where user code reads or writes ``.grad`` (LightningModule; callbacks have
#: the ``on_*`` ones)
GRAD_HOOKS = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping", "optimizer_step",
              "on_before_zero_grad", "optimizer_zero_grad", "backward")
#: hooks between ``optimizer_step`` and the next forward (LightningModule and callbacks)
BETWEEN_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_train_epoch_start", "on_train_epoch_end")
#: batch hooks of the LightningModule and the LightningDataModule, run before ``on_train_batch_start``;
#: an override of any of them is an observer of ``"batch_transfer"``
BATCH_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")

#: Lightning callbacks whose hooks read neither parameters nor gradients (progress, timing,
#: learning-rate and device monitoring, early stopping on logged metrics, checkpointing — a
#: checkpoint goes through ``lightning_module_state_dict``, which applies pending updates first)
SAFE_CALLBACKS = (
    "lightning.pytorch.callbacks.progress.progress_bar.ProgressBar",
    "lightning.pytorch.callbacks.progress.tqdm_progress.TQDMProgressBar",
    "lightning.pytorch.callbacks.progress.rich_progress.RichProgressBar",
    "lightning.pytorch.callbacks.lr_monitor.LearningRateMonitor",
    "lightning.pytorch.callbacks.timer.Timer",
    "lightning.pytorch.callbacks.model_summary.ModelSummary",
    "lightning.pytorch.callbacks.rich_model_summary.RichModelSummary",
    "lightning.pytorch.callbacks.early_stopping.EarlyStopping",
    "lightning.pytorch.callbacks.checkpoint.Checkpoint",
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint",
    "lightning.pytorch.callbacks.on_exception_checkpoint.OnExceptionCheckpoint",
    "lightning.pytorch.callbacks.device_stats_monitor.DeviceStatsMonitor",
    "lightning.pytorch.callbacks.throughput_monitor.ThroughputMonitor",
    "lightning.pytorch.callbacks.gradient_accumulation_scheduler.GradientAccumulationScheduler",
    "lightning.pytorch.callbacks.callback.Callback",
)
_LM_BASES = ("lightning.pytorch.core.module.", "lightning.pytorch.core.hooks.", "lightning.pytorch.core.datamodule.")


@dataclass
class Observers:
    """Hooks that can observe a deferred update, as ``"Class.hook"`` strings.

    Attributes:
        grads: gradient hooks present (the step must run in sync mode when non-empty).
        between: between-step hook name -> the overrides of it (flush before them).
    """

    grads: list[str] = field(default_factory=list)
    between: dict[str, list[str]] = field(default_factory=dict)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _defining_class(obj: Any, name: str) -> type | None:
    for cls in type(obj).__mro__:
        if name in cls.__dict__:
            return cls
    return None


def _callback_observes(callback: Any, hook: str) -> bool:
    if getattr(callback, "pipedap_reads_model", True) is False:
        return False
    if hook in getattr(callback, "__dict__", {}):  # set on the instance (LambdaCallback)
        return True
    owner = _defining_class(callback, hook)
    return owner is not None and _qualname(owner) not in SAFE_CALLBACKS


def _module_observes(module: Any, hook: str) -> bool:
    owner = _defining_class(module, hook)
    return owner is not None and not _qualname(owner).startswith(_LM_BASES)


def find_observers(module: Any, callbacks: Iterable[Any], datamodule: Any = None) -> Observers:
    """The hooks of ``module`` (a LightningModule), ``callbacks`` and ``datamodule`` that can observe a
    deferred update.

    Returns:
        :class:`Observers` with ``"Class.hook"`` entries in call order (callbacks, then the module); the
        batch hooks (:data:`BATCH_HOOKS`) of the module and the datamodule under ``"batch_transfer"``.
    """
    found = Observers()
    callbacks = list(callbacks)
    for hook in GRAD_HOOKS:
        if hook.startswith("on_"):
            found.grads += [f"{type(cb).__name__}.{hook}" for cb in callbacks if _callback_observes(cb, hook)]
        if _module_observes(module, hook):
            found.grads.append(f"{type(module).__name__}.{hook}")
    for hook in BETWEEN_HOOKS:
        names = [f"{type(cb).__name__}.{hook}" for cb in callbacks if _callback_observes(cb, hook)]
        if _module_observes(module, hook):
            names.append(f"{type(module).__name__}.{hook}")
        if names:
            found.between[hook] = names
    batch = [f"{type(obj).__name__}.{hook}" for obj in (datamodule, module) if obj is not None
             for hook in BATCH_HOOKS if _module_observes(obj, hook)]
    if batch:
        found.between["batch_transfer"] = batch
    return found


class ObservationFlush(Callback):
    """A Lightning callback, first in ``trainer.callbacks``, that makes the next hooks see DDP's values.

    It finds the observers (:func:`find_observers`) at set-up and again whenever the callback list
    changes, and logs once which hook costs what. Before the other callbacks' and the
    LightningModule's between-step hooks that observe, it applies the pending update and writes
    the averaged gradients to ``.grad`` (``defer_update="auto"``); before ``on_validation_start``
    and ``on_train_end`` it always applies pending updates (weight averaging callbacks copy their
    average into the model in ``on_train_end``; a pending update landing after that would
    overwrite it).

    Args:
        strategy: the :class:`~lightning_pipedap.PipeDAPStrategy` (its ``config``, ``flush()``, ``say_once()``,
            ``updates_pending`` and ``apply_pending()``).

    Attributes:
        observers: the :class:`Observers` found last.
    """

    pipedap_reads_model = False

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.observers = Observers()
        self._found_for: tuple[int, ...] | None = None

    def find(self, trainer: Any) -> None:
        """Find the observers of ``trainer``'s module and callbacks (a no-op when the callbacks did not change)."""
        ids = tuple(id(cb) for cb in trainer.callbacks)
        if ids == self._found_for:
            return
        self._found_for = ids
        self.observers = find_observers(trainer.lightning_module, trainer.callbacks, trainer.datamodule)
        if self.strategy.config.defer_update != "auto":
            return
        say = self.strategy.say_once  # (nothing outside a multi-process fit)
        if self.observers.grads:
            names = ", ".join(self.observers.grads)
            say("grads:" + names, f"pipedap: {names} can read or write .grad: steps run in sync mode (averaged "
                "gradients in .grad at the end of backward, the optimizer steps as with DDP; the reduce-scatter/"
                "all-gather still overlap backward). Pass defer_update=True if they do not.")
        for hook, found in self.observers.between.items():
            names = ", ".join(found)
            say(f"between:{hook}:{names}", f"pipedap: {names} can read parameters or .grad: pending updates are "
                f"applied before {hook} (their all-gathers no longer overlap the next forward). Pass "
                "defer_update=True if they do not.")

    def before_batch_transfer(self, trainer: Any) -> None:
        """Before the batch hooks (``on_before_batch_transfer``, ...) of the module and the datamodule."""
        self._observe("batch_transfer", trainer)

    def _observe(self, hook: str, trainer: Any) -> None:
        if not self.strategy.updates_pending or self.strategy._aborted or trainer.interrupted:
            return
        if hook == "on_train_end" or self.strategy.config.defer_update == "auto" and hook in self.observers.between:
            self.strategy.apply_pending("observe")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.find(trainer)
        self._observe("on_train_batch_start", trainer)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._observe("on_train_batch_end", trainer)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._observe("on_train_epoch_start", trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._observe("on_train_epoch_end", trainer)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.strategy.flush()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """First of the callbacks' ``on_exception``: no collective from here on (``strategy.abort``)."""
        self.strategy.abort(exception)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._observe("on_train_end", trainer)
