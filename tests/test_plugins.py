"""A new layer is one file: dropped into a rule package, it is imported and registered, and
einsum, ghost and book-keeping use its samplers (float64, against micro-batching)."""

import importlib
import pathlib
import sys
import warnings

import pytest
import torch

import workbench as wb
from tests.helpers import (
    assert_agree,
    assert_clipping_agrees,
    import_rule_package,
    mse_per_sample,
    random_batch,
)
from workbench.clipping.registry import NORM_SAMPLERS
from workbench.per_sample import einsum as einsum_module
from workbench.per_sample.registry import GRAD_SAMPLERS

LAYER_FILE = '''
"""y = x * s + t, per feature: a layer the workbench has no rule for."""
import torch
from torch import nn

from workbench import register_grad_sampler, register_norm_sampler


class ScaleShift(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.t = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return x * self.s + self.t


CALLS = []


@register_grad_sampler(ScaleShift)
def grad_sampler(layer, activations, backprops):
    CALLS.append("grad")
    return {"s": activations[0] * backprops, "t": backprops}  # (n, d): d(x s + t)/ds = x


@register_norm_sampler(ScaleShift)
def norm_sampler(layer, activations, backprops):
    CALLS.append("norm")
    return (activations[0] * backprops).pow(2).sum(1) + backprops.pow(2).sum(1)
'''


@pytest.fixture
def plugin_package(tmp_path, monkeypatch):
    """A package ``toy_rules`` holding one rule file, imported as a rule package is; the
    registrations and modules are removed after the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    import_rule_package(tmp_path, "toy_rules", {
        "scale_shift": LAYER_FILE,
        "_helper": "raise ImportError('a _private module is not a rule')\n"})
    module = sys.modules["toy_rules.scale_shift"]
    yield module
    GRAD_SAMPLERS.pop(module.ScaleShift, None)
    NORM_SAMPLERS.pop(module.ScaleShift, None)
    for name in ("toy_rules", "toy_rules.scale_shift"):
        sys.modules.pop(name, None)


def test_a_dropped_in_file_registers_its_layer(plugin_package):
    layer = plugin_package.ScaleShift
    assert GRAD_SAMPLERS[layer] is plugin_package.grad_sampler
    assert NORM_SAMPLERS[layer] is plugin_package.norm_sampler
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), layer(4), torch.nn.Linear(4, 2)).double()
    x, y = random_batch((6, 3), (6, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no vmap warning: the rules are used
        einsum_module._WARNED.clear()
        assert_agree(model, mse_per_sample, x, y, methods=("einsum",), strict=True)
        assert_clipping_agrees(model, mse_per_sample, x, y)
    assert {"grad", "norm"} <= set(plugin_package.CALLS)
    assert wb.ghost_routes(model, mse_per_sample, x, y)["route"][1] == "norm sampler"


@pytest.mark.parametrize("package", ["workbench.rules", "workbench.accounting.accountants"])
def test_each_rule_package_imports_a_new_file(package, tmp_path, monkeypatch):
    """The package's own ``__init__``, run with one more folder on its path, imports the new
    file there: a new rule needs no import line anywhere."""
    pkg = importlib.import_module(package)
    (tmp_path / "zz_new_rule.py").write_text("LOADED = True\n")
    importlib.invalidate_caches()
    monkeypatch.setattr(pkg, "__path__", [*pkg.__path__, str(tmp_path)])
    try:
        code = compile(pathlib.Path(pkg.__file__).read_text(), pkg.__file__, "exec")
        exec(code, {"__name__": package, "__path__": pkg.__path__})
        assert sys.modules[f"{package}.zz_new_rule"].LOADED
    finally:
        sys.modules.pop(f"{package}.zz_new_rule", None)
    folder = pathlib.Path(pkg.__file__).parent  # and every file of its own is imported
    files = sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))
    assert files and all(f"{package}.{f}" in sys.modules for f in files)
