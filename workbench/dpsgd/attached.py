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

**The ledger travels with the weights** (probe of 2026-12-01: a copy made private by a new
engine each epoch reported ε 4.54 for a true 6.70; weights saved with ``state_dict`` and
loaded into a model a new engine made private, 5.75 for 7.52; neither warned). Each layer
that owns parameters also carries ``Spent``: the ledgers (accountants) of every private run
its weights came from. ``copy.deepcopy`` keeps it (the copy's weights carry the same
spending), the private model's ``state_dict`` writes those runs' histories into the state
dict's metadata (``_metadata[""]``, plain numbers: ``torch.load(weights_only=True)`` reads
them), and loading such a state dict into a model made private marks it so. A
``make_private``, or a load into a private model, whose engine's ledger does not hold one of
those runs warns with the ε left out (``load_checkpoint(..., engine=)`` restores the ledger
before the weights: no warning; a state dict saved earlier in the same run, a rollback,
spends nothing new: ``_within``). Not covered: a state dict loaded into a plain model *before*
``make_private`` (no hook sees it), weights moved by hand (``p.copy_``).
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
SPENT = "_workbench_dp_spent"  # on each layer: Spent, the ledgers its weights carry
METADATA = "workbench_privacy_histories"  # in a state dict's _metadata[""]


class Ledger:
    """A run's spending as a state dict carried it: its history [(σ, q, T), ...], the
    accountant's name, and its data set's size (for δ)."""

    def __init__(self, history, name: str, dataset_size):
        self.history, self.name, self.dataset_size = [tuple(g) for g in history], name, \
            dataset_size

    def __len__(self):
        return int(sum(t for *_, t in self.history))

    def get_epsilon(self, delta: float) -> float:
        from workbench.accounting.curve import history_epsilon
        return history_epsilon(self.history, delta, self.name)


class Spent(tuple):
    """The ledgers (live accountants, or ``Ledger``\\ s read from a state dict) of every private
    run a layer's weights came from; a copy of the layer carries the same ones."""

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):  # a pickled model (torch.save(model)) keeps the histories alone
        return Spent, (tuple(g if isinstance(g, Ledger) else
                             Ledger(g.history, g.name, _size(g)) for g in self),)


def _size(ledger):
    return getattr(ledger, "dataset_size", None)


def spent_elsewhere(model: nn.Module, accountant) -> list:
    """The ledgers ``model``'s weights carry that are not ``accountant`` and hold steps."""
    out = {}
    for layer in owning_layers(model):
        for ledger in layer.__dict__.get(SPENT, ()):
            if ledger is not accountant and len(ledger):
                out[id(ledger)] = ledger
    return list(out.values())


def carry(model: nn.Module, ledgers) -> None:
    """Add ``ledgers`` to what each layer of ``model`` carries."""
    for layer in owning_layers(model):
        have = layer.__dict__.get(SPENT, ())
        layer.__dict__[SPENT] = Spent((*have, *(g for g in ledgers
                                                 if all(g is not h for h in have))))


def warn_spent(ledgers, how: str, stacklevel: int = 3) -> None:
    """Warn that the ledgers' steps are outside this engine's ε (``how``: what happened)."""
    if not ledgers:
        return
    steps = sum(len(g) for g in ledgers)
    parts = []
    for g in ledgers[:3]:
        size = _size(g)
        delta = 1 / (10 * size) if size else 1e-5
        try:
            parts.append(f"{len(g)} steps, epsilon = {g.get_epsilon(delta):.3g} at delta = "
                         f"{delta:.2g}")
        except Exception:  # noqa: BLE001 - a ledger that cannot answer is still named
            parts.append(f"{len(g)} steps")
    warnings.warn(
        f"{how}: these weights come from {len(ledgers)} earlier private run(s) this engine's "
        f"ledger does not hold ({'; '.join(parts)}; {steps} steps in all). The engine counts "
        f"from zero, so its epsilon leaves them out, though the records they trained on are "
        f"the same: to continue a run, restore its ledger (wb.dpsgd.load_checkpoint(..., "
        f"engine=engine), or make_private on the first engine); report the runs' composed "
        f"epsilon otherwise", stacklevel=stacklevel)


def state_dict_hook(module, state_dict, prefix, local_metadata) -> None:
    """The private model's ``state_dict``: its layers' runs' histories in the metadata."""
    ledgers = spent_elsewhere(module, None)
    if ledgers and not prefix:
        local_metadata[METADATA] = [
            {"history": [list(map(float, g)) for g in ledger.history], "name": ledger.name,
             "dataset_size": _size(ledger)} for ledger in ledgers]


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
    """Note on each of ``model``'s layers that ``optimizer`` (of ``engine``) records it, and
    that its weights carry ``engine``'s ledger (``Spent``); the model's ``state_dict`` writes
    the ledgers, a load reads them (hooks put on once)."""
    for layer in owning_layers(model):
        layer.__dict__[ATTRIBUTE] = Attached((optimizer, engine, model))
    carry(model, [engine.accountant])
    if not model.__dict__.get(HOOKED):
        model.__dict__[HOOKED] = True
        model.register_state_dict_post_hook(state_dict_hook)
        model.register_load_state_dict_pre_hook(load_hook)


HOOKED = "_workbench_ledger_hooks"


def warn_carried(model: nn.Module, engine) -> None:
    """Before ``make_private`` on ``model``: warn of ledgers its weights carry that neither
    ``engine`` nor an engine now recording the model (``detach_earlier`` warns of those)
    holds: a copy of a privately trained model, weights loaded into one."""
    owners = _owners(model)
    warn_spent([g for g in spent_elsewhere(model, engine.accountant)
                if not any(getattr(o, "accountant", None) is g for o in owners)],
               "make_private on a model whose weights were trained privately before (a copy "
               "of, or weights loaded into, a model an earlier engine made private)",
               stacklevel=4)


def _owners(model):
    """The engines recording ``model``'s layers now."""
    return [t[1] for t in (layer.__dict__.get(ATTRIBUTE, NOTHING)
                           for layer in owning_layers(model)) if t[1] is not None]


def _within(history, live) -> bool:
    """Whether ``history`` is the start of the ``live`` ledger's (a state dict saved earlier
    in the same run: a rollback to the best weights spends nothing new)."""
    live = list(live)
    if not history or len(history) > len(live):
        return False
    *head, last = history
    return all(tuple(a) == tuple(b) for a, b in zip(head, live)) and \
        tuple(last[:2]) == tuple(live[len(head)][:2]) and last[2] <= live[len(head)][2]


def load_hook(module, state_dict, prefix, local_metadata, *rest) -> None:
    """A state dict loaded into a private model: the ledgers its metadata carries that no
    engine recording the model holds are carried by the layers from now on, and warned."""
    entries = local_metadata.get(METADATA) if not prefix else None
    if not entries:
        return
    live = [getattr(o, "accountant", None) for o in _owners(module)]
    ledgers = [Ledger(e["history"], e.get("name", "rdp"), e.get("dataset_size"))
               for e in entries if isinstance(e, dict) and e.get("history")]
    ledgers = [g for g in ledgers
               if not any(a is not None and _within(g.history, a.history) for a in live)]
    if not ledgers:
        return
    carry(module, ledgers)
    warn_spent(ledgers, "load_state_dict into a model made private", stacklevel=7)


__all__ = ["ATTRIBUTE", "Attached", "Ledger", "METADATA", "NOTHING", "SPENT", "Spent", "carry",
           "detach_earlier", "load_hook", "owning_layers", "remember", "spent_elsewhere",
           "state_dict_hook", "warn_carried", "warn_spent"]
