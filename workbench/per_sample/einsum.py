"""Per-sample gradients in one backward pass: hooks + per-layer grad samplers.

The method of Opacus (Yousefpour et al. 2021, arXiv 2109.12298, Appendix B). One ordinary
forward pass records each layer's activations a; one ordinary backward pass of Σ_i ℓ_i
records the backprops b = ∂(Σ_i ℓ_i)/∂o (``hooks.py``). A per-layer rule then builds every
sample's gradient at once, e.g. for ``nn.Linear`` (o = W a + c)

    ∂ℓ_i/∂W = b_i a_iᵀ        (n, p, d)   Eq. (5)
    ∂ℓ_i/∂c = b_i             (n, p)

with an extra sum over the positions of a sequence. The rules live in ``workbench/rules/`` and in
the registry (``registry.py``). A layer with trainable parameters but no rule is handled by
``vmap`` on that layer alone (``functional.layer_vmap_grad_sampler``), after a one-time
warning; ``strict=True`` raises instead.

A parameter the rules cannot account for (used outside its layer, or by a layer whose dim 0
is not the batch: ``recording.py``) gets the exact fallback (``fallback.py``), and the result
is checked against micro-batching on one sample before it is returned (``selfcheck.py``).

Notation: n batch size, a activations (n, ..., d), b backprops (n, ..., p), W (p, d).
"""

import warnings

import torch

from workbench.errors import PerSampleCheckError
from workbench.per_sample import selfcheck, state_replay
from workbench.per_sample.derived import served_gradients
from workbench.per_sample.fallback import exact_per_sample_gradients
from workbench.per_sample.functional import layer_vmap_grad_sampler
from workbench.per_sample.precision import in_full_precision
from workbench.per_sample.recording import Recording, record
from workbench.per_sample.registry import find_grad_sampler

_WARNED: set[tuple[type, str]] = set()


def warn_fallbacks(rec: Recording, covered=None) -> None:
    """After the forward pass: warn once per layer that will be sampled by vmap."""
    for path, layer in rec.layers.items():
        kind = type(layer)
        if (find_grad_sampler(layer) is not None or (covered is not None and covered(layer))
                or not rec.recorder.calls[path] or not rec.own(layer)
                or (kind, path) in _WARNED):
            continue
        _WARNED.add((kind, path))
        warnings.warn(f"{kind.__name__} at {path or '<model>'} has no registered grad sampler; "
                      f"computing its per-sample gradients by vmap on that layer (slower). "
                      f"Register one with @wb.register_grad_sampler({kind.__name__}).",
                      stacklevel=4)


@in_full_precision  # a and b widened (precision.py): the rule computes in their dtype
def sample_layer(layer, call, keep=None) -> dict[str, torch.Tensor]:
    """Per-sample gradients of ``layer``'s own trainable parameters for one recorded call
    (``keep``: local names to return; default all).

    Samplers run under ``no_grad``: the results are data for clipping, not part of a graph
    (so they keep no activations alive and may write into preallocated outputs).
    """
    enabled = torch.is_grad_enabled()  # torch.no_grad() without its context manager's
    torch._C._set_grad_enabled(False)  # cost (~4 µs, paid by every rule call)
    try:
        return sample_call(layer, call, keep)
    finally:
        torch._C._set_grad_enabled(enabled)


def sample_call(layer, call, keep=None) -> dict[str, torch.Tensor]:
    """``sample_layer`` for a caller that runs under ``full_precision`` and ``no_grad``
    already (``clipping.engine.materialise``: once for all calls, not once per call)."""
    if "parametrizations" in layer._modules:  # its weight read as the pass computed it
        with state_replay.read_only_parametrizations(layer):
            return _sample_call(layer, call, keep)
    return _sample_call(layer, call, keep)


def _sample_call(layer, call, keep) -> dict[str, torch.Tensor]:
    sampler = find_grad_sampler(layer)
    if sampler is None:  # torch.func transforms ignore the outer no_grad
        grads = layer_vmap_grad_sampler(layer, call.args, call.kwargs, call.backprops,
                                        call.rows is not None)
    else:
        grads = sampler(layer, call.args, call.backprops)
        check_shapes(layer, call, grads)
    return grads if keep is None else {k: g for k, g in grads.items() if k in keep}


def check_shapes(layer, call, grads: dict) -> None:
    """Every per-sample gradient a rule returns is (n, *p.shape): a rule that returns another
    shape has summed over the wrong dims (a parameter of shape (1, 1, 1, C) treated as (C,)),
    and its numbers must never reach a sum or a norm."""
    b = call.backprops[0] if isinstance(call.backprops, tuple) else call.backprops
    n = b.shape[0] if isinstance(b, torch.Tensor) and b.dim() else None
    for name, g in grads.items():
        p = getattr(layer, name, None)
        if n is None or not isinstance(p, torch.Tensor) or tuple(g.shape) == (n, *p.shape):
            continue
        raise PerSampleCheckError(
            f"the grad rule of {type(layer).__name__} at {call.path or '<model>'} returned a "
            f"per-sample gradient of shape {tuple(g.shape)} for {name!r}, not (n, *{name}.shape) "
            f"= {(n, *p.shape)}: the rule does not fit this layer; unregister it or fix it")


def rule_gradients(rec: Recording) -> dict[int, torch.Tensor]:
    """{id(param): (n, *shape)} from the per-layer rules, summed over each parameter's calls."""
    by_param: dict[int, torch.Tensor] = {}
    for _, layer, call in rec.calls():
        own = dict(rec.own(layer))
        if not own:
            continue
        for local_name, g in sample_layer(layer, call, keep=own).items():
            key = id(own[local_name])
            by_param[key] = g if key not in by_param else by_param[key] + g
    return by_param


def replay_of(rec: Recording):
    """(random state, device) of a forward pass that drew random numbers, else None: the
    fallback then replays the batch's masks (``fallback.py`` Eq. 1)."""
    return (rec.rng, rec.device) if rec.random and rec.rng is not None else None


def fallback_gradients(rec: Recording, model, loss_fn, inputs, targets):
    """{id(param): (n, *shape)} of the fallback parameters, exact."""
    if not rec.fallback:  # no parameter marked: nothing to compute (the common case)
        return {}
    served = served_gradients(rec)  # computed from parameters alone (derived.py)
    names = [name for name in rec.fallback_names() if id(rec.params[name]) not in served]
    reasons = sorted({why for key, why in rec.fallback.items() if key not in served})
    with state_replay.replayed(rec.state):  # the model's state as the pass read it
        grads = exact_per_sample_gradients(model, loss_fn, inputs, targets, names, reasons,
                                           replay_of(rec))
    exact = {**served, **{id(rec.params[name]): g for name, g in grads.items()}}
    selfcheck.compare_alone(rec, exact)  # on a checked call (``alone_params``)
    return exact


def replay_probe(rec: Recording, model, loss_fn, inputs, targets) -> dict:
    """Exact g_i of sample n - 1 with the other samples substituted and the batch's random
    state replayed (``selfcheck.record_probe``): loss_fn's own term of that sample."""
    i = rec.n - 1
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    swapped = selfcheck.substituted(targets, i, rec.n)
    return selfcheck.record_probe(rec, model, args, {},
                                  lambda out: loss_fn(out, swapped)[i])


def einsum_per_sample_gradients(model, loss_fn, inputs, targets, strict=False, check=True):
    """``{name: Tensor(n, *param.shape)}`` from one forward and one backward pass."""
    selfcheck.check_option(check)
    rec = record(model, loss_fn, inputs, targets, strict=strict)
    warn_fallbacks(rec)
    sig = selfcheck.known(model, rec, check)
    ref = selfcheck.probe(rec, model, loss_fn, inputs, targets) if sig else None
    every = selfcheck.all_params(rec) if sig else []  # Σ_i g_i against the batch's own
    batch = dict(zip(map(id, every), rec.recorder.backward(rec.losses.sum(), params=every)))
    alone = selfcheck.alone_params(rec, sig)
    selfcheck.keep_batch_grads(rec, alone, [batch[id(p)] for p in alone])
    by_param = rule_gradients(rec)
    by_rules = dict(by_param)
    by_param.update(fallback_gradients(rec, model, loss_fn, inputs, targets))
    n = rec.n
    grads = {name: by_param[id(p)] if id(p) in by_param
             else torch.zeros(n, *p.shape, dtype=p.dtype, device=p.device)  # never reached loss
             for name, p in rec.params.items()}
    if sig is not None:
        if rec.random:  # sample i alone draws other masks: replay the batch's (selfcheck.py)
            ref = replay_probe(rec, model, loss_fn, inputs, targets)
        selfcheck.compare(rec, {k: g[n - 1] for k, g in grads.items()}, ref,
                          f"the per-sample gradient of sample {n - 1}")
    if sig:  # then every record, not only the probed one (a rule wrong for some rows): its
        selfcheck.compare_sums(rec, by_rules, batch)  # message says record n - 1 matched
    if sig is not None:
        selfcheck.remember(model, sig, dict(rec.fallback))
    return grads


__all__ = [
    "check_shapes", "einsum_per_sample_gradients", "fallback_gradients", "replay_probe",
    "rule_gradients", "sample_call", "sample_layer", "warn_fallbacks",
]
