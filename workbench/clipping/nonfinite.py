"""Non-finite records: a NaN or inf per-sample gradient never poisons a sum, nor vanishes silently.

One NaN input, one inf target, one log(0) in a loss, or an overflow in the forward pass gives
that record a gradient g_i with NaN or inf entries, so ||g_i|| is NaN or inf. Left alone,
c_i = C / NaN = NaN, and Σ_i c_i g_i, hence every parameter, is NaN after one step. Scaling by
c_i = 0 is not enough either: 0 · NaN = NaN, and a matmul over the batch (book-keeping's
(c ⊙ B)ᵀ A, Bu et al. 2023, Eq. 3) adds that NaN into every coordinate. So:

- ``flat.clip_factors`` gives c_i = 0 where ||g_i|| is not finite, and the clipping engine
  (``engine.clipped_sum``) *masks* such records (``masked``: their backprops, activations or
  materialised rows are replaced by zeros before any product), so the sum is exactly the sum of
  the other records' clipped gradients;
- **the DP optimizer skips such records**, counts them in ``optimizer.last["nonfinite"]`` (and
  their indices in ``last["nonfinite_indices"]``, over this step's records in recording order)
  and warns (``NonFiniteRecordWarning``). Why skip and not raise: a record left out of the sum
  is equivalent to a record with a zero gradient, which satisfies ||c_i g_i|| <= C; so long as
  the decision depends on record i alone, the released sum stays a sum of per-record terms of
  norm at most C and the DP analysis covers it. A raise would stop the run on a data-dependent
  event, which is itself a release the analysis does not cover. The decision depends on record
  i alone when the model and the loss are per-record: the engine refuses layers that mix samples
  (batch statistics, ``per_sample.checks``) and verifies the per-sample norms against
  micro-batching one record alone. A NaN that spreads through the batch (a batch statistic
  outside any module, NaN parameters) makes *every* record non-finite: with n >= 2 records,
  all of them non-finite, the optimizer raises ``NonFiniteGradientError`` before changing
  anything, since skipping them would release noise only while reporting a step;
- **the functional API** (``clipped_grad_sum``) raises ``NonFiniteGradientError`` naming the
  records, before returning anything; ``per_sample_grad_norms`` returns their NaN or inf norms
  (that is their value), so it is the tool to find them.

Notation: n batch size, g_i per-sample gradient, c_i clip factor, C max_grad_norm.
"""

import warnings

import torch

from workbench.errors import NonFiniteGradientError

FIX = ("find them with wb.per_sample_grad_norms(model, loss_fn, inputs, targets) (their norms "
       "are NaN or inf) and fix or drop them: a NaN or inf input or target, a loss of inf "
       "(e.g. log(0)), or an overflow in the forward pass")


class NonFiniteRecordWarning(UserWarning):
    """The DP optimizer left records with NaN or inf gradients out of a step's sum."""


def bad_records(norms: torch.Tensor) -> torch.Tensor:
    """(n,) bool: the records whose gradient norm is NaN or inf."""
    return ~torch.isfinite(norms)


def masked(t: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """``t`` (n, ...) with the rows where ``ok`` is False set to zero (not multiplied: 0·NaN)."""
    return torch.where(ok.view(-1, *[1] * (t.dim() - 1)), t, torch.zeros((), dtype=t.dtype,
                                                                          device=t.device))


def finite_values(x):
    """Tensors (in tuples, lists, dicts) with NaN and inf replaced by 0, for the re-run of a
    layer on stored inputs when some record is non-finite (finite entries are unchanged, and
    a non-finite entry belongs to a non-finite record, whose backprop is masked to 0)."""
    if isinstance(x, (tuple, list)):
        return type(x)(finite_values(t) for t in x)
    if isinstance(x, dict):
        return {k: finite_values(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    return x


def indices(bad: torch.Tensor) -> list[int]:
    return torch.nonzero(bad).flatten().tolist()


def _listed(idx: list[int]) -> str:
    return ", ".join(map(str, idx[:10])) + (f" ... ({len(idx)} in all)" if len(idx) > 10 else "")


def refuse_nonfinite(norms: torch.Tensor) -> None:
    """The functional API's policy: raise naming the records whose gradient is not finite."""
    bad = bad_records(norms)
    if bad.any():
        raise NonFiniteGradientError(
            f"the per-sample gradients of record(s) {_listed(indices(bad))} of the batch hold "
            f"NaN or inf, so no clipped sum is returned (it would be NaN); {FIX}. (The DP "
            f"optimizer instead leaves such records out and counts them in "
            f"optimizer.last['nonfinite'].)")


def skip_nonfinite(norms: torch.Tensor, scaled: bool = False) -> list[int]:
    """The optimizer's policy for one batch: the indices of the non-finite records (their clip
    factor is 0 and the engine has masked them); every record of n >= 2 non-finite raises,
    unless ``scaled``: a GradScaler's loss scale is in the gradients, and its overflow, not a
    bug, is the usual reason every record is inf at once (its scale doubles every 2000 clean
    steps until one overflows; measured 2026-11-30: scale 2^18 on a float16 autocast model
    overflowed all 6 records). Then every record is left out, the step releases noise alone
    (each record's term is 0, within C), and ``scaler.update()`` lowers the scale as usual;
    raising would end the run at the scaler's first overflow."""
    bad = bad_records(norms)
    idx = indices(bad) if bad.any() else []
    if len(idx) >= 2 and len(idx) == norms.numel() and not scaled:
        raise NonFiniteGradientError(
            f"every one of the {len(idx)} records of this batch has a NaN or inf gradient: the "
            f"parameters are non-finite already, or a NaN spreads across the batch (a batch "
            f"statistic in the model or the loss), and leaving every record out would release "
            f"noise alone as a step. Nothing was stepped; check the parameters with "
            f"all(p.isfinite().all() for p in model.parameters()), and {FIX}")
    return idx


def warn_skipped(idx: list[int], n: int, scaled: bool = False) -> None:
    if idx:
        why = ("; under a GradScaler this is most likely its loss scale overflowing, which "
               "scaler.update() lowers" if scaled else "")
        warnings.warn(f"{len(idx)} of {n} records of this step have a NaN or inf gradient "
                      f"(indices {_listed(idx)}): they were left out of the clipped sum (clip "
                      f"factor 0), counted in optimizer.last['nonfinite']{why}; {FIX}",
                      NonFiniteRecordWarning, stacklevel=4)


__all__ = [
    "FIX", "NonFiniteRecordWarning", "bad_records", "finite_values", "indices", "masked",
    "refuse_nonfinite", "skip_nonfinite", "warn_skipped",
]
