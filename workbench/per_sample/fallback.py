"""The exact fallback: per-sample gradients of some parameters from the whole model.

Where no per-layer rule can be trusted for a parameter (``recording.py`` says why), its
per-sample gradient is computed from the model and the loss as a whole, which is exact
whatever the model does with the parameter:

    g_i^p = ∂ℓ(f(x_i; θ), y_i) / ∂p

by ``vmap(grad(...))`` restricted to those parameters (``functional.py``), and, where
``torch.func`` cannot run the model (data-dependent control flow, ``.item()``, in-place
writes into the batch), by micro-batching (``microbatch.py``), with a warning that says what
it costs. Only the fallback parameters are materialised: (n, *p.shape) each.

**Randomness** (dropout): vmap and micro-batching run each record alone, which draws other
masks than the batch did, so their g_i is not the gradient the batch computed (and the
self-check, which replays the batch's masks, would refuse it). For a model that drew random
numbers (``replay``: the random state of its forward pass) the fallback runs the batch's
forward pass again from that state, so every record gets its own mask of the batch, and
takes each record's gradient from the per-record losses ℓ (n,) by one backward pass batched
over the rows of the identity (``is_grads_batched``; one backward pass per record where
that cannot run):

    g_i^p = ∂⟨e_i, ℓ(f(x; θ, masks), y)⟩ / ∂p        e_i: the i-th unit vector          (1)

exact when records do not mix (which the self-check verifies with the same masks). A layer
without a per-layer rule whose forward holds a stochastic module (``redraws``: dropout in
training mode) would meet the same problem in the per-layer vmap (each record's call alone,
other masks): its parameters come here instead.

Notation: n batch size, θ trainable parameters, p one parameter, ℓ per-sample loss.
"""

import warnings
from contextlib import contextmanager

import torch
from torch.nn.modules.dropout import _DropoutNd

from workbench.errors import WorkbenchError
from workbench.per_sample.checks import forward
from workbench.per_sample.functional import vmap_per_sample_gradients
from workbench.per_sample.microbatch import microbatch_per_sample_gradients
from workbench.per_sample.uses import LOSS

_WARNED: set[tuple] = set()


def exact_per_sample_gradients(model, loss_fn, inputs, targets, names, reasons=(),
                               replay=None):
    """{name: Tensor(n, *p.shape)} for ``names``, exact (vmap, else micro-batching; with
    ``replay`` = (random state, device) of a random forward pass: Eq. (1))."""
    if not names:
        return {}
    if replay is not None:
        return replayed_per_sample_gradients(model, loss_fn, inputs, targets, names, *replay)
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


@contextmanager
def replayed(state: tuple, device: torch.device):
    """Inside: the random state ``state``; outside: the caller's, untouched."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def replayed_per_sample_gradients(model, loss_fn, inputs, targets, names, rng, device):
    """Eq. (1): the batch's forward pass replayed from ``rng``, then one row of g per record."""
    params = dict(model.named_parameters())
    ps = [params[k] for k in names]
    with replayed(rng, device), torch.enable_grad():
        losses = loss_fn(forward(model, inputs), targets).reshape(-1)  # (n,)
    n = losses.shape[0]
    try:
        eye = torch.eye(n, dtype=losses.dtype, device=losses.device)
        grads = torch.autograd.grad(losses, ps, grad_outputs=eye, is_grads_batched=True,
                                    allow_unused=True, retain_graph=True)
    except (RuntimeError, NotImplementedError):  # an op without a batching rule
        rows = [torch.autograd.grad(losses[i], ps, allow_unused=True, retain_graph=True)
                for i in range(n)]
        grads = [None if all(r[k] is None for r in rows) else torch.stack(
            [torch.zeros_like(p) if r[k] is None else r[k] for r in rows])
            for k, p in enumerate(ps)]
    return {k: torch.zeros(n, *p.shape, dtype=p.dtype, device=p.device) if g is None else g
            for k, p, g in zip(names, ps, grads)}


def redraws(layer) -> str | None:
    """Why the per-layer vmap of a layer without a rule would redraw random numbers, or None:
    a stochastic submodule in training mode (Dropout, RReLU, an attention dropout rate)."""
    from workbench.per_sample.registry import find_grad_sampler

    if find_grad_sampler(layer) is not None:
        return None
    for name, m in layer.named_modules():
        rate = getattr(m, "p", None) if isinstance(m, _DropoutNd) else next(
            (v for k, v in vars(m).items() if "dropout" in k and isinstance(v, float)), None)
        if m.training and ((rate or 0) > 0 or isinstance(m, torch.nn.RReLU)):
            return (f"has no per-layer rule and draws random numbers in {type(m).__name__} "
                    f"at {name or 'itself'} (the per-layer vmap would draw other masks "
                    f"than the batch): computed from the whole model with the batch's "
                    f"random state replayed")
    return None


def warn_once(model, names, why: str) -> None:
    key = (id(model), tuple(names))
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"per-sample gradients of {', '.join(names)} cannot come from a "
                      f"per-layer rule or vmap ({why}); computing them exactly by micro-batching "
                      f"instead: one forward and backward pass per sample, about n times slower "
                      f"for these parameters", stacklevel=5)


def alone_differs(total: float, rel: float, names, why: str) -> str:
    """The words of a failed comparison of the fallback's Σ_i g_i, each record run alone, with
    the batch's own gradient (``selfcheck.compare_alone``, the optimizer's path check):
    ``names`` the parameters off, ``why`` the reason their layer took the fallback."""
    return (f"the gradient of the loss over the batch differs from the sum of the per-record "
            f"gradients by {total:.3g} (relative {rel:.3g}), mostly in {', '.join(names)}, "
            f"whose per-record gradients come from the model run on one record at a time "
            f"because {why}: the model treats a record differently in the batch than alone, "
            f"so a record's gradient depends on which records Poisson sampling put beside it "
            f"and where (a layer applied to a fixed slice of the batch, x[:k], or to rows "
            f"picked by position), and clipping it bounds nothing. Apply the layer to every "
            f"record and choose by each record's own data (torch.where on a per-record mask)")


__all__ = ["alone_differs", "exact_per_sample_gradients", "warn_once"]
