"""LM training loops: perplexity against a direct computation, pretraining lowers the loss,
and the DP loop's noiseless update equals the clipped sum over qN (one Adam-free check)."""

import math

import pytest
import torch
from torch.utils.data import TensorDataset

import workbench as wb
from workbench.lm.training import dp_train_lm, perplexity, train_lm
from workbench.models import sequence_cross_entropy, tiny_gpt


def model_and_data(N=40, T=8):
    model = tiny_gpt(11, block_size=T, n_layer=1, n_head=2, n_embd=8,
                     generator=torch.Generator().manual_seed(0)).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 11, (N, T), generator=g)  # (N, T)
    return model, TensorDataset(x, (x + 1) % 11)  # learnable: next = current + 1


def test_perplexity_is_exp_of_mean_token_loss():
    model, data = model_and_data()
    with torch.no_grad():
        want = math.exp(sequence_cross_entropy(model(data.tensors[0]), data.tensors[1]).mean())
    assert math.isclose(perplexity(model, data, batch_size=7), want, rel_tol=1e-12)


def test_pretraining_lowers_perplexity():
    model, data = model_and_data()
    before = perplexity(model, data)
    train_lm(model, data, steps=30, batch_size=8, lr=1e-2, generator=torch.Generator())
    assert perplexity(model, data) < 0.5 * before


def test_dp_step_without_noise_is_clipped_sum_over_expected_batch(monkeypatch):
    model, data = model_and_data()
    x, y = data.tensors
    q, N, C = 0.25, 40, 0.3
    draws = torch.rand(N, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    idx = (draws < q).nonzero().squeeze(1)  # the engine's sampler: float64 draws
    want = wb.clipped_grad_sum(model, sequence_cross_entropy, x[idx], y[idx], C,
                               method="microbatch")
    seen = {}
    monkeypatch.setattr(torch.optim.Adam, "step", lambda self: seen.update(
        {id(p): p.grad.clone() for p in self.param_groups[0]["params"]}))
    run = dp_train_lm(model, data, target_epsilon=math.inf, delta=1e-5, steps=1,
                      batch_size=10, max_grad_norm=C, lr=1e-3, method="vmap",
                      generator=torch.Generator().manual_seed(5),
                      noise_generator=torch.Generator())
    assert run.noise_multiplier == 0.0 and run.epsilon == math.inf
    for name, p in model.named_parameters():
        assert torch.allclose(seen[id(p)], want[name] / (q * N), rtol=1e-9, atol=1e-15)


def test_dp_run_calibrates_sigma_to_target_epsilon():
    model, data = model_and_data()
    run = dp_train_lm(model, data, target_epsilon=4.0, delta=1e-5, steps=3, batch_size=10,
                      max_grad_norm=1.0, lr=1e-3, method="vmap",
                      generator=torch.Generator().manual_seed(0),
                      noise_generator=torch.Generator().manual_seed(1))
    assert run.noise_multiplier > 0 and 3.9 <= run.epsilon <= 4.0 and run.sample_rate == 0.25
    with pytest.raises(ValueError, match=r"batch_size must be an integer in \[1, N=40\]"):
        dp_train_lm(model, data, target_epsilon=4.0, delta=1e-5, steps=1, batch_size=41,
                    max_grad_norm=1.0, lr=1e-3, generator=torch.Generator(),
                    noise_generator=torch.Generator())
