"""Profile replay: the published profiles (vgg16, resnet50, densenet201, bert_base, gpt2) as sleep models with
real parameters, trained by every matrix strategy over real gloo traffic on the network-namespace testbed.

* :mod:`~lightning_pipedap.bench.replay.model`: the sleep model (layers of the profile's sizes whose
  forward/backward sleep ``t_f`` / ``t_b``, releasing the GIL like asynchronous GPU kernels);
* :mod:`~lightning_pipedap.bench.replay.rates`: comm/compute ratios and the link rate for a ratio (pure);
* :mod:`~lightning_pipedap.bench.replay.cells`: per profile and rank count the scales and rate (pure);
* :mod:`~lightning_pipedap.bench.replay.analysis`: window bound, ratios, simulator error, tables (pure);
* :mod:`~lightning_pipedap.bench.replay.cli`: the command line; each cell is one launch of the benchmark
  matrix's driver (:func:`lightning_pipedap.bench.matrix.driver.run_cell`) with the model ``"replay"``.
"""
