"""From Rényi DP to (ε, δ)-DP.

Balle, Barthe, Gaboardi, Hsu, Sato (2020), "Hypothesis Testing Interpretations and Rényi
Differential Privacy", arXiv:1905.09982, Theorem 21; the same bound is Proposition 12 of
Canonne, Kamath, Steinke (2020), "The Discrete Gaussian for Differential Privacy",
arXiv:2004.00010. A mechanism with RDP ε(α) at order α is (ε, δ)-DP for              (1)

    ε = ε(α) + log((α - 1) / α) - (log δ + log α) / (α - 1),

which improves on Mironov's ε(α) + log(1/δ) / (α - 1) by log((α - 1) / α) - log(α) / (α - 1) < 0.
Every order gives a valid bound, so we take the smallest over the orders tried. When (1) is
negative the mechanism is also (0, δ)-DP, so ε is clipped at 0 (never negative).

Notation: α order, ε(α) the RDP at α (already composed over all steps), δ target delta.
"""

import numpy as np

from workbench.checks import check_delta, check_orders


def rdp_to_epsilon(orders, rdp, delta):
    """(ε, best order) from RDP values at ``orders``, Eq. (1) minimised over the orders.

    ``rdp`` has shape (n_orders,) or (..., n_orders) (one row per curve point); the result is
    then a pair of floats or a pair of arrays of shape (...). Infinite RDP gives ε = inf.

    >>> eps, order = rdp_to_epsilon([2, 8, 32], [0.1, 0.5, 3.0], 1e-5)
    >>> round(eps, 4), order
    (1.7141, 8.0)
    """
    orders = check_orders(orders)
    delta = check_delta(delta)
    rdp = np.asarray(rdp, dtype=np.float64)
    if rdp.shape[-1:] != orders.shape:
        raise ValueError(
            f"rdp must have one value per order (last axis {orders.size}); got shape {rdp.shape}"
        )
    if np.isnan(rdp).any() or (rdp < 0).any():
        raise ValueError("rdp must be >= 0 (RDP of a mechanism); got a negative value or NaN")
    eps = rdp + np.log1p(-1 / orders) - (np.log(delta) + np.log(orders)) / (orders - 1)  # Eq. (1)
    best = np.argmin(eps, axis=-1)
    eps_best = np.maximum(np.take_along_axis(eps, best[..., None], -1)[..., 0], 0.0)
    if rdp.ndim == 1:
        return float(eps_best), float(orders[best])
    return eps_best, orders[best]


__all__ = ["rdp_to_epsilon"]
