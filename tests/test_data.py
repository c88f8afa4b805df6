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
    assert str(missing) in message and "python tools/make_digits.py" in message


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
    assert "python tools/make_digits.py" in message


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


# --- the text corpus (workbench/lm/corpus.py, re-exported by workbench.data) ---------------------

from workbench.data import TEXTS, CharTokenizer, load_text, split_ids, windows  # noqa: E402
from workbench.lm.corpus import TEXT_DIR, normalise  # noqa: E402


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_text_files_match_checksums_and_roles(name):
    assert sha256_of(TEXT_DIR / TEXTS[name].file) == TEXTS[name].sha256
    assert {s.role for s in TEXTS.values()} == {"public", "private"}


def test_texts_load_normalised_with_known_lengths_and_openings():
    shakespeare, carroll = load_text("shakespeare"), load_text("carroll")
    assert (len(shakespeare), len(carroll)) == (122_813, 143_255)
    assert shakespeare.startswith("AS YOU LIKE IT\n\nDRAMATIS PERSONAE")
    assert carroll.startswith("ALICE'S ADVENTURES IN WONDERLAND\n\nLewis Carroll")
    for text in (shakespeare, carroll):
        assert "\r" not in text and "\t" not in text and "  " not in text and "\n\n\n" not in text


def test_normalise_rules():
    assert normalise("a\t b \r\n\r\n\r\n\r\nc  d\x1a") == "a b\n\nc d\n"


def test_tokenizer_round_trip_and_fixed_alphabet():
    tok = CharTokenizer()
    assert tok.vocab_size == 96 and tok.encode("\n")[0] == 0 and tok.encode(" ")[0] == 1
    text = load_text("carroll")
    ids = tok.encode(text)
    assert ids.dtype == torch.int64 and 0 <= ids.min() and ids.max() < 96
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("the PIN is 4815")) == "the PIN is 4815"


def test_tokenizer_names_unknown_character():
    with pytest.raises(ValueError, match=r"'é' at position 2"):
        CharTokenizer().encode("caé")
    with pytest.raises(ValueError, match="repeated"):
        CharTokenizer("aa")


def test_split_and_windows_shift_by_one():
    ids = torch.arange(23)
    train, val = split_ids(ids, val_fraction=0.25)
    assert torch.equal(torch.cat([train, val]), ids) and len(val) == 6
    x, y = windows(ids, 5).tensors
    assert x.shape == y.shape == (4, 5)
    assert torch.equal(x[1], torch.arange(5, 10)) and torch.equal(y[1], torch.arange(6, 11))
    with pytest.raises(ValueError, match="block_size=30"):
        windows(ids, 30)
    with pytest.raises(ValueError, match="val_fraction"):
        split_ids(ids, 1.5)


def test_text_checksum_and_missing_file_errors(tmp_path):
    (tmp_path / "alice29.txt").write_text("not Alice")
    with pytest.raises(DataChecksumError, match="git checkout data/text/alice29.txt"):
        load_text("carroll", directory=tmp_path)
    with pytest.raises(FileNotFoundError, match="asyoulik.txt"):
        load_text("shakespeare", directory=tmp_path)
    with pytest.raises(KeyError, match="carroll"):
        load_text("milton")
