"""The privacy ledger travels with the weights (probe of 2026-12-01, ``attached.py``).

Weights trained privately carry that run's spending: a copy made private by a new engine each
epoch reported ε 4.54 for a true 6.70, weights saved with ``state_dict`` and loaded into a
model a new engine made private reported 5.75 for 7.52, with no warning. Now each warns with
the ε left out; a rollback in the same run, a proper resume and a plain model do not."""

import copy
import io
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import workbench as wb
from workbench.dpsgd import load_checkpoint, save_checkpoint

LEFT_OUT = r"earlier private run.*10 steps, epsilon = .*leaves them out"


def private(model=None, seed=0):
    torch.manual_seed(seed)
    train_set, _ = wb.data.load_digits()
    model = wb.models.digits_mlp() if model is None else model
    engine = wb.PrivacyEngine()
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt, loader = engine.make_private(
        module=model, optimizer=sgd, data_loader=DataLoader(train_set, batch_size=128),
        noise_multiplier=1.0, max_grad_norm=1.0,
        sampling_generator=torch.Generator().manual_seed(seed))
    return model, opt, loader, engine


def train(model, opt, loader, k):
    it = iter(loader)
    for _ in range(k):
        x, y = next(it)
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()


def quiet(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn()


def test_a_copy_of_a_privately_trained_model_made_private_again_warns():
    model, opt, loader, engine = private()
    train(model, opt, loader, 10)
    with pytest.warns(UserWarning, match=LEFT_OUT):
        private(copy.deepcopy(model), seed=1)
    quiet(lambda: private(seed=2))  # a fresh model: nothing carried


def test_a_state_dict_loaded_into_a_model_a_new_engine_made_private_warns():
    model, opt, loader, engine = private()
    train(model, opt, loader, 10)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # the histories are plain numbers
    model2, *_ = private(seed=1)
    with pytest.warns(UserWarning, match=LEFT_OUT):
        model2.load_state_dict(state)
    plain = wb.models.digits_mlp()
    quiet(lambda: plain.load_state_dict(state))  # a plain model: strict, no extra keys


def test_a_rollback_in_the_same_run_and_a_proper_resume_do_not_warn(tmp_path):
    model, opt, loader, engine = private()
    train(model, opt, loader, 3)
    best = copy.deepcopy(model.state_dict())
    save_checkpoint(tmp_path / "run.pt", model=model, optimizer=opt, engine=engine)
    train(model, opt, loader, 3)
    quiet(lambda: model.load_state_dict(best))  # the run's own earlier weights
    model2, opt2, loader2, engine2 = private(seed=1)
    quiet(lambda: load_checkpoint(tmp_path / "run.pt", model=model2, optimizer=opt2,
                                  engine=engine2))
    assert len(engine2.accountant) == 3


def test_weights_loaded_with_the_history_ignored_into_a_private_model_warn(tmp_path):
    model, opt, loader, engine = private()
    train(model, opt, loader, 10)
    save_checkpoint(tmp_path / "run.pt", model=model, optimizer=opt, engine=engine)
    model2, opt2, *_ = private(seed=1)
    with pytest.warns(UserWarning, match=LEFT_OUT):
        load_checkpoint(tmp_path / "run.pt", model=model2, optimizer=opt2,
                        ignore_privacy_history=True)


def test_a_whole_private_model_pickles_with_its_histories():
    model, opt, loader, engine = private()
    train(model, opt, loader, 10)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with pytest.warns(UserWarning, match=LEFT_OUT):
        private(loaded, seed=1)
