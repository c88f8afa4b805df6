"""A zoo of losses and models that couple records, and the plain cross-entropy they replace.

``bug_zoo`` holds wrong DP steps on given per-sample gradients; this zoo holds the wrongs that
enter *before* them, through the loss or the model: each record's term depends on the other
records, so removing one record moves the others' clipped gradients too and the released sum
by more than C (``workbench.audit.influence``). Measured with ``naive_released_sum`` (a DP
step that takes the loss's per-record terms at face value); the workbench's engine must pass
the same models with a plain per-record cross-entropy, or refuse them.

Each case is ``build() -> (model, loss_fn, inputs, targets, C)`` on a pool of n + 1 = 9
records; ``loss_fn(out, y)`` returns the per-record terms ℓ_i (shape (n,)) whose mean is the
scalar loss a user writes (n ℓ̄ is what a mean-reduced backward gives record i).

    class_weighted_mean   ℓ_i = n w_{y_i} CE_i / Σ_j w_{y_j}          (weight=, reduction mean)
    ignore_index_mean     ℓ_i = n Σ_t CE_it / K, K non-ignored tokens   (Hugging Face's -100)
    info_nce              ℓ_i = -log softmax_j(z_i·p_j / τ)_i            (contrastive)
    centred_logits        ℓ_i = CE(o_i - mean_j o_j, y_i)                (batch-centred)
    mixing_dropout        plain CE on a model with h - mean(h) and Dropout(0.1)
"""

import torch
import torch.nn.functional as F
from torch import nn

N = 8  # batch size; the pool has N + 1 records (the last one substitutes)
IGNORE = -100


def _ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def plain_cross_entropy(out, y):
    """Per-record cross-entropy; a sequence record sums its non-ignored tokens (its own
    normalisation, independent of the batch)."""
    if out.dim() == 3:  # (n, T, V) and (n, T)
        return F.cross_entropy(out.transpose(1, 2), y, reduction="none",
                               ignore_index=IGNORE).sum(1)
    return _ce(out[:, :3], y)  # (n,) the first 3 outputs are the class logits


def class_weighted_mean(out, y, weight=(1.0, 4.0, 0.25)):
    w = torch.tensor(weight, dtype=out.dtype)[y]  # (n,)
    return len(y) * w * _ce(out[:, :3], y) / w.sum()


def ignore_index_mean(out, y):
    tokens = F.cross_entropy(out.transpose(1, 2), y, reduction="none", ignore_index=IGNORE)
    return len(y) * tokens.sum(1) / (y != IGNORE).sum()  # (n,) token mean over the batch


def info_nce(out, y, temperature=0.5):
    z, p = out.chunk(2, dim=1)  # (n, e) each: the two views
    logits = z @ p.T / temperature  # (n, n)
    return _ce(logits, torch.arange(len(out)))


def centred_logits(out, y):
    return _ce(out[:, :3] - out[:, :3].mean(0, keepdim=True), y)


class MixingDropout(nn.Module):
    """h = W1 x; h - mean over the batch; Dropout(0.1); W2: a BatchNorm-like sample mixer."""

    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(5, 6), nn.Dropout(0.1), nn.Linear(6, 3)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(self.drop(torch.tanh(h - h.mean(0, keepdim=True))))


def _tabular(out_features=3):
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, out_features))
    x = 2 * torch.randn(N + 1, 5, generator=g)
    y = torch.tensor([0, 1, 2, 1, 0, 2, 1, 1, 0])
    return model, x, y


def _sequence():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 6), nn.Tanh(), nn.Linear(6, 7))
    x = torch.randint(0, 7, (N + 1, 5), generator=g)
    y = torch.randint(0, 7, (N + 1, 5), generator=g)
    y[torch.rand(N + 1, 5, generator=g) < 0.4] = IGNORE  # padding / prompt tokens
    y[:, 0] = torch.randint(0, 7, (N + 1,), generator=g)  # every record has a token
    return model, x, y


def _build(data, loss, C):
    def build():
        model, x, y = data()
        return model, loss, x, y, C
    return build


COUPLING = {
    "class_weighted_mean": _build(_tabular, class_weighted_mean, 0.3),
    "ignore_index_mean": _build(_sequence, ignore_index_mean, 0.5),
    "info_nce": _build(lambda: _tabular(6), info_nce, 0.3),
    "centred_logits": _build(_tabular, centred_logits, 0.3),
    "mixing_dropout": _build(lambda: (MixingDropout(), *_tabular()[1:]), plain_cross_entropy,
                             0.3),
}
"""name -> build() -> (model, coupled loss, inputs, targets, C); each must be flagged."""

DOCS = {
    "class_weighted_mean": "cross_entropy(weight=w) with mean reduction: Σ_j w_{y_j} over the "
                           "batch divides every term",
    "ignore_index_mean": "token mean over labels != -100 (Hugging Face causal LM): the batch's "
                         "token count divides every term",
    "info_nce": "InfoNCE: each record's term contains the other records' embeddings",
    "centred_logits": "logits centred over the batch inside the loss",
    "mixing_dropout": "a model subtracting the batch mean, with Dropout(0.1)",
}


def plain_case(name: str):
    """The same model, data and C as ``COUPLING[name]`` with ``plain_cross_entropy``."""
    model, _, x, y, C = COUPLING[name]()
    return model, plain_cross_entropy, x, y, C


__all__ = [
    "COUPLING", "DOCS", "IGNORE", "N", "MixingDropout", "centred_logits", "class_weighted_mean",
    "ignore_index_mean", "info_nce", "plain_case", "plain_cross_entropy",
]
