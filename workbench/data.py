"""Bundled data: the UCI handwritten digits (8x8), with a fixed train/test split, and text.

The text corpus (two public-domain authors, character-level) is in ``lm/corpus.py`` and its
names are re-exported here.

Source: E. Alpaydin and C. Kaynak (1998), "Optical Recognition of Handwritten Digits",
UCI Machine Learning Repository, https://doi.org/10.24432/C50P49 (CC BY 4.0), in the copy
that scikit-learn bundles as ``sklearn.datasets.load_digits``. ``tools/make_digits.py``
writes it to ``data/digits.npz``; data/README.md has the provenance.

The data files live in the repository's top-level ``data/`` (with their provenance in
``data/README.md``); the wheel ships them inside the package as ``workbench/_data/``
(``setup.py`` copies them at build time). ``bundled`` finds the installed copy first and the
checkout's ``data/`` otherwise, so an installed package (``pip install .``) and an editable
checkout load the same files; their sha256 is checked on every load.

Small enough for micro-batching and for training a model on two CPU cores in seconds,
real enough that DP-SGD's accuracy cost is visible.

Notation: n number of samples; x_i in [0, 1]^(1x8x8) the image, x_i = counts_i / 16;
y_i in {0..9} its label.

The split is a permutation of the 1797 indices drawn by ``np.random.default_rng(SPLIT_SEED)``:
the first floor(0.8 n) = 1437 are the training set, the other 360 the test set. Not stratified.
"""

import math
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from workbench.lm.corpus import TEXTS, CharTokenizer, load_text, split_ids, windows
from workbench.shipped import DataChecksumError, bundled, sha256_of

# the checksum helpers (shipped.py) and the text corpus (lm/corpus.py: two public-domain
# authors, by character) are re-exported here, beside the data sets
__all__ = [
    "DIGITS_PATH", "DIGITS_SHA256", "CharTokenizer", "DataChecksumError", "TEXTS",
    "bundled", "check_digits_file", "fast_mode", "load_digits", "load_digits_arrays",
    "load_text", "sha256_of", "split_indices", "split_ids", "to_dataset", "windows",
]

DIGITS_PATH = bundled("digits.npz")
DIGITS_SHA256 = "1dc781c8fe699ce12f056a510e6dd518c795428f089effc1a3e2eec0f3ece269"
REGENERATE = "python tools/make_digits.py"  # run from the repository root; needs scikit-learn
SPLIT_SEED = 0
TRAIN_FRACTION = 0.8
MAX_PIXEL = 16  # pixel values are counts of on-pixels in 4x4 blocks: 0..16

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def fast_mode() -> bool:
    """True when the environment variable ``WORKBENCH_FAST`` asks for small, quick runs.

    Notebooks shrink data and epochs when it is set ("1", "true", "yes", "on"; any case).
    Unset, "", "0", "false", "no" and "off" mean full size.
    """
    value = os.environ.get("WORKBENCH_FAST", "")
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise ValueError(
        f"WORKBENCH_FAST={value!r} is not understood; use WORKBENCH_FAST=1 for fast runs "
        "or unset it (or 0) for full-size runs"
    )


def check_digits_file(path: Path) -> None:
    """Raise a specific error when ``path`` is missing or not the expected bytes."""
    if not path.is_file():
        raise FileNotFoundError(
            f"digits data file not found: {path}. Regenerate it from the repository root with "
            f"`{REGENERATE}` (needs scikit-learn), or pass path= to where your copy lives"
        )
    got = sha256_of(path)
    if got != DIGITS_SHA256:
        raise DataChecksumError(
            f"digits data file {path} has sha256 {got}, expected {DIGITS_SHA256}; the file is "
            f"corrupt or was written differently. Regenerate it with `{REGENERATE}` or restore "
            "it with `git checkout data/digits.npz` (or reinstall the package)"
        )


def load_digits_arrays(path: str | Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Raw arrays after the checksum check: images uint8 (1797, 8, 8) in 0..16, labels (1797,)."""
    path = DIGITS_PATH if path is None else Path(path)
    check_digits_file(path)
    with np.load(path, allow_pickle=False) as archive:
        return archive["images"], archive["labels"]


def split_indices(n: int, seed: int = SPLIT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """Fixed split of ``range(n)``: (train, test) index arrays, floor(0.8 n) training samples.

    A permutation from ``np.random.default_rng(seed)``. NumPy does not promise that a
    Generator's stream stays the same across releases (NEP 19), so tests/test_data.py pins the
    first test indices: a change in numpy that moves the split fails there, not silently.
    """
    permutation = np.random.default_rng(seed).permutation(n)  # (n,)
    n_train = math.floor(TRAIN_FRACTION * n)
    return permutation[:n_train], permutation[n_train:]


def to_dataset(images: np.ndarray, labels: np.ndarray) -> TensorDataset:
    """TensorDataset of x float32 (n, 1, 8, 8) in [0, 1] and y int64 (n,)."""
    x = torch.from_numpy(images.astype(np.float32) / MAX_PIXEL).unsqueeze(1)  # (n, 1, 8, 8)
    y = torch.from_numpy(labels.astype(np.int64))  # (n,)
    return TensorDataset(x, y)


def load_digits(path: str | Path | None = None) -> tuple[TensorDataset, TensorDataset]:
    """The digits as (train, test) TensorDatasets of 1437 and 360 samples.

    Each item is (x, y): x float32 (1, 8, 8) scaled into [0, 1], y int64 in 0..9.
    ``path`` defaults to the copy shipped in the package (``DIGITS_PATH``,
    ``data/digits.npz``); the file's sha256 is checked
    (FileNotFoundError when missing, DataChecksumError, a ValueError, when corrupt).
    """
    images, labels = load_digits_arrays(path)
    train_idx, test_idx = split_indices(len(labels))
    train = to_dataset(images[train_idx], labels[train_idx])
    test = to_dataset(images[test_idx], labels[test_idx])
    return train, test
