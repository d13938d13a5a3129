"""The communication engine: flat buckets, the worker that runs a schedule's op list, transports.

* :mod:`~lightning_pipedap.engine.collectives` -- the one module that calls ``torch.distributed``
  (ring reduce-scatter / all-gather / all-reduce on gloo, NCCL calls on CUDA, the dedicated group);
* :mod:`~lightning_pipedap.engine.buckets` -- :class:`FlatBucket` (tensor fusion, tensor partitioning:
  pieces of split parameters, used flags);
* :mod:`~lightning_pipedap.engine.transport` -- :class:`DenseTransport` and the :class:`Transport`
  interface; :mod:`~lightning_pipedap.engine.compressed` -- :class:`CompressedTransport`;
* :mod:`~lightning_pipedap.engine.engine` -- :class:`CommEngine` (one worker thread per rank);
* :mod:`~lightning_pipedap.engine.update` -- per-bucket optimizer updates and gradient write-back;
* :mod:`~lightning_pipedap.engine.sparse` -- :class:`SparseGradReducer` (sparse gradients, reduced as DDP does);
* :mod:`~lightning_pipedap.engine.threads` -- thread priority of the training thread.
"""

from lightning_pipedap.engine.buckets import FlatBucket
from lightning_pipedap.engine.compressed import CompressedTransport, CompressionStats
from lightning_pipedap.engine.engine import CommEngine, EngineError
from lightning_pipedap.engine.sparse import SparseGradReducer
from lightning_pipedap.engine.transport import DenseTransport, Transport

__all__ = ["CommEngine", "CompressedTransport", "CompressionStats", "DenseTransport", "EngineError", "FlatBucket",
           "SparseGradReducer", "Transport"]
