"""Window attention on (n·windows) rows (Swin-V2's): the windows of each image flattened
sample-major, cosine attention ``normalize(q) @ normalize(k)ᵀ`` scaled by ``exp(logit_scale)``
(a parameter of the rule-less attention module), a bias table computed by an MLP from fixed
coordinates, softmax, ``p @ v``, heads merged back. The rows stay proved sample-major through
the transposes, the softmax and the batched matmuls (``flat_rows.keeps_rows``), so the output
projection takes its rule; the scale and the bias MLP meet the windows' rows
(``derived.py``, a meeting whose rows are n·windows, each sample's summed). Every case exact
against micro-batching in float64, at n ≠ windows and n = windows, with and without the
check; windows flattened window-major (row r is sample r mod n) keep the exact fallback."""

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.helpers import (
    assert_agree,
    assert_clipping_agrees,
    assert_optimizer_matches_microbatch,
    exact_routes,
    mse_per_sample,
)
from workbench.dpsgd import MODES
from workbench.per_sample.flat_rows import FlatRows, keeps_rows

SIDE, WIN, D, HEADS = 4, 2, 4, 2  # a 4x4 image in 2x2 windows: 4 windows of 4 rows each
WINDOWS = (SIDE // WIN) ** 2


class WindowAttention(nn.Module):
    """Swin-V2's ``Swinv2SelfAttention``: owns ``logit_scale``, has no rule of its own."""

    def __init__(self, bias="sigmoid"):
        super().__init__()
        self.bias = bias  # "sigmoid": Swin-V2's 16 σ(table); "direct": the MLP's output added
        self.query, self.key, self.value = (nn.Linear(D, D) for _ in range(3))
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones(HEADS, 1, 1)) + 0.1 *
                                        torch.randn(HEADS, 1, 1))
        self.bias_mlp = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, HEADS))
        span = torch.arange(-(WIN - 1), WIN, dtype=torch.float32)
        table = torch.stack(torch.meshgrid(span, span, indexing="ij"), -1).unsqueeze(0)
        self.register_buffer("coords", table)  # (1, 2w-1, 2w-1, 2), no sample in it
        pos = torch.stack(torch.meshgrid(torch.arange(WIN), torch.arange(WIN), indexing="ij"))
        pos = pos.flatten(1)
        rel = (pos[:, :, None] - pos[:, None, :]).permute(1, 2, 0) + WIN - 1
        self.register_buffer("index", rel[..., 0] * (2 * WIN - 1) + rel[..., 1])
        self.register_buffer("square", torch.randn(WIN * WIN, WIN * WIN, 2))  # dim 0 = windows

    def forward(self, h):  # (n·windows, w², d)
        rows, length, _ = h.shape

        def heads(t):
            return t.view(rows, length, HEADS, D // HEADS).transpose(1, 2)

        q, k, v = heads(self.query(h)), heads(self.key(h)), heads(self.value(h))
        s = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        s = s * torch.clamp(self.logit_scale, max=math.log(100.0)).exp()
        if self.bias == "direct":  # a layer's batch-free output added to the window rows
            s = s + self.bias_mlp(self.square).permute(2, 0, 1)
        else:
            table = self.bias_mlp(self.coords).view(-1, HEADS)
            bias = table[self.index.view(-1)].view(length, length, -1).permute(2, 0, 1)
            s = s + 16 * torch.sigmoid(bias.contiguous()).unsqueeze(0)
        p = F.softmax(s, dim=-1)
        context = torch.matmul(p, v).permute(0, 2, 1, 3).contiguous()
        return context.view(rows, length, D)


class Swinish(nn.Module):
    """Patch embedding, window partition, attention, output projection, windows merged back.
    ``layout``: "sample" (Swin's, sample-major) or "window" (window-major rows)."""

    def __init__(self, layout="sample", bias="sigmoid"):
        super().__init__()
        self.layout = layout
        self.embed, self.attn = nn.Linear(2, D), WindowAttention(bias)
        self.out, self.head = nn.Linear(D, D), nn.Linear(D, 2)

    def forward(self, x):  # (n, SIDE, SIDE, 2)
        n, g = x.shape[0], SIDE // WIN
        h = self.embed(x).view(n, g, WIN, g, WIN, D)
        order = (0, 1, 3, 2, 4, 5) if self.layout == "sample" else (1, 3, 0, 2, 4, 5)
        windows = h.permute(*order).contiguous().view(-1, WIN * WIN, D)
        o = self.out(self.attn(windows))  # (n·windows, w², d)
        if self.layout == "sample":
            o = o.view(n, g, g, WIN, WIN, D).permute(0, 1, 3, 2, 4, 5)
        else:
            o = o.view(g, g, n, WIN, WIN, D).permute(2, 0, 3, 1, 4, 5)
        return self.head(torch.tanh(o.reshape(n, SIDE * SIDE, D)).mean(1))  # (n, 2)


def model(layout="sample", bias="sigmoid"):
    torch.manual_seed(0)
    return Swinish(layout, bias).double()


def batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, SIDE, SIDE, 2, generator=g, dtype=torch.float64),
            torch.randn(n, 2, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("bias", ["sigmoid", "direct"])  # direct: not BatchFree's to convert
@pytest.mark.parametrize("n", [3, WINDOWS])  # n = windows: a layout shapes cannot tell apart
def test_window_rows_take_rules_and_meetings_exactly(n, bias):
    routes = exact_routes(model(bias=bias), *batch(n))
    assert not routes["route"].str.contains("fallback|vmap").any(), routes
    by_layer = dict(zip(routes["layer"], routes["route"]))
    assert by_layer["attn"] == "derived (meetings)", routes  # logit_scale
    assert by_layer["attn.bias_mlp.0"] == by_layer["attn.bias_mlp.2"] == "derived (meetings)"
    assert "fallback" not in by_layer["out"] and "derived" not in by_layer["out"], routes


@pytest.mark.parametrize("n", [3, WINDOWS])
def test_window_major_rows_keep_the_exact_fallback(n):
    routes = exact_routes(model("window"), *batch(n))
    by_layer = dict(zip(routes["layer"], routes["route"]))
    assert by_layer["out"] == "exact fallback", routes  # rows of unproven layout
    assert by_layer["attn"] != "derived (meetings)", routes  # its rows are not per sample


@pytest.mark.parametrize("mode", [*MODES, "auto"])
@pytest.mark.parametrize(("layout", "bias"), [("sample", "sigmoid"), ("window", "sigmoid"),
                                              ("sample", "direct")])
def test_optimizer_on_window_rows_matches_microbatching(mode, layout, bias):
    sizes = ((0, 3), (1, WINDOWS), (2, 5))  # n = windows in the middle: probed again
    batches = [batch(n, seed) for seed, n in sizes]
    assert_optimizer_matches_microbatch(model(layout, bias), mse_per_sample, batches,
                                        method=mode)


@pytest.mark.parametrize(("layout", "bias"), [("sample", "sigmoid"), ("window", "sigmoid"),
                                              ("sample", "direct"), ("window", "direct")])
@pytest.mark.parametrize("n", [SIDE // WIN, WINDOWS])  # n = windows per side: window-major
def test_unchecked_window_rows_are_exact_too(layout, bias, n):  # rows look sample-major
    m, (x, y) = model(layout, bias), batch(n)
    assert_agree(m, mse_per_sample, x, y, check=False)
    assert_clipping_agrees(m, mse_per_sample, x, y)


def test_row_wise_ops_keep_rows_only_where_each_row_stands_alone():
    rows, x = FlatRows(tainted=lambda t: t is not w), torch.randn(2, 3, 4, 5)
    rows.seed([x])
    h = x.reshape(6, 4, 5)
    rows.after("reshape", (x, 6, 4, 5), {}, h)
    tag = rows.of(h)
    assert tag == (2, 3)

    def kept(name, *args, **kwargs):
        out = getattr(torch, name)(*args, **kwargs)
        return keeps_rows(name, args, kwargs, out, rows.of, rows.tainted)

    assert kept("transpose", h, 1, 2) and kept("permute", h, (0, 2, 1))
    assert not kept("transpose", h, 0, 1) and not kept("permute", h, (1, 0, 2))
    assert kept("softmax", h, -1) and kept("softmax", h, dim=1)
    assert not kept("softmax", h, 0)
    assert not keeps_rows("normalize", (h, None), {"p": 2.0, "dim": 0, "eps": 1e-12},
                          F.normalize(h, dim=0), rows.of)
    assert keeps_rows("normalize", (h, None), {"p": 2.0, "dim": -1, "eps": 1e-12},
                      F.normalize(h, dim=-1), rows.of)
    w = torch.randn(5, 3)  # carries no sample: a weight
    assert kept("matmul", h, w)
    k = h.transpose(1, 2)
    rows.tag(k, *tag)  # the same rows: each a batch dim of the product
    assert kept("matmul", h, k) and kept("bmm", h, k)
    flat = h.reshape(6, 20)
    rows.tag(flat, *tag)
    assert not kept("matmul", flat, flat.T)  # h h^T: every row meets every other
    other = torch.randn(6, 5, 2)  # of the batch, rows of unknown order
    assert not kept("matmul", h, other)


class Residual(Swinish):
    """Swin's block: the windows merged back and added to the residual stream (n, H, W, d)."""

    def forward(self, x):
        n, g = x.shape[0], SIDE // WIN
        h = self.embed(x)  # (n, SIDE, SIDE, d)
        windows = h.view(n, g, WIN, g, WIN, D).permute(0, 1, 3, 2, 4, 5).reshape(-1, WIN * WIN,
                                                                                 D)
        o = self.out(self.attn(windows)).view(n, g, g, WIN, WIN, D).permute(0, 1, 3, 2, 4, 5)
        h = h + o.reshape(n, SIDE, SIDE, D)  # the add BatchFree would take for a broadcast
        return self.head(torch.tanh(h).reshape(n, SIDE * SIDE, D).mean(1))


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("n", [1, 3])
def test_one_sample_window_rows_added_to_the_residual(n, check):
    """At n = 1 the output projection's (windows, w², d) output, merged back to (1, H, W, d)
    and added to the residual, looked like a batch-free output broadcast into the batch (its
    dim 0 of size 1): BatchFree converted the call although its rows were proved the batch's,
    and every method crashed with a reshape error (torchvision's and Hugging Face's Swin, the
    sweep of new architectures). A call on the batch's rows is no batch-free call now."""
    torch.manual_seed(0)
    m, (x, y) = Residual().double(), batch(n)
    assert_agree(m, mse_per_sample, x, y, check=check)
    assert_clipping_agrees(m, mse_per_sample, x, y)


@pytest.mark.parametrize("mode", [*MODES, "auto"])
def test_optimizer_on_one_sample_window_rows(mode):
    torch.manual_seed(0)
    batches = [batch(n, seed) for seed, n in ((0, 1), (1, 3), (2, 1))]
    assert_optimizer_matches_microbatch(Residual().double(), mse_per_sample, batches,
                                        method=mode)
