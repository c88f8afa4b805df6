"""``structure.model_tables``: the cached tables equal a fresh computation after every kind of
change to the model, and the cache keeps no model alive."""

import gc
import weakref

import torch
from torch import nn
from torch.nn.utils import parametrize

import workbench as wb
from workbench.per_sample.recording import tables
from workbench.per_sample.structure import model_tables


def same_as_fresh(model):
    got, want = model_tables(model, tables), tables(model)
    assert [(k, v) for k, v in got[0].items()] == [(k, v) for k, v in want[0].items()]
    assert list(got[1].items()) == list(want[1].items())
    assert got[2] == want[2] and got[3] == want[3]


class Double(nn.Module):
    def forward(self, w):
        return 2 * w


def test_cached_tables_follow_every_change_of_the_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    same_as_fresh(model)
    same_as_fresh(model)  # a hit
    model[2] = nn.Linear(4, 2)  # a layer replaced
    same_as_fresh(model)
    model[0].bias.requires_grad_(False)  # a parameter frozen
    same_as_fresh(model)
    model[0].bias.requires_grad_(True)
    model[0].weight = nn.Parameter(torch.randn(4, 3))  # a parameter replaced
    same_as_fresh(model)
    model.add_module("extra", nn.Linear(2, 2))  # a layer added
    same_as_fresh(model)
    model[0].weight, model[0].bias = model[0].bias, model[0].weight  # parameters swapped
    same_as_fresh(model)
    model[2].bias = model[0].weight  # a parameter shared
    same_as_fresh(model)
    parametrize.register_parametrization(model[2], "weight", Double())  # class swapped
    same_as_fresh(model)
    del model[2]  # a layer removed, then another in its place and size
    gc.collect()
    model.add_module("2", nn.Linear(4, 2))
    same_as_fresh(model)


def test_replaced_layer_of_the_same_class_after_a_free_is_not_taken_for_the_old_one():
    model = nn.Sequential(nn.Linear(3, 3))
    same_as_fresh(model)
    for _ in range(20):  # ids reused by CPython's allocator must never match
        del model[0]
        gc.collect()
        model.add_module("0", nn.Linear(3, 3))
        same_as_fresh(model)


def test_the_cache_keeps_no_model_alive():
    model = nn.LayerNorm(4)
    wb.per_sample_gradients(model, lambda o, t: (o * t).sum(1), torch.randn(3, 4),
                            torch.randn(3, 4), check=False)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_per_sample_gradients_after_a_freeze_between_calls():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    loss = nn.CrossEntropyLoss(reduction="none")
    assert set(wb.per_sample_gradients(model, loss, x, y)) == {
        "0.weight", "0.bias", "2.weight", "2.bias"}
    model[0].weight.requires_grad_(False)
    grads = wb.per_sample_gradients(model, loss, x, y)
    assert set(grads) == {"0.bias", "2.weight", "2.bias"}
    want = wb.per_sample_gradients(model, loss, x, y, method="microbatch")
    for k in want:
        torch.testing.assert_close(grads[k], want[k])
