"""Write ``data/digits.npz`` from scikit-learn's copy of the UCI handwritten digits.

Source: "Optical Recognition of Handwritten Digits", UCI Machine Learning Repository,
E. Alpaydin and C. Kaynak (1998), https://doi.org/10.24432/C50P49 (CC BY 4.0). scikit-learn
ships its test part (1797 images of 8x8 pixels, values 0..16) as
``sklearn.datasets.load_digits`` (BSD-3-Clause). See data/README.md.

The archive holds two arrays, stored uncompressed so the bytes do not depend on the zlib
build:

    images  uint8 (1797, 8, 8)  pixel counts 0..16
    labels  uint8 (1797,)       digit 0..9

``np.savez`` gives every member the fixed zip timestamp 1980-01-01, so two runs write the
same bytes; the script checks that the file reads back equal and prints its sha256, which
must match ``workbench.data.DIGITS_SHA256``.

Usage (from the repository root; needs scikit-learn)::

    python tools/make_digits.py
"""

import argparse
import hashlib
from pathlib import Path

import numpy as np

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "data" / "digits.npz"


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 (1797, 8, 8) and labels uint8 (1797,) from scikit-learn's copy."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise SystemExit("make_digits.py needs scikit-learn: pip install scikit-learn") from err
    bunch = load_digits()
    images = bunch.images  # (1797, 8, 8) float64 holding integers 0..16
    labels = bunch.target  # (1797,) int64 holding 0..9
    if not np.array_equal(images, np.round(images)) or images.min() < 0 or images.max() > 16:
        raise ValueError("scikit-learn's digits are no longer integers in 0..16; check the source")
    return images.astype(np.uint8), labels.astype(np.uint8)


def sha256_of(path: Path) -> str:
    """Hex sha256 of the file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_digits(out: Path) -> str:
    """Write the archive to ``out``, check it reads back equal, return its sha256."""
    images, labels = digits_arrays()
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as f:  # a file object: np.savez would append ".npz" to other names
        np.savez(f, images=images, labels=labels)
    with np.load(out) as saved:
        assert np.array_equal(saved["images"], images)
        assert np.array_equal(saved["labels"], labels)
    return sha256_of(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the .npz")
    args = parser.parse_args()
    digest = write_digits(args.out)
    print(f"wrote {args.out}")
    print(f"sha256 {digest}")


if __name__ == "__main__":
    main()
