"""Every way a loop starts a backward pass, read as one request: where it starts, with which
output gradient, into which tensors.

The loss window (``loss_watch.LossFunctions``) checks the loss before the backward pass runs:
its records' attribution, batch statistics, reduction and coupling. The loss it checks is
the *objective* the pass differentiates, whatever spelling starts it:

- ``loss.backward()``, ``torch.autograd.backward(loss)``: L = loss (a scalar);
- ``losses.backward(v)``, ``torch.autograd.backward([l1, l2], [v1, v2])``,
  ``torch.autograd.grad(l, inputs, grad_outputs=v)``: the pass computes the gradient of
  L = Σ_k ⟨v_k, l_k⟩ (the vector-Jacobian product's definition), so that scalar is checked;
  a v_k with every entry equal to one number c is the scalar c · l_k.sum(), written
  ``l_k.sum() / m`` when c = 1 / m for a whole number m (``loss.backward(ones / n)`` reads
  as the mean it is, not as a sum times a tensor, ``record_reduction.py``).

Until 2026-11-29 the window read only ``loss.backward()``'s first argument: a per-record
loss vector given its gradient (``losses.backward(torch.ones(n))``) skipped every check with
a warning, and ``torch.autograd.backward((loss,))`` (a tuple where a Tensor was looked for)
skipped them silently: a loss coupling records through logits centred over the batch was
then clipped record by record as if it did not, the sensitivity no longer C.

What the request is, ``kind`` says:

- ``"training"``: ``backward`` into every leaf: the pass of the step, checked;
- ``"restricted"``: ``backward(inputs=...)`` naming some of the model's parameters: refused.
  Autograd then runs only the nodes leading to those tensors, and the optimizer keeps the
  weights of the layers it taps out of the graph (``skip_weights.py``), so whole layers'
  backprops went missing: the self-check failed on the first step, and with it off the
  clipped sums were wrong;
- ``"aside"``: a pass writing no parameter's ``.grad``: ``torch.autograd.grad`` (FGSM's input
  gradient, a saliency map, a gradient norm for a log, the workbench's own functional API
  run on the private model) or ``backward(inputs=...)`` into none of the parameters. It is
  no pass of the step, so it runs unrecorded and unchecked; until 2026-11-29 its backprops
  were recorded as a pass of the step (FGSM's step was refused, blaming an L2 penalty);
- ``"second order"``: ``torch.autograd.grad(..., create_graph=True)``: aside too, but its
  results carry a graph back into the parameters; a training loss that reads them (a
  gradient penalty, an input-gradient regulariser, a physics-informed residual) gives the
  parameters' gradient second-order terms that no record's gradient at the model's outputs
  carries, and is refused by name at its ``backward`` (``LossWatch.second_order``).

Notation: l_k the tensors the pass starts from, v_k their gradients (None: 1 for a scalar).
"""

from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge

ENTRY_POINTS = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)


@dataclass
class BackwardCall:
    """One request for a backward pass (module docstring)."""

    roots: list  # [(l_k, v_k)]: the Tensors it starts from and their gradients (or None)
    inputs: tuple | None  # the tensors it differentiates into; None: every leaf (backward)
    create_graph: bool
    grad: bool  # torch.autograd.grad: returns the gradients, writes no .grad

    def kind(self, parameter_ids: set[int]) -> str:
        """"training", "restricted", "aside" or "second order" (module docstring)."""
        if self.grad:
            return "second order" if self.create_graph else "aside"
        if self.inputs is None:
            return "training"
        if any(id(t) in parameter_ids for t in self.inputs if isinstance(t, torch.Tensor)):
            return "restricted"
        return "aside"


def _as_tuple(x) -> tuple:
    if x is None:
        return ()
    if isinstance(x, (torch.Tensor, GradientEdge)):
        return (x,)
    return tuple(x)


def backward_call(func, args, kwargs) -> BackwardCall:
    """The request ``func(*args, **kwargs)`` makes, for one of ``ENTRY_POINTS`` as the
    TorchFunctionMode receives it (positional or keyword)."""
    def arg(k, name, default=None):
        return args[k] if len(args) > k else kwargs.get(name, default)

    if func is torch.Tensor.backward:
        roots = [(arg(0, "self"), arg(1, "gradient"))]
        inputs = arg(4, "inputs")
        return BackwardCall(roots, None if inputs is None else _as_tuple(inputs),
                            bool(arg(3, "create_graph", False)), grad=False)
    if func is torch.autograd.backward:
        tensors = _as_tuple(arg(0, "tensors"))
        grads = _as_tuple(arg(1, "grad_tensors", kwargs.get("grad_variables")))
        inputs = arg(5, "inputs")
        create = arg(3, "create_graph", False)
        grad = False
    else:  # torch.autograd.grad
        tensors = _as_tuple(arg(0, "outputs"))
        grads = _as_tuple(arg(2, "grad_outputs"))
        inputs = arg(1, "inputs", ())
        create = arg(4, "create_graph", False)
        grad = True
    grads = grads or (None,) * len(tensors)
    return BackwardCall(list(zip(tensors, grads)),
                        None if inputs is None else _as_tuple(inputs), bool(create), grad)


def objective(roots, through):
    """The scalar L = Σ_k ⟨v_k, l_k⟩ the pass differentiates (module docstring), each op
    computed by ``through(func, *args)`` (the loss window's own handler, so that its
    followers see the products and sums as they see the loop's ops); ``roots`` non-empty.
    A single scalar root without v is returned as it is."""
    if len(roots) == 1 and roots[0][1] is None:
        return roots[0][0]
    total = None
    for t, v in roots:
        if v is None:  # a scalar: its own gradient is 1
            term = t
        elif not isinstance(v, torch.Tensor):  # a number for a scalar
            term = through(torch.Tensor.mul, t, float(v))
        else:
            term = _weighted(t, v.detach() if v.requires_grad else v, through)  # v itself:
            # the batch statistics' follower knows it by identity (w / w.sum())
        total = term if total is None else through(torch.Tensor.add, total, term)
    return total


def _weighted(t, v, through):
    """⟨v, t⟩, as a sum divided by a whole number where v is one number 1/m everywhere."""
    if v.numel() and v.shape == t.shape:
        first = v.reshape(-1)[0]
        if bool((v == first).all()):
            c = float(first)
            total = through(torch.Tensor.sum, t)
            if c == 1.0:
                return total
            m = round(1.0 / c) if c else 0
            if m >= 1 and abs(m * c - 1.0) <= 1e-12:
                return through(torch.Tensor.div, total, m)
            return through(torch.Tensor.mul, total, c)
    return through(torch.Tensor.sum, through(torch.Tensor.mul, t, v))


__all__ = ["ENTRY_POINTS", "BackwardCall", "backward_call", "objective"]
