"""Which hooks can observe a deferred update (``lightning_pipedap.observers``). No processes."""

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import (BackboneFinetuning, EarlyStopping, EMAWeightAveraging, LearningRateMonitor,
                                         ModelCheckpoint, TQDMProgressBar)

from lightning_pipedap.measure import CommTimeline, SpeedupMonitor
from lightning_pipedap.strategy.observers import find_observers


class Plain(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)


class GradNormLogging(Plain):
    """Lightning docs ("Track and visualize gradient norms"): ``grad_norm`` in ``on_before_optimizer_step``."""

    def on_before_optimizer_step(self, optimizer):
        pass


class Clipping(Plain):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)


class BatchEndReader(Plain):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        pass


class MyBar(TQDMProgressBar):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.layer.weight.norm()


class Harmless(pl.Callback):
    pipedap_reads_model = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pass


def test_plain_module_and_lightnings_own_callbacks_observe_nothing():
    found = find_observers(Plain(), [TQDMProgressBar(), LearningRateMonitor(), ModelCheckpoint(), EarlyStopping("x"),
                                     SpeedupMonitor(), CommTimeline(), Harmless()])
    assert found.grads == [] and found.between == {}


def test_gradient_hooks_of_the_module_are_found():
    assert find_observers(GradNormLogging(), []).grads == ["GradNormLogging.on_before_optimizer_step"]
    assert find_observers(Clipping(), []).grads == ["Clipping.configure_gradient_clipping"]


def test_between_step_hooks_of_module_and_callbacks():
    found = find_observers(BatchEndReader(), [MyBar(), EMAWeightAveraging()])
    assert found.grads == []
    assert found.between["on_train_batch_end"] == ["MyBar.on_train_batch_end", "EMAWeightAveraging.on_train_batch_end",
                                                   "BatchEndReader.on_train_batch_end"]
    assert found.between["on_train_epoch_end"] == ["EMAWeightAveraging.on_train_epoch_end"]
    assert "on_train_batch_start" not in found.between


def test_finetuning_callback_counts_as_observer_of_the_epoch_start():
    found = find_observers(Plain(), [BackboneFinetuning()])
    assert found.between == {"on_train_epoch_start": ["BackboneFinetuning.on_train_epoch_start"]}


def test_lambda_callback_hooks_set_on_the_instance_are_observers():
    """``LambdaCallback(on_train_batch_end=fn)`` sets the hook as an instance attribute."""
    from lightning.pytorch.callbacks import LambdaCallback

    found = find_observers(Plain(), [LambdaCallback(on_train_batch_end=lambda *a: None)])
    assert found.between == {"on_train_batch_end": ["LambdaCallback.on_train_batch_end"]}


class BatchHook(Plain):
    def on_after_batch_transfer(self, batch, dataloader_idx):
        return batch


def test_batch_hooks_of_module_and_datamodule_are_observers():
    class DM(pl.LightningDataModule):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            return batch

    found = find_observers(BatchHook(), [], DM())
    assert found.between == {"batch_transfer": ["DM.on_before_batch_transfer", "BatchHook.on_after_batch_transfer"]}
    assert find_observers(Plain(), [], pl.LightningDataModule()).between == {}
