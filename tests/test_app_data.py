"""Data modules: digits split, the stdlib character corpus, synthetic data."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from lightning_pipedap.data import (
    DigitsDataModule,
    StdlibTextDataModule,
    SyntheticImagesDataModule,
    SyntheticTokensDataModule,
    stdlib_files,
)
from lightning_pipedap.data.stdlib_text import TokenWindows, is_val_file, read_corpus


def test_digits_split_is_deterministic_disjoint_and_complete():
    a, b = DigitsDataModule(), DigitsDataModule()
    a.setup(), b.setup()
    assert len(a.train_set) == 1438 and len(a.val_set) == 359  # 1,797 images, round(0.2 * 1797) = 359
    tr, va = a.split_indices(1797)
    assert np.array_equal(tr, b.split_indices(1797)[0])
    assert not set(tr) & set(va) and len(set(tr) | set(va)) == 1797
    x, y = a.train_set[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32 and 0.0 <= x.min() and x.max() <= 1.0
    assert torch.equal(a.val_set.tensors[1], b.val_set.tensors[1])
    assert DigitsDataModule(split_seed=1).split_indices(1797)[1].tolist() != va.tolist()


def test_digits_limit_and_bad_fraction():
    dm = DigitsDataModule(limit=100, val_fraction=0.25)
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set)) == (75, 25)
    with pytest.raises(ValueError, match="val_fraction"):
        DigitsDataModule(val_fraction=1.0)


def _fake_stdlib(root):
    files = {
        "a.py": b"print('a')\n",
        "pkg/b.py": b"x = 1",
        "pkg/c.txt": b"not python",
        "test/test_a.py": b"skipped",
        "pkg/tests/t.py": b"skipped",
        "site-packages/third.py": b"skipped",
        "__pycache__/a.py": b"skipped",
    }
    for rel, data in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def test_stdlib_files_skips_tests_and_third_party(tmp_path):
    _fake_stdlib(tmp_path)
    assert stdlib_files(str(tmp_path)) == ["a.py", "pkg/b.py"]
    # each file followed by a newline; max_bytes truncates exactly
    assert read_corpus(["a.py", "pkg/b.py"], str(tmp_path)) == b"print('a')\n\nx = 1\n"
    assert read_corpus(["a.py", "pkg/b.py"], str(tmp_path), max_bytes=13) == b"print('a')\n\nx"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        stdlib_files(str(tmp_path / "missing"))


def test_token_windows_shift_by_one():
    ds = TokenWindows(torch.arange(10, dtype=torch.uint8), block_size=3)
    assert len(ds) == 3  # (10 - 1) // 3
    x, y = ds[1]
    assert x.tolist() == [3, 4, 5] and y.tolist() == [4, 5, 6] and x.dtype == torch.int64
    with pytest.raises(IndexError):
        ds[3]


def test_real_stdlib_corpus_is_deterministic_with_disjoint_file_split():
    files = stdlib_files()
    assert files == sorted(files) and "os.py" in files and len(files) > 100
    assert not any(part in ("test", "tests", "site-packages") for f in files for part in f.split("/")[:-1])
    a = StdlibTextDataModule(block_size=64, train_bytes=20_000, val_bytes=5_000)
    b = StdlibTextDataModule(block_size=64, train_bytes=20_000, val_bytes=5_000)
    a.setup()
    assert a.fingerprint() == b.fingerprint()
    assert not set(a.train_files) & set(a.val_files)
    assert set(a.train_files) | set(a.val_files) == set(files)
    assert 0.05 < len(a.val_files) / len(files) < 0.15  # hash split, expected fraction 0.1
    assert all(is_val_file(f, 0.1) for f in a.val_files)
    assert len(a.train_set.tokens) == 20_000 and len(a.val_set.tokens) == 5_000
    assert len(a.train_set) == (20_000 - 1) // 64
    x, y = a.train_set[0]
    assert torch.equal(x[1:], y[:-1])
    # the train stream starts with the first train file's bytes
    with open(os.path.join(a.root or __import__("sysconfig").get_paths()["stdlib"], a.train_files[0]), "rb") as f:
        head = f.read(64)
    assert bytes(a.train_set.tokens[: len(head)].tolist()) == head


def test_synthetic_data_is_seeded():
    a, b = SyntheticImagesDataModule(num_samples=8, val_samples=2, shape=(3, 4, 4)), SyntheticImagesDataModule(
        num_samples=8, val_samples=2, shape=(3, 4, 4))
    a.setup(), b.setup()
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0]) and a.train_set.tensors[0].shape == (8, 3, 4, 4)
    t = SyntheticTokensDataModule(num_samples=4, val_samples=1, block_size=5, vocab_size=7)
    t.setup()
    x, y = t.train_set[0]
    assert x.shape == (5,) and torch.equal(x[1:], y[:-1]) and int(x.max()) < 7
