import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import workbench as wb
from workbench.dpsgd import load_checkpoint, save_checkpoint
from workbench.dpsgd.checkpoint import CheckpointError


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


def test_history_without_engine_is_refused_unless_explicitly_ignored(tmp_path):
    model, opt, loader, engine, scheduler, noise, sampling = setup()
    steps(model, opt, loader, scheduler, 2)
    save_checkpoint(tmp_path / "run.pt", model=model, optimizer=opt, engine=engine)
    model2, opt2, *_ = setup()
    before = model2[1].weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"run.pt holds the privacy history of 2 DP steps"
                                              r".*engine=.*ignore_privacy_history=True"):
        load_checkpoint(tmp_path / "run.pt", model=model2, optimizer=opt2)
    assert torch.equal(model2[1].weight, before)  # nothing restored before the error
    load_checkpoint(tmp_path / "run.pt", model=model2, optimizer=opt2,
                    ignore_privacy_history=True)
    assert torch.equal(model2[1].weight, model[1].weight)


def test_no_history_needs_no_engine(tmp_path):
    model, opt, *_ = setup()  # no step taken: the accountant's history is empty
    save_checkpoint(tmp_path / "fresh.pt", model=model, optimizer=opt)
    model2, opt2, *_ = setup()
    with torch.no_grad():  # weights that differ from the saved ones
        for p in model2.parameters():
            p.add_(1.0)
    load_checkpoint(tmp_path / "fresh.pt", model=model2, optimizer=opt2)  # no engine= needed
    for (name, saved), loaded in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(saved, loaded), name


def test_corrupted_truncated_and_foreign_files_fail_with_their_name(tmp_path):
    model, opt, loader, engine, scheduler, *_ = setup()
    path = tmp_path / "run.pt"
    save_checkpoint(path, model=model, optimizer=opt, engine=engine)
    data = path.read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    (tmp_path / "flipped.pt").write_bytes(bytes(flipped))
    (tmp_path / "short.pt").write_bytes(data[:-100])
    torch.save({"model": model.state_dict()}, tmp_path / "plain.pt")
    for name, match in (("flipped.pt", "is corrupted or truncated: the SHA-256"),
                        ("short.pt", "is corrupted or truncated"),
                        ("plain.pt", "is not a workbench checkpoint")):
        with pytest.raises(CheckpointError, match=f"{name} {match}"):
            load_checkpoint(tmp_path / name, model=model, optimizer=opt, engine=engine)
    assert not list(tmp_path.glob("*.partial"))  # the atomic write left nothing behind


def test_secure_mode_generators_save_and_load_and_refuse_the_other_mode(tmp_path):
    model = wb.models.digits_mlp()
    train_set, _ = wb.data.load_digits()
    model, opt, loader = wb.PrivacyEngine(secure_mode=True).make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(train_set, batch_size=128), noise_multiplier=1.0,
        max_grad_norm=1.0)
    secure = opt.generator
    save_checkpoint(tmp_path / "s.pt", model=model, optimizer=opt, noise_generator=secure,
                    sampling_generator=secure)
    load_checkpoint(tmp_path / "s.pt", model=model, optimizer=opt, noise_generator=secure,
                    sampling_generator=secure)
    with pytest.raises(CheckpointError, match="holds a secure-mode noise_generator, but "
                                              "noise_generator is a Generator"):
        load_checkpoint(tmp_path / "s.pt", model=model, optimizer=opt,
                        noise_generator=torch.Generator())
    save_checkpoint(tmp_path / "g.pt", model=model, optimizer=opt,
                    noise_generator=torch.Generator().manual_seed(0))
    with pytest.raises(CheckpointError, match="holds a seeded noise_generator, but "
                                              "noise_generator is a SecureGenerator"):
        load_checkpoint(tmp_path / "g.pt", model=model, optimizer=opt, noise_generator=secure)
    with pytest.raises(TypeError, match="noise_generator must be a torch.Generator .*got int"):
        save_checkpoint(tmp_path / "x.pt", model=model, optimizer=opt, noise_generator=7)
