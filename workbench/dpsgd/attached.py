"""One recorder per model: a second ``make_private`` on a model detaches the first one's hooks.

A notebook cell that calls ``make_private`` is often run twice on the same model object. Each
call hooks every layer to record its calls; without this, the second call would add a second
set of hooks, every forward pass would be recorded twice (memory grows, and the first
optimizer keeps a ledger nobody reads). So the engine notes, on each layer that owns
parameters, which ``DPOptimizer`` records it; the next ``make_private`` on any of those layers
detaches that optimizer first (``DPOptimizer.detach``), wholly: its hooks are removed from
every layer of its model, and its later ``step()`` or ``zero_grad()`` raises (``loop.py``)
instead of silently doing nothing. A re-run on the same model object is silent; a call on a
part of, a wrapper of, or a model sharing layers with the earlier one is warned (the earlier
optimizer no longer records any of its model).

If the earlier optimizer has already taken steps under a *different* engine, the model has
already spent privacy that the new engine's ledger will not contain: that is warned, with the
ε it leaves out. (The same engine keeps one ledger across both calls.)
"""

import warnings

from torch import nn

ATTRIBUTE = "_workbench_dp_optimizer"  # on each layer: (DPOptimizer, PrivacyEngine, model)


class Attached(tuple):
    """(DPOptimizer, PrivacyEngine, model), as noted on a layer; a copy of the layer
    (``copy.deepcopy``: an EMA teacher, ``AveragedModel``) or a pickle of it is attached to
    nothing, as every hook the workbench puts on it is inert there (``hooks.OwnHook``): the
    copy is a plain model. (Copied, the optimizer failed with a bare ``KeyError:
    '_defaults'`` until 2026-11-29.)"""

    def __deepcopy__(self, memo):
        return NOTHING

    def __reduce__(self):
        return tuple, (tuple(NOTHING),)


NOTHING = (None, None, None)


def owning_layers(model: nn.Module) -> list[nn.Module]:
    """The submodules that own parameters directly: the ones the recorder hooks."""
    return [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]


def detach_earlier(model: nn.Module, engine, keep=None) -> None:
    """Detach every earlier DPOptimizer recording a layer of ``model`` (but ``keep``)."""
    earlier = {}
    for layer in owning_layers(model):
        optimizer, owner, its_model = layer.__dict__.get(ATTRIBUTE, NOTHING)
        if optimizer is not None and optimizer is not keep:
            earlier[id(optimizer)] = (optimizer, owner, its_model)
    for optimizer, owner, its_model in earlier.values():
        optimizer.detach(f"make_private was called again on {_which(model, its_model)}")
        for layer in owning_layers(its_model):
            if layer.__dict__.get(ATTRIBUTE, (None,))[0] is optimizer:
                del layer.__dict__[ATTRIBUTE]
        steps = len(owner.accountant)
        if its_model is not model:  # a part or a wrapper: the first run's model loses hooks
            warnings.warn(
                f"make_private on {_which(model, its_model)}: the earlier DPOptimizer recorded "
                f"all of its model, and is now detached from every layer (its step() raises); "
                f"train with the optimizer this call returns, or call make_private once on "
                f"the whole model you train", stacklevel=3)
        if owner is not engine and steps:
            delta = 1 / (10 * owner.dataset_size) if owner.dataset_size else 1e-5
            warnings.warn(
                f"make_private was already called on this model, and that run took {steps} "
                f"private steps (epsilon = {owner.get_epsilon(delta):.3g} at delta = "
                f"{delta:.2g}); its hooks are now removed. The new engine counts from zero, so "
                f"its epsilon leaves those steps out: to continue that run, call make_private "
                f"on the first engine; to start afresh, build a new model", stacklevel=3)


def _which(model, its_model) -> str:
    if its_model is model:
        return "the same model"
    inner = {id(m) for m in its_model.modules()}
    if id(model) in inner:
        return "a part of the model an earlier make_private made private"
    if id(its_model) in {id(m) for m in model.modules()}:
        return "a model containing one an earlier make_private made private"
    return "a model sharing layers with one an earlier make_private made private"


def remember(model: nn.Module, optimizer, engine) -> None:
    """Note on each of ``model``'s layers that ``optimizer`` (of ``engine``) records it."""
    for layer in owning_layers(model):
        layer.__dict__[ATTRIBUTE] = Attached((optimizer, engine, model))


__all__ = ["ATTRIBUTE", "Attached", "NOTHING", "detach_earlier", "owning_layers", "remember"]
