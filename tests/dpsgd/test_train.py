import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import workbench as wb


def test_train_returns_one_row_per_epoch_with_privacy_columns():
    torch.manual_seed(0)
    train_set, test_set = wb.data.load_digits()
    model = wb.models.digits_mlp()
    engine = wb.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(train_set, batch_size=128), noise_multiplier=1.0,
        max_grad_norm=2.0, noise_generator=torch.Generator().manual_seed(1),
        sampling_generator=torch.Generator().manual_seed(2))
    table = wb.train(model, opt, loader, epochs=3, engine=engine, eval_data=test_set,
                     progress=False)
    assert isinstance(table, pd.DataFrame) and list(table.index) == [1, 2, 3]
    assert {"loss", "accuracy", "epsilon", "fraction_clipped", "grad_snr"} <= set(table)
    assert table["epsilon"].is_monotonic_increasing
    assert table["epsilon"].iloc[-1] == pytest.approx(engine.get_epsilon(1e-5))
    assert table["accuracy"].iloc[-1] > 0.3  # far above chance (0.1) after 3 noisy epochs
    assert ((table["fraction_clipped"] >= 0) & (table["fraction_clipped"] <= 1)).all()
    assert (table["grad_snr"] > 0).all()


def test_train_without_dp_and_bad_epochs():
    train_set, _ = wb.data.load_digits()
    model = wb.models.digits_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    table = wb.train(model, opt, DataLoader(train_set, batch_size=256), epochs=1, progress=False)
    assert list(table.columns) == ["loss"]
    with pytest.raises(ValueError, match="epochs must be a positive integer; got 0"):
        wb.train(model, opt, DataLoader(train_set, batch_size=256), epochs=0)


def test_train_refuses_a_criterion_whose_reduction_is_not_the_optimizers():
    train_set, _ = wb.data.load_digits()
    model = wb.models.digits_mlp()
    _, opt, loader = wb.PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(train_set, batch_size=256), noise_multiplier=1.0,
        max_grad_norm=1.0, loss_reduction="sum")
    with pytest.raises(ValueError, match="criterion.reduction='mean' but loss_reduction='sum'"):
        wb.train(model, opt, loader, epochs=1, progress=False)  # the default criterion: mean
    wb.train(model, opt, loader, epochs=1, progress=False,
             criterion=nn.CrossEntropyLoss(reduction="sum"))
