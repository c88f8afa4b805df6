"""Backprops used as they arrive: one backward pass that holds no layer's b past its use.

``ActivationRecorder.backward`` asks autograd for ∂(Σ_i ℓ_i)/∂o at every recorded output's
edge in one call, ``torch.autograd.grad(loss, edges)``; autograd keeps each captured gradient
until the whole pass has finished, so at its end every layer's backprop b is alive at once
(tiny_gpt, b = 32, T = 128: 26.5 MB next to a plain step's 55 MB peak). A norm needs each b
only once (Goodfellow 2015, arXiv 1510.01799; Li et al. 2022, arXiv 2110.05679, §4: the
per-layer norm ||g_i^{layer}||² is a function of that layer's (a, b) alone), so ghost
clipping can turn b into n numbers the moment it is complete and let it go.

How, with autograd's own rules: a node *on the way* to a captured edge is run by the engine,
and a hook registered before it (``Node.register_prehook``) sees the gradient of its outputs,
complete (summed over every use), just before the node runs; a captured node that leads to no
other capture is not run, and its gradient is returned instead. So

1. the edges are split (``frontier``): an edge whose node reaches another recorded edge's node
   through the graph (``next_functions``) is *passed through*, one that reaches none is
   *captured*; every passed edge lies on the way to a captured one, so its hook fires;
2. ``torch.autograd.grad(loss, captured)`` runs the pass; each passed call's hook stores the
   gradients of its outputs and, once all of them have arrived, hands the call (its b set)
   to ``on_call`` and drops b. Captured calls (the first layers: the token embedding) are
   handed over from the returned gradients at the end.

The pass computes exactly what the single ``autograd.grad`` over all edges computes (the same
nodes run, parameter gradients are not computed), and ``on_call`` sees every call that the
loss reached, with the same b. The hooks are removed before returning, also on error, so a
later pass over a retained graph (``retain_graph``) runs without them.

Notation: n batch size, a activations, b backprops, o a layer's output, ℓ_i per-sample loss.
"""

import torch

_ARRIVED = object()  # marks "not yet": a gradient that arrived may itself be None (unused)


def reaches(starts, targets) -> list[bool]:
    """For each node in ``starts``: does a path of one or more steps through
    ``next_functions`` lead from it to a node of ``targets``? One iterative post-order walk
    (an unrolled RNN's graph is deeper than Python's recursion limit), each node expanded
    once; the node objects are held so that their ids stay theirs during the walk."""
    target_ids = {id(t) for t in targets}
    memo: dict[int, bool] = {}
    held = []
    for start in starts:
        stack = [(start, None)]
        while stack:
            node, kids = stack.pop()
            if id(node) in memo:
                continue
            if kids is None:  # first visit: children first, then this node again
                kids = [nxt for nxt, _ in node.next_functions if nxt is not None]
                held.append(node)
                stack.append((node, kids))
                stack.extend((kid, None) for kid in kids if id(kid) not in memo)
            else:
                memo[id(node)] = any(id(kid) in target_ids or memo[id(kid)] for kid in kids)
    return [memo[id(s)] for s in starts]


def frontier(calls) -> tuple[list, list]:
    """(passed, captured) calls: a call is passed when every one of its capture edges' nodes
    reaches another recorded edge's node, so all its hooks fire during the pass."""
    nodes = [e.node for call in calls for e in call.capture_edges()]
    hits = iter(reaches(nodes, nodes))
    passed, captured = [], []
    for call in calls:
        ok = [next(hits) for _ in call.capture_edges()]
        (passed if all(ok) else captured).append(call)
    return passed, captured


def stream_backward(calls, total_loss: torch.Tensor, on_call, retain_graph: bool = False,
                    derived=None, params=()) -> list:
    """One backward pass of ``total_loss``; ``on_call(call)`` for every call that received a
    gradient, with ``call.backprops`` set, which is set back to None right after. Returns
    the gradient of ``total_loss`` with respect to each of ``params`` (None where unused)."""
    passed, captured = frontier(calls)
    handles = []

    def arrive(call, k, grad):
        call.grads[k] = grad
        if all(g is not _ARRIVED for g in call.grads):
            hand_over(call, call.grads)

    def hand_over(call, grads):
        call.grads = [None] * len(grads)
        call.set_backprops(grads)
        if call.backprops is not None:
            on_call(call)
        call.backprops = None

    def prehook(call, k, nr):
        return lambda grad_outputs: arrive(call, k, grad_outputs[nr])  # returns None: b flows

    try:
        for call in passed:
            call.grads = [_ARRIVED] * len(call.capture_edges())
            for k, edge in enumerate(call.capture_edges()):
                handles.append(edge.node.register_prehook(prehook(call, k, edge.output_nr)))
        edges = [e for call in captured for e in call.capture_edges()]
        extra = derived.edges() if derived is not None else []  # their hooks run (derived.py)
        grads = torch.autograd.grad(total_loss, [*edges, *params, *extra], allow_unused=True,
                                    retain_graph=retain_graph) \
            if edges or extra or params else ()
        wanted = list(grads[len(edges):len(edges) + len(params)]) if grads else []
        grads = grads[:len(edges)]
    finally:
        for handle in handles:
            handle.remove()
    k = 0
    for call in captured:
        m = len(call.capture_edges())
        hand_over(call, list(grads[k:k + m]))
        k += m
    for call in passed:  # not handed over: an output the loss never reached (node never ran)
        if any(g is _ARRIVED for g in call.grads):
            hand_over(call, [None if g is _ARRIVED else g for g in call.grads])
    return wanted


__all__ = ["frontier", "reaches", "stream_backward"]
