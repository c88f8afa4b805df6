"""A parameter used as the weight of ``F.linear`` outside its layer: a tied head.

GPT-2 and nanoGPT tie the output head to the token embedding (Press & Wolf 2017, arXiv
1608.05859) and write it as ``F.linear(h, self.wte.weight)``, outside any module call: no
module hook sees it. The use tracker (``uses.py``) sees the call with its arguments, and the
call *is* a Linear layer's:

    o = x Wᵀ (+ c)        ∂ℓ_i/∂W = Σ_t b_{i,t} x_{i,t}ᵀ       (n, p, d)   Linear rule, Eq. (5)
                                                              of Yousefpour et al. 2021

so it is recorded as a call of a *functional layer*: an ``nn.Linear`` built around the same
Parameter objects (no copy; its path names them, e.g. ``F.linear(wte.weight)``), with the
activations x and the backprops of o captured like any module call's. Every Linear rule
(grad sampler, ghost norm, book-keeping) then applies unchanged, and its dim 0 is checked like
any call's (``recording.batch_problem``, ``selfcheck.probe``).

The parameter is now used in two calls (the Embedding and the head), so its per-sample
gradient is the *sum* of the two rules' results, and its norm has cross terms:
``Recording.shared_ids`` lists it, and ghost clipping and book-keeping materialise it
(n, V, d) and sum before taking the norm (``clipping/ghost.py``).

Only ``F.linear(x, W)`` and ``F.linear(x, W, c)`` with W (and c) trainable parameters used
outside the layers that own them, and x not a parameter, are recorded this way. Anything else
(``h @ W.T``, ``torch.matmul(h, W.t())``, a weight computed from W) stays an uncovered use:
its parameter gets the exact whole-model fallback (``fallback.py``).

Notation: n batch, x activations (n, ..., d), b backprops (n, ..., p), W (p, d), c bias (p,).
"""

import torch
from torch import nn
from torch.nn import functional as F

LINEAR = F.linear  # the builtin the use tracker receives as ``func``


def linear_arguments(args, kwargs):
    """(x, W, c) of an ``F.linear`` call."""
    names = ("input", "weight", "bias")
    values = dict(zip(names, args), **kwargs)
    return values.get("input"), values.get("weight"), values.get("bias")


def functional_linear(weight: nn.Parameter, bias: nn.Parameter | None) -> nn.Linear:
    """An ``nn.Linear`` whose weight (and bias) *are* the given Parameter objects."""
    layer = nn.Linear(1, 1, bias=False, device="meta")  # allocates nothing
    del layer.weight
    layer.weight = weight  # registered, not copied
    layer.bias = bias
    layer.out_features, layer.in_features = weight.shape
    return layer


def record_linear(tracker, args, kwargs, result, where: str) -> bool:
    """Record a functional ``F.linear`` call of tracked parameters as a Linear call.

    Returns False (nothing recorded: the uses stay uncovered) unless W is a tracked parameter
    used outside its owners, c is None or such a parameter too, and x is a plain tensor.
    """
    x, W, c = linear_arguments(args, kwargs)
    owners = tracker.owners
    if (id(W) not in owners or where in owners[id(W)] or W.dim() != 2
            or not isinstance(x, torch.Tensor) or id(x) in owners
            or (c is not None and (id(c) not in owners or where in owners[id(c)]))):
        return False
    names = [tracker.names.get(id(p), "a parameter") for p in (W, c) if p is not None]
    path = f"F.linear({', '.join(names)})"
    recorder = tracker.recorder
    layer = recorder.layers[path] if path in recorder.layers else recorder.add_layer(
        path, functional_linear(W, c))
    if layer.weight is not W or layer.bias is not c:
        return False  # two parameters with one name (should not happen): stay uncovered
    recorder.add_call(path, layer, (x,), {}, result)
    return True


__all__ = ["LINEAR", "functional_linear", "linear_arguments", "record_linear"]
