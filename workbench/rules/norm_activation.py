"""A normalisation layer that applies its own activation, recognised by what it computes
(Hugging Face BiT's ``BitGroupNormActivation``: ``act(group_norm(x))`` in one module).

The layer computes o = act(z) with z = γ ⊙ â + β its parent normalisation's output (``norms.py``)
and ``act`` its one parameter-free submodule, which treats each sample alone. Then

    ∂ℓ_i/∂z_i = J_act(z_i)ᵀ b_i                                                     (1)

for the whole batch in one vector-Jacobian product of ``act`` at z with b, exact per sample
because ``act`` mixes no samples, and the parent's rule turns (a, ∂ℓ/∂z) into γ's and β's
per-sample gradients: ∂ℓ_i/∂γ = Σ_{positions} ∂ℓ_i/∂z_i ⊙ â_i, ∂ℓ_i/∂β = Σ ∂ℓ_i/∂z_i.
The norm is fast gradient clipping's (the parent's has no norm rule either), and
book-keeping's clipped sum re-runs the layer on its stored input with c ⊙ b.

``norm_activation(layer)`` is the test behind the rule (``LayerRule(matches=...)``): an
``nn.GroupNorm`` or ``nn.LayerNorm`` subclass with one submodule holding no parameters, whose
``forward`` on a float64 probe equals that submodule applied to the parent's functional form,
and whose submodule gives a sample alone the same rows as in the batch. Anything else keeps
per-layer vmap.

Notation: n batch, a activations, b backprops, z the normalised and scaled input, γ weight,
β bias.
"""

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.stateless import _reparametrize_module

from workbench.rules._rule import PROBE_ERRORS, LayerRule, probe_forward, register_rule
from workbench.rules.conv_chunks import in_chunks
from workbench.rules.norms import group_norm_grad_sampler, layer_norm_grad_sampler

TOLERANCE = 1e-10  # relative, float64 probe


def group_norm(layer, x):
    return F.group_norm(x, layer.num_groups, layer.weight, layer.bias, layer.eps)


def layer_norm(layer, x):
    return F.layer_norm(x, layer.normalized_shape, layer.weight, layer.bias, layer.eps)


PARENTS = {nn.GroupNorm: (group_norm, group_norm_grad_sampler),
           nn.LayerNorm: (layer_norm, layer_norm_grad_sampler)}


def parent(layer):
    """(functional form, grad rule) of the normalisation ``layer`` subclasses, or None."""
    for kind, found in PARENTS.items():
        if isinstance(layer, kind) and type(layer) is not kind:
            return found
    return None


def activation(layer) -> nn.Module | None:
    """The layer's one submodule when it holds no parameters, else None."""
    children = list(layer.children())
    if len(children) != 1 or any(True for _ in children[0].parameters()):
        return None
    return children[0]


def probe_input(layer, g, device):
    if isinstance(layer, nn.GroupNorm):
        shape = (3, layer.num_channels, 3, 2)
    else:
        shape = (3, 2, *layer.normalized_shape)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(device)


def norm_activation(layer) -> bool:
    """Whether ``layer`` computes act(norm(x)) as the module docstring says (the registry
    caches the verdict per layer: ``per_sample.registry.by_behaviour``)."""
    found, act = parent(layer), activation(layer)
    own = dict(layer.named_parameters(recurse=False))
    if found is None or act is None or set(own) - {"weight", "bias"}:
        return False
    g = torch.Generator().manual_seed(0)
    device = next(iter(own.values())).device if own else torch.device("cpu")
    params = {k: torch.randn(p.shape, generator=g, dtype=torch.float64).to(device)
              for k, p in own.items()}
    x = probe_input(layer, g, device)
    try:
        with torch.no_grad(), _reparametrize_module(layer, params):
            out = probe_forward(layer, x)
            z = found[0](layer, x)
            want = act(z.clone())
            alone = act(z[:1].clone())
    except PROBE_ERRORS:
        return False
    close = lambda u, v: (u.dtype == torch.float64 and u.shape == v.shape  # noqa: E731
                          and (u - v).norm() <= TOLERANCE * v.norm())
    return close(out, want) and close(want[:1], alone)


SCRATCH = 5  # z, its clone, act's output, ∂ℓ/∂z, then â and ∂ℓ/∂z ⊙ â: per input number


def norm_activation_grad_sampler(layer, activations, backprops):
    """The parent's rule on (a, ∂ℓ/∂z), ∂ℓ/∂z by (1), over the batch in chunks whose scratch
    (``SCRATCH`` times their input) is bounded by a quarter of the call's a and b or
    ``MIN_CHUNK`` samples (``conv_chunks.in_chunks``), so book-keeping streams it
    (``LayerRule.streams``)."""
    a = activations[0]
    return in_chunks(_norm_activation_grads, layer, a, backprops,
                     SCRATCH * (a[0].numel() if a.dim() and a.shape[0] else 0),
                     capped=False)  # chunks of at least MIN_CHUNK samples, also in the
    # backward pass: each chunk re-runs the norm and a vector-Jacobian product, at about the
    # whole call's cost at small n (BiT, base, n = 16: its normalisations in three chunks
    # each took 23.0 ms of CPU per DP step against 20.9 whole, with the same peak)


def _norm_activation_grads(layer, activations, backprops):
    functional, rule = parent(layer)
    a = activations[0]
    with torch.no_grad():
        z = functional(layer, a)
    with torch.enable_grad():
        leaf = z.detach().requires_grad_()
        out = activation(layer)(leaf.clone())  # a clone: an in-place activation is allowed
        (dz,) = torch.autograd.grad(out, leaf, backprops)
    del z, leaf, out  # before the parent's rule makes â and ∂ℓ/∂z ⊙ â
    return rule(layer, (a,), dz)


RULE = register_rule(LayerRule("normalisation with its own activation (o = act(γ ⊙ â + β))",
                               grad=norm_activation_grad_sampler, matches=norm_activation,
                               streams=True))


__all__ = ["RULE", "SCRATCH", "activation", "norm_activation", "norm_activation_grad_sampler",
           "parent"]
