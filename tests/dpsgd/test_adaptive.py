"""Adaptive clipping (dpsgd/adaptive.py; Andrew et al. 2021): C follows the target quantile of
known norm distributions, in every mode; the noise is split as Eq. (3) says and the accountant
charges the σ asked for; the count's noise is N(0, σ_b²); invalid combinations are refused."""

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import workbench as wb
from workbench.dpsgd import MODES, AdaptiveClipDPOptimizer, AdaptiveClipping
from workbench.dpsgd.adaptive import gradient_noise_multiplier


def norm_data(n=2000, d=5, seed=0):
    """x_i = r_i u_i with r_i log-normal and u_i a unit vector: g_i = x_i for the loss below."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(n, d, generator=g, dtype=torch.float64)
    r = torch.exp(0.5 * torch.randn(n, generator=g, dtype=torch.float64))
    return u / u.norm(dim=1, keepdim=True) * r[:, None], r


def run(mode="einsum", steps=150, quantile=0.5, C0=5.0, lr=0.0, sigma=1.0, seed=0, x=None):
    x, r = norm_data() if x is None else (x, x.norm(dim=1))
    model = nn.Linear(x.shape[1], 1, bias=False).double()
    nn.init.zeros_(model.weight)  # g_i = x_i whatever w is; w then shows the update alone
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loader = DataLoader(TensorDataset(x), batch_size=200)
    engine = wb.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=sigma,
        max_grad_norm=C0, method=mode, loss_reduction="sum",
        adaptive_clipping=AdaptiveClipping(target_quantile=quantile, learning_rate=0.2),
        noise_generator=torch.Generator().manual_seed(seed),
        sampling_generator=torch.Generator().manual_seed(seed + 1))
    trace, taken = [], 0
    while taken < steps:
        for (xb,) in loader:
            opt.zero_grad()
            model(xb).sum().backward()  # ℓ_i = w·x_i: g_i = x_i, ||g_i|| = r_i
            opt.step()
            trace.append((opt.last["max_grad_norm"], opt.last["unclipped_fraction"],
                          opt.last["norms"].clone()))
            taken += 1
            if taken == steps:
                break
    return engine, opt, trace, r


@pytest.mark.parametrize("quantile", [0.3, 0.5, 0.9])
def test_clip_norm_tracks_the_target_quantile(quantile):
    _, _, trace, r = run(quantile=quantile, steps=200)
    target = float(torch.quantile(r, quantile))
    late = torch.tensor([c for c, _, _ in trace[-50:]])
    assert abs(float(late.median()) / target - 1) < 0.15, (float(late.median()), target)
    assert abs(trace[0][0] - 5.0) > 0  # it moved from C0 = 5 at once


def test_every_mode_follows_the_same_path():
    paths = {m: [c for c, _, _ in run(mode=m, steps=6)[2]] for m in MODES}
    ref = paths["microbatch"]
    for mode, path in paths.items():
        assert path == pytest.approx(ref, rel=1e-9), mode


def test_noise_is_split_and_the_accountant_charges_sigma():
    engine, opt, trace, _ = run(steps=5)
    sigma_b = opt.expected_batch_size / 20
    assert opt.count_noise_multiplier == sigma_b
    assert opt.noise_std() == pytest.approx(
        gradient_noise_multiplier(1.0, sigma_b) * opt.max_grad_norm)
    # Eq. (3): the two releases together are one Gaussian query of multiplier σ = 1
    s_d = gradient_noise_multiplier(1.0, sigma_b)
    assert s_d ** -2 + (2 * sigma_b) ** -2 == pytest.approx(1.0)
    assert engine.accountant.history == [(1.0, 0.1, 5)]


def test_gradient_noise_has_the_gradients_share():
    x = torch.zeros(400, 4000, dtype=torch.float64)  # g_i = 0: the update is the noise alone
    engine, opt, trace, _ = run(steps=1, x=x, lr=1.0, C0=2.0)
    w = opt.param_groups[0]["params"][0].detach()
    B = opt.expected_batch_size
    expected = gradient_noise_multiplier(1.0, B / 20) * 2.0 / B  # σ_Δ C / B per coordinate
    assert float(w.std()) == pytest.approx(expected, rel=0.05)


def test_count_noise_is_gaussian_with_sigma_b():
    _, opt, trace, _ = run(steps=300, C0=1.0)
    B, sigma_b = opt.expected_batch_size, opt.count_noise_multiplier
    C = [1.0] + [c for c, _, _ in trace[:-1]]  # the C each step clipped to
    noise = torch.tensor([(b - 0.5) * B - float(((norms <= c).double() - 0.5).sum())
                          for c, (_, b, norms) in zip(C, trace)])
    assert abs(float(noise.mean())) < 4 * sigma_b / math.sqrt(len(noise))
    assert float(noise.std()) == pytest.approx(sigma_b, rel=0.15)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_grad_norm=[1.0]), ValueError, "one max_grad_norm for the whole model"),
    (dict(noise_multiplier=0.0), ValueError, "needs noise_multiplier > 0"),
    (dict(adaptive_clipping=AdaptiveClipping(count_noise_multiplier=0.1)), ValueError,
     r"sigma_b > sigma / 2 = 0.5"),
    (dict(adaptive_clipping=0.5), TypeError, "must be a wb.dpsgd.AdaptiveClipping"),
])
def test_invalid_combinations_are_refused(kwargs, error, match):
    model = nn.Linear(3, 1)
    args = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=DataLoader(TensorDataset(torch.randn(50, 3)), batch_size=10),
                noise_multiplier=1.0, max_grad_norm=1.0, adaptive_clipping=AdaptiveClipping())
    with pytest.raises(error, match=match):
        wb.PrivacyEngine().make_private(**(args | kwargs))


def test_noise_turned_off_after_make_private_is_refused_by_name():
    """A ZeroDivisionError from Eq. (3) until 2026-11-30."""
    model = nn.Linear(3, 1)
    model, opt, loader = wb.PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(torch.randn(50, 3)), batch_size=25),
        noise_multiplier=1.0, max_grad_norm=1.0, adaptive_clipping=AdaptiveClipping())
    opt.noise_multiplier = 0.0
    (x,) = next(iter(loader))
    opt.zero_grad()
    model(x).mean().backward()
    with pytest.raises(ValueError, match="adaptive clipping needs noise_multiplier > 0"):
        opt.step()


@pytest.mark.parametrize("kwargs, match", [
    (dict(target_quantile=1.0), r"target_quantile must be in \(0, 1\)"),
    (dict(learning_rate=-1), "learning_rate must be a finite number > 0"),
    (dict(count_noise_multiplier=0), "count_noise_multiplier must be a finite number > 0"),
])
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveClipping(**kwargs)


def test_is_the_optimizer_class_made():
    _, opt, _, _ = run(steps=1)
    assert isinstance(opt, AdaptiveClipDPOptimizer)
