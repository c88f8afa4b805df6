"""DPOptimizer and PrivacyEngine: the ordinary loop, every mode, against clipped_grad_sum."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import workbench as wb
from tests.helpers import relative_error
from workbench.dpsgd import MODES, DPOptimizer, PrivacyEngine
from workbench.layers import DPLSTM

CE_MEAN = nn.CrossEntropyLoss()  # the user's ordinary, mean-reduced criterion
CE = nn.CrossEntropyLoss(reduction="none")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3)).double()


def batch(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,),
                                                                               generator=g)


def one_step(model, mode, x, y, C, B, sigma=0.0, generator=None):
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=sigma,
                      max_grad_norm=C, expected_batch_size=B, method=mode,
                      generator=generator)
    opt.zero_grad()
    CE_MEAN(model(x), y).backward()
    opt.step()
    opt.detach()
    return {name: p.grad.clone() for name, p in model.named_parameters()}, opt


@pytest.mark.parametrize("mode", MODES)
def test_noiseless_update_is_the_clipped_sum_over_expected_batch_size(mode):
    model = mlp()
    x, y = batch()
    C, B = 0.5, 10.0
    expected = wb.clipped_grad_sum(model, CE, x, y, C, method="microbatch")
    grads, _ = one_step(model, mode, x, y, C, B)
    for name, g in grads.items():
        assert relative_error(g, expected[name] / B) <= 1e-9, (mode, name)


def test_dp_lstm_in_the_ordinary_loop():
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = DPLSTM(3, 4, batch_first=True), nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.rnn(x)[0].mean(1))

    model = Model().double()
    x, y = torch.randn(5, 6, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    expected = wb.clipped_grad_sum(model, CE, x, y, 0.1, method="microbatch")
    for mode in ("einsum", "bookkeeping"):
        grads, _ = one_step(model, mode, x, y, 0.1, 5.0)
        for name, g in grads.items():
            assert relative_error(g, expected[name] / 5.0) <= 1e-9, (mode, name)


def test_noise_is_gaussian_with_std_sigma_c_over_b_on_zero_gradients():
    torch.manual_seed(0)
    model = nn.Linear(100, 100)
    x = torch.randn(4, 100)
    sigma, C, B = 1.3, 0.7, 16.0
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=sigma,
                      max_grad_norm=C, expected_batch_size=B,
                      generator=torch.Generator().manual_seed(1))
    opt.zero_grad()
    (0.0 * model(x)).mean().backward()  # every per-sample gradient is zero
    opt.step()
    noise = torch.cat([p.grad.flatten() for p in model.parameters()])  # 10,100 draws
    expected = sigma * C / B
    # the sample std of m normal draws has relative sd ~ 1/sqrt(2m) = 0.7%: allow 4 sd
    assert abs(noise.std().item() / expected - 1) < 4 / (2 * noise.numel()) ** 0.5
    assert abs(noise.mean().item()) < 4 * expected / noise.numel() ** 0.5


def test_noise_reproducible_from_generator_and_fresh_each_step():
    model = mlp()
    x, y = batch()
    g1, _ = one_step(model, "einsum", x, y, 1.0, 7.0, sigma=1.0,
                     generator=torch.Generator().manual_seed(5))
    g2, _ = one_step(model, "einsum", x, y, 1.0, 7.0, sigma=1.0,
                     generator=torch.Generator().manual_seed(5))
    assert all(torch.equal(g1[k], g2[k]) for k in g1)
    gen = torch.Generator().manual_seed(5)
    a, _ = one_step(model, "einsum", x, y, 1.0, 7.0, sigma=1.0, generator=gen)
    b, _ = one_step(model, "einsum", x, y, 1.0, 7.0, sigma=1.0, generator=gen)
    assert not torch.equal(a["0.weight"], b["0.weight"])


def digits_loader(batch_size=64, n=512):
    train, _ = wb.data.load_digits()
    x, y = train.tensors
    return DataLoader(TensorDataset(x[:n], y[:n]), batch_size=batch_size)


def test_engine_virtual_steps_equal_one_logical_batch_and_noise_once():
    torch.manual_seed(0)
    model = wb.models.digits_mlp()
    engine = PrivacyEngine()
    gen = torch.Generator().manual_seed(0)
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=digits_loader(), noise_multiplier=0.0, max_grad_norm=1.0,
        sampling_generator=gen, max_physical_batch_size=16)
    chunks = []
    for x, y in loader:
        opt.zero_grad()
        CE_MEAN(model(x), y).backward()
        opt.step()
        chunks.append((x, y))
        if not opt.expect_more:
            break
    logical = [torch.cat(t) for t in zip(*chunks)]  # the logical batch the chunks came from
    assert len(chunks) == -(-len(logical[1]) // 16) and len(engine.accountant) == 1
    assert all(len(y) <= 16 for _, y in chunks)
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    opt.detach()
    expected = wb.clipped_grad_sum(model, CE, logical[0], logical[1], 1.0, method="microbatch")
    for k, g in got.items():
        assert relative_error(g, expected[k] / 64.0) <= 1e-5  # float32


def test_empty_batch_still_steps_and_adds_noise():
    torch.manual_seed(0)
    model = nn.Linear(64, 10)
    flat = nn.Sequential(nn.Flatten(), model)
    engine = PrivacyEngine()
    data = digits_loader(batch_size=1, n=100)  # q = 0.01
    flat, opt, loader = engine.make_private(
        module=flat, optimizer=torch.optim.SGD(flat.parameters(), lr=0.0), data_loader=data,
        noise_multiplier=1.0, max_grad_norm=1.0,
        sampling_generator=torch.Generator().manual_seed(3))
    for x, y in loader:
        if len(y) == 0:
            opt.zero_grad()
            out = flat(x)
            assert out.shape == (0, 10)
            CE(out, y).sum().backward()  # a sum over no samples
            opt.step()
            assert model.weight.grad.abs().sum() > 0  # noise only
            break
    else:
        pytest.skip("no empty batch drawn")
    assert len(engine.accountant) >= 1


def test_make_private_with_epsilon_solves_sigma_and_accounts():
    torch.manual_seed(0)
    model = wb.models.digits_mlp()
    engine = PrivacyEngine()
    data = digits_loader()
    model, opt, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=data,
        target_epsilon=3.0, target_delta=1e-5, epochs=1, max_grad_norm=1.0)
    q = 64 / 512
    assert opt.noise_multiplier == pytest.approx(  # planned for the 8 steps the loader runs
        wb.accounting.get_noise_multiplier(3.0, 1e-5, q, steps=8))
    for x, y in loader:
        opt.zero_grad()
        CE_MEAN(model(x), y).backward()
        opt.step()
    assert len(engine.accountant) == len(loader) == 8
    # spends at most the target, with σ within 1% of the least that does (get_noise_multiplier)
    assert engine.get_epsilon(1e-5) <= 3.0 < wb.accounting.epsilon(
        q, opt.noise_multiplier / 1.01, 8, 1e-5)


def test_errors():
    bn = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with pytest.raises(wb.SampleMixingError, match="BatchNorm1d at 1.*wb.fix_model"):
        PrivacyEngine().make_private(module=bn, optimizer=torch.optim.SGD(bn.parameters(), 0.1),
                                     data_loader=digits_loader(), noise_multiplier=1.0,
                                     max_grad_norm=1.0)
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = dict(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=8)
    with pytest.raises(ValueError, match="method must be one of"):
        DPOptimizer(sgd, model, method="fast", **kw)
    with pytest.raises(ValueError, match="loss_reduction must be 'mean'"):
        DPOptimizer(sgd, model, loss_reduction="avg", **kw)
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number >= 0"):
        DPOptimizer(sgd, model, **{**kw, "noise_multiplier": -1})
    with pytest.raises(ValueError, match="accountant must be one of"):
        PrivacyEngine(accountant="gdp")


def test_detach_leaves_no_hooks():
    model = mlp()
    _, opt = one_step(model, "bookkeeping", *batch(), 1.0, 7.0)
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0


@pytest.mark.parametrize("mode", MODES)
def test_per_layer_clipping_clips_each_group_to_its_norm(mode):
    model = mlp()
    x, y = batch()
    groups = [{"params": list(model[0].parameters())},
              {"params": list(model[2].parameters()) + list(model[3].parameters())}]
    C = [0.3, 0.7]
    opt = DPOptimizer(torch.optim.SGD(groups, lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=4.0, method=mode)
    opt.zero_grad()
    CE_MEAN(model(x), y).backward()
    opt.step()
    opt.detach()
    # the slow twin: micro-batched per-sample gradients, each group's part clipped to its C
    grads = wb.per_sample_gradients(model, CE, x, y, method="microbatch")
    names = [["0.weight", "0.bias"], ["2.weight", "2.bias", "3.weight", "3.bias"]]
    for group_names, C_g in zip(names, C):
        norms = torch.stack([grads[k].flatten(1).pow(2).sum(1) for k in group_names]).sum(0).sqrt()
        c = (C_g / norms).clamp(max=1.0)
        for k in group_names:
            expected = torch.tensordot(c, grads[k], dims=1) / 4.0
            assert relative_error(model.get_parameter(k).grad, expected) <= 1e-9, (mode, k)
    assert opt.clip_norm_total == pytest.approx((0.3**2 + 0.7**2) ** 0.5)


def test_per_layer_clip_norms_must_match_the_groups():
    model = mlp()
    with pytest.raises(ValueError, match="max_grad_norm has 2 values for 1 parameter groups"):
        DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                    max_grad_norm=[1.0, 2.0], expected_batch_size=4.0)
