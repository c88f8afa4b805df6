import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import workbench as wb
from workbench.dpsgd import load_checkpoint, save_checkpoint


def setup():
    torch.manual_seed(0)
    train_set, _ = wb.data.load_digits()
    model = wb.models.digits_mlp()
    engine = wb.PrivacyEngine()
    noise, sampling = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, opt, loader = engine.make_private(
        module=model, optimizer=sgd, data_loader=DataLoader(train_set, batch_size=128),
        noise_multiplier=1.0, max_grad_norm=1.0, noise_generator=noise,
        sampling_generator=sampling)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, loader, engine, scheduler, noise, sampling


def steps(model, opt, loader, scheduler, k):
    it = iter(loader)
    for _ in range(k):
        x, y = next(it)
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        scheduler.step()


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    model, opt, loader, engine, scheduler, noise, sampling = setup()
    steps(model, opt, loader, scheduler, 4)
    kw = dict(engine=engine, scheduler=scheduler, noise_generator=noise,
              sampling_generator=sampling)
    save_checkpoint(tmp_path / "run.pt", model=model, optimizer=opt, **kw)
    steps(model, opt, loader, scheduler, 3)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    eps = engine.get_epsilon(1e-5)

    model2, opt2, loader2, engine2, scheduler2, noise2, sampling2 = setup()
    load_checkpoint(tmp_path / "run.pt", model=model2, optimizer=opt2, engine=engine2,
                    scheduler=scheduler2, noise_generator=noise2, sampling_generator=sampling2)
    assert len(engine2.accountant) == 4 and scheduler2.last_epoch == 4
    steps(model2, opt2, loader2, scheduler2, 3)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert engine2.get_epsilon(1e-5) == pytest.approx(eps)


def test_missing_state_is_a_clear_error(tmp_path):
    model, opt, loader, engine, scheduler, noise, sampling = setup()
    save_checkpoint(tmp_path / "m.pt", model=model, optimizer=opt)
    with pytest.raises(ValueError, match="has no accountant state"):
        load_checkpoint(tmp_path / "m.pt", model=model, optimizer=opt, engine=engine)
