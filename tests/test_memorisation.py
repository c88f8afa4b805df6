"""Exposure (Carlini et al. 2019): candidates, insertion, log-perplexity against a direct
computation, and rank/exposure on a model whose preferences are set by hand."""

import math

import pytest
import torch
from torch import nn

from workbench.data import CharTokenizer
from workbench.lm.memorisation import (
    exposure,
    insert_secret,
    log_perplexities,
    pin_candidates,
)
from workbench.models import tiny_gpt

TOK = CharTokenizer()


def test_pin_candidates():
    c = pin_candidates(4)
    assert len(c) == 10_000 and c[0] == "0000" and c[4815] == "4815" and len(set(c)) == 10_000
    with pytest.raises(ValueError, match="digits"):
        pin_candidates(0)


def test_insert_secret_adds_whole_lines_reproducibly():
    text = "".join(f"line {i}\n" for i in range(50))
    out = insert_secret(text, "the PIN is 4815", 5, torch.Generator().manual_seed(0))
    assert out.count("the PIN is 4815\n") == 5
    assert out.replace("the PIN is 4815\n", "") == text
    assert out == insert_secret(text, "the PIN is 4815", 5, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"copies must be in \[1, 50\]"):
        insert_secret(text, "x", 51, torch.Generator())


def test_log_perplexity_matches_chain_rule_in_bits():
    model = tiny_gpt(96, block_size=16, n_layer=1, n_head=2, n_embd=8,
                     generator=torch.Generator().manual_seed(0)).double()
    prefix, cands = "PIN ", ["12", "77"]
    got = log_perplexities(model, TOK, prefix, cands)
    for px, cand in zip(got, cands):
        ids = TOK.encode(prefix + cand)
        logp = torch.log_softmax(model(ids[None, :-1])[0], -1)  # (L-1, V)
        want = -sum(logp[t - 1, ids[t]].item() for t in (len(ids) - 2, len(ids) - 1))
        assert math.isclose(px.item(), want / math.log(2), rel_tol=1e-12)


class Prefers(nn.Module):
    """A stand-in LM: next-token logits that favour one digit string, position by position."""

    block_size = 32

    def __init__(self, favourite: str, strength: float):
        super().__init__()
        self.favourite, self.strength = TOK.encode(favourite), strength

    def forward(self, idx):
        n, T = idx.shape
        logits = torch.zeros(n, T, 96)
        k = len(self.favourite)
        for j in range(k):  # position T - k + j predicts the favourite's j-th character
            logits[:, T - k + j, self.favourite[j]] = self.strength
        return logits


def test_exposure_is_max_when_the_secret_is_preferred_and_small_otherwise():
    cands = pin_candidates(3)
    top = exposure(Prefers("481", 5.0), TOK, "is ", "481", cands)
    assert top.rank == 1 and math.isclose(top.exposure, math.log2(1000))
    uniform = exposure(Prefers("481", 0.0), TOK, "is ", "481", cands)
    assert uniform.rank == 1000 and uniform.exposure == 0.0  # all tie: ties count against it
    # "482" misses one digit of the favourite: "481" beats it, and the 3 x 9 = 27 candidates
    # that miss exactly one digit (itself included) tie with it -> rank 1 + 27 (Def. 3, ≤)
    near = exposure(Prefers("481", 5.0), TOK, "is ", "482", cands)
    assert near.rank == 28 and math.isclose(near.exposure, math.log2(1000 / 28))
    assert "rank 28 of 1000" in str(near)
    with pytest.raises(ValueError, match="not among the candidates"):
        exposure(Prefers("481", 1.0), TOK, "is ", "48", cands)


def test_windows_with_secret_counts_whole_and_straddling_copies():
    from workbench.lm.corpus import windows
    from workbench.lm.memorisation import windows_with_secret

    tok = CharTokenizer()
    text = "ab PIN1 cd" + "xxxxxxxxPI" + "N1xxxxxxxx" + "x" * 10  # T = 10: whole, straddling
    data = windows(tok.encode(text), 10)
    assert windows_with_secret(data, tok, "PIN1") == (1, 3)
