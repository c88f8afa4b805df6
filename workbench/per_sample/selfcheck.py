"""The self-check: a fast per-sample result is compared with an exact twin before it is used.

Shapes cannot show every batch-dimension mistake: a sequence-first layer with T == n, or a
positional embedding on ``arange(T)`` when T == n, looks batch-first. Two checks close that
gap, both cheap next to a step:

1. **The probe** runs the forward and backward pass of one sample i alone (micro-batching,
   Yousefpour et al. 2021, arXiv 2109.12298, App. A), with the same hooks. A call whose dim 0
   carries the batch has dim 0 = n in the batch and 1 in the probe; a layer whose dim 0 does
   not follow (T stays T) is sent to the exact fallback. The probe also gives the exact
   g_i = ∇ℓ_i, and the fast result's row i (or its norm ||g_i||) must equal it:

       ||ĝ_i − g_i|| ≤ tol · max(||g_i||, ||ĝ_i||) + atol        tol: TOLERANCE[dtype]

   which catches a wrong sampler, a sample-mixing model (``x - x.mean(0)``) and any use the
   tracker missed. Cost: one forward and backward pass at batch size 1.
2. **The record probe, for randomness** (dropout): sample i alone draws other masks than in
   the batch, so the probe above cannot compare. Instead the batch forward is re-run at the
   same n with the random state of the batch's forward restored (the same masks, drawn in
   the same order), every record but i *substituted* by record 0, and record i's own loss
   backpropagated (``record_probe``). If model and loss treat records independently, g_i is
   unchanged; a model that mixes records (``x - x.mean(0)`` with Dropout(0.1)), a coupled
   loss or a missed use changes it, and the comparison above fails. Cost: one forward and
   backward pass at batch size n, on checked calls only.

Both run the first time a model is seen with a given call signature: the shapes of every
recorded call with the batch size made symbolic (every dimension equal to n written "n"), so
Poisson batches of varying n reuse one verdict, while a batch whose n equals another
dimension of some call (T == n: T5's relative position bias on a (T, T) bucket matrix) is a
new signature and is checked again; so is a pass whose ops differ (by name, in order: a branch
that mixes records taken only on some data, or after a flag was set). Later calls with the same
signature reuse the verdict and
the probe's decisions. ``check="always"`` checks every call, ``check=False`` none (benchmarks
only: on a model never checked before, a sequence-first layer with T == n then goes
undetected).

Notation: n batch size, i the probed sample, g_i exact per-sample gradient, ĝ_i fast one.
"""

import contextlib
import math
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_map

from workbench.errors import LossCouplingError, PerSampleCheckError, SampleMixingError
from workbench.per_sample import host_random, precision, sketch, state_replay
from workbench.per_sample.checks import (
    alone,
    check_batch,
    check_losses,
    forward,
    take,
    trainable_parameters,
)
from workbench.per_sample.fallback import alone_differs, replayed
from workbench.per_sample.hooks import ActivationRecorder
from workbench.per_sample.leaves import leaves
from workbench.per_sample.loss import substitute
from workbench.per_sample.recording import (
    NOT_THE_BATCH,
    Recording,
    checked_shapes,
    loss_reach,
    owners_of,
    parameter_names,
)
from workbench.per_sample.sketch import RowSketch
from workbench.per_sample.uses import UseTracker, advanced, generator_states

TOLERANCE = precision.TOLERANCE  # by dtype; precision.tolerance(rec) adds the device's TF32
CHECKS = (True, False, "always")

_VERIFIED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {sig: marks}


def check_option(check) -> None:
    if check not in CHECKS:
        raise ValueError(f"check must be True (check the first call of each model and call "
                         f"signature), 'always' or False (no check, for benchmarks); got "
                         f"{check!r}")


def symbolic(shape, n: int) -> tuple:
    """The shape with every dimension equal to n written -1 ("n")."""
    return tuple(-1 if d == n else d for d in shape)


def signature(rec: Recording, extra=()) -> tuple:
    """The verdict's key: every recorded call's checked shapes with n symbolic, and the
    forward pass's ops in order (``rec.trace``): a model that takes another branch on other
    data or after a flag changed (``if x.abs().max() > 4: h = h - h.mean(0)``) is checked
    again, not released on the first branch's verdict (silent until 2026-11-29). A batch of
    one record has signatures of its own: its probe is the batch itself, so it verifies the
    values (a wrong rule: unchecked at n = 1 until 2026-11-29, and Poisson sampling draws
    such batches) but no layout, and its verdict serves no larger batch, nor theirs it."""
    calls = tuple((path, tuple(symbolic(s, rec.n) for s in checked_shapes(layer, call)))
                  for path, layer in rec.layers.items() for call in rec.recorder.calls[path]
                  if rec.generation is None or call.generation == rec.generation)
    return calls, tuple(sorted(rec.fallback)), rec.dtype, rec.trace, rec.n == 1, extra


def known(model, rec: Recording, check, extra=(), stronger=None) -> tuple | None:
    """The signature to verify, or None when this call need not be checked (re-applying the
    probe's decisions of the first call with the same signature). ``stronger``: the ``extra``
    of a check whose verdict implies this one's (a verified per-record vector implies its
    norm); a weaker check's verdict never stands in for a stronger one (ghost's norm check
    for book-keeping's sums, which read every per-sample vector)."""
    parts, rec.loss_parts = rec.loss_parts, None  # held no longer than this decision
    if rec.n < 1:
        return None
    sig = _known(model, rec, check, extra, stronger)
    if sig is not None and parts is not None:
        loss_fn, outputs, targets, inputs = parts
        check_model_halves(rec, model, inputs, outputs)
        if loss_fn is not None:  # None: a loss that drew random numbers
            check_separable(rec, loss_fn, outputs, targets)
    return sig


def _known(model, rec: Recording, check, extra, stronger) -> tuple | None:
    sig = signature(rec, extra)
    verified = _VERIFIED.get(model, {})
    marks = verified.get(sig)
    if marks is None and stronger is not None:
        marks = verified.get(signature(rec, stronger))
    if marks is not None and check != "always":
        for key, reason in marks.items():  # the probe's decisions, also with check=False
            rec.fallback.setdefault(key, reason)
        return None
    return None if check is False else sig


def remember(model, sig, marks: dict) -> None:
    _VERIFIED.setdefault(model, {})[sig] = marks


def probe(rec: Recording, model, loss_fn, inputs, targets) -> dict[str, torch.Tensor]:
    """Sample i = n - 1 alone: mark layers whose dim 0 is not the batch; return exact g_i."""
    loss = _probe_loss(rec, model, loss_fn, inputs, targets)
    params = list(rec.params.values())
    with exact_backward(rec):
        grads = torch.autograd.grad(loss.sum(), params, allow_unused=True)
    return {name: torch.zeros_like(p) if g is None else g
            for (name, p), g in zip(rec.params.items(), grads)}


def exact_backward(rec: Recording):
    """The twin's backward pass without oneDNN where it ran under autocast on the CPU:
    PyTorch's oneDNN bfloat16 convolution backward leaves the weight gradient of kernel taps
    that see only padding unwritten (a 3x3 stride-2 convolution on a 1x1 input: timm's and
    torchvision's ResNet-GN at 32x32), so the twin read NaN or 1e14 from leftover memory and
    refused a right answer (2026-11-30; the rules compute in float32 with autocast off)."""
    off = rec.autocast is not None and rec.device.type == "cpu"
    return torch.backends.mkldnn.flags(enabled=False) if off else contextlib.nullcontext()


def probe_sketch(rec: Recording, model, loss_fn, inputs, targets) -> RowSketch:
    """``probe``'s g_i as a sketch (``sketch.py``: 3 numbers per parameter, all the norm and
    vector checks need), each parameter's gradient sketched as the backward pass produces it
    and let go: a hook on the parameter hands autograd back a zero that takes no memory
    (stride 0). The model-sized g_i is never held, neither through the batch's backward pass
    (it added one model's worth to the peak of ghost's and book-keeping's first call) nor at
    the probe's own end, where the batch's recording, backprops and ``.grad`` are alive."""
    loss = _probe_loss(rec, model, loss_fn, inputs, targets)
    params = {id(p): p for p in rec.params.values()}
    out = RowSketch(params)

    def sketched(key):
        def hook(g):
            out.add(key, g)
            return torch.zeros((), dtype=g.dtype, device=g.device).expand(g.shape)
        return hook

    with torch._C.DisableTorchFunction():  # hooks are not uses of the parameters
        handles = [p.register_hook(sketched(key)) for key, p in params.items()]
    try:
        with exact_backward(rec):
            torch.autograd.grad(loss.sum(), list(params.values()), allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    for key in params:
        if key not in out.dots:  # not reached: g_i = 0 there, compared as such
            out.add_zero(key)
    return out


def _probe_loss(rec: Recording, model, loss_fn, inputs, targets) -> torch.Tensor:
    """Sample i = n - 1's loss alone (1,), its layers' calls compared with the batch's: a
    layer whose dim 0 is not the batch is marked (``rec.mark``)."""
    i = rec.n - 1
    rows = slice(i, i + 1)
    devices = [rec.device] if rec.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), ActivationRecorder(dict(rec.layers)) as small, \
            precision.replayed(rec.autocast, rec.device), \
            state_replay.replayed(rec.state):  # the batch's autocast state and model state
        tracker = UseTracker(owners_of(rec.layers, model), small, parameter_names(model))
        with tracker:  # the same functional and batch-free calls as the batch's (uses.py)
            x1, y1 = take(inputs, rows), take(targets, rows)
            tracker.start(leaves((x1, y1)))  # its taint and rows, as the batch's
            with alone():  # a model or loss that cannot: a clear refusal
                out = forward(model, x1)
                tracker.in_loss = True
                loss = loss_fn(out, y1)  # (1,)
    check_losses(loss, 1)
    # calls whose output reaches the loss, in both passes (recording.loss_reach): one that
    # does not (DoRA's adapter on eye(d), detached) adds nothing to g_i and proves nothing
    feeds = rec.feeds if rec.feeds is not None else (lambda call: True)
    feeds_one = loss_reach([loss])
    for path, layer in rec.layers.items():
        big = [c for c in rec.recorder.calls[path]
               if (rec.generation is None or c.generation == rec.generation) and feeds(c)]
        one = [c for c in small.calls[path] if feeds_one(c)]
        if big and not one:
            rec.mark(layer, path, f"is called {len(big)} times for the batch and never for one "
                                  f"sample, so its batch dimension cannot be verified")
            continue
        # a sequence layer may run fewer steps for one (shorter) sample than for the padded
        # batch: the calls both passes made must scale with the batch
        for c_big, c_one in zip(big, one):
            if treatment(c_big) != treatment(c_one):
                if one_broadcasts(layer, c_big, c_one, rec.n):
                    continue  # a batch call, its dim 0 shrunk to 1: verified
                rec.mark(layer, path, f"is recorded {treatment_words(c_big)} for n = {rec.n} "
                                      f"samples but {treatment_words(c_one)} for one: its "
                                      f"batch dimension cannot be verified")
                break
            for s_big, s_one in zip(checked_shapes(layer, c_big), checked_shapes(layer, c_one)):
                if len(s_one) == 0 or s_one[0] != 1:
                    rec.mark(layer, path, f"is called on shape {tuple(s_big)} for n = {rec.n} "
                                          f"samples and {tuple(s_one)} for one: dim 0 is not "
                                          f"the batch")
    return loss


def treatment(call) -> tuple:
    """How a call was recorded: given a batch dim it did not have (a batch-free output
    broadcast into the batch, ``broadcast.py``), and on batch-flattened rows
    (``flat_rows.py``). A shape seen after such a conversion was made by it, and at n = 1 a
    conversion can apply that does not at n (a dim 0 of size 1 broadcasts: MPNet's bias
    expanded to the batch size meets the scores as a broadcast at n = 1 only), so the
    probe's shapes prove the batch's only when both passes treated the call alike. (A call
    whose dim 0 of size 1 was expanded, not added, keeps its shapes at n = 1: no change.)"""
    return call.meet is not None and call.meet.new_dim, call.rows is not None


def one_broadcasts(layer, c_big, c_one, n: int) -> bool:
    """The one benign difference of treatment: a call recorded as called for the batch, on
    dim 0 of size n, that one sample's pass converted as broadcast into the batch only because
    a dim 0 of size 1 broadcasts against another of size 1 (ConvNeXt-V2's ``pwconv2`` output,
    permuted, then added to the residual of one sample: ``broadcast.convert`` gives it a new
    dim). Its own shapes before that conversion (each converted shape is (1, *own)) must then
    have dim 0 of 1: the batch dim shrunk with the batch, which is what the probe proves for
    any call. A batch-free call whose dim 0 happened to equal n keeps its size there and is
    still refused."""
    if treatment(c_big)[0] or not treatment(c_one)[0] or \
            treatment(c_big)[1] != treatment(c_one)[1]:
        return False
    big, one = checked_shapes(layer, c_big), checked_shapes(layer, c_one)
    return (bool(big) and len(big) == len(one)
            and all(len(s) >= 1 and s[0] == n for s in big)
            and all(len(s) >= 2 and s[0] == 1 and s[1] == 1 and len(s) == len(b) + 1
                    for s, b in zip(one, big)))


def treatment_words(call) -> str:
    broadcast, rows = treatment(call)
    words = [w for w, on in (("broadcast into the batch", broadcast),
                             ("on batch-flattened rows", rows)) if on]
    return " and ".join(words) if words else "as called"


def substituted(batch, i: int, n: int):
    """Every Tensor of ``batch`` (any nesting) with n rows: record i kept, the others
    replaced by record 0 (``loss.substitute``); other leaves unchanged."""
    def swap(t):
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == n:
            return substitute(t, i, 0, n)
        return t

    return tree_map(swap, batch)


def record_probe(rec: Recording, model, args, kwargs, loss_of_record) -> dict:
    """Exact g_i of record i = n - 1 in the batch with every other record substituted and
    the batch's random state replayed: ∇_θ loss_of_record(model(*args', **kwargs'))."""
    i = rec.n - 1
    args, kwargs = substituted((args, kwargs), i, rec.n)
    with replayed(rec.rng, rec.device), torch.enable_grad(), \
            precision.replayed(rec.autocast, rec.device), state_replay.replayed(rec.state):
        loss = loss_of_record(model(*args, **kwargs))
    params = list(rec.params.values())
    with exact_backward(rec):
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    return {name: torch.zeros_like(p) if g is None else g
            for (name, p), g in zip(rec.params.items(), grads)}


NORM_CHUNK = 2**16  # numbers per float64 chunk of ``_norm``: 512 KiB, whatever the tensor


def _norm(tensors) -> torch.Tensor:
    """(Σ_t Σ t²)^½ accumulated in float64, chunk by chunk: never a float64 copy of a whole
    (model-sized) tensor, which doubled the self-check's comparison peak."""
    total = None
    for t in tensors:
        for chunk in t.detach().reshape(-1).split(NORM_CHUNK):
            chunk = chunk.double()
            part = torch.dot(chunk, chunk)
            total = part if total is None else total + part
    return torch.zeros((), dtype=torch.float64) if total is None else total.sqrt()


def compare(rec: Recording, got: dict, ref: dict, what: str) -> None:
    """Raise PerSampleCheckError unless ``got`` (name -> tensor) equals ``ref``."""
    if not ref:
        return
    tol = precision.tolerance(rec)
    err = _norm(got[k] - ref[k] for k in ref)  # one difference alive at a time
    scale = max(float(_norm(ref.values())), float(_norm(got.values())))
    if not math.isfinite(float(_norm(ref.values()))) and \
            not math.isfinite(float(_norm(got.values()))):
        return  # a non-finite record either way: clipping/nonfinite.py's policy handles it
    atol = 1e-12 if rec.dtype == torch.float64 else 1e-6
    if float(err) <= tol * scale + atol:
        return
    diffs = {k: float(_norm([got[k] - ref[k]])) for k in ref}
    worst = [k for k in sorted(diffs, key=lambda k: -diffs[k])[:3]
             if diffs[k] > tol * scale + atol] or sorted(diffs, key=lambda k: -diffs[k])[:1]
    raise PerSampleCheckError(
        f"self-check failed: {what} differs from the exact value by {float(err):.3g} "
        f"(relative {float(err) / max(scale, 1e-300):.3g}, tolerance {tol:g} for "
        f"{precision.described(rec)}); "
        f"the largest differences are in {', '.join(worst)}. A grad/norm sampler registered "
        f"for their layer is wrong, or the model mixes samples outside any module (e.g. "
        f"x - x.mean(0)), or reads a parameter in a way no hook sees, or the loss couples "
        f"records (a batch statistic of the outputs, or a normalisation by one of the data: "
        f"w[y].sum(), mask.sum(), y.max()). Nothing was returned. "
        f"Locate it with wb.audit.audit_gradients(model, loss_fn, inputs, targets); "
        f"method='vmap' or 'microbatch' are exact for models whose samples do not mix")


def as_sketch(rec: Recording, exact) -> RowSketch:
    """An exact g_i ({name: tensor}, the record probe's) as a sketch; a sketch unchanged."""
    return exact if isinstance(exact, RowSketch) else sketch.of(
        {id(p): p for p in rec.params.values()},
        {id(rec.params[k]): g for k, g in exact.items()})


def check_separable(rec: Recording, loss_fn, outputs, targets) -> None:
    """The functional API's loss_fn on each half of the batch gives the batch's own losses
    for those records (under ``no_grad``, the outputs as the batch computed them): a loss
    normalised or centred by a statistic of the batch (``/ y.abs().max()``, ``- out.mean(0)``)
    changes for at least one half, whichever record holds the statistic. The probe compares
    record n - 1 alone, and where that record holds the maximum it agreed (73% off, silently,
    until 2026-11-29). Two calls of loss_fn on half the rows; none for n = 1."""
    separable(loss_fn, outputs, targets, rec.losses.detach(), rec.n, precision.tolerance(rec),
              1e-12 if rec.dtype == torch.float64 else 1e-6,
              [rec.device] if rec.device.type == "cuda" else [])


def separable(loss_fn, outputs, targets, losses, n: int, tol: float, atol: float,
              devices=()) -> None:
    """``check_separable`` given the batch's ``losses`` (n,) and the tolerances."""
    if n < 2:
        return

    def rows(t, part):
        return t[part] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == n else t

    worst, where = 0.0, None
    with torch.no_grad(), torch.random.fork_rng(devices=list(devices)):
        for part in (slice(0, n // 2), slice(n // 2, n)):
            try:
                got = loss_fn(tree_map(lambda t, p=part: rows(t, p), outputs),
                              tree_map(lambda t, p=part: rows(t, p), targets))
            except Exception:  # noqa: BLE001  (outputs not batch-first: the probe's case)
                return
            want = losses[part]
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                return  # check_losses' business, at the probe
            off = (got.to(want.dtype) - want).abs()
            bad = off > tol * torch.maximum(got.abs().to(want.dtype), want.abs()) + atol
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0]) + part.start
                if float(off.max()) > worst:
                    worst, where = float(off.max()), i
    if where is not None:
        raise LossCouplingError(
            f"loss_fn couples the records: record {where}'s loss changes (by {worst:.3g}) when "
            f"loss_fn sees half of the batch instead of all of it, so it reads a statistic of "
            f"the batch (a normaliser such as y.abs().max() or mask.sum(), a mean or std over "
            f"the records, a contrastive loss over the batch's pairs), and a record's gradient "
            f"depends on which records were sampled beside it: per-record clipping bounds "
            f"nothing. Normalise by constants of the data set or per record (over its own "
            f"dims), and return one loss per record")


def check_model_halves(rec: Recording, model, inputs, outputs=None) -> None:
    """The model on each half of the batch gives the batch's own outputs for those records
    (under ``no_grad``, with the model's state as the pass read it; ``outputs``: the batch's,
    else computed again): a forward that reads a statistic of the whole batch, even a
    detached one (``h / h.abs().max().detach()``), changes for the half without it, whichever
    record holds it. The probe compares record n - 1 alone, and where that record held the
    maximum it agreed (5-60% off, silently, until 2026-11-29). A model drawing random numbers
    is left to the record probe (the halves would draw others). A statistic whose effect on
    the outputs vanishes but whose gradient does not (HF Nystromformer's pseudo-inverse) is
    the use tracker's (``batch_reductions.py``)."""
    n = rec.n
    if n < 2 or rec.random:
        return
    found = halves_differ(model, inputs, n, precision.tolerance(rec),
                          1e-12 if rec.dtype == torch.float64 else 1e-6,
                          [rec.device] if rec.device.type == "cuda" else [], rec.state, outputs)
    if found is not None:
        raise halves_error(*found, n)


def halves_error(part: slice, off: float, n: int) -> SampleMixingError:
    return SampleMixingError(
        f"the model couples the records: its outputs for records "
        f"{part.start}..{part.stop - 1} change (their sums by up to "
        f"{off:.3g}) when it runs on those records alone instead of "
        f"the whole batch of {n}, so its forward reads a statistic of the batch (a "
        f"max, mean or norm over the records, detached or not: x / x.abs().max()), "
        f"or branches on one, and a record's gradient depends on which records "
        f"were sampled beside it. Compute such statistics per record (over its own "
        f"dims) or from constants of the data set")


def check_alone(model, loss_fn, inputs, targets) -> None:
    """Before ``method="microbatch"`` or ``"vmap"`` of the functional API, which take each
    record's gradient from the record alone: the model on each half of the batch gives the
    batch's outputs (``halves_differ``) and loss_fn on each half its losses (``separable``),
    else ``SampleMixingError`` / ``LossCouplingError``. A contrastive loss over the batch
    (CLIP's InfoNCE: a record alone has a 1 x 1 logit matrix and loss 0) or a forward that
    reads the batch's variance (timm's EvoNorm2dB0 in training) gave a per-record answer
    that is no record's gradient in the batch (zeros for CLIP; 5% off for EvoNorm), silently,
    until 2026-11-30; einsum, ghost and book-keeping refused them. Three forward passes
    without gradient and two calls of loss_fn; the model's buffers put back after; a model
    drawing random numbers (dropout in training) is not compared (others would be drawn)."""
    n = check_batch(inputs, targets)
    p = next((q for q in model.parameters() if q.is_floating_point()), None)
    if n < 2 or p is None:
        return
    devices = [p.device] if p.device.type == "cuda" else []
    tol = precision.tolerance_of(p.dtype, p.device)
    atol = 1e-12 if p.dtype == torch.float64 else 1e-6
    kept = state_replay.Snapshot(model)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            before, host = generator_states(), host_random.states()
            try:
                outputs = forward(model, inputs)
            except Exception:  # noqa: BLE001  (the method itself says what is wrong)
                return
            if (which := host_random.drew(host)) is not None:
                raise host_random.error(which)  # no twin replays it (host_random.py)
            if advanced(before):
                return
            losses = loss_fn(outputs, targets)
        if not isinstance(losses, torch.Tensor) or losses.shape != (n,):
            return  # check_losses' business, in the method
        found = halves_differ(model, inputs, n, tol, atol, devices, kept, outputs)  # each
        # half from the state the batch started from (a spectral norm's power iteration,
        # a counter: as micro-batching runs every record)
        if found is not None:
            raise halves_error(*found, n)
        separable(loss_fn, outputs, targets, losses.detach(), n, tol, atol, devices)
    finally:
        kept.rewind()


def check_vmap(model, loss_fn, inputs, targets, grads: dict, start=None) -> None:
    """After ``method="vmap"`` of the functional API, on every call the check is on:
    torch.func's answer for record n - 1 against autograd's for that record run alone, the
    same computation (each record alone: ``check_alone`` ran first), each parameter, at the
    pass's tolerance (its dtype, or the narrowest float it computed in:
    ``precision.Lowering``), from ``start`` (a ``state_replay.Snapshot`` taken before vmap
    ran: a spectral norm's power iteration, a counter, read as vmap read them), the state vmap
    left put back after. torch.func's batching rules are not autograd, and vmap's answer was
    returned unchecked until 2026-12-02. Where the two disagree one of them is wrong, and
    either way nothing is returned: in Hugging Face's CvT (a depthwise convolution and an eval
    BatchNorm behind a permuted view, joined back by ``torch.cat``) it is PyTorch's backward
    pass for a batch of ONE record (97% off finite differences, where vmap, a batch of two
    and the whole batch agree with them to 4e-10; probe AK), which micro-batching, whose
    meaning is each record alone, cannot tell (left alone: README). ``PerSampleCheckError``
    naming the parameters; not for a model drawing random numbers (other draws)."""
    n = check_batch(inputs, targets)
    params = {k: p for k, p in trainable_parameters(model).items() if k in grads}
    p = next(iter(params.values()), None)
    if n < 1 or p is None:
        return
    devices = [p.device] if p.device.type == "cuda" else []
    kept = state_replay.Snapshot(model)  # as vmap left it: put back at the end
    start = start or kept
    low = precision.Lowering()
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=devices):
            before = generator_states()
            start.rewind()
            last = slice(n - 1, n)
            with low:
                one = loss_fn(forward(model, take(inputs, last)), take(targets, last))
            if advanced(before) or not isinstance(one, torch.Tensor):
                return
            alone = torch.autograd.grad(one.sum(), list(params.values()), allow_unused=True)
    finally:
        kept.rewind()
    dtype = precision.state(p.device) or (
        low.lowered if low.lowered is not None and low.lowered.itemsize < p.dtype.itemsize
        else p.dtype)
    tol = precision.tolerance_of(dtype, p.device)
    atol = 1e-12 if dtype == torch.float64 else 1e-6
    got = [grads[k][n - 1] for k in params]
    ref = [torch.zeros_like(g) if r is None else r.detach() for r, g in zip(alone, got)]
    overall = math.sqrt(sum(float(r.to(torch.float64).pow(2).sum()) for r in ref))
    off = []
    for k, r, g in zip(params, ref, got):
        diff = float((g.to(torch.float64) - r.to(torch.float64)).norm())
        scale = max(float(r.to(torch.float64).norm()), overall)
        if diff > tol * scale + atol:  # NaN: a non-finite record, not this check's
            off.append((diff / max(scale, 1e-300), k))
    if off:
        rel, name = max(off)
        names = ", ".join(k for _, k in sorted(off, reverse=True))
        raise PerSampleCheckError(
            f"method='vmap' and autograd disagree on record {n - 1}'s gradient of {name}, by "
            f"{rel:.3g} of its norm (autograd on the record run alone; parameters off: "
            f"{names[:300]}): torch.func's batching rules, or PyTorch's kernels for a batch of "
            f"one record, are wrong for this model (Hugging Face's CvT: the batch of one). "
            f"Nothing was returned; use method='einsum', or clipped_grad_sum with "
            f"method='ghost' or 'bookkeeping', whose checks run the batch")


@contextlib.contextmanager
def _from(state):
    """A re-run from ``state``: a pass's log (``state_replay.replayed``), or a ``Snapshot``
    of the model before any check ran (``check_alone``), put back first."""
    if isinstance(state, state_replay.Snapshot):
        state.rewind()
        yield
    else:
        with state_replay.replayed(state):
            yield


def halves_differ(model, inputs, n: int, tol: float, atol: float, devices=(), state=None,
                  outputs=None):
    """(the half, the largest difference) where the model's outputs for a half of the n
    records, run on that half alone, differ from the batch's, or None (also when the model
    cannot run so, or its outputs are not batch-first). Under ``no_grad``, the random state
    forked, the model's state ``state`` (``state_replay``) replayed; per row of each
    batch-first floating output its sum, absolute sum and sum of squares are compared, so no
    output (an LM's logits) is held past its pass. ``check_model_halves`` and
    ``audit.audit_gradients`` ask it."""

    def rows(out, m) -> list:
        return [torch.stack([f.sum(1), f.abs().sum(1), f.pow(2).sum(1)], 1)
                for t in tree_flatten(out)[0]
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim()
                and t.shape[0] == m
                for f in [t.detach().reshape(m, -1).to(torch.float64)]]

    parts = (slice(0, n // 2), slice(n // 2, n))
    with torch.no_grad(), torch.random.fork_rng(devices=list(devices)):
        try:  # a model that cannot run so (a half of the wrong size, a forward hook
            # registering a tensor hook, which needs grad) is left to the probe to explain
            if outputs is None:
                with _from(state):
                    full = rows(forward(model, inputs), n)
            else:
                full = rows(outputs, n)
            halves = []
            for part in parts:
                with _from(state):
                    halves.append(rows(forward(model, take(inputs, part)),
                                       part.stop - part.start))
        except Exception:  # noqa: BLE001
            return None
    for part, half in zip(parts, halves):
        if len(half) != len(full):
            return None  # the outputs are not batch-first alike: nothing to compare by rows
        for f, h in zip(full, half):
            want = f[part]
            off = (h - want).abs()
            scale = torch.stack([want[:, 1], want[:, 1], want[:, 2]], 1)  # |sum| <= abs sum
            if bool((off > tol * torch.maximum(scale, h.abs()) + atol).any()):
                return part, float(off.max())
    return None


def alone_params(rec: Recording, checked) -> list:
    """The parameters whose g_i the whole-model fallback computes because their layer was
    called off the batch's rows (``recording.batch_problem``), each once, when this call is
    checked (``checked``: its signature, or None): the backward pass of the batch also returns
    their gradient, for ``compare_alone``. (Other fallback parameters are the probe's: a
    record alone meets them as in the batch, unless the model mixes records, which the probe
    sees; and a lookup's ``scale_grad_by_freq`` makes the batch's backward no sum of the
    records' gradients at all.)"""
    if not checked or not rec.fallback:
        return []
    seen = {}
    for p in rec.params.values():
        if NOT_THE_BATCH in rec.fallback.get(id(p), ""):
            seen.setdefault(id(p), p)
    return list(seen.values())


def all_params(rec: Recording) -> list:
    """Every trainable parameter of the recording, each once."""
    return list({id(p): p for p in rec.params.values()}.values())


def sums_against_batch(grads: dict, batch: dict) -> list:
    """[(||Σ_i g_i - batch||, Σ_i ||g_i||, ||batch||, key)] in float64 for each key of
    ``grads`` ({id: (n, *shape)}) that ``batch`` ({id: Tensor or None}) holds: the one
    comparison ``compare_sums`` and ``compare_alone`` judge (Σ_i ||g_i|| is the rounding
    scale of a sum of records that cancel, an InstanceNorm weight's)."""
    out = []
    for key, g in grads.items():
        if key not in batch:
            continue
        total = g.sum(0).to(torch.float64)
        ref = torch.zeros_like(total) if batch[key] is None else batch[key].to(torch.float64)
        out.append((float((total - ref).norm()),
                    float(g.reshape(g.shape[0], -1).to(torch.float64).norm(dim=1).sum()),
                    float(ref.norm()), key))
    return out


def _names(rec: Recording) -> dict:
    names = {}
    for name, p in rec.params.items():
        names.setdefault(id(p), name)
    return names


def compare_sums(rec: Recording, grads: dict, batch: dict) -> None:
    """Σ_i g_i of each parameter a rule computed (``grads``: {id: (n, *shape)}) against the
    batch's own gradient from the same backward pass (``batch``: {id: Tensor or None}): the
    probe compares record n - 1 alone, and a rule wrong only for other rows (an Embedding
    rule that assigns a repeated token's rows instead of adding them, where record n - 1
    repeats none) passed it (6% off, silently, until 2026-11-29). ``PerSampleCheckError``
    naming the parameters."""
    tol = precision.tolerance(rec)
    atol = 1e-12 if rec.dtype == torch.float64 else 1e-6
    names = _names(rec)
    overall = math.sqrt(sum(float(b.to(torch.float64).pow(2).sum()) for b in batch.values()
                            if b is not None))  # a parameter whose true gradient is ~0
    # (an InstanceNorm weight under a sum loss) is rounding noise at the model's scale
    off = [(diff, names.get(key, "?")) for diff, scale, ref, key in sums_against_batch(grads, batch)
           if diff > tol * max(scale, ref, overall) + atol]  # NaN: a non-finite record, whose
    # policy (clipping/nonfinite.py) names it; not this check's
    if off:
        worst = ", ".join(name for _, name in sorted(off, reverse=True)[:3])
        raise PerSampleCheckError(
            f"self-check failed: the per-sample gradients of {worst} do not sum to the "
            f"batch's own gradient (by {max(d for d, _ in off):.3g}), though record "
            f"{rec.n - 1}'s matched its exact twin: the grad sampler of their layer is wrong "
            f"for some other record (a rule that handles a case record {rec.n - 1} does not "
            f"have: a repeated index, a padding row). Nothing was returned; check the rule "
            f"against micro-batching with wb.audit.audit_gradients on a batch with such rows")


def keep_batch_grads(rec: Recording, params: list, grads) -> None:
    rec.batch_grads = {id(p): g for p, g in zip(params, grads)}


def compare_alone(rec: Recording, exact: dict) -> None:
    """The fallback's Σ_i g_i (``exact``: {id: (n, *shape)}) against the batch's own
    gradient of each such parameter (``rec.batch_grads``, from the same backward pass as the
    rules' backprops). The fallback runs each record alone (or the batch again, for random
    models); the probe compares one record with the same twin, so it cannot see a model that
    treats a record differently in the batch than alone (``b(x[:k])``: records 0..k-1 get
    b's gradient in the batch, none alone). The sum over the batch can: it is the one
    gradient of every record in its place."""
    if not rec.batch_grads:
        return
    tol = precision.tolerance(rec)
    names = _names(rec)
    rows = sums_against_batch({k: exact[k] for k in rec.batch_grads if k in exact},
                              rec.batch_grads)
    diffs = [(diff, key) for diff, _, _, key in rows]
    scale = max((max(s_, r) for _, s_, r, _ in rows), default=0.0)
    rec.batch_grads = {}
    off = math.sqrt(sum(d * d for d, _ in diffs))
    atol = 1e-12 if rec.dtype == torch.float64 else 1e-6
    if off <= tol * scale + atol:
        return
    worst = [key for d, key in sorted(diffs, key=lambda t: -t[0] if t[0] == t[0] else -math.inf)[:3]
             if not d <= 0]  # NaN ranks first (a NaN left no name: an IndexError)
    raise SampleMixingError(alone_differs(off, off / max(scale, 1e-300),
                                          [names[key] for key in worst],
                                          rec.fallback[worst[0]]))


def digits(a: float, b: float) -> int:
    """Significant digits that print a and b differently (6 at least, 17 at most): a refusal
    printed "14.3305, its exact twin gives 14.3305" (probe AK)."""
    for k in range(6, 18):
        if f"{a:.{k}g}" != f"{b:.{k}g}":
            return k
    return 17


def compare_norm(rec: Recording, got: torch.Tensor, exact) -> None:
    """The fast ||g_i|| of the probed sample against the exact ||g_i|| (a number, or the
    exact g_i itself as a dict, from the record probe)."""
    tol = precision.tolerance(rec)
    exact = as_sketch(rec, exact).norm if isinstance(exact, (dict, RowSketch)) \
        else float(exact)
    if not math.isfinite(exact) and not math.isfinite(float(got)):
        return  # a non-finite record either way: clipping/nonfinite.py's policy handles it
    err = abs(float(got) - exact)
    if err <= tol * max(exact, float(got)) + (1e-12 if rec.dtype == torch.float64 else 1e-6):
        return
    raise PerSampleCheckError(
        f"self-check failed: the per-sample gradient norm of sample {rec.n - 1} is "
        f"{float(got):.{digits(float(got), exact)}g}, its exact twin gives "
        f"{exact:.{digits(float(got), exact)}g}, {err / max(exact, 1e-300):.3g} apart "
        f"(relative; tolerance {tol:g} for "
        f"{precision.described(rec)}; the twin runs the sample alone, or, with "
        f"randomness such as dropout, "
        f"the batch again with the same random state and the other samples replaced). A "
        f"norm or grad sampler registered for one of the layers is wrong, or the model "
        f"mixes samples outside any module (e.g. x - x.mean(0), with or without dropout), "
        f"or the loss does (a batch statistic of the outputs, or a normalisation by one of "
        f"the data: w[y].sum(), mask.sum(), y.max()). Nothing was "
        f"returned; locate it with wb.audit.audit_gradients(model, loss_fn, inputs, targets)")


def compare_rows(rec: Recording, fast: RowSketch, exact) -> None:
    """Record n - 1's contribution as the fast path sums it (``fast``: its per-parameter
    parts, from the clipped sum's own code with c = e_i) against its exact twin (a sketch or
    {name: g_i}), parameter by parameter (``sketch.py``): the vector, not only its norm."""
    exact = as_sketch(rec, exact)
    tol = precision.tolerance(rec)
    atol = 1e-12 if rec.dtype == torch.float64 else 1e-6
    if not math.isfinite(exact.norm):
        return  # a non-finite record either way: clipping/nonfinite.py's policy handles it
    bad = sketch.differences(fast, exact, tol, atol)
    if not bad:
        return
    names = {id(p): k for k, p in rec.params.items()}
    worst = ", ".join(f"{names[key]} ({over:.3g}x the tolerance)" for key, over in bad[:3])
    raise PerSampleCheckError(
        f"self-check failed: the per-sample gradient of sample {rec.n - 1}, as the clipped "
        f"sum adds it, differs from its exact twin in {len(bad)} parameter(s): {worst} "
        f"(tolerance {tol:g} for {precision.described(rec)}, parameter by parameter). "
        f"Its norm may still agree: the record's contribution to these parameters is not its "
        f"own gradient. A grad/norm sampler registered for their layer is wrong, or their "
        f"layer is called on rows that are not the batch's (a position table looked up on a "
        f"(T, T) matrix when T equals n), or the model mixes samples outside any module. "
        f"Nothing was returned. Locate it with wb.audit.audit_gradients(model, loss_fn, "
        f"inputs, targets); method='vmap' or 'microbatch' are exact for models whose samples "
        f"do not mix")


__all__ = [
    "CHECKS", "NORM_CHUNK", "TOLERANCE", "all_params", "alone_params", "as_sketch",
    "check_model_halves", "check_option", "compare_sums", "halves_differ",
    "check_separable", "compare",
    "compare_alone", "compare_norm", "compare_rows", "keep_batch_grads", "known", "probe",
    "probe_sketch", "record_probe", "remember", "replayed", "signature", "substituted",
    "sums_against_batch",
    "symbolic", "treatment",
]
