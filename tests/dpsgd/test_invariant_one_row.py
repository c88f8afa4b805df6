"""The invariant "each record is behind exactly one row of the model's input, and each row
comes from one record" when the loop rebuilds the batch's rows before the forward pass
(``row_mixing.RowOrder.one_row``, checked at ``loss_watch.LossWatch.forward_begins``).
A batch resampled with repeats (a bootstrap, ``torch.multinomial(w, n, True)``), a record
indexed twice, overlapping pieces joined (``torch.cat([x[:h], x[:h]])``, two augmented views
of half the batch) or records joined and cut into rows of another length (packing) keep the
row count at or under the records handed out, so ``count_records`` saw nothing: one record's
influence was 2-3 C, silently (probe 2026-12-01). Each is refused at the forward pass; a
filter, a slice, a permutation, a flip, a per-record augmentation, a reshape that keeps whole
records and a repeat cut back to the batch stay exact against each record clipped alone."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import workbench as wb
from workbench.errors import RecordCountError

N, D, K, C = 48, 6, 3, 0.5


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, dtype=torch.float64, generator=g)
    y = torch.randint(0, K, (N,), generator=g)
    return TensorDataset(x, y)


DATA = data()


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, K)).double()


def twin(model, xr, yr):
    """Σ_r clip_C(∇ℓ_r), each row alone (float64)."""
    params = list(model.parameters())
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    for r in range(xr.shape[0]):
        g = torch.autograd.grad(F.cross_entropy(model(xr[r:r + 1]), yr[r:r + 1],
                                                reduction="sum"), params)
        g = torch.cat([t.flatten() for t in g])
        total += g * min(1.0, C / float(g.norm()))
    return total


def loop(prepare, steps=3, **options):
    """``steps`` steps of the engine's loop on the rows ``prepare(x, y)``; per step the
    released gradient (σ = 0, lr = 0) and the twin's clipped sum, both over the batch size."""
    model = mlp()
    engine = wb.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(DATA, batch_size=16), noise_multiplier=0.0, max_grad_norm=C,
        loss_reduction="sum", sampling_generator=torch.Generator().manual_seed(1), **options)
    out = []
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        xr, yr = prepare(x, y)
        want = twin(mlp(), xr.detach(), yr)
        opt.zero_grad()
        F.cross_entropy(model(xr), yr, reduction="sum").backward()
        opt.step()
        got = torch.cat([p.grad.flatten() for p in model.parameters()])
        out.append((got, want, x.shape[0]))
    return out


def _draw(n, seed=0):
    return torch.randint(0, n, (n,), generator=torch.Generator().manual_seed(seed))


def _two_views(x, y):  # two noisy views of half the batch
    h = max(len(x) // 2, 1)
    return torch.cat([x[:h] + 0.1 * torch.randn_like(x[:h]),
                      x[:h] + 0.1 * torch.randn_like(x[:h])]), torch.cat([y[:h], y[:h]])


def _balanced(x, y):  # oversample class 2 inside the batch, size kept
    i = torch.multinomial((y == 2).double() * 2 + 1, len(y), replacement=True,
                          generator=torch.Generator().manual_seed(0))
    return x[i], y[i]


def _packed(x, y):  # the records joined and cut into rows of D starting mid-record
    k = max(len(x) - 1, 0)
    return x.reshape(-1)[D // 2:D // 2 + k * D].view(k, D), y[:k]


REPEATED = {
    "cat of the first half twice": lambda x, y: (
        torch.cat([x[:len(x) // 2], x[:len(x) // 2]]), torch.cat([y[:len(y) // 2]] * 2)),
    "bootstrap x[randint]": lambda x, y: (x[_draw(len(x))], y[_draw(len(x))]),
    "bootstrap by a list": lambda x, y: (x[_draw(len(x)).tolist()], y[_draw(len(x)).tolist()]),
    "a record picked twice by a list": lambda x, y: (
        x[[0] + list(range(len(x) - 1))], y[[0] + list(range(len(y) - 1))]),
    "index_select with repeats": lambda x, y: (
        x.index_select(0, torch.tensor([0] + list(range(len(x) - 1)))),
        y.index_select(0, torch.tensor([0] + list(range(len(y) - 1))))),
    "two views of half the batch": _two_views,
    "multinomial resampling": _balanced,
    "repeat_interleave cut to n": lambda x, y: (x.repeat_interleave(2, 0)[:len(x)],
                                               y.repeat_interleave(2, 0)[:len(y)]),
}


@pytest.mark.parametrize("case", sorted(REPEATED))
def test_a_record_behind_several_rows_is_refused_at_the_forward_pass(case):
    with pytest.raises(RecordCountError,
                       match="not one row per record the loader drew.*times") as info:
        loop(REPEATED[case])
    assert "Dataset transform" in str(info.value) and "Poisson loader" in str(info.value)


def test_rows_cut_across_records_are_refused_at_the_forward_pass():
    with pytest.raises(RecordCountError, match="cut across the records by reshape"):
        loop(_packed)


def _perm(x, y):
    p = torch.randperm(len(x), generator=torch.Generator().manual_seed(3))
    return x[p], y[p]


EXACT = {
    "a filter x[mask]": lambda x, y: (x[y != 0], y[y != 0]),
    "a slice x[:3]": lambda x, y: (x[:3], y[:3]),
    "one record x[:1]": lambda x, y: (x[:1], y[:1]),
    "a permutation x[perm]": _perm,
    "a flip": lambda x, y: (torch.flip(x, (0,)), y.flip(0)),
    "per-record noise": lambda x, y: (x + 0.1 * torch.randn_like(x), y),
    "x.view(n, -1)": lambda x, y: (x.view(len(x), -1), y),
    "x.reshape(n, 2, 3)": lambda x, y: (x.reshape(len(x), 2, D // 2), y),
    "flattened and back to whole records": lambda x, y: (x.reshape(-1).view(len(x), -1), y),
    "a repeat cut back to the batch": lambda x, y: (x.repeat(2, 1)[:len(x)], y),
    "an index without repeats": lambda x, y: (x[list(range(len(x)))[::-1]],
                                              y[list(range(len(y)))[::-1]]),
    "transposed and back": lambda x, y: (x.t().contiguous().T, y),
    "moved by movedim and back": lambda x, y: (x.movedim(0, 1).movedim(1, 0), y),
}


@pytest.mark.parametrize("case", sorted(EXACT))
def test_rows_that_keep_one_record_each_are_exact(case):
    steps = loop(EXACT[case])
    assert steps and any(n >= 2 for _, _, n in steps)
    for got, want, _ in steps:  # (the release is the clipped sum over q N)
        assert torch.allclose(got * (N / 3), want, rtol=1e-9, atol=1e-12)


def test_a_training_record_joined_to_every_batch_is_refused():
    """A record of the training set (an anchor) joined to every batch is in every step,
    charged at q: its epsilon is that of q = 1 (probe d04: 19.05 reported as 5.75)."""
    anchor_x, anchor_y = DATA.tensors[0][:1], DATA.tensors[1][:1]
    with pytest.raises(RecordCountError, match="taken from the training set"):
        loop(lambda x, y: (torch.cat([x[:-1], anchor_x]), torch.cat([y[:-1], anchor_y])))


class TokenModel(nn.Module):
    """Per-token logits of a sequence-first model: (T, n) ids to (T, n, V)."""

    def __init__(self, V=7):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(V, 4), nn.Linear(4, V)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


SEQUENCE_FIRST = {  # the records handed out as (n, T), the model fed (T, n)
    "x.t()": lambda x: x.t(),
    "x.T": lambda x: x.T,
    "x.transpose(0, 1).contiguous()": lambda x: x.transpose(0, 1).contiguous(),
    "x.permute(1, 0).clone()": lambda x: x.permute(1, 0).clone(),
}


@pytest.mark.parametrize("case", sorted(SEQUENCE_FIRST))
def test_a_sequence_first_input_is_refused(case):
    """A word_language_model-style loop, ``model(x.t())``: each time step was clipped as a
    record (silent when T <= n; one record moved the release by T·C, probe Y)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 7, (N, 4), generator=g)
    model = TokenModel()
    model, opt, loader = wb.PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(ids), batch_size=16), noise_multiplier=0.0,
        max_grad_norm=C, loss_reduction="sum",
        sampling_generator=torch.Generator().manual_seed(1))
    with pytest.raises(RecordCountError, match="moved off dim 0") as info:
        for (x,) in loader:
            if len(x) < 2:
                continue
            seq = SEQUENCE_FIRST[case](x)
            opt.zero_grad()
            logits = model(seq[:-1])
            F.cross_entropy(logits.reshape(-1, 7), seq[1:].reshape(-1), reduction="sum").backward()
            opt.step()
    assert "batch_first=True" in str(info.value)
