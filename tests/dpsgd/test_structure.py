"""recorded.structure (the model's layout checked every step) == the modules()/parameters()
walk it replaces: same ids, same order, same de-duplication, on the zoo and on the odd cases
(a shared module, a tied or repeated parameter, a frozen one, a None child, a class that
overrides the walk)."""

import pytest
import torch
from torch import nn

from workbench.dpsgd.recorded import structure
from workbench.lm.gpt import TinyGPT
from workbench.models import make_model


def walk(model):
    return [id(m) for m in model.modules()], [
        (id(p), p.shape) for p in model.parameters() if p.requires_grad]  # a resize shows


def shared():
    inner = nn.Linear(3, 3)
    model = nn.Sequential(inner, nn.Sequential(nn.ReLU(), inner), nn.Linear(3, 2))
    model[2].weight = inner.weight  # a tied parameter, met again in another module
    model[2].bias.requires_grad_(False)
    model.register_module("nothing", None)
    model.register_parameter("again", inner.bias)
    model.extra = nn.ModuleList([nn.Sequential(nn.Linear(2, 2)), inner])
    return model


class HidesChild(nn.Module):  # a walk of its own: structure must follow it
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        yield prefix, self


class OwnParameters(nn.Sequential):
    def parameters(self, recurse=True):
        return iter([self[0].weight])


MODELS = {"shared": shared,
          "child walk": lambda: nn.Sequential(nn.Linear(2, 2), HidesChild()),
          "root parameters": lambda: OwnParameters(nn.Linear(2, 2), nn.Linear(2, 3)),
          "tiny_gpt": lambda: TinyGPT(vocab_size=11, block_size=4, n_layer=2, n_head=2,
                                      n_embd=8),
          **{name: (lambda name=name: make_model(name))
             for name in ("mnist_cnn", "imdb_embedding", "imdb_lstm")}}


@pytest.mark.parametrize("name", list(MODELS))
def test_structure_is_the_modules_and_parameters_walk(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    assert structure(model) == walk(model)
    next(model.parameters()).requires_grad_(False)
    assert structure(model) == walk(model)  # a frozen parameter leaves it
