"""The rule table for per-sample gradient *norms* without the per-sample gradients.

A *norm rule* (formerly "norm sampler"; the old names stay as aliases; a layer family
registers it with its grad rule and routes from one file, ``workbench/rules/``) has the grad
rule's signature but returns only squared norms::

    norm_sampler(layer, activations, backprops) -> Tensor(n,)   Σ over the layer's
                                                                  trainable params of ||g_i||²

It may come with ``route(layer, activations) -> (Route, reason)``, a pure function of shapes
saying how it will compute the norm (``ghost_routes`` shows it per layer and call); the
``rules.Route`` carries its cost for ``auto`` and the memory model.
Layers without a norm sampler are handled by "fast gradient clipping": their per-sample
gradients are materialised by the grad sampler (or vmap), normed and dropped at once.
Lookup is ``per_sample.registry.find_rule``'s, as for grad samplers: the exact type, a parent
whose forward the layer does not change, or a behaviour rule (``register_norm_by_behaviour``).
"""

from collections.abc import Callable

import torch
from torch import nn

from workbench.per_sample.registry import (
    RuleList,
    RuleTable,
    check_callable,
    check_layer_types,
    find_rule,
)

NormSamplerFn = Callable[[nn.Module, tuple, torch.Tensor], torch.Tensor]

NORM_SAMPLERS: dict[type[nn.Module], NormSamplerFn] = RuleTable()
"""layer type -> norm sampler (squared per-sample norms). Add with the decorator."""

NORM_ROUTES: dict[type[nn.Module], Callable] = RuleTable()
"""layer type -> ``route(layer, activations) -> (route, reason)``."""

NORM_BEHAVIOURS: list[tuple[Callable, NormSamplerFn]] = RuleList()
"""(matches(layer), norm sampler): rules found by what a layer computes."""
ROUTE_BEHAVIOURS: list[tuple[Callable, Callable]] = RuleList()


def register_norm_sampler(*layer_types: type[nn.Module], route=None):
    """Decorator registering a squared-norm sampler for one or more layer types.

    >>> import torch
    >>> from torch import nn
    >>> class Scale(nn.Module):
    ...     def __init__(self, d):
    ...         super().__init__()
    ...         self.s = nn.Parameter(torch.ones(d))
    ...     def forward(self, x):
    ...         return x * self.s
    >>> @register_norm_sampler(Scale)
    ... def scale_norms(layer, activations, backprops):
    ...     return (activations[0] * backprops).pow(2).sum(1)   # ||x_i ⊙ b_i||²
    >>> NORM_SAMPLERS[Scale] is scale_norms
    True
    >>> del NORM_SAMPLERS[Scale]
    """
    check_layer_types("register_norm_sampler", layer_types)

    def decorator(fn: NormSamplerFn) -> NormSamplerFn:
        check_callable("register_norm_sampler", fn)
        for layer_type in layer_types:
            NORM_SAMPLERS[layer_type] = fn
            if route is not None:
                NORM_ROUTES[layer_type] = route
        return fn

    return decorator


def register_norm_by_behaviour(matches, route=None):
    """Decorator: the norm sampler of every layer without a type rule for which
    ``matches(layer)`` holds (see ``per_sample.registry.register_by_behaviour``)."""
    check_callable("register_norm_by_behaviour", matches)

    def decorator(fn: NormSamplerFn) -> NormSamplerFn:
        check_callable("register_norm_by_behaviour", fn)
        NORM_BEHAVIOURS.append((matches, fn))
        if route is not None:
            ROUTE_BEHAVIOURS.append((matches, route))
        return fn

    return decorator


def find_norm_rule(layer: nn.Module) -> NormSamplerFn | None:
    """The norm rule of ``layer``: the same lookup as the grad rule's (``find_rule``)."""
    return find_rule(NORM_SAMPLERS, layer, NORM_BEHAVIOURS)


def find_norm_route(layer: nn.Module):
    """``route(layer, activations)`` of the layer's norm sampler, or None."""
    return find_rule(NORM_ROUTES, layer, ROUTE_BEHAVIOURS)


NORM_RULES = NORM_SAMPLERS  # "norm rule" is the name; the sampler names are kept as aliases
register_norm_rule = register_norm_sampler
find_norm_sampler = find_norm_rule


__all__ = [
    "NORM_BEHAVIOURS", "NORM_ROUTES", "NORM_RULES", "NORM_SAMPLERS", "ROUTE_BEHAVIOURS",
    "NormSamplerFn", "find_norm_route", "find_norm_rule", "find_norm_sampler",
    "register_norm_by_behaviour", "register_norm_rule", "register_norm_sampler",
]
