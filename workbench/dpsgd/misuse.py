"""Legal but risky (or wrong) make_private arguments: checked, warned or refused here.

- ``criterion``: its ``reduction`` must be ``loss_reduction``. DPOptimizer multiplies the
  recorded backprops by n when ``loss_reduction="mean"`` to undo the mean's 1/n; a sum-reduced
  loss would then have every per-sample gradient n times too large before clipping (or 1/n
  too small the other way round), which silently changes what C means.
- δ >= 1/N: (ε, δ)-DP with δ = 1/N is met by releasing one random example in full, so the
  customary rule is δ well below 1/N (Dwork and Roth 2014, "The Algorithmic Foundations of
  Differential Privacy", §2.3). Warned, not refused: the number is still correctly computed.
- ``poisson_sampling=False``: the RDP/PLD accountants analyse the *Poisson*-subsampled
  Gaussian (Mironov, Talwar, Zhang 2019, arXiv 1908.10530). Shuffled fixed-size batches do not
  enjoy that amplification in general (Chua et al. 2024, arXiv 2403.17673, show the gap can be
  large), so the Poisson ε understates the privacy spent. Warned.
"""

import warnings

from torch import nn


class PrivacyAccountingWarning(UserWarning):
    """The reported ε may understate the privacy spent (the message says why and the cost)."""


def warn_delta(delta, N: int, where: str) -> None:
    """Warn when δ >= 1/N (the rule: δ well below 1/N, e.g. 1e-5 or 1/N^1.1)."""
    try:
        delta = float(delta)
    except (TypeError, ValueError):
        return  # not a number: the accountant's own check names it
    if N and delta >= 1 / N:
        warnings.warn(f"{where}: delta={delta:g} >= 1/N = {1 / N:.3g} (N = {N}). The rule is "
                      f"delta << 1/N: with delta >= 1/N, (epsilon, delta)-DP allows a mechanism "
                      f"that publishes a random example in full, so this epsilon protects "
                      f"little; use e.g. delta = {min(1e-5, N ** -1.1):.1g}",
                      PrivacyAccountingWarning, stacklevel=3)


def check_criterion(criterion, loss_reduction: str) -> None:
    """The criterion's ``reduction`` must be ``loss_reduction`` (see ``make_private``); a
    module loss without one (a custom ``nn.Module``) is probed at its first call
    (``loss_watch.py``)."""
    if isinstance(criterion, nn.Module) and not hasattr(criterion, "reduction"):
        return
    reduction = getattr(criterion, "reduction", None)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"criterion={criterion!r} has reduction={reduction!r}; make_private "
                         f"can check only a loss module whose reduction is 'mean' or 'sum' "
                         f"(e.g. nn.CrossEntropyLoss()); the DP loop needs a scalar loss. Pass "
                         f"such a criterion, or none (and check loss_reduction yourself)")
    if reduction != loss_reduction:
        factor = "n" if reduction == "sum" else "1/n"
        raise ValueError(f"criterion.reduction={reduction!r} but loss_reduction="
                         f"{loss_reduction!r}: every per-sample gradient would be scaled by "
                         f"{factor} before clipping, which silently changes what max_grad_norm "
                         f"means; pass loss_reduction={reduction!r}")


def warn_shuffle() -> None:
    warnings.warn("poisson_sampling=False: batches are shuffled fixed-size batches, but "
                  "the accountant assumes Poisson sampling, whose amplification a shuffle "
                  "does not have, so get_epsilon understates the privacy spent (sometimes "
                  "several-fold); keep poisson_sampling=True for a sound epsilon",
                  PrivacyAccountingWarning, stacklevel=3)


__all__ = ["PrivacyAccountingWarning", "check_criterion", "warn_delta", "warn_shuffle"]
