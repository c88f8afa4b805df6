"""The per-sample loss and the plain step every benchmark times or measures.

- ``sum_of_products(outputs, targets)``: ℓ_i = Σ over the non-batch dims of o_i ⊙ t_i, a
  per-sample loss for a layer of any output shape (the targets t have the output's shape;
  ``layer_specs.make_case`` draws them). Its backprop at the output is t itself, so every
  method sees the same, well-scaled gradients whatever the layer.
- ``plain_step(model, x, t)``: the non-private baseline, one forward and one backward pass of
  Σ_i ℓ_i to the trainable parameters' gradients (no per-sample anything).
"""

import torch


def sum_of_products(outputs, targets):
    """A per-sample loss for any output shape: Σ over non-batch dims of o ⊙ t. Shape (n,)."""
    return (outputs * targets).reshape(len(outputs), -1).sum(1)


def plain_step(model, x, t, loss_fn=sum_of_products, reduce=torch.sum):
    """∇_θ reduce(loss_fn(model(x), t)) for the trainable parameters θ: one plain step.

    ``reduce``: ``torch.sum`` (Σ_i ℓ_i, what the clipped sum is compared with) or
    ``torch.mean`` (the mean loss of ordinary training, as in ``bench e2e``).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(reduce(loss_fn(model(x), t)), params)


__all__ = ["plain_step", "sum_of_products"]
