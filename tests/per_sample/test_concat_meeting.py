"""Prompt tuning's virtual tokens: o = E(arange(v)) (1, v, d) computed without the batch,
repeated to it and concatenated before every sample's token embeddings (PEFT's
``prompts.repeat(n, 1, 1)``, ``torch.cat((prompts, embeds), dim=1)``). The Embedding's call is
converted to the call on the batch (``per_sample/concat.py``): its rule, not the whole-model
fallback; and where the concatenated rows are not copies of one (o's dim 0 is n: each sample
gets its own row: ``row_positions``) or the cat stacks batches (dim 0), the exact fallback
stays. Every method
and optimizer mode against a float64 one-at-a-time loop, n ≠ T and n = T."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.helpers import relative_error
from workbench.dpsgd import MODES, DPOptimizer
from workbench.per_sample.concat import row_positions

V, T, D, P = 11, 4, 6, 3


class Prompted(nn.Module):
    """``how``: "repeat" / "expand" (o (1, P, D) to the batch, cat on dim 1: a meeting),
    "stack" (cat on dim 0: not a meeting, fallback)."""

    def __init__(self, how="repeat", p=0.0):
        super().__init__()
        self.how = how
        self.prompt = nn.Embedding(P, D)
        self.wte = nn.Embedding(V, D).requires_grad_(False)  # frozen, as PEFT sets it
        self.fc = nn.Linear(D, D)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        n = ids.shape[0]
        a = self.wte(ids)  # (n, T, D)
        if self.how == "stack":
            o = self.prompt(torch.arange(P)[None])  # (1, P, D)
            s = torch.cat([o, a[:, :P]], dim=0)  # (1 + n, P, D): stacked, not a meeting
            h = torch.cat([s[1:] + s[:1], a], dim=1)
        else:
            o = self.prompt(torch.arange(P)[None])  # (1, P, D)
            d = o.repeat(n, 1, 1) if self.how == "repeat" else o.expand(n, -1, -1)
            h = torch.cat([d, a], dim=1)  # (n, P + T, D)
        return self.head(torch.tanh(self.drop(self.fc(h))))[:, -T:]


def loss_fn(out, y):
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none").sum(1)


def batch(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n, T), generator=g), torch.randint(0, V, (n, T), generator=g)


def reference(model, x, y, seed=None):
    """One sample at a time; with dropout, one batched forward (the batch's masks)."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    if seed is None:
        rows = [torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]).sum(),
                                    list(params.values())) for i in range(x.shape[0])]
    else:
        torch.manual_seed(seed)
        losses = loss_fn(model(x), y)
        rows = [torch.autograd.grad(losses[i], list(params.values()), retain_graph=True)
                for i in range(x.shape[0])]
    return {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(params)}


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def build(how, p=0.0):
    torch.manual_seed(0)
    model = Prompted(how, p).double()
    return model.train(p > 0)


@pytest.mark.parametrize("how,route", [("repeat", "rule"), ("expand", "rule"),
                                       ("stack", "fallback")])
@pytest.mark.parametrize("n", [3, T])
def test_functional_api(how, route, n):
    model = build(how)
    x, y = batch(n, n)
    ref = reference(model, x, y)
    for method in ("einsum", "vmap"):
        got = quiet(wb.per_sample_gradients, model, loss_fn, x, y, method=method)
        for k in ref:
            assert relative_error(got[k], ref[k]) <= 1e-9, (method, k)
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in ref.values()))
    C = float(norms.median())
    c = (C / norms).clamp(max=1)
    for method in ("ghost", "bookkeeping"):
        got = quiet(wb.clipped_grad_sum, model, loss_fn, x, y, C, method=method)
        for k, g in ref.items():
            assert relative_error(got[k], torch.einsum("n,n...->...", c, g)) <= 1e-9, (method, k)
    routes = quiet(wb.ghost_routes, model, loss_fn, x, y)
    prompt = routes[routes["layer"] == "prompt"]["route"]
    assert len(prompt) == 1 and ("fallback" in prompt.iloc[0]) == (route == "fallback"), routes


@pytest.mark.parametrize("mode", MODES)
def test_optimizer_with_dropout(mode):
    model = build("repeat", p=0.3)
    C = 1.0
    opt = DPOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
                      model, noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=1.0,
                      method=mode, loss_reduction="sum")
    try:
        for step, n in enumerate((3, T, 2, T)):
            x, y = batch(n, 10 + step)
            with torch.random.fork_rng():
                ref = reference(model, x, y, seed=100 + step)
            c = (C / torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in ref.values()))).clamp(max=1)
            opt.zero_grad()
            with torch.random.fork_rng():
                torch.manual_seed(100 + step)
                loss_fn(model(x), y).sum().backward()
                quiet(opt.step)
            for k, p in model.named_parameters():
                if p.requires_grad:
                    want = torch.einsum("n,n...->...", c, ref[k])
                    assert relative_error(p.grad, want) <= 1e-9, (mode, step, k)
    finally:
        opt.detach()


def test_rows_that_are_not_copies_of_one_are_not_a_meeting():
    """D's positions in o, one row per sample: equal rows (o repeated) give that row; rows
    that differ (o's own rows, its dim 0 equal to n by chance) give no meeting."""
    index = torch.arange(6).view(1, 2, 3)
    assert torch.equal(row_positions(index.repeat(4, 1, 1).flatten(), 4), torch.arange(6))
    assert row_positions(torch.arange(12), 4) is False
    assert row_positions(None, 4) is False
