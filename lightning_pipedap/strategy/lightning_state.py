"""Where :class:`~lightning_pipedap.strategy.lightning.PipeDAPStrategy` brings the parameters up to date and saves
or restores the run-time's state (mixins of it): :class:`FlushPoints` (pending updates applied before validation,
the end of training, a state dict) and :class:`CheckpointHooks` (the final schedule and the compression state in
a checkpoint, and back at resume).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

import lightning_pipedap.strategy.messages as M
import lightning_pipedap.strategy.sharded_checkpoint as SC
from lightning_pipedap.strategy.lightning_reads import trainer_of
from lightning_pipedap.strategy.resume import add_plan, add_to_checkpoint


class FlushPoints:
    """The flush points: every pending update is applied before Lightning reads or replaces the parameters
    (validation, the end of training, ``lightning_module_state_dict``, ``optimizer_state``). Mixed into
    :class:`~lightning_pipedap.strategy.lightning.PipeDAPStrategy` ahead of ``DDPStrategy``."""

    _rt: Any
    _aborted: bool
    lightning_module: Any
    config: Any
    global_rank: int

    def flush(self) -> None:
        """Apply every pending update now (all ranks must call it). No-op after an exception."""
        rt = self._rt
        if self._aborted or rt is None:
            return
        trainer = trainer_of(self.lightning_module)
        if trainer is not None and trainer.interrupted:
            return
        rt.flush()

    @override
    def on_validation_start(self) -> None:
        self.flush()
        if self._rt is not None and self._rt.deferred is not None:
            self._rt.deferred.forget_unwritten()  # Lightning cleared .grad for validation, as under DDP
        super().on_validation_start()

    @override
    def on_train_end(self) -> None:
        self.flush()
        super().on_train_end()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.flush()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """The optimizer's state dict as DDP's, pending updates applied. With ``shard_optimizer`` the state is
        gathered from every rank's shards, on rank 0 in CPU memory (the other ranks get ``{}``, as with Lightning's
        FSDP strategy; the checkpoint is written by rank 0): a collective, so every rank calls it, as Lightning's
        checkpointing does. After a failure nothing can be gathered: ``{}``, and :meth:`save_checkpoint` then
        writes nothing and says why. With ``sharded_checkpoint``: this rank's part, no collective
        (:func:`.sharded_checkpoint.local_optimizer_state`)."""
        self.flush()
        rt = self._rt
        if self.config.sharded_checkpoint:  # (this rank's part only, as FSDP's sharded state dict: no collective)
            return SC.rank_part(rt, optimizer, self.lightning_module, self.global_rank)
        if rt is not None and rt.slot.holds_sharded(optimizer):
            return {} if self._aborted else rt.slot.sharded_state_dict(optimizer)
        return super().optimizer_state(optimizer)

    def optimizer_state_nbytes(self, optimizer: Optimizer) -> int:
        """Bytes of ``optimizer``'s state held by this rank (with ``shard_optimizer``: its shards, about 1/N)."""
        rt = self._rt
        if rt is not None:
            return rt.slot.state_nbytes(optimizer)
        return sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
                   if isinstance(v, Tensor))


class CheckpointHooks:
    """The final schedule and every rank's compression state in a checkpoint (:func:`.resume.add_to_checkpoint`),
    and back into the resume state at load (:class:`~lightning_pipedap.strategy.resume.ResumeState`). Mixed into
    :class:`~lightning_pipedap.strategy.lightning.PipeDAPStrategy` ahead of ``DDPStrategy``."""

    _rt: Any
    _aborted: bool
    _resume: Any
    lightning_module: Any
    optimizers: Any
    config: Any
    updates_pending: bool
    failure_checkpoint: Any
    world_size: int
    global_rank: int

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Add the final schedule and every rank's compression state (:func:`.resume.add_to_checkpoint`: one
        ``all_gather_object``, so every rank must call it, as ``Trainer.save_checkpoint`` does), then let rank 0
        write. After a failure the state of the last step whose update completed is written, assembled on this rank
        (:mod:`.failure_state`: no collective; the plan is added, the other ranks' compression state is not), or
        nothing, with a warning saying why.
        """
        if self._aborted:  # (the trainer was left at the last completed step, or why not: .failure_state)
            why = self.failure_checkpoint(filepath)
            if why is None and self.config.sharded_checkpoint:
                why = ("sharded_checkpoint=True writes through torch.distributed.checkpoint, a collective every rank "
                       "must join")
            if why is not None:
                M.warn(f"pipedap: not writing {filepath} after the failure: {why}")
                return
            if self._rt is not None:
                add_plan(self._rt, checkpoint)  # (local; the other ranks' compression state cannot be gathered)
        elif self._rt is not None:
            add_to_checkpoint(self._rt, checkpoint)
        if self.config.sharded_checkpoint:  # (a directory, each rank writing its part: sharded_checkpoint.py)
            if storage_options is not None:
                raise TypeError("pipedap: sharded_checkpoint=True writes through torch.distributed.checkpoint, not "
                                f"the CheckpointIO: storage_options={storage_options!r} is not supported (as with "
                                "Lightning's FSDP strategy)")
            SC.save_sharded_checkpoint(checkpoint, filepath)
            return
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load as Lightning does, and keep this rank's compression state and the plan for set-up.

        Lightning loads the checkpoint before ``setup`` (``configure_ddp``), so the plan is installed there
        directly and the compression state is applied when compression starts. A checkpoint of another
        compressor or world size gives a warning naming both values, and compression starts with fresh state.
        """
        if SC.is_sharded_checkpoint(checkpoint_path):  # (a directory: sharded_checkpoint=True wrote it)
            checkpoint = SC.load_sharded_checkpoint(checkpoint_path, weights_only=weights_only)
        else:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        cfg = self.config
        for note in self._resume.load_state_dict(checkpoint, cfg.compression, cfg.compression_kwargs,
                                                 self.world_size, self.global_rank):
            (M.warn if "fresh" in note else M.info)(note)
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """As Lightning; a sharded checkpoint's optimizer states are read by each rank for its own slices (or whole
        where it steps unsharded): re-sharded to this world size (:func:`.sharded_checkpoint.load_optimizer_states`)."""
        states = checkpoint["optimizer_states"]
        if not any(SC.is_sharded_state(st) for st in states):
            return super().load_optimizer_state_dict(checkpoint)
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        SC.load_optimizer_states(self.optimizers, states, names, SC.sharded_of(self._rt),
                                 lambda torch_states: super(CheckpointHooks, self).load_optimizer_state_dict(
                                     {**checkpoint, "optimizer_states": torch_states}))
        return None
