"""``python -m lightning_pipedap.bench.replay``: see :mod:`lightning_pipedap.bench.replay.cli`."""

import sys

from lightning_pipedap.bench.replay.cli import main

if __name__ == "__main__":
    sys.exit(main())
