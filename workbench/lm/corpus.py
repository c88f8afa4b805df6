"""Bundled English text for the language-model notebook: two public-domain authors, by character.

Sources (data/README.md has the provenance, licences and how to re-fetch them): the
Canterbury corpus (R. Arnold and T. Bell, 1997, "A corpus for the evaluation of lossless compression
algorithms", Proc. DCC '97) as shipped byte for byte in the ``brotli`` 1.2.1 source
distribution on PyPI, ``tests/testdata/``:

    name          file           author / work                               role     bytes
    shakespeare   asyoulik.txt   W. Shakespeare, "As You Like It" (1599)      public   125,179
    carroll       alice29.txt    L. Carroll, "Alice's Adventures in           private  152,089
                                 Wonderland" (1865)

"public" pretrains a model without privacy; "private" is what DP fine-tuning must protect.

Tokenisation is by character over a fixed alphabet: newline and the 95 printable ASCII
characters (ids 0..95), so digits exist even where a text has none (the notebook plants a
PIN). ``normalise`` makes line ends LF, tabs and runs of spaces one space, and at most one
blank line in a row, and drops a DOS end-of-file mark.

Notation: V = 96 vocabulary size, T block size, N number of windows.
"""

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from workbench.shipped import DataChecksumError, bundled, sha256_of

TEXT_DIR = bundled("text")  # data/text/, byte-exact CRLF files (.gitattributes)
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))  # V = 96


@dataclass(frozen=True)
class TextSource:
    file: str
    sha256: str
    author: str
    title: str
    role: str  # "public" (pretraining) or "private" (DP fine-tuning)


TEXTS = {
    "shakespeare": TextSource("asyoulik.txt",
                              "eaa3526fe53859f34ecdf255712f9ecf0b2c903451d4755b2edaa2e2599cb0fc",
                              "William Shakespeare", "As You Like It", "public"),
    "carroll": TextSource("alice29.txt",
                          "7467306ee0feed4971260f3c87421154a05be571d944e9cb021a5713700c38f0",
                          "Lewis Carroll", "Alice's Adventures in Wonderland", "private"),
}


def normalise(text: str) -> str:
    """LF line ends, tabs and space runs -> one space, no trailing spaces, ≤ 1 blank line.

    Also drops the DOS end-of-file mark (Ctrl-Z, 0x1A) that ends alice29.txt.
    """
    text = text.replace("\r\n", "\n").replace("\t", " ").replace("\x1a", "")
    text = re.sub(r" +", " ", text)
    text = re.sub(r" *\n *", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def load_text(name: str, directory: str | Path | None = None) -> str:
    """The normalised text of source ``name`` ("shakespeare" or "carroll"), checksum checked."""
    if name not in TEXTS:
        raise KeyError(f"text name={name!r} is not bundled; choose one of {sorted(TEXTS)}")
    source = TEXTS[name]
    path = (TEXT_DIR if directory is None else Path(directory)) / source.file
    if not path.is_file():
        raise FileNotFoundError(f"text file not found: {path}; restore it with `git checkout "
                                f"data/text/{source.file}` or reinstall the package "
                                f"(data/README.md: how to re-fetch)")
    got = sha256_of(path)
    if got != source.sha256:
        raise DataChecksumError(f"text file {path} has sha256 {got}, expected {source.sha256}; "
                                f"restore it with `git checkout data/text/"
                                f"{source.file}` or reinstall the package")
    return normalise(path.read_text(encoding="ascii"))


class CharTokenizer:
    """Characters of ``ALPHABET`` <-> ids 0..V-1 (``encode`` refuses anything else)."""

    def __init__(self, alphabet: str = ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("alphabet has repeated characters; each must appear once")
        self.alphabet = alphabet
        self.index = {ch: i for i, ch in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> torch.Tensor:
        """int64 (len(text),) ids; ValueError naming the first character outside the alphabet."""
        try:
            return torch.tensor([self.index[ch] for ch in text], dtype=torch.long)
        except KeyError as err:
            pos = next(i for i, ch in enumerate(text) if ch not in self.index)
            raise ValueError(f"character {err.args[0]!r} at position {pos} is not in the "
                             f"tokenizer's alphabet; pass the text through "
                             f"workbench.lm.corpus.normalise or extend the alphabet") from None

    def decode(self, ids) -> str:
        return "".join(self.alphabet[int(i)] for i in ids)


def split_ids(ids: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous split: the first (1 - val_fraction) of the ids train, the rest validate."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1); got {val_fraction!r}")
    cut = round(len(ids) * (1 - val_fraction))
    return ids[:cut], ids[cut:]


def windows(ids: torch.Tensor, block_size: int) -> TensorDataset:
    """Non-overlapping next-character pairs: x (N, T) and y (N, T), y shifted by one.

    Each window is one sample for DP-SGD (a sequence is the unit of privacy); a partial
    last window is dropped.
    """
    if int(block_size) != block_size or block_size < 1:
        raise ValueError(f"block_size must be a positive integer; got {block_size!r}")
    N = (len(ids) - 1) // block_size
    if N < 1:
        raise ValueError(f"{len(ids)} ids make no window of block_size={block_size} + 1")
    x = ids[:N * block_size].view(N, block_size)  # (N, T)
    y = ids[1:N * block_size + 1].view(N, block_size)  # (N, T)
    return TensorDataset(x, y)


__all__ = [
    "ALPHABET", "TEXTS", "TEXT_DIR", "CharTokenizer", "TextSource", "load_text", "normalise",
    "split_ids", "windows",
]
