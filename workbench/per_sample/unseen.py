"""Parameters that reach the graph through no op the use tracker saw.

The use tracker (``uses.py``) sees every torch function the forward pass calls, so every use
of a parameter that autograd records: except the ops inside a ``torch.autograd.Function``.
``Function.apply`` itself does not dispatch to a ``TorchFunctionMode``, and its ``forward``
runs with gradients off, so the ops there (which the mode does see) return nothing
differentiable and are not uses. PEFT's LoHa writes its adapted weight so,

    ΔW = HadaWeight.apply(w1a, w1b, w2a, w2b, s) = ((w1a w1b) ⊙ (w2a w2b)) s     (p, d)

with its own ``backward``: the four parameters join the graph, no hook sees them, and no
recorded call is theirs, so the rules gave them a zero per-sample gradient (silently: only
the self-check's probe saw the difference).

**The invariant**: a trainable parameter whose gradient the loss reaches is accounted for by
a use the tracker saw (``UseTracker.seen``) or by a recorded call of a layer that owns it
(the layer's rule or vmap covers everything its forward does). ``unseen`` finds the others:
the candidates (tracked parameters neither seen nor owned by a called layer: usually none,
then nothing is walked) looked up among the ``AccumulateGrad`` nodes of the autograd graph
behind the forward pass's outputs, a walk over the graph's nodes that stops once every
candidate is found. Each one found is reported as a use outside any layer, so its per-sample
gradient comes from the exact whole-model fallback (``fallback.py``; ``vmap`` cannot run a
``Function`` without ``setup_context``, so micro-batching, with its warning).

Cost: a set difference per forward pass; the graph walk (one visit per node) only when a
trainable parameter had no seen use and no called owner (an unused parameter, or this case).

Notation: p a trainable parameter, ΔW an adapted weight computed from parameters.
"""

import torch

UNSEEN = "<an op no hook sees: inside a torch.autograd.Function>"


def candidates(tracker) -> set[int]:
    """ids of tracked parameters with no seen use and no recorded call of an owner."""
    called = {path for path, calls in tracker.recorder.calls.items() if calls}
    return {key for key, paths in tracker.owners.items()
            if key not in tracker.seen and key not in tracker.uncovered
            and called.isdisjoint(paths)}


def reached(roots, wanted: set[int]) -> set[int]:
    """The ids in ``wanted`` of leaf tensors whose gradient the tensors ``roots`` reach."""
    todo = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, found = {}, set()  # id -> node: held, so no id is reused (derived.graph_nodes)
    while todo and len(found) < len(wanted):
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it feeds
        if variable is not None and id(variable) in wanted:
            found.add(id(variable))
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found


def unseen(tracker, roots) -> dict[int, set[str]]:
    """{id(p): {UNSEEN}} for the parameters the tracker missed that ``roots`` reach."""
    wanted = candidates(tracker)
    if not wanted:
        return {}
    with torch._C.DisableTorchFunction():  # book-keeping, not a use of the model
        return {key: {UNSEEN} for key in reached(roots, wanted)}


__all__ = ["UNSEEN", "candidates", "reached", "unseen"]
