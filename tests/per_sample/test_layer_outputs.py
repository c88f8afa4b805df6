"""Layers as real model code calls them, each exact (float64, against the independent
one-sample-at-a-time loop of ``realzoo.reference``) in every method of the functional API and
every DP-optimizer mode, at n ≠ T and n = T:

- an output that is not one Tensor: ``(output, None)`` (Hugging Face's attention blocks,
  DeBERTa's ``DisentangledSelfAttention``, Doge's attention: recorded, its Tensors' b), a
  tuple with a mask that does not require grad, a dict (``recording.odd_outputs``: the exact
  fallback for that layer's parameters, never a refusal of the whole model, never zeros);
- a leaf layer with a weight and bias returning a tuple (IBert's ``QuantLinear``): the
  behaviour rules' probes (``rules/_rule.probe_forward``) see no Tensor and do not match;
- an input passed by keyword, ``fc(input=x)``, ``mixer(hidden_states=h)`` (Jamba's Mamba
  mixer): moved to ``args`` (``per_sample/positional.py``), where every rule reads it;
- a layer a behaviour rule matches on one input, called with more (HF's
  ``MambaRMSNormGated(h, gate)`` in Mamba2, Bamba, Zamba2: the affine rule given h alone was
  silently wrong for its weight with ``check=False``): the per-layer vmap, every argument;
- an output written in place after the call (RoCBert: ``h = self.map_inputs_layer(x);
  h += token_type_embeddings``): torch returns a Linear on (n, T, d) as a view of its
  (n·T, p) product, and the view's node leaves the graph at the in-place op, so the Linear's
  per-sample gradients were zeros (silently with ``check=False``): b is read at the base
  (``per_sample/views.py``); a partial view written in place takes the exact fallback;
- a rule-less layer given a batch-free Tensor inside a tuple argument (a rotary
  ``(cos, sin)`` pair of shape (1, T, d)): its parameters take the exact fallback, not a
  per-layer vmap that maps the pair over a batch it does not have.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from workbench.dpsgd import MODES, DPOptimizer
from workbench.realzoo.reference import clipped_sum, error, norms_of, one_at_a_time, scale

T, D = 5, 4


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


class Attention(nn.Module):  # owns a parameter used in its forward, returns (output, None)
    def __init__(self, style):
        super().__init__()
        self.style = style
        self.proj = nn.Linear(D, D)
        self.q_bias = nn.Parameter(torch.randn(D))
        self.mix = nn.Parameter(torch.randn(D, D) / 2)

    def forward(self, h, pe=None):  # (n, T, D)
        q = self.proj(h) + self.q_bias
        scores = torch.softmax(q @ h.transpose(1, 2), -1)  # (n, T, T)
        out = torch.tanh(scores @ h @ self.mix)
        if pe is not None:  # a rotary (cos, sin) pair: (1, T, D) each
            out = out * pe[0] + pe[1]
        if self.style == "none":
            return out, None
        if self.style == "indices":  # a router's expert indices: no gradient to carry
            return out, scores.argmax(-1), None
        if self.style == "mask":
            return out, (h > 0).to(h.dtype)  # a Tensor that does not require grad
        if self.style == "dict":
            return {"hidden": out}
        return out


class QuantLinear(nn.Module):  # IBert: weight and bias, returns (output, scale)
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) / 2)
        self.bias = nn.Parameter(torch.randn(D))

    def forward(self, x, scale=None):
        return F.linear(x, self.weight, self.bias), None


class GatedRMSNorm(nn.Module):  # Hugging Face's MambaRMSNormGated
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D))

    def forward(self, h, gate=None):
        if gate is not None:
            h = h * F.silu(gate)
        return self.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.gate = nn.Embedding(8, D), nn.Linear(D, D)
        self.norm, self.plain, self.head = GatedRMSNorm(), GatedRMSNorm(), nn.Linear(D, 3)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(self.plain(self.norm(h, self.gate(h)))).sum(1)


class Chunk(nn.Module):  # a fused projection's first half: a partial view of the product
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, 2 * D) / 2)

    def forward(self, x):
        return (x @ self.weight)[..., :D]


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.lin, self.pos = nn.Embedding(8, D), nn.Linear(D, D), nn.Embedding(T, D)
        self.chunk, self.head = Chunk(), nn.Linear(D, 3)

    def forward(self, ids):
        h = self.lin(self.embed(ids))  # (n, T, D): a view of the (n·T, D) product
        h += self.pos(torch.arange(ids.shape[1]))  # in place, a batch-free position table
        h.relu_()
        c = self.chunk(h)
        c *= 2.0  # a partial view, in place: the exact fallback for chunk.weight
        return self.head(c + h).sum(1)


class ScaledLinear(nn.Module):  # IBert's QuantLinear in quant mode: (output, scale)
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) / 2)

    def forward(self, x):
        scale = self.weight.detach().abs().amax() + 1.0  # no grad
        return x @ self.weight / scale, scale


class Quantised(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.quant, self.head = nn.Embedding(8, D), ScaledLinear(), nn.Linear(D, 3)

    def forward(self, ids):
        h, scale = self.quant(self.embed(ids))
        return self.head(h * (4.0 // scale)).sum(1)  # floor_divide: no derivative


class Model(nn.Module):
    def __init__(self, style, keyword=False, rotary=False, quant=False):
        super().__init__()
        self.style, self.keyword, self.rotary = style, keyword, rotary
        self.embed = nn.Embedding(8, D)
        self.attn = Attention(style)
        self.quant = QuantLinear() if quant else None
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 3)

    def forward(self, ids):
        h = self.embed(ids)  # (n, T, D)
        pe = None
        if self.rotary:
            t = torch.arange(ids.shape[1], dtype=h.dtype)[None, :, None] / D  # (1, T, 1)
            pe = (torch.cos(t).expand(1, -1, D), torch.sin(t).expand(1, -1, D))
        if self.keyword:
            out = self.attn(h=h, pe=pe)
        else:
            out = self.attn(h, pe)
        out = out["hidden"] if isinstance(out, dict) else out[0] if isinstance(out, tuple) else out
        h = out + h if self.quant is None else self.quant(out + h)[0]
        h = self.norm(input=h) if self.keyword else self.norm(h)
        return self.head(input=h).sum(1) if self.keyword else self.head(h).sum(1)  # (n, 3)


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def batch(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 8, (n, T), generator=g), torch.randint(0, 3, (n,), generator=g)


def assert_exact(got, want, size, what):
    for k in want:
        assert error(got[k], want[k], size) <= 1, f"{what} {k}: {(got[k] - want[k]).norm():.2e}"


def check_functional(model):
    for n, seed in ((3, 0), (T, 1)):  # n = T: the layout shapes cannot tell apart
        x, y = batch(n, seed)
        ref = one_at_a_time(model, loss_fn, x, y)
        size, C = scale(ref), float(norms_of(ref).median())
        for method in ("microbatch", "vmap", "einsum"):
            got = quiet(wb.per_sample_gradients, model, loss_fn, x, y, method=method)
            assert set(got) == set(ref), method
            assert_exact(got, ref, size, method)
        norms = quiet(wb.per_sample_grad_norms, model, loss_fn, x, y, method="ghost")
        assert error(norms, norms_of(ref), size) <= 1
        want = clipped_sum(ref, C)
        for method in ("ghost", "bookkeeping", "einsum"):
            got = quiet(wb.clipped_grad_sum, model, loss_fn, x, y, C, method=method)
            assert_exact(got, want, size, f"clipped sum {method}")


def check_optimizer(model, mode):
    opt = quiet(DPOptimizer, torch.optim.SGD(model.parameters(), lr=0.0), model,
                noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=4.0,
                method=mode, loss_reduction="sum")
    try:
        for step, n in enumerate((3, T, 4, T)):
            x, y = batch(n, 10 + step)
            ref = one_at_a_time(model, loss_fn, x, y)
            opt.max_grad_norm = C = float(norms_of(ref).median())
            opt.zero_grad()
            loss_fn(model(x), y).sum().backward()
            quiet(opt.step)
            got = {k: p.grad * 4.0 for k, p in model.named_parameters()}
            assert_exact(got, clipped_sum(ref, C), scale(ref), f"{mode} step {step}")
    finally:
        opt.detach()


def build(*args, **kwargs):
    torch.manual_seed(0)
    return Model(*args, **kwargs).double()


CASES = {
    "tuple with None": dict(style="none", quant=True),
    "tuple with a mask": dict(style="mask"),
    "tuple with integer indices": dict(style="indices"),
    "dict": dict(style="dict"),
    "keyword inputs": dict(style="tensor", keyword=True),
    "keyword inputs, tuple with None": dict(style="none", keyword=True, quant=True),
    "batch-free tuple argument": dict(style="tensor", rotary=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_functional_api_is_exact(case):
    check_functional(build(**CASES[case]))


# every mode on the case that takes every new path (keywords, a tuple with None); book-keeping
# and auto (the optimizer's own recording and its fallback) on each of the others
STEPS = [("keyword inputs, tuple with None", mode) for mode in (*MODES, "auto")] + [
    (case, mode) for case in CASES if case != "keyword inputs, tuple with None"
    for mode in ("bookkeeping", "auto")]


@pytest.mark.parametrize("case,mode", STEPS)
def test_dp_optimizer_is_exact(case, mode):
    check_optimizer(build(**CASES[case]), mode)


def routes_of(model):
    x, y = batch(3, 0)
    return quiet(wb.ghost_routes, model, loss_fn, x, y).set_index("layer")["route"]


def test_tuple_with_none_is_recorded_not_sent_to_the_fallback():
    """(output, None): the attention block's own parameters on its per-layer route (vmap on
    the layer, q_bias by the broadcast rule), the QuantLinear's ``F.linear`` on the Linear
    rule inside it (``tied.rule_less_owner``; per-layer vmap on it before); an integer Tensor
    beside the output, like None, carries no gradient."""
    routes = routes_of(build("none", quant=True))
    assert not routes.str.contains("fallback").any(), routes
    assert "F.linear(quant.weight, quant.bias) in its owner" in routes.index, routes
    assert "attn.proj" in routes.index, routes
    routes = routes_of(build("indices"))
    assert not routes.str.contains("fallback").any(), routes


@pytest.mark.parametrize("style", ["mask", "dict"])
def test_an_unreadable_output_sends_that_layer_alone_to_the_fallback(style):
    routes = routes_of(build(style))
    fallback = set(routes[routes.str.contains("fallback")].index)
    assert fallback and all("attn" in path and "proj" not in path for path in fallback), routes
    assert "fallback" not in routes["attn.proj"]


def test_keyword_inputs_take_their_rules():
    """head(input=h), norm(input=h): the Linear and LayerNorm rules, not the fallback."""
    routes = routes_of(build("tensor", keyword=True))
    assert not routes.str.contains("fallback|vmap").any() or set(
        routes[routes.str.contains("fallback|vmap")].index) <= {"attn"}, routes
    assert routes["head"] != "exact fallback" and routes["norm"] != "exact fallback"


def test_behaviour_probe_of_a_layer_returning_a_tuple_does_not_match():
    from workbench.rules._rule import find_layer_rule

    assert find_layer_rule(QuantLinear().double()) is None


def test_a_gated_norm_takes_the_per_layer_vmap_not_the_affine_rule():
    torch.manual_seed(0)
    model = Gated().double()
    routes = routes_of(model)
    # the gated call: no affine rule (its weight, a broadcast product, taken over:
    # tied.py); the same class called with its input alone keeps the affine rule
    assert "vmap" in routes.get("norm", "vmap") and "norm.weight" in " ".join(routes.index)
    assert routes["plain"] == "fast gradient clipping", routes
    for n, seed in ((3, 0), (T, 1)):
        x, y = batch(n, seed)
        ref = one_at_a_time(model, loss_fn, x, y)
        got = quiet(wb.per_sample_gradients, model, loss_fn, x, y, method="einsum", check=False)
        assert_exact(got, ref, scale(ref), "einsum unchecked")
    check_functional(model)
    for mode in ("bookkeeping", "auto"):
        check_optimizer(model, mode)


def test_outputs_written_in_place_after_the_call():
    torch.manual_seed(0)
    model = InPlace().double()
    for n, seed in ((3, 0), (T, 1)):
        x, y = batch(n, seed)
        ref = one_at_a_time(model, loss_fn, x, y)
        for method in ("einsum",):
            got = quiet(wb.per_sample_gradients, model, loss_fn, x, y, method=method,
                        check=False)
            assert_exact(got, ref, scale(ref), f"{method} unchecked")
    routes = routes_of(model)
    assert "fallback" not in routes["lin"] + routes["pos"], routes
    assert routes["chunk"] == "exact fallback", routes
    check_functional(model)
    for mode in (*MODES, "auto"):
        check_optimizer(model, mode)


def test_optimizer_never_makes_an_output_that_needs_no_grad_require_it():
    """skip_weights' Tap made every floating output of a tapped layer require grad: the scale
    of IBert's QuantLinear reached ``4.0 // scale`` and the user's backward pass crashed
    (derivative for floor_divide not implemented); a layer is tapped only with a grad rule."""
    torch.manual_seed(0)
    model = Quantised().double()
    for mode in ("bookkeeping", "auto"):
        check_optimizer(model, mode)
    opt = quiet(DPOptimizer, torch.optim.SGD(model.parameters(), lr=0.0), model,
                noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=4.0,
                loss_reduction="sum")
    opt.skip_weight_grads = True
    try:
        for step in range(2):
            x, y = batch(3, step)
            opt.zero_grad()
            loss_fn(model(x), y).sum().backward()
            quiet(opt.step)
    finally:
        opt.detach()
