"""method="auto": make_private's default picks einsum or book-keeping by the rule of
clipping/auto.py, gives the clipped sums of the explicit modes, and an explicit mode wins."""

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

CE_MEAN = nn.CrossEntropyLoss()
CE = nn.CrossEntropyLoss(reduction="none")


def embedding_model():  # an Embedding(V, d): n V d numbers to materialise, n T d to read
    return nn.Sequential(nn.Embedding(50, 4), models.MeanOver(1), nn.Linear(4, 3)).double()


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


CASES = {"embedding": (embedding_model, "bookkeeping"), "conv": (conv_model, "einsum"),
         "lstm": (lambda: LSTMModel().double(), "einsum")}


@pytest.fixture
def no_cache(monkeypatch):  # the test models are tiny: let any avoided size count
    monkeypatch.setattr(auto, "BYTES", 0)


def test_small_per_sample_gradients_stay_with_einsum():
    torch.manual_seed(0)
    rec = record(embedding_model(), CE, *inputs("embedding"), retain_graph=False)
    mode, why = choose_mode(rec)
    assert mode == "einsum" and why["avoided_bytes"] < auto.BYTES
    assert why["avoided_bytes"] == why["avoided"] * 8  # float64


@pytest.mark.parametrize("kind", CASES)
def test_the_rule_picks_a_valid_mode_with_its_reason(kind, no_cache):
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
def test_auto_gives_the_clipped_sums_of_the_explicit_modes(kind, no_cache):
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


def test_make_private_defaults_to_auto_and_an_explicit_mode_wins(no_cache):
    torch.manual_seed(0)
    x, y = inputs("embedding", n=16)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    for kwargs, ran in (({}, "bookkeeping"), ({"method": "einsum"}, "einsum")):
        model = embedding_model()
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
