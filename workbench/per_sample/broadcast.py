"""A layer called without the batch and broadcast into it: ``tok + wpe(arange(T))``.

nanoGPT's positional embedding ``o = P[arange(T)]`` (T, C) has no batch dim; it meets the
batch once, in ``h = a + o`` with a (n, T, C). The gradient of the loss at o is Σ_i ∂ℓ_i/∂o,
the per-sample parts already summed, so o's own backprop cannot give per-sample gradients.
They are where o meets the batch: h_i = a_i + o, so if o is used nowhere else

    ∂ℓ_i/∂o = Σ_{broadcast dims} ∂ℓ_i/∂h_i                 (n, *o.shape) from (n, *h.shape[1:])

(``Tensor.sum_to_size``), and row i of ∂(Σ_j ℓ_j)/∂h is ∂ℓ_i/∂h_i because samples do not mix,
the assumption of every hook rule (``hooks.py``). A *position-wise* layer (its leading dims
are batch-like: Embedding, Linear, LayerNorm) called on the input x expanded to n copies
returns o expanded to n copies, so the call is recorded as if it had been that one,

    activations  x.expand(n, *x.shape)      backprops  ∂ℓ_i/∂o  (n, *o.shape)

and the layer's ordinary rule (grad sampler, norm sampler, book-keeping's weight gradient
from c ⊙ b) applies to it unchanged.

When is this done? The use tracker (``uses.py``) counts every differentiable use of the
output o of such a call during the forward pass and the loss. Exactly one use, an ``add``
(``+``, ``torch.add``, ``+=``) with a tensor that carries dim 0 of the result, where o is
broadcast along that dim 0 (o has fewer dims than h, or size 1 in dim 0): converted. A no-op that
returns o itself (``o.to(o.device)``, as Hugging Face's GPT-2 writes it) is not a use. Anything
else (o used twice, a view of o, ``a - o``) keeps the call as it was; its dim 0 is then not the
batch and ``recording.py`` sends its parameters to the exact fallback. The self-check
(``selfcheck.py``) runs the same conversion at n = 1 and compares the result with
micro-batching, which verifies the assumption numerically.

Notation: n batch size, T sequence length, C width, o the batch-free output, h = a + o.
"""

import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

# position-wise layers: layer(x.expand(n, *x.shape)) == layer(x).expand(n, *o.shape), exact type
BROADCASTABLE = (nn.Embedding, nn.Linear, nn.LayerNorm)
ADDS = {"add", "add_", "__add__", "__radd__", "__iadd__"}


@dataclass
class Meeting:
    """Where a batch-free call's output o meets the batch: h's gradient edge, and the sizes."""

    edge: GradientEdge  # h = a + o
    target: tuple  # (n, 1, ..., *o_rest): h's gradient summed to this size
    shape: tuple  # (n, *o_rest): the per-sample backprop of the expanded call

    def reduce(self, grad_h: torch.Tensor) -> torch.Tensor:
        """∂ℓ_i/∂o (n, *o_rest) from ∂(Σ ℓ)/∂h (n, *h.shape[1:])."""
        return grad_h.sum_to_size(self.target).reshape(self.shape)


@dataclass
class _Watched:
    ref: weakref.ref  # the output o (weakly: an id alone may be reused after o is freed)
    call: object  # hooks.LayerCall
    uses: int = 0
    edge: GradientEdge | None = None  # h's edge, if the first use was a meeting add
    h_shape: tuple = ()


def meets_batch(func, args, kwargs, o: torch.Tensor, h) -> bool:
    """Is ``h = func(*args)`` an add in which o is broadcast along h's batch dim 0?"""
    if getattr(func, "__name__", "") not in ADDS or len(args) != 2 or kwargs.get("alpha", 1) != 1:
        return False
    if args[0] is o and func.__name__ in ("add_", "__iadd__"):
        return False  # o += a: o itself is overwritten
    a = args[1] if args[0] is o else args[0]
    if not (isinstance(a, torch.Tensor) and isinstance(h, torch.Tensor) and h.dim() >= 1):
        return False
    carries = a.dim() == h.dim() and a.shape[0] == h.shape[0]
    broadcast = 1 <= o.dim() < h.dim() or (o.dim() == h.dim() and o.shape[0] == 1)
    return carries and broadcast and h.requires_grad


class BatchFree:
    """The outputs of position-wise layer calls during one forward pass, and their uses."""

    def __init__(self):
        self.watched: dict[int, _Watched] = {}  # id(o) -> the entry of the live o
        self.entries: list[_Watched] = []  # all, also of outputs freed (their ids reused)

    def watch(self, call, output: torch.Tensor) -> None:
        entry = _Watched(weakref.ref(output), call)
        self.watched[id(output)] = entry
        self.entries.append(entry)

    def saw(self, func, args, kwargs, result, differentiable) -> None:
        """Count the uses of watched outputs among the arguments of one torch function."""
        for a in (*args, *kwargs.values()):
            if type(a) in (list, tuple):
                for b in a:
                    self._use(b, func, args, kwargs, result, differentiable)
            else:
                self._use(a, func, args, kwargs, result, differentiable)

    def _use(self, a, func, args, kwargs, result, differentiable) -> None:
        entry = self.watched.get(id(a))
        if entry is None or entry.ref() is not a or not differentiable(result):
            return
        if result is a:  # a no-op returning o itself (Hugging Face's ``o.to(device)``)
            return
        entry.uses += 1
        if entry.uses == 1 and meets_batch(func, args, kwargs, a, result):
            entry.edge, entry.h_shape = get_gradient_edge(result), tuple(result.shape)

    def exclude(self, tensors) -> None:
        """Outputs the model returns: their uses in the loss are not seen (optimizer)."""
        for t in tensors:
            entry = self.watched.get(id(t))
            if entry is not None and entry.ref() is t:
                entry.uses += 2  # never converted

    def finish(self, recorder) -> None:
        """After the forward pass (and loss): convert each call used once, in a meeting."""
        for entry in self.entries:  # o itself may be freed by now
            if entry.uses == 1 and entry.edge is not None:
                convert(recorder, entry.call, entry.edge, entry.h_shape)
        self.watched.clear()
        self.entries.clear()


def expanded(t: torch.Tensor, n: int, new_dim: bool) -> torch.Tensor | None:
    if new_dim:
        return t.unsqueeze(0).expand(n, *t.shape)  # (n, *x.shape)
    return t.expand(n, *t.shape[1:]) if t.dim() >= 1 and t.shape[0] == 1 else None


def convert(recorder, call, edge: GradientEdge, h_shape: tuple) -> None:
    """Record ``call`` as the call on the inputs expanded to the batch (module docstring)."""
    if call.is_tuple or len(call.outputs) != 1 or any(isinstance(v, torch.Tensor)
                                                      for v in call.kwargs.values()):
        return
    o_shape, dtype, device = call.outputs[0]
    n, new_dim = h_shape[0], len(o_shape) < len(h_shape)
    args = [expanded(a, n, new_dim) if isinstance(a, torch.Tensor) else a for a in call.args]
    if any(e is None for e in args):
        return
    rest = tuple(o_shape) if new_dim else tuple(o_shape[1:])
    target = (n, *[1] * (len(h_shape) - 1 - len(rest)), *rest)
    call.args = tuple(args)
    call.meet = Meeting(edge, target, (n, *rest))
    call.outputs = [(torch.Size((n, *rest)), dtype, device)]
    recorder.redirect(call, edge)


__all__ = ["ADDS", "BROADCASTABLE", "BatchFree", "Meeting", "convert", "expanded", "meets_batch"]
