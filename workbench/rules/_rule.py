"""One object per layer family: its grad rule, norm rule, routes with their costs, fast path.

A ``LayerRule`` gathers everything the workbench knows about one layer family, so a family
is one file (``workbench/rules/<family>.py``) ending in ``register_rule(RULE)``:

- ``grad(layer, activations, backprops) -> {param_name: (n, *shape)}``: the *grad rule*
  (einsum, and every method that materialises a layer);
- ``norm(layer, activations, backprops) -> (n,)``: the *norm rule*, Σ over the layer's
  trainable parameters of ||g_i||², without g_i (ghost clipping, book-keeping);
- ``route(layer, activations) -> (Route, reason)``: which of the rule's ``routes`` the norm
  rule takes for these shapes, and why (``ghost_routes``);
- ``weight_grads(layer, call, weighted, own, ok) -> {id(param): Σ_i c_i g_i}`` (or None: not
  for this layer's options): an optional fast path for book-keeping's clipped sum without
  re-running the layer (Bu et al. 2023, arXiv 2210.00038, Eq. 3); for the rule's exact types;
- ``reweighted(layer, call, c, own, ok) -> {id(param): Σ_i c_i g_i}`` (or None): as
  ``weight_grads``, but weighting the call's backprops by c itself (in chunks), so that no
  (n, ...) copy c ⊙ b exists; tried first (``clipping.engine.reweighted_weight_grads``);
- ``check(layer)``: raises before any work for options the rules do not support;
- ``rows``: True (or ``rows(layer) -> bool``) where grad and norm rule work row by row, so a
  call on batch-flattened (n·T, d) rows is the call on (n, T, d) (``per_sample/flat_rows.py``);
- ``streams``: a behaviour rule whose grad rule's scratch is bounded by a share of the call's
  own a and b (it works in chunks of samples), so book-keeping may materialise its calls in
  the backward pass, where g_i take less memory than a and b, and let a and b go
  (``clipping/bookkeeping.streams``; the exact types of ``STREAMED`` always may).

A ``Route`` is a named way to take the norm that carries its own cost, so ``auto`` and the
memory model ask it instead of interpreting its name:

    scratch(layer, call) -> numbers per sample the route creates beyond a and b
    flops(layer, call)   -> multiply-adds per sample (``None``: not modelled)
    materialises         -> whether the per-sample gradient itself is made (no saving)

Notation: n batch, g_i per-sample gradient, c_i clip factor, a activations, b backprops.
"""

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from workbench.clipping.registry import (
    find_norm_route,
    register_norm_by_behaviour,
    register_norm_sampler,
)
from workbench.per_sample.registry import (
    RuleList,
    RuleTable,
    check_layer_types,
    find_rule,
    register_by_behaviour,
    register_grad_sampler,
    rng_kept,
)


def own_gradient_size(layer: nn.Module, call=None) -> int:
    """P: the numbers of the layer's own trainable parameters, its per-sample gradient."""
    return sum(p.numel() for p in layer.parameters(recurse=False) if p.requires_grad)


@dataclass(frozen=True)
class Route:
    """A named way to take a layer call's norm, with its scratch per sample (numbers)."""

    name: str
    scratch: Callable | None  # (layer, call) -> numbers per sample; None: unknown
    materialises: bool = False
    flops: Callable | None = None  # (layer, call) -> multiply-adds per sample

    def __str__(self) -> str:
        return self.name


PROBE_ERRORS = (RuntimeError, TypeError, ValueError, IndexError, AssertionError)
"""What a behaviour rule's probe forward may raise on a layer it does not fit (an Embedding
subclass given floats, a shape assertion): the layer simply does not match."""



def probe_forward(layer: nn.Module, *args) -> torch.Tensor:
    """``layer.forward(*args)`` on a behaviour rule's probe input, which must return one Tensor:
    a layer returning anything else (IBert's ``QuantLinear``: a tuple (output, scale)) is no
    o = f(a) layer of any behaviour rule, so it raises TypeError, one of ``PROBE_ERRORS``
    (the probe's "does not match"). Every probe forward goes through here; a random draw inside
    it leaves the global generators as they were (``registry.rng_kept``).

    A layer on a GPU is probed on its CPU twin (``cpu_twin``), the output moved back: a probe
    input the layer does not fit raises on the CPU, where it is caught, but on CUDA an index
    out of range is a device-side assert, which no ``except`` catches and which ends CUDA for
    the whole process (measured on an H200, 2026-11-30: OPT's positional embedding, an
    ``nn.Embedding`` subclass whose forward takes a mask, given a float probe)."""
    twin = cpu_twin(layer)
    if twin is not layer:
        args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    with rng_kept(twin):
        out = twin.forward(*args)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{type(layer).__name__} returns a {type(out).__name__}, not a Tensor")
    return out if twin is layer else out.to(_device_of(layer))


def _device_of(layer: nn.Module) -> torch.device:
    """The device of the layer's first tensor off the CPU (CPU when it has none)."""
    for t in (*layer.parameters(), *layer.buffers()):
        if t.device.type != "cpu":
            return t.device
    return torch.device("cpu")


def _off_cpu(tensors) -> bool:
    return any(t.device.type != "cpu" for t in tensors)


def cpu_twin(layer: nn.Module) -> nn.Module:
    """``layer`` itself when its parameters and buffers are on the CPU, else a copy of it with
    CPU copies of them (no second copy on the device: the copy's tensors are made on the CPU
    directly). A layer that cannot be copied raises TypeError, a ``PROBE_ERRORS`` "does not
    match": it takes the exact per-layer fallback rather than a probe on the device."""
    tensors = [*layer.parameters(), *layer.buffers()]
    if not _off_cpu(tensors):
        return layer
    try:
        memo = {}
        for t in tensors:
            if id(t) not in memo:
                memo[id(t)] = (nn.Parameter(t.detach().to("cpu", copy=True),
                                            requires_grad=t.requires_grad)
                               if isinstance(t, nn.Parameter) else t.detach().to("cpu", copy=True))
        return copy.deepcopy(layer, memo)
    except Exception as error:  # noqa: BLE001  (an attribute that cannot be copied, a meta
        # tensor)
        raise TypeError(f"{type(layer).__name__} cannot be copied to the CPU for its probe: "
                        f"{type(error).__name__}: {error}") from error


MATERIALISE = Route("materialise", own_gradient_size, materialises=True)
"""The per-sample gradient itself, normed and dropped: P numbers per sample."""


@dataclass(frozen=True)
class LayerRule:
    """Everything the workbench knows about one layer family (module docstring)."""

    name: str
    types: tuple = ()
    grad: Callable | None = None
    norm: Callable | None = None
    route: Callable | None = None  # (layer, activations) -> (Route, reason)
    routes: tuple = ()  # every Route ``route`` may return
    weight_grads: Callable | None = None
    reweighted: Callable | None = None  # weight_grads from (b, c): no c ⊙ b copy
    check: Callable | None = None
    matches: Callable | None = None  # a behaviour rule: matches(layer) runs its forward
    rows: bool | Callable = False  # row by row: flattened (n·T, ...) rows allowed (flat_rows)
    streams: bool = False  # a behaviour rule with bounded scratch: materialised as b arrives


RULES: dict[type[nn.Module], LayerRule] = RuleTable()
"""layer type -> its LayerRule (the grad and norm tables are filled from it)."""

RULE_BEHAVIOURS: list[tuple[Callable, LayerRule]] = RuleList()
"""(matches(layer), rule): rules found by what a layer computes."""


def register_rule(rule: LayerRule) -> LayerRule:
    """Register ``rule`` for its types (or, with ``matches``, by behaviour) in every table."""
    if not isinstance(rule, LayerRule):
        raise TypeError(f"register_rule needs a LayerRule; got {rule!r}")
    if rule.norm is not None and rule.route is not None and not rule.routes:
        raise TypeError(f"rule {rule.name!r}: list the Route objects its route() returns in "
                        f"routes=(...), so auto and the memory model know their costs")
    if rule.matches is None:
        check_layer_types("register_rule", rule.types)
        RULES.update(dict.fromkeys(rule.types, rule))
        if rule.grad is not None:
            register_grad_sampler(*rule.types, check=rule.check)(rule.grad)
        if rule.norm is not None:
            register_norm_sampler(*rule.types, route=rule.route)(rule.norm)
        return rule
    RULE_BEHAVIOURS.append((rule.matches, rule))
    if rule.grad is not None:
        register_by_behaviour(rule.matches)(rule.grad)
    if rule.norm is not None:
        register_norm_by_behaviour(rule.matches, route=rule.route)(rule.norm)
    return rule


def unregister_rule(rule: LayerRule) -> None:
    """Remove ``rule`` from every table (a test's or a notebook's temporary layer)."""
    from workbench.clipping import registry as norms
    from workbench.per_sample import registry as grads

    for kind in rule.types:
        for table in (RULES, grads.GRAD_SAMPLERS, grads.SAMPLER_CHECKS, norms.NORM_SAMPLERS,
                      norms.NORM_ROUTES):
            table.pop(kind, None)
    for entries in (RULE_BEHAVIOURS, grads.GRAD_BEHAVIOURS, norms.NORM_BEHAVIOURS,
                    norms.ROUTE_BEHAVIOURS):
        entries[:] = [entry for entry in entries if entry[0] is not rule.matches]


def find_layer_rule(layer: nn.Module) -> LayerRule | None:
    """The LayerRule of ``layer`` (``per_sample.registry.find_rule``), or None."""
    return find_rule(RULES, layer, RULE_BEHAVIOURS)


def norm_route(layer: nn.Module, activations) -> tuple[Route, str] | None:
    """(Route, reason) of ``layer``'s norm rule for these inputs, or None without a route.

    A route function registered the old way may return a name: its Route has no known cost
    (``scratch=None``), so the memory model refuses it instead of guessing."""
    route = find_norm_route(layer)
    if route is None:
        return None
    chosen, reason = route(layer, activations)
    return (chosen if isinstance(chosen, Route) else Route(str(chosen), None)), reason


def fast_weight_grads(layer: nn.Module):
    """The rule's book-keeping fast path, for a layer of exactly one of the rule's types."""
    rule = RULES.get(type(layer))
    return rule.weight_grads if rule is not None else None


def fast_reweighted(layer: nn.Module):
    """The rule's clipped sum that weights b by c itself, for exactly one of its types."""
    rule = RULES.get(type(layer))
    return rule.reweighted if rule is not None else None


__all__ = [
    "MATERIALISE", "PROBE_ERRORS", "RULES", "RULE_BEHAVIOURS", "LayerRule", "Route",
    "fast_reweighted", "fast_weight_grads", "find_layer_rule", "norm_route", "own_gradient_size",
    "probe_forward", "register_rule", "unregister_rule",
]
