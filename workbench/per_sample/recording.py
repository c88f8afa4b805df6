"""One recording of a batch, shared by einsum, ghost clipping, book-keeping and the optimizer.

A per-layer rule (``workbench/rules/``) is exact for a parameter only when every
use of that parameter is a call of a layer that owns it, hooked, with the batch on dim 0 of
the call's inputs and outputs. ``record`` runs the forward pass with the hooks of
``hooks.ActivationRecorder`` and the ``uses.UseTracker`` and decides, per parameter, which of
the two it is:

- **by rule**: every use is covered and every call carries the batch on dim 0;
- **exact fallback**: anything else (a tied head written ``h @ E.T``, a positional embedding
  used twice, a sequence-first layer, ``self.fc.forward(x)``, a parametrised weight, a layer
  whose output no hook can read: a dict, a tuple with a mask, ``odd_outputs``; a partial
  view of a tensor written in place after the call, ``views.py``; a weight computed inside
  a ``torch.autograd.Function``: ``unseen.py``).

Common uses outside a layer's own call become rule calls during the forward pass
(``uses.py``): ``F.linear(h, E)`` of a tied head and ``F.embedding(ids, W)`` of an Embedding
subclass (``tied.py``), a parameter broadcast into the batch, ``x + pos_embed`` (``tied.py``,
``rules/broadcast.py``), and a position-wise layer called without the batch and added to it,
``tok + wpe(arange(T))`` (``broadcast.py``). Its per-sample
  gradient comes from ``torch.func`` over the whole model (``vmap(grad(...))``), or, where
  vmap cannot run the model, from micro-batching; ``fallback`` says why, per parameter.

The batch-on-dim-0 test here looks at shapes (dim 0 must be n); ``selfcheck.py`` adds what
shapes cannot show (T == n) and checks the result numerically.

Notation: n batch size, a activations, b backprops, ℓ_i per-sample loss.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.nn.utils.parametrize import ParametrizationList

from workbench.errors import LossCouplingError, LossShapeError, UnsupportedLayerError
from workbench.per_sample import precision
from workbench.per_sample.batch_reductions import loss_window_tolerance, refuse_reached
from workbench.per_sample.checks import (
    check_batch,
    check_losses,
    check_no_sample_mixing,
    forward,
    scalar_output_problem,
    trainable_parameters,
)
from workbench.per_sample.derived import graph_nodes
from workbench.per_sample.fallback import redraws
from workbench.per_sample.hooks import PAUSED, ActivationRecorder
from workbench.per_sample.leaves import call_leaves, leaves
from workbench.per_sample.registry import find_grad_sampler, find_sampler_check, layer_type
from workbench.per_sample.state_replay import PassLog
from workbench.per_sample.structure import model_tables
from workbench.per_sample.tied import delegates
from workbench.per_sample.unseen import unseen
from workbench.per_sample.uses import UseTracker, advanced, generator_states
from workbench.per_sample.views import stale


def rng_state(device: torch.device) -> tuple:
    """The random state a forward pass starts from (CPU, and the CUDA device's), replayed by
    ``selfcheck.record_probe``."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def own_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters a module owns itself: registered on it and not also on one of
    its submodules (a DP layer re-exposes its parts' weights under torch.nn's names; the
    part, the innermost owner, is where they are used and sampled). A leaf layer, the common
    case, is read from its own table, without a walk (a fixed cost of every record)."""
    deeper = {id(p) for child in module.children() for p in child.parameters()} \
        if module._modules else ()
    seen, own = set(), []
    for name, p in module._parameters.items():  # as named_parameters(recurse=False)
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            if p.requires_grad and id(p) not in deeper:
                own.append((name, p))
    return own


def layers_with_parameters(model: nn.Module) -> dict[str, nn.Module]:
    """``{path: module}`` of modules owning trainable parameters themselves.

    A ``ParametrizationList`` (``torch.nn.utils.parametrize``) is left out: its output is a
    weight, not a batch, so its parameters are uses outside any layer (exact fallback). So is
    an Embedding subclass without a rule (``tied.delegates``): its ``F.embedding`` lookups are
    recorded as Embedding calls, any other use of its weight is uncovered (exact fallback).
    """
    return {path: module for path, module in model.named_modules()
            if not isinstance(module, ParametrizationList) and own_parameters(module)
            and not delegates(module)}


def owners_of(layers: dict[str, nn.Module], model: nn.Module, params=None) -> dict[int, set[str]]:
    """{id(param): paths of the recorded layers owning it} for every trainable parameter of
    ``model`` (an empty set: no recorded layer owns it, so every use is uncovered);
    ``params``: ``trainable_parameters(model)`` if the caller has it (no second walk)."""
    params = trainable_parameters(model) if params is None else params
    owners: dict[int, set[str]] = {id(p): set() for p in params.values()}
    for path, layer in layers.items():
        for _, p in own_parameters(layer):
            owners.setdefault(id(p), set()).add(path)
    return owners


def parameter_names(model: nn.Module, params=None) -> dict[int, str]:
    """{id(param): name} of the trainable parameters (paths of functional layers);
    ``params``: ``trainable_parameters(model)`` if the caller has it."""
    params = trainable_parameters(model) if params is None else params
    return {id(p): name for name, p in params.items()}


def check_layers(layers: dict[str, nn.Module], strict: bool, covered=None) -> None:
    """Before the forward pass: each sampler's option check, and ``strict`` for layers
    without a sampler (``covered(layer) -> bool`` marks layers another rule handles)."""
    for path, layer in layers.items():
        kind = layer_type(layer)
        check = find_sampler_check(layer)
        if check is not None:
            check(layer)
        has_rule = find_grad_sampler(layer) is not None or (covered is not None and covered(layer))
        if strict and not has_rule:
            raise UnsupportedLayerError(
                f"{kind.__name__} at {path or '<model>'} has trainable parameters but no grad "
                f"sampler; register one with @wb.register_grad_sampler({kind.__name__}) or "
                f"pass strict=False to compute it by vmap on that layer")


FUSED = (nn.RNNBase, nn.MultiheadAttention)  # torch.nn layers whose kernels hide the products


def check_recorded(layers: dict[str, nn.Module], recorder: ActivationRecorder) -> None:
    """One of torch.nn's fused recurrent and attention layers without a grad sampler of its
    own is an error, never zeros: its kernel hides the products a rule needs (``fix_model``
    swaps in the DP version). Any other layer whose output no hook can read is sent to the
    exact fallback (``odd_outputs``)."""
    for path, layer in layers.items():
        if not isinstance(layer, FUSED) or find_grad_sampler(layer) is not None:
            continue
        odd = recorder.untracked.get(path)
        if odd is None and not recorder.calls[path]:
            continue
        name = type(layer).__name__
        raise UnsupportedLayerError(
            f"{name} at {path or '<model>'} returns a {(odd or 'tuple').split()[0]}, and its "
            f"per-sample "
            f"gradients cannot be captured (torch.nn's fused recurrent and attention kernels "
            f"hide their inner products); use wb.fix_model(model) to swap in the wb.layers DP "
            f"version, or register a grad sampler for {name}")


def odd_outputs(rec: "Recording") -> None:
    """Send to the exact fallback the parameters of every layer that returned something other
    than a Tensor or a tuple of Tensors (``hooks.tensor_outputs``: a tuple holding ``None``,
    as Hugging Face's attention blocks return ``(output, None)``; IBert's ``QuantLinear``'s
    ``(output, None)``; a dict): no hook reads the gradient of such an output, so no rule or
    per-layer vmap can be applied to its calls, while ``g_i`` of the whole model is exact.
    A parameter the layer hands over to a broadcast call (a cls token ``cat``-ed to the batch
    inside Hugging Face's ``embeddings, (height, width)`` of Data2Vec-Vision, PVT, Hiera:
    ``tied.py``, ``rec.taken``) keeps that call's rule, which needs no call of its owner."""
    for path, kind in rec.recorder.untracked.items():
        layer = rec.layers.get(path)
        if layer is None:
            continue
        for _, p in own_parameters(layer):
            if id(p) not in rec.taken:
                rec.fallback.setdefault(id(p), f"{type(layer).__name__} at {path or '<model>'} "
                                               f"returns a {kind}: no hook can read the "
                                               f"gradient of its output")


def checked_shapes(layer, call) -> list[torch.Size]:
    """Shapes that must carry the batch on dim 0 for ``layer``'s rule to hold: its outputs
    and first input (a registered sampler), or every Tensor in its arguments, nested ones
    too (vmap on the layer maps every Tensor leaf: a rotary (cos, sin) pair of shape
    (1, T, d) passed as a tuple is no more batched than a (1, T) argument)."""
    shapes = [s for s, _, _ in call.outputs]
    if find_grad_sampler(layer) is not None:
        return shapes + [a.shape for a in call.args if isinstance(a, torch.Tensor)][:1]
    return shapes + [t.shape for t in call_leaves(call.args, call.kwargs)
                     if isinstance(t, torch.Tensor)]


NOT_THE_BATCH = "dim 0 is not the batch"  # batch_problem's words (dpsgd/path_check.py)


def batch_problem(layer, call, n: int, proved: bool = True) -> str | None:
    """Why a call does not carry the batch on dim 0 (by shape, or by what its inputs were
    computed from), or None. ``proved``: its rows must be proved the records' in order, op by
    op (``flat_rows.unproved``); not for the model's own call, which the whole-model
    fallback runs on each record alone (its halves are checked: ``selfcheck``)."""
    for shape in checked_shapes(layer, call):
        if len(shape) == 0 or shape[0] != n:
            return (f"is called on a tensor of shape {tuple(shape)}: {NOT_THE_BATCH} "
                    f"(n = {n})")
    if call.reordered:
        return ("is called on the batch's rows in another order (an index along dim 0 "
                "inside the model, x[perm] or index_select, as a sort by length does): row r "
                "is not record r's, so its rule would give record r another record's "
                "gradient; its parameters take the exact fallback")
    if proved and call.unproved:
        return (f"is called on {call.unproved} computed from the batch by an op that does not "
                f"show which record each row is (row r may be another record's: a sort or "
                f"mix of the rows the tracker cannot follow, a custom autograd.Function, an "
                f"FFT, a write out[idx] = h); its parameters take the exact fallback")
    return rows_not_samples(layer, call, n)


def rows_not_samples(layer, call, n: int) -> str | None:
    """A call on tensors computed without the batch (``derived.Taint``) whose dim 0 happens
    to be n (DoRA's ``lora_A(eye(d))`` with d = n, a position table with T = n): its rows
    are not samples unless they are one constant row repeated (BERT's token types expanded
    to the batch), so its rule would read them as samples. Else None."""
    if call.tainted is not False or call.meet is not None or call.rows is not None or n < 2 \
            or layer.__dict__.get("takes_over", False):
        return None
    known = call.repeated  # noted before streaming dropped the values (hooks.drop_inputs)
    for i, a in enumerate(call_leaves(call.args, call.kwargs)):
        if isinstance(a, torch.Tensor) and a.dim() >= 1 and a.shape[0] == n:
            if a.is_meta:
                same = known is not None and i < len(known) and known[i]
            else:
                with torch.no_grad():
                    same = bool((a == a[:1]).all())
            if not same:
                return (f"is called on a tensor computed without the batch, of shape "
                        f"{tuple(a.shape)}: its dim 0 is n = {n} by coincidence, its rows "
                        f"are not samples")
    return None


@dataclass
class Recording:
    """A forward pass (and, after ``backward``, its backprops) of one batch of n samples."""

    n: int
    layers: dict[str, nn.Module]
    recorder: ActivationRecorder
    params: dict[str, nn.Parameter]
    dtype: torch.dtype
    device: torch.device
    losses: torch.Tensor | None = None  # (n,)
    fallback: dict[int, str] = field(default_factory=dict)  # id(param) -> why not by rule
    random: bool = False  # a random function (dropout) ran in the forward pass
    lowered: object = None  # a float dtype narrower than the parameters' computed in (uses.py)
    generation: int | None = None  # capture="hooks": only calls of this backward pass
    exact: dict = field(default_factory=dict)  # id(param) -> (n, *shape): the fallback's g_i
    probe: object = None  # selfcheck.probe_sketch: micro-batching's g_i of one sample (sketched)
    signature: tuple | None = None  # selfcheck: the call signature this recording verifies
    rng: tuple | None = None  # selfcheck.rng_state before the forward pass (record_probe)
    state: object = None  # state_replay.PassLog: the model's state the forward pass read
    replay: object = None  # () -> exact g_i of the record probe (random models, when checked)
    factors: torch.Tensor | None = None  # (n,) f_i applied to record i's backprops (loss.py)
    autocast: torch.dtype | None = None  # the forward pass's autocast dtype (precision.py)
    taken: dict = field(default_factory=dict)  # id(param) -> [the tied.py layers (a
    # BroadcastParameter, a functional linear) that take it over from its rule-less owner]
    feeds: object = None  # (call) -> whether its output reaches the loss (``loss_reach``)
    trace: int = 0  # uses.UseTracker.trace of the forward pass: its ops (selfcheck.signature)
    hooks: list = field(default_factory=list)  # the gradient hooks the pass registered
    loss_parts: tuple | None = None  # (loss_fn or None for a random loss, outputs, targets,
    # inputs): the functional API's model and loss on halves of the batch, on a checked call
    # (``selfcheck.check_model_halves``, ``check_separable``), then dropped
    halves: object = None  # the optimizer's: the batch's inputs, for check_model_halves
    batch_grads: dict = field(default_factory=dict)  # id(param) -> the batch's own gradient
    # of a fallback parameter, on a checked call (``selfcheck.compare_alone``)

    def calls(self):
        """(path, layer, call) for every call whose output reached the loss."""
        for path, layer in self.layers.items():
            for call in self.recorder.calls[path]:
                if call.backprops is not None and (self.generation is None
                                                   or call.generation == self.generation):
                    yield path, layer, call

    def own(self, layer) -> list[tuple[str, nn.Parameter]]:
        """The layer's trainable parameters computed by its rule (not by the fallback)."""
        ids, taken = self._ids(), self.taken
        return [(name, p) for name, p in self._owned(layer)
                if id(p) in ids and id(p) not in self.fallback
                and (id(p) not in taken or any(t is layer for t in taken[id(p)]))]

    def hands_over(self, layer) -> bool:
        """Every parameter of ``layer`` is taken over by a BroadcastParameter call (timm's
        ViT: the model owns cls_token and pos_embed): the layer has nothing to sample."""
        owned = self._owned(layer)
        return bool(owned) and all(id(p) in self.taken and not any(
            t is layer for t in self.taken[id(p)]) for _, p in owned)

    def _owned(self, layer):
        cache = self.__dict__.setdefault("_own_cache", {})
        if id(layer) not in cache:
            cache[id(layer)] = own_parameters(layer)
        return cache[id(layer)]

    def _ids(self) -> set[int]:
        """ids of the parameters this recording is for (an optimizer's may be a subset)."""
        if getattr(self, "_param_ids", None) is None:
            self._param_ids = {id(p) for p in self.params.values()}
        return self._param_ids

    def shared_ids(self) -> set[int]:
        """ids of rule parameters used in more than one call (their norms need cross terms)."""
        seen: dict[int, int] = {}
        for _, layer, _ in self.calls():
            for _, p in self.own(layer):
                seen[id(p)] = seen.get(id(p), 0) + 1
        return {key for key, count in seen.items() if count > 1}

    def fallback_names(self) -> list[str]:
        return [name for name, p in self.params.items() if id(p) in self.fallback]

    def mark(self, layer, path: str, reason: str) -> None:
        """Send the layer's parameters to the exact fallback, saying why."""
        for _, p in own_parameters(layer):
            self.fallback.setdefault(id(p), f"{type(layer).__name__} at {path or '<model>'} "
                                             f"{reason}")


def tables(model: nn.Module) -> tuple[dict, dict, dict, dict]:
    """(layers, params, owners, names): what ``record`` reads of the model's structure,
    computed afresh (``structure.model_tables`` keeps it per layout)."""
    layers, params = layers_with_parameters(model), trainable_parameters(model)
    return layers, params, owners_of(layers, model, params), parameter_names(model, params)


def record(model, loss_fn, inputs, targets, strict=False, covered=None) -> Recording:
    """The forward pass with hooks and the use tracker; losses (n,); the fallback decided."""
    check_no_sample_mixing(model)
    n = check_batch(inputs, targets)
    layers, params, owners, names = model_tables(model, tables)  # once per layout
    check_layers(layers, strict, covered)
    p0 = next(iter(params.values()))
    rng = rng_state(p0.device)
    with ActivationRecorder(layers) as recorder:
        tracker = UseTracker(owners, recorder, names)
        with torch._C.DisableTorchFunction():
            log = PassLog(model)  # the state the pass reads, for re-runs
        tracker.state = log
        with tracker:
            tracker.start(leaves((inputs, targets)))  # the batch: what it touches, its rows
            outputs = forward(model, inputs)
            quiet = partial(quiet_passes, recorder, model)
            tracker.refuse_mixing(leaves(outputs), quiet)  # a statistic over the
            # records the outputs' gradient flows through (batch_reductions.py)
            tracker.in_loss = True
            with torch._C.DisableTorchFunction():
                drawn = generator_states()  # a random loss is not run on halves (selfcheck)
            tracker.loss_stats = loss_statistics(n, outputs)
            tracker.loss_rows = loss_row_proof(outputs, tracker)
            try:
                losses = loss_fn(outputs, targets)  # (n,)
                coupled = loss_coupling(tracker, losses, outputs, quiet)
            finally:
                tracker.loss_stats.stop()
                tracker.loss_stats = tracker.loss_rows = None
            with torch._C.DisableTorchFunction():
                random_loss = advanced(drawn) or tracker.loss_drew
            tracker.state = None  # the loss's draws from its own generator too (re-runs
            with torch._C.DisableTorchFunction():  # call loss_fn again: rerun_losses, the
                log.close()  # record probe, the replayed fallback)
        if coupled is not None:
            raise coupled
        check_losses(losses, n)
        problem = scalar_output_problem(outputs, losses, quiet)
        if problem:  # the optimizer's own check (``output_rows_problem``), before any work
            raise LossShapeError(problem)
        tracker.derived.settle([losses], n, recorder)
    check_recorded(layers, recorder)
    every_call = [(path, layer, call) for path, layer in layers.items()
                  for call in recorder.calls[path]]
    uncovered = {**tracker.uncovered, **unseen(tracker, [losses])}  # disjoint (unseen.py)
    return new_recording(n, layers, recorder, params, uncovered, every_call,
                         losses=losses, random=tracker.random, lowered=tracker.lowered, rng=rng,
                         trace=tracker.trace,
                         loss_parts=(None if random_loss else loss_fn, outputs, targets,
                                     inputs),
                         autocast=precision.state(p0.device), feeds=loss_reach([losses]),
                         state=log)


@contextmanager
def quiet_passes(recorder, model):
    """``recorder.paused()``, and no recorder of ``model`` itself stores a gradient either
    (``hooks.PAUSED``): the checks' own gradient passes from the losses to the outputs reach
    the model's outputs, where a DP optimizer attached to the same model keeps its root
    hooks; they took such a pass for the user's and refused the next step as a stray backward
    pass (a functional call beside an optimizer, as ``choose_mode`` is tested) until
    2026-12-02."""
    with recorder.paused():
        PAUSED[id(model)] += 1
        try:
            yield
        finally:
            PAUSED[id(model)] -= 1
            if PAUSED[id(model)] <= 0:
                del PAUSED[id(model)]


def loss_statistics(n: int, outputs):
    """The optimizer's follower of batch statistics in the loss window
    (``dpsgd.loss_terms.BatchStatistics``), started on the batch's n and the model's
    ``outputs``: the functional API's loss_fn is followed op by op as the optimizer follows a
    loop's loss. (Imported here: the optimizer's package imports this one.)"""
    from workbench.dpsgd.loss_terms import BatchStatistics
    stats = BatchStatistics()
    stats.reset(n, leaves(outputs))
    return stats


def loss_row_proof(outputs, tracker):
    """The optimizer's row proof of the loss (``dpsgd.loss_rows.LossRows``), seeded with the
    rows the forward pass proved for the model's ``outputs``; None where the pass registered
    a gradient hook (its backward may combine rows whatever the ops did)."""
    from workbench.dpsgd.loss_rows import LossRows
    if tracker.hooks:
        return None
    with torch._C.DisableTorchFunction():
        return LossRows([(o, tracker.flat_rows.full(o)) for o in leaves(outputs)
                         if isinstance(o, torch.Tensor) and o.requires_grad])


def rows_proved(losses, outputs, tracker) -> bool:
    """Are the per-record ``losses`` (n,) proved record i's from record i's rows of the
    outputs alone by their ops (``loss_row_proof``: loss i is row i of a tensor the proof
    tagged one row per record, in the records' order), with no custom ``autograd.Function``
    or gradient hook but the workbench's own between them and the outputs? Then ∂L_i/∂o_j is
    0 for i != j by construction, and ``loss_rows_coupled``'s two backward passes, which
    measure exactly that, need not run."""
    from workbench.dpsgd.loss_rows import foreign_hooks, opaque
    proof, n = tracker.loss_rows, losses.shape[0]
    if proof is None or not proof.on or tracker.hooks or proof.rows.full(losses) != (n, 1, None):
        return False
    chain = (entry[0]() for entry in proof.rows.tags.values())
    if any(foreign_hooks(t) for t in chain if t is not None):
        return False
    held = [t.grad_fn for t in leaves(outputs) if isinstance(t, torch.Tensor)]  # held: the
    stops = {id(node) for node in held if node is not None}  # walk meets these objects
    return not opaque(graph_nodes([losses], stops))


def loss_coupling(tracker, losses, outputs, paused):
    """The error for a loss_fn whose losses couple the records, or None; two structural
    checks, where the halves check (``selfcheck.check_separable``) compares values at the
    pass's tolerance: a router's balance term times 1e-4 moved the float32 losses by 2.4e-5
    and passed ghost clipping, book-keeping and einsum (micro-batching refused it) until
    2026-12-02. (1) The losses are a batch statistic, or loss_fn branched on one: a reduction
    over the records without gradient, or a detached one, reached them (the optimizer's
    ``LossWatch.statistics``, one message: ``loss_terms.statistic_error``). (2) A reduction
    over the records with gradient in loss_fn that the losses' gradient flows through
    (``batch_reductions.refuse_reached`` from the losses). Any other op reading another
    record's rows with gradient: ``loss_rows_coupled``."""
    from workbench.dpsgd.loss_terms import statistic_error
    stats = tracker.loss_stats
    error = statistic_error(stats.statistic(losses) if isinstance(losses, torch.Tensor)
                            else None, stats.branch(), "in loss_fn")
    if error is not None:
        return error
    notes, tracker.loss_reductions = tracker.loss_reductions, []
    if not (isinstance(losses, torch.Tensor) and losses.requires_grad and losses.dim() == 1):
        return None
    try:
        with torch._C.DisableTorchFunction():
            if notes:
                refuse_reached(notes, [losses], graph_nodes, paused, loss_window_tolerance,
                               who="loss_fn")
            if not rows_proved(losses, outputs, tracker):  # else 0 by its ops
                loss_rows_coupled(losses, proved_outputs(outputs, losses.shape[0],
                                                         tracker.flat_rows.of), paused)
    except LossCouplingError as err:
        return err
    return None


def proved_outputs(outputs, n: int, rows_of) -> tuple:
    """The model's floating outputs with gradient whose rows are proved the n records', in
    order (``rows_of``: ``flat_rows.FlatRows.of``): blocks of m rows each."""
    return tuple(t for t in leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad
                 and t.is_floating_point() and t.dim() and (rows_of(t) or (0,))[0] == n)


def loss_rows_coupled(losses, outs, paused) -> None:
    """LossCouplingError unless each record's loss has gradient on its own rows of the
    outputs ``outs`` alone (``proved_outputs``). With per-record losses L_i,
    ∂(Σ_i u_i L_i)/∂o_j = u_j ∂(Σ_i L_i)/∂o_j for every record j and any weights u: two
    backward passes through loss_fn's ops alone (the gradient stops at the outputs), with
    u = 1 and u fixed random in [1, 2], each gradient reduced at once to two numbers per record
    (its norm, and its product with the record's own output rows, which sees a coupling
    orthogonal to the record's own gradient) and freed, so one output-sized gradient is alive
    at a time; compared at rounding (``loss_window_tolerance``). Any op that lets one
    record's loss read another's rows breaks it, whatever it is (a Gram matrix o @ o.T, a
    roll, a cdist, a cumulative sum cancelled in value): at 1e-4 of the loss, such terms
    passed the batched methods under float32's value tolerance until 2026-12-02, and with
    check=False at any size (probe AH). A statistic without gradient is the follower's
    (``loss_coupling``)."""
    n = losses.shape[0] if isinstance(losses, torch.Tensor) and losses.dim() == 1 else 0
    if n < 2 or not outs or not losses.requires_grad:
        return
    gen = torch.Generator().manual_seed(0)
    u = 1 + torch.rand(n, generator=gen, dtype=torch.float64)
    seen = []
    for w in (torch.ones(n, dtype=torch.float64), u):
        with paused(), torch.enable_grad():
            grads = torch.autograd.grad(losses, outs, grad_outputs=w.to(losses),
                                        retain_graph=True, allow_unused=True)
        seen.append([None if g is None else _row_numbers(g, t, n)
                     for t, g in zip(outs, grads)])
        del grads
    for t, one, weighted in zip(outs, *seen):
        if one is None or weighted is None:
            continue
        (dot1, norm1, size), (dotu, normu, _) = one, weighted
        off = max(float((dotu - u * dot1).norm() / ((u * norm1 + normu) * size).norm()
                        .clamp_min(1e-300)),
                  float((normu - u * norm1).norm() / (u * norm1 + normu).norm()
                        .clamp_min(1e-300)))
        if off > loss_window_tolerance(t.dtype, t.device):
            raise LossCouplingError(
                f"loss_fn couples the records: record i's loss has gradient on other records' "
                f"rows of the model's output {tuple(t.shape)} (off by {off:.3g} of the "
                f"gradient there; a per-record loss has none): it reads other records' "
                f"outputs (a Gram matrix o @ o.T, a contrastive loss over the batch's pairs, a "
                f"roll, flip or permutation of the records, a cumulative sum, a distance "
                f"between records), even where its value does not change. Record i's clipped "
                f"gradient then carries the others', so per-record clipping bounds nothing. "
                f"Compute each record's loss from its own rows only, and return one loss per "
                f"record")


def _row_numbers(g, t, n: int) -> tuple:
    """(⟨g_j, o_j⟩, ||g_j||, ||o_j||) per record j, (n,) each, computed in float64 over
    chunks of an eighth of the records, so no temporary is larger than a quarter of the
    output (``loss_rows_coupled``): float32's own sums would hide a coupling of 1e-5."""
    rows, own = g.reshape(n, 1, -1), t.detach().reshape(n, -1, 1)
    step = max(1, n // 8)
    parts = [(torch.bmm(a, b).reshape(-1), torch.linalg.vector_norm(a, dim=(1, 2)),
              torch.linalg.vector_norm(b, dim=(1, 2)))
             for i in range(0, n, step)
             for a, b in [(rows[i:i + step].double(), own[i:i + step].double())]]
    return tuple(torch.cat([p[k] for p in parts]).cpu() for k in range(3))


def loss_reach(roots):
    """(call) -> whether the call's output reaches the loss: its gradient node is among those
    the graph from ``roots`` (tensors, or autograd nodes) reaches, walked once, when first
    asked. A call whose output never reaches the loss (DoRA's ``lora_B(lora_A(eye(d)))``,
    detached before the norm it feeds) adds nothing to any g_i: its shapes and inputs prove
    or disprove nothing, so no layout check may send its layer to the fallback for it."""
    seen = None

    def feeds(call) -> bool:
        nonlocal seen
        if seen is None:
            seen = {id(node): node for node in graph_nodes(roots)}  # held: ids stay theirs
        return any(e.node is not None and id(e.node) in seen for e in call.capture_edges())

    return feeds


DREW = ("has no per-layer rule and drew random numbers during its call (a default generator "
        "advanced: functional dropout, torch.rand...; the per-layer vmap would draw others): "
        "computed from the whole model with the batch's random state replayed")


def new_recording(n: int, layers, recorder, params, uncovered, calls, **fields) -> Recording:
    """The one constructor of a Recording (``record`` above, the optimizer's
    ``dpsgd/recorded.py``): the fallback decided for the parameters used outside their layer
    (``uncovered``) and for the layers of ``calls`` [(path, layer, call)] whose call does not
    carry the batch on dim 0. ``fields``: the Recording's optional fields."""
    p0 = next(iter(params.values()))
    rec = Recording(n, layers, recorder, params, p0.dtype, p0.device, **fields)
    note_uncovered(rec, uncovered)
    stale_views(rec)
    for path, layer, call in calls:
        if layer.__dict__.get("takes_over", False):  # tied.py's layers set it in __init__;
            # getattr would ask nn.Module.__getattr__, which builds an error for each layer
            for q in layer.parameters(recurse=False):  # a functional linear's bias too
                rec.taken.setdefault(id(q), []).append(layer)  # every one: a bias a
                # functional linear and a broadcast both take (``o = F.linear(x, w, b) + b``)
                # is in both their rules (its linear part dropped, 0.5 off, until 2026-11-30)
        problem = batch_problem(layer, call, n) or (rec.random and redraws(layer)) or (
            path in recorder.drew and DREW)
        if problem and (rec.feeds is None or rec.feeds(call)):
            rec.mark(layer, path, problem)
    if recorder.untracked:
        odd_outputs(rec)
    if recorder.before:
        stateful(rec)
    derived_of_ruleless(rec)
    return rec


def stateful(rec: Recording) -> None:
    """Every layer without a grad rule whose attributes or buffers changed since its first
    call (``hooks.changed_state``: RecurrentGemma's RG-LRU rebinds ``recurrent_states``,
    which its next call starts from): its calls are re-run by the
    per-layer vmap and micro-batching, which would read the state the pass left, not the state
    each call read, so its parameters take the exact whole-model fallback (which re-runs the
    whole forward, the state set up by the model as the user's pass set it up). A layer with
    a grad rule is never re-run: its rule reads the recorded a and b."""
    rule_less = rec.recorder.changed(among=lambda layer: find_grad_sampler(layer) is None)
    for path, names in rule_less.items():
        layer = rec.layers.get(path)
        if layer is not None:
            rec.mark(layer, path, f"changes {', '.join(names)} in its forward: a re-run of a "
                                  f"call (per-layer vmap or micro-batching) would read what "
                                  f"the pass left there, not what the call read")


def derived_of_ruleless(rec: Recording) -> None:
    """Parameters that reach the loss only through meetings of tensors computed from them
    (``derived.py``), owned by a layer without a rule (Mamba's mixer: ``-exp(A_log)`` times
    the batch) or by a layer called only without the batch (a Linear projecting an embedding
    table whose dim 0 happens to be n: its rule would read the rows as samples): from the
    meetings, not by vmap on the layer or its rule; the whole-model fallback if a meeting
    cannot give them."""
    derived = rec.recorder.derived
    if derived is None or not derived.meetings:
        return
    gen = rec.generation if rec.generation is not None else 0
    complete = {id(p) for m in derived.meetings if m.generation == gen for p in m.params}
    for path, layer in rec.layers.items():
        calls = rec.recorder.calls.get(path, [])
        if find_grad_sampler(layer) is None:
            why = "has no rule"
        elif calls and not any(c.tainted for c in calls):
            why = "is called only on tensors computed without the batch"
        else:
            continue
        for _, p in own_parameters(layer):
            if id(p) in complete:
                rec.fallback.setdefault(id(p), f"{type(layer).__name__} at "
                                               f"{path or '<model>'} {why}")


def stale_views(rec: Recording) -> None:
    """Every recorded call whose output, a view of part of a tensor, was written in place
    after the call (``views.py``): its b never arrives (nor a generation), so every call of
    the recorder is looked at, not only those whose b arrived; its layer's parameters take
    the exact fallback, in the recording of every backward pass before the step (a stale
    call has no generation to say which one it belongs to)."""
    for path, calls in rec.recorder.calls.items():
        if path in rec.layers and any(call.watch and stale(call.watch) for call in calls):
            rec.mark(rec.layers[path], path, "returns a view of part of a tensor, written in "
                                             "place after the call, so the gradient of its "
                                             "output cannot be read")


def note_uncovered(rec: Recording, uncovered: dict[int, set[str]]) -> None:
    if not uncovered:
        return
    names = {id(p): name for name, p in rec.params.items()}
    for key, where in uncovered.items():
        places = ", ".join(sorted(w or "<model>" for w in where))
        rec.fallback.setdefault(key, f"{names.get(key, 'a parameter')} is used outside the "
                                     f"forward of the layer that owns it (in {places})")


__all__ = [
    "FUSED", "NOT_THE_BATCH", "Recording", "batch_problem", "check_layers", "check_recorded",
    "checked_shapes", "derived_of_ruleless", "layers_with_parameters", "loss_reach",
    "note_uncovered", "odd_outputs",
    "own_parameters", "owners_of", "parameter_names", "record", "rng_state",
    "rows_not_samples", "stale_views", "stateful", "tables",
]
