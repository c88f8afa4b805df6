"""Ghost clipping: per-sample gradient norms from activations and backprops alone.

DP-SGD needs only ||g_i|| and Σ_i c_i g_i, never the n per-sample gradients themselves.
Ghost clipping (Goodfellow 2015, arXiv 1510.01799; Li, Tramèr, Liang, Hashimoto 2022,
arXiv 2110.05679, §4) gets both with two backward passes:

1. a backward pass of Σ_i ℓ_i in which each layer's *norm sampler* turns (a, b) into
   ||g_i^{layer}||² the moment the layer's backprop b is complete, and b and a are dropped
   (``per_sample.streaming``); ||g_i||² = Σ_layers ||g_i^{layer}||²;
2. c_i = min(1, C / ||g_i||) (``flat.clip_factors``), then an ordinary backward pass of
   Σ_i c_i ℓ_i, whose parameter gradient is Σ_i c_i g_i: the clipped sum.

Memory: Li et al. run pass 2 over pass 1's retained graph. Pass 1 then frees nothing that
autograd saved while its gradients flow through the graph (tiny_gpt, b = 32, T = 128: the
attention scores' gradients on top of every saved activation, 1.29x a plain step's peak,
``bench e2e``). Here pass 1 frees the graph as it goes, like a plain backward pass, and pass 2
runs the forward pass again (``rerun_losses``: the same random state, so the same dropout
masks, and the same autocast state) before its backward pass: no layer's a or b is kept
between the passes, and the peak is a plain step's (1.01x), for one more forward pass of
time, the trade of gradient checkpointing (Chen et al. 2016, arXiv 1604.06174). Book-keeping
(``bookkeeping.py``) keeps a and b instead and needs no second pass at all.

Layers without a norm sampler (normalisation layers, custom layers) get "fast gradient
clipping" (Opacus blog on fast gradient clipping and ghost clipping, seed 004): their
per-sample gradients are materialised, normed and dropped immediately.

A parameter used in more than one call (a module called twice) has the *sum* of several
layers' gradients as its per-sample gradient; the norm of a sum has cross terms. A weight
whose every call is a Linear's or an Embedding's (a tied head's E: its Embedding call and its
``F.linear`` call, ``per_sample.tied``; ALBERT's layers) is normed from its calls' (T, T)
Grams with those cross terms (``cross.py``) when they are smaller than its gradient; any
other shared parameter is materialised per call and summed before taking the norm: one
(n, *shape) tensor, to which each call adds its part as its b arrives. Parameters no per-layer
rule can account for (``per_sample.recording``) are materialised exactly by the whole-model
fallback, and the norms are checked against micro-batching on one sample
(``per_sample.selfcheck``).

Norm samplers compute ||g_i||² in the layer's dtype (||a_i||² ||b_i||² for ``nn.Linear``), which
overflows float32 once ||g_i|| passes 1.8e19: a layer whose ghost norm comes out NaN or inf is
re-normed by fast gradient clipping, whose norms are overflow-safe (``flat.sample_norms``); a
record that is non-finite there too is non-finite (``nonfinite.py``). Squared norms are float64.

Notation: n batch, a activations, b backprops, c clip factors, C max_grad_norm.
"""

import torch
from torch.nn.utils.parametrize import is_parametrized

from workbench.clipping import cross
from workbench.clipping.flat import many_sample_squares, norm_dtype
from workbench.clipping.registry import find_norm_sampler
from workbench.errors import PerSampleCheckError
from workbench.per_sample import precision, selfcheck, state_replay
from workbench.per_sample.checks import check_losses, forward
from workbench.per_sample.einsum import (
    fallback_gradients,
    replay_probe,
    sample_layer,
    warn_fallbacks,
)
from workbench.per_sample.fallback import replayed
from workbench.per_sample.hooks import drop_inputs
from workbench.per_sample.precision import in_full_precision, widen
from workbench.per_sample.recording import Recording, own_parameters
from workbench.per_sample.recording import record as record_forward
from workbench.per_sample.streaming import stream_backward


def _covered(layer) -> bool:
    return find_norm_sampler(layer) is not None


NORM_CHECK = ("norm",)  # the verdict key of a check of ||g_i|| alone (ghost's own sums)


def record_batch(model, loss_fn, inputs, targets, check=False, norms_only=False) -> Recording:
    """The forward pass with hooks; the fallback decided and, when ``check`` asks for it,
    ``probe`` (a sketch of micro-batching's g_i of one sample, ``per_sample/sketch.py``) set.
    No backward pass yet. ``norms_only``: the caller checks ||g_i|| alone (ghost clipping,
    whose sum is autograd's: only the norms enter it), under its own verdict key, which a
    verdict of the vector check (book-keeping, einsum) implies but never the reverse."""
    selfcheck.check_option(check)
    rec = record_forward(model, loss_fn, inputs, targets, covered=_covered)
    warn_fallbacks(rec, _covered)
    sig = selfcheck.known(model, rec, check, *((NORM_CHECK, ()) if norms_only else ()))
    rec.probe = selfcheck.probe_sketch(rec, model, loss_fn, inputs, targets) if sig \
        else None  # 3 numbers per parameter
    if sig is not None and rec.random:  # the record probe, run when the norms are known
        rec.replay = lambda: replay_probe(rec, model, loss_fn, inputs, targets)
    rec.signature = sig
    return rec


def record(model, loss_fn, inputs, targets, retain_graph: bool, check=False) -> Recording:
    """Forward, then one backward pass collecting every call's backprops (book-keeping keeps
    them for its clipped sum), and ``exact`` (the fallback parameters' per-sample gradients)."""
    rec = record_batch(model, loss_fn, inputs, targets, check)
    alone = selfcheck.alone_params(rec, rec.signature)
    selfcheck.keep_batch_grads(rec, alone, rec.recorder.backward(
        rec.losses.sum(), retain_graph=retain_graph, params=alone))
    rec.exact = fallback_gradients(rec, model, loss_fn, inputs, targets)
    return rec


def record_norms(model, loss_fn, inputs, targets, check=False):
    """(rec, ||g_i||² (n,), materialised): forward, then one backward pass in which each
    call's backprops become its norm contribution as they arrive and are dropped, with its
    inputs (``per_sample.streaming``, ``hooks.drop_inputs``): the graph is freed as it goes,
    and no two layers' b are held at once."""
    rec = record_batch(model, loss_fn, inputs, targets, check, norms_only=True)
    norms = NormSum(rec, lambda p: None, shared=recorded_shared(rec))
    layer_of = {id(call): layer for path, layer in rec.layers.items()
                for call in rec.recorder.calls[path]}

    def on_call(call):
        norms.add_call(layer_of[id(call)], call)
        drop_inputs(call)  # a: normed; the second pass runs the forward again

    alone = selfcheck.alone_params(rec, rec.signature)
    selfcheck.keep_batch_grads(rec, alone, stream_backward(
        rec.recorder.all_calls(), rec.losses.sum(), on_call, derived=rec.recorder.derived,
        params=alone))
    rec.exact = fallback_gradients(rec, model, loss_fn, inputs, targets)
    squares, materialised = norms.result(rec.exact)
    zeros = torch.zeros(rec.n, dtype=torch.float64, device=rec.device)
    return rec, squares.get(None, zeros), materialised


def verify_norms(model, rec: Recording, squares: torch.Tensor, remember: bool = True):
    """The probed sample's norm against micro-batching (deterministic models) or the record
    probe (random ones: ``selfcheck.py``); remember the verdict unless the caller checks more
    (``remember=False``: book-keeping then compares the sum's own row). Returns the exact
    twin (a sketch), or None when this call is not checked."""
    if rec.signature is None:
        return None
    ref = selfcheck.as_sketch(rec, rec.replay()) if rec.random else rec.probe
    rec.replay = None
    selfcheck.compare_norm(rec, squares[rec.n - 1].sqrt(), ref)
    if remember:
        selfcheck.remember(model, rec.signature, dict(rec.fallback))
    return ref


def checked_norms(layer, value, n: int) -> torch.Tensor:
    """A norm rule's result as float64 (n,), or ``PerSampleCheckError`` naming the layer: a
    rule returning another shape ((T,), (n, T)) broadcast into a raw size error, or worse,
    into the sum (until 2026-11-29), as a grad rule's wrong shape never could
    (``einsum.check_shapes``)."""
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != (n,):
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise PerSampleCheckError(
            f"the norm sampler registered for {type(layer).__name__} returned {got}, not the "
            f"({n},) squared norms of the batch's {n} records: it sums over the wrong dims. "
            f"Return Σ over the layer's parameters of ||g_i||², one number per record")
    return value.double()


def recorded_shared(rec: Recording) -> set[int]:
    """ids of rule parameters in more than one *recorded* call, known before the backward
    pass (``Recording.shared_ids`` counts the calls the loss reached, known after it)."""
    seen: dict[int, int] = {}
    for path, layer in rec.layers.items():
        for _ in rec.recorder.calls[path]:
            for _, p in rec.own(layer):
                seen[id(p)] = seen.get(id(p), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def squared_norms(rec: Recording, exact=None):
    """(||g_i||² (n,), {id(param): (n, *shape)} materialised: shared and exact)."""
    squares, materialised = squared_norms_by(rec, lambda p: None, exact)
    return squares.get(None, torch.zeros(rec.n, dtype=torch.float64, device=rec.device)), \
        materialised


def squared_norms_by(rec: Recording, group_of, exact=None):
    """Like ``squared_norms``, with ||g_i||² split by ``group_of(param)`` (per-layer clipping).

    Returns ({group: (n,)}, materialised), from the recorded backprops of every call.
    """
    norms = NormSum(rec, group_of, deferred=True)  # the backprops stay until result()
    for _, layer, call in rec.calls():
        norms.add_call(layer, call)
    return norms.result(exact)


class NormSum:
    """||g_i||² by group, one call at a time (a norm sampler gives one number per layer, so
    a layer whose rule parameters lie in different groups, or that has parameters left to
    the fallback, is materialised instead; so are ``shared`` parameters, summed over their
    calls before the norm).

    A ghost norm that is NaN or inf (float32 overflow, or a non-finite record) is re-normed by
    fast gradient clipping (module docstring). ``deferred`` (the calls keep their backprops
    until ``result``): the check waits for ``result``, one device sync for all layers; else
    (``stream_backward`` drops each b once handed over) each layer is checked as it comes.
    """

    def __init__(self, rec: Recording, group_of, shared=None, deferred=False):
        self.rec, self.group_of = rec, group_of
        self.shared = rec.shared_ids() if shared is None else shared
        self.squares: dict = {}
        self.materialised: dict[int, torch.Tensor] = {}
        self.deferred, self.ghost = deferred, []  # [(layer, call, own, group, (n,) value)]
        # shared weights normed by their calls' Grams with cross terms (``cross.py``)
        self.cross = {key: cross.CrossNorm(p) for key, p in cross.plan(rec, self.shared).items()}

    def add(self, group, value) -> None:
        squares = self.squares
        squares[group] = value if group not in squares else squares[group] + value

    @in_full_precision  # its products in float32, also inside an autocast block
    def add_call(self, layer, call) -> None:
        own = dict(self.rec.own(layer))
        if not own:
            return
        with torch.no_grad():
            sampler = None if is_parametrized(layer) else find_norm_sampler(layer)
            everything = len(own) == len(own_parameters(layer))
            groups = {self.group_of(p) for p in own.values()}
            if any(id(p) in self.cross for p in own.values()):
                own = self.add_cross(layer, call, own)
                if not own:
                    return
            elif (sampler is not None and everything and len(groups) == 1
                    and not any(id(p) in self.shared for p in own.values())):
                # float16 -> float32: squared norms above 256² fit
                args, b = widen(call.args, torch.float32), widen(call.backprops, torch.float32)
                value = checked_norms(layer, sampler(layer, args, b), self.rec.n)  # (n,)
                if self.deferred:
                    self.ghost.append((layer, call, own, groups.pop(), value))
                    return
                if torch.isfinite(value).all():  # else overflow, or a non-finite record:
                    self.add(groups.pop(), value)  # re-normed below, without overflow
                    return
            self.fast_gradient_clipping(layer, call, own)

    def add_cross(self, layer, call, own: dict) -> dict:
        """Add this call's factors to each cross-normed weight's norm (``cross.py``); returns
        the parameters left to materialise (a bias, or a weight whose call could not be
        factored: its earlier calls are materialised then, and the sum goes on as shared)."""
        rest = {}
        for name, p in own.items():
            norm = self.cross.get(id(p))
            f = None if norm is None else cross.factors(layer, call, p)
            if f is not None:
                norm.add(f)
                continue
            if norm is not None:  # not as planned: materialise this weight from here on
                del self.cross[id(p)]
                done = norm.materialise()
                if done is not None:
                    self.materialised[id(p)] = done
            rest[name] = p
        if set(rest) == {"bias"}:
            grads = cross.bias_grads(layer, call, rest)
            if grads is not None:
                self.take(own, grads)
                return {}
        return rest

    def fast_gradient_clipping(self, layer, call, own) -> None:
        """The layer's per-sample gradients materialised, normed (overflow-safe) and dropped."""
        self.take(own, sample_layer(layer, call, keep=own))

    def take(self, own: dict, grads: dict) -> None:
        """Per-sample gradients {name: g} of ``own`` parameters: a shared one added to its sum,
        the others normed and dropped."""
        normed = []  # (param, g): normed together, one overflow test (host sync) per call
        for name, g in grads.items():
            p = own[name]
            if id(p) in self.shared:  # summed over its uses before the norm
                self.materialised[id(p)] = self.materialised.get(id(p), 0) + g
            else:
                normed.append((p, g))
        for (p, _), sq in zip(normed, many_sample_squares([g for _, g in normed])):
            self.add(self.group_of(p), sq)  # normed, then dropped

    def _check_deferred(self) -> None:
        if not self.ghost:
            return
        values = torch.stack([value for *_, value in self.ghost])  # (L, n)
        finite = torch.isfinite(values).all(1).tolist()  # one sync for every layer
        with torch.no_grad():
            for (layer, call, own, group, value), ok in zip(self.ghost, finite):
                if ok:
                    self.add(group, value)
                else:
                    self.fast_gradient_clipping(layer, call, own)
        self.ghost = []

    def result(self, exact=None):
        """({group: (n,)}, {id(param): (n, *shape)}: the shared and the ``exact`` ones)."""
        self._check_deferred()
        params = {id(p): p for p in self.rec.params.values()}
        for key, norm in self.cross.items():
            if norm.value is not None:
                self.add(self.group_of(params[key]), norm.square())
        materialised = {**(exact or {}), **self.materialised}
        with torch.no_grad():  # one overflow test (host sync) for all, not one per parameter
            for key, sq in zip(materialised, many_sample_squares(list(materialised.values()))):
                self.add(self.group_of(params[key]), sq)
        return self.squares, materialised


def rerun_losses(rec: Recording, model, loss_fn, inputs, targets) -> torch.Tensor:
    """ℓ (n,) of the batch's forward pass run again as it was: the same random state (the
    same dropout masks; the caller's own random state is left as the first pass left it)
    and the same autocast state, so ∇ Σ_i c_i ℓ_i is the clipped sum of the norms' g_i."""
    with replayed(rec.rng, rec.device), precision.replayed(rec.autocast, rec.device), \
            torch.enable_grad(), state_replay.replayed(rec.state):
        losses = loss_fn(forward(model, inputs), targets)
    check_losses(losses, rec.n)
    return losses


def ghost_norms(model, loss_fn, inputs, targets, check=True) -> torch.Tensor:
    """||g_i|| (n,) from one forward and one backward pass."""
    rec, squares, _ = record_norms(model, loss_fn, inputs, targets, check=check)
    verify_norms(model, rec, squares)
    return squares.sqrt().to(norm_dtype(rec.dtype))  # NaN or inf for a non-finite record


__all__ = [
    "NORM_CHECK", "NormSum", "ghost_norms", "record", "record_batch", "record_norms",
    "recorded_shared", "rerun_losses", "squared_norms", "squared_norms_by", "verify_norms",
]
