import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import workbench as wb


def private(secure_mode=True, **kw):
    torch.manual_seed(0)
    train_set, _ = wb.data.load_digits()
    model = wb.models.digits_mlp()
    engine = wb.PrivacyEngine(secure_mode=secure_mode)
    return engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                               data_loader=DataLoader(train_set, batch_size=128),
                               noise_multiplier=1.0, max_grad_norm=1.0, **kw)


def one_step(model, opt, loader):
    x, y = next(iter(loader))
    opt.zero_grad()
    nn.CrossEntropyLoss()(model(x), y).backward()
    opt.step()
    return y, model[1].weight.grad.clone()


def test_secure_mode_refuses_user_seeds():
    with pytest.raises(ValueError, match="secure_mode=True .* do not pass noise_generator"):
        private(noise_generator=torch.Generator().manual_seed(0))


def test_secure_mode_noise_and_batches_differ_between_identical_runs():
    y1, g1 = one_step(*private())
    y2, g2 = one_step(*private())
    assert not torch.equal(g1, g2)
    assert len(y1) != len(y2) or not torch.equal(y1, y2)
