"""LightningDataModules for the app: real data that needs no download, and synthetic data.

* :class:`DigitsDataModule`: scikit-learn's 1,797 handwritten 8x8 digits, deterministic split.
* :class:`StdlibTextDataModule`: the Python standard library's own ``.py`` sources as a byte-level
  character corpus (present on every machine), deterministic file list and split.
* :class:`SyntheticImagesDataModule`, :class:`SyntheticTokensDataModule`: seeded random tensors for
  throughput benchmarks.
"""

from lightning_pipedap.data.digits import DigitsDataModule
from lightning_pipedap.data.stdlib_text import StdlibTextDataModule, stdlib_files
from lightning_pipedap.data.synthetic import SyntheticImagesDataModule, SyntheticTokensDataModule

__all__ = [
    "DigitsDataModule",
    "StdlibTextDataModule",
    "SyntheticImagesDataModule",
    "SyntheticTokensDataModule",
    "stdlib_files",
]
