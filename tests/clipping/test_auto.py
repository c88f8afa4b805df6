"""method="auto": make_private's default picks einsum or book-keeping by the cost model of
clipping/auto.py (Eq. 1 and 2, from shapes and routes), gives the clipped sums of the explicit
modes, and an explicit mode wins."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import workbench as wb
from tests.helpers import relative_error
from workbench import models
from workbench.clipping import auto
from workbench.clipping.auto import choose_mode
from workbench.clipping.ghost import record
from workbench.dpsgd import MODES, DPOptimizer
from workbench.layers import DPLSTM
from workbench.rules import Route

CE_MEAN = nn.CrossEntropyLoss()
CE = nn.CrossEntropyLoss(reduction="none")


def embedding_model(V=50):  # an Embedding(V, d): n V d numbers to materialise, n T d to read
    return nn.Sequential(nn.Embedding(V, 4), models.MeanOver(1), nn.Linear(4, 3)).double()


def conv_model():  # image convolutions take the "materialise" norm route in both modes
    # (2 L² = 162 >= p d = 100) and are not streamed (n 104 g_i numbers > n (49 + 36) in a, b)
    return nn.Sequential(nn.Conv2d(1, 4, 5), nn.Tanh(), models.MeanOver((2, 3)),
                         nn.Linear(4, 3)).double()


class LSTMModel(nn.Module):  # at T = 12, 2T² >= pd: its parts take the "materialise" route
    def __init__(self):
        super().__init__()
        self.rnn, self.head = DPLSTM(3, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0].mean(1))


def inputs(kind, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = {"embedding": lambda: torch.randint(0, 50, (n, 5), generator=g),
         "conv": lambda: torch.randn(n, 1, 7, 7, generator=g, dtype=torch.float64),
         "lstm": lambda: torch.randn(n, 12, 3, generator=g, dtype=torch.float64)}[kind]()
    return x, torch.randint(0, 3, (n,), generator=g)


# a 40,000-row table: n V d = 960,000 per-sample numbers against n T d = 120 backprops
CASES = {"embedding": (lambda: embedding_model(40_000), "bookkeeping"),
         "conv": (conv_model, "einsum"), "lstm": (lambda: LSTMModel().double(), "einsum")}


def test_the_mode_is_the_smaller_modelled_cost_and_small_tables_stay_with_einsum():
    torch.manual_seed(0)
    for V, expected in ((50, "einsum"), (40_000, "bookkeeping")):
        rec = record(embedding_model(V), CE, *inputs("embedding"), retain_graph=False)
        mode, why = choose_mode(rec)
        assert mode == expected, (V, why)
        assert mode == min(("einsum", "bookkeeping"), key=lambda m: why[f"{m}_s"])
        assert why["avoided"] == 6 * (V * 4 + 4 * 3 + 3)  # both layers differ


def test_linear_costs_follow_equations_1_and_2():
    """One Linear(d, p) call at T = 1 (norm product route), costed by hand from its shapes."""
    n, d, p = 5, 7, 3
    model = nn.Linear(d, p).double()
    x, y = torch.randn(n, d, dtype=torch.float64), torch.randint(0, p, (n,))
    rec = record(model, CE, x, y, retain_graph=False)
    _, why = choose_mode(rec)
    P, s = p * d + p, 8
    m = P  # one position: P multiply-adds per sample
    einsum = n * m / auto.SAMPLE + 3 * n * P * s / auto.BANDWIDTH
    r = d + p  # the norm product reads a_i and b_i (rules/linear.py's declared flops)
    bookkeeping = n * (r + m) / auto.GEMM + n * (d + 2 * p) * s / auto.BANDWIDTH + auto.FIXED
    assert why["einsum_s"] == pytest.approx(einsum, rel=1e-12)
    assert why["bookkeeping_s"] == pytest.approx(bookkeeping, rel=1e-12)


def test_the_choice_follows_the_constants(monkeypatch):
    """The same recording flips mode with the model's constants, never with a timing."""
    torch.manual_seed(0)
    rec = record(embedding_model(50), CE, *inputs("embedding"), retain_graph=False)
    monkeypatch.setattr(auto, "FIXED", 0.0)  # no fixed cost: reading T d beats writing V d
    assert choose_mode(rec)[0] == "bookkeeping"
    monkeypatch.setattr(auto, "BANDWIDTH", 1e30)  # free memory traffic: only products count
    monkeypatch.setattr(auto, "GEMM", 1.0)  # and the large products are the slow ones
    assert choose_mode(rec)[0] == "einsum"


def test_calls_materialised_in_both_modes_do_not_count():
    """A Linear at T = 16 positions whose g_i (n p d) are smaller than its a and b
    (n T (d + p)) is materialised during the backward pass in either mode: no difference."""
    model = nn.Sequential(nn.Linear(4, 4), models.MeanOver(1)).double()
    x, y = torch.randn(6, 16, 4, dtype=torch.float64), torch.randint(0, 4, (6,))
    rec = record(model, CE, x, y, retain_graph=False)
    mode, why = choose_mode(rec)
    assert (mode, why["avoided"], why["einsum_s"], why["bookkeeping_s"]) == ("einsum", 0, 0, 0)
    assert why["materialised"] == 6 * 20


def test_a_tied_head_differs_when_its_weight_is_cross_normed():
    """Book-keeping norms a tied embedding from its two calls' Grams (``cross.py``), einsum
    materialises it: both calls count, with the pairs' Gram cost (T · Σ T · (V + d) each)."""
    from tests.clipping.test_cross import TiedHead, sequence_ce, tokens

    n, T, V, d = 6, 5, 20_000, 16
    model = TiedHead(V=V, d=d, hidden_bias=False).double()
    x, y = tokens(n=n, T=T, V=V)
    rec = record(model, sequence_ce, x, y, retain_graph=False)
    mode, why = choose_mode(rec)
    assert why["avoided"] == n * (2 * V * d + d * d)  # both tied calls and the d x d Linear
    assert mode == "bookkeeping", why
    head = [call for path, _, call in rec.calls() if path.startswith("F.linear")][0]
    e, k = auto.call_costs(rec, rec.layers["F.linear(wte.weight)"], head, V * d, T * 2 * T)
    m = V * d * T
    assert e == pytest.approx(n * m / auto.SAMPLE + 3 * n * V * d * 8 / auto.BANDWIDTH)
    assert k == pytest.approx(n * (2 * T * T * (V + d) + m) / auto.GEMM
                              + n * (T * d + 2 * T * V) * 8 / auto.BANDWIDTH + auto.FIXED)


def test_a_route_without_declared_flops_assumes_no_saving(monkeypatch):
    torch.manual_seed(0)
    rec = record(embedding_model(40_000), CE, *inputs("embedding"), retain_graph=False)
    bare = Route("segment sum", lambda layer, call: 1)  # flops not declared
    real = auto.norm_route
    monkeypatch.setattr(auto, "norm_route", lambda layer, a: (bare, "") if isinstance(
        layer, nn.Embedding) else real(layer, a))
    mode, why = choose_mode(rec)
    assert mode == "einsum", why  # the Embedding costs the same both ways; the head decides


@pytest.mark.parametrize("kind", CASES)
def test_the_rule_picks_a_valid_mode_with_its_reason(kind):
    torch.manual_seed(0)
    make, expected = CASES[kind]
    rec = record(make(), CE, *inputs(kind), retain_graph=False)
    mode, why = choose_mode(rec)
    assert mode in MODES and mode == expected, (kind, mode, why)
    assert 0 <= why["avoided"] <= why["materialised"] and why["materialised"] > 0


def step(model, mode, x, y, C=0.5, B=8.0):
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=B, method=mode)
    opt.zero_grad()
    CE_MEAN(model(x), y).backward()
    opt.step()
    opt.detach()
    return {k: p.grad.clone() for k, p in model.named_parameters()}, opt.last["mode"]


@pytest.mark.parametrize("kind", CASES)
def test_auto_gives_the_clipped_sums_of_the_explicit_modes(kind):
    make, expected = CASES[kind]
    x, y = inputs(kind)
    torch.manual_seed(0)
    model = make()
    reference = wb.clipped_grad_sum(model, CE, x, y, 0.5, method="microbatch")
    grads, ran = step(model, "auto", x, y)
    assert ran == expected
    for explicit in ("einsum", "bookkeeping"):
        other, ran_explicit = step(model, explicit, x, y)
        assert ran_explicit == explicit  # an explicit mode is never overridden
        for k, g in grads.items():
            assert relative_error(g, other[k]) <= 1e-9, (kind, explicit, k)
    for k, g in grads.items():
        assert relative_error(g, reference[k] / 8.0) <= 1e-9, (kind, k)


def test_make_private_defaults_to_auto_and_an_explicit_mode_wins():
    torch.manual_seed(0)
    x, y = inputs("embedding", n=16)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    for kwargs, ran in (({}, "bookkeeping"), ({"method": "einsum"}, "einsum")):
        model = embedding_model(40_000)
        _, opt, dp_loader = wb.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            sampling_generator=torch.Generator().manual_seed(0),
            noise_generator=torch.Generator().manual_seed(1), **kwargs)
        assert opt.method == kwargs.get("method", "auto")
        for bx, by in dp_loader:
            if len(bx):
                opt.zero_grad()
                CE_MEAN(model(bx), by).backward()
                opt.step()
                break
        assert opt.last["mode"] == ran
        opt.detach()


class PositionBias(nn.Module):
    """A learned (heads, T, T) bias called without arguments (Swin's relative position bias):
    no (a, b) pair to cost. At n = 1 its output's dim 0 of size 1 looks like the batch's."""

    def __init__(self, T=4):
        super().__init__()
        self.table = nn.Parameter(torch.randn(1, T, T) / 4)

    def forward(self):
        return self.table


class Biased(nn.Module):
    def __init__(self, T=4, d=3):
        super().__init__()
        self.bias, self.proj, self.head = PositionBias(T), nn.Linear(d, d), nn.Linear(d, 2)

    def forward(self, x):  # x: (n, T, d)
        scores = self.proj(x) @ x.transpose(1, 2) + self.bias()
        return self.head((scores.softmax(-1) @ x).mean(1))


@pytest.mark.parametrize("sizes", [(1,), (1, 3, 1), (3, 1, 2)])
def test_auto_costs_a_call_without_arguments(sizes):
    """Used to raise IndexError in the cost model (``_first`` of no arguments) at n = 1."""
    from tests.helpers import assert_optimizer_matches_microbatch

    torch.manual_seed(0)
    model = Biased().double()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 4, 3, generator=g, dtype=torch.float64),
                torch.randint(0, 2, (n,), generator=g)) for n in sizes]
    assert_optimizer_matches_microbatch(
        model, lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"), batches,
        max_grad_norm=0.05, method="auto")
