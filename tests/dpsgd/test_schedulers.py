import pytest
import torch
from torch import nn

import workbench as wb
from workbench.dpsgd import DPOptimizer
from workbench.dpsgd.schedulers import ExponentialSchedule, LambdaSchedule, StepSchedule


def optimizer(sigma=2.0, C=1.0):
    model = nn.Linear(3, 2)
    return DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                       noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=4)


def test_schedules_follow_their_formulas():
    opt = optimizer()
    s = StepSchedule(opt, step_size=2, gamma=0.5)
    values = []
    for _ in range(5):
        s.step()
        values.append(opt.noise_multiplier)
    assert values == [2.0, 1.0, 1.0, 0.5, 0.5]
    opt = optimizer()
    e = ExponentialSchedule(opt, gamma=0.9, attribute="max_grad_norm")
    e.step()
    e.step()
    assert opt.max_grad_norm == pytest.approx(0.81)
    opt = optimizer()
    lam = LambdaSchedule(opt, lambda t: 1 / (1 + t))
    lam.step()
    assert opt.noise_multiplier == pytest.approx(1.0)


def test_state_dict_round_trip_and_errors():
    opt = optimizer()
    s = ExponentialSchedule(opt, gamma=0.5)
    s.step()
    state = s.state_dict()
    opt2 = optimizer()
    s2 = ExponentialSchedule(opt2, gamma=0.5)
    s2.load_state_dict(state)
    assert opt2.noise_multiplier == opt.noise_multiplier == 1.0
    with pytest.raises(ValueError, match="max_grad_norm = 0.0 at step 1"):
        LambdaSchedule(optimizer(), lambda t: 0.0, attribute="max_grad_norm").step()
    with pytest.raises(ValueError, match="step_size must be a positive integer"):
        StepSchedule(optimizer(), step_size=0, gamma=0.5)


def test_accountant_records_the_scheduled_sigmas():
    torch.manual_seed(0)
    from torch.utils.data import DataLoader
    train_set, _ = wb.data.load_digits()
    model = wb.models.digits_mlp()
    engine = wb.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(train_set, batch_size=256), noise_multiplier=2.0,
        max_grad_norm=1.0)
    schedule = StepSchedule(opt, step_size=1, gamma=0.5)
    for _ in range(2):  # two epochs, σ = 2 then 1
        for x, y in loader:
            opt.zero_grad()
            nn.CrossEntropyLoss()(model(x), y).backward()
            opt.step()
        schedule.step()
    sigmas = [round(h[0], 6) for h in engine.accountant.history]
    assert sigmas == [2.0, 1.0]  # consecutive equal steps merged per σ
