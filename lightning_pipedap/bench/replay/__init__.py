"""Profile replay: the published profiles (vgg16, resnet50, densenet201, bert_base, gpt2) as sleep models with
real parameters, trained by every matrix strategy over real gloo traffic on the network-namespace testbed.

* :mod:`~lightning_pipedap.bench.replay.model`: the sleep model (layers of the profile's sizes whose
  forward/backward sleep ``t_f`` / ``t_b``, releasing the GIL like asynchronous GPU kernels);
* :mod:`~lightning_pipedap.bench.replay.rates`: comm/compute ratios and the link rate for a ratio (pure);
* :mod:`~lightning_pipedap.bench.replay.cells`: per profile and rank count the scales and rate (pure);
* :mod:`~lightning_pipedap.bench.replay.analysis`: window bound, ratios, simulator error, tables (pure);
* :mod:`~lightning_pipedap.bench.replay.cli`: the command line; each cell is one launch of the benchmark
  matrix's driver (:func:`lightning_pipedap.bench.matrix.driver.run_cell`) with the model ``"replay"``.

The optimizer step is not replayed from the profile: the published profiles hold no optimizer time
(``t_update = 0`` in all five), and the sleep model's parameters are real tensors of the profile's sizes, so every
variant runs the real optimizer (``--optimizer sgd|adam``, the matrix's :data:`~lightning_pipedap.bench.matrix.models.
OPTIMIZERS`) over them, on this CPU. What the strategy's simulator is given for ``t_update`` is what the strategy
measures in its profiling steps, as for any model: unsharded, the time from the end of backward to the end of the
step; with ``shard_optimizer=True`` (``@shard``), the engine's time of the sharded sync step scaled to a whole-model
update (the unsharded part plus N x this rank's slices, without the parameter all-gathers), which the sharded model
then divides by N per bucket (``t_update · bytes(b) / total / N`` on the communication channel between ``RS(b)``
and ``AG(b)``, :mod:`lightning_pipedap.plan.sharding`). The profile's ``t_update`` (0) enters only the cell's
nominal comm/compute ratio (:mod:`~lightning_pipedap.bench.replay.rates`); the window bound is scaled to the
measured compute-only iteration, which includes the real step.
"""
