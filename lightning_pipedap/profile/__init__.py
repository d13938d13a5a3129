"""Measuring the inputs of planning at run time: per-layer compute times and the α-β cost model.

* :mod:`.recorder` turns timestamps taken in the strategy's hooks during warm-up steps into a
  :class:`~lightning_pipedap.plan.profile.ModelProfile` (pure Python).
* :mod:`.alpha_beta` times RS, AG and AR on the live dedicated process group and fits
  ``T = α + β·bytes`` per primitive (through :mod:`lightning_pipedap.engine.collectives`).
"""

from lightning_pipedap.profile.recorder import StepRecorder, group_layers, merge_steps

__all__ = ["StepRecorder", "group_layers", "merge_steps"]
