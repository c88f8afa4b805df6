"""A recorded call's inputs as its layer's forward reads them: positional, however passed.

Every grad and norm rule reads a layer's input as ``activations[0]`` (Opacus' sampler
signature, ``registry.py``), and the shape checks read dim 0 of the first positional input
(``recording.checked_shapes``). A forward hook sees the call as the caller wrote it:
``self.fc(input=x)`` and Hugging Face's ``self.mamba(hidden_states=h, attention_mask=m)``
(Jamba) arrive with ``args = ()`` and the input among the keyword arguments, where no rule
looks. So each recorded call is first rewritten as the same call with the keyword arguments
that fill the forward's leading positional parameters moved into ``args``, in the
signature's order:

    forward(self, p_1, ..., p_k, *, ...) called with args = (a_1, ..., a_j), kwargs K
    -> args = (a_1, ..., a_j, K[p_(j+1)], ..., K[p_m]),  m: the last p with p_(j+1..m) in K

which binds every parameter to the same value (Python's own binding rule), so the layer, its
per-layer vmap and a re-run of its forward compute exactly what the caller's call computed.
A parameter the caller left to its default ends the move (a positional gap cannot be filled
without choosing a value the caller did not pass).
"""

import inspect

from torch import nn

_LEADING: dict[type, tuple[str, ...]] = {}  # layer class -> its forward's positional names
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def leading_names(layer: nn.Module) -> tuple[str, ...]:
    """The names of ``layer.forward``'s positional parameters, in order (``self`` excluded);
    cached per class unless the instance carries its own ``forward``."""
    own = "forward" in layer.__dict__  # an instance-level forward (a wrapper's): not cached
    kind = type(layer)
    if not own and kind in _LEADING:
        return _LEADING[kind]
    try:
        params = inspect.signature(layer.forward).parameters.values()
    except (TypeError, ValueError):  # a builtin or C forward without a signature
        names: tuple[str, ...] = ()
    else:
        names = []
        for p in params:
            if p.kind not in _POSITIONAL:
                break
            names.append(p.name)
        names = tuple(names)
    if not own:
        _LEADING[kind] = names
    return names


def as_positional(layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """(args, kwargs) of the same call with the keyword arguments that fill the forward's
    next positional parameters moved into ``args`` (module docstring)."""
    names = leading_names(layer)
    j = len(args)
    if j >= len(names) or names[j] not in kwargs:
        return args, kwargs
    moved, rest = list(args), dict(kwargs)
    for name in names[j:]:
        if name not in rest:
            break
        moved.append(rest.pop(name))
    return tuple(moved), rest


__all__ = ["as_positional", "leading_names"]
