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
    check_batch,
    check_losses,
    forward,
    take,
    trainable_parameters,
)
from workbench.per_sample.memory import zeros_per_sample


def microbatch_per_sample_gradients(model, loss_fn, inputs, targets):
    """``{name: Tensor(n, *param.shape)}`` by one backward pass per sample.

    A parameter that sample i does not reach gets a zero gradient for that sample.
    Dropout and other randomness in the model make each pass draw its own noise.
    """
    n = check_batch(inputs, targets)
    params = trainable_parameters(model)
    grads = {name: zeros_per_sample((n, *p.shape), like=p) for name, p in params.items()}
    for i in range(n):
        rows = slice(i, i + 1)
        loss = loss_fn(forward(model, take(inputs, rows)), take(targets, rows))  # (1,)
        check_losses(loss, 1)
        g_i = torch.autograd.grad(loss.sum(), list(params.values()), allow_unused=True)
        for name, g in zip(params, g_i):
            if g is not None:
                grads[name][i] = g
    return grads
