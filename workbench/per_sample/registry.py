"""The visible rule table: which function computes per-sample gradients for which layer type.

A layer family's rules are registered together from one file (``workbench/rules/``,
``LayerRule``); this module holds the grad table and the one lookup every table uses.
A *grad rule* (formerly "grad sampler"; the old names stay as aliases) has one pure
signature (the convention of Opacus' grad samplers, Yousefpour et al. 2021, arXiv 2109.12298,
§2 and Appendix B)::

    sampler(layer, activations, backprops) -> {param_name: Tensor(n, *param.shape)}

- ``activations``: the tuple of positional inputs the layer received in the forward pass
  (batch on dim 0), so a one-input layer reads ``a = activations[0]``;
- ``backprops``: the gradient of ``sum_i loss_i`` w.r.t. the layer's output, shape
  ``(n, *output.shape[1:])``. Because samples do not mix, its row i is the gradient of
  loss_i alone (the "highway gradient" of the Opacus paper, Eq. 4);
- ``param_name``: the layer's own attribute names (``"weight"``, ``"bias"``); the caller maps
  them to the model's dotted names. Only names of trainable parameters need to be returned.

Lookup (``find_rule``, one mechanism for the grad and the norm tables) never lets a subclass
that changes ``forward`` inherit its parent's rule silently:

1. a rule registered for the layer's exact type;
2. else a parent's rule, only when no class between the layer's type and that parent defines
   a method other than those in ``INHERITABLE`` (``__init__``, ``reset_parameters``, ...): the
   computation is then the parent's own (``class MyLinear(nn.Linear)`` with a new
   ``__init__``);
3. else a *behaviour* rule (``register_by_behaviour``): a ``matches(layer)`` test that runs the
   layer's own forward on a probe input and accepts it only where the output is the rule's
   formula (e.g. every RMSNorm class of Hugging Face, ``rules/affine.py``);
   its verdict is cached per layer object, and holds only for a layer called with its one
   input (``called_with_more``: a gated norm's second argument is no part of the probe).

Anything else has no rule: vmap on the layer (``functional.layer_vmap_grad_sampler``).

A sampler may come with a ``check(layer)`` that raises before any work is done when the
layer uses an option the sampler does not support (e.g. ``nn.Embedding(sparse=True)``).
"""

import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils.parametrize import is_parametrized

GradSamplerFn = Callable[[nn.Module, tuple, torch.Tensor], dict[str, torch.Tensor]]

_VERSION = [0]  # bumped by every change of a rule table, so ``find_rule``'s answers are kept


def _bump(*_):
    _VERSION[0] += 1


def _changing(cls, methods):
    """``cls`` with each of ``methods`` also bumping the tables' version."""
    def wrap(name):
        base = getattr(cls.__mro__[1], name)

        def method(self, *args, **kwargs):
            out = base(self, *args, **kwargs)
            _VERSION[0] += 1
            return out
        method.__name__ = name
        return method

    for name in methods:
        setattr(cls, name, wrap(name))
    return cls


class RuleTable(dict):
    """A rule table (layer type -> rule): a dict whose every change, by any path (``del``,
    ``pop``, an update), tells ``find_rule`` that its kept answers are out of date."""


class RuleList(list):
    """A list of (matches, rule) behaviour rules, changes noted as ``RuleTable``'s."""


_changing(RuleTable, ("__setitem__", "__delitem__", "pop", "popitem", "update", "setdefault",
                      "clear", "__ior__"))
_changing(RuleList, ("__setitem__", "__delitem__", "append", "extend", "insert", "remove",
                     "pop", "clear", "__iadd__", "sort", "reverse"))

GRAD_SAMPLERS: dict[type[nn.Module], GradSamplerFn] = RuleTable()
"""layer type -> grad sampler. Read it to see what is supported; add with the decorator."""

SAMPLER_CHECKS: dict[type[nn.Module], Callable[[nn.Module], None]] = RuleTable()
"""layer type -> ``check(layer)``, raising UnsupportedLayerError for unsupported options."""

GRAD_BEHAVIOURS: list[tuple[Callable[[nn.Module], bool], GradSamplerFn]] = RuleList()
"""(matches(layer), sampler) rules found by what a layer computes, tried in order."""

INHERITABLE = frozenset({"__init__", "reset_parameters", "_reset_parameters", "extra_repr",
                         "__repr__", "__setstate__", "_load_from_state_dict"})
"""Methods a subclass may define and still inherit its parent's rule (they do not compute)."""


def register_grad_sampler(*layer_types: type[nn.Module], check=None):
    """Decorator registering a grad sampler for one or more layer types.

    >>> import torch
    >>> from torch import nn
    >>> class Scale(nn.Module):
    ...     def __init__(self, d):
    ...         super().__init__()
    ...         self.s = nn.Parameter(torch.ones(d))
    ...     def forward(self, x):
    ...         return x * self.s
    >>> @register_grad_sampler(Scale)
    ... def scale_sampler(layer, activations, backprops):
    ...     return {"s": activations[0] * backprops}     # (n, d): d(x*s)/ds = x
    >>> GRAD_SAMPLERS[Scale] is scale_sampler
    True
    >>> del GRAD_SAMPLERS[Scale]
    """
    check_layer_types("register_grad_sampler", layer_types)
    if check is not None and not callable(check):
        raise TypeError(f"register_grad_sampler: check must be callable(layer); got {check!r}")

    def decorator(fn: GradSamplerFn) -> GradSamplerFn:
        check_callable("register_grad_sampler", fn)
        for layer_type in layer_types:
            GRAD_SAMPLERS[layer_type] = fn
            if check is not None:
                SAMPLER_CHECKS[layer_type] = check
        return fn

    return decorator


def check_layer_types(decorator: str, layer_types: tuple) -> None:
    """A registration decorator needs one or more nn.Module subclasses."""
    if not layer_types:
        raise TypeError(f"{decorator}() needs at least one layer type, e.g. "
                        f"@{decorator}(MyLayer)")
    for layer_type in layer_types:
        if not (isinstance(layer_type, type) and issubclass(layer_type, nn.Module)):
            raise TypeError(f"{decorator}: layer_types must be nn.Module subclasses; "
                            f"got {layer_type!r}")


def check_callable(decorator: str, fn) -> None:
    if not callable(fn):
        raise TypeError(f"{decorator} must decorate a function; got {fn!r}")


def layer_type(layer: nn.Module) -> type:
    """``type(layer)``, or the original class of a ``torch.nn.utils.parametrize``d layer
    (parametrize swaps in a generated subclass whose forward is the original's)."""
    kind = type(layer)
    if kind.__name__.startswith("Parametrized") and is_parametrized(layer):  # name: cheap first
        return kind.__bases__[0]
    return kind


def computes_like(kind: type, parent: type) -> bool:
    """No class from ``kind`` up to (not including) ``parent`` defines a computing method."""
    for cls in kind.__mro__:
        if cls is parent:
            return True
        if any((callable(v) or isinstance(v, (property, staticmethod, classmethod)))
               and k not in INHERITABLE for k, v in vars(cls).items()):
            return False  # a descriptor computes too (forward = property(...))
    return False


_FOUND: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def find_rule(table: dict, layer: nn.Module, behaviours=()):
    """``table``'s rule for ``layer`` by the three steps of the module docstring, or None.
    The answer is kept per layer, its type and the tables' version (a layer's behaviour
    verdicts are kept anyway): a lookup per layer call, not a walk of its classes."""
    rule = table.get(type(layer))  # registered for its own class (parametrize's generated
    if rule is not None:  # classes are never registered): step 1 without layer_type's tests
        return rule
    if not isinstance(table, RuleTable) or not isinstance(behaviours, (RuleList, tuple)) \
            or (behaviours and not isinstance(behaviours, RuleList)):
        return _find_rule(table, layer, behaviours)
    if torch.compiler.is_compiling():  # Dynamo tracing a private model's hooks (refused
        # there: recorded.compiled_call) would guard on the weak cache's keys by position,
        # and a layer collected meanwhile failed the guard with a raw IndexError
        return _find_rule(table, layer, behaviours)
    key, version, kind = (id(table), id(behaviours)), _VERSION[0], type(layer)
    kept = _FOUND.get(layer)
    if kept is not None:
        hit = kept.get(key)
        if hit is not None and hit[0] == version and hit[1] is kind:
            return hit[2]
    rule = _find_rule(table, layer, behaviours)
    _FOUND.setdefault(layer, {})[key] = (version, kind, rule)
    return rule


def _find_rule(table: dict, layer: nn.Module, behaviours):
    kind = layer_type(layer)
    if kind in table:
        return table[kind]
    for parent in kind.__mro__[1:]:
        if parent in table:
            if computes_like(kind, parent):
                return table[parent]
            break  # the nearest registered parent's forward is not this layer's
    return by_behaviour(layer, behaviours)


_VERDICTS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()
_CALLED_WITH_MORE: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def called_with_more(layer: nn.Module, args: tuple, kwargs: dict) -> None:
    """Note a recorded call of ``layer`` (its ``args`` made positional: ``positional.py``).
    A behaviour rule's probe verifies o = f(a) on one input ``a``; a call that passes
    anything else (HF's ``MambaRMSNormGated(h, gate)``: o = RMSNorm(h ⊙ silu(gate)) ⊙ w,
    which an affine rule given h alone would take for RMSNorm(h) ⊙ w) computes what no probe
    saw. From its first such call on, no behaviour rule is the layer's rule (``by_behaviour``):
    it takes the per-layer vmap, which passes every argument, in every method."""
    if (any(a is not None for a in args[1:]) or any(v is not None for v in kwargs.values())) \
            and layer not in _CALLED_WITH_MORE:
        _CALLED_WITH_MORE.add(layer)
        _bump()  # its behaviour rule no longer holds: no kept answer may say it does


def rng_kept(layer: nn.Module):
    """A context in which a probe of ``layer`` may draw random numbers (its forward, random
    probe values): the global generators (CPU, and the layer's CUDA devices) are as before
    afterwards, so a probe never moves the user's random stream (the dropout masks a seeded
    training run draws next)."""
    devices = sorted({p.device.index or 0 for p in layer.parameters() if p.device.type == "cuda"})
    return torch.random.fork_rng(devices=devices)


def by_behaviour(layer: nn.Module, behaviours):
    """The first behaviour rule whose ``matches(layer)`` holds (cached per layer), or None;
    None for a layer called with more than its input (``called_with_more``)."""
    if not behaviours or layer in _CALLED_WITH_MORE:
        return None
    verdicts = _VERDICTS.setdefault(layer, {})
    for matches, rule in behaviours:
        if matches not in verdicts:
            with rng_kept(layer):  # the probe's draws are its own
                verdicts[matches] = bool(matches(layer))
        if verdicts[matches]:
            return rule
    return None


def register_by_behaviour(matches: Callable[[nn.Module], bool]):
    """Decorator: ``sampler`` is the rule of every layer without a type rule for which
    ``matches(layer)`` holds. ``matches`` must check what the layer computes (run its forward
    on a probe and compare with the rule's formula), never only its name."""
    check_callable("register_by_behaviour", matches)

    def decorator(fn: GradSamplerFn) -> GradSamplerFn:
        check_callable("register_by_behaviour", fn)
        GRAD_BEHAVIOURS.append((matches, fn))
        return fn

    return decorator


def find_grad_rule(layer: nn.Module) -> GradSamplerFn | None:
    """The grad rule of ``layer`` (``find_rule``), or None."""
    return find_rule(GRAD_SAMPLERS, layer, GRAD_BEHAVIOURS)


def find_sampler_check(layer: nn.Module):
    """The option check of ``layer``'s sampler, or None."""
    return find_rule(SAMPLER_CHECKS, layer)


GRAD_RULES = GRAD_SAMPLERS  # "grad rule" is the name; the sampler names are kept as aliases
register_grad_rule = register_grad_sampler
find_grad_sampler = find_grad_rule


__all__ = [
    "GRAD_BEHAVIOURS", "GRAD_RULES", "GRAD_SAMPLERS", "INHERITABLE", "SAMPLER_CHECKS",
    "GradSamplerFn", "RuleList", "RuleTable", "by_behaviour", "called_with_more",
    "check_callable", "check_layer_types",
    "computes_like", "find_grad_rule", "find_grad_sampler", "find_rule", "find_sampler_check",
    "layer_type", "register_by_behaviour", "register_grad_rule", "register_grad_sampler",
]
