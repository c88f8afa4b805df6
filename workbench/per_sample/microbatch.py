"""Per-sample gradients by micro-batching: the slow, obviously-correct reference.

One forward and one backward pass per sample (Yousefpour et al. 2021, arXiv 2109.12298,
Appendix A: "micro-batching"): for i = 1..n,

    g_i = ∇_θ ℓ(f(x_i; θ), y_i)

It works for any model whose samples do not interact, and every fast method in the workbench
is tested against it. It is slow on purpose: n small passes cannot use the hardware the way
one batched pass does.

Notation: n batch size, θ trainable parameters, ℓ the per-sample loss.
"""

import torch

from workbench.per_sample.checks import (
    alone,
    batch_runs,
    check_batch,
    check_losses,
    dense,
    forward,
    take,
    trainable_parameters,
)
from workbench.per_sample.hooks import output_tensors
from workbench.per_sample.memory import zeros_per_sample
from workbench.per_sample.state_replay import Snapshot


def microbatch_per_sample_gradients(model, loss_fn, inputs, targets, names=None):
    """``{name: Tensor(n, *param.shape)}`` by one backward pass per sample.

    A parameter that sample i does not reach gets a zero gradient for that sample.
    Dropout and other randomness in the model make each pass draw its own noise. Each pass
    starts from the model's state as the call found it (``state_replay.Snapshot``: a forward
    that writes a buffer or rebinds an attribute, a power iteration, a call counter), so
    after the call the model holds what one pass left, as a batched pass would.
    ``names``: only these trainable parameters.
    """
    n = check_batch(inputs, targets)
    params = {k: p for k, p in trainable_parameters(model).items()
              if names is None or k in names}
    grads = {name: zeros_per_sample((n, *p.shape), like=p) for name, p in params.items()}
    state = Snapshot(model)  # what a forward pass that writes the model's state reads

    def whole() -> bool:  # on a record's error only: does the batch run (checks.batch_runs)?
        state.rewind()
        return batch_runs(model, loss_fn, inputs, targets)

    for i in range(n):
        if i:
            state.rewind()  # as record 0 read it, not as records 0..i-1 left it
        rows = slice(i, i + 1)
        with alone(whole=whole):  # a model or loss that cannot: a clear refusal
            loss = loss_fn(forward(model, take(inputs, rows)), take(targets, rows))  # (1,)
        check_losses(loss, 1)
        g_i = torch.autograd.grad(loss.sum(), list(params.values()), allow_unused=True)
        for name, g in zip(params, g_i):
            if g is not None:
                grads[name][i] = g.to_dense() if g.is_sparse else g  # Embedding(sparse=True):
                # a raw "copy_() between dense and sparse" error until 2026-11-30
    return grads


def layer_microbatch_grad_sampler(layer, args, kwargs, backprops, flat: bool = False):
    """One layer's per-sample gradients from its recorded inputs and output gradient, by a
    loop over samples: o_i = layer(a_i), g_i = (∂o_i/∂w)ᵀ b_i. The layer-level reference,
    used where the loss is not at hand (the DP optimizer's ``method="microbatch"``);
    every Tensor argument must carry the batch on dim 0 (``flat``: as (n, T, ...), a call on
    batch-flattened rows, each sample called on its T rows as flattened, (T, ...))."""
    own = {name: p for name, p in layer.named_parameters(recurse=False) if p.requires_grad}
    many = isinstance(backprops, (tuple, list))  # a layer returning a tuple of Tensors
    n = (backprops[0] if many else backprops).shape[0]
    grads = {name: zeros_per_sample((n, *p.shape), like=p) for name, p in own.items()}

    def row(t, i):
        return dense((t[i] if flat else t[i:i + 1]).detach()) if isinstance(t, torch.Tensor) \
            else t

    for i in range(n):
        args_i = tuple(row(t, i) for t in args)
        kwargs_i = {k: row(v, i) for k, v in kwargs.items()}
        with torch.enable_grad():
            o_i = layer.forward(*args_i, **kwargs_i)  # .forward: no recording hooks
        outs = output_tensors(o_i)  # a tuple's Tensors, None skipped (as its b)
        b_i = [row(b, i) for b in backprops] if many else [row(backprops, i)]
        g_i = torch.autograd.grad(outs, list(own.values()), b_i, allow_unused=True)
        for name, g in zip(own, g_i):
            if g is not None:
                grads[name][i] = g.to_dense() if g.is_sparse else g
    return grads


__all__ = ["layer_microbatch_grad_sampler", "microbatch_per_sample_gradients"]
