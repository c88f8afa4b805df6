"""The exact fallback: per-sample gradients of some parameters from the whole model.

Where no per-layer rule can be trusted for a parameter (``recording.py`` says why), its
per-sample gradient is computed from the model and the loss as a whole, which is exact
whatever the model does with the parameter:

    g_i^p = ∂ℓ(f(x_i; θ), y_i) / ∂p

by ``vmap(grad(...))`` restricted to those parameters (``functional.py``), and, where
``torch.func`` cannot run the model (data-dependent control flow, ``.item()``, in-place
writes into the batch), by micro-batching (``microbatch.py``), with a warning that says what
it costs. Only the fallback parameters are materialised: (n, *p.shape) each.

Notation: n batch size, θ trainable parameters, p one parameter, ℓ per-sample loss.
"""

import warnings

from workbench.errors import WorkbenchError
from workbench.per_sample.functional import vmap_per_sample_gradients
from workbench.per_sample.microbatch import microbatch_per_sample_gradients
from workbench.per_sample.uses import LOSS

_WARNED: set[tuple] = set()


def exact_per_sample_gradients(model, loss_fn, inputs, targets, names, reasons=()):
    """{name: Tensor(n, *p.shape)} for ``names``, exact (vmap, else micro-batching)."""
    if not names:
        return {}
    if any(LOSS in reason for reason in reasons):  # vmap's functional_call cannot swap those
        warn_once(model, names, "the loss function reads them directly, outside the model, "
                  "where torch.func cannot substitute them")
        return microbatch_per_sample_gradients(model, loss_fn, inputs, targets,
                                               names=set(names))
    try:
        return vmap_per_sample_gradients(model, loss_fn, inputs, targets, names=set(names))
    except WorkbenchError:
        raise
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as error:
        why = "; ".join(reasons) or "no per-layer rule applies"
        warn_once(model, names, f"{why}; and torch.func.vmap cannot run this model "
                  f"({type(error).__name__}: {str(error).splitlines()[0][:160]})")
        return microbatch_per_sample_gradients(model, loss_fn, inputs, targets,
                                               names=set(names))


def warn_once(model, names, why: str) -> None:
    key = (id(model), tuple(names))
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"per-sample gradients of {', '.join(names)} cannot come from a "
                      f"per-layer rule or vmap ({why}); computing them exactly by micro-batching "
                      f"instead: one forward and backward pass per sample, about n times slower "
                      f"for these parameters", stacklevel=5)


__all__ = ["exact_per_sample_gradients", "warn_once"]
