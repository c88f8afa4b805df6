"""Each row of the batch the model sees depends on its own record alone: the ``collate_fn``.

The engine follows a batch's rows from the moment its loader hands the batch out
(``loss_watch.watched``), after the ``collate_fn`` ran. Two collates break the row invariant
before that point (probe of 2026-12-01, both silent until then):

- one that combines records (mixup inside the collate: row i = .6 x_i + .4 x_{i+1}): one
  record's influence 1.33-1.53 C;
- one that pads each batch to its longest record (``pad_sequence``, Hugging Face's dynamic
  padding) feeding a model or loss that reads the pads (a mean over the padded length, an
  RNN or attention without the mask, a loss on pad tokens without ``ignore_index``, left
  padding without position ids): record i's gradient depends on T_max, the length of the
  longest record drawn beside it; one record's influence 2.19 C.

Here, at the hand-out of the first batch of each new layout (its leaves' shapes beyond dim
0), a few of its records (at most ``RECORDS``: n - 1 always, then those with the most
padding) are collated alone, ``collate_fn([dataset[j]])``, twice. Two alone collations that
differ (random augmentation in the data set or the collate, masked-language-model masking)
leave the batch unchecked: nothing is known. Otherwise the alone row is compared, leaf by
leaf, with the batch's row of that record: equal (the record's own), or its prefix (right
padding) or suffix (left padding) with the rest of the batch's row one constant (padded), or
neither: the collate combines records, refused here (``SampleMixingError``). A padded batch
leaves a ``Padded`` plan that the optimizer's first self-check of the batch's layout turns
into a gradient comparison (``recorded.Recorder.padding_probe``): record j's gradient from
the batch against its gradient from its alone collation, the model's output and the loss's
gradient cropped to the record's own positions.

Notation: n records in the batch, j a dataset index, i a row of the batch.
"""

import collections
import contextlib

import torch
from torch.utils._pytree import tree_flatten, tree_map

from workbench.dpsgd.batches import leaves
from workbench.errors import SampleMixingError

RECORDS = 3  # records collated alone per new layout
PLANS = 4  # padded batches kept for the optimizer's check (gradient accumulation)


class Padded:
    """A padded batch's plan: ``rows`` [(i, j, alone batch)], the batch's tensor ``leaves``
    [(path, tensor)], and per padded leaf path its (dims, side) (``side``: 'right' or
    'left'), for the optimizer's first self-check of its layout."""

    def __init__(self, batch_leaves, rows, padded, collate_name: str):
        self.leaves = batch_leaves
        self.rows = rows
        self.padded = padded
        self.collate_name = collate_name


def _name(collate_fn) -> str:
    inner = getattr(collate_fn, "collate_fn", collate_fn)  # PoissonCollate's
    return getattr(inner, "__qualname__", None) or type(inner).__name__


def layout(found) -> tuple:
    """The batch's leaves' shapes beyond dim 0 and dtypes (its layout)."""
    return tuple((path, tuple(t.shape[1:]), t.dtype) for path, t in found)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (floats to a few units of their rounding: a collate's vectorised
    arithmetic may round one row differently from the same arithmetic alone)."""
    if a.shape != b.shape:
        return False
    if a.is_floating_point() or b.is_floating_point():
        dtype = a.dtype if a.is_floating_point() else b.dtype
        eps = 16 * float(torch.finfo(dtype).eps)
        a, b = a.double(), b.double()
        if not a.numel():
            return True
        scale = float(torch.nan_to_num(torch.maximum(a.abs().max(), b.abs().max())))
        return bool(torch.isclose(a, b, rtol=0.0, atol=eps * scale, equal_nan=True).all())
    return torch.equal(a, b)


def match(alone: torch.Tensor, row: torch.Tensor):
    """How the record's alone row ``alone`` sits in the batch's row ``row``: 'own' (equal),
    ('right' | 'left', dims) (padded at that side in those dims, the rest one constant),
    or None (neither: combined with other records, or another layout)."""
    if alone.shape == row.shape:
        return "own" if _same(alone, row) else None
    if alone.dim() != row.dim() or any(a > b for a, b in zip(alone.shape, row.shape)):
        return None
    dims = tuple(d for d in range(row.dim()) if alone.shape[d] < row.shape[d])
    for side in ("right", "left"):
        index = tuple(slice(0, a) if side == "right" else slice(b - a, b)
                      for a, b in zip(alone.shape, row.shape))
        if not _same(alone, row[index]):
            continue
        rest = torch.ones(row.shape, dtype=torch.bool, device=row.device)
        rest[index] = False
        pads = row[rest]
        if pads.numel() and bool((pads == pads.reshape(-1)[0]).all()):
            return side, dims
    return None


def _padding_score(row: torch.Tensor) -> int:
    """How many trailing or leading positions of ``row`` along its dim 0 repeat its last or
    first one, unless all do: a guess of how far the row was padded (used to pick the
    records to check)."""
    if row.dim() == 0 or row.shape[0] < 2:
        return 0
    flat = row.reshape(row.shape[0], -1)
    best = 0
    for last, end in ((True, flat[-1]), (False, flat[0])):
        same = (flat == end).all(1)
        order = same.flip(0) if last else same
        run = int(torch.cumprod(order.int(), 0).sum())
        if run < flat.shape[0]:  # a constant row (an unpadded record's attention mask) tells
            best = max(best, run)  # nothing: it scored highest, and no padded row was picked
    return best


def _pick(found, n: int) -> tuple[list[int], bool]:
    """Rows to check: n - 1, then the rows that look most padded; and whether any row
    looks padded."""
    scores = [0] * n
    for _, t in found:
        if t.dim() >= 2 and t.shape[0] == n:
            for i in range(n):
                scores[i] = max(scores[i], _padding_score(t[i]))
    rest = sorted(range(n - 1), key=lambda i: -scores[i])
    return [n - 1, *rest[:RECORDS - 1]], any(scores)


def _placed(found, alone, r: int) -> list:
    """``match`` of each alone leaf against row r of the batch's."""
    return [match(a[0], t[r].to(a.device)) for (_, t), (_, a) in zip(found, alone)]


class CollateCheck:
    """The engine loader's check of its ``collate_fn`` (module docstring): ``handed(batch,
    indices)`` at each batch's hand-out, ``plans``: the padded batches waiting for the
    optimizer's check."""

    def __init__(self, dataset, collate_fn):
        self.dataset, self.collate_fn = dataset, collate_fn
        self.seen: set = set()
        self.plans: collections.deque = collections.deque(maxlen=PLANS)

    def alone(self, j: int):
        return self.collate_fn([self.dataset[j]])

    def handed(self, batch, indices) -> None:
        if indices is None or len(indices) < 2:
            return  # a batch of one is its record alone; none, or not known: nothing to check
        try:
            found = leaves(batch)
        except TypeError:
            return
        n = len(indices)
        if not found or any(t.dim() == 0 or t.shape[0] != n for _, t in found):
            return
        key = layout(found)
        if key in self.seen:
            return
        self.seen.add(key)
        if len(self.seen) > 4096:  # a run of ever new layouts: keep the memory bounded
            self.seen = {key}
        rows, padded = [], {}
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            picked, looks_padded = _pick(found, n)
            for i in picked:
                try:
                    first, second = self.alone(indices[i]), self.alone(indices[i])
                    a1, a2 = leaves(first), leaves(second)
                except Exception:  # noqa: BLE001  (a collate that needs two records: unknown)
                    return
                if [p for p, _ in a1] != [p for p, _ in found] or \
                        [p for p, _ in a2] != [p for p, _ in found] or \
                        any(x.shape != y.shape or not _same(x, y) for (_, x), (_, y) in
                            zip(a1, a2)):
                    return  # random per collation, or another structure: unknown
                if any(t.dim() == 0 or t.shape[0] != 1 for _, t in a1):
                    return
                hows, row = _placed(found, a1, i), i
                if None in hows:  # another row of the batch may be its (a collate that
                    row = next((r for r in range(n)  # sorts by length): no mixing
                                if r != i and None not in _placed(found, a1, r)), None)
                    if row is None:
                        bad = hows.index(None)
                        raise combined(self.collate_fn, found[bad][0], i, indices[i],
                                       a1[bad][1][0], found[bad][1][i])
                    hows = _placed(found, a1, row)
                for (path, _), how in zip(found, hows):
                    if how != "own":
                        if padded.get(path, how) != how and path in padded:
                            padded[path] = None  # padded differently per record: unknown
                        else:
                            padded.setdefault(path, how)
                rows.append((row, indices[i], first))
        padded = {p: how for p, how in padded.items() if how is not None}
        if padded:
            self.plans.append(Padded(found, rows, padded, _name(self.collate_fn)))
        elif looks_padded:  # the rows picked were not the padded ones (a guess): the
            self.seen.discard(key)  # layout's next batch is checked again


def combined(collate_fn, path: str, i: int, j: int, alone: torch.Tensor,
             row: torch.Tensor) -> SampleMixingError:
    """The error for a collate whose row i is not record j's alone collation."""
    if alone.shape == row.shape:
        diff = (row.double() - alone.double()).abs()
        measured = (f"by up to {float(diff.max()):.3g} (relative "
                    f"{float(diff.norm() / alone.double().norm().clamp(min=1e-300)):.3g})")
    else:
        measured = (f"with shape {tuple(row.shape)} where the record alone gives "
                    f"{tuple(alone.shape)}, and neither its prefix nor its suffix is the "
                    f"record's with the rest one padding value")
    return SampleMixingError(
        f"the data loader's collate_fn {_name(collate_fn)!r} combines records: leaf "
        f"{path} of row {i} (dataset record {j}) differs from collate_fn([dataset[{j}]]), "
        f"the record collated alone, {measured}, though collating it alone twice gives the "
        f"same result (nothing random). A row built from several records (mixup or a "
        f"normalisation by the batch inside the collate_fn) gives one record influence on "
        f"other rows' gradients, beyond the clip norm C that DP-SGD's noise is calibrated to. "
        f"Do per-record work in the Dataset's __getitem__ or a per-record transform, and keep "
        f"the collate_fn to stacking and padding; mixup needs a DP-aware recipe (e.g. mixing "
        f"within one record's own augmentations)")


def plan_for(plans, args, kwargs, n: int):
    """The padded plan whose batch the model call's inputs are (each input tensor with n rows
    one of its leaves: the same tensor, or its values cast to the call's dtype and device),
    taken off ``plans``, with the call's inputs as (tensor, leaf path) pairs; None if none."""
    inputs = [t for t in tree_flatten((args, kwargs))[0]
              if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == n]
    for plan in list(plans or ()):
        if not inputs or len(plan.rows) == 0 or plan.leaves[0][1].shape[0] != n:
            continue
        paths = []
        for t in inputs:
            path = next((p for p, leaf in plan.leaves if leaf is t), None)
            if path is None:
                path = next((p for p, leaf in plan.leaves if leaf.shape == t.shape
                             and torch.equal(leaf.to(t.device, t.dtype), t.detach())), None)
            if path is None:
                break
            paths.append(path)
        else:
            plans.remove(plan)
            return plan, dict(zip(map(id, inputs), paths))
    return None


def _substituted(args, kwargs, paths: dict, alone):
    """The call's inputs with each loader leaf replaced by the record's alone one."""
    mine = dict(leaves(alone))

    def swap(t):
        path = paths.get(id(t)) if isinstance(t, torch.Tensor) else None
        return t if path is None else mine[path].to(t.device, t.dtype)

    return tree_map(swap, (args, kwargs))


def _crop(b: torch.Tensor, shape, sides: set, sizes: set):
    """The loss's gradient ``b`` (one record's, the batch's padded shape) cut to ``shape``,
    the record's own output (its positions kept at the padding's other side); None where
    the two shapes are not one padded to the other."""
    if tuple(b.shape) == tuple(shape):
        return b
    if b.dim() != len(shape) or len(sides) != 1:
        return None
    side = next(iter(sides))
    index = []
    for a, full in zip(shape, b.shape):
        if a > full or (a < full and full not in sizes):
            return None
        index.append(slice(0, a) if side == "right" else slice(full - a, full))
    return b[tuple(index)]


def padding_probe(rec, model, plan: Padded, args, kwargs, paths: dict, b_rows: dict,
                  keys=None) -> None:
    """Record i's gradient in the padded batch against its gradient from its alone
    collation (module docstring): ∇_θ ⟨o_i, b_i⟩ on the batch, ∇_θ ⟨o, b_i cut to o's
    shape⟩ on the record alone, dropout off and every random generator restored; a
    difference beyond ``precision.tolerance(rec)`` is refused. Randomness other than
    dropout (two passes on the batch differ): unknown, nothing refused."""
    from workbench.audit.influence_twin import NoDropout
    from workbench.dpsgd.model_loss import select
    from workbench.per_sample import precision, state_replay
    from workbench.per_sample.selfcheck import _norm, exact_backward

    sides = {side for side, _ in plan.padded.values()}
    sizes = {leaf.shape[1 + d] for path, leaf in plan.leaves if path in plan.padded
             for d in plan.padded[path][1]}
    params = list(rec.params.values())
    devices = [rec.device] if rec.device.type == "cuda" else []

    def grads(loss):
        with exact_backward(rec):
            got = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, got)]

    with torch.random.fork_rng(devices=devices), NoDropout(), \
            precision.replayed(rec.autocast, rec.device), state_replay.replayed(rec.state):
        if rec.random:  # randomness other than dropout: two passes differ, nothing known
            with torch.no_grad():
                torch.manual_seed(0)
                one = select(model(*args, **kwargs), keys)
                torch.manual_seed(1)
                two = select(model(*args, **kwargs), keys)
            if any(not torch.equal(a, b) for a, b in zip(one, two)):
                return
        with torch.enable_grad():
            torch.manual_seed(0)
            outs = select(model(*args, **kwargs), keys)
            for i, j, alone in plan.rows:
                b_i = b_rows.get(i)
                if b_i is None:
                    continue
                pairs = [(o[i], b) for o, b in zip(outs, b_i) if b is not None]
                in_batch = grads(sum((o * b.to(o.dtype)).sum() for o, b in pairs))
                a_args, a_kwargs = _substituted(args, kwargs, paths, alone)
                torch.manual_seed(0)
                own = select(model(*a_args, **a_kwargs), keys)
                terms = []
                for o, b in zip(own, b_i):
                    if b is None:
                        continue
                    cut = _crop(b, o.shape[1:], sides, sizes)
                    if cut is None or o.shape[0] != 1:
                        terms = None
                        break
                    terms.append((o[0] * cut.to(o.dtype)).sum())
                if not terms:
                    continue  # outputs not one record's padded to the batch's: unknown
                alone_g = grads(sum(terms))
                tol = precision.tolerance(rec)
                atol = 1e-12 if rec.dtype == torch.float64 else 1e-6
                err = float(_norm(g - h for g, h in zip(in_batch, alone_g)))
                scale = max(float(_norm(in_batch)), float(_norm(alone_g)))
                if err > tol * scale + atol:
                    raise padding_error(plan, i, j, err, scale, tol)


def padding_error(plan: Padded, i: int, j: int, err: float, scale: float, tol: float):
    leaves_ = ", ".join(f"{p} ({side} padding)" for p, (side, _) in plan.padded.items())
    return SampleMixingError(
        f"the gradient of row {i} (dataset record {j}) depends on how far its batch was "
        f"padded: the data loader's collate_fn {plan.collate_name!r} pads each batch to "
        f"its longest record ({leaves_}), "
        f"and the record's gradient from this batch differs from its gradient from the "
        f"record collated alone by {err:.3g} (relative {err / max(scale, 1e-300):.3g}, "
        f"tolerance {tol:g}). The longest record drawn is another record, so one record moves "
        f"every other row's gradient, beyond the clip norm C that DP-SGD's noise is "
        f"calibrated to. The model or the loss reads the pad positions: a mean pooled over "
        f"the padded length, attention or an RNN without the mask, a loss over pad tokens "
        f"without ignore_index, left padding without position_ids. Mask the pads (pass "
        f"attention_mask; a masked mean: the sum over real tokens / the record's own length; "
        f"torch.nn.utils.rnn.pack_padded_sequence; labels -100 with ignore_index=-100), or "
        f"pad every batch to one fixed length")


@contextlib.contextmanager
def unfollowed(watch):
    """The check's own collations: not the batch's data (``LossWatch.unfollowed``)."""
    with watch.unfollowed() if watch is not None else contextlib.nullcontext():
        yield


__all__ = [
    "CollateCheck", "Padded", "RECORDS", "combined", "layout", "match", "padding_error",
    "padding_probe", "plan_for",
]
