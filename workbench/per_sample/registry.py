"""The visible rule table: which function computes per-sample gradients for which layer type.

A *grad sampler* has one pure signature (the convention of Opacus' grad samplers,
Yousefpour et al. 2021, arXiv 2109.12298, §2 and Appendix B)::

    sampler(layer, activations, backprops) -> {param_name: Tensor(n, *param.shape)}

- ``activations``: the tuple of positional inputs the layer received in the forward pass
  (batch on dim 0), so a one-input layer reads ``a = activations[0]``;
- ``backprops``: the gradient of ``sum_i loss_i`` w.r.t. the layer's output, shape
  ``(n, *output.shape[1:])``. Because samples do not mix, its row i is the gradient of
  loss_i alone (the "highway gradient" of the Opacus paper, Eq. 4);
- ``param_name``: the layer's own attribute names (``"weight"``, ``"bias"``); the caller maps
  them to the model's dotted names. Only names of trainable parameters need to be returned.

Lookup is by *exact* type: a subclass may change ``forward``, so it does not inherit its
parent's sampler silently; register it explicitly (the same function usually works).

A sampler may come with a ``check(layer)`` that raises before any work is done when the
layer uses an option the sampler does not support (e.g. ``nn.Embedding(sparse=True)``).
"""

from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils.parametrize import is_parametrized

GradSamplerFn = Callable[[nn.Module, tuple, torch.Tensor], dict[str, torch.Tensor]]

GRAD_SAMPLERS: dict[type[nn.Module], GradSamplerFn] = {}
"""layer type -> grad sampler. Read it to see what is supported; add with the decorator."""

SAMPLER_CHECKS: dict[type[nn.Module], Callable[[nn.Module], None]] = {}
"""layer type -> ``check(layer)``, raising UnsupportedLayerError for unsupported options."""


def register_grad_sampler(*layer_types: type[nn.Module], check=None):
    """Decorator registering a grad sampler for one or more layer types.

    >>> import torch
    >>> from torch import nn
    >>> class Scale(nn.Module):
    ...     def __init__(self, d):
    ...         super().__init__()
    ...         self.s = nn.Parameter(torch.ones(d))
    ...     def forward(self, x):
    ...         return x * self.s
    >>> @register_grad_sampler(Scale)
    ... def scale_sampler(layer, activations, backprops):
    ...     return {"s": activations[0] * backprops}     # (n, d): d(x*s)/ds = x
    >>> GRAD_SAMPLERS[Scale] is scale_sampler
    True
    >>> del GRAD_SAMPLERS[Scale]
    """
    check_layer_types("register_grad_sampler", layer_types)
    if check is not None and not callable(check):
        raise TypeError(f"register_grad_sampler: check must be callable(layer); got {check!r}")

    def decorator(fn: GradSamplerFn) -> GradSamplerFn:
        check_callable("register_grad_sampler", fn)
        for layer_type in layer_types:
            GRAD_SAMPLERS[layer_type] = fn
            if check is not None:
                SAMPLER_CHECKS[layer_type] = check
        return fn

    return decorator


def check_layer_types(decorator: str, layer_types: tuple) -> None:
    """A registration decorator needs one or more nn.Module subclasses."""
    if not layer_types:
        raise TypeError(f"{decorator}() needs at least one layer type, e.g. "
                        f"@{decorator}(MyLayer)")
    for layer_type in layer_types:
        if not (isinstance(layer_type, type) and issubclass(layer_type, nn.Module)):
            raise TypeError(f"{decorator}: layer_types must be nn.Module subclasses; "
                            f"got {layer_type!r}")


def check_callable(decorator: str, fn) -> None:
    if not callable(fn):
        raise TypeError(f"{decorator} must decorate a function; got {fn!r}")


def layer_type(layer: nn.Module) -> type:
    """``type(layer)``, or the original class of a ``torch.nn.utils.parametrize``d layer
    (parametrize swaps in a generated subclass whose forward is the original's)."""
    kind = type(layer)
    if is_parametrized(layer) and kind.__name__.startswith("Parametrized"):
        return kind.__bases__[0]
    return kind


def find_grad_sampler(layer: nn.Module) -> GradSamplerFn | None:
    """The sampler registered for ``type(layer)`` (see ``layer_type``), or None."""
    return GRAD_SAMPLERS.get(layer_type(layer))
