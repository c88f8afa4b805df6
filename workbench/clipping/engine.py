"""The one clipping engine: Σ_i c_i g_i from a recording, for every method and the optimizer.

Abadi et al. 2016 (arXiv 1607.00133), Algorithm 1: c_i = min(1, C / ||g_i||), and the sum
Σ_i c_i g_i that noise is added to. From one recording (``per_sample.recording``) of a batch:

- ``microbatch`` / ``vmap`` / ``einsum``: materialise each layer's per-sample gradients (a
  loop over samples, ``vmap``, or the registered grad sampler), then norm, clip and sum;
- ``ghost`` / ``bookkeeping``: norms from (a, b) by the norm samplers (``ghost.py``), then each
  layer's clipped sum as its *ordinary* weight gradient with backprops c_i b_i (Bu, Wang, Zha,
  Karypis 2023, arXiv 2210.00038, §3):  Σ_i c_i g_i(a_i, b_i) = Σ_i g_i(a_i, c_i b_i).
  The backward pass has freed the graph by then (``wb.clipped_grad_sum``'s book-keeping does
  not retain it; the optimizer comes after the user's backward): a layer whose rule has a
  fast path (``LayerRule.weight_grads``: ``nn.Linear``'s one matmul of its stored inputs and
  c ⊙ b, Bu et al. Eq. 3; ``nn.Embedding``'s one ``index_add_``) takes it, and any other
  layer alone is re-run on its stored inputs.

The functional API's other two methods end here too: ``clip_materialised`` (microbatch, vmap,
einsum over the whole model: {name: (n, *shape)} normed, clipped, summed) and
``clip_by_backward`` (ghost: the second backward pass of Σ_i c_i ℓ_i, over ``rec.losses``).
Every C reaching this file was validated once by its caller (``flat.checked_clip_factors``).

Parameters materialised anyway (exact fallback, or used in several calls) enter as
Σ_i c_i g_i from their (n, *shape) tensors.

**Per-layer clipping** (a C_g per parameter group; McMahan et al. 2018, arXiv 1710.06963,
§3): each group's part of g_i is clipped to C_g, so the clipped gradient has norm at most
||C||₂ = (Σ_g C_g²)^½, the sensitivity the noise is scaled to.

**Norms and non-finite records.** Squared norms are float64 and overflow-safe (``flat.py``);
a record whose norm is NaN or inf in any group gets c_i = 0 in *every* group and is masked,
not multiplied, out of each product (``nonfinite.py``), so it cannot turn the sum into NaN.

Notation: n batch, g_i per-sample gradient, c_i clip factor, C max_grad_norm, b backprops.
"""

import torch
from torch.utils._pytree import tree_map

from workbench.clipping.flat import checked_clip_factors, grad_norms, weighted_sum
from workbench.clipping.ghost import record_norms, rerun_losses, squared_norms_by, verify_norms
from workbench.clipping.grouped import Grouped
from workbench.clipping.nonfinite import bad_records, finite_values, masked, refuse_nonfinite
from workbench.clipping.users import user_factors, user_squares_from_grads, user_squares_ghost
from workbench.methods import CLIP_METHODS, MATERIALISING
from workbench.per_sample import state_replay
from workbench.per_sample.checks import dense
from workbench.per_sample.einsum import sample_call
from workbench.per_sample.functional import layer_vmap_grad_sampler
from workbench.per_sample.microbatch import layer_microbatch_grad_sampler
from workbench.per_sample.precision import in_full_precision
from workbench.rules import fast_reweighted, fast_weight_grads

MODES = CLIP_METHODS  # ghost and bookkeeping: one path here (the graph is gone by now)


@in_full_precision  # the layers re-run on widened inputs (per_sample/precision.py)
def materialise(rec, mode: str, grads: Grouped | None = None) -> Grouped:
    """The per-sample gradients (n, *shape) of the rule parameters, summed over each
    parameter's calls, written into ``grads`` (``grouped.Grouped``: the small ones as columns
    of one buffer per group; default: one group). Each call's backprops are freed once its
    gradients are written (nothing reads them after the clipped sum's materialisation)."""
    if grads is None:
        grads = Grouped(rec.n, {id(p): p for p in rec.params.values()}, lambda key: None)
    with torch.no_grad():
        for _, layer, call in list(rec.calls()):
            own = dict(rec.own(layer))
            if not own:
                continue
            if mode == "einsum":
                local = sample_call(layer, call, keep=own)  # under this function's wrappers
            else:  # the layer re-run: a parametrization's state (spectral norm's power
                # iteration, a counter) is read, not advanced once per record (until
                # 2026-11-29 n more iterations each step, in these two modes only)
                sampler = layer_vmap_grad_sampler if mode == "vmap" else \
                    layer_microbatch_grad_sampler
                with state_replay.read_only_parametrizations(layer, cache=False):
                    local = sampler(layer, call.args, call.kwargs, call.backprops,
                                    call.rows is not None)
            for name, g in local.items():
                if name in own:
                    grads.put(id(own[name]), g)
            call.backprops = local = None  # used: free it before the next layer's gradients
    return grads


def _weighted(b, c, ok=None):
    cb = c.to(b.dtype).view(-1, *[1] * (b.dim() - 1)) * b  # c_i b_i
    return cb if ok is None else masked(cb, ok)  # a non-finite record's row: 0, not 0 · NaN


@in_full_precision
def reweighted_weight_grads(layer, call, c, own: list, ok=None) -> dict:
    """{id(param): Σ_i c_i g_i} for ``own`` parameters of one call, by one weight gradient
    from the call's stored inputs (the backward pass has freed the graph). ``ok`` (n,), when
    some records are non-finite: the others' backprops are masked to 0 and the stored inputs'
    NaN and inf entries replaced by 0, so no 0 · NaN enters the weight gradient. A
    parametrized layer's weight is read as the pass computed it, not computed again
    (``state_replay.read_only_parametrizations``)."""
    if "parametrizations" in layer._modules:
        with state_replay.read_only_parametrizations(layer):
            return _reweighted(layer, call, c, own, ok)
    return _reweighted(layer, call, c, own, ok)


def _reweighted(layer, call, c, own: list, ok) -> dict:
    b = call.backprops
    chunked = fast_reweighted(layer)  # the rule weights b itself: no c ⊙ b copy (rules/)
    if chunked is not None and isinstance(b, torch.Tensor):
        with torch.no_grad():
            grads = chunked(layer, call, c, own, ok)  # None: not for these options
        if grads is not None:
            return grads
    weighted = [_weighted(t, c, ok) for t in (b if isinstance(b, tuple) else (b,))]
    fast = fast_weight_grads(layer)  # the layer rule's own clipped sum (rules/), if any
    if fast is not None:
        with torch.no_grad():
            grads = fast(layer, call, weighted[0], own, ok)  # None: not for these options
        if grads is not None:
            return grads
    detach = lambda t: dense(t.detach()) if isinstance(t, torch.Tensor) else t  # noqa: E731
    if call.rows is not None:  # batch-flattened rows (flat_rows.py): (n, T, ...) back to the
        # (n·T, ...) the layer was called on (a router's forward reshapes its input itself)
        detach = lambda t: t.detach().flatten(0, 1) if isinstance(t, torch.Tensor) else t  # noqa: E731
        weighted = [w.flatten(0, 1) for w in weighted]
    args, kwargs = tree_map(detach, call.args), tree_map(detach, call.kwargs)
    if ok is not None:
        args, kwargs = finite_values(args), finite_values(kwargs)
    with torch.enable_grad():
        out = layer.forward(*args, **kwargs)
    outputs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
               if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(outputs, own, grad_outputs=weighted, allow_unused=True)
    return {id(p): g for p, g in zip(own, grads) if g is not None}


def clipped_sum(rec, max_grad_norm, mode: str, group_of=None, exact=None, users=None,
                row=None):
    """({id(param): Σ_i c_i g_i}, norms (n,), clip factors (n,)) for one recorded batch.

    ``row``: a ``sketch.RowSketch`` (keys id(param)) into which record n - 1's own
    contribution is added, computed by this function's own summing code with c = e_{n-1}
    (the sum is linear in c): what the self-check compares with the exact g_{n-1}
    (``selfcheck.compare_rows``), so a per-sample gradient that is wrong where only the
    sum reads it (a misattributed small parameter) cannot pass a norm check unseen.

    ``users``: a ``users.BatchUsers`` for user-level clipping (one C, no groups): each record
    gets its user's factor c_{u(i)}, from ||Σ_{i ∈ R_u} g_i|| (``users.py``); the norms
    returned are still the records' own (the self-check compares them).

    ``max_grad_norm``: one C, or {group: C_g} with ``group_of(param)`` naming each parameter's
    group. ``exact``: {id(param): (n, *shape)} of the fallback parameters. The returned clip
    factors are, per sample, the smallest over the groups.
    """
    per_group = isinstance(max_grad_norm, dict)
    C = max_grad_norm if per_group else {None: max_grad_norm}
    group_of = group_of if per_group else (lambda p: None)
    params = {id(p): p for p in rec.params.values()}
    zeros = torch.zeros(rec.n, dtype=torch.float64, device=rec.device)  # squares: flat.py
    exact = exact or {}
    if mode in MATERIALISING:  # the small ones in one buffer per group (grouped.py)
        planned = {key: p for key, p in params.items() if key not in exact}
        grads = materialise(rec, mode, Grouped(rec.n, planned, lambda key: group_of(params[key])))
        grads.loose.update(exact)  # already materialised: per parameter, as they are
        squares = grads.squares(zeros)  # one overflow test for all parameters
    else:
        squares, materialised = squared_norms_by(rec, group_of, exact)
        grads = Grouped(rec.n, {}, lambda key: group_of(params[key]))
        grads.loose.update(materialised)
    norms = sum(squares.values(), zeros).sqrt()  # (n,) NaN or inf if any group is
    bad = bad_records(norms)
    ok = ~bad if bad.any() else None  # None: the usual case, nothing to mask
    c = {group: checked_clip_factors(sq.sqrt(), C[group]) for group, sq in squares.items()}
    if users is not None:  # user-level: c_i = c_{u(i)}; a non-finite user masked as a whole
        user_sq = user_squares_from_grads(grads.tensors(), users, zeros[:users.U]) \
            if mode in MATERIALISING else user_squares_ghost(rec, users, grads.tensors(),
                                                              zeros[:users.U])
        c[None], ok = user_factors(user_sq, users, C[None])
        ok = None if bool(ok.all()) else ok
    if ok is not None:  # a non-finite record: 0 in every group, not only in its bad one
        c = {group: masked(cg, ok) for group, cg in c.items()}
    sums = {}
    e = None if row is None else _one_hot(rec.n, rec.n - 1, zeros)  # (n,) c = e_{n-1}
    if mode not in MATERIALISING:
        for _, layer, call in list(rec.calls()):
            for group in {group_of(p) for _, p in rec.own(layer)} & set(c):
                own = [p for _, p in rec.own(layer)
                       if id(p) not in grads and group_of(p) == group]
                if own and e is not None:  # before the sum: both read the same (a, b)
                    for key, g in reweighted_weight_grads(layer, call, e, own, ok).items():
                        row.add(key, g)
                if own:
                    for key, g in reweighted_weight_grads(layer, call, c[group], own,
                                                          ok).items():
                        sums[key] = g if key not in sums else sums[key] + g
            call.backprops = None  # used: free it before the next layer's weight gradient
    if e is not None:
        for key, g in grads.weighted_sums({group: e for group in c}, ok).items():
            row.add(key, g)
    sums.update(grads.weighted_sums(c, ok))  # materialised: Σ_i c_i g_i directly
    factors = torch.stack(list(c.values())).min(0).values if c else zeros + 1
    return sums, norms, factors


def _one_hot(n: int, i: int, like: torch.Tensor) -> torch.Tensor:
    e = torch.zeros_like(like)  # float64, like the clip factors
    e[i] = 1.0
    return e


def clip_materialised(grads: dict[str, torch.Tensor], C: float) -> dict[str, torch.Tensor]:
    """{name: Σ_i c_i g_i} from whole-model per-sample gradients {name: (n, *shape)};
    ``NonFiniteGradientError`` names a record whose gradient holds NaN or inf."""
    sample_norms = grad_norms(grads)  # (n,) float64
    refuse_nonfinite(sample_norms)
    return weighted_sum(grads, checked_clip_factors(sample_norms, C))


def clip_by_backward(rec, squares: torch.Tensor, C: float) -> dict[str, torch.Tensor]:
    """{name: Σ_i c_i g_i} by a second backward pass of Σ_i c_i ℓ_i over ``rec.losses``' graph
    (ghost clipping: the forward pass run again, ``ghost.rerun_losses``); the fallback
    parameters from their exact g_i (``rec.exact``)."""
    refuse_nonfinite(squares)  # 0 · NaN in the second backward pass would spread it
    c = checked_clip_factors(squares.sqrt(), C)  # (n,)
    for call in rec.recorder.all_calls():
        call.backprops = None  # not needed by the second pass: free them before it runs
    names = [k for k, p in rec.params.items() if id(p) not in rec.exact]
    grads = torch.autograd.grad((c.detach() * rec.losses).sum(),
                                [rec.params[k] for k in names], allow_unused=True) if names else ()
    sums = {k: torch.zeros_like(rec.params[k]) if g is None else g for k, g in zip(names, grads)}
    with torch.no_grad():
        for key, g in rec.exact.items():  # the fallback's own g_i: the norms' g_i
            sums[next(k for k, p in rec.params.items() if id(p) == key)] = \
                torch.tensordot(c.to(g.dtype), g, dims=1)
    return {name: sums[name] for name in rec.params}


def ghost_clipped_sum(model, loss_fn, inputs, targets, max_grad_norm, check=True) -> dict:
    """{name: Σ_i c_i g_i}: the streamed norm pass (graph freed as it goes), then the second
    backward pass of Σ_i c_i ℓ_i over the forward pass run again (module docstring, Memory);
    ``max_grad_norm`` validated by the caller."""
    rec, squares, _ = record_norms(model, loss_fn, inputs, targets, check=check)
    verify_norms(model, rec, squares)
    refuse_nonfinite(squares)  # before the forward pass runs again for nothing
    rec.recorder.clear()  # the first forward's activations: freed before the second one
    rec.losses = rerun_losses(rec, model, loss_fn, inputs, targets)
    return clip_by_backward(rec, squares, max_grad_norm)


__all__ = [
    "MODES", "clip_by_backward", "clip_materialised", "clipped_sum", "ghost_clipped_sum",
    "materialise", "reweighted_weight_grads",
]
