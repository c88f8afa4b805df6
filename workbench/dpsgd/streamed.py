"""Book-keeping's streaming in the user's own backward pass (the optimizer's side).

Bu, Wang, Zha, Karypis 2023 (arXiv 2210.00038, §4) choose per layer between keeping (a, b)
for the clipped sum and materialising the per-sample gradients g_i. ``clipping/bookkeeping.py``
decides by memory (``materialise_call``): a Linear call whose g_i (n p d numbers) are smaller
than its stored a and b (n T (d + p)) is materialised the moment b is complete, and a and b
are let go. The functional API hands each call over from ``per_sample.streaming``; here the
user's ``loss.backward()`` runs, and the recorder's tensor hook on the call's output
(``per_sample.hooks``, ``on_complete``) hands it over instead. Without this every layer's
(a, b) stayed alive until ``step()`` (tiny_gpt, b = 32, T = 128: 1.34x a plain SGD step's
peak, the same as the functional API's un-streamed book-keeping).

What is not known while the backward pass runs is settled at ``step()``:

- the per-record loss factors f_i and a GradScaler's scale (``recorded._rescaled``): g_i is
  linear in b_i, so g_i is rescaled exactly as b_i would have been;
- the fallback (a use outside the layer, a call whose dim 0 is not n, the self-check's
  probe): a streamed parameter sent there is dropped here and computed exactly by the
  whole-model fallback, which needs no layer's a;
- weight sharing: a parameter streamed in one call and not in another (or shared by two
  layers) has the rest of its calls materialised too and summed (``merge``), so the engine
  sees one exact g_i per parameter and no call's b is counted twice.

Notation: n batch, a activations, b backprops, g_i per-sample gradient, f_i loss factor.
"""

import torch

from workbench.clipping.bookkeeping import materialise_call, streams
from workbench.errors import WorkbenchError
from workbench.per_sample.einsum import sample_layer
from workbench.per_sample.precision import in_full_precision
from workbench.per_sample.recording import batch_problem, own_parameters


def stream_call(recorder, call) -> None:
    """The tensor hook's hand-over (``hooks.ActivationRecorder.on_complete``): materialise
    ``call`` now when book-keeping's memory rule says so, else leave it to ``step()``."""
    if call.sampled is not None:  # a second backward pass: refused at step() for every
        return  # call alike (hooks.ActivationRecorder.again, recorded.batches)
    layer = recorder.layers.get(call.path)
    n = recorder._n
    if call.meet is not None or n is None or not streams(layer):
        return  # only these are ever materialised (bookkeeping.smaller_materialised)
    if batch_problem(layer, call, n):
        return
    if call.path not in recorder._own:
        recorder._own[call.path] = {name: p for name, p in own_parameters(layer)
                                    if id(p) in recorder._ids}
    own = {name: p for name, p in recorder._own[call.path].items()
           if id(p) not in recorder.uncovered}
    call.set_backprops(call.grads)
    try:
        grads = materialise_call(layer, call, own, set(), n)
    except WorkbenchError:  # a rule refusing this call's input (a behaviour rule's check,
        grads = None  # ``affine.still_affine``): left to step(), where the same rule runs and
        # raises with every other refusal of the step, not out of the user's backward pass
    finally:
        call.backprops = None  # b stays in call.grads when not materialised (collect())
    if grads is not None:
        call.sampled, call.grads = grads, [None] * len(call.grads)


def streamed_gradients(rec, gen: int, rescale) -> tuple[dict, dict]:
    """({id(param): Σ over its calls of g_i (n, *shape)}, {id(param): paths}) of batch
    ``gen``: the streamed calls' g_i rescaled (``rescale(g)``: f_i, GradScaler), the fallback
    parameters left out, and every other call of a streamed parameter merged in."""
    grads, paths = {}, {}
    for path, calls in rec.recorder.calls.items():
        for call in calls:
            if call.sampled is None or call.generation != gen:
                continue
            for key, g in call.sampled.items():
                if key not in rec.fallback:
                    add(grads, paths, key, rescale(g), path)
            call.sampled = None
    merge(rec, grads, paths)
    return grads, paths


@in_full_precision  # as the engine's materialise
def merge(rec, grads: dict, paths: dict) -> None:
    """Materialise every recorded call that uses a parameter already in ``grads`` (and, in
    turn, the calls of its other parameters), adding its g_i and freeing its b."""
    changed = bool(grads)
    while changed:
        changed = False
        for path, layer, call in list(rec.calls()):
            own = dict(rec.own(layer))
            if not any(id(p) in grads for p in own.values()):
                continue
            for name, g in sample_layer(layer, call, keep=own).items():
                add(grads, paths, id(own[name]), g, path)
            call.backprops = None
            changed = True


def add(grads: dict, paths: dict, key: int, g: torch.Tensor, path: str) -> None:
    grads[key] = g if key not in grads else grads[key] + g
    paths.setdefault(key, set()).add(path)


__all__ = ["merge", "stream_call", "streamed_gradients"]
