"""A parameter used by ``F.linear`` or ``F.embedding`` outside a layer that owns it.

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

**The lookup op of an Embedding subclass.** OPT's and BART's learned positional embeddings
are ``nn.Embedding`` subclasses whose ``forward(attention_mask)`` builds its own indices
(``cumsum(mask) - 1``, or ``arange(T)``, then ``+ 2``) and ends in ``F.embedding(ids, W)``;
the module's input is not the indices, so the Embedding rule cannot be applied to its call
(and must not be inherited: ``registry.find_rule``). The op itself *is* an Embedding's:

    o = F.embedding(x, W)        ∂ℓ_i/∂W = Σ_t e_{x_{i,t}} b_{i,t}ᵀ     (n, V, d)  embedding.py

with x the indices actually passed. So an ``nn.Embedding`` subclass without a rule of its own
is *not* hooked as a layer (``delegates``): every use of its parameter is a use outside a
layer, each ``F.embedding(x, W)`` is recorded as a call of a functional ``nn.Embedding`` with
the same options, and any other use of W is uncovered (exact fallback). Whatever the forward
computes around the lookup (its indices, a scale after it) is then the model's business, and
the rule is exact without knowing how the indices were built. Options whose rule differs
(``max_norm``, ``sparse``, ``scale_grad_by_freq``) are not recorded: exact fallback.

Notation: n batch, x activations (n, ..., d) or indices (n, T), b backprops (n, ..., p),
W (p, d), c bias (p,), V vocabulary, d width.
"""

import torch
from torch import nn
from torch.nn import functional as F

from workbench.per_sample.registry import find_grad_sampler

LINEAR = F.linear  # the builtins the use tracker receives as ``func``
EMBEDDING = F.embedding


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


def outside(tracker, where: str, *params) -> bool:
    """Are ``params`` (None skipped) tracked parameters used outside their owners here?"""
    owners = tracker.owners
    return all(id(p) in owners and where not in owners[id(p)] for p in params if p is not None)


def record_call(tracker, path: str, make, params: dict, args: tuple, result) -> bool:
    """Record ``result = layer(*args)`` of the functional layer at ``path`` (``make()`` builds
    it the first time); False when that layer holds other Parameter objects than ``params``."""
    recorder = tracker.recorder
    layer = recorder.layers[path] if path in recorder.layers else recorder.add_layer(path, make())
    if any(getattr(layer, name) is not p for name, p in params.items()):
        return False  # two parameters with one name (should not happen): stay uncovered
    recorder.add_call(path, layer, args, {}, result)
    return True


def record_linear(tracker, args, kwargs, result, where: str) -> bool:
    """Record a functional ``F.linear`` call of tracked parameters as a Linear call.

    Returns False (nothing recorded: the uses stay uncovered) unless W is a tracked parameter
    used outside its owners, c is None or such a parameter too, and x is a plain tensor.
    """
    x, W, c = linear_arguments(args, kwargs)
    if (not outside(tracker, where, W, c) or W.dim() != 2 or not isinstance(x, torch.Tensor)
            or id(x) in tracker.owners):
        return False
    names = [tracker.names.get(id(p), "a parameter") for p in (W, c) if p is not None]
    return record_call(tracker, f"F.linear({', '.join(names)})",
                       lambda: functional_linear(W, c), {"weight": W, "bias": c}, (x,), result)


EMBEDDING_OPTIONS = ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")


def embedding_arguments(args, kwargs) -> dict:
    """{input, weight, padding_idx, ...} of an ``F.embedding`` call."""
    return dict(zip(("input", "weight", *EMBEDDING_OPTIONS), args), **kwargs)


def functional_embedding(weight: nn.Parameter, padding_idx=None) -> nn.Embedding:
    """An ``nn.Embedding`` whose weight *is* the given Parameter object."""
    layer = nn.Embedding(1, 1, device="meta")  # allocates nothing
    del layer.weight
    layer.weight = weight
    layer.num_embeddings, layer.embedding_dim = weight.shape
    layer.padding_idx = padding_idx  # F.embedding's, already made non-negative
    return layer


def record_embedding(tracker, args, kwargs, result, where: str) -> bool:
    """Record a functional ``F.embedding(x, W)`` of a tracked parameter W used outside its
    owners (an Embedding subclass's lookup: module docstring) as an Embedding call."""
    values = embedding_arguments(args, kwargs)
    x, W = values.get("input"), values.get("weight")
    if (not outside(tracker, where, W) or W.dim() != 2 or not isinstance(x, torch.Tensor)
            or x.is_floating_point() or values.get("max_norm") is not None
            or values.get("sparse") or values.get("scale_grad_by_freq")):
        return False  # an option whose gradient differs: uncovered, the exact fallback
    pad = values.get("padding_idx")
    path = f"F.embedding({tracker.names.get(id(W), 'a parameter')}, padding_idx={pad})"
    return record_call(tracker, path, lambda: functional_embedding(W, pad), {"weight": W},
                       (x,), result)


FUNCTIONAL = {LINEAR: record_linear, EMBEDDING: record_embedding}
"""torch function -> how its call on parameters outside their owners becomes a layer call."""


def delegates(module: nn.Module) -> bool:
    """An ``nn.Embedding`` subclass without a rule of its own (its forward builds indices):
    not hooked as a layer, its lookups are recorded as functional Embedding calls instead."""
    return isinstance(module, nn.Embedding) and find_grad_sampler(module) is None


__all__ = [
    "EMBEDDING", "EMBEDDING_OPTIONS", "FUNCTIONAL", "LINEAR", "delegates",
    "embedding_arguments", "functional_embedding", "functional_linear", "linear_arguments",
    "outside", "record_call", "record_embedding", "record_linear",
]
