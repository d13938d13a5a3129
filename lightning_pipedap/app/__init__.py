"""The Hydra application: ``pipedap-train`` / ``python -m lightning_pipedap.app.train``.

* :mod:`~lightning_pipedap.app.train`: the entry point (``@hydra.main``; config in
  ``lightning_pipedap/conf/``, package data).
* :mod:`~lightning_pipedap.app.schema`: structured-config schemas (dataclasses in Hydra's ConfigStore)
  and the validation run before any process starts.
* :mod:`~lightning_pipedap.app.launch`: making multi-process training work under Hydra multirun.
* :mod:`~lightning_pipedap.app.sweep`: Hydra callbacks that validate every job of a sweep up front and
  summarise it at the end (CSV, Markdown, PNG, TensorBoard).
"""
