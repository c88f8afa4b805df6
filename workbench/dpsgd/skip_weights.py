"""Skipping the weight gradients that the user's backward pass computes and DP-SGD discards.

Bu, Wang, Zha, Karypis, "Differentially private optimization on large model at small cost"
(ICML 2023, arXiv 2210.00038), §3: book-keeping needs from the backward pass only each
layer's backprops b; the clipped sum Σ_i c_i g_i is a weight gradient of (a, c ⊙ b) computed
afterwards (``clipping/engine.py``). The ordinary ``loss.backward()`` also computes the
*unclipped* weight gradient Σ_i g_i of every layer, e.g. Bᵀ A for ``nn.Linear`` (p x d per
layer, about a third of a Linear layer's backward FLOPs), only for the optimizer to overwrite
it with the noised clipped sum. This module keeps autograd from computing it:

- a forward pre-hook on each recorded leaf layer turns ``requires_grad`` off for its
  parameters in the optimizer, for the duration of that layer's forward only (restored by a
  forward hook that runs also when the forward raises, before the user sees the output). It
  runs after the layer's other pre-hooks (``keep_last``, also for one registered later):
  an old-style ``weight_norm``'s or pruning's computes the weight from other parameters
  there, outside the forward, and that use must keep its graph and be seen (it makes them
  fallback parameters); a user's hook reading the weight into a loss term likewise. Run
  first, it hid them: with ``skip_weight_grads = True`` and the check off, ``weight_g``/
  ``weight_v``'s clipped sums came out 100% off and the layer's other parameters' 15-23%,
  and the hook's loss term was dropped, silently;
- the same forward hook passes the output through ``Tap``, an identity whose extra input is a
  scalar that requires grad: the output still requires grad (the first layer's too, whose
  input does not), so the recorder's tensor hooks catch b, and the backward pass continues to
  the layer's inputs as before. Nothing else of the graph changes.

Not under saved-tensor hooks (activation checkpointing with ``use_reentrant=False``, Hugging
Face's ``gradient_checkpointing_enable()``): the checkpoint recomputes the forward in the
backward pass, where nothing is skipped, and refuses a recomputation whose saved tensors
differ from the forward's (a weight that did not require grad saves other tensors).

Only *leaf* layers (no submodules) that are not parametrised and have a grad rule are
tapped, and only in calls on the batch (a call on a tensor computed from parameters alone,
DeBERTa's ``pos_proj`` on its relative embeddings, keeps its weight's graph edge: its
per-sample gradient is taken where its output meets the batch, ``per_sample/derived.py``,
which follows that edge), nor in calls whose dim 0 is not the batch's rows (``b(x[:k])``, a
layer on a slice of the batch: its parameters take the whole-model fallback, which computes
each record alone, and only autograd's gradient of the batch can show that a record alone is
not the record in the batch, through the optimizer's path check; a layer tapped in a call on
the rows and then called off them in the same pass is tapped no more from the next step on,
whose check then runs): every use of their parameters inside their forward is their own
call, so the use tracker (``per_sample.uses``) sees the same uses either way; uses outside the
layer's forward keep ``requires_grad``; and their output is one Tensor (a rule-less layer's
may hold a Tensor that must not start requiring grad: autograd computes its weight gradients
as usual).

What the user's ``.grad`` then holds (the contract, on by default): before ``step()``, for a
tapped parameter only the gradient of terms outside the tapped calls (an L2 penalty, a tied
head's ``F.linear``), no non-private gradient of the layer's own calls; after ``step()``,
the private one. ``recorded.path_gradients`` leaves the tapped calls out accordingly, so the
``.grad`` check still finds such terms. Off where ``.grad`` itself matters: under
``torch.distributed`` / DDP (its all-reduce runs on ``.grad``), under autocast, with a
GradScaler (its inf check reads ``.grad``: the default skips nothing once a scaler stepped,
and at its first step, before a scaler can have been seen, leaves one layer untapped, the
one with the fewest parameters, so that a scaler stepping there has a ``.grad`` to check and
``scaler.update()`` an inf check to read; a scaler seen later is refused, as with
``skip_weight_grads = True``), and
inside the optimizer's own checks (the recorder paused). The bit-identical updates are the
reason it can be the default: nothing DP-SGD computes reads the skipped gradients.

Notation: a activations, b backprops, g_i per-sample gradient, c_i clip factor.
"""

import torch
from torch import nn
from torch.nn.utils.parametrize import is_parametrized
from torch.utils._pytree import tree_map

from workbench.per_sample.hooks import OwnHook
from workbench.per_sample.registry import find_grad_rule
from workbench.per_sample.uses import quiet

AUTO = "auto"  # DPOptimizer.skip_weight_grads's default (module docstring)
_requires_grad = quiet(lambda t: t.requires_grad)  # read without a mode seeing it


def saving_hooks() -> bool:
    """Saved-tensor hooks are on (``torch.utils.checkpoint`` with ``use_reentrant=False``,
    ``save_on_cpu``): the forward's saved tensors are packed, and, under checkpointing,
    recomputed in the backward pass and checked against the forward's."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None


class Tap(torch.autograd.Function):
    """Identity on ``out`` that requires grad through ``dummy``; backward: b to ``out``."""

    @staticmethod
    def forward(ctx, dummy, out):
        return out.detach()  # shares out's storage and version counter: no copy

    @staticmethod
    def backward(ctx, grad):
        return None, grad


def tappable(layer: nn.Module) -> bool:
    """A leaf layer, not parametrised: all uses of its parameters in its forward are its own;
    and one with a grad rule, so its output is one Tensor (``Tap`` makes every floating output
    require grad: IBert's ``QuantLinear`` returns (output, scale), and a tapped scale reached
    ``1.0 // scale`` in the user's backward pass, which has no derivative)."""
    return (next(layer.children(), None) is None and not is_parametrized(layer)
            and find_grad_rule(layer) is not None)


class WeightGradSkipper:
    """Hooks on ``layers`` ({path: module}) turning off autograd's weight gradient of the
    parameters in ``params`` (ids) while ``active()`` is true; ``tapped``: the paths tapped
    since the last ``clear``."""

    def __init__(self, layers: dict, params: set[int], active, batch_free=lambda args: False,
                 off_rows=lambda args: False):
        self.active, self.tapped, self.spared = active, set(), set()
        self.batch_free = batch_free  # (args) -> a call without the batch: not tapped (its
        # parameters' per-sample gradients come from where its output meets the batch,
        # per_sample/derived.py, which follows the graph to them)
        self.off_rows = off_rows  # (args) -> a call whose dim 0 is not the batch's rows: not
        # tapped (its parameters take the whole-model fallback, whose Σ_i g_i the path check
        # must compare with autograd's gradient of the batch: module docstring)
        self.never: set[str] = set()  # paths once called off the batch's rows after being
        # tapped in the same pass: never tapped again
        self.late: set[str] = set()  # such paths of this step: their check waits a step
        self.own = {path: [p for p in layer.parameters(recurse=False)
                           if p.requires_grad and id(p) in params]
                    for path, layer in layers.items() if tappable(layer)}
        self.layers = layers
        self.kept = None  # a path not tapped (the default's first step: ``smallest``)
        self._last: dict[str, int] = {}  # path -> the id of its pre-hook, kept last
        self._smallest = ...
        self._off: dict[str, list] = {}
        self._dummy: dict = {}  # device -> a scalar that requires grad
        self._handles = []
        self._quiet_tap = quiet(self._tap_tensor)

    def attach(self, on: bool) -> None:
        """Hooks on the layers (``on``), or none: a model whose optimizer never skips keeps
        the hooks it had."""
        if on and not self._handles:
            for path, own in self.own.items():
                if own:
                    layer = self.layers[path]
                    pre = layer.register_forward_pre_hook(OwnHook(quiet(self._pre(path))))
                    self._last[path] = pre.id
                    self._handles += [pre, layer.register_forward_hook(
                        OwnHook(self._post(path)), prepend=True, always_call=True)]
        elif not on:
            self.close()

    def keep_last(self) -> None:
        """Move each layer's pre-hook after any pre-hook registered since (a user's, after the
        optimizer was made): it must run after every other (module docstring). Called at the
        start of each recorded forward pass; a dict lookup per layer when nothing moved."""
        for path, hook_id in self._last.items():
            hooks = self.layers[path]._forward_pre_hooks
            if len(hooks) > 1 and next(reversed(hooks)) != hook_id and hook_id in hooks:
                hooks.move_to_end(hook_id)

    def smallest(self):
        """The path of the tappable layer with the fewest parameters to skip (None if none)."""
        if self._smallest is ...:
            sizes = {path: sum(p.numel() for p in own) for path, own in self.own.items() if own}
            self._smallest = min(sizes, key=sizes.get) if sizes else None
        return self._smallest

    def _pre(self, path):
        def pre_hook(module, args):
            if path in self._off or not self.active() or saving_hooks() or path == self.kept:
                return  # under checkpointing the recomputation must save what the forward did
            if path not in self.tapped:
                if path in self.spared or path in self.never or self.batch_free(args) \
                        or self.off_rows(args):
                    self.spared.add(path)  # and every later call of its path in this step:
                    return  # every call of a path is tapped, or none, as
                    # ``recorded.path_gradients`` assumes
            elif self.off_rows(args):  # tapped earlier in this pass: tapped again, as said;
                self.never.add(path)  # from the next step on, not tapped
                self.late.add(path)
            own = [p for p in self.own[path] if p.requires_grad]
            for p in own:
                p.requires_grad_(False)
            self._off[path] = own

        return pre_hook

    def _post(self, path):
        @quiet  # requires_grad_ and the taps are not uses of the parameters (uses.py)
        def restore(own):
            for p in own:
                p.requires_grad_(True)

        def hook(module, args, output):
            own = self._off.pop(path, None)
            if own is None:
                return None
            restore(own)  # first, also when the forward raised
            self.tapped.add(path)
            if type(output) is torch.Tensor:  # the common case: no pytree walk
                if _requires_grad(output) and not any(output is a for a in args):
                    return None  # through the layer's input: the graph reaches this new
                    # output without a Tap (one autograd node and a tree_map less per call)
                return self._tap(output)
            return tree_map(self._tap, output)

        return hook

    def _tap(self, t):
        if not isinstance(t, torch.Tensor):
            return t
        # quiet for a plain Tensor (uses.quiet); a subclass keeps its dispatch
        return self._quiet_tap(t) if type(t) is torch.Tensor else self._tap_tensor(t)

    def _tap_tensor(self, t):
        if not t.is_floating_point():
            return t
        dummy = self._dummy.get(t.device)
        if dummy is None:
            dummy = self._dummy[t.device] = torch.zeros((), device=t.device, requires_grad=True)
            dummy.workbench_own = True  # no user's tensor (loss_watch.outside)
        return Tap.apply(dummy, t)

    def clear(self) -> None:
        self.tapped, self.spared, self.late = set(), set(), set()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._last.clear()


__all__ = ["AUTO", "Tap", "WeightGradSkipper", "saving_hooks", "tappable"]
