"""BatchNorm with frozen statistics (eval mode, running statistics present):
(x - μ) / σ · γ + β per channel, each record alone, so exact per-sample gradients exist and
nothing is written from the batch. Refused by type in any mode until 2026-11-30 (freezing a
pre-trained model's batch statistics is the usual way to fine-tune it privately); in training
mode, or without running statistics, still refused, and checked at every pass: a
``model.train()`` in the loop is refused before its running statistics are written."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from workbench.dpsgd.optimizer import DPOptimizer
from workbench.errors import SampleMixingError
from workbench.realzoo import PROBLEMS

TOL = 1e-10
N = 5


def frozen(norm: str) -> nn.Module:
    torch.manual_seed(0)
    if norm == "batchnorm1d":
        model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3))
    elif norm == "instancenorm2d":
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, affine=True,
                                                                    track_running_stats=True),
                              nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    else:
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                              nn.Linear(4 * 6 * 6, 3))
    model = model.double()
    norm_layer = model[1]
    with torch.no_grad():  # statistics as if pre-trained elsewhere, and a non-trivial affine
        norm_layer.running_mean.normal_()
        norm_layer.running_var.uniform_(0.5, 2.0)
        norm_layer.weight.uniform_(0.5, 1.5)
        norm_layer.bias.normal_()
    return model.eval()


def batch(norm: str, n: int = N):
    g = torch.Generator().manual_seed(1)
    shape = (n, 6) if norm == "batchnorm1d" else (n, 3, 8, 8)
    return torch.randn(*shape, generator=g, dtype=torch.float64), \
        torch.randint(0, 3, (n,), generator=g)


def loss_none(o, y):
    return F.cross_entropy(o, y, reduction="none")


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


NORMS = ["batchnorm1d", "batchnorm2d"]


@pytest.mark.parametrize("norm", NORMS)
def test_frozen_statistics_give_exact_per_sample_gradients_by_every_method(norm):
    model = frozen(norm)
    x, y = batch(norm)
    ref = wb.per_sample_gradients(model, loss_none, x, y, method="microbatch")
    for method in ("vmap", "einsum"):
        got = quiet(wb.per_sample_gradients, model, loss_none, x, y, method=method)
        for k in ref:
            assert rel(got[k], ref[k]) <= TOL, (norm, method, k)
    want = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    got = quiet(wb.per_sample_grad_norms, model, loss_none, x, y, method="ghost")
    assert rel(got, want) <= TOL, norm


@pytest.mark.parametrize("mode", ["auto", "bookkeeping", "ghost", "einsum", "vmap"])
@pytest.mark.parametrize("norm", NORMS)
def test_the_optimizer_is_exact_over_steps_with_frozen_statistics(norm, mode):
    model = frozen(norm)
    stats = model[1].running_mean.clone()
    opt = quiet(DPOptimizer, torch.optim.SGD(model.parameters(), lr=0.0), model,
                noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=4.0,
                method=mode, loss_reduction="sum")
    try:
        for n in (N, 3):
            x, y = batch(norm, n)
            C = 0.3
            opt.max_grad_norm = C
            want = wb.clipped_grad_sum(model, loss_none, x, y, C, method="microbatch")
            opt.zero_grad()
            F.cross_entropy(model(x), y, reduction="sum").backward()
            quiet(opt.step)
            for k, p in model.named_parameters():
                assert rel(p.grad * 4.0, want[k]) <= TOL, (norm, mode, n, k)
    finally:
        opt.detach()
    assert torch.equal(model[1].running_mean, stats)  # nothing written


@pytest.mark.parametrize("grad", [True, False], ids=["training pass", "pass without grad"])
def test_a_norm_put_back_in_training_mode_is_refused_before_its_statistics_move(grad):
    model = frozen("batchnorm2d")
    x, y = batch("batchnorm2d")
    opt = quiet(DPOptimizer, torch.optim.SGD(model.parameters(), lr=0.1), model,
                noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=4.0,
                loss_reduction="sum")
    opt.zero_grad()
    F.cross_entropy(model(x), y, reduction="sum").backward()
    quiet(opt.step)
    stats = model[1].running_mean.clone()
    model.train()  # the loop's usual model.train() at an epoch's start
    opt.zero_grad()
    with pytest.raises(SampleMixingError, match="BatchNorm2d at 1.*training mode"), \
            torch.set_grad_enabled(grad):
        model(x)
    assert torch.equal(model[1].running_mean, stats)
    model.eval()  # and the loop goes on, its passes counted as before
    opt.zero_grad()
    F.cross_entropy(model(x), y, reduction="sum").backward()
    quiet(opt.step)
    assert opt.recorder._depth == 0
    opt.detach()


def test_an_instance_norm_tracking_statistics_stays_refused_in_eval_mode():
    """Its rule normalises by each record's own statistics; in eval mode it reads running
    ones: refused by type in every mode (the self-check saw 4% off)."""
    model = frozen("instancenorm2d")
    x, y = batch("instancenorm2d")
    with pytest.raises(SampleMixingError, match="InstanceNorm2d at 1.*track_running_stats"):
        wb.per_sample_gradients(model, loss_none, x, y, method="einsum")


@pytest.mark.parametrize("case", ["training mode", "no running statistics"])
def test_batch_statistics_are_still_refused_everywhere(case):
    model = frozen("batchnorm2d")
    if case == "training mode":
        model.train()
    else:
        model[1].track_running_stats = False
        model[1].running_mean = model[1].running_var = None
    x, y = batch("batchnorm2d")
    for fn in (wb.per_sample_gradients, wb.per_sample_grad_norms):
        with pytest.raises(SampleMixingError, match="BatchNorm2d"):
            fn(model, loss_none, x, y)
    with pytest.raises(SampleMixingError, match="BatchNorm2d"):
        DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                    max_grad_norm=1.0, expected_batch_size=4.0)
    assert wb.validate_model(model)


def test_a_timm_resnet_with_frozen_batchnorm_is_exact_in_the_default_mode():
    """The real-architecture table's BatchNorm ResNet (built in eval mode, as fine-tuned):
    its statistics frozen, every parameter's clipped sum exact; in training mode refused."""
    problem = PROBLEMS["timm_resnet_bn"]
    model = quiet(problem.build)
    with pytest.raises(SampleMixingError, match="BatchNorm2d"):
        DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), quiet(problem.build).train(),
                    noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=4.0)
    x, y = problem.batch(3)
    C = 1.0
    want = wb.clipped_grad_sum(model, problem.loss_fn, x, y, C, method="microbatch")
    opt = quiet(DPOptimizer, torch.optim.SGD(model.parameters(), lr=0.0), model,
                noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=4.0,
                loss_reduction="sum")
    try:
        opt.zero_grad()
        problem.loss_fn(model(x), y).sum().backward()
        quiet(opt.step)
        for k, p in model.named_parameters():
            assert rel(p.grad * 4.0, want[k]) <= 1e-9, k
    finally:
        opt.detach()


def test_a_submodule_called_in_training_mode_is_refused_before_its_statistics_move():
    """The check ran at the root's pass only: ``model.backbone(x)`` without gradient, in
    training mode, wrote the running statistics from private data, silently (a review)."""
    model = nn.Sequential(frozen("batchnorm2d")[:3], nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    model.eval()
    x, _ = batch("batchnorm2d")
    opt = quiet(DPOptimizer, torch.optim.SGD(model.parameters(), lr=0.1), model,
                noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=4.0)
    before = model[0][1].running_mean.clone()
    model.train()
    with pytest.raises(SampleMixingError, match="BatchNorm2d at 0.1"), torch.no_grad():
        model[0](x)
    assert torch.equal(model[0][1].running_mean, before)
    opt.detach()


def _freeze_bn(model):
    model.train()
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()  # the usual "freeze BN" helper
    return model


def test_the_library_loops_keep_each_modules_mode():
    """Their evaluation restored model.train() on the root, putting a frozen BatchNorm back
    in training mode: wb.dpsgd.train(..., eval_data=...) refused its second epoch, and the
    record-influence audit (python -m workbench audit --model) failed the model."""
    from torch.utils.data import DataLoader, TensorDataset

    from workbench.audit import audit_record_influence, engine_released_sum
    from workbench.dpsgd.train import train

    model = _freeze_bn(frozen("batchnorm2d").float())
    x, y = batch("batchnorm2d", 32)
    x = x.float()
    engine = wb.PrivacyEngine()
    model, opt, loader = quiet(engine.make_private, module=model,
                               optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                               data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
                               noise_multiplier=1.0, max_grad_norm=1.0)
    history = quiet(train, model, opt, loader, epochs=2, engine=engine, eval_data=(x[:8], y[:8]),
                    progress=False)
    assert len(history) == 2 and model.training and not model[1].training  # modes kept
    opt.detach()
    released = engine_released_sum(_freeze_bn(frozen("batchnorm2d")), loss_none,
                                   *batch("batchnorm2d", 9), 1.0)
    assert quiet(audit_record_influence, released, 8, max_grad_norm=1.0, name="frozen").passed
