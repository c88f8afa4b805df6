"""The self-check compares a record's gradient parameter by parameter (``per_sample/sketch.py``):
random projections that add over parts, see an error in a small parameter that the record's
norm hides, ignore rounding, and move nobody's random stream; and a rule that attributes one
record's gradient to another is refused in the optimizer, where a norm check passed it."""

import pytest
import torch
from torch import nn

from workbench.dpsgd import DPOptimizer
from workbench.errors import PerSampleCheckError
from workbench.per_sample import sketch
from workbench.rules import LayerRule, register_rule, unregister_rule

TOL64, TOL32 = 1e-7, 1e-3  # selfcheck.TOLERANCE


def parameters(*shapes):
    g = torch.Generator().manual_seed(0)
    return {f"p{k}": torch.randn(s, generator=g, dtype=torch.float64) for k, s in enumerate(shapes)}


def test_parts_add_up_to_the_whole_and_big_parameters_draw_in_chunks():
    params = parameters((3, 5), (sketch.CHUNK + 7,))  # the second spans two chunks
    g = {k: torch.randn_like(p) for k, p in params.items()}
    whole = sketch.of(params, g)
    parts = sketch.RowSketch(params)
    for k, v in g.items():
        parts.add(k, 0.25 * v)
        parts.add(k, 0.75 * v)
    assert sketch.differences(parts, whole, TOL64, 1e-12) == []
    assert all(q is None for q in parts.squares.values())  # a sum of parts: no norm kept
    assert abs(whole.norm - float(torch.cat([v.flatten() for v in g.values()]).norm())) < 1e-9


def test_an_error_in_a_small_parameter_is_seen_where_the_norm_hides_it():
    params = parameters((1000,), (3,))
    g = {"p0": 30 * torch.randn(1000, dtype=torch.float64), "p1": torch.full((3,), 1e-3)}
    wrong = {"p0": g["p0"], "p1": g["p1"].flip(0) * 1.02}  # misattributed: same size
    norm = lambda d: float(torch.cat([v.flatten() for v in d.values()]).norm())  # noqa: E731
    assert abs(norm(wrong) - norm(g)) <= TOL64 * norm(g)  # a norm check passes it
    bad = sketch.differences(sketch.of(params, wrong), sketch.of(params, g), TOL64, 1e-12)
    assert [k for k, _ in bad] == ["p1"]


def test_rounding_is_not_an_error_and_a_missing_parameter_is():
    params = parameters((40, 7), (7,))
    g = {k: torch.randn_like(p) for k, p in params.items()}
    rounded = {k: v.float().double() for k, v in g.items()}  # float32 rounding
    exact = sketch.of(params, g)
    assert sketch.differences(sketch.of(params, rounded), exact, TOL32, 1e-6) == []
    missing = sketch.of(params, {"p0": g["p0"]})  # the fast side never added p1
    assert [k for k, _ in sketch.differences(missing, exact, TOL32, 1e-6)] == ["p1"]


def test_no_random_stream_moves():
    state = torch.random.get_rng_state()
    params = parameters((5,))
    sketch.of(params, {"p0": torch.ones(5, dtype=torch.float64)}).numbers()
    assert torch.equal(state, torch.random.get_rng_state())


class Offset(nn.Module):
    """x + ε s: a parameter whose per-sample gradients are tiny next to the others'."""

    def __init__(self, d):
        super().__init__()
        self.s = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return x + 1e-4 * self.s


def misattributing_rule(layer, activations, backprops):
    """Each record gets the previous record's gradient: every norm close, every row wrong."""
    return {"s": (1e-4 * backprops).roll(1, 0)}


@pytest.fixture
def wrong_rule():
    rule = register_rule(LayerRule("offset", (Offset,), grad=misattributing_rule))
    yield
    unregister_rule(rule)


@pytest.mark.parametrize("mode", ["einsum", "vmap", "microbatch", "bookkeeping"])
def test_a_misattributing_rule_is_refused_by_every_optimizer_mode(wrong_rule, mode):
    """einsum (its rows come from the rule) must refuse; the other modes do not use the rule
    for this layer's rows (vmap, micro-batching) or its sum (book-keeping re-runs the layer;
    only its norms read the rule, a 1e-9 part of ||g_i||) and must be exact or refuse."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), Offset(3), nn.Tanh(), nn.Linear(3, 2)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    y = torch.randn(5, 2, dtype=torch.float64)
    loss = lambda out, t: (out - t).pow(2).sum(1)  # noqa: E731
    grads = []
    for i in range(5):  # the independent twin: one record at a time
        model.zero_grad()
        loss(model(x[i:i + 1]), y[i:i + 1]).sum().backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    norms = torch.stack([torch.cat([g.flatten() for g in r.values()]).norm() for r in grads])
    C = float(norms.median())
    c = (C / norms).clamp(max=1)
    want = {k: sum(c[i] * grads[i][k] for i in range(5)) for k in grads[0]}
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, loss_reduction="sum",
                      method=mode)
    try:
        opt.zero_grad()
        loss(model(x), y).sum().backward()
        if mode == "einsum":
            with pytest.raises(PerSampleCheckError, match=r"1\.s "):
                opt.step()
            return
        try:
            opt.step()
        except PerSampleCheckError:
            return  # refused: fine, never silently wrong
        for k, p in model.named_parameters():  # book-keeping norms this layer by the rule:
            # its clip factors carry the norm check's tolerance (1e-7, selfcheck.TOLERANCE)
            torch.testing.assert_close(p.grad, want[k], rtol=1e-6, atol=1e-12)
    finally:
        opt.detach()


class Float32Inside(nn.Module):  # Hugging Face's RMSNorm: hidden_states.to(torch.float32)
    def __init__(self, cast):
        super().__init__()
        self.cast, self.fc, self.out = cast, nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.fc(x)
        if self.cast == "softmax":
            h = h * torch.softmax(h, -1, dtype=torch.float32).to(x.dtype)
        elif self.cast:
            h = (h.to(torch.float32) * torch.rsqrt(h.to(torch.float32).pow(2).mean(-1, True)
                                                   + 1e-6)).to(x.dtype)
        return self.out(h)


@pytest.mark.parametrize("cast", [False, True, "softmax"])
def test_checks_use_the_tolerance_of_the_narrowest_dtype_computed_in(cast):
    """A float64 model computing partly in float32 rounds at float32's precision: its
    per-parameter check uses float32's tolerance (a T5 in a training loop was refused at 1.5x
    float64's), a model computing in float64 throughout keeps float64's."""
    from workbench.per_sample import precision
    from workbench.per_sample.recording import record

    torch.manual_seed(0)
    model = Float32Inside(cast).double()
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    rec = record(model, lambda o, t: ((o - t) ** 2).sum(1), x, y)
    want = torch.float32 if cast else torch.float64
    assert precision.compared_dtype(rec) == want
