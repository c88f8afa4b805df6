"""Per-sample gradients: one entry point, three methods that must agree.

``per_sample_gradients(model, loss_fn, inputs, targets, method=...)`` returns
``{param_name: Tensor(n, *param.shape)}`` for the trainable parameters of ``model``, keyed
like ``model.named_parameters()``, where row i is ∇_θ loss_fn(model(inputs), targets)[i].

- ``"microbatch"``: a loop over samples; the obviously-correct reference (microbatch.py).
- ``"vmap"``: torch.func ``vmap(grad(...))`` over the batch (functional.py).
- ``"einsum"``: hooks + per-layer grad rules, one backward pass (einsum.py, ``rules/``).
"""

from workbench.methods import PER_SAMPLE_METHODS as METHODS
from workbench.per_sample.checks import check_batch, check_no_sample_mixing
from workbench.per_sample.einsum import einsum_per_sample_gradients
from workbench.per_sample.functional import vmap_or_explain
from workbench.per_sample.hooks import refusing_reentrant
from workbench.per_sample.microbatch import microbatch_per_sample_gradients
from workbench.per_sample.registry import GRAD_SAMPLERS, register_grad_sampler
from workbench.per_sample.selfcheck import check_alone, check_option, check_vmap
from workbench.per_sample.state_replay import Snapshot


@refusing_reentrant
def per_sample_gradients(model, loss_fn, inputs, targets, method="einsum", strict=False,
                         check=True):
    """Per-sample gradients ``{param_name: Tensor(n, *param.shape)}`` of trainable parameters.

    Args:
        model: an ``nn.Module`` whose samples do not interact (no BatchNorm).
        loss_fn: ``loss_fn(outputs, targets) -> Tensor(n,)``, one loss per sample, e.g.
            ``nn.CrossEntropyLoss(reduction="none")``.
        inputs: Tensor with the batch on dim 0, or a tuple of them (``model(*inputs)``).
        targets: Tensor (or tuple) with the batch on dim 0, or None.
        method: ``"microbatch"``, ``"vmap"`` or ``"einsum"``.
        strict: einsum only: raise for a layer without a grad sampler instead of falling
            back to vmap on that layer.
        check: einsum: ``True`` compares the result with micro-batching on one sample
            the first time a model is seen with a given call signature (``selfcheck.py``),
            ``"always"`` on every call, ``False`` never (benchmarks). A failed check raises
            ``PerSampleCheckError``; nothing wrong is returned. microbatch and vmap (each
            record alone): unless ``False``, every call first checks that the model and the
            loss give each half of the batch what the whole batch gives it
            (``selfcheck.check_alone``): a coupling raises, no record-alone answer is
            returned for a batch whose records interact. vmap's answer is then checked
            against autograd's for record n - 1 run alone (``selfcheck.check_vmap``; not
            for a model drawing random numbers).

    einsum is exact on models that use a parameter outside its layer (a tied head), or whose
    layers do not carry the batch on dim 0 (a positional embedding on ``arange(T)``, a
    sequence-first layer): those parameters are computed exactly over the whole model.

    The model's ``.grad`` fields, hooks and training mode are left as they were.

    >>> import torch
    >>> from torch import nn
    >>> model = nn.Linear(3, 2)
    >>> loss_fn = nn.CrossEntropyLoss(reduction="none")
    >>> x, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    >>> grads = per_sample_gradients(model, loss_fn, x, y)
    >>> {name: tuple(g.shape) for name, g in grads.items()}
    {'weight': (5, 2, 3), 'bias': (5, 2)}
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    check_option(check)
    trainable = any(p.requires_grad for p in model.parameters())
    if method == "einsum" and trainable:  # its record() checks for sample mixing first
        return einsum_per_sample_gradients(model, loss_fn, inputs, targets, strict=strict,
                                           check=check)
    check_no_sample_mixing(model)
    if not trainable:
        check_batch(inputs, targets)
        return {}  # nothing trainable: no per-sample gradients to compute
    if check is not False:  # each record alone: the batch must not couple the records
        check_alone(model, loss_fn, inputs, targets)
    if method == "microbatch":
        return microbatch_per_sample_gradients(model, loss_fn, inputs, targets)
    start = Snapshot(model) if check is not False else None  # the state vmap reads
    grads = vmap_or_explain(model, loss_fn, inputs, targets)  # "vmap" (einsum returned above)
    if check is not False:  # torch.func's answer against autograd's (selfcheck.check_vmap)
        check_vmap(model, loss_fn, inputs, targets, grads, start)
    return grads


__all__ = ["GRAD_SAMPLERS", "METHODS", "per_sample_gradients", "register_grad_sampler"]
