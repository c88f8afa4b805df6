"""Each record's own loss: the reduction of the common losses, owned, and a probe for the rest.

DP-SGD clips ∇ℓ_i, the gradient of *record i's own* loss (Abadi et al. 2016, arXiv
1607.00133, Algorithm 1). A training loop writes a batch loss L(z, y) over the criterion's
input z (rows: the records, or each record's positions, record-major: ``out.view(-1, V)``).
When L = Σ_i ℓ_i / n, the recorded output gradient of record i times n is ∇ℓ_i. Two common
losses are not of that form, though each is *separable up to one batch constant*:

- ``CrossEntropyLoss`` / ``NLLLoss`` with ``weight=`` and the mean: L = Σ_t w_{y_t} ℓ_t / D,
  D = Σ_t w_{y_t} over the batch (a data-dependent denominator, so removing one record
  moves every other record's term);
- ``ignore_index`` (every Hugging Face causal-LM loss: -100) with the mean: D counts the
  non-ignored positions of the whole batch.

The engine owns their reduction. **Record i's own loss** is

    ℓ_i = Σ_{t ∈ i, y_t ≠ ignore} w_{y_t} ℓ_t / N_i        N_i = #{t ∈ i : y_t ≠ ignore}   (1)

(w = 1 without ``weight=``; a record with N_i = 0 contributes 0; one row per record gives
ℓ_i = w_{y_i} ℓ_t: the class weight, no denominator). The backward pass from z to the
parameters is linear in record i's rows of ∂L/∂z, so multiplying them by

    f_i = D / N_i        (mean)        f_i = 1        (sum)                                 (2)

turns the recorded gradient of record i into ∇ℓ_i exactly (``record_factors``; every other
loss with the mean: f_i = n, as before). Label smoothing and soft targets keep (1); BCE's
``pos_weight``, MSE, L1, Huber and the other element-wise losses average over elements,
so f_i = n.

**The probe** (``check_separable``) decides whether a loss is separable at all: record i's
rows of f ⊙ ∂L/∂z must not change when every other record's rows of z and y are replaced by
record k's. An InfoNCE / contrastive loss, logits centred over the batch, a loss using batch
statistics, or a subclass changing ``forward`` (a rule applies to the exact type only) fail
it, and ``LossCouplingError`` names the loss and the fix.

Notation: n records, z criterion input (n m rows, m per record), y targets, t a row
(position), w class weights, D the mean's denominator, f (n,) per-record factors.
"""

import torch
from torch import nn

from workbench.errors import LossCouplingError

DENOMINATOR = (nn.CrossEntropyLoss, nn.NLLLoss)  # exact types whose mean divides by Σ w_{y_t}


def substitute(x, i: int, k: int, n: int):
    """x with every record but i replaced by record k (rows grouped record-major in blocks of
    x.shape[0] // n); anything without n·m rows on dim 0 is returned unchanged."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or n < 2 or x.shape[0] % n:
        return x
    m = x.shape[0] // n
    index = torch.full((n,), k, dtype=torch.long, device=x.device)
    index[i] = i
    rows = (index[:, None] * m + torch.arange(m, device=x.device)).reshape(-1)  # (n m,)
    return x.index_select(0, rows)


def reduction_of(criterion, loss_reduction: str) -> str:
    """'mean' or 'sum': the criterion's own, or the loop's (reduction='none', or none given)."""
    reduction = getattr(criterion, "reduction", "none")
    if reduction in ("mean", "batchmean", "elementwise_mean"):
        reduction = "mean"
    if reduction not in ("mean", "sum"):
        return loss_reduction
    if reduction != loss_reduction:
        factor = "n" if reduction == "sum" else "1/n"
        raise LossCouplingError(  # as the functional loss's mismatch (a ValueError too)
            f"{type(criterion).__name__} has reduction={reduction!r} but the DP "
            f"optimizer has loss_reduction={loss_reduction!r}: every per-sample "
            f"gradient would be scaled by {factor} before clipping, which silently "
            f"changes what max_grad_norm means; pass loss_reduction={reduction!r} "
            f"to make_private")
    return reduction


def _counted(criterion, z, y):
    """(weight of each position in D (rows, ...), counted positions (rows, ...)) of (1)."""
    if y.is_floating_point():  # soft targets: every position counts once, weights inside
        shape = (y.shape[0], *y.shape[2:])
        ones = torch.ones(shape, dtype=z.dtype, device=z.device)
        return ones, ones
    valid = y != criterion.ignore_index
    w = criterion.weight
    weight = valid.to(z.dtype) if w is None else w[torch.where(valid, y, 0)] * valid
    return weight, valid.to(z.dtype)


def record_factors(criterion, z, y, n: int, reduction: str) -> torch.Tensor:
    """f (n,) of Eq. (2): record i's rows of ∂L/∂z times f_i are ∇_z ℓ_i."""
    rows = z.shape[0] if isinstance(z, torch.Tensor) and z.dim() else n
    # at least float32: under autocast z is bfloat16/float16, where n / GradScaler's 65536
    # would be 0 and D / N_i rounded (per_sample/precision.py)
    dtype = torch.promote_types(z.dtype, torch.float32) if z.is_floating_point() \
        else torch.get_default_dtype()
    uniform = torch.full((n,), float(n if reduction == "mean" else 1), dtype=dtype,
                         device=z.device)
    if reduction == "sum" or n == 0 or type(criterion) not in DENOMINATOR or not isinstance(
            y, torch.Tensor):
        return uniform
    if z.dim() == 1:
        raise LossCouplingError(
            f"{type(criterion).__name__}'s input has one dim ({rows} values): torch reads it as "
            f"one sample's class scores and takes one softmax over all of them, which with the "
            f"batch on dim 0 is a softmax over the records (each record's loss moves with "
            f"every other record's output). Pass scores of shape (n, C), one row per record "
            f"(out.unsqueeze(1) for one score per record is a single class: use "
            f"F.binary_cross_entropy_with_logits for a binary target)")
    if rows % n:
        raise LossCouplingError(
            f"{type(criterion).__name__}'s input has {rows} rows on dim 0, not a multiple of "
            f"the batch size n = {n}: its mean (over weights or non-ignored positions) cannot "
            f"be attributed to records. Pass the model output record-major (out.view(-1, V), "
            f"targets.view(-1)), or use reduction='none' and reduce per record yourself")
    weight, counted = _counted(criterion, z.detach(), y)
    D = weight.sum()
    N = counted.reshape(n, -1).sum(1)  # (n,) N_i
    return torch.where(N > 0, D / N.clamp(min=1), torch.zeros_like(N)).to(uniform.dtype)


def _grad(criterion, z, args):
    z = z.detach().requires_grad_(True)
    with torch.enable_grad():
        loss = criterion(z, *args)
    if not isinstance(loss, torch.Tensor):
        raise LossCouplingError(f"{type(criterion).__name__} returned {type(loss).__name__}, "
                                f"not a Tensor; the DP loop needs a Tensor loss")
    (g,) = torch.autograd.grad(loss.sum(), z, allow_unused=True)  # 'none': the loop reduces
    return torch.zeros_like(z) if g is None else g


def _ctc_substituted(z, args, i: int, k: int, n: int):
    """``nn.CTCLoss``'s (log_probs (T, N, C), (targets, input_lengths, target_lengths)) with
    every record but i replaced by record k: its records on dim 1 of log_probs, on dim 0 of
    the rest (targets (N, S), or one dim concatenated record by record), or None."""
    if len(args) < 3 or not isinstance(args[0], torch.Tensor):
        return None
    index = torch.full((n,), k, dtype=torch.long)
    index[i] = i
    targets, inputs, lengths = args[0], torch.as_tensor(args[1]), torch.as_tensor(args[2])
    if inputs.shape != (n,) or lengths.shape != (n,):
        return None
    if targets.dim() == 2 and targets.shape[0] == n:
        targets = targets.index_select(0, index.to(targets.device))
    elif targets.dim() == 1:
        ends = lengths.cumsum(0).tolist()
        starts = [e - int(t) for e, t in zip(ends, lengths.tolist())]
        targets = torch.cat([targets[starts[j]:ends[j]] for j in index.tolist()])
    else:
        return None
    return (z.index_select(1, index.to(z.device)),
            (targets, inputs[index].to(args[1].device) if isinstance(args[1], torch.Tensor)
             else inputs[index], lengths[index].to(args[2].device)
             if isinstance(args[2], torch.Tensor) else lengths[index], *args[3:]))


def check_separable(criterion, z, args, n: int, reduction: str, tol: float) -> torch.Tensor:
    """f (n,) after checking that record i = n - 1's rows of f ⊙ ∂L/∂z stay when the other
    records are replaced by record 0; LossCouplingError otherwise. ``nn.CTCLoss`` reads its
    records on dim 1 of its (T, N, C) input, every other loss on dim 0."""
    y = args[0] if args else None
    f = record_factors(criterion, z, y, n, reduction)
    i = n - 1
    if isinstance(criterion, nn.CTCLoss):
        if n < 2 or z.dim() != 3 or z.shape[1] != n:
            return f  # (T, C): one record; any other layout CTC itself refuses
        swapped = _ctc_substituted(z, args, i, 0, n)
        if swapped is None:
            return f
        z2, swapped = swapped
        g, g2 = _grad(criterion, z, args)[:, i], _grad(criterion, z2, swapped)[:, i]
        f2 = f
    else:
        if n < 2 or z.shape[0] % n:
            return f
        m = z.shape[0] // n
        g = _grad(criterion, z, args)[i * m:]
        swapped = [substitute(a, i, 0, n) if isinstance(a, torch.Tensor) and a.dim()
                   and a.shape[0] == z.shape[0] else a for a in args]
        z2 = substitute(z, i, 0, n)
        f2 = record_factors(criterion, z2, swapped[0] if swapped else None, n, reduction)
        g2 = _grad(criterion, z2, swapped)[i * m:]
    a, b = f[i] * g.double(), f2[i] * g2.double()
    err, scale = float((a - b).norm()), max(float(a.norm()), float(b.norm()))
    if err > tol * scale + 1e-12:
        raise LossCouplingError(
            f"the loss {type(criterion).__name__} couples records: the gradient of record "
            f"{i}'s term changes by {err / max(scale, 1e-300):.3g} (relative) when the other "
            f"records of the batch are replaced, so removing one record would move the others' "
            f"clipped gradients and the sensitivity is no longer max_grad_norm. A contrastive "
            f"(InfoNCE) loss, logits centred or normalised over the batch, or batch statistics "
            f"inside the loss do this. Compute a loss per record (from that record's outputs "
            f"and targets alone), e.g. nn.CrossEntropyLoss(); a contrastive objective needs "
            f"each pair (or group) as one record of the data set")
    return f


__all__ = ["DENOMINATOR", "check_separable", "record_factors", "reduction_of", "substitute"]
