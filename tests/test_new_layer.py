"""Adding a layer is one file: ``nn.Bilinear``'s rule, written into a rule package in a tmp
folder, is imported, registered, and then right in every method (float64, against
micro-batching), in its routes, in ``auto`` and in the memory model (against a measured peak).

nn.Bilinear: o_t = x_tᵀ W z_t + c, W: (p, d, e). Per sample over T positions:

    ∂ℓ_i/∂W[o, j, k] = Σ_t b_{t,o} x_{t,j} z_{t,k}         (n, p, d, e)
    ||g_i||² = Σ_{t,s} <b_t, b_s> <x_t, x_s> <z_t, z_s>     three (T, T) Grams: 3T² per sample

so a memory model that read the route's name "gram" as a Linear's two Grams (2T²) would say
8 where 12 are made at T = 2; the rule's Route declares its own 3T².
"""

import sys
import warnings

import pytest
import torch
from torch import nn

import workbench as wb
from tests.helpers import (
    assert_agree,
    assert_clipping_agrees,
    import_rule_package,
    mse_per_sample,
    random_batch,
)
from workbench.bench.peak_memory import peak_bytes
from workbench.clipping.auto import choose_mode
from workbench.clipping.ghost import record
from workbench.clipping.memory_model import ghost_memory
from workbench.per_sample import einsum as einsum_module
from workbench.rules import MATERIALISE, RULES, LayerRule, register_rule, unregister_rule

RULE_FILE = '''
"""nn.Bilinear: o_t = x_tᵀ W z_t + c; grad rule, norm rule by three Grams or materialised."""
import torch
from torch import nn

from workbench.rules import LayerRule, Route, register_rule


def positions(x):
    return x[0].numel() // x.shape[-1]


def grad_rule(layer, activations, backprops):
    x, z = activations
    n, (p, d, e) = x.shape[0], layer.weight.shape
    X, Z = x.reshape(n, -1, d), z.reshape(n, -1, e)  # (n, T, d), (n, T, e)
    B = backprops.reshape(n, -1, p)  # (n, T, p)
    out = {}
    if layer.weight.requires_grad:
        BX = (B.unsqueeze(3) * X.unsqueeze(2)).flatten(2)  # (n, T, p d)
        out["weight"] = torch.bmm(BX.transpose(1, 2), Z).view(n, p, d, e)  # Σ_t b x zᵀ
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = B.sum(1)  # (n, p)
    return out


def gram_is_cheaper(T, layer):
    return 3 * T * T < layer.weight[0].numel() * layer.weight.shape[0]


def norm_rule(layer, activations, backprops):
    x, z = activations
    n, (p, d, e) = x.shape[0], layer.weight.shape
    X, Z, B = x.reshape(n, -1, d), z.reshape(n, -1, e), backprops.reshape(n, -1, p)
    if gram_is_cheaper(X.shape[1], layer):
        XX, ZZ, BB = (torch.bmm(M, M.transpose(1, 2)) for M in (X, Z, B))  # (n, T, T) each
        squares = (XX * ZZ * BB).sum((1, 2))  # Σ_ts <x_t,x_s><z_t,z_s><b_t,b_s>
    else:
        squares = grad_rule(layer, activations, backprops)["weight"].pow(2).sum((1, 2, 3))
    if layer.bias is not None:
        squares = squares + B.sum(1).pow(2).sum(1)  # ||Σ_t b_t||²
    return squares


GRAM = Route("gram", lambda layer, call: 3 * positions(call.args[0]) ** 2)  # three Grams
MATERIALISE = Route(  # g_i (p d e + p) and the (T, p d) product before the matmul
    "materialise", lambda layer, call: (layer.weight[0].numel() + 1) * layer.weight.shape[0]
    + positions(call.args[0]) * layer.weight.shape[0] * layer.weight.shape[1],
    materialises=True)


def route(layer, activations):
    T = positions(activations[0])
    if gram_is_cheaper(T, layer):
        return GRAM, f"3T² = {3 * T * T} < pde: three (T, T) Grams"
    return MATERIALISE, f"3T² = {3 * T * T} >= pde: the gradient is smaller"


RULE = register_rule(LayerRule("bilinear", (nn.Bilinear,), grad=grad_rule, norm=norm_rule,
                               route=route, routes=(GRAM, MATERIALISE)))
'''


@pytest.fixture
def bilinear_rule(tmp_path, monkeypatch):
    """The package ``new_rules`` with one file, imported as ``workbench.rules`` is; the
    rule and the modules are removed afterwards (nn.Bilinear has no built-in rule)."""
    assert nn.Bilinear not in RULES
    monkeypatch.syspath_prepend(str(tmp_path))
    import_rule_package(tmp_path, "new_rules", {"bilinear": RULE_FILE})
    module = sys.modules["new_rules.bilinear"]
    yield module
    unregister_rule(module.RULE)
    for name in ("new_rules", "new_rules.bilinear"):
        sys.modules.pop(name, None)
    assert nn.Bilinear not in RULES and nn.Bilinear not in wb.GRAD_SAMPLERS


class Pair(nn.Module):
    """Splits the last dim of x into the two inputs of a Bilinear, then a Linear head."""

    def __init__(self, d, e, p):
        super().__init__()
        self.d = d
        self.bilinear = nn.Bilinear(d, e, p)
        self.head = nn.Linear(p, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.bilinear(x[..., :self.d], x[..., self.d:])))


CASES = {  # name -> (input shape per sample, (d, e, p), route of the Bilinear)
    "one position": ((7,), (3, 4, 5), "gram"),  # T = 1: three 1 x 1 Grams
    "gram": ((3, 7), (3, 4, 5), "gram"),  # 3T² = 27 < 60
    "materialise": ((6, 7), (3, 4, 2), "materialise"),  # 3T² = 108 >= 24
}


def problem(name, n=5):
    shape, (d, e, p), _ = CASES[name]
    torch.manual_seed(0)
    model = Pair(d, e, p).double()
    x, y = random_batch((n, *shape), (n, *shape[:-1], 2))
    return model, x, y


@pytest.mark.parametrize("name", ["gram", "materialise"])
def test_every_method_agrees_with_micro_batching(bilinear_rule, name):
    model, x, y = problem(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no vmap warning: the rule file's rules are used
        warnings.filterwarnings("ignore", "There is a performance drop")  # torch's own vmap
        einsum_module._WARNED.clear()
        assert_agree(model, mse_per_sample, x, y, methods=("vmap", "einsum"), strict=True)
        assert_clipping_agrees(model, mse_per_sample, x, y)  # vmap, einsum, ghost, book-keeping
    routes = wb.ghost_routes(model, mse_per_sample, x, y)
    assert routes["route"][0] == CASES[name][2] and "3T²" in routes["reason"][0]


def test_one_position_takes_the_route_the_rule_declares(bilinear_rule):
    model, x, y = problem("one position")  # T = 1: 3 < pde = 60
    assert_clipping_agrees(model, mse_per_sample, x, y)
    assert wb.ghost_routes(model, mse_per_sample, x, y)["route"][0] == "gram"


def test_auto_reads_whether_the_route_materialises(bilinear_rule):
    for name, cheap in (("gram", True), ("materialise", False)):
        model, x, y = problem(name)
        rec = record(model, mse_per_sample, x, y, retain_graph=False, check=False)
        _, numbers = choose_mode(rec)
        bilinear = sum(p.numel() for p in model.bilinear.parameters()) * x.shape[0]
        assert numbers["avoided"] == (bilinear if cheap else 0), name  # the head materialises


@pytest.mark.parametrize("d, e, p, T, route", [(3, 4, 5, 2, "gram"), (16, 16, 16, 24, "gram"),
                                               (3, 4, 2, 12, "materialise")])
def test_memory_model_is_the_routes_declared_scratch_and_matches_the_measured_peak(
        bilinear_rule, d, e, p, T, route):
    """The model's scratch is what the rule's Route declares; measured (the CPU profiler's
    peak around the norm rule alone, its inputs already live) it is at least that and at most
    twice (the elementwise products before their sum, the bias's ||Σ_t b_t||²)."""
    n = 64
    g = torch.Generator().manual_seed(0)
    x, z, b = (torch.randn(n, T, k, generator=g, dtype=torch.float64) for k in (d, e, p))
    model = Pair(d, e, p).double()
    table = ghost_memory(model, mse_per_sample, torch.cat([x, z], -1)[:2],
                         torch.randn(2, T, 2, dtype=torch.float64))
    want = 3 * T * T if route == "gram" else p * d * e + p + T * p * d
    assert (table["route"][0], table["scratch"][0]) == (route, want)
    if T == 2:  # the case: a Linear's two Grams, 2T², would say 8; 12 are made
        assert want == 12
        return  # too small to measure against the allocator's other bytes
    with torch.no_grad():
        step = lambda: bilinear_rule.norm_rule(model.bilinear, (x, z), b)  # noqa: E731
        step()  # warm-up
        measured = peak_bytes(step, torch.device("cpu"), resident=0)
    predicted = n * want * 8
    assert predicted <= measured <= 2 * predicted, (measured, predicted)


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x):
        return x * self.s


def scale_norms(layer, activations, backprops):
    return (activations[0] * backprops).pow(2).sum(1)


def test_a_route_of_unknown_cost_is_refused_not_guessed():
    """A norm rule registered the old way, with a route that returns a name, has no declared
    scratch: the memory model raises, naming the layer and the fix."""
    from workbench.clipping.registry import NORM_ROUTES, NORM_SAMPLERS, register_norm_rule

    register_norm_rule(Scale, route=lambda layer, a: ("mine", "a name, not a Route"))(
        scale_norms)
    try:
        x, y = random_batch((4, 3), (4, 3))
        assert wb.ghost_routes(Scale(), mse_per_sample, x, y)["route"][0] == "mine"
        with pytest.raises(ValueError, match=r"'mine' of Scale declares no scratch.*Route"):
            ghost_memory(Scale(), mse_per_sample, x, y)
    finally:
        NORM_SAMPLERS.pop(Scale)
        NORM_ROUTES.pop(Scale)


def test_register_rule_needs_the_routes_a_norm_rule_takes():
    with pytest.raises(TypeError, match=r"rule 'scale': list the Route objects"):
        register_rule(LayerRule("scale", (Scale,), norm=scale_norms,
                                route=lambda layer, a: (MATERIALISE, "")))
    with pytest.raises(TypeError, match="register_rule needs a LayerRule"):
        register_rule(scale_norms)
    assert Scale not in RULES
