"""method="vmap" of the functional API: torch.func's answer checked against autograd's on
every call (``selfcheck.check_vmap``): Σ_i g_i against the batch's gradient and record n - 1's
g against the record alone. torch.func's batching rules were wrong on Hugging Face's CvT
(probe AK: an eval BatchNorm's output viewed, permuted and joined by ``torch.cat`` to a
``torch.split`` piece of the input), and vmap's answer was returned unchecked.

Invariant: no per-sample gradient is returned that autograd's ordinary backward pass
contradicts. The mechanism is tested on answers corrupted on purpose (whatever torch's
batching rules do in a later release), and on the pattern itself: exact or refused."""

import pytest
import torch
from torch import nn

import workbench as wb
import workbench.per_sample as per_sample
from tests.helpers import RTOL
from workbench.errors import PerSampleCheckError
from workbench.per_sample import functional

H = W = 4
C = 8


class CatAfterNorm(nn.Module):
    """The op pattern inside CvtSelfAttention."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 3, padding=1, groups=C, bias=False)
        self.bn = nn.BatchNorm2d(C)

    def forward(self, h):  # (b, 1 + H W, C)
        cls, r = torch.split(h, [1, H * W], 1)
        b = r.shape[0]
        r = r.permute(0, 2, 1).view(b, C, H, W)
        q = self.bn(self.conv(r)).view(b, C, H * W).permute(0, 2, 1)
        return torch.cat((cls, q), dim=1)


def cat_model():
    torch.manual_seed(0)
    m = CatAfterNorm().double().eval()
    with torch.no_grad():
        m.bn.running_mean.normal_()
        m.bn.running_var.uniform_(0.5, 2)
        m.bn.weight.normal_()
        m.bn.bias.normal_()
    return m


def squares(o, y):
    return o.pow(2).reshape(len(o), -1).sum(1)


def mlp(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def batch(n=5, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g, dtype=dtype), torch.randn(n, 3, generator=g,
                                                                    dtype=dtype)


def mse(o, y):
    return (o - y).pow(2).sum(1)


def test_the_cvt_pattern_is_exact_or_refused():
    m = cat_model()
    x = torch.randn(3, 1 + H * W, C, dtype=torch.float64)
    want = wb.per_sample_gradients(m, squares, x, torch.zeros(3), method="microbatch")
    try:
        got = wb.per_sample_gradients(m, squares, x, torch.zeros(3), method="vmap")
    except PerSampleCheckError as error:
        assert "method='vmap'" in str(error) and "einsum" in str(error)
        return
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=RTOL[torch.float64], atol=1e-12)


@pytest.mark.parametrize("corruption", ["one record scaled", "two records swapped"])
def test_a_wrong_vmap_answer_is_refused_naming_the_parameter(monkeypatch, corruption):
    original = functional.vmap_or_explain

    def wrong(*args):
        grads = original(*args)
        g = grads["2.weight"]
        if corruption == "one record scaled":
            g[1] *= 1.01  # the sum is off, record n - 1 is right
        else:
            g[[3, 4]] = g[[4, 3]]  # the sum is right, record n - 1 is not
        return grads

    monkeypatch.setattr(per_sample, "vmap_or_explain", wrong)
    x, y = batch()
    with pytest.raises(PerSampleCheckError, match=r"2\.weight"):
        wb.per_sample_gradients(mlp(), mse, x, y, method="vmap")
    with pytest.raises(PerSampleCheckError, match=r"2\.weight"):
        wb.clipped_grad_sum(mlp(), mse, x, y, 1.0, method="vmap")
    wb.per_sample_gradients(mlp(), mse, x, y, method="vmap", check=False)  # opted out


class Float32Inside(nn.Module):
    """A float64 model computing a norm in float32 (Hugging Face's RMSNorm does)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.a(x)
        h32 = h.to(torch.float32)
        h = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return self.b(h)


@pytest.mark.parametrize("build", ["float64", "float32", "float32 inside float64"])
def test_correct_models_pass_the_check(build):
    dtype = torch.float32 if build == "float32" else torch.float64
    torch.manual_seed(0)
    model = Float32Inside().double() if build == "float32 inside float64" else mlp(dtype)
    x, y = batch(6, dtype)
    got = wb.per_sample_gradients(model, mse, x, y, method="vmap")
    want = wb.per_sample_gradients(model, mse, x, y, method="microbatch")
    tol = 1e-4 if build != "float64" else RTOL[torch.float64]
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=tol, atol=tol)


def test_a_model_drawing_random_numbers_is_not_compared():
    """vmap draws each record's own dropout mask: nothing of autograd's to compare with."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3)).double().train()
    x, y = batch()
    got = wb.per_sample_gradients(model, mse, x, y, method="vmap")
    assert got["0.weight"].shape == (5, 8, 4)
