"""The optimizer's side of the one recording: the user's loop runs, the hooks listen.

``DPOptimizer`` never sees the loss, only what the user's ``loss.backward()`` leaves behind.
``ModelRecorder`` keeps, per backward pass (a *generation*, ``per_sample.hooks``):

- every layer call's activations and backprops (the per-layer rules' input);
- the model's own call: its inputs and the gradient of its output b_out. For one sample,
  ⟨f(x_i; θ), b_out,i⟩ has gradient g_i (the loss depends on θ only through the output), so
  ``dot_loss`` turns the exact machinery of the functional API (whole-model fallback, probe)
  into the optimizer's;
- the uses of parameters outside their layer (``per_sample.uses``), seen while the model's
  forward runs.

Two backward passes before one ``step()`` (gradient accumulation) are two batches of distinct
samples: each is clipped on its own. ``verify`` (the first step, or on request) compares the
engine's ||g_i|| with micro-batching on one sample (``per_sample.selfcheck``); a model with
randomness (dropout) cannot be compared that way, and then only the batch dimensions are
verified. A loss that reads a parameter directly (not through the model) cannot be seen here.

Notation: n batch size, b_out gradient of the loss w.r.t. the model's output, g_i per-sample
gradient.
"""

import warnings
from contextlib import ExitStack, contextmanager

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from workbench.errors import UnsupportedLayerError
from workbench.per_sample import selfcheck
from workbench.per_sample.fallback import exact_per_sample_gradients
from workbench.per_sample.hooks import ActivationRecorder
from workbench.per_sample.recording import (
    Recording,
    batch_problem,
    check_layers,
    check_recorded,
    layers_with_parameters,
    note_uncovered,
    owners_of,
    parameter_names,
)
from workbench.per_sample.uses import UseTracker

ROOT = "<model>"


def dot_loss(outputs, backprops) -> torch.Tensor:
    """(n,): ⟨o_i, b_i⟩ per sample, whose gradient w.r.t. θ is the per-sample gradient."""
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    bs = backprops if isinstance(backprops, (tuple, list)) else (backprops,)
    return sum((o * b).flatten(1).sum(1) for o, b in zip(outs, bs))


class ModelRecorder:
    """Hooks on ``model`` for the parameters of ``param_groups``; removed by ``close``."""

    def __init__(self, model, param_groups):
        # DistributedDataParallel / DataParallel: record and probe the wrapped module itself,
        # so the checks' extra passes never start a collective the other ranks do not join
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        self.model = model
        self.layers = layers_with_parameters(model)
        check_layers(self.layers, strict=False)
        trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
        in_optimizer = {id(p) for g in param_groups for p in g["params"]}
        unknown = in_optimizer - {id(p) for p in trainable.values()}
        if unknown:
            raise ValueError(f"the optimizer holds {len(unknown)} parameter(s) that are not "
                             f"trainable parameters of the model (frozen, or of another model); "
                             f"build the optimizer from model.parameters() of this model")
        self.params = {k: p for k, p in trainable.items() if id(p) in in_optimizer}
        self.outside = [p for p in trainable.values() if id(p) not in in_optimizer]
        if self.outside:
            names = [k for k, p in trainable.items() if id(p) not in in_optimizer]
            warnings.warn(f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''} require "
                          f"grad but are not in the optimizer: they are not clipped or "
                          f"updated, and their (non-private) .grad is cleared at every step; "
                          f"set requires_grad=False to silence this", stacklevel=4)
        self.snapshot = self._structure()
        self.layer_rec = ActivationRecorder(self.layers, capture="hooks").__enter__()
        self.root_rec = ActivationRecorder({ROOT: model}, capture="hooks").__enter__()
        self.tracker = UseTracker(owners_of(self.layers, model), self.layer_rec,
                                  parameter_names(model))
        self.uncovered: dict[int, set[str]] = {}
        self._depth, self._tracking = 0, False
        self._handles = [model.register_forward_pre_hook(self._enter),
                         model.register_forward_hook(self._exit, always_call=True)]

    def _structure(self):
        return [id(m) for m in self.model.modules()], [
            id(p) for p in self.model.parameters() if p.requires_grad]

    def _enter(self, module, args):
        self._depth += 1
        if self._depth == 1 and self.layer_rec.recording:
            self.tracker.__enter__()
            self._tracking = True

    def _exit(self, module, args, output):
        self._depth -= 1
        if self._depth == 0 and self._tracking:
            self._tracking = False
            # the loss is not seen here: an output the model returns may be used there
            self.tracker.batch_free.exclude(tree_flatten(output)[0])
            self.tracker.__exit__(None, None, None)
            for key, where in self.tracker.uncovered.items():
                self.uncovered.setdefault(key, set()).update(where)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.layer_rec.__exit__(None, None, None)
        self.root_rec.__exit__(None, None, None)

    @contextmanager
    def paused(self):
        with ExitStack() as stack:
            stack.enter_context(self.layer_rec.paused())
            stack.enter_context(self.root_rec.paused())
            yield

    def clear(self) -> None:
        self.layer_rec.clear()
        self.root_rec.clear()

    def check_step(self) -> None:
        """A fresh backward pass since the last step, into the model made private."""
        if self._structure() != self.snapshot:
            raise RuntimeError("the model's layers or trainable parameters changed after "
                               "make_private (a layer added, replaced or unfrozen): their "
                               "gradients would not be recorded. Call make_private again on "
                               "the changed model (with a new optimizer over its parameters)")
        if not any(any(g is not None for g in c.grads) for c in self.root_rec.all_calls()):
            raise RuntimeError("step() called without a backward() since the last step (or "
                               "twice after one backward): each step needs its own "
                               "optimizer.zero_grad(), loss = criterion(model(x), y), "
                               "loss.backward(), then optimizer.step(). A step without fresh "
                               "gradients would be a pure-noise update charged to the budget")

    def batches(self, loss_reduction: str, verify: bool):
        """(Recording, exact per-sample gradients of fallback parameters) per backward pass."""
        self.layer_rec.collect()
        self.root_rec.collect()
        check_recorded(self.layers, self.layer_rec)
        roots = [c for c in self.root_rec.calls[ROOT] if c.backprops is not None]
        for gen in sorted({c.generation for c in roots}):
            mine = [c for c in roots if c.generation == gen]
            rec = self._recording(gen, mine, loss_reduction)
            rec.probe = None
            if verify and rec.n >= 2 and len(mine) == 1:
                root = mine[0]
                rec.probe = selfcheck.probe_norm(selfcheck.probe(
                    rec, self.model, dot_loss, _inputs(root), root.backprops))  # ||g_i||
            yield rec, self._exact(rec, mine)

    def _recording(self, gen: int, roots, loss_reduction: str) -> Recording:
        b = roots[0].backprops
        t = b[0] if isinstance(b, tuple) else b
        n = t.shape[0] if t.dim() else 1
        p0 = next(iter(self.params.values()))
        rec = Recording(n, self.layers, self.layer_rec, self.params, p0.dtype, p0.device,
                        random=self.tracker.random, generation=gen)
        note_uncovered(rec, self.uncovered)
        calls = [c for _, _, c in rec.calls()] + list(roots)
        if loss_reduction == "mean":  # a mean-reduced loss scaled every b_i by 1/n
            for call in calls:
                b = call.backprops
                call.backprops = tuple(t * n for t in b) if isinstance(b, tuple) else b * n
        for path, layer, call in rec.calls():
            problem = batch_problem(layer, call, n)
            if problem:
                rec.mark(layer, path, problem)
        return rec

    def _exact(self, rec: Recording, roots) -> dict:
        names = rec.fallback_names()
        if not names or rec.n == 0:
            return {}
        reasons = sorted(set(rec.fallback.values()))
        root = roots[0]
        if len(roots) != 1 or root.kwargs or batch_problem(self.model, root, rec.n):
            raise UnsupportedLayerError(
                f"{', '.join(names)} need the exact whole-model fallback ({'; '.join(reasons)})"
                f", which needs one call model(*inputs) per backward pass with the batch on "
                f"dim 0 of the inputs and outputs; this backward pass had {len(roots)} model "
                f"call(s). Restructure the forward pass, or compute per-sample gradients with "
                f"wb.clipped_grad_sum(model, loss_fn, x, y, C, method=...)")
        grads = exact_per_sample_gradients(self.model, dot_loss, _inputs(root), root.backprops,
                                           names, reasons)
        return {id(self.params[k]): g for k, g in grads.items()}

    def verify(self, rec: Recording, norms: torch.Tensor) -> None:
        """The probed sample's norm against micro-batching (deterministic models)."""
        if rec.probe is not None and not rec.random:
            selfcheck.compare_norm(rec, norms[rec.n - 1], rec.probe)

    def drop_outside_grads(self) -> None:
        for p in self.outside:
            p.grad = None


def _inputs(call):
    return call.args if len(call.args) != 1 else call.args[0]

