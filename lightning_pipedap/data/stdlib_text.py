"""The Python standard library's own ``.py`` sources as a byte-level character corpus.

Every Python installation carries its standard library, so this is real text (code) that needs no
download. Tokens are the UTF-8 bytes of the files (vocabulary 256): a character-level corpus for
ASCII source, with no vocabulary file to build or ship. The corpus depends on the Python version
(3.11.7 here: about 730 files, 14 MB without the test suites).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import zlib
from typing import Optional

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

#: Directories skipped: third-party packages, caches, and the test suites (Linux distributions ship
#: those separately, so skipping them keeps the corpus the same across distributions).
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
VOCAB_SIZE = 256


def stdlib_root() -> str:
    """Directory of the running interpreter's standard library (``sysconfig`` path ``"stdlib"``)."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: Optional[str] = None) -> list[str]:
    """All ``.py`` files under ``root`` (default :func:`stdlib_root`), as sorted POSIX paths relative
    to ``root``, skipping :data:`EXCLUDED_DIRS`. Deterministic for a given installation.

    Raises:
        FileNotFoundError: ``root`` is not a directory, or holds no ``.py`` file.
    """
    root = root or stdlib_root()
    if not os.path.isdir(root):
        raise FileNotFoundError(f"standard library directory {root!r} does not exist")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        rel_dir = os.path.relpath(dirpath, root)
        for f in filenames:
            if f.endswith(".py"):
                out.append(f if rel_dir == "." else f"{rel_dir}/{f}".replace(os.sep, "/"))
    if not out:
        raise FileNotFoundError(f"no .py files under {root!r}")
    return sorted(out)


def is_val_file(rel_path: str, val_fraction: float) -> bool:
    """Whether ``rel_path`` belongs to the validation split: ``crc32(path) mod 10000 < 10000 * f``.

    A hash of the path (not a random draw) keeps each file's split stable when other files are added
    or removed, and identical on every rank, run and machine with the same library.
    """
    return zlib.crc32(rel_path.encode()) % 10000 < val_fraction * 10000


def read_corpus(files: list[str], root: str, max_bytes: Optional[int] = None) -> bytes:
    """Concatenate ``files`` (relative to ``root``) in order, each followed by a newline; stop once
    ``max_bytes`` bytes are collected (the result is then exactly ``max_bytes`` long)."""
    parts: list[bytes] = []
    n = 0
    for rel in files:
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read() + b"\n"
        parts.append(data)
        n += len(data)
        if max_bytes is not None and n >= max_bytes:
            break
    out = b"".join(parts)
    return out if max_bytes is None else out[:max_bytes]


class TokenWindows(Dataset):
    """Non-overlapping windows of a token stream for next-token prediction.

    Item ``i``: ``x = tokens[i*T : i*T + T]``, ``y = tokens[i*T + 1 : i*T + T + 1]`` (both ``(T,)``
    int64, ``T = block_size``). Length ``(len(tokens) - 1) // T``.
    """

    def __init__(self, tokens: Tensor, block_size: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.block_size)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range [0, {len(self)})")
        s = i * self.block_size
        chunk = self.tokens[s : s + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class StdlibTextDataModule(pl.LightningDataModule):
    """Byte-level language-modelling data from the standard library's sources.

    Files are split by :func:`is_val_file` (whole files, so no text leaks between splits), each
    split's files are concatenated in sorted order, and cut into :class:`TokenWindows`.

    Args:
        block_size: tokens per sequence T.
        batch_size: sequences per batch per process.
        val_fraction: expected fraction of files in the validation split (0 < f < 1).
        train_bytes: keep only the first ``train_bytes`` bytes of the train stream; ``None``: all.
        val_bytes: same for the validation stream.
        root: library directory (default: the running interpreter's).
        num_workers: DataLoader workers.

    Raises:
        ValueError: bad sizes, or a split with fewer than ``block_size + 1`` bytes.
        FileNotFoundError: ``root`` missing or without ``.py`` files.
    """

    def __init__(self, block_size: int = 128, batch_size: int = 32, val_fraction: float = 0.1,
                 train_bytes: Optional[int] = 2_000_000, val_bytes: Optional[int] = 200_000,
                 root: Optional[str] = None, num_workers: int = 0) -> None:
        super().__init__()
        if block_size < 1 or batch_size < 1:
            raise ValueError(f"block_size and batch_size must be >= 1, got {block_size}, {batch_size}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        for name, v in (("train_bytes", train_bytes), ("val_bytes", val_bytes)):
            if v is not None and v <= block_size:
                raise ValueError(f"{name}={v} must exceed block_size={block_size} (or be None)")
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.train_bytes = train_bytes
        self.val_bytes = val_bytes
        self.root = root
        self.num_workers = num_workers
        self.train_files: list[str] = []
        self.val_files: list[str] = []
        self.train_set: Optional[TokenWindows] = None
        self.val_set: Optional[TokenWindows] = None

    def split_files(self) -> tuple[list[str], list[str]]:
        """``(train_files, val_files)``, sorted relative paths."""
        files = stdlib_files(self.root)
        val = [f for f in files if is_val_file(f, self.val_fraction)]
        train = [f for f in files if not is_val_file(f, self.val_fraction)]
        if not val or not train:
            raise ValueError(f"val_fraction={self.val_fraction} leaves an empty split of {len(files)} files")
        return train, val

    def fingerprint(self) -> str:
        """SHA-256 (hex, first 16 digits) of both token streams: equal fingerprints, equal data."""
        self.setup()
        h = hashlib.sha256()
        for ds in (self.train_set, self.val_set):
            h.update(ds.tokens.numpy().tobytes())
        return h.hexdigest()[:16]

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        root = self.root or stdlib_root()
        self.train_files, self.val_files = self.split_files()
        streams = []
        for files, limit, name in ((self.train_files, self.train_bytes, "train"),
                                   (self.val_files, self.val_bytes, "val")):
            data = read_corpus(files, root, limit)
            if len(data) <= self.block_size:
                raise ValueError(f"{name} split has {len(data)} bytes, fewer than block_size + 1 = "
                                 f"{self.block_size + 1}")
            streams.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.train_set = TokenWindows(streams[0], self.block_size)
        self.val_set = TokenWindows(streams[1], self.block_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)
