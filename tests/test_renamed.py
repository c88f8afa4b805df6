"""Renamed names keep working for one release, each with a FutureWarning naming the new one;
passing a new keyword and its old name together is a TypeError (``workbench/deprecation.py``)."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from workbench import methods
from workbench.audit.dpsgd_step import workbench_step
from workbench.dpsgd import MODES, DPOptimizer, PrivacyEngine

RENAMED = "will be removed in the next release"


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def data(n=12):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,),
                                                                               generator=g)


def private(**kw):
    x, y = data()
    model = mlp()
    return PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=4), noise_multiplier=1.0,
        max_grad_norm=1.0, **kw)


def update(method):
    """One optimizer step (σ = 0) in ``method``: the parameters' .grad, flattened."""
    x, y = data()
    model = mlp()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=0.5, expected_batch_size=4.0, method=method)
    opt.zero_grad()
    nn.CrossEntropyLoss()(model(x), y).backward()
    opt.step()
    opt.detach()
    return torch.cat([p.grad.flatten() for p in model.parameters()]), opt


def test_make_private_grad_sample_mode_is_the_old_name_of_method():
    with pytest.warns(FutureWarning, match="grad_sample_mode= is renamed method="):
        _, opt, _ = private(grad_sample_mode="einsum")
    assert opt.method == "einsum"
    _, opt, _ = private(method="vmap")
    assert opt.method == "vmap"
    _, opt, _ = private()
    assert opt.method == "auto" and type(opt.method) is str


@pytest.mark.parametrize("call", [
    lambda: private(method="einsum", grad_sample_mode="einsum"),
    lambda: private(method="auto", grad_sample_mode="einsum"),  # "auto" given, not defaulted
    lambda: DPOptimizer(
        torch.optim.SGD(mlp().parameters(), lr=0.1), mlp(), noise_multiplier=1.0,
        max_grad_norm=1.0, expected_batch_size=4.0, method="einsum", grad_sample_mode="vmap"),
    lambda: workbench_step(1.0, 1.0, 4.0, method="einsum", grad_sample_mode="einsum"),
])
def test_both_names_together_are_refused(call):
    with pytest.raises(TypeError, match="pass only method="):
        call()


def test_an_unknown_keyword_is_still_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'grad_sample_method'"):
        private(grad_sample_method="einsum")


def test_optimizer_attribute_and_audit_step_keep_the_old_name():
    _, opt = update("einsum")
    with pytest.warns(FutureWarning, match="grad_sample_mode is renamed method"):
        assert opt.grad_sample_mode == "einsum"
    with pytest.warns(FutureWarning, match="grad_sample_mode is renamed method"):
        opt.grad_sample_mode = "vmap"
    assert opt.method == "vmap"
    with pytest.warns(FutureWarning, match="grad_sample_mode= is renamed method="):
        workbench_step(1.0, 1.0, 4.0, grad_sample_mode="einsum")


def test_the_optimizers_ghost_is_bookkeeping_by_its_canonical_name():
    """One code path, one name: "ghost" in the optimizer warns and runs book-keeping, with a
    bitwise-equal update."""
    assert "ghost" not in MODES and methods.OPTIMIZER_ALIASES == {"ghost": "bookkeeping"}
    want, _ = update("bookkeeping")
    with pytest.warns(FutureWarning, match="method='ghost' is renamed method='bookkeeping'"):
        got, opt = update("ghost")
    assert opt.method == "bookkeeping" and opt.last["mode"] == "bookkeeping"
    assert torch.equal(got, want)


def test_every_method_tuple_comes_from_the_one_table():
    import workbench as wb
    from workbench.audit import cli_suite
    from workbench.bench import memory
    from workbench.clipping import engine

    names = [m.name for m in methods.TABLE]
    assert wb.METHODS == methods.PER_SAMPLE_METHODS == methods.MATERIALISING
    assert wb.clipping.CLIP_METHODS == engine.MODES == tuple(names)
    assert wb.clipping.NORM_METHODS == methods.NORM_METHODS
    assert set(cli_suite.METHODS) | set(memory.DP_MODES) <= set(names)
    assert all(methods.describe(n) for n in names)
    with pytest.raises(KeyError, match="no per-sample method 'fast'"):
        methods.describe("fast")


def test_accountant_mechanism_is_its_name_and_get_privacy_spent_its_epsilon_and_order():
    from workbench.accounting import Accountant, RDPAccountant

    acc = RDPAccountant()
    acc.step(noise_multiplier=1.0, sample_rate=0.01, steps=20)
    assert acc.name == "rdp" and acc.state_dict()["name"] == "rdp"
    with pytest.warns(FutureWarning, match="Accountant.mechanism is renamed Accountant.name"):
        assert acc.mechanism == "rdp"
    with pytest.warns(FutureWarning, match="get_privacy_spent is renamed get_epsilon_and_order"):
        assert acc.get_privacy_spent(1e-5) == acc.get_epsilon_and_order(1e-5)
    assert acc.get_epsilon_and_order(1e-5)[0] == acc.get_epsilon(1e-5)
    old = {("mechanism" if k == "name" else k): v for k, v in acc.state_dict().items()}
    again = RDPAccountant()
    again.load_state_dict(old)  # a checkpoint of the previous release
    assert again.history == acc.history
    with pytest.warns(FutureWarning, match="Old.mechanism is renamed name"):
        class Old(Accountant):
            mechanism = "rdp"
    assert Old.name == "rdp" and Old().get_epsilon(1e-5) == 0.0


@pytest.mark.parametrize("old, new", [("models_gpt", "gpt"), ("corpus", "corpus"),
                                      ("lm_training", "training"),
                                      ("memorisation", "memorisation")])
def test_the_language_model_files_moved_into_lm_and_the_old_paths_still_import(old, new):
    import importlib
    import sys

    sys.modules.pop(f"workbench.{old}", None)  # run the shim again, whatever ran before
    with pytest.warns(FutureWarning, match=f"workbench.{old} is renamed workbench.lm.{new}"):
        moved = importlib.import_module(f"workbench.{old}")
    assert moved is importlib.import_module(f"workbench.lm.{new}")
