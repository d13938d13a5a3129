"""``python -m lightning_pipedap.bench.matrix``: see :func:`lightning_pipedap.bench.matrix.driver.main`."""

import sys

from lightning_pipedap.bench.matrix.driver import main

if __name__ == "__main__":
    sys.exit(main())
