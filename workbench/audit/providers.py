"""Providers: other libraries' per-sample gradients, behind one signature, for the audit.

A provider is any callable ``provider(model, loss_fn, inputs, targets) -> {param_name:
Tensor(n, *param.shape)}`` (the signature of ``wb.per_sample_gradients``), so
``audit_gradients(..., providers={"mine": provider})`` can check any implementation against
micro-batching, the reference Opacus validates its grad samplers against (Yousefpour et al.
2021, arXiv 2109.12298, Appendix A).

- ``torch_func_provider``: ``vmap(grad(...))`` written here from ``torch.func`` directly,
  independently of ``workbench.per_sample.functional`` (no shared helpers, no checks).
- ``opacus_provider(mode)``: Opacus' ``GradSampleModule`` with ``grad_sample_mode`` in
  ``"hooks"``, ``"functorch"``, ``"ew"`` (expanded weights). Opacus' ``"ghost"`` mode
  materialises no per-sample gradients, so there is nothing here to compare; audit the
  workbench's own ``"ghost"`` method for norms instead.
- ``backpack_provider``: BackPACK's ``BatchGrad`` extension. Honest note: BackPACK is not
  installed in the development environment, so this adapter follows its documentation and
  is untested here.

Optional libraries are imported only when a provider runs; ``available_providers()`` says
which ones can run and, for the others, why not.

Notation: n batch size, θ trainable parameters, g_i per-sample gradient.
"""

import copy
import importlib.util

from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_map

OPACUS_MODES = ("hooks", "functorch", "ew", "ghost")  # ghost: per-sample norms only


def _as_tuple(inputs):
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _trainable(model):
    return {k: p for k, p in model.named_parameters() if p.requires_grad}


def _slots(model, theta: dict, trainable: dict) -> dict:
    """{dotted name: tensor} with every parameter slot named once (a module registered under
    two parents, VB-LoRA's shared bank, is one slot: ``functional_call``'s ``tie_weights``
    swapped it once per name and left the substitute in the model), valued from ``theta``
    for the trainable parameters (a Parameter tied across two modules: in both)."""
    by_id = {id(trainable[k]): v for k, v in theta.items()}
    return {f"{path}.{name}" if path else name: by_id.get(id(p), p.detach())
            for path, m in model.named_modules() for name, p in m._parameters.items()
            if p is not None}


def torch_func_provider(model, loss_fn, inputs, targets):
    """g_i = vmap_i(grad_θ ℓ(f(x_i; θ), y_i)) with ``torch.func``: {name: Tensor(n, ...)}."""
    trainable = _trainable(model)
    params = {k: p.detach() for k, p in trainable.items()}

    def loss_of_one(theta, xs, y):
        xs = tree_map(lambda v: v.unsqueeze(0), xs)  # each (1, ...)
        y = None if y is None else y.unsqueeze(0)  # (1, ...)
        out = functional_call(model, _slots(model, theta, trainable), xs, tie_weights=False)
        return loss_fn(out, y).sum()  # scalar ℓ_i

    in_dims = (None, 0, None if targets is None else 0)
    return vmap(grad(loss_of_one), in_dims=in_dims)(params, _as_tuple(inputs), targets)


def _require(module: str, pip_name: str):
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"{module} is not installed (pip install {pip_name}); "
                          f"this provider needs it")


def _wrap(model, mode):
    """Opacus' grad-sample wrapper for ``mode`` (what ``opacus.grad_sample.get_gsm_class``
    picks), summing the losses: ``loss_reduction="sum"``."""
    from opacus.grad_sample import GradSampleModule, GradSampleModuleExpandedWeights

    if mode == "ew":
        return GradSampleModuleExpandedWeights(model, batch_first=True, loss_reduction="sum")
    if mode == "ghost":
        from opacus.grad_sample import GradSampleModuleFastGradientClipping

        return GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="sum",
                                                    max_grad_norm=1.0, use_ghost_clipping=True)
    return GradSampleModule(model, batch_first=True, loss_reduction="sum",
                            force_functorch=mode == "functorch")


def opacus_provider(mode: str = "hooks"):
    """A provider running Opacus' ``GradSampleModule(grad_sample_mode=mode)`` on a model copy.

    Mode "ghost" (``GradSampleModuleFastGradientClipping``) returns per-sample gradient norms,
    Tensor(n,), which ``audit_gradients`` audits as norms.

    The losses are summed (``loss_reduction="sum"``), so ``p.grad_sample[i]`` is g_i itself.
    """
    if mode not in OPACUS_MODES:
        raise ValueError(f"mode must be one of {OPACUS_MODES}; got {mode!r}")

    def provider(model, loss_fn, inputs, targets):
        _require("opacus", "opacus")
        gsm = _wrap(copy.deepcopy(model), mode)
        try:
            loss_fn(gsm(*_as_tuple(inputs)), targets).sum().backward()  # Σ_i ℓ_i
            if mode == "ghost":  # ghost clipping materialises no g_i: audit its norms (n,)
                return gsm.get_norm_sample().detach()
            return {k: p.grad_sample.detach() for k, p in _trainable(gsm._module).items()}
        finally:
            getattr(gsm, "_close", lambda: None)()  # removes Opacus' hooks

    provider.__name__ = f"opacus_{mode}"
    return provider


def backpack_provider(model, loss_fn, inputs, targets):
    """BackPACK's ``BatchGrad`` on an extended model copy (untested here: see module notes)."""
    _require("backpack", "backpack-for-pytorch")
    from backpack import backpack, extend
    from backpack.extensions import BatchGrad

    model = extend(copy.deepcopy(model))
    loss = loss_fn(model(*_as_tuple(inputs)), targets).sum()  # Σ_i ℓ_i: no 1/n scaling
    with backpack(BatchGrad()):
        loss.backward()
    return {k: p.grad_batch.detach() for k, p in _trainable(model).items()}


def _candidates():
    """name -> (provider, module it needs or None)."""
    found = {"torch_func": (torch_func_provider, None)}
    found.update({f"opacus_{m}": (opacus_provider(m), ("opacus", "opacus")) for m in OPACUS_MODES})
    found["backpack"] = (backpack_provider, ("backpack", "backpack-for-pytorch"))
    return found


def available_providers() -> tuple[dict, dict]:
    """({name: provider} that can run here, {name: reason} for those that cannot).

    >>> found, missing = available_providers()
    >>> "torch_func" in found
    True
    """
    found, missing = {}, {}
    for name, (provider, needs) in _candidates().items():
        if needs is not None and importlib.util.find_spec(needs[0]) is None:
            missing[name] = f"{needs[0]} is not installed (pip install {needs[1]})"
        else:
            found[name] = provider
    return found, missing


__all__ = ["OPACUS_MODES", "available_providers", "backpack_provider", "opacus_provider",
           "torch_func_provider"]
