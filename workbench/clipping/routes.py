"""Which way each layer's per-sample gradient norm is computed, and why.

``ghost_routes`` runs one forward and backward pass and returns a table with one row per
layer call: the route its norm takes in ``per_sample_grad_norms(method="ghost")`` and the
reason (e.g. "2T² = 512 < pd = 4096: (T, T) Grams are smaller"). "fast gradient clipping
(vmap)" marks a layer with no rule at all: the slow path.
"""

from typing import TYPE_CHECKING

from workbench.clipping import cross
from workbench.clipping.ghost import record
from workbench.clipping.registry import find_norm_sampler
from workbench.per_sample.derived import served_gradients
from workbench.per_sample.recording import own_parameters
from workbench.per_sample.registry import find_grad_sampler
from workbench.rules._rule import Route, norm_route, own_gradient_size

if TYPE_CHECKING:
    import pandas as pd


FALLBACK = Route("exact fallback", own_gradient_size, materialises=True)
DERIVED = Route("derived (meetings)", own_gradient_size, materialises=True)  # derived.py
SHARED = Route("materialise (shared)", own_gradient_size, materialises=True)
CROSS = Route("gram (shared)",  # the call's (T, T) Grams with itself and every other call
              lambda layer, call: 2 * cross.positions(layer, call) ** 2)
FAST_GRADIENT_CLIPPING = Route("fast gradient clipping", own_gradient_size, materialises=True)
VMAP = Route("fast gradient clipping (vmap)", own_gradient_size, materialises=True)
UNDECLARED = Route("norm sampler", None)  # a norm rule registered without routes: cost unknown


def layer_route(layer, call, shared: set[int], fallback=None,
                crossed=(), derived=()) -> tuple[Route, str]:
    reasons = sorted({fallback[id(p)] for _, p in own_parameters(layer)
                      if fallback and id(p) in fallback})
    if reasons and all(id(p) in derived for _, p in own_parameters(layer)
                       if id(p) in fallback):
        return (DERIVED, "computed from parameters alone where they meet the batch: each "
                         "meeting op's per-sample vjp, then back through that computation, "
                         "batched (derived.py); no whole-model pass (" + "; ".join(reasons) + ")")
    if reasons:
        return (FALLBACK, "per-sample gradients over the whole model (vmap, else "
                                  "micro-batching): " + "; ".join(reasons))
    shared_names = [name for name, p in layer.named_parameters(recurse=False)
                    if id(p) in shared]
    grams = [name for name in shared_names if id(getattr(layer, name)) in crossed]
    if grams:
        return (CROSS,
                f"{', '.join(grams)} used in several calls: the norm of the sum from every "
                f"call's (T, T) Grams with cross terms, smaller than the (n, *shape) gradient")
    if shared_names:
        return (SHARED,
                f"{', '.join(shared_names)} used in several calls: the norm of the summed "
                f"per-sample gradient has cross terms")
    if find_norm_sampler(layer) is None:
        if find_grad_sampler(layer) is None:
            return (VMAP,
                    "no norm sampler and no grad sampler: per-sample gradient by vmap on the "
                    "layer, normed and dropped (register a rule to take the fast path)")
        return (FAST_GRADIENT_CLIPPING,
                "no norm sampler: per-sample gradient materialised, normed and dropped")
    return norm_route(layer, call.args) or (
        UNDECLARED, "a norm rule registered without routes: its cost is not declared")


COLUMNS = ["layer", "type", "call", "route", "reason"]


def route_calls(model, loss_fn, inputs, targets, check=True):
    """One (row of ``ghost_routes``, layer, recorded call, Route) per layer call.

    The call is ``None`` for a fallback layer no hook saw (called as ``.forward(x)``).
    ``check``: as in ``per_sample_grad_norms`` (the recording's one-sample probe).
    """
    rec = record(model, loss_fn, inputs, targets, retain_graph=False, check=check)
    derived = set(served_gradients(rec))
    shared = rec.shared_ids()
    crossed = cross.plan(rec, shared)
    seen = {}
    for path, layer, call in rec.calls():
        if rec.hands_over(layer):  # its parameters are sampled by their broadcast calls
            continue
        seen[path] = seen.get(path, -1) + 1
        route, reason = layer_route(layer, call, shared, rec.fallback, crossed, derived)
        yield ({"layer": path or "<model>", "type": type(layer).__name__, "call": seen[path],
                "route": route.name, "reason": reason}, layer, call, route)
    for path, layer in rec.layers.items():  # fallback layers no hook saw (.forward(x))
        if path not in seen and any(id(p) in rec.fallback for _, p in own_parameters(layer)):
            route, reason = layer_route(layer, None, shared, rec.fallback, derived=derived)
            yield ({"layer": path or "<model>", "type": type(layer).__name__, "call": "-",
                    "route": route.name, "reason": reason}, layer, None, route)


def ghost_routes(model, loss_fn, inputs, targets) -> "pd.DataFrame":
    """One row per layer call: path, layer type, call index, route, reason."""
    import pandas as pd  # lazy: pandas only where used

    rows = [row for row, *_ in route_calls(model, loss_fn, inputs, targets)]
    return pd.DataFrame(rows, columns=COLUMNS)


__all__ = ["COLUMNS", "ghost_routes", "layer_route", "route_calls"]
