"""Checkpoints record the privacy unit (``checkpoint_checks.privacy_unit``): a user-level
run resumed record-level, or with another ``user_reduction``, or the reverse, is refused
before anything changes; the same unit resumes."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import workbench as wb
from workbench.dpsgd.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

N, D, K = 12, 3, 2
UNITS = {"record": {}, "user sum": {"privacy_unit": "user", "user_ids": torch.arange(N) // 2},
         "user mean": {"privacy_unit": "user", "user_ids": torch.arange(N) // 2,
                       "user_reduction": "mean"}}


def run(unit):
    torch.manual_seed(0)
    model = nn.Linear(D, K).double()
    data = TensorDataset(torch.randn(N, D, dtype=torch.float64), torch.arange(N) % K)
    engine = wb.PrivacyEngine()
    model, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0,
        sampling_generator=torch.Generator().manual_seed(1),
        noise_generator=torch.Generator().manual_seed(2), **UNITS[unit])
    return engine, model, opt


@pytest.mark.parametrize("saved", sorted(UNITS))
@pytest.mark.parametrize("loaded", sorted(UNITS))
def test_the_privacy_unit_must_match(saved, loaded, tmp_path):
    engine, model, opt = run(saved)
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, engine=engine)
    engine, model, opt = run(loaded)
    with torch.no_grad():
        model.weight.fill_(3.0)
    if saved == loaded:
        load_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, engine=engine)
        assert not torch.all(model.weight == 3.0)
        return
    with pytest.raises(CheckpointError, match="privacy_unit"):
        load_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, engine=engine)
    assert torch.all(model.weight == 3.0)  # nothing changed


def test_a_path_that_cannot_be_written_is_refused_first(tmp_path):
    from workbench.outputs import OutputPathError

    engine, model, opt = run("record")
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path, tmp_path / "file" / "c.pt"):
        with pytest.raises(OutputPathError, match="save_checkpoint"):
            save_checkpoint(bad, model=model, optimizer=opt, engine=engine)
    save_checkpoint(tmp_path / "new" / "c.pt", model=model, optimizer=opt, engine=engine)
