"""Book-keeping: the clipped sum from the *same* backward pass that gave the norms.

Bu, Wang, Zha, Karypis 2023 (arXiv 2210.00038, §3) observe that ghost clipping's second
backward pass recomputes what the first one already had: each layer's activations a and
backprops b. Because a layer's per-sample gradient is linear in its backprop,

    Σ_i c_i g_i(a_i, b_i) = Σ_i g_i(a_i, c_i b_i)

so the clipped sum of a layer is its *ordinary* parameter gradient with the backprops
reweighted per sample; for ``nn.Linear`` that is one matrix product (Bu et al. Eq. 3)

    Σ_i c_i B_iᵀ A_i = (c ⊙ B)ᵀ A          (p, d)

The backward pass that gives the backprops does not retain the graph: as in a plain step,
what autograd saved inside the layers (attention maps, GELU inputs) is freed as the pass goes,
and only each layer's inputs a and backprops b are kept, which is what peak memory is made of
(bench e2e, tiny_gpt, b = 32, T = 128: about 1.3x a plain step's peak when every layer kept
its (a, b)). So the backward pass is streamed (``per_sample.streaming``): a Linear,
normalisation or convolution call whose per-sample gradients g_i (n p d for a Linear, n 2d
for a LayerNorm, n p C k / G for a convolution) are smaller than its (a, b) (n T (d + p),
n 2 T d, n (C H W + p H' W')), as in a transformer's projections and LayerNorms at T >= 2
and a CNN's first, wide-image convolutions, is materialised the moment its b is complete,
and its a and b let go (the layers found by what they compute too, where their rule bounds
its scratch, ``LayerRule.streams``: the RMSNorm family and ``T5LayerNorm``, BiT's
weight-standardised convolutions and normalisations with their activation; until
2026-12-01 they kept (a, b) to ``step()``: ``bench real``, base, T5 1.27x a plain step's
peak, then 1.06x; BiT 2.10x, then 1.12x with its stem's unfold in chunks,
``conv_chunks.strict``); its clipped sum is then Σ_i c_i g_i (Bu et al. §4 choose per layer
between the ghost norm and materialising, by time; the choice here is by memory: 1.12x a
plain step's peak on tiny_gpt; the CIFAR-10 CNN's ``bench training --memory``
step, b = 64 / 256, 2.16x / 2.25x -> 1.54x / 1.58x).
``materialise_call`` is that decision, for the optimizer's hooks too (``dpsgd/streamed.py``).
Each layer's clipped sum is then computed from (a, c ⊙ b) alone: for ``nn.Linear`` the one
matmul above; for any other layer PyTorch's own weight-gradient kernel, by re-running the layer
alone on its stored inputs and asking autograd for the gradient with grad_outputs = c ⊙ b.
Each call's backprops are freed once used. The loop itself is the one clipping engine's
(``engine.clipped_sum``, mode ``"bookkeeping"``), the optimizer's too.

Notation: n batch, a activations, b backprops, c clip factors (n,).
"""

import torch
from torch import nn
from torch.nn.utils.parametrize import is_parametrized

from workbench.clipping.engine import clipped_sum
from workbench.clipping.ghost import record_batch, recorded_shared, squared_norms, verify_norms
from workbench.clipping.nonfinite import refuse_nonfinite
from workbench.per_sample import selfcheck
from workbench.per_sample.einsum import fallback_gradients, sample_layer
from workbench.per_sample.hooks import drop_inputs
from workbench.per_sample.precision import in_full_precision
from workbench.per_sample.recording import own_parameters
from workbench.per_sample.registry import find_grad_sampler
from workbench.per_sample.sketch import RowSketch
from workbench.per_sample.streaming import stream_backward
from workbench.per_sample.tied import BroadcastProduct, ParameterRows
from workbench.rules import conv_chunks
from workbench.rules._rule import find_layer_rule


def bookkeeping_clipped_sum(model, loss_fn, inputs, targets, max_grad_norm, check=True):
    """{name: Σ_i c_i g_i} from one forward and one backward pass (plus local weight grads);
    ``max_grad_norm`` validated by the caller."""
    rec, materialised = record_streamed(model, loss_fn, inputs, targets, check)
    exact = {**rec.exact, **materialised}  # (n, *shape) each: normed and summed as given
    row = None
    if rec.signature is not None:  # the norms are the engine's; verify them first
        ref = verify_norms(model, rec, squared_norms(rec, exact)[0], remember=False)
        row = RowSketch({id(p): p for p in rec.params.values()})
    sums, norms, _ = clipped_sum(rec, max_grad_norm, "bookkeeping", exact=exact, row=row)
    if row is not None and bool(torch.isfinite(norms[-1])):  # the sum's own row n - 1
        selfcheck.compare_rows(rec, row, ref)
        selfcheck.remember(model, rec.signature, dict(rec.fallback))
    refuse_nonfinite(norms)  # the engine masked them; the functional API names them
    return {name: sums[id(p)] if id(p) in sums else p.new_zeros(p.shape)
            for name, p in rec.params.items()}


def record_streamed(model, loss_fn, inputs, targets, check):
    """(rec, {id(param): (n, *shape)}): forward, then one streamed backward pass
    (``per_sample.streaming``) in which a Linear call whose per-sample gradients are smaller
    than its (a, b) is materialised on the spot and its a and b let go; every other call
    keeps its b for the clipped sum."""
    rec = record_batch(model, loss_fn, inputs, targets, check)
    shared = recorded_shared(rec)
    layer_of = {id(call): layer for path, layer in rec.layers.items()
                for call in rec.recorder.calls[path]}
    kept, materialised = {}, {}

    def on_call(call):
        layer = layer_of[id(call)]
        grads = materialise_call(layer, call, dict(rec.own(layer)), shared, rec.n)
        if grads is None:
            kept[id(call)] = call.backprops
        else:
            materialised.update(grads)

    alone = selfcheck.alone_params(rec, rec.signature)
    selfcheck.keep_batch_grads(rec, alone, stream_backward(
        rec.recorder.all_calls(), rec.losses.sum(), on_call, derived=rec.recorder.derived,
        params=alone))
    for call in rec.recorder.all_calls():
        call.backprops = kept.get(id(call))
    rec.exact = fallback_gradients(rec, model, loss_fn, inputs, targets)
    return rec, materialised


@in_full_precision  # as the engine's materialise
def materialise_call(layer, call, own: dict, shared: set, n: int) -> dict | None:
    """{id(param): g_i (n, *shape)} of one call whose b has just arrived, when its per-sample
    gradients take less memory than its a and b (``smaller_materialised``); its a is then
    dropped (``hooks.drop_inputs``: shapes kept for the checks). None, the call untouched,
    otherwise. The one streaming decision of book-keeping: the functional API's streamed
    backward (``record_streamed``) and the optimizer's tensor hooks (``dpsgd/recorded.py``)."""
    if not own or not smaller_materialised(layer, call, own, shared, n):
        return None
    with conv_chunks.strict():  # in the backward pass: the scratch adds to the peak
        grads = {id(own[name]): g for name, g in sample_layer(layer, call, keep=own).items()}
    drop_inputs(call)
    return grads


# layers whose rule needs no more temporary memory than the call's a and b (a matmul; the
# normalised input times b; a convolution's per-sample weight gradients, chunked so that
# their scratch is at most a and b: ``rules/conv_chunks.chunks``; the scatter-add of a
# parameter's picked rows, ``rules/gather.py``: Mixtral's experts, whose b is each token's
# k experts' weight rows, n T k p d numbers against the n E p d of g_i; a layer scale's
# b ⊙ x summed, ``rules/broadcast.py``: Data2Vec-Vision's and ConvNeXt's, whose b and x,
# n T d each, waited for step() until 2026-12-01): exact types, a subclass may change forward
STREAMED = (nn.Linear, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.Conv1d, nn.Conv2d,
            nn.Conv3d, ParameterRows, BroadcastProduct, nn.BatchNorm1d, nn.BatchNorm2d,
            nn.BatchNorm3d)
# (BatchNorm: with frozen statistics only, checked at every pass before a rule runs)


def smaller_materialised(layer, call, own: dict, shared: set, n: int) -> bool:
    """A call of a ``STREAMED`` layer (``nn.Linear``, a normalisation layer, a convolution),
    all its parameters by rule and used in this call only, whose per-sample gradients
    (n (p d + p) numbers for a Linear, n 2d for a LayerNorm, n (p C k / G + p) for a
    convolution) take less memory than its stored inputs a and backprops b (n T (d + p),
    n 2 T d: T >= 2 positions for the usual widths; n (C H W + p H' W') for a convolution:
    the early, wide-image layers of a CNN, whose clipped sum then needs no second
    weight-gradient kernel either)."""
    b = call.backprops
    if (not streams(layer) or is_parametrized(layer) or n == 0
            or not isinstance(b, torch.Tensor) or not call.args
            or len(own) != len(own_parameters(layer))
            or any(id(p) in shared for p in own.values())):
        return False
    if isinstance(layer, nn.modules.conv._ConvNd) and \
            call.args[0].dim() != len(layer.kernel_size) + 2:
        return False  # an unbatched (C, *spatial) input, even when C = n: the fallback's
    grad_numel = sum(p.numel() for p in own.values())
    return n * grad_numel < call.args[0].numel() + b.numel()


def streams(layer) -> bool:
    """May a call of ``layer`` be materialised in the backward pass? A layer of exactly one of
    the ``STREAMED`` types, or one whose rule was found by what it computes and bounds its
    own scratch (``LayerRule.streams``: BiT's weight-standardised convolutions and its
    normalisations with their activation, the RMSNorm family, ``T5LayerNorm``), that rule being
    the one its calls get (``find_grad_sampler``: not for a call with more than its input)."""
    if type(layer) in STREAMED:
        return True
    rule = find_layer_rule(layer)
    return (rule is not None and rule.streams and rule.matches is not None
            and find_grad_sampler(layer) is rule.grad)


__all__ = ["STREAMED", "bookkeeping_clipped_sum", "materialise_call", "record_streamed",
           "smaller_materialised", "streams"]
