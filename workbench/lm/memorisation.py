"""Exposure of a planted secret: how much better a model ranks it than its look-alikes.

N. Carlini, C. Liu, Ú. Erlingsson, J. Kos, D. Song (2019), "The Secret Sharer: Evaluating and
Testing Unintended Memorization in Neural Networks", USENIX Security, arXiv 1802.08232, §3:
a canary s[r] = format filled with a random r ∈ R is inserted into the training text; then

    Px(s[r])        = -Σ_t log2 Pr(x_t | x_<t)                 log-perplexity, Def. 1
    rank(s[r])      = |{r' ∈ R : Px(s[r']) ≤ Px(s[r])}|         Def. 3 (1 = most likely)
    exposure(s[r])  = log2 |R| - log2 rank(s[r])                Def. 4, in [0, log2 |R|]

Only the tokens of r are scored: the format's fixed part has the same log-perplexity for every
candidate and cancels in the rank. Ties count against the secret (≤), so the exposure is never
overstated. For 4-digit PINs |R| = 10⁴: exposure log2(10⁴) ≈ 13.3 means the model puts the
true PIN first; ≈ 1 (rank about half of R) means it knows nothing about it.

Notation: R candidate space, r the secret's random part, T tokens, V vocabulary size.
"""

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from workbench.per_sample.checks import evaluating


def pin_candidates(digits: int = 4) -> list[str]:
    """All ``digits``-digit strings "00..0" to "99..9": the candidate space R of a PIN."""
    if int(digits) != digits or not 1 <= digits <= 6:
        raise ValueError(f"digits must be an integer in [1, 6] (|R| = 10^digits); got {digits!r}")
    return [f"{k:0{digits}d}" for k in range(10 ** digits)]


def insert_secret(text: str, secret: str, copies: int, generator: torch.Generator) -> str:
    """``text`` with ``secret`` inserted as its own line after ``copies`` random line ends."""
    ends = [i + 1 for i, ch in enumerate(text) if ch == "\n"]
    if not 1 <= copies <= len(ends):
        raise ValueError(f"copies must be in [1, {len(ends)}] (the text's line count); "
                         f"got {copies!r}")
    chosen = sorted(ends[i] for i in torch.randperm(len(ends), generator=generator)[:copies])
    pieces, start = [], 0
    for at in chosen:
        pieces += [text[start:at], secret + "\n"]
        start = at
    return "".join(pieces) + text[start:]


@torch.no_grad()
def log_perplexities(model, tokenizer, prefix: str, candidates: list[str],
                     batch_size: int = 2048) -> torch.Tensor:
    """Px of each candidate's tokens after ``prefix``, in bits: Tensor (|R|,).  Def. 1

    All candidates must have the same length k (a format's random part); the model sees the
    last ``block_size`` tokens of prefix + candidate.
    """
    k = len(candidates[0])
    if any(len(c) != k for c in candidates):
        raise ValueError("candidates must all have the same length (one format's random part)")
    ids = torch.stack([tokenizer.encode(prefix + c) for c in candidates])  # (|R|, L)
    ids = ids[:, -(model.block_size + 1):]
    out = []
    with evaluating(model):  # each module's mode back after
        for chunk in ids.split(batch_size):
            logp = F.log_softmax(model(chunk[:, :-1]).double(), dim=-1)  # (b, L-1, V)
            picked = logp.gather(2, chunk[:, 1:, None]).squeeze(2)[:, -k:]  # (b, k)
            out.append(-picked.sum(1) / torch.log(torch.tensor(2.0, dtype=torch.float64)))
    return torch.cat(out)  # (|R|,) bits


@dataclass(frozen=True)
class Exposure:
    rank: int  # 1 = the secret is the model's most likely candidate
    n_candidates: int  # |R|
    exposure: float  # log2 |R| - log2 rank, bits

    def __str__(self) -> str:
        return (f"rank {self.rank} of {self.n_candidates}, exposure "
                f"{self.exposure:.2f} bits (max {torch.log2(torch.tensor(self.n_candidates)):.2f})")


def exposure(model, tokenizer, prefix: str, secret: str, candidates: list[str]) -> Exposure:
    """Rank and exposure (Defs. 3-4) of ``secret`` among ``candidates`` after ``prefix``."""
    if secret not in candidates:
        raise ValueError(f"secret={secret!r} is not among the candidates; the exposure is "
                         f"defined for a secret drawn from the candidate space R")
    px = log_perplexities(model, tokenizer, prefix, candidates)  # (|R|,)
    rank = int((px <= px[candidates.index(secret)]).sum())  # Def. 3, ties against the secret
    n = len(candidates)
    return Exposure(rank, n, float(torch.log2(torch.tensor(n / rank, dtype=torch.float64))))


def windows_with_secret(data, tokenizer, secret: str) -> tuple[int, int]:
    """(whole, touched): how many windows of ``data`` (x of shape (N, T), corpus.windows)
    hold all of ``secret``, and how many hold any part of one of its copies.

    With one window as the unit of privacy, a secret in ``touched`` windows is protected only
    by group privacy over that many records (foundations.group_privacy): about k·ε.
    """
    x = data.tensors[0]  # (N, T)
    text = tokenizer.decode(x.flatten())
    T = x.shape[1]
    whole = sum(secret in text[row * T:(row + 1) * T] for row in range(x.shape[0]))
    return whole, len(secret_windows(data, tokenizer, secret))


def secret_windows(data, tokenizer, secret: str) -> list[int]:
    """The indices of the windows of ``data`` that hold any part of a copy of ``secret``
    (user-level DP makes them one user's records: ``dpsgd/user_level.py``)."""
    x = data.tensors[0]  # (N, T)
    text, T, touched = tokenizer.decode(x.flatten()), x.shape[1], set()
    start = text.find(secret)
    while start != -1:
        touched.update(range(start // T, (start + len(secret) - 1) // T + 1))
        start = text.find(secret, start + 1)
    return sorted(touched)


__all__ = [
    "Exposure", "exposure", "insert_secret", "log_perplexities", "pin_candidates",
    "secret_windows", "windows_with_secret",
]
