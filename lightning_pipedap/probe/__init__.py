"""Measuring the inputs of planning at run time: per-layer compute times and the α-β cost model.

* :mod:`.recorder` turns timestamps taken in the strategy's hooks during warm-up steps into a
  :class:`~lightning_pipedap.plan.profile.ModelProfile` (pure Python).
* :mod:`.alpha_beta` times RS, AG and AR on the live dedicated process group and fits
  ``T = α + β·bytes`` per primitive (through :mod:`lightning_pipedap.engine.collectives`).
* :mod:`.compression_cost` times the configured gradient compressor in the trainer and returns the
  :class:`~lightning_pipedap.plan.compression.CompressionCost` the planners use (imported on use).
"""

from lightning_pipedap.probe.recorder import StepRecorder, group_layers, merge_steps

__all__ = ["StepRecorder", "group_layers", "merge_steps"]
