"""A module registered under two parents (VB-LoRA's vector bank: one ``ParameterDict`` held by
every adapted layer) has one parameter slot reached by several names. ``functional_call`` with
``tie_weights=True`` swapped that slot once per name and left its substitute in the model, so
after one vmap (the method, or the whole-model fallback) the parameter was gone: every later
call returned zeros for it, silently (``per_sample/functional.py``, ``slot_values``)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.helpers import ce_per_sample as loss_fn
from tests.helpers import classification_batch, one_at_a_time_grads, relative_error
from workbench.dpsgd import MODES, DPOptimizer

D, K = 4, 3


class Adapted(nn.Module):
    """A frozen Linear plus x Bᵀ with B gathered from a shared bank (VB-LoRA's habit)."""

    def __init__(self, bank: nn.ParameterDict, rows):
        super().__init__()
        self.base = nn.Linear(D, D).requires_grad_(False)
        self.bank, self.rows = bank, rows  # the same ParameterDict in every layer
        self.logits = nn.Parameter(torch.randn(D, 2))

    def forward(self, x):
        B = (self.logits.softmax(-1).unsqueeze(-1) * self.bank["v"][self.rows]).sum(1)  # (D, D)
        return self.base(x) + F.linear(x, B)


class SharedBank(nn.Module):
    def __init__(self):
        super().__init__()
        bank = nn.ParameterDict({"v": nn.Parameter(torch.randn(5, D))})
        self.a = Adapted(bank, torch.tensor([[0, 1]] * D))
        self.b = Adapted(bank, torch.tensor([[2, 4]] * D))
        self.bank = bank  # also held by the top model (peft's VBLoRAModel does)
        self.head = nn.Linear(D, K)

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def batch(n, seed):
    return classification_batch(n, D, K, seed)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return SharedBank().double()


def slots(model):
    return [p for m in model.modules() for p in m._parameters.values()]


@pytest.mark.parametrize("method", ["vmap", "einsum"])
def test_per_sample_gradients_stay_exact_call_after_call(model, method):
    before = slots(model)
    for seed in range(3):  # the bank's parameter vanished after the first call
        x, y = batch(4, seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = wb.per_sample_gradients(model, loss_fn, x, y, method=method)
        ref = one_at_a_time_grads(model, loss_fn, x, y)
        assert set(got) == set(ref)
        for k in ref:
            assert relative_error(got[k], ref[k]) <= 1e-9, (method, seed, k)
        assert all(a is b for a, b in zip(slots(model), before))  # the same Parameters


def test_clipped_sums_and_the_optimizer_stay_exact(model):
    for seed, method in enumerate(["vmap", "ghost", "bookkeeping", "ghost"]):
        x, y = batch(4, seed)
        ref = one_at_a_time_grads(model, loss_fn, x, y)
        norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in ref.values()))
        C = float(norms.median())
        c = (C / norms).clamp(max=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = wb.clipped_grad_sum(model, loss_fn, x, y, C, method=method)
        for k, g in ref.items():
            assert relative_error(got[k], torch.einsum("n,n...->...", c, g)) <= 1e-9, (method, k)
    for mode in MODES:
        opt = DPOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                          lr=0.0), model, noise_multiplier=0.0, max_grad_norm=C,
                          expected_batch_size=1.0, method=mode, loss_reduction="sum")
        try:
            for seed, n in enumerate((3, 4, 3)):
                x, y = batch(n, 10 + seed)
                ref = one_at_a_time_grads(model, loss_fn, x, y)
                norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in ref.values()))
                c = (C / norms).clamp(max=1)
                opt.zero_grad()
                loss_fn(model(x), y).sum().backward()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    opt.step()
                for k, p in model.named_parameters():
                    if p.requires_grad:
                        want = torch.einsum("n,n...->...", c, ref[k])
                        assert relative_error(p.grad, want) <= 1e-9, (mode, seed, k)
        finally:
            opt.detach()


def test_the_audits_torch_func_provider_leaves_the_model_as_it_was(model):
    from workbench.audit.providers import torch_func_provider

    before = slots(model)
    for seed in range(2):
        x, y = batch(3, seed)
        got = torch_func_provider(model, loss_fn, x, y)
        ref = one_at_a_time_grads(model, loss_fn, x, y)
        for k in ref:
            assert relative_error(got[k], ref[k]) <= 1e-9, (seed, k)
        assert all(a is b for a, b in zip(slots(model), before))
