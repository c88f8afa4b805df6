"""A parameter used only inside a ``torch.autograd.Function`` (PEFT's LoHa: ΔW =
HadaWeight.apply(w1a, w1b, w2a, w2b)) reaches the loss through no op the use tracker sees:
the rules gave it a zero per-sample gradient, caught only by the self-check's probe. It now
takes the exact whole-model fallback (``per_sample/unseen.py``), with and without the self-check,
in every method and optimizer mode, against a float64 loop."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.helpers import ce_per_sample as loss_fn
from tests.helpers import classification_batch, one_at_a_time_grads, relative_error
from workbench.dpsgd import MODES, DPOptimizer
from workbench.per_sample.unseen import reached

D, K = 4, 3


class Hada(torch.autograd.Function):
    """((a b) ⊙ (c d)), its own backward; no setup_context: torch.func cannot run it."""

    @staticmethod
    def forward(ctx, a, b, c, d):
        ctx.save_for_backward(a, b, c, d)
        return (a @ b) * (c @ d)

    @staticmethod
    def backward(ctx, g):
        a, b, c, d = ctx.saved_tensors
        u, v = g * (c @ d), g * (a @ b)
        return u @ b.T, a.T @ u, v @ d.T, c.T @ v


class LoHaLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(D, D).requires_grad_(False)
        self.a, self.c = nn.ParameterDict({"x": nn.Parameter(torch.randn(D, 2))}), \
            nn.ParameterDict({"x": nn.Parameter(torch.randn(D, 2))})
        self.b = nn.Parameter(torch.randn(2, D))
        self.d = nn.Parameter(torch.randn(2, D))
        self.head = nn.Linear(D, K)

    def forward(self, x):
        dw = Hada.apply(self.a["x"], self.b, self.c["x"], self.d)  # (D, D), no hook sees it
        return self.head(torch.tanh(self.base(x) + F.linear(x, dw)))


def batch(n, seed):
    return classification_batch(n, D, K, seed)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return LoHaLike().double()


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


@pytest.mark.parametrize("check", [True, False])
def test_functional_api_is_exact(model, check):
    x, y = batch(4, 0)
    ref = one_at_a_time_grads(model, loss_fn, x, y)
    got = quiet(wb.per_sample_gradients, model, loss_fn, x, y, method="einsum", check=check)
    for k in ref:
        assert relative_error(got[k], ref[k]) <= 1e-9, k
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in ref.values()))
    C = float(norms.median())
    c = (C / norms).clamp(max=1)
    for method in ("ghost", "bookkeeping"):
        got = quiet(wb.clipped_grad_sum, model, loss_fn, x, y, C, method=method, check=check)
        for k, g in ref.items():
            assert relative_error(got[k], torch.einsum("n,n...->...", c, g)) <= 1e-9, (method, k)


@pytest.mark.parametrize("mode", MODES)
def test_optimizer_is_exact(model, mode):
    C = 0.5
    opt = DPOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
                      model, noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=1.0,
                      method=mode, loss_reduction="sum")
    try:
        for seed, n in enumerate((3, 4)):
            x, y = batch(n, 10 + seed)
            ref = one_at_a_time_grads(model, loss_fn, x, y)
            c = (C / torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in ref.values()))).clamp(max=1)
            opt.zero_grad()
            loss_fn(model(x), y).sum().backward()
            quiet(opt.step)
            for k, p in model.named_parameters():
                if p.requires_grad:
                    want = torch.einsum("n,n...->...", c, ref[k])
                    assert relative_error(p.grad, want) <= 1e-9, (mode, seed, k)
    finally:
        opt.detach()


def test_reached_walks_only_to_the_wanted_leaves():
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    out = Hada.apply(a.view(2, 1), a.view(1, 2), a.view(2, 1), a.view(1, 2)).sum()
    assert reached([out], {id(a), id(b)}) == {id(a)}
    assert reached([out.detach()], {id(a)}) == set()
