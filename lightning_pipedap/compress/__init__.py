"""Gradient compression: compressors with error feedback, and the pipelined helper process.

* :mod:`.base`: :class:`Payload`, :class:`Compressor`, :class:`BucketState`.
* :mod:`.compressors`: the methods and :func:`get_compressor` (the registry of all methods).
* :mod:`.powersgd`: :class:`~.powersgd.PowerSGDCompressor` and its per-bucket matrix layout.
* :mod:`.memory`: error-feedback residual updates.
* :mod:`.runtime`: :class:`CompressionRuntime` (compressor + per-bucket states).
* :mod:`.state`: the state per parameter name, for checkpoints and re-plans (independent of buckets).
* :mod:`.pipeline`: :class:`CompressionPipeline` (helper process with shared-memory slots, or inline),
  built from :mod:`.tickets` (ticket book-keeping), :mod:`.backends` (where compression runs),
  :mod:`.slots` (shared-memory slots and payload hand-off), :mod:`.channel` (the trainer's end of the
  helper: start, requests, timeouts, liveness) and :mod:`.helper` (the helper process itself).
"""

from lightning_pipedap.compress.base import BucketState, Compressor, Payload, TensorSpec
from lightning_pipedap.compress.compressors import compressor_kwargs, get_compressor, valid_compressor_names
from lightning_pipedap.compress.runtime import CompressionRuntime

__all__ = [
    "BucketState", "Compressor", "Payload", "TensorSpec", "CompressionRuntime",
    "compressor_kwargs", "get_compressor", "valid_compressor_names",
    "CompressionPipeline", "Ticket", "HelperDiedError", "HelperTimeoutError",
]


def __getattr__(name):  # lazy: the pipeline pulls in multiprocessing machinery
    if name in ("CompressionPipeline", "Ticket", "HelperDiedError", "HelperTimeoutError"):
        from lightning_pipedap.compress import pipeline

        return getattr(pipeline, name)
    raise AttributeError(name)
