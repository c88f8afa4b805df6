"""The bundled digits: file checksum, shapes, dtypes, ranges and the fixed 1437/360 split."""

import shutil

import numpy as np
import pytest
import torch

from workbench.data import (
    DIGITS_PATH,
    DIGITS_SHA256,
    DataChecksumError,
    fast_mode,
    load_digits,
    sha256_of,
    split_indices,
)


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def test_bundled_file_matches_checksum():
    assert DIGITS_PATH.is_file()
    assert sha256_of(DIGITS_PATH) == DIGITS_SHA256


def test_split_sizes(digits):
    train, test = digits
    assert (len(train), len(test)) == (1437, 360)


@pytest.mark.parametrize("part", [0, 1])
def test_shapes_dtypes_and_ranges(digits, part):
    x, y = digits[part].tensors
    assert x.shape[1:] == (1, 8, 8) and x.dtype == torch.float32
    assert y.shape == (x.shape[0],) and y.dtype == torch.int64
    assert x.min() >= 0.0 and x.max() <= 1.0
    assert x.max() == 1.0  # some pixel is fully on: the scale is /16, not /max
    assert torch.equal(x * 16, torch.round(x * 16))  # counts 0..16 survive the scaling
    assert set(y.tolist()) == set(range(10))


def test_split_is_a_partition_and_fixed():
    train_idx, test_idx = split_indices(1797)
    assert np.array_equal(np.sort(np.concatenate([train_idx, test_idx])), np.arange(1797))
    again_train, again_test = split_indices(1797)
    assert np.array_equal(train_idx, again_train) and np.array_equal(test_idx, again_test)
    # Pinned: numpy does not promise Generator streams across releases (NEP 19).
    assert test_idx[:5].tolist() == [256, 1340, 1067, 1276, 1409]


def test_file_equals_scikit_learn_copy():
    datasets = pytest.importorskip("sklearn.datasets", reason="scikit-learn is optional")
    source = datasets.load_digits()
    with np.load(DIGITS_PATH) as archive:
        assert np.array_equal(archive["images"], source.images)
        assert np.array_equal(archive["labels"], source.target)


def test_load_is_deterministic(digits):
    train, test = load_digits()
    assert torch.equal(train.tensors[0], digits[0].tensors[0])
    assert torch.equal(test.tensors[1], digits[1].tensors[1])


def test_path_override_reads_a_copy(tmp_path, digits):
    copy = tmp_path / "digits.npz"
    shutil.copyfile(DIGITS_PATH, copy)
    train, _ = load_digits(path=copy)
    assert torch.equal(train.tensors[0], digits[0].tensors[0])


def test_missing_file_names_path_and_fix(tmp_path):
    missing = tmp_path / "nowhere.npz"
    with pytest.raises(FileNotFoundError) as info:
        load_digits(path=missing)
    message = str(info.value)
    assert str(missing) in message and "python data/make_digits.py" in message


def test_corrupt_file_names_both_checksums_and_fix(tmp_path):
    corrupt = tmp_path / "digits.npz"
    data = bytearray(DIGITS_PATH.read_bytes())
    data[-100] ^= 0xFF  # flip one byte
    corrupt.write_bytes(bytes(data))
    with pytest.raises(DataChecksumError) as info:
        load_digits(path=corrupt)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert DIGITS_SHA256 in message and sha256_of(corrupt) in message
    assert "python data/make_digits.py" in message


@pytest.mark.parametrize(
    "value, expected",
    [("1", True), ("true", True), ("TRUE", True), ("0", False), ("false", False), ("", False)],
)
def test_fast_mode_reads_env(monkeypatch, value, expected):
    monkeypatch.setenv("WORKBENCH_FAST", value)
    assert fast_mode() is expected


def test_fast_mode_unset_is_false(monkeypatch):
    monkeypatch.delenv("WORKBENCH_FAST", raising=False)
    assert fast_mode() is False


def test_fast_mode_rejects_unknown_value(monkeypatch):
    monkeypatch.setenv("WORKBENCH_FAST", "maybe")
    with pytest.raises(ValueError, match="WORKBENCH_FAST='maybe'"):
        fast_mode()
