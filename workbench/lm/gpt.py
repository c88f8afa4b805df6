"""tiny_gpt: a decoder-only transformer written the way GPT-2 / nanoGPT code is written.

Sources: A. Radford et al. (2019), "Language Models are Unsupervised Multitask Learners"
(GPT-2), §2.3: pre-LayerNorm blocks, a final LayerNorm, learned positional embeddings, the
output head tied to the token embedding (Press & Wolf 2017, arXiv 1608.05859); A. Vaswani et
al. (2017), "Attention Is All You Need", arXiv 1706.03762, Eq. (1):

    Attention(Q, K, V) = softmax(Q Kᵀ / √d_h + M) V       M: causal mask, -inf above diagonal

    h_0 = E[x] + P[arange(T)]                               (n, T, C)
    h_l = h_{l-1} + Attn(LN(h_{l-1}));  h_l += MLP(LN(h_l))  MLP(u) = W_2 GELU(W_1 u)
    logits = LN(h_L) Eᵀ                                      (n, T, V)  tied head

The code is deliberately *not* restructured for per-sample engines: the head is
``F.linear(h, self.wte.weight)`` (a parameter used outside its module) and the positional
embedding is called on ``arange(T)`` (no batch dim). Those two idioms are where hook-based
engines go wrong; tests/test_tiny_gpt.py checks every method against micro-batching.

Notation: n batch, T sequence length (≤ block_size), C = n_embd, H = n_head, d_h = C / H,
V vocabulary size, L = n_layer.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F

from workbench.per_sample.checks import evaluating


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with q, k, v and output projections as nn.Linear."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float = 0.0):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head} (each head "
                             f"gets n_embd / n_head dims); pick e.g. n_head=1 or n_embd="
                             f"{n_head * max(1, round(n_embd / n_head))}")
        self.n_head = n_head
        self.query = nn.Linear(n_embd, n_embd)
        self.key = nn.Linear(n_embd, n_embd)
        self.value = nn.Linear(n_embd, n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, block_size, block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, T, C = x.shape
        heads = lambda t: t.view(n, T, self.n_head, C // self.n_head).transpose(1, 2)  # noqa: E731
        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))  # (n, H, T, d_h)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])  # (n, H, T, T)  Eq. (1)
        att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))  # causal mask M
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(n, T, C)  # (n, T, C) heads side by side
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise u -> W_2 GELU(W_1 u), hidden width 4C (GPT-2)."""

    def __init__(self, n_embd: int, dropout: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))  # (n, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + Attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float = 0.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """Token ids (n, T) -> next-token logits (n, T, V). Build it with ``tiny_gpt``."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int,
                 n_embd: int, dropout: float = 0.0):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)  # token embedding E, also the head
        self.wpe = nn.Embedding(block_size, n_embd)  # positional embedding P
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(n_embd, n_head, block_size, dropout)
                               for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n, T = idx.shape
        if T > self.block_size:
            raise ValueError(f"sequence length T={T} exceeds block_size={self.block_size}; "
                             f"crop the input to its last {self.block_size} tokens")
        pos = torch.arange(T, device=idx.device)  # (T,)  no batch dim, as in nanoGPT
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (n, T, C) + (T, C)
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # (n, T, V)  tied head: E used twice


def tiny_gpt(vocab_size: int, block_size: int = 128, n_layer: int = 2, n_head: int = 4,
             n_embd: int = 64, dropout: float = 0.0,
             generator: torch.Generator | None = None) -> TinyGPT:
    """A GPT-2-style character model; GPT-2's initialisation drawn from ``generator``.

    Weights N(0, 0.02²), biases 0, LayerNorms (1, 0); the residual projections (attn.proj,
    mlp.proj) N(0, (0.02 / √(2L))²) (GPT-2 §2.3). The defaults give 113,152 parameters at
    vocab_size=96; ``dropout`` defaults to 0 so that per-sample methods can be compared.
    """
    for name, value in dict(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer,
                            n_head=n_head, n_embd=n_embd).items():
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}")
    model = TinyGPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout)
    for name, p in model.named_parameters():
        if name.endswith("bias") or ".ln_" in name or name.startswith("ln_"):
            continue  # LayerNorm and biases keep torch's (1, 0) and 0
        std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
        with torch.no_grad():
            p.normal_(0.0, std, generator=generator)
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    return model


def sequence_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                           reduction: str = "mean") -> torch.Tensor:
    """Per-sequence loss (n,): next-token cross-entropy averaged (or summed) over T.

    ``logits`` (n, T, V), ``targets`` (n, T) int64. The per-sample loss of the workbench's
    contract: sequence i's gradient is that of its own tokens only.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum' over a sequence's tokens; "
                         f"got {reduction!r}")
    n, T, V = logits.shape
    per_token = F.cross_entropy(logits.reshape(n * T, V), targets.reshape(n * T),
                                reduction="none").view(n, T)  # (n, T)
    return per_token.mean(1) if reduction == "mean" else per_token.sum(1)  # (n,)


@torch.no_grad()
def generate(model: TinyGPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample ``max_new_tokens`` tokens after the prompt ``idx`` (n, T0) -> (n, T0 + new).

    Each step feeds the last ``block_size`` tokens, divides the last position's logits by
    ``temperature``, keeps the ``top_k`` largest (if given) and draws from the softmax with
    ``generator``. The model's training mode is restored afterwards.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature!r} (use a small value, "
                         f"e.g. 1e-3, for near-greedy decoding)")
    with evaluating(model):  # each module's mode back after
        for _ in range(int(max_new_tokens)):
            logits = model(idx[:, -model.block_size:])[:, -1, :] / temperature  # (n, V)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)  # (n, T + 1)
    return idx


__all__ = [
    "MLP", "Block", "CausalSelfAttention", "TinyGPT", "generate", "sequence_cross_entropy",
    "tiny_gpt",
]
