"""The model's structure as ``record`` reads it, computed once per layout of the model.

Every ``record`` (each call of the functional API) needs the same four tables of the model:
``layers_with_parameters`` ({path: layer}), ``trainable_parameters`` ({name: p}), ``owners_of``
({id(p): paths of its recorded owners}) and ``parameter_names`` ({id(p): name}). Computing
them walks the model several times (``named_modules``, ``named_parameters``, and per module
the parameters of all its children); on a one-layer model that is a fixed ~25 µs of every
call, on a deep model far more.

**The invariant**: a cached table is returned only for a model whose *layout* is, object for
object, the one it was computed from. The layout is one walk over ``_modules`` and
``_parameters``: every module and parameter (compared by identity, through weak references,
so an id reused after a module was replaced never matches), each module's class (a
``parametrize``\\ d layer swaps it), the names of its children and parameters, each
parameter's ``requires_grad``, and for an ``nn.Embedding`` whether it delegates to the
functional lookups (``tied.delegates``: it depends on the rule registry). Everything the four
tables read is in it, so any change to the model (a layer replaced, added or renamed, a
parameter frozen, replaced or re-registered) gives another layout and a fresh computation.
A class that overrides how the model is walked (``named_modules``, ``children``,
``parameters`` ...) is never cached: its tables are computed on every call, as before.

The cache holds weak references only (a ``WeakKeyDictionary`` on the model): it never keeps a
model, a layer or a parameter alive.
"""

import weakref

from torch import nn

from workbench.per_sample.tied import delegates

_WALKS = ("named_modules", "modules", "children", "named_children", "parameters",
          "named_parameters", "_named_members")
_PLAIN_WALK: dict[type, bool] = {}  # class -> walks the model as nn.Module does
_CACHE: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _plain(kind: type) -> bool:
    plain = _PLAIN_WALK.get(kind)
    if plain is None:
        plain = _PLAIN_WALK[kind] = all(getattr(kind, k) is getattr(nn.Module, k)
                                        for k in _WALKS)
    return plain


def layout(model: nn.Module) -> tuple[list, list] | None:
    """(objects, flags): every module and parameter in one walk, and what the tables read of
    them besides identity (module docstring); None when a class overrides the walk."""
    objects, flags, seen, todo = [], [], set(), [model]
    while todo:
        m = todo.pop()
        if m is None or id(m) in seen:
            flags.append(m is None)
            continue
        kind = type(m)
        if not _plain(kind):
            return None
        seen.add(id(m))
        objects.append(m)
        flags.append(kind)
        if isinstance(m, nn.Embedding):
            flags.append(delegates(m))
        for name, p in m._parameters.items():
            objects.append(p)
            flags.append(name)
            flags.append(p is not None and p.requires_grad)
        flags.extend(m._modules)  # the children's names, in order
        todo.extend(reversed(m._modules.values()))
    return objects, flags


def _same(refs: list, objects: list) -> bool:
    return len(refs) == len(objects) and all(
        (r is None and o is None) or (r is not None and r() is o) for r, o in zip(refs, objects))


def model_tables(model: nn.Module, compute) -> tuple[dict, dict, dict, dict]:
    """(layers, params, owners, names) of ``model``: ``compute(model)`` once per layout
    (module docstring), then the cached tables (layers and params fresh dicts each call: the
    recorder adds functional layers to its own; owners and names are shared, read only)."""
    now = layout(model)
    if now is None:
        return compute(model)
    objects, flags = now
    entry = _CACHE.get(model)
    if entry is not None and entry[1] == flags and _same(entry[0], objects):
        _, _, layer_at, param_at, owners, names = entry
        return ({path: objects[k] for path, k in layer_at},
                {name: objects[k] for name, k in param_at}, owners, names)
    layers, params, owners, names = compute(model)
    index = {id(o): k for k, o in enumerate(objects) if o is not None}
    if all(id(v) in index for v in (*layers.values(), *params.values())):
        refs = [None if o is None else weakref.ref(o) for o in objects]
        _CACHE[model] = (refs, flags, [(path, index[id(v)]) for path, v in layers.items()],
                         [(name, index[id(p)]) for name, p in params.items()], owners, names)
    return layers, params, owners, names


__all__ = ["layout", "model_tables"]
